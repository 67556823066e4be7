// dsa-floor-bench: the repo's own measurement of the hardware floor of the
// indexer backward. A thin wrapper over the dsaib_bench
// core (bench/core/floor_kernels.cu): on the GPU, with CUDA events, warm-up launches
// and the median of many timed launches, it measures
//   a. the fp32 scatter-add rate: 512-byte rows (128 floats) added into random
//      rows of an fp32 (R, 128) table, for several table sizes, three ways
//      (float4 atomicAdd, scalar atomicAdd, cp.reduce.async.bulk add.f32), and, not
//      part of the floor, float4 adds in a wgmma accumulator's register pattern
//      (32 B into each of 16 rows per warp instruction; ScatterWay::float4_fragment);
//      and, not part of the floor either, float4 adds that each first read the row's
//      256-B bf16 key from a key table of the same row count (ScatterWay::gather_float4:
//      the scatter rate left when the fused op's key reads share the L2; the ns per
//      row it implies at topk 2048 is printed beside it);
//   b. the bf16 GEMM rate of cuBLAS (8192^3 by default);
//   c. the derived floor per query row of the backward for a fixed list of shapes:
//        max(topk*D*4 B / scatter rate (best way, table size matching S_kv*D*4 B),
//            6*H*D*topk FLOP / GEMM rate).
//   d. the key-gather rate of the loss forward (KeyGatherConfig): per query row, its
//      selected 256-B bf16 key rows copied with cp.async into shared memory, random
//      and causal ids, D128 topk 2048, at each --gather-seq S, and the forward's floor
//      max(gather time per row, 2*H*D*slots FLOP / GEMM rate) at H64.
// `dsaib bench` measures the same rates at each benchmarked case's own dK
// size and reports the floor next to the op; `dsa-kl-forward-bench` does the same
// for the loss forward.
//
//   dsa-floor-bench [--json FILE] [--iters N] [--warmup N] [--tables 2,8,32,512]
//                   [--payload-mib 1024] [--gemm-size 8192] [--seed N]
//                   [--gather-seq 4096,16384,65536]
// Exit codes: 0 ok, 1 a CUDA/cuBLAS error or a failed check, 2 bad arguments,
// 77 no sm_90 GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "bench_core.hpp"

namespace {

using namespace dsaib::bench;

constexpr int kRowFloats = 128;            // one dK row at D = 128
constexpr int kRowBytes = kRowFloats * 4;  // 512 B
constexpr double kMiB = 1024.0 * 1024.0;

struct FloorCase {
  std::string name;
  int64_t heads, dim, topk, seq_kv;
};

struct FloorResult {
  FloorCase c;
  double dk_table_mib, rate_table_mib;
  std::string way;
  double scatter_tbps;
  Floor f;
  bool approx;  // rows are not 512 B, or the table matched is not the case's size
};

struct Options {
  std::string json;
  int iters = 25;
  int warmup = 3;
  std::vector<double> tables_mib = {2, 8, 32, 512};
  double payload_mib = 1024;
  int gemm_size = 8192;
  uint32_t seed = 12345;
  std::vector<double> gather_seq = {4096, 16384, 65536};
};

double mib_of(const ScatterResult& r) { return static_cast<double>(r.table_bytes) / kMiB; }

std::vector<FloorResult> derive_floor(const std::vector<ScatterResult>& sc, const GemmResult& g) {
  const std::vector<FloorCase> cases = {
      {"deepseek S4096", 64, 128, 2048, 4096},   {"deepseek S16384", 64, 128, 2048, 16384},
      {"deepseek S65536", 64, 128, 2048, 65536}, {"topk512 S16384", 64, 128, 512, 16384},
      {"topk1024 S16384", 64, 128, 1024, 16384}, {"H32 S16384", 32, 128, 2048, 16384},
      {"H128 S16384", 128, 128, 2048, 16384},    {"D64 S16384", 64, 64, 2048, 16384},
  };
  std::vector<double> tables;
  for (const auto& r : sc)
    if (std::find(tables.begin(), tables.end(), mib_of(r)) == tables.end()) tables.push_back(mib_of(r));
  std::sort(tables.begin(), tables.end());
  std::vector<FloorResult> out;
  if (tables.empty()) return out;
  for (const auto& c : cases) {
    FloorResult f;
    f.c = c;
    f.dk_table_mib = static_cast<double>(c.seq_kv) * c.dim * 4 / kMiB;
    // The smallest measured table at least as large as dK (else the largest).
    f.rate_table_mib = tables.back();
    for (double t : tables)
      if (t >= f.dk_table_mib * (1 - 1e-9)) {
        f.rate_table_mib = t;
        break;
      }
    f.scatter_tbps = 0;
    for (const auto& r : sc)
      if (mib_of(r) == f.rate_table_mib && r.tbps > f.scatter_tbps) {
        f.scatter_tbps = r.tbps;
        f.way = scatter_way_name(r.way);
      }
    f.approx = c.dim != kRowFloats || std::fabs(f.rate_table_mib - f.dk_table_mib) > 1e-9;
    f.f = floor_per_row(static_cast<double>(c.topk), c.heads, c.dim, f.scatter_tbps, g.tflops);
    out.push_back(f);
  }
  return out;
}

std::vector<double> parse_doubles(const std::string& s) {
  std::vector<double> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stod(item));
  return v;
}

