// The native runtime's module: its init, the objects every translation unit shares (the interned attribute names,
// the exact types the pack hook tests for) and small helpers (PointTotals among them). The types and functions are in
// hooks.cpp, copy_path.cpp, held_checks.cpp, copy_calls.cpp, bursts.cpp (with pool_calls.cpp and burst_clock.cpp),
// entry.cpp, reload.cpp, backward.cpp, node_hooks.cpp and points_block.cpp. See __init__.py for why and how this is
// built.

#include "common.h"

#include <atomic>

namespace mco {

// set once by init(): torch.Tensor and torch.nn.Parameter (exact-type checks, as the Python hooks make)
PyObject* g_tensor_type = nullptr;
PyObject* g_parameter_type = nullptr;

// interned attribute names
PyObject* s_finished;
PyObject* s_parameters;
PyObject* s_users;
PyObject* s_awaiting;
PyObject* s_reloaded_ref;
PyObject* s_runtime_ns;
PyObject* s_device_storage;
PyObject* s_compute_waited;
PyObject* s_rebuild;
PyObject* s_tensor_push;
PyObject* s_tensor_pop;
PyObject* s_offloading_activation;
PyObject* s_host;
PyObject* s_nbytes;
PyObject* s_d2h_event;
PyObject* s_h2d_event;
PyObject* s_h2d_seq;
PyObject* s_point;
PyObject* s_off_device;
PyObject* s_reload_seq;
PyObject* s_released_in_forward;
PyObject* s_released_late;
PyObject* s_off_device_bytes;
PyObject* s_forward_handler;
PyObject* s_chain;
PyObject* s_points;
PyObject* s_refs;
PyObject* s_let_go;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int add_to_attr(PyObject* obj, PyObject* name, int64_t delta) {
  PyObject* cur = getattr_fast(obj, name);
  if (cur == nullptr) return -1;
  PyObject* step = PyLong_FromLongLong(delta);
  PyObject* sum = step ? PyNumber_Add(cur, step) : nullptr;
  Py_DECREF(cur);
  Py_XDECREF(step);
  if (sum == nullptr) return -1;
  int rc = setattr_fast(obj, name, sum);
  Py_DECREF(sum);
  return rc;
}

int set_long(PyObject* obj, PyObject* name, long value) {
  Ref v(PyLong_FromLong(value));
  return v ? setattr_fast(obj, name, v.get()) : -1;
}

namespace {
bool name_ok(PyObject* name) {
  if (name != nullptr) return true;
  if (!PyErr_Occurred()) PyErr_NoMemory();
  return false;
}
}  // namespace

// dict[key] += delta, from 0 where the key is missing (-1: error)
static int add_to_item(PyObject* dict, PyObject* key, long long delta) {
  PyObject* cur = PyDict_GetItemWithError(dict, key);  // borrowed
  if (cur == nullptr && PyErr_Occurred()) return -1;
  long long base = cur == nullptr ? 0 : PyLong_AsLongLong(cur);
  if (base == -1 && PyErr_Occurred()) return -1;
  PyObject* sum = PyLong_FromLongLong(base + delta);
  int rc = sum ? PyDict_SetItem(dict, key, sum) : -1;
  Py_XDECREF(sum);
  return rc;
}

PyObject* get_attr(PyObject* obj, PyObject* name) { return name_ok(name) ? getattr_fast(obj, name) : nullptr; }

int set_attr(PyObject* obj, PyObject* name, PyObject* value) {
  return name_ok(name) ? setattr_fast(obj, name, value) : -1;
}

PyObject* call_method(PyObject* obj, PyObject* name, std::initializer_list<PyObject*> args) {
  if (!name_ok(name)) return nullptr;
  // a free slot, obj, then the arguments (ours pass at most five): the free slot in front is what
  // PY_VECTORCALL_ARGUMENTS_OFFSET promises, so that a bound callee need not copy the arguments
  PyObject* stack[8];
  if (args.size() + 2 > sizeof(stack) / sizeof(stack[0])) {
    PyErr_SetString(PyExc_SystemError, "call_method: too many arguments");
    return nullptr;
  }
  stack[0] = nullptr;
  stack[1] = obj;
  size_t n = 1;
  for (PyObject* a : args) stack[1 + n++] = a;
  return PyObject_VectorcallMethod(name, stack + 1, n | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
}

int attr_true(PyObject* obj, PyObject* name) {
  Ref v(getattr_fast(obj, name));
  return v ? PyObject_IsTrue(v.get()) : -1;
}

long attr_long(PyObject* obj, PyObject* name) {
  Ref v(get_attr(obj, name));
  return v ? PyLong_AsLong(v.get()) : -1;
}

PyObject* lookup_attr(PyObject* obj, PyObject* name) {
  PyObject* out = member_fast(obj, name);
  if (out != nullptr || PyErr_Occurred()) return out;
#if PY_VERSION_HEX >= 0x030D0000
  if (PyObject_GetOptionalAttr(obj, name, &out) < 0) return nullptr;
#else
  if (_PyObject_LookupAttr(obj, name, &out) < 0) return nullptr;
#endif
  if (out == nullptr) {
    Py_INCREF(Py_None);
    return Py_None;
  }
  return out;
}

// ------------------------------------------------------------------------------- storages and views without a fill
namespace {

// The allocator at::empty uses on the CPU and on CUDA (the caching allocator, one object for every device), read
// from a storage at::empty made, once: storages made through it come from where at::empty's would (the current
// device and stream, the active memory pool), only without the deterministic-mode fill. A cache of a process-wide
// fact PyTorch fixes at the first allocation (a pluggable allocator must be chosen before it), so no reset.
std::atomic<c10::Allocator*> g_allocators[2];

c10::Allocator* allocator_for(c10::Device device) {
  std::atomic<c10::Allocator*>& slot = g_allocators[device.is_cuda() ? 1 : 0];
  c10::Allocator* allocator = slot.load(std::memory_order_acquire);
  if (allocator == nullptr) {
    allocator = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device)).storage().allocator();
    slot.store(allocator, std::memory_order_release);
  }
  return allocator;
}

}  // namespace

