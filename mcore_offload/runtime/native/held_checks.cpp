// The checks handler.flush makes on each storage before copying it (see __init__.py for why and how this is built):
//
//   covers                    saved.covers: whether the saved views of a storage cover enough of it to be worth moving
//   held_by_other_than_one    saved.held_by_other_than_one, and
//   held_by_other_than_many   saved.held_by_other_than_many: whether a tensor other than the saved ones (and their
//                             bases) keeps the storage, so that copying it would free nothing
//   held_elsewhere            the module's entry for the tests: saved.held_elsewhere with the two above
//
// Used by copy_out (copy_path.cpp); the answers are the Python ones (tests/test_native_copy_out.py compares them).

#include "common.h"

#include <utility>

namespace mco {

// A new reference to ref.tensor (nullptr without an error if it is None or unset, nullptr with one on failure)
PyObject* ref_tensor(PyObject* ref) {
  PyObject* t;
  if (Py_TYPE(ref) == &SavedRefType) {
    t = reinterpret_cast<SavedRef*>(ref)->tensor;
    Py_XINCREF(t);
  } else {
    t = get_attr(ref, MCO_NAME("tensor"));
    if (t == nullptr) return nullptr;
  }
  if (t == Py_None) Py_CLEAR(t);
  if (t != nullptr && !THPVariable_Check(t)) {
    Py_DECREF(t);
    PyErr_SetString(PyExc_TypeError, "a saved reference holds something other than a tensor");
    return nullptr;
  }
  return t;
}

// saved.covers: whether the distinct byte ranges the refs' views start at cover ``need`` bytes (-1: error)
int covers(PyObject* refs, double need) {
  std::vector<std::pair<int64_t, int64_t>> seen;
  double covered = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(refs); ++i) {
    PyObject* tensor = ref_tensor(PyList_GET_ITEM(refs, i));
    if (tensor == nullptr) {
      if (PyErr_Occurred()) return -1;
      continue;
    }
    const at::Tensor& t = THPVariable_Unpack(tensor);
    int64_t size = static_cast<int64_t>(t.element_size());
    std::pair<int64_t, int64_t> key{t.storage_offset() * size, t.numel() * size};
    Py_DECREF(tensor);
    bool known = false;
    for (const auto& k : seen) known = known || k == key;
    if (!known) {
      seen.push_back(key);
      covered += static_cast<double>(key.second);
      if (covered >= need) return 1;
    }
  }
  return 0;
}

// saved.held_by_other_than_one: whether a tensor other than the one saved view (and its base) holds the
// storage. The same counts: each threshold is the Python one less the references that code's own locals and
// getrefcount's argument add, plus the one this function holds. -1: error
int held_by_other_than_one(PyObject* st, PyObject* ref) {
  PyObject* tensor = ref_tensor(ref);
  if (tensor == nullptr) return PyErr_Occurred() ? -1 : 0;
  const at::Tensor& t = THPVariable_Unpack(tensor);
  bool view = t.is_view();
  // storage users: the saved tensor, its base if it is a view, and the storage object we hold
  int held = THPStorage_Unpack(st).use_count() > (view ? 3u : 2u);
  // Python references to the tensor: the SavedRef and ours
  if (!held) held = Py_REFCNT(tensor) > 2;
  if (!held && view) {
    PyObject* base = THPVariable_Wrap(t._base());
    if (base == nullptr) {
      held = -1;
    } else {
      held = Py_REFCNT(base) > 2;  // ours and the view's C++ side
      Py_DECREF(base);
    }
  }
  Py_DECREF(tensor);
  return held;
}

