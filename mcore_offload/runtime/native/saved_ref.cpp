// SavedRef, what the pack hook returns for an eligible tensor, as a C type (see __init__.py for why and how this is
// built): saved.SavedRef's tensor, group, point and entry as members, and the saved view's layout (dtype, offset,
// sizes, strides) kept as C++ values, which Python reads and writes as dtype / offset / size / stride (None until
// set). The struct is in common.h; the hooks that make and read it are hooks.cpp's, the copy-out's copy_path.cpp's.
// Apart from hooks.cpp so that each file holds one concept and stays under the project's ~500 lines. Also here:
// release_refs, a group letting go of its list of refs when backward reaches it (backward.cpp's commit_backward).

#include "common.h"

namespace mco {

PyMemberDef saved_ref_members[] = {
    {"tensor", T_OBJECT, offsetof(SavedRef, tensor), 0, nullptr},
    {"group", T_OBJECT, offsetof(SavedRef, group), 0, nullptr},
    {"point", T_OBJECT, offsetof(SavedRef, point), 0, nullptr},
    {"entry", T_OBJECT, offsetof(SavedRef, entry), 0, nullptr},
    {"unpacked", T_BOOL, offsetof(SavedRef, unpacked), 0, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyObject* int_tuple_of(c10::IntArrayRef values) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  for (size_t i = 0; out != nullptr && i < values.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (v == nullptr) {
      Py_CLEAR(out);
      break;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), v);
  }
  return out;
}

namespace {

// The layout's fields as Python sees them (saved.SavedRef's dtype, offset, size, stride): None until set; a set
// size or stride reads back as a tuple of ints, the dtype as the torch.dtype.
PyObject* saved_ref_get_dtype(SavedRef* self, void*) {
  if (!self->layout.has_dtype) Py_RETURN_NONE;
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(self->layout.dtype));
  Py_INCREF(dtype);
  return dtype;
}

PyObject* saved_ref_get_offset(SavedRef* self, void*) {
  if (!self->layout.has_offset) Py_RETURN_NONE;
  return PyLong_FromLongLong(self->layout.offset);
}

PyObject* saved_ref_get_size(SavedRef* self, void*) {
  if (!self->layout.has_size) Py_RETURN_NONE;
  return int_tuple_of(self->layout.sizes);
}

PyObject* saved_ref_get_stride(SavedRef* self, void*) {
  if (!self->layout.has_stride) Py_RETURN_NONE;
  return int_tuple_of(self->layout.strides);
}

bool refuse_delete(PyObject* value, const char* field) {
  if (value != nullptr) return false;
  PyErr_Format(PyExc_AttributeError, "SavedRef.%s cannot be deleted; set it to None instead", field);
  return true;
}

int saved_ref_set_dtype(SavedRef* self, PyObject* value, void*) {
  if (refuse_delete(value, "dtype")) return -1;
  if (value == Py_None) {
    self->layout.has_dtype = false;
    return 0;
  }
  if (!THPDtype_Check(value)) {
    PyErr_SetString(PyExc_TypeError, "SavedRef.dtype must be a torch.dtype or None");
    return -1;
  }
  self->layout.dtype = reinterpret_cast<THPDtype*>(value)->scalar_type;
  self->layout.has_dtype = true;
  return 0;
}

int saved_ref_set_offset(SavedRef* self, PyObject* value, void*) {
  if (refuse_delete(value, "offset")) return -1;
  if (value == Py_None) {
    self->layout.has_offset = false;
    return 0;
  }
  long long offset = PyLong_AsLongLong(value);
  if (offset == -1 && PyErr_Occurred()) return -1;
  self->layout.offset = offset;
  self->layout.has_offset = true;
  return 0;
}

// size or stride from a sequence of ints (torch.Size, a tuple, a list); unchanged on error
int set_dims(PyObject* value, const char* field, bool& has, at::DimVector& out) {
  if (refuse_delete(value, field)) return -1;
  if (value == Py_None) {
    has = false;
    return 0;
  }
  Ref seq(PySequence_Fast(value, "SavedRef.size and SavedRef.stride must be sequences of ints or None"));
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
  at::DimVector dims(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    dims[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq.get(), i));
    if (dims[i] == -1 && PyErr_Occurred()) return -1;
  }
  out = std::move(dims);
  has = true;
  return 0;
}

int saved_ref_set_size(SavedRef* self, PyObject* value, void*) {
  return set_dims(value, "size", self->layout.has_size, self->layout.sizes);
}

int saved_ref_set_stride(SavedRef* self, PyObject* value, void*) {
  return set_dims(value, "stride", self->layout.has_stride, self->layout.strides);
}

