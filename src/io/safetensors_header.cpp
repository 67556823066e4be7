// The safetensors header's JSON (safetensors_header.hpp).
#include "io/safetensors_header.hpp"


#include <bit>
#include <cstdint>
#include <limits>
#include <map>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsaib/host_tensor.hpp"

namespace dsaib::io {

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

namespace {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

using json = nlohmann::json;

/// Bounds on what a header may make the reader hold or do (HeaderReader):
/// the same byte cap as the reference implementation (safetensors' MAX_HEADER_SIZE);
/// the nesting of a valid header (the header object, a tensor's object, its
/// shape or data_offsets array); tensors and metadata keys together, far above
/// any real file (2^20, a million; a model's shards hold thousands); dimensions
/// of a shape (numpy's limit, NPY_MAXDIMS).
constexpr size_t kMaxDepth = 3;
constexpr uint64_t kMaxEntries = uint64_t{1} << 20;
constexpr uint64_t kMaxRank = 64;



/// dtypes of the safetensors format that this library does not handle.
bool is_known_unsupported_dtype(const std::string& s) {
  static const char* const kOthers[] = {"BOOL", "U8",  "I8",  "U16", "I16",     "F16",     "U32",
                                        "U64",  "I64", "F8_E5M2", "F8_E8M0", "F6_E2M3",
                                        "F6_E3M2", "F4", "C64"};
  return std::find(std::begin(kOthers), std::end(kOthers), s) != std::end(kOthers);
}

bool parse_dtype(const std::string& s, DType* out) {
  if (s == "BF16") *out = DType::bf16;
  else if (s == "F32") *out = DType::f32;
  else if (s == "I32") *out = DType::i32;
  else if (s == "F64") *out = DType::f64;
  else if (s == "F8_E4M3") *out = DType::e4m3;
  else return false;
  return true;
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
    return io::describe(scalar);
  }
};

struct TensorFields {
  Member dtype, shape, data_offsets;
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
      io_fail(path, where + ": unsupported dtype " + untrusted(ds) + " (supported: BF16, F32, I32, F64, F8_E4M3)");
    }
    io_fail(path, where + ": unknown dtype \"" + untrusted(ds) + "\" (supported: BF16, F32, I32, F64, F8_E4M3)");
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

std::vector<Entry> parse_header(const std::string& path, const std::string& header, uint64_t buffer_bytes,
                                std::map<std::string, std::string>* metadata) {
  HeaderReader reader(path, buffer_bytes);
  if (!json::sax_parse(header, &reader)) io_fail(path, "header is not valid JSON");
  if (metadata) *metadata = std::move(reader.metadata());
  return std::move(reader.entries());
}

}  // namespace dsaib::io
