// The cuda attention target (label gpu) against the fp64 reference
// (dsaib::reference_attention_target, itself checked against the definition by
// tests/cpu/test_attention_target.cpp): Hq x Dqk 128 x 576, 64 x 192, 16 x 64,
// 48 x 128; BSHD and THD; local and global ids; -1 and out-of-range slots; a row
// without a valid slot; topk 1 and topk not a multiple of 64; lse natural and
// base 2, contiguous and transposed; normalize on and off; a CUDA-graph capture
// of a THD call; bitwise reproducibility; and without an lse (each head's lse
// over the row's selected keys: every kernel, THD, topk edges, logits beyond
// exp's range, rows without a valid slot). Every run first fills the output with
// NaN; each test draws fresh random inputs (its seed is printed on failure).
// Without a compute-capability-9.0 GPU every test is SKIPPED (never passed).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dsaib/attention_target.hpp"
#include "dsaib/host_tensor.hpp"
#include "gpu/device_problem.hpp"

namespace dsaib::test {
namespace {

// Accuracy against fp64 (fp32 accumulation): relative RMS over the output, and a
// per-element bound (U is a sum of positive terms, so each element's relative
// error is at most that of one term; below kAbsFloor elements compare absolutely).
constexpr double kRelRms = 1e-5, kElemRel = 1e-4, kAbsFloor = 1e-30;

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
double from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct TargetSpec {
  Layout layout = Layout::bshd;
  IdMode id_mode = IdMode::local;
  int64_t batch = 2, s_q = 16, s_kv = 300;     // bshd
  std::vector<int64_t> seqlens_q, seqlens_k;   // thd (batch = their count)
  int64_t heads = 64, dim = 192, topk = 100;
  LseBase lse_base = LseBase::natural;
  bool normalize = true;
  bool causal = false;          // ids of row t within keys 0..t (else the whole sequence)
  double invalid_share = 0.1;   // slots set to -1 or out of range
  bool empty_row = true;        // query row 1: no valid slot
  bool lse_transposed = false;  // lse a transposed view of (B, Hq, S_q) / (Hq, T_q) storage
  bool no_lse = false;          // lse absent: each head's lse over the row's valid slots (two sweeps)
  double scale_mul = 1.0;       // sm_scale times this (large: logits far beyond exp's range)
};

/// One problem on the host, with the lse of each row and head the log-sum-exp
/// over its valid slots plus an offset in [0, 1) (the main attention's lse also
/// counts keys that were not selected).
struct TargetProblem {
  TargetSpec s;
  uint64_t seed = 0;
  float sm_scale = 0;
  int64_t rows = 0, key_rows = 0;
  HostTensor query, kv, lse_storage, ids, cu_q, cu_k;
  std::vector<int64_t> lse_strides;  // of the (B, S_q, Hq) / (T_q, Hq) view over lse_storage

  std::vector<int64_t> lse_shape() const {
    return s.layout == Layout::thd ? std::vector<int64_t>{rows, s.heads}
                                   : std::vector<int64_t>{s.batch, s.s_q, s.heads};
  }
  TensorView lse_view(void* data, DeviceType dev) const {
    const std::vector<int64_t> shape = lse_shape();
    TensorView v = contiguous_view(data, DType::f32, shape.data(), static_cast<int32_t>(shape.size()), dev, 0);
    for (size_t i = 0; i < shape.size(); ++i) v.strides[i] = lse_strides[i];
    return v;
  }
  AttentionTargetOptions options(Backend backend) const {
    AttentionTargetOptions o;
    o.layout = s.layout;
    o.id_mode = s.id_mode;
    o.backend = backend;
    o.sm_scale = sm_scale;
    o.lse_base = s.lse_base;
    o.normalize = s.normalize;
    return o;
  }
  std::vector<int64_t> out_shape() const {
    return s.layout == Layout::thd ? std::vector<int64_t>{rows, s.topk} : std::vector<int64_t>{s.batch, s.s_q, s.topk};
  }
  AttentionTargetInputs host_inputs() const {
    AttentionTargetInputs in;
    in.query = query.view();
    in.kv = kv.view();
    if (!s.no_lse) in.lse = lse_view(const_cast<uint8_t*>(lse_storage.bytes.data()), DeviceType::cpu);
    in.topk_indices = ids.view();
    if (s.layout == Layout::thd) {
      in.cu_seqlens_q = cu_q.view();
      in.cu_seqlens_k = cu_k.view();
    }
    return in;
  }
};

TargetProblem make_target_problem(const TargetSpec& spec, uint64_t seed) {
  TargetProblem p;
  p.s = spec;
  p.seed = seed;
  const TargetSpec& s = p.s;
  const bool thd = s.layout == Layout::thd;
  const int64_t B = thd ? static_cast<int64_t>(s.seqlens_q.size()) : s.batch;
  std::vector<int64_t> q_start(B + 1, 0), k_start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    q_start[b + 1] = q_start[b] + (thd ? s.seqlens_q[b] : s.s_q);
    k_start[b + 1] = k_start[b] + (thd ? s.seqlens_k[b] : s.s_kv);
  }
  p.rows = q_start[B];
  p.key_rows = k_start[B];
  const int64_t H = s.heads, D = s.dim, K = s.topk;
  p.sm_scale = static_cast<float>(s.scale_mul * 1.1 / std::sqrt(static_cast<double>(D)));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> uni(0.0, 1.0);

