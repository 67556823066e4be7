// The bench's flags and their checks, shared by `dsaib bench` and the dsaib-bench
// binary (bench/dsaib_bench.cpp); the run is run_bench (bench.cpp, cuda builds; builds
// without CUDA report that the bench needs it).
#include <cmath>

#include "bench_names.hpp"
#include "commands.hpp"

namespace dsaib::cli {
namespace {

constexpr const char* kBenchFooter =
    "Runs on the GPU (compute capability 9.0, cuda backend), in this order:\n"
    "  1. the floors the cases need (unless --no-floor), each the best of several ways\n"
    "     measured in this run, each way checked for correctness:\n"
    "     - backward, step, one-call: the fp32 scatter-add rate into a table of each case's\n"
    "       dK size (B*S_kv*D*4 bytes; rows of D floats added into random rows, 1 GiB per\n"
    "       launch; float4 atomicAdd, scalar atomicAdd and cp.reduce.async.bulk, the best\n"
    "       counts), the same float4 adds each after reading its row's bf16 key from a key\n"
    "       table of as many rows (the key-read rate: the op's K gathers beside its dK\n"
    "       reduce), and the cuBLAS bf16 GEMM rate (8192^3, fp32 compute, the best of\n"
    "       four operand layouts);\n"
    "     - forward, step, one-call, target: the key gather of each case's ids pattern, S,\n"
    "       D (target: Dqk) and topk: every valid slot's bf16 key row read into the SM by\n"
    "       16-byte vector loads per lane, by a cp.async ring and by cp.async.bulk per row on\n"
    "       an mbarrier, each at a few depths and CTA counts, inputs rotated beyond the L2;\n"
    "       the fastest counts, and the report names it;\n"
    "     - target: the cuBLAS bf16 GEMM rate at the target's shape (Hq x topk x Dqk,\n"
    "       batched, no gather);\n"
    "     - topk: the cuBLAS bf16 GEMM rate (8192^3, the best of four operand layouts);\n"
    "  2. every --op x --ids x --seq case (the target: x --shapes x --target-lse; topk: --ranges x\n"
    "     --topk-shapes x --seq, B 1): --warmup untimed\n"
    "     launches, then --iters launches, each timed with CUDA events after a 3 ms GPU\n"
    "     spin (the events bracket GPU time, not the host's calls); input sets rotated so\n"
    "     consecutive launches touch different memory, beyond L2;\n"
    "  3. then (--sustained-ms, default 2000) launches back to back for that long, an event\n"
    "     between each two and no spin: the GPU's power management has the whole run to act\n"
    "     (on the H200 the op reaches the 700 W limit and the SM clock drops), so this is\n"
    "     what a training loop gets; sustained ns/row = the median of the run's second half.\n"
    "Per case: ns per query row (median over the launches; min-max), TFLOP/s (useful FLOP\n"
    "per valid slot: 6*H*D backward, 2*H*D forward and target, 8*H*D step and one-call),\n"
    "the floor, the bound (which term of the floor is the larger) and xfloor = ns/row / floor:\n"
    "  backward:        floor ns/row = max(topk*D*4 B / scatter rate at this case's dK size,\n"
    "                                      6*H*D*topk FLOP / GEMM rate)\n"
    "  forward, target: floor ns/row = max(gather ns/row, 2*H*D*slots FLOP / GEMM rate)\n"
    "  step, one-call:  floor ns/row = max(topk*D*4 B / scatter rate,\n"
    "                                      8*H*D*topk FLOP / GEMM rate, gather ns/row)\n"
    "  topk:            floor ns/row = visible keys per row * H*D*2 FLOP / GEMM rate\n"
    "                   (e4m3 inputs: the e4m3 GEMM rate)\n"
    "                   (ns/row over the S_q query rows; after the timed launches, one call\n"
    "                   with the library's own workspace gives its extra memory: the\n"
    "                   workspace size, the memory pool's peak and the cudaMemGetInfo delta)\n"
    "and for the backward also xtraffic = ns/row / traffic floor (topk*D*4 B / key-read rate:\n"
    "the K reads and dK reduces alone, a reference, not the floor) and x278 = ns/row / 278 ns\n"
    "(a fixed reference floor for H64 D128 topk 2048: the dK reduce of 2048 rows of 128\n"
    "fp32 values at 3.77 TB/s, with dK in L2).\n"
    "The JSON states every formula and the rotation, every floor way's time, and each\n"
    "launch's time. For paired A/B runs of two builds (scripts/ab_compare.py) pass\n"
    "--no-floor --sustained-ms 0.\n"
    "Exit status: 0 ok, 1 a floor's correctness check failed, 2 error (bad usage; no GPU\n"
    "or a build without CUDA: \"bench needs the CUDA backend and a GPU\").\n";

/// MiB of L2 set aside for persisting lines: a decimal number in [0, 1 TiB] (the driver caps it).
CLI::Validator mib_range() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        double x = 0;
        if (!dsaib::bench::parse_bounded_decimal(v, 0.0, 1048576.0, &x)) {
          return "expected a number of MiB from 0 to 1048576, got \"" + v + "\"";
        }
        return std::string();
      },
      "MIB");
}

