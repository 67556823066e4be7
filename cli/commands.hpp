// The subcommands of dsaib. Each adds itself and its flags to the
// CLI11 app when constructed (so it must stay where it was built: the flags
// write into its members) and runs when the command line selected it.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "cli.hpp"
#include "flags.hpp"

namespace dsaib::cli {

/// Exit status: 0 success (and PASS), 1 verification FAIL, 2 error.
inline constexpr int kExitFail = 1;
inline constexpr int kExitError = 2;

/// `generate`: writes a problem (inputs and metadata) to a safetensors file.
class GenerateCommand {
 public:
  explicit GenerateCommand(CLI::App& app);
  GenerateCommand(const GenerateCommand&) = delete;
  GenerateCommand& operator=(const GenerateCommand&) = delete;
  bool selected() const { return cmd_->parsed(); }
  int run();

 private:
  CLI::App* cmd_ = nullptr;
  GenOptions gen_;
  ScalarOverrides scalars_;
  std::string out_;
  int32_t threads_ = 0;
};

/// Flags of `backward` besides the generation flags and the scalar overrides.
struct OperationArgs {
  std::string in, out, backend = "auto", out_dtype = "bf16", verify = "auto";
  int64_t sample_rows = 64;
  int32_t threads = 0;
  int warmup = -1, repeat = 1;
  bool json = false, strict = false, deterministic = false;
  std::string a_operand = "auto";
  std::string l2_hints = "auto", start_stagger = "auto", forward_fusion = "auto";
};

/// `backward`, `forward` and `step`: runs, times and verifies one library call
/// (LossOp: the backward given P, the loss forward, or the loss and gradients in
/// one call) on a problem read from a file or generated; reports as text or
/// JSON, writes the outputs on request.
class OperationCommand {
 public:
  explicit OperationCommand(CLI::App& app, LossOp op = LossOp::backward);
  OperationCommand(const OperationCommand&) = delete;
  OperationCommand& operator=(const OperationCommand&) = delete;
  bool selected() const { return cmd_->parsed(); }
  /// Whether the report (an error's too) is JSON on stdout.
  bool json() const { return args_.json; }
  /// Whether the words after `backward` ask for JSON (for a command line that did not parse).
  static bool json_requested(const std::vector<std::string>& words);
  int run();

 private:
  CLI::App* cmd_ = nullptr;
  LossOp op_ = LossOp::backward;
  GenOptions gen_;
  ScalarOverrides scalars_;
  OperationArgs args_;
};

/// The bench's flags on a CLI11 app or subcommand, and what they parse into. The
/// `bench` subcommand and the dsaib-bench binary (bench/dsaib_bench.cpp) both use it, so
/// they take the same flags, check them the same way and run the same code (run_bench).
/// Must stay where it was built: the flags write into its members.
struct BenchFlags {
  BenchArgs args;
  // The lists are taken as text and split after the parse (split_list_items), so that an
  // empty item ("4096,,16384") is an error naming the flag, not dropped.
  std::vector<std::string> op_text, seq_text, ids_text, shapes_text, topk_shapes_text, ranges_text, topk_dtype_text,
      target_lse_text;
  CLI::Option* op_opt = nullptr;
  CLI::Option* seq_opt = nullptr;
  CLI::Option* ids_opt = nullptr;
  CLI::Option* shapes_opt = nullptr;
  CLI::Option* topk_shapes_opt = nullptr;
  CLI::Option* ranges_opt = nullptr;
  CLI::Option* topk_dtype_opt = nullptr;
  CLI::Option* target_lse_opt = nullptr;
};
/// Adds the bench's flags to `cmd`, into `f`, and its --help footer.
void add_bench_flags(CLI::App* cmd, BenchFlags& f);
/// After the parse: the lists split and checked (errors name the flag), `command_line`
/// kept for the report; then run_bench. Returns its exit status.
int run_bench_flags(BenchFlags& f, const std::string& command_line);
/// Whether `words` (the flags) ask for the JSON report on stdout (--json -), for a command
/// line that did not parse.
bool bench_json_requested(const std::vector<std::string>& words);

/// `bench`: the floors and the ops on the GPU (BenchFlags, run_bench).
class BenchCommand {
 public:
  explicit BenchCommand(CLI::App& app);
  BenchCommand(const BenchCommand&) = delete;
  BenchCommand& operator=(const BenchCommand&) = delete;
  bool selected() const { return cmd_->parsed(); }
  /// Whether the JSON report (an error's too) goes to stdout (--json -).
  bool json_to_stdout() const { return flags_.args.json == "-"; }
  /// Whether the words after `bench` ask for JSON on stdout (for a command line that did not parse).
  static bool json_requested(const std::vector<std::string>& words) { return bench_json_requested(words); }
  /// `command_line`: the whole command line, for the JSON report.
  int run(const std::string& command_line) { return run_bench_flags(flags_, command_line); }

 private:
  CLI::App* cmd_ = nullptr;
  BenchFlags flags_;
};

/// Flags of `topk`.
struct TopkArgs {
  int64_t batch = 2, s_q = 128, s_kv = -1, heads = 8, head_dim = 64, topk = 32;
  std::string visible = "causal", causal_offset = "auto", layout = "bshd", id_mode = "local";
  std::string order = "logit_descending", backend = "auto";
  uint64_t seed = 0;
  int32_t threads = 0;
  int warmup = -1, repeat = 1;
  bool weights_f32 = false, strict_ranges = false, json = false;
  std::string dtype = "bf16";  // index_q and index_k: bf16, or e4m3 with per-token scales
};

/// `topk`: generates a random indexer_topk() problem, runs it on a backend,
/// checks the selection against the fp64 reference (check_indexer_topk) and
/// reports PASS or FAIL, as text or JSON.
class TopkCommand {
 public:
  explicit TopkCommand(CLI::App& app);
  TopkCommand(const TopkCommand&) = delete;
  TopkCommand& operator=(const TopkCommand&) = delete;
  bool selected() const { return cmd_->parsed(); }
  bool json() const { return args_.json; }
  int run();

 private:
  CLI::App* cmd_ = nullptr;
  TopkArgs args_;
};

/// `presets`: lists the presets of the generation flags.
class PresetsCommand {
 public:
  explicit PresetsCommand(CLI::App& app);
  bool selected() const { return cmd_->parsed(); }
  int run();

 private:
  CLI::App* cmd_ = nullptr;
};

}  // namespace dsaib::cli
