// The reload's bookkeeping in C++ (see __init__.py for why and how this is built):
//
//   reload   handler._reload: which entries of the given runs are on the host only (each once), one call to the
//            transport's to_device for them, then each entry's reloaded storage, done event and burst number, and
//            the counters (manager.on_reloaded's, per point and burst; entry by entry while the summary traces the
//            peak, which reads the allocator at each change)

#include "common.h"

#include <unordered_set>

namespace mco {
namespace {

// 1: attr is None, 0: it is not, -1: error
int attr_is_none(PyObject* obj, PyObject* name) {
  PyObject* v = getattr_fast(obj, name);
  if (v == nullptr) return -1;
  int none = v == Py_None;
  Py_DECREF(v);
  return none;
}

// The entries of ``runs`` still only on the host, each once, and how many each run contributed (-1: error)
int on_host_only(PyObject* runs, std::vector<PyObject*>& todo, std::vector<Py_ssize_t>& parts) {
  std::unordered_set<PyObject*> seen;
  for (Py_ssize_t r = 0; r < PyTuple_GET_SIZE(runs); ++r) {
    PyObject* seq = PySequence_Fast(PyTuple_GET_ITEM(runs, r), "reload takes lists of entries");
    if (seq == nullptr) return -1;
    size_t before = todo.size();
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
      PyObject* e = PySequence_Fast_GET_ITEM(seq, i);
      int gone = attr_is_none(e, s_device_storage);
      int no_host = gone == 1 ? attr_is_none(e, s_host) : 1;
      if (gone < 0 || no_host < 0) {
        Py_DECREF(seq);
        return -1;
      }
      if (gone == 1 && no_host == 0 && seen.insert(e).second) todo.push_back(e);  // borrowed: runs outlive us
    }
    Py_DECREF(seq);
    if (todo.size() > before) parts.push_back(static_cast<Py_ssize_t>(todo.size() - before));
  }
  return 0;
}

// A list of getattr(e, name) over ``todo`` (nullptr: error)
PyObject* gather(const std::vector<PyObject*>& todo, PyObject* name) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(todo.size()));
  for (size_t i = 0; out != nullptr && i < todo.size(); ++i) {
    PyObject* v = getattr_fast(todo[i], name);
    if (v == nullptr) {
      Py_CLEAR(out);
      break;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), v);
  }
  return out;
}

// manager.on_reloaded for every entry of the burst: entry by entry while the summary traces the peak (it reads the
// allocator at each change), else one summary.add per point and counter and one summary.off_device for the entries
// that were off the device
int count_reloaded(PyObject* handler, const std::vector<PyObject*>& todo, bool on_demand) {
  PyObject* summary = get_attr(handler, MCO_NAME("summary"));
  if (summary == nullptr) return -1;
  int tracing = summary_traces(summary);
  bool ok = tracing >= 0;
  if (ok && tracing) {
    PyObject* manager = get_attr(handler, MCO_NAME("manager"));
    ok = manager != nullptr;
    for (size_t i = 0; ok && i < todo.size(); ++i) {
      PyObject* r = PyObject_CallMethod(manager, "on_reloaded", "OO", todo[i], on_demand ? Py_True : Py_False);
      ok = r != nullptr;
      Py_XDECREF(r);
    }
    Py_XDECREF(manager);
  } else if (ok) {
    PointTotals reloaded;
    long long back = 0;
    for (size_t i = 0; ok && i < todo.size(); ++i) {
      PyObject* point = getattr_fast(todo[i], s_point);
      PyObject* nbytes = point ? getattr_fast(todo[i], s_nbytes) : nullptr;
      long long n = nbytes ? PyLong_AsLongLong(nbytes) : -1;
      Py_XDECREF(nbytes);
      PyObject* off = n == -1 && PyErr_Occurred() ? nullptr : getattr_fast(todo[i], s_off_device);
      ok = point != nullptr && off != nullptr;
      if (ok && off == Py_True) {
        back += n;
        ok = setattr_fast(todo[i], s_off_device, Py_False) == 0;
      }
      if (ok) reloaded.add(point, n);
      Py_XDECREF(off);
      Py_XDECREF(point);
    }
    ok = ok && reloaded.report(summary, MCO_NAME("reloaded")) == 0 &&
         (!on_demand || reloaded.report(summary, MCO_NAME("reloaded_on_demand")) == 0);
    ok = ok && (back == 0 || summary_off_device(summary, -back) == 0);
  }
  Py_DECREF(summary);
  return ok ? 0 : -1;
}

}  // namespace

