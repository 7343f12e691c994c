// The copy-out of the native runtime (see __init__.py for why and how this is built).
//
// Each does what its Python counterpart in runtime/handler.py, runtime/saved.py or runtime/transport.py does, for the
// common case:
//
//   copy_out    handler.flush for a step that neither audits nor probes (auto's first steps): the grouping by
//               storage, the coverage and alias checks, one Entry per storage copied, its release callback (a weak
//               reference to the storage, as handler._released_callback; both types in entry.cpp), the counters,
//               and the per-view bookkeeping (attach). The copies themselves are the transport's to_host, called
//               from here.
//   storages_of, attach   handler.flush's grouping of saved refs by storage, and handler._attach (the Python flush
//               uses them where copy_out does not run)
//
// The coverage and alias checks copy_out makes on each storage are in held_checks.cpp.
//
// The transport's copy loop and reload allocations are in copy_calls.cpp.

#include "common.h"

#include <utility>

namespace mco {
namespace {

// handler.flush's grouping (the module's storages_of(groups)). {storage address: (storage, [refs])} over the refs still
// holding their tensor, in the order their storages first appear; one storage object per storage, as the Python loop
// keeps
PyObject* storages_of(PyObject* groups) {
  HANDLE_TH_ERRORS
  PyObject* out = PyDict_New();
  PyObject* seq = out ? PySequence_Fast(groups, "storages_of takes a list of groups") : nullptr;
  if (seq == nullptr) {
    Py_XDECREF(out);
    return nullptr;
  }
  bool ok = true;
  for (Py_ssize_t g = 0; ok && g < PySequence_Fast_GET_SIZE(seq); ++g) {
    PyObject* refs = get_attr(PySequence_Fast_GET_ITEM(seq, g), MCO_NAME("refs"));
    PyObject* rseq = refs ? PySequence_Fast(refs, "group.refs must be a list") : nullptr;
    Py_XDECREF(refs);
    if (rseq == nullptr) {
      ok = false;
      break;
    }
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(rseq); ++i) {
      PyObject* ref = PySequence_Fast_GET_ITEM(rseq, i);
      PyObject* tensor = ref_tensor(ref);
      if (tensor == nullptr) {
        ok = !PyErr_Occurred();
        continue;
      }
      const c10::Storage& storage = THPVariable_Unpack(tensor).storage();
      PyObject* key = PyLong_FromVoidPtr(const_cast<void*>(storage.data()));
      PyObject* item = key ? PyDict_GetItemWithError(out, key) : nullptr;  // borrowed
      if (item == nullptr && !PyErr_Occurred() && key != nullptr) {
        PyObject* st = THPStorage_Wrap(storage);
        PyObject* lst = st ? PyList_New(0) : nullptr;
        item = lst ? PyTuple_Pack(2, st, lst) : nullptr;
        Py_XDECREF(st);
        Py_XDECREF(lst);
        if (item != nullptr) {
          int rc = PyDict_SetItem(out, key, item);
          Py_DECREF(item);  // the dict holds it
          if (rc < 0) item = nullptr;
        }
      }
      ok = item != nullptr && PyList_Append(PyTuple_GET_ITEM(item, 1), ref) == 0;
      Py_XDECREF(key);
      Py_DECREF(tensor);
    }
    Py_DECREF(rseq);
  }
  Py_DECREF(seq);
  if (!ok) Py_CLEAR(out);
  return out;
  END_HANDLE_TH_ERRORS
}

int set_attr_steal(PyObject* obj, const char* name, PyObject* value) {
  if (value == nullptr) return -1;
  int rc = PyObject_SetAttrString(obj, name, value);
  Py_DECREF(value);
  return rc;
}

// Record one ref's view layout and swap its tensor for ``entry`` (the per-ref half of handler._attach); -1 on error
int attach_one(PyObject* entry, PyObject* ref) {
  PyObject* tensor = ref_tensor(ref);
  if (tensor == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "attach: a saved reference has no tensor left");
    return -1;
  }
  const at::Tensor& t = THPVariable_Unpack(tensor);
  int rc = 0;
  if (Py_TYPE(ref) == &SavedRefType) {  // the layout as C++ values (ViewLayout: no Python ints or tuples)
    SavedRef* r = reinterpret_cast<SavedRef*>(ref);
    ViewLayout& layout = r->layout;
    layout.dtype = t.scalar_type();
    layout.offset = t.storage_offset();
    layout.sizes.assign(t.sizes().begin(), t.sizes().end());
    layout.strides.assign(t.strides().begin(), t.strides().end());
    layout.has_dtype = layout.has_offset = layout.has_size = layout.has_stride = true;
    Py_INCREF(entry);
    Py_XSETREF(r->entry, entry);
    Py_CLEAR(r->tensor);  // reads as None
  } else {
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));  // borrowed
    Py_INCREF(dtype);
    // each value is made just before it is set (set_attr_steal takes it), so a failure leaks nothing
    rc = set_attr_steal(ref, "dtype", dtype) < 0 ||
                 set_attr_steal(ref, "offset", PyLong_FromLongLong(t.storage_offset())) < 0 ||
                 set_attr_steal(ref, "size", int_tuple_of(t.sizes())) < 0 ||
                 set_attr_steal(ref, "stride", int_tuple_of(t.strides())) < 0 ||
                 set_attr(ref, MCO_NAME("entry"), entry) < 0 || set_attr(ref, MCO_NAME("tensor"), Py_None) < 0
             ? -1
             : 0;
  }
  Py_DECREF(tensor);  // after the swap: this may have been the last reference to the saved tensor
  return rc;
}

