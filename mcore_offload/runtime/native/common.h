// Declarations shared by the native runtime's translation units: module.cpp (the module, the interned names and the
// helpers below), hooks.cpp (the saved-tensor hook types), copy_path.cpp (the copy-out), copy_calls.cpp (the
// transport's copy loop and reload allocations), bursts.cpp (the raw transport's copy bursts, with pool_calls.cpp and
// burst_clock.cpp), entry.cpp (the copy-out's object types), reload.cpp (the reload's bookkeeping), backward.cpp (a
// group's backward), finish_release.cpp (a chunk's release) and node_hooks.cpp (hooks on autograd nodes). See
// __init__.py for why and how this is built.
#pragma once

#include <Python.h>
#include <structmember.h>

#include <ATen/DimVector.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <chrono>
#include <initializer_list>
#include <new>
#include <vector>

// A benchmark build (MCORE_OFFLOAD_NATIVE_COUNT_ATTRS=1, see __init__.py) counts every generic attribute read and
// write the runtime makes, by type and name (attr_counts.cpp, benchmarks/cpu_attr_counts.py): the C-API traffic that
// session 45's perf profile put at half of the runtime's host time. Off in every other build.
#ifdef MCO_COUNT_ATTRS
namespace mco {
PyObject* counted_getattr(PyObject* obj, PyObject* name);
int counted_setattr(PyObject* obj, PyObject* name, PyObject* value);
// member_slots.cpp's direct slot reads and writes ("get" / "set"), counted apart from the generic calls
void count_slot_access(const char* kind, PyObject* obj, PyObject* name);
}  // namespace mco
#define PyObject_GetAttr(obj, name) mco::counted_getattr(obj, name)
#define PyObject_SetAttr(obj, name, value) mco::counted_setattr(obj, name, value)
#endif

namespace mco {

// Storage and view construction that skips what at::empty adds under torch.use_deterministic_algorithms(True): a fill
// of every new tensor (NaN, or an integer's largest value) on the current stream. Megatron runs that want bitwise
// reproducibility turn that mode on, and there every reload allocation paid a fill kernel launch (session 31's
// profile: one per reloaded storage, 356 a step on config A's attention set) and every rebuilt view a fill call, for
// memory the reload copy overwrites whole (or, for a view, none at all). See module.cpp.
c10::Storage fresh_storage(int64_t nbytes, c10::Device device);
at::Tensor view_of(const c10::Storage& storage, at::ScalarType dtype, int64_t offset, c10::IntArrayRef sizes,
                   c10::IntArrayRef strides);

// set once by init(): torch.Tensor and torch.nn.Parameter (exact-type checks, as the Python hooks make)
extern PyObject* g_tensor_type;
extern PyObject* g_parameter_type;

// interned attribute names (module.cpp: intern_all)
extern PyObject* s_finished;
extern PyObject* s_parameters;
extern PyObject* s_users;
extern PyObject* s_awaiting;
extern PyObject* s_reloaded_ref;
extern PyObject* s_runtime_ns;
extern PyObject* s_device_storage;
extern PyObject* s_compute_waited;
extern PyObject* s_rebuild;
extern PyObject* s_tensor_push;
extern PyObject* s_tensor_pop;
extern PyObject* s_offloading_activation;
extern PyObject* s_host;
extern PyObject* s_nbytes;
extern PyObject* s_d2h_event;
extern PyObject* s_h2d_event;
extern PyObject* s_h2d_seq;
extern PyObject* s_point;
extern PyObject* s_off_device;
extern PyObject* s_reload_seq;
extern PyObject* s_released_in_forward;
extern PyObject* s_released_late;
extern PyObject* s_off_device_bytes;
// read by both the forward glue (points_block.cpp) and a group's backward (backward.cpp)
extern PyObject* s_forward_handler;
extern PyObject* s_chain;
extern PyObject* s_points;
extern PyObject* s_refs;
extern PyObject* s_let_go;

// a Python string to intern into a global slot (module.cpp: intern_names, each text into its slot; false: error set)
struct NameSlot {
  PyObject** slot;
  const char* text;
};
bool intern_names(const NameSlot* names, size_t count);

// The interned Python string of a string literal, made once per use site (a function-local static: C++ makes its
// first initialisation thread-safe, and every caller holds the GIL). Why: PyObject_GetAttrString and
// PyObject_CallMethod build a new string (and an argument tuple) at each call, about 70-80 ns more than a lookup by
// an interned name on the development machine; the copy bursts and the release callback make a few dozen such calls
// a layer. nullptr only where interning failed (no memory): the helpers below then fail with an error set.
#define MCO_NAME(literal)                                                      \
  ([]() -> PyObject* {                                                         \
    static PyObject* const interned_name = PyUnicode_InternFromString("" literal); \
    return interned_name;                                                      \
  }())

// getattr(obj, name), setattr(obj, name, value) and obj.name(*args) by an interned name (MCO_NAME); nullptr / -1 with
// an error set on failure, as the C-API calls they stand for
PyObject* get_attr(PyObject* obj, PyObject* name);
int set_attr(PyObject* obj, PyObject* name, PyObject* value);
PyObject* call_method(PyObject* obj, PyObject* name, std::initializer_list<PyObject*> args = {});

// list.pop() of a non-empty exact list (a new reference), or nullptr without an error for an empty one, another
// type or nullptr (link_calls.cpp; the event and host-buffer pools' free lists)
PyObject* pop_last(PyObject* list);

// An owned Python reference, let go at the end of its scope (backward.cpp, pool_calls.cpp)
class Ref {
 public:
  explicit Ref(PyObject* p = nullptr) : p_(p) {}
  ~Ref() { Py_XDECREF(p_); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* get() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }
  void reset(PyObject* p) {  // takes ``p`` (a new reference)
    Py_XDECREF(p_);
    p_ = p;
  }

