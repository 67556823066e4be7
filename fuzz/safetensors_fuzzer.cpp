// libFuzzer target: a file's bytes through dsaib::read_safetensors, then through
// what `dsaib backward --in` does with a problem file before and while
// it runs: its metadata (load_problem), the library's validation and the problem's
// geometry (analyze_problem), and, for small problems, the cpu backend and the
// fp64 reference on it.
//
// Findings, besides the sanitizers' reports: an exception that is not a
// dsaib::Error; a reader error that is not io_error / out_of_memory naming the
// file; a file that reads but does not survive a write and a second read
// unchanged; a problem-path error of a code a file cannot cause.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <streambuf>
#include <string>
#include <system_error>

#include "cli.hpp"
#include "dsaib/error.hpp"
#include "dsaib/safetensors.hpp"

namespace {

using dsaib::Error;
using dsaib::ErrorCode;

/// The problems the fuzzer also runs: at most this many multiply-adds (rows * topk * H * D).
constexpr double kMaxRunCost = 1 << 18;

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "safetensors_fuzzer: %s\n", what.c_str());
  std::abort();
}

void expect(bool ok, const std::string& what) {
  if (!ok) finding(what);
}

/// Where an input lives while it is read: an in-memory file (memfd), named by
/// its /proc/self/fd path, rewritten for each input.
struct InputFile {
  int fd = -1;
  std::string path;

  InputFile() {
    fd = ::memfd_create("safetensors_fuzz_input", 0);
    if (fd < 0) finding("memfd_create failed");
    path = "/proc/self/fd/" + std::to_string(fd);
  }
  void write(const uint8_t* data, size_t size) {
    if (::ftruncate(fd, 0) != 0) finding("ftruncate failed");
    for (size_t done = 0; done < size;) {
      const ssize_t n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
      if (n <= 0) finding("pwrite failed");
      done += static_cast<size_t>(n);
    }
  }
};

/// A folder for the round trip's files (the writer renames a temporary next to its target).
const std::string& scratch_file() {
  static const std::string path = [] {
    static char dir[] = "/tmp/safetensors_fuzz.XXXXXX";
    if (!::mkdtemp(dir)) finding("mkdtemp failed");
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    });
    return std::string(dir) + "/roundtrip.safetensors";
  }();
  return path;
}

/// The stage log of the problem code goes to std::cerr: discarded here.
struct NullBuffer : std::streambuf {
  int overflow(int c) override { return c; }
};

void check_reader_error(const Error& e, const std::string& path) {
  expect(e.code() == ErrorCode::io_error || e.code() == ErrorCode::out_of_memory,
         std::string("reader error of code ") + dsaib::error_code_name(e.code()) + ": " + e.what());
  expect(e.argument() == path, "reader error naming " + e.argument() + ", not the file: " + e.what());
  expect(std::string(e.what()).rfind(path + ": ", 0) == 0, std::string("reader message without the path: ") + e.what());
}

/// What reads must write and read back unchanged.
void check_round_trip(const std::map<std::string, dsaib::HostTensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string& file = scratch_file();
  dsaib::write_safetensors(file, tensors, metadata);
  std::map<std::string, std::string> metadata_back;
  const auto back = dsaib::read_safetensors(file, &metadata_back);
  expect(metadata_back == metadata, "metadata changed in a write and read");
  expect(back.size() == tensors.size(), "tensor count changed in a write and read");
  for (const auto& [name, t] : tensors) {
    const auto it = back.find(name);
    expect(it != back.end(), "tensor lost in a write and read");
    expect(it->second.dtype == t.dtype && it->second.shape == t.shape && it->second.bytes == t.bytes,
           "tensor changed in a write and read");
  }
}

/// load_problem, analyze_problem and, for a small problem, the cpu backend and the reference.
void check_problem_path(const std::string& path) {
  using namespace dsaib::cli;
  try {
    const Problem p = load_problem(path);
    const Geometry g = analyze_problem(p);
    const double cost = double(g.num_q_rows) * double(g.topk) * double(g.heads) * double(g.head_dim);
    if (cost > kMaxRunCost) return;
    const RunResult r = run_cpu(p, g, dsaib::DType::f32, /*threads=*/1, /*warmup=*/0, /*repeat=*/1);
    (void)verify_all(p, g, r, /*threads=*/1);
  } catch (const Error& e) {
    // A file can be malformed (io_error), describe a wrong problem (invalid_argument)
    // or a problem too large for this machine (out_of_memory); nothing else.
    expect(e.code() == ErrorCode::io_error || e.code() == ErrorCode::invalid_argument ||
               e.code() == ErrorCode::out_of_memory,
           std::string("problem-path error of code ") + dsaib::error_code_name(e.code()) + ": " + e.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  static NullBuffer null_buffer;
  std::cerr.rdbuf(&null_buffer);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static InputFile input;
  input.write(data, size);
  std::map<std::string, std::string> metadata;
  std::map<std::string, dsaib::HostTensor> tensors;
  try {
    tensors = dsaib::read_safetensors(input.path, &metadata);
  } catch (const Error& e) {
    check_reader_error(e, input.path);
    return 0;
  }
  check_round_trip(tensors, metadata);
  check_problem_path(input.path);
  return 0;
}
