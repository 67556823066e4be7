// safetensors reader/writer: round trips and every kind of malformed file.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "dsaib/error.hpp"
#include "dsaib/safetensors.hpp"
#include "io/output_path.hpp"
#include "support/test_support.hpp"

namespace {

using dsaib::DType;
using dsaib::test::kSanitizedBuild;
using dsaib::test::limit_address_space;
using dsaib::Error;
using dsaib::ErrorCode;
using dsaib::HostTensor;

// One directory per process: ctest may run test cases (and other builds) in parallel.
std::filesystem::path temp_dir() {
  return std::filesystem::path(::testing::TempDir()) / ("dsaib_safetensors_test." + std::to_string(::getpid()));
}

std::string temp_path(const std::string& name) {
  std::filesystem::create_directories(temp_dir());
  return (temp_dir() / name).string();
}

struct RemoveTempDir : ::testing::Environment {
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(temp_dir(), ec);
  }
};
[[maybe_unused]] ::testing::Environment* const remove_temp_dir = ::testing::AddGlobalTestEnvironment(new RemoveTempDir);

HostTensor random_tensor(DType dt, std::vector<int64_t> shape, uint32_t seed) {
  HostTensor t(dt, std::move(shape));
  std::mt19937 rng(seed);
  for (auto& b : t.bytes) b = static_cast<uint8_t>(rng());
  return t;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

/// A file with the given header text and data buffer.
std::string make_file(const std::string& header, const std::string& data, uint64_t header_len_override = UINT64_MAX) {
  uint64_t n = header_len_override == UINT64_MAX ? header.size() : header_len_override;
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i, n >>= 8) out[i] = static_cast<char>(n & 0xff);
  return out + header + data;
}

/// Expects read_safetensors(path) to raise io_error whose message contains every fragment.
void expect_io_error(const std::string& path, std::initializer_list<std::string> fragments) {
  try {
    dsaib::read_safetensors(path);
    ADD_FAILURE() << "expected io_error for " << path;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io_error) << e.what();
    EXPECT_EQ(e.argument(), path);
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(path, 0), 0u) << "message should start with the path: " << msg;
    for (const auto& frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << "'" << frag << "' not in: " << msg;
  }
}

void expect_bad_header(const std::string& name, const std::string& header, const std::string& data,
                       std::initializer_list<std::string> fragments) {
  const std::string path = temp_path(name);
  write_bytes(path, make_file(header, data));
  expect_io_error(path, fragments);
}

/// In a child process: reads a (sparse) file holding one 1 GiB tensor under an
/// address-space limit 64 MiB above what is mapped; exits 0 when the reader
/// raised out_of_memory naming the path and the tensor, else a code that says
/// which check failed.
/// Removes the folder of `path` (the child's own copy; see below), then _Exit(code).
[[noreturn]] void exit_removing(const std::string& path, int code) {
  std::error_code ec;
  std::filesystem::remove_all(std::filesystem::path(path).parent_path(), ec);
  std::_Exit(code);
}

[[noreturn]] void read_under_memory_limit(const std::string& path) {
  // The death test re-runs the test body in the child, which writes its own copy of
  // the file under its own pid's folder: remove that folder before every exit.
  if (!limit_address_space(size_t{64} << 20)) exit_removing(path, 11);
  try {
    dsaib::read_safetensors(path);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::out_of_memory) exit_removing(path, 12);
    const std::string msg = e.what();
    if (e.argument() != path || msg.rfind(path + ": tensor 'big': expected room in host memory", 0) != 0) {
      exit_removing(path, 13);
    }
    exit_removing(path, 0);
  } catch (...) {
    exit_removing(path, 14);
  }
  exit_removing(path, 15);  // it read the tensor: the limit did not bite
}