 private:
  PyObject* p_;
};

int64_t now_ns();
// obj.<name> += delta (-1 on a Python error): the counters the Python code keeps (runtime_ns, parameters, users)
int add_to_attr(PyObject* obj, PyObject* name, int64_t delta);
// obj.<name> = value (0, or -1 with an error set). module.cpp
int set_long(PyObject* obj, PyObject* name, long value);
// summary_calls.cpp: the C++ paths' host-time clock (summary.native_clock; see there for why)
struct RuntimeClock {
  PyObject_HEAD
  int64_t ns;
};
extern PyTypeObject RuntimeClockType;
bool clock_type_ready(PyObject* module);  // readied and added to the module (false: error set)
// summary.native_clock where it is a RuntimeClock (a new reference); nullptr otherwise, with an error set only where
// reading it failed
PyObject* runtime_clock_of(PyObject* summary);
// ns more on the summary's clock: its native_clock, or summary.runtime_ns where it has none (-1 on a Python error)
int add_runtime(PyObject* summary, int64_t ns);
// the same with the clock already looked up (runtime_clock_of: nullptr where the summary has none)
inline int add_runtime(PyObject* summary, PyObject* clock, int64_t ns) {
  if (clock == nullptr) return add_runtime(summary, ns);
  reinterpret_cast<RuntimeClock*>(clock)->ns += ns;
  return 0;
}
// getattr(obj, name, None) without raising (a new reference, or nullptr with an error set)
PyObject* lookup_attr(PyObject* obj, PyObject* name);
// 1 / 0: getattr(obj, name) is true / false; -1: error set
int attr_true(PyObject* obj, PyObject* name);
// getattr(obj, name) as a C long (-1 with an error set on failure; callers check PyErr_Occurred)
long attr_long(PyObject* obj, PyObject* name);

// A saved view's layout in its storage, recorded when the storage is attached to an entry and read when the view is
// rebuilt. Kept as C++ values: as Python ints and tuples it cost about 100 C-API calls a layer-microbatch (their
// building at attach and their parsing at rebuild, session 50's count), and a tuple per field kept alive until
// backward. Python reads and writes it through SavedRef's dtype / offset / size / stride (None until set).
struct ViewLayout {
  bool has_dtype = false;
  bool has_offset = false;
  bool has_size = false;
  bool has_stride = false;
  at::ScalarType dtype = at::ScalarType::Undefined;
  int64_t offset = 0;
  at::DimVector sizes;
  at::DimVector strides;
  bool complete() const { return has_dtype && has_offset && has_size && has_stride; }
};

// What the pack hook returns for an eligible tensor (saved.SavedRef's fields, read and written by the handler).
// ``layout`` is constructed in place by new_saved_ref and destroyed by the type's dealloc (saved_ref.cpp).
struct SavedRef {
  PyObject_HEAD
  PyObject* tensor;
  PyObject* group;
  PyObject* point;
  PyObject* entry;
  char unpacked;  // read by backward since it was offloaded (hooks.cpp: first_read); a char for T_BOOL
  PyObject* weakreflist;  // weak references to it (a group's let_go, saved_ref.cpp: release_refs)
  ViewLayout layout;
};
extern PyTypeObject SavedRefType;
// saved_ref.cpp: a new SavedRef(tensor, group, point), its layout unset (nullptr: error set)
PyObject* new_saved_ref(PyObject* tensor, PyObject* group, PyObject* point);
// saved_ref.cpp: handler._release_refs, backward reached the group (1, or -1 with an error set)
int release_refs(PyObject* group);
// (1, 2, ...) as a Python tuple of ints (a new reference, or nullptr with an error set). hooks.cpp
PyObject* int_tuple_of(c10::IntArrayRef values);

// Byte totals per offload point over one burst, reported as summary.add(point, counter, total) per point: the
// counters of manager.on_offloaded / on_reloaded for a whole burst (the same totals). module.cpp
class PointTotals {
 public:
  PointTotals() = default;
  PointTotals(const PointTotals&) = delete;
  PointTotals& operator=(const PointTotals&) = delete;
  ~PointTotals();
  void add(PyObject* point, long long n);  // keeps a reference to ``point``
  int report(PyObject* summary, PyObject* counter) const;  // ``counter`` interned (MCO_NAME); -1: error set
  long long total() const;

