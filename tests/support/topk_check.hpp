// Test problems of indexer_topk() and the definition of its selection written
// out independently of the library: every visible key's fp64 logit, then a full
// std::sort by (logit descending, id ascending; NaN first, NaNs by id).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/bf16.hpp"
#include "dsaib/host_tensor.hpp"
#include "dsaib/indexer_topk.hpp"

namespace dsaib::test {

struct TopkSpec {
  Layout layout = Layout::bshd;
  IdMode id_mode = IdMode::local;
  TopkOrder order = TopkOrder::logit_descending;
  int64_t batch = 2, s_q = 5, s_kv = 13, heads = 3, head_dim = 8, topk = 4;
  std::vector<int64_t> q_lens, k_lens;  // THD
  bool ranges = false;                  // random starts/ends (some outside the sequence, some empty)
  bool weights_f32 = true;
  int64_t causal_offset = kCausalOffsetAuto;
  uint64_t seed = 1;
  // float8: index_q and index_k in e4m3 (random codes), with index_q_scale /
  // index_k_scale when asked (random in [1/4, 4], negative with negative_scales)
  bool e4m3 = false, q_scale = true, k_scale = true, negative_scales = false;
};

/// A float8 e4m3 ("fn") code's value, written out from the format: sign,
/// 4 exponent bits of bias 7 (0: subnormal), 3 mantissa bits, S.1111.111 NaN.
inline double e4m3_value(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double v = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return (code & 0x80) ? -v : v;
}

struct TopkProblem {
  TopkSpec spec;
  HostTensor index_q, weights, index_k, starts, ends, cu_q, cu_k;
  HostTensor index_q_scale, index_k_scale;  // e4m3 problems, when asked
  int64_t rows = 0, keys = 0;
  std::vector<int64_t> q_start, k_start, q_len, k_len;  // per sequence

