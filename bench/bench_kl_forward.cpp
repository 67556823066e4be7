// dsa-kl-forward-bench: the loss forward (indexer_kl_forward on the cuda backend: the
// fused forward kernel and the fixed-order sum of the loss terms) timed by the benchmark
// core (bench/core: CUDA events, warm-up, median, input sets rotated beyond L2), next
// to its floor measured in the same run:
//   floor = max(key gather ns/row, 2*H*D*slots FLOP / GEMM rate)
// the key gather being dsa-floor-bench's micro-benchmark (cp.async of the row's valid
// bf16 key rows into shared memory) with the case's ids pattern, S, D and topk, and the
// GEMM rate cuBLAS's bf16 rate (8192^3).
//   dsa-kl-forward-bench [--json FILE] [--seq 4096,16384,65536] [--ids causal,random]
//                        [--heads 64] [--topk 2048] [--dim 128] [--batch 1] [--iters 20]
//                        [--warmup 3] [--input-sets 0] [--sustained-ms 0] [--index-score]
//                        [--no-floor]
// --heads and --topk take lists (every combination is a case). --index-score also
// writes P. --no-floor skips the floor (faster; what scripts/ab_compare.py runs).
// The JSON is a list of cases with the keys scripts/ab_compare.py reads.
// Exit: 0 ok, 1 a CUDA error, 2 bad arguments, 77 no sm_90 GPU.
#include <cstdio>
#include <exception>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
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

std::vector<int64_t> split_ints(const std::string& s) {
  std::vector<int64_t> v;
  for (const auto& x : split(s)) v.push_back(std::stoll(x));
  return v;
}