  p.query = thd ? HostTensor(DType::bf16, {p.rows, H, D}) : HostTensor(DType::bf16, {B, s.s_q, H, D});
  p.kv = thd ? HostTensor(DType::bf16, {p.key_rows, D}) : HostTensor(DType::bf16, {B, s.s_kv, D});
  p.ids = thd ? HostTensor(DType::i32, {p.rows, K}) : HostTensor(DType::i32, {B, s.s_q, K});
  uint16_t* q = p.query.data<uint16_t>();
  uint16_t* kv = p.kv.data<uint16_t>();
  int32_t* ids = p.ids.data<int32_t>();
  for (int64_t i = 0; i < p.rows * H * D; ++i) q[i] = to_bf16(normal(rng));
  for (int64_t i = 0; i < p.key_rows * D; ++i) kv[i] = to_bf16(normal(rng));
  if (thd) {
    p.cu_q = HostTensor(DType::i32, {B + 1});
    p.cu_k = HostTensor(DType::i32, {B + 1});
    for (int64_t b = 0; b <= B; ++b) {
      p.cu_q.data<int32_t>()[b] = static_cast<int32_t>(q_start[b]);
      p.cu_k.data<int32_t>()[b] = static_cast<int32_t>(k_start[b]);
    }
  }

  // ids: per slot -1, out of range (past the sequence, or before it in global
  // mode), or a key of the row's window; duplicates allowed.
  std::vector<int64_t> key_row(p.rows * K, -1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t k_len = k_start[b + 1] - k_start[b];
    const int64_t base = s.id_mode == IdMode::global ? k_start[b] : 0;
    for (int64_t r = q_start[b]; r < q_start[b + 1]; ++r) {
      const int64_t t = r - q_start[b];
      const int64_t window = s.causal ? std::min(k_len, t + 1) : k_len;
      for (int64_t i = 0; i < K; ++i) {
        int64_t id = -1;
        const double u = uni(rng);
        if (window > 0 && !(s.empty_row && r == 1) && u >= s.invalid_share) {
          id = static_cast<int64_t>(uni(rng) * static_cast<double>(window));
          if (id >= window) id = window - 1;
          key_row[r * K + i] = k_start[b] + id;
          id += base;
        } else if (u < s.invalid_share / 3) {
          id = base + k_len + static_cast<int64_t>(uni(rng) * 5.0);  // past the sequence
        } else if (s.id_mode == IdMode::global && u < 2 * s.invalid_share / 3 && k_start[b] > 0) {
          id = k_start[b] - 1;  // the previous sequence's last key
        }
        ids[r * K + i] = static_cast<int32_t>(id);
      }
    }
  }

