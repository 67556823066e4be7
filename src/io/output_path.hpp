// Where a file written to `path` really goes (internal; the safetensors writer
// and the CLI's up-front --out check share it).
#pragma once

#include <atomic>
#include <string>

namespace dsaib::detail {

/// `path` with every symbolic link of its chain followed (a dangling link's
/// target included; a relative target is relative to its link's directory).
/// Raises dsaib::Error(io_error) naming `path` for a loop or an unreadable link.
std::string resolve_output_path(const std::string& path);

/// What an existing non-regular file at `path` is ("a directory", "a FIFO",
/// "a character device", "a block device", "a socket", "not a regular file"),
/// following symbolic links; nullptr when nothing is there or a regular file
/// is. A file written by rename would replace such a thing, not write to it.
const char* non_regular_file_kind(const std::string& path);

/// The counter in the safetensors writer's temporary names
/// (`<target>.tmp.<pid>.<counter>`), process-wide; tests read it to know the
/// names the next write will try.
std::atomic<unsigned>& temporary_name_counter();

}  // namespace dsaib::detail