TEST(Safetensors, TensorBeyondHostMemoryIsOutOfMemory) {
  if (kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  constexpr uint64_t kBytes = uint64_t{1} << 30;
  const std::string path = temp_path("big.safetensors");
  const std::string header = "{\"big\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(kBytes / 4) +
                             "],\"data_offsets\":[0," + std::to_string(kBytes) + "]}}";
  write_bytes(path, make_file(header, ""));
  ASSERT_EQ(truncate(path.c_str(), static_cast<off_t>(8 + header.size() + kBytes)), 0);  // sparse: no disk used
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(read_under_memory_limit(path), ::testing::ExitedWithCode(0), "");
  std::filesystem::remove(path);
}

TEST(Safetensors, RoundTripEveryDtypeAndMetadata) {
  std::map<std::string, HostTensor> tensors;
  tensors["a_bf16"] = random_tensor(DType::bf16, {2, 3, 4, 5}, 1);
  tensors["b_f32"] = random_tensor(DType::f32, {7, 3}, 2);
  tensors["c_i32"] = random_tensor(DType::i32, {11}, 3);
  tensors["d_scalar"] = random_tensor(DType::f32, {}, 4);
  tensors["e_empty"] = HostTensor(DType::bf16, {0, 5});
  tensors["f_odd"] = random_tensor(DType::bf16, {3}, 5);  // 6 bytes: later tensors are unaligned
  tensors["g_after_odd"] = random_tensor(DType::i32, {1, 2, 3}, 6);
  tensors["h_f64"] = random_tensor(DType::f64, {2, 3}, 7);  // after the odd tensor: unaligned in the file
  const std::map<std::string, std::string> meta = {{"sm_scale", "0.088388"}, {"layout", "bshd"}, {"empty", ""}};
  const std::string path = temp_path("roundtrip.safetensors");
  dsaib::write_safetensors(path, tensors, meta);

  std::map<std::string, std::string> meta_back;
  const auto back = dsaib::read_safetensors(path, &meta_back);
  EXPECT_EQ(meta_back, meta);
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(back.count(name)) << name;
    const HostTensor& b = back.at(name);
    EXPECT_EQ(b.dtype, t.dtype) << name;
    EXPECT_EQ(b.shape, t.shape) << name;
    EXPECT_EQ(b.bytes, t.bytes) << name;
  }
  // The header is padded so that the data buffer starts 8-byte aligned.
  const std::string raw = read_bytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(raw[i]);
  EXPECT_EQ(n % 8, 0u);
  // No metadata requested: fine too; a file without metadata gives an empty map.
  EXPECT_EQ(dsaib::read_safetensors(path).size(), tensors.size());
  dsaib::write_safetensors(path, tensors);
  dsaib::read_safetensors(path, &meta_back);
  EXPECT_TRUE(meta_back.empty());
}

TEST(Safetensors, ReadsForeignLayoutAndDtypeNames) {
  // As the Python writer emits it: metadata last, unsorted names, trailing-space padding.
  const std::string data = std::string("\x01\x00\x00\x00\x02\x00\x00\x00", 8) + std::string("\x80\x3f", 2);
  const std::string header =
      R"({"w":{"dtype":"BF16","shape":[1],"data_offsets":[8,10]},"ids":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}})"
      "    ";
  const std::string path = temp_path("foreign.safetensors");
  write_bytes(path, make_file(header, data));
  std::map<std::string, std::string> meta;
  const auto t = dsaib::read_safetensors(path, &meta);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(meta.at("format"), "pt");
  EXPECT_EQ(t.at("ids").dtype, DType::i32);
  EXPECT_EQ(t.at("ids").data<int32_t>()[1], 2);
  EXPECT_EQ(t.at("w").dtype, DType::bf16);
  EXPECT_EQ(t.at("w").data<uint16_t>()[0], 0x3f80);
  EXPECT_STREQ(dsaib::safetensors_dtype_name(DType::bf16), "BF16");
  EXPECT_STREQ(dsaib::safetensors_dtype_name(DType::f32), "F32");
  EXPECT_STREQ(dsaib::safetensors_dtype_name(DType::i32), "I32");
  EXPECT_STREQ(dsaib::safetensors_dtype_name(DType::f64), "F64");
}

TEST(Safetensors, MissingFileAndDirectory) {
  expect_io_error(temp_path("does_not_exist.safetensors"), {"cannot open"});
  expect_io_error(std::filesystem::path(temp_path("x")).parent_path().string(), {"is a directory, not a safetensors file"});
  // Not regular files: refused before opening (a FIFO would block the reader forever).
  const std::string fifo = temp_path("pipe.safetensors");
  std::filesystem::remove(fifo);
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  expect_io_error(fifo, {"is a FIFO, not a safetensors file"});
  expect_io_error("/dev/zero", {"is a character device, not a safetensors file"});
}

TEST(Safetensors, HeaderWithNulOrByteOrderMarkIsAnError) {
  const std::string ok = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  expect_bad_header("nul_pad.safetensors", ok + std::string("\0\0\0", 3), std::string(4, '\0'),
                    {"header: a NUL byte at offset " + std::to_string(ok.size())});
  expect_bad_header("nul_mid.safetensors", R"({"x":{"dtype":"F32",)" + std::string(1, '\0') + R"("shape":[1],"data_offsets":[0,4]}})",
                    std::string(4, '\0'), {"header: a NUL byte at offset 20"});
  expect_bad_header("bom.safetensors", "\xEF\xBB\xBF" + ok, std::string(4, '\0'), {"byte-order mark"});
}