// saved.held_by_other_than_many: whether a tensor other than the saved views (and their bases) holds the storage,
// for a storage several saved references share (q, k and v of one projection; a grouped GEMM's split per expert).
// The same counts as the Python check, without its dicts: that function was a third of the flush's host time on
// C's grouped GEMMs (16 views a storage). Each distinct saved tensor and base is held once here (one reference of
// ours on top of what the Python check's thresholds leave out). -1: error
int held_by_other_than_many(PyObject* st, PyObject* refs) {
  struct Saved {
    PyObject* obj;                  // a reference of ours
    const c10::TensorImpl* impl;
    const c10::TensorImpl* base;    // its base's, or nullptr
    int64_t uses;                   // the saved references holding it
  };
  std::vector<Saved> tensors;       // distinct saved tensors
  std::vector<PyObject*> bases;     // distinct bases that are not saved tensors (a reference of ours each)
  std::vector<const c10::TensorImpl*> base_impls;
  int held = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(refs); ++i) {
    PyObject* t = ref_tensor(PyList_GET_ITEM(refs, i));  // a new reference
    if (t == nullptr) {
      if (PyErr_Occurred()) held = -1;
      continue;
    }
    bool known = false;
    for (auto& k : tensors) {
      if (k.obj == t) {
        ++k.uses;
        known = true;
        break;
      }
    }
    if (known) {
      Py_DECREF(t);
      continue;
    }
    const at::Tensor& v = THPVariable_Unpack(t);
    tensors.push_back({t, v.unsafeGetTensorImpl(), v.is_view() ? v._base().unsafeGetTensorImpl() : nullptr, 1});
  }
  // bases of the saved views: one that is itself a saved tensor counts once, and its Python object has one more
  // reference, the one the view's C++ side keeps alive (``uses``)
  for (size_t i = 0; held == 0 && i < tensors.size(); ++i) {
    const c10::TensorImpl* base = tensors[i].base;
    if (base == nullptr) continue;
    bool saved = false;
    for (auto& k : tensors) {
      if (k.impl == base) {
        saved = true;
        break;
      }
    }
    if (saved) continue;
    bool known = false;
    for (const c10::TensorImpl* b : base_impls) known = known || b == base;
    if (known) continue;
    PyObject* obj = THPVariable_Wrap(THPVariable_Unpack(tensors[i].obj)._base());
    if (obj == nullptr) {
      held = -1;
      break;
    }
    bases.push_back(obj);
    base_impls.push_back(base);
  }
  for (auto& k : tensors) {
    for (auto& v : tensors) {
      if (v.base == k.impl) {
        ++k.uses;
        break;
      }
    }
  }
  if (held == 0) {  // storage users: every distinct saved tensor and base, and the storage object we hold
    held = THPStorage_Unpack(st).use_count() > tensors.size() + bases.size() + 1;
  }
  for (size_t i = 0; held == 0 && i < tensors.size(); ++i) {
    held = Py_REFCNT(tensors[i].obj) - 1 > tensors[i].uses;  // less ours
  }
  for (size_t i = 0; held == 0 && i < bases.size(); ++i) {
    held = Py_REFCNT(bases[i]) > 2;  // ours and the views' C++ side; more: Python code still holds the base
  }
  for (auto& k : tensors) Py_DECREF(k.obj);
  for (PyObject* b : bases) Py_DECREF(b);
  return held;
}

namespace {

// held_elsewhere(storage, refs): saved.held_elsewhere with the checks above, for the tests (the same answers as the
// Python ones)
PyObject* module_held_elsewhere(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *st, *refs;
  if (!PyArg_ParseTuple(args, "OO!", &st, &PyList_Type, &refs)) return nullptr;
  if (!THPStorage_Check(st) || PyList_GET_SIZE(refs) == 0) {
    PyErr_SetString(PyExc_TypeError, "held_elsewhere takes an untyped storage and a non-empty list of saved references");
    return nullptr;
  }
  int held = PyList_GET_SIZE(refs) == 1 ? held_by_other_than_one(st, PyList_GET_ITEM(refs, 0))
                                        : held_by_other_than_many(st, refs);
  if (held < 0) return nullptr;
  return PyBool_FromLong(held);
  END_HANDLE_TH_ERRORS
}

}  // namespace

PyMethodDef held_check_methods[] = {
    {"held_elsewhere", module_held_elsewhere, METH_VARARGS, "held_elsewhere(storage, refs): saved.held_elsewhere"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
