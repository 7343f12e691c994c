// handler.finish's release in C++ (see __init__.py for why and how this is built):
//
//   finish_release   the body of handler.finish for a step that did not fail: host buffers back to the pool
//                    (pool_calls.cpp: release_fast), the counts (manager_calls.cpp), every reference let go
//
// Once per chunk and microbatch, at the end of its backward, on the backward's host path (a launch-bound step's
// time). tests/test_native_backward.py runs training steps through it and through the Python method and compares the
// CUDA calls, counters, losses and gradients.

#include "common.h"

#include <unordered_set>

namespace mco {
namespace {

// obj.<name> = [] (a new list, as the Python code assigns)
int set_empty_list(PyObject* obj, PyObject* name) {
  Ref v(PyList_New(0));
  return v ? set_attr(obj, name, v.get()) : -1;
}

// finish_release(handler, pool): handler.finish's work after it marked the handler finished, for a step that did not
// fail. ``pool``: the transport's HostBufferPool where its release_host is the pool's release, else None (the method
// is called for each buffer)
PyObject* module_finish_release(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *handler, *pool;
  if (!PyArg_ParseTuple(args, "OO", &handler, &pool)) return nullptr;
  Ref transport(get_attr(handler, MCO_NAME("transport")));
  Ref manager(transport ? get_attr(handler, MCO_NAME("manager")) : nullptr);
  Ref groups(manager ? attr_items(handler, MCO_NAME("groups")) : nullptr);
  Ref freed(groups ? PyList_New(0) : nullptr);
  if (!freed) return nullptr;
  Ref free_by_class, routed_owner;
  if (pool != Py_None) {
    free_by_class.reset(get_attr(pool, MCO_NAME("_free")));
    routed_owner.reset(free_by_class ? get_attr(pool, MCO_NAME("_routed_owner")) : nullptr);
    if (!routed_owner) return nullptr;
  }
  // each entry once (groups that save views of one storage share its entry); the next writer of a buffer waits for
  // the last copy that read it
  std::unordered_set<PyObject*> seen;
  for (Py_ssize_t g = 0; g < PySequence_Fast_GET_SIZE(groups.get()); ++g) {
    Ref seq(attr_items(PySequence_Fast_GET_ITEM(groups.get(), g), MCO_NAME("entries")));
    if (!seq) return nullptr;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq.get()); ++i) {
      PyObject* e = PySequence_Fast_GET_ITEM(seq.get(), i);
      if (seen.count(e)) continue;
      Ref host(getattr_fast(e, s_host));
      if (!host) return nullptr;
      if (host.get() == Py_None) continue;
      seen.insert(e);
      Ref event(getattr_fast(e, s_h2d_event));
      if (!event) return nullptr;
      if (pool != Py_None) {
        if (release_fast(pool, free_by_class.get(), routed_owner.get(), host.get(), event.get()) < 0) return nullptr;
      } else {
        Ref r(call_method(transport.get(), MCO_NAME("release_host"), {host.get(), event.get()}));
        if (!r) return nullptr;
      }
      if (PyList_Append(freed.get(), e) < 0) return nullptr;
    }
  }
  // manager.on_hosts_freed reads off_device before the loop below
  if (PyList_GET_SIZE(freed.get()) > 0 && hosts_freed(manager.get(), freed.get()) < 0) return nullptr;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(freed.get()); ++i) {
    PyObject* e = PyList_GET_ITEM(freed.get(), i);
    if (setattr_fast(e, s_host, Py_None) < 0 || setattr_fast(e, s_device_storage, Py_None) < 0)
      return nullptr;
  }
  // every reference the handler holds goes (see handler.finish: autograd, not the cyclic collector, frees them)
  Ref opened(attr_items(handler, MCO_NAME("opened")));
  if (!opened) return nullptr;
  for (Py_ssize_t g = 0; g < PySequence_Fast_GET_SIZE(opened.get()); ++g) {
    PyObject* group = PySequence_Fast_GET_ITEM(opened.get(), g);
    Ref refs(getattr_fast(group, s_refs));
    Ref entries(refs ? get_attr(group, MCO_NAME("entries")) : nullptr);
    if (!entries || !PyList_Check(refs.get()) || !PyList_Check(entries.get())) {
      if (entries) PyErr_SetString(PyExc_TypeError, "group.refs and group.entries must be lists");
      return nullptr;
    }
    if (PyList_SetSlice(refs.get(), 0, PY_SSIZE_T_MAX, nullptr) < 0) return nullptr;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries.get()); ++i) {
      if (set_attr(PyList_GET_ITEM(entries.get(), i), MCO_NAME("storage_ref"), Py_None) < 0) return nullptr;
    }
    if (PyList_SetSlice(entries.get(), 0, PY_SSIZE_T_MAX, nullptr) < 0) return nullptr;
  }
  Ref live(get_attr(handler, MCO_NAME("live")));
  if (!live || set_empty_list(handler, MCO_NAME("groups")) < 0 || set_empty_list(handler, MCO_NAME("pending")) < 0 ||
      set_empty_list(handler, MCO_NAME("opened")) < 0)
    return nullptr;
  if (PyDict_Check(live.get())) {
    PyDict_Clear(live.get());
  } else {
    Ref r(PyObject_CallMethod(live.get(), "clear", nullptr));
    if (!r) return nullptr;
  }
  if (handler_finished(manager.get(), handler) < 0) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

}  // namespace

PyMethodDef finish_methods[] = {
    {"finish_release", module_finish_release, METH_VARARGS,
     "finish_release(handler, pool): handler.finish's work for a step that did not fail"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
