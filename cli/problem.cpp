// Problems of the CLI: presets, generation from flags, geometry (the files: problem_file.cpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>
#include <cctype>

#include "cli.hpp"
#include "dsaib/reference.hpp"

namespace dsaib::cli {

[[noreturn]] void bad(const std::string& arg, const std::string& message) {
  throw Error(ErrorCode::invalid_argument, arg, message);
}

std::string short_list(const std::vector<std::string>& items) {
  constexpr size_t kItems = 16, kItemBytes = 64;
  std::string s;
  for (size_t i = 0; i < items.size() && i < kItems; ++i) {
    s += (i ? ", " : "") + (items[i].size() > kItemBytes ? items[i].substr(0, kItemBytes) + "..." : items[i]);
  }
  if (items.size() > kItems) s += ", ... (" + std::to_string(items.size()) + " in all)";
  return s;
}

namespace {

struct Preset {
  const char* name;
  const char* description;
  Layout layout;
  int64_t batch, s_q, s_kv, heads, head_dim, topk;
  IdPattern ids;
  std::vector<int64_t> seqlens;  // THD
};

const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"small", "B1 S_q=S_kv=1024 H64 D128 topk256, causal top-k (default; about 10 s on 2 cpu cores with full verification)",
       Layout::bshd, 1, 1024, 1024, 64, 128, 256, IdPattern::causal_topk, {}},
      {"deepseek-v32", "DeepSeek-V3.2 indexer: B1 S_q=S_kv=4096 H64 D128 topk2048, causal top-k", Layout::bshd, 1, 4096,
       4096, 64, 128, 2048, IdPattern::causal_topk, {}},
      {"b1-q1-k512-random", "B1 S_q1 S_kv512 H64 D128 topk128, random permutation ids", Layout::bshd, 1, 1, 512, 64, 128, 128,
       IdPattern::random_permutation, {}},
      {"b3-q64-k2048-random", "B3 S_q64 S_kv2048 H64 D128 topk512, random permutation ids", Layout::bshd, 3, 64, 2048, 64, 128,
       512, IdPattern::random_permutation, {}},
      {"b1-s512-causal", "B1 S_q=S_kv=512 H64 D128 topk128, causal top-k", Layout::bshd, 1, 512, 512, 64, 128, 128,
       IdPattern::causal_topk, {}},
      {"thd", "THD, sequences of 1, 37 and 300 tokens, H64 D128 topk128, causal top-k", Layout::thd, 3, 0, 0, 64, 128,
       128, IdPattern::causal_topk, {1, 37, 300}},
      {"tiny", "B2 S_q=S_kv=64 H8 D64 topk16, causal top-k (for quick checks)", Layout::bshd, 2, 64, 64, 8, 64, 16,
       IdPattern::causal_topk, {}},
  };
  return p;
}

std::string join_lengths(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < 16; ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  if (v.size() > 16) s += ",... (" + std::to_string(v.size()) + " lengths)";
  return s;
}

const std::string kMaxRowsText = std::to_string(kMaxRows) + " (2^31 - 1)";

/// a * b, or -1 when it overflows int64 (a, b >= 0).
int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? -1 : r;
}

/// BSHD sizes (or a BSHD preset turned THD): B, B*S_q, B*S_kv each at most kMaxRows.
void check_bshd_sizes(const GenerateSpec& s) {
  if (s.batch < 0) bad("--batch", "--batch: expected >= 0, got " + std::to_string(s.batch));
  if (s.s_q < 0) bad("--s-q", "--s-q: expected >= 0, got " + std::to_string(s.s_q));
  if (s.s_kv < 0) bad("--s-kv", "--s-kv: expected >= 0, got " + std::to_string(s.s_kv));
  if (s.batch > kMaxRows) {
    bad("--batch", "--batch: expected at most " + kMaxRowsText + " sequences, got " + std::to_string(s.batch));
  }
  for (const auto& [flag, len, what] : {std::tuple<const char*, int64_t, const char*>{"--s-q", s.s_q, "query"},
                                        {"--s-kv", s.s_kv, "key"}}) {
    const int64_t rows = checked_mul(s.batch, len);
    if (len > kMaxRows || rows < 0 || rows > kMaxRows) {
      bad(flag, std::string(flag) + ": expected --batch * " + flag + " <= " + kMaxRowsText + " " + what +
                    " rows in all, got " + flag + " " + std::to_string(len) + " with --batch " +
                    std::to_string(s.batch) +
                    (rows < 0 ? std::string(" (the product overflows int64)") : " (" + std::to_string(rows) + " rows)"));
    }
  }
}

}  // namespace

