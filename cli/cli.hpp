// Internals of the dsaib command line tool (not part of the library API).
#pragma once

#include "core/problem.hpp"

#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "dsaib/generate.hpp"
#include "dsaib/host_tensor.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/indexer_kl_forward.hpp"

namespace dsaib::cli {

// ---------------------------------------------------------------- scalar text

/// The whole of `text` as a number (strtod's syntax), into *value. False when it is
/// not one: empty, a leading blank (strtod would skip it) or anything left over
/// (a trailing blank included). Overflow parses as inf, underflow towards 0: the
/// caller judges the value. The CLI's flags (finite_float) and a problem file's
/// metadata (load_problem) share these rules.
inline bool parse_number_text(const std::string& text, double* value) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  char* end = nullptr;
  *value = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size();
}

/// Whether v[from..] is one or more decimal digits.
inline bool is_digits(const std::string& v, size_t from) {
  return v.size() > from && v.find_first_not_of("0123456789", from) == std::string::npos;
}

/// "010", "-07": digits with a leading zero (octal to CLI11).
inline bool has_leading_zero(const std::string& v) {
  const size_t d = (!v.empty() && v[0] == '-') ? 1 : 0;
  return is_digits(v, d) && v.size() > d + 1 && v[d] == '0';
}

/// "" if `v` is a plain decimal integer (optional '-', digits, no leading zero
/// except "0" itself), else why not. CLI11 2.1 converts integers with base 0, so
/// "010" would be read as octal 8 and "0x10" as 16: only decimal text is taken.
/// The rule of the integer flags and of the integer metadata of problem files.
inline std::string decimal_integer_error(const std::string& v) {
  if (!is_digits(v, (!v.empty() && v[0] == '-') ? 1 : 0)) return "expected a decimal integer, got \"" + v + "\"";
  if (has_leading_zero(v)) return "expected a decimal integer without leading zeros, got \"" + v + "\"";
  return std::string();
}

/// The one integer parse of the CLI's flags, lists and metadata: `v` as a plain
/// decimal integer (decimal_integer_error's rule) into *value. False when it is
/// not one or lies beyond int64: such text is never clamped to the int64 limits,
/// so that callers can report it as typed.
inline bool parse_decimal_int64(const std::string& v, int64_t* value) {
  if (!decimal_integer_error(v).empty()) return false;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), *value);
  return ec == std::errc() && end == v.data() + v.size();
}

/// `text` as it may go to a terminal: control characters (C0, DEL and the C1
/// range U+0080..U+009F) written as escapes ("\n", "\t", "\x1b", "\u009b") and bytes
/// that are not UTF-8 as "\xff". Names and strings read from a file reach the
/// human-readable output only through it: a tensor name holding "\n" or an escape
/// sequence can neither forge a line of the log nor drive the terminal.
std::string terminal_text(const std::string& text);

/// Whether a finite `v` can be an fp32 scalar of the op: finite after rounding to
/// fp32 (3.40282347e+38, the largest float as written, is; 3.5e38 is not) and, with
/// `nonzero`, not 0 after that rounding (1e-50).
inline bool fits_fp32_scalar(double v, bool nonzero) {
  const float f = static_cast<float>(v);
  return !std::isinf(f) && !(nonzero && f == 0.0f);
}

// ---------------------------------------------------------------- problems

/// Tensor names of a problem file (as written by `generate` and scripts/dump_torch_step.py).
inline const char* const kInputNames[] = {"index_q", "weights", "index_k", "topk_indices", "attn_score", "index_score"};
inline const char* const kSeqlenNames[] = {"cu_seqlens_q", "cu_seqlens_k"};
inline const char* const kOutputNames[] = {"d_index_q", "d_weights", "d_index_k"};

/// A problem held on the host: its tensors by name and the options that come with it.
struct Problem {
  std::map<std::string, HostTensor> tensors;
  IndexerOptions options;             // layout, id_mode, sm_scale, loss_coeff, grad_loss, normalization_count
  std::string origin;                         // "generated (preset small, seed 0)" or "file x.safetensors"
  std::map<std::string, std::string> info;    // extra metadata written with it (ids, seed, preset)

