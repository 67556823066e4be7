// GPU tests (label gpu) of the bench on tiny shapes: `dsaib bench` and
// dsaib-bench (one parser, one run, one JSON report): the floors, each the best of the
// ways measured in the same run and each way checked, every op against its floor, and
// the JSON that scripts/ab_compare.py and scripts/plot_bench.py read.
// Without a compute-capability-9.0 GPU every test is SKIPPED (never passed).
// The binaries are the build tree's; DSAIB_BIN_DIR=dir takes them from dir instead
// (binaries copied to another machine, without the build tree).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "dsaib/indexer_backward.hpp"
#include "support/test_support.hpp"

#if !defined(DSAIB_CLI_PATH) || !defined(DSAIB_BENCH_PATH)
#error "the build must define DSAIB_CLI_PATH and DSAIB_BENCH_PATH"
#endif

namespace dsaib::test {
namespace {

std::string binary(const char* built) {
  const char* dir = std::getenv("DSAIB_BIN_DIR");
  if (!dir || !*dir) return built;
  return (std::filesystem::path(dir) / std::filesystem::path(built).filename()).string();
}

class BenchTools : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_backend_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
    dir_ = std::filesystem::path(::testing::TempDir()) / ("dsaib_bench_test." + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  /// Runs one of the tools (the build's, or DSAIB_BIN_DIR's) with `args`, which
  /// start with a blank and carry their own redirections.
  static CommandResult run_tool(const char* built, const std::string& args) {
    return run_command(shell_quote(binary(built)) + args);
  }
  /// The same with `--json json` appended and stderr merged into the output.
  static CommandResult run_tool_json(const char* built, const std::string& args, const std::string& json) {
    return run_tool(built, args + " --json " + shell_quote(json) + " 2>&1");
  }
  static nlohmann::json read_json(const std::string& p) {
    std::ifstream f(p);
    return nlohmann::json::parse(f);
  }
  std::filesystem::path dir_;
};

TEST_F(BenchTools, BenchSubcommandMeasuresTheFloorAndTheOpAndWritesJson) {
  const std::string json = path("bench.json");
  const CommandResult r = run_tool_json(DSAIB_CLI_PATH,
                                       " bench --seq 512,1024 --ids causal,random --heads 16 --dim 64 --topk 128"
                                       " --iters 5 --warmup 1 --sustained-ms 40",
                                       json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* frag : {"scatter-add", "bf16 GEMM", "key-read", "xfloor", "xtraffic", "x278", "causal", "random"}) {
    EXPECT_NE(r.output.find(frag), std::string::npos) << "'" << frag << "' not in:\n" << r.output;
  }
  const nlohmann::json j = read_json(json);
  EXPECT_EQ(j["tool"], "dsaib bench");
  EXPECT_TRUE(j["checks_ok"].get<bool>());
  EXPECT_TRUE(j["method"]["floor_formula"].is_string());
  EXPECT_TRUE(j["method"]["input_rotation"].is_string());
  EXPECT_EQ(j["method"]["fixed_floor_ns_per_row"], 278.0);
  // Two dK tables (S 512 and 1024 at D64), three ways each, all checked.
  ASSERT_EQ(j["floor_measurements"]["scatter"].size(), 6u);
  for (const auto& s : j["floor_measurements"]["scatter"]) {
    EXPECT_TRUE(s["check"].get<bool>()) << s.dump();
    EXPECT_EQ(s["row_bytes"], 256);
    EXPECT_GT(s["tbps"].get<double>(), 0.0);
  }
  // The traffic floor's way, once per table, checked (each add used its key).
  ASSERT_EQ(j["floor_measurements"]["key_read_scatter"].size(), 2u);
  for (const auto& s : j["floor_measurements"]["key_read_scatter"]) {
    EXPECT_TRUE(s["check"].get<bool>()) << s.dump();
    EXPECT_EQ(s["way"], "gather");
    EXPECT_EQ(s["key_row_bytes"], 128);
    EXPECT_GT(s["tbps"].get<double>(), 0.0);
  }
  EXPECT_TRUE(j["method"]["traffic_floor_formula"].is_string());
  EXPECT_TRUE(j["floor_measurements"]["gemm"]["check"].get<bool>());
  ASSERT_EQ(j["cases"].size(), 4u);
  for (const auto& c : j["cases"]) {
    SCOPED_TRACE(c.dump());
    EXPECT_EQ(c["launch_ms"].size(), 5u);
    EXPECT_GE(c["input_sets"].get<int>(), 2);  // tiny sets: rotated
    const double ns = c["ns_per_row"].get<double>();
    EXPECT_GT(ns, 0.0);
    EXPECT_LE(c["ns_per_row_min"].get<double>(), ns);
    EXPECT_GE(c["ns_per_row_max"].get<double>(), ns);
    EXPECT_EQ(c["floor"]["dk_table_bytes"], c["seq"].get<int64_t>() * 64 * 4);
    const double floor_ns = c["floor"]["ns_per_row"].get<double>();
    EXPECT_GT(floor_ns, 0.0);
    EXPECT_NEAR(c["floor_ratio"].get<double>(), ns / floor_ns, 1e-9 * ns / floor_ns);
    EXPECT_NEAR(c["fixed_floor_ratio"].get<double>(), ns / 278.0, 1e-9 * ns);
    // The traffic floor: the reduce bytes of topk slots at the key-read rate of this table.
    const double key_read_tbps = c["traffic_floor"]["key_read_scatter_tbps"].get<double>();
    const double traffic_ns = c["traffic_floor"]["ns_per_row"].get<double>();
    EXPECT_NEAR(traffic_ns, c["topk"].get<double>() * 64 * 4 / (key_read_tbps * 1e3), 1e-9 * traffic_ns);
    EXPECT_NEAR(c["traffic_floor_ratio"].get<double>(), ns / traffic_ns, 1e-9 * ns / traffic_ns);
    // The sustained run: at least 20 launches back to back, its ratios from its own median.
    const auto& st = c["sustained"];
    ASSERT_TRUE(st.is_object());
    EXPECT_GE(st["launches"].get<int>(), 20);
    const double sns = st["ns_per_row"].get<double>();
    EXPECT_TRUE(std::isfinite(sns) && sns > 0.0);
    EXPECT_NEAR(st["floor_ratio"].get<double>(), sns / floor_ns, 1e-9 * sns / floor_ns);
    EXPECT_NEAR(st["fixed_floor_ratio"].get<double>(), sns / 278.0, 1e-9 * sns);
    EXPECT_NEAR(st["traffic_floor_ratio"].get<double>(), sns / traffic_ns, 1e-9 * sns / traffic_ns);
  }
  EXPECT_EQ(j["settings"]["sustained_ms"], 40.0);
  EXPECT_NE(r.output.find("sustained:"), std::string::npos) << r.output;
}

TEST_F(BenchTools, BenchSubcommandWithoutFloorAndWithoutRotation) {
  const CommandResult r = run_tool(DSAIB_CLI_PATH,
                                   " bench --seq 256 --ids random --heads 8 --dim 128 --topk 64 --iters 3"
                                   " --input-sets 1 --no-floor --sustained-ms 0 --json - 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_TRUE(j["floor_measurements"].is_null());
  ASSERT_EQ(j["cases"].size(), 1u);
  EXPECT_EQ(j["cases"][0]["input_sets"], 1);
  EXPECT_TRUE(j["cases"][0]["floor"].is_null());
  EXPECT_TRUE(j["cases"][0]["floor_ratio"].is_null());
  EXPECT_TRUE(j["cases"][0]["traffic_floor"].is_null());
  EXPECT_TRUE(j["cases"][0]["traffic_floor_ratio"].is_null());
  EXPECT_TRUE(j["cases"][0]["sustained"].is_null());  // --sustained-ms 0: no sustained run
}

TEST_F(BenchTools, BenchBinaryWritesWhatAbCompareReads) {
  const std::string json = path("op.json");
  const CommandResult r = run_tool_json(DSAIB_BENCH_PATH,
                                       " --seq 512 --ids causal,random,causal-shuffled,random-shuffled --heads 16"
                                       " --dim 128 --topk 128 --iters 3 --no-floor --sustained-ms 0",
                                       json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = read_json(json);
  EXPECT_EQ(j["tool"], "dsaib-bench");
  const auto& cases = j["cases"];
  ASSERT_EQ(cases.size(), 4u);
  // The shuffled patterns are the same draws in another order: as many valid slots.
  EXPECT_EQ(cases[0]["ids"], "causal");
  EXPECT_EQ(cases[2]["ids"], "causal-shuffled");
  EXPECT_EQ(cases[3]["ids"], "random-shuffled");
  EXPECT_EQ(cases[2]["valid_slots_per_row"], cases[0]["valid_slots_per_row"]);
  EXPECT_EQ(cases[3]["valid_slots_per_row"], cases[1]["valid_slots_per_row"]);
  EXPECT_LT(cases[0]["valid_slots_per_row"].get<double>(), 128.0);  // causal: rows t < 127 keep t + 1
  EXPECT_EQ(cases[1]["valid_slots_per_row"].get<double>(), 128.0);
  for (const auto& c : cases) {
    for (const char* key : {"op", "ids", "seq", "heads", "dim", "topk", "ns_per_row", "timing", "fixed_floor_ratio"}) {
      EXPECT_TRUE(c.contains(key)) << key << " missing in " << c.dump();
    }
    EXPECT_EQ(c["op"], "backward");
    EXPECT_TRUE(c["floor"].is_null()) << c.dump();
    EXPECT_NEAR(c["fixed_floor_ratio"].get<double>(), c["ns_per_row"].get<double>() / 278.0, 2e-3);
  }
}

TEST_F(BenchTools, BenchBinarySustainedRunReportsItsSteadyState) {
  const std::string json = path("sustained.json");
  const CommandResult r = run_tool_json(
      DSAIB_BENCH_PATH, " --seq 512 --ids random --heads 16 --dim 128 --topk 128 --iters 3 --no-floor --sustained-ms 50",
      json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("sustained:"), std::string::npos) << r.output;
  const nlohmann::json j = read_json(json);
  ASSERT_EQ(j["cases"].size(), 1u);
  const auto& st = j["cases"][0]["sustained"];
  // At least kSustainedMinLaunches (20) launches, timed back to back.
  EXPECT_GE(st["launches"].get<int>(), 20) << st.dump();
  const double ns = st["ns_per_row"].get<double>(), first = st["ns_per_row_first_half"].get<double>();
  EXPECT_TRUE(std::isfinite(ns) && ns > 0.0) << st.dump();
  EXPECT_TRUE(std::isfinite(first) && first > 0.0) << st.dump();
  // The whole run's GPU time covers its launches: at least half of them at the second half's median.
  EXPECT_GE(st["seconds"].get<double>() * 1e9, 0.5 * st["launches"].get<double>() * ns * 512.0 * 0.5) << st.dump();
}

TEST_F(BenchTools, EveryOpAgainstItsFloorEachFloorTheBestOfItsCheckedWays) {
  const std::string json = path("ops.json");
  const CommandResult r = run_tool_json(DSAIB_BENCH_PATH,
                                       " --op backward,forward,step,one-call,target --seq 512 --ids causal,random"
                                       " --heads 16 --dim 128 --topk 128 --shapes 64x192 --iters 3 --warmup 1"
                                       " --sustained-ms 0",
                                       json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* frag : {"key gather", "vector", "cp.async", "bulk", "fastest", "scatter-add", "bf16 GEMM",
                           "batched", "xfloor"}) {
    EXPECT_NE(r.output.find(frag), std::string::npos) << "'" << frag << "' not in:\n" << r.output;
  }
  const nlohmann::json j = read_json(json);
  EXPECT_TRUE(j["checks_ok"].get<bool>());
  const auto& fm = j["floor_measurements"];
  // The key gather of (causal, random) x (D 128 for the loss's ops, Dqk 192 for the target).
  ASSERT_EQ(fm["key_gather"].size(), 4u);
  std::map<std::string, double> gather_ns;  // "ids D" -> the floor's gather time
  for (const auto& g : fm["key_gather"]) {
    SCOPED_TRACE(g.dump());
    std::set<std::string> methods;
    double best = 1e30;
    for (const auto& v : g["variants"]) {
      EXPECT_TRUE(v["check"].get<bool>()) << v.dump();
      EXPECT_GT(v["ns_per_row"].get<double>(), 0.0);
      methods.insert(v["method"].get<std::string>());
      best = std::min(best, v["ns_per_row"].get<double>());
    }
    EXPECT_EQ(methods, (std::set<std::string>{"vector", "cp.async", "bulk"}));
    EXPECT_DOUBLE_EQ(g["fastest"]["ns_per_row"].get<double>(), best);
    for (const char* m : {"vector", "cp.async", "bulk"}) EXPECT_GE(g["best_ns_per_row_by_method"][m].get<double>(), best);
    gather_ns[g["ids"].get<std::string>() + " " + std::to_string(g["dim"].get<int>())] = best;
  }
  ASSERT_EQ(fm["gemm_batched"].size(), 1u);
  EXPECT_TRUE(fm["gemm_batched"][0]["check"].get<bool>());
  EXPECT_TRUE(fm["gemm"]["check"].get<bool>());
  // The GEMM rate: the fastest of cuBLAS's four operand layouts, each checked.
  ASSERT_EQ(fm["gemm"]["ways"].size(), 4u);
  double best_tflops = 0;
  for (const auto& w : fm["gemm"]["ways"]) {
    EXPECT_TRUE(w["check"].get<bool>()) << w.dump();
    best_tflops = std::max(best_tflops, w["tflops"].get<double>());
  }
  EXPECT_DOUBLE_EQ(fm["gemm"]["tflops"].get<double>(), best_tflops);
  ASSERT_EQ(j["cases"].size(), 10u);  // 5 ops x 2 id patterns
  std::set<std::string> ops;
  for (const auto& c : j["cases"]) {
    SCOPED_TRACE(c.dump());
    const std::string op = c["op"].get<std::string>();
    ops.insert(op);
    const double ns = c["ns_per_row"].get<double>(), floor_ns = c["floor"]["ns_per_row"].get<double>();
    EXPECT_GT(ns, 0.0);
    EXPECT_GT(floor_ns, 0.0);
    EXPECT_NEAR(c["floor_ratio"].get<double>(), ns / floor_ns, 1e-9 * ns / floor_ns);
    const std::string gather_key = c["ids"].get<std::string>() + " " + std::to_string(c["dim"].get<int>());
    if (op == "forward" || op == "target") {
      EXPECT_DOUBLE_EQ(c["floor"]["gather_ns"].get<double>(), gather_ns.at(gather_key));
      EXPECT_DOUBLE_EQ(floor_ns, std::max(c["floor"]["gather_ns"].get<double>(), c["floor"]["gemm_ns"].get<double>()));
    }
    if (op == "step" || op == "one-call") {
      EXPECT_DOUBLE_EQ(c["floor"]["gather_ns"].get<double>(), gather_ns.at(gather_key));
      EXPECT_DOUBLE_EQ(floor_ns, std::max({c["floor"]["scatter_ns"].get<double>(), c["floor"]["gemm_ns"].get<double>(),
                                           c["floor"]["gather_ns"].get<double>()}));
    }
    if (op == "target") {
      EXPECT_EQ(c["heads"], 64);
      EXPECT_EQ(c["dim"], 192);
      // the faster of the batched call at the target's shape and the square GEMM
      EXPECT_DOUBLE_EQ(c["floor"]["gemm_tflops"].get<double>(),
                       std::max(fm["gemm_batched"][0]["tflops"].get<double>(), fm["gemm"]["tflops"].get<double>()));
    }
    if (op == "backward") EXPECT_TRUE(c["traffic_floor"].is_object());
  }
  EXPECT_EQ(ops, (std::set<std::string>{"backward", "forward", "step", "one-call", "target"}));
}

TEST_F(BenchTools, TopkAgainstTheGemmFloorWithItsExtraMemory) {
  const std::string json = path("topk.json");
  const CommandResult r = run_tool_json(DSAIB_BENCH_PATH,
                                       " --op topk --seq 512 --topk-shapes 64x128,32x64 --topk 128 --iters 3"
                                       " --warmup 1 --sustained-ms 0",
                                       json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* frag : {"bf16 GEMM", "xfloor", "extra memory", "cudaMemGetInfo delta"}) {
    EXPECT_NE(r.output.find(frag), std::string::npos) << "'" << frag << "' not in:\n" << r.output;
  }
  const nlohmann::json j = read_json(json);
  EXPECT_TRUE(j["checks_ok"].get<bool>());
  const double tflops = j["floor_measurements"]["gemm"]["tflops"].get<double>();
  ASSERT_GT(tflops, 0.0);
  ASSERT_EQ(j["cases"].size(), 4u);  // (causal, cp-shard) x (64x128, 32x64)
  std::set<std::string> ranges;
  for (const auto& c : j["cases"]) {
    SCOPED_TRACE(c.dump());
    EXPECT_EQ(c["op"], "topk");
    const std::string rg = c["ranges"].get<std::string>();
    ranges.insert(rg);
    // causal: 512 rows seeing 1..512 keys; cp-shard: 256 rows seeing 257..512
    EXPECT_EQ(c["seq_q"].get<int>(), rg == "causal" ? 512 : 256);
    EXPECT_DOUBLE_EQ(c["visible_keys_per_row"].get<double>(), rg == "causal" ? 256.5 : 384.5);
    const double h = c["heads"].get<double>(), d = c["dim"].get<double>();
    const double floor_ns = c["floor"]["ns_per_row"].get<double>(), ns = c["ns_per_row"].get<double>();
    EXPECT_NEAR(floor_ns, c["visible_keys_per_row"].get<double>() * h * d * 2 / (tflops * 1e3), 1e-9 * floor_ns);
    EXPECT_GT(ns, 0.0);
    EXPECT_GT(ns, floor_ns);
    EXPECT_NEAR(c["floor_ratio"].get<double>(), ns / floor_ns, 1e-9 * ns / floor_ns);
    const auto& m = c["memory"];
    EXPECT_GT(m["workspace_bytes"].get<double>(), 0.0);
    // without topk_logits the selection's high words need room too
    EXPECT_GT(m["workspace_bytes_ids_only"].get<double>(), m["workspace_bytes"].get<double>());
    EXPECT_GE(m["pool_used_high_bytes"].get<double>(), m["workspace_bytes"].get<double>());
    EXPECT_GE(m["mem_get_info_delta_bytes"].get<double>(), 0.0);
  }
  EXPECT_EQ(ranges, (std::set<std::string>{"causal", "cp-shard"}));
}

TEST_F(BenchTools, TargetWithAndWithoutAnLse) {
  const std::string json = path("target_lse.json");
  const CommandResult r = run_tool_json(DSAIB_BENCH_PATH,
                                       " --op target --target-lse given,absent --seq 512 --ids random --shapes 64x192"
                                       " --topk 128 --iters 3 --warmup 1 --sustained-ms 0",
                                       json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("random no-lse"), std::string::npos) << r.output;
  const nlohmann::json j = read_json(json);
  EXPECT_TRUE(j["checks_ok"].get<bool>());
  EXPECT_EQ(j["settings"]["target_lse"], (nlohmann::json{"given", "absent"}));
  ASSERT_EQ(j["cases"].size(), 2u);
  EXPECT_EQ(j["cases"][0]["lse"], "given");
  EXPECT_EQ(j["cases"][1]["lse"], "absent");
  for (const auto& c : j["cases"]) {
    SCOPED_TRACE(c.dump());
    EXPECT_EQ(c["op"], "target");
    EXPECT_GT(c["ns_per_row"].get<double>(), 0.0);
    // the same floor: the same gather and the same logits' FLOPs at the best GEMM rate
    EXPECT_DOUBLE_EQ(c["floor"]["ns_per_row"].get<double>(), j["cases"][0]["floor"]["ns_per_row"].get<double>());
  }
  // the input set without an lse is S x Hq x 4 bytes smaller
  EXPECT_EQ(j["cases"][0]["input_set_bytes"].get<int64_t>() - j["cases"][1]["input_set_bytes"].get<int64_t>(),
            512 * 64 * 4);
}

TEST_F(BenchTools, BenchBinaryAndSubcommandShareTheirFlagChecks) {
  for (const char* built : {DSAIB_CLI_PATH, DSAIB_BENCH_PATH}) {
    const std::string sub = std::string(built) == DSAIB_CLI_PATH ? " bench" : "";
    for (const std::string args : {" --op target --ids causal-shuffled", " --op target --batch 2", " --shapes 100x576",
                                   " --op backwards", " --op topk --topk-shapes 64x96", " --op topk --ranges random",
                                   " --op topk --batch 2", " --op topk --topk 8193", " --op target --target-lse none"}) {
      const CommandResult r = run_tool(built, sub + args + " --seq 64 --iters 1 2>&1");
      EXPECT_EQ(r.exit_code, 2) << built << args << "\n" << r.output;
    }
  }
}

}  // namespace
}  // namespace dsaib::test
