// Tensor views: the non-owning (pointer, dtype, shape, strides, device) records
// that every public entry point of dsaib takes. Framework-agnostic: no torch here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace dsaib {

/// Element types the library reads or writes.
enum class DType : int32_t {
  bf16 = 0,  ///< bfloat16, 2 bytes
  f32 = 1,   ///< IEEE float32, 4 bytes
  i32 = 2,   ///< int32, 4 bytes
  f64 = 3,   ///< IEEE float64, 8 bytes: the cpu backend's outputs (and some inputs) only
  e4m3 = 4,  ///< float8 e4m3 (OCP "fn": no infinities, NaN 0x7f/0xff, largest 448), 1 byte: indexer_topk's index_q and index_k
};

/// Where a tensor's memory lives.
enum class DeviceType : int32_t {
  cpu = 0,   ///< host memory
  cuda = 1,  ///< CUDA device memory (global memory of device `device_index`)
};

inline constexpr int kMaxRank = 4;

/// Size of one element in bytes.
std::size_t dtype_size(DType dtype);
/// "bf16", "f32", "i32", "f64", "e4m3".
const char* dtype_name(DType dtype);
const char* device_name(DeviceType device);

/// A non-owning view of a strided tensor.
///
/// - `shape[i]` for i < rank; sizes must be >= 0.
/// - `strides[i]` are in ELEMENTS (not bytes), like torch; they must be >= 0.
/// - A view with rank 0 and a null pointer is "absent" (used for optional
///   arguments such as cu_seqlens in the BSHD layout).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int32_t rank = 0;
  int64_t shape[kMaxRank] = {0, 0, 0, 0};
  int64_t strides[kMaxRank] = {0, 0, 0, 0};
  DeviceType device = DeviceType::cpu;
  int32_t device_index = 0;

  bool present() const { return rank != 0 || data != nullptr; }
  /// Product of the sizes (1 for rank 0).
  int64_t numel() const;
  /// True when strides are the row-major strides of shape.
  bool is_contiguous() const;
  /// "(2, 64, 8, 128)".
  std::string shape_string() const;
  std::string strides_string() const;
};

/// A row-major (contiguous) view of `data` with the given shape (rank 0..4, every
/// size >= 0, the element count below 2^63). Throws Error(invalid_argument,
/// "rank" / "shape") otherwise. A view with a size-0 dimension holds no element
/// whatever its other sizes: its strides saturate at INT64_MAX, never an error.
TensorView contiguous_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                           DeviceType device = DeviceType::cpu, int32_t device_index = 0);
TensorView contiguous_view(void* data, DType dtype, const int64_t* shape, int32_t rank,
                           DeviceType device = DeviceType::cpu, int32_t device_index = 0);

}  // namespace dsaib
