// Random attention-target problems and the target written from its definition
// in fp64 (include/dsaib/attention_target.hpp), independent of the library's
// reference: own bf16 decoding, own id validity, flat contiguous indexing.
// Header-only; used by the cpu and gpu tests of attention_target().
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "dsaib/attention_target.hpp"
#include "dsaib/host_tensor.hpp"

namespace dsaib::test {

/// A problem of attention_target() in host memory, every tensor contiguous.
/// Sequences: BSHD has `batch` sequences of s_q query rows and s_kv key rows;
/// THD has q_lens[b] and k_lens[b] rows per sequence.
struct TargetProblem {
  Layout layout = Layout::bshd;
  IdMode id_mode = IdMode::local;
  LseBase lse_base = LseBase::natural;
  int64_t heads = 16, head_dim = 192, topk = 8;
  float sm_scale = 0.1f;
  std::vector<int64_t> q_lens, k_lens;  // per sequence (BSHD: all equal)
  HostTensor query, kv, lse, topk_indices, cu_seqlens_q, cu_seqlens_k;

  int64_t batch() const { return static_cast<int64_t>(q_lens.size()); }
  int64_t num_q_rows() const {
    int64_t n = 0;
    for (int64_t l : q_lens) n += l;
    return n;
  }
  int64_t num_k_rows() const {
    int64_t n = 0;
    for (int64_t l : k_lens) n += l;
    return n;
  }
  int64_t q_start(int64_t b) const {
    int64_t n = 0;
    for (int64_t i = 0; i < b; ++i) n += q_lens[i];
    return n;
  }
  int64_t k_start(int64_t b) const {
    int64_t n = 0;
    for (int64_t i = 0; i < b; ++i) n += k_lens[i];
    return n;
  }
  int32_t* ids() { return topk_indices.data<int32_t>(); }
  const int32_t* ids() const { return topk_indices.data<int32_t>(); }

