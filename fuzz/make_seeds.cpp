// Writes the seed corpus of safetensors_fuzzer into a folder: small problems of
// every generator preset (as `dsaib generate` writes them, with a few
// of its flags' variants), and malformed files like those the tests use.
//
//   safetensors_fuzz_seeds DIR
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "dsaib/error.hpp"
#include "dsaib/safetensors.hpp"

namespace {

using dsaib::cli::GenFlags;

/// A preset's problem, shrunk to a few KB: H8, D64, topk 4, and 2 query / 6 key
/// rows per sequence (a THD preset: sequences of 1, 2 and 5 tokens).
GenFlags small_flags(const std::string& preset) {
  GenFlags f;
  f.preset = preset;
  f.has_preset = true;
  f.heads = 8;
  f.head_dim = 64;
  f.topk = 4;
  f.has_heads = f.has_head_dim = f.has_topk = true;
  if (preset == "thd") {
    f.seqlens_q = {1, 2, 5};
    f.has_seqlens_q = true;
  } else {
    f.batch = 2;
    f.s_q = 2;
    f.s_kv = 6;
    f.has_batch = f.has_s_q = f.has_s_kv = true;
  }
  return f;
}

/// The 8-byte header length, the header text and the data, as they are.
std::string file_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

void write(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw dsaib::Error(dsaib::ErrorCode::io_error, path, path + ": cannot write");
}

int write_problems(const std::string& dir) {
  int n = 0;
  for (const auto& [preset, description] : dsaib::cli::preset_list()) {
    GenFlags f = small_flags(preset);
    dsaib::cli::save_problem(dir + "/preset_" + preset + ".safetensors", dsaib::cli::generate(f, 1));
    ++n;
  }
  // Flag variants: global ids, f32 weights, explicit scalars, a random permutation, thd from sizes.
  GenFlags v = small_flags("tiny");
  v.id_mode = "global";
  v.has_id_mode = true;
  v.weights_f32 = true;
  v.loss_coeff = 0.5f;
  v.grad_loss = 2.0f;
  v.normalization_count = 3;
  v.sm_scale = 0.25f;
  v.has_sm_scale = true;
  dsaib::cli::save_problem(dir + "/variant_global_f32.safetensors", dsaib::cli::generate(v, 1));
  GenFlags w = small_flags("thd");
  w.ids = "permutation";
  w.has_ids = true;
  w.id_mode = "global";
  w.has_id_mode = true;
  dsaib::cli::save_problem(dir + "/variant_thd_permutation.safetensors", dsaib::cli::generate(w, 1));
  // Stored gradients beside the inputs (torch_d_*), as scripts/dump_torch_step.py --with-grads writes them.
  dsaib::cli::Problem p = dsaib::cli::generate(small_flags("tiny"), 1);
  for (const char* name : {"index_q", "weights", "index_k"}) {
    p.tensors[std::string("torch_d_") + name] = dsaib::HostTensor(dsaib::DType::f32, p.tensors.at(name).shape);
  }
  dsaib::cli::save_problem(dir + "/with_stored_gradients.safetensors", p);
  return n + 3;
}

int write_malformed(const std::string& dir) {
  const std::string d4(4, '\0'), d8(8, '\0'), d16(16, '\0');
  const std::vector<std::pair<std::string, std::string>> files = {
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", d4},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"I32","shape":[2],"data_offsets":[4,12]}})", d16},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8},
      {R"({"__metadata__":{"a":"1","a":"2"},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", d8},
      {R"({"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", d4},
      {R"({"x":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,16]}})", d16},
      {R"({"x":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,16]}})", d16},
      {R"({"x":{"dtype":"F32","shape":[4294967296,0],"data_offsets":[0,0]}})", ""},
      {R"({"x":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})", d4},
      {R"({"x":{"dtype":"BF16","shape":[2],"data_offsets":[0,4],"extra":{"a":1}}})", d4},
      {R"({"__metadata__":{"layout":"thd","id_mode":"global","sm_scale":"1e-50","normalization_count":"007"}})", ""},
      {"[[[[1]]]]", ""},
      {R"({"x": {"dtype": "F32", )", ""},
  };
  int n = 0;
  for (const auto& [header, data] : files) write(dir + "/malformed_" + std::to_string(n++) + ".safetensors", file_bytes(header, data));
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  std::cerr.setstate(std::ios::badbit);  // the generator's stage log
  try {
    const int n = write_problems(argv[1]) + write_malformed(argv[1]);
    std::printf("wrote %d seed files to %s\n", n, argv[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