  // lse: fp64 log-sum-exp of the row's valid slots per head (of the bf16
  // values), plus an offset in [0, 1); 0 for a row without a valid slot.
  const bool base2 = s.lse_base == LseBase::base2;
  const double log2e = 1.4426950408889634073599246810019;
  std::vector<double> lse(p.rows * H, 0.0), qd(H * D), kd(D);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t i = 0; i < H * D; ++i) qd[i] = from_bf16(q[r * H * D + i]);
    std::vector<double> mx(H, -INFINITY), sum(H, 0.0);
    std::vector<double> logits;
    for (int64_t i = 0; i < K; ++i) {
      const int64_t j = key_row[r * K + i];
      if (j < 0) continue;
      for (int64_t d = 0; d < D; ++d) kd[d] = from_bf16(kv[j * D + d]);
      for (int64_t h = 0; h < H; ++h) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += qd[h * D + d] * kd[d];
        logits.push_back(p.sm_scale * dot * (base2 ? log2e : 1.0));
      }
    }
    const int64_t n = static_cast<int64_t>(logits.size()) / H;
    for (int64_t h = 0; h < H; ++h) {
      if (n == 0) continue;
      double m = -INFINITY, acc = 0;
      for (int64_t i = 0; i < n; ++i) m = std::max(m, logits[i * H + h]);
      for (int64_t i = 0; i < n; ++i) acc += base2 ? std::exp2(logits[i * H + h] - m) : std::exp(logits[i * H + h] - m);
      lse[r * H + h] = m + (base2 ? std::log2(acc) : std::log(acc)) + uni(rng);
    }
  }
  p.lse_storage = HostTensor(DType::f32, {p.rows * H});
  float* ls = p.lse_storage.data<float>();
  const int64_t S = thd ? p.rows : s.s_q;
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t b = r / S, t = r % S;
    for (int64_t h = 0; h < H; ++h) {
      // transposed: storage (B, Hq, S) / (Hq, T)
      const int64_t at = s.lse_transposed ? (b * H + h) * S + t : r * H + h;
      ls[at] = static_cast<float>(lse[r * H + h]);
    }
  }
  if (thd) p.lse_strides = s.lse_transposed ? std::vector<int64_t>{1, p.rows} : std::vector<int64_t>{H, 1};
  else p.lse_strides = s.lse_transposed ? std::vector<int64_t>{H * S, 1, S} : std::vector<int64_t>{S * H, H, 1};
  return p;
}

/// The problem's inputs on the device.
struct DeviceTarget {
  DeviceTensor query, kv, lse, ids, cu_q, cu_k, out;
  const TargetProblem& p;
  explicit DeviceTarget(const TargetProblem& prob)
      : query(prob.query),
        kv(prob.kv),
        lse(prob.lse_storage),
        ids(prob.ids),
        cu_q(prob.cu_q),  // empty (absent) for BSHD
        cu_k(prob.cu_k),
        out(DType::f32, prob.out_shape()),
        p(prob) {}
  AttentionTargetInputs inputs() const {
    AttentionTargetInputs in;
    in.query = query.view;
    in.kv = kv.view;
    if (!p.s.no_lse) in.lse = p.lse_view(lse.buffer.ptr, DeviceType::cuda);
    in.topk_indices = ids.view;
    if (p.s.layout == Layout::thd) {
      in.cu_seqlens_q = cu_q.view;
      in.cu_seqlens_k = cu_k.view;
    }
    return in;
  }
  AttentionTargetOutputs outputs() const { return {out.view}; }
  void poison() { out.fill_bytes(0xff); }  // NaN in every element
  /// Runs the cuda backend (output poisoned first) and returns the output.
  std::vector<float> run() {
    poison();
    attention_target(inputs(), outputs(), p.options(Backend::cuda));
    check_cuda(cudaDeviceSynchronize(), "attention_target");
    return host_out();
  }
  std::vector<float> host_out() const {
    const HostTensor h = out.to_host();
    return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
  }
};

struct Comparison {
  double rel_rms = 0, worst_excess = 0;  // worst |out - ref| / (kElemRel * |ref| + kAbsFloor)
  int64_t worst_at = -1, non_finite = 0, bad_zero = 0;
  bool ok() const { return non_finite == 0 && bad_zero == 0 && rel_rms <= kRelRms && worst_excess <= 1.0; }
};

Comparison compare_target(const std::vector<float>& out, const std::vector<double>& ref) {
  Comparison c;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = out[i];
    if (!std::isfinite(o)) {
      ++c.non_finite;
      continue;
    }
    if (ref[i] == 0.0 && (o != 0.0 || std::signbit(o))) ++c.bad_zero;  // exactly +0 where the reference is 0
    const double e = std::fabs(o - ref[i]);
    num += e * e;
    den += ref[i] * ref[i];
    const double excess = e / (kElemRel * std::fabs(ref[i]) + kAbsFloor);
    if (excess > c.worst_excess) {
      c.worst_excess = excess;
      c.worst_at = static_cast<int64_t>(i);
    }
  }
  c.rel_rms = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
  return c;
}

