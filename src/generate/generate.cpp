// Realistic input generator (include/dsaib/generate.hpp): what one forward
// pass of a DSA lightning indexer hands to its backward.
//
// What is drawn
//   index_q, index_k ~ N(0, 1), weights ~ N(0, 1) / sqrt(H), rounded to bf16
//   (weights kept in f32 when spec.weights_f32). Every later quantity is
//   computed from these rounded values.
//
// Ids (per query row t of sequence b, with S_q = q length and S_kv = k length
// of that sequence)
//   causal_topk: the row may see keys s in [0, min(S_kv, t + (S_kv - S_q) + 1))
//     (the usual bottom-right-aligned causal mask; S_q == S_kv gives s <= t).
//     Every visible key is scored with z = sm_scale * sum_h w_h relu(q_h . k_s)
//     in fp32; the topk largest are kept, ordered by decreasing z (ties: lower
//     s first), then -1 for the remaining slots.
//   random_permutation: min(topk, S_kv) distinct keys of the sequence drawn
//     uniformly (no causality), then -1.
//   Ids are written local (s) or global (flat key row: b*S_kv + s for BSHD,
//   cu_seqlens_k[b] + s for THD).
//
// Scores (0 at every -1 slot)
//   index_score: softmax over the valid slots of the fp64 logits, computed in
//     exactly the summation order of reference_index_logits(), so it is the
//     fp32 rounding of the reference's own softmax.
//   attn_score: a genuine sparse-attention distribution: per query row 4
//     random fp32 main-attention heads of dim 32 (queries per query row, keys
//     per key row, N(0, 1)); each head takes a softmax of q.k / sqrt(32) over
//     the row's valid slots; the heads are summed and L1-normalised.
//
// THD: spec.seqlens_q gives the sequences (at least one); spec.seqlens_k the
// key lengths, or empty for "same as seqlens_q". spec.batch/s_q/s_kv are ignored.
//
// Determinism: every row draws from its own counter-based stream (seed,
// tensor, row), and rows are independent, so the result depends only on the
// spec, not on num_threads or scheduling.
//
// Cost, per query row with n visible keys:
//   causal_topk        n * H * D fp32 multiply-adds (scoring) + topk * H * D
//                      fp64 (exact logits of the selection) + O(n log topk);
//                      for S_q = S_kv = S about S^2/2 * H * D in all: S = 1024,
//                      H64 D128 is ~4.3 G fp32 MACs (~1-2 s on 2 cores), S = 4096
//                      ~69 G (tens of seconds); beyond that prefer random_permutation.
//   random_permutation O(topk) to draw + topk * H * D fp64.
// Rows are spread over num_threads threads (0 = hardware concurrency).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/allocation.hpp"
#include "core/float_mode.hpp"
#include "core/threads.hpp"

#include "core/bf16.hpp"
#include "dsaib/generate.hpp"
#include "generate/sequences.hpp"

namespace dsaib {
namespace {

using detail::bf16_to_float;
using detail::float_to_bf16;

using generate::kAttnDim;
using generate::kAttnHeads;
using generate::kMaxRows;
using generate::resolve;
using generate::Sequences;

// ---------------------------------------------------------------- random ---

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

enum Stream : uint64_t { kStreamQ = 1, kStreamW, kStreamK, kStreamIds, kStreamAttnQ, kStreamAttnK };

/// A small counter-based generator: one independent stream per (seed, stream, row).
class Rng {
 public:
  Rng(uint64_t seed, uint64_t stream, uint64_t row) {
    uint64_t s = seed;
    state_ = splitmix64(s);
    s = state_ ^ (stream * 0xD1B54A32D192ED03ull);
    state_ = splitmix64(s);
    s = state_ ^ (row * 0x8CB92BA72F3D8DD7ull);
    state_ = splitmix64(s);
  }
  uint64_t next() { return splitmix64(state_); }
  /// Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// Standard normal (Box-Muller, both values used).
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double a = 2.0 * 3.14159265358979323846 * u2;
    spare_ = r * std::sin(a);
    has_spare_ = true;
    return r * std::cos(a);
  }
  /// Uniform integer in [0, n), n >= 1 (rejection sampling, unbiased).
  uint64_t below(uint64_t n) {
    const uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % n;
    uint64_t x;
    do x = next();
    while (x >= limit);
    return x % n;
  }

