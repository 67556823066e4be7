// Buffer (memory owned by this module, exported through DLPack) and the
// workspace of a library call taken from the caller's allocator
// (dlpack_buffers.hpp).
#include "dlpack_buffers.hpp"

#include <nanobind/stl/string.h>

#include <cstdlib>
#include <new>
#include <string>
#include <utility>

#if DSAIB_PY_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "dsaib/error.hpp"
#include "dsaib/tensor.hpp"
#include "type_error.hpp"

namespace dsaib_py {

namespace {

/// A Buffer's memory, owned by a capsule that the Buffer and each DLPack
/// export of it hold: freed on its device when the last of them is gone.
struct Allocation {
  void* ptr = nullptr;
  int device_type = nb::device::cpu::value;
  int device_id = 0;
};

void free_allocation(void* p) noexcept {
  auto* a = static_cast<Allocation*>(p);
  if (a->device_type == nb::device::cpu::value) {
    std::free(a->ptr);
  } else {
#if DSAIB_PY_WITH_CUDA
    int prev = 0;
    if (cudaGetDevice(&prev) == cudaSuccess) {
      if (prev != a->device_id) cudaSetDevice(a->device_id);
      cudaFree(a->ptr);
      if (prev != a->device_id) cudaSetDevice(prev);
    }
#endif
  }
  delete a;
}

}  // namespace

void cuda_call(bool ok_status, const char* what, const char* detail) {
  if (!ok_status) {
    throw dsaib::Error(dsaib::ErrorCode::cuda_error, what, std::string(what) + ": " + detail);
  }
}

Buffer make_buffer(const std::vector<int64_t>& shape, const std::string& dtype, const std::string& device) {
  nb::dlpack::dtype dt;
  size_t elem = 0;
  if (dtype == "f32") {
    dt = nb::dtype<float>();
    elem = 4;
  } else if (dtype == "bf16") {
    dt = nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    elem = 2;
  } else if (dtype == "f64") {
    dt = nb::dtype<double>();
    elem = 8;
  } else if (dtype == "i32") {
    dt = nb::dtype<int32_t>();
    elem = 4;
  } else {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "dtype",
                       "dtype: expected \"f32\", \"bf16\", \"f64\" or \"i32\", got \"" + dtype + "\"");
  }
  if (shape.size() > static_cast<size_t>(dsaib::kMaxRank)) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "shape",
                       "shape: expected rank <= " + std::to_string(dsaib::kMaxRank) + ", got rank " +
                           std::to_string(shape.size()));
  }
  std::vector<size_t> ushape;
  size_t n = 1;
  for (int64_t s : shape) {
    if (s < 0 || s > (int64_t{1} << 40)) {
      throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "shape", "shape: expected sizes in [0, 2^40], got " + std::to_string(s));
    }
    ushape.push_back(static_cast<size_t>(s));
    n *= static_cast<size_t>(s);
  }
  const size_t bytes = ((n * elem + 255) / 256) * 256 + 256;  // never 0; 256-byte multiple
  auto* a = new Allocation;
  if (device == "cpu") {
    a->ptr = std::aligned_alloc(256, bytes);
    if (!a->ptr) {
      delete a;
      throw std::bad_alloc();
    }
  } else if (device.rfind("cuda:", 0) == 0) {
    a->device_type = nb::device::cuda::value;
    a->device_id = std::stoi(device.substr(5));
#if DSAIB_PY_WITH_CUDA
    int prev = 0;
    cudaError_t st = cudaGetDevice(&prev);
    if (st == cudaSuccess && prev != a->device_id) st = cudaSetDevice(a->device_id);
    if (st == cudaSuccess) st = cudaMalloc(&a->ptr, bytes);
    if (prev != a->device_id) cudaSetDevice(prev);
    if (st != cudaSuccess) {
      delete a;
      (void)cudaGetLastError();
      if (st == cudaErrorMemoryAllocation) {  // MemoryError, as the library's out_of_memory
        throw dsaib::Error(dsaib::ErrorCode::out_of_memory, "cudaMalloc",
                           std::string("cudaMalloc: expected ") + std::to_string(bytes) +
                               " bytes of device memory for an output, got " + cudaGetErrorString(st));
      }
      cuda_call(false, "cudaMalloc", cudaGetErrorString(st));
    }
#else
    delete a;
    throw dsaib::Error(dsaib::ErrorCode::backend_unavailable, "device",
                       "device: expected cpu (this build has no CUDA support), got " + device);
#endif
  } else {
    delete a;
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "device",
                       "device: expected \"cpu\" or \"cuda:N\", got \"" + device + "\"");
  }
  nb::capsule owner(a, &free_allocation);
  Buffer b;
  b.array = nb::ndarray<>(a->ptr, ushape.size(), ushape.data(), owner, nullptr, dt, a->device_type, a->device_id);
  b.shape = shape;
  b.dtype = dtype;
  b.device_type = a->device_type;
  b.device_id = a->device_id;
  return b;
}

PyWorkspace::PyWorkspace(const std::optional<nb::object>& allocate, std::string device)
    : allocate_(allocate), device_(std::move(device)) {
  if (allocate_ && !allocate_->is_none() && !PyCallable_Check(allocate_->ptr())) {
    throw PyTypeError{"workspace: expected None or a callable nbytes -> array (an allocator), got " +
                      nb::cast<std::string>(nb::str(allocate_->type().attr("__name__")))};
  }
}

dsaib::WorkspaceAllocator PyWorkspace::allocator() {
  if (!allocate_ || allocate_->is_none()) return {};  // the library allocates it, stream-ordered
  return {&PyWorkspace::allocate, this};
}

void* PyWorkspace::allocate(void* self, std::size_t bytes) {
  auto* w = static_cast<PyWorkspace*>(self);
  nb::gil_scoped_acquire gil;
  try {
    OutArray a = nb::cast<OutArray>((*w->allocate_)(bytes));
    const std::string got = device_string(a.device_type(), a.device_id());
    if (got != w->device_) {
      throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "workspace",
                         "workspace: expected the allocator's array on " + w->device_ +
                             " (the backend's device), got one on " + got);
    }
    if (a.nbytes() < bytes) {
      throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "workspace",
                         "workspace: expected the allocator's array to hold >= " + std::to_string(bytes) +
                             " bytes, got " + std::to_string(a.nbytes()));
    }
    w->held_ = a;
    return a.data();
  } catch (nb::python_error& e) {
    e.restore();
    throw PendingPythonError{};
  } catch (const nb::cast_error&) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "workspace",
                       "workspace: expected the allocator to return an array (DLPack), got another object");
  }
}

}  // namespace dsaib_py
