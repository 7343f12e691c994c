// HostBufferPool's common answers in C++ (see __init__.py for why and how this is built): what the copy-out burst
// (bursts.cpp) asks the pool for once per storage, without a Python frame where the answer is a list pop, and what a
// chunk's finish (backward.cpp) hands back once per buffer, where the answer is a list append. Every other
// case (a search through larger size classes, an allocation, a routed buffer that does not fit) is the Python method's,
// so the pool keeps one owner of its rules (runtime/host_pool.py); tests/test_native_bursts.py checks that the buffers
// handed out are the Python method's.

#include "common.h"

#include <algorithm>

namespace mco {
namespace {

// host_pool.size_class: ``nbytes`` rounded up to 1/8 of its power of two, at least 512-byte granules
long long size_class(long long nbytes) {
  int bits = 0;
  for (unsigned long long v = static_cast<unsigned long long>(nbytes); v != 0; v >>= 1) ++bits;
  long long granule = 1LL << std::max(bits - 4, 9);
  return (nbytes + granule - 1) / granule * granule;
}

}  // namespace

// HostBufferPool.acquire_base's common cases without its Python frame: a free buffer of the request's own size class,
// or, for a routed key, the key's last free buffer where it fits (and the key's largest request raised, as there).
// A new (buffer, event) reference; nullptr without an error: the Python method decides (a search through larger
// classes, an allocation, a routed buffer that does not fit); nullptr with an error set: an error
PyObject* acquire_fast(PyObject* pool, long long nbytes, PyObject* routed) {
  if (routed == Py_None) {
    PyObject* free_by_class = get_attr(pool, MCO_NAME("_free"));
    PyObject* key = free_by_class ? PyLong_FromLongLong(size_class(nbytes)) : nullptr;
    PyObject* free = key && PyDict_Check(free_by_class) ? PyDict_GetItemWithError(free_by_class, key) : nullptr;
    PyObject* out = free && PyList_Check(free) && PyList_GET_SIZE(free) > 0 ? pop_last(free) : nullptr;
    Py_XDECREF(key);
    Py_XDECREF(free_by_class);
    return out;
  }
  PyObject* largest = get_attr(pool, MCO_NAME("_routed_largest"));
  PyObject* free_by_key = largest ? get_attr(pool, MCO_NAME("_routed_free")) : nullptr;
  PyObject* out = nullptr;
  if (free_by_key != nullptr && PyDict_Check(largest) && PyDict_Check(free_by_key)) {
    PyObject* seen = PyDict_GetItemWithError(largest, routed);  // borrowed
    long long most = seen == nullptr ? 0 : PyLong_AsLongLong(seen);
    bool ok = !PyErr_Occurred();
    if (ok && nbytes > most) {
      PyObject* n = PyLong_FromLongLong(nbytes);
      ok = n != nullptr && PyDict_SetItem(largest, routed, n) == 0;
      Py_XDECREF(n);
    }
    PyObject* free = ok ? PyDict_GetItemWithError(free_by_key, routed) : nullptr;
    if (free != nullptr && PyList_Check(free) && PyList_GET_SIZE(free) > 0) {
      PyObject* last = PyList_GET_ITEM(free, PyList_GET_SIZE(free) - 1);
      PyObject* buf = PyTuple_Check(last) && PyTuple_GET_SIZE(last) == 2 ? PyTuple_GET_ITEM(last, 0) : nullptr;
      if (buf != nullptr && THPVariable_Check(buf) && THPVariable_Unpack(buf).numel() >= nbytes) out = pop_last(free);
    }
  }
  Py_XDECREF(free_by_key);
  Py_XDECREF(largest);
  return out;
}

// HostBufferPool.release's common case without its Python frame: the buffer (or the buffer a slice was cut from) goes
// on its size class's free list with the event of the last copy that read it
int release_fast(PyObject* pool, PyObject* free_by_class, PyObject* routed_owner, PyObject* buf, PyObject* event) {
  bool fast = THPVariable_Check(buf) && PyDict_Check(free_by_class) && PyDict_Check(routed_owner);
  Ref base;
  if (fast) {
    base.reset(get_attr(buf, MCO_NAME("_base")));
    if (!base) return -1;
    if (base.get() == Py_None) {
      Py_INCREF(buf);
      base.reset(buf);
    }
    fast = THPVariable_Check(base.get());
  }
  PyObject* free = nullptr;  // borrowed
  if (fast) {
    const at::Tensor& b = THPVariable_Unpack(base.get());
    if (PyDict_GET_SIZE(routed_owner) > 0) {
      Ref ptr(PyLong_FromVoidPtr(b.data_ptr()));
      if (!ptr) return -1;
      PyObject* key = PyDict_GetItemWithError(routed_owner, ptr.get());
      if (key == nullptr && PyErr_Occurred()) return -1;
      fast = key == nullptr || key == Py_None;
    }
    if (fast) {
      Ref cls(PyLong_FromLongLong(b.numel()));
      if (!cls) return -1;
      free = PyDict_GetItemWithError(free_by_class, cls.get());
      if (free == nullptr && PyErr_Occurred()) return -1;
    }
  }
  if (free == nullptr || !PyList_Check(free)) {  // a new size class (kept sorted), a routed buffer, another type
    Ref r(PyObject_CallMethod(pool, "release", "OO", buf, event));
    return r ? 0 : -1;
  }
  Ref item(PyTuple_Pack(2, base.get(), event));
  return item ? PyList_Append(free, item.get()) : -1;
}

}  // namespace mco
