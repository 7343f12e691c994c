// Attribute reads and writes that go straight to an object's slot (getattr_fast / setattr_fast in common.h).
//
// Why: after sessions 45-47 the runtime's C++ still made about 330 generic attribute reads a layer-microbatch on the
// Python objects that hold its state (the handler, the manager, the groups, the summary, the transport), about 220
// instructions each through PyObject_GetAttr: the type's MRO lookup, the descriptor or instance-dict dispatch, the
// call chain. Those classes keep the attributes our C++ touches in ``__slots__``; a slot is a member descriptor
// holding a fixed offset into the object, so once the (type, name) pair is resolved a read is one load.
//
// What makes the shortcut exact: it is taken only where PyObject_GetAttr / PyObject_SetAttr would end in the very
// same member descriptor and do the same thing with it. The type's lookup is cached under its version tag
// (CPython clears the tag whenever the type or a base is modified: a class attribute assigned, a descriptor
// replaced, __getattribute__ or __setattr__ set), the type must use the generic getattro / setattro, the descriptor
// must be a plain object member (T_OBJECT or T_OBJECT_EX, no flags but READONLY, and READONLY only for reads) of a
// class the type derives from. An unset T_OBJECT_EX slot, a delete and everything else take the generic path, which
// raises what it always raised.
//
// Entry (entry.cpp), a third of the accesses (session 49's slot counts), skips the table: its type is static, cannot
// be subclassed and refuses new attributes, so an exact Entry's members are always its struct's fields, found by
// comparing the interned name with its thirteen field names.

#include "common.h"

#include <cstdint>

namespace mco {

namespace {

// 32 bytes, aligned: one entry never straddles two cache lines, and a set's two entries share one (a lookup between
// the interpreter's work finds the table cold, session 49's profile)
struct alignas(32) MemberSlot {
  PyTypeObject* type = nullptr;  // not owned: a type freed and another made at its address has another version tag
  PyObject* name = nullptr;      // owned
  unsigned int version = 0;
  int32_t offset = -1;           // -1: not a plain object member of this type (or one past what 32 bits hold)
  bool none_if_unset = false;    // T_OBJECT reads an unset slot as None; T_OBJECT_EX raises AttributeError
  bool readable = false;         // the type reads attributes with PyObject_GenericGetAttr
  bool writable = false;         // ... writes them with PyObject_GenericSetAttr, and the member is not READONLY
};
static_assert(sizeof(MemberSlot) == 32, "a MemberSlot is one aligned half of a cache line");

// two-way set-associative by (type, name), the set's most recently resolved pair first: direct-mapped, a few hot
// pairs that shared an entry evicted each other hundreds of times a step (which ones depends on the addresses, so
// it moved from run to run: 128 to 768 lookups a step in session 49). Every caller holds the GIL.
// _reset_member_slots() empties it (tests).
constexpr size_t kSets = 1024;
alignas(64) MemberSlot g_member_slots[kSets][2];
long long g_resolved = 0;  // lookups that went to the type (misses), for the tests

MemberSlot* set_of(PyTypeObject* type, PyObject* name) {
  // Fibonacci hashing of both addresses: the runtime touches about 150 pairs, which should rarely fill a set
  uint64_t h = (reinterpret_cast<uint64_t>(type) ^ (reinterpret_cast<uint64_t>(name) * 0x9E3779B97F4A7C15ull)) *
               0xBF58476D1CE4E5B9ull;
  return g_member_slots[h >> 54];  // the top 10 bits: kSets sets
}

bool current(const MemberSlot& s, PyTypeObject* type, PyObject* name) {
  return s.type == type && s.name == name && s.version == type->tp_version_tag &&
         PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG);
}

void resolve(MemberSlot& s, PyTypeObject* type, PyObject* name) {
  ++g_resolved;
  PyObject* descr = _PyType_Lookup(type, name);  // borrowed; sets no error; gives the type a version tag
  s.type = nullptr;  // an invalid entry until every field below is set
  if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) return;  // no tag to cache under
  s.offset = -1;
  s.none_if_unset = s.readable = s.writable = false;
  if (descr != nullptr && Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
      PyType_IsSubtype(type, PyDescr_TYPE(descr))) {
    const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
    if ((m->type == T_OBJECT || m->type == T_OBJECT_EX) && (m->flags & ~READONLY) == 0 && m->offset >= 0 &&
        m->offset <= INT32_MAX) {
      s.offset = static_cast<int32_t>(m->offset);
      s.none_if_unset = m->type == T_OBJECT;
      s.readable = type->tp_getattro == PyObject_GenericGetAttr;
      s.writable = type->tp_setattro == PyObject_GenericSetAttr && (m->flags & READONLY) == 0;
    }
  }
  Py_INCREF(name);
  Py_XSETREF(s.name, name);
  s.version = type->tp_version_tag;
  s.type = type;
}

