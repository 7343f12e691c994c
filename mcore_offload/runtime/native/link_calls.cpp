// The raw transport's per-burst and per-wait Python in C++ (see __init__.py for why and how this is built):
//
//   telemetry_mark  LinkTelemetry.mark(stream): a pooled timing event re-recorded (the Python method where the pool
//                   is empty and a new event must be made)
//   telemetry_span  LinkTelemetry.span(kind, start, end, nbytes, keep_end=True): one tuple appended to the step's
//   done_event      RawCudaTransport._done_event() recorded on a stream: a pooled event (the Python method where the
//                   pool is empty)
//   bursts_in_cpp   RawCudaTransport._native_bursts() is not None, read from the same attributes
//   wait_reload     Transport.wait_reload with RawCudaTransport.wait: the compute stream waits for a reload burst
//                   unless it already waited for it or a later one, between an arrival mark and a stall span
//
// Session 44's profile of D-dense found half of the runtime's host time was the Python interpreter called from the C++
// paths; these were five of its frames, each run once or more per burst or per group (about 12 a layer-microbatch with
// the events' constructor and finaliser, cpu_runtime_python.py). The objects stay the Python ones (the telemetry's
// pool and spans, the transport's _waited_seq, the events), so the Python methods and these make the same calls in
// the same order; tests/test_native_link_calls.py compares them.

#include "common.h"

