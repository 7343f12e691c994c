// The offload points' forward glue in C++ (see __init__.py for why and how this is built): points.offload's decision,
// _OffloadBlock's entry and exit and points.commit's work, for the common case only: a point of the forward chunk's
// own config without auto, on a plain torch.Tensor. Every other case goes back to the Python functions (offload_block
// answers None, commit_point NotImplemented, before changing anything), so the two paths cannot disagree.
//
//   offload_block(manager, name, config, tensor)   a Block (the context of the point: on, or a passthrough when off
//                                                  for this chunk now), or None where points.offload must decide
//   Block.__enter__ / __exit__                     _OffloadBlock's: the group opened or joined, the start hook on the
//                                                  input's node (node_hooks.cpp's GroupHook), the saved-tensor hooks
//                                                  pushed and popped, the group registered as open
//   commit_point(manager, opened, name, config, value)
//                                                  points.commit once manager.open_groups had an entry for ``name``:
//                                                  the chain left open for the next point, or the group queued and
//                                                  the commit hook on the output's node; NotImplemented: the Python
//                                                  function must decide
//
// Why: A's three points cost about 33 µs of Python a layer and microbatch on the development machine (six calls, three
// context objects, a dozen clock reads), of which the group, the hooks and their registration are about 11; the rest
// is interpreter work that a launch-bound step pays in full. Uncommon moves stay in Python and are called from here:
// handler.open_group (a Group is a Python dataclass), on_group_commit_forward, close_chain, GroupStart's and
// GroupCommit's identity nodes for a tensor without a node, and the log line of a point that saved nothing.
// tests/test_native_points.py runs training steps through both paths and compares groups, counters, losses, grads.

#include "common.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/graph_task.h>

namespace mco {

PyObject* s_summary;
PyObject* s_on_group_backward_done;
PyObject* s_on_group_commit_backward;

namespace {

PyObject* s_config;
PyObject* s_auto;
PyObject* s_enabled_points;
PyObject* s_close_chain;
PyObject* s_open_group;
PyObject* s_node_hooks;
PyObject* s_rejected;
PyObject* s_open_groups;
PyObject* s_announced_points;
PyObject* s_chaining;
PyObject* s_chain_next;
PyObject* s_on_group_commit_forward;
PyObject* s_push_hooks;
PyObject* s_pop_hooks;

// points.py's callables this file hands uncommon moves to, read at the first use (process-wide facts of
// imported modules, like module.cpp's allocators: no reset). The saved-tensor hooks are pushed and popped through
// points._push_hooks / _pop_hooks, read at each use: the Python block's way (None: this torch lacks them, and
// offload_block leaves the block to Python, which has the context-manager fallback), and what tests wrap.
struct PointCalls {
  PyObject* points = nullptr;         // the module mcore_offload.runtime.points
  PyObject* start_node = nullptr;     // points._start: GroupStart's identity node, for an input without a node
  PyObject* commit_node = nullptr;    // points._commit_node: GroupCommit's, for an output without one
  PyObject* saved_nothing = nullptr;  // points._saved_nothing: the log line of a point that offloaded nothing
  bool ready = false;
};
PointCalls g_calls;

PyObject* attr_or_none(PyObject* obj, const char* name) {
  if (obj == nullptr) return nullptr;
  PyObject* name_obj = PyUnicode_FromString(name);
  if (name_obj == nullptr) return nullptr;
  PyObject* out = lookup_attr(obj, name_obj);
  Py_DECREF(name_obj);
  return out;
}

bool calls_ready() {
  if (g_calls.ready) return true;
  Ref points(PyImport_ImportModule("mcore_offload.runtime.points"));
  if (!points) return false;
  Py_INCREF(points.get());
  Py_XSETREF(g_calls.points, points.get());
  PyObject** slots[] = {&g_calls.start_node, &g_calls.commit_node, &g_calls.saved_nothing};
  const char* names[] = {"_start", "_commit_node", "_saved_nothing"};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); ++i) {
    PyObject* v = attr_or_none(points.get(), names[i]);
    if (v == nullptr) return false;
    Py_XSETREF(*slots[i], v);
  }
  g_calls.ready = true;
  return true;
}

