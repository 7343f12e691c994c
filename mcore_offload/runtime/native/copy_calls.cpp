// The transport's per-burst helpers in C++ (see __init__.py for why and how this is built): what RawCudaTransport
// does once per storage of a copy burst, without a Python frame per storage.
//
//   copy_burst       RawCudaTransport._copy_burst's loop: one cudaMemcpyAsync per copy, called at the address of the
//                    CUDA runtime PyTorch has loaded
//   empty_storages   RawCudaTransport.to_device's reload allocations (a fresh byte storage per size)
//   region_storages  byte storages over parts of one block, each keeping the block alive: a coalesced reload
//                    (MCORE_OFFLOAD_COALESCE_RELOADS) copies a group's storages into one block with one copy

#include "common.h"

namespace mco {
namespace {

// The address a copy reads or writes, a tensor's data pointer or a storage's, into ``out`` (false: error set)
bool address_of(PyObject* obj, void*& out) {
  if (THPVariable_Check(obj)) {
    out = THPVariable_Unpack(obj).data_ptr();
  } else if (THPStorage_Check(obj)) {
    out = THPStorage_Unpack(obj).mutable_data();
  } else {
    PyErr_SetString(PyExc_TypeError, "copy_burst copies between tensors and untyped storages only");
    return false;
  }
  return true;
}

using MemcpyAsync = int (*)(void*, const void*, size_t, int, void*);

// copy_burst(memcpy_address, dsts, srcs, sizes, kind, stream): RawCudaTransport._copy_burst's loop, one
// cudaMemcpyAsync (called through the address of the runtime PyTorch has loaded) per copy; the first CUDA error
// code, or 0. Stops at the first error, as the Python loop does.
PyObject* module_copy_burst(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  unsigned long long fn, stream;
  PyObject *dsts, *srcs, *sizes;
  int kind;
  if (!PyArg_ParseTuple(args, "KOOOiK", &fn, &dsts, &srcs, &sizes, &kind, &stream)) return nullptr;
  if (!PyList_Check(dsts) || !PyList_Check(srcs) || !PyList_Check(sizes) ||
      PyList_GET_SIZE(dsts) != PyList_GET_SIZE(srcs) || PyList_GET_SIZE(dsts) != PyList_GET_SIZE(sizes) || fn == 0) {
    PyErr_SetString(PyExc_ValueError, "copy_burst takes a function address and three lists of one length");
    return nullptr;
  }
  MemcpyAsync memcpy_async = reinterpret_cast<MemcpyAsync>(static_cast<uintptr_t>(fn));
  void* raw_stream = reinterpret_cast<void*>(static_cast<uintptr_t>(stream));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(dsts); ++i) {
    void *dst, *src;
    if (!address_of(PyList_GET_ITEM(dsts, i), dst) || !address_of(PyList_GET_ITEM(srcs, i), src)) return nullptr;
    unsigned long long n = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(sizes, i));
    if (n == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
    int err = memcpy_async(dst, src, static_cast<size_t>(n), kind, raw_stream);
    if (err != 0) return PyLong_FromLong(err);
  }
  return PyLong_FromLong(0);
  END_HANDLE_TH_ERRORS
}

// empty_storages(sizes, device_index): one fresh byte storage per size on that CUDA device (-1: the CPU), from the
// caching allocator on the current stream, unfilled: RawCudaTransport.to_device's reload allocations
PyObject* module_empty_storages(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* sizes;
  int device_index;
  if (!PyArg_ParseTuple(args, "Oi", &sizes, &device_index)) return nullptr;
  PyObject* seq = PySequence_Fast(sizes, "empty_storages takes a list of sizes");
  if (seq == nullptr) return nullptr;
  c10::Device device = device_index < 0 ? c10::Device(c10::kCPU)
                                        : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject* out = PyList_New(n);
  for (Py_ssize_t i = 0; out != nullptr && i < n; ++i) {
    long long bytes = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (bytes == -1 && PyErr_Occurred()) {
      Py_CLEAR(out);
      break;
    }
    PyObject* st = THPStorage_Wrap(fresh_storage(bytes, device));  // no deterministic-mode fill: see common.h
    if (st == nullptr) {
      Py_CLEAR(out);
      break;
    }
    PyList_SET_ITEM(out, i, st);
  }
  Py_DECREF(seq);
  return out;
  END_HANDLE_TH_ERRORS
}

// region_storages(block, offsets, sizes): one byte storage per (offset, size) over the memory of ``block`` (an
// untyped storage), not resizable. Each holds a reference to the block's storage, so the block goes back to its
// allocator when its last region dies (a reloaded group's storages die together, at the group's end).
PyObject* module_region_storages(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *block_obj, *offsets, *sizes;
  if (!PyArg_ParseTuple(args, "OOO", &block_obj, &offsets, &sizes)) return nullptr;
  if (!THPStorage_Check(block_obj) || !PyList_Check(offsets) || !PyList_Check(sizes) ||
      PyList_GET_SIZE(offsets) != PyList_GET_SIZE(sizes)) {
    PyErr_SetString(PyExc_TypeError, "region_storages takes an untyped storage and two lists of one length");
    return nullptr;
  }
  const c10::Storage& block = THPStorage_Unpack(block_obj);
  char* base = static_cast<char*>(block.mutable_data());
  const int64_t capacity = static_cast<int64_t>(block.nbytes());
  Py_ssize_t n = PyList_GET_SIZE(offsets);
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long off = PyLong_AsLongLong(PyList_GET_ITEM(offsets, i));
    long long size = PyLong_AsLongLong(PyList_GET_ITEM(sizes, i));
    if (PyErr_Occurred()) {
      Py_DECREF(out);
      return nullptr;
    }
    if (off < 0 || size < 0 || off + size > capacity) {
      Py_DECREF(out);
      PyErr_SetString(PyExc_ValueError, "region_storages: a region lies outside the block");
      return nullptr;
    }
    auto* keep = new c10::Storage(block);  // released by the region's deleter
    c10::DataPtr data(base + off, keep, [](void* ctx) { delete static_cast<c10::Storage*>(ctx); }, block.device());
    c10::Storage region(c10::Storage::use_byte_size_t(), static_cast<size_t>(size), std::move(data), nullptr, false);
    PyObject* st = THPStorage_Wrap(std::move(region));
    if (st == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, st);
  }
  return out;
  END_HANDLE_TH_ERRORS
}

}  // namespace

PyMethodDef copy_call_methods[] = {
    {"copy_burst", module_copy_burst, METH_VARARGS,
     "copy_burst(memcpy_address, dsts, srcs, sizes, kind, stream): the first CUDA error, or 0"},
    {"empty_storages", module_empty_storages, METH_VARARGS, "empty_storages(sizes, device_index)"},
    {"region_storages", module_region_storages, METH_VARARGS, "region_storages(block, offsets, sizes)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
