// dsa-indexer-bwd: generate DSA lightning-indexer problems, run the backward on
// a backend, verify it against the fp64 reference, report.
//
//   dsa-indexer-bwd generate --out p.safetensors [--preset small | --batch .. --s-q .. ...]
//   dsa-indexer-bwd backward [--in p.safetensors | generation flags] [--out grads.safetensors]
//                            [--backend auto|cpu|cuda] [--out-dtype bf16|f32] [--verify auto|none|all|sample]
//   dsa-indexer-bwd bench [--seq 4096,16384,65536] [--ids causal,random] [--heads 64] [--dim 128] [--topk 2048]
//                         [--batch 1] [--iters 20] [--warmup 3] [--sustained-ms 2000] [--json FILE] [--no-floor]
//                         (cuda builds, a GPU)
//   dsa-indexer-bwd presets
//
// Exit status: 0 success (and PASS), 1 verification FAIL, 2 error (bad usage, bad file, bad input).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cctype>
#include <cmath>
#include <limits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <iostream>
#include <numeric>
#include <sstream>

#include "bench_names.hpp"
#include "cli.hpp"
#include "dsaib/safetensors.hpp"
#include "io/output_path.hpp"

namespace dsaib::cli {
namespace {

constexpr int kExitFail = 1;
constexpr int kExitError = 2;

/// Set once `backward --json` has been parsed: errors are then also printed as a
/// JSON object on stdout (besides the usual line on stderr), so that a caller
/// parsing stdout gets a report on every exit.
bool g_json_errors = false;

/// The tool's one error style on stderr, and the JSON error object on stdout
/// when g_json_errors: {"error": {"code", "argument", "message"}, "result": "ERROR", "exit_code": kExitError}.
void report_error(const std::string& code, const std::string& argument, const std::string& message) {
  std::cerr << "dsa-indexer-bwd: error" << (code.empty() ? "" : " (" + code + ")") << ": " << message << std::endl;
  if (!g_json_errors) return;
  nlohmann::ordered_json j;
  j["error"] = {{"code", code.empty() ? "error" : code}, {"argument", argument}, {"message", message}};
  j["result"] = "ERROR";
  j["exit_code"] = kExitError;
  // The message may quote a flag's value or a path that is not UTF-8: replaced
  // (U+FFFD), never thrown from here.
  std::cout << report_json_text(j) << std::endl;
}

/// `text` with every byte sequence that is not UTF-8 replaced by U+FFFD: for
/// paths that go into a safetensors header (JSON, UTF-8 only).
std::string utf8_text(const std::string& text) {
  const auto replaced = nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return nlohmann::json::parse(replaced).get<std::string>();
}

/// Any decimal integer (the range is checked elsewhere).
CLI::Validator decimal_int() {
  return CLI::Validator([](std::string& v) { return decimal_integer_error(v); }, "INT");
}

/// Integer range checks whose messages read "--flag: expected >= 1, got 0" (CLI11
/// prefixes the flag), instead of CLI::Range's double-formatted bounds.
CLI::Validator int_range(int64_t lo, int64_t hi = std::numeric_limits<int64_t>::max()) {
  const std::string expected = hi == std::numeric_limits<int64_t>::max()
                                   ? ">= " + std::to_string(lo)
                                   : "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return CLI::Validator(
      [lo, hi, expected](std::string& v) -> std::string {
        if (has_leading_zero(v)) return decimal_integer_error(v);
        char* end = nullptr;
        errno = 0;
        const long long x = std::strtoll(v.c_str(), &end, 10);
        if (errno == ERANGE && !v.empty() && end == v.c_str() + v.size()) {  // an integer, beyond int64
          return "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + v;
        }
        if (v.empty() || end != v.c_str() + v.size() || errno == ERANGE) {
          return "expected an integer " + (expected.rfind(">=", 0) == 0 ? expected : expected.substr(11)) +
                 ", got \"" + v + "\"";
        }
        if (x < lo || x > hi) return "expected " + expected + ", got " + v;
        return std::string();
      },
      expected.rfind(">=", 0) == 0 ? "INT " + expected : "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

/// One of `choices` (exact text): "expected one of a, b, got \"x\"" otherwise.
CLI::Validator one_of(std::vector<std::string> choices) {
  std::string list;
  for (const std::string& c : choices) list += (list.empty() ? "" : ", ") + c;
  std::string name = "{";
  for (const std::string& c : choices) name += (name.size() > 1 ? "," : "") + c;
  name += "}";
  return CLI::Validator(
      [choices, list](std::string& v) -> std::string {
        for (const std::string& c : choices) {
          if (v == c) return std::string();
        }
        return "expected one of " + list + ", got \"" + v + "\"";
      },
      name);
}

/// A file name that is not empty ("--out ''" would otherwise mean "no output").
CLI::Validator nonempty_path() {
  return CLI::Validator([](std::string& v) -> std::string { return v.empty() ? "expected a file name, got \"\"" : ""; },
                        "FILE");
}

/// A decimal number of milliseconds in [0, hi]: hex, NaN, inf, negative and
/// out-of-range text are errors naming the flag (as dsa-indexer-bwd-bench's flag).
CLI::Validator millis_range(double hi) {
  return CLI::Validator(
      [hi](std::string& v) -> std::string {
        double x = 0;
        if (!dsaib::bench::parse_bounded_decimal(v, 0.0, hi, &x)) {  // the bench tools' rule (bench_names.hpp)
          return "expected a number of milliseconds from 0 to " + std::to_string(static_cast<int64_t>(hi)) +
                 ", got \"" + v + "\"";
        }
        return std::string();
      },
      "MS");
}

/// A finite floating-point value (fp32 range): NaN, inf and out-of-range text are
/// errors naming the flag, before any file is read. With `nonzero`, 0 is one too.
CLI::Validator finite_float(bool nonzero = false) {
  return CLI::Validator(
      [nonzero](std::string& v) -> std::string {
        double x = 0;
        if (!parse_number_text(v, &x)) return "expected a number, got \"" + v + "\"";
        if (!std::isfinite(x) || !fits_fp32_scalar(x, nonzero)) {
          return std::string("expected a finite ") + (nonzero ? "nonzero " : "") + "number (fp32 range), got " + v;
        }
        return std::string();
      },
      nonzero ? "FLOAT (finite, nonzero)" : "FLOAT (finite)");
}

/// An unsigned 64-bit integer written in decimal digits only (no sign, no
/// wrap-around, no clamping).
CLI::Validator uint64_text() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        const bool digits = is_digits(v, 0);
        errno = 0;
        if (digits) (void)std::strtoull(v.c_str(), nullptr, 10);
        if (!digits || errno == ERANGE) return "expected an integer in [0, 2^64 - 1], got \"" + v + "\"";
        return decimal_integer_error(v);  // no leading zeros (CLI11 would read them as octal)
      },
      "UINT64");
}

