// dsa-indexer-bwd-bench: benchmark of the cuda backend (whole op: dK zeroing, fused
// kernel, bf16 cast) with CUDA events: warm-up, median and spread of many runs, input
// sets rotated beyond L2, JSON output. A thin wrapper over the dsaib_bench core
// (bench/core); `dsaib bench` runs the same cases and adds the floor measured
// in the same run. This tool measures no floor, so it starts faster: its flags and JSON
// are what scripts/ab_compare.py (paired A/B of two builds) and a profiler run use.
//   dsa-indexer-bwd-bench [--json FILE] [--seq 4096,16384] [--topk 2048] [--heads 64] [--dim 128]
//                         [--ids causal,random] [--iters 20] [--warmup 3] [--batch 1] [--input-sets 0] [--a-operand auto|bf16x2|bf16]
//                         [--l2-hints auto|on|off] [--start-stagger auto|off]
//                         [--l2-set-aside-mib X] [--sustained-ms X]
// Reports ns per query row, TFLOP/s (6*H*D per valid slot), dK-reduce GB/s
// (D*4 bytes per valid slot) and "fixed_floor_ratio" (console: x278), the ratio to the
// fixed reference floor of 278 ns/row (bench/core/bench_core.hpp, kFixedFloorNsPerRow:
// the DeepSeek shape's dK reduce at the H200's L2 scatter-add rate, topk valid slots per
// row); the same key as in `dsaib bench --json`, whose "floor_ratio" is the
// ratio to the floor it measures in the same run.
// --input-sets 1 turns the rotation off (the behaviour before it was added).
// --l2-set-aside-mib X sets this process's L2 set-aside for persisting lines
// (cudaLimitPersistingL2CacheSize, a context-wide limit that belongs to the
// application, never to the library) before the runs: the L2-hinted kernel's
// evict_last dK lines live there (src/hopper/indexer_backward/l2_policy.cuh). The driver rounds
// and caps the value; the one in force is printed to stderr.
// --sustained-ms X adds, per case, X ms of back-to-back launches after the timed ones
// and reports the median ns/row over their second half ("ns_per_row_sustained"): each
// timed launch follows a 3 ms GPU pre-roll (as the peers' timer does), which leaves the
// GPU under its power limit where back-to-back launches reach it (on the H200 at S 65536
// they reach the 700 W limit and the SM clock drops).
// Exit: 0 ok, 1 a CUDA error, 2 bad arguments, 77 no sm_90 GPU.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "bench_core.hpp"

