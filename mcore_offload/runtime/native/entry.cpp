// The two object types of the C++ copy-out (copy_path.cpp), see __init__.py for why and how this is built:
//
//   Entry     saved.Entry: one offloaded storage, with the same attributes and initial values
//   Released  handler._released_callback: the weak reference callback of one offloaded storage

#include "common.h"

namespace mco {
namespace {

// --------------------------------------------------------------------------------------------------------- Entry
// saved.Entry: one offloaded storage. Every field is a Python object, read and written by the Python handler.
struct Entry {
  PyObject_HEAD
  PyObject* point;
  PyObject* nbytes;
  PyObject* host;
  PyObject* d2h_event;
  PyObject* device_storage;
  PyObject* h2d_event;
  PyObject* h2d_seq;
  PyObject* compute_waited;
  PyObject* users;
  PyObject* storage_ref;
  PyObject* off_device;
  PyObject* device_ptr;
  PyObject* peak_key;
  PyObject* awaiting;
  PyObject* reloaded_ref;
};

#define MCO_ENTRY_FIELDS(X) \
  X(point) X(nbytes) X(host) X(d2h_event) X(device_storage) X(h2d_event) X(h2d_seq) X(compute_waited) X(users) \
  X(storage_ref) X(off_device) X(device_ptr) X(peak_key) X(awaiting) X(reloaded_ref)

#define MCO_MEMBER(name) {#name, T_OBJECT, offsetof(Entry, name), 0, nullptr},
PyMemberDef entry_members[] = {MCO_ENTRY_FIELDS(MCO_MEMBER){nullptr, 0, 0, 0, nullptr}};
#undef MCO_MEMBER

int entry_traverse(Entry* self, visitproc visit, void* arg) {
#define MCO_VISIT(name) Py_VISIT(self->name);
  MCO_ENTRY_FIELDS(MCO_VISIT)
#undef MCO_VISIT
  return 0;
}

int entry_clear(Entry* self) {
#define MCO_CLEAR(name) Py_CLEAR(self->name);
  MCO_ENTRY_FIELDS(MCO_CLEAR)
#undef MCO_CLEAR
  return 0;
}

void entry_dealloc(Entry* self) {
  PyObject_GC_UnTrack(self);
  entry_clear(self);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyTypeObject EntryType = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

// Entry(point, nbytes, host, d2h_event, device_ptr=0), as saved.Entry (the same initial values)
PyObject* new_entry(PyObject* point, PyObject* nbytes, PyObject* host, PyObject* d2h_event, PyObject* device_ptr) {
  PyObject* zero = PyLong_FromLong(0);
  if (zero == nullptr) return nullptr;
  Entry* e = PyObject_GC_New(Entry, &EntryType);
  if (e == nullptr) {
    Py_DECREF(zero);
    return nullptr;
  }
  auto own = [](PyObject* o) {
    Py_INCREF(o);
    return o;
  };
  e->point = own(point);
  e->nbytes = own(nbytes);
  e->host = own(host);
  e->d2h_event = own(d2h_event);
  e->device_storage = own(Py_None);
  e->h2d_event = own(Py_None);
  e->h2d_seq = own(zero);
  e->compute_waited = own(Py_False);
  e->users = own(zero);
  e->storage_ref = own(Py_None);
  e->off_device = own(Py_False);
  e->device_ptr = device_ptr != nullptr ? own(device_ptr) : own(zero);
  e->peak_key = own(Py_None);
  e->awaiting = own(zero);
  e->reloaded_ref = own(Py_None);
  Py_DECREF(zero);
  PyObject_GC_Track(e);
  return reinterpret_cast<PyObject*>(e);
}

namespace {

PyObject* entry_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"point", "nbytes", "host", "d2h_event", "device_ptr", nullptr};
  PyObject *point, *nbytes, *host, *d2h_event, *device_ptr = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|O", const_cast<char**>(names), &point, &nbytes, &host,
                                   &d2h_event, &device_ptr))
    return nullptr;
  return new_entry(point, nbytes, host, d2h_event, device_ptr);
}

