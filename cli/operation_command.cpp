// `dsaib backward`, `forward` and `step`: reads or generates a problem,
// runs one library call on a backend (the backward given P, the loss forward, or
// the loss and gradients in one call), verifies it against the fp64 reference,
// writes the outputs, reports.
#include <algorithm>
#include <cmath>
#include <map>
#include <new>
#include <numeric>

#include <nlohmann/json.hpp>

#include "operation.hpp"
#include "dsaib/safetensors.hpp"

namespace dsaib::cli {

namespace {

const char* command_description(LossOp op) {
  switch (op) {
    case LossOp::forward:
      return "run, time and verify the loss forward of a problem (indexer_kl_forward: the loss, each row's LSE and "
             "target mass, P)";
    case LossOp::step:
      return "run, time and verify the loss and its gradients in one call (indexer_kl_loss_and_grad: the forward "
             "and the P-free backward, no P)";
    case LossOp::backward: break;
  }
  return "run, time and verify the backward of a problem";
}

const char* out_flag_help(LossOp op) {
  switch (op) {
    case LossOp::forward: return "write loss, row_lse, row_target_mass, index_score to this .safetensors file";
    case LossOp::step: return "write loss, d_index_q, d_weights, d_index_k to this .safetensors file";
    case LossOp::backward: break;
  }
  return "write d_index_q, d_weights, d_index_k to this .safetensors file";
}

}  // namespace

OperationCommand::OperationCommand(CLI::App& app, LossOp op) : op_(op) {
  cmd_ = app.add_subcommand(loss_op_name(op), command_description(op));
  OperationArgs& a = args_;
  const bool gradients = op != LossOp::forward;
  cmd_->add_option("--in,-i", a.in, "input problem file (else one is generated from the generation flags)")
      ->check(nonempty_path());
  cmd_->add_option("--out,-o", a.out, out_flag_help(op))->check(nonempty_path());
  gen_.add(cmd_);
  scalars_.add(cmd_, true);
  cmd_->add_option("--backend", a.backend, "auto (cuda if available, else cpu), cpu or cuda")
      ->check(one_of({"auto", "cpu", "cuda"}))
      ->default_str("auto");
  if (gradients) {
    cmd_->add_option("--out-dtype", a.out_dtype, "dtype of the gradients")
        ->check(one_of({"bf16", "f32"}))
        ->default_str("bf16");
  }
  if (gradients) {
    cmd_->add_option("--verify", a.verify,
                     "compare with the fp64 reference: all rows, sampled rows, none, or auto (all for problems up to "
                     "about twice the small preset, else sample)" +
                         std::string(op == LossOp::step ? "; the loss always against the whole fp64 forward" : ""))
        ->check(one_of({"auto", "none", "all", "sample"}))
        ->default_str("auto");
    cmd_->add_option("--sample-rows", a.sample_rows, "query rows and key rows checked by --verify sample")
        ->check(int_range(1))
        ->default_str("64");
  } else {
    cmd_->add_option("--verify", a.verify,
                     "compare the loss, row_lse, row_target_mass and P with the fp64 reference forward: all (auto) "
                     "or none")
        ->check(one_of({"auto", "none", "all"}))
        ->default_str("auto");
  }
  cmd_->add_option("--threads", a.threads, "worker threads of the cpu backend, reference and generator (0: all cores)")
      ->check(int_range(0, 1 << 20));
  cmd_->add_option("--warmup", a.warmup, "untimed runs before the timed ones (default: 1 on cuda, 0 on cpu)")
      ->check(int_range(0, 100000));
  cmd_->add_option("--repeat", a.repeat, "timed runs (>= 1)")->check(int_range(1, 1000000))->default_str("1");
  cmd_->add_flag("--strict-indices", a.strict, "raise an error on the first invalid (out of range) id");
  if (!gradients) {
    cmd_->add_flag("--json", a.json,
                   "print the report as JSON on stdout (an error too: {\"error\": {code, argument, message}, "
                   "\"result\": \"ERROR\"})");
    return;
  }
  cmd_->add_flag("--deterministic", a.deterministic,
                 "bitwise reproducible d_index_k on cuda (64-bit fixed-point accumulation, docs/api.md "
                 "\"Determinism\"); the cpu backend always is");
  cmd_->add_option("--a-operand", a.a_operand,
                   "cuda: precision of the a operand of the dK/dQ GEMMs: auto (bf16x2 if an output is f32, else bf16), "
                   "bf16x2 or bf16 (docs/api.md)")
      ->check(one_of({"auto", "bf16x2", "bf16"}))
      ->default_str("auto");
  add_launch_option_flags(cmd_, &a.l2_hints, &a.start_stagger, &a.forward_fusion);
  cmd_->add_flag("--json", a.json,
                 "print the report as JSON on stdout (an error too: {\"error\": {code, argument, message}, \"result\": "
                 "\"ERROR\"})");
}

bool OperationCommand::json_requested(const std::vector<std::string>& words) {
  return std::find(words.begin(), words.end(), "--json") != words.end();
}

namespace {

/// `text` with every byte sequence that is not UTF-8 replaced by U+FFFD: for
/// paths that go into a safetensors header (JSON, UTF-8 only).
std::string utf8_text(const std::string& text) {
  const auto replaced = nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return nlohmann::json::parse(replaced).get<std::string>();
}

/// The problem file of --in, its errors named by the flag (the message names the file).
/// Only the backward reads index_score from it.
Problem read_input(const std::string& in, const ScalarOverrides& scalars, LossOp op) {
  log_stage("reading " + in + " ...");
  try {
    return load_problem(in, scalars.overridden_keys(), op == LossOp::backward);
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (msg.rfind("--in", 0) == 0) throw;
    throw Error(e.code(), "--in", "--in: " + msg);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::out_of_memory, "--in", "--in: " + in + ": out of host memory while reading the file");
  }
}

/// The problem's geometry; a file's errors name the file.
Geometry checked_geometry(const Problem& p, const std::string& in) {
  try {
    return analyze_problem(p);
  } catch (const Error& e) {
    if (in.empty()) throw;
    throw Error(e.code(), e.argument(), in + ": " + e.what());
  }
}

BackendChoice choose_backend(const std::string& requested) {
  BackendChoice c;
  if (requested == "cuda") {
    c.backend = Backend::cuda;
    c.why = "requested";
  } else if (requested == "cpu") {
    c.why = "requested";
  } else if (cuda_backend_available()) {
    c.backend = Backend::cuda;
    c.why = "auto: CUDA device found";
  } else {
    c.why = "auto: " + cuda_unavailable_reason();
  }
  return c;
}

/// The a-operand precision of the dK/dQ GEMMs (IndexerOptions::a_operand_precision):
/// auto is bf16x2 when an output is f32, else bf16; the cpu backend ignores it (fp64 throughout).
void describe_a_operand(BackwardOutcome& o) {
  if (o.op == LossOp::forward) {
    o.a_operand_used = o.a_operand_line = "ignored (the forward has no dK/dQ GEMMs)";
    return;
  }
  if (o.backend.backend != Backend::cuda) {
    o.a_operand_used = o.a_operand_line = "ignored (cpu backend)";
    return;
  }
  AOperandPrecision used = o.p.options.a_operand_precision;
  if (used == AOperandPrecision::automatic) {
    used = o.out_dtype == DType::f32 ? AOperandPrecision::bf16x2 : AOperandPrecision::bf16;
    o.a_operand_line = std::string(a_operand_precision_name(used)) + " (auto: " + dtype_name(o.out_dtype) + " outputs)";
  } else {
    o.a_operand_line = std::string(a_operand_precision_name(used)) + " (requested)";
  }
  o.a_operand_used = a_operand_precision_name(used);
}

/// Counts the non-finite inputs the backends read and warns about them with what they do.
void find_nonfinite_inputs(BackwardOutcome& o) {
  o.input_nonfinite = nonfinite_inputs(o.p, o.g, o.op, &o.nonfinite_found);
  if (o.input_nonfinite.empty()) return;
  std::string effects;
  for (const auto& nf : o.nonfinite_found) effects += "; " + nonfinite_effect(nf.first);
  log_stage("warning: non-finite input values (" + o.input_nonfinite + ")" + effects +
            "; attn_score and index_score at invalid slots (id -1 or out of range) are ignored");
}

int64_t count_nonfinite(const HostTensor& t) {
  int64_t n = 0;
  for (int64_t i = 0; i < t.numel(); ++i) n += std::isfinite(element(t, i)) ? 0 : 1;
  return n;
}

/// --verify auto: all rows for problems up to about twice the small preset, else sampled rows.
std::string verify_mode(const std::string& requested, const Geometry& g) {
  if (requested != "auto") return requested;
  const double cost = double(g.num_q_rows) * double(g.topk) * double(g.heads) * double(g.head_dim);
  return cost <= 4.5e9 ? "all" : "sample";
}

std::string verdict(const BackwardOutcome& o) {
  if (!o.input_nonfinite.empty()) return "FAIL (non-finite inputs: " + o.input_nonfinite + ")";
  if (!o.pass) return "FAIL";
  if (o.v.mode != "none") {
    // No query rows: d_index_q / d_weights are empty and d_index_k is all zero, so a PASS
    // compares nothing but that; say so rather than print a bare PASS.
    if (o.op == LossOp::forward) return o.g.num_q_rows == 0 ? "PASS (no query rows: the loss is 0)" : "PASS";
    return o.r.d_index_q.numel() == 0 ? "PASS (no query rows: empty d_index_q / d_weights, d_index_k all zero)"
                                      : "PASS";
  }
  return o.stored.empty() ? "OK (not verified)" : "PASS (stored gradients only)";
}

/// NaN/inf among the outputs, which were poisoned with NaN; -inf in row_lse is
/// a row without a valid slot, not a missed element.
int64_t count_nonfinite_outputs(const BackwardOutcome& o) {
  int64_t n = 0;
  for (const HostTensor* t : {&o.r.d_index_q, &o.r.d_weights, &o.r.d_index_k, &o.r.loss, &o.r.row_target_mass,
                              &o.r.index_score}) {
    if (!t->bytes.empty()) n += count_nonfinite(*t);
  }
  for (int64_t i = 0; i < (o.r.row_lse.bytes.empty() ? 0 : o.r.row_lse.numel()); ++i) {
    const double x = element(o.r.row_lse, i);
    n += (std::isnan(x) || (x > 0 && std::isinf(x))) ? 1 : 0;
  }
  return n;
}

/// The outputs of the op as named tensors: those --out writes.
std::map<std::string, HostTensor> op_outputs(const BackwardOutcome& o) {
  switch (o.op) {
    case LossOp::forward:
      return {{"loss", o.r.loss}, {"row_lse", o.r.row_lse}, {"row_target_mass", o.r.row_target_mass},
              {"index_score", o.r.index_score}};
    case LossOp::step:
      return {{"loss", o.r.loss}, {"d_index_q", o.r.d_index_q}, {"d_weights", o.r.d_weights},
              {"d_index_k", o.r.d_index_k}};
    case LossOp::backward: break;
  }
  return {{"d_index_q", o.r.d_index_q}, {"d_weights", o.r.d_weights}, {"d_index_k", o.r.d_index_k}};
}

/// Useful FLOP of the op: 2*H*D per valid slot for GEMM1 (the forward), 6*H*D
/// for the backward's three GEMMs, 8*H*D for both.
double useful_flops(const BackwardOutcome& o) {
  const double per_slot = o.op == LossOp::forward ? 2.0 : (o.op == LossOp::step ? 8.0 : 6.0);
  return per_slot * double(o.g.heads) * double(o.g.head_dim) * double(o.g.valid_slots);
}

/// Verifies the op against the fp64 reference in `mode`: the forward's outputs
/// (verify_forward); the gradients (verify_all / verify_sampled); for step
/// first the loss, then the gradients against the reference backward given the
/// reference forward's P, which is the P the one call rebuilds.
Verification verify_op(const BackwardOutcome& o, const std::string& mode, int64_t sample_rows, uint64_t seed,
                       int32_t threads) {
  Verification v;
  v.mode = mode;
  if (mode == "none") return v;
  if (o.op == LossOp::backward) {
    return mode == "all" ? verify_all(o.p, o.g, o.r, threads)
                         : verify_sampled(o.p, o.g, o.r, sample_rows, seed, threads);
  }
  ReferenceKLForward ref;
  const Verification fwd = verify_forward(o.p, o.r, threads, &ref);
  if (o.op == LossOp::forward) return fwd;
  Problem with_p = o.p;
  HostTensor P(DType::f32, o.p.tensors.at("topk_indices").shape);
  for (size_t i = 0; i < ref.index_score.size(); ++i) P.data<float>()[i] = static_cast<float>(ref.index_score[i]);
  with_p.tensors["index_score"] = std::move(P);
  v = mode == "all" ? verify_all(with_p, o.g, o.r, threads)
                    : verify_sampled(with_p, o.g, o.r, sample_rows, seed, threads);
  v.metrics.insert(v.metrics.begin(), fwd.metrics.begin(), fwd.metrics.end());
  v.seconds += fwd.seconds;
  return v;
}

void write_gradients(const std::string& out, const BackwardOutcome& o) {
  const std::map<std::string, std::string> meta = {
      {"op", loss_op_name(o.op)},
      {"backend", backend_name(o.backend.backend)},
      {"out_dtype", dtype_name(o.out_dtype)},
      {"layout", layout_name(o.p.options.layout)},
      {"id_mode", id_mode_name(o.p.options.id_mode)},
      {"sm_scale", format_float(o.p.options.sm_scale)},
      {"loss_coeff", format_float(o.p.options.loss_coeff)},
      {"grad_loss", format_float(o.p.options.grad_loss)},
      // N as the library uses it (max(rows, 1) when 0)
      {"normalization_count", std::to_string(o.g.normalization_count)},
      {"input", utf8_text(o.p.origin)},
      {std::string(loss_op_name(o.op)) + "_seconds", format_float(o.mean_seconds)},
  };
  write_safetensors(out, op_outputs(o), meta);
  log_stage("wrote " + out);
}

}  // namespace