/// The generation flags of a subcommand, and the CLI11 options that set them.
struct GenOptions {
  GenFlags f;
  std::vector<std::pair<CLI::Option*, bool*>> opts;
  std::vector<std::string> seqlens_q_text, seqlens_k_text;

  void add(CLI::App* app) {
    std::string presets = "Preset (sizes and id pattern; explicit flags override it). One of:";
    for (const auto& [name, desc] : preset_list()) presets += "\n  " + name + ": " + desc;
    reg(app->add_option("--preset", f.preset, presets)->default_str("small"), &f.has_preset);
    reg(app->add_option("--batch,-b", f.batch, "B: batch size (BSHD) / number of sequences")->check(decimal_int()), &f.has_batch);
    reg(app->add_option("--s-q", f.s_q, "S_q: query tokens per sequence (also sets S_kv unless --s-kv)")->check(decimal_int()), &f.has_s_q);
    reg(app->add_option("--s-kv", f.s_kv, "S_kv: key tokens per sequence")->check(decimal_int()), &f.has_s_kv);
    reg(app->add_option("--heads", f.heads, "H: index heads (multiple of 8, 8..128)")->check(decimal_int()), &f.has_heads);
    reg(app->add_option("--head-dim", f.head_dim, "D: head dimension (64 or 128)")->check(decimal_int()), &f.has_head_dim);
    reg(app->add_option("--topk", f.topk, "selected keys per query row")->check(decimal_int()), &f.has_topk);
    reg(app->add_option("--ids", f.ids, "id pattern: causal (true top-k over the keys a bottom-right-aligned causal mask shows row t: s <= t + S_kv - S_q) or permutation")
            ->check(one_of({"causal", "permutation"})),
        &f.has_ids);
    reg(app->add_option("--id-mode", f.id_mode, "ids local to their sequence or global flat rows")
            ->check(one_of({"local", "global"})),
        &f.has_id_mode);
    reg(app->add_option("--layout", f.layout, "bshd (fixed lengths) or thd (packed varlen)")
            ->check(one_of({"bshd", "thd"})),
        &f.has_layout);
    // Taken as text and split here (parse_lengths), so that empty items are errors, not dropped or zeros.
    // Given once, like every other option: a second --seqlens-q is an error (finish),
    // not appended to the first (CLI11's default for a list).
    reg(add_list_once(app, "--seqlens-q", seqlens_q_text, seqlens_q_given, "THD query lengths, e.g. 1,37,300"),
        &f.has_seqlens_q);
    reg(add_list_once(app, "--seqlens-k", seqlens_k_text, seqlens_k_given, "THD key lengths (default: the query lengths)"),
        &f.has_seqlens_k);
    reg(app->add_option("--seed", f.seed, "random seed")->default_str("0")->check(uint64_text()), &f.has_seed);
    static bool unused = false;
    reg(app->add_flag("--weights-f32", f.weights_f32, "weights in f32 instead of bf16"), &unused);
  }
  void reg(CLI::Option* o, bool* has) { opts.emplace_back(o, has); }
  int seqlens_q_given = 0, seqlens_k_given = 0;  // occurrences on the command line
  /// A list option whose callback runs at each occurrence (CLI11 trigger_on_parse),
  /// counting them: the items of one occurrence, in one token or several, are the list.
  static CLI::Option* add_list_once(CLI::App* app, const std::string& name, std::vector<std::string>& text, int& given,
                                    const std::string& help) {
    return app
        ->add_option_function<std::vector<std::string>>(
            name,
            [&text, &given](const std::vector<std::string>& items) {
              text = items;
              ++given;
            },
            help)
        ->type_name("INT,...")
        ->trigger_on_parse();
  }
  /// Sets the has_* fields and parses the lengths; returns the first given flag's name (or "").
  /// Raises dsaib::Error(invalid_argument) for malformed lengths and for a list given twice.
  std::string finish() {
    std::string first;
    for (auto& [o, has] : opts) {
      *has = o->count() > 0;
      if (*has && first.empty()) first = o->get_name();
    }
    for (const auto& [name, given] : {std::pair{"--seqlens-q", seqlens_q_given}, std::pair{"--seqlens-k", seqlens_k_given}}) {
      if (given > 1) {
        throw Error(ErrorCode::invalid_argument, name,
                    std::string(name) + ": expected once (one comma-separated list), got " + std::to_string(given) + " times");
      }
    }
    if (f.has_seqlens_q) f.seqlens_q = parse_lengths("--seqlens-q", seqlens_q_text);
    if (f.has_seqlens_k) f.seqlens_k = parse_lengths("--seqlens-k", seqlens_k_text);
    return first;
  }
};

/// Scalars that override the problem's metadata.
struct ScalarOverrides {
  float sm_scale = 0, loss_coeff = 1, grad_loss = 1;
  int64_t normalization_count = 0;
  CLI::Option *o_sm = nullptr, *o_lc = nullptr, *o_gl = nullptr, *o_n = nullptr;

  void add(CLI::App* app, bool overriding) {
    const std::string suffix = overriding ? " (overrides the file's metadata)" : "";
    // 0 is refused: the generator reads 0 as "1/sqrt(D)", a backward override would
    // take it literally (all-zero gradients); one meaning, none surprising.
    o_sm = app->add_option("--sm-scale", sm_scale, "logit scale (default 1/sqrt(D))" + suffix)
               ->check(finite_float(/*nonzero=*/true));
    o_lc = app->add_option("--loss-coeff", loss_coeff, "loss weight (default 1)" + suffix)->check(finite_float());
    o_gl = app->add_option("--grad-loss", grad_loss, "upstream gradient of the loss (default 1)" + suffix)
               ->check(finite_float());
    o_n = app->add_option("--normalization-count", normalization_count,
                          "N in c = grad_loss*loss_coeff/N (default 0: the number of query tokens)" + suffix)
              ->check(int_range(0));
  }
  bool any_given() const { return o_sm->count() || o_lc->count() || o_gl->count() || o_n->count(); }
  void apply_to_flags(GenFlags& f) const {
    if (o_sm->count()) {
      f.sm_scale = sm_scale;
      f.has_sm_scale = true;
    }
    if (o_lc->count()) f.loss_coeff = loss_coeff;
    if (o_gl->count()) f.grad_loss = grad_loss;
    if (o_n->count()) f.normalization_count = normalization_count;
  }
  /// The problem-file metadata keys these flags override (not read from the file).
  std::set<std::string> overridden_keys() const {
    std::set<std::string> k;
    if (o_sm->count()) k.insert("sm_scale");
    if (o_lc->count()) k.insert("loss_coeff");
    if (o_gl->count()) k.insert("grad_loss");
    if (o_n->count()) k.insert("normalization_count");
    return k;
  }
  void apply_to_options(IndexerBackwardOptions& o) const {
    if (o_sm->count()) o.sm_scale = sm_scale;
    if (o_lc->count()) o.loss_coeff = loss_coeff;
    if (o_gl->count()) o.grad_loss = grad_loss;
    if (o_n->count()) o.normalization_count = normalization_count;
  }
};