namespace {
std::string joined(const std::vector<std::string>& tokens) {
  std::string given;
  for (const std::string& t : tokens) given += (given.empty() ? "" : " ") + t;
  return given;
}
}  // namespace

std::vector<std::string> split_list_items(const std::string& flag, const std::vector<std::string>& tokens,
                                          const std::string& what) {
  std::vector<std::string> out;
  for (const std::string& t : tokens) {
    size_t pos = 0;
    for (;;) {
      const size_t comma = t.find(',', pos);
      std::string item = t.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
      if (item.empty()) {
        bad(flag, flag + ": expected a comma-separated list of " + what + " without empty items, got \"" +
                      joined(tokens) + "\"");
      }
      out.push_back(std::move(item));
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
  }
  return out;
}

std::vector<int64_t> parse_int_list(const std::string& flag, const std::vector<std::string>& tokens,
                                    int64_t min_value, const std::string& what) {
  const std::string given = joined(tokens);
  std::vector<int64_t> out;
  for (const std::string& item : split_list_items(flag, tokens, what)) {
    // Signed digits follow the integer flags' rule: no '+', no leading zeros ("+5",
    // "007"); anything else gets the message below. (split_list_items refuses empty items.)
    const bool signed_digits = is_digits(item, item[0] == '-' || item[0] == '+' ? 1 : 0);
    if (const std::string why = decimal_integer_error(item); signed_digits && !why.empty()) {
      bad(flag, flag + ": " + why + " in \"" + given + "\"");
    }
    int64_t v = 0;
    if (!parse_decimal_int64(item, &v)) {  // not an integer, or beyond int64
      bad(flag, flag + ": expected integer " + what + ", got \"" + item + "\" in \"" + given + "\"");
    }
    if (v < min_value) bad(flag, flag + ": expected " + what + ", got " + item + " in \"" + given + "\"");
    out.push_back(v);
  }
  return out;
}

std::vector<int64_t> parse_lengths(const std::string& flag, const std::vector<std::string>& tokens) {
  return parse_int_list(flag, tokens, 0, "lengths >= 0");
}

std::string format_float(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::vector<std::pair<std::string, std::string>> preset_list() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Preset& p : presets()) out.emplace_back(p.name, p.description);
  return out;
}

IndexerInputs Problem::inputs() const {
  auto view = [&](const char* name) {
    const auto it = tensors.find(name);
    return it == tensors.end() ? TensorView{} : it->second.view();
  };
  IndexerInputs in;
  in.index_q = view("index_q");
  in.weights = view("weights");
  in.index_k = view("index_k");
  in.topk_indices = view("topk_indices");
  in.attn_score = view("attn_score");
  in.index_score = view("index_score");
  in.cu_seqlens_q = view("cu_seqlens_q");
  in.cu_seqlens_k = view("cu_seqlens_k");
  return in;
}

