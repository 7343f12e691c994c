// A group's backward in C++ (see __init__.py for why and how this is built):
//
//   commit_backward  handler.on_group_commit_backward after the chunk's first group: the on-demand reload, the compute
//                    stream's one wait (link_calls.cpp: wait_reload), the prefetch of the layer below
//                    (handler._prefetch with one layer a burst)
//   group_done       handler.on_group_backward_done (the late prefetch and finish are called as they are)
//
// (handler.finish's release, once per chunk and microbatch, is finish_release.cpp.) These run once per group on the
// backward's host path, where each Python frame is step time in a launch-bound step (about 110 µs a group of Python
// in session 33's breakdown of A).
// commit_backward and group_done answer False, having changed nothing, where the Python method must decide: the
// chunk's first backward group (what forward left pending), a chain still open, another chunk's groups waiting to be
// flushed, the auto probe's clock marks, reload bursts of several layers. tests/test_native_backward.py runs training
// steps through both and compares the CUDA calls, counters, losses and gradients.

#include "common.h"

#include <algorithm>
#include <vector>

namespace mco {

// (common.h) list(seq) items of getattr(obj, name), as a fast sequence (nullptr: error)
PyObject* attr_items(PyObject* obj, PyObject* name) {
  Ref v(get_attr(obj, name));  // get_attr: finish_release.cpp passes MCO_NAME names, nullptr where interning failed
  return v ? PySequence_Fast(v.get(), "a list was expected") : nullptr;
}

namespace {

PyObject* s_backward_started;
PyObject* s_manager;
PyObject* s_pending;
PyObject* s_marks;
PyObject* s_reload_layers;
PyObject* s_prefetch;
PyObject* s_layers;
PyObject* s_chunk_layers;
PyObject* s_vp_stage;
PyObject* s_entries;
PyObject* s_transport;
PyObject* s_index;
PyObject* s_layer;
PyObject* s_groups;
PyObject* s_kept_on_device;
PyObject* s_done;
PyObject* s_reload_bursts;
PyObject* s_current_group;
PyObject* s_groups_done;
PyObject* s_late_method;
PyObject* s_prefetch_layer_below;
PyObject* s_finish;
PyObject* s_split_chains;

enum PrefetchMode { kLayerMode, kLateMode, kTailMode, kOtherMode };

// manager.prefetch, one of MCORE_OFFLOAD_PREFETCH's three spellings (kOtherMode: none of them; -1: error)
int prefetch_mode(PyObject* manager) {
  Ref mode(getattr_fast(manager, s_prefetch));
  if (!mode) return -1;
  const char* names[] = {"layer", "late", "tail"};
  for (int m = kLayerMode; m <= kTailMode; ++m) {
    if (PyUnicode_Check(mode.get()) && PyUnicode_CompareWithASCIIString(mode.get(), names[m]) == 0) return m;
  }
  return kOtherMode;
}

// handler._late(layer) (1 / 0; -1: error)
int late_for(PyObject* handler, int mode, long layer) {
  if (mode == kLayerMode) return 0;
  if (mode == kLateMode) return 1;
  if (mode != kTailMode) {  // not a mode this file knows: the method answers
    Ref n(PyLong_FromLong(layer));
    Ref answer(n ? PyObject_CallMethodObjArgs(handler, s_late_method, n.get(), nullptr) : nullptr);
    return answer ? PyObject_IsTrue(answer.get()) : -1;
  }
  // tail: late in the chunk's last layer where that layer came back from the host
  Ref groups(getattr_fast(handler, s_groups));
  if (!groups) return -1;
  if (!PyList_Check(groups.get()) || PyList_GET_SIZE(groups.get()) == 0) {
    PyErr_SetString(PyExc_RuntimeError, "mcore-offload: a group's backward in a chunk without committed groups; "
                                        "this is a bug, please report it");
    return -1;
  }
  PyObject* last = PyList_GET_ITEM(groups.get(), PyList_GET_SIZE(groups.get()) - 1);
  long last_layer = attr_long(last, s_layer);
  if (last_layer == -1 && PyErr_Occurred()) return -1;
  if (layer != last_layer) return 0;
  int kept = attr_true(last, s_kept_on_device);
  return kept < 0 ? -1 : !kept;
}

// The point whose entries a split chain reloads last and waits for at their first unpack (prefetch._chain_parts):
// the group's first point where it spans several and handler.manager.split_chains holds; else None. A new reference
// (nullptr: error).
PyObject* split_first_point(PyObject* handler, PyObject* group) {
  Ref points(getattr_fast(group, s_points));
  if (!points) return nullptr;
  Py_ssize_t n = PyObject_Length(points.get());
  if (n < 0) return nullptr;
  if (n < 2) Py_RETURN_NONE;
  Ref manager(getattr_fast(handler, s_manager));
  int split = manager ? attr_true(manager.get(), s_split_chains) : -1;
  if (split < 0) return nullptr;
  if (!split) Py_RETURN_NONE;
  return PySequence_GetItem(points.get(), 0);
}

// 1 where entry.point equals ``point`` (a str, or None: never), 0 where not, -1 error
int of_point(PyObject* entry, PyObject* point) {
  if (point == Py_None) return 0;
  Ref p(getattr_fast(entry, s_point));
  return p ? PyObject_RichCompareBool(p.get(), point, Py_EQ) : -1;
}

// prefetch._chain_parts: ``run`` (entries of ``group``) appended to ``needed`` as one part, or as a split chain's two
// (its later points' entries, then its first point's) (-1: error)
int append_parts(PyObject* handler, PyObject* group, PyObject* run, PyObject* needed) {
  Ref first(split_first_point(handler, group));
  if (!first) return -1;
  if (first.get() != Py_None) {
    Ref later(PyList_New(0));
    Ref own(later ? PyList_New(0) : nullptr);
    if (!own) return -1;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(run); ++k) {
      PyObject* e = PyList_GET_ITEM(run, k);
      int mine = of_point(e, first.get());
      if (mine < 0 || PyList_Append(mine ? own.get() : later.get(), e) < 0) return -1;
    }
    if (PyList_GET_SIZE(later.get()) > 0 && PyList_GET_SIZE(own.get()) > 0) {
      return PyList_Append(needed, later.get()) < 0 ? -1 : PyList_Append(needed, own.get());
    }
  }
  return PyList_Append(needed, run);
}

// handler.groups, which must be a list (nullptr: error)
PyObject* handler_groups(PyObject* handler) {
  PyObject* groups = getattr_fast(handler, s_groups);
  if (groups != nullptr && !PyList_Check(groups)) {
    Py_DECREF(groups);
    PyErr_SetString(PyExc_TypeError, "handler.groups must be a list");
    return nullptr;
  }
  return groups;
}

// handler._on_host_down_to: the entries still only on the host of the groups before ``index``, back to layer
// ``reach``, one list per group that has any (two for a split chain: append_parts), appended to ``needed`` in backward
// order (-1: error)
int on_host_down_to(PyObject* handler, long index, long reach, PyObject* needed) {
  Ref groups(handler_groups(handler));
  if (!groups) return -1;
  for (long i = std::min<long>(index, static_cast<long>(PyList_GET_SIZE(groups.get()))) - 1; i >= 0; --i) {
    PyObject* prev = PyList_GET_ITEM(groups.get(), i);
    long layer = attr_long(prev, s_layer);
    if (layer == -1 && PyErr_Occurred()) return -1;
    if (layer < reach) break;
    int done = attr_true(prev, s_done);
    if (done < 0) return -1;
    if (done) continue;
    Ref seq(attr_items(prev, s_entries));
    Ref run(seq ? PyList_New(0) : nullptr);
    if (!run) return -1;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq.get()); ++k) {
      PyObject* e = PySequence_Fast_GET_ITEM(seq.get(), k);
      Ref storage(getattr_fast(e, s_device_storage));
      Ref host(storage ? getattr_fast(e, s_host) : nullptr);
      if (!host) return -1;
      if (storage.get() == Py_None && host.get() != Py_None && PyList_Append(run.get(), e) < 0) return -1;
    }
    if (PyList_GET_SIZE(run.get()) > 0 && append_parts(handler, prev, run.get(), needed) < 0) return -1;
  }
  return 0;
}