/// "AxB" as two decimal integers without leading zeros; false for anything else.
bool parse_pair(const std::string& item, int64_t* a, int64_t* b) {
  const size_t x = item.find('x');
  return x != std::string::npos && parse_decimal_int64(item.substr(0, x), a) &&
         parse_decimal_int64(item.substr(x + 1), b) && !has_leading_zero(item.substr(0, x)) &&
         !has_leading_zero(item.substr(x + 1));
}

/// "HqxDqk" (e.g. 128x576): Hq a multiple of 16 up to 128, Dqk a multiple of 64 up to 576.
std::pair<int64_t, int64_t> parse_shape(const std::string& item) {
  int64_t h = 0, d = 0;
  if (!parse_pair(item, &h, &d)) {
    throw Error(ErrorCode::invalid_argument, "--shapes", "--shapes: expected HqxDqk (e.g. 128x576), got \"" + item + "\"");
  }
  if (h < 16 || h > 128 || h % 16 != 0 || d < 64 || d > 576 || d % 64 != 0) {
    throw Error(ErrorCode::invalid_argument, "--shapes",
                "--shapes: expected Hq a multiple of 16 up to 128 and Dqk a multiple of 64 up to 576, got \"" + item +
                    "\"");
  }
  return {h, d};
}

/// "HxD" (e.g. 64x128): the cuda top-k's H a multiple of 8 up to 128, D 64 or 128.
std::pair<int64_t, int64_t> parse_topk_shape(const std::string& item) {
  int64_t h = 0, d = 0;
  if (!parse_pair(item, &h, &d)) {
    throw Error(ErrorCode::invalid_argument, "--topk-shapes",
                "--topk-shapes: expected HxD (e.g. 64x128), got \"" + item + "\"");
  }
  if (h < 8 || h > 128 || h % 8 != 0 || (d != 64 && d != 128)) {
    throw Error(ErrorCode::invalid_argument, "--topk-shapes",
                "--topk-shapes: expected H a multiple of 8 up to 128 and D 64 or 128, got \"" + item + "\"");
  }
  return {h, d};
}

}  // namespace