TEST(Safetensors, TruncatedFiles) {
  const std::string path = temp_path("trunc.safetensors");
  write_bytes(path, "");
  expect_io_error(path, {"truncated", "0 bytes"});
  write_bytes(path, std::string("\x10\x00\x00", 3));
  expect_io_error(path, {"truncated", "3 bytes"});

  // A good file cut inside its header, and cut inside its data buffer.
  std::map<std::string, HostTensor> tensors{{"x", random_tensor(DType::f32, {4, 4}, 7)}};
  dsaib::write_safetensors(path, tensors);
  const std::string good = read_bytes(path);
  write_bytes(path, good.substr(0, 20));
  expect_io_error(path, {"header length", "exceeds"});
  write_bytes(path, good.substr(0, good.size() - 1));
  expect_io_error(path, {"tensor 'x'", "past the end of the data buffer", "truncated"});
}

TEST(Safetensors, HeaderLengthTooLarge) {
  const std::string path = temp_path("hugelen.safetensors");
  write_bytes(path, make_file("{}", "", 1ull << 62));
  expect_io_error(path, {"header length 4611686018427387904", "exceeds"});
  write_bytes(path, make_file("{}", "", UINT64_MAX - 1));
  expect_io_error(path, {"header length", "exceeds"});
}

TEST(Safetensors, BadJson) {
  expect_bad_header("badjson1.safetensors", R"({"x": {"dtype": "F32", )", "", {"not valid JSON"});
  expect_bad_header("badjson2.safetensors", "\xff\xfe garbage", "", {"not valid JSON"});
  expect_bad_header("badjson3.safetensors", "[1, 2, 3]", "", {"expected a JSON object"});
  expect_bad_header("badjson4.safetensors", R"({"x": 5})", "", {"tensor 'x'", "expected an object"});
  expect_bad_header("badjson5.safetensors", R"({"x": {"dtype": "F32", "shape": [1]}})", "", {"missing \"data_offsets\""});
  expect_bad_header("badjson6.safetensors", R"({"__metadata__": {"a": 1}})", "", {"__metadata__", "expected a string"});
  expect_bad_header("badjson7.safetensors", R"({"__metadata__": [1]})", "", {"__metadata__", "expected an object"});
}

TEST(Safetensors, DeeplyNestedHeaderIsAnErrorNotACrash) {
  // A 200 KB header (far below the 100 MB cap) of 100000 nested arrays, and a
  // tensor entry that is such an array. The error message must not serialise
  // the whole value recursively (that overflows the stack: SIGSEGV).
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  expect_bad_header("deep_root.safetensors", deep, "", {"expected a JSON object"});
  expect_bad_header("deep_entry.safetensors", R"({"x": )" + deep + "}", "", {"tensor 'x'", "expected an object"});
  expect_bad_header("deep_metadata.safetensors", R"({"__metadata__": {"a": )" + deep + "}}", "",
                    {"__metadata__", "expected a string"});
}

/// CPU seconds this process has used (not wall time: the machine may be busy).
double cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

/// A header of `n` comma-separated items made by `item(i)`, in braces.
std::string object_of(size_t n, const std::function<std::string(size_t)>& item) {
  std::string h = "{";
  for (size_t i = 0; i < n; ++i) h += (i ? "," : "") + item(i);
  return h + "}";
}