void usage(FILE* f) {
  std::fprintf(f,
               "usage: dsa-floor-bench [--json FILE] [--iters N] [--warmup N] [--tables MiB,MiB,...]\n"
               "                       [--payload-mib MiB] [--gemm-size N] [--seed N]\n"
               "Measures on the GPU (sm_90): the fp32 scatter-add rate of 512-B rows into random rows of\n"
               "fp32 (R,128) tables (atomicAdd float4, atomicAdd float, cp.reduce.async.bulk add.f32), the\n"
               "cuBLAS bf16 GEMM rate, and the derived floor per query row of the indexer backward:\n"
               "max(topk*D*4 B / scatter rate, 6*H*D*topk / GEMM rate).\n"
               "(`dsaib bench` measures the same at each benchmarked case's own dK size.)\n"
               "  --json FILE       also write the results as JSON\n"
               "  --iters N         timed launches per case, median reported (default 25)\n"
               "  --warmup N        untimed launches first (default 3)\n"
               "  --tables LIST     dK table sizes in MiB (default 2,8,32,512: S_kv 4096, 16384, 65536 at D128, and\n"
               "                    one beyond L2)\n"
               "  --payload-mib M   bytes added per launch (default 1024)\n"
               "  --gemm-size N     GEMM is N x N x N (default 8192)\n"
               "  --seed N          row-hash seed (default 12345)\n"
               "  --gather-seq LIST S of the key-gather cases (default 4096,16384,65536)\n"
               "Exit: 0 ok, 1 CUDA/cuBLAS error or failed check, 2 bad arguments, 77 no sm_90 GPU.\n");
}

