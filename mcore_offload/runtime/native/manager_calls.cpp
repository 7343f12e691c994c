// The manager's bookkeeping at a chunk's finish in C++ (see __init__.py for why and how this is built): backward.cpp's
// finish_release reports the host buffers it gave back (OffloadManager.on_hosts_freed) and the finished handler
// (on_handler_finished) here, without their Python frames (five a layer-microbatch with on_hosts_freed's generator,
// cpu_runtime_python.py). Where the summary traces the peak, the manager's method runs. tests/test_native_backward.py
// compares the counters with the Python finish's.

#include "common.h"

namespace mco {
// manager.on_hosts_freed(freed) where the summary traces no peak, without its Python frames: the host-resident bytes
// fall by the entries' total, and each entry still counted off the device comes back (the method where it traces;
// -1: error set)
int hosts_freed(PyObject* manager, PyObject* freed) {
  Ref summary(get_attr(manager, MCO_NAME("summary")));
  int tracing = summary ? summary_traces(summary.get()) : -1;
  if (tracing != 0) {
    Ref r(tracing > 0 ? call_method(manager, MCO_NAME("on_hosts_freed"), {freed}) : nullptr);
    return r ? 0 : -1;
  }
  long long total = 0, back = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(freed); ++i) {
    PyObject* e = PyList_GET_ITEM(freed, i);
    long n = attr_long(e, s_nbytes);
    if (n == -1 && PyErr_Occurred()) return -1;
    total += n;
    int off = attr_true(e, s_off_device);
    if (off < 0) return -1;
    if (off) {  // manager._back_on_device
      if (setattr_fast(e, s_off_device, Py_False) < 0) return -1;
      back += n;
    }
  }
  if (summary_resident(summary.get(), -total) < 0) return -1;
  return back == 0 ? 0 : summary_off_device(summary.get(), -back);
}

// manager.on_handler_finished(handler) without its Python frame: the handler leaves the step's list and, if it is
// the forward chunk's, that slot (-1: error set)
int handler_finished(PyObject* manager, PyObject* handler) {
  Ref handlers(get_attr(manager, MCO_NAME("handlers")));
  if (!handlers) return -1;
  if (!PyList_CheckExact(handlers.get())) {
    Ref r(call_method(manager, MCO_NAME("on_handler_finished"), {handler}));
    return r ? 0 : -1;
  }
  int in = PySequence_Contains(handlers.get(), handler);
  if (in < 0) return -1;
  if (in) {
    Ref r(PyObject_CallMethod(handlers.get(), "remove", "O", handler));
    if (!r) return -1;
  }
  Ref forward(get_attr(manager, MCO_NAME("forward_handler")));
  if (!forward) return -1;
  return forward.get() == handler ? set_attr(manager, MCO_NAME("forward_handler"), Py_None) : 0;
}

}  // namespace mco