// enabled.in_backward(): the autograd engine runs a backward (1), not (0). The C++ function behind
// torch._C._current_graph_task_id, called directly instead of through that Python function (a call and an int at
// every point that is on, twice a point)
int in_backward() { return torch::autograd::get_current_graph_task_id() != -1; }

// name in handler.enabled_points and grad mode on and no backward running: handler_for's answer for the forward
// chunk's own config without auto (1 on, 0 off, -1 error)
int point_on(PyObject* handler, PyObject* name) {
  Ref enabled(getattr_fast(handler, s_enabled_points));
  if (!enabled) return -1;
  int in = PySequence_Contains(enabled.get(), name);
  if (in <= 0) return in;
  return c10::GradMode::is_enabled() && !in_backward();
}

// ns more on manager.summary's clock (add_runtime; -1: error)
int add_manager_runtime(PyObject* manager, int64_t ns) {
  Ref summary(getattr_fast(manager, s_summary));
  return summary ? add_runtime(summary.get(), ns) : -1;
}

// ------------------------------------------------------------------------------------------------------- Block
// points._OffloadBlock (handler set) or points._Passthrough (handler nullptr)
struct Block {
  PyObject_HEAD
  PyObject* manager;
  PyObject* handler;
  PyObject* name;
  PyObject* tensor;  // the input until __enter__ hands it on (the block does not keep it alive)
  PyObject* group;   // the joined chain's group, or the one __enter__ opened
  PyObject* rejected_before;  // a copy of group.rejected at entry where it had entries, else nullptr
  Py_ssize_t refs_before;
  long long parameters_before;
};

void block_dealloc(Block* self) {
  Py_XDECREF(self->manager);
  Py_XDECREF(self->handler);
  Py_XDECREF(self->name);
  Py_XDECREF(self->tensor);
  Py_XDECREF(self->group);
  Py_XDECREF(self->rejected_before);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyTypeObject BlockType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// A new Block; references to every argument but nullptr ones (nullptr: error)
PyObject* new_block(PyObject* manager, PyObject* handler, PyObject* name, PyObject* tensor, PyObject* joined) {
  Block* self = PyObject_New(Block, &BlockType);
  if (self == nullptr) return nullptr;
  PyObject* fields[] = {manager, handler, name, tensor, joined};
  for (PyObject* f : fields) Py_XINCREF(f);
  self->manager = manager;
  self->handler = handler;
  self->name = name;
  self->tensor = tensor;
  self->group = joined;
  self->rejected_before = nullptr;
  self->refs_before = 0;
  self->parameters_before = 0;
  return reinterpret_cast<PyObject*>(self);
}

// The group's state at entry (what _OffloadBlock keeps to tell, at exit, whether the block saved anything)
int note_group_state(Block* self) {
  Ref refs(getattr_fast(self->group, s_refs));
  Ref rejected(refs ? getattr_fast(self->group, s_rejected) : nullptr);
  if (!rejected) return -1;
  self->refs_before = PyObject_Length(refs.get());
  if (self->refs_before < 0) return -1;
  int any = PyObject_IsTrue(rejected.get());
  if (any < 0) return -1;
  if (any) {
    PyObject* copy = PyDict_Check(rejected.get()) ? PyDict_Copy(rejected.get()) : nullptr;
    if (copy == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "mcore-offload: group.rejected must be a dict");
      return -1;
    }
    Py_XSETREF(self->rejected_before, copy);
  }
  Ref parameters(getattr_fast(self->group, s_parameters));
  if (!parameters) return -1;
  self->parameters_before = PyLong_AsLongLong(parameters.get());
  return self->parameters_before == -1 && PyErr_Occurred() ? -1 : 0;
}