 private:
  std::vector<std::pair<PyObject*, long long>> totals_;
};

// hooks.cpp: SavedRef, Packer and Unpacker readied and added to the module (false: error set)
bool hook_types_ready(PyObject* module);
// saved_ref.cpp: SavedRef's part of it
bool saved_ref_type_ready(PyObject* module);

// copy_path.cpp, held_checks.cpp, copy_calls.cpp, bursts.cpp and reload.cpp: their module functions
extern PyMethodDef copy_path_methods[];
extern PyMethodDef held_check_methods[];
extern PyMethodDef copy_call_methods[];
extern PyMethodDef reload_methods[];
extern PyMethodDef burst_methods[];
// reload.cpp: handler._reload over ``runs`` (a tuple of lists of entries; -1: error), for backward.cpp too
int reload_runs(PyObject* handler, PyObject* runs, bool on_demand);
// backward.cpp: commit_backward and group_done (a group's backward); its names interned (false: error)
extern PyMethodDef backward_methods[];
bool backward_names_ready();
// backward.cpp: list(getattr(obj, name)) as a fast sequence (nullptr: error), for finish_release.cpp too
PyObject* attr_items(PyObject* obj, PyObject* name);
// finish_release.cpp: finish_release (handler.finish's release)
extern PyMethodDef finish_methods[];
// backward.cpp: the common case of handler.on_group_commit_backward and on_group_backward_done (1 done, 0 the Python
// method must run, -1 error set), for the module functions and the node hooks of points_block.cpp
int commit_backward_impl(PyObject* handler, PyObject* group);
int group_done_impl(PyObject* handler, PyObject* group);
// node_hooks.cpp: add_prehook (the group start and commit hooks on existing autograd nodes)
extern PyMethodDef node_hook_methods[];
// node_hooks.cpp: a group's start hook (handler.on_group_backward_done) or commit hook (on_group_commit_backward) on
// the node that made ``tensor``, in C++ throughout (false: the tensor has no such node)
enum GroupHookKind { kGroupStart, kGroupCommit };
bool add_group_hook(const at::Tensor& tensor, GroupHookKind kind, PyObject* handler, PyObject* group);
// points_block.cpp: interned names the node hooks share
extern PyObject* s_summary;
extern PyObject* s_on_group_backward_done;
extern PyObject* s_on_group_commit_backward;
// points_block.cpp: Block, offload_block and commit_point (the offload points' forward glue); the types readied and
// added to the module (false: error set)
extern PyMethodDef point_methods[];
bool point_types_ready(PyObject* module);
// hooks.cpp: an offload block's pack hook (Packer(handler, group, point)) into *pack and its unpack hook
// (Unpacker(handler)) into *unpack, either one nullptr to skip it, without a Python call and with the handler's
// attributes read once for both (points_block.cpp; false: error set, nothing made)
bool make_hooks(PyObject* handler, PyObject* group, PyObject* point, PyObject** pack, PyObject** unpack);

// ------------------------------------------------------------------------------------- the CUDA runtime's calls
// bursts.cpp: the CUDA runtime's entry points, called at the addresses CudaRuntime read from the library PyTorch has
// loaded (transport.rt.call_addresses), and the transport's attributes the bursts read
using MemcpyAsync = int (*)(void*, const void*, size_t, int, void*);
using EventRecord = int (*)(void*, void*);
using StreamWait = int (*)(void*, void*, unsigned);
using EventQuery = int (*)(void*);
struct Calls {
  MemcpyAsync memcpy_async;
  EventRecord record;
  StreamWait wait;
  EventQuery query;
};
inline void* as_handle(unsigned long long v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); }
bool calls_of(PyObject* transport, Calls& out);  // false: error set
bool int_attr(PyObject* obj, PyObject* name, unsigned long long& out);
bool nested_int_attr(PyObject* obj, PyObject* a, PyObject* b, unsigned long long& out);
bool compute_handle(PyObject* transport, unsigned long long& out);  // transport._compute_handle()
void fail(PyObject* transport, const char* what, int err);         // transport.rt.fail(what, err): raises
// bursts.cpp: RawCudaTransport.to_host / to_device's C++ bursts, module functions (args: their argument tuple)
PyObject* module_to_host_burst(PyObject*, PyObject* args);
PyObject* module_to_device_burst(PyObject*, PyObject* args);