std::string sci(double v, int digits = 2) {
  if (std::isnan(v)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*e", digits, v);
  return buf;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string human_bytes(double b) {
  if (b < 1024 * 1024) return fixed(b / 1024, 1) + " KiB";
  if (b < 1024.0 * 1024 * 1024) return fixed(b / (1024 * 1024), 1) + " MiB";
  return fixed(b / (1024.0 * 1024 * 1024), 2) + " GiB";
}

std::string tensor_dtypes(const Problem& p) {
  return std::string("index_q ") + dtype_name(p.tensors.at("index_q").dtype) + ", weights " +
         dtype_name(p.tensors.at("weights").dtype) + ", index_k " + dtype_name(p.tensors.at("index_k").dtype);
}

int64_t count_nonfinite(const HostTensor& t) {
  int64_t n = 0;
  for (int64_t i = 0; i < t.numel(); ++i) n += std::isfinite(element(t, i)) ? 0 : 1;
  return n;
}

void print_metrics(std::ostream& s, const std::vector<Metric>& metrics) {
  char head[160];
  std::snprintf(head, sizeof head, "    %-16s %-20s %-5s %-9s %-9s %-9s %-6s %s\n", "output", "shape", "dtype", "rel_rms",
                "max_abs", "ref_rms", "tol", "result");
  s << head;
  for (const Metric& m : metrics) {
    char line[256];
    std::snprintf(line, sizeof line, "    %-16s %-20s %-5s %-9s %-9s %-9s %-6s %s", m.name.c_str(),
                  shape_string(m.shape).c_str(), dtype_name(m.dtype), sci(m.rel_rms).c_str(), sci(m.max_abs).c_str(),
                  sci(m.ref_rms).c_str(), sci(m.tol, 0).c_str(), m.pass ? "PASS" : "FAIL");
    s << line;
    if (m.nonfinite > 0) s << " (" << m.nonfinite << " non-finite elements)";
    if (m.ref_nonfinite > 0) s << " (" << m.ref_nonfinite << " non-finite reference elements)";
    s << "\n";
  }
}

// ---------------------------------------------------------------- generate

/// Fails (io_error / invalid_argument, naming --out) before any work when `out` cannot
/// be written as a file: a directory, a FIFO, device or socket, a missing or unwritable
/// parent directory, or the same file as the input `in` (which would be overwritten).
void check_out_path(const std::string& out_given, const std::string& in) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // The file that will really be written: a symbolic link's final target (the
  // writer follows the chain), so its directory is the one that must be writable.
  std::string out;
  try {
    out = detail::resolve_output_path(out_given);
  } catch (const Error& e) {
    throw Error(ErrorCode::io_error, "--out", std::string("--out: ") + e.what());
  }
  const std::string shown = out == out_given ? out : out_given + " (-> " + out + ")";
  if (fs::is_directory(out, ec)) {
    throw Error(ErrorCode::io_error, "--out", "--out: expected a file name, got \"" + shown + "\", a directory");
  }
  // An existing FIFO, device or socket would be replaced by the file, not
  // written to: refused up front (write_safetensors refuses it too).
  if (const char* kind = detail::non_regular_file_kind(out)) {
    throw Error(ErrorCode::io_error, "--out",
                "--out: expected a regular file or a new path, got \"" + shown + "\", " + kind);
  }
  const fs::path parent = fs::path(out).has_parent_path() ? fs::path(out).parent_path() : fs::path(".");
  if (!fs::is_directory(parent, ec) || ::access(parent.c_str(), W_OK) != 0) {
    throw Error(ErrorCode::io_error, "--out",
                "--out: expected a file in an existing writable directory, got \"" + shown + "\"");
  }
  if (!in.empty()) {
    bool same = false;
    if (fs::exists(out, ec) && fs::exists(in, ec)) {
      same = fs::equivalent(out, in, ec) && !ec;
    } else {
      const fs::path a = fs::weakly_canonical(out, ec), b = fs::weakly_canonical(in, ec);
      same = !ec && a == b;
    }
    if (same) {
      throw Error(ErrorCode::invalid_argument, "--out",
                  "--out: expected a file other than the input (--in " + in + "), got \"" + shown +
                      "\" (the gradients would overwrite the problem)");
    }
  }
}

int cmd_generate(GenOptions& gen, const ScalarOverrides& sc, const std::string& out, int32_t threads) {
  gen.finish();
  check_out_path(out, "");
  sc.apply_to_flags(gen.f);
  const auto t0 = std::chrono::steady_clock::now();
  Problem p = generate(gen.f, threads);
  const Geometry g = analyze_problem(p);
  save_problem(out, p);
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(out, ec);
  std::cout << "wrote " << out << " (" << human_bytes(ec ? 0.0 : double(bytes)) << ") in "
            << human_seconds(seconds_since(t0)) << "\n"
            << "  problem     " << g.summary() << "\n"
            << "  ids         " << p.info["ids"] << ", valid slots " << g.valid_slots << " of "
            << g.num_q_rows * g.topk << "\n"
            << "  dtypes      " << tensor_dtypes(p) << "\n"
            << "  scalars     sm_scale=" << format_float(p.options.sm_scale)
            << " loss_coeff=" << format_float(p.options.loss_coeff)
            << " grad_loss=" << format_float(p.options.grad_loss) << "\n";
  return 0;
}

// ---------------------------------------------------------------- backward

struct BackwardArgs {
  std::string in, out, backend = "auto", out_dtype = "bf16", verify = "auto";
  int64_t sample_rows = 64;
  int32_t threads = 0;
  int warmup = -1, repeat = 1;
  bool json = false, strict = false, deterministic = false;
  std::string a_operand = "auto";
};

/// "attn_score: 3 (first at element 17), ..." for the floating-point inputs holding NaN/inf; "" if none.
/// What every backend (and the fp64 reference) does with NaN/inf in each input
/// (g_i = -c * max(T_i, eps) * [P_i >= eps], G = sum_i g_i, gs_i = g_i - P_i * G;
/// a slot and head contribute only where the logit x = q_h . k > 0).
std::string nonfinite_effect(const std::string& name) {
  if (name == "index_q" || name == "index_k") {
    return name + ": a logit q.k that comes out NaN (or -inf) counts as not positive (relu(NaN) = 0, [NaN > 0] = 0), "
                  "so that slot and head drop out silently, not propagated; a logit of +inf (e.g. +inf in index_k "
                  "against a positive query entry) propagates";
  }
  if (name == "weights") return "weights: propagate into d_index_q and d_index_k of the row's selected keys";
  if (name == "attn_score") {
    return "attn_score: at a valid slot whose index_score is >= eps (e^-100), NaN and +inf propagate through "
           "G = sum g_i into every gradient of that query row, -inf is clamped to eps (max(T, eps)); where "
           "index_score < eps it is ignored";
  }
  if (name == "index_score") {
    return "index_score: at a valid slot, NaN/inf propagates into that slot's gradients (a NaN one also drops its "
           "attn_score term, as NaN >= eps is false)";
  }
  return name + ": propagate";
}

/// Why outputs are not finite, as far as the run can tell: non-finite inputs; a
/// reference at or beyond the output dtype's rounding-to-infinity point
/// (overflow, as IEEE rounding gives); or, with finite inputs and a reference in
/// range, unexplained (in the sampled rows only, with --verify sample; none
/// computed with --verify none).
std::string nonfinite_outputs_cause(const std::string& input_nonfinite, const Verification& v) {
  if (!input_nonfinite.empty()) return "the inputs hold non-finite values: " + input_nonfinite;
  std::string overflowed;
  for (const Metric& m : v.metrics) {
    // Halfway between the largest finite value and the next power of two: from
    // there on, round-to-nearest-even gives infinity (bf16 0x7f7f8000, f32 2^128 (1 - 2^-25)).
    const double to_infinity = m.dtype == DType::bf16 ? 3.39617752923046e38 : 3.4028235677973366e38;
    if (m.nonfinite > 0 && m.ref_max_abs >= to_infinity) {
      overflowed += (overflowed.empty() ? "" : ", ") + m.name + " (|ref| up to " + format_float(m.ref_max_abs) + ")";
    }
  }
  if (!overflowed.empty()) return "the fp64 reference exceeds the output dtype's range: overflow in " + overflowed;
  if (v.mode == "none") return "the inputs are all finite; --verify tells an overflow of the output dtype from a defect";
  if (v.mode == "sample") {
    return "the inputs are all finite and the sampled rows' fp64 reference is within the output dtype's range; "
           "--verify all tells an overflow in other rows from a defect";
  }
  return "the inputs are all finite and the fp64 reference is within the output dtype's range: unexpected";
}

/// attn_score and index_score count only at valid slots, index_k only in key rows
/// that a valid slot selects (the backends never read the others, so NaN padding
/// there is fine).
std::string nonfinite_inputs(const Problem& p, const Geometry& g,
                             std::vector<std::pair<std::string, int64_t>>* found = nullptr) {
  std::string out;
  const HostTensor& ids = p.tensors.at("topk_indices");
  for (const char* name : {"index_q", "weights", "index_k", "attn_score", "index_score"}) {
    const auto it = p.tensors.find(name);
    if (it == p.tensors.end()) continue;
    const HostTensor& t = it->second;
    if (t.dtype == DType::i32) continue;
    const bool per_slot = std::string(name) == "attn_score" || std::string(name) == "index_score";
    const bool per_key_row = std::string(name) == "index_k" && g.head_dim > 0;
    // elements per query row of index_q / weights (0: not a per-query-row tensor)
    const int64_t per_q_row = std::string(name) == "index_q" ? g.heads * g.head_dim
                              : std::string(name) == "weights" ? g.heads
                                                               : 0;
    int64_t count = 0, first = -1;
    for (int64_t e = 0; e < t.numel(); ++e) {
      if (per_slot && g.topk > 0) {  // same (rows, topk) layout as topk_indices, contiguous
        int64_t b, tq;
        g.q_row_coords(e / g.topk, &b, &tq);
        if (g.key_row(b, ids.data<int32_t>()[e]) < 0) continue;
      }
      if (per_key_row && !g.key_selected[static_cast<size_t>(e / g.head_dim)]) continue;  // a key row no valid slot selects
      // a query row without a valid slot: its index_q and weights are never used (gradients 0)
      if (per_q_row > 0 && !g.q_row_used[static_cast<size_t>(e / per_q_row)]) continue;
      if (!std::isfinite(element(t, e))) {
        if (first < 0) first = e;
        ++count;
      }
    }
    if (count > 0) {
      if (found) found->emplace_back(name, count);
      out += (out.empty() ? "" : ", ") + std::string(name) + ": " + std::to_string(count) + " (first at element " +
             std::to_string(first) + ")";
    }
  }
  return out;
}

int cmd_backward(GenOptions& gen, const ScalarOverrides& sc, const BackwardArgs& a) {
  const std::string first_gen_flag = gen.finish();
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

  // Inputs.
  Problem p;
  if (!a.in.empty()) {
    log_stage("reading " + a.in + " ...");
    try {
      p = load_problem(a.in, sc.overridden_keys());
    } catch (const Error& e) {  // name the flag the file came from (the message names the file)
      const std::string msg = e.what();
      if (msg.rfind("--in", 0) == 0) throw;
      throw Error(e.code(), "--in", "--in: " + msg);
    }
  } else {
    sc.apply_to_flags(gen.f);
    p = generate(gen.f, threads);
  }
  sc.apply_to_options(p.options);
  p.options.strict_indices = a.strict;
  p.options.deterministic = a.deterministic;
  (void)parse_a_operand_precision(a.a_operand, &p.options.a_operand_precision);  // checked by CLI11
  Geometry g;
  try {
    g = analyze_problem(p);
  } catch (const Error& e) {
    if (a.in.empty()) throw;
    throw Error(e.code(), e.argument(), a.in + ": " + e.what());
  }

  // Backend.
  Backend backend = Backend::cpu;
  std::string backend_note;
  if (a.backend == "cuda") {
    backend = Backend::cuda;
    backend_note = "requested";
  } else if (a.backend == "cpu") {
    backend_note = "requested";
  } else {
    if (cuda_backend_available()) {
      backend = Backend::cuda;
      backend_note = "auto: CUDA device found";
    } else {
      backend_note = "auto: " + cuda_unavailable_reason();
    }
  }
  const std::string backend_line = std::string(backend_name(backend)) + " (" + backend_note + ")";
  log_stage("backend: " + backend_line);
  const DType out_dtype = a.out_dtype == "f32" ? DType::f32 : DType::bf16;
  const int warmup = a.warmup >= 0 ? a.warmup : (backend == Backend::cuda ? 1 : 0);
  // The a-operand precision of the dK/dQ GEMMs (IndexerBackwardOptions::a_operand_precision):
  // auto is bf16x2 when an output is f32, else bf16; the cpu backend ignores it (fp64 throughout).
  std::string a_operand_used, a_operand_line;
  if (backend == Backend::cuda) {
    AOperandPrecision used = p.options.a_operand_precision;
    if (used == AOperandPrecision::automatic) {
      used = out_dtype == DType::f32 ? AOperandPrecision::bf16x2 : AOperandPrecision::bf16;
      a_operand_line = std::string(a_operand_precision_name(used)) + " (auto: " + dtype_name(out_dtype) + " outputs)";
    } else {
      a_operand_line = std::string(a_operand_precision_name(used)) + " (requested)";
    }
    a_operand_used = a_operand_precision_name(used);
  } else {
    a_operand_used = a_operand_line = "ignored (cpu backend)";
  }
  log_stage("problem: " + g.summary());
  std::vector<std::pair<std::string, int64_t>> nonfinite_found;
  const std::string input_nonfinite = nonfinite_inputs(p, g, &nonfinite_found);
  if (!input_nonfinite.empty()) {
    std::string effects;
    for (const auto& nf : nonfinite_found) effects += "; " + nonfinite_effect(nf.first);
    log_stage("warning: non-finite input values (" + input_nonfinite + ")" + effects +
              "; attn_score and index_score at invalid slots (id -1 or out of range) are ignored");
  }

  RunResult r = backend == Backend::cuda ? run_cuda(p, g, out_dtype, warmup, a.repeat)
                                         : run_cpu(p, g, out_dtype, threads, warmup, a.repeat);
  const double mean = std::accumulate(r.seconds.begin(), r.seconds.end(), 0.0) / r.seconds.size();
  const double best = *std::min_element(r.seconds.begin(), r.seconds.end());
  const double flops = 6.0 * double(g.heads) * double(g.head_dim) * double(g.valid_slots);

  // Verification.
  std::string mode = a.verify;
  if (mode == "auto") {
    const double cost = double(g.num_q_rows) * double(g.topk) * double(g.heads) * double(g.head_dim);
    mode = cost <= 4.5e9 ? "all" : "sample";
  }
  Verification v;
  if (mode == "all") v = verify_all(p, g, r, threads);
  else if (mode == "sample") v = verify_sampled(p, g, r, a.sample_rows, gen.f.seed, threads);
  else v.mode = "none";
  // Gradients stored in the input file by its producer (scripts/dump_torch_step.py --with-grads):
  // compared too, unless scalar overrides changed the problem.
  std::vector<Metric> stored;
  if (!a.in.empty() && !sc.any_given()) stored = verify_against_stored(p, r, "torch_");
  // Outputs were poisoned with NaN: every element must come back finite (checked even without --verify).
  const int64_t nonfinite = count_nonfinite(r.d_index_q) + count_nonfinite(r.d_weights) + count_nonfinite(r.d_index_k);
  // Non-finite inputs make the gradients meaningless even where they match the
  // reference (a NaN logit drops out silently): never a PASS.
  const bool pass = v.pass() && nonfinite == 0 && input_nonfinite.empty() &&
                    std::all_of(stored.begin(), stored.end(), [](const Metric& m) { return m.pass; });

  // Gradients to a file.
  if (!a.out.empty()) {
    std::map<std::string, std::string> meta = {
        {"backend", backend_name(backend)},
        {"out_dtype", dtype_name(out_dtype)},
        {"layout", layout_name(p.options.layout)},
        {"id_mode", id_mode_name(p.options.id_mode)},
        {"sm_scale", format_float(p.options.sm_scale)},
        {"loss_coeff", format_float(p.options.loss_coeff)},
        {"grad_loss", format_float(p.options.grad_loss)},
        {"normalization_count",
         std::to_string(g.normalization_count)},  // N as the library uses it (max(rows, 1) when 0)
        {"input", utf8_text(p.origin)},
        {"backward_seconds", format_float(mean)},
    };
    write_safetensors(a.out, {{"d_index_q", r.d_index_q}, {"d_weights", r.d_weights}, {"d_index_k", r.d_index_k}},
                      meta);
    log_stage("wrote " + a.out);
  }

  const int64_t n_norm = g.normalization_count;  // as the library uses it: max(rows, 1) when 0
  // No query rows: d_index_q / d_weights are empty and d_index_k is all zero, so a PASS
  // compares nothing but that; say so rather than print a bare PASS.
  const bool no_query_rows = r.d_index_q.numel() == 0;
  const std::string verdict = !input_nonfinite.empty() ? "FAIL (non-finite inputs: " + input_nonfinite + ")"
                              : !pass                   ? "FAIL"
                              : v.mode != "none"        ? (no_query_rows ? "PASS (no query rows: empty d_index_q / "
                                                                          "d_weights, d_index_k all zero)"
                                                                        : "PASS")
                              : !stored.empty()         ? "PASS (stored gradients only)"
                                                        : "OK (not verified)";
  if (a.json) {
    nlohmann::ordered_json j;
    j["problem"] = {{"layout", layout_name(g.layout)},
                    {"id_mode", id_mode_name(g.id_mode)},
                    {"batch", g.batch},
                    {"s_q", g.s_q},
                    {"s_kv", g.s_kv},
                    {"num_q_rows", g.num_q_rows},
                    {"num_k_rows", g.num_k_rows},
                    {"heads", g.heads},
                    {"head_dim", g.head_dim},
                    {"topk", g.topk},
                    {"valid_slots", g.valid_slots},
                    {"q_lengths", g.q_len},
                    {"k_lengths", g.k_len},
                    {"dtypes", tensor_dtypes(p)}};
    j["input"] = p.origin;
    j["scalars"] = {{"sm_scale", p.options.sm_scale},
                    {"loss_coeff", p.options.loss_coeff},
                    {"grad_loss", p.options.grad_loss},
                    {"normalization_count", n_norm}};
    j["backend"] = {{"name", backend_name(backend)}, {"why", backend_note}, {"device", r.device}};
    j["out_dtype"] = dtype_name(out_dtype);
    j["a_operand"] = {{"requested", a_operand_precision_name(p.options.a_operand_precision)}, {"used", a_operand_used}};
    j["deterministic"] = p.options.deterministic;
    j["timing"] = {{"timer", r.timer},
                   {"warmup", warmup},
                   {"seconds", r.seconds},
                   {"mean_seconds", mean},
                   {"min_seconds", best},
                   {"per_query_row_seconds", g.num_q_rows > 0 ? mean / double(g.num_q_rows) : 0.0},
                   {"useful_gflop", flops * 1e-9},
                   {"gflop_per_second", mean > 0 ? flops * 1e-9 / mean : 0.0}};
    nlohmann::ordered_json outs = nlohmann::ordered_json::array();
    for (const Metric& m : v.metrics) {
      outs.push_back({{"name", m.name},
                      {"shape", m.shape},
                      {"dtype", dtype_name(m.dtype)},
                      {"compared", m.compared},
                      {"nonfinite", m.nonfinite},
                      {"ref_nonfinite", m.ref_nonfinite},
                      {"rel_rms", m.rel_rms},
                      {"max_abs", m.max_abs},
                      {"ref_rms", m.ref_rms},
                      {"ref_max_abs", m.ref_max_abs},
                      {"tolerance", m.tol},
                      {"pass", m.pass}});
    }
    nlohmann::ordered_json st = nlohmann::ordered_json::array();
    for (const Metric& m : stored) {
      st.push_back({{"name", m.name}, {"rel_rms", m.rel_rms}, {"max_abs", m.max_abs}, {"tolerance", m.tol}, {"pass", m.pass}});
    }
    j["verify"] = {{"mode", v.mode},
                   {"stored_gradients", st},
                   {"seconds", v.seconds},
                   {"sampled_q_rows", v.q_rows.size()},
                   {"sampled_k_rows", v.k_rows.size()},
                   {"outputs", outs}};
    nlohmann::ordered_json nfi = nlohmann::ordered_json::object();
    for (const auto& nf : nonfinite_found) nfi[nf.first] = nf.second;
    j["nonfinite_inputs"] = nfi;
    j["nonfinite_outputs"] = nonfinite;
    j["output_file"] = a.out;
    j["pass"] = pass;  // no check failed (true also when nothing was checked: see "result")
    j["result"] = verdict;  // the text report's verdict
    std::cout << report_json_text(j) << std::endl;
    return pass ? 0 : kExitFail;
  }

  std::ostringstream s;
  s << "dsa-indexer-bwd backward\n"
    << "  problem     " << g.summary() << "\n"
    << "  input       " << p.origin << "\n"
    << "  dtypes      " << tensor_dtypes(p) << " -> outputs " << dtype_name(out_dtype) << "\n"
    << "  valid slots " << g.valid_slots << " of " << g.num_q_rows * g.topk << " ("
    << fixed(g.num_q_rows * g.topk > 0 ? 100.0 * double(g.valid_slots) / double(g.num_q_rows * g.topk) : 0.0, 1)
    << "%)\n"
    << "  scalars     sm_scale=" << format_float(p.options.sm_scale) << " loss_coeff=" << format_float(p.options.loss_coeff)
    << " grad_loss=" << format_float(p.options.grad_loss) << " N=" << n_norm << "\n"
    << "  backend     " << backend_line << ", " << r.device << "\n"
    << "  a operand   " << a_operand_line << "\n";
  if (p.options.deterministic) {
    s << "  determinism "
      << (backend == Backend::cuda ? "d_index_k in 64-bit fixed point (--deterministic)"
                                   : "requested (--deterministic; the cpu backend always is)")
      << "\n";
  }
  s << "  backward    " << human_seconds(mean);
  if (r.seconds.size() > 1) s << " mean, " << human_seconds(best) << " min of " << r.seconds.size() << " runs";
  s << " (" << human_seconds(g.num_q_rows > 0 ? mean / double(g.num_q_rows) : 0.0) << " per query row, "
    << fixed(mean > 0 ? flops * 1e-9 / mean : 0.0, 2) << " GFLOP/s useful; " << r.timer << ")\n";
  if (v.mode == "none") {
    s << "  verify      none\n";
  } else {
    s << "  verify      " << (v.mode == "all" ? "all rows" : std::to_string(v.q_rows.size()) + " sampled query rows, " +
                                                             std::to_string(v.k_rows.size()) + " sampled key rows")
      << " vs the fp64 reference (" << human_seconds(v.seconds) << ")\n";
    print_metrics(s, v.metrics);
  }
  if (!stored.empty()) {
    s << "  stored      vs the gradients stored in the input file (torch_*: torch autograd)\n";
    print_metrics(s, stored);
  } else if (!a.in.empty() && sc.any_given() &&
             (p.tensors.count("torch_d_index_q") || p.tensors.count("torch_d_weights") || p.tensors.count("torch_d_index_k"))) {
    s << "  stored      not compared: the scalar flags changed the problem the stored torch_* gradients are for\n";
  }
  if (nonfinite > 0) {
    s << "  non-finite  " << nonfinite << " output elements are NaN/inf (" << nonfinite_outputs_cause(input_nonfinite, v)
      << ")\n";
  }
  if (!a.out.empty()) s << "  output      " << a.out << "\n";
  s << "  result      " << verdict << "\n";
  std::cout << s.str() << std::flush;
  return pass ? 0 : kExitFail;
}

int run_main(int argc, char** argv) {
  CLI::App app{
      "dsa-indexer-bwd: backward of the DeepSeek Sparse Attention lightning indexer.\n"
      "Generates problems, runs the backward on the cpu or cuda backend and verifies it\n"
      "against the fp64 reference, benchmarks it against the hardware floor.\n"
      "Exit status: 0 ok/PASS, 1 FAIL, 2 error."};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "help of every subcommand");

  // generate
  CLI::App* gen_cmd = app.add_subcommand("generate", "write a realistic problem (inputs) to a safetensors file");
  GenOptions gen_g;
  ScalarOverrides gen_sc;
  std::string gen_out;
  int32_t gen_threads = 0;
  gen_cmd->add_option("--out,-o", gen_out, "output .safetensors file")->required()->check(nonempty_path());
  gen_g.add(gen_cmd);
  gen_sc.add(gen_cmd, false);
  gen_cmd->add_option("--threads", gen_threads, "worker threads (0: all cores)")->check(int_range(0, 1 << 20));

  // backward
  CLI::App* bwd_cmd = app.add_subcommand("backward", "run, time and verify the backward of a problem");
  GenOptions bwd_g;
  ScalarOverrides bwd_sc;
  BackwardArgs a;
  bwd_cmd->add_option("--in,-i", a.in, "input problem file (else one is generated from the generation flags)")
      ->check(nonempty_path());
  bwd_cmd->add_option("--out,-o", a.out, "write d_index_q, d_weights, d_index_k to this .safetensors file")
      ->check(nonempty_path());
  bwd_g.add(bwd_cmd);
  bwd_sc.add(bwd_cmd, true);
  bwd_cmd->add_option("--backend", a.backend, "auto (cuda if available, else cpu), cpu or cuda")
      ->check(one_of({"auto", "cpu", "cuda"}))
      ->default_str("auto");
  bwd_cmd->add_option("--out-dtype", a.out_dtype, "dtype of the gradients")
      ->check(one_of({"bf16", "f32"}))
      ->default_str("bf16");
  bwd_cmd->add_option("--verify", a.verify,
                      "compare with the fp64 reference: all rows, sampled rows, none, or auto (all for problems up to "
                      "about twice the small preset, else sample)")
      ->check(one_of({"auto", "none", "all", "sample"}))
      ->default_str("auto");
  bwd_cmd->add_option("--sample-rows", a.sample_rows, "query rows and key rows checked by --verify sample")
      ->check(int_range(1))
      ->default_str("64");
  bwd_cmd->add_option("--threads", a.threads, "worker threads of the cpu backend, reference and generator (0: all cores)")
      ->check(int_range(0, 1 << 20));
  bwd_cmd->add_option("--warmup", a.warmup, "untimed runs before the timed ones (default: 1 on cuda, 0 on cpu)")
      ->check(int_range(0, 100000));
  bwd_cmd->add_option("--repeat", a.repeat, "timed runs (>= 1)")->check(int_range(1, 1000000))->default_str("1");
  bwd_cmd->add_flag("--strict-indices", a.strict, "raise an error on the first invalid (out of range) id");
  bwd_cmd->add_flag("--deterministic", a.deterministic,
                    "bitwise reproducible d_index_k on cuda (64-bit fixed-point accumulation, docs/api.md "
                    "\"Determinism\"); the cpu backend always is");
  bwd_cmd->add_option("--a-operand", a.a_operand,
                      "cuda: precision of the a operand of the dK/dQ GEMMs: auto (bf16x2 if an output is f32, else bf16), "
                      "bf16x2 or bf16 (docs/api.md)")
      ->check(one_of({"auto", "bf16x2", "bf16"}))
      ->default_str("auto");
  bwd_cmd->add_flag("--json", a.json, "print the report as JSON on stdout (an error too: {\"error\": {code, argument, message}, \"result\": \"ERROR\"})");

  // bench
  CLI::App* bench_cmd = app.add_subcommand(
      "bench", "benchmark the cuda backend against the hardware floor measured in the same run (needs a GPU)");
  BenchArgs ba;
  // --seq and --ids are taken as text and split in the bench branch below
  // (split_list_items), so that an empty item ("4096,,16384") is an error, not dropped.
  std::vector<std::string> bench_seq_text, bench_ids_text;
  CLI::Option* bench_seq_opt =
      bench_cmd->add_option("--seq", bench_seq_text, "S_q = S_kv of each case, a comma-separated list")
          ->type_name("INT,...")
          ->default_str("4096,16384,65536");
  CLI::Option* bench_ids_opt =
      bench_cmd->add_option("--ids", bench_ids_text,
                            "id patterns, a comma-separated list: causal (row t selects min(t+1, topk) "
                            "keys of 0..t), random (topk keys of the whole sequence); ids ascending "
                            "within a row, or in a random order with causal-shuffled / random-shuffled "
                            "(as a top-k by score returns them)")
          ->type_name("PATTERN,...")
          ->default_str("causal,random");
  bench_cmd->add_option("--heads", ba.heads, "H: index heads (multiple of 8, 8..128)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            if (std::string e = decimal_integer_error(v); !e.empty()) return e;
            const long long h = std::strtoll(v.c_str(), nullptr, 10);
            const bool ok = h >= 8 && h <= 128 && h % 8 == 0;
            return ok ? std::string() : "expected a multiple of 8 in [8, 128], got " + v;
          },
          "INT (multiple of 8, 8..128)"))
      ->default_str("64");
  bench_cmd->add_option("--dim", ba.dim, "D: head dimension")->check(CLI::IsMember({64, 128}))->default_str("128");
  bench_cmd->add_option("--topk", ba.topk, "selected keys per query row")->check(int_range(1))->default_str("2048");
  bench_cmd->add_option("--a-operand", ba.a_operand,
                        "precision of the a operand of the dK/dQ GEMMs: auto (bf16 for these bf16 outputs), bf16x2 or bf16")
      ->check(one_of({"auto", "bf16x2", "bf16"}))
      ->default_str("auto");
  bench_cmd->add_flag("--deterministic", ba.deterministic,
                      "time the deterministic mode (fixed-point d_index_k, docs/api.md \"Determinism\")");
  bench_cmd->add_option("--batch,-b", ba.batch, "B: batch size")->check(int_range(1))->default_str("1");
  bench_cmd->add_option("--iters", ba.iters, "timed launches per case and per floor micro-benchmark")
      ->check(int_range(1, 100000))
      ->default_str("20");
  bench_cmd->add_option("--warmup", ba.warmup, "untimed launches first")->check(int_range(0, 100000))->default_str("3");
  bench_cmd->add_option("--input-sets", ba.input_sets,
                        "input sets rotated over (0: automatic, enough to exceed twice the L2 and at least 2; "
                        "1: no rotation)")
      ->check(int_range(0, 1024))
      ->default_str("0");
  bench_cmd->add_option("--seed", ba.seed, "generator seed (a case uses seed + S)")->default_str("1234")->check(uint64_text());
  bench_cmd->add_option("--json", ba.json, "also write the report as JSON to FILE (- : JSON on stdout, the table on "
                                           "stderr); on an error FILE is not written (exit 2, the message on "
                                           "stderr; with - an error object on stdout)")
      ->type_name("FILE")
      ->check(nonempty_path());
  bench_cmd->add_option("--sustained-ms", ba.sustained_ms,
                        "after each case's timed launches, about MS ms of launches back to back (no spin, no "
                        "host wait; 20 to 20000 launches): the steady state under the GPU's power limit (0: skip)")
      ->check(millis_range(600000))
      ->default_str("2000");
  bench_cmd->add_flag("--no-floor", ba.no_floor, "skip the floor micro-benchmarks (only the ratio to 278 ns)");
  bench_cmd->footer(std::string(
      "Runs on the GPU (compute capability 9.0, cuda backend), in this order:\n"
      "  1. floor micro-benchmarks (unless --no-floor): the fp32 scatter-add rate into a table\n"
      "     of each case's dK size (B*S_kv*D*4 bytes; rows of D floats added into random rows,\n"
      "     1 GiB per launch; float4 atomicAdd, scalar atomicAdd and cp.reduce.async.bulk, the\n"
      "     best counts), the same float4 adds each after reading its row's bf16 key from a key\n"
      "     table of as many rows (the key-read rate: the op's K gathers beside its dK reduce),\n"
      "     and the cuBLAS bf16 GEMM rate (8192^3, fp32 compute);\n"
      "  2. the op (dK zeroing, fused kernel, bf16 cast) for every --ids x --seq case: --warmup\n"
      "     untimed launches, then --iters launches, each timed with CUDA events after a 3 ms\n"
      "     GPU spin (the events bracket GPU time, not the host's calls); input sets\n"
      "     rotated so consecutive launches touch different memory, beyond L2;\n"
      "  3. then (--sustained-ms, default 2000) launches back to back for that long, an event\n"
      "     between each two and no spin: the GPU's power management has the whole run to act\n"
      "     (on the H200 the op reaches the 700 W limit and the SM clock drops), so this is\n"
      "     what a training loop gets; sustained ns/row = the median of the run's second half.\n"
      "Per case: ns per query row (median over the launches; min-max), TFLOP/s (6*H*D FLOP\n"
      "per valid slot), dK-reduce GB/s (D*4 B per valid slot), the floor, and the ratios:\n"
      "  floor ns/row = max(topk*D*4 B / scatter rate at this case's dK size,\n"
      "                     6*H*D*topk FLOP / GEMM rate)\n"
      "  traffic floor ns/row = topk*D*4 B / key-read rate (the K reads and dK reduces alone:\n"
      "                     a reference, not the floor)\n"
      "  xfloor = ns/row / floor;  xtraffic = ns/row / traffic floor;  x278 = ns/row / 278 ns\n"
      "  (the fixed floor of the project's design notes, h200-facts.md, outside this\n"
      "  repository: H64 D128 topk 2048, dK in L2, 3.77 TB/s).\n"
      "The JSON states every formula and the rotation, and holds each launch's time.\n"
      "Exit status: 0 ok, 1 a floor micro-benchmark failed its correctness check, 2 error\n"
      "(bad usage; no GPU or a build without CUDA: \"bench needs the CUDA backend and a GPU\").\n"));

  // presets
  CLI::App* presets_cmd = app.add_subcommand("presets", "list the presets");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help and friends
    // No subcommand matched: name the word that came and the ones expected
    // (CLI11 says only "A subcommand is required").
    std::string message = e.what();
    if (app.get_subcommands().empty()) {  // the subcommands that were parsed: none
      std::string names;
      for (const CLI::App* sub : app.get_subcommands({})) names += (names.empty() ? "" : ", ") + sub->get_name();
      message = argc >= 2 && argv[1][0] != '-'
                    ? "unknown subcommand '" + std::string(argv[1]) + "': expected one of " + names
                    : "a subcommand is required: one of " + names;
    }
    // `backward --json` reports a command-line error as JSON too (the flag is
    // known from the words even though the parse failed).
    if (argc >= 2 && std::string(argv[1]) == "backward") {
      for (int i = 2; i < argc; ++i) g_json_errors = g_json_errors || std::string(argv[i]) == "--json";
    }
    // `bench --json -` likewise (its JSON goes to stdout).
    if (argc >= 2 && std::string(argv[1]) == "bench") {
      for (int i = 2; i < argc; ++i) {
        const std::string w = argv[i];
        g_json_errors = g_json_errors || w == "--json=-" || (w == "--json" && i + 1 < argc && std::string(argv[i + 1]) == "-");
      }
    }
    // One error style for the whole tool: "dsa-indexer-bwd: error (...): message".
    // The argument is the flag the message starts with ("--sm-scale: expected ..."), if any.
    const size_t colon = message.find(": ");
    const std::string flag = message.rfind("-", 0) == 0 && colon != std::string::npos &&
                                     message.find(' ') > colon
                                 ? message.substr(0, colon)
                                 : std::string();
    report_error("invalid_argument", flag, message);
    std::cerr << "Run with --help or --help-all for more information.\n";
    return kExitError;
  }

  if (*presets_cmd) {
    for (const auto& [name, desc] : preset_list()) std::cout << name << ": " << desc << "\n";
    return 0;
  }
  if (*gen_cmd) return cmd_generate(gen_g, gen_sc, gen_out, gen_threads);
  if (*bench_cmd) {
    // `bench --json -` puts its JSON on stdout: an error is a JSON object there too, as for backward --json.
    g_json_errors = ba.json == "-";
    if (bench_seq_opt->count() > 0) ba.seqs = parse_int_list("--seq", bench_seq_text, 1, "sequence lengths >= 1");
    if (bench_ids_opt->count() > 0) {
      // Checked here too (run_bench checks again), so a build without CUDA reports bad usage as such.
      ba.ids = split_list_items("--ids", bench_ids_text, "id patterns");
      for (const std::string& id : ba.ids) {
        dsaib::bench::IdPattern parsed;
        if (!dsaib::bench::parse_id_pattern(id, &parsed)) {
          throw Error(ErrorCode::invalid_argument, "--ids",
                      "--ids: expected one of " + dsaib::bench::id_pattern_list() + ", got \"" + id + "\"");
        }
      }
    }
    for (int i = 0; i < argc; ++i) ba.command_line += (i ? " " : "") + std::string(argv[i]);
    return run_bench(ba);
  }
  g_json_errors = a.json;
  return cmd_backward(bwd_g, bwd_sc, a);
}

}  // namespace
}  // namespace dsaib::cli

int main(int argc, char** argv) {
  try {
    return dsaib::cli::run_main(argc, argv);
  } catch (const dsaib::Error& e) {
    dsaib::cli::report_error(dsaib::error_code_name(e.code()), e.argument(), e.what());
  } catch (const std::bad_alloc&) {
    dsaib::cli::report_error(dsaib::error_code_name(dsaib::ErrorCode::out_of_memory), "",
                             "out of host memory (the problem's tensors, e.g. B*S_q*topk ids and scores, "
                             "do not fit: reduce --batch/--s-q/--s-kv/--topk; the cpu backend's own working set "
                             "reports itself as out_of_memory with what it needed)");
  } catch (const std::exception& e) {
    dsaib::cli::report_error("", "", e.what());
  } catch (...) {
    dsaib::cli::report_error("", "", "unknown exception");
  }
  return dsaib::cli::kExitError;
}