PyObject* block_enter(PyObject* obj, PyObject*) {
  HANDLE_TH_ERRORS
  Block* self = reinterpret_cast<Block*>(obj);
  if (self->tensor == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "mcore-offload: an offload block was entered twice");
    return nullptr;
  }
  Ref tensor(self->tensor);  // the block lets go of its input here
  self->tensor = nullptr;
  if (self->handler == nullptr) {  // a point that is off: the tensor through, unchanged
    Py_INCREF(tensor.get());
    return tensor.get();
  }
  int64_t t0 = now_ns();
  if (self->group == nullptr) {
    self->group = PyObject_CallMethodObjArgs(self->handler, s_open_group, self->name, nullptr);
    if (self->group == nullptr) return nullptr;
    if (THPVariable_Unpack(tensor.get()).requires_grad()) {
      int node_hooks = attr_true(self->manager, s_node_hooks);
      if (node_hooks < 0) return nullptr;
      if (!node_hooks ||
          !add_group_hook(THPVariable_Unpack(tensor.get()), kGroupStart, self->handler, self->group)) {
        // a leaf has no node to hook: an identity node of our own
        tensor.reset(PyObject_CallFunctionObjArgs(g_calls.start_node, tensor.get(), self->handler, self->group,
                                                  nullptr));
        if (!tensor) return nullptr;
      }
    }
  } else {
    // a point once per group: an expert loop's group is joined by every expert's points (points.expert_loop)
    Ref points(getattr_fast(self->group, s_points));
    int listed = points ? PySequence_Contains(points.get(), self->name) : -1;
    if (listed < 0 || (!listed && PyList_Append(points.get(), self->name) < 0)) return nullptr;
  }
  if (note_group_state(self) < 0) return nullptr;
  PyObject *pack_hook = nullptr, *unpack_hook = nullptr;
  bool made = make_hooks(self->handler, self->group, self->name, &pack_hook, &unpack_hook);
  Ref pack(pack_hook), unpack(unpack_hook);
  Ref push(made ? getattr_fast(g_calls.points, s_push_hooks) : nullptr);
  Ref pushed(push ? PyObject_CallFunctionObjArgs(push.get(), pack.get(), unpack.get(), nullptr) : nullptr);
  if (!pushed || add_manager_runtime(self->manager, now_ns() - t0) < 0) return nullptr;
  Py_INCREF(tensor.get());
  return tensor.get();
  END_HANDLE_TH_ERRORS
}