// handler._layer_below: the layer of the nearest group before ``index`` whose layer is under ``layer`` (a plan may
// leave layers out), else layer - 1 (-1 with an error set: error)
long layer_below(PyObject* handler, long index, long layer) {
  Ref groups(handler_groups(handler));
  if (!groups) return -1;
  for (long i = std::min<long>(index, static_cast<long>(PyList_GET_SIZE(groups.get()))) - 1; i >= 0; --i) {
    long prev = attr_long(PyList_GET_ITEM(groups.get(), i), s_layer);
    if (prev == -1 && PyErr_Occurred()) return -1;
    if (prev < layer) return prev;
  }
  return layer - 1;
}

// handler._prefetch(group) with one layer a reload burst (-1: error)
int prefetch(PyObject* handler, PyObject* group, int mode) {
  long index = attr_long(group, s_index);
  if (index == -1 && PyErr_Occurred()) return -1;
  if (index <= 0) return 0;
  long layer = attr_long(group, s_layer);
  if (layer == -1 && PyErr_Occurred()) return -1;
  int late = late_for(handler, mode, layer);
  if (late < 0) return -1;
  long reach = late ? layer : layer_below(handler, index, layer);
  if (reach == -1 && PyErr_Occurred()) return -1;
  Ref needed(PyList_New(0));
  if (!needed || on_host_down_to(handler, index, reach, needed.get()) < 0) return -1;
  Py_ssize_t n = PyList_GET_SIZE(needed.get());
  if (n == 0) return 0;
  // late: one done event per group; ahead of time, one burst (one event) for what the layer below needs
  Ref runs;
  if (late) {
    runs.reset(PyList_AsTuple(needed.get()));
  } else {
    Ref all(PyList_New(0));
    for (Py_ssize_t i = 0; all && i < n; ++i) {
      PyObject* run = PyList_GET_ITEM(needed.get(), i);
      if (PyList_SetSlice(all.get(), PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, run) < 0) return -1;
    }
    if (all) runs.reset(PyTuple_Pack(1, all.get()));
  }
  if (!runs || add_to_attr(handler, s_reload_bursts, 1) < 0) return -1;
  return reload_runs(handler, runs.get(), false);
}