PyGetSetDef saved_ref_getset[] = {
    {"dtype", reinterpret_cast<getter>(saved_ref_get_dtype), reinterpret_cast<setter>(saved_ref_set_dtype), nullptr,
     nullptr},
    {"offset", reinterpret_cast<getter>(saved_ref_get_offset), reinterpret_cast<setter>(saved_ref_set_offset),
     nullptr, nullptr},
    {"size", reinterpret_cast<getter>(saved_ref_get_size), reinterpret_cast<setter>(saved_ref_set_size), nullptr,
     nullptr},
    {"stride", reinterpret_cast<getter>(saved_ref_get_stride), reinterpret_cast<setter>(saved_ref_set_stride),
     nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

}  // namespace

int saved_ref_traverse(SavedRef* self, visitproc visit, void* arg) {
  Py_VISIT(self->tensor);
  Py_VISIT(self->group);
  Py_VISIT(self->point);
  Py_VISIT(self->entry);
  return 0;
}

int saved_ref_clear(SavedRef* self) {
  Py_CLEAR(self->tensor);
  Py_CLEAR(self->group);
  Py_CLEAR(self->point);
  Py_CLEAR(self->entry);
  return 0;
}

void saved_ref_dealloc(SavedRef* self) {
  PyObject_GC_UnTrack(self);
  if (self->weakreflist != nullptr) PyObject_ClearWeakRefs(reinterpret_cast<PyObject*>(self));
  saved_ref_clear(self);
  self->layout.~ViewLayout();
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyTypeObject SavedRefType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* new_saved_ref(PyObject* tensor, PyObject* group, PyObject* point) {
  SavedRef* ref = PyObject_GC_New(SavedRef, &SavedRefType);
  if (ref == nullptr) return nullptr;
  Py_INCREF(tensor);
  Py_INCREF(group);
  Py_INCREF(point);
  ref->tensor = tensor;
  ref->group = group;
  ref->point = point;
  ref->entry = nullptr;
  ref->unpacked = 0;
  ref->weakreflist = nullptr;
  new (&ref->layout) ViewLayout();  // PyObject_GC_New does not construct C++ members
  PyObject_GC_Track(ref);
  return reinterpret_cast<PyObject*>(ref);
}

// SavedRef(tensor, group, point), as saved.SavedRef
PyObject* saved_ref_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"tensor", "group", "point", nullptr};
  PyObject *tensor, *group, *point;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO", const_cast<char**>(names), &tensor, &group, &point))
    return nullptr;
  return new_saved_ref(tensor, group, point);
}

// handler._release_refs: the group's list of saved refs emptied, a weak reference to each that still holds its
// tensor added to group.let_go (1, or -1 with an error set)
int release_refs(PyObject* group) {
  Ref refs(getattr_fast(group, s_refs));
  Ref let_go(refs ? getattr_fast(group, s_let_go) : nullptr);
  if (!let_go) return -1;
  if (!PyList_Check(refs.get()) || !PyList_Check(let_go.get())) {
    PyErr_SetString(PyExc_TypeError, "group.refs and group.let_go must be lists");
    return -1;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(refs.get()); ++i) {
    PyObject* ref = PyList_GET_ITEM(refs.get(), i);
    bool native = Py_TYPE(ref) == &SavedRefType;
    Ref tensor(native ? nullptr : get_attr(ref, MCO_NAME("tensor")));  // a Python SavedRef's
    if (!native && !tensor) return -1;
    PyObject* held = native ? reinterpret_cast<SavedRef*>(ref)->tensor : tensor.get();
    if (held == nullptr || held == Py_None) continue;
    Ref weak(PyWeakref_NewRef(ref, nullptr));
    if (!weak || PyList_Append(let_go.get(), weak.get()) < 0) return -1;
  }
  return PyList_SetSlice(refs.get(), 0, PY_SSIZE_T_MAX, nullptr) == 0 ? 1 : -1;
}

// SavedRefType filled in, readied and added to the module as "SavedRef" (hook_types_ready calls this once)
bool saved_ref_type_ready(PyObject* module) {
  SavedRefType.tp_name = "mcore_offload_native.SavedRef";
  SavedRefType.tp_basicsize = sizeof(SavedRef);
  SavedRefType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  SavedRefType.tp_doc = "What the pack hook returns for an eligible tensor (see saved.SavedRef).";
  SavedRefType.tp_new = saved_ref_new;
  SavedRefType.tp_dealloc = reinterpret_cast<destructor>(saved_ref_dealloc);
  SavedRefType.tp_traverse = reinterpret_cast<traverseproc>(saved_ref_traverse);
  SavedRefType.tp_clear = reinterpret_cast<inquiry>(saved_ref_clear);
  SavedRefType.tp_members = saved_ref_members;
  SavedRefType.tp_weaklistoffset = offsetof(SavedRef, weakreflist);
  SavedRefType.tp_getset = saved_ref_getset;
  return PyType_Ready(&SavedRefType) == 0 &&
         PyModule_AddObjectRef(module, "SavedRef", reinterpret_cast<PyObject*>(&SavedRefType)) == 0;
}

}  // namespace mco