 private:
  uint64_t state_ = 0;
  double spare_ = 0;
  bool has_spare_ = false;
};

// ------------------------------------------------------------- per row ----

struct RowScratch {
  std::vector<float> q_t;       // (D, H): the row's queries, transposed, as float
  std::vector<double> q_t64;    // (D, H) in double
  std::vector<double> w;        // (H)
  std::vector<float> w32;       // (H)
  std::vector<float> x32;       // (H)
  std::vector<double> x64;      // (H)
  std::vector<float> z_all;     // (visible keys) fp32 scores
  std::vector<int32_t> order;   // candidate keys
  std::vector<int32_t> perm;    // identity permutation of max_k_len (random_permutation)
  std::vector<std::pair<int64_t, int64_t>> swaps;
  std::vector<int64_t> sel;     // selected local key ids
  std::vector<double> z;        // their fp64 logits
  std::vector<float> aq;        // main-attention queries (heads * dim)
  std::vector<double> t;        // attn accumulator
  std::vector<double> p;        // per-head softmax
};

}  // namespace

// ------------------------------------------------------------ the problem ---

IndexerInputs GeneratedProblem::inputs() const {
  IndexerInputs in;
  in.index_q = index_q.view();
  in.weights = weights.view();
  in.index_k = index_k.view();
  in.topk_indices = topk_indices.view();
  in.attn_score = attn_score.view();
  in.index_score = index_score.view();
  in.cu_seqlens_q = cu_seqlens_q.view();
  in.cu_seqlens_k = cu_seqlens_k.view();
  return in;
}

IndexerOptions GeneratedProblem::options() const {
  IndexerOptions opt;
  opt.layout = spec.layout;
  opt.id_mode = spec.id_mode;
  opt.sm_scale = sm_scale;
  return opt;
}

