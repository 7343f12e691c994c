// The saved-tensor hooks of an offload point, in C++ (see __init__.py for why and how this is built).
//
// Three types, each doing exactly what its Python counterpart in runtime/handler.py, runtime/saved.py or
// runtime/points.py does for the common case, and handing every other case to that Python code, so that the two paths
// cannot disagree:
//
//   SavedRef  what the pack hook returns for an eligible tensor (saved.SavedRef's fields, read and written by the
//             Python handler at flush time): its type is saved_ref.cpp's
//   Packer    the pack hook of one offload block: points._OffloadBlock's closure + ChunkOffloadHandler.tensor_push
//             + ineligible_reason. A tensor that is not exactly a torch.Tensor goes to tensor_push.
//   Unpacker  the unpack hook of one handler: ChunkOffloadHandler.tensor_pop. Only a view whose entry is back on
//             the device and already waited for is rebuilt here; the rest goes to the handler's _rebuild.
//
// The copy-out is in copy_path.cpp and entry.cpp, the transport's copy loop in copy_calls.cpp, the reload's
// bookkeeping in reload.cpp, the module and what they share in module.cpp. Every hook adds its host time to the
// summary's clock (its native_clock, summary_calls.cpp), as the Python hooks add theirs to summary.runtime_ns.

#include "common.h"

namespace mco {

// rejection reasons (handler.ineligible_reason's words)
PyObject* r_other_device;
PyObject* r_small;
PyObject* r_parameter;
PyObject* r_not_offloadable_storage;
PyObject* r_conj_neg;
PyObject* r_marked;

// the Python objects behind the reasons, interned once (hook_types_ready)
bool intern_reasons() {
  static const NameSlot names[] = {{&r_other_device, "other device"},
                                   {&r_small, "under min_offloaded_tensor_size"},
                                   {&r_parameter, "parameter"},
                                   {&r_not_offloadable_storage, "parameter or main_grad storage"},
                                   {&r_conj_neg, "lazy conj/neg view"},
                                   {&r_marked, "marked not offloadable"}};
  return intern_names(names, sizeof(names) / sizeof(names[0]));
}

// ------------------------------------------------------------------------------------------------------ Packer
struct Packer {
  PyObject_HEAD
  PyObject* handler;
  PyObject* group;
  PyObject* point;
  PyObject* refs;  // group.refs (a list the handler only ever clears, never replaces)
  PyObject* rejected;  // group.rejected (a dict, likewise)
  PyObject* summary;
  PyObject* clock;  // summary.native_clock (a RuntimeClock), or nullptr: the summary's runtime_ns
  PyObject* not_offloadable;  // handler.not_offloadable: data_ptrs of parameter and main_grad storages
  int64_t device_index;
  int64_t min_numel;
  vectorcallfunc vectorcall;
};

int packer_traverse(Packer* self, visitproc visit, void* arg) {
  Py_VISIT(self->handler);
  Py_VISIT(self->group);
  Py_VISIT(self->point);
  Py_VISIT(self->refs);
  Py_VISIT(self->rejected);
  Py_VISIT(self->summary);
  Py_VISIT(self->clock);
  Py_VISIT(self->not_offloadable);
  return 0;
}

int packer_clear(Packer* self) {
  Py_CLEAR(self->handler);
  Py_CLEAR(self->group);
  Py_CLEAR(self->point);
  Py_CLEAR(self->refs);
  Py_CLEAR(self->rejected);
  Py_CLEAR(self->summary);
  Py_CLEAR(self->clock);
  Py_CLEAR(self->not_offloadable);
  return 0;
}

void packer_dealloc(Packer* self) {
  PyObject_GC_UnTrack(self);
  packer_clear(self);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// group.rejected[reason] += 1
int count_rejected(PyObject* rejected, PyObject* reason) {
  PyObject* cur = PyDict_GetItemWithError(rejected, reason);  // borrowed
  if (cur == nullptr && PyErr_Occurred()) return -1;
  long long n = cur == nullptr ? 0 : PyLong_AsLongLong(cur);
  if (n == -1 && PyErr_Occurred()) return -1;
  PyObject* next = PyLong_FromLongLong(n + 1);
  if (next == nullptr) return -1;
  int rc = PyDict_SetItem(rejected, reason, next);
  Py_DECREF(next);
  return rc;
}

// handler.ineligible_reason for an exact torch.Tensor: a borrowed reason, Py_None if eligible, nullptr on error
PyObject* ineligible_reason(Packer* self, PyObject* saved) {
  const at::Tensor& t = THPVariable_Unpack(saved);
  if (t.get_device() != self->device_index) return r_other_device;
  const c10::Storage& storage = t.storage();
  if (static_cast<int64_t>(storage.nbytes()) < self->min_numel * static_cast<int64_t>(t.element_size()))
    return r_small;
  if (t.requires_grad() && t.is_leaf() && !t.is_view()) return r_parameter;
  PyObject* ptr = PyLong_FromVoidPtr(const_cast<void*>(storage.data()));
  if (ptr == nullptr) return nullptr;
  int held = PySet_Contains(self->not_offloadable, ptr);
  Py_DECREF(ptr);
  if (held < 0) return nullptr;
  if (held) return r_not_offloadable_storage;
  if (t.is_conj() || t.is_neg()) return r_conj_neg;
  PyObject* mark = lookup_attr(saved, s_offloading_activation);
  if (mark == nullptr) return nullptr;
  bool marked = mark == Py_False;
  Py_DECREF(mark);
  return marked ? r_marked : Py_None;
}

PyObject* packer_pack(Packer* self, PyObject* saved) {
  HANDLE_TH_ERRORS
  PyTypeObject* type = Py_TYPE(saved);
  if (reinterpret_cast<PyObject*>(type) == g_parameter_type) {  // weights: kept, at the least cost
    if (add_to_attr(self->group, s_parameters, 1) < 0) return nullptr;
    Py_INCREF(saved);
    return saved;
  }
  if (reinterpret_cast<PyObject*>(type) != g_tensor_type || THPVariable_Unpack(saved).layout() != c10::kStrided) {
    // subclasses, other layouts: the Python hook decides (and counts the reason)
    return PyObject_CallMethodObjArgs(self->handler, s_tensor_push, saved, self->group, self->point, nullptr);
  }
  PyObject* finished = getattr_fast(self->handler, s_finished);
  if (finished == nullptr) return nullptr;
  int done = PyObject_IsTrue(finished);
  Py_DECREF(finished);
  if (done < 0) return nullptr;
  if (done) {
    Py_INCREF(saved);
    return saved;
  }
  int64_t t0 = now_ns();
  PyObject* reason = ineligible_reason(self, saved);
  if (reason == nullptr) return nullptr;
  PyObject* out;
  if (reason != Py_None) {
    if (count_rejected(self->rejected, reason) < 0) return nullptr;
    Py_INCREF(saved);
    out = saved;
  } else {
    out = new_saved_ref(saved, self->group, self->point);
    if (out == nullptr) return nullptr;
    if (PyList_Append(self->refs, out) < 0) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  if (add_runtime(self->summary, self->clock, now_ns() - t0) < 0) {
    Py_DECREF(out);
    return nullptr;
  }
  return out;
  END_HANDLE_TH_ERRORS
}

PyObject* packer_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != nullptr) {
    PyErr_SetString(PyExc_TypeError, "a pack hook takes one tensor");
    return nullptr;
  }
  return packer_pack(reinterpret_cast<Packer*>(self), args[0]);
}

// Packer(handler, group, point): the pack hook of one offload block
PyObject* packer_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"handler", "group", "point", nullptr};
  PyObject *handler, *group, *point;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO", const_cast<char**>(names), &handler, &group, &point))
    return nullptr;
  PyObject* pack = nullptr;
  return make_hooks(handler, group, point, &pack, nullptr) ? pack : nullptr;
}

