// The counting build's attr_counts() (see MCO_COUNT_ATTRS in common.h and benchmarks/cpu_attr_counts.py): every
// generic attribute read and write the native runtime makes, by "get|set <type>.<name>", since the last call; and
// slot_counts(): the same for the reads and writes member_slots.cpp makes straight to a slot or an Entry's field.
// Only compiled in where MCORE_OFFLOAD_NATIVE_COUNT_ATTRS=1 built the module; other builds add no function.

#include "common.h"

#ifdef MCO_COUNT_ATTRS
#include <map>
#include <string>
#endif

namespace mco {

#ifdef MCO_COUNT_ATTRS
namespace {

using Counts = std::map<std::string, long long>;

// every caller holds the GIL, which serialises the updates; attr_counts() / slot_counts() empty them (the reset the
// tool uses)
Counts& counts() {
  static Counts by_key;
  return by_key;
}

// the reads and writes member_slots.cpp makes straight to a slot: not C-API calls, counted apart
Counts& slot_counts() {
  static Counts by_key;
  return by_key;
}

void count_into(Counts& into, const char* kind, PyObject* obj, PyObject* name) {
  const char* text = name != nullptr && PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : nullptr;
  if (text == nullptr) {
    PyErr_Clear();
    text = "?";
  }
  into[std::string(kind) + " " + Py_TYPE(obj)->tp_name + "." + text] += 1;
}

void count(const char* kind, PyObject* obj, PyObject* name) { count_into(counts(), kind, obj, name); }

// the counts as a new dict, emptied (nullptr: error)
PyObject* take(Counts& from) {
  PyObject* out = PyDict_New();
  for (const auto& kv : from) {
    PyObject* n = out ? PyLong_FromLongLong(kv.second) : nullptr;
    if (n == nullptr || PyDict_SetItemString(out, kv.first.c_str(), n) < 0) {
      Py_XDECREF(n);
      Py_CLEAR(out);
      return nullptr;
    }
    Py_DECREF(n);
  }
  from.clear();
  return out;
}

PyObject* module_attr_counts(PyObject*, PyObject*) { return take(counts()); }

PyObject* module_slot_counts(PyObject*, PyObject*) { return take(slot_counts()); }

}  // namespace

void count_slot_access(const char* kind, PyObject* obj, PyObject* name) { count_into(slot_counts(), kind, obj, name); }

// the function-like macros in common.h do not expand a parenthesised name: these call the C-API's own functions
PyObject* counted_getattr(PyObject* obj, PyObject* name) {
  count("get", obj, name);
  return (PyObject_GetAttr)(obj, name);
}

int counted_setattr(PyObject* obj, PyObject* name, PyObject* value) {
  count("set", obj, name);
  return (PyObject_SetAttr)(obj, name, value);
}

PyMethodDef attr_count_methods[] = {
    {"attr_counts", module_attr_counts, METH_NOARGS,
     "attr_counts(): {'get|set type.name': count} since the last call (a counting build only)"},
    {"slot_counts", module_slot_counts, METH_NOARGS,
     "slot_counts(): {'get|set type.name': count} of the direct slot reads and writes since the last call (a "
     "counting build only)"},
    {nullptr, nullptr, 0, nullptr}};
#else
PyMethodDef attr_count_methods[] = {{nullptr, nullptr, 0, nullptr}};
#endif

}  // namespace mco