  AttentionTargetInputs inputs() const {
    AttentionTargetInputs in;
    in.query = query.view();
    in.kv = kv.view();
    in.lse = lse.view();
    in.topk_indices = topk_indices.view();
    if (layout == Layout::thd) {
      in.cu_seqlens_q = cu_seqlens_q.view();
      in.cu_seqlens_k = cu_seqlens_k.view();
    }
    return in;
  }
  AttentionTargetOptions options(bool normalize = true) const {
    AttentionTargetOptions o;
    o.layout = layout;
    o.id_mode = id_mode;
    o.sm_scale = sm_scale;
    o.lse_base = lse_base;
    o.normalize = normalize;
    o.num_threads = 2;
    return o;
  }
  /// An f32 output shaped like topk_indices.
  HostTensor make_output() const { return HostTensor(DType::f32, topk_indices.shape); }
};

inline float target_bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
/// Round to nearest even (finite inputs).
inline uint16_t target_float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct TargetSpec {
  Layout layout = Layout::bshd;
  IdMode id_mode = IdMode::local;
  LseBase lse_base = LseBase::natural;
  int64_t heads = 16, head_dim = 192, topk = 8;
  int64_t batch = 2, s_q = 5, s_kv = 12;    // BSHD
  std::vector<int64_t> q_lens, k_lens;      // THD
  /// Share of slots set to -1 and to an id just outside the row's sequence.
  double invalid_share = 0.15, out_of_range_share = 0.1;
  uint64_t seed = 1;
};

/// The true natural-log LSE of query row r, head h over every key row of its
/// sequence (a dense softmax's), so the targets are of a realistic size.
/// Returned in the problem's base (base 2: divided by ln 2), as f32.
inline TargetProblem make_target_problem(const TargetSpec& s) {
  TargetProblem p;
  p.layout = s.layout;
  p.id_mode = s.id_mode;
  p.lse_base = s.lse_base;
  p.heads = s.heads;
  p.head_dim = s.head_dim;
  p.topk = s.topk;
  p.sm_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  if (s.layout == Layout::bshd) {
    p.q_lens.assign(static_cast<size_t>(s.batch), s.s_q);
    p.k_lens.assign(static_cast<size_t>(s.batch), s.s_kv);
  } else {
    p.q_lens = s.q_lens;
    p.k_lens = s.k_lens;
  }
  const int64_t H = s.heads, D = s.head_dim, K = s.topk, Tq = p.num_q_rows(), Tk = p.num_k_rows();
  const bool thd = s.layout == Layout::thd;
  const int64_t B = p.batch();
  p.query = thd ? HostTensor(DType::bf16, {Tq, H, D}) : HostTensor(DType::bf16, {B, s.s_q, H, D});
  p.kv = thd ? HostTensor(DType::bf16, {Tk, D}) : HostTensor(DType::bf16, {B, s.s_kv, D});
  p.lse = thd ? HostTensor(DType::f32, {Tq, H}) : HostTensor(DType::f32, {B, s.s_q, H});
  p.topk_indices = thd ? HostTensor(DType::i32, {Tq, K}) : HostTensor(DType::i32, {B, s.s_q, K});
  if (thd) {
    p.cu_seqlens_q = HostTensor(DType::i32, {B + 1});
    p.cu_seqlens_k = HostTensor(DType::i32, {B + 1});
    for (int64_t b = 0; b <= B; ++b) {
      p.cu_seqlens_q.data<int32_t>()[b] = static_cast<int32_t>(p.q_start(b));
      p.cu_seqlens_k.data<int32_t>()[b] = static_cast<int32_t>(p.k_start(b));
    }
  }
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int64_t e = 0; e < p.query.numel(); ++e) p.query.data<uint16_t>()[e] = target_float_to_bf16(normal(rng));
  for (int64_t e = 0; e < p.kv.numel(); ++e) p.kv.data<uint16_t>()[e] = target_float_to_bf16(normal(rng));
  const double ln2 = std::log(2.0);
  std::vector<double> logit;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = p.q_start(b), k0 = p.k_start(b), kl = p.k_lens[b];
    for (int64_t t = 0; t < p.q_lens[b]; ++t) {
      const int64_t r = q0 + t;
      for (int64_t h = 0; h < H; ++h) {
        double mx = -INFINITY, sum = 0;
        logit.assign(static_cast<size_t>(kl), 0.0);
        for (int64_t j = 0; j < kl; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            dot += static_cast<double>(target_bf16_to_float(p.query.data<uint16_t>()[(r * H + h) * D + d])) *
                   target_bf16_to_float(p.kv.data<uint16_t>()[(k0 + j) * D + d]);
          }
          logit[j] = p.sm_scale * dot;
          mx = std::max(mx, logit[j]);
        }
        for (int64_t j = 0; j < kl; ++j) sum += std::exp(logit[j] - mx);
        const double lse = kl > 0 ? mx + std::log(sum) : 0.0;
        p.lse.data<float>()[r * H + h] = static_cast<float>(s.lse_base == LseBase::base2 ? lse / ln2 : lse);
      }
      std::uniform_int_distribution<int64_t> key(0, std::max<int64_t>(kl - 1, 0));
      for (int64_t i = 0; i < K; ++i) {
        const double u = unit(rng);
        int64_t id;
        if (kl == 0 || u < s.invalid_share) {
          id = -1;
        } else if (u < s.invalid_share + s.out_of_range_share) {
          id = kl + static_cast<int64_t>(unit(rng) * 3);  // just past the sequence (local)
        } else {
          id = key(rng);
        }
        if (s.id_mode == IdMode::global && id >= 0) id += k0;
        p.ids()[r * K + i] = static_cast<int32_t>(id);
      }
    }
  }
  return p;
}

