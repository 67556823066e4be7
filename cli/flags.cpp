// Flags shared by the subcommands (flags.hpp).
#include "flags.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include <unistd.h>

#include "bench_names.hpp"
#include "io/output_path.hpp"

namespace dsaib::cli {

// ---------------------------------------------------------------- validators

std::string integer_flag_error(const std::string& v, int64_t lo, int64_t hi) {
  const bool unbounded = hi == std::numeric_limits<int64_t>::max();
  const std::string at_least = ">= " + std::to_string(lo);
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (has_leading_zero(v)) return decimal_integer_error(v);
  int64_t x = 0;
  if (!parse_decimal_int64(v, &x)) {
    if (is_digits(v, !v.empty() && v[0] == '-' ? 1 : 0)) {  // an integer, beyond int64
      return "expected an integer in " + range + ", got " + v;
    }
    return "expected an integer " + (unbounded ? at_least : "in " + range) + ", got \"" + v + "\"";
  }
  if (x < lo || x > hi) return "expected " + (unbounded ? at_least : "an integer in " + range) + ", got " + v;
  return std::string();
}

CLI::Validator int_range(int64_t lo, int64_t hi) {
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  const std::string name = hi == std::numeric_limits<int64_t>::max() ? "INT >= " + std::to_string(lo) : "INT in " + range;
  return CLI::Validator([lo, hi](std::string& v) { return integer_flag_error(v, lo, hi); }, name);
}

CLI::Validator heads_value() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        if (std::string e = decimal_integer_error(v); !e.empty()) return e;
        int64_t h = 0;
        const bool ok = parse_decimal_int64(v, &h) && h >= 8 && h <= 128 && h % 8 == 0;
        return ok ? std::string() : "expected a multiple of 8 in [8, 128], got " + v;
      },
      "INT (multiple of 8, 8..128)");
}

CLI::Validator head_dim_value() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        if (std::string e = decimal_integer_error(v); !e.empty()) return e;
        int64_t d = 0;
        const bool ok = parse_decimal_int64(v, &d) && (d == 64 || d == 128);
        return ok ? std::string() : "expected 64 or 128, got " + v;
      },
      "{64,128}");
}

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

CLI::Validator nonempty_path() {
  return CLI::Validator([](std::string& v) -> std::string { return v.empty() ? "expected a file name, got \"\"" : ""; },
                        "FILE");
}

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