std::string describe(const Comparison& c, const std::vector<float>& out, const std::vector<double>& ref) {
  std::string s = "rel_rms " + std::to_string(c.rel_rms) + ", worst element excess " + std::to_string(c.worst_excess) +
                  ", non-finite " + std::to_string(c.non_finite) + ", nonzero at zeros " + std::to_string(c.bad_zero);
  if (c.worst_at >= 0) {
    s += " (element " + std::to_string(c.worst_at) + ": got " + std::to_string(out[c.worst_at]) + ", expected " +
         std::to_string(ref[c.worst_at]) + ")";
  }
  return s;
}

uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

/// Generates, runs on the GPU and checks against the reference; returns the output.
std::vector<float> check_case(const TargetSpec& spec, uint64_t seed) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  const TargetProblem p = make_target_problem(spec, seed);
  const ReferenceAttentionTarget ref = reference_attention_target(p.host_inputs(), p.options(Backend::cpu));
  DeviceTarget d(p);
  const std::vector<float> out = d.run();
  EXPECT_EQ(out.size(), ref.attn_score.size());
  const Comparison c = compare_target(out, ref.attn_score);
  EXPECT_TRUE(c.ok()) << describe(c, out, ref.attn_score);
  return out;
}

class AttentionTargetGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  }
};

TargetSpec shape(int64_t heads, int64_t dim, int64_t topk) {
  TargetSpec s;
  s.heads = heads;
  s.dim = dim;
  s.topk = topk;
  return s;
}

TargetSpec thd_spec(int64_t heads, int64_t dim, int64_t topk) {
  TargetSpec s = shape(heads, dim, topk);
  s.layout = Layout::thd;
  s.seqlens_q = {0, 9, 1, 14};
  s.seqlens_k = {7, 200, 0, 331};
  return s;
}

TEST_F(AttentionTargetGpu, DeepSeekShapeBshd) { check_case(shape(128, 576, 200), fresh_seed()); }
TEST_F(AttentionTargetGpu, SmallShapeBshd) { check_case(shape(64, 192, 300), fresh_seed()); }
TEST_F(AttentionTargetGpu, Heads16Dim64) { check_case(shape(16, 64, 130), fresh_seed()); }
TEST_F(AttentionTargetGpu, Heads48Dim128) { check_case(shape(48, 128, 64), fresh_seed()); }
TEST_F(AttentionTargetGpu, EveryHeadCountAndDim) {
  for (int64_t h = 16; h <= 128; h += 16) {
    for (int64_t d : {64, 256, 384, 512}) {
      SCOPED_TRACE("Hq " + std::to_string(h) + " Dqk " + std::to_string(d));
      TargetSpec s = shape(h, d, 70);
      s.batch = 1;
      s.s_q = 6;
      check_case(s, fresh_seed());
    }
  }
}

TEST_F(AttentionTargetGpu, ThdLocalAndGlobal) {
  for (IdMode mode : {IdMode::local, IdMode::global}) {
    for (auto [h, d] : {std::pair<int64_t, int64_t>{128, 576}, {64, 192}}) {
      SCOPED_TRACE(std::string(mode == IdMode::global ? "global" : "local") + " Hq " + std::to_string(h));
      TargetSpec s = thd_spec(h, d, 150);
      s.id_mode = mode;
      check_case(s, fresh_seed());
    }
  }
}

TEST_F(AttentionTargetGpu, GlobalIdsBshd) {
  TargetSpec s = shape(64, 192, 100);
  s.id_mode = IdMode::global;
  check_case(s, fresh_seed());
}

TEST_F(AttentionTargetGpu, Base2AndTransposedLse) {
  for (bool transposed : {false, true}) {
    for (Layout layout : {Layout::bshd, Layout::thd}) {
      SCOPED_TRACE(std::string(transposed ? "transposed" : "contiguous") + (layout == Layout::thd ? " thd" : " bshd"));
      TargetSpec s = layout == Layout::thd ? thd_spec(128, 576, 90) : shape(128, 576, 90);
      s.lse_base = LseBase::base2;
      s.lse_transposed = transposed;
      check_case(s, fresh_seed());
    }
  }
}

TEST_F(AttentionTargetGpu, Unnormalised) {
  for (auto [h, d] : {std::pair<int64_t, int64_t>{128, 576}, {32, 192}}) {
    TargetSpec s = shape(h, d, 190);
    s.normalize = false;
    check_case(s, fresh_seed());
    s.layout = Layout::thd;
    s.seqlens_q = {5, 11};
    s.seqlens_k = {400, 3};
    s.lse_base = LseBase::base2;
    check_case(s, fresh_seed());
  }
}

