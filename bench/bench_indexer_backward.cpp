// Benchmark of the cuda backend (whole op: dK zeroing, fused kernel, bf16 cast)
// with CUDA events: warm-up, median and spread of many runs, JSON output.
//   dsa-indexer-bwd-bench [--json FILE] [--seq 4096,16384] [--topk 2048] [--heads 64] [--dim 128]
//                         [--ids causal,random] [--iters 20]
// Reports ns per query row, TFLOP/s (6*H*D per valid slot), dK-reduce GB/s
// (D*4 bytes per valid slot) and the ratio to the 278 ns/row floor of
// shared/design/h200-facts.md (which assumes topk valid slots per row).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "dsaib/indexer_backward.hpp"

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

struct Result {
  std::string ids;
  int64_t seq, heads, dim, topk;
  double valid_slots_per_row, median_ms, min_ms, max_ms, ns_per_row, tflops, dk_gbps, floor_ratio;
};

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

Result run_case(const std::string& ids_kind, int64_t S, int64_t H, int64_t D, int64_t topk, int iters, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  const int64_t B = 1;
  std::vector<uint16_t> q(B * S * H * D), k(B * S * D), w(B * S * H);
  for (auto& x : q) x = to_bf16(normal(rng));
  for (auto& x : k) x = to_bf16(normal(rng));
  for (auto& x : w) x = to_bf16(normal(rng) / std::sqrt(static_cast<float>(H)));
  std::vector<int32_t> ids(B * S * topk, -1);
  std::vector<float> attn(B * S * topk, 0.0f), pred(B * S * topk, 0.0f);
  int64_t valid_total = 0;
  std::vector<int32_t> pool(S);
  for (int64_t t = 0; t < S; ++t) {
    // causal: keys 0..t (all of them when t < topk); random: any key of the sequence
    const int64_t avail = ids_kind == "causal" ? t + 1 : S;
    const int64_t n = std::min(avail, topk);
    for (int64_t s = 0; s < avail; ++s) pool[s] = static_cast<int32_t>(s);
    for (int64_t i = 0; i < n; ++i) {  // partial Fisher-Yates
      std::uniform_int_distribution<int64_t> pick(i, avail - 1);
      std::swap(pool[i], pool[pick(rng)]);
    }
    std::sort(pool.begin(), pool.begin() + n);
    float st = 0, sp = 0;
    for (int64_t i = 0; i < n; ++i) {
      ids[t * topk + i] = pool[i];
      attn[t * topk + i] = uni(rng);
      pred[t * topk + i] = uni(rng);
      st += attn[t * topk + i];
      sp += pred[t * topk + i];
    }
    for (int64_t i = 0; i < n; ++i) {
      attn[t * topk + i] /= st;
      pred[t * topk + i] /= sp;
    }
    valid_total += n;
  }
  auto upload = [](const void* src, size_t bytes) {
    void* d = nullptr;
    check(cudaMalloc(&d, bytes), "cudaMalloc");
    check(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice), "H2D");
    return d;
  };
  void* dq_in = upload(q.data(), q.size() * 2);
  void* dk_in = upload(k.data(), k.size() * 2);
  void* dw_in = upload(w.data(), w.size() * 2);
  void* d_ids = upload(ids.data(), ids.size() * 4);
  void* d_attn = upload(attn.data(), attn.size() * 4);
  void* d_pred = upload(pred.data(), pred.size() * 4);
  void *g_q, *g_w, *g_k;
  check(cudaMalloc(&g_q, q.size() * 2), "cudaMalloc");
  check(cudaMalloc(&g_w, w.size() * 2), "cudaMalloc");
  check(cudaMalloc(&g_k, k.size() * 2), "cudaMalloc");
  using dsaib::contiguous_view;
  using dsaib::DeviceType;
  using dsaib::DType;
  dsaib::IndexerBackwardInputs in{contiguous_view(dq_in, DType::bf16, {B, S, H, D}, DeviceType::cuda),
                                  contiguous_view(dw_in, DType::bf16, {B, S, H}, DeviceType::cuda),
                                  contiguous_view(dk_in, DType::bf16, {B, S, D}, DeviceType::cuda),
                                  contiguous_view(d_ids, DType::i32, {B, S, topk}, DeviceType::cuda),
                                  contiguous_view(d_attn, DType::f32, {B, S, topk}, DeviceType::cuda),
                                  contiguous_view(d_pred, DType::f32, {B, S, topk}, DeviceType::cuda),
                                  {},
                                  {}};
  dsaib::IndexerBackwardOutputs out{contiguous_view(g_q, DType::bf16, {B, S, H, D}, DeviceType::cuda),
                                    contiguous_view(g_w, DType::bf16, {B, S, H}, DeviceType::cuda),
                                    contiguous_view(g_k, DType::bf16, {B, S, D}, DeviceType::cuda)};
  dsaib::IndexerBackwardOptions opt;
  opt.backend = dsaib::Backend::cuda;
  opt.sm_scale = 1.0f / std::sqrt(static_cast<float>(D));
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  opt.stream = stream;
  const size_t ws_bytes = dsaib::indexer_backward_workspace_size(in, out, opt);
  void* ws = nullptr;
  check(cudaMalloc(&ws, ws_bytes), "cudaMalloc ws");
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  for (int i = 0; i < 3; ++i) dsaib::indexer_backward(in, out, opt, ws, ws_bytes);
  check(cudaStreamSynchronize(stream), "warmup");
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    check(cudaEventRecord(e0, stream), "record");
    dsaib::indexer_backward(in, out, opt, ws, ws_bytes);
    check(cudaEventRecord(e1, stream), "record");
    check(cudaEventSynchronize(e1), "sync");
    float t = 0;
    check(cudaEventElapsedTime(&t, e0, e1), "elapsed");
    ms.push_back(t);
  }
  check(cudaGetLastError(), "after timing");
  std::sort(ms.begin(), ms.end());
  Result r;
  r.ids = ids_kind;
  r.seq = S;
  r.heads = H;
  r.dim = D;
  r.topk = topk;
  r.valid_slots_per_row = static_cast<double>(valid_total) / static_cast<double>(S);
  r.median_ms = ms[ms.size() / 2];
  r.min_ms = ms.front();
  r.max_ms = ms.back();
  const double sec = r.median_ms * 1e-3;
  r.ns_per_row = sec * 1e9 / static_cast<double>(B * S);
  r.tflops = 6.0 * H * D * static_cast<double>(valid_total) / sec / 1e12;
  r.dk_gbps = static_cast<double>(valid_total) * D * 4.0 / sec / 1e9;
  r.floor_ratio = r.ns_per_row / 278.0;
  for (void* p : {dq_in, dk_in, dw_in, d_ids, d_attn, d_pred, g_q, g_w, g_k, ws}) cudaFree(p);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, ids_arg = "causal,random";
  std::vector<int64_t> seqs = {4096, 16384};
  int64_t topk = 2048, heads = 64, dim = 128;
  int iters = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--json") json_path = v;
    else if (a == "--seq") seqs = parse_list(v);
    else if (a == "--topk") topk = std::stoll(v);
    else if (a == "--heads") heads = std::stoll(v);
    else if (a == "--dim") dim = std::stoll(v);
    else if (a == "--ids") ids_arg = v;
    else if (a == "--iters") iters = std::stoi(v);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (!dsaib::cuda_backend_available()) {
    std::fprintf(stderr, "no compute-capability-9.0 GPU: nothing to benchmark\n");
    return 77;
  }
  std::vector<std::string> kinds;
  {
    std::stringstream ss(ids_arg);
    std::string item;
    while (std::getline(ss, item, ',')) kinds.push_back(item);
  }
  std::vector<Result> results;
  std::printf("%-7s %6s %4s %4s %5s %8s %10s %9s %8s %9s %7s\n", "ids", "S", "H", "D", "topk", "valid/r", "median_ms",
              "ns/row", "TFLOP/s", "dK GB/s", "floor×");
  for (const auto& kind : kinds) {
    for (int64_t S : seqs) {
      const Result r = run_case(kind, S, heads, dim, topk, iters, 1234 + S);
      results.push_back(r);
      std::printf("%-7s %6lld %4lld %4lld %5lld %8.1f %10.3f %9.1f %8.1f %9.1f %7.2f   (min %.3f max %.3f ms)\n",
                  r.ids.c_str(), (long long)r.seq, (long long)r.heads, (long long)r.dim, (long long)r.topk,
                  r.valid_slots_per_row, r.median_ms, r.ns_per_row, r.tflops, r.dk_gbps, r.floor_ratio, r.min_ms, r.max_ms);
      std::fflush(stdout);
    }
  }
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) return 1;
    std::fprintf(f, "[\n");
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(f,
                   "  {\"ids\": \"%s\", \"seq\": %lld, \"heads\": %lld, \"dim\": %lld, \"topk\": %lld, \"valid_slots_per_row\": %.2f, "
                   "\"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, \"ns_per_row\": %.2f, \"tflops\": %.2f, "
                   "\"dk_reduce_gbps\": %.1f, \"floor_ratio\": %.3f}%s\n",
                   r.ids.c_str(), (long long)r.seq, (long long)r.heads, (long long)r.dim, (long long)r.topk,
                   r.valid_slots_per_row, r.median_ms, r.min_ms, r.max_ms, r.ns_per_row, r.tflops, r.dk_gbps,
                   r.floor_ratio, i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "]\n");
    std::fclose(f);
  }
  return 0;
}