/// generate_problem without its floating-point scope and allocation-failure mapping.
static GeneratedProblem generate_problem_unguarded(const GenerateSpec& spec) {
  const Sequences seqs = resolve(spec);
  const int64_t H = spec.heads, D = spec.head_dim, K = spec.topk;
  const int64_t Tq = seqs.num_q_rows, Tk = seqs.num_k_rows;
  const bool thd = spec.layout == Layout::thd;

  GeneratedProblem p;
  p.spec = spec;
  p.sm_scale = spec.sm_scale != 0.0f ? spec.sm_scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const double sm_scale = p.sm_scale;
  const DType wtype = spec.weights_f32 ? DType::f32 : DType::bf16;
  if (thd) {
    p.index_q = HostTensor(DType::bf16, {Tq, H, D});
    p.weights = HostTensor(wtype, {Tq, H});
    p.index_k = HostTensor(DType::bf16, {Tk, D});
    p.topk_indices = HostTensor(DType::i32, {Tq, K});
    p.attn_score = HostTensor(DType::f32, {Tq, K});
    p.index_score = HostTensor(DType::f32, {Tq, K});
    const int64_t nseq = static_cast<int64_t>(seqs.q_len.size());
    p.cu_seqlens_q = HostTensor(DType::i32, {nseq + 1});
    p.cu_seqlens_k = HostTensor(DType::i32, {nseq + 1});
    for (int64_t b = 0; b <= nseq; ++b) {
      p.cu_seqlens_q.data<int32_t>()[b] = static_cast<int32_t>(b < nseq ? seqs.q_start[b] : Tq);
      p.cu_seqlens_k.data<int32_t>()[b] = static_cast<int32_t>(b < nseq ? seqs.k_start[b] : Tk);
    }
  } else {
    const int64_t B = spec.batch;
    p.index_q = HostTensor(DType::bf16, {B, spec.s_q, H, D});
    p.weights = HostTensor(wtype, {B, spec.s_q, H});
    p.index_k = HostTensor(DType::bf16, {B, spec.s_kv, D});
    p.topk_indices = HostTensor(DType::i32, {B, spec.s_q, K});
    p.attn_score = HostTensor(DType::f32, {B, spec.s_q, K});
    p.index_score = HostTensor(DType::f32, {B, spec.s_q, K});
  }

  const int threads = detail::thread_count(spec.num_threads, std::max(Tq, Tk));
  const double w_std = 1.0 / std::sqrt(static_cast<double>(H));

  // Keys: bf16 index_k (+ an fp32 copy for scoring), and main-attention keys.
  uint16_t* kdst = p.index_k.data<uint16_t>();
  std::vector<float> k32(static_cast<size_t>(Tk * D));
  std::vector<float> attn_k(static_cast<size_t>(Tk * kAttnHeads * kAttnDim));
  detail::parallel_for(threads, Tk, 64, [&](int64_t j, int) {
    Rng rng(spec.seed, kStreamK, static_cast<uint64_t>(j));
    for (int64_t d = 0; d < D; ++d) {
      const uint16_t h = float_to_bf16(static_cast<float>(rng.normal()));
      kdst[j * D + d] = h;
      k32[j * D + d] = bf16_to_float(h);
    }
    Rng arng(spec.seed, kStreamAttnK, static_cast<uint64_t>(j));
    for (int e = 0; e < kAttnHeads * kAttnDim; ++e) attn_k[j * kAttnHeads * kAttnDim + e] = static_cast<float>(arng.normal());
  });

  uint16_t* qdst = p.index_q.data<uint16_t>();
  int32_t* ids = p.topk_indices.data<int32_t>();
  float* tdst = p.attn_score.data<float>();
  float* pdst = p.index_score.data<float>();

  std::vector<RowScratch> scratch(static_cast<size_t>(threads));
  for (RowScratch& s : scratch) {
    s.q_t.resize(D * H);
    s.q_t64.resize(D * H);
    s.w.resize(H);
    s.w32.resize(H);
    s.x32.resize(H);
    s.x64.resize(H);
    // Every buffer a row can need, at its largest, here on the calling thread:
    // the workers then never allocate (an allocation failure in a worker
    // thread would terminate the process instead of raising out_of_memory).
    const auto selectable = static_cast<size_t>(std::min<int64_t>(K, seqs.max_k_len));
    s.sel.reserve(selectable);
    s.z.reserve(selectable);
    s.t.reserve(selectable);
    s.p.reserve(selectable);
    s.swaps.reserve(selectable);
    s.z_all.reserve(static_cast<size_t>(seqs.max_k_len));
    s.order.reserve(static_cast<size_t>(seqs.max_k_len));
    s.aq.resize(kAttnHeads * kAttnDim);
    if (spec.ids == IdPattern::random_permutation) {
      s.perm.resize(static_cast<size_t>(seqs.max_k_len));
      std::iota(s.perm.begin(), s.perm.end(), 0);
    }
  }

  detail::parallel_for(threads, Tq, 8, [&](int64_t r, int tid) {
    RowScratch& s = scratch[tid];
    const int64_t b = seqs.seq_of_q_row[r];
    const int64_t t = r - seqs.q_start[b];
    const int64_t k0 = seqs.k_start[b], kn = seqs.k_len[b];

    // q and w of this row.
    Rng qrng(spec.seed, kStreamQ, static_cast<uint64_t>(r));
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d) {
        const uint16_t v = float_to_bf16(static_cast<float>(qrng.normal()));
        qdst[(r * H + h) * D + d] = v;
        s.q_t[d * H + h] = bf16_to_float(v);
        s.q_t64[d * H + h] = bf16_to_float(v);
      }
    }
    Rng wrng(spec.seed, kStreamW, static_cast<uint64_t>(r));
    for (int64_t h = 0; h < H; ++h) {
      const float v = static_cast<float>(wrng.normal() * w_std);
      if (spec.weights_f32) {
        p.weights.data<float>()[r * H + h] = v;
        s.w[h] = v;
      } else {
        const uint16_t hv = float_to_bf16(v);
        p.weights.data<uint16_t>()[r * H + h] = hv;
        s.w[h] = bf16_to_float(hv);
      }
      s.w32[h] = static_cast<float>(s.w[h]);
    }

    // Selection (local key ids in s.sel).
    s.sel.clear();
    if (spec.ids == IdPattern::causal_topk) {
      const int64_t visible = std::clamp<int64_t>(t + (kn - seqs.q_len[b]) + 1, 0, kn);
      s.z_all.resize(static_cast<size_t>(visible));
      for (int64_t key = 0; key < visible; ++key) {
        const float* kr = &k32[(k0 + key) * D];
        std::fill(s.x32.begin(), s.x32.end(), 0.0f);
        for (int64_t d = 0; d < D; ++d) {
          const float kd = kr[d];
          const float* qd = &s.q_t[d * H];
          for (int64_t h = 0; h < H; ++h) s.x32[h] += qd[h] * kd;
        }
        float zz = 0;
        for (int64_t h = 0; h < H; ++h) zz += s.w32[h] * std::max(s.x32[h], 0.0f);
        s.z_all[key] = zz;  // sm_scale > 0 or < 0 flips the order: applied below
      }
      const float sign = sm_scale < 0 ? -1.0f : 1.0f;
      s.order.resize(static_cast<size_t>(visible));
      std::iota(s.order.begin(), s.order.end(), 0);
      auto better = [&](int32_t a, int32_t c) {
        const float za = sign * s.z_all[a], zc = sign * s.z_all[c];
        return za != zc ? za > zc : a < c;
      };
      const int64_t m = std::min(K, visible);
      if (m < visible) std::nth_element(s.order.begin(), s.order.begin() + m, s.order.end(), better);
      std::sort(s.order.begin(), s.order.begin() + m, better);
      for (int64_t i = 0; i < m; ++i) s.sel.push_back(s.order[i]);
    } else {
      Rng irng(spec.seed, kStreamIds, static_cast<uint64_t>(r));
      const int64_t m = std::min(K, kn);
      s.swaps.clear();
      for (int64_t i = 0; i < m; ++i) {  // partial Fisher-Yates on an identity array, undone below
        const int64_t j = i + static_cast<int64_t>(irng.below(static_cast<uint64_t>(kn - i)));
        std::swap(s.perm[i], s.perm[j]);
        s.swaps.emplace_back(i, j);
        s.sel.push_back(s.perm[i]);
      }
      for (auto it = s.swaps.rbegin(); it != s.swaps.rend(); ++it) std::swap(s.perm[it->first], s.perm[it->second]);
    }
    const int64_t nsel = static_cast<int64_t>(s.sel.size());
    const int64_t id_offset = spec.id_mode == IdMode::global ? k0 : 0;
    for (int64_t i = 0; i < K; ++i) ids[r * K + i] = i < nsel ? static_cast<int32_t>(s.sel[i] + id_offset) : -1;

    // index_score: softmax of the fp64 logits, summed in the reference's order
    // (x over d, then z over h, then times sm_scale).
    s.z.assign(static_cast<size_t>(nsel), 0.0);
    double zmax = -std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < nsel; ++i) {
      const float* kr = &k32[(k0 + s.sel[i]) * D];
      std::fill(s.x64.begin(), s.x64.end(), 0.0);
      for (int64_t d = 0; d < D; ++d) {
        const double kd = kr[d];
        const double* qd = &s.q_t64[d * H];
        for (int64_t h = 0; h < H; ++h) s.x64[h] += qd[h] * kd;
      }
      double zi = 0;
      for (int64_t h = 0; h < H; ++h) zi += s.w[h] * std::max(s.x64[h], 0.0);
      s.z[i] = sm_scale * zi;
      zmax = std::max(zmax, s.z[i]);
    }
    double sum = 0;
    for (int64_t i = 0; i < nsel; ++i) sum += (s.z[i] = std::exp(s.z[i] - zmax));
    for (int64_t i = 0; i < K; ++i) pdst[r * K + i] = i < nsel ? static_cast<float>(s.z[i] / sum) : 0.0f;

    // attn_score: main-attention heads, softmax per head over the valid slots.
    Rng arng(spec.seed, kStreamAttnQ, static_cast<uint64_t>(r));
    for (float& v : s.aq) v = static_cast<float>(arng.normal());
    s.t.assign(static_cast<size_t>(nsel), 0.0);
    s.p.resize(static_cast<size_t>(nsel));
    const double inv_sqrt_dim = 1.0 / std::sqrt(static_cast<double>(kAttnDim));
    for (int h = 0; h < kAttnHeads && nsel > 0; ++h) {
      double lmax = -std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < nsel; ++i) {
        const float* ak = &attn_k[((k0 + s.sel[i]) * kAttnHeads + h) * kAttnDim];
        double dot = 0;
        for (int e = 0; e < kAttnDim; ++e) dot += static_cast<double>(s.aq[h * kAttnDim + e]) * ak[e];
        s.p[i] = dot * inv_sqrt_dim;
        lmax = std::max(lmax, s.p[i]);
      }
      double hs = 0;
      for (int64_t i = 0; i < nsel; ++i) hs += (s.p[i] = std::exp(s.p[i] - lmax));
      for (int64_t i = 0; i < nsel; ++i) s.t[i] += s.p[i] / hs;
    }
    double tsum = 0;
    for (int64_t i = 0; i < nsel; ++i) tsum += s.t[i];
    for (int64_t i = 0; i < K; ++i) tdst[r * K + i] = i < nsel ? static_cast<float>(s.t[i] / tsum) : 0.0f;
  });
  return p;
}

GeneratedProblem generate_problem(const GenerateSpec& spec) {
  const detail::IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ must not change the problem (float_mode.hpp)
  // past the estimate: a cgroup or address-space limit sysinfo does not see
  return detail::allocation_failure_as_out_of_memory(
      "out of memory: expected room in host memory for the problem, got an allocation failure (a limit below "
      "the machine's memory and swap, e.g. a container's or ulimit -v)",
      [&] { return generate_problem_unguarded(spec); });
}

}  // namespace dsaib
