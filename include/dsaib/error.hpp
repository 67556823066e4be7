// The one exception type the C++ API raises, and its codes (mirrored by the C ABI).
#pragma once

#include <stdexcept>
#include <string>

namespace dsaib {

/// Error categories. The numeric values are the C ABI's status codes.
enum class ErrorCode : int {
  ok = 0,
  invalid_argument = 1,    ///< wrong dtype, rank, shape, stride, alignment, size or value
  unsupported = 2,         ///< valid input this backend cannot run (no current rule raises it; kept for the ABI)
  index_out_of_range = 3,  ///< strict mode: a topk id outside its sequence
  backend_unavailable = 4, ///< e.g. the cuda backend on a machine without a GPU or a build without CUDA
  cuda_error = 5,          ///< a CUDA runtime call failed
  io_error = 6,            ///< file reading/writing (safetensors)
  internal = 7,
  out_of_memory = 8,       ///< host (validation's copies, cpu backend, generator, safetensors reader) or device (cuda backend) memory could not be allocated
};

const char* error_code_name(ErrorCode code);

/// Raised by every public function on failure. what() is the full message;
/// argument() names the offending argument where there is one (else "").
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string argument, const std::string& message);
  ErrorCode code() const noexcept { return code_; }
  const std::string& argument() const noexcept { return argument_; }

 private:
  ErrorCode code_;
  std::string argument_;
};

}  // namespace dsaib
