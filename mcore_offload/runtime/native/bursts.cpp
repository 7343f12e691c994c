// The raw-copy transport's bursts in C++ (see __init__.py for why and how this is built): RawCudaTransport.to_host,
// to_device and release_copied for the common case (no coalesced reloads, no cudaMemcpyBatchAsync), each one call
// instead of a Python frame per step of the burst and a ctypes call per CUDA call.
//
//   to_host_burst    RawCudaTransport.to_host: the copied blocks seen done go back (release_copied), the bound on
//                    bursts in flight (bound_in_flight, MCORE_OFFLOAD_D2H_IN_FLIGHT), the D2H stream
//                    waits for the compute stream, one host buffer per storage from the pool, a wait on each reused
//                    buffer's reload unless the compute stream already waited for it, the copies, the done event
//   to_device_burst  RawCudaTransport.to_device: fresh device storages, the H2D stream waits for the compute stream
//                    and for each D2H not yet seen done, the copies part by part, one done event per part numbered
//                    as the handler numbers reload bursts
//   release_copied   CudaTransport.release_copied (not ``final``)
//
// The CUDA runtime's entry points are called at the addresses CudaRuntime read from the library PyTorch has loaded
// (transport.rt.call_addresses). The objects stay the Python ones: the pool, the events (RawEvent, from the transport's
// pool), the held deque, the telemetry. So the Python methods and these make the same calls in the same order with the
// same events; tests/test_stream_order.py checks the hand-offs from the calls of both. The pool's common answers are
// in pool_calls.cpp, the bursts' phase clock in burst_clock.cpp.

#include "common.h"

namespace mco {

constexpr int kHostToDevice = 1;  // cudaMemcpyHostToDevice
constexpr int kDeviceToHost = 2;  // cudaMemcpyDeviceToHost
constexpr int kNotReady = 600;    // cudaErrorNotReady: cudaEventQuery's "not yet"

// transport.rt.call_addresses: (cudaMemcpyAsync, cudaEventRecord, cudaStreamWaitEvent, cudaEventQuery) (false: error)
bool calls_of(PyObject* transport, Calls& out) {
  PyObject* rt = get_attr(transport, MCO_NAME("rt"));
  PyObject* t = rt ? get_attr(rt, MCO_NAME("call_addresses")) : nullptr;
  Py_XDECREF(rt);
  if (t == nullptr) return false;
  unsigned long long a[4] = {0, 0, 0, 0};
  // the four items read directly: PyArg_ParseTuple's format parsing cost about 1,000 instructions a call, and this
  // runs at every burst and reload wait
  bool ok = PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 4;
  for (int i = 0; ok && i < 4; ++i) {
    a[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, i));
    ok = !(a[i] == static_cast<unsigned long long>(-1) && PyErr_Occurred());
  }
  Py_DECREF(t);
  if (!ok || a[0] == 0 || a[1] == 0 || a[2] == 0 || a[3] == 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "transport.rt.call_addresses must hold four addresses");
    return false;
  }
  out.memcpy_async = reinterpret_cast<MemcpyAsync>(static_cast<uintptr_t>(a[0]));
  out.record = reinterpret_cast<EventRecord>(static_cast<uintptr_t>(a[1]));
  out.wait = reinterpret_cast<StreamWait>(static_cast<uintptr_t>(a[2]));
  out.query = reinterpret_cast<EventQuery>(static_cast<uintptr_t>(a[3]));
  return true;
}

// An integer attribute (a handle or a counter; ``name`` interned: MCO_NAME) into ``out`` (false: error set)
bool int_attr(PyObject* obj, PyObject* name, unsigned long long& out) {
  PyObject* v = get_attr(obj, name);
  if (v == nullptr) return false;
  out = PyLong_AsUnsignedLongLong(v);
  Py_DECREF(v);
  return !(out == static_cast<unsigned long long>(-1) && PyErr_Occurred());
}

