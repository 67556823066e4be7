// Flags shared by the subcommands of dsaib: CLI11 validators whose
// messages read "--flag: expected ..., got VALUE", the generation flags, the
// scalar overrides, and the up-front check of an output path.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cli.hpp"

namespace dsaib::cli {

// ---------------------------------------------------------------- validators

/// "" if `v` is a decimal integer in [lo, hi], else why not (CLI11 prefixes the
/// flag): "expected >= 1, got 0", "expected an integer in [0, 100000], got -5",
/// "expected an integer >= 1, got \"x\"". Text beyond int64 is out of range and
/// quoted as typed, never clamped. Every integer flag is checked by it.
std::string integer_flag_error(const std::string& v, int64_t lo, int64_t hi);

/// A decimal integer in [lo, hi] (integer_flag_error).
CLI::Validator int_range(int64_t lo, int64_t hi = std::numeric_limits<int64_t>::max());
/// H: a multiple of 8 in [8, 128].
CLI::Validator heads_value();
/// D: 64 or 128.
CLI::Validator head_dim_value();
/// One of `choices` (exact text): "expected one of a, b, got \"x\"" otherwise.
CLI::Validator one_of(std::vector<std::string> choices);
/// A file name that is not empty ("--out ''" would otherwise mean "no output").
CLI::Validator nonempty_path();
/// A decimal number of milliseconds in [0, hi] (the bench tools' rule).
CLI::Validator millis_range(double hi);
/// A finite floating-point value (fp32 range); with `nonzero`, not 0 either.
CLI::Validator finite_float(bool nonzero = false);
/// An unsigned 64-bit integer written in decimal digits only.
CLI::Validator uint64_text();

/// --l2-hints auto|on|off, --start-stagger auto|off and --forward-fusion auto|off
/// (IndexerOptions::l2_hints, ::start_stagger, ::forward_fusion) on `cmd`,
/// into the three words.
void add_launch_option_flags(CLI::App* cmd, std::string* l2_hints, std::string* start_stagger,
                             std::string* forward_fusion);

// ---------------------------------------------------------------- flag groups

/// The generation flags of a subcommand, and the CLI11 options that set them.
class GenOptions {
 public:
  GenFlags f;

  void add(CLI::App* app);
  /// Sets the has_* fields and parses the lengths; returns the first given flag's name (or "").
  /// Raises dsaib::Error(invalid_argument) for malformed lengths and for a list given twice.
  std::string finish();

 private:
  void reg(CLI::Option* o, bool* has) { opts_.emplace_back(o, has); }

  std::vector<std::pair<CLI::Option*, bool*>> opts_;
  std::vector<std::string> seqlens_q_text_, seqlens_k_text_;
  int seqlens_q_given_ = 0, seqlens_k_given_ = 0;  // occurrences on the command line
  bool weights_f32_given_ = false;
};

/// Scalars that override the problem's metadata.
class ScalarOverrides {
 public:
  void add(CLI::App* app, bool overriding);
  bool any_given() const;
  void apply_to_flags(GenFlags& f) const;
  /// The problem-file metadata keys these flags override (not read from the file).
  std::set<std::string> overridden_keys() const;
  void apply_to_options(IndexerOptions& o) const;

 private:
  float sm_scale_ = 0, loss_coeff_ = 1, grad_loss_ = 1;
  int64_t normalization_count_ = 0;
  CLI::Option *o_sm_ = nullptr, *o_lc_ = nullptr, *o_gl_ = nullptr, *o_n_ = nullptr;
};

// ---------------------------------------------------------------- paths

/// Fails (io_error / invalid_argument, naming --out) before any work when `out` cannot
/// be written as a file: a directory, a FIFO, device or socket, a missing or unwritable
/// parent directory, or the same file as the input `in` (which would be overwritten).
void check_out_path(const std::string& out, const std::string& in);

}  // namespace dsaib::cli