int OperationCommand::run() {
  const OperationArgs& a = args_;
  const std::string first_gen_flag = gen_.finish();
  if (!a.in.empty() && !first_gen_flag.empty()) {
    throw Error(ErrorCode::invalid_argument, first_gen_flag,
                "--in and " + first_gen_flag + ": give an input file or generation flags, not both");
  }
  const int32_t threads = resolve_threads(a.threads);
  // Fail before generating or reading anything: an explicitly requested cuda
  // backend that is not there, and an output file that cannot be written.
  if (a.backend == "cuda" && !cuda_backend_available()) {
    throw Error(ErrorCode::backend_unavailable, "--backend",
                "--backend: expected cpu or auto (" + cuda_unavailable_reason() + "), got cuda");
  }
  if (!a.out.empty()) check_out_path(a.out, a.in);

  BackwardOutcome o;
  o.op = op_;
  if (!a.in.empty()) {
    o.p = read_input(a.in, scalars_, op_);
  } else {
    scalars_.apply_to_flags(gen_.f);
    o.p = generate(gen_.f, threads);
  }
  scalars_.apply_to_options(o.p.options);
  o.p.options.strict_indices = a.strict;
  o.p.options.deterministic = a.deterministic;
  (void)parse_a_operand_precision(a.a_operand, &o.p.options.a_operand_precision);  // checked by CLI11
  (void)parse_l2_hints(a.l2_hints, &o.p.options.l2_hints);                          // likewise
  (void)parse_start_stagger(a.start_stagger, &o.p.options.start_stagger);           // likewise
  (void)parse_forward_fusion(a.forward_fusion, &o.p.options.forward_fusion);        // likewise
  o.g = checked_geometry(o.p, a.in);

  o.backend = choose_backend(a.backend);
  log_stage("backend: " + o.backend.line());
  o.out_dtype = a.out_dtype == "f32" || o.op == LossOp::forward ? DType::f32 : DType::bf16;
  o.warmup = a.warmup >= 0 ? a.warmup : (o.backend.backend == Backend::cuda ? 1 : 0);
  describe_a_operand(o);
  log_stage("problem: " + o.g.summary());
  find_nonfinite_inputs(o);

  o.r = o.backend.backend == Backend::cuda ? run_cuda(o.p, o.g, o.out_dtype, o.warmup, a.repeat, o.op)
                                           : run_cpu(o.p, o.g, o.out_dtype, threads, o.warmup, a.repeat, o.op);
  o.mean_seconds = std::accumulate(o.r.seconds.begin(), o.r.seconds.end(), 0.0) / o.r.seconds.size();
  o.best_seconds = *std::min_element(o.r.seconds.begin(), o.r.seconds.end());
  o.flops = useful_flops(o);

  // The forward has no sampled reference: auto verifies all its rows.
  const std::string mode = o.op == LossOp::forward && a.verify == "auto" ? "all" : verify_mode(a.verify, o.g);
  o.v = verify_op(o, mode, a.sample_rows, gen_.f.seed, threads);
  // Gradients stored in the input file by its producer (scripts/dump_torch_step.py --with-grads):
  // compared too, unless scalar overrides changed the problem.
  if (!a.in.empty() && !scalars_.any_given() && o.op != LossOp::forward) {
    o.stored = verify_against_stored(o.p, o.r, "torch_");
  }
  // Outputs were poisoned with NaN: every element must come back finite (checked even without --verify).
  o.nonfinite_outputs = count_nonfinite_outputs(o);
  // Non-finite inputs make the gradients meaningless even where they match the
  // reference (a NaN logit drops out silently): never a PASS.
  o.pass = o.v.pass() && o.nonfinite_outputs == 0 && o.input_nonfinite.empty() &&
           std::all_of(o.stored.begin(), o.stored.end(), [](const Metric& m) { return m.pass; });
  o.verdict = verdict(o);

  if (!a.out.empty()) write_gradients(a.out, o);
  if (a.json) {
    print_backward_json(o, a);
  } else {
    print_backward_text(o, a, scalars_.any_given());
  }
  return o.pass ? 0 : kExitFail;
}

}  // namespace dsaib::cli