void write_scatter_array(FILE* f, const char* key, const std::vector<ScatterResult>& sc) {
  std::fprintf(f, "  \"%s\": [\n", key);
  for (size_t i = 0; i < sc.size(); ++i) {
    const auto& r = sc[i];
    std::fprintf(f,
                 "    {\"table_mib\": %.3f, \"rows\": %llu, \"way\": \"%s\", \"row_bytes\": %d, \"payload_bytes\": %llu, "
                 "\"grid\": %d, \"block\": %d, \"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, "
                 "\"tbps\": %.4f, \"check\": %s}%s\n",
                 mib_of(r), (unsigned long long)r.rows, scatter_way_name(r.way), r.row_floats * 4,
                 (unsigned long long)r.payload_bytes, r.grid, r.block, r.t.median_ms, r.t.min_ms, r.t.max_ms, r.tbps,
                 r.check_ok ? "true" : "false", i + 1 < sc.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n");
}

void write_json(const std::string& path, const DeviceInfo& dev, const Options& o, const std::vector<ScatterResult>& sc,
                const std::vector<ScatterResult>& frag, const std::vector<ScatterResult>& gath,
                const std::vector<std::vector<KeyGatherResult>>& kg, const GemmResult& g,
                const std::vector<FloorResult>& fl) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
  std::fprintf(f, "{\n  \"device\": \"%s\", \"sm_count\": %d, \"l2_bytes\": %lld, \"iters\": %d, \"warmup\": %d,\n",
               dev.name.c_str(), dev.sm_count, (long long)dev.l2_bytes, o.iters, o.warmup);
  write_scatter_array(f, "scatter", sc);
  write_scatter_array(f, "scatter_fragment_pattern", frag);
  write_scatter_array(f, "scatter_with_key_reads", gath);
  std::fprintf(f,
               "  \"gemm\": {\"m\": %d, \"n\": %d, \"k\": %d, \"dtype\": \"bf16\", \"compute\": \"fp32\", "
               "\"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, \"tflops\": %.2f, \"check\": %s, "
               "\"max_rel_err\": %.3g},\n",
               g.m, g.n, g.k, g.t.median_ms, g.t.min_ms, g.t.max_ms, g.tflops, g.check_ok ? "true" : "false",
               g.max_rel_err);
  std::fprintf(f, "  \"key_gather\": [\n");
  for (size_t i = 0; i < kg.size(); ++i) {
    const KeyGatherResult& b = fastest(kg[i]);
    const ForwardFloor ff = forward_floor_per_row(b.ns_per_row, b.valid_slots_per_row, 64, b.dim, g.tflops);
    std::fprintf(f, "    {\"ids\": \"%s\", \"seq\": %lld, \"dim\": %d, \"topk\": %lld, \"valid_slots_per_row\": %.2f, ",
                 b.causal ? "causal" : "random", (long long)b.seq, b.dim, (long long)b.topk, b.valid_slots_per_row);
    for (const KeyGatherResult& r : kg[i])
      std::fprintf(f, "\"ns_per_row_%d_in_flight\": %.2f, ", r.in_flight, r.ns_per_row);
    std::fprintf(f,
                 "\"best_in_flight\": %d, \"gather_ns_per_row\": %.2f, \"gather_tbps\": %.4f, "
                 "\"forward_floor_h64\": {\"gather_ns\": %.2f, \"gemm_ns\": %.2f, \"ns_per_row\": %.2f, \"bound\": \"%s\"}}%s\n",
                 b.in_flight, b.ns_per_row, b.tbps, ff.gather_ns, ff.gemm_ns, ff.ns, ff.bound,
                 i + 1 < kg.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n");
  std::fprintf(f, "  \"floor\": [\n");
  for (size_t i = 0; i < fl.size(); ++i) {
    const auto& r = fl[i];
    std::fprintf(f,
                 "    {\"case\": \"%s\", \"heads\": %lld, \"dim\": %lld, \"topk\": %lld, \"seq_kv\": %lld, "
                 "\"dk_table_mib\": %.3f, \"rate_table_mib\": %.3f, \"scatter_way\": \"%s\", \"scatter_tbps\": %.4f, "
                 "\"scatter_ns\": %.2f, \"gemm_ns\": %.2f, \"floor_ns_per_row\": %.2f, \"bound\": \"%s\", "
                 "\"approx\": %s}%s\n",
                 r.c.name.c_str(), (long long)r.c.heads, (long long)r.c.dim, (long long)r.c.topk,
                 (long long)r.c.seq_kv, r.dk_table_mib, r.rate_table_mib, r.way.c_str(), r.scatter_tbps, r.f.scatter_ns,
                 r.f.gemm_ns, r.f.ns, r.f.bound, r.approx ? "true" : "false", i + 1 < fl.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "missing value for %s\n", a.c_str());
      usage(stderr);
      return 2;
    }
    const std::string v = argv[++i];
    try {
      if (a == "--json") o.json = v;
      else if (a == "--iters") o.iters = std::stoi(v);
      else if (a == "--warmup") o.warmup = std::stoi(v);
      else if (a == "--tables") o.tables_mib = parse_doubles(v);
      else if (a == "--payload-mib") o.payload_mib = std::stod(v);
      else if (a == "--gemm-size") o.gemm_size = std::stoi(v);
      else if (a == "--seed") o.seed = static_cast<uint32_t>(std::stoul(v));
      else if (a == "--gather-seq") o.gather_seq = parse_doubles(v);
      else {
        std::fprintf(stderr, "unknown argument %s\n", a.c_str());
        usage(stderr);
        return 2;
      }
    } catch (const std::exception&) {
      std::fprintf(stderr, "bad value for %s: %s\n", a.c_str(), v.c_str());
      return 2;
    }
  }
  if (o.iters < 1 || o.warmup < 0 || o.payload_mib < 1 || o.payload_mib > 1e6 || o.gemm_size < 64 ||
      o.tables_mib.empty()) {
    std::fprintf(stderr, "bad arguments\n");
    usage(stderr);
    return 2;
  }
  for (double S : o.gather_seq)
    if (!(S >= 1 && S <= 1048576 && S == std::floor(S))) {
      std::fprintf(stderr, "--gather-seq: expected whole numbers from 1 to 1048576, got %g\n", S);
      return 2;
    }
  for (double t : o.tables_mib)
    if (!(t > 0) || t * kMiB / kRowBytes > 4294967295.0) {
      std::fprintf(stderr, "bad table size %g MiB\n", t);
      return 2;
    }

  const DeviceInfo dev = probe_device();
  if (!dev.usable) {
    std::fprintf(stderr, "%s: nothing to measure\n", dev.reason.c_str());
    return 77;
  }
  std::printf("dsa-floor-bench on %s (%d SMs, L2 %.0f MiB); median of %d launches after %d warm-ups\n",
              dev.name.c_str(), dev.sm_count, dev.l2_bytes / kMiB, o.iters, o.warmup);
  std::fflush(stdout);

  std::vector<ScatterResult> sc, frag, gath;
  std::vector<std::vector<KeyGatherResult>> kg;  // per (ids, S): one result per in-flight depth
  GemmResult g;
  try {
    for (double mib : o.tables_mib) {
      ScatterConfig c;
      c.table_bytes = static_cast<uint64_t>(mib * kMiB);
      c.row_floats = kRowFloats;
      c.payload_bytes = static_cast<uint64_t>(o.payload_mib * kMiB);
      c.iters = o.iters;
      c.warmup = o.warmup;
      c.seed = o.seed;
      // Measures `ways` on this table, prints each, and appends them to `into`.
      auto measure_into = [&](const std::vector<ScatterWay>& ways, int name_width, std::vector<ScatterResult>& into) {
        for (const ScatterResult& r : measure_scatter(c, ways)) {
          std::fprintf(stderr, "  scatter %7.1f MiB %-*s %8.3f ms  %6.3f TB/s  check %s\n", mib_of(r), name_width,
                       scatter_way_name(r.way), r.t.median_ms, r.tbps, r.check_ok ? "ok" : "FAIL");
          into.push_back(r);
        }
      };
      measure_into(kAllScatterWays, 6, sc);
      measure_into({ScatterWay::float4_fragment}, 8, frag);
      measure_into({ScatterWay::gather_float4}, 8, gath);
    }
    for (bool causal : {false, true}) {
      for (double S : o.gather_seq) {
        KeyGatherConfig c;
        c.seq = static_cast<int64_t>(S);
        c.causal = causal;
        c.iters = o.iters;
        c.warmup = o.warmup;
        kg.push_back(measure_key_gather(c));
        for (const KeyGatherResult& r : kg.back())
          std::fprintf(stderr, "  key gather %-6s S %6lld  %d in flight  %8.3f ms  %7.1f ns/row  %6.3f TB/s\n",
                       causal ? "causal" : "random", (long long)r.seq, r.in_flight, r.t.median_ms, r.ns_per_row,
                       r.tbps);
      }
    }
    g = measure_gemm(o.gemm_size, o.iters, o.warmup);
    std::fprintf(stderr, "  gemm %d^3 %8.3f ms  %7.1f TFLOP/s  check %s (max rel err %.2g)\n", g.m, g.t.median_ms,
                 g.tflops, g.check_ok ? "ok" : "FAIL", g.max_rel_err);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsa-floor-bench: %s\n", e.what());
    return 1;
  }
  const auto fl = derive_floor(sc, g);

  std::printf("\nfp32 scatter-add of 512-B rows into random rows, TB/s of payload (%.0f MiB added per launch)\n",
              sc.empty() ? 0.0 : sc.front().payload_bytes / kMiB);
  std::printf("%10s %9s %9s %9s %9s %9s %9s %12s   %s\n", "table MiB", "rows", "float4", "scalar", "bulk", "fragment",
              "gather", "gather ns/r", "check");
  for (size_t i = 0; i + 2 < sc.size() && i / 3 < frag.size() && i / 3 < gath.size(); i += 3) {
    const ScatterResult& fr = frag[i / 3];
    const ScatterResult& ga = gath[i / 3];
    const bool ok = sc[i].check_ok && sc[i + 1].check_ok && sc[i + 2].check_ok && fr.check_ok && ga.check_ok;
    std::printf("%10.1f %9llu %9.3f %9.3f %9.3f %9.3f %9.3f %12.1f   %s\n", mib_of(sc[i]),
                (unsigned long long)sc[i].rows, sc[i].tbps, sc[i + 1].tbps, sc[i + 2].tbps, fr.tbps, ga.tbps,
                2048.0 * kRowBytes / (ga.tbps * 1e12) * 1e9, ok ? "ok" : "FAIL");
  }
  std::printf("(fragment: not a floor way; float4 adds in a wgmma accumulator's register pattern, 32 B into each\n"
              " of 16 rows per warp instruction)\n"
              "(gather: not a floor way; float4 adds that each first read the row's 256-B bf16 key from a key\n"
              " table of as many rows (half the bytes); gather ns/r: 2048 such adds, one query row at topk 2048)\n");
  std::printf("\nbf16 GEMM (cuBLAS, fp32 compute) %d^3: %.1f TFLOP/s (median %.3f ms, min %.3f, max %.3f)  check %s\n",
              g.m, g.tflops, g.t.median_ms, g.t.min_ms, g.t.max_ms, g.check_ok ? "ok" : "FAIL");
  std::printf("\nfloor per query row = max(topk*D*4 B / scatter rate, 6*H*D*topk / GEMM rate)\n");
  std::printf("%-16s %4s %4s %5s %6s %8s %8s %-6s %9s %9s %9s\n", "case", "H", "D", "topk", "S_kv", "dK MiB",
              "rate@MiB", "way", "scat ns", "gemm ns", "floor ns");
  for (const auto& r : fl)
    std::printf("%-16s %4lld %4lld %5lld %6lld %8.1f %8.1f %-6s %9.1f %9.1f %9.1f%s\n", r.c.name.c_str(),
                (long long)r.c.heads, (long long)r.c.dim, (long long)r.c.topk, (long long)r.c.seq_kv, r.dk_table_mib,
                r.rate_table_mib, r.way.c_str(), r.f.scatter_ns, r.f.gemm_ns, r.f.ns, r.approx ? "  (approx)" : "");
  std::printf("(approx: rate measured with 512-B rows into a table of another size than this dK)\n");

  std::printf("\nloss forward: key gather (cp.async of 256-B bf16 key rows into shared memory, D128 topk 2048) and\n"
              "its floor per query row = max(gather ns, 2*H*D*slots / GEMM rate) at H64\n");
  std::printf("%-7s %6s %8s %9s %9s %9s %7s %9s %9s %9s\n", "ids", "S", "valid/r", "2 blocks", "4 blocks", "6 blocks",
              "TB/s", "gather ns", "gemm ns", "floor ns");
  for (const auto& v : kg) {
    const KeyGatherResult& b = fastest(v);
    const ForwardFloor ff = forward_floor_per_row(b.ns_per_row, b.valid_slots_per_row, 64, b.dim, g.tflops);
    std::printf("%-7s %6lld %8.1f %9.1f %9.1f %9.1f %7.3f %9.1f %9.1f %9.1f\n", b.causal ? "causal" : "random",
                (long long)b.seq, b.valid_slots_per_row, v[0].ns_per_row, v[1].ns_per_row, v[2].ns_per_row, b.tbps,
                ff.gather_ns, ff.gemm_ns, ff.ns);
  }

  if (!o.json.empty()) write_json(o.json, dev, o, sc, frag, gath, kg, g, fl);
  bool ok = g.check_ok;
  for (const auto* results : {&sc, &frag, &gath}) {
    for (const auto& r : *results) ok = ok && r.check_ok;
  }
  if (!ok) {
    std::fprintf(stderr, "a correctness check failed\n");
    return 1;
  }
  return 0;
}