// handler._reload (runs: a tuple of lists of entries, in the order needed; each run gets its own done event); -1 on
// error. Also backward.cpp's, for the reloads of a group's backward
int reload_runs(PyObject* handler, PyObject* runs, bool on_demand) {
  std::vector<PyObject*> todo;
  std::vector<Py_ssize_t> parts;
  if (on_host_only(runs, todo, parts) < 0) return -1;
  if (todo.empty()) return 0;
  PyObject* hosts = gather(todo, s_host);
  PyObject* sizes = hosts ? gather(todo, s_nbytes) : nullptr;
  PyObject* after = sizes ? gather(todo, s_d2h_event) : nullptr;
  PyObject* parts_arg = nullptr;
  if (after != nullptr) {
    if (parts.size() > 1) {
      parts_arg = PyList_New(static_cast<Py_ssize_t>(parts.size()));
      for (size_t i = 0; parts_arg != nullptr && i < parts.size(); ++i) {
        PyObject* n = PyLong_FromSsize_t(parts[i]);
        if (n == nullptr) {
          Py_CLEAR(parts_arg);
          break;
        }
        PyList_SET_ITEM(parts_arg, static_cast<Py_ssize_t>(i), n);
      }
    } else {
      Py_INCREF(Py_None);
      parts_arg = Py_None;
      parts.assign(1, static_cast<Py_ssize_t>(todo.size()));
    }
  }
  PyObject* transport = parts_arg ? get_attr(handler, MCO_NAME("transport")) : nullptr;
  PyObject* device = transport ? get_attr(handler, MCO_NAME("device")) : nullptr;
  // transport.to_device, or straight to its C++ burst where that is what it would call (link_calls.cpp)
  int direct = device ? bursts_in_cpp(transport) : -1;
  PyObject* args = direct == 1 ? PyTuple_Pack(5, transport, hosts, sizes, after, parts_arg) : nullptr;
  PyObject* result = direct == 1   ? (args ? module_to_device_burst(nullptr, args) : nullptr)
                     : direct == 0 ? call_method(transport, MCO_NAME("to_device"), {hosts, sizes, after, device, parts_arg})
                                   : nullptr;
  Py_XDECREF(args);
  Py_XDECREF(hosts);
  Py_XDECREF(sizes);
  Py_XDECREF(after);
  Py_XDECREF(parts_arg);
  Py_XDECREF(device);
  PyObject *storages = nullptr, *events = nullptr;
  bool ok = result != nullptr && PyArg_ParseTuple(result, "OO", &storages, &events) && PyList_Check(storages) &&
            PyList_Check(events) && PyList_GET_SIZE(storages) == static_cast<Py_ssize_t>(todo.size()) &&
            PyList_GET_SIZE(events) == static_cast<Py_ssize_t>(parts.size());
  if (result != nullptr && !ok && !PyErr_Occurred())
    PyErr_SetString(PyExc_TypeError, "reload: to_device must answer (one storage per entry, one event per run)");
  size_t i = 0;
  for (size_t p = 0; ok && p < parts.size(); ++p) {
    // transport.reload_seq += 1: this run's burst number (Transport.wait_reload)
    ok = add_to_attr(transport, s_reload_seq, 1) == 0;
    PyObject* seq = ok ? getattr_fast(transport, s_reload_seq) : nullptr;
    ok = seq != nullptr;
    PyObject* event = ok ? PyList_GET_ITEM(events, static_cast<Py_ssize_t>(p)) : nullptr;
    for (Py_ssize_t k = 0; ok && k < parts[p]; ++k, ++i) {
      PyObject* e = todo[i];
      ok = setattr_fast(e, s_device_storage, PyList_GET_ITEM(storages, static_cast<Py_ssize_t>(i))) == 0 &&
           setattr_fast(e, s_h2d_event, event) == 0 && setattr_fast(e, s_h2d_seq, seq) == 0 &&
           setattr_fast(e, s_compute_waited, Py_False) == 0;
    }
    Py_XDECREF(seq);
  }
  Py_XDECREF(result);
  Py_XDECREF(transport);
  return !ok || count_reloaded(handler, todo, on_demand) < 0 ? -1 : 0;
}

namespace {

// reload(handler, runs, on_demand): handler._reload
PyObject* module_reload(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *handler, *runs;
  int on_demand;
  if (!PyArg_ParseTuple(args, "OO!p", &handler, &PyTuple_Type, &runs, &on_demand)) return nullptr;
  if (reload_runs(handler, runs, on_demand != 0) < 0) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

}  // namespace

PyMethodDef reload_methods[] = {
    {"reload", module_reload, METH_VARARGS, "reload(handler, runs, on_demand): handler._reload"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
