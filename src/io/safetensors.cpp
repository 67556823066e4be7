// safetensors reader and writer (include/dsaib/safetensors.hpp).
//
// The reader trusts nothing in the file: every size, offset and JSON type is
// checked before it is used, and every failure is a dsaib::Error(io_error)
// whose message starts with the file's path (out_of_memory when a tensor's
// bytes cannot be allocated).
#include "dsaib/safetensors.hpp"
#include "io/output_path.hpp"

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
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

using json = nlohmann::json;

/// Bounds on what a header may make the reader hold or do (HeaderReader):
/// the same byte cap as the reference implementation (safetensors' MAX_HEADER_SIZE);
/// the nesting of a valid header (the header object, a tensor's object, its
/// shape or data_offsets array); tensors and metadata keys together, far above
/// any real file (2^20, a million; a model's shards hold thousands); dimensions
/// of a shape (numpy's limit, NPY_MAXDIMS).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr size_t kMaxDepth = 3;
constexpr uint64_t kMaxEntries = uint64_t{1} << 20;
constexpr uint64_t kMaxRank = 64;
constexpr const char* kMetadataKey = "__metadata__";

[[noreturn]] void io_fail(const std::string& path, const std::string& message) {
  throw Error(ErrorCode::io_error, path, path + ": " + message);
}

/// numel * dtype size of a shape with non-negative sizes, for the reader and the
/// writer alike; nullopt when it does not fit in 64 bits. A size-0 dimension
/// makes 0 bytes whatever the other sizes (checked before any product).
std::optional<uint64_t> tensor_byte_count(DType dtype, const std::vector<int64_t>& shape) {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  uint64_t bytes = dtype_size(dtype);
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) return std::nullopt;
  }
  return bytes;
}

/// dtypes of the safetensors format that this library does not handle.
bool is_known_unsupported_dtype(const std::string& s) {
  static const char* const kOthers[] = {"BOOL", "U8",  "I8",  "U16", "I16",     "F16",     "U32",
                                        "U64",  "I64", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F6_E2M3",
                                        "F6_E3M2", "F4", "C64"};
  return std::find(std::begin(kOthers), std::end(kOthers), s) != std::end(kOthers);
}

bool parse_dtype(const std::string& s, DType* out) {
  if (s == "BF16") *out = DType::bf16;
  else if (s == "F32") *out = DType::f32;
  else if (s == "I32") *out = DType::i32;
  else if (s == "F64") *out = DType::f64;
  else return false;
  return true;
}

/// A string from the file (a tensor name, a key, a dtype) as error messages show
/// it: at most 64 bytes (cut before a UTF-8 continuation byte, then "..."), with
/// NUL as \0 so that what() does not end there. Other control characters are
/// left to the caller's output (the CLI escapes them for the terminal).
std::string untrusted(const std::string& s) {
  constexpr std::size_t kMax = 64;
  std::size_t n = s.size();
  bool cut = false;
  if (n > kMax) {
    n = kMax - 3;
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
    cut = true;
  }
  std::string out;
  out.reserve(n + 8);
  for (std::size_t i = 0; i < n; ++i) {
    if (s[i] == '\0') out += "\\0";
    else out += s[i];
  }
  if (cut) out += "...";
  return out;
}

/// A short description of a JSON scalar for error messages.
std::string describe(const json& j) {
  std::string s = j.dump();
  if (s.size() > 60) {
    std::size_t n = 57;
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // not inside a UTF-8 character
    s = s.substr(0, n) + "...";
  }
  return s;
}

/// A non-negative JSON integer, else an io_error naming `what`.
uint64_t get_unsigned(const json& j, const std::string& path, const std::string& what) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    if (v >= 0) return static_cast<uint64_t>(v);
    io_fail(path, what + ": expected a non-negative integer, got " + std::to_string(v));
  }
  io_fail(path, what + ": expected a non-negative integer, got " + describe(j));
}

