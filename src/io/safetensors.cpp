// safetensors reader and writer (include/dsaib/safetensors.hpp).
//
// The reader trusts nothing in the file: every size, offset and JSON type is
// checked before it is used, and every failure is a dsaib::Error(io_error)
// whose message starts with the file's path (out_of_memory when a tensor's
// bytes cannot be allocated).
#include "dsaib/safetensors.hpp"
#include "io/output_path.hpp"
#include "io/safetensors_header.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <map>
#include <new>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "dsaib/error.hpp"

namespace dsaib {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

using json = nlohmann::json;
using io::Entry;
using io::io_fail;
using io::kMaxHeaderBytes;
using io::kMetadataKey;
using io::tensor_byte_count;
using io::untrusted;

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "BF16";
    case DType::f32: return "F32";
    case DType::i32: return "I32";
    case DType::f64: return "F64";
    case DType::e4m3: return "F8_E4M3";
  }
  return "UNKNOWN";
}

std::map<std::string, HostTensor> read_safetensors(const std::string& path,
                                                   std::map<std::string, std::string>* metadata) {
  if (metadata) metadata->clear();
  // A FIFO or a device would block or stream forever; a directory cannot be read.
  if (const char* kind = detail::non_regular_file_kind(path)) {
    io_fail(path, std::string("is ") + kind + ", not a safetensors file (expected a regular file)");
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) io_fail(path, std::string("cannot open for reading (") + std::strerror(errno) + ")");
  f.seekg(0, std::ios::end);
  const std::streamoff end_pos = f.tellg();
  if (!f || end_pos < 0) io_fail(path, "cannot determine the file size");
  const uint64_t file_bytes = static_cast<uint64_t>(end_pos);
  f.seekg(0, std::ios::beg);
  if (file_bytes < 8) {
    io_fail(path, "truncated: " + std::to_string(file_bytes) +
                      " bytes, but a safetensors file starts with an 8-byte header length");
  }
  unsigned char len_bytes[8];
  f.read(reinterpret_cast<char*>(len_bytes), 8);
  if (!f) io_fail(path, "cannot read the header length");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | len_bytes[i];
  if (header_bytes > file_bytes - 8) {
    io_fail(path, "header length " + std::to_string(header_bytes) + " exceeds the " + std::to_string(file_bytes - 8) +
                      " bytes that follow it (truncated or not a safetensors file)");
  }
  if (header_bytes > kMaxHeaderBytes) {
    io_fail(path, "header length " + std::to_string(header_bytes) + " exceeds the limit of " +
                      std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (header_bytes < 2) io_fail(path, "header length " + std::to_string(header_bytes) + " is too small for a JSON object");
  std::string header;
  try {
    header.resize(header_bytes);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::out_of_memory, path,
                path + ": header: expected room in host memory for its " + std::to_string(header_bytes) +
                    " bytes, got an allocation failure");
  }
  f.read(header.data(), static_cast<std::streamsize>(header_bytes));
  if (!f) io_fail(path, "cannot read the " + std::to_string(header_bytes) + "-byte header");
  const uint64_t buffer_bytes = file_bytes - 8 - header_bytes;

  // JSON text only: nlohmann would stop at a NUL (ignoring what follows) and skip a
  // byte-order mark; the format's reference reader refuses both.
  if (const auto nul = header.find('\0'); nul != std::string::npos) {
    io_fail(path, "header: a NUL byte at offset " + std::to_string(nul) + " (expected JSON text, padded with spaces)");
  }
  if (header.rfind("\xEF\xBB\xBF", 0) == 0) io_fail(path, "header: starts with a UTF-8 byte-order mark (expected JSON text)");
  std::vector<Entry> entries;
  try {
    entries = io::parse_header(path, header, buffer_bytes, metadata);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::out_of_memory, path,
                path + ": header: expected room in host memory for what its " + std::to_string(header_bytes) +
                    " bytes describe, got an allocation failure");
  }

  // No two tensors may share bytes.
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const Entry& a = *by_offset[i - 1];
    const Entry& b = *by_offset[i];
    if (b.begin < a.end) {
      io_fail(path, "tensors '" + untrusted(a.name) + "' [" + std::to_string(a.begin) + ", " + std::to_string(a.end) + ") and '" +
                        untrusted(b.name) + "' [" + std::to_string(b.begin) + ", " + std::to_string(b.end) + ") overlap");
    }
  }

  // The tensors cover the byte buffer exactly, in some order, with no hole and
  // nothing after the last one (as the format's reference reader requires).
  uint64_t covered = 0;
  for (const Entry* e : by_offset) {
    if (e->begin != covered) {
      io_fail(path, "tensor '" + untrusted(e->name) + "' starts at byte " + std::to_string(e->begin) + " of the data buffer, expected " +
                        std::to_string(covered) + " (the tensors must cover the buffer without holes)");
    }
    covered = e->end;
  }
  if (covered != buffer_bytes) {
    io_fail(path, "data buffer: expected " + std::to_string(covered) + " bytes (the end of the last tensor), got " +
                      std::to_string(buffer_bytes) + " (trailing bytes after the last tensor)");
  }

  std::map<std::string, HostTensor> out;
  const uint64_t data_start = 8 + header_bytes;
  for (const Entry* e : by_offset) {
    HostTensor t;
    t.dtype = e->dtype;
    t.shape = e->shape;
    try {
      t.bytes.resize(e->end - e->begin);
    } catch (const std::bad_alloc&) {
      throw Error(ErrorCode::out_of_memory, path,
                  path + ": tensor '" + untrusted(e->name) + "': expected room in host memory for its " +
                      std::to_string(e->end - e->begin) + " bytes, got an allocation failure");
    }
    if (!t.bytes.empty()) {
      f.seekg(static_cast<std::streamoff>(data_start + e->begin), std::ios::beg);
      f.read(reinterpret_cast<char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
      if (!f) io_fail(path, "tensor '" + untrusted(e->name) + "': cannot read its " + std::to_string(t.bytes.size()) + " bytes");
    }
    out.emplace(e->name, std::move(t));
  }
  return out;
}

