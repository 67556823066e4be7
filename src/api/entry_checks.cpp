// The checks every entry point runs around its own validation (cuda_backend.hpp):
// the options and the backend's availability first, and a caller's workspace
// against the launch plan before anything is written.
#include <cstdint>
#include <string>

#include "api/cuda_backend.hpp"
#include "core/validate_rules.hpp"

namespace dsaib::detail {

void check_options_and_backend(const IndexerOptions& opt) {
  check_options(opt);  // errors.md: the options first, then the backend's availability
  if (opt.backend != Backend::cuda) return;
  if (!cuda_backend_compiled()) {
    throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
  }
  if (!cuda_device_present()) {
    throw Error(ErrorCode::backend_unavailable, "backend",
                "backend: expected cpu (no CUDA device of compute capability 9.0 is visible), got cuda");
  }
}

void check_caller_workspace(const void* workspace, std::size_t workspace_bytes, std::size_t need,
                            const char* size_function) {
  if (workspace == nullptr && workspace_bytes == 0) return;  // the backend's own memory
  if (workspace_bytes < need) {
    throw Error(ErrorCode::invalid_argument, "workspace_bytes",
                "workspace_bytes: expected >= " + std::to_string(need) + " (" + size_function + "), got " +
                    std::to_string(workspace_bytes));
  }
  if (need > 0 && (workspace == nullptr || reinterpret_cast<std::uintptr_t>(workspace) % 256 != 0)) {
    throw Error(ErrorCode::invalid_argument, "workspace",
                "workspace: expected a non-null 256-byte aligned device pointer, got " +
                    std::string(workspace ? "a misaligned pointer" : "null"));
  }
}

}  // namespace dsaib::detail