namespace {

const Preset& find_preset(const std::string& name) {
  const auto& all = presets();
  const auto it = std::find_if(all.begin(), all.end(), [&](const Preset& p) { return name == p.name; });
  if (it == all.end()) {
    std::string names;
    for (const Preset& p : all) names += (names.empty() ? "" : ", ") + std::string(p.name);
    bad("--preset", "--preset: expected one of " + names + ", got \"" + name + "\"");
  }
  return *it;
}

/// The preset's sizes and pattern, then the flags that override them (the layout excepted).
GenerateSpec preset_with_overrides(const Preset& p, const GenFlags& f) {
  GenerateSpec s;
  s.layout = p.layout;
  s.batch = p.batch;
  s.s_q = p.s_q;
  s.s_kv = p.s_kv;
  s.heads = p.heads;
  s.head_dim = p.head_dim;
  s.topk = p.topk;
  s.ids = p.ids;
  s.seqlens_q = p.seqlens;
  s.seqlens_k = p.seqlens;
  if (f.has_batch) s.batch = f.batch;
  if (f.has_s_q) s.s_q = f.s_q;
  if (f.has_s_kv) s.s_kv = f.s_kv;
  else if (f.has_s_q) s.s_kv = f.s_q;  // --s-q alone means S_kv = S_q
  if (f.has_heads) s.heads = f.heads;
  if (f.has_head_dim) s.head_dim = f.head_dim;
  if (f.has_topk) s.topk = f.topk;
  if (f.has_ids) {
    if (f.ids == "causal") s.ids = IdPattern::causal_topk;
    else if (f.ids == "permutation") s.ids = IdPattern::random_permutation;
    else bad("--ids", "--ids: expected causal or permutation, got \"" + f.ids + "\"");
  }
  if (f.has_id_mode) {
    if (f.id_mode == "local") s.id_mode = IdMode::local;
    else if (f.id_mode == "global") s.id_mode = IdMode::global;
    else bad("--id-mode", "--id-mode: expected local or global, got \"" + f.id_mode + "\"");
  }
  return s;
}

/// THD lengths >= 0 and their totals (checked, no int64 overflow) within the row
/// limit, before anything is allocated.
void check_thd_totals(const GenerateSpec& s, const GenFlags& f) {
  for (const auto& [flag, lens, what] :
       {std::tuple<const char*, const std::vector<int64_t>*, const char*>{"--seqlens-q", &s.seqlens_q, "query"},
        {"--seqlens-k", &s.seqlens_k, "key"}}) {
    // Lengths the user did not give come from the preset or from --seqlens-q / --s-q.
    const std::string name = std::string(flag) == "--seqlens-k" && !f.has_seqlens_k
                                 ? (f.has_seqlens_q ? "--seqlens-q" : "--s-kv")
                                 : std::string(flag);
    int64_t total = 0;
    for (const int64_t len : *lens) {
      if (len < 0) bad(name, name + ": expected lengths >= 0, got " + std::to_string(len) + " in " + join_lengths(*lens));
      if (__builtin_add_overflow(total, len, &total) || total > kMaxRows) {
        bad(name, name + ": expected lengths summing to at most " + kMaxRowsText + " " + what +
                      " rows (cu_seqlens are int32), got " + join_lengths(*lens) +
                      (total > kMaxRows ? " (at least " + std::to_string(total) + ")"
                                        : std::string(" (the sum overflows int64)")));
      }
    }
  }
}

/// The THD sequence lengths: from --seqlens-q/-k, the preset's, or B sequences of
/// S_q / S_kv tokens (a BSHD preset turned THD); flags they make meaningless are refused.
void set_thd_lengths(GenerateSpec& s, const Preset& p, const GenFlags& f) {
  if (f.has_seqlens_q) s.seqlens_q = f.seqlens_q;
  if (f.has_seqlens_k) s.seqlens_k = f.seqlens_k;
  else if (f.has_seqlens_q) s.seqlens_k = s.seqlens_q;
  // Lengths from sizes: a BSHD preset (or none) turned THD without --seqlens-q.
  const bool from_sizes = s.seqlens_q.empty() || (p.layout == Layout::bshd && !f.has_seqlens_q);
  const std::string q_lengths_source =
      f.has_seqlens_q ? std::string("--seqlens-q")
                      : from_sizes ? (f.has_batch ? std::string("--batch") : "B of preset " + f.preset)
                                   : "preset " + f.preset;
  if (from_sizes && s.batch == 0) {
    const std::string flag = f.has_batch ? "--batch" : "--preset";
    bad(flag, flag + ": expected at least one sequence (B >= 1) for layout thd, got B = 0");
  }
  if (from_sizes) {
    // A BSHD preset turned THD: B sequences of S_q (resp. S_kv) tokens.
    check_bshd_sizes(s);
    s.seqlens_q.assign(static_cast<size_t>(std::max<int64_t>(s.batch, 0)), s.s_q);
    if (!f.has_seqlens_k) s.seqlens_k.assign(static_cast<size_t>(std::max<int64_t>(s.batch, 0)), s.s_kv);
  }
  if (s.seqlens_q.size() != s.seqlens_k.size()) {
    bad("--seqlens-k", "--seqlens-k: expected " + std::to_string(s.seqlens_q.size()) +
                           " lengths (one per query sequence, from " + q_lengths_source + "), got " +
                           std::to_string(s.seqlens_k.size()));
  }
  check_thd_totals(s, f);
  // Flags the THD lengths make meaningless are refused, not silently dropped.
  if (f.has_batch && f.batch != static_cast<int64_t>(s.seqlens_q.size())) {
    bad("--batch", "--batch: expected " + std::to_string(s.seqlens_q.size()) + " (the number of sequences in " +
                       join_lengths(s.seqlens_q) + ") or no --batch, got " + std::to_string(f.batch));
  }
  if (!from_sizes && f.has_s_q) {
    bad("--s-q", "--s-q: expected no --s-q with the query lengths of " + q_lengths_source + " (" +
                     join_lengths(s.seqlens_q) + "), got " + std::to_string(f.s_q));
  }
  if ((!from_sizes || f.has_seqlens_k) && f.has_s_kv) {
    const std::string k_source = f.has_seqlens_k ? std::string("--seqlens-k") : q_lengths_source;
    bad("--s-kv", "--s-kv: expected no --s-kv with the key lengths of " + k_source + " (" +
                      join_lengths(s.seqlens_k) + "), got " + std::to_string(f.s_kv));
  }
  s.batch = static_cast<int64_t>(s.seqlens_q.size());
}

}  // namespace