TEST_F(AttentionTargetGpu, TopkEdgesAndSlotChunks) {
  // topk 1, below and above a block, not a multiple of 64, and more than one
  // producer chunk of 1024 slots (with a causal window: rows with few keys).
  for (int64_t topk : {1, 63, 65, 1000, 2100}) {
    SCOPED_TRACE("topk " + std::to_string(topk));
    TargetSpec s = shape(64, 192, topk);
    s.s_kv = 2500;
    s.s_q = 5;
    check_case(s, fresh_seed());
  }
  TargetSpec full = shape(128, 576, 2048);  // the DeepSeek-V3.2 row: two chunks of 16 blocks
  full.batch = 1;
  full.s_q = 3;
  full.s_kv = 3000;
  full.invalid_share = 0.02;
  full.empty_row = false;
  check_case(full, fresh_seed());
  TargetSpec causal = shape(64, 192, 2048);  // rows with 1 to 40 keys
  causal.batch = 1;
  causal.s_q = 40;
  causal.s_kv = 3000;
  causal.causal = true;
  causal.invalid_share = 0.0;
  check_case(causal, fresh_seed());
}

TEST_F(AttentionTargetGpu, NoValidSlotAnywhere) {
  TargetSpec s = shape(64, 128, 80);
  s.invalid_share = 1.0;
  for (bool normalize : {true, false}) {
    s.normalize = normalize;
    const std::vector<float> out = check_case(s, fresh_seed());
    for (float v : out) ASSERT_TRUE(v == 0.0f && !std::signbit(v));
  }
}

TEST_F(AttentionTargetGpu, BitwiseReproducible) {
  for (auto [h, d] : {std::pair<int64_t, int64_t>{128, 576}, {64, 192}}) {
    TargetSpec s = shape(h, d, 700);
    s.s_q = 64;
    s.s_kv = 1500;
    const TargetProblem p = make_target_problem(s, fresh_seed());
    DeviceTarget dev(p);
    const std::vector<float> a = dev.run(), b = dev.run();
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "Hq " << h;
  }
}

// ---- without an lse: each head's lse over the row's valid slots, computed by the
//      kernel's first sweep (the reference computes it in fp64, max-shifted)

TEST_F(AttentionTargetGpu, NoLseEveryKernel) {
  // both head paddings and both slice counts, normalised and not
  for (auto [h, d, k] : {std::tuple<int64_t, int64_t, int64_t>{128, 576, 200}, {64, 192, 300}, {16, 64, 130},
                         {48, 128, 64}, {128, 192, 150}, {64, 576, 90}}) {
    for (bool normalize : {true, false}) {
      SCOPED_TRACE("Hq " + std::to_string(h) + " Dqk " + std::to_string(d) + (normalize ? " normalised" : ""));
      TargetSpec s = shape(h, d, k);
      s.no_lse = true;
      s.normalize = normalize;
      const std::vector<float> out = check_case(s, fresh_seed());
      if (!normalize) {
        // U of a row with a valid slot sums to Hq: each head's softmax over the slots sums to 1
        double row0 = 0;
        for (int64_t i = 0; i < k; ++i) row0 += out[i];
        EXPECT_NEAR(row0, static_cast<double>(h), 1e-4 * h);
      }
    }
  }
}

TEST_F(AttentionTargetGpu, NoLseThdAndTopkEdges) {
  for (IdMode mode : {IdMode::local, IdMode::global}) {
    TargetSpec s = thd_spec(64, 192, 300);
    s.id_mode = mode;
    s.no_lse = true;
    check_case(s, fresh_seed());
  }
  // topk 1, not a multiple of 64, more than one chunk of 1024 slots, more than
  // the 2048 slots U keeps in shared memory; rows with few keys (causal)
  for (int64_t topk : {1, 65, 1000, 2100}) {
    SCOPED_TRACE("topk " + std::to_string(topk));
    TargetSpec s = shape(64, 192, topk);
    s.s_kv = 2500;
    s.s_q = 5;
    s.no_lse = true;
    check_case(s, fresh_seed());
  }
  TargetSpec full = shape(128, 576, 2048);
  full.batch = 1;
  full.s_q = 3;
  full.s_kv = 3000;
  full.invalid_share = 0.02;
  full.no_lse = true;
  check_case(full, fresh_seed());
  TargetSpec causal = shape(128, 576, 2048);
  causal.batch = 1;
  causal.s_q = 40;
  causal.s_kv = 3000;
  causal.causal = true;
  causal.invalid_share = 0.0;
  causal.no_lse = true;
  check_case(causal, fresh_seed());
}

