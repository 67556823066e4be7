// The host's waits on a GPU made inside the extension (host_waits.cpp).
#pragma once

#include <cstdint>

namespace dsaib_py {

/// How many of the CUDA runtime's blocking calls the extension and the library
/// linked into it have made so far (0 in a build without CUDA).
std::uint64_t host_waits();

/// Whether this build counts them (a CUDA build linked with --wrap).
bool counts_host_waits();

}  // namespace dsaib_py
