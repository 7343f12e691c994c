// OffloadSummary's byte counters, as the C++ copy-out, reload and release paths report them (see __init__.py for why
// and how this is built): the summary's ``tracing`` property and its host_resident and (where no peak is traced)
// off_device methods, each a Python frame per burst before (three a layer-microbatch, cpu_runtime_python.py). The
// counters stay the summary's attributes; tests/test_native_copy_out.py and tests/test_native_backward.py compare
// them with the Python paths'.
//
// RuntimeClock: the host time of the C++ paths, the part of summary.runtime_ns they add (summary.native_clock, which
// the manager sets where this module is loaded; OffloadSummary.runtime_total_ns adds the two). Why: every hook call
// added its time to the summary's Python int (read, add, a new int, write: about 800 instructions), 27 times a
// layer-microbatch (session 46's counts); an int64 field costs none of that, and the hooks keep the clock itself.

#include "common.h"

namespace mco {

// --------------------------------------------------------------------------------------------------- RuntimeClock
namespace {

PyObject* s_native_clock;  // interned by clock_type_ready

PyObject* clock_take(PyObject* self, PyObject*) {
  auto* clock = reinterpret_cast<RuntimeClock*>(self);
  int64_t ns = clock->ns;
  clock->ns = 0;
  return PyLong_FromLongLong(ns);
}

PyObject* clock_add(PyObject* self, PyObject* arg) {
  long long ns = PyLong_AsLongLong(arg);
  if (ns == -1 && PyErr_Occurred()) return nullptr;
  reinterpret_cast<RuntimeClock*>(self)->ns += ns;
  Py_RETURN_NONE;
}

PyMethodDef clock_methods[] = {{"take", clock_take, METH_NOARGS, "the nanoseconds so far, and the clock back to 0"},
                               {"add", clock_add, METH_O, "add(ns): ns more nanoseconds"},
                               {nullptr, nullptr, 0, nullptr}};

PyMemberDef clock_members[] = {{"ns", T_LONGLONG, offsetof(RuntimeClock, ns), READONLY, "nanoseconds so far"},
                               {nullptr, 0, 0, 0, nullptr}};

}  // namespace

PyTypeObject RuntimeClockType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool clock_type_ready(PyObject* module) {
  s_native_clock = PyUnicode_InternFromString("native_clock");
  if (s_native_clock == nullptr) return false;
  RuntimeClockType.tp_name = "mcore_offload_native.RuntimeClock";
  RuntimeClockType.tp_basicsize = sizeof(RuntimeClock);
  RuntimeClockType.tp_flags = Py_TPFLAGS_DEFAULT;
  RuntimeClockType.tp_doc = "RuntimeClock(): the host time of the C++ paths, in nanoseconds (OffloadSummary.native_clock).";
  RuntimeClockType.tp_new = PyType_GenericNew;  // zeroed: ns = 0
  RuntimeClockType.tp_methods = clock_methods;
  RuntimeClockType.tp_members = clock_members;
  return PyType_Ready(&RuntimeClockType) == 0 &&
         PyModule_AddObjectRef(module, "RuntimeClock", reinterpret_cast<PyObject*>(&RuntimeClockType)) == 0;
}

PyObject* runtime_clock_of(PyObject* summary) {
  PyObject* clock = getattr_fast(summary, s_native_clock);
  if (clock == nullptr || Py_TYPE(clock) == &RuntimeClockType) return clock;
  Py_DECREF(clock);
  return nullptr;
}

int add_runtime(PyObject* summary, int64_t ns) {
  PyObject* clock = runtime_clock_of(summary);
  if (clock == nullptr) return PyErr_Occurred() ? -1 : add_to_attr(summary, s_runtime_ns, ns);
  reinterpret_cast<RuntimeClock*>(clock)->ns += ns;
  Py_DECREF(clock);
  return 0;
}

// --------------------------------------------------------------------------------------------------- the counters

int summary_traces(PyObject* summary) {
  // summary.tracing: _peak_reader is not None or off_by_key is not None
  Ref reader(get_attr(summary, MCO_NAME("_peak_reader")));
  if (!reader) return -1;
  if (reader.get() != Py_None) return 1;
  Ref by_key(get_attr(summary, MCO_NAME("off_by_key")));
  if (!by_key) return -1;
  return by_key.get() != Py_None ? 1 : 0;
}

int summary_resident(PyObject* summary, long long delta) {
  // host_resident_bytes += delta; host_resident_peak_bytes = max(peak, bytes)
  if (add_to_attr(summary, MCO_NAME("host_resident_bytes"), delta) < 0) return -1;
  Ref now(get_attr(summary, MCO_NAME("host_resident_bytes")));
  Ref peak(now ? get_attr(summary, MCO_NAME("host_resident_peak_bytes")) : nullptr);
  if (!peak) return -1;
  int above = PyObject_RichCompareBool(now.get(), peak.get(), Py_GT);
  if (above < 0) return -1;
  return above ? set_attr(summary, MCO_NAME("host_resident_peak_bytes"), now.get()) : 0;
}

int summary_off_device(PyObject* summary, long long delta) {
  // off_device(delta) with no peak reader and no per-key counts: off_device_bytes += delta
  return add_to_attr(summary, s_off_device_bytes, delta);
}

}  // namespace mco