TEST_F(AttentionTargetGpu, NoLseLargeLogitsNoValidSlotAndReproducible) {
  // sm_scale x 40: |logits| in the hundreds, beyond exp's range without the max
  // shift. fp32 logits of that size carry ~1e-5 absolute error each, so the
  // bounds are 20x and 10x the usual ones; NaN, inf and wrong zeros still fail.
  for (auto [h, d] : {std::pair<int64_t, int64_t>{128, 576}, {64, 192}}) {
    TargetSpec s = shape(h, d, 300);
    s.no_lse = true;
    s.scale_mul = 40.0;
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    const TargetProblem p = make_target_problem(s, seed);
    const ReferenceAttentionTarget ref = reference_attention_target(p.host_inputs(), p.options(Backend::cpu));
    DeviceTarget dev(p);
    const std::vector<float> out = dev.run();
    const Comparison c = compare_target(out, ref.attn_score);
    EXPECT_EQ(c.non_finite, 0) << describe(c, out, ref.attn_score);
    EXPECT_EQ(c.bad_zero, 0) << describe(c, out, ref.attn_score);
    EXPECT_LE(c.rel_rms, 20 * kRelRms) << describe(c, out, ref.attn_score);
    EXPECT_LE(c.worst_excess, 10.0) << describe(c, out, ref.attn_score);
  }
  TargetSpec none = shape(64, 128, 80);
  none.invalid_share = 1.0;
  none.no_lse = true;
  for (bool normalize : {true, false}) {
    none.normalize = normalize;
    const std::vector<float> out = check_case(none, fresh_seed());
    for (float v : out) ASSERT_TRUE(v == 0.0f && !std::signbit(v));
  }
  TargetSpec s = shape(128, 576, 700);
  s.s_q = 64;
  s.s_kv = 1500;
  s.no_lse = true;
  const TargetProblem p = make_target_problem(s, fresh_seed());
  DeviceTarget dev(p);
  const std::vector<float> a = dev.run(), b = dev.run();
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

TEST_F(AttentionTargetGpu, ThdCapturedInCudaGraph) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const TargetProblem p = make_target_problem(thd_spec(128, 576, 120), seed);
  const ReferenceAttentionTarget ref = reference_attention_target(p.host_inputs(), p.options(Backend::cpu));
  DeviceTarget d(p);
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  AttentionTargetOptions opt = p.options(Backend::cuda);
  opt.stream = stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
  attention_target(d.inputs(), d.outputs(), opt);
  check_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  for (int replay = 0; replay < 2; ++replay) {
    d.poison();
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check_cuda(cudaStreamSynchronize(stream), "graph replay");
    const std::vector<float> out = d.host_out();
    const Comparison c = compare_target(out, ref.attn_score);
    EXPECT_TRUE(c.ok()) << "replay " << replay << ": " << describe(c, out, ref.attn_score);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The checker itself: a perturbed element, a NaN and a -0 at a zero must fail it.
TEST(AttentionTargetCompare, FlagsErrors) {
  const std::vector<double> ref = {0.25, 0.5, 0.0, 0.25};
  std::vector<float> out = {0.25f, 0.5f, 0.0f, 0.25f};
  EXPECT_TRUE(compare_target(out, ref).ok());
  out[1] = 0.5f * (1 + 3e-4f);
  EXPECT_FALSE(compare_target(out, ref).ok());
  out[1] = NAN;
  EXPECT_FALSE(compare_target(out, ref).ok());
  out[1] = 0.5f;
  out[2] = -0.0f;
  EXPECT_FALSE(compare_target(out, ref).ok());
}

// The sanitizer's cases (tests/sanitizer/run_sanitizer.sh runs Sanitized.*):
// both kernels (64 and 128 heads), BSHD and THD, normalised and not, small.
TEST(Sanitized, AttentionTargetEveryKernel) {
  if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  TargetSpec a = shape(128, 576, 140);
  a.batch = 1;
  a.s_q = 6;
  check_case(a, fresh_seed());
  TargetSpec b = thd_spec(48, 192, 70);
  b.normalize = false;
  check_case(b, fresh_seed());
}

}  // namespace
}  // namespace dsaib::test