// The header is read in time linear in its size. A duplicate-key check through
// nlohmann-json's DOM callback parser, whose end_object is linear in the
// object's size, takes minutes on 200000 empty entries (2.3 MB).
TEST(Safetensors, HeaderParseIsLinearInItsSize) {
  const std::string empty_entries =
      object_of(200000, [](size_t i) { return "\"" + std::to_string(i) + "\":{}"; });
  const std::string many = temp_path("many_entries.safetensors");
  write_bytes(many, make_file(empty_entries, ""));
  double t0 = cpu_seconds();
  expect_io_error(many, {"tensor '0': missing \"dtype\""});
  EXPECT_LT(cpu_seconds() - t0, 1.0) << "200000 empty entries";

  // 200000 valid empty tensors (11.7 MB of header) are read, in well under a second of work.
  const std::string valid_entries = object_of(200000, [](size_t i) {
    return "\"t" + std::to_string(i) + R"(":{"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
  });
  const std::string valid = temp_path("many_valid.safetensors");
  write_bytes(valid, make_file(valid_entries, ""));
  t0 = cpu_seconds();
  const auto tensors = dsaib::read_safetensors(valid);
  EXPECT_LT(cpu_seconds() - t0, 3.0) << "200000 valid empty tensors";
  EXPECT_EQ(tensors.size(), 200000u);
  EXPECT_EQ(tensors.at("t199999").shape, (std::vector<int64_t>{0}));
  std::filesystem::remove(many);
  std::filesystem::remove(valid);
}

/// `n` distinct 16-byte ASCII names that libstdc++'s std::hash<std::string> maps
/// to one value (its _Hash_bytes has a fixed, public seed, so its second 8-byte
/// block can be solved for a chosen state): a hash set of them degrades to a
/// list. Returned as JSON string bodies (control characters, '"' and '\\' as
/// \u00XX, which the parser decodes to those bytes).
std::vector<std::string> colliding_names(size_t n) {
  const uint64_t mul = (uint64_t{0xc6a4a793u} << 32) + 0x5bd1e995u, seed = 0xc70f6907u;
  auto shift_mix = [](uint64_t v) { return v ^ (v >> 47); };
  uint64_t mul_inv = mul;  // Newton's iteration for the inverse mod 2^64
  for (int i = 0; i < 6; ++i) mul_inv *= 2 - mul * mul_inv;
  auto ascii = [](uint64_t v) { return (v & 0x8080808080808080ULL) == 0; };
  const uint64_t h0 = seed ^ (16 * mul), target = 0x123456789abcdefULL;
  std::mt19937_64 rng(1);
  std::vector<std::string> names;
  while (names.size() < n) {
    uint64_t a1 = 0;
    for (int i = 0; i < 8; ++i) a1 |= uint64_t(0x21 + rng() % 90) << (8 * i);
    const uint64_t h1 = (h0 ^ (shift_mix(a1 * mul) * mul)) * mul;
    const uint64_t a2 = shift_mix((h1 ^ target) * mul_inv) * mul_inv;
    if (!ascii(a2)) continue;
    std::string s(16, '\0');
    std::memcpy(s.data(), &a1, 8);
    std::memcpy(s.data() + 8, &a2, 8);
    names.push_back(s);
  }
  return names;
}

// Names chosen to collide in a hash table (hash flooding) cost no more than
// other names: the duplicate-key check does not hash the names.
TEST(Safetensors, HeaderParseIsLinearForCollidingNames) {
  const std::vector<std::string> names = colliding_names(50000);
  ASSERT_EQ(std::hash<std::string>{}(names[0]), std::hash<std::string>{}(names[1]))
      << "the names no longer collide under this standard library's std::hash";
  auto json_body = [](const std::string& name) {
    std::string out;
    for (const char c : name) {
      if (static_cast<unsigned char>(c) < 0x20 || c == '"' || c == '\\') {
        char esc[8];
        std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
        out += esc;
      } else {
        out += c;
      }
    }
    return out;
  };
  const std::string entries = object_of(names.size(), [&](size_t i) {
    return "\"" + json_body(names[i]) + R"(":{"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
  });
  const std::string path = temp_path("colliding_names.safetensors");
  write_bytes(path, make_file(entries, ""));
  const double t0 = cpu_seconds();
  const auto tensors = dsaib::read_safetensors(path);
  EXPECT_LT(cpu_seconds() - t0, 1.5) << "50000 names of one hash value";
  EXPECT_EQ(tensors.size(), names.size());
  std::filesystem::remove(path);
}

// Strings from the file reach error messages bounded (64 bytes) and whole: a NUL
// shows as \0 instead of ending what() there.
TEST(Safetensors, FileStringsInErrorsAreBoundedAndKeepTheirEnd) {
  const std::string d(4, '\0');
  const std::string long_dtype(1 << 20, 'X');
  const std::string path = temp_path("long_dtype.safetensors");
  write_bytes(path, make_file(R"({"x":{"dtype":")" + long_dtype + R"(","shape":[1],"data_offsets":[0,4]}})", d));
  try {
    dsaib::read_safetensors(path);
    ADD_FAILURE() << "no error";
  } catch (const dsaib::Error& e) {
    EXPECT_EQ(e.code(), dsaib::ErrorCode::io_error);
    EXPECT_LT(std::string(e.what()).size(), 400u) << e.what();
    EXPECT_NE(std::string(e.what()).find("...\" (supported: BF16, F32, I32, F64, F8_E4M3)"), std::string::npos) << e.what();
  }
  write_bytes(path, make_file(R"({"x":{"dtype":"F32\u0000","shape":[1],"data_offsets":[0,4]}})", d));
  expect_io_error(path, {"unknown dtype \"F32\\0\" (supported: BF16, F32, I32, F64, F8_E4M3)"});
  std::filesystem::remove(path);
}

// Bounds on what a header can make the reader hold: tensors and metadata keys
// (2^20 together), nesting (3 levels), dimensions of a shape (64). Each is an
// io_error naming the file, found where the header crosses it.
TEST(Safetensors, HeaderBoundsAreIoErrors) {
  const std::string d(4, '\0');
  const std::string keys = object_of((size_t{1} << 20) + 1, [](size_t i) { return "\"" + std::to_string(i) + "\":\"\""; });
  const std::string meta = temp_path("bound_entries.safetensors");
  write_bytes(meta, make_file(R"({"__metadata__":)" + keys + "}", ""));
  const double t0 = cpu_seconds();
  expect_io_error(meta, {"header: more than 1048576 tensors and metadata keys"});
  EXPECT_LT(cpu_seconds() - t0, 3.0);
  std::filesystem::remove(meta);

  expect_bad_header("bound_depth1.safetensors", R"({"x": {"dtype": "F32", "shape": [[1]], "data_offsets": [0, 4]}})", d,
                    {"header: nested deeper than 3 levels"});
  expect_bad_header("bound_depth2.safetensors",
                    R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": {"a": [1]}}})", d,
                    {"header: nested deeper than 3 levels"});
  const auto ones = [](int rank) {
    std::string s = "[";
    for (int i = 0; i < rank; ++i) s += i ? ",1" : "1";
    return s + "]";
  };
  expect_bad_header("bound_rank.safetensors",
                    R"({"x": {"dtype": "F32", "shape": )" + ones(65) + R"(, "data_offsets": [0, 4]}})", d,
                    {"tensor 'x': shape: expected at most 64 dimensions, got 65"});
  // 64 dimensions are read; members the format does not define are skipped (a
  // repeated key inside one of them included: nothing of them is kept).
  const std::string rank64 = ones(64);
  const std::string ok = temp_path("rank64.safetensors");
  write_bytes(ok, make_file(R"({"x": {"dtype": "F32", "shape": )" + rank64 +
                                R"(, "data_offsets": [0, 4], "note": {"a": 1, "a": "2"}, "more": [2, 3]}})",
                            d));
  EXPECT_EQ(dsaib::read_safetensors(ok).at("x").shape, std::vector<int64_t>(64, 1));
}

/// In a child process: reads `path` under an address-space limit of what is
/// mapped plus 512 MiB (the 100 MB header read into memory, then little more);
/// exits 0 when the reader raised io_error naming the path with `fragment` in
/// its message, else a code that says which check failed.
[[noreturn]] void read_deep_header_under_memory_limit(const std::string& path, const std::string& fragment) {
  if (!limit_address_space(size_t{512} << 20)) exit_removing(path, 11);
  try {
    dsaib::read_safetensors(path);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::io_error) exit_removing(path, 12);  // out_of_memory: the header grew a tree
    const std::string msg = e.what();
    if (e.argument() != path || msg.rfind(path + ": ", 0) != 0 || msg.find(fragment) == std::string::npos) {
      exit_removing(path, 13);
    }
    exit_removing(path, 0);
  } catch (...) {
    exit_removing(path, 14);
  }
  exit_removing(path, 15);
}

// A 100 MB header of nested arrays (the format's cap) is an io_error found where
// the nesting passes 3 levels, in memory about the header's size: a document
// tree of it would take 3.9 GB and fail as out_of_memory.
TEST(Safetensors, DeeplyNestedHundredMegabyteHeaderIsAnIoErrorInBoundedMemory) {
  if (kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  constexpr size_t kHeaderBytes = 100'000'000;
  const std::string path = temp_path("deep100.safetensors");
  const std::string open = R"({"x":{"shape":)", close = "}}";
  const size_t levels = (kHeaderBytes - open.size() - close.size()) / 2;
  std::string header = open + std::string(levels, '[') + std::string(levels, ']') + close;
  header.resize(kHeaderBytes, ' ');
  write_bytes(path, make_file(header, ""));
  header.clear();
  header.shrink_to_fit();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(read_deep_header_under_memory_limit(path, "header: nested deeper than 3 levels"),
              ::testing::ExitedWithCode(0), "");
  std::filesystem::remove(path);
}

TEST(Safetensors, WrongDtypeStrings) {
  const std::string d(4, '\0');
  expect_bad_header("dtype1.safetensors", R"({"x": {"dtype": "F17", "shape": [1], "data_offsets": [0, 4]}})", d,
                    {"tensor 'x'", "unknown dtype \"F17\"", "BF16, F32, I32, F64"});
  expect_bad_header("dtype2.safetensors", R"({"x": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}})", d,
                    {"tensor 'x'", "unsupported dtype F16"});
  expect_bad_header("dtype3.safetensors", R"({"x": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}})",
                    std::string(8, '\0'), {"unsupported dtype I64"});
  expect_bad_header("dtype4.safetensors", R"({"x": {"dtype": 32, "shape": [1], "data_offsets": [0, 4]}})", d,
                    {"dtype: expected a string"});
  expect_bad_header("dtype5.safetensors", R"({"x": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}})", d,
                    {"unknown dtype \"f32\""});
}

TEST(Safetensors, DuplicateKeysAreErrors) {
  // The format's reference reader rejects them; keeping the last one would hide a second tensor.
  const std::string d(8, '\0');
  expect_bad_header("dup1.safetensors",
                    R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, )"
                    R"("x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                    d, {"duplicate key \"x\""});
  expect_bad_header("dup2.safetensors",
                    R"({"x": {"dtype": "F32", "dtype": "I32", "shape": [2], "data_offsets": [0, 8]}})", d,
                    {"duplicate key \"dtype\""});
  expect_bad_header("dup3.safetensors",
                    R"({"__metadata__": {"a": "1", "a": "2"}, "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
                    d, {"duplicate key \"a\""});
}

TEST(Safetensors, OffsetsAndShapesMismatch) {
  const std::string d(16, '\0');
  expect_bad_header("off1.safetensors", R"({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", d,
                    {"tensor 'x'", "span 16 bytes", "and shape (3,) need 12"});
  expect_bad_header("off2.safetensors", R"({"x": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}})", d,
                    {"past the end of the data buffer (16 bytes"});
  expect_bad_header("off3.safetensors", R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", d,
                    {"begin is after end"});
  expect_bad_header("off4.safetensors", R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", d,
                    {"data_offsets: expected [begin, end]"});
  expect_bad_header("off5.safetensors", R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", d,
                    {"data_offsets[0]", "non-negative integer", "-4"});
  expect_bad_header("off6.safetensors",
                    R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                        "y": {"dtype": "I32", "shape": [2], "data_offsets": [4, 12]}})",
                    d, {"'x'", "'y'", "overlap"});
  expect_bad_header("off7.safetensors", R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1e3]}})", d,
                    {"data_offsets[1]", "non-negative integer"});
  // The tensors must cover the buffer exactly (the format's reference reader rejects the rest).
  expect_bad_header("off8.safetensors", R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", d,
                    {"data buffer: expected 8 bytes", "got 16", "trailing bytes"});
  expect_bad_header("off9.safetensors",
                    R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                        "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                    d, {"tensor 'y' starts at byte 8", "expected 4", "holes"});
  expect_bad_header("off10.safetensors", R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})", d,
                    {"tensor 'x' starts at byte 8", "expected 0"});
}