CLI::Validator finite_float(bool nonzero) {
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

void add_launch_option_flags(CLI::App* cmd, std::string* l2_hints, std::string* start_stagger,
                             std::string* forward_fusion) {
  cmd->add_option("--l2-hints", *l2_hints,
                  "cuda: L2 eviction-policy hints on the d_index_k reductions: auto (the launch decides from the "
                  "key table against the L2), on or off (docs/api.md)")
      ->check(one_of({"auto", "on", "off"}))
      ->default_str("auto");
  cmd->add_option("--start-stagger", *start_stagger,
                  "cuda: delayed start of the persistent CTAs that run one task fewer: auto or off (docs/api.md)")
      ->check(one_of({"auto", "off"}))
      ->default_str("auto");
  cmd->add_option("--forward-fusion", *forward_fusion,
                  "cuda, loss and gradients in one call: auto (the loss forward runs inside the backward kernel "
                  "where that kernel applies) or off (two kernels) (docs/api.md)")
      ->check(one_of({"auto", "off"}))
      ->default_str("auto");
}

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

// ---------------------------------------------------------------- GenOptions

namespace {

/// A list option whose callback runs at each occurrence (CLI11 trigger_on_parse),
/// counting them: the items of one occurrence, in one token or several, are the list.
CLI::Option* add_list_once(CLI::App* app, const std::string& name, std::vector<std::string>& text, int& given,
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

}  // namespace

void GenOptions::add(CLI::App* app) {
  std::string presets = "Preset (sizes and id pattern; explicit flags override it). One of:";
  for (const auto& [name, desc] : preset_list()) presets += "\n  " + name + ": " + desc;
  reg(app->add_option("--preset", f.preset, presets)->default_str("small"), &f.has_preset);
  reg(app->add_option("--batch,-b", f.batch, "B: batch size (BSHD) / number of sequences")->check(int_range(0)),
      &f.has_batch);
  reg(app->add_option("--s-q", f.s_q, "S_q: query tokens per sequence (also sets S_kv unless --s-kv)")
          ->check(int_range(0)),
      &f.has_s_q);
  reg(app->add_option("--s-kv", f.s_kv, "S_kv: key tokens per sequence")->check(int_range(0)), &f.has_s_kv);
  reg(app->add_option("--heads", f.heads, "H: index heads (multiple of 8, 8..128)")->check(heads_value()), &f.has_heads);
  reg(app->add_option("--head-dim", f.head_dim, "D: head dimension (64 or 128)")->check(head_dim_value()),
      &f.has_head_dim);
  reg(app->add_option("--topk", f.topk, "selected keys per query row")->check(int_range(1)), &f.has_topk);
  reg(app->add_option("--ids", f.ids,
                      "id pattern: causal (true top-k over the keys a bottom-right-aligned causal mask shows row t: "
                      "s <= t + S_kv - S_q) or permutation")
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
  reg(add_list_once(app, "--seqlens-q", seqlens_q_text_, seqlens_q_given_, "THD query lengths, e.g. 1,37,300"),
      &f.has_seqlens_q);
  reg(add_list_once(app, "--seqlens-k", seqlens_k_text_, seqlens_k_given_, "THD key lengths (default: the query lengths)"),
      &f.has_seqlens_k);
  reg(app->add_option("--seed", f.seed, "random seed")->default_str("0")->check(uint64_text()), &f.has_seed);
  reg(app->add_flag("--weights-f32", f.weights_f32, "weights in f32 instead of bf16"), &weights_f32_given_);
}

std::string GenOptions::finish() {
  std::string first;
  for (auto& [o, has] : opts_) {
    *has = o->count() > 0;
    if (*has && first.empty()) first = o->get_name();
  }
  for (const auto& [name, given] :
       {std::pair{"--seqlens-q", seqlens_q_given_}, std::pair{"--seqlens-k", seqlens_k_given_}}) {
    if (given > 1) {
      throw Error(ErrorCode::invalid_argument, name,
                  std::string(name) + ": expected once (one comma-separated list), got " + std::to_string(given) +
                      " times");
    }
  }
  if (f.has_seqlens_q) f.seqlens_q = parse_lengths("--seqlens-q", seqlens_q_text_);
  if (f.has_seqlens_k) f.seqlens_k = parse_lengths("--seqlens-k", seqlens_k_text_);
  return first;
}

// ---------------------------------------------------------------- ScalarOverrides

void ScalarOverrides::add(CLI::App* app, bool overriding) {
  const std::string suffix = overriding ? " (overrides the file's metadata)" : "";
  // 0 is refused: the generator reads 0 as "1/sqrt(D)", a backward override would
  // take it literally (all-zero gradients); one meaning, none surprising.
  o_sm_ = app->add_option("--sm-scale", sm_scale_, "logit scale (default 1/sqrt(D))" + suffix)
              ->check(finite_float(/*nonzero=*/true));
  o_lc_ = app->add_option("--loss-coeff", loss_coeff_, "loss weight (default 1)" + suffix)->check(finite_float());
  o_gl_ = app->add_option("--grad-loss", grad_loss_, "upstream gradient of the loss (default 1)" + suffix)
              ->check(finite_float());
  o_n_ = app->add_option("--normalization-count", normalization_count_,
                         "N in c = grad_loss*loss_coeff/N (default 0: the number of query tokens)" + suffix)
             ->check(int_range(0));
}

bool ScalarOverrides::any_given() const { return o_sm_->count() || o_lc_->count() || o_gl_->count() || o_n_->count(); }

void ScalarOverrides::apply_to_flags(GenFlags& f) const {
  if (o_sm_->count()) {
    f.sm_scale = sm_scale_;
    f.has_sm_scale = true;
  }
  if (o_lc_->count()) f.loss_coeff = loss_coeff_;
  if (o_gl_->count()) f.grad_loss = grad_loss_;
  if (o_n_->count()) f.normalization_count = normalization_count_;
}

std::set<std::string> ScalarOverrides::overridden_keys() const {
  std::set<std::string> k;
  if (o_sm_->count()) k.insert("sm_scale");
  if (o_lc_->count()) k.insert("loss_coeff");
  if (o_gl_->count()) k.insert("grad_loss");
  if (o_n_->count()) k.insert("normalization_count");
  return k;
}

void ScalarOverrides::apply_to_options(IndexerOptions& o) const {
  if (o_sm_->count()) o.sm_scale = sm_scale_;
  if (o_lc_->count()) o.loss_coeff = loss_coeff_;
  if (o_gl_->count()) o.grad_loss = grad_loss_;
  if (o_n_->count()) o.normalization_count = normalization_count_;
}

// ---------------------------------------------------------------- paths

namespace {

/// Whether `out` and `in` name the same file (existing or not).
bool same_file(const std::string& out, const std::string& in) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(out, ec) && fs::exists(in, ec)) return fs::equivalent(out, in, ec) && !ec;
  const fs::path a = fs::weakly_canonical(out, ec), b = fs::weakly_canonical(in, ec);
  return !ec && a == b;
}

}  // namespace

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
  if (!in.empty() && same_file(out, in)) {
    throw Error(ErrorCode::invalid_argument, "--out",
                "--out: expected a file other than the input (--in " + in + "), got \"" + shown +
                    "\" (the gradients would overwrite the problem)");
  }
}

}  // namespace dsaib::cli
