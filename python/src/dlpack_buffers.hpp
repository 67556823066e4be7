// Memory that crosses between Python and the library through DLPack
// (dlpack_buffers.cpp): Buffer, an array owned by this module (the outputs
// dsaib allocates for frameworks it cannot allocate with, `empty`), and
// PyWorkspace, a call's scratch memory from the caller's allocator.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dlpack_views.hpp"
#include "dsaib/workspace.hpp"

namespace dsaib_py {

/// Throws the library's cuda_error ("what: detail") unless ok_status.
void cuda_call(bool ok_status, const char* what, const char* detail);

/// A contiguous array in memory owned by this module, host or CUDA. Python
/// sees an object with __dlpack__ and __dlpack_device__ (so numpy.from_dlpack,
/// torch.from_dlpack, cupy.from_dlpack, jax.dlpack.from_dlpack take it
/// without copying), shape and dtype.
struct Buffer {
  nb::ndarray<> array;
  std::vector<int64_t> shape;
  std::string dtype;
  int device_type = 0;
  int device_id = 0;
};

/// An uninitialised Buffer: dtype "f32", "bf16", "f64" or "i32", device "cpu"
/// or "cuda:N" (MemoryError when the device has no room for it).
Buffer make_buffer(const std::vector<int64_t>& shape, const std::string& dtype, const std::string& device);

/// A Python exception raised by the allocator, restored as the pending error
/// (with the GIL held) and raised again once the library call has returned.
struct PendingPythonError {};

/// dsaib::WorkspaceAllocator over a Python callable nbytes -> DLPack array. The
/// array is held until the call returns (the caller's allocator orders its
/// reuse after the work on the call's stream).
class PyWorkspace {
 public:
  /// `allocate`: None (the library allocates, stream-ordered) or a callable;
  /// `device`: the backend's "cpu" or "cuda:N", where the array must live.
  PyWorkspace(const std::optional<nb::object>& allocate, std::string device);
  dsaib::WorkspaceAllocator allocator();

 private:
  static void* allocate(void* self, std::size_t bytes);

  std::optional<nb::object> allocate_;
  std::string device_;
  std::optional<OutArray> held_;
};

}  // namespace dsaib_py