PyTypeObject PackerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ---------------------------------------------------------------------------------------------------- Unpacker
struct Unpacker {
  PyObject_HEAD
  PyObject* handler;
  PyObject* summary;
  PyObject* clock;  // as Packer's
  vectorcallfunc vectorcall;
};

int unpacker_traverse(Unpacker* self, visitproc visit, void* arg) {
  Py_VISIT(self->handler);
  Py_VISIT(self->summary);
  Py_VISIT(self->clock);
  return 0;
}

int unpacker_clear(Unpacker* self) {
  Py_CLEAR(self->handler);
  Py_CLEAR(self->summary);
  Py_CLEAR(self->clock);
  return 0;
}

void unpacker_dealloc(Unpacker* self) {
  PyObject_GC_UnTrack(self);
  unpacker_clear(self);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// The view of a reloaded entry (handler._rebuild's last two lines), or nullptr with an error set
PyObject* rebuild_view(SavedRef* ref, PyObject* device_storage) {
  const ViewLayout& layout = ref->layout;
  if (!layout.complete() || !THPStorage_Check(device_storage)) {
    PyErr_SetString(PyExc_RuntimeError, "mcore-offload: an offloaded saved tensor lacks its view's layout; this is "
                                        "a bug, please report it with the model configuration.");
    return nullptr;
  }
  const c10::Storage& storage = THPStorage_Unpack(device_storage);
  return THPVariable_Wrap(view_of(storage, layout.dtype, layout.offset, layout.sizes, layout.strides));
}

// handler._first_read: the ref's first read since it was offloaded. When every saved view of the entry has been read,
// the entry keeps only a weak reference to its reloaded storage: autograd's views hold it while their nodes need it,
// and it goes with the last of them, as without offloading (0, or -1 with an error set)
int first_read(SavedRef* ref, PyObject* storage) {
  ref->unpacked = 1;
  long left = attr_long(ref->entry, s_awaiting);
  if ((left == -1 && PyErr_Occurred()) || set_long(ref->entry, s_awaiting, left - 1) < 0) return -1;
  if (left != 1) return 0;
  Ref weak(PyWeakref_NewRef(storage, nullptr));
  return weak && setattr_fast(ref->entry, s_reloaded_ref, weak.get()) == 0 &&
                 setattr_fast(ref->entry, s_device_storage, Py_None) == 0
             ? 0
             : -1;
}

PyObject* unpacker_unpack(Unpacker* self, PyObject* tag) {
  HANDLE_TH_ERRORS
  if (Py_TYPE(tag) != &SavedRefType) {
    if (THPVariable_Check(tag)) {  // kept as it was by the pack hook
      Py_INCREF(tag);
      return tag;
    }
    return PyObject_CallMethodObjArgs(self->handler, s_tensor_pop, tag, nullptr);  // a Python SavedRef
  }
  SavedRef* ref = reinterpret_cast<SavedRef*>(tag);
  if (ref->tensor != nullptr && ref->tensor != Py_None) {
    Py_INCREF(ref->tensor);
    return ref->tensor;
  }
  int64_t t0 = now_ns();
  PyObject* out = nullptr;
  PyObject* storage = nullptr;
  int waited = 0;
  if (ref->entry != nullptr && ref->entry != Py_None) {
    storage = getattr_fast(ref->entry, s_device_storage);
    if (storage == nullptr) return nullptr;
    PyObject* flag = getattr_fast(ref->entry, s_compute_waited);
    if (flag == nullptr) {
      Py_DECREF(storage);
      return nullptr;
    }
    waited = flag == Py_True;
    Py_DECREF(flag);
  }
  if (storage != nullptr && storage != Py_None && !waited) {
    // back, not yet waited for (a split chain's first point): handler._rebuild's wait (link_calls.cpp)
    Ref transport(get_attr(self->handler, MCO_NAME("transport")));
    Ref event(transport ? getattr_fast(ref->entry, s_h2d_event) : nullptr);
    Ref seq(event ? getattr_fast(ref->entry, s_h2d_seq) : nullptr);
    waited = seq && wait_reload(transport.get(), event.get(), seq.get()) == 0 &&
             setattr_fast(ref->entry, s_compute_waited, Py_True) == 0;
    if (!waited) {
      Py_DECREF(storage);
      return nullptr;
    }
  }
  if (storage != nullptr && storage != Py_None && waited) {
    out = rebuild_view(ref, storage);
    if (out != nullptr && !ref->unpacked && first_read(ref, storage) < 0) Py_CLEAR(out);
  } else {  // not back yet: the handler's own path (inline reload, wait, errors)
    out = PyObject_CallMethodObjArgs(self->handler, s_rebuild, tag, nullptr);
  }
  Py_XDECREF(storage);
  if (out != nullptr && add_runtime(self->summary, self->clock, now_ns() - t0) < 0) {
    Py_CLEAR(out);
  }
  return out;
  END_HANDLE_TH_ERRORS
}

PyObject* unpacker_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != nullptr) {
    PyErr_SetString(PyExc_TypeError, "an unpack hook takes one packed value");
    return nullptr;
  }
  return unpacker_unpack(reinterpret_cast<Unpacker*>(self), args[0]);
}