namespace {

using namespace dsaib::bench;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(item);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, ids_arg = "causal,random";
  std::vector<int64_t> seqs = {4096, 16384};
  OpCase base;
  OpConfig cfg;
  std::vector<IdPattern> kinds;
  double l2_set_aside_mib = -1.0;  // < 0: leave the context's limit as it is
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "dsa-indexer-bwd-bench: the cuda backend's whole op (dK zeroing, fused kernel, bf16 cast) timed with\n"
          "CUDA events (warm-up, median and spread of many launches, input sets rotated beyond L2).\n"
          "  --seq 4096,16384   S_q = S_kv values        --ids causal,random   id patterns\n"
          "    (ids ascending within a row; causal-shuffled, random-shuffled: in a random order)\n"
          "  --topk 2048  --heads 64  --dim 128  --batch 1  --iters 20  --warmup 3\n"
          "  --input-sets 0 (automatic rotation; 1: off)  --a-operand auto|bf16x2|bf16  --json FILE\n"
          "  --l2-hints auto|on|off  --start-stagger auto|off\n"
          "  --l2-set-aside-mib X   set the context's L2 set-aside for persisting lines first\n"
          "  --sustained-ms X  after the timed launches, X ms of launches back to back (no pre-roll, no\n"
          "                    host wait): the steady-state ns/row under the GPU's power management\n"
          "                    (median of the run's second half; 0, the default: not run)\n"
          "`dsaib bench` runs the same cases with the floor measured in the same run.\n"
          "Exit: 0 ok, 1 a CUDA error, 2 bad arguments, 77 no sm_90 GPU.\n");
      return 0;
    }
  }
  try {
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string a = argv[i], v = argv[i + 1];
      if (a == "--json") json_path = v;
      else if (a == "--seq") {
        seqs.clear();
        for (const auto& s : split(v)) seqs.push_back(std::stoll(s));
      } else if (a == "--topk") base.topk = std::stoll(v);
      else if (a == "--heads") base.heads = std::stoll(v);
      else if (a == "--dim") base.dim = std::stoll(v);
      else if (a == "--batch") base.batch = std::stoll(v);
      else if (a == "--ids") ids_arg = v;
      else if (a == "--iters") cfg.iters = std::stoi(v);
      else if (a == "--warmup") cfg.warmup = std::stoi(v);
      else if (a == "--input-sets") cfg.input_sets = std::stoi(v);
      else if (a == "--l2-set-aside-mib") {
        // MiB, 0 to 1 TiB (the driver caps it at the device's maximum).
        if (!parse_bounded_decimal(v, 0.0, 1048576.0, &l2_set_aside_mib)) {
          std::fprintf(stderr, "--l2-set-aside-mib: expected a number of MiB from 0 to 1048576, got \"%s\"\n",
                       v.c_str());
          return 2;
        }
      } else if (a == "--sustained-ms") {
        if (!parse_bounded_decimal(v, 0.0, 600000.0, &cfg.sustained_ms)) {
          std::fprintf(stderr, "--sustained-ms: expected a number of milliseconds from 0 to 600000, got \"%s\"\n",
                       v.c_str());
          return 2;
        }
      }
      else if (a == "--a-operand") {
        if (!parse_a_operand_precision(v, &base.a_operand)) {
          std::fprintf(stderr, "--a-operand: expected auto, bf16x2 or bf16, got %s\n", v.c_str());
          return 2;
        }
      }
      else if (a == "--l2-hints") {
        if (!parse_l2_hints(v, &base.l2_hints)) {
          std::fprintf(stderr, "--l2-hints: expected auto, on or off, got %s\n", v.c_str());
          return 2;
        }
      }
      else if (a == "--start-stagger") {
        if (!parse_start_stagger(v, &base.start_stagger)) {
          std::fprintf(stderr, "--start-stagger: expected auto or off, got %s\n", v.c_str());
          return 2;
        }
      }
      else {
        std::fprintf(stderr, "unknown argument %s\n", a.c_str());
        return 2;
      }
    }
    if (argc % 2 == 0) {
      std::fprintf(stderr, "missing value for %s\n", argv[argc - 1]);
      return 2;
    }
    for (const auto& k : split(ids_arg)) {
      IdPattern p;
      if (!parse_id_pattern(k, &p)) {
        std::fprintf(stderr, "--ids: expected one of %s, got \"%s\"\n", id_pattern_list().c_str(), k.c_str());
        return 2;
      }
      kinds.push_back(p);
    }
    if (cfg.iters < 1 || cfg.warmup < 0 || cfg.input_sets < 0) {
      std::fprintf(stderr, "bad --iters/--warmup/--input-sets\n");
      return 2;
    }
    for (int64_t S : seqs) {
      OpCase c = base;
      c.seq = S;
      check_case(c);
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
  if (l2_set_aside_mib >= 0.0) {
    const size_t bytes = static_cast<size_t>(l2_set_aside_mib * 1024.0 * 1024.0);
    cudaError_t e = cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, bytes);
    size_t now = 0;
    if (e == cudaSuccess) e = cudaDeviceGetLimit(&now, cudaLimitPersistingL2CacheSize);
    if (e != cudaSuccess) {
      std::fprintf(stderr, "--l2-set-aside-mib %.2f: %s\n", l2_set_aside_mib, cudaGetErrorString(e));
      return 1;
    }
    std::fprintf(stderr, "L2 set aside for persisting lines: %.2f MiB (was %.2f MiB)\n", now / 1048576.0,
                 dev.l2_persisting_bytes / 1048576.0);
  }
  std::vector<OpResult> results;
  try {
    std::printf("%-15s %6s %4s %4s %5s %8s %10s %9s %8s %9s %7s\n", "ids", "S", "H", "D", "topk", "valid/r",
                "median_ms", "ns/row", "TFLOP/s", "dK GB/s", "x278");
    for (IdPattern kind : kinds) {
      for (int64_t S : seqs) {
        OpCase c = base;
        c.ids = kind;
        c.seq = S;
        const OpResult r = run_op_case(c, cfg);
        results.push_back(r);
        std::printf("%-15s %6lld %4lld %4lld %5lld %8.1f %10.3f %9.1f %8.1f %9.1f %7.2f   (min %.3f max %.3f ms, "
                    "%d input sets)\n",
                    id_pattern_name(kind), (long long)S, (long long)c.heads, (long long)c.dim, (long long)c.topk,
                    r.valid_slots_per_row, r.t.median_ms, r.ns_per_row, r.tflops, r.dk_gbps,
                    r.ns_per_row / kFixedFloorNsPerRow, r.t.min_ms, r.t.max_ms, r.input_sets);
        if (r.sustained_launches > 0) {
          std::printf("%-15s %6s   sustained: %d launches back to back over %.3f s: %.1f ns/row (x278 %.2f) in the "
                      "second half, %.1f in the first\n",
                      "", "", r.sustained_launches, r.sustained_seconds, r.ns_per_row_sustained,
                      r.ns_per_row_sustained / kFixedFloorNsPerRow, r.ns_per_row_sustained_first_half);
        }
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsa-indexer-bwd-bench: %s\n", e.what());
    return 1;
  }
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::fprintf(f, "[\n");
    for (size_t i = 0; i < results.size(); ++i) {
      const OpResult& r = results[i];
      std::fprintf(f,
                   "  {\"ids\": \"%s\", \"seq\": %lld, \"heads\": %lld, \"dim\": %lld, \"topk\": %lld, "
                   "\"valid_slots_per_row\": %.2f, \"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, "
                   "\"ns_per_row\": %.2f, \"tflops\": %.2f, \"dk_reduce_gbps\": %.1f, \"fixed_floor_ratio\": %.3f, "
                   "\"batch\": %lld, \"warmup\": %d, \"iters\": %d, \"input_sets\": %d, \"input_set_bytes\": %llu, "
                   "\"sustained_launches\": %d, \"sustained_seconds\": %.6f, \"ns_per_row_sustained\": %.2f, "
                   "\"ns_per_row_sustained_first_half\": %.2f}%s\n",
                   id_pattern_name(r.c.ids), (long long)r.c.seq, (long long)r.c.heads, (long long)r.c.dim,
                   (long long)r.c.topk, r.valid_slots_per_row, r.t.median_ms, r.t.min_ms, r.t.max_ms, r.ns_per_row,
                   r.tflops, r.dk_gbps, r.ns_per_row / kFixedFloorNsPerRow, (long long)r.c.batch, cfg.warmup,
                   cfg.iters, r.input_sets, (unsigned long long)r.set_bytes, r.sustained_launches, r.sustained_seconds,
                   r.ns_per_row_sustained, r.ns_per_row_sustained_first_half, i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "]\n");
    std::fclose(f);
  }
  return 0;
}