PyObject* block_exit(PyObject* obj, PyObject* args) {
  HANDLE_TH_ERRORS
  Block* self = reinterpret_cast<Block*>(obj);
  PyObject *exc_type, *exc, *tb;
  if (!PyArg_ParseTuple(args, "OOO", &exc_type, &exc, &tb)) return nullptr;
  if (self->handler == nullptr || self->group == nullptr) Py_RETURN_NONE;
  int64_t t0 = now_ns();
  Ref pop(getattr_fast(g_calls.points, s_pop_hooks));
  Ref popped(pop ? PyObject_CallNoArgs(pop.get()) : nullptr);
  if (!popped) return nullptr;
  if (exc_type == Py_None) {  // a block that raised leaves its group uncommitted (finish() cuts it loose)
    Ref open_groups(getattr_fast(self->manager, s_open_groups));
    Ref opened(open_groups ? PyTuple_Pack(2, self->handler, self->group) : nullptr);
    if (!opened || PyObject_SetItem(open_groups.get(), self->name, opened.get()) < 0) return nullptr;
    Ref refs(getattr_fast(self->group, s_refs));
    Py_ssize_t n = refs ? PyObject_Length(refs.get()) : -1;
    if (n < 0) return nullptr;
    if (n == self->refs_before) {  // saved nothing to offload: its log line, written once (then nothing to build)
      Ref announced(getattr_fast(self->manager, s_announced_points));
      int known = announced ? PySequence_Contains(announced.get(), self->name) : -1;
      if (known < 0) return nullptr;
      if (!known) {
        Ref before(self->rejected_before != nullptr ? (Py_INCREF(self->rejected_before), self->rejected_before)
                                                    : PyDict_New());
        Ref parameters(before ? PyLong_FromLongLong(self->parameters_before) : nullptr);
        Ref r(parameters ? PyObject_CallFunctionObjArgs(g_calls.saved_nothing, self->manager, self->name,
                                                        self->group, before.get(), parameters.get(), nullptr)
                         : nullptr);
        if (!r) return nullptr;
      }
    }
  }
  if (add_manager_runtime(self->manager, now_ns() - t0) < 0) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef block_methods[] = {{"__enter__", block_enter, METH_NOARGS, "the point's input, its hooks pushed"},
                               {"__exit__", block_exit, METH_VARARGS, "the hooks popped, the group open"},
                               {nullptr, nullptr, 0, nullptr}};

// ---------------------------------------------------------------------------------------------------- offload
// offload_block(manager, name, config, tensor): points.offload past its first test (the manager has a forward
// handler); None where the Python function must decide
PyObject* module_offload_block(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "offload_block(manager, name, config, tensor)");
    return nullptr;
  }
  PyObject *manager = args[0], *name = args[1], *config = args[2], *tensor = args[3];
  if (!calls_ready()) return nullptr;
  if (reinterpret_cast<PyObject*>(Py_TYPE(tensor)) != g_tensor_type) Py_RETURN_NONE;  // a subclass: the Python block
  Ref forward(getattr_fast(manager, s_forward_handler));
  Ref own(forward && forward.get() != Py_None ? getattr_fast(forward.get(), s_config) : nullptr);
  Ref autoplan(own ? getattr_fast(manager, s_auto) : nullptr);
  if (!autoplan) return PyErr_Occurred() ? nullptr : (Py_INCREF(Py_None), Py_None);
  if (own.get() != config || autoplan.get() != Py_None) Py_RETURN_NONE;
  int on = point_on(forward.get(), name);
  if (on < 0) return nullptr;
  if (!on) return new_block(manager, nullptr, name, tensor, nullptr);
  // read for a point that is on only (two reads less at each point that is off: attn_norm and mlp_norm, say)
  Ref push(getattr_fast(g_calls.points, s_push_hooks));
  Ref pop(push ? getattr_fast(g_calls.points, s_pop_hooks) : nullptr);
  if (!pop) return nullptr;
  if (push.get() == Py_None || pop.get() == Py_None) Py_RETURN_NONE;  // the context-manager fallback: Python's
  Ref chain(getattr_fast(manager, s_chain));
  if (!chain) return nullptr;
  PyObject* joined = nullptr;  // borrowed from ``chain``
  if (chain.get() != Py_None) {
    bool continues = PyTuple_Check(chain.get()) && PyTuple_GET_SIZE(chain.get()) == 3 &&
                     PyTuple_GET_ITEM(chain.get(), 0) == forward.get();
    int same = continues ? PyObject_RichCompareBool(PyTuple_GET_ITEM(chain.get(), 2), name, Py_EQ) : 0;
    if (same < 0) return nullptr;
    if (same) {  // the previous point left its group open for this one
      joined = PyTuple_GET_ITEM(chain.get(), 1);
      if (setattr_fast(manager, s_chain, Py_None) < 0) return nullptr;
    } else {
      Ref r(PyObject_CallMethodObjArgs(manager, s_close_chain, nullptr));
      if (!r) return nullptr;
    }
  }
  return new_block(manager, forward.get(), name, tensor, joined);
  END_HANDLE_TH_ERRORS
}

// ----------------------------------------------------------------------------------------------------- commit
// handler.on_group_commit_forward(group) without its Python frame: the group is committed and, if it saved something
// to offload, queued for the next flush (a new reference to None; nullptr: error set)
PyObject* commit_forward(PyObject* handler, PyObject* group) {
  int committed = attr_true(group, MCO_NAME("committed"));
  int finished = committed == 0 ? attr_true(handler, s_finished) : 0;
  if (committed < 0 || finished < 0) return nullptr;
  if (committed || finished) Py_RETURN_NONE;
  if (set_attr(group, MCO_NAME("committed"), Py_True) < 0) return nullptr;
  int saved = attr_true(group, MCO_NAME("refs"));
  if (saved < 0) return nullptr;
  if (saved) {
    Ref groups(get_attr(handler, MCO_NAME("groups")));
    Ref pending(groups ? get_attr(handler, MCO_NAME("pending")) : nullptr);
    if (!pending) return nullptr;
    Py_ssize_t count = PyObject_Size(groups.get());
    Ref index(count >= 0 ? PyLong_FromSsize_t(count) : nullptr);
    if (!index || set_attr(group, MCO_NAME("index"), index.get()) < 0 || PyList_Append(groups.get(), group) < 0 ||
        PyList_Append(pending.get(), group) < 0)
      return nullptr;
  }
  if (add_to_attr(handler, MCO_NAME("current_group"), 1) < 0) return nullptr;
  Py_RETURN_NONE;
}


