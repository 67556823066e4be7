// One mapping of host allocation failures to the library's out_of_memory error,
// for the entry points that allocate as they go (validation, the generator).
#pragma once

#include <new>
#include <stdexcept>

#include "dsaib/error.hpp"

namespace dsaib::detail {

/// fn()'s result; an allocation failure inside it (std::bad_alloc, or
/// std::length_error: a std::vector beyond its max_size) is raised as
/// Error(out_of_memory, "", message) instead. Other errors pass through.
template <class Fn>
auto allocation_failure_as_out_of_memory(const char* message, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {
  }
  throw Error(ErrorCode::out_of_memory, "", message);
}

}  // namespace dsaib::detail