  IndexerInputs inputs() const;       // host views (cu_seqlens absent if not held)
};

/// Sizes and sequence structure of a validated problem: the library's own
/// geometry (src/core/problem.hpp), plus what the report needs.
struct Geometry : detail::ProblemGeometry {
  int64_t valid_slots = 0;
  std::vector<uint8_t> key_selected;  // per flat key row: selected by at least one valid slot
  std::vector<uint8_t> q_row_used;    // per flat query row: holds at least one valid slot

  std::string summary() const;  // "bshd B=1 S_q=1024 S_kv=1024 H=64 D=128 topk=256 (ids local)"
};

/// Checks the tensors (presence, ranks, then the library's own validation on
/// the cpu backend) and derives the geometry. Raises dsaib::Error.
Geometry analyze_problem(const Problem& p);

/// Generation flags: a preset, then explicit overrides.
struct GenFlags {
  std::string preset = "small";
  int64_t batch = 0, s_q = 0, s_kv = 0, heads = 0, head_dim = 0, topk = 0;
  std::string ids, id_mode, layout;
  std::vector<int64_t> seqlens_q, seqlens_k;
  uint64_t seed = 0;
  bool weights_f32 = false;
  float sm_scale = 0.0f, loss_coeff = 1.0f, grad_loss = 1.0f;
  int64_t normalization_count = 0;
  // Which flags were given on the command line.
  bool has_preset = false, has_batch = false, has_s_q = false, has_s_kv = false, has_heads = false,
       has_head_dim = false, has_topk = false, has_ids = false, has_id_mode = false, has_layout = false,
       has_seqlens_q = false, has_seqlens_k = false, has_seed = false, has_sm_scale = false;
};

/// The generator's (and the ids') limit on query rows, key rows, sequences: 2^31 - 1.
inline constexpr int64_t kMaxRows = 2147483647;
/// Parses sequence lengths given to `flag` (each token a comma-separated list of
/// integers >= 0, no empty items). Raises dsaib::Error(invalid_argument) naming the flag and the value.
std::vector<int64_t> parse_lengths(const std::string& flag, const std::vector<std::string>& tokens);
/// The comma-separated items of `tokens` (each token may hold several). Raises
/// dsaib::Error(invalid_argument, flag) on an empty item ("a,,b", "a,", ""), naming
/// `what` the list should hold and the text given: empty items are errors, never dropped.
std::vector<std::string> split_list_items(const std::string& flag, const std::vector<std::string>& tokens,
                                          const std::string& what);
/// split_list_items, then each item a decimal integer >= min_value. Raises
/// dsaib::Error(invalid_argument, flag) naming the bad item.
std::vector<int64_t> parse_int_list(const std::string& flag, const std::vector<std::string>& tokens,
                                    int64_t min_value, const std::string& what);

/// Names and one-line descriptions of the presets.
std::vector<std::pair<std::string, std::string>> preset_list();
/// The spec of a preset with the flags' overrides applied. Raises dsaib::Error(invalid_argument).
GenerateSpec make_spec(const GenFlags& flags, int32_t threads);
/// Runs the generator and wraps its output as a Problem.
Problem generate(const GenFlags& flags, int32_t threads);
/// Reads a problem file. Raises dsaib::Error(io_error / invalid_argument / out_of_memory).
/// `overridden`: metadata keys that flags replace (ScalarFlags); those are not read.
/// `index_score_required`: false for the ops that compute P (forward, step),
/// whose files need not hold it.
Problem load_problem(const std::string& path, const std::set<std::string>& overridden = {},
                     bool index_score_required = true);
/// Writes a problem file (inputs and their metadata).
void save_problem(const std::string& path, const Problem& p);

/// `status`, or `error_status` with a line on stderr when standard output could
/// not be written (closed, a full disk): a report that is lost is an error,
/// not an exit status 0 behind it. Called as a program returns.
int with_written_report(int status, int error_status);

