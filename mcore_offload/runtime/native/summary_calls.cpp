// OffloadSummary's byte counters, as the C++ copy-out, reload and release paths report them (see __init__.py for why
// and how this is built): the summary's ``tracing`` property and its host_resident and (where no peak is traced)
// off_device methods, each a Python frame per burst before (three a layer-microbatch, cpu_runtime_python.py). The
// counters stay the summary's attributes; tests/test_native_copy_out.py and tests/test_native_backward.py compare
// them with the Python paths'.

#include "common.h"

namespace mco {

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
