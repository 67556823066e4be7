// The bench's floors: measured once per run for the cases that need them, their table
// lines and JSON, and each case's floor (bench_floors.hpp).
#include "bench_floors.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>

namespace dsaib::cli {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

nlohmann::ordered_json stats_json(const bench::Stats& t) {
  return {{"median_ms", t.median_ms}, {"min_ms", t.min_ms}, {"max_ms", t.max_ms}, {"runs", t.runs}};
}

namespace {

using bench::BenchOp;

constexpr uint64_t kScatterPayloadBytes = 1ull << 30;  // added per scatter launch
constexpr int kGemmSize = 8192;

GatherKey gather_key(const bench::OpCase& c) { return {bench::is_causal(c.ids), c.seq, c.dim, c.topk}; }

std::string gather_cell(const GatherRates& g, bench::GatherMethod m) {
  const bench::KeyGatherResult* r = bench::fastest_of(g.variants, m);
  return r ? fmt("%.1f", r->ns_per_row) : std::string("-");
}

nlohmann::ordered_json gather_floor_fields(const GatherRates& g) {
  return {{"gather_ns", g.best->ns_per_row},
          {"gather_method", bench::gather_method_name(g.best->method)},
          {"gather_variant", bench::gather_variant_name(*g.best)},
          {"gather_tbps", g.best->tbps}};
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

}  // namespace

Floors measure_floors(const BenchArgs& a, const std::vector<bench::OpCase>& cases) {
  Floors f;
  f.measured = true;
  bool e4m3_gemm = false;
  for (const bench::OpCase& c : cases) {
    e4m3_gemm = e4m3_gemm || c.e4m3;
    if (uses_scatter(c.op)) f.tables[{c.dk_table_bytes(), c.dim}];
    if (uses_gather(c.op)) f.gathers[gather_key(c)];
    // The target's GEMM rate is the faster of the batched call at its shape and
    // the square GEMM, which every op measures.
    if (c.op == BenchOp::target) f.batched[{c.heads, c.dim, c.topk}];
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
  if (!cases.empty()) {
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
      const bench::GemmResult* batched = c.op == BenchOp::target ? &f.batched.at({c.heads, c.dim, c.topk}) : nullptr;
      const bool use_batched = batched != nullptr && batched->tflops > f.gemm->tflops;
      const bench::GemmResult& gemm = use_batched ? *batched : *f.gemm;
      const bench::ForwardFloor fl =
          bench::forward_floor_per_row(g.best->ns_per_row, r.valid_slots_per_row, c.heads, c.dim, gemm.tflops);
      j = {{"formula", "max(gather_ns, 2*H*D*slots FLOP / GEMM rate)"}};
      j.update(gather_floor_fields(g));
      j["gemm_tflops"] = gemm.tflops;
      if (batched != nullptr) {
        j["gemm_way"] = use_batched ? "batched at the target's shape" : "square";
        j["gemm_batched_tflops"] = batched->tflops;
        j["gemm_square_tflops"] = f.gemm->tflops;
        j["gemm_batch"] = batched->batch;
        j["gemm_check"] = batched->check_ok && f.gemm->check_ok;
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

}  // namespace dsaib::cli
