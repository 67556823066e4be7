// The workspace of a call whose caller gave a WorkspaceAllocator (dsaib/workspace.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "dsaib/error.hpp"
#include "dsaib/workspace.hpp"

namespace dsaib::detail {

/// `need` bytes from the allocator, checked: null when nothing is needed or the
/// allocator leaves the workspace to the call (its allocate is null), else a
/// non-null 256-byte aligned pointer. Called after validation, before anything
/// is written.
inline void* allocate_workspace(const WorkspaceAllocator& allocator, std::size_t need) {
  if (need == 0 || allocator.allocate == nullptr) return nullptr;
  void* p = allocator.allocate(allocator.context, need);
  if (p == nullptr || reinterpret_cast<std::uintptr_t>(p) % 256 != 0) {
    throw Error(ErrorCode::invalid_argument, "workspace",
                "workspace: expected the allocator to return a non-null 256-byte aligned device pointer to " +
                    std::to_string(need) + " bytes, got " + (p ? "a misaligned pointer" : "null"));
  }
  return p;
}

}  // namespace dsaib::detail
