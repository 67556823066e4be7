// Internals of `dsaib backward`, shared by its run (operation_command.cpp)
// and its reports (operation_report.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "commands.hpp"

namespace dsaib::cli {

/// The backend a run uses and why ("requested", "auto: CUDA device found", "auto: <why not>").
struct BackendChoice {
  Backend backend = Backend::cpu;
  std::string why;
  std::string line() const { return std::string(backend_name(backend)) + " (" + why + ")"; }
};

/// Everything a backward run produced and how it was judged: what the reports print.
struct BackwardOutcome {
  LossOp op = LossOp::backward;
  Problem p;
  Geometry g;
  BackendChoice backend;
  DType out_dtype = DType::bf16;
  int warmup = 0;
  std::string a_operand_used;  // "bf16", "bf16x2" or "ignored (cpu backend)"
  std::string a_operand_line;  // the same with why ("bf16x2 (auto: f32 outputs)")
  RunResult r;
  double mean_seconds = 0, best_seconds = 0;
  double flops = 0;  // useful FLOP: 6*H*D per valid slot
  Verification v;
  std::vector<Metric> stored;  // against the gradients stored in the input file
  std::vector<std::pair<std::string, int64_t>> nonfinite_found;  // input name, non-finite elements read
  std::string input_nonfinite;  // nonfinite_found as text, "" if none
  int64_t nonfinite_outputs = 0;
  bool pass = false;
  std::string verdict;  // "PASS", "FAIL (...)", "OK (not verified)", ...
};

/// "attn_score: 3 (first at element 17), ..." for the floating-point inputs holding
/// NaN/inf where operation `op` reads them (forward and step compute P, so they
/// never read index_score); "" if none. `found` (optional) gets the counts.
std::string nonfinite_inputs(const Problem& p, const Geometry& g, LossOp op,
                             std::vector<std::pair<std::string, int64_t>>* found = nullptr);
/// What every backend (and the fp64 reference) does with NaN/inf in input `name`.
std::string nonfinite_effect(const std::string& name);

/// The report on stdout: JSON (--json) or text. `scalars_given`: a scalar flag
/// changed the problem (stored gradients were then not compared).
void print_backward_json(const BackwardOutcome& o, const OperationArgs& a);
void print_backward_text(const BackwardOutcome& o, const OperationArgs& a, bool scalars_given);

}  // namespace dsaib::cli
