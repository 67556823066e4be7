// `dsaib bench`: its flags and their checks; the run is run_bench (bench.cpp,
// cuda builds; builds without CUDA report that bench needs it).
#include "bench_names.hpp"
#include "commands.hpp"

namespace dsaib::cli {
namespace {

constexpr const char* kBenchFooter =
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
    "  (a fixed reference floor for H64 D128 topk 2048: the dK reduce of 2048 rows of 128\n"
    "  fp32 values at 3.77 TB/s, with dK in L2).\n"
    "The JSON states every formula and the rotation, and holds each launch's time.\n"
    "Exit status: 0 ok, 1 a floor micro-benchmark failed its correctness check, 2 error\n"
    "(bad usage; no GPU or a build without CUDA: \"bench needs the CUDA backend and a GPU\").\n";

}  // namespace

BenchCommand::BenchCommand(CLI::App& app) {
  cmd_ = app.add_subcommand(
      "bench", "benchmark the cuda backend against the hardware floor measured in the same run (needs a GPU)");
  BenchArgs& a = args_;
  seq_opt_ = cmd_->add_option("--seq", seq_text_, "S_q = S_kv of each case, a comma-separated list")
                 ->type_name("INT,...")
                 ->default_str("4096,16384,65536");
  ids_opt_ = cmd_->add_option("--ids", ids_text_,
                              "id patterns, a comma-separated list: causal (row t selects min(t+1, topk) "
                              "keys of 0..t), random (topk keys of the whole sequence); ids ascending "
                              "within a row, or in a random order with causal-shuffled / random-shuffled "
                              "(as a top-k by score returns them)")
                 ->type_name("PATTERN,...")
                 ->default_str("causal,random");
  cmd_->add_option("--heads", a.heads, "H: index heads (multiple of 8, 8..128)")->check(heads_value())->default_str("64");
  cmd_->add_option("--dim", a.dim, "D: head dimension")->check(head_dim_value())->default_str("128");
  cmd_->add_option("--topk", a.topk, "selected keys per query row")->check(int_range(1))->default_str("2048");
  cmd_->add_option("--op", a.op,
                   "what each case times: backward (indexer_backward given P), forward (indexer_kl_forward), step "
                   "(indexer_kl_forward, then the P-free indexer_backward: an autograd loss's training step) or "
                   "one-call (indexer_kl_loss_and_grad); the floors and ratios are the backward's")
      ->check(one_of({"backward", "forward", "step", "one-call"}))
      ->default_str("backward");
  cmd_->add_option("--a-operand", a.a_operand,
                   "precision of the a operand of the dK/dQ GEMMs: auto (bf16 for these bf16 outputs), bf16x2 or bf16")
      ->check(one_of({"auto", "bf16x2", "bf16"}))
      ->default_str("auto");
  add_launch_option_flags(cmd_, &a.l2_hints, &a.start_stagger, &a.forward_fusion);
  cmd_->add_flag("--deterministic", a.deterministic,
                 "time the deterministic mode (fixed-point d_index_k, docs/api.md \"Determinism\")");
  cmd_->add_option("--batch,-b", a.batch, "B: batch size")->check(int_range(1))->default_str("1");
  cmd_->add_option("--iters", a.iters, "timed launches per case and per floor micro-benchmark")
      ->check(int_range(1, 100000))
      ->default_str("20");
  cmd_->add_option("--warmup", a.warmup, "untimed launches first")->check(int_range(0, 100000))->default_str("3");
  cmd_->add_option("--input-sets", a.input_sets,
                   "input sets rotated over (0: automatic, enough to exceed twice the L2 and at least 2; "
                   "1: no rotation)")
      ->check(int_range(0, 1024))
      ->default_str("0");
  cmd_->add_option("--seed", a.seed, "generator seed (a case uses seed + S)")->default_str("1234")->check(uint64_text());
  cmd_->add_option("--json", a.json,
                   "also write the report as JSON to FILE (- : JSON on stdout, the table on stderr); on an error FILE "
                   "is not written (exit 2, the message on stderr; with - an error object on stdout)")
      ->type_name("FILE")
      ->check(nonempty_path());
  cmd_->add_option("--sustained-ms", a.sustained_ms,
                   "after each case's timed launches, about MS ms of launches back to back (no spin, no "
                   "host wait; 20 to 20000 launches): the steady state under the GPU's power limit (0: skip)")
      ->check(millis_range(600000))
      ->default_str("2000");
  cmd_->add_flag("--no-floor", a.no_floor, "skip the floor micro-benchmarks (only the ratio to 278 ns)");
  cmd_->footer(kBenchFooter);
}

bool BenchCommand::json_requested(const std::vector<std::string>& words) {
  for (size_t i = 0; i < words.size(); ++i) {
    if (words[i] == "--json=-" || (words[i] == "--json" && i + 1 < words.size() && words[i + 1] == "-")) return true;
  }
  return false;
}

int BenchCommand::run(const std::string& command_line) {
  if (seq_opt_->count() > 0) args_.seqs = parse_int_list("--seq", seq_text_, 1, "sequence lengths >= 1");
  if (ids_opt_->count() > 0) {
    // Checked here too (run_bench checks again), so a build without CUDA reports bad usage as such.
    args_.ids = split_list_items("--ids", ids_text_, "id patterns");
    for (const std::string& id : args_.ids) {
      dsaib::bench::IdPattern parsed;
      if (!dsaib::bench::parse_id_pattern(id, &parsed)) {
        throw Error(ErrorCode::invalid_argument, "--ids",
                    "--ids: expected one of " + dsaib::bench::id_pattern_list() + ", got \"" + id + "\"");
      }
    }
  }
  args_.command_line = command_line;
  return run_bench(args_);
}

}  // namespace dsaib::cli