// Unpacker(handler): the unpack hook of one handler
PyObject* unpacker_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"handler", nullptr};
  PyObject* handler;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O", const_cast<char**>(names), &handler)) return nullptr;
  PyObject* unpack = nullptr;
  return make_hooks(handler, nullptr, nullptr, nullptr, &unpack) ? unpack : nullptr;
}

PyTypeObject UnpackerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ------------------------------------------------------------------------------------------------- make_hooks
bool make_hooks(PyObject* handler, PyObject* group, PyObject* point, PyObject** pack, PyObject** unpack) {
  if (g_tensor_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "mcore-offload's native hooks were used before init(); load them through "
                                        "mcore_offload.runtime.native.load_native()");
    return false;
  }
  // what both hooks read of the handler, once
  Ref summary(get_attr(handler, MCO_NAME("summary")));
  Ref clock(summary ? runtime_clock_of(summary.get()) : nullptr);
  if (!summary || PyErr_Occurred()) return false;
  if (pack != nullptr) {
    Ref refs(get_attr(group, MCO_NAME("refs")));
    Ref rejected(refs ? get_attr(group, MCO_NAME("rejected")) : nullptr);
    Ref not_offloadable(rejected ? get_attr(handler, MCO_NAME("not_offloadable")) : nullptr);
    Ref device_index(not_offloadable ? get_attr(handler, MCO_NAME("device_index")) : nullptr);
    Ref min_numel(device_index ? get_attr(handler, MCO_NAME("min_numel")) : nullptr);
    if (!min_numel) return false;
    if (!PyList_Check(refs.get()) || !PyDict_Check(rejected.get()) || !PyAnySet_Check(not_offloadable.get())) {
      PyErr_SetString(PyExc_TypeError, "Packer: group.refs must be a list, group.rejected a dict and "
                                       "handler.not_offloadable a set");
      return false;
    }
    int64_t dev = PyLong_AsLongLong(device_index.get());
    int64_t mn = dev == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(min_numel.get());
    if (PyErr_Occurred()) return false;
    Packer* self = PyObject_GC_New(Packer, &PackerType);
    if (self == nullptr) return false;
    PyObject* fields[] = {handler, group, point, refs.get(), rejected.get(), summary.get(), clock.get(),
                          not_offloadable.get()};
    for (PyObject* f : fields) Py_XINCREF(f);
    self->handler = handler;
    self->group = group;
    self->point = point;
    self->refs = refs.get();
    self->rejected = rejected.get();
    self->summary = summary.get();
    self->clock = clock.get();
    self->not_offloadable = not_offloadable.get();
    self->device_index = dev;
    self->min_numel = mn;
    self->vectorcall = packer_vectorcall;
    PyObject_GC_Track(self);
    *pack = reinterpret_cast<PyObject*>(self);
  }
  if (unpack != nullptr) {
    Unpacker* self = PyObject_GC_New(Unpacker, &UnpackerType);
    if (self == nullptr) {
      if (pack != nullptr) Py_CLEAR(*pack);
      return false;
    }
    Py_INCREF(handler);
    Py_INCREF(summary.get());
    Py_XINCREF(clock.get());
    self->handler = handler;
    self->summary = summary.get();
    self->clock = clock.get();
    self->vectorcall = unpacker_vectorcall;
    PyObject_GC_Track(self);
    *unpack = reinterpret_cast<PyObject*>(self);
  }
  return true;
}