GenerateSpec make_spec(const GenFlags& f, int32_t threads) {
  const Preset& p = find_preset(f.preset);
  GenerateSpec s = preset_with_overrides(p, f);
  if (f.has_layout) {
    if (f.layout == "bshd") s.layout = Layout::bshd;
    else if (f.layout == "thd") s.layout = Layout::thd;
    else bad("--layout", "--layout: expected bshd or thd, got \"" + f.layout + "\"");
  } else if (f.has_seqlens_q || f.has_seqlens_k) {
    s.layout = Layout::thd;  // giving sequence lengths means THD
  }
  if (s.layout == Layout::bshd && p.layout == Layout::thd && !f.has_s_q) {
    // A THD preset has sequence lengths, not one S_q: no silent 0-length problem.
    bad("--s-q", "--s-q: expected a query length for --layout bshd with preset " + f.preset +
                     " (a THD preset has no fixed lengths), got none");
  }
  if (s.layout == Layout::thd) {
    set_thd_lengths(s, p, f);
  } else if (f.has_seqlens_q || f.has_seqlens_k) {
    bad("--seqlens-q", "--seqlens-q/--seqlens-k: only with --layout thd");
  } else {
    check_bshd_sizes(s);
  }
  if (s.topk > kMaxRows) bad("--topk", "--topk: expected at most " + kMaxRowsText + ", got " + std::to_string(s.topk));
  if (f.weights_f32) s.weights_f32 = true;
  if (f.has_sm_scale) s.sm_scale = f.sm_scale;
  s.seed = f.seed;
  s.num_threads = threads;
  return s;
}

/// generate_problem, with its argument errors renamed for the command line: a
/// GenerateSpec field the user set by a flag is named by that flag ("--topk: ..."),
/// one that came from the preset says so ("topk (preset small): ...").
GeneratedProblem generate_with_flag_names(const GenerateSpec& spec, const GenFlags& f) {
  try {
    return generate_problem(spec);
  } catch (const Error& e) {
    struct Field {
      const char* field;
      const char* flag;
      bool given;
    };
    const Field fields[] = {{"batch", "--batch", f.has_batch},          {"s_q", "--s-q", f.has_s_q},
                            {"s_kv", "--s-kv", f.has_s_kv},             {"heads", "--heads", f.has_heads},
                            {"head_dim", "--head-dim", f.has_head_dim}, {"topk", "--topk", f.has_topk},
                            {"seqlens_q", "--seqlens-q", f.has_seqlens_q}, {"seqlens_k", "--seqlens-k", f.has_seqlens_k},
                            {"sm_scale", "--sm-scale", f.has_sm_scale}};
    const std::string msg = e.what();
    for (const Field& fd : fields) {
      const std::string prefix = std::string(fd.field) + ":";
      if (e.argument() != fd.field || msg.rfind(prefix, 0) != 0) continue;
      const std::string name = fd.given ? std::string(fd.flag) : std::string(fd.field) + " (preset " + f.preset + ")";
      throw Error(e.code(), fd.given ? fd.flag : fd.field, name + ":" + msg.substr(prefix.size()));
    }
    throw;
  }
}

Problem generate(const GenFlags& f, int32_t threads) {
  const GenerateSpec spec = make_spec(f, threads);
  const auto t0 = std::chrono::steady_clock::now();
  log_stage("generate: preset " + f.preset + (f.has_batch || f.has_s_q || f.has_s_kv || f.has_heads || f.has_head_dim ||
                                                        f.has_topk || f.has_layout || f.has_seqlens_q || f.has_ids
                                                    ? " with overrides"
                                                    : "") +
            ", seed " + std::to_string(f.seed) + " ...");
  GeneratedProblem gp = generate_with_flag_names(spec, f);
  log_stage("generate: done in " + human_seconds(seconds_since(t0)));
  Problem p;
  p.options = gp.options();
  p.options.loss_coeff = f.loss_coeff;
  p.options.grad_loss = f.grad_loss;
  p.options.normalization_count = f.normalization_count;
  p.tensors["index_q"] = std::move(gp.index_q);
  p.tensors["weights"] = std::move(gp.weights);
  p.tensors["index_k"] = std::move(gp.index_k);
  p.tensors["topk_indices"] = std::move(gp.topk_indices);
  p.tensors["attn_score"] = std::move(gp.attn_score);
  p.tensors["index_score"] = std::move(gp.index_score);
  if (spec.layout == Layout::thd) {
    p.tensors["cu_seqlens_q"] = std::move(gp.cu_seqlens_q);
    p.tensors["cu_seqlens_k"] = std::move(gp.cu_seqlens_k);
  }
  p.origin = "generated (preset " + f.preset + ", seed " + std::to_string(f.seed) + ")";
  p.info["generator"] = "dsaib generate";
  p.info["preset"] = f.preset;
  p.info["ids"] = spec.ids == IdPattern::causal_topk ? "causal" : "permutation";
  p.info["seed"] = std::to_string(f.seed);
  return p;
}