namespace detail {

std::string resolve_output_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path t = path;
  for (int hops = 0; fs::is_symlink(fs::symlink_status(t, ec)); ++hops) {
    if (hops == 40) io_fail(path, "too many levels of symbolic links");
    const fs::path next = fs::read_symlink(t, ec);
    if (ec) io_fail(path, "cannot read the symbolic link " + t.string() + " (" + ec.message() + ")");
    t = next.is_relative() ? t.parent_path() / next : next;
  }
  return t.string();
}

const char* non_regular_file_kind(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st) || fs::is_regular_file(st)) return nullptr;
  return fs::is_directory(st)        ? "a directory"
         : fs::is_fifo(st)           ? "a FIFO"
         : fs::is_character_file(st) ? "a character device"
         : fs::is_block_file(st)     ? "a block device"
         : fs::is_socket(st)         ? "a socket"
                                     : "not a regular file";
}

}  // namespace detail

void write_safetensors(const std::string& path, const std::map<std::string, HostTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // The header is JSON, which holds UTF-8 text only: refused here, before the file
  // is touched, rather than by the serialiser halfway through.
  const auto require_utf8 = [](const std::string& text, const std::string& argument, const std::string& what) {
    try {
      (void)json(text).dump();
    } catch (const json::type_error&) {
      throw Error(ErrorCode::invalid_argument, argument,
                  what + ": expected UTF-8 text (the safetensors header is JSON), got bytes that are not UTF-8");
    }
  };
  for (const auto& [k, v] : metadata) {
    require_utf8(k, "metadata", "metadata key");
    require_utf8(v, "metadata", "metadata value of a key");
  }
  for (const auto& entry : tensors) require_utf8(entry.first, "tensors", "tensor name");
  json header = json::object();
  if (!metadata.empty()) {
    json m = json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header[kMetadataKey] = std::move(m);
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == kMetadataKey) {
      throw Error(ErrorCode::invalid_argument, name, "tensor name '__metadata__' is reserved by the safetensors format");
    }
    for (int64_t d : t.shape) {
      if (d < 0) {
        throw Error(ErrorCode::invalid_argument, name,
                    "tensor '" + name + "': expected non-negative sizes, got " + json(t.shape).dump());
      }
    }
    // The byte count in 64 bits, as the reader requires.
    const std::optional<uint64_t> bytes = tensor_byte_count(t.dtype, t.shape);
    if (!bytes) {
      throw Error(ErrorCode::invalid_argument, name,
                  "tensor '" + name + "': expected a shape whose byte count fits in 64 bits, got " +
                      json(t.shape).dump() + " of dtype " + dtype_name(t.dtype));
    }
    const uint64_t need = *bytes;
    if (t.bytes.size() != need) {
      throw Error(ErrorCode::invalid_argument, name,
                  "tensor '" + name + "': expected " + std::to_string(need) + " bytes for dtype " +
                      dtype_name(t.dtype) + " and shape " + json(t.shape).dump() + ", got " +
                      std::to_string(t.bytes.size()));
    }
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + need}}};
    offset += need;
  }
  std::string text = header.dump();
  // Pad with spaces so that the data buffer starts 8-byte aligned (as the reference writer does).
  text.append((8 - text.size() % 8) % 8, ' ');

  // The file to replace: a symbolic link's target (the link stays; a dangling
  // link's target is created); an existing non-regular file (FIFO, device,
  // directory, socket) is refused, since renaming over it would replace it.
  const std::string target = detail::resolve_output_path(path);
  if (const char* kind = detail::non_regular_file_kind(target)) {
    io_fail(path, std::string("expected a regular file or a new path, got ") + kind + " (" + target +
                      "); it is not replaced");
  }
  // An existing file is replaced only where this process could write it (its
  // effective ids, as opening it for writing would require); the new file takes
  // its rwx permission bits (not setuid / setgid / sticky, not its owner).
  struct stat old_stat {};
  const bool replacing = ::stat(target.c_str(), &old_stat) == 0;
  if (replacing && ::faccessat(AT_FDCWD, target.c_str(), W_OK, AT_EACCESS) != 0) {
    io_fail(path, std::string("expected a writable file, got one this process may not write (") +
                      std::strerror(errno) + ", " + target + "); it is not replaced");
  }
  const mode_t mode = replacing ? (old_stat.st_mode & 0777) : 0666;
  // Write a temporary file next to the target, then rename it over the target. The
  // temporary is created with O_EXCL | O_NOFOLLOW: never an existing file or a link
  // planted at its (predictable) name; a name that exists is skipped for the next
  // one. It is created with the final mode less the umask (0666 & ~umask for a new
  // file, as any other new file of this process); a replaced file's own rwx bits
  // are then set exactly (fchmod: the umask does not narrow them). Its data reach
  // the disk (fsync) before the rename.
  struct Temporary {  // closes and removes the temporary on every way out, until kept
    int fd = -1;
    std::string name;
    bool keep = false;
    ~Temporary() {
      if (fd >= 0) ::close(fd);
      if (!keep && !name.empty()) std::remove(name.c_str());
    }
  } tmp;
  const std::string dir = std::filesystem::path(target).parent_path().string();
  for (int attempt = 0; attempt < 64 && tmp.fd < 0; ++attempt) {
    const std::string name = target + ".tmp." + std::to_string(::getpid()) + "." +
                             std::to_string(detail::temporary_name_counter()++);
    tmp.fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (tmp.fd >= 0) tmp.name = name;
    if (tmp.fd < 0 && errno != EEXIST) break;
  }
  if (tmp.fd < 0) {
    io_fail(path, std::string("cannot open for writing (no temporary file could be created in ") +
                      (dir.empty() ? std::string(".") : dir) + ": " + std::strerror(errno) + ")");
  }
  auto write_all = [fd = tmp.fd](const void* data, size_t size) {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd, p, size);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) errno = EIO;  // no progress on a regular file: report it as an I/O error
      if (n <= 0) return false;
      p += n;
      size -= static_cast<size_t>(n);
    }
    return true;
  };
  unsigned char len_bytes[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i, n >>= 8) len_bytes[i] = static_cast<unsigned char>(n & 0xff);
  bool ok = (!replacing || ::fchmod(tmp.fd, mode) == 0) && write_all(len_bytes, 8) &&
            write_all(text.data(), text.size());
  for (const auto& [name, t] : tensors) ok = ok && write_all(t.bytes.data(), t.bytes.size());
  ok = ok && ::fsync(tmp.fd) == 0;
  if (ok) {
    const int fd = tmp.fd;
    tmp.fd = -1;
    ok = ::close(fd) == 0;
  }
  if (!ok) io_fail(path, std::string("write failed (") + std::strerror(errno) + ")");
  std::error_code ec;
  std::filesystem::rename(tmp.name, target, ec);
  if (ec) io_fail(path, "cannot replace the file (" + ec.message() + ")");
  tmp.keep = true;
}

namespace detail {
std::atomic<unsigned>& temporary_name_counter() {
  static std::atomic<unsigned> counter{0};
  return counter;
}
}  // namespace detail

}  // namespace dsaib