/// "%.9g": round-trips a float.
std::string format_float(double v);
/// dsaib::Error(invalid_argument) naming `arg` (a flag or a file's field).
[[noreturn]] void bad(const std::string& arg, const std::string& message);
/// "a, b, c": the first 16 items, each cut at 64 bytes, then "... (N in all)":
/// names from a file, which may hold a million of them, each as long as the header.
std::string short_list(const std::vector<std::string>& items);

// ---------------------------------------------------------------- running

/// The library call a run makes: the backward given P (indexer_backward), the
/// loss forward (indexer_kl_forward, P written too), or the loss and gradients
/// in one call (indexer_kl_loss_and_grad). The problem's index_score is passed
/// to the backward only.
enum class LossOp { backward, forward, step };
/// "backward", "forward" or "step": the subcommand's name.
const char* loss_op_name(LossOp op);

struct RunResult {
  HostTensor d_index_q, d_weights, d_index_k;
  HostTensor loss, row_lse, row_target_mass, index_score;  // the forward's (step: loss only)
  std::vector<double> seconds;  // per timed run
  std::string timer;            // "std::chrono (host)" / "cudaEvent"
  std::string device;           // e.g. "NVIDIA H200 (sm_90)"
};

/// The outputs of `op` allocated in `r` (gradients in out_dtype, the forward's
/// f32), in the order run_op takes their views.
std::vector<HostTensor*> allocate_outputs(const Problem& p, LossOp op, DType out_dtype, RunResult& r);
/// The library's workspace size for `op`, and the call itself, with the outputs
/// as views (on the backend's device) in allocate_outputs' order.
std::size_t op_workspace_size(LossOp op, const IndexerInputs& in, const std::vector<TensorView>& outs,
                              const IndexerOptions& opt);
void run_op(LossOp op, const IndexerInputs& in, const std::vector<TensorView>& outs,
            const IndexerOptions& opt, void* workspace, std::size_t workspace_bytes);
/// Runs `op` on the host (cpu backend), outputs poisoned with NaN first.
RunResult run_cpu(const Problem& p, const Geometry& g, DType out_dtype, int32_t threads, int warmup, int repeat,
                  LossOp op = LossOp::backward);

/// Whether this binary was built with the CUDA runtime, and why cuda is unavailable (empty if available).
bool cli_built_with_cuda();
std::string cuda_unavailable_reason();
/// Copies the problem to the device, runs indexer_backward on the cuda backend
/// (timed with cudaEvents), copies the outputs back. Raises dsaib::Error.
RunResult run_cuda(const Problem& p, const Geometry& g, DType out_dtype, int warmup, int repeat,
                   LossOp op = LossOp::backward);

// ---------------------------------------------------------------- bench