// Whether commit_backward may do the group's work: 1 yes, 0 the Python method must, -1 error
int commit_fast_path(PyObject* handler, PyObject* manager) {
  int started = attr_true(handler, s_backward_started);  // the chunk's first group settles what forward left
  if (started <= 0) return started;
  Ref chain(getattr_fast(manager, s_chain));  // manager.on_backward closes an open chain
  if (!chain) return -1;
  if (chain.get() != Py_None) return 0;
  Ref fwd(getattr_fast(manager, s_forward_handler));  // and flushes another chunk's pending groups
  if (!fwd) return -1;
  if (fwd.get() != Py_None && fwd.get() != handler) {
    int pending = attr_true(fwd.get(), s_pending);
    if (pending != 0) return pending < 0 ? -1 : 0;
  }
  Ref marks(getattr_fast(handler, s_marks));  // the auto probe's clock marks
  if (!marks) return -1;
  if (marks.get() != Py_None) return 0;
  long k = attr_long(manager, s_reload_layers);  // bursts of several layers
  if (k == -1 && PyErr_Occurred()) return -1;
  return k == 1 ? 1 : 0;
}

// handler._wait_for_start: the compute stream's one wait before a group's backward, on the latest reload burst of
// the entries it needs not yet waited for (it covers the earlier ones), which are marked waited; a split chain's
// first point's entries in a later burst are left to their first unpack (-1: error)
int wait_latest(PyObject* handler, PyObject* group, PyObject* entries) {
  Ref first(split_first_point(handler, group));
  Ref seq(first ? PySequence_Fast(entries, "group.entries must be a list") : nullptr);
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
  std::vector<long> seqs(static_cast<size_t>(n), 0);
  std::vector<char> open(static_cast<size_t>(n), 0), mine(static_cast<size_t>(n), 0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* e = PySequence_Fast_GET_ITEM(seq.get(), i);
    int waited = attr_true(e, s_compute_waited);
    if (waited < 0) return -1;
    if (waited) continue;
    open[i] = 1;
    seqs[i] = attr_long(e, s_h2d_seq);
    int m = of_point(e, first.get());
    if ((seqs[i] == -1 && PyErr_Occurred()) || m < 0) return -1;
    mine[i] = static_cast<char>(m);
  }
  bool split = true;
  Py_ssize_t latest = -1;
  for (int pass = 0; pass < 2 && latest < 0; ++pass) {  // the second pass: nothing but the first point's
    split = pass == 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (open[i] && !(split && mine[i]) && (latest < 0 || seqs[i] > seqs[latest])) latest = i;
    }
  }
  if (latest < 0) return 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (open[i] && (!split || seqs[i] <= seqs[latest]) &&
        setattr_fast(PySequence_Fast_GET_ITEM(seq.get(), i), s_compute_waited, Py_True) < 0)
      return -1;
  }
  PyObject* entry = PySequence_Fast_GET_ITEM(seq.get(), latest);
  Ref transport(getattr_fast(handler, s_transport));
  Ref event(transport ? getattr_fast(entry, s_h2d_event) : nullptr);
  Ref latest_seq(event ? getattr_fast(entry, s_h2d_seq) : nullptr);
  return latest_seq ? wait_reload(transport.get(), event.get(), latest_seq.get()) : -1;
}

