// dsa-target-bench: the attention target (attention_target on the cuda backend) timed
// with the benchmark core's timer (CUDA events, a GPU pre-roll before each launch,
// warm-up, median, input sets rotated beyond the L2), next to its floor measured in
// the same run:
//   floor = max(gather_ns, gemm_ns) per query row
//   gather_ns = the key-gather micro-benchmark's time per row: the row's valid slots'
//               latent key rows (Dqk*2 bytes each) copied into shared memory, with the
//               case's ids pattern, S, Dqk and topk
//   gemm_ns   = 2*Hq*Dqk*slots FLOP / the cuBLAS bf16 rate at the target's shape
//               (Hq x topk x Dqk per row, batched, no gather)
//   dsa-target-bench [--json FILE] [--seq 4096,16384,65536] [--ids causal,random]
//                    [--shapes 128x576,64x192] [--topk 2048] [--iters 10] [--warmup 2]
//                    [--input-sets 0] [--lse-base natural|base2] [--unnormalized] [--no-floor]
// Inputs are made on the device: query and kv bf16 of magnitude [0.25, 1) with hashed
// signs, lse 8 (every exp2 finite and non-zero), ids as the key-gather benchmark's
// (random: topk hashed keys of the sequence; causal: row t's min(t + 1, topk) keys of
// [0, t], the rest -1). BSHD, batch 1, local ids.
// Exit: 0 ok, 1 a CUDA error, 2 bad arguments, 77 no sm_90 GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "bench_core.hpp"
#include "cuda_check.hpp"
#include "dsaib/attention_target.hpp"

namespace {

using namespace dsaib;
using namespace dsaib::bench;

std::vector<std::string> split(const std::string& s, char sep = ',') {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) v.push_back(item);
  return v;
}

struct TargetCase {
  int64_t seq = 4096, heads = 128, dim = 576, topk = 2048;
  bool causal = false;
  LseBase lse_base = LseBase::natural;
  bool normalize = true;
};

struct CaseResult {
  TargetCase c;
  double valid_slots_per_row = 0;
  int input_sets = 0;
  Stats t;
  double ns_per_row = 0, tflops = 0, gather_tbps = 0;
  bool has_floor = false;
  KeyGatherResult gather;
  GemmResult gemm;
  double floor_gather_ns = 0, floor_gemm_ns = 0, floor_ns = 0;
};

double valid_slots_per_row(const TargetCase& c) {
  if (!c.causal) return static_cast<double>(c.topk);
  double s = 0;
  for (int64_t t = 0; t < c.seq; ++t) s += static_cast<double>(std::min(t + 1, c.topk));
  return s / static_cast<double>(c.seq);
}

/// One set of the case's tensors on the device.
struct TargetSet {
  DeviceBuffer query, kv, lse, ids, out;
  AttentionTargetInputs in;
  AttentionTargetOutputs outputs;
  TargetSet(const TargetCase& c, int device, uint32_t salt, cudaStream_t s)
      : query(static_cast<size_t>(c.seq * c.heads * c.dim) * 2),
        kv(static_cast<size_t>(c.seq * c.dim) * 2),
        lse(static_cast<size_t>(c.seq * c.heads) * 4),
        ids(static_cast<size_t>(c.seq * c.topk) * 4),
        out(static_cast<size_t>(c.seq * c.topk) * 4) {
    fill_device_bf16(query.ptr, static_cast<uint64_t>(c.seq * c.heads * c.dim), salt, s);
    fill_device_bf16(kv.ptr, static_cast<uint64_t>(c.seq * c.dim), salt + 1, s);
    fill_device_f32(lse.as<float>(), static_cast<uint64_t>(c.seq * c.heads), 8.0f, s);
    fill_device_gather_ids(ids.as<int32_t>(), c.seq, c.topk, c.causal, 4321u, s);
    const int64_t B = 1;
    in.query = contiguous_view(query.ptr, DType::bf16, {B, c.seq, c.heads, c.dim}, DeviceType::cuda, device);
    in.kv = contiguous_view(kv.ptr, DType::bf16, {B, c.seq, c.dim}, DeviceType::cuda, device);
    in.lse = contiguous_view(lse.ptr, DType::f32, {B, c.seq, c.heads}, DeviceType::cuda, device);
    in.topk_indices = contiguous_view(ids.ptr, DType::i32, {B, c.seq, c.topk}, DeviceType::cuda, device);
    outputs.attn_score = contiguous_view(out.ptr, DType::f32, {B, c.seq, c.topk}, DeviceType::cuda, device);
  }
};