// link_calls.cpp: the link telemetry's mark and span (LinkTelemetry.mark / span), a burst's done event
// (RawCudaTransport._done_event, recorded on ``stream``), whether a transport's bursts are the C++ ones
// (RawCudaTransport._native_bursts: 1 yes, 0 no, -1 error set) and the compute stream's wait on a reload burst
// (Transport.wait_reload; -1: error set), without a Python frame where the transport is the raw one
PyObject* telemetry_mark(PyObject* telemetry, const Calls& calls, PyObject* transport, unsigned long long stream);
int telemetry_span(PyObject* telemetry, PyObject* kind, PyObject* start, PyObject* end, long long nbytes);
PyObject* done_event(PyObject* transport, const Calls& calls, unsigned long long stream);
int bursts_in_cpp(PyObject* transport);
int wait_reload(PyObject* transport, PyObject* event, PyObject* seq);
extern PyMethodDef link_call_methods[];
// event_type.cpp: RawEventBase readied and added to the module (false: error set)
bool event_type_ready(PyObject* module);
// layer_boundary.cpp: layer_boundary (OffloadManager.layer_boundary without auto)
extern PyMethodDef layer_boundary_methods[];
// copy_path.cpp: copy_out(handler, groups, routed_points, min_coverage), a module function (args: its argument tuple)
PyObject* module_copy_out(PyObject*, PyObject* args);
// manager_calls.cpp: manager.on_hosts_freed(freed) and manager.on_handler_finished(handler) (-1: error set)
int hosts_freed(PyObject* manager, PyObject* freed);
int handler_finished(PyObject* manager, PyObject* handler);
// points_block.cpp: enabled.in_backward() (1: the autograd engine runs a backward, 0 not)
int backward_running();

// summary_calls.cpp: OffloadSummary's counters where no peak is traced, without its Python frames.
// summary_traces: summary.tracing (1 / 0, -1 error set); resident: summary.host_resident(delta); off_device:
// summary.off_device(delta) where it traces nothing (the caller checked), -1 on error
int summary_traces(PyObject* summary);
int summary_resident(PyObject* summary, long long delta);
int summary_off_device(PyObject* summary, long long delta);