// handler._upper_layer_done_first (prefetch.py): where the next group up is the first of a later layer whose prefetch
// is late and it is not done yet, it is done now, so that its late burst brings this layer back before this group
// reloads on its own (both hook the node that made the layer's output; pre-hooks run in the order they were added).
// 1: done, or nothing to do; 0: the Python method must run; -1: error set
int upper_layer_done_first(PyObject* handler, PyObject* group, int mode) {
  if (mode == kLayerMode) return 1;
  long index = attr_long(group, s_index);
  if (index == -1 && PyErr_Occurred()) return -1;
  if (index < 0) return 1;
  Ref groups(handler_groups(handler));
  if (!groups) return -1;
  if (index + 1 >= PyList_GET_SIZE(groups.get())) return 1;
  Ref upper(PySequence_GetItem(groups.get(), index + 1));
  long upper_layer = upper ? attr_long(upper.get(), s_layer) : -1;
  long layer = upper ? attr_long(group, s_layer) : -1;
  if (PyErr_Occurred()) return -1;
  if (upper_layer <= layer) return 1;
  int done = attr_true(upper.get(), s_done);
  if (done != 0) return done < 0 ? -1 : 1;
  int late = late_for(handler, mode, upper_layer);
  if (late <= 0) return late < 0 ? -1 : 1;
  return group_done_impl(handler, upper.get());
}

}  // namespace

// handler.on_group_commit_backward's common case: 1 done, 0 nothing done (the Python method must run), -1 error set
int commit_backward_impl(PyObject* handler, PyObject* group) {
  Ref manager(getattr_fast(handler, s_manager));
  if (!manager) return -1;
  int fast = commit_fast_path(handler, manager.get());
  int mode = fast > 0 ? prefetch_mode(manager.get()) : 0;
  if (fast < 0 || mode < 0) return -1;
  if (fast == 0) return 0;
  int upper = upper_layer_done_first(handler, group, mode);
  if (upper <= 0) return upper;
  // manager.on_backward, with no chain to close and no other chunk to flush: _forward_ended's layer count
  Ref layers(getattr_fast(handler, s_layers));
  int any = layers ? PyObject_IsTrue(layers.get()) : -1;
  if (any < 0) return -1;
  if (any) {
    Ref chunk_layers(getattr_fast(manager.get(), s_chunk_layers));
    Ref vp(chunk_layers ? getattr_fast(handler, s_vp_stage) : nullptr);
    if (!vp || PyObject_SetItem(chunk_layers.get(), vp.get(), layers.get()) < 0) return -1;
  }
  Ref entries(getattr_fast(group, s_entries));
  Ref parts(entries && PyList_Check(entries.get()) ? PyList_New(0) : nullptr);
  if (entries && !parts && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "group.entries must be a list");
  Ref runs(parts && append_parts(handler, group, entries.get(), parts.get()) == 0 ? PyList_AsTuple(parts.get())
                                                                                 : nullptr);
  if (!runs || reload_runs(handler, runs.get(), true) < 0 || wait_latest(handler, group, entries.get()) < 0 ||
      prefetch(handler, group, mode) < 0)
    return -1;
  long current = attr_long(handler, s_current_group);
  if ((current == -1 && PyErr_Occurred()) || set_long(handler, s_current_group, current > 1 ? current - 1 : 0) < 0)
    return -1;
  return release_refs(group);
}