// obj.<a>.<b> as an integer (the fence events' handles)
bool nested_int_attr(PyObject* obj, PyObject* a, PyObject* b, unsigned long long& out) {
  PyObject* inner = get_attr(obj, a);
  if (inner == nullptr) return false;
  bool ok = int_attr(inner, b, out);
  Py_DECREF(inner);
  return ok;
}

// transport._compute_handle(): the current (compute) stream's raw handle
bool compute_handle(PyObject* transport, unsigned long long& out) {
  PyObject* v = call_method(transport, MCO_NAME("_compute_handle"));
  if (v == nullptr) return false;
  out = PyLong_AsUnsignedLongLong(v);
  Py_DECREF(v);
  return !(out == static_cast<unsigned long long>(-1) && PyErr_Occurred());
}

// transport.rt.fail(what, err): raises (always nullptr-returning for the caller)
void fail(PyObject* transport, const char* what, int err) {
  PyObject* rt = PyObject_GetAttrString(transport, "rt");
  if (rt == nullptr) return;
  PyObject* r = PyObject_CallMethod(rt, "fail", "si", what, err);
  Py_DECREF(rt);
  Py_XDECREF(r);
  if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "%s failed (error %d)", what, err);
}

namespace {

// CudaTransport.release_copied without ``final``: the held D2H bursts seen complete, oldest first, are dropped (their
// device blocks go back to the allocator) and their done events marked seen. 0, or -1 with an error set
int release_done(PyObject* transport, const Calls& calls, BurstDirection d) {
  PyObject* held = get_attr(transport, MCO_NAME("_held"));
  if (held == nullptr) return -1;
  int rc = 0;
  while (true) {
    Py_ssize_t n = PyObject_Size(held);
    if (n <= 0) {
      rc = n < 0 ? -1 : 0;
      break;
    }
    PyObject* first = PySequence_GetItem(held, 0);  // (done event, the device tensors it read)
    PyObject* event = first && PyTuple_Check(first) && PyTuple_GET_SIZE(first) == 2 ? PyTuple_GET_ITEM(first, 0)
                                                                                   : nullptr;
    unsigned long long handle = 0;
    if (event == nullptr || !int_attr(event, MCO_NAME("handle"), handle)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "transport._held must hold (event, tensors) pairs");
      Py_XDECREF(first);
      rc = -1;
      break;
    }
    int64_t t0 = burst_clock_on() ? now_ns() : 0;
    int err = calls.query(as_handle(handle));
    if (t0 != 0) burst_time(d, kQuery, now_ns() - t0);
    if (err == kNotReady) {
      Py_DECREF(first);
      break;
    }
    if (err != 0) {
      Py_DECREF(first);
      fail(transport, "cudaEventQuery", err);
      rc = -1;
      break;
    }
    PyObject* popped = call_method(held, MCO_NAME("popleft"));
    Py_XDECREF(popped);  // with ``first``'s reference gone below, the tensors it held go
    // reloads of these blocks need not wait on it (RawCudaTransport.to_device)
    rc = popped == nullptr || set_attr(event, MCO_NAME("seen_done"), Py_True) < 0 ? -1 : 0;
    Py_DECREF(first);
    if (rc < 0) break;
  }
  Py_DECREF(held);
  return rc;
}

// MCORE_OFFLOAD_D2H_IN_FLIGHT: where as many copy-out bursts as it allows are still held (release_done has dropped
// those seen complete), CudaTransport.bound_in_flight makes the compute stream wait for the oldest. In Python: it
// runs only where the link is behind the forward, not on the common path. 0, or -1 with an error set
int bound_in_flight(PyObject* transport) {
  unsigned long long limit = 0;
  if (!int_attr(transport, MCO_NAME("d2h_in_flight"), limit)) return -1;
  if (limit == 0) return 0;
  PyObject* held = get_attr(transport, MCO_NAME("_held"));
  if (held == nullptr) return -1;
  Py_ssize_t n = PyObject_Size(held);
  Py_DECREF(held);
  if (n < 0) return -1;
  if (static_cast<unsigned long long>(n) < limit) return 0;
  PyObject* r = call_method(transport, MCO_NAME("bound_in_flight"));
  Py_XDECREF(r);
  return r == nullptr ? -1 : 0;
}