// the set's entry that is current for the pair, or nullptr
const MemberSlot* find(const MemberSlot* set, PyTypeObject* type, PyObject* name) {
  return current(set[0], type, name) ? &set[0] : current(set[1], type, name) ? &set[1] : nullptr;
}

const MemberSlot* member_slot(PyObject* obj, PyObject* name) {
  PyTypeObject* type = Py_TYPE(obj);
  MemberSlot* set = set_of(type, name);
  const MemberSlot* s = find(set, type, name);
  if (s == nullptr) {  // the first entry moves to the second (its name reference with it), the pair goes first
    Py_XDECREF(set[1].name);
    set[1] = set[0];
    set[0].name = nullptr;
    set[0].type = nullptr;
    resolve(set[0], type, name);
    s = &set[0];
  }
  return s->type != nullptr && s->offset >= 0 ? s : nullptr;
}

PyObject** at(PyObject* obj, const MemberSlot& s) {
  return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + s.offset);
}

// the module's dict holds what its attribute read finds for a name that is not a dunder (ModuleType's own
// descriptors are all dunders); nullptr without an error where it holds nothing
PyObject* module_global(PyObject* module, PyObject* name) {
  Py_ssize_t n = PyUnicode_GET_LENGTH(name);
  if (n >= 2 && PyUnicode_READ_CHAR(name, 0) == '_' && PyUnicode_READ_CHAR(name, 1) == '_') return nullptr;
  PyObject* dict = PyModule_GetDict(module);  // borrowed
  return dict != nullptr ? PyDict_GetItemWithError(dict, name) : nullptr;
}

// forget every resolved (type, name) pair (tests)
PyObject* py_reset_member_slots(PyObject*, PyObject*) {
  for (MemberSlot* set : g_member_slots) {
    for (int way = 0; way < 2; ++way) {
      set[way].type = nullptr;
      Py_CLEAR(set[way].name);
    }
  }
  g_resolved = 0;
  Py_RETURN_NONE;
}

PyObject* py_member_slot_lookups(PyObject*, PyObject*) { return PyLong_FromLongLong(g_resolved); }

// the interned name of a test call's (obj, name[, value]) (a new reference; nullptr with an error set)
PyObject* interned_name(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, const char* usage) {
  if (nargs != want || !PyUnicode_CheckExact(args[1])) {
    PyErr_Format(PyExc_TypeError, "%s: name must be a str", usage);
    return nullptr;
  }
  PyObject* name = args[1];
  Py_INCREF(name);
  PyUnicode_InternInPlace(&name);
  return name;
}

PyObject* py_get_attr(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Ref name(interned_name(args, nargs, 2, "_get_attr(obj, name)"));
  return name ? getattr_fast(args[0], name.get()) : nullptr;
}

PyObject* py_set_attr(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Ref name(interned_name(args, nargs, 3, "_set_attr(obj, name, value)"));
  if (!name || setattr_fast(args[0], name.get(), args[2]) < 0) return nullptr;
  Py_RETURN_NONE;
}

}  // namespace

