// The bench's floors (`dsaib bench` and the dsaib-bench binary): what the cases need
// measured once per run, their table lines and JSON, and each case's floor from them.
// Compiled only when the project is built with CUDA (DSAIB_CLI_WITH_CUDA).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bench_core.hpp"
#include "cli.hpp"

namespace dsaib::cli {

inline constexpr double kMiB = 1024.0 * 1024.0;

/// printf-formats one number.
std::string fmt(const char* f, double v);
/// A timing's statistics in the JSON report.
nlohmann::ordered_json stats_json(const bench::Stats& t);

/// The ops whose floor counts the dK scatter-add (the gradients), and the key gather.
inline bool uses_scatter(bench::BenchOp op) {
  return op == bench::BenchOp::backward || op == bench::BenchOp::step || op == bench::BenchOp::one_call;
}
inline bool uses_gather(bench::BenchOp op) { return op != bench::BenchOp::backward && op != bench::BenchOp::topk; }

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

/// A case's floor (JSON and table columns); null / "-" without floor measurements.
struct CaseFloor {
  nlohmann::ordered_json floor = nullptr, ratio = nullptr, traffic = nullptr, traffic_ratio = nullptr;
  double ns = 0, traffic_ns = 0;
  std::string floor_ns = "-", floor_x = "-", bound = "-";
};

/// 1. The floors the cases need, each measured once in this run.
Floors measure_floors(const BenchArgs& a, const std::vector<bench::OpCase>& cases);
/// The floors' lines of the report's header.
void print_floors(std::ostream& out, const Floors& f);
/// A case's floor (JSON and table columns); null / "-" without floor measurements.
CaseFloor case_floor(const bench::OpCase& c, const bench::OpResult& r, const Floors& f, const bench::DeviceInfo& dev);
/// The floors' measurements in the JSON report (null without them).
nlohmann::ordered_json floor_measurements_json(const Floors& f);

}  // namespace dsaib::cli