// handler._attach: each ref's layout is recorded and its tensor dropped for the entry; each ref's group lists the
// entry once, and the entry counts each such group once (entry.users). -1 on error
int attach_all(PyObject* entry, PyObject* refs) {
  PyObject* seq = PySequence_Fast(refs, "attach takes a list of saved references");
  if (seq == nullptr) return -1;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); ++i) {
    PyObject* ref = PySequence_Fast_GET_ITEM(seq, i);
    ok = attach_one(entry, ref) == 0 && add_to_attr(entry, s_awaiting, 1) == 0;
    if (!ok) break;
    PyObject* group = Py_TYPE(ref) == &SavedRefType ? reinterpret_cast<SavedRef*>(ref)->group : nullptr;
    if (group != nullptr) {
      Py_INCREF(group);
    } else {
      group = get_attr(ref, MCO_NAME("group"));
      if (group == nullptr) {
        ok = false;
        break;
      }
    }
    PyObject* entries = get_attr(group, MCO_NAME("entries"));
    int has = entries ? PySequence_Contains(entries, entry) : -1;
    if (has == 0) {
      ok = PyList_Append(entries, entry) == 0 && add_to_attr(entry, s_users, 1) == 0;
    } else {
      ok = has > 0;
    }
    Py_XDECREF(entries);
    Py_DECREF(group);
  }
  Py_DECREF(seq);
  return ok ? 0 : -1;
}

