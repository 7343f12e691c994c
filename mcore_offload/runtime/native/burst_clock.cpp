// The copy bursts' phase clock (see __init__.py for why and how this is built): host time per phase of each burst of
// bursts.cpp, summed per direction, read and reset by burst_timing(on) (benchmarks/runtime_breakdown.py reads it at the
// end of a run). Off by default: each lap then costs one flag test.

#include "common.h"

namespace mco {
namespace {

const char* const kPhaseNames[kBurstPhases] = {"release", "query", "alloc", "fence", "acquire", "waits", "mark",
                                               "copies", "done", "book"};

struct PhaseTotals {
  bool on = false;
  long long ns[kBurstDirections][kBurstPhases] = {};
  long long bursts[kBurstDirections] = {};
  long long copies[kBurstDirections] = {};
};
PhaseTotals g_phases;  // process-wide diagnostic counters; burst_timing() reads and resets them (tests do)

// burst_timing(on): the phase totals so far ({"to_host": {"bursts", "copies", "ns": {phase: ns}}, "to_device": ...}),
// then zeroed, and timing turned on or off (benchmarks/runtime_breakdown.py; tests)
PyObject* module_burst_timing(PyObject*, PyObject* on_obj) {
  int on = PyObject_IsTrue(on_obj);
  if (on < 0) return nullptr;
  PyObject* out = PyDict_New();
  const char* names[kBurstDirections] = {"to_host", "to_device"};
  for (int d = 0; out != nullptr && d < kBurstDirections; ++d) {
    PyObject* ns = PyDict_New();
    for (int p = 0; ns != nullptr && p < kBurstPhases; ++p) {
      PyObject* v = PyLong_FromLongLong(g_phases.ns[d][p]);
      if (v == nullptr || PyDict_SetItemString(ns, kPhaseNames[p], v) < 0) Py_CLEAR(ns);
      Py_XDECREF(v);
    }
    PyObject* row = ns ? Py_BuildValue("{s:L,s:L,s:N}", "bursts", g_phases.bursts[d], "copies", g_phases.copies[d],
                                       "ns", ns)
                       : nullptr;
    if (row == nullptr || PyDict_SetItemString(out, names[d], row) < 0) Py_CLEAR(out);
    Py_XDECREF(row);
  }
  if (out == nullptr) return nullptr;
  g_phases = PhaseTotals();
  g_phases.on = on != 0;
  return out;
}

}  // namespace

bool burst_clock_on() { return g_phases.on; }

void burst_time(BurstDirection d, BurstPhase p, int64_t ns) { g_phases.ns[d][p] += ns; }

void burst_copies(BurstDirection d, long long n) {
  if (g_phases.on) g_phases.copies[d] += n;
}

BurstLap::BurstLap(BurstDirection d) : d_(d), t_(g_phases.on ? now_ns() : 0) {
  if (g_phases.on) g_phases.bursts[d_] += 1;
}

void BurstLap::to(BurstPhase p) {
  if (!g_phases.on) return;
  int64_t n = now_ns();
  g_phases.ns[d_][p] += n - t_;
  t_ = n;
}

PyMethodDef burst_clock_methods[] = {
    {"burst_timing", module_burst_timing, METH_O, "burst_timing(on): the bursts' phase times so far, then reset"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