c10::Storage fresh_storage(int64_t nbytes, c10::Device device) {
  TORCH_CHECK(nbytes >= 0, "mcore-offload: a reload of ", nbytes, " bytes; this is a bug, please report it");
  c10::Allocator* allocator = (device.is_cpu() || device.is_cuda()) ? allocator_for(device) : nullptr;
  if (allocator == nullptr) {  // another device type, or a storage with no allocator: at::empty, fill and all
    return at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device)).storage();
  }
  c10::DeviceGuard guard(device);  // the caching allocator allocates on the current device
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, allocator, /*resizable=*/true);
}

at::Tensor view_of(const c10::Storage& storage, at::ScalarType dtype, int64_t offset, c10::IntArrayRef sizes,
                   c10::IntArrayRef strides) {
  // the bounds check Tensor.set_ makes: the view must lie inside the storage
  TORCH_CHECK(sizes.size() == strides.size() && offset >= 0,
              "mcore-offload: a saved view's layout is inconsistent; this is a bug, please report it");
  int64_t last = offset;
  bool empty = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(sizes[i] >= 0 && strides[i] >= 0,
                "mcore-offload: a saved view with a negative size or stride; this is a bug, please report it");
    if (sizes[i] == 0) empty = true;
    else last += (sizes[i] - 1) * strides[i];
  }
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK(empty || (last + 1) * itemsize <= static_cast<int64_t>(storage.nbytes()),
              "mcore-offload: a saved view reaches byte ", (last + 1) * itemsize, " of a reloaded storage of ",
              storage.nbytes(), "; this is a bug, please report it with the model configuration");
  // what at::empty builds, on this storage: a strided tensor of this dtype on the storage's device
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(c10::computeDispatchKey(dtype, c10::kStrided, storage.device())),
      c10::scalarTypeToTypeMeta(dtype));
  view.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return view;
}

// ------------------------------------------------------------------------------------------------------ module
// init(tensor_type, parameter_type): the exact types the pack hook tests for
PyObject* module_init(PyObject*, PyObject* args) {
  PyObject *tensor_type, *parameter_type;
  if (!PyArg_ParseTuple(args, "OO", &tensor_type, &parameter_type)) return nullptr;
  if (!PyType_Check(tensor_type) || !PyType_Check(parameter_type)) {
    PyErr_SetString(PyExc_TypeError, "init(torch.Tensor, torch.nn.Parameter) takes two types");
    return nullptr;
  }
  Py_INCREF(tensor_type);
  Py_INCREF(parameter_type);
  Py_XSETREF(g_tensor_type, tensor_type);
  Py_XSETREF(g_parameter_type, parameter_type);
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"init", module_init, METH_VARARGS, "init(torch.Tensor, torch.nn.Parameter)"},
    {nullptr, nullptr, 0, nullptr}};

#define MCO_STR_(x) #x
#define MCO_STR(x) MCO_STR_(x)
#define MCO_CONCAT_(a, b) a##b
#define MCO_CONCAT(a, b) MCO_CONCAT_(a, b)

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, MCO_STR(TORCH_EXTENSION_NAME),
                          "mcore-offload's saved-tensor hooks in C++", -1, module_methods};