// attach(entry, refs): handler._attach
PyObject* module_attach(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *entry, *refs;
  if (!PyArg_ParseTuple(args, "OO", &entry, &refs)) return nullptr;
  if (attach_all(entry, refs) < 0) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* module_storages_of(PyObject*, PyObject* groups) { return storages_of(groups); }

// ------------------------------------------------------------------------------------------------------ copy_out
// (the coverage and alias checks it makes are in held_checks.cpp)
struct ToCopy {
  PyObject* ptr;  // borrowed from the grouping dict, which outlives the list
  PyObject* storage;
  PyObject* refs;
};

// The entries of one copy burst: made, registered in handler.live with their release callbacks, counted, attached
int make_entries(PyObject* handler, PyObject* live, const std::vector<ToCopy>& todo, PyObject* hosts,
                 PyObject* event) {
  PointTotals offloaded;
  for (size_t i = 0; i < todo.size(); ++i) {
    const ToCopy& c = todo[i];
    PyObject* first = PyList_GET_ITEM(c.refs, 0);
    PyObject* point = getattr_fast(first, s_point);
    if (point == nullptr) return -1;
    int64_t n = static_cast<int64_t>(THPStorage_Unpack(c.storage).nbytes());
    PyObject* nbytes = PyLong_FromLongLong(n);
    PyObject* entry = nbytes ? new_entry(point, nbytes, PyList_GET_ITEM(hosts, i), event, c.ptr) : nullptr;
    Py_XDECREF(nbytes);
    PyObject* callback = entry ? new_released(handler, c.ptr, entry) : nullptr;
    PyObject* weak = callback ? PyWeakref_NewRef(c.storage, callback) : nullptr;
    Py_XDECREF(callback);
    int rc = weak == nullptr ? -1 : 0;
    if (rc == 0) {
      entry_set_storage_ref(entry, weak);
      rc = PyDict_SetItem(live, c.ptr, entry);
    }
    if (rc == 0) {
      offloaded.add(point, n);
      rc = attach_all(entry, c.refs);
    }
    Py_XDECREF(entry);
    Py_DECREF(point);
    if (rc < 0) return -1;
  }
  PyObject* summary = get_attr(handler, MCO_NAME("summary"));
  if (summary == nullptr) return -1;
  // summary.host_resident(total) once for a burst: the same resident peak as one call per entry (every delta is
  // positive)
  int rc =
      offloaded.report(summary, MCO_NAME("offloaded")) < 0 || summary_resident(summary, offloaded.total()) < 0 ? -1 : 0;
  Py_DECREF(summary);
  return rc;
}

// handler.on_held(point, nbytes, refs) (second_look.SecondLook.on_held) without its Python frames: counted as
// skipped_aliased (manager.on_skipped), and the refs' groups kept for the second look (-1: error set)
int on_held(PyObject* handler, PyObject* point, long long nbytes, PyObject* refs) {
  int again = attr_true(handler, MCO_NAME("looking_again"));
  if (again != 0) return again < 0 ? -1 : 0;  // counted at the first look
  Ref manager(get_attr(handler, MCO_NAME("manager")));
  Ref summary(manager ? get_attr(manager.get(), MCO_NAME("summary")) : nullptr);
  if (!summary) return -1;
  PointTotals skipped;
  skipped.add(point, nbytes);
  if (skipped.report(summary.get(), MCO_NAME("skipped_aliased")) < 0) return -1;
  int look = attr_true(manager.get(), MCO_NAME("second_look"));  // MCORE_OFFLOAD_SECOND_LOOK
  if (look <= 0) return look;
  Ref held(get_attr(handler, MCO_NAME("held_back")));
  if (!held) return -1;
  if (!PyList_Check(held.get()) || !PyList_Check(refs)) {
    PyErr_SetString(PyExc_TypeError, "on_held: handler.held_back and the refs must be lists");
    return -1;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(refs); ++i) {
    Ref group(get_attr(PyList_GET_ITEM(refs, i), MCO_NAME("group")));
    if (!group) return -1;
    bool known = false;
    for (Py_ssize_t j = 0; !known && j < PyList_GET_SIZE(held.get()); ++j)
      known = PyList_GET_ITEM(held.get(), j) == group.get();
    if (!known && PyList_Append(held.get(), group.get()) < 0) return -1;
  }
  return 0;
}

}  // namespace

