// Reading and writing safetensors files (https://github.com/huggingface/safetensors):
// the format in which the CLI and scripts/dump_torch_step.py exchange problems.
//
// File layout:
//   8 bytes      N, the header length, unsigned little-endian
//   N bytes      UTF-8 JSON object:
//                  { "<name>": {"dtype": "BF16"|"F32"|"I32", "shape": [d0, ...],
//                               "data_offsets": [begin, end]}, ...,
//                    "__metadata__": {"<key>": "<string value>", ...} }   (optional)
//   the rest     the byte buffer; tensor <name> is bytes [begin, end) of it,
//                row-major, little-endian.
#pragma once

#include <map>
#include <string>

#include "dsaib/host_tensor.hpp"

namespace dsaib {

/// safetensors dtype string of a dtype: "BF16", "F32", "I32".
const char* safetensors_dtype_name(DType dtype);

/// Reads every tensor of a safetensors file. If `metadata` is non-null it
/// receives the "__metadata__" map (empty when the file has none).
///
/// Supported dtypes: BF16, F32, I32, F64. Raises dsaib::Error(ErrorCode::io_error)
/// with argument() == path and a message starting with the path for every
/// unreadable or malformed file: missing file, not a regular file (directory,
/// FIFO, device, socket: refused before opening), truncated file, header length
/// beyond the file, invalid JSON (a NUL byte or a leading byte-order mark in the
/// header included), a duplicate key (in the header object, in __metadata__, or
/// among a tensor's dtype, shape and data_offsets), a header that is not the
/// expected object, an unknown or unsupported dtype (named), negative,
/// non-integer or overflowing shapes, data_offsets out of the buffer,
/// overlapping each other or not matching numel * dtype size, non-string
/// metadata values. Members of a tensor's object other than dtype, shape and
/// data_offsets are ignored.
///
/// The header is read in time and memory linear in its size, within bounds on
/// everything a file controls; crossing one is an io_error too:
///   - the header: at most 100,000,000 bytes (as the format's reference reader);
///   - nesting: at most 3 levels (the header object, a tensor's object, its
///     shape or data_offsets array: all a valid header has);
///   - at most 2^20 (1,048,576) tensors and metadata keys together;
///   - a shape: at most 64 dimensions.
/// A header with several problems reports the first in its text.
/// A tensor (or a header) whose bytes cannot be allocated raises
/// dsaib::Error(ErrorCode::out_of_memory), same argument and message start.
std::map<std::string, HostTensor> read_safetensors(const std::string& path,
                                                   std::map<std::string, std::string>* metadata = nullptr);

/// Writes the tensors (in name order) and the metadata to `path`, replacing
/// the file: a temporary file next to it (created with O_EXCL | O_NOFOLLOW, so
/// never an existing file or a link planted at its name) is renamed over it, so
/// a reader never sees a half-written file (its data are synced to disk before
/// the rename). A replaced file keeps its rwx permission bits (not setuid,
/// setgid or sticky, and not its owner: the new file belongs to this process);
/// one this process may not write (effective ids) is not replaced (io_error).
/// A symbolic link is followed (its target is
/// replaced, the link stays). Raises dsaib::Error(invalid_argument) naming the
/// tensor when a tensor is inconsistent (negative size, a byte count past 64
/// bits, bytes.size() != numel * dtype size) or named "__metadata__", invalid_argument with argument() "tensors" /
/// "metadata" when a name, key or value is not UTF-8 (checked before the file is
/// touched), and dsaib::Error(io_error) when the file
/// cannot be written or when `path` (or a link's target) exists and is not a
/// regular file (directory, FIFO, device, socket), which is never replaced.
void write_safetensors(const std::string& path, const std::map<std::string, HostTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace dsaib