void add_bench_flags(CLI::App* cmd, BenchFlags& f) {
  BenchArgs& a = f.args;
  f.op_opt = cmd->add_option("--op", f.op_text,
                             "what the cases time, a comma-separated list: backward (indexer_backward given P), "
                             "forward (indexer_kl_forward), step (indexer_kl_forward, then the P-free "
                             "indexer_backward: an autograd loss's training step), one-call "
                             "(indexer_kl_loss_and_grad), target (attention_target, at --shapes), topk "
                             "(indexer_topk, at --ranges and --topk-shapes); each against its own floor")
                 ->type_name("OP,...")
                 ->default_str("backward");
  f.seq_opt = cmd->add_option("--seq", f.seq_text, "S_q = S_kv of each case, a comma-separated list")
                  ->type_name("INT,...")
                  ->default_str("4096,16384,65536");
  f.ids_opt = cmd->add_option("--ids", f.ids_text,
                              "id patterns, a comma-separated list: causal (row t selects min(t+1, topk) "
                              "keys of 0..t), random (topk keys of the whole sequence); ids ascending "
                              "within a row, or in a random order with causal-shuffled / random-shuffled "
                              "(as a top-k by score returns them; not for the target)")
                  ->type_name("PATTERN,...")
                  ->default_str("causal,random");
  cmd->add_option("--heads", a.heads, "H: index heads (multiple of 8, 8..128)")->check(heads_value())->default_str("64");
  cmd->add_option("--dim", a.dim, "D: head dimension")->check(head_dim_value())->default_str("128");
  cmd->add_option("--topk", a.topk, "selected keys per query row")->check(int_range(1))->default_str("2048");
  f.shapes_opt = cmd->add_option("--shapes", f.shapes_text,
                                 "target: query heads x latent width of each case, a comma-separated list of "
                                 "HqxDqk (Hq a multiple of 16 up to 128, Dqk a multiple of 64 up to 576)")
                     ->type_name("HqxDqk,...")
                     ->default_str("128x576,64x192");
  f.topk_shapes_opt = cmd->add_option("--topk-shapes", f.topk_shapes_text,
                                      "topk: index heads x head dim of each case, a comma-separated list of HxD "
                                      "(H a multiple of 8 up to 128, D 64 or 128)")
                          ->type_name("HxD,...")
                          ->default_str("64x128,32x128");
  f.ranges_opt = cmd->add_option("--ranges", f.ranges_text,
                                 "topk: the keys each query row sees, a comma-separated list (instead of --ids): "
                                 "causal (S query rows, row t sees keys 0..t), cp-shard (a context-parallel shard: "
                                 "the S/2 rows of the sequence's second half against all S keys, given as "
                                 "starts/ends)")
                     ->type_name("RANGES,...")
                     ->default_str("causal,cp-shard");
  f.topk_dtype_opt = cmd->add_option("--topk-dtype", f.topk_dtype_text,
                                     "topk: the dtype of index_q and index_k, a comma-separated list: bf16, e4m3 "
                                     "(float8 with per-token scales, D 128; its floor takes the e4m3 GEMM rate)")
                         ->type_name("DTYPE,...")
                         ->default_str("bf16");
  cmd->add_option("--lse-base", a.lse_base, "target: the base of the lse input (natural, or base2 as FlashMLA writes it)")
      ->check(one_of({"natural", "base2"}))
      ->default_str("natural");
  cmd->add_flag("--unnormalized", a.unnormalized, "target: the unnormalised sum U (normalize = false)");
  f.target_lse_opt = cmd->add_option("--target-lse", f.target_lse_text,
                                     "target: the lse of each case, a comma-separated list: given (an lse input), "
                                     "absent (no lse: each head's softmax over the selected keys, which the kernel "
                                     "sweeps the row's keys twice for)")
                         ->type_name("LSE,...")
                         ->default_str("given");
  cmd->add_flag("--index-score", a.index_score, "forward: also write P (the (B, S, topk) f32 index_score)");
  cmd->add_flag("--topk-logits", a.topk_logits,
                "forward, one-call: take the selected keys' logits as the top-k writes them (topk_logits), so the "
                "forward gathers no key and runs no GEMM; the other ops ignore it");
  cmd->add_option("--a-operand", a.a_operand,
                  "precision of the a operand of the dK/dQ GEMMs: auto (bf16 for these bf16 outputs), bf16x2 or bf16")
      ->check(one_of({"auto", "bf16x2", "bf16"}))
      ->default_str("auto");
  add_launch_option_flags(cmd, &a.l2_hints, &a.start_stagger, &a.forward_fusion);
  cmd->add_flag("--deterministic", a.deterministic,
                "time the deterministic mode (fixed-point d_index_k, docs/api.md \"Determinism\")");
  cmd->add_option("--batch,-b", a.batch, "B: batch size (the target: 1)")->check(int_range(1))->default_str("1");
  cmd->add_option("--iters", a.iters, "timed launches per case and per floor measurement")
      ->check(int_range(1, 100000))
      ->default_str("20");
  cmd->add_option("--warmup", a.warmup, "untimed launches first")->check(int_range(0, 100000))->default_str("3");
  cmd->add_option("--input-sets", a.input_sets,
                  "input sets rotated over (0: automatic, enough to exceed twice the L2 and at least 2; "
                  "1: no rotation)")
      ->check(int_range(0, 1024))
      ->default_str("0");
  cmd->add_option("--seed", a.seed, "generator seed (a case uses seed + S)")->default_str("1234")->check(uint64_text());
  cmd->add_option("--json", a.json,
                  "also write the report as JSON to FILE (- : JSON on stdout, the table on stderr); on an error FILE "
                  "is not written (exit 2, the message on stderr; with - an error object on stdout)")
      ->type_name("FILE")
      ->check(nonempty_path());
  cmd->add_option("--sustained-ms", a.sustained_ms,
                  "after each case's timed launches, about MS ms of launches back to back (no spin, no "
                  "host wait; 20 to 20000 launches): the steady state under the GPU's power limit (0: skip)")
      ->check(millis_range(600000))
      ->default_str("2000");
  cmd->add_option("--l2-set-aside-mib", a.l2_set_aside_mib,
                  "set this process's L2 set-aside for persisting lines (cudaLimitPersistingL2CacheSize, a "
                  "context-wide limit that belongs to the application, never to the library) before the runs; the "
                  "driver rounds and caps it, and the value in force is reported (default: left as it is)")
      ->check(mib_range());
  cmd->add_flag("--no-floor", a.no_floor, "skip the floors (the backward keeps only the ratio to 278 ns)");
  cmd->footer(kBenchFooter);
}

bool bench_json_requested(const std::vector<std::string>& words) {
  for (size_t i = 0; i < words.size(); ++i) {
    if (words[i] == "--json=-" || (words[i] == "--json" && i + 1 < words.size() && words[i + 1] == "-")) return true;
  }
  return false;
}