// handler.on_group_backward_done's common case: 1 done (or the group was done already), 0 nothing done (the Python
// method must run), -1 error set
int group_done_impl(PyObject* handler, PyObject* group) {
  int done = attr_true(group, s_done);
  if (done != 0) return done < 0 ? -1 : 1;
  Ref manager(getattr_fast(handler, s_manager));
  Ref chain(manager ? getattr_fast(manager.get(), s_chain) : nullptr);
  if (!chain) return -1;
  if (chain.get() != Py_None) return 0;  // the method lets go of a broken chain's group
  if (setattr_fast(group, s_done, Py_True) < 0) return -1;
  Ref seq(attr_items(group, s_entries));
  if (!seq) return -1;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq.get()); ++i) {
    PyObject* e = PySequence_Fast_GET_ITEM(seq.get(), i);
    long users = attr_long(e, s_users);
    if ((users == -1 && PyErr_Occurred()) || set_long(e, s_users, users - 1) < 0) return -1;
    if (users - 1 == 0 && setattr_fast(e, s_device_storage, Py_None) < 0) return -1;
  }
  long index = attr_long(group, s_index);
  Ref groups(index == -1 && PyErr_Occurred() ? nullptr : getattr_fast(handler, s_groups));
  if (!groups) return -1;
  if (index >= 0) {  // one of handler.groups (a group that saved nothing was never committed there)
    if (add_to_attr(handler, s_groups_done, 1) < 0) return -1;
    if (index > 0) {
      Ref prev(PySequence_GetItem(groups.get(), index - 1));
      long prev_layer = prev ? attr_long(prev.get(), s_layer) : -1;
      long layer = prev ? attr_long(group, s_layer) : -1;
      if (PyErr_Occurred()) return -1;
      if (prev_layer < layer) {
        int mode = prefetch_mode(manager.get());
        int late = mode < 0 ? -1 : late_for(handler, mode, layer);
        if (late < 0) return -1;
        if (late) {
          Ref r(PyObject_CallMethodObjArgs(handler, s_prefetch_layer_below, group, nullptr));
          if (!r) return -1;
        }
      }
    }
  }
  long groups_done = attr_long(handler, s_groups_done);
  Py_ssize_t n = PyObject_Length(groups.get());  // only finish replaces handler.groups
  if (n < 0 || (groups_done == -1 && PyErr_Occurred())) return -1;
  if (groups_done == n) {
    Ref r(PyObject_CallMethodObjArgs(handler, s_finish, nullptr));
    if (!r) return -1;
  }
  return 1;
}

namespace {

// commit_backward(handler, group): handler.on_group_commit_backward; False (nothing done) where the Python method
// must run
PyObject* module_commit_backward(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *handler, *group;
  if (!PyArg_ParseTuple(args, "OO", &handler, &group)) return nullptr;
  int rc = commit_backward_impl(handler, group);
  if (rc < 0) return nullptr;
  return PyBool_FromLong(rc);
  END_HANDLE_TH_ERRORS
}

// group_done(handler, group): handler.on_group_backward_done; False (nothing done) where the Python method must run
PyObject* module_group_done(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *handler, *group;
  if (!PyArg_ParseTuple(args, "OO", &handler, &group)) return nullptr;
  int rc = group_done_impl(handler, group);
  if (rc < 0) return nullptr;
  return PyBool_FromLong(rc);
  END_HANDLE_TH_ERRORS
}

}  // namespace

bool backward_names_ready() {
  static const NameSlot names[] = {
      {&s_backward_started, "backward_started"}, {&s_manager, "manager"},
      {&s_pending, "pending"}, {&s_marks, "marks"},
      {&s_reload_layers, "reload_layers"}, {&s_prefetch, "prefetch"}, {&s_layers, "layers"},
      {&s_chunk_layers, "_chunk_layers"}, {&s_vp_stage, "vp_stage"}, {&s_entries, "entries"},
      {&s_transport, "transport"}, {&s_index, "index"}, {&s_layer, "layer"},
      {&s_groups, "groups"}, {&s_kept_on_device, "kept_on_device"}, {&s_done, "done"},
      {&s_reload_bursts, "reload_bursts"}, {&s_current_group, "current_group"}, {&s_groups_done, "groups_done"},
      {&s_late_method, "_late"}, {&s_prefetch_layer_below, "_prefetch_layer_below"}, {&s_finish, "finish"},
      {&s_split_chains, "split_chains"}};
  return intern_names(names, sizeof(names) / sizeof(names[0]));
}

PyMethodDef backward_methods[] = {
    {"commit_backward", module_commit_backward, METH_VARARGS,
     "commit_backward(handler, group): handler.on_group_commit_backward (False: the method must run)"},
    {"group_done", module_group_done, METH_VARARGS,
     "group_done(handler, group): handler.on_group_backward_done (False: the method must run)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