// ------------------------------------------------------------------------------------------------- the types
// The three types filled in, readied and added to the module (module.cpp calls this once; SavedRef's own part is
// saved_ref.cpp's)
bool hook_types_ready(PyObject* module) {
  PackerType.tp_name = "mcore_offload_native.Packer";
  PackerType.tp_basicsize = sizeof(Packer);
  PackerType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  PackerType.tp_doc = "Packer(handler, group, point): the pack hook of one offload block.";
  PackerType.tp_new = packer_new;
  PackerType.tp_dealloc = reinterpret_cast<destructor>(packer_dealloc);
  PackerType.tp_traverse = reinterpret_cast<traverseproc>(packer_traverse);
  PackerType.tp_clear = reinterpret_cast<inquiry>(packer_clear);
  PackerType.tp_vectorcall_offset = offsetof(Packer, vectorcall);
  PackerType.tp_call = PyVectorcall_Call;

  UnpackerType.tp_name = "mcore_offload_native.Unpacker";
  UnpackerType.tp_basicsize = sizeof(Unpacker);
  UnpackerType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  UnpackerType.tp_doc = "Unpacker(handler): the unpack hook of one handler.";
  UnpackerType.tp_new = unpacker_new;
  UnpackerType.tp_dealloc = reinterpret_cast<destructor>(unpacker_dealloc);
  UnpackerType.tp_traverse = reinterpret_cast<traverseproc>(unpacker_traverse);
  UnpackerType.tp_clear = reinterpret_cast<inquiry>(unpacker_clear);
  UnpackerType.tp_vectorcall_offset = offsetof(Unpacker, vectorcall);
  UnpackerType.tp_call = PyVectorcall_Call;

  return intern_reasons() && saved_ref_type_ready(module) && PyType_Ready(&PackerType) == 0 &&
         PyType_Ready(&UnpackerType) == 0 &&
         PyModule_AddObjectRef(module, "Packer", reinterpret_cast<PyObject*>(&PackerType)) == 0 &&
         PyModule_AddObjectRef(module, "Unpacker", reinterpret_cast<PyObject*>(&UnpackerType)) == 0;
}

}  // namespace mco