// ------------------------------------------------------------------------------------------------------ Released
// The weak reference callback of one offloaded storage (handler._released_callback): the storage is gone, so its
// entry leaves handler.live (if still there) and the manager counts the release.
struct Released {
  PyObject_HEAD
  PyObject* handler;
  PyObject* ptr;
  PyObject* entry;
  vectorcallfunc vectorcall;
};

int released_traverse(Released* self, visitproc visit, void* arg) {
  Py_VISIT(self->handler);
  Py_VISIT(self->ptr);
  Py_VISIT(self->entry);
  return 0;
}

int released_clear(Released* self) {
  Py_CLEAR(self->handler);
  Py_CLEAR(self->ptr);
  Py_CLEAR(self->entry);
  return 0;
}

void released_dealloc(Released* self) {
  PyObject_GC_UnTrack(self);
  released_clear(self);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// manager.on_released(entry, during_forward) where the summary traces no peak (its _peak_reader and off_by_key are
// None): summary.add(point, released_in_forward / released_late, nbytes), and for an entry whose only copy is now
// on the host, entry.off_device = True and summary.off_device_bytes += nbytes; what the Python method does there,
// without its three Python frames per storage. 1: done, 0: the summary traces (the caller calls the method), -1: error
int count_released(PyObject* manager, PyObject* entry, bool during_forward) {
  PyObject* summary = get_attr(manager, MCO_NAME("summary"));
  if (summary == nullptr) return -1;
  int tracing = summary_traces(summary);
  if (tracing != 0) {
    Py_DECREF(summary);
    return tracing < 0 ? -1 : 0;
  }
  PyObject* point = getattr_fast(entry, s_point);
  PyObject* nbytes_obj = point ? getattr_fast(entry, s_nbytes) : nullptr;
  long long nbytes = nbytes_obj ? PyLong_AsLongLong(nbytes_obj) : -1;
  int rc = nbytes == -1 && PyErr_Occurred() ? -1 : 0;
  if (rc == 0) {  // summary.add(point, counter, nbytes), as a burst's totals are counted
    PointTotals released;
    released.add(point, nbytes);
    rc = released.report(summary, during_forward ? s_released_in_forward : s_released_late);
  }
  PyObject* host = rc == 0 ? getattr_fast(entry, s_host) : nullptr;
  PyObject* device = host ? getattr_fast(entry, s_device_storage) : nullptr;
  if (device == nullptr) {
    rc = -1;
  } else if (host != Py_None && device == Py_None) {
    rc = setattr_fast(entry, s_off_device, Py_True) < 0 || add_to_attr(summary, s_off_device_bytes, nbytes) < 0
             ? -1
             : 0;
  }
  Py_XDECREF(host);
  Py_XDECREF(device);
  Py_XDECREF(nbytes_obj);
  Py_XDECREF(point);
  Py_DECREF(summary);
  return rc < 0 ? -1 : 1;
}

PyObject* released_vectorcall(PyObject* obj, PyObject* const*, size_t, PyObject*) {
  HANDLE_TH_ERRORS
  Released* self = reinterpret_cast<Released*>(obj);
  PyObject* live = get_attr(self->handler, MCO_NAME("live"));
  if (live == nullptr) return nullptr;
  PyObject* cur = PyDict_Check(live) ? PyDict_GetItemWithError(live, self->ptr) : nullptr;  // borrowed
  int rc = PyErr_Occurred() ? -1 : 0;
  if (rc == 0 && cur == self->entry) rc = PyDict_DelItem(live, self->ptr);
  Py_DECREF(live);
  if (rc < 0) return nullptr;
  PyObject* started = get_attr(self->handler, MCO_NAME("backward_started"));
  int backward = started ? PyObject_IsTrue(started) : -1;
  Py_XDECREF(started);
  if (backward < 0) return nullptr;
  PyObject* manager = get_attr(self->handler, MCO_NAME("manager"));
  if (manager == nullptr) return nullptr;
  int counted = count_released(manager, self->entry, !backward);
  PyObject* out = nullptr;
  if (counted == 1) {
    Py_INCREF(Py_None);
    out = Py_None;
  } else if (counted == 0) {
    out = call_method(manager, MCO_NAME("on_released"), {self->entry, backward ? Py_False : Py_True});
  }
  Py_DECREF(manager);
  return out;
  END_HANDLE_TH_ERRORS
}

PyTypeObject ReleasedType = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

PyObject* new_released(PyObject* handler, PyObject* ptr, PyObject* entry) {
  Released* self = PyObject_GC_New(Released, &ReleasedType);
  if (self == nullptr) return nullptr;
  Py_INCREF(handler);
  Py_INCREF(ptr);
  Py_INCREF(entry);
  self->handler = handler;
  self->ptr = ptr;
  self->entry = entry;
  self->vectorcall = released_vectorcall;
  PyObject_GC_Track(self);
  return reinterpret_cast<PyObject*>(self);
}

void entry_set_storage_ref(PyObject* entry, PyObject* weak) {
  Py_XSETREF(reinterpret_cast<Entry*>(entry)->storage_ref, weak);
}

PyTypeObject* g_entry_type = nullptr;

namespace {

// the fields' interned names and their offsets, in the struct's order
#define MCO_ONE(name) +1
constexpr int kEntryFields = 0 MCO_ENTRY_FIELDS(MCO_ONE);
#undef MCO_ONE
PyObject* g_entry_names[kEntryFields];
#define MCO_OFFSET(name) offsetof(Entry, name),
constexpr size_t kEntryOffsets[kEntryFields] = {MCO_ENTRY_FIELDS(MCO_OFFSET)};
#undef MCO_OFFSET

bool intern_entry_names() {
  const char* names[] = {
#define MCO_TEXT(name) #name,
      MCO_ENTRY_FIELDS(MCO_TEXT)
#undef MCO_TEXT
  };
  for (int i = 0; i < kEntryFields; ++i) {
    if (g_entry_names[i] == nullptr && (g_entry_names[i] = PyUnicode_InternFromString(names[i])) == nullptr)
      return false;
  }
  return true;
}

}  // namespace

PyObject** entry_field_named(PyObject* entry, PyObject* name) {
  for (int i = 0; i < kEntryFields; ++i) {
    if (g_entry_names[i] == name)
      return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(entry) + kEntryOffsets[i]);
  }
  return nullptr;
}