TEST(Safetensors, NegativeAndHugeShapes) {
  const std::string d(16, '\0');
  expect_bad_header("shape1.safetensors", R"({"x": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}})", d,
                    {"shape[0]", "non-negative integer", "-1"});
  expect_bad_header("shape2.safetensors",
                    R"({"x": {"dtype": "F32", "shape": [4294967296, 4294967296, 4], "data_offsets": [0, 16]}})", d,
                    {"span 16 bytes", "and shape (4294967296, 4294967296, 4) need more than 2^64 bytes"});
  expect_bad_header("shape3.safetensors",
                    R"({"x": {"dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 16]}})", d,
                    {"too large"});
  expect_bad_header("shape4.safetensors", R"({"x": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 16]}})", d,
                    {"shape[0]", "non-negative integer"});
  expect_bad_header("shape5.safetensors", R"({"x": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}})", d,
                    {"shape: expected an array"});
  // A huge size times 0 is a valid empty tensor.
  const std::string path = temp_path("shape6.safetensors");
  write_bytes(path, make_file(R"({"x": {"dtype": "F32", "shape": [4294967296, 0], "data_offsets": [0, 0]}})", ""));
  const auto t = dsaib::read_safetensors(path);
  EXPECT_EQ(t.at("x").shape, (std::vector<int64_t>{4294967296, 0}));
  EXPECT_TRUE(t.at("x").bytes.empty());
}

