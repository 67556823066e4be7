// GPU tests (label gpu) of the benchmark tools on tiny shapes: `dsaib bench`
// (floor micro-benchmarks and the op, its JSON report), dsa-indexer-bwd-bench and
// dsa-floor-bench (the JSON that scripts/ab_compare.py and the perf log read).
// Without a compute-capability-9.0 GPU every test is SKIPPED (never passed).
// The binaries are the build tree's; DSAIB_BIN_DIR=dir takes them from dir instead
// (binaries copied to another machine, without the build tree).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "dsaib/indexer_backward.hpp"
#include "support/test_support.hpp"

#if !defined(DSAIB_CLI_PATH) || !defined(DSAIB_OP_BENCH_PATH) || !defined(DSAIB_FLOOR_BENCH_PATH)
#error "the build must define DSAIB_CLI_PATH, DSAIB_OP_BENCH_PATH and DSAIB_FLOOR_BENCH_PATH"
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

TEST_F(BenchTools, OpBenchKeepsItsJsonForAbCompare) {
  const std::string json = path("op.json");
  const CommandResult r = run_tool_json(DSAIB_OP_BENCH_PATH,
                                       " --seq 512 --ids causal,random,causal-shuffled,random-shuffled --heads 16"
                                       " --dim 128 --topk 128 --iters 3",
                                       json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = read_json(json);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 4u);
  // The shuffled patterns are the same draws in another order: as many valid slots.
  EXPECT_EQ(j[0]["ids"], "causal");
  EXPECT_EQ(j[2]["ids"], "causal-shuffled");
  EXPECT_EQ(j[3]["ids"], "random-shuffled");
  EXPECT_EQ(j[2]["valid_slots_per_row"], j[0]["valid_slots_per_row"]);
  EXPECT_EQ(j[3]["valid_slots_per_row"], j[1]["valid_slots_per_row"]);
  EXPECT_LT(j[0]["valid_slots_per_row"].get<double>(), 128.0);  // causal: rows t < 127 keep t + 1
  EXPECT_EQ(j[1]["valid_slots_per_row"].get<double>(), 128.0);
  for (const auto& c : j) {
    for (const char* key : {"ids", "seq", "heads", "dim", "topk", "ns_per_row", "median_ms", "fixed_floor_ratio"}) {
      EXPECT_TRUE(c.contains(key)) << key << " missing in " << c.dump();
    }
    // It measures no floor, so no "floor_ratio" (which `dsaib bench` keeps for its measured one).
    EXPECT_FALSE(c.contains("floor_ratio")) << c.dump();
    EXPECT_NEAR(c["fixed_floor_ratio"].get<double>(), c["ns_per_row"].get<double>() / 278.0, 2e-3);
  }
}

TEST_F(BenchTools, OpBenchSustainedRunReportsItsSteadyState) {
  const std::string json = path("sustained.json");
  const CommandResult r = run_tool_json(
      DSAIB_OP_BENCH_PATH, " --seq 512 --ids random --heads 16 --dim 128 --topk 128 --iters 3 --sustained-ms 50", json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("sustained:"), std::string::npos) << r.output;
  const nlohmann::json j = read_json(json);
  ASSERT_EQ(j.size(), 1u);
  const auto& c = j[0];
  // At least kSustainedMinLaunches (20) launches, timed back to back.
  EXPECT_GE(c["sustained_launches"].get<int>(), 20) << c.dump();
  const double ns = c["ns_per_row_sustained"].get<double>(), first = c["ns_per_row_sustained_first_half"].get<double>();
  EXPECT_TRUE(std::isfinite(ns) && ns > 0.0) << c.dump();
  EXPECT_TRUE(std::isfinite(first) && first > 0.0) << c.dump();
  // The whole run's GPU time covers its launches: at least half of them at the second half's median.
  EXPECT_GE(c["sustained_seconds"].get<double>() * 1e9,
            0.5 * c["sustained_launches"].get<double>() * ns * 512.0 * 0.5) << c.dump();
  // Without the flag: no sustained run, zeros.
  const std::string plain = path("plain.json");
  const CommandResult q =
      run_tool_json(DSAIB_OP_BENCH_PATH, " --seq 512 --ids random --heads 16 --dim 128 --topk 128 --iters 3", plain);
  ASSERT_EQ(q.exit_code, 0) << q.output;
  EXPECT_EQ(read_json(plain)[0]["sustained_launches"], 0);
  EXPECT_EQ(q.output.find("sustained:"), std::string::npos) << q.output;
}

TEST_F(BenchTools, FloorBenchChecksEveryWay) {
  const std::string json = path("floor.json");
  const CommandResult r =
      run_tool_json(DSAIB_FLOOR_BENCH_PATH, " --tables 2,8 --iters 3 --payload-mib 64 --gemm-size 1024", json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = read_json(json);
  ASSERT_EQ(j["scatter"].size(), 6u);
  for (const auto& s : j["scatter"]) EXPECT_TRUE(s["check"].get<bool>()) << s.dump();
  // The ways that are not part of the floor, one per table: each checked too (the
  // gather way's keys are 1.0, so its exact column sums prove every add read its key).
  for (const char* extra : {"scatter_fragment_pattern", "scatter_with_key_reads"}) {
    ASSERT_EQ(j[extra].size(), 2u) << extra;
    for (const auto& s : j[extra]) EXPECT_TRUE(s["check"].get<bool>()) << extra << " " << s.dump();
  }
  EXPECT_EQ(j["scatter_with_key_reads"][0]["way"], "gather");
  EXPECT_TRUE(j["gemm"]["check"].get<bool>());
  ASSERT_EQ(j["floor"].size(), 8u);
  // The floor uses the three floor ways only: each case's way is one of them.
  for (const auto& f : j["floor"]) {
    const std::string way = f["scatter_way"].get<std::string>();
    EXPECT_TRUE(way == "float4" || way == "scalar" || way == "bulk") << f.dump();
  }
}

}  // namespace
}  // namespace dsaib::test