bool entry_types_ready(PyObject* module) {
  EntryType.tp_name = "mcore_offload_native.Entry";
  EntryType.tp_basicsize = sizeof(Entry);
  EntryType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  EntryType.tp_doc = "One offloaded storage (see saved.Entry).";
  EntryType.tp_new = entry_new;
  EntryType.tp_dealloc = reinterpret_cast<destructor>(entry_dealloc);
  EntryType.tp_traverse = reinterpret_cast<traverseproc>(entry_traverse);
  EntryType.tp_clear = reinterpret_cast<inquiry>(entry_clear);
  EntryType.tp_members = entry_members;

  ReleasedType.tp_name = "mcore_offload_native.Released";
  ReleasedType.tp_basicsize = sizeof(Released);
  ReleasedType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  ReleasedType.tp_doc = "The release callback of one offloaded storage (see handler._released_callback).";
  ReleasedType.tp_dealloc = reinterpret_cast<destructor>(released_dealloc);
  ReleasedType.tp_traverse = reinterpret_cast<traverseproc>(released_traverse);
  ReleasedType.tp_clear = reinterpret_cast<inquiry>(released_clear);
  ReleasedType.tp_vectorcall_offset = offsetof(Released, vectorcall);
  ReleasedType.tp_call = PyVectorcall_Call;

  if (PyType_Ready(&EntryType) < 0 || PyType_Ready(&ReleasedType) < 0 || !intern_entry_names() ||
      PyModule_AddObjectRef(module, "Entry", reinterpret_cast<PyObject*>(&EntryType)) < 0)
    return false;
  g_entry_type = &EntryType;
  return true;
}

}  // namespace mco