struct Row {
  OpResult r;
  bool has_floor = false;
  KeyGatherResult gather;
  ForwardFloor floor;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, ids_arg = "causal,random";
  std::vector<int64_t> seqs = {4096, 16384, 65536}, heads = {64}, topks = {2048};
  OpCase base;
  base.op = BenchOp::kl_forward;
  OpConfig cfg;
  bool floor = true;
  std::vector<IdPattern> kinds;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::printf(
            "dsa-kl-forward-bench: the cuda loss forward (indexer_kl_forward) timed with CUDA events, and its floor\n"
            "max(key gather ns/row, 2*H*D*slots / GEMM rate) measured in the same run.\n"
            "  --seq 4096,16384,65536  --ids causal,random  --heads 64 (list)  --topk 2048 (list)  --dim 128\n"
            "  --batch 1  --iters 20  --warmup 3  --input-sets 0  --sustained-ms 0  --index-score  --no-floor\n"
            "  --json FILE\n"
            "Exit: 0 ok, 1 a CUDA error, 2 bad arguments, 77 no sm_90 GPU.\n");
        return 0;
      }
      if (a == "--index-score") {
        base.write_index_score = true;
        continue;
      }
      if (a == "--no-floor") {
        floor = false;
        continue;
      }
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value for %s\n", a.c_str());
        return 2;
      }
      const std::string v = argv[++i];
      if (a == "--json") json_path = v;
      else if (a == "--seq") seqs = split_ints(v);
      else if (a == "--heads") heads = split_ints(v);
      else if (a == "--topk") topks = split_ints(v);
      else if (a == "--dim") base.dim = std::stoll(v);
      else if (a == "--batch") base.batch = std::stoll(v);
      else if (a == "--ids") ids_arg = v;
      else if (a == "--iters") cfg.iters = std::stoi(v);
      else if (a == "--warmup") cfg.warmup = std::stoi(v);
      else if (a == "--input-sets") cfg.input_sets = std::stoi(v);
      else if (a == "--sustained-ms") {
        if (!parse_bounded_decimal(v, 0.0, 600000.0, &cfg.sustained_ms)) {
          std::fprintf(stderr, "--sustained-ms: expected a number of milliseconds from 0 to 600000, got \"%s\"\n",
                       v.c_str());
          return 2;
        }
      } else {
        std::fprintf(stderr, "unknown argument %s\n", a.c_str());
        return 2;
      }
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
    for (int64_t S : seqs)
      for (int64_t H : heads)
        for (int64_t K : topks) {
          OpCase c = base;
          c.seq = S, c.heads = H, c.topk = K;
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
  std::vector<Row> rows;
  try {
    GemmResult gemm;
    if (floor) {
      gemm = measure_gemm();
      std::printf("bf16 GEMM (cuBLAS) %d^3: %.1f TFLOP/s  check %s\n", gemm.m, gemm.tflops,
                  gemm.check_ok ? "ok" : "FAIL");
    }
    // Key-gather floor per (ids, S, D, topk): it does not depend on H.
    std::map<std::tuple<bool, int64_t, int64_t>, KeyGatherResult> gathers;
    std::printf("%-15s %6s %4s %4s %5s %8s %10s %9s %8s %9s %9s %7s\n", "ids", "S", "H", "D", "topk", "valid/r",
                "median_ms", "ns/row", "TFLOP/s", "gather ns", "floor ns", "xfloor");
    for (IdPattern kind : kinds)
      for (int64_t K : topks)
        for (int64_t H : heads)
          for (int64_t S : seqs) {
            Row row;
            OpCase c = base;
            c.ids = kind, c.seq = S, c.heads = H, c.topk = K;
            row.r = run_op_case(c, cfg);
            if (floor) {
              const auto key = std::make_tuple(is_causal(kind), S, K);
              if (!gathers.count(key)) {
                KeyGatherConfig g;
                g.seq = S;
                g.topk = K;
                g.dim = static_cast<int>(c.dim);
                g.causal = is_causal(kind);
                gathers[key] = fastest(measure_key_gather(g));
              }
              row.has_floor = true;
              row.gather = gathers[key];
              row.floor = forward_floor_per_row(row.gather.ns_per_row, row.gather.valid_slots_per_row, H, c.dim,
                                                gemm.tflops);
            }
            const OpResult& r = row.r;
            std::printf("%-15s %6lld %4lld %4lld %5lld %8.1f %10.3f %9.1f %8.1f %9.1f %9.1f %7.2f\n",
                        id_pattern_name(kind), (long long)S, (long long)H, (long long)c.dim, (long long)K,
                        r.valid_slots_per_row, r.t.median_ms, r.ns_per_row, r.tflops, row.floor.gather_ns,
                        row.floor.ns, row.has_floor ? r.ns_per_row / row.floor.ns : 0.0);
            if (r.sustained_launches > 0)
              std::printf("%-15s %6s   sustained: %d launches back to back: %.1f ns/row in the second half\n", "", "",
                          r.sustained_launches, r.ns_per_row_sustained);
            std::fflush(stdout);
            rows.push_back(row);
          }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsa-kl-forward-bench: %s\n", e.what());
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
      const OpResult& r = rows[i].r;
      std::fprintf(f,
                   "  {\"op\": \"kl_forward\", \"index_score\": %s, \"ids\": \"%s\", \"seq\": %lld, \"heads\": %lld, "
                   "\"dim\": %lld, \"topk\": %lld, \"batch\": %lld, \"valid_slots_per_row\": %.2f, "
                   "\"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, \"ns_per_row\": %.2f, \"tflops\": %.2f, "
                   "\"warmup\": %d, \"iters\": %d, \"input_sets\": %d, \"sustained_launches\": %d, "
                   "\"ns_per_row_sustained\": %.2f",
                   r.c.write_index_score ? "true" : "false", id_pattern_name(r.c.ids), (long long)r.c.seq,
                   (long long)r.c.heads, (long long)r.c.dim, (long long)r.c.topk, (long long)r.c.batch,
                   r.valid_slots_per_row, r.t.median_ms, r.t.min_ms, r.t.max_ms, r.ns_per_row, r.tflops, cfg.warmup,
                   cfg.iters, r.input_sets, r.sustained_launches, r.ns_per_row_sustained);
      if (rows[i].has_floor) {
        const ForwardFloor& fl = rows[i].floor;
        std::fprintf(f,
                     ", \"floor\": {\"formula\": \"max(gather_ns, 2*H*D*slots / GEMM rate)\", \"gather_ns\": %.2f, "
                     "\"gather_in_flight\": %d, \"gather_tbps\": %.4f, \"gemm_ns\": %.2f, \"ns_per_row\": %.2f, "
                     "\"bound\": \"%s\"}, \"floor_ratio\": %.3f",
                     fl.gather_ns, rows[i].gather.in_flight, rows[i].gather.tbps, fl.gemm_ns, fl.ns, fl.bound,
                     r.ns_per_row / fl.ns);
      }
      std::fprintf(f, "}%s\n", i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "]\n");
    std::fclose(f);
  }
  return 0;
}