bool intern_names(const NameSlot* names, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    *names[i].slot = PyUnicode_InternFromString(names[i].text);
    if (*names[i].slot == nullptr) return false;
  }
  return true;
}

bool intern_all() {
  static const NameSlot names[] = {{&s_finished, "finished"},
                                   {&s_parameters, "parameters"},
                                   {&s_users, "users"},
                                   {&s_awaiting, "awaiting"},
                                   {&s_reloaded_ref, "reloaded_ref"},
                                   {&s_runtime_ns, "runtime_ns"},
                                   {&s_device_storage, "device_storage"},
                                   {&s_compute_waited, "compute_waited"},
                                   {&s_rebuild, "_rebuild"},
                                   {&s_tensor_push, "tensor_push"},
                                   {&s_tensor_pop, "tensor_pop"},
                                   {&s_offloading_activation, "offloading_activation"},
                                   {&s_host, "host"},
                                   {&s_nbytes, "nbytes"},
                                   {&s_d2h_event, "d2h_event"},
                                   {&s_h2d_event, "h2d_event"},
                                   {&s_h2d_seq, "h2d_seq"},
                                   {&s_point, "point"},
                                   {&s_off_device, "off_device"},
                                   {&s_released_in_forward, "released_in_forward"},
                                   {&s_released_late, "released_late"},
                                   {&s_off_device_bytes, "off_device_bytes"},
                                   {&s_reload_seq, "reload_seq"},
                                   {&s_forward_handler, "forward_handler"},
                                   {&s_chain, "chain"},
                                   {&s_points, "points"},
                                   {&s_refs, "refs"},
                                   {&s_let_go, "let_go"}};
  return intern_names(names, sizeof(names) / sizeof(names[0]));
}

PointTotals::~PointTotals() {
  for (auto& pn : totals_) Py_DECREF(pn.first);
}

void PointTotals::add(PyObject* point, long long n) {
  for (auto& pn : totals_) {
    int same = pn.first == point ? 1 : PyObject_RichCompareBool(pn.first, point, Py_EQ);
    if (same < 0) PyErr_Clear();  // points are strings: a comparison that fails counts as another point
    if (same > 0) {
      pn.second += n;
      return;
    }
  }
  Py_INCREF(point);
  totals_.emplace_back(point, n);
}

int PointTotals::report(PyObject* summary, PyObject* counter) const {
  if (totals_.empty()) return 0;
  // summary.add's work without its Python frame: summary._current[point][counter] += total (a defaultdict of dicts)
  Ref current(get_attr(summary, MCO_NAME("_current")));
  if (!current || counter == nullptr) {
    if (!PyErr_Occurred()) PyErr_NoMemory();
    return -1;
  }
  for (const auto& pn : totals_) {
    Ref counters(PyObject_GetItem(current.get(), pn.first));
    if (!counters) return -1;
    if (!PyDict_Check(counters.get())) {
      PyErr_SetString(PyExc_TypeError, "summary._current must map points to dicts of counters");
      return -1;
    }
    if (add_to_item(counters.get(), counter, pn.second) < 0) return -1;
  }
  return 0;
}

long long PointTotals::total() const {
  long long sum = 0;
  for (const auto& pn : totals_) sum += pn.second;
  return sum;
}

}  // namespace mco

using namespace mco;

PyMODINIT_FUNC MCO_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  if (!intern_all() || !backward_names_ready()) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (!hook_types_ready(m) || PyModule_AddFunctions(m, copy_path_methods) < 0 || PyModule_AddFunctions(m, held_check_methods) < 0 ||
      PyModule_AddFunctions(m, copy_call_methods) < 0 || PyModule_AddFunctions(m, reload_methods) < 0 ||
      PyModule_AddFunctions(m, burst_methods) < 0 || PyModule_AddFunctions(m, burst_clock_methods) < 0 ||
      PyModule_AddFunctions(m, node_hook_methods) < 0 || PyModule_AddFunctions(m, backward_methods) < 0 ||
      PyModule_AddFunctions(m, finish_methods) < 0 ||
      PyModule_AddFunctions(m, point_methods) < 0 || PyModule_AddFunctions(m, link_call_methods) < 0 ||
      PyModule_AddFunctions(m, layer_boundary_methods) < 0 ||
      PyModule_AddFunctions(m, attr_count_methods) < 0 || PyModule_AddFunctions(m, member_slot_methods) < 0 || !event_type_ready(m) || !point_types_ready(m) || !entry_types_ready(m) ||
      !clock_type_ready(m)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