// Owned references released at scope exit
struct Refs {
  std::vector<PyObject*> held;
  PyObject* keep(PyObject* o) {
    if (o != nullptr) held.push_back(o);
    return o;
  }
  ~Refs() {
    for (PyObject* o : held) Py_DECREF(o);
  }
};

// A burst's start: the CUDA entry points read, and the copied blocks seen done let go (``lap``'s "release" ends here);
// false: error set
bool begin_burst(PyObject* transport, Calls& calls, BurstLap& lap, BurstDirection d) {
  if (!calls_of(transport, calls) || release_done(transport, calls, d) < 0) return false;
  lap.to(kRelease);
  return true;
}

// ``stream`` waits for ``event`` unless an earlier call of the burst failed (``err``: its code); false: error set
bool wait_for(const Calls& calls, unsigned long long stream, PyObject* event, int& err) {
  unsigned long long handle = 0;
  if (!int_attr(event, MCO_NAME("handle"), handle)) return false;
  if (err == 0) err = calls.wait(as_handle(stream), as_handle(handle), 0);
  return true;
}

// After a burst's fence and waits (``lap``'s "waits" ends here): the first failed call raised (``err``), else the
// start mark on ``stream`` (None in an untimed step; "mark"), with ``telemetry`` set; both kept in ``refs``. nullptr:
// error set
PyObject* waits_done(PyObject* transport, const Calls& calls, Refs& refs, BurstLap& lap, int err,
                     unsigned long long stream, PyObject*& telemetry) {
  lap.to(kWaits);
  if (err != 0) {
    fail(transport, "cudaEventRecord/cudaStreamWaitEvent", err);
    return nullptr;
  }
  telemetry = refs.keep(get_attr(transport, MCO_NAME("telemetry")));
  PyObject* start = telemetry ? refs.keep(telemetry_mark(telemetry, calls, transport, stream)) : nullptr;
  lap.to(kMark);
  return start;
}

}  // namespace