  IndexerTopkInputs inputs() const {
    IndexerTopkInputs in;
    in.index_q = index_q.view();
    in.weights = weights.view();
    in.index_k = index_k.view();
    if (!starts.empty()) {
      in.starts = starts.view();
      in.ends = ends.view();
    }
    if (spec.layout == Layout::thd) {
      in.cu_seqlens_q = cu_q.view();
      in.cu_seqlens_k = cu_k.view();
    }
    in.index_q_scale = index_q_scale.view();
    in.index_k_scale = index_k_scale.view();
    return in;
  }
  IndexerTopkOptions options() const {
    IndexerTopkOptions o;
    o.layout = spec.layout;
    o.id_mode = spec.id_mode;
    o.order = spec.order;
    o.causal_offset = spec.causal_offset;
    o.num_threads = 2;
    return o;
  }
  std::vector<int64_t> out_shape(int64_t last) const {
    if (spec.layout == Layout::thd) return {rows, last};
    return {spec.batch, spec.s_q, last};
  }
  std::vector<int64_t> row_shape() const {
    if (spec.layout == Layout::thd) return {rows};
    return {spec.batch, spec.s_q};
  }
  uint16_t* q_bits() { return index_q.data<uint16_t>(); }
  uint16_t* k_bits() { return index_k.data<uint16_t>(); }
  /// Sequence of flat query row r.
  int64_t seq_of(int64_t r) const {
    int64_t b = 0;
    while (b + 1 < static_cast<int64_t>(q_start.size()) && r >= q_start[b] + q_len[b]) ++b;
    return b;
  }
};

/// Output buffers shaped for a problem.
struct TopkOutputs {
  HostTensor ids, logits, lengths;
  TopkOutputs(const TopkProblem& p, int64_t topk, DType logits_dtype = DType::f32)
      : ids(DType::i32, p.out_shape(topk)), logits(logits_dtype, p.out_shape(topk)), lengths(DType::i32, p.row_shape()) {
    poison();
  }
  void poison() {
    for (int64_t e = 0; e < ids.numel(); ++e) ids.data<int32_t>()[e] = 0x7fc00000;
    for (int64_t e = 0; e < lengths.numel(); ++e) lengths.data<int32_t>()[e] = 0x7fc00000;
    std::fill(logits.bytes.begin(), logits.bytes.end(), uint8_t{0xff});  // NaN in f32 and f64
  }
  IndexerTopkOutputs views() const { return {ids.view(), logits.view(), lengths.view()}; }
};

/// THD: four sequences, one without queries and one without keys (its rows are empty).
inline TopkSpec thd_spec(TopkSpec s) {
  s.layout = Layout::thd;
  s.q_lens = {3, 0, 6, 2};
  s.k_lens = {9, 5, 14, 0};
  return s;
}

inline TopkProblem make_topk_problem(const TopkSpec& s) {
  TopkProblem p;
  p.spec = s;
  std::mt19937_64 rng(s.seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const bool thd = s.layout == Layout::thd;
  if (thd) {
    int64_t qs = 0, ks = 0;
    for (size_t b = 0; b < s.q_lens.size(); ++b) {
      p.q_start.push_back(qs);
      p.k_start.push_back(ks);
      p.q_len.push_back(s.q_lens[b]);
      p.k_len.push_back(s.k_lens[b]);
      qs += s.q_lens[b];
      ks += s.k_lens[b];
    }
    p.rows = qs;
    p.keys = ks;
    const int64_t nb = static_cast<int64_t>(s.q_lens.size());
    p.cu_q = HostTensor(DType::i32, {nb + 1});
    p.cu_k = HostTensor(DType::i32, {nb + 1});
    for (int64_t b = 0; b <= nb; ++b) {
      p.cu_q.data<int32_t>()[b] = static_cast<int32_t>(b < nb ? p.q_start[b] : qs);
      p.cu_k.data<int32_t>()[b] = static_cast<int32_t>(b < nb ? p.k_start[b] : ks);
    }
    p.index_q = HostTensor(s.e4m3 ? DType::e4m3 : DType::bf16, {p.rows, s.heads, s.head_dim});
    p.weights = HostTensor(s.weights_f32 ? DType::f32 : DType::bf16, {p.rows, s.heads});
    p.index_k = HostTensor(s.e4m3 ? DType::e4m3 : DType::bf16, {p.keys, s.head_dim});
  } else {
    for (int64_t b = 0; b < s.batch; ++b) {
      p.q_start.push_back(b * s.s_q);
      p.k_start.push_back(b * s.s_kv);
      p.q_len.push_back(s.s_q);
      p.k_len.push_back(s.s_kv);
    }
    p.rows = s.batch * s.s_q;
    p.keys = s.batch * s.s_kv;
    p.index_q = HostTensor(s.e4m3 ? DType::e4m3 : DType::bf16, {s.batch, s.s_q, s.heads, s.head_dim});
    p.weights = HostTensor(s.weights_f32 ? DType::f32 : DType::bf16, {s.batch, s.s_q, s.heads});
    p.index_k = HostTensor(s.e4m3 ? DType::e4m3 : DType::bf16, {s.batch, s.s_kv, s.head_dim});
  }
  if (s.e4m3) {
    // Random codes of magnitude below 2^3 (exponent field up to 9), NaN excluded.
    std::uniform_int_distribution<int> code(0, 0x4f);
    const auto fill = [&](HostTensor& t) {
      for (int64_t e = 0; e < t.numel(); ++e) t.data<uint8_t>()[e] = static_cast<uint8_t>(code(rng) | (rng() & 0x80));
    };
    fill(p.index_q);
    fill(p.index_k);
    std::uniform_real_distribution<float> mag(0.25f, 4.0f);
    const auto scales = [&](std::vector<int64_t> shape) {
      HostTensor t(DType::f32, shape);
      for (int64_t e = 0; e < t.numel(); ++e) t.data<float>()[e] = mag(rng) * (s.negative_scales && (rng() & 1) ? -1.0f : 1.0f);
      return t;
    };
    if (s.q_scale) p.index_q_scale = scales(thd ? std::vector<int64_t>{p.rows, s.heads} : std::vector<int64_t>{s.batch, s.s_q, s.heads});
    if (s.k_scale) p.index_k_scale = scales(thd ? std::vector<int64_t>{p.keys} : std::vector<int64_t>{s.batch, s.s_kv});
  } else {
    for (int64_t e = 0; e < p.index_q.numel(); ++e) p.q_bits()[e] = detail::float_to_bf16(u(rng));
    for (int64_t e = 0; e < p.index_k.numel(); ++e) p.k_bits()[e] = detail::float_to_bf16(u(rng));
  }
  for (int64_t e = 0; e < p.weights.numel(); ++e) {
    const float w = u(rng);
    if (s.weights_f32) p.weights.data<float>()[e] = w;
    else p.weights.data<uint16_t>()[e] = detail::float_to_bf16(w);
  }
  if (s.ranges) {
    p.starts = HostTensor(DType::i32, p.row_shape());
    p.ends = HostTensor(DType::i32, p.row_shape());
    for (int64_t r = 0; r < p.rows; ++r) {
      const int64_t b = p.seq_of(r);
      const int64_t base = thd ? p.k_start[b] : 0, n = p.k_len[b];
      std::uniform_int_distribution<int64_t> pos(-2, n + 2);
      p.starts.data<int32_t>()[r] = static_cast<int32_t>(base + pos(rng));
      p.ends.data<int32_t>()[r] = static_cast<int32_t>(base + pos(rng));
    }
  }
  return p;
}

/// fp64 logit of flat query row r and flat key row j, written out as the
/// definition (e4m3: k_scale[j] * sum_h (w_h q_scale_h) relu(q_h . k)).
inline double definition_logit(const TopkProblem& p, int64_t r, int64_t j) {
  const int64_t H = p.spec.heads, D = p.spec.head_dim;
  const bool fp8 = p.spec.e4m3;
  const auto q_at = [&](int64_t e) {
    return fp8 ? e4m3_value(p.index_q.data<uint8_t>()[e]) : double(detail::bf16_to_float(p.index_q.data<uint16_t>()[e]));
  };
  const auto k_at = [&](int64_t e) {
    return fp8 ? e4m3_value(p.index_k.data<uint8_t>()[e]) : double(detail::bf16_to_float(p.index_k.data<uint16_t>()[e]));
  };
  double sum = 0;
  for (int64_t h = 0; h < H; ++h) {
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += q_at((r * H + h) * D + d) * k_at(j * D + d);
    double w = p.spec.weights_f32 ? double(p.weights.data<float>()[r * H + h])
                                  : double(detail::bf16_to_float(p.weights.data<uint16_t>()[r * H + h]));
    if (!p.index_q_scale.empty()) w *= double(p.index_q_scale.data<float>()[r * H + h]);
    const double relu = std::isnan(dot) ? dot : std::max(dot, 0.0);
    sum += w * relu;
  }
  return p.index_k_scale.empty() ? sum : double(p.index_k_scale.data<float>()[j]) * sum;
}

/// The selection written out: ids (in `order`), fp64 logits, -1 / -inf past
/// each row's count, and the counts.
struct BruteTopk {
  std::vector<int32_t> ids;
  std::vector<double> logits;
  std::vector<int32_t> lengths;
};

inline BruteTopk brute_force_topk(const TopkProblem& p, const IndexerTopkOptions& opt, int64_t topk) {
  BruteTopk res;
  res.ids.assign(static_cast<size_t>(p.rows * topk), -1);
  res.logits.assign(static_cast<size_t>(p.rows * topk), -std::numeric_limits<double>::infinity());
  res.lengths.assign(static_cast<size_t>(p.rows), 0);
  const bool thd = opt.layout == Layout::thd;
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t b = p.seq_of(r), t = r - p.q_start[b], n = p.k_len[b];
    int64_t lo = 0, hi = 0;
    if (!p.starts.empty()) {
      const int64_t base = thd ? p.k_start[b] : 0;
      lo = std::min<int64_t>(std::max<int64_t>(p.starts.data<int32_t>()[r] - base, 0), n);
      hi = std::min<int64_t>(std::max<int64_t>(p.ends.data<int32_t>()[r] - base, 0), n);
    } else {
      const long double off = opt.causal_offset == kCausalOffsetAuto ? double(n - p.q_len[b]) : double(opt.causal_offset);
      const long double end = (long double)t + off + 1;
      hi = end <= 0 ? 0 : (end >= n ? n : static_cast<int64_t>(end));
    }
    struct Key {
      double logit;
      int64_t pos;
    };
    std::vector<Key> keys;
    for (int64_t s = lo; s < hi; ++s) keys.push_back({definition_logit(p, r, p.k_start[b] + s), s});
    std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& c) {
      if (std::isnan(a.logit) != std::isnan(c.logit)) return std::isnan(a.logit);
      if (!std::isnan(a.logit) && a.logit != c.logit) return a.logit > c.logit;
      return a.pos < c.pos;
    });
    const int64_t cnt = std::min<int64_t>(topk, static_cast<int64_t>(keys.size()));
    keys.resize(static_cast<size_t>(cnt));
    if (opt.order == TopkOrder::id_ascending) {
      std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& c) { return a.pos < c.pos; });
    }
    for (int64_t i = 0; i < cnt; ++i) {
      res.ids[r * topk + i] = static_cast<int32_t>(opt.id_mode == IdMode::local ? keys[i].pos : p.k_start[b] + keys[i].pos);
      res.logits[r * topk + i] = keys[i].logit;
    }
    res.lengths[r] = static_cast<int32_t>(cnt);
  }
  return res;
}

}  // namespace dsaib::test