// The point's output with its group queued (points._commit past the chain test; a new reference, nullptr: error)
PyObject* commit_group(PyObject* manager, PyObject* handler, PyObject* group, PyObject* value) {
  bool is_sequence = PyTuple_CheckExact(value) || PyList_CheckExact(value);
  PyObject* first = is_sequence ? (PySequence_Fast_GET_SIZE(value) > 0 ? PySequence_Fast_GET_ITEM(value, 0)
                                                                        : nullptr)
                                : value;
  if (first == nullptr) {
    PyErr_SetString(PyExc_IndexError, "mcore-offload: commit() of an empty tuple or list");
    return nullptr;
  }
  Ref out;  // the first item's replacement, where an identity node of ours made one
  if (THPVariable_Check(first) && THPVariable_Unpack(first).requires_grad()) {
    int node_hooks = attr_true(manager, s_node_hooks);
    if (node_hooks < 0) return nullptr;
    const at::Tensor& t = THPVariable_Unpack(first);
    if (node_hooks && t.grad_fn()) {
      Ref r(commit_forward(handler, group));
      if (!r) return nullptr;
      add_group_hook(t, kGroupCommit, handler, group);
    } else {
      out.reset(PyObject_CallFunctionObjArgs(g_calls.commit_node, first, handler, group, nullptr));
      if (!out) return nullptr;
    }
  } else {  // nothing for backward to hook: the group is still queued for offload
    Ref r(commit_forward(handler, group));
    if (!r) return nullptr;
  }
  if (!out) {
    Py_INCREF(value);
    return value;
  }
  if (!is_sequence) {
    Py_INCREF(out.get());
    return out.get();
  }
  // type(value)((tensor, *value[1:]))
  Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
  PyObject* copy = PyTuple_CheckExact(value) ? PyTuple_New(n) : PyList_New(n);
  if (copy == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = i == 0 ? out.get() : PySequence_Fast_GET_ITEM(value, i);
    Py_INCREF(item);
    if (PyTuple_CheckExact(value)) PyTuple_SET_ITEM(copy, i, item);
    else PyList_SET_ITEM(copy, i, item);
  }
  return copy;
}

