// The bench's run and report (`dsaib bench` and the dsaib-bench binary): the
// floors the cases need, then every case, over the dsaib_bench core (bench/core); the
// table on the console and one JSON report. Compiled only when the project is built with
// CUDA (DSAIB_CLI_WITH_CUDA); run.cpp has the stub of other builds.
#include <cuda_runtime_api.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>

#include "bench_core.hpp"
#include "cli.hpp"

namespace dsaib::cli {
namespace {

using bench::BenchOp;

constexpr double kMiB = 1024.0 * 1024.0;
constexpr uint64_t kScatterPayloadBytes = 1ull << 30;  // added per scatter launch
constexpr int kGemmSize = 8192;

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string version_string(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

bool uses_scatter(BenchOp op) { return op == BenchOp::backward || op == BenchOp::step || op == BenchOp::one_call; }
bool uses_gather(BenchOp op) { return op != BenchOp::backward && op != BenchOp::topk; }

// ---------------------------------------------------------------- the floors

/// The scatter measurements of one dK table (size, row length): every floor way, the
/// best, and the key-read way (ScatterWay::gather_float4, not a floor way) of the
/// traffic floor.
struct TableRates {
  std::vector<bench::ScatterResult> ways;
  const bench::ScatterResult* best = nullptr;
  bench::ScatterResult key_read;
};

/// The key gather of one (causal, S, D, topk): every variant and the fastest.
struct GatherRates {
  std::vector<bench::KeyGatherResult> variants;
  const bench::KeyGatherResult* best = nullptr;
};
using GatherKey = std::tuple<bool, int64_t, int64_t, int64_t>;  // causal, S, D, topk
using BatchedKey = std::tuple<int64_t, int64_t, int64_t>;       // Hq, Dqk, topk

/// The floor measurements of the run. Moved, never copied: `best` pointers point into
/// their own vectors.
struct Floors {
  Floors() = default;
  Floors(Floors&&) = default;
  Floors& operator=(Floors&&) = default;
  Floors(const Floors&) = delete;
  Floors& operator=(const Floors&) = delete;

  bool measured = false;                                      // false with --no-floor
  std::map<std::pair<uint64_t, int64_t>, TableRates> tables;  // (dK bytes, D) -> rates
  std::map<GatherKey, GatherRates> gathers;
  std::vector<bench::GemmResult> gemm_ways;                   // cuBLAS 8192^3 at each layout
  std::optional<bench::GemmResult> gemm;                      // the fastest of them (every op but the target)
  std::optional<bench::GemmResult> gemm_e4m3;                 // cuBLASLt e4m3 8192^3 (the top-k's e4m3 cases)
  std::map<BatchedKey, bench::GemmResult> batched;            // the target's shape
  bool checks_ok = true;                                      // every measurement's correctness check
};

GatherKey gather_key(const bench::OpCase& c) { return {bench::is_causal(c.ids), c.seq, c.dim, c.topk}; }

/// The cases (--op x --ids x --seq; the target x --shapes), checked against the library's
/// rules before anything runs.
std::vector<bench::OpCase> bench_cases(const BenchArgs& a) {
  std::vector<bench::OpCase> cases;
  for (const std::string& word : a.ops) {
    BenchOp op;
    if (!bench::parse_bench_op(word, &op)) {
      throw Error(ErrorCode::invalid_argument, "op", "--op: expected one of " + bench::bench_op_list() + ", got " + word);
    }
    const std::vector<std::pair<int64_t, int64_t>> shapes =
        op == BenchOp::target ? a.shapes
        : op == BenchOp::topk ? a.topk_shapes
                              : std::vector<std::pair<int64_t, int64_t>>{{a.heads, a.dim}};
    // topk's cases go over --ranges instead of --ids (its rows see key ranges, not ids).
    const std::vector<std::string>& patterns = op == BenchOp::topk ? a.ranges : a.ids;
    // topk's cases go over --topk-dtype too (index_q and index_k in bf16 or e4m3).
    const std::vector<std::string> dtypes = op == BenchOp::topk ? a.topk_dtypes : std::vector<std::string>{"bf16"};
    for (const std::string& dtype : dtypes)
    for (const std::string& ids : patterns) {
      for (const auto& [heads, dim] : shapes) {
        for (int64_t s : a.seqs) {
          bench::OpCase c;
          c.op = op;
          if (!bench::parse_topk_dtype(dtype, &c.e4m3)) {
            throw Error(ErrorCode::invalid_argument, "topk_dtype", "--topk-dtype: expected bf16 or e4m3, got " + dtype);
          }
          if (op == BenchOp::topk) {
            if (!bench::parse_topk_ranges(ids, &c.ranges)) {
              throw Error(ErrorCode::invalid_argument, "ranges",
                          "--ranges: expected one of " + bench::topk_ranges_list() + ", got \"" + ids + "\"");
            }
            c.ids = bench::IdPattern::causal;  // unused
          } else if (!bench::parse_id_pattern(ids, &c.ids)) {
            throw Error(ErrorCode::invalid_argument, "ids",
                        "--ids: expected one of " + bench::id_pattern_list() + ", got \"" + ids + "\"");
          }
          c.batch = a.batch;
          c.seq = s;
          c.heads = heads;
          c.dim = dim;
          c.topk = a.topk;
          c.write_index_score = a.index_score;
          c.from_topk_logits = a.topk_logits && (op == BenchOp::kl_forward || op == BenchOp::one_call);
          if (!parse_lse_base(a.lse_base, &c.lse_base)) {
            throw Error(ErrorCode::invalid_argument, "lse_base", "--lse-base: expected natural or base2, got " + a.lse_base);
          }
          c.normalize = !a.unnormalized;
          if (!parse_a_operand_precision(a.a_operand, &c.a_operand)) {
            throw Error(ErrorCode::invalid_argument, "a_operand",
                        "--a-operand: expected auto, bf16x2 or bf16, got " + a.a_operand);
          }
          if (!parse_l2_hints(a.l2_hints, &c.l2_hints)) {
            throw Error(ErrorCode::invalid_argument, "l2_hints", "--l2-hints: expected auto, on or off, got " + a.l2_hints);
          }
          if (!parse_start_stagger(a.start_stagger, &c.start_stagger)) {
            throw Error(ErrorCode::invalid_argument, "start_stagger",
                        "--start-stagger: expected auto or off, got " + a.start_stagger);
          }
          if (!parse_forward_fusion(a.forward_fusion, &c.forward_fusion)) {
            throw Error(ErrorCode::invalid_argument, "forward_fusion",
                        "--forward-fusion: expected auto or off, got " + a.forward_fusion);
          }
          c.deterministic = a.deterministic;
          try {
            bench::check_case(c);
          } catch (const Error& e) {
            throw Error(e.code(), e.argument(), std::string(bench::bench_op_name(op)) + " " + ids + " S " +
                                                    std::to_string(s) + ": " + e.what());
          }
          cases.push_back(c);
        }
      }
    }
  }
  return cases;
}

std::string device_line(const bench::DeviceInfo& dev) {
  return dev.name + " (sm_" + std::to_string(dev.cc_major) + std::to_string(dev.cc_minor) + ", " +
         std::to_string(dev.sm_count) + " SMs, L2 " + fmt("%.1f", dev.l2_bytes / kMiB) + " MiB, " +
         (dev.l2_persisting_bytes >= 0 ? fmt("%.2f", dev.l2_persisting_bytes / kMiB) + " MiB" : std::string("unknown")) +
         " set aside for persisting lines), driver " + version_string(dev.driver_version) + ", runtime " +
         version_string(dev.runtime_version);
}

std::string ops_text(const BenchArgs& a) {
  std::string s;
  for (const std::string& op : a.ops) s += (s.empty() ? "" : ", ") + op;
  return s;
}

void print_header(std::ostream& out, const BenchArgs& a, const bench::DeviceInfo& dev) {
  out << a.tool << "\n"
      << "  ops         " << ops_text(a) << "\n"
      << "  device      " << device_line(dev) << "\n"
      << "  method      CUDA events around each launch; median (min-max) of " << a.iters << " launches after "
      << a.warmup << " warm-ups; input sets rotated beyond L2\n"
      << "  sustained   "
      << (a.sustained_ms > 0 ? fmt("%g", a.sustained_ms) + " ms of launches back to back per case (steady state "
                                                           "under the power limit: median of the second half)"
                             : std::string("off (--sustained-ms 0)"))
      << "\n"
      << std::flush;
}

/// 1. The floors the cases need, each measured once in this run.
Floors measure_floors(const BenchArgs& a, const std::vector<bench::OpCase>& cases) {
  Floors f;
  f.measured = true;
  bool square_gemm = false, e4m3_gemm = false;
  for (const bench::OpCase& c : cases) {
    e4m3_gemm = e4m3_gemm || c.e4m3;
    if (uses_scatter(c.op)) f.tables[{c.dk_table_bytes(), c.dim}];
    if (uses_gather(c.op)) f.gathers[gather_key(c)];
    if (c.op == BenchOp::target) {
      f.batched[{c.heads, c.dim, c.topk}];
    } else {
      square_gemm = true;
    }
  }
  for (auto& [key, rates] : f.tables) {  // filled in place: rates.best points into rates.ways
    log_stage("floor: scatter-add into a " + fmt("%.1f", key.first / kMiB) + " MiB fp32 table, rows of " +
              std::to_string(key.second) + " floats ...");
    bench::ScatterConfig sc;
    sc.table_bytes = key.first;
    sc.row_floats = static_cast<int>(key.second);
    sc.payload_bytes = kScatterPayloadBytes;
    sc.iters = a.iters;
    sc.warmup = a.warmup;
    rates.ways = bench::measure_scatter(sc);
    rates.best = &bench::fastest(rates.ways);
    for (const auto& r : rates.ways) f.checks_ok = f.checks_ok && r.check_ok;
    rates.key_read = bench::measure_scatter(sc, {bench::ScatterWay::gather_float4}).at(0);
    f.checks_ok = f.checks_ok && rates.key_read.check_ok;
  }
  for (auto& [key, rates] : f.gathers) {
    const auto& [causal, seq, dim, topk] = key;
    log_stage(std::string("floor: key gather, ") + (causal ? "causal" : "random") + " S=" + std::to_string(seq) +
              " D=" + std::to_string(dim) + " topk=" + std::to_string(topk) + ", three ways ...");
    bench::KeyGatherConfig g;
    g.seq = seq;
    g.dim = static_cast<int>(dim);
    g.topk = topk;
    g.causal = causal;
    g.iters = a.iters;
    g.warmup = a.warmup;
    g.input_sets = a.input_sets;
    rates.variants = bench::measure_key_gather(g);
    for (const auto& r : rates.variants) f.checks_ok = f.checks_ok && r.check_ok;
    rates.best = &bench::fastest(rates.variants);
  }
  if (square_gemm) {
    log_stage("floor: cuBLAS bf16 GEMM " + std::to_string(kGemmSize) + "^3, four layouts ...");
    f.gemm_ways = bench::measure_gemm_layouts(kGemmSize, a.iters, a.warmup);
    for (const auto& g : f.gemm_ways) f.checks_ok = f.checks_ok && g.check_ok;
    f.gemm = bench::fastest(f.gemm_ways);
  }
  if (e4m3_gemm) {
    log_stage("floor: cuBLASLt e4m3 GEMM " + std::to_string(kGemmSize) + "^3 (TN) ...");
    f.gemm_e4m3 = bench::measure_gemm_e4m3(kGemmSize, a.iters, a.warmup);
    f.checks_ok = f.checks_ok && f.gemm_e4m3->check_ok;
  }
  for (auto& [key, g] : f.batched) {
    const auto& [h, d, topk] = key;
    const double flop_per_row = 2.0 * h * d * static_cast<double>(topk);
    const int batch = static_cast<int>(std::clamp(std::ceil(4e11 / flop_per_row), 1.0, 8192.0));
    log_stage("floor: cuBLAS bf16 GEMM, batched " + std::to_string(batch) + " x " + std::to_string(h) + "x" +
              std::to_string(topk) + "x" + std::to_string(d) + " ...");
    g = bench::measure_gemm_batched(static_cast<int>(h), static_cast<int>(topk), static_cast<int>(d), batch, a.iters,
                                    a.warmup);
    f.checks_ok = f.checks_ok && g.check_ok;
  }
  return f;
}

std::string gather_cell(const GatherRates& g, bench::GatherMethod m) {
  const bench::KeyGatherResult* r = bench::fastest_of(g.variants, m);
  return r ? fmt("%.1f", r->ns_per_row) : std::string("-");
}

void print_floors(std::ostream& out, const Floors& f) {
  out << "  floors      measured in this run, each the best of several ways\n";
  char line[320];
  if (!f.tables.empty()) {
    out << "    scatter-add, fp32 rows into random rows of the dK table, " << fmt("%.0f", kScatterPayloadBytes / kMiB)
        << " MiB per launch, TB/s:\n";
    std::snprintf(line, sizeof line, "    %12s %10s %4s %8s %8s %8s  %-6s %10s  %s\n", "dK table", "rows", "D", "float4",
                  "scalar", "bulk", "best", "key-read", "check");
    out << line;
    for (const auto& [key, rates] : f.tables) {
      std::map<std::string, double> tb;
      bool ok = true;
      for (const auto& r : rates.ways) {
        tb[bench::scatter_way_name(r.way)] = r.tbps;
        ok = ok && r.check_ok;
      }
      ok = ok && rates.key_read.check_ok;
      std::snprintf(line, sizeof line, "    %8.1f MiB %10llu %4lld %8.3f %8.3f %8.3f  %-6s %10.3f  %s\n",
                    key.first / kMiB, (unsigned long long)rates.best->rows, (long long)key.second, tb["float4"],
                    tb["scalar"], tb["bulk"], bench::scatter_way_name(rates.best->way), rates.key_read.tbps,
                    ok ? "ok" : "FAIL");
      out << line;
    }
    out << "    key-read: not a floor way; the float4 way with each row-add first reading its row's D-element bf16\n"
        << "    key from a key table of as many rows (the op's K gather beside its dK reduce): the traffic floor\n";
  }
  if (!f.gathers.empty()) {
    out << "    key gather, ns per query row (each way at its best depth and CTA count; the fastest is the floor):\n";
    std::snprintf(line, sizeof line, "    %-7s %6s %4s %5s %9s %4s %8s %9s %8s  %-64s %6s  %s\n", "ids", "S", "D", "topk",
                  "valid/row", "sets", "vector", "cp.async", "bulk", "fastest", "TB/s", "check");
    out << line;
    for (const auto& [key, g] : f.gathers) {
      const auto& [causal, seq, dim, topk] = key;
      bool ok = true;
      for (const auto& r : g.variants) ok = ok && r.check_ok;
      std::snprintf(line, sizeof line, "    %-7s %6lld %4lld %5lld %9.1f %4d %8s %9s %8s  %-64s %6.2f  %s\n",
                    causal ? "causal" : "random", (long long)seq, (long long)dim, (long long)topk,
                    g.best->valid_slots_per_row, g.best->input_sets,
                    gather_cell(g, bench::GatherMethod::vector_loads).c_str(),
                    gather_cell(g, bench::GatherMethod::cp_async_ring).c_str(),
                    gather_cell(g, bench::GatherMethod::bulk_copy).c_str(),
                    bench::gather_variant_name(*g.best).c_str(), g.best->tbps, ok ? "ok" : "FAIL");
      out << line;
    }
  }
  if (f.gemm) {
    out << "    bf16 GEMM (cuBLAS, fp32 compute) " << kGemmSize << "^3, TFLOP/s by operand layout:";
    bool ok = true;
    for (const auto& g : f.gemm_ways) {
      out << " " << bench::gemm_layout_name(g.layout) << " " << fmt("%.1f", g.tflops);
      ok = ok && g.check_ok;
    }
    out << "; fastest " << bench::gemm_layout_name(f.gemm->layout) << " " << fmt("%.1f", f.gemm->tflops)
        << " TFLOP/s  check " << (ok ? "ok" : "FAIL") << "\n";
  }
  if (f.gemm_e4m3) {
    out << "    e4m3 GEMM (cuBLASLt, TN, fp32 compute, bf16 out) " << kGemmSize << "^3: "
        << fmt("%.1f", f.gemm_e4m3->tflops) << " TFLOP/s  check " << (f.gemm_e4m3->check_ok ? "ok" : "FAIL") << "\n";
  }
  for (const auto& [key, g] : f.batched) {
    out << "    bf16 GEMM (cuBLAS, batched " << g.batch << " x " << g.m << "x" << g.n << "x" << g.k
        << ", fp32 compute): " << fmt("%.1f", g.tflops) << " TFLOP/s  check " << (g.check_ok ? "ok" : "FAIL") << "\n";
  }
}

/// A case's floor (JSON and table columns); null / "-" without floor measurements.
struct CaseFloor {
  nlohmann::ordered_json floor = nullptr, ratio = nullptr, traffic = nullptr, traffic_ratio = nullptr;
  double ns = 0, traffic_ns = 0;
  std::string floor_ns = "-", floor_x = "-", bound = "-";
};

nlohmann::ordered_json gather_floor_fields(const GatherRates& g) {
  return {{"gather_ns", g.best->ns_per_row},
          {"gather_method", bench::gather_method_name(g.best->method)},
          {"gather_variant", bench::gather_variant_name(*g.best)},
          {"gather_tbps", g.best->tbps}};
}

CaseFloor case_floor(const bench::OpCase& c, const bench::OpResult& r, const Floors& f, const bench::DeviceInfo& dev) {
  CaseFloor cf;
  // Given the top-k's logits the forward only streams ids, logits and targets:
  // none of the floors measured here bounds that, so it gets none.
  if (!f.measured || (c.from_topk_logits && c.op == BenchOp::kl_forward)) return cf;
  nlohmann::ordered_json j;
  // Given the top-k's logits the one call's forward runs no GEMM and gathers
  // nothing: its floor is the backward's.
  switch (c.from_topk_logits && c.op == BenchOp::one_call ? BenchOp::backward : c.op) {
    case BenchOp::backward: {
      const TableRates& rates = f.tables.at({c.dk_table_bytes(), c.dim});
      const bench::Floor fl = bench::floor_per_row(static_cast<double>(c.topk), c.heads, c.dim, rates.best->tbps,
                                                   f.gemm->tflops);
      const bench::Floor fv =
          bench::floor_per_row(r.valid_slots_per_row, c.heads, c.dim, rates.best->tbps, f.gemm->tflops);
      j = {{"formula", "max(topk*D*4 B / scatter rate, 6*H*D*topk FLOP / GEMM rate)"},
           {"dk_table_bytes", c.dk_table_bytes()},
           {"dk_fits_l2", static_cast<int64_t>(c.dk_table_bytes()) <= dev.l2_bytes},
           {"scatter_way", bench::scatter_way_name(rates.best->way)},
           {"scatter_tbps", rates.best->tbps},
           {"gemm_tflops", f.gemm->tflops},
           {"scatter_ns", fl.scatter_ns},
           {"gemm_ns", fl.gemm_ns},
           {"ns_per_row", fl.ns},
           {"bound", fl.bound},
           {"valid_slots_ns_per_row", fv.ns}};
      cf.ns = fl.ns;
      cf.bound = fl.bound;
      cf.traffic_ns = bench::traffic_floor_ns_per_row(static_cast<double>(c.topk), c.dim, rates.key_read.tbps);
      if (cf.traffic_ns > 0) {  // 0: no key-read rate (never with a timed launch); then no traffic floor
        cf.traffic = {{"key_read_scatter_tbps", rates.key_read.tbps},
                      {"ns_per_row", cf.traffic_ns},
                      {"valid_slots_ns_per_row",
                       bench::traffic_floor_ns_per_row(r.valid_slots_per_row, c.dim, rates.key_read.tbps)}};
        cf.traffic_ratio = r.ns_per_row / cf.traffic_ns;
      }
      break;
    }
    case BenchOp::kl_forward:
    case BenchOp::target: {
      const GatherRates& g = f.gathers.at(gather_key(c));
      const bench::GemmResult& gemm = c.op == BenchOp::target ? f.batched.at({c.heads, c.dim, c.topk}) : *f.gemm;
      const bench::ForwardFloor fl =
          bench::forward_floor_per_row(g.best->ns_per_row, r.valid_slots_per_row, c.heads, c.dim, gemm.tflops);
      j = {{"formula", "max(gather_ns, 2*H*D*slots FLOP / GEMM rate)"}};
      j.update(gather_floor_fields(g));
      j["gemm_tflops"] = gemm.tflops;
      if (c.op == BenchOp::target) {
        j["gemm_batch"] = gemm.batch;
        j["gemm_check"] = gemm.check_ok;
      }
      j["gemm_ns"] = fl.gemm_ns;
      j["ns_per_row"] = fl.ns;
      j["bound"] = fl.bound;
      cf.ns = fl.ns;
      cf.bound = fl.bound;
      break;
    }
    case BenchOp::topk: {
      // e4m3 inputs: the fp8 GEMM rate
      const bench::GemmResult& gemm = c.e4m3 ? *f.gemm_e4m3 : *f.gemm;
      const double ns = bench::topk_floor_ns_per_row(r.visible_keys_per_row, c.heads, c.dim, gemm.tflops);
      j = {{"formula", "visible_keys_per_row*H*D*2 FLOP / GEMM rate"},
           {"visible_keys_per_row", r.visible_keys_per_row},
           {"flop_per_row", 2.0 * static_cast<double>(c.heads) * static_cast<double>(c.dim) * r.visible_keys_per_row},
           {"gemm_dtype", c.e4m3 ? "e4m3" : "bf16"},
           {"gemm_tflops", gemm.tflops},
           {"gemm_layout", bench::gemm_layout_name(gemm.layout)},
           {"ns_per_row", ns},
           {"bound", "gemm"}};
      cf.ns = ns;
      cf.bound = "gemm";
      break;
    }
    case BenchOp::step:
    case BenchOp::one_call: {
      const TableRates& rates = f.tables.at({c.dk_table_bytes(), c.dim});
      const GatherRates& g = f.gathers.at(gather_key(c));
      const bench::StepFloor fl = bench::step_floor_per_row(static_cast<double>(c.topk), c.heads, c.dim,
                                                            rates.best->tbps, f.gemm->tflops, g.best->ns_per_row);
      const bench::StepFloor fv = bench::step_floor_per_row(r.valid_slots_per_row, c.heads, c.dim, rates.best->tbps,
                                                            f.gemm->tflops, g.best->ns_per_row);
      j = {{"formula", "max(topk*D*4 B / scatter rate, 8*H*D*topk FLOP / GEMM rate, gather_ns)"},
           {"dk_table_bytes", c.dk_table_bytes()},
           {"scatter_way", bench::scatter_way_name(rates.best->way)},
           {"scatter_tbps", rates.best->tbps},
           {"gemm_tflops", f.gemm->tflops},
           {"scatter_ns", fl.scatter_ns},
           {"gemm_ns", fl.gemm_ns}};
      j.update(gather_floor_fields(g));
      j["ns_per_row"] = fl.ns;
      j["bound"] = fl.bound;
      j["valid_slots_ns_per_row"] = fv.ns;
      cf.ns = fl.ns;
      cf.bound = fl.bound;
      break;
    }
  }
  cf.floor = j;
  cf.ratio = r.ns_per_row / cf.ns;
  cf.floor_ns = fmt("%.1f", cf.ns);
  cf.floor_x = fmt("%.2f", r.ns_per_row / cf.ns);
  return cf;
}

nlohmann::ordered_json stats_json(const bench::Stats& t) {
  return {{"median_ms", t.median_ms}, {"min_ms", t.min_ms}, {"max_ms", t.max_ms}, {"runs", t.runs}};
}

/// The sustained run's line of the table and its JSON (null when none ran).
nlohmann::ordered_json report_sustained(std::ostream& out, const bench::OpResult& r, const CaseFloor& cf) {
  if (r.sustained_launches <= 0) return nullptr;
  const bool backward = r.c.op == BenchOp::backward;
  nlohmann::ordered_json j = {{"launches", r.sustained_launches},
                              {"seconds", r.sustained_seconds},
                              {"ns_per_row", r.ns_per_row_sustained},
                              {"ns_per_row_first_half", r.ns_per_row_sustained_first_half},
                              {"floor_ratio", nullptr}};
  std::string extra;
  if (cf.ns > 0) {
    j["floor_ratio"] = r.ns_per_row_sustained / cf.ns;
    extra += ", xfloor " + fmt("%.2f", r.ns_per_row_sustained / cf.ns);
  }
  if (backward) {
    j["traffic_floor_ratio"] = nullptr;
    if (cf.traffic_ns > 0) {
      j["traffic_floor_ratio"] = r.ns_per_row_sustained / cf.traffic_ns;
      extra += ", xtraffic " + fmt("%.2f", r.ns_per_row_sustained / cf.traffic_ns);
    }
    j["fixed_floor_ratio"] = r.ns_per_row_sustained / bench::kFixedFloorNsPerRow;
    extra += ", x278 " + fmt("%.2f", r.ns_per_row_sustained / bench::kFixedFloorNsPerRow);
  }
  char line[320];
  std::snprintf(line, sizeof line,
                "%-8s %-15s   sustained: %d launches back to back, %.3f s: %.1f ns/row (second half; first half "
                "%.1f)%s\n",
                "", "", r.sustained_launches, r.sustained_seconds, r.ns_per_row_sustained,
                r.ns_per_row_sustained_first_half, extra.c_str());
  out << line << std::flush;
  return j;
}

/// The top-k's extra memory: a line under its case, and its JSON.
std::string mib_or_dash(int64_t bytes) { return bytes < 0 ? std::string("-") : fmt("%.1f MiB", bytes / kMiB); }

std::string topk_memory_line(const bench::TopkMemory& m) {
  return std::string(19, ' ') + "  extra memory: workspace " + mib_or_dash(static_cast<int64_t>(m.workspace_bytes)) +
         " (ids alone " + mib_or_dash(static_cast<int64_t>(m.workspace_bytes_ids_only)) +
         "); one call with its own workspace: pool peak used " + mib_or_dash(m.pool_used_high_bytes) + ", reserved " +
         mib_or_dash(m.pool_reserved_high_bytes) + ", cudaMemGetInfo delta " + mib_or_dash(m.mem_get_info_delta_bytes) +
         "\n";
}

nlohmann::ordered_json topk_memory_json(const bench::TopkMemory& m) {
  auto measured = [](int64_t v) { return v < 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(v); };
  return {{"workspace_bytes", m.workspace_bytes},
          {"workspace_bytes_ids_only", m.workspace_bytes_ids_only},
          {"pool_used_high_bytes", measured(m.pool_used_high_bytes)},
          {"pool_reserved_high_bytes", measured(m.pool_reserved_high_bytes)},
          {"mem_get_info_delta_bytes", measured(m.mem_get_info_delta_bytes)}};
}

/// A case's ids column: its id pattern, or the top-k's key ranges (and " e4m3" for float8 inputs).
std::string case_pattern(const bench::OpCase& c) {
  if (c.op != BenchOp::topk) return bench::id_pattern_name(c.ids);
  return std::string(bench::topk_ranges_name(c.ranges)) + (c.e4m3 ? " e4m3" : "");
}

/// 2. One case: its line(s) of the table, and its JSON.
nlohmann::ordered_json run_case(std::ostream& out, const bench::OpCase& c, const bench::OpConfig& cfg,
                                const Floors& f, const bench::DeviceInfo& dev) {
  log_stage(std::string("op: ") + bench::bench_op_name(c.op) + " " +
            case_pattern(c) +
            " S=" + std::to_string(c.seq) + " H=" + std::to_string(c.heads) + " D=" + std::to_string(c.dim) +
            ": generating, uploading, " + std::to_string(cfg.warmup) + " + " + std::to_string(cfg.iters) +
            " launches" + (cfg.sustained_ms > 0 ? ", then ~" + fmt("%g", cfg.sustained_ms) + " ms back to back" : "") +
            " ...");
  const bench::OpResult r = bench::run_op_case(c, cfg);
  const bool backward = c.op == BenchOp::backward, topk = c.op == BenchOp::topk;
  const CaseFloor cf = case_floor(c, r, f, dev);
  char spread[64];
  std::snprintf(spread, sizeof spread, "(%.1f-%.1f)", r.ns_per_row_min, r.ns_per_row_max);
  std::string extra;
  if (backward) {
    if (!cf.traffic_ratio.is_null()) extra += "xtraffic " + fmt("%.2f", cf.traffic_ratio.get<double>()) + " ";
    extra += "x278 " + fmt("%.2f", r.ns_per_row / bench::kFixedFloorNsPerRow);
  }
  char line[400];
  std::snprintf(line, sizeof line,
                "%-8s %-15s %3lld %6lld %4lld %4lld %5lld %9.1f %4d %8.1f %19s %8.1f %9s %-7s %7s  %s\n",
                bench::bench_op_name(c.op), case_pattern(c).c_str(),
                (long long)c.batch, (long long)c.seq, (long long)c.heads, (long long)c.dim, (long long)c.topk,
                topk ? r.visible_keys_per_row : r.valid_slots_per_row, r.input_sets,
                r.ns_per_row, spread, r.tflops, cf.floor_ns.c_str(), cf.bound.c_str(), cf.floor_x.c_str(),
                extra.c_str());
  out << line << std::flush;
  if (topk) out << topk_memory_line(r.topk_memory) << std::flush;
  const nlohmann::ordered_json sustained = report_sustained(out, r, cf);
  nlohmann::ordered_json j = {{"op", bench::bench_op_name(c.op)}};
  if (topk) {
    j["ranges"] = bench::topk_ranges_name(c.ranges);
    j["dtype"] = c.e4m3 ? "e4m3" : "bf16";
  } else {
    j["ids"] = bench::id_pattern_name(c.ids);
  }
  j["batch"] = c.batch;
  j["seq"] = c.seq;
  if (topk) j["seq_q"] = r.query_rows;
  j["seq_kv"] = c.seq;
  j["heads"] = c.heads;
  j["dim"] = c.dim;
  j["topk"] = c.topk;
  if (topk) {
    j["layout"] = "bshd";
    j["order"] = "logit_descending";
    j["outputs"] = "topk_indices and topk_logits";
    j["workspace"] = "the caller's, of indexer_topk_workspace_size bytes";
    j["visible_keys_per_row"] = r.visible_keys_per_row;
  } else if (c.op == BenchOp::target) {
    j["lse_base"] = lse_base_name(c.lse_base);
    j["normalize"] = c.normalize;
  } else {
    j["a_operand_precision"] = a_operand_precision_name(c.a_operand);
    j["l2_hints"] = l2_hints_name(c.l2_hints);
    j["start_stagger"] = start_stagger_name(c.start_stagger);
    j["forward_fusion"] = forward_fusion_name(c.forward_fusion);
    j["deterministic"] = c.deterministic;
  }
  if (c.op == BenchOp::kl_forward) j["index_score"] = c.write_index_score;
  if (c.op == BenchOp::kl_forward || c.op == BenchOp::one_call) j["topk_logits"] = c.from_topk_logits;
  j["valid_slots_per_row"] = r.valid_slots_per_row;
  j["input_sets"] = r.input_sets;
  j["input_set_bytes"] = r.set_bytes;
  j["workspace_bytes"] = r.workspace_bytes;
  j["timing"] = stats_json(r.t);
  j["launch_ms"] = r.ms;
  j["ns_per_row"] = r.ns_per_row;
  j["ns_per_row_min"] = r.ns_per_row_min;
  j["ns_per_row_max"] = r.ns_per_row_max;
  j["tflops"] = r.tflops;
  j["dk_reduce_gbps"] = uses_scatter(c.op) ? nlohmann::ordered_json(r.dk_gbps) : nlohmann::ordered_json(nullptr);
  j["floor"] = cf.floor;
  j["floor_ratio"] = cf.ratio;
  if (topk) j["memory"] = topk_memory_json(r.topk_memory);
  if (backward) {
    j["traffic_floor"] = cf.traffic;
    j["traffic_floor_ratio"] = cf.traffic_ratio;
    j["fixed_floor_ratio"] = r.ns_per_row / bench::kFixedFloorNsPerRow;
  }
  j["sustained"] = sustained;
  return j;
}

nlohmann::ordered_json method_json() {
  return {
      {"op", "the whole op on the cuda backend, per case (cases[].op): backward = indexer_backward given P (dK "
             "workspace zeroing, fused kernel, bf16 cast of dK); forward = indexer_kl_forward; step = "
             "indexer_kl_forward then the P-free indexer_backward; one-call = indexer_kl_loss_and_grad; target = "
             "attention_target (heads = Hq, dim = Dqk); topk = indexer_topk (BSHD, B 1, local ids, "
             "logit_descending, topk_indices and topk_logits, the caller's workspace; causal: S query rows against S "
             "keys; cp-shard: the S/2 rows of the second half against all S keys, as starts/ends)"},
      {"timing", "CUDA events recorded around each launch on a non-blocking stream, after a 3 ms GPU spin, "
                 "synchronised after each; warm-up launches untimed"},
      {"statistics", "median, min and max over the timed launches; ns_per_row = time / (B*S_q) (topk: / seq_q)"},
      {"sustained", "after the timed launches, settings.sustained_ms of launches back to back (an event between "
                    "each two, no spin, no host wait); sustained.ns_per_row = the median over the second half "
                    "of them (the steady state under the GPU's power limit), ratios as above; null when 0"},
      {"tflops", "useful FLOP per valid slot / median time: 6*H*D (backward), 2*H*D (forward, target), 8*H*D (step, "
                 "one-call); topk: 2*H*D per visible key"},
      {"dk_reduce_gbps", "D*4 bytes of fp32 dK reduce per valid slot / median time (backward, step, one-call)"},
      {"input_rotation", bench::rotation_method()},
      {"floor_formula", kBenchFloorFormula},
      {"gather_floor_formula", kBenchGatherFloorFormula},
      {"step_floor_formula", kBenchStepFloorFormula},
      {"topk_floor_formula", kBenchTopkFloorFormula},
      {"topk_memory", "memory (topk): workspace_bytes = indexer_topk_workspace_size of the timed call (ids and "
                      "logits), workspace_bytes_ids_only without topk_logits; then, after one untimed call, one call "
                      "with the library's own stream-ordered workspace: pool_used_high_bytes and "
                      "pool_reserved_high_bytes = the device's current memory pool's high-water marks over it (reset "
                      "before), mem_get_info_delta_bytes = cudaMemGetInfo's free bytes before minus after it with "
                      "the pool keeping what it reserved"},
      {"floor_ways", "every floor term is the best of the ways measured in this run: the scatter rate of three "
                     "(floor_measurements.scatter), the key gather of three at a few depths and CTA counts "
                     "(floor_measurements.key_gather, each variant with its time and check), the GEMM rate the "
                     "best of cuBLAS at four operand layouts (floor_measurements.gemm.ways; the target's: cuBLAS "
                     "batched at its shape, gemm_batched)"},
      {"floor_valid_slots", "floor.valid_slots_ns_per_row (backward, step, one-call): the same formula with the "
                            "valid slots per row actually present (causal rows t < topk hold t+1) instead of topk"},
      {"floor_ratio", "ns_per_row / floor.ns_per_row"},
      {"traffic_floor_formula", kBenchTrafficFloorFormula},
      {"traffic_floor_ratio", "ns_per_row / traffic_floor.ns_per_row (backward; not the floor: a reference for how "
                              "close the op is to the memory traffic any design that reads each selected key's row "
                              "once per query row and adds its dK row in fp32 must move)"},
      {"fixed_floor_ratio", "ns_per_row / 278 (backward; a fixed reference floor for H64 D128 topk 2048: the dK "
                            "reduce of 2048 rows of 128 fp32 values at 3.77 TB/s, with dK in L2)"},
      {"fixed_floor_ns_per_row", bench::kFixedFloorNsPerRow}};
}

nlohmann::ordered_json scatter_json(const bench::ScatterResult& r) {
  return {{"table_bytes", r.table_bytes},
          {"rows", r.rows},
          {"row_bytes", r.row_floats * 4},
          {"way", bench::scatter_way_name(r.way)},
          {"payload_bytes", r.payload_bytes},
          {"grid", r.grid},
          {"block", r.block},
          {"timing", stats_json(r.t)},
          {"tbps", r.tbps},
          {"check", r.check_ok}};
}

nlohmann::ordered_json gemm_json(const bench::GemmResult& g) {
  return {{"m", g.m},
          {"n", g.n},
          {"k", g.k},
          {"batch", g.batch},
          {"dtype", g.e4m3 ? "e4m3" : "bf16"},
          {"compute", "fp32"},
          {"method", g.e4m3 ? "cublaslt" : "cublas"},
          {"layout", bench::gemm_layout_name(g.layout)},
          {"timing", stats_json(g.t)},
          {"tflops", g.tflops},
          {"check", g.check_ok},
          {"max_rel_err", g.max_rel_err}};
}

nlohmann::ordered_json gather_json(const GatherKey& key, const GatherRates& g) {
  const auto& [causal, seq, dim, topk] = key;
  nlohmann::ordered_json variants = nlohmann::ordered_json::array();
  for (const bench::KeyGatherResult& r : g.variants) {
    variants.push_back({{"method", bench::gather_method_name(r.method)},
                        {"variant", bench::gather_variant_name(r)},
                        {"depth", r.depth},
                        {"ctas_per_sm", r.ctas_per_sm},
                        {"grid", r.grid},
                        {"block", r.block},
                        {"smem_bytes", r.smem_bytes},
                        {"timing", stats_json(r.t)},
                        {"ns_per_row", r.ns_per_row},
                        {"tbps", r.tbps},
                        {"check", r.check_ok}});
  }
  nlohmann::ordered_json best_of = nlohmann::ordered_json::object();
  for (bench::GatherMethod m : bench::kAllGatherMethods) {
    const bench::KeyGatherResult* r = bench::fastest_of(g.variants, m);
    best_of[bench::gather_method_name(m)] = r ? nlohmann::ordered_json(r->ns_per_row) : nlohmann::ordered_json(nullptr);
  }
  return {{"ids", causal ? "causal" : "random"},
          {"seq", seq},
          {"dim", dim},
          {"topk", topk},
          {"row_bytes", dim * 2},
          {"valid_slots_per_row", g.best->valid_slots_per_row},
          {"input_sets", g.best->input_sets},
          {"variants", variants},
          {"best_ns_per_row_by_method", best_of},
          {"fastest", {{"method", bench::gather_method_name(g.best->method)},
                       {"variant", bench::gather_variant_name(*g.best)},
                       {"ns_per_row", g.best->ns_per_row},
                       {"tbps", g.best->tbps}}}};
}

nlohmann::ordered_json floor_measurements_json(const Floors& f) {
  if (!f.measured) return nullptr;
  nlohmann::ordered_json sc = nlohmann::ordered_json::array(), kr = nlohmann::ordered_json::array();
  for (const auto& [key, rates] : f.tables) {
    for (const auto& r : rates.ways) sc.push_back(scatter_json(r));
    nlohmann::ordered_json e = scatter_json(rates.key_read);
    e["key_row_bytes"] = rates.key_read.row_floats * 2;  // bf16 key read before each add
    kr.push_back(e);
  }
  nlohmann::ordered_json kg = nlohmann::ordered_json::array(), gb = nlohmann::ordered_json::array();
  for (const auto& [key, g] : f.gathers) kg.push_back(gather_json(key, g));
  for (const auto& [key, g] : f.batched) gb.push_back(gemm_json(g));
  nlohmann::ordered_json gemm = nullptr;
  if (f.gemm) {
    gemm = gemm_json(*f.gemm);
    gemm["ways"] = nlohmann::ordered_json::array();
    for (const auto& g : f.gemm_ways) gemm["ways"].push_back(gemm_json(g));
  }
  return {{"scatter", sc},
          {"key_read_scatter", kr},
          {"key_gather", kg},
          {"gemm", gemm},
          {"gemm_e4m3", f.gemm_e4m3 ? gemm_json(*f.gemm_e4m3) : nlohmann::ordered_json(nullptr)},
          {"gemm_batched", gb}};
}

/// The JSON report (--json): the device, the settings, the method, the floors and the cases.
nlohmann::ordered_json bench_json(const BenchArgs& a, const bench::DeviceInfo& dev, const Floors& f,
                                  const nlohmann::ordered_json& cases) {
  nlohmann::ordered_json j;
  j["tool"] = a.tool;
  j["command"] = a.command_line;
  j["device"] = {{"name", dev.name},
                 {"compute_capability", std::to_string(dev.cc_major) + "." + std::to_string(dev.cc_minor)},
                 {"sm_count", dev.sm_count},
                 {"l2_bytes", dev.l2_bytes},
                 {"l2_persisting_bytes", dev.l2_persisting_bytes},
                 {"memory_bytes", dev.total_bytes},
                 {"driver", version_string(dev.driver_version)},
                 {"runtime", version_string(dev.runtime_version)}};
  nlohmann::ordered_json shapes = nlohmann::ordered_json::array();
  for (const auto& [h, d] : a.shapes) shapes.push_back(std::to_string(h) + "x" + std::to_string(d));
  nlohmann::ordered_json topk_shapes = nlohmann::ordered_json::array();
  for (const auto& [h, d] : a.topk_shapes) topk_shapes.push_back(std::to_string(h) + "x" + std::to_string(d));
  j["settings"] = {{"ops", a.ops},
                   {"iters", a.iters},
                   {"warmup", a.warmup},
                   {"input_sets", a.input_sets},
                   {"sustained_ms", a.sustained_ms + 0.0},
                   {"seed", a.seed},
                   {"floor", !a.no_floor},
                   {"target_shapes", shapes},
                   {"topk_shapes", topk_shapes},
                   {"topk_ranges", a.ranges},
                   {"topk_dtypes", a.topk_dtypes},
                   {"l2_set_aside_mib", a.l2_set_aside_mib >= 0 ? nlohmann::ordered_json(a.l2_set_aside_mib)
                                                                : nlohmann::ordered_json(nullptr)},
                   {"dtypes", "bf16 inputs and outputs"},
                   {"layout", "bshd"},
                   {"id_mode", "local"}};
  j["method"] = method_json();
  j["floor_measurements"] = floor_measurements_json(f);
  j["cases"] = cases;
  j["checks_ok"] = f.checks_ok;
  return j;
}

void write_json(const BenchArgs& a, const nlohmann::ordered_json& j) {
  if (a.json == "-") {
    std::cout << report_json_text(j) << std::endl;
    return;
  }
  std::ofstream f(a.json);
  f << report_json_text(j) << "\n";
  if (!f) throw Error(ErrorCode::io_error, "json", "cannot write " + a.json);
  log_stage("wrote " + a.json);
}

/// --l2-set-aside-mib: the context's persisting-L2 limit, then the value in force on `out`.
void set_l2_aside(std::ostream& out, const BenchArgs& a, const bench::DeviceInfo& dev) {
  const size_t bytes = static_cast<size_t>(a.l2_set_aside_mib * kMiB);
  cudaError_t e = cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, bytes);
  size_t now = 0;
  if (e == cudaSuccess) e = cudaDeviceGetLimit(&now, cudaLimitPersistingL2CacheSize);
  if (e != cudaSuccess) {
    throw Error(ErrorCode::cuda_error, "l2_set_aside_mib",
                "--l2-set-aside-mib " + fmt("%.2f", a.l2_set_aside_mib) + ": " + cudaGetErrorString(e));
  }
  out << "  L2 aside    " << fmt("%.2f", now / kMiB) << " MiB set aside for persisting lines (was "
      << fmt("%.2f", dev.l2_persisting_bytes / kMiB) << " MiB)\n";
}

}  // namespace

int run_bench(const BenchArgs& a) {
  const std::vector<bench::OpCase> cases = bench_cases(a);
  const bench::DeviceInfo dev = bench::probe_device();
  if (!dev.usable || !cuda_backend_available()) {
    throw Error(ErrorCode::backend_unavailable, "bench",
                "bench needs the CUDA backend and a GPU (compute capability 9.0): " +
                    (dev.reason.empty() ? cuda_unavailable_reason() : dev.reason));
  }
  if (!a.json.empty() && a.json != "-" && !std::ofstream(a.json, std::ios::app)) {
    throw Error(ErrorCode::io_error, "json", "--json: cannot write " + a.json);
  }
  // With --json -, the JSON goes to stdout and the human report to stderr.
  std::ostream& out = a.json == "-" ? std::cerr : std::cout;
  print_header(out, a, dev);
  if (a.l2_set_aside_mib >= 0) set_l2_aside(out, a, dev);

  Floors floors;
  if (!a.no_floor) {
    floors = measure_floors(a, cases);
    print_floors(out, floors);
  } else {
    out << "  floors      not measured (--no-floor); the backward's x278 is the ratio to the fixed 278 ns/row\n";
  }
  out << "\n" << std::flush;

  char line[320];
  std::snprintf(line, sizeof line, "%-8s %-15s %3s %6s %4s %4s %5s %9s %4s %8s %19s %8s %9s %-7s %7s\n", "op", "ids",
                "B", "S", "H", "D", "topk", "valid/row", "sets", "ns/row", "(min-max)", "TFLOP/s", "floor ns", "bound",
                "xfloor");
  out << line << std::flush;
  bench::OpConfig cfg;
  cfg.iters = a.iters;
  cfg.warmup = a.warmup;
  cfg.input_sets = a.input_sets;
  cfg.seed = a.seed;
  cfg.sustained_ms = a.sustained_ms + 0.0;  // -0 -> 0
  nlohmann::ordered_json jcases = nlohmann::ordered_json::array();
  for (const bench::OpCase& c : cases) jcases.push_back(run_case(out, c, cfg, floors, dev));
  out << "ns/row: median over B*S query rows (min-max of the launches); xfloor: ns/row / floor ns; bound: the "
         "floor's larger term; backward: xtraffic = ns/row / traffic floor ns (the K reads and dK reduces alone), "
         "x278 = ns/row / 278 ns; topk: ids = its ranges, valid/row = visible keys per row, ns/row over its S_q rows\n";
  if (!floors.checks_ok) out << "a floor measurement failed its correctness check (see the JSON)\n";
  out << std::flush;

  if (!a.json.empty()) write_json(a, bench_json(a, dev, floors, jcases));
  return floors.checks_ok ? 0 : 1;
}

}  // namespace dsaib::cli