namespace {

/// The sizes of every case, named by their flag: rows and topk are int32 in the
/// library's ids and cu_seqlens, so --batch, each --seq and --topk, and the
/// rows of a case (--batch x --seq), are at most 2^31 - 1. Every tensor's
/// element count then fits in 64 bits.
void check_bench_sizes(const BenchArgs& a) {
  const auto at_most_rows = [](const char* flag, int64_t v, const std::string& what) {
    if (v > kMaxRows) {
      throw Error(ErrorCode::invalid_argument, flag,
                  std::string(flag) + ": expected " + what + " of at most 2147483647 (2^31 - 1: ids and cu_seqlens are "
                  "int32), got " + std::to_string(v));
    }
  };
  at_most_rows("--batch", a.batch, "a batch");
  at_most_rows("--topk", a.topk, "a topk");
  for (const int64_t s : a.seqs) {
    at_most_rows("--seq", s, "sequence lengths");
    if (a.batch > kMaxRows / s) {
      throw Error(ErrorCode::invalid_argument, "--seq",
                  "--seq: expected --batch x --seq of at most 2147483647 rows (2^31 - 1), got " +
                      std::to_string(a.batch) + " x " + std::to_string(s));
    }
  }
}

/// `tokens` split as `flag`'s list (split_list_items), each word checked by `known`: an
/// unknown word is an invalid_argument naming the flag, "FLAG: expected EXPECTED, got "WORD"".
template <class Known>
std::vector<std::string> split_known_words(const char* flag, const std::vector<std::string>& tokens,
                                           const char* what, const std::string& expected, Known known) {
  std::vector<std::string> words = split_list_items(flag, tokens, what);
  for (const std::string& w : words) {
    if (!known(w)) {
      throw Error(ErrorCode::invalid_argument, flag,
                  std::string(flag) + ": expected " + expected + ", got \"" + w + "\"");
    }
  }
  return words;
}

}  // namespace

int run_bench_flags(BenchFlags& f, const std::string& command_line) {
  BenchArgs& a = f.args;
  namespace b = dsaib::bench;
  // Checked here (run_bench checks the cases again), so a build without CUDA reports bad usage as such.
  if (f.op_opt->count() > 0) {
    a.ops = split_known_words("--op", f.op_text, "ops", "one of " + b::bench_op_list(), [](const std::string& w) {
      b::BenchOp parsed;
      return b::parse_bench_op(w, &parsed);
    });
  }
  if (f.seq_opt->count() > 0) a.seqs = parse_int_list("--seq", f.seq_text, 1, "sequence lengths >= 1");
  if (f.ids_opt->count() > 0) {
    a.ids = split_known_words("--ids", f.ids_text, "id patterns", "one of " + b::id_pattern_list(),
                              [](const std::string& w) {
                                b::IdPattern parsed;
                                return b::parse_id_pattern(w, &parsed);
                              });
  }
  if (f.shapes_opt->count() > 0) {
    a.shapes.clear();
    for (const std::string& item : split_list_items("--shapes", f.shapes_text, "shapes")) a.shapes.push_back(parse_shape(item));
  }
  if (f.topk_shapes_opt->count() > 0) {
    a.topk_shapes.clear();
    for (const std::string& item : split_list_items("--topk-shapes", f.topk_shapes_text, "shapes")) {
      a.topk_shapes.push_back(parse_topk_shape(item));
    }
  }
  if (f.ranges_opt->count() > 0) {
    a.ranges = split_known_words("--ranges", f.ranges_text, "ranges", "one of " + b::topk_ranges_list(),
                                 [](const std::string& w) {
                                   b::TopkRanges parsed;
                                   return b::parse_topk_ranges(w, &parsed);
                                 });
  }
  if (f.topk_dtype_opt->count() > 0) {
    a.topk_dtypes = split_known_words("--topk-dtype", f.topk_dtype_text, "dtypes", "bf16 or e4m3",
                                      [](const std::string& w) {
                                        bool e4m3 = false;
                                        return b::parse_topk_dtype(w, &e4m3);
                                      });
  }
  if (f.target_lse_opt->count() > 0) {
    a.target_lse = split_known_words("--target-lse", f.target_lse_text, "lse words", "given or absent",
                                     [](const std::string& w) {
                                       bool given = true;
                                       return b::parse_target_lse(w, &given);
                                     });
  }
  check_bench_sizes(a);
  a.sustained_ms += 0.0;  // -0 -> 0
  a.command_line = command_line;
  return run_bench(a);
}

BenchCommand::BenchCommand(CLI::App& app) {
  cmd_ = app.add_subcommand(
      "bench", "benchmark the cuda backend's ops against their hardware floors measured in the same run (needs a GPU)");
  add_bench_flags(cmd_, flags_);
}

}  // namespace dsaib::cli
