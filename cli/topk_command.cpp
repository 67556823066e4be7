// `dsaib topk`: generates a random indexer_topk() problem (causal rows or
// starts/ends ranges, BSHD or THD), runs it on the cpu or cuda backend, checks
// the selection against the fp64 reference with check_indexer_topk (exact up
// to near-ties within the logits' bounds, docs/indexer-topk.md) and reports
// PASS or FAIL.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <random>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "core/bf16.hpp"
#include "core/e4m3.hpp"
#include "topk.hpp"

namespace dsaib::cli {

TopkCommand::TopkCommand(CLI::App& app) {
  cmd_ = app.add_subcommand("topk",
                            "run and check the indexer's top-k forward (indexer_topk) on a random problem: each query "
                            "row's topk keys of largest logit sum_h w_h ReLU(q_h . k), against the fp64 reference");
  TopkArgs& a = args_;
  cmd_->add_option("--batch,-b", a.batch, "B: batch size (BSHD) / number of sequences (THD)")
      ->check(int_range(0, kMaxRows))
      ->default_str("2");
  cmd_->add_option("--s-q", a.s_q, "S_q: query rows per sequence (THD: the longest; lengths drawn in [0, S_q])")
      ->check(int_range(0, kMaxRows))
      ->default_str("128");
  cmd_->add_option("--s-kv", a.s_kv,
                   "S_kv: keys per sequence (default S_q; THD: each sequence's key count is drawn between its query "
                   "count and S_kv, so it can exceed S_kv when --s-q > --s-kv)")
      ->check(int_range(0, kMaxRows));
  cmd_->add_option("--heads", a.heads, "H: index heads (cuda: a multiple of 8 up to 128)")
      ->check(int_range(1, 65536))
      ->default_str("8");
  cmd_->add_option("--head-dim", a.head_dim, "D: head dimension (cuda: 64 or 128)")
      ->check(int_range(1, 65536))
      ->default_str("64");
  cmd_->add_option("--topk", a.topk, "keys selected per query row (cuda: up to 8192)")
      ->check(int_range(1, kMaxRows))
      ->default_str("32");
  cmd_->add_option("--visible", a.visible,
                   "the keys a row sees: causal (row t sees [0, t + causal offset + 1)) or ranges (random "
                   "starts/ends: a window ending at the causal edge)")
      ->check(one_of({"causal", "ranges"}))
      ->default_str("causal");
  cmd_->add_option("--causal-offset", a.causal_offset,
                   "causal rows: auto (each sequence's S_kv - S_q) or an integer")
      ->check(CLI::Validator(
          [](std::string& v) {
            // The least int64 is the library's kCausalOffsetAuto: it would run as auto.
            int64_t x = 0;
            return v == "auto" || (parse_decimal_int64(v, &x) && x != kCausalOffsetAuto)
                       ? std::string()
                       : "expected auto or a decimal integer in [-2^63+1, 2^63-1], got \"" + v + "\"";
          },
          "auto|INT"))
      ->default_str("auto");
  cmd_->add_option("--layout", a.layout, "bshd (fixed lengths) or thd (packed sequences of random lengths)")
      ->check(one_of({"bshd", "thd"}))
      ->default_str("bshd");
  cmd_->add_option("--id-mode", a.id_mode, "ids local to their sequence or global flat rows of index_k")
      ->check(one_of({"local", "global"}))
      ->default_str("local");
  cmd_->add_option("--order", a.order, "the order of each row's ids")
      ->check(one_of({"logit_descending", "id_ascending"}))
      ->default_str("logit_descending");
  cmd_->add_option("--seed", a.seed, "random seed")->default_str("0")->check(uint64_text());
  cmd_->add_flag("--weights-f32", a.weights_f32, "weights in f32 instead of bf16");
  cmd_->add_option("--dtype", a.dtype,
                   "index_q and index_k: bf16, or e4m3 quantised per token (and head) with f32 scales "
                   "(index_q_scale, index_k_scale; cuda: D 128)")
      ->check(one_of({"bf16", "e4m3"}))
      ->default_str("bf16");
  cmd_->add_flag("--strict-ranges", a.strict_ranges, "ranges: raise an error for a range outside its sequence");
  cmd_->add_option("--backend", a.backend, "auto (cuda if available, else cpu), cpu or cuda")
      ->check(one_of({"auto", "cpu", "cuda"}))
      ->default_str("auto");
  cmd_->add_option("--threads", a.threads, "worker threads of the cpu backend and the check (0: all cores)")
      ->check(int_range(0, 1 << 20));
  cmd_->add_option("--warmup", a.warmup, "untimed runs before the timed ones (default: 1 on cuda, 0 on cpu)")
      ->check(int_range(0, 100000));
  cmd_->add_option("--repeat", a.repeat, "timed runs (>= 1)")->check(int_range(1, 1000000))->default_str("1");
  cmd_->add_flag("--json", a.json,
                 "print the report as JSON on stdout (an error too: {\"error\": {code, argument, message}, "
                 "\"result\": \"ERROR\"})");
}

namespace {

/// The problem of the flags: random bf16 index_q, index_k, weights in [-1, 1]
/// (e4m3: index_q and index_k quantised from such values, each query head and
/// each key row by its largest magnitude over 448, with that scale), THD
/// sequence lengths, ranges; outputs allocated (logits in f32).
TopkRun generate_topk(const TopkArgs& a) {
  TopkRun run;
  IndexerTopkOptions& o = run.options;
  o.layout = a.layout == "thd" ? Layout::thd : Layout::bshd;
  o.id_mode = a.id_mode == "global" ? IdMode::global : IdMode::local;
  parse_topk_order(a.order, &o.order);
  if (a.causal_offset != "auto") parse_decimal_int64(a.causal_offset, &o.causal_offset);
  o.strict_ranges = a.strict_ranges;
  o.num_threads = a.threads;
  std::mt19937_64 rng(a.seed);
  const int64_t s_kv = a.s_kv >= 0 ? a.s_kv : a.s_q;
  const bool thd = o.layout == Layout::thd;
  // Per sequence: query and key lengths. THD draws them into tables; BSHD's
  // are S_q and S_kv (no table, so that an empty problem's memory does not
  // grow with B).
  std::vector<int64_t> q_len, k_len;
  int64_t rows = 0, keys = 0;
  if (thd) {
    q_len.resize(static_cast<size_t>(a.batch));
    k_len.resize(static_cast<size_t>(a.batch));
    for (int64_t b = 0; b < a.batch; ++b) {
      q_len[b] = std::uniform_int_distribution<int64_t>(0, a.s_q)(rng);
      k_len[b] = std::uniform_int_distribution<int64_t>(std::min(q_len[b], s_kv), std::max(q_len[b], s_kv))(rng);
      rows += q_len[b], keys += k_len[b];
    }
  } else {  // the flags are below 2^31, so the products fit
    rows = a.batch * a.s_q;
    keys = a.batch * s_kv;
  }
  if (rows > kMaxRows || keys > kMaxRows) {
    throw Error(ErrorCode::invalid_argument, "--batch",
                "--batch: expected fewer than 2^31 query rows and key rows in all, got " + std::to_string(rows) +
                    " and " + std::to_string(keys));
  }
  const int64_t H = a.heads, D = a.head_dim;
  const auto shape = [&](std::vector<int64_t> bshd, std::vector<int64_t> packed) { return thd ? packed : bshd; };
  const bool fp8 = a.dtype == "e4m3";
  const DType qk = fp8 ? DType::e4m3 : DType::bf16;
  run.index_q = HostTensor(qk, shape({a.batch, a.s_q, H, D}, {rows, H, D}));
  run.weights = HostTensor(a.weights_f32 ? DType::f32 : DType::bf16, shape({a.batch, a.s_q, H}, {rows, H}));
  run.index_k = HostTensor(qk, shape({a.batch, s_kv, D}, {keys, D}));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  if (fp8) {
    run.index_q_scale = HostTensor(DType::f32, shape({a.batch, a.s_q, H}, {rows, H}));
    run.index_k_scale = HostTensor(DType::f32, shape({a.batch, s_kv}, {keys}));
    // Each vector of D values quantised by its largest magnitude: scale = amax / 448.
    const auto quantise = [&](HostTensor& t, HostTensor& scales) {
      std::vector<float> v(static_cast<size_t>(D));
      for (int64_t vec = 0; vec < scales.numel(); ++vec) {
        float amax = 0.0f;
        for (float& x : v) amax = std::max(amax, std::fabs(x = u(rng)));
        const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        scales.data<float>()[vec] = scale;
        for (int64_t d = 0; d < D; ++d) t.data<uint8_t>()[vec * D + d] = detail::double_to_e4m3(v[d] / scale);
      }
    };
    quantise(run.index_q, run.index_q_scale);
    quantise(run.index_k, run.index_k_scale);
  } else {
    for (int64_t e = 0; e < run.index_q.numel(); ++e) run.index_q.data<uint16_t>()[e] = detail::float_to_bf16(u(rng));
    for (int64_t e = 0; e < run.index_k.numel(); ++e) run.index_k.data<uint16_t>()[e] = detail::float_to_bf16(u(rng));
  }
  for (int64_t e = 0; e < run.weights.numel(); ++e) {
    const float w = u(rng);
    if (a.weights_f32) run.weights.data<float>()[e] = w;
    else run.weights.data<uint16_t>()[e] = detail::float_to_bf16(w);
  }
  if (thd) {
    run.cu_seqlens_q = HostTensor(DType::i32, {a.batch + 1});
    run.cu_seqlens_k = HostTensor(DType::i32, {a.batch + 1});
    for (int64_t b = 0; b < a.batch; ++b) {
      run.cu_seqlens_q.data<int32_t>()[b + 1] = static_cast<int32_t>(run.cu_seqlens_q.data<int32_t>()[b] + q_len[b]);
      run.cu_seqlens_k.data<int32_t>()[b + 1] = static_cast<int32_t>(run.cu_seqlens_k.data<int32_t>()[b] + k_len[b]);
    }
  }
  if (a.visible == "ranges") {
    // A window ending at the causal edge of each row, of random length.
    run.starts = HostTensor(DType::i32, shape({a.batch, a.s_q}, {rows}));
    run.ends = HostTensor(DType::i32, shape({a.batch, a.s_q}, {rows}));
    int64_t r = 0, key_base = 0;
    for (int64_t b = 0; r < rows; ++b) {  // up to the last sequence with rows
      const int64_t base = thd ? key_base : 0;
      const int64_t nq = thd ? q_len[b] : a.s_q, nk = thd ? k_len[b] : s_kv;
      for (int64_t t = 0; t < nq; ++t, ++r) {
        const int64_t end = std::clamp<int64_t>(t + nk - nq + 1, 0, nk);
        const int64_t start = std::uniform_int_distribution<int64_t>(0, end)(rng);
        run.starts.data<int32_t>()[r] = static_cast<int32_t>(base + start);
        run.ends.data<int32_t>()[r] = static_cast<int32_t>(base + end);
      }
      key_base += nk;
    }
  }
  run.topk_indices = HostTensor(DType::i32, shape({a.batch, a.s_q, a.topk}, {rows, a.topk}));
  run.topk_logits = HostTensor(DType::f32, run.topk_indices.shape);
  run.topk_lengths = HostTensor(DType::i32, shape({a.batch, a.s_q}, {rows}));
  return run;
}

std::string summary(const TopkArgs& a, const TopkRun& run) {
  const IndexerTopkOptions& o = run.options;
  std::string s = std::string(layout_name(o.layout)) + " B=" + std::to_string(a.batch) + " S_q=" + std::to_string(a.s_q) +
                  " S_kv=" + std::to_string(a.s_kv >= 0 ? a.s_kv : a.s_q) + " H=" + std::to_string(a.heads) +
                  " D=" + std::to_string(a.head_dim) + " topk=" + std::to_string(a.topk);
  s += " (" + a.visible + (a.visible == "causal" ? " offset " + a.causal_offset : std::string()) + ", ids " +
       id_mode_name(o.id_mode) + ", order " + topk_order_name(o.order) + ")";
  return s;
}

}  // namespace

int TopkCommand::run() {
  const TopkArgs& a = args_;
  TopkRun run = generate_topk(a);
  // auto: e4m3 inputs of a D other than 128 run on the cpu backend, the one that takes them
  const bool cpu_only = a.dtype == "e4m3" && a.head_dim != 128;
  const bool cuda = a.backend == "cuda" || (a.backend == "auto" && !cpu_only && cuda_backend_available());
  const std::string why = a.backend != "auto" ? "requested"
                          : cuda              ? "auto: CUDA device found"
                          : cpu_only          ? "auto: e4m3 inputs of D other than 128 (the cpu backend takes them)"
                                              : "auto: " + cuda_unavailable_reason();
  const int warmup = a.warmup >= 0 ? a.warmup : (cuda ? 1 : 0);
  log_stage(std::string("topk: ") + (cuda ? "cuda" : "cpu") + " backend, " + summary(a, run));
  if (cuda) {
    run_topk_cuda(run, warmup, a.repeat);
  } else {
    run.timer = "std::chrono (host)";
    run.device = "cpu (" + std::to_string(resolve_threads(a.threads)) + " threads)";
    for (int i = 0; i < warmup + a.repeat; ++i) {
      for (HostTensor* t : {&run.topk_indices, &run.topk_logits, &run.topk_lengths}) {
        std::memset(t->bytes.data(), 0xff, t->bytes.size());  // every element must be written
      }
      const auto t0 = std::chrono::steady_clock::now();
      indexer_topk(run.inputs(), run.outputs(), run.options);
      if (i >= warmup) run.seconds.push_back(seconds_since(t0));
    }
  }
  log_stage("topk: checking against the fp64 reference ...");
  const auto t0 = std::chrono::steady_clock::now();
  const TopkCheck check = check_indexer_topk(run.inputs(), run.options, run.outputs());
  const double check_seconds = seconds_since(t0);
  const double best = run.seconds.empty() ? 0.0 : *std::min_element(run.seconds.begin(), run.seconds.end());
  const int status = check.pass ? 0 : kExitFail;
  if (a.json) {
    nlohmann::ordered_json j;
    j["command"] = "topk";
    j["problem"] = {{"layout", layout_name(run.options.layout)},
                    {"batch", a.batch},
                    {"s_q", a.s_q},
                    {"s_kv", a.s_kv >= 0 ? a.s_kv : a.s_q},
                    {"heads", a.heads},
                    {"head_dim", a.head_dim},
                    {"topk", a.topk},
                    {"visible", a.visible},
                    {"causal_offset", a.causal_offset},
                    {"id_mode", id_mode_name(run.options.id_mode)},
                    {"order", topk_order_name(run.options.order)},
                    {"weights", a.weights_f32 ? "f32" : "bf16"},
                    {"dtype", a.dtype},
                    {"seed", a.seed}};
    j["backend"] = {{"name", cuda ? "cuda" : "cpu"}, {"why", why}, {"device", run.device}};
    j["timing"] = {{"timer", run.timer}, {"warmup", warmup}, {"seconds", run.seconds}, {"best_seconds", best}};
    j["check"] = {{"rows", check.rows},
                  {"exchanged_ids", check.exchanged_ids},
                  {"max_logit_error", check.max_logit_error},
                  {"max_logit_error_rows", check.max_logit_error_rows},
                  {"first_failure", check.first_failure},
                  {"seconds", check_seconds}};
    j["pass"] = check.pass;
    j["result"] = check.pass ? "PASS" : "FAIL";
    j["exit_code"] = status;
    std::cout << report_json_text(j) << std::endl;
    return status;
  }
  std::cout << "dsaib topk\n"
            << "  problem     " << summary(a, run) << "\n"
            << "  backend     " << (cuda ? "cuda" : "cpu") << " (" << why << "), " << run.device << "\n"
            << "  time        " << human_seconds(best) << " (best of " << run.seconds.size() << ", " << run.timer
            << ")\n"
            << "  check       " << check.rows << " rows against the fp64 reference in " << human_seconds(check_seconds)
            << ": " << check.exchanged_ids << " ids exchanged for near-ties, logits within "
            << sci(check.max_logit_error) << " of their bounds\n";
  if (!check.pass) std::cout << "  failure     " << terminal_text(check.first_failure) << "\n";
  std::cout << "  result      " << (check.pass ? "PASS" : "FAIL") << "\n";
  return status;
}

}  // namespace dsaib::cli