// commit_point(manager, opened, name, config, value): points.commit once ``opened`` = manager.open_groups[name];
// NotImplemented where the Python function must decide
PyObject* module_commit_point(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "commit_point(manager, opened, name, config, value)");
    return nullptr;
  }
  PyObject *manager = args[0], *opened = args[1], *name = args[2], *config = args[3], *value = args[4];
  if (!calls_ready()) return nullptr;
  bool plain = PyTuple_CheckExact(value) || PyList_CheckExact(value) ||
               !(PyTuple_Check(value) || PyList_Check(value));  // a tuple or list subclass: the Python function
  if (!plain || !PyTuple_Check(opened) || PyTuple_GET_SIZE(opened) != 2) Py_RETURN_NOTIMPLEMENTED;
  PyObject* handler = PyTuple_GET_ITEM(opened, 0);
  PyObject* group = PyTuple_GET_ITEM(opened, 1);
  Ref forward(getattr_fast(manager, s_forward_handler));
  Ref own(forward ? getattr_fast(handler, s_config) : nullptr);
  Ref autoplan(own ? getattr_fast(manager, s_auto) : nullptr);
  if (!autoplan) return nullptr;
  if (forward.get() != handler || own.get() != config || autoplan.get() != Py_None) Py_RETURN_NOTIMPLEMENTED;
  int on = point_on(handler, name);
  if (on < 0) return nullptr;
  if (!on) {
    Py_INCREF(value);
    return value;
  }
  int64_t t0 = now_ns();
  Py_INCREF(opened);  // the entry goes from open_groups below; ``opened`` stays alive until the end here
  Ref keep_opened(opened);
  Ref open_groups(getattr_fast(manager, s_open_groups));
  if (!open_groups || PyObject_DelItem(open_groups.get(), name) < 0) return nullptr;
  // manager.chain_next: points.CHAIN_NEXT, or an expert loop's (points.expert_loop)
  Ref chain_next(getattr_fast(manager, s_chain_next));
  if (!chain_next) return nullptr;
  if (!PyDict_Check(chain_next.get())) {
    PyErr_SetString(PyExc_TypeError, "mcore-offload: manager.chain_next must be a dict");
    return nullptr;
  }
  PyObject* follower = PyDict_GetItemWithError(chain_next.get(), name);  // borrowed
  if (follower == nullptr && PyErr_Occurred()) return nullptr;
  PyObject* result = nullptr;
  if (follower != nullptr) {
    int chaining = attr_true(manager, s_chaining);
    int next_on = 0;
    if (chaining > 0) {
      Ref enabled(getattr_fast(handler, s_enabled_points));
      next_on = enabled ? PySequence_Contains(enabled.get(), follower) : -1;
    }
    if (chaining < 0 || next_on < 0) return nullptr;
    if (next_on) {
      // The next point of this layer is on too: it joins this group (points._commit says why)
      Ref chain(PyTuple_Pack(3, handler, group, follower));
      if (!chain || setattr_fast(manager, s_chain, chain.get()) < 0) return nullptr;
      Py_INCREF(value);
      result = value;
    }
  }
  if (result == nullptr) result = commit_group(manager, handler, group, value);
  if (result != nullptr && add_manager_runtime(manager, now_ns() - t0) < 0) Py_CLEAR(result);
  return result;
  END_HANDLE_TH_ERRORS
}

}  // namespace

int backward_running() { return in_backward(); }

PyMethodDef point_methods[] = {
    {"offload_block", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(module_offload_block)),
     METH_FASTCALL, "offload_block(manager, name, config, tensor): a Block, or None where points.offload decides"},
    {"commit_point", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(module_commit_point)),
     METH_FASTCALL, "commit_point(manager, opened, name, config, value): points.commit's work, or NotImplemented"},
    {nullptr, nullptr, 0, nullptr}};

bool point_types_ready(PyObject* module) {
  static const NameSlot names[] = {
      {&s_summary, "summary"}, {&s_on_group_backward_done, "on_group_backward_done"},
      {&s_on_group_commit_backward, "on_group_commit_backward"},
      {&s_config, "config"}, {&s_auto, "auto"}, {&s_enabled_points, "enabled_points"},
      {&s_close_chain, "close_chain"}, {&s_open_group, "open_group"}, {&s_node_hooks, "node_hooks"},
      {&s_rejected, "rejected"}, {&s_open_groups, "open_groups"},
      {&s_announced_points, "announced_points"}, {&s_chaining, "chaining"}, {&s_chain_next, "chain_next"},
      {&s_on_group_commit_forward, "on_group_commit_forward"},
      {&s_push_hooks, "_push_hooks"}, {&s_pop_hooks, "_pop_hooks"}};
  if (!intern_names(names, sizeof(names) / sizeof(names[0]))) return false;
  BlockType.tp_name = "mcore_offload_native.Block";
  BlockType.tp_basicsize = sizeof(Block);
  BlockType.tp_flags = Py_TPFLAGS_DEFAULT;
  BlockType.tp_doc = "The context of an offload point (points._OffloadBlock, or a passthrough where it is off).";
  BlockType.tp_dealloc = reinterpret_cast<destructor>(block_dealloc);
  BlockType.tp_methods = block_methods;
  return PyType_Ready(&BlockType) == 0 &&
         PyModule_AddObjectRef(module, "Block", reinterpret_cast<PyObject*>(&BlockType)) == 0;
}

}  // namespace mco
