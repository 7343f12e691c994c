// The transport's per-burst helpers in C++ (see __init__.py for why and how this is built): what RawCudaTransport
// does once per storage of a copy burst, without a Python frame per storage.
//
//   copy_burst       RawCudaTransport._copy_burst's loop: one cudaMemcpyAsync per copy, called at the address of the
//                    CUDA runtime PyTorch has loaded
//   empty_storages   RawCudaTransport.to_device's reload allocations (a fresh byte storage per size)

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
// caching allocator on the current stream: RawCudaTransport.to_device's torch.empty + untyped_storage per reload
PyObject* module_empty_storages(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* sizes;
  int device_index;
  if (!PyArg_ParseTuple(args, "Oi", &sizes, &device_index)) return nullptr;
  PyObject* seq = PySequence_Fast(sizes, "empty_storages takes a list of sizes");
  if (seq == nullptr) return nullptr;
  at::TensorOptions options = at::TensorOptions().dtype(at::kByte).device(
      device_index < 0 ? c10::Device(c10::kCPU) : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index)));
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject* out = PyList_New(n);
  for (Py_ssize_t i = 0; out != nullptr && i < n; ++i) {
    long long bytes = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (bytes == -1 && PyErr_Occurred()) {
      Py_CLEAR(out);
      break;
    }
    PyObject* st = THPStorage_Wrap(at::empty({bytes}, options).storage());
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

}  // namespace

PyMethodDef copy_call_methods[] = {
    {"copy_burst", module_copy_burst, METH_VARARGS,
     "copy_burst(memcpy_address, dsts, srcs, sizes, kind, stream): the first CUDA error, or 0"},
    {"empty_storages", module_empty_storages, METH_VARARGS, "empty_storages(sizes, device_index)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mco