std::string Geometry::summary() const {
  std::ostringstream s;
  if (layout == Layout::bshd) {
    s << "bshd B=" << batch << " S_q=" << s_q << " S_kv=" << s_kv;
  } else {
    s << "thd " << batch << " sequences, T_q=" << num_q_rows << " T_k=" << num_k_rows << " (q lengths ";
    for (size_t b = 0; b < q_len.size() && b < 8; ++b) s << (b ? "," : "") << q_len[b];
    if (q_len.size() > 8) s << ",...";
    s << ")";
  }
  s << " H=" << heads << " D=" << head_dim << " topk=" << topk << ", ids " << id_mode_name(id_mode);
  return s.str();
}

Geometry analyze_problem(const Problem& p) {
  const bool thd = p.options.layout == Layout::thd;
  // Ranks first, so that the output shapes below make sense; the library checks the rest.
  // In the order docs/errors.md gives (the library's own order): index_q first.
  const std::vector<std::pair<std::string, size_t>> ranks = {
      {"index_q", thd ? 3u : 4u},      {"weights", thd ? 2u : 3u},    {"index_k", thd ? 2u : 3u},
      {"topk_indices", thd ? 2u : 3u}, {"attn_score", thd ? 2u : 3u}, {"index_score", thd ? 2u : 3u}};
  for (const auto& [name, rank] : ranks) {
    const auto it = p.tensors.find(name);
    if (it == p.tensors.end() && name == "index_score") continue;  // a file for forward / step (load_problem)
    if (it == p.tensors.end()) bad(name, name + ": expected a tensor, got nothing (absent)");
    if (it->second.shape.size() != rank) {
      // Only a file can get here (generated problems have the layout's ranks): its layout
      // comes from its metadata, or from index_q's rank when the metadata has none.
      bad(name, name + ": expected rank " + std::to_string(rank) + " (" + layout_name(p.options.layout) +
                    " layout, from the file's layout metadata or, without it, index_q's rank), got rank " +
                    std::to_string(it->second.shape.size()) + " with shape " + shape_string(it->second.shape));
    }
  }
  if (thd) {
    for (const char* name : kSeqlenNames) {
      if (!p.tensors.count(name)) bad(name, std::string(name) + ": expected a tensor (THD layout), got nothing (absent)");
    }
  }
  // The library's own validation of the inputs (cpu backend, host views), which
  // also derives the geometry.
  IndexerOptions opt = p.options;
  opt.backend = Backend::cpu;
  opt.deterministic = false;
  Geometry g;
  IndexerInputs in = p.inputs();
  // Without index_score (forward, step), attn_score stands in for it: the same
  // dtype and shape rules, as the library's forward validates.
  if (!in.index_score.present()) in.index_score = in.attn_score;
  static_cast<detail::ProblemGeometry&>(g) = detail::validate_problem(in, {}, opt, nullptr, /*check_outputs=*/false);
  g.key_selected.assign(static_cast<size_t>(g.num_k_rows), 0);
  g.q_row_used.assign(static_cast<size_t>(g.num_q_rows), 0);
  const int32_t* ids = p.tensors.at("topk_indices").data<int32_t>();
  for (int64_t b = 0; b < static_cast<int64_t>(g.q_len.size()); ++b) {
    for (int64_t r = g.q_start[b]; r < g.q_start[b] + g.q_len[b]; ++r) {
      for (int64_t i = 0; i < g.topk; ++i) {
        const int64_t kr = g.key_row(b, ids[r * g.topk + i]);
        if (kr < 0) continue;
        ++g.valid_slots;
        g.key_selected[static_cast<size_t>(kr)] = 1;
        g.q_row_used[static_cast<size_t>(r)] = 1;
      }
    }
  }
  return g;
}

}  // namespace dsaib::cli