// copy_out(handler, groups, routed_points, min_coverage): handler.flush's work after it took the pending groups (see
// the file comment)
PyObject* module_copy_out(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *handler, *groups, *routed_points;
  double min_coverage;
  if (!PyArg_ParseTuple(args, "OOOd", &handler, &groups, &routed_points, &min_coverage)) return nullptr;
  if (!PyAnySet_Check(routed_points)) {
    PyErr_SetString(PyExc_TypeError, "copy_out: routed_points must be a set");
    return nullptr;
  }
  PyObject* by_storage = storages_of(groups);
  if (by_storage == nullptr) return nullptr;
  PyObject* live = get_attr(handler, MCO_NAME("live"));
  PyObject* storages = PyList_New(0);
  PyObject* keep = PyList_New(0);
  PyObject* routed = PyList_New(0);
  std::vector<ToCopy> todo;
  bool ok = live != nullptr && storages != nullptr && keep != nullptr && routed != nullptr;
  if (ok && !PyDict_Check(live)) {
    PyErr_SetString(PyExc_TypeError, "copy_out: handler.live must be a dict");
    ok = false;
  }
  Py_ssize_t pos = 0;
  PyObject *ptr, *item;
  while (ok && PyDict_Next(by_storage, &pos, &ptr, &item)) {
    PyObject* st = PyTuple_GET_ITEM(item, 0);
    PyObject* refs = PyTuple_GET_ITEM(item, 1);
    PyObject* entry = PyDict_GetItemWithError(live, ptr);  // borrowed
    if (entry != nullptr) {  // already offloaded by an earlier group of this chunk
      // held across the attach: dropping the last view of a storage runs its release callback, which takes the
      // entry out of handler.live
      Py_INCREF(entry);
      ok = attach_all(entry, refs) == 0;
      Py_DECREF(entry);
      continue;
    }
    if (PyErr_Occurred()) {
      ok = false;
      break;
    }
    double need = min_coverage * static_cast<double>(THPStorage_Unpack(st).nbytes());
    int held;
    if (PyList_GET_SIZE(refs) == 1) {
      PyObject* tensor = ref_tensor(PyList_GET_ITEM(refs, 0));
      if (tensor == nullptr) {
        ok = !PyErr_Occurred();
        continue;
      }
      const at::Tensor& t = THPVariable_Unpack(tensor);
      bool small = static_cast<double>(t.numel() * static_cast<int64_t>(t.element_size())) < need;
      Py_DECREF(tensor);
      if (small) continue;
      held = held_by_other_than_one(st, PyList_GET_ITEM(refs, 0));
    } else {
      int enough = covers(refs, need);
      if (enough <= 0) {
        ok = enough == 0;
        continue;
      }
      held = held_by_other_than_many(st, refs);
    }
    if (held < 0) {
      ok = false;
      break;
    }
    PyObject* first = PyList_GET_ITEM(refs, 0);
    PyObject* point = get_attr(first, MCO_NAME("point"));
    if (point == nullptr) {
      ok = false;
      break;
    }
    if (held) {
      // Another live tensor keeps the storage: copying it would free nothing (handler.on_held counts it and
      // keeps its groups for a second look)
      ok = on_held(handler, point, static_cast<long long>(THPStorage_Unpack(st).nbytes()), refs) == 0;
      Py_DECREF(point);
      continue;
    }
    int is_routed = PySet_Contains(routed_points, point);
    PyObject* tensor = is_routed >= 0 ? ref_tensor(first) : nullptr;
    ok = tensor != nullptr && PyList_Append(storages, st) == 0 && PyList_Append(keep, tensor) == 0 &&
         PyList_Append(routed, is_routed ? point : Py_None) == 0;
    Py_XDECREF(tensor);
    Py_DECREF(point);
    if (ok) todo.push_back({ptr, st, refs});
  }
  if (ok && !todo.empty()) {
    PyObject* transport = get_attr(handler, MCO_NAME("transport"));
    // transport.to_host, or straight to its C++ burst where that is what it would call (link_calls.cpp)
    int direct = transport ? bursts_in_cpp(transport) : -1;
    PyObject* args = direct == 1 ? PyTuple_Pack(4, transport, storages, keep, routed) : nullptr;
    PyObject* result = direct == 1   ? (args ? module_to_host_burst(nullptr, args) : nullptr)
                       : direct == 0 ? call_method(transport, MCO_NAME("to_host"), {storages, keep, routed})
                                     : nullptr;
    Py_XDECREF(args);
    Py_XDECREF(transport);
    Py_CLEAR(keep);  // the transport holds what it must until the copy has read it
    PyObject *hosts = nullptr, *event = nullptr;
    ok = result != nullptr && PyArg_ParseTuple(result, "OO", &hosts, &event) && PyList_Check(hosts) &&
         PyList_GET_SIZE(hosts) == static_cast<Py_ssize_t>(todo.size());
    if (result != nullptr && !ok && !PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "copy_out: to_host must answer (a list of host buffers, one event)");
    ok = ok && make_entries(handler, live, todo, hosts, event) == 0;
    Py_XDECREF(result);
  }
  Py_XDECREF(keep);
  Py_XDECREF(storages);
  Py_XDECREF(routed);
  Py_XDECREF(live);
  Py_DECREF(by_storage);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef copy_path_methods[] = {
    {"storages_of", module_storages_of, METH_O, "storages_of(groups): handler.flush's grouping by storage"},
    {"attach", module_attach, METH_VARARGS, "attach(entry, refs): handler._attach"},
    {"copy_out", module_copy_out, METH_VARARGS,
     "copy_out(handler, groups, routed_points, min_coverage): handler.flush's work"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