// to_host_burst(transport, storages, keep_alive, routed) -> (host buffers, done event): RawCudaTransport.to_host
PyObject* module_to_host_burst(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *transport, *storages, *keep_alive, *routed;
  if (!PyArg_ParseTuple(args, "OO!OO!", &transport, &PyList_Type, &storages, &keep_alive, &PyList_Type, &routed))
    return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(storages);
  if (PyList_GET_SIZE(routed) != n) {
    PyErr_SetString(PyExc_ValueError, "to_host_burst: one routed key per storage");
    return nullptr;
  }
  BurstLap lap(kToHost);
  Calls calls;
  if (!begin_burst(transport, calls, lap, kToHost) || bound_in_flight(transport) < 0) return nullptr;
  Refs refs;
  unsigned long long d2h, fence, compute;
  if (!int_attr(transport, MCO_NAME("_d2h_handle"), d2h) ||
      !nested_int_attr(transport, MCO_NAME("_d2h_fence"), MCO_NAME("handle"), fence) ||
      !compute_handle(transport, compute))
    return nullptr;
  // The saved tensors were produced on the compute stream: copy only after it reached this point.
  int err = calls.record(as_handle(fence), as_handle(compute));
  if (err == 0) err = calls.wait(as_handle(d2h), as_handle(fence), 0);
  std::vector<const void*> srcs(n);
  std::vector<size_t> sizes(n);
  long long nbytes = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* st = PyList_GET_ITEM(storages, i);
    if (!THPStorage_Check(st)) {
      PyErr_SetString(PyExc_TypeError, "to_host_burst copies untyped storages only");
      return nullptr;
    }
    const c10::Storage& storage = THPStorage_Unpack(st);
    srcs[i] = storage.data();
    sizes[i] = storage.nbytes();
    nbytes += static_cast<long long>(sizes[i]);
  }
  lap.to(kFence);
  PyObject* pool = refs.keep(get_attr(transport, MCO_NAME("pool")));
  PyObject* acquire = pool ? refs.keep(get_attr(pool, MCO_NAME("acquire_base"))) : nullptr;
  PyObject* bufs = acquire ? refs.keep(PyList_New(n)) : nullptr;
  if (bufs == nullptr) return nullptr;
  std::vector<PyObject*> reuse_events(n, nullptr);  // borrowed from the pool's answers, kept in ``answers``
  PyObject* answers = refs.keep(PyList_New(0));
  if (answers == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* answer = acquire_fast(pool, static_cast<long long>(sizes[i]), PyList_GET_ITEM(routed, i));
    if (answer == nullptr && PyErr_Occurred()) return nullptr;
    if (answer == nullptr)
      answer = PyObject_CallFunction(acquire, "nO", static_cast<Py_ssize_t>(sizes[i]), PyList_GET_ITEM(routed, i));
    if (answer == nullptr) return nullptr;
    int rc = PyList_Append(answers, answer);
    Py_DECREF(answer);
    if (rc < 0) return nullptr;
    if (!PyTuple_Check(answer) || PyTuple_GET_SIZE(answer) != 2 || !THPVariable_Check(PyTuple_GET_ITEM(answer, 0))) {
      PyErr_SetString(PyExc_TypeError, "to_host_burst: pool.acquire_base must answer (tensor, event)");
      return nullptr;
    }
    PyObject* buf = PyTuple_GET_ITEM(answer, 0);
    Py_INCREF(buf);
    PyList_SET_ITEM(bufs, i, buf);
    reuse_events[i] = PyTuple_GET_ITEM(answer, 1);
  }
  lap.to(kAcquire);
  // A reused buffer's previous H2D must have read it before we overwrite it, unless the compute stream already
  // waited for that reload burst or a later one (the fence above, recorded after that wait, orders this burst).
  long long ordered = 0;
  {
    PyObject* waited_seq = refs.keep(get_attr(transport, MCO_NAME("_waited_seq")));
    PyObject* key = waited_seq ? PyLong_FromUnsignedLongLong(compute) : nullptr;
    PyObject* got = key ? PyDict_GetItemWithError(waited_seq, key) : nullptr;  // borrowed
    Py_XDECREF(key);
    if (got == nullptr && PyErr_Occurred()) return nullptr;
    if (got != nullptr) {
      ordered = PyLong_AsLongLong(got);
      if (ordered == -1 && PyErr_Occurred()) return nullptr;
    }
  }
  PyObject* waited = nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* event = reuse_events[i];
    if (event == Py_None || event == waited) continue;
    PyObject* seq = getattr_fast(event, s_reload_seq);
    if (seq == nullptr) return nullptr;
    long long s = seq == Py_None ? -1 : PyLong_AsLongLong(seq);
    Py_DECREF(seq);
    if (s == -1 && PyErr_Occurred()) return nullptr;
    if (s != -1 && s <= ordered) continue;
    if (!wait_for(calls, d2h, event, err)) return nullptr;
    waited = event;
  }
  PyObject* telemetry = nullptr;
  PyObject* start = waits_done(transport, calls, refs, lap, err, d2h, telemetry);
  if (start == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    void* dst = THPVariable_Unpack(PyList_GET_ITEM(bufs, i)).data_ptr();
    err = calls.memcpy_async(dst, srcs[i], sizes[i], kDeviceToHost, as_handle(d2h));
    if (err != 0) {
      fail(transport, "cudaMemcpyAsync", err);
      return nullptr;
    }
  }
  lap.to(kCopies);
  burst_copies(kToHost, n);
  PyObject* done = refs.keep(done_event(transport, calls, d2h));
  if (done == nullptr) return nullptr;
  lap.to(kDone);
  // The caching allocator must not hand these blocks out before the copy has read them (release_copied).
  PyObject* held = refs.keep(get_attr(transport, MCO_NAME("_held")));
  PyObject* pair = held ? refs.keep(PyTuple_Pack(2, done, keep_alive)) : nullptr;
  PyObject* r = pair ? call_method(held, MCO_NAME("append"), {pair}) : nullptr;
  if (r == nullptr) return nullptr;
  Py_DECREF(r);
  if (telemetry_span(telemetry, MCO_NAME("d2h"), start, done, nbytes) < 0) return nullptr;
  lap.to(kBook);
  return PyTuple_Pack(2, bufs, done);
  END_HANDLE_TH_ERRORS
}