TEST(Safetensors, CorruptedFilesNeverCrash) {
  // Every truncation and many single-byte corruptions of a valid file either
  // read or raise io_error.
  std::map<std::string, HostTensor> tensors{{"q", random_tensor(DType::bf16, {2, 3}, 9)},
                                            {"ids", random_tensor(DType::i32, {5}, 10)}};
  const std::string path = temp_path("corrupt.safetensors");
  dsaib::write_safetensors(path, tensors, {{"k", "v"}});
  const std::string good = read_bytes(path);
  auto check = [&](const std::string& bytes) {
    write_bytes(path, bytes);
    try {
      dsaib::read_safetensors(path);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::io_error) << e.what();
    }
  };
  for (size_t n = 0; n < good.size(); ++n) check(good.substr(0, n));
  std::mt19937 rng(1);
  for (int i = 0; i < 2000; ++i) {
    std::string bad = good;
    const size_t pos = rng() % std::min<size_t>(bad.size(), 200);
    bad[pos] = static_cast<char>(rng());
    check(bad);
  }
}

TEST(Safetensors, WriterRejectsInconsistentTensors) {
  const std::string path = temp_path("writer.safetensors");
  HostTensor bad(DType::f32, {2, 2});
  bad.bytes.resize(12);
  try {
    dsaib::write_safetensors(path, {{"bad", bad}});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("tensor 'bad'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dsaib::write_safetensors(path, {{"__metadata__", HostTensor(DType::f32, {1})}}), Error);
  // Text that is not UTF-8 (the header is JSON): refused before the file is touched.
  const struct {
    std::map<std::string, HostTensor> tensors;
    std::map<std::string, std::string> metadata;
    std::string argument, what;
  } not_utf8[] = {
      {{{"x", HostTensor(DType::f32, {1})}}, {{"input", "file a\xff.st"}}, "metadata", "metadata value of a key"},
      {{{"x", HostTensor(DType::f32, {1})}}, {{"k\xc3", "v"}}, "metadata", "metadata key"},
      {{{"x\xe2\x82", HostTensor(DType::f32, {1})}}, {}, "tensors", "tensor name"},
  };
  for (const auto& c : not_utf8) {
    std::filesystem::remove(path);
    try {
      dsaib::write_safetensors(path, c.tensors, c.metadata);
      ADD_FAILURE() << c.what;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_EQ(e.argument(), c.argument);
      EXPECT_EQ(std::string(e.what()), c.what + ": expected UTF-8 text (the safetensors header is JSON), got bytes that are not UTF-8");
    }
    EXPECT_FALSE(std::filesystem::exists(path)) << c.what;
  }
  try {
    dsaib::write_safetensors(temp_path("no_such_dir/x.safetensors"), {{"x", HostTensor(DType::f32, {1})}});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io_error);
    EXPECT_NE(std::string(e.what()).find("cannot open for writing"), std::string::npos) << e.what();
  }
}

/// A size product past 64 bits is an inconsistent tensor (invalid_argument
/// naming it, nothing written): a wrapped product would write a file that
/// cannot be read back.
TEST(Safetensors, WriterRejectsByteCountsPast64Bits) {
  // A size-0 dimension makes 0 bytes whatever the others (the reader takes such a file).
  {
    HostTensor empty;
    empty.dtype = DType::f32;
    empty.shape = {int64_t{1} << 40, int64_t{1} << 40, 0};
    const std::string ok_path = temp_path("writer_empty_huge.safetensors");
    dsaib::write_safetensors(ok_path, {{"empty", empty}});
    EXPECT_EQ(dsaib::read_safetensors(ok_path).at("empty").shape, empty.shape);
  }
  const std::string path = temp_path("writer_overflow.safetensors");
  std::filesystem::remove(path);
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{int64_t{1} << 32, int64_t{1} << 32},
                                            std::vector<int64_t>{int64_t{1} << 62}}) {
    HostTensor huge;
    huge.dtype = DType::f32;
    huge.shape = shape;  // no bytes: before the check, the wrapped product was 0
    try {
      dsaib::write_safetensors(path, {{"huge", huge}});
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_EQ(e.argument(), "huge");
      EXPECT_NE(std::string(e.what()).find("byte count fits in 64 bits"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(std::filesystem::exists(path));
  }
}

/// The temporary file is created, never opened: links planted at every name it
/// can take are not followed (their target keeps its bytes) and the call is an
/// io_error; once they are gone the write succeeds. A replaced file keeps its
/// permission bits.
TEST(Safetensors, WriterNeverFollowsALinkAtItsTemporaryNameAndKeepsTheMode) {
  namespace fs = std::filesystem;
  const HostTensor t(DType::f32, {3});
  const std::string target = temp_path("planted.safetensors"), victim = temp_path("victim.txt");
  std::error_code ec;
  fs::remove(target, ec);
  { std::ofstream(victim, std::ios::trunc) << "precious"; }
  std::vector<std::string> links;
  const unsigned next = dsaib::detail::temporary_name_counter().load();  // the names the next write tries
  for (unsigned k = next; k < next + 64; ++k) {
    links.push_back(target + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(k));
    fs::remove(links.back(), ec);
    fs::create_symlink(victim, links.back());
  }
  try {
    dsaib::write_safetensors(target, {{"x", t}});
    ADD_FAILURE() << "no error with every temporary name taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io_error) << e.what();
  }
  {
    std::ifstream in(victim);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, "precious") << "a planted link was followed";
  }
  EXPECT_FALSE(fs::exists(target));
  for (const auto& l : links) fs::remove(l, ec);
  dsaib::write_safetensors(target, {{"x", t}});
  EXPECT_EQ(dsaib::read_safetensors(target).count("x"), 1u);
  // The rwx bits of a replaced file stay (0640 here), whatever the umask gives new
  // files; setuid / setgid are not carried over to the new file.
  const fs::perms rw_r = fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read;
  fs::permissions(target, rw_r);
  dsaib::write_safetensors(target, {{"y", t}});
  EXPECT_EQ(fs::status(target).permissions() & fs::perms::mask, rw_r);
  EXPECT_EQ(dsaib::read_safetensors(target).count("y"), 1u);
  fs::permissions(target, rw_r | fs::perms::set_uid | fs::perms::set_gid);
  dsaib::write_safetensors(target, {{"z", t}});
  EXPECT_EQ(fs::status(target).permissions() & fs::perms::mask, rw_r);
}

/// A new file gets 0666 less the umask, as any new file (an fchmod after the
/// open would undo the umask: not for a new file).
TEST(Safetensors, NewFileModeFollowsTheUmask) {
  namespace fs = std::filesystem;
  const HostTensor t(DType::f32, {2});
  for (const mode_t mask : {mode_t{022}, mode_t{077}, mode_t{027}}) {
    const std::string target = temp_path("umask.safetensors");
    std::error_code ec;
    fs::remove(target, ec);
    const mode_t previous = ::umask(mask);
    dsaib::write_safetensors(target, {{"x", t}});
    ::umask(previous);
    struct stat st {};
    ASSERT_EQ(::stat(target.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0666 & ~mask) << "umask 0" << std::oct << mask;
    fs::remove(target, ec);
  }
}

/// A file this process may not write (its effective ids) is not replaced. Root
/// may write any file, so the check is skipped there.
TEST(Safetensors, WriterDoesNotReplaceAFileItMayNotWrite) {
  if (::geteuid() == 0) GTEST_SKIP() << "root may write any file";
  namespace fs = std::filesystem;
  const std::string target = temp_path("read_only.safetensors");
  std::error_code ec;
  fs::remove(target, ec);
  dsaib::write_safetensors(target, {{"old", HostTensor(DType::f32, {1})}});
  fs::permissions(target, fs::perms::owner_read);
  try {
    dsaib::write_safetensors(target, {{"new", HostTensor(DType::f32, {1})}});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io_error) << e.what();
    EXPECT_NE(std::string(e.what()).find("may not write"), std::string::npos) << e.what();
  }
  fs::permissions(target, fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(dsaib::read_safetensors(target).count("old"), 1u);
}

TEST(Safetensors, WriterFollowsSymlinksAndNeverReplacesSpecialFiles) {
  namespace fs = std::filesystem;
  const HostTensor t(DType::f32, {3});
  // A symbolic link: its target gets the new file, the link stays a link.
  const std::string target = temp_path("link_target.safetensors");
  const std::string link = temp_path("link.safetensors");
  dsaib::write_safetensors(target, {{"old", t}});
  std::error_code ec;
  fs::remove(link, ec);
  fs::create_symlink(target, link);
  dsaib::write_safetensors(link, {{"new", t}});
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(link)));
  const auto back = dsaib::read_safetensors(target);
  EXPECT_EQ(back.count("new"), 1u);
  EXPECT_EQ(back.count("old"), 0u);
  // A dangling link (also at the end of a chain, with a relative target): its
  // target is created and the links stay; a target in a missing directory is an io_error.
  const std::string dangling = temp_path("dangling.safetensors"), chain = temp_path("chain.safetensors");
  const std::string created = temp_path("created_by_link.safetensors");
  fs::remove(dangling, ec);
  fs::remove(chain, ec);
  fs::remove(created, ec);
  fs::create_symlink("created_by_link.safetensors", dangling);  // relative to the link's directory
  fs::create_symlink(dangling, chain);
  dsaib::write_safetensors(chain, {{"new", t}});
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(chain)));
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dangling)));
  EXPECT_EQ(dsaib::read_safetensors(created).count("new"), 1u);
  const std::string nowhere = temp_path("nowhere.safetensors");
  fs::remove(nowhere, ec);
  fs::create_symlink(temp_path("no_such_dir/x.safetensors"), nowhere);
  EXPECT_THROW(dsaib::write_safetensors(nowhere, {{"x", t}}), Error);
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(nowhere)));
  // A FIFO and a directory are refused (io_error naming the kind) and stay what they were.
  const std::string fifo = temp_path("fifo.safetensors");
  fs::remove(fifo, ec);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string dir = temp_path("dir.safetensors");
  fs::create_directories(dir);
  for (const auto& [p, kind] : {std::pair<std::string, std::string>{fifo, "a FIFO"}, {dir, "a directory"}}) {
    try {
      dsaib::write_safetensors(p, {{"x", t}});
      ADD_FAILURE() << p;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::io_error);
      EXPECT_NE(std::string(e.what()).find(kind), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(fs::is_fifo(fs::status(fifo)));
  EXPECT_TRUE(fs::is_directory(fs::status(dir)));
}

}  // namespace
