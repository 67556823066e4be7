// The one workspace carver: a call's scratch as parts at 256-byte boundaries,
// in the order they are added. Every family's plan carves its workspace with
// it, so the size a workspace query returns and the offsets a run uses come
// from the same code. Host code without CUDA headers.
#pragma once

#include <cstddef>

namespace dsaib::hopper {

/// Workspaces and their parts start at 256-byte boundaries (the alignment the
/// entry points require of a caller's workspace).
inline constexpr std::size_t kWorkspaceAlignment = 256;

constexpr std::size_t round_up_256(std::size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

class WorkspaceCarver {
 public:
  /// Places a part of `bytes` at the next 256-byte boundary; returns its offset.
  std::size_t add(std::size_t bytes) {
    const std::size_t at = round_up_256(end_);
    end_ = at + bytes;
    return at;
  }
  /// Bytes from the start to the end of the last part.
  std::size_t total() const { return end_; }

 private:
  std::size_t end_ = 0;
};

}  // namespace dsaib::hopper