/// Flags of the bench: `dsaib bench` and the dsaib-bench binary take the same
/// ones (cli/bench_command.cpp). Defaults: the DeepSeek-V3.2 indexer shapes at three lengths.
struct BenchArgs {
  std::vector<std::string> ops = {"backward"};       // bench::BenchOp words
  std::vector<int64_t> seqs = {4096, 16384, 65536};  // S_q = S_kv
  std::vector<std::string> ids = {"causal", "random"};
  int64_t batch = 1, heads = 64, dim = 128, topk = 2048;
  std::vector<std::pair<int64_t, int64_t>> shapes = {{128, 576}, {64, 192}};  // target: Hq x Dqk
  std::vector<std::pair<int64_t, int64_t>> topk_shapes = {{64, 128}, {32, 128}};  // topk: H x D
  std::vector<std::string> ranges = {"causal", "cp-shard"};  // topk: bench::TopkRanges words
  std::vector<std::string> topk_dtypes = {"bf16"};           // topk: index_q and index_k in bf16 or e4m3
  std::string lse_base = "natural";            // target: AttentionTargetOptions::lse_base
  bool unnormalized = false;                   // target: AttentionTargetOptions::normalize = false
  std::vector<std::string> target_lse = {"given"};  // target: the lse given, or absent (AttentionTargetInputs::lse)
  bool index_score = false;                    // forward: also write P
  bool topk_logits = false;                    // forward, one-call: the top-k's logits given (IndexerInputs::topk_logits)
  int iters = 20, warmup = 3, input_sets = 0;  // input_sets 0: automatic
  double sustained_ms = 2000;                   // back-to-back launches after the timed ones (0: none)
  double l2_set_aside_mib = -1;                 // < 0: the context's persisting-L2 limit as it is
  uint64_t seed = 1234;
  std::string json;                             // "" none, "-" stdout
  bool no_floor = false;
  std::string a_operand = "auto";               // IndexerOptions::a_operand_precision
  std::string l2_hints = "auto";                // IndexerOptions::l2_hints
  std::string start_stagger = "auto";           // IndexerOptions::start_stagger
  std::string forward_fusion = "auto";          // IndexerOptions::forward_fusion
  bool deterministic = false;                   // IndexerOptions::deterministic
  std::string tool = "dsaib bench";   // names the report
  std::string command_line;                     // for the JSON report
};

/// The per-case floors, as --help and the JSON state them.
inline constexpr const char* kBenchFloorFormula =
    "backward: floor ns/row = max(topk*D*4 B / scatter rate, 6*H*D*topk FLOP / GEMM rate), where the scatter rate "
    "is the best of three ways (float4 atomicAdd, scalar atomicAdd, cp.reduce.async.bulk add.f32) of adding "
    "rows of D fp32 values into random rows of an fp32 table of this case's dK size (B*S_kv*D*4 bytes), and "
    "the GEMM rate is the best of cuBLAS bf16 (fp32 compute) at 8192^3 at four operand layouts, both measured in "
    "the same run";
inline constexpr const char* kBenchGatherFloorFormula =
    "forward: floor ns/row = max(gather ns/row, 2*H*D*slots FLOP / GEMM rate); target: the same with Hq, Dqk and "
    "the cuBLAS rate at the target's shape (Hq x topk x Dqk, batched); where gather ns/row is the fastest of three "
    "ways (16-byte vector loads per lane, a cp.async ring, cp.async.bulk per row on an mbarrier), each at a few "
    "depths and CTA counts, of reading every valid slot's D*2-byte key row of an (S, topk) id table of this case's "
    "pattern, S and topk, inputs rotated over the L2 as the op's; slots = the case's valid slots per row";
inline constexpr const char* kBenchStepFloorFormula =
    "step, one-call: floor ns/row = max(topk*D*4 B / scatter rate, 8*H*D*topk FLOP / GEMM rate, gather ns/row): "
    "the backward's terms with the forward's GEMM1 added, and the key gather";

/// The top-k's floor, as --help and the JSON state it.
inline constexpr const char* kBenchTopkFloorFormula =
    "topk: floor ns/row = visible keys per row * H * D * 2 FLOP / GEMM rate (every visible key's dot product with "
    "every head: the causal FLOPs summed over the rows, per row), where the GEMM rate is the best of cuBLAS bf16 "
    "(fp32 compute) at 8192^3 at four operand layouts, or for e4m3 inputs cuBLASLt's e4m3 GEMM (TN, fp32 compute) "
    "at 8192^3, measured in the same run";

/// The per-case traffic floor (not the floor; a second reference), as the report states it.
inline constexpr const char* kBenchTrafficFloorFormula =
    "traffic floor ns/row = topk*D*4 B / key-read scatter rate, where the key-read scatter rate is the rate of "
    "float4 fp32 row-adds into random rows of this case's dK table when each row-add first reads its row's D bf16 "
    "key (D*2 B, ld.global.cg) from a key table of as many rows: the op's dK reduce and K gather traffic alone, "
    "with uniformly random rows";

