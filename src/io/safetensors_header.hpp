// The safetensors header's JSON (safetensors.cpp's reader): parsed as a
// stream of events, in time and memory linear in its size, with bounds on what
// the file controls. Internal to src/io.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dsaib/error.hpp"
#include "dsaib/tensor.hpp"

namespace dsaib::io {

/// The largest header the reader takes: the reference implementation's cap
/// (safetensors' MAX_HEADER_SIZE).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

/// The header's key of the free-form string metadata.
inline constexpr const char* kMetadataKey = "__metadata__";

/// An io_error naming `path`: "<path>: <message>".
[[noreturn]] void io_fail(const std::string& path, const std::string& message);

/// numel * dtype size of a shape with non-negative sizes, for the reader and the
/// writer alike; nullopt when it does not fit in 64 bits. A size-0 dimension
/// makes 0 bytes whatever the other sizes (checked before any product).
std::optional<uint64_t> tensor_byte_count(DType dtype, const std::vector<int64_t>& shape);

/// A string from the file as error messages show it (at most 64 bytes, NUL as \0).
std::string untrusted(const std::string& s);

/// One tensor of the header, checked against the data buffer's size.
struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

/// The tensors of `header` (JSON text) and, when `metadata` is not null, its
/// __metadata__; every problem raises io_error naming `path`, the first in text
/// order; an allocation failure raises std::bad_alloc.
std::vector<Entry> parse_header(const std::string& path, const std::string& header, uint64_t buffer_bytes,
                                std::map<std::string, std::string>* metadata);

}  // namespace dsaib::io
