// `dsaib bench`: the floor micro-benchmarks and the op, in one run, over the
// dsaib_bench core (bench/core). Compiled only when the project is built with CUDA
// (DSAIB_CLI_WITH_CUDA); run.cpp has the stub of other builds.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include "bench_core.hpp"
#include "cli.hpp"

namespace dsaib::cli {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr uint64_t kScatterPayloadBytes = 1ull << 30;  // added per scatter launch
constexpr int kGemmSize = 8192;

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string version_string(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

/// The floor measurements of one dK table (size, row length): every floor way, the
/// best, and the key-read way (ScatterWay::gather_float4, not a floor way) of the
/// traffic floor.
struct TableRates {
  std::vector<bench::ScatterResult> ways;
  const bench::ScatterResult* best = nullptr;
  bench::ScatterResult key_read;
};

nlohmann::ordered_json stats_json(const bench::Stats& t) {
  return {{"median_ms", t.median_ms}, {"min_ms", t.min_ms}, {"max_ms", t.max_ms}, {"runs", t.runs}};
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

/// The floor measurements of the run: per dK table (size, row length) and the GEMM rate.
/// Moved, never copied: each table's `best` points into its own `ways`.
struct Floors {
  Floors() = default;
  Floors(Floors&&) = default;
  Floors& operator=(Floors&&) = default;
  Floors(const Floors&) = delete;
  Floors& operator=(const Floors&) = delete;

  std::map<std::pair<uint64_t, int64_t>, TableRates> tables;  // (dK bytes, D) -> rates
  std::optional<bench::GemmResult> gemm;                      // none with --no-floor
  bool checks_ok = true;                                      // every micro-benchmark's correctness check
};

/// The op of --op (its words: bench::bench_op_name).
bench::BenchOp bench_op(const std::string& word) {
  for (bench::BenchOp op : {bench::BenchOp::backward, bench::BenchOp::kl_forward, bench::BenchOp::step,
                            bench::BenchOp::one_call}) {
    if (word == bench::bench_op_name(op)) return op;
  }
  throw Error(ErrorCode::invalid_argument, "op", "--op: expected backward, forward, step or one-call, got " + word);
}

/// The cases (--ids x --seq), checked against the library's rules before anything runs.
std::vector<bench::OpCase> bench_cases(const BenchArgs& a) {
  std::vector<bench::OpCase> cases;
  for (const std::string& ids : a.ids) {
    for (int64_t s : a.seqs) {
      bench::OpCase c;
      if (!bench::parse_id_pattern(ids, &c.ids)) {
        throw Error(ErrorCode::invalid_argument, "ids", "--ids: expected one of " + bench::id_pattern_list() + ", got \"" + ids + "\"");
      }
      c.batch = a.batch;
      c.seq = s;
      c.heads = a.heads;
      c.dim = a.dim;
      c.topk = a.topk;
      if (!parse_a_operand_precision(a.a_operand, &c.a_operand)) {
        throw Error(ErrorCode::invalid_argument, "a_operand", "--a-operand: expected auto, bf16x2 or bf16, got " + a.a_operand);
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
      c.op = bench_op(a.op);
      bench::check_case(c);
      cases.push_back(c);
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

void print_header(std::ostream& out, const BenchArgs& a, const bench::DeviceInfo& dev) {
  out << "dsaib bench\n"
      << "  op          " << a.op << "\n"
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

/// 1. Floor micro-benchmarks: the scatter-add rate at each case's dK table, the GEMM rate.
Floors measure_floors(const BenchArgs& a, const std::vector<bench::OpCase>& cases) {
  Floors f;
  for (const bench::OpCase& c : cases) f.tables[{c.dk_table_bytes(), c.dim}];
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
  log_stage("floor: cuBLAS bf16 GEMM " + std::to_string(kGemmSize) + "^3 ...");
  f.gemm = bench::measure_gemm(kGemmSize, a.iters, a.warmup);
  f.checks_ok = f.checks_ok && f.gemm->check_ok;
  return f;
}

void print_floors(std::ostream& out, const Floors& f) {
  out << "  floor       measured in this run (" << kBenchFloorFormula << ")\n"
      << "    scatter-add, fp32 rows into random rows of the dK table, " << fmt("%.0f", kScatterPayloadBytes / kMiB)
      << " MiB per launch, TB/s:\n";
  char line[256];
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
    std::snprintf(line, sizeof line, "    %8.1f MiB %10llu %4lld %8.3f %8.3f %8.3f  %-6s %10.3f  %s\n", key.first / kMiB,
                  (unsigned long long)rates.best->rows, (long long)key.second, tb["float4"], tb["scalar"], tb["bulk"],
                  bench::scatter_way_name(rates.best->way), rates.key_read.tbps, ok ? "ok" : "FAIL");
    out << line;
  }
  out << "    key-read: not a floor way; the float4 way with each row-add first reading its row's D-element bf16\n"
      << "    key from a key table of as many rows (the op's K gather beside its dK reduce): the traffic floor\n"
      << "    (" << kBenchTrafficFloorFormula << ")\n";
  out << "    bf16 GEMM (cuBLAS, fp32 compute) " << kGemmSize << "^3: " << fmt("%.1f", f.gemm->tflops)
      << " TFLOP/s (median " << fmt("%.3f", f.gemm->t.median_ms) << " ms)  check " << (f.gemm->check_ok ? "ok" : "FAIL")
      << "\n";
}

/// A case's floors (JSON and table columns); all null / "-" without floor measurements.
struct CaseFloors {
  nlohmann::ordered_json floor = nullptr, ratio = nullptr, traffic = nullptr, traffic_ratio = nullptr;
  std::string floor_ns = "-", floor_x = "-", traffic_x = "-";
  double traffic_ns = 0;
};

CaseFloors case_floors(const bench::OpCase& c, const bench::OpResult& r, const Floors& f, const bench::DeviceInfo& dev) {
  CaseFloors cf;
  if (!f.gemm) return cf;
  const TableRates& rates = f.tables.at({c.dk_table_bytes(), c.dim});
  const bench::Floor fl =
      bench::floor_per_row(static_cast<double>(c.topk), c.heads, c.dim, rates.best->tbps, f.gemm->tflops);
  const bench::Floor fv = bench::floor_per_row(r.valid_slots_per_row, c.heads, c.dim, rates.best->tbps, f.gemm->tflops);
  cf.floor = {{"dk_table_bytes", c.dk_table_bytes()},
              {"dk_fits_l2", static_cast<int64_t>(c.dk_table_bytes()) <= dev.l2_bytes},
              {"scatter_way", bench::scatter_way_name(rates.best->way)},
              {"scatter_tbps", rates.best->tbps},
              {"gemm_tflops", f.gemm->tflops},
              {"scatter_ns", fl.scatter_ns},
              {"gemm_ns", fl.gemm_ns},
              {"ns_per_row", fl.ns},
              {"bound", fl.bound},
              {"valid_slots_ns_per_row", fv.ns}};
  cf.ratio = r.ns_per_row / fl.ns;
  cf.floor_ns = fmt("%.1f", fl.ns);
  cf.floor_x = fmt("%.2f", r.ns_per_row / fl.ns);
  cf.traffic_ns = bench::traffic_floor_ns_per_row(static_cast<double>(c.topk), c.dim, rates.key_read.tbps);
  if (cf.traffic_ns > 0) {  // 0: no key-read rate (never with a timed launch); then no traffic floor
    cf.traffic = {{"key_read_scatter_tbps", rates.key_read.tbps},
                  {"ns_per_row", cf.traffic_ns},
                  {"valid_slots_ns_per_row",
                   bench::traffic_floor_ns_per_row(r.valid_slots_per_row, c.dim, rates.key_read.tbps)}};
    cf.traffic_ratio = r.ns_per_row / cf.traffic_ns;
    cf.traffic_x = fmt("%.2f", r.ns_per_row / cf.traffic_ns);
  }
  return cf;
}

/// The sustained run's line of the table and its JSON (null when none ran).
nlohmann::ordered_json report_sustained(std::ostream& out, const bench::OpResult& r, const CaseFloors& cf) {
  if (r.sustained_launches <= 0) return nullptr;
  std::string sx = "-", stx = "-";
  const double sustained_fixed_ratio = r.ns_per_row_sustained / bench::kFixedFloorNsPerRow;
  nlohmann::ordered_json j = {{"launches", r.sustained_launches},
                              {"seconds", r.sustained_seconds},
                              {"ns_per_row", r.ns_per_row_sustained},
                              {"ns_per_row_first_half", r.ns_per_row_sustained_first_half},
                              {"floor_ratio", nullptr},
                              {"traffic_floor_ratio", nullptr},
                              {"fixed_floor_ratio", sustained_fixed_ratio}};
  if (!cf.floor.is_null()) {
    const double sustained_ratio = r.ns_per_row_sustained / cf.floor["ns_per_row"].get<double>();
    j["floor_ratio"] = sustained_ratio;
    sx = fmt("%.2f", sustained_ratio);
    if (!cf.traffic.is_null()) {
      const double sustained_traffic_ratio = r.ns_per_row_sustained / cf.traffic_ns;
      j["traffic_floor_ratio"] = sustained_traffic_ratio;
      stx = fmt("%.2f", sustained_traffic_ratio);
    }
  }
  char line[320];
  std::snprintf(line, sizeof line,
                "%-15s %3s %6s   sustained: %d launches back to back, %.3f s: %.1f ns/row (second half; first "
                "half %.1f), xfloor %s, xtraffic %s, x278 %.2f\n",
                "", "", "", r.sustained_launches, r.sustained_seconds, r.ns_per_row_sustained,
                r.ns_per_row_sustained_first_half, sx.c_str(), stx.c_str(), sustained_fixed_ratio);
  out << line << std::flush;
  return j;
}

/// 2. The op on one case: its line(s) of the table, and its JSON.
nlohmann::ordered_json run_case(std::ostream& out, const bench::OpCase& c, const bench::OpConfig& cfg,
                                const Floors& f, const bench::DeviceInfo& dev) {
  log_stage(std::string("op: ") + bench::id_pattern_name(c.ids) + " S=" + std::to_string(c.seq) +
            ": generating, uploading, " + std::to_string(cfg.warmup) + " + " + std::to_string(cfg.iters) +
            " launches" + (cfg.sustained_ms > 0 ? ", then ~" + fmt("%g", cfg.sustained_ms) + " ms back to back" : "") +
            " ...");
  const bench::OpResult r = bench::run_op_case(c, cfg);
  const double fixed_ratio = r.ns_per_row / bench::kFixedFloorNsPerRow;
  const CaseFloors cf = case_floors(c, r, f, dev);
  char spread[64];
  std::snprintf(spread, sizeof spread, "(%.1f-%.1f)", r.ns_per_row_min, r.ns_per_row_max);
  char line[320];
  std::snprintf(line, sizeof line,
                "%-15s %3lld %6lld %4lld %4lld %5lld %9.1f %4d %8.1f %19s %8.1f %8.1f %9s %7s %9s %6.2f\n",
                bench::id_pattern_name(c.ids), (long long)c.batch, (long long)c.seq, (long long)c.heads,
                (long long)c.dim, (long long)c.topk, r.valid_slots_per_row, r.input_sets, r.ns_per_row, spread,
                r.tflops, r.dk_gbps, cf.floor_ns.c_str(), cf.floor_x.c_str(), cf.traffic_x.c_str(), fixed_ratio);
  out << line << std::flush;
  const nlohmann::ordered_json sustained = report_sustained(out, r, cf);
  return {{"op", bench::bench_op_name(c.op)},
          {"ids", bench::id_pattern_name(c.ids)},
          {"batch", c.batch},
          {"seq", c.seq},
          {"seq_kv", c.seq},
          {"heads", c.heads},
          {"dim", c.dim},
          {"topk", c.topk},
          {"a_operand_precision", a_operand_precision_name(c.a_operand)},
          {"l2_hints", l2_hints_name(c.l2_hints)},
          {"start_stagger", start_stagger_name(c.start_stagger)},
          {"forward_fusion", forward_fusion_name(c.forward_fusion)},
          {"deterministic", c.deterministic},
          {"valid_slots_per_row", r.valid_slots_per_row},
          {"input_sets", r.input_sets},
          {"input_set_bytes", r.set_bytes},
          {"workspace_bytes", r.workspace_bytes},
          {"timing", stats_json(r.t)},
          {"launch_ms", r.ms},
          {"ns_per_row", r.ns_per_row},
          {"ns_per_row_min", r.ns_per_row_min},
          {"ns_per_row_max", r.ns_per_row_max},
          {"tflops", r.tflops},
          {"dk_reduce_gbps", r.dk_gbps},
          {"floor", cf.floor},
          {"floor_ratio", cf.ratio},
          {"traffic_floor", cf.traffic},
          {"traffic_floor_ratio", cf.traffic_ratio},
          {"fixed_floor_ratio", fixed_ratio},
          {"sustained", sustained}};
}

nlohmann::ordered_json method_json() {
  return {
      {"op", "the whole op on the cuda backend, per case (cases[].op): backward = indexer_backward given P (dK "
             "workspace zeroing, fused kernel, bf16 cast of dK); forward = indexer_kl_forward; step = "
             "indexer_kl_forward then the P-free indexer_backward; one-call = indexer_kl_loss_and_grad"},
      {"timing", "CUDA events recorded around each launch on a non-blocking stream, synchronised after each; "
                 "warm-up launches untimed"},
      {"statistics", "median, min and max over the timed launches; ns_per_row = time / (B*S_q)"},
      {"sustained", "after the timed launches, settings.sustained_ms of launches back to back (an event between "
                    "each two, no spin, no host wait); sustained.ns_per_row = the median over the second half "
                    "of them (the steady state under the GPU's power limit), ratios as above; null when 0"},
      {"tflops", "useful FLOP per valid slot / median time: 6*H*D (backward), 2*H*D (forward), 8*H*D (step, "
                 "one-call)"},
      {"dk_reduce_gbps", "D*4 bytes of fp32 dK reduce per valid slot / median time"},
      {"input_rotation", bench::rotation_method()},
      {"floor_formula", kBenchFloorFormula},
      {"floor_valid_slots", "floor.valid_slots_ns_per_row: the same formula with the valid slots per row actually "
                            "present (causal rows t < topk hold t+1) instead of topk"},
      {"floor_ratio", "ns_per_row / floor.ns_per_row"},
      {"traffic_floor_formula", kBenchTrafficFloorFormula},
      {"traffic_floor_valid_slots", "traffic_floor.valid_slots_ns_per_row: the same formula with the valid slots "
                                    "per row actually present instead of topk"},
      {"traffic_floor_ratio", "ns_per_row / traffic_floor.ns_per_row (not the floor: a reference for how "
                              "close the op is to the memory traffic any design that reads each selected key's row "
                              "once per query row and adds its dK row in fp32 must move)"},
      {"fixed_floor_ratio", "ns_per_row / 278 (a fixed reference floor for H64 D128 topk 2048: the dK reduce of "
                            "2048 rows of 128 fp32 values at 3.77 TB/s, with dK in L2)"},
      {"fixed_floor_ns_per_row", bench::kFixedFloorNsPerRow}};
}

nlohmann::ordered_json floor_measurements_json(const Floors& f) {
  if (!f.gemm) return nullptr;
  nlohmann::ordered_json sc = nlohmann::ordered_json::array();
  for (const auto& [key, rates] : f.tables) {
    for (const auto& r : rates.ways) sc.push_back(scatter_json(r));
  }
  nlohmann::ordered_json kr = nlohmann::ordered_json::array();
  for (const auto& [key, rates] : f.tables) {
    nlohmann::ordered_json e = scatter_json(rates.key_read);
    e["key_row_bytes"] = rates.key_read.row_floats * 2;  // bf16 key read before each add
    kr.push_back(e);
  }
  const bench::GemmResult& g = *f.gemm;
  return {{"scatter", sc},
          {"key_read_scatter", kr},
          {"gemm",
           {{"m", g.m}, {"n", g.n}, {"k", g.k}, {"dtype", "bf16"}, {"compute", "fp32"}, {"timing", stats_json(g.t)},
            {"tflops", g.tflops}, {"check", g.check_ok}, {"max_rel_err", g.max_rel_err}}}};
}

/// The JSON report (--json): the device, the settings, the method, the floors and the cases.
nlohmann::ordered_json bench_json(const BenchArgs& a, const bench::DeviceInfo& dev, const Floors& f,
                                  const nlohmann::ordered_json& cases) {
  nlohmann::ordered_json j;
  j["tool"] = "dsaib bench";
  j["command"] = a.command_line;
  j["device"] = {{"name", dev.name},
                 {"compute_capability", std::to_string(dev.cc_major) + "." + std::to_string(dev.cc_minor)},
                 {"sm_count", dev.sm_count},
                 {"l2_bytes", dev.l2_bytes},
                 {"l2_persisting_bytes", dev.l2_persisting_bytes},
                 {"memory_bytes", dev.total_bytes},
                 {"driver", version_string(dev.driver_version)},
                 {"runtime", version_string(dev.runtime_version)}};
  j["settings"] = {{"op", a.op},            {"iters", a.iters},      {"warmup", a.warmup},     {"input_sets", a.input_sets},
                   {"sustained_ms", a.sustained_ms + 0.0},
                   {"seed", a.seed},        {"floor", !a.no_floor},   {"dtypes", "bf16 inputs and outputs"},
                   {"layout", "bshd"},      {"id_mode", "local"}};
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

  Floors floors;
  if (!a.no_floor) {
    floors = measure_floors(a, cases);
    print_floors(out, floors);
  } else {
    out << "  floor       not measured (--no-floor); x278 is the ratio to the fixed 278 ns/row\n";
  }
  out << "\n" << std::flush;

  char line[320];
  std::snprintf(line, sizeof line, "%-15s %3s %6s %4s %4s %5s %9s %4s %8s %19s %8s %8s %9s %7s %9s %6s\n", "ids", "B",
                "S", "H", "D", "topk", "valid/row", "sets", "ns/row", "(min-max)", "TFLOP/s", "dK GB/s", "floor ns",
                "xfloor", "xtraffic", "x278");
  out << line << std::flush;
  bench::OpConfig cfg;
  cfg.iters = a.iters;
  cfg.warmup = a.warmup;
  cfg.input_sets = a.input_sets;
  cfg.seed = a.seed;
  cfg.sustained_ms = a.sustained_ms + 0.0;  // -0 -> 0
  nlohmann::ordered_json jcases = nlohmann::ordered_json::array();
  for (const bench::OpCase& c : cases) jcases.push_back(run_case(out, c, cfg, floors, dev));
  out << "ns/row: median over B*S query rows (min-max of the launches); xfloor: ns/row / floor ns; xtraffic: ns/row / "
         "traffic floor ns (the K reads and dK reduces alone); x278: ns/row / 278 ns\n";
  if (!floors.checks_ok) out << "a floor micro-benchmark failed its correctness check (see the JSON)\n";
  out << std::flush;

  if (!a.json.empty()) write_json(a, bench_json(a, dev, floors, jcases));
  return floors.checks_ok ? 0 : 1;
}

}  // namespace dsaib::cli