namespace {

// an exact Entry's field (a new reference); nullptr without an error for a name that is none of its fields
PyObject* entry_read(PyObject* entry, PyObject* name) {
  PyObject** field = entry_field_named(entry, name);
  if (field == nullptr) return nullptr;
#ifdef MCO_COUNT_ATTRS
  count_slot_access("get", entry, name);
#endif
  PyObject* v = *field != nullptr ? *field : Py_None;  // T_OBJECT: an unset field reads as None
  Py_INCREF(v);
  return v;
}

// a resolved entry's slot (a new reference); nullptr without an error where the generic path must answer
PyObject* slot_read(PyObject* obj, PyObject* name, const MemberSlot& s) {
#ifdef MCO_COUNT_ATTRS
  count_slot_access("get", obj, name);
#else
  (void)name;
#endif
  PyObject* v = *at(obj, s);
  if (v == nullptr && s.none_if_unset) v = Py_None;
  Py_XINCREF(v);
  return v;
}

// the direct read where the table has no current entry for the pair: a module's dict, or the pair resolved
__attribute__((noinline)) PyObject* read_on_miss(PyObject* obj, PyObject* name) {
  if (PyModule_CheckExact(obj)) {
    PyObject* v = module_global(obj, name);
    Py_XINCREF(v);
    return v;
  }
  const MemberSlot* s = member_slot(obj, name);
  return s != nullptr && s->readable ? slot_read(obj, name, *s) : nullptr;
}

// the direct read, in one call: an Entry's fields, then the table's hit (two thirds of the reads, session 49's slot
// counts), and only on a miss the module and resolve paths
inline PyObject* direct_read(PyObject* obj, PyObject* name) {
  PyTypeObject* type = Py_TYPE(obj);
  if (type == g_entry_type) return entry_read(obj, name);
  if (const MemberSlot* s = find(set_of(type, name), type, name)) return s->readable ? slot_read(obj, name, *s) : nullptr;
  return read_on_miss(obj, name);
}

}  // namespace

PyObject* member_fast(PyObject* obj, PyObject* name) { return direct_read(obj, name); }

PyObject* member_get(PyObject* obj, PyObject* name) {
  PyObject* v = direct_read(obj, name);
  return v != nullptr || PyErr_Occurred() ? v : PyObject_GetAttr(obj, name);
}

int member_set(PyObject* obj, PyObject* name, PyObject* value) {
  if (value != nullptr && Py_IS_TYPE(obj, g_entry_type)) {
    if (PyObject** field = entry_field_named(obj, name)) {
#ifdef MCO_COUNT_ATTRS
      count_slot_access("set", obj, name);
#endif
      Py_INCREF(value);
      Py_XSETREF(*field, value);
      return 0;
    }
  }
  const MemberSlot* s = value != nullptr ? member_slot(obj, name) : nullptr;  // a delete takes the generic path
  if (s == nullptr || !s->writable) return PyObject_SetAttr(obj, name, value);
#ifdef MCO_COUNT_ATTRS
  count_slot_access("set", obj, name);
#endif
  Py_INCREF(value);
  Py_XSETREF(*at(obj, *s), value);
  return 0;
}

PyMethodDef member_slot_methods[] = {
    {"_reset_member_slots", py_reset_member_slots, METH_NOARGS,
     "_reset_member_slots(): empty the cache of resolved (type, name) slots (tests)"},
    {"_member_slot_lookups", py_member_slot_lookups, METH_NOARGS,
     "_member_slot_lookups(): how many (type, name) pairs were resolved against their type since the last reset"},
    {"_get_attr", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_get_attr)), METH_FASTCALL,
     "_get_attr(obj, name): getattr as the C++ runtime reads it (tests)"},
    {"_set_attr", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_set_attr)), METH_FASTCALL,
     "_set_attr(obj, name, value): setattr as the C++ runtime writes it (tests)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