namespace mco {

PyObject* pop_last(PyObject* list) {
  if (list == nullptr || !PyList_CheckExact(list)) return nullptr;
  Py_ssize_t n = PyList_GET_SIZE(list);
  if (n == 0) return nullptr;
  PyObject* last = PyList_GET_ITEM(list, n - 1);
  Py_INCREF(last);
  if (PyList_SetSlice(list, n - 1, n, nullptr) < 0) {
    Py_DECREF(last);
    return nullptr;
  }
  return last;
}

namespace {

// event.record's work on ``stream`` with the bursts' entry point (``event``: an object with an integer ``handle``);
// false: error set
bool record_on(PyObject* transport, const Calls& calls, PyObject* event, unsigned long long stream) {
  unsigned long long handle = 0;
  if (!int_attr(event, MCO_NAME("handle"), handle)) return false;
  int err = calls.record(as_handle(handle), as_handle(stream));
  if (err != 0) {
    fail(transport, "cudaEventRecord", err);
    return false;
  }
  return true;
}

}  // namespace

PyObject* telemetry_mark(PyObject* telemetry, const Calls& calls, PyObject* transport, unsigned long long stream) {
  int on = attr_true(telemetry, MCO_NAME("timing"));
  if (on < 0) return nullptr;
  if (!on) Py_RETURN_NONE;
  Ref free_list(lookup_attr(telemetry, MCO_NAME("_free")));
  if (!free_list) return nullptr;
  PyObject* event = pop_last(free_list.get());
  if (event == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    Ref handle(PyLong_FromUnsignedLongLong(stream));  // a new event: the Python method makes and counts it
    return handle ? call_method(telemetry, MCO_NAME("mark"), {handle.get()}) : nullptr;
  }
  if (!record_on(transport, calls, event, stream)) {
    Py_DECREF(event);
    return nullptr;
  }
  return event;
}

int telemetry_span(PyObject* telemetry, PyObject* kind, PyObject* start, PyObject* end, long long nbytes) {
  Ref n(PyLong_FromLongLong(nbytes));
  if (!n || kind == nullptr) {
    if (!PyErr_Occurred()) PyErr_NoMemory();
    return -1;
  }
  Ref current(lookup_attr(telemetry, MCO_NAME("_current")));
  Ref spans(current && current.get() != Py_None ? lookup_attr(current.get(), MCO_NAME("spans")) : nullptr);
  if (PyErr_Occurred()) return -1;
  if (!spans || !PyList_CheckExact(spans.get())) {  // not a LinkTelemetry: its own method
    Ref r(call_method(telemetry, MCO_NAME("span"), {kind, start, end, n.get(), Py_True}));
    return r ? 0 : -1;
  }
  Ref item(PyTuple_Pack(5, kind, start, end, n.get(), Py_True));
  return item ? PyList_Append(spans.get(), item.get()) : -1;
}

PyObject* done_event(PyObject* transport, const Calls& calls, unsigned long long stream) {
  // transport._timed_events.get(): a free handle in a new event object of the pool's kind
  Ref pool(get_attr(transport, MCO_NAME("_timed_events")));
  Ref free_list(pool ? lookup_attr(pool.get(), MCO_NAME("free")) : nullptr);
  Ref kind(free_list ? lookup_attr(pool.get(), MCO_NAME("event_type")) : nullptr);
  if (!kind) return nullptr;
  Ref done;
  Ref handle(kind.get() != Py_None ? pop_last(free_list.get()) : nullptr);
  if (PyErr_Occurred()) return nullptr;
  if (handle) {
    Ref rt(get_attr(transport, MCO_NAME("rt")));
    if (!rt) return nullptr;
    done.reset(PyObject_CallFunctionObjArgs(kind.get(), rt.get(), handle.get(), free_list.get(), nullptr));
  } else {  // none free (or a pool of another kind): the Python method
    done.reset(call_method(transport, MCO_NAME("_done_event")));
  }
  if (!done || !record_on(transport, calls, done.get(), stream)) return nullptr;
  PyObject* out = done.get();
  Py_INCREF(out);
  return out;
}

int bursts_in_cpp(PyObject* transport) {
  // the conditions of RawCudaTransport._native_bursts, in its order: its C++ switch on, the C++ module loaded, no
  // coalesced reloads, no cudaMemcpyBatchAsync, a runtime with C entry points
  Ref on(lookup_attr(transport, MCO_NAME("cpp_bursts")));
  if (!on) return -1;
  if (on.get() != Py_True) return 0;
  Ref native(get_attr(transport, MCO_NAME("native")));
  Ref coalesce(native && native.get() != Py_None ? get_attr(transport, MCO_NAME("coalesce")) : nullptr);
  if (!coalesce) return PyErr_Occurred() ? -1 : 0;
  int coalesced = PyObject_IsTrue(coalesce.get());
  if (coalesced != 0) return coalesced < 0 ? -1 : 0;
  Ref rt(get_attr(transport, MCO_NAME("rt")));
  Ref batch(rt ? get_attr(rt.get(), MCO_NAME("memcpy_batch")) : nullptr);
  if (!batch) return -1;
  if (batch.get() != Py_None) return 0;
  Ref addresses(lookup_attr(rt.get(), MCO_NAME("call_addresses")));
  if (!addresses) return -1;
  return addresses.get() != Py_None ? 1 : 0;
}

int wait_reload(PyObject* transport, PyObject* event, PyObject* seq) {
  int direct = bursts_in_cpp(transport);
  if (direct < 0) return -1;
  if (!direct) {
    Ref r(call_method(transport, MCO_NAME("wait_reload"), {event, seq}));
    return r ? 0 : -1;
  }
  long long wanted = PyLong_AsLongLong(seq);
  if (wanted == -1 && PyErr_Occurred()) return -1;
  unsigned long long compute = 0;
  if (!compute_handle(transport, compute)) return -1;
  // one H2D stream runs the bursts in order: a wait covers every earlier burst (Transport.wait_reload)
  Ref waited_seq(get_attr(transport, MCO_NAME("_waited_seq")));
  Ref key(waited_seq ? PyLong_FromUnsignedLongLong(compute) : nullptr);
  if (!key) return -1;
  if (!PyDict_Check(waited_seq.get())) {
    PyErr_SetString(PyExc_TypeError, "transport._waited_seq must be a dict");
    return -1;
  }
  PyObject* got = PyDict_GetItemWithError(waited_seq.get(), key.get());  // borrowed
  if (got == nullptr && PyErr_Occurred()) return -1;
  long long already = got == nullptr ? 0 : PyLong_AsLongLong(got);
  if (already == -1 && PyErr_Occurred()) return -1;
  if (already >= wanted) return 0;
  if (PyDict_SetItem(waited_seq.get(), key.get(), seq) < 0) return -1;
  if (event == Py_None) return 0;
  // RawCudaTransport.wait: the stall is how long after the compute stream reached this wait the copy finished
  Calls calls;
  if (!calls_of(transport, calls)) return -1;
  Ref telemetry(get_attr(transport, MCO_NAME("telemetry")));
  Ref arrival(telemetry ? telemetry_mark(telemetry.get(), calls, transport, compute) : nullptr);
  unsigned long long handle = 0;
  if (!arrival || !int_attr(event, MCO_NAME("handle"), handle)) return -1;
  int err = calls.wait(as_handle(compute), as_handle(handle), 0);
  if (err != 0) {
    fail(transport, "cudaStreamWaitEvent", err);
    return -1;
  }
  return telemetry_span(telemetry.get(), MCO_NAME("stall"), arrival.get(), event, 0);
}

namespace {

// wait_reload(transport, event, seq): Transport.wait_reload, for the handler's Python paths
PyObject* module_wait_reload(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *transport, *event, *seq;
  if (!PyArg_ParseTuple(args, "OOO", &transport, &event, &seq)) return nullptr;
  if (wait_reload(transport, event, seq) < 0) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// bursts_in_cpp(transport): whether wait_reload and the copy-out and reload paths take the C++ bursts
PyObject* module_bursts_in_cpp(PyObject*, PyObject* transport) {
  int on = bursts_in_cpp(transport);
  if (on < 0) return nullptr;
  return PyBool_FromLong(on);
}

}  // namespace

PyMethodDef link_call_methods[] = {
    {"wait_reload", module_wait_reload, METH_VARARGS, "wait_reload(transport, event, seq): Transport.wait_reload"},
    {"bursts_in_cpp", module_bursts_in_cpp, METH_O,
     "bursts_in_cpp(transport): RawCudaTransport._native_bursts() is not None, as the C++ paths read it"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