/// Runs the bench: the floors every case needs, then every case (--op x --ids x --seq, and
/// --shapes for the target); prints the report (and writes the JSON). Returns the exit
/// status: 0, or 1 when a floor's correctness check failed. Raises
/// dsaib::Error(backend_unavailable) in a build without CUDA or on a machine without a
/// compute-capability-9.0 GPU, dsaib::Error(cuda_error) when a CUDA call fails.
int run_bench(const BenchArgs& a);

// ---------------------------------------------------------------- verification

struct Metric {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::f32;
  int64_t compared = 0;    // elements compared
  int64_t nonfinite = 0;   // non-finite output elements among them
  int64_t ref_nonfinite = 0;  // non-finite reference elements among them (a stored gradient's NaN): never a pass
  double rel_rms = 0, max_abs = 0, ref_rms = 0, ref_max_abs = 0, tol = 0;
  // The least reference RMS that rel_rms divides by (docs/errors.md): 2^-24 times
  // the size of one slot's term of this gradient, from the inputs; 0 = none.
  double ref_floor = 0;
  bool pass = false;
};

struct Verification {
  std::string mode;  // "all" or "sample"
  std::vector<int64_t> q_rows, k_rows;  // sampled rows (empty for "all")
  double seconds = 0;
  std::vector<Metric> metrics;
  bool pass() const;
};

/// Compares against reference_backward (all rows).
Verification verify_all(const Problem& p, const Geometry& g, const RunResult& r, int32_t threads);
/// Compares against reference_backward_sampled on `sample_rows` query rows
/// (first, last and random ones) and `sample_rows` key rows (mostly selected ones).
Verification verify_sampled(const Problem& p, const Geometry& g, const RunResult& r, int64_t sample_rows,
                            uint64_t seed, int32_t threads);

/// Compares the forward's outputs (loss, row_lse, row_target_mass, index_score)
/// with reference_kl_forward: the loss by its relative error (tolerance 1e-6),
/// row_lse by its largest absolute error over rows with a valid slot (1e-5; the
/// others must be -inf), row_target_mass by its relative RMS error (1e-5;
/// defined with the LSE as written: the fp64 mass times exp(row_lse - LSE)), P by
/// its largest relative error where the reference is >= 1e-30 (1e-5; elsewhere
/// within 1e-30). Metric.tol is that tolerance. `r` without row_lse (step):
/// the loss only.
Verification verify_forward(const Problem& p, const RunResult& r, int32_t threads, ReferenceKLForward* reference);
/// Compares the outputs with gradients stored in the problem file under `prefix` + output name
/// (scripts/dump_torch_step.py --with-grads writes torch_d_index_q, torch_d_weights, torch_d_index_k,
/// fp64 autograd cast to f32). Returns no metric for a name that is absent or shaped differently.
std::vector<Metric> verify_against_stored(const Problem& p, const RunResult& r, const std::string& prefix);

// ---------------------------------------------------------------- helpers

/// Element i of a bf16/f32/i32 host tensor as double.
double element(const HostTensor& t, int64_t i);
/// Stage messages on stderr: "[  1.23 s] message", the message through terminal_text.
void log_stage(const std::string& message);

/// `j` as the CLI prints its JSON reports: indented by 2, with byte sequences that
/// are not UTF-8 (a path or a flag's value quoted in it) replaced by U+FFFD
/// instead of an exception from the serialiser.
std::string report_json_text(const nlohmann::ordered_json& j);
/// "1.234 s", "12.345 ms", "3.2 us".
std::string human_seconds(double s);
/// "12.3 KiB", "4.5 MiB", "1.25 GiB".
std::string human_bytes(double bytes);
/// "%.*f" and "%.*e" ("nan" for NaN) of `v`.
std::string fixed(double v, int digits);
std::string sci(double v, int digits = 2);
/// "index_q bf16, weights bf16, index_k bf16".
std::string tensor_dtypes(const Problem& p);
double seconds_since(std::chrono::steady_clock::time_point t0);
int32_t resolve_threads(int32_t threads);

}  // namespace dsaib::cli
