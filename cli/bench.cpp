// The bench's run and report (`dsaib bench` and the dsaib-bench binary): the
// floors the cases need, then every case, over the dsaib_bench core (bench/core); the
// table on the console and one JSON report. Compiled only when the project is built with
// CUDA (DSAIB_CLI_WITH_CUDA); run.cpp has the stub of other builds.
#include <cuda_runtime_api.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "bench_core.hpp"
#include "bench_floors.hpp"
#include "cli.hpp"

namespace dsaib::cli {
namespace {

using bench::BenchOp;

std::string version_string(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

/// The cases (--op x --ids x --seq; the target x --shapes x --target-lse), checked against the library's
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
    // the target's cases go over --target-lse too (an lse given, or none).
    const std::vector<std::string> lses = op == BenchOp::target ? a.target_lse : std::vector<std::string>{"given"};
    for (const std::string& lse : lses)
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
          if (!bench::parse_target_lse(lse, &c.lse_given)) {
            throw Error(ErrorCode::invalid_argument, "target_lse", "--target-lse: expected given or absent, got " + lse);
          }
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

/// A case's ids column: its id pattern (and " no-lse" for a target without an lse), or the
/// top-k's key ranges (and " e4m3" for float8 inputs).
std::string case_pattern(const bench::OpCase& c) {
  if (c.op == BenchOp::target && !c.lse_given) return std::string(bench::id_pattern_name(c.ids)) + " no-lse";
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
    j["lse"] = c.lse_given ? "given" : "absent";
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
                     "best of cuBLAS at four operand layouts (floor_measurements.gemm.ways; the target's: the faster of "
                     "that and cuBLAS batched at its shape, gemm_batched)"},
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
                   {"target_lse", a.target_lse},
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