// burst_clock.cpp: host time per phase of the copy bursts (bursts.cpp), for benchmarks/runtime_breakdown.py; off
// unless burst_timing(True) turned it on. ("query": release's completion queries, also counted in "release")
enum BurstPhase { kRelease, kQuery, kAlloc, kFence, kAcquire, kWaits, kMark, kCopies, kDone, kBook, kBurstPhases };
enum BurstDirection { kToHost, kToDevice, kBurstDirections };
bool burst_clock_on();
void burst_time(BurstDirection d, BurstPhase p, int64_t ns);
void burst_copies(BurstDirection d, long long n);
// Lap times of one burst: to(phase) adds the time since the last lap to that phase
class BurstLap {
 public:
  explicit BurstLap(BurstDirection d);
  void to(BurstPhase p);

 private:
  BurstDirection d_;
  int64_t t_;
};
extern PyMethodDef burst_clock_methods[];

// attr_counts.cpp: attr_counts() in a counting build (see MCO_COUNT_ATTRS above), nothing otherwise
extern PyMethodDef attr_count_methods[];

// pool_calls.cpp: HostBufferPool.acquire_base's common answers, a new (buffer, event) reference; nullptr without an
// error where the Python method must decide, nullptr with an error set on an error
PyObject* acquire_fast(PyObject* pool, long long nbytes, PyObject* routed);
// pool_calls.cpp: HostBufferPool.release(buf, event) where the answer is a list append (a buffer of a size class the
// pool knows, not a routed one), the method otherwise; free_by_class, routed_owner: the pool's _free and _routed_owner
// (-1: error)
int release_fast(PyObject* pool, PyObject* free_by_class, PyObject* routed_owner, PyObject* buf, PyObject* event);

// entry.cpp: Entry(point, nbytes, host, d2h_event, device_ptr) and Released(handler, ptr, entry) as new references
// (nullptr: error set); entry.storage_ref = weak (stolen); the two types readied and Entry added to the module
PyObject* new_entry(PyObject* point, PyObject* nbytes, PyObject* host, PyObject* d2h_event, PyObject* device_ptr);
PyObject* new_released(PyObject* handler, PyObject* ptr, PyObject* entry);
void entry_set_storage_ref(PyObject* entry, PyObject* weak);
bool entry_types_ready(PyObject* module);
// entry.cpp: Entry's type once readied (nullptr before); the address of the field of an exact Entry that an
// interned name names (nullptr: none of its fields, or a name not interned). Entry is a static type that cannot be
// subclassed and whose attributes cannot be replaced, so its members are always these fields (member_slots.cpp).
extern PyTypeObject* g_entry_type;
PyObject** entry_field_named(PyObject* entry, PyObject* name);
// member_slots.cpp: getattr / setattr that read and write an object's slot directly where the generic path would
// end in that slot's member descriptor (the runtime's state classes keep what our C++ touches in __slots__, Entry and
// SavedRef are C types with members), and read a module's dict directly; the generic path otherwise, with its
// results and errors. Why and when it is exact: see there. nullptr / -1 with an error set, as PyObject_GetAttr /
// PyObject_SetAttr.
PyObject* member_get(PyObject* obj, PyObject* name);
// the direct read alone: a new reference, or nullptr without an error where the generic path must answer
PyObject* member_fast(PyObject* obj, PyObject* name);
int member_set(PyObject* obj, PyObject* name, PyObject* value);
extern PyMethodDef member_slot_methods[];
inline PyObject* getattr_fast(PyObject* obj, PyObject* name) { return member_get(obj, name); }
inline int setattr_fast(PyObject* obj, PyObject* name, PyObject* value) { return member_set(obj, name, value); }

// held_checks.cpp, for copy_out: a new reference to ref.tensor (nullptr without an error if None or unset); the
// coverage check; whether another tensor keeps a storage (1), not (0), error (-1)
PyObject* ref_tensor(PyObject* ref);
int covers(PyObject* refs, double need);
int held_by_other_than_one(PyObject* st, PyObject* ref);
int held_by_other_than_many(PyObject* st, PyObject* refs);

}  // namespace mco
