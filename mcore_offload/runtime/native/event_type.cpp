// The raw transport's pooled events as a C type (see __init__.py for why and how this is built): RawEventBase holds
// what cudart.RawEvent holds (the handle, the runtime, the free list it returns to, seen_done, reload_seq) and gives
// the handle back to that list when its last reference goes. cudart.native_event_type adds RawEvent's Python methods
// (record, query, synchronize, elapsed_time) in a subclass with no instance dict.
//
// Why: a copy burst makes a done event and the link telemetry re-records marks, two or three a layer-microbatch, and a
// Python RawEvent ran two Python frames for each (__init__ and __del__; cpu_runtime_python.py). Made from C (the C++
// bursts, link_calls.cpp: done_event) or from Python (cudart.EventPool), these run none. tests/test_native_link_calls.py
// checks that both kinds return their handles alike.

#include "common.h"

namespace mco {
namespace {

struct RawEventObject {
  PyObject_HEAD
  unsigned long long handle;
  PyObject* rt;
  PyObject* free;
  PyObject* reload_seq;
  char seen_done;
};

PyObject* raw_event_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  static const char* keywords[] = {"rt", "handle", "free", nullptr};
  PyObject *rt, *free;
  unsigned long long handle;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKO!:RawEvent", const_cast<char**>(keywords), &rt, &handle,
                                   &PyList_Type, &free))
    return nullptr;
  RawEventObject* self = reinterpret_cast<RawEventObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->handle = handle;
  Py_INCREF(rt);
  self->rt = rt;
  Py_INCREF(free);
  self->free = free;
  Py_INCREF(Py_None);
  self->reload_seq = Py_None;
  // a query answered complete for this record (set by the transport); a recycled handle comes back unseen
  self->seen_done = 0;
  return reinterpret_cast<PyObject*>(self);
}

void raw_event_dealloc(RawEventObject* self) {
  // RawEvent.__del__: the handle goes back to its free list (no wait can be enqueued on it any more)
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (self->free != nullptr) {
    PyObject* h = PyLong_FromUnsignedLongLong(self->handle);
    if (h == nullptr || PyList_Append(self->free, h) < 0) PyErr_WriteUnraisable(reinterpret_cast<PyObject*>(self));
    Py_XDECREF(h);
  }
  PyErr_Restore(type, value, traceback);
  Py_CLEAR(self->rt);
  Py_CLEAR(self->free);
  Py_CLEAR(self->reload_seq);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyMemberDef raw_event_members[] = {
    {"handle", T_ULONGLONG, offsetof(RawEventObject, handle), READONLY, "the cudaEvent_t, as an integer"},
    {"_rt", T_OBJECT, offsetof(RawEventObject, rt), READONLY, "the CudaRuntime"},
    {"_free", T_OBJECT, offsetof(RawEventObject, free), READONLY, "the free list the handle returns to"},
    {"seen_done", T_BOOL, offsetof(RawEventObject, seen_done), 0, "a query answered complete for this record"},
    {"reload_seq", T_OBJECT, offsetof(RawEventObject, reload_seq), 0,
     "the reload burst (part) this event ends, or None"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject RawEventBaseType = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

bool event_type_ready(PyObject* module) {
  RawEventBaseType.tp_name = "mcore_offload_hooks.RawEventBase";
  RawEventBaseType.tp_basicsize = sizeof(RawEventObject);
  RawEventBaseType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE;
  RawEventBaseType.tp_doc = "A pooled cudaEvent_t: (rt, handle, free); the handle returns to free when it goes";
  RawEventBaseType.tp_new = raw_event_new;
  RawEventBaseType.tp_dealloc = reinterpret_cast<destructor>(raw_event_dealloc);
  RawEventBaseType.tp_members = raw_event_members;
  if (PyType_Ready(&RawEventBaseType) < 0) return false;
  Py_INCREF(&RawEventBaseType);
  if (PyModule_AddObject(module, "RawEventBase", reinterpret_cast<PyObject*>(&RawEventBaseType)) < 0) {
    Py_DECREF(&RawEventBaseType);
    return false;
  }
  return true;
}

}  // namespace mco
