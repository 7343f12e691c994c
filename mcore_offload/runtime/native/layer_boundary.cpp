// The start of a transformer layer's forward in C++ (see __init__.py for why and how this is built):
//
//   layer_boundary(manager, routed_points, min_coverage)
//       OffloadManager.layer_boundary where auto is off: the chain the last layer left open is
//       closed (manager.close_chain, called as it is), the layer counted, and where _flush_due says so the pending
//       groups are flushed (handler.flush, with copy_path.cpp's copy-out unless the audit is on)
//
// Why: it runs once per layer and microbatch, and in Python it was six frames (the manager's method, in_backward,
// close_chain, _flush_due, the handler's flush and _copy_out; cpu_runtime_python.py). Where auto is set, the chunk
// takes clock marks or the peak is traced, the manager's Python method runs instead. tests/test_native_link_calls.py
// runs training steps through both and compares the layers each flush came at, the counters, losses and gradients.

#include "common.h"

namespace mco {
namespace {

// manager._flush_due(handler) for a chunk without clock marks, ``layers`` its count with the starting layer (1 / 0 /
// -1 error set)
int flush_due(PyObject* manager, PyObject* handler, long long layers) {
  long k = attr_long(manager, MCO_NAME("flush_layers"));
  if (k == -1 && PyErr_Occurred()) return -1;
  if (k == 1) return 1;
  Ref chunk_layers(get_attr(manager, MCO_NAME("_chunk_layers")));
  Ref vp(chunk_layers ? get_attr(handler, MCO_NAME("vp_stage")) : nullptr);
  if (!vp) return -1;
  if (!PyDict_Check(chunk_layers.get())) {
    PyErr_SetString(PyExc_TypeError, "manager._chunk_layers must be a dict");
    return -1;
  }
  PyObject* expected = PyDict_GetItemWithError(chunk_layers.get(), vp.get());  // borrowed
  if (expected == nullptr) return PyErr_Occurred() ? -1 : 1;  // the chunk's first forward: every layer flushes
  long long e = PyLong_AsLongLong(expected);
  if (e == -1 && PyErr_Occurred()) return -1;
  if (layers >= e - 1) return 1;
  return (e - 1 - layers) % k == 0 ? 1 : 0;
}

// handler.flush(): the pending groups copied out (-1: error set)
int flush(PyObject* manager, PyObject* handler, PyObject* routed_points, PyObject* min_coverage) {
  Ref groups(get_attr(handler, MCO_NAME("pending")));
  Ref empty(groups ? PyList_New(0) : nullptr);
  if (!empty || set_attr(handler, MCO_NAME("pending"), empty.get()) < 0) return -1;
  int some = PyObject_IsTrue(groups.get());
  int finished = some > 0 ? attr_true(handler, MCO_NAME("finished")) : 0;
  if (some < 0 || finished < 0) return -1;
  if (!some || finished) return 0;
  Ref log(get_attr(manager, MCO_NAME("offload_log")));
  if (!log) return -1;
  Ref r;
  if (log.get() == Py_None) {  // handler._copy_out's C++ case (no audit; no probe: the caller checked auto)
    Ref args(PyTuple_Pack(4, handler, groups.get(), routed_points, min_coverage));
    r.reset(args ? module_copy_out(nullptr, args.get()) : nullptr);
  } else {
    r.reset(call_method(handler, MCO_NAME("_copy_out"), {groups.get()}));
  }
  return r ? 0 : -1;
}

PyObject* module_layer_boundary(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *manager, *routed_points, *min_coverage;
  if (!PyArg_ParseTuple(args, "OOO", &manager, &routed_points, &min_coverage)) return nullptr;
  Ref handler(get_attr(manager, MCO_NAME("forward_handler")));
  if (!handler) return nullptr;
  if (handler.get() == Py_None) Py_RETURN_NONE;
  if (backward_running()) Py_RETURN_NONE;
  // the auto probe's clock marks and peak trace: the manager's own method
  Ref autoplan(get_attr(manager, MCO_NAME("auto")));
  Ref marks(autoplan ? get_attr(handler.get(), MCO_NAME("marks")) : nullptr);
  Ref peak(marks ? get_attr(manager, MCO_NAME("_peak_reader")) : nullptr);
  if (!peak) return nullptr;
  if (autoplan.get() != Py_None || marks.get() != Py_None || peak.get() != Py_None)
    return call_method(manager, MCO_NAME("layer_boundary"));
  int64_t t0 = now_ns();
  Ref chain(get_attr(manager, MCO_NAME("chain")));
  if (!chain) return nullptr;
  if (chain.get() != Py_None) {
    Ref r(call_method(manager, MCO_NAME("close_chain")));
    if (!r) return nullptr;
  }
  long layers =
      add_to_attr(handler.get(), MCO_NAME("layers"), 1) == 0 ? attr_long(handler.get(), MCO_NAME("layers")) : -1;
  int due = layers == -1 && PyErr_Occurred() ? -1 : flush_due(manager, handler.get(), layers);
  if (due < 0 || (due && flush(manager, handler.get(), routed_points, min_coverage) < 0)) return nullptr;
  Ref summary(get_attr(manager, MCO_NAME("summary")));
  if (!summary || add_runtime(summary.get(), now_ns() - t0) < 0) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

}  // namespace

PyMethodDef layer_boundary_methods[] = {
    {"layer_boundary", module_layer_boundary, METH_VARARGS,
     "layer_boundary(manager, routed_points, min_coverage): OffloadManager.layer_boundary without auto"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
