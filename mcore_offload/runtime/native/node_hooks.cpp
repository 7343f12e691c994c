// The group start and commit hooks on existing autograd nodes (points.py: StartHook, CommitHook), registered in C++.
//
// Why: Python's Node.register_prehook builds a RemovableHandle (a weak reference, a dict entry, an id) that we never
// use, and calls each hook with a tuple of wrapped gradient tensors that our hooks ignore: 3-5 µs a registration, two
// registrations per group, on the launch-bound path. Node::add_pre_hook with a small C++ hook does the same job: the
// engine runs a node's pre-hooks before the node, whatever registered them. The hook holds the GIL only while it calls
// the Python callable, as PyTorch's own Python pre-hooks do. Unlike those, it does not take part in compiled autograd
// (torch.compile of the backward: a C++ hook without compiled_args fails there), under which the runtime has never
// been tested; MCORE_OFFLOAD_NATIVE=0 keeps the Python registration. See __init__.py for why and how this is built.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include "common.h"

namespace mco {

namespace {

// Calls ``fn(None)`` before the node runs and passes the gradients through unchanged (returns them as they came).
struct CallBeforeNode : torch::autograd::FunctionPreHook {
  explicit CallBeforeNode(PyObject* fn) : fn_(fn) { Py_INCREF(fn_); }

  ~CallBeforeNode() override {
    // Nodes die on whichever thread drops the graph (the engine's, in backward): take the GIL to release ``fn``.
    if (Py_IsInitialized()) {
      PyGILState_STATE state = PyGILState_Ensure();
      Py_DECREF(fn_);
      PyGILState_Release(state);
    }
  }

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    PyGILState_STATE state = PyGILState_Ensure();
    PyObject* out = PyObject_CallOneArg(fn_, Py_None);
    if (out == nullptr) {
      // The Python error becomes the backward's exception, as for a failing Python hook.
      python_error err;
      err.persist();
      PyGILState_Release(state);
      throw err;
    }
    Py_DECREF(out);
    PyGILState_Release(state);
    return grads;
  }

  PyObject* fn_;
};

// A group's start or commit hook whole in C++ (points_block.cpp registers it): points.StartHook / CommitHook without
// their Python frames and the handler method's in front of backward.cpp's common case, which the hook calls directly;
// where that answers "the method must run", the handler's Python method runs, as the Python hooks do.
struct GroupHook : torch::autograd::FunctionPreHook {
  GroupHook(GroupHookKind kind, PyObject* handler, PyObject* group) : kind_(kind), handler_(handler), group_(group) {
    Py_INCREF(handler_);
    Py_INCREF(group_);
  }

  ~GroupHook() override {
    if (Py_IsInitialized()) {  // see CallBeforeNode
      PyGILState_STATE state = PyGILState_Ensure();
      Py_DECREF(handler_);
      Py_DECREF(group_);
      PyGILState_Release(state);
    }
  }

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    PyGILState_STATE state = PyGILState_Ensure();
    int64_t t0 = now_ns();
    int rc = run();
    if (rc == 0) {  // the Python method decides (it asks backward.cpp again, and takes the uncommon case itself)
      PyObject* out = PyObject_CallMethodObjArgs(
          handler_, kind_ == kGroupStart ? s_on_group_backward_done : s_on_group_commit_backward, group_, nullptr);
      rc = out == nullptr ? -1 : 1;
      Py_XDECREF(out);
    }
    if (rc > 0) {
      Ref summary(getattr_fast(handler_, s_summary));
      rc = summary && add_runtime(summary.get(), now_ns() - t0) == 0 ? 1 : -1;
    }
    if (rc < 0) {
      python_error err;
      err.persist();
      PyGILState_Release(state);
      throw err;
    }
    PyGILState_Release(state);
    return grads;
  }

  // 1 done, 0 the handler's method must run, -1 error set
  int run() {
    if (kind_ == kGroupStart) return group_done_impl(handler_, group_);
    // on_group_commit_backward: nothing once the handler has finished (an aborted step's leftovers)
    int done = attr_true(handler_, s_finished);
    if (done != 0) return done < 0 ? -1 : 1;
    return commit_backward_impl(handler_, group_);
  }

  GroupHookKind kind_;
  PyObject* handler_;
  PyObject* group_;
};

// add_prehook(tensor, fn): before the backward of the node that made ``tensor``, call ``fn(None)``. False where the
// tensor has no such node (a leaf, or no grad): the caller then uses an identity node of its own.
PyObject* module_add_prehook(PyObject*, PyObject* args) {
  PyObject *tensor, *fn;
  if (!PyArg_ParseTuple(args, "OO", &tensor, &fn)) return nullptr;
  if (!THPVariable_Check(tensor)) {
    PyErr_SetString(PyExc_TypeError, "add_prehook(tensor, fn) takes a tensor");
    return nullptr;
  }
  if (!PyCallable_Check(fn)) {
    PyErr_SetString(PyExc_TypeError, "add_prehook(tensor, fn): fn must be callable");
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(tensor);
  const auto& node = t.grad_fn();  // shared_ptr or intrusive_ptr, by torch version
  if (!node) Py_RETURN_FALSE;
  node->add_pre_hook(std::make_unique<CallBeforeNode>(fn));
  Py_RETURN_TRUE;
}

}  // namespace

bool add_group_hook(const at::Tensor& tensor, GroupHookKind kind, PyObject* handler, PyObject* group) {
  const auto& node = tensor.grad_fn();
  if (!node) return false;
  node->add_pre_hook(std::make_unique<GroupHook>(kind, handler, group));
  return true;
}

PyMethodDef node_hook_methods[] = {
    {"add_prehook", module_add_prehook, METH_VARARGS,
     "add_prehook(tensor, fn): fn(None) runs before the backward of tensor's grad_fn; False if it has none"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