CaseResult run_case(const TargetCase& c, int iters, int warmup, int input_sets) {
  CaseResult r;
  r.c = c;
  r.valid_slots_per_row = valid_slots_per_row(c);
  int dev = 0, l2 = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "cudaDeviceGetAttribute");
  size_t free_b = 0, total_b = 0;
  check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const uint64_t set_bytes = static_cast<uint64_t>(c.seq) * (c.heads * c.dim * 2 + c.dim * 2 + c.heads * 4 + c.topk * 8);
  r.input_sets = input_sets > 0 ? input_sets : auto_input_sets(set_bytes, l2, free_b);
  Timer timer;
  std::vector<TargetSet> sets;
  sets.reserve(r.input_sets);
  for (int s = 0; s < r.input_sets; ++s) sets.emplace_back(c, dev, 0x5EEDu + 2u * s, timer.stream);
  check_cuda(cudaStreamSynchronize(timer.stream), "input generation");
  AttentionTargetOptions opt;
  opt.backend = Backend::cuda;
  opt.sm_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dim)));
  opt.lse_base = c.lse_base;
  opt.normalize = c.normalize;
  opt.stream = timer.stream;
  int launches = 0;
  auto run = [&] {
    const TargetSet& s = sets[launches++ % r.input_sets];
    attention_target(s.in, s.outputs, opt);
  };
  for (int i = 0; i < warmup; ++i) run();
  check_cuda(cudaStreamSynchronize(timer.stream), "warm-up launches");
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) ms.push_back(timer.time(run));
  check_cuda(cudaGetLastError(), "after the timed launches");
  r.t = stats_of(ms);
  const double sec = r.t.median_ms * 1e-3;
  const double slots = r.valid_slots_per_row * static_cast<double>(c.seq);
  r.ns_per_row = r.t.median_ms * 1e6 / static_cast<double>(c.seq);
  r.tflops = 2.0 * c.heads * c.dim * slots / sec / 1e12;
  r.gather_tbps = slots * c.dim * 2.0 / sec / 1e12;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, ids_arg = "causal,random", shapes_arg = "128x576,64x192";
  std::vector<int64_t> seqs = {4096, 16384, 65536};
  int64_t topk = 2048;
  int iters = 10, warmup = 2, input_sets = 0;
  bool floor = true, normalize = true;
  LseBase lse_base = LseBase::natural;
  std::vector<std::pair<int64_t, int64_t>> shapes;
  std::vector<bool> kinds;  // causal?
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::printf(
            "dsa-target-bench: the cuda attention target (attention_target) timed with CUDA events, and its floor\n"
            "max(key gather ns/row, 2*Hq*Dqk*slots / GEMM rate at Hq x topk x Dqk) measured in the same run.\n"
            "  --seq 4096,16384,65536  --ids causal,random  --shapes 128x576,64x192 (Hq x Dqk)  --topk 2048\n"
            "  --iters 10  --warmup 2  --input-sets 0 (automatic)  --lse-base natural|base2  --unnormalized\n"
            "  --no-floor  --json FILE\n"
            "Exit: 0 ok, 1 a CUDA error, 2 bad arguments, 77 no sm_90 GPU.\n");
        return 0;
      }
      if (a == "--no-floor") {
        floor = false;
        continue;
      }
      if (a == "--unnormalized") {
        normalize = false;
        continue;
      }
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value for %s\n", a.c_str());
        return 2;
      }
      const std::string v = argv[++i];
      if (a == "--json") json_path = v;
      else if (a == "--seq") {
        seqs.clear();
        for (const auto& x : split(v)) seqs.push_back(std::stoll(x));
      } else if (a == "--ids") ids_arg = v;
      else if (a == "--shapes") shapes_arg = v;
      else if (a == "--topk") topk = std::stoll(v);
      else if (a == "--iters") iters = std::stoi(v);
      else if (a == "--warmup") warmup = std::stoi(v);
      else if (a == "--input-sets") input_sets = std::stoi(v);
      else if (a == "--lse-base") {
        if (!parse_lse_base(v, &lse_base)) {
          std::fprintf(stderr, "--lse-base: expected natural or base2, got \"%s\"\n", v.c_str());
          return 2;
        }
      } else {
        std::fprintf(stderr, "unknown argument %s\n", a.c_str());
        return 2;
      }
    }
    for (const auto& k : split(ids_arg)) {
      if (k != "causal" && k != "random") {
        std::fprintf(stderr, "--ids: expected causal or random, got \"%s\"\n", k.c_str());
        return 2;
      }
      kinds.push_back(k == "causal");
    }
    for (const auto& s : split(shapes_arg)) {
      const auto hd = split(s, 'x');
      if (hd.size() != 2) {
        std::fprintf(stderr, "--shapes: expected HqxDqk (e.g. 128x576), got \"%s\"\n", s.c_str());
        return 2;
      }
      const int64_t h = std::stoll(hd[0]), d = std::stoll(hd[1]);
      if (h < 16 || h > 128 || h % 16 != 0 || d < 64 || d > 576 || d % 64 != 0) {
        std::fprintf(stderr, "--shapes: Hq a multiple of 16 up to 128, Dqk a multiple of 64 up to 576, got \"%s\"\n",
                     s.c_str());
        return 2;
      }
      shapes.emplace_back(h, d);
    }
    if (iters < 1 || warmup < 0 || input_sets < 0 || topk < 1) {
      std::fprintf(stderr, "bad --iters/--warmup/--input-sets/--topk\n");
      return 2;
    }
    for (int64_t s : seqs) {
      if (s < 1 || s > (1ll << 30)) {
        std::fprintf(stderr, "--seq: expected 1 to 2^30, got %lld\n", static_cast<long long>(s));
        return 2;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bad arguments: %s\n", e.what());
    return 2;
  }
  const DeviceInfo dev = probe_device();
  if (!dev.usable) {
    std::fprintf(stderr, "no compute-capability-9.0 GPU (%s): nothing to benchmark\n", dev.reason.c_str());
    return 77;
  }
  std::vector<CaseResult> rows;
  try {
    std::map<std::pair<int64_t, int64_t>, GemmResult> gemms;        // per (Hq, Dqk)
    std::map<std::tuple<bool, int64_t, int64_t>, KeyGatherResult> gathers;  // per (causal, S, Dqk)
    if (floor) {
      for (const auto& [h, d] : shapes) {
        const double flop_per_row = 2.0 * h * d * static_cast<double>(topk);
        const int batch = static_cast<int>(std::clamp(std::ceil(4e11 / flop_per_row), 1.0, 8192.0));
        const GemmResult g = measure_gemm_batched(static_cast<int>(h), static_cast<int>(topk), static_cast<int>(d), batch);
        gemms[{h, d}] = g;
        std::printf("bf16 GEMM (cuBLAS, batched %d x %lldx%lldx%lld): %.1f TFLOP/s  check %s\n", batch, (long long)h,
                    (long long)topk, (long long)d, g.tflops, g.check_ok ? "ok" : "FAIL");
      }
    }
    std::printf("%-7s %6s %4s %4s %5s %8s %10s %9s %8s %8s %9s %9s %9s %7s\n", "ids", "S", "Hq", "Dqk", "topk",
                "valid/r", "median_ms", "ns/row", "TFLOP/s", "gath TB/s", "gather ns", "gemm ns", "floor ns", "xfloor");
    for (bool causal : kinds)
      for (const auto& [h, d] : shapes)
        for (int64_t S : seqs) {
          TargetCase c;
          c.seq = S, c.heads = h, c.dim = d, c.topk = topk, c.causal = causal;
          c.lse_base = lse_base;
          c.normalize = normalize;
          CaseResult r = run_case(c, iters, warmup, input_sets);
          if (floor) {
            const auto key = std::make_tuple(causal, S, d);
            if (!gathers.count(key)) {
              KeyGatherConfig g;
              g.seq = S;
              g.topk = topk;
              g.dim = static_cast<int>(d);
              g.causal = causal;
              gathers[key] = fastest(measure_key_gather(g));
            }
            r.has_floor = true;
            r.gather = gathers[key];
            r.gemm = gemms[{h, d}];
            r.floor_gather_ns = r.gather.ns_per_row;
            r.floor_gemm_ns = 2.0 * h * d * r.valid_slots_per_row / (r.gemm.tflops * 1e12) * 1e9;
            r.floor_ns = std::max(r.floor_gather_ns, r.floor_gemm_ns);
          }
          std::printf("%-7s %6lld %4lld %4lld %5lld %8.1f %10.3f %9.1f %8.1f %8.2f %9.1f %9.1f %9.1f %7.2f\n",
                      causal ? "causal" : "random", (long long)S, (long long)h, (long long)d, (long long)topk,
                      r.valid_slots_per_row, r.t.median_ms, r.ns_per_row, r.tflops, r.gather_tbps, r.floor_gather_ns,
                      r.floor_gemm_ns, r.floor_ns, r.has_floor ? r.ns_per_row / r.floor_ns : 0.0);
          std::fflush(stdout);
          rows.push_back(r);
        }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsa-target-bench: %s\n", e.what());
    return 1;
  }
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::fprintf(f, "[\n");
    for (size_t i = 0; i < rows.size(); ++i) {
      const CaseResult& r = rows[i];
      std::fprintf(f,
                   "  {\"op\": \"attention_target\", \"ids\": \"%s\", \"seq\": %lld, \"heads\": %lld, \"dim\": %lld, "
                   "\"topk\": %lld, \"batch\": 1, \"lse_base\": \"%s\", \"normalize\": %s, "
                   "\"valid_slots_per_row\": %.2f, \"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, "
                   "\"ns_per_row\": %.2f, \"tflops\": %.2f, \"gather_tbps\": %.4f, \"warmup\": %d, \"iters\": %d, "
                   "\"input_sets\": %d",
                   r.c.causal ? "causal" : "random", (long long)r.c.seq, (long long)r.c.heads, (long long)r.c.dim,
                   (long long)r.c.topk, lse_base_name(r.c.lse_base), r.c.normalize ? "true" : "false",
                   r.valid_slots_per_row, r.t.median_ms, r.t.min_ms, r.t.max_ms, r.ns_per_row, r.tflops,
                   r.gather_tbps, warmup, iters, r.input_sets);
      if (r.has_floor) {
        std::fprintf(f,
                     ", \"floor\": {\"formula\": \"max(gather_ns, 2*Hq*Dqk*slots / GEMM rate)\", \"gather_ns\": %.2f, "
                     "\"gather_in_flight\": %d, \"gather_tbps\": %.4f, \"gemm_ns\": %.2f, \"gemm_tflops\": %.2f, "
                     "\"gemm_batch\": %d, \"gemm_check\": %s, \"ns_per_row\": %.2f, \"bound\": \"%s\"}, "
                     "\"floor_ratio\": %.3f",
                     r.floor_gather_ns, r.gather.in_flight, r.gather.tbps, r.floor_gemm_ns, r.gemm.tflops,
                     r.gemm.batch, r.gemm.check_ok ? "true" : "false", r.floor_ns,
                     r.floor_gather_ns >= r.floor_gemm_ns ? "gather" : "gemm", r.ns_per_row / r.floor_ns);
      }
      std::fprintf(f, "}%s\n", i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "]\n");
    std::fclose(f);
  }
  return 0;
}
