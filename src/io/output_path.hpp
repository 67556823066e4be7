// Where a file written to `path` really goes (internal; the safetensors writer
// and the CLI's up-front --out check share it).
#pragma once

#include <string>

namespace dsaib::detail {

/// `path` with every symbolic link of its chain followed (a dangling link's
/// target included; a relative target is relative to its link's directory).
/// Raises dsaib::Error(io_error) naming `path` for a loop or an unreadable link.
std::string resolve_output_path(const std::string& path);

}  // namespace dsaib::detail