/// One member of a tensor's object (dtype, shape or data_offsets) as the checks
/// need it: a scalar kept whole; an array's length and its first
/// kMaxRank + 1 elements (scalars: the nesting bound leaves no room for more);
/// an object's member count. Nothing else is kept, whatever the header holds.
struct Member {
  enum class Kind { absent, scalar, array, object } kind = Kind::absent;
  json scalar;
  uint64_t size = 0;        // array elements or object members
  std::vector<json> items;  // the first kMaxRank + 1 array elements

  std::string describe() const {
    if (kind == Kind::array) return "an array of " + std::to_string(size) + " element(s)";
    if (kind == Kind::object) return "an object of " + std::to_string(size) + " member(s)";
    return dsaib::describe(scalar);
  }
};

struct TensorFields {
  Member dtype, shape, data_offsets;
};

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

/// The checks of one tensor's object, in the order its members are described.
Entry parse_entry(const std::string& path, const std::string& name, const TensorFields& f, uint64_t buffer_bytes) {
  const std::string where = "tensor '" + untrusted(name) + "'";
  for (const auto& [key, member] : {std::pair<const char*, const Member*>{"dtype", &f.dtype},
                                    {"shape", &f.shape},
                                    {"data_offsets", &f.data_offsets}}) {
    if (member->kind == Member::Kind::absent) io_fail(path, where + ": missing \"" + key + "\"");
  }
  Entry e;
  e.name = name;
  if (f.dtype.kind != Member::Kind::scalar || !f.dtype.scalar.is_string()) {
    io_fail(path, where + ": dtype: expected a string, got " + f.dtype.describe());
  }
  const std::string ds = f.dtype.scalar.get<std::string>();
  if (!parse_dtype(ds, &e.dtype)) {
    if (is_known_unsupported_dtype(ds)) {
      io_fail(path, where + ": unsupported dtype " + untrusted(ds) + " (supported: BF16, F32, I32, F64)");
    }
    io_fail(path, where + ": unknown dtype \"" + untrusted(ds) + "\" (supported: BF16, F32, I32, F64)");
  }
  if (f.shape.kind != Member::Kind::array) {
    io_fail(path, where + ": shape: expected an array of sizes, got " + f.shape.describe());
  }
  if (f.shape.size > kMaxRank) {
    io_fail(path, where + ": shape: expected at most " + std::to_string(kMaxRank) + " dimensions, got " +
                      std::to_string(f.shape.size));
  }
  for (size_t i = 0; i < f.shape.items.size(); ++i) {
    const uint64_t d = get_unsigned(f.shape.items[i], path, where + ": shape[" + std::to_string(i) + "]");
    if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      io_fail(path, where + ": shape[" + std::to_string(i) + "] = " + std::to_string(d) + " is too large");
    }
    e.shape.push_back(static_cast<int64_t>(d));
  }
  if (f.data_offsets.kind != Member::Kind::array || f.data_offsets.size != 2) {
    io_fail(path, where + ": data_offsets: expected [begin, end], got " + f.data_offsets.describe());
  }
  e.begin = get_unsigned(f.data_offsets.items[0], path, where + ": data_offsets[0]");
  e.end = get_unsigned(f.data_offsets.items[1], path, where + ": data_offsets[1]");
  if (e.begin > e.end) {
    io_fail(path, where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                      "]: begin is after end");
  }
  if (e.end > buffer_bytes) {
    io_fail(path, where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                      "] run past the end of the data buffer (" + std::to_string(buffer_bytes) +
                      " bytes; truncated file?)");
  }
  // A size that does not fit in 64 bits cannot match the offsets.
  const std::optional<uint64_t> bytes = tensor_byte_count(e.dtype, e.shape);
  if (!bytes || e.end - e.begin != *bytes) {
    io_fail(path, where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "] span " +
                      std::to_string(e.end - e.begin) + " bytes, but dtype " + ds + " and shape " + shape_string(e.shape) +
                      " need " + (bytes ? std::to_string(*bytes) : std::string("more than 2^64 bytes")));
  }
  return e;
}