/// attn_score (row-major, num_q_rows x topk) from the definition, in fp64.
inline std::vector<double> naive_attention_target(const TargetProblem& p, bool normalize) {
  const int64_t H = p.heads, D = p.head_dim, K = p.topk;
  std::vector<double> out(static_cast<size_t>(p.num_q_rows() * K), 0.0);
  const uint16_t* q = p.query.data<uint16_t>();
  const uint16_t* kv = p.kv.data<uint16_t>();
  const float* lse = p.lse.data<float>();
  const double log2e = 1.0 / std::log(2.0);
  for (int64_t b = 0; b < p.batch(); ++b) {
    const int64_t k0 = p.k_start(b), kl = p.k_lens[b];
    for (int64_t t = 0; t < p.q_lens[b]; ++t) {
      const int64_t r = p.q_start(b) + t;
      double sum = 0;
      for (int64_t i = 0; i < K; ++i) {
        const int64_t id = p.ids()[r * K + i];
        const int64_t j = p.id_mode == IdMode::local ? (id >= 0 && id < kl ? k0 + id : -1)
                                                     : (id >= k0 && id < k0 + kl ? id : -1);
        if (j < 0) continue;
        double u = 0;
        for (int64_t h = 0; h < H; ++h) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            dot += static_cast<double>(target_bf16_to_float(q[(r * H + h) * D + d])) * target_bf16_to_float(kv[j * D + d]);
          }
          const double l = lse[r * H + h];
          u += p.lse_base == LseBase::base2 ? std::exp2(p.sm_scale * log2e * dot - l) : std::exp(p.sm_scale * dot - l);
        }
        out[r * K + i] = u;
        sum += u;
      }
      if (normalize) {
        for (int64_t i = 0; i < K; ++i) out[r * K + i] = sum > 0 ? out[r * K + i] / sum : 0.0;
      }
    }
  }
  return out;
}

/// attn_score without a given lse, from the definition in fp64: each head's
/// natural lse over the row's valid slots, lse[r, h] = log sum_i exp(sm_scale *
/// (q[r, h] . kv[j_i])) (shifted by the head's max logit), then U and T as above
/// with it. p.lse is not read.
inline std::vector<double> naive_selected_attention_target(const TargetProblem& p, bool normalize) {
  const int64_t H = p.heads, D = p.head_dim, K = p.topk;
  std::vector<double> out(static_cast<size_t>(p.num_q_rows() * K), 0.0);
  const uint16_t* q = p.query.data<uint16_t>();
  const uint16_t* kv = p.kv.data<uint16_t>();
  std::vector<double> x;  // (slot, head) logits of a row; NaN at invalid slots
  for (int64_t b = 0; b < p.batch(); ++b) {
    const int64_t k0 = p.k_start(b), kl = p.k_lens[b];
    for (int64_t t = 0; t < p.q_lens[b]; ++t) {
      const int64_t r = p.q_start(b) + t;
      x.assign(static_cast<size_t>(K * H), NAN);
      std::vector<bool> valid(static_cast<size_t>(K), false);
      for (int64_t i = 0; i < K; ++i) {
        const int64_t id = p.ids()[r * K + i];
        const int64_t j = p.id_mode == IdMode::local ? (id >= 0 && id < kl ? k0 + id : -1)
                                                     : (id >= k0 && id < k0 + kl ? id : -1);
        if (j < 0) continue;
        valid[i] = true;
        for (int64_t h = 0; h < H; ++h) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            dot += static_cast<double>(target_bf16_to_float(q[(r * H + h) * D + d])) * target_bf16_to_float(kv[j * D + d]);
          }
          x[i * H + h] = p.sm_scale * dot;
        }
      }
      double sum = 0;
      std::vector<double> u(static_cast<size_t>(K), 0.0);
      for (int64_t h = 0; h < H; ++h) {
        double mx = -INFINITY, e = 0;
        for (int64_t i = 0; i < K; ++i) {
          if (valid[i]) mx = std::max(mx, x[i * H + h]);
        }
        for (int64_t i = 0; i < K; ++i) {
          if (valid[i]) e += std::exp(x[i * H + h] - mx);
        }
        for (int64_t i = 0; i < K; ++i) {
          if (valid[i]) u[i] += std::exp(x[i * H + h] - mx) / e;  // head h's softmax over the slots
        }
      }
      for (int64_t i = 0; i < K; ++i) sum += u[i];
      for (int64_t i = 0; i < K; ++i) out[r * K + i] = normalize ? (sum > 0 ? u[i] / sum : 0.0) : u[i];
    }
  }
  return out;
}

}  // namespace dsaib::test