// to_device_burst(transport, hosts, sizes, after, parts) -> (device storages, done events): RawCudaTransport.to_device
PyObject* module_to_device_burst(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *transport, *hosts, *sizes_obj, *after, *parts;
  if (!PyArg_ParseTuple(args, "OO!O!O!O", &transport, &PyList_Type, &hosts, &PyList_Type, &sizes_obj, &PyList_Type,
                        &after, &parts))
    return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(hosts);
  if (PyList_GET_SIZE(sizes_obj) != n || PyList_GET_SIZE(after) != n) {
    PyErr_SetString(PyExc_ValueError, "to_device_burst: one size and one D2H event per host buffer");
    return nullptr;
  }
  // The copy counts after which each part ends (None or []: one part), as transport.part_ends checks them
  std::vector<Py_ssize_t> ends;
  if (parts != Py_None) {
    PyObject* seq = PySequence_Fast(parts, "to_device_burst: parts must be a list of counts");
    if (seq == nullptr) return nullptr;
    Py_ssize_t total = 0;
    bool ok = true;
    for (Py_ssize_t p = 0; ok && p < PySequence_Fast_GET_SIZE(seq); ++p) {
      Py_ssize_t k = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, p));
      ok = !(k == -1 && PyErr_Occurred()) && k > 0;
      total += k;
      ends.push_back(total);
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) return nullptr;
    if (!ok || (!ends.empty() && total != n)) {
      PyObject* shown = PyObject_Repr(parts);
      PyErr_Format(PyExc_ValueError, "reload parts %s do not split %zd copies into non-empty runs",
                   shown ? PyUnicode_AsUTF8(shown) : "?", n);
      Py_XDECREF(shown);
      return nullptr;
    }
  }
  if (ends.empty()) ends.push_back(n);
  BurstLap lap(kToDevice);
  Calls calls;
  if (!begin_burst(transport, calls, lap, kToDevice)) return nullptr;
  Refs refs;
  unsigned long long h2d, fence, compute;
  if (!int_attr(transport, MCO_NAME("_h2d_handle"), h2d) ||
      !nested_int_attr(transport, MCO_NAME("_h2d_fence"), MCO_NAME("handle"), fence))
    return nullptr;
  PyObject* index_obj = refs.keep(get_attr(transport, MCO_NAME("device_index")));
  if (index_obj == nullptr) return nullptr;
  long device_index = PyLong_AsLong(index_obj);
  if (device_index == -1 && PyErr_Occurred()) return nullptr;
  c10::Device device = device_index < 0 ? c10::Device(c10::kCPU)
                                        : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  std::vector<size_t> sizes(n);
  std::vector<const void*> srcs(n);
  long long nbytes = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long s = PyLong_AsLongLong(PyList_GET_ITEM(sizes_obj, i));
    if (s == -1 && PyErr_Occurred()) return nullptr;
    PyObject* host = PyList_GET_ITEM(hosts, i);
    if (!THPVariable_Check(host)) {
      PyErr_SetString(PyExc_TypeError, "to_device_burst copies from host tensors only");
      return nullptr;
    }
    sizes[i] = static_cast<size_t>(s);
    srcs[i] = THPVariable_Unpack(host).data_ptr();
    nbytes += s;
  }
  // Allocated on the compute stream, which is the stream that consumes and later frees them (no fill: common.h)
  PyObject* out = refs.keep(PyList_New(n));
  if (out == nullptr) return nullptr;
  std::vector<void*> dsts(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    c10::Storage storage = fresh_storage(static_cast<int64_t>(sizes[i]), device);
    dsts[i] = storage.mutable_data();
    PyObject* st = THPStorage_Wrap(std::move(storage));
    if (st == nullptr) return nullptr;
    PyList_SET_ITEM(out, i, st);
  }
  lap.to(kAlloc);
  if (!compute_handle(transport, compute)) return nullptr;
  // The new blocks may be memory the compute stream has just freed and still reads.
  int err = calls.record(as_handle(fence), as_handle(compute));
  if (err == 0) err = calls.wait(as_handle(h2d), as_handle(fence), 0);
  lap.to(kFence);
  PyObject* waited = nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* event = PyList_GET_ITEM(after, i);
    if (event == Py_None || event == waited) continue;
    PyObject* seen = get_attr(event, MCO_NAME("seen_done"));
    int is_seen = seen ? PyObject_IsTrue(seen) : -1;
    Py_XDECREF(seen);
    if (is_seen < 0) return nullptr;
    if (is_seen) continue;  // a D2H already seen complete (release_copied) needs no wait
    // A reload reads the host copy: its own D2H must have finished (upstream bug #7398).
    if (!wait_for(calls, h2d, event, err)) return nullptr;
    waited = event;
  }
  PyObject* telemetry = nullptr;
  PyObject* start = waits_done(transport, calls, refs, lap, err, h2d, telemetry);
  if (start == nullptr) return nullptr;
  unsigned long long reload_seq = 0;
  if (!int_attr(transport, s_reload_seq, reload_seq)) return nullptr;
  PyObject* events = refs.keep(PyList_New(0));
  if (events == nullptr) return nullptr;
  Py_ssize_t first = 0;
  for (size_t p = 0; p < ends.size(); ++p) {
    for (Py_ssize_t i = first; i < ends[p]; ++i) {
      err = calls.memcpy_async(dsts[i], srcs[i], sizes[i], kHostToDevice, as_handle(h2d));
      if (err != 0) {
        fail(transport, "cudaMemcpyAsync", err);
        return nullptr;
      }
    }
    lap.to(kCopies);
    PyObject* done = done_event(transport, calls, h2d);
    if (done == nullptr) return nullptr;
    // The number the handler gives this part right after (Transport.wait_reload), for to_host's reuse check
    PyObject* seq = PyLong_FromUnsignedLongLong(reload_seq + 1 + p);
    int rc = seq ? setattr_fast(done, s_reload_seq, seq) : -1;
    Py_XDECREF(seq);
    if (rc == 0) rc = PyList_Append(events, done);
    Py_DECREF(done);
    if (rc < 0) return nullptr;
    first = ends[p];
    lap.to(kDone);
  }
  burst_copies(kToDevice, n);
  PyObject* last = PyList_GET_ITEM(events, PyList_GET_SIZE(events) - 1);
  if (set_attr(transport, MCO_NAME("_last_h2d_done"), last) < 0 ||
      telemetry_span(telemetry, MCO_NAME("h2d"), start, last, nbytes) < 0)
    return nullptr;
  lap.to(kBook);
  return PyTuple_Pack(2, out, events);
  END_HANDLE_TH_ERRORS
}

namespace {

// release_copied(transport): CudaTransport.release_copied(final=False) for the raw transport
PyObject* module_release_copied(PyObject*, PyObject* transport) {
  HANDLE_TH_ERRORS
  Calls calls;
  if (!calls_of(transport, calls) || release_done(transport, calls, kToHost) < 0) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

}  // namespace

PyMethodDef burst_methods[] = {
    {"to_host_burst", module_to_host_burst, METH_VARARGS,
     "to_host_burst(transport, storages, keep_alive, routed): RawCudaTransport.to_host"},
    {"to_device_burst", module_to_device_burst, METH_VARARGS,
     "to_device_burst(transport, hosts, sizes, after, parts): RawCudaTransport.to_device"},
    {"release_copied", module_release_copied, METH_O, "release_copied(transport): release_copied(final=False)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