/// The header's JSON, read as a stream of events (nlohmann's SAX interface) into
/// the tensor entries and the metadata: no document tree is built, so time and
/// memory stay linear in the header's size. Every problem raises io_error at the
/// event that shows it, so a header reports the first of its problems in text
/// order. The bounds:
///   - nesting depth kMaxDepth (3): the header object, a tensor's object, its
///     shape or data_offsets array; anything deeper is refused where it starts;
///   - kMaxEntries tensors and metadata keys together;
///   - a tensor's shape at most kMaxRank dimensions;
///   - members of a tensor's object other than dtype, shape and data_offsets
///     are skipped (the format defines none) and keep nothing.
/// Duplicate keys (in the header object, in __metadata__, among a tensor's
/// dtype, shape and data_offsets) are refused: keeping the last one would hide
/// a tensor.
class HeaderReader final : public nlohmann::json_sax<json> {
 public:
  HeaderReader(const std::string& path, uint64_t buffer_bytes) : path_(path), buffer_bytes_(buffer_bytes) {}

  std::vector<Entry>& entries() { return entries_; }
  std::map<std::string, std::string>& metadata() { return metadata_; }

  bool null() override { return scalar(json(nullptr)); }
  bool boolean(bool v) override { return scalar(json(v)); }
  bool number_integer(number_integer_t v) override { return scalar(json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return scalar(json(v)); }
  bool number_float(number_float_t v, const string_t&) override { return scalar(json(v)); }
  bool binary(binary_t&) override { return scalar(json(nullptr)); }  // not produced by the JSON parser
  bool string(string_t& v) override {
    if (!frames_.empty() && frames_.back() == Frame::metadata) {
      metadata_.emplace(key_, std::move(v));
      return true;
    }
    return scalar(json(std::move(v)));
  }

  bool start_object(std::size_t) override { return start(Frame::member_object, "an object"); }
  bool start_array(std::size_t) override { return start(Frame::member_array, "an array"); }
  bool end_object() override { return end(); }
  bool end_array() override { return end(); }

  bool key(string_t& k) override {
    switch (frames_.back()) {
      case Frame::header:
        if (!names_.insert(k).second) duplicate(k);
        if (k != kMetadataKey) count_entry();  // the limit counts tensors and metadata keys
        key_ = std::move(k);
        break;
      case Frame::metadata:
        if (metadata_.count(k)) duplicate(k);
        count_entry();
        key_ = std::move(k);
        break;
      case Frame::tensor:
        member_ = k == "dtype" ? &fields_.dtype : k == "shape" ? &fields_.shape : k == "data_offsets" ? &fields_.data_offsets
                                                                                                    : nullptr;
        if (member_ && member_->kind != Member::Kind::absent) duplicate(k);
        break;
      case Frame::member_object:
        if (capturing()) ++member_->size;
        break;
      case Frame::member_array:
        break;
    }
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    std::string msg = e.what();
    // "[json.exception.parse_error.101] parse error at line 1, column 5: ..." -> keep the part after the tag.
    const auto tag_end = msg.find("] ");
    if (msg.rfind("[json.exception", 0) == 0 && tag_end != std::string::npos) msg = msg.substr(tag_end + 2);
    io_fail(path_, "header is not valid JSON (" + msg + ")");
  }

 private:
  /// Where the parser is: the open objects and arrays, innermost last.
  enum class Frame { header, metadata, tensor, member_object, member_array };

  /// A tensor member (dtype, shape or data_offsets) is being read into member_.
  bool capturing() const { return member_ != nullptr; }
  std::string tensor_where() const { return "tensor '" + untrusted(key_) + "'"; }

  [[noreturn]] void duplicate(const std::string& k) { io_fail(path_, "header: duplicate key \"" + untrusted(k) + "\""); }

  void count_entry() {
    if (++entry_count_ > kMaxEntries) {
      io_fail(path_, "header: more than " + std::to_string(kMaxEntries) +
                         " tensors and metadata keys (the limit of this reader)");
    }
  }

  /// A value where the header says what it must be: only an object or a string
  /// may appear at the first two levels; below a tensor member everything goes
  /// to the member (checked when the tensor's object ends).
  bool scalar(json v) {
    if (frames_.empty()) io_fail(path_, "header: expected a JSON object, got " + describe(v));
    switch (frames_.back()) {
      case Frame::header:
        if (key_ == kMetadataKey) io_fail(path_, "__metadata__: expected an object of strings, got " + describe(v));
        io_fail(path_, tensor_where() + ": expected an object {dtype, shape, data_offsets}, got " + describe(v));
      case Frame::metadata:
        io_fail(path_, "__metadata__[\"" + untrusted(key_) + "\"]: expected a string, got " + describe(v));
      case Frame::tensor:
        if (capturing()) {
          member_->kind = Member::Kind::scalar;
          member_->scalar = std::move(v);
        }
        break;
      case Frame::member_array:
        if (capturing()) {
          if (member_->items.size() <= kMaxRank) member_->items.push_back(std::move(v));
          ++member_->size;
        }
        break;
      case Frame::member_object:
        break;
    }
    return true;
  }

  /// An object or array opens: `nested` is its frame below a tensor member,
  /// `what` its description ("an object", "an array").
  bool start(Frame nested, const char* what) {
    const bool object = nested == Frame::member_object;
    if (frames_.empty()) {
      if (!object) io_fail(path_, std::string("header: expected a JSON object, got ") + what);
      frames_.push_back(Frame::header);
      return true;
    }
    if (frames_.size() >= kMaxDepth) {
      io_fail(path_, "header: nested deeper than " + std::to_string(kMaxDepth) +
                         " levels (the header object, a tensor's object, its shape or data_offsets array)");
    }
    switch (frames_.back()) {
      case Frame::header:
        if (key_ == kMetadataKey) {
          if (!object) io_fail(path_, std::string("__metadata__: expected an object of strings, got ") + what);
          frames_.push_back(Frame::metadata);
        } else {
          if (!object) {
            io_fail(path_, tensor_where() + ": expected an object {dtype, shape, data_offsets}, got " + what);
          }
          fields_ = TensorFields();
          member_ = nullptr;
          frames_.push_back(Frame::tensor);
        }
        return true;
      case Frame::metadata:
        io_fail(path_, "__metadata__[\"" + untrusted(key_) + "\"]: expected a string, got " + what);
      case Frame::tensor:
        if (capturing()) member_->kind = object ? Member::Kind::object : Member::Kind::array;
        frames_.push_back(nested);
        return true;
      default:  // below kMaxDepth, only the frames above hold objects or arrays
        frames_.push_back(nested);
        return true;
    }
  }

  bool end() {
    const Frame closed = frames_.back();
    frames_.pop_back();
    if (closed == Frame::tensor) entries_.push_back(parse_entry(path_, key_, fields_, buffer_bytes_));
    return true;
  }

  const std::string& path_;
  const uint64_t buffer_bytes_;
  std::vector<Frame> frames_;
  std::string key_;                       // the current key of the header or __metadata__ object
  // Keys of the header object. Ordered: a hash set's buckets can be flooded by
  // names chosen to collide under std::hash (a fixed, public seed), which made
  // the duplicate check quadratic; compares cost O(log n) whatever the names.
  std::set<std::string> names_;
  uint64_t entry_count_ = 0;
  TensorFields fields_;                   // of the tensor being read
  Member* member_ = nullptr;              // the member of fields_ being read, if a known one
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "BF16";
    case DType::f32: return "F32";
    case DType::i32: return "I32";
    case DType::f64: return "F64";
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
    HeaderReader reader(path, buffer_bytes);
    if (!json::sax_parse(header, &reader)) io_fail(path, "header is not valid JSON");
    entries = std::move(reader.entries());
    if (metadata) *metadata = std::move(reader.metadata());
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
