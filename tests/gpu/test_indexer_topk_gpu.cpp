// The cuda indexer_topk (label gpu) judged by check_indexer_topk, the fp64
// reference's checker (itself tested against the definition on the cpu):
// H 8, 32, 64, 128 and D 64, 128; BSHD causal (auto and explicit offsets) and
// THD with cu_seqlens; starts/ends as a context-parallel shard's rows against
// all-gathered keys, and clipped and empty ranges; exact ties; rows seeing fewer
// keys than topk; topk 1 to 8192; S_kv 262144; key offsets beyond 2^31
// elements; sequence-first index_q and weights; both orders and id modes;
// logits and lengths present and absent; a NaN in one row of index_q; bitwise
// determinism; CUDA-graph capture of a BSHD and a THD call; a caller's
// workspace. Every run first poisons the outputs
// (ids 0x7f7f7f7f, logits NaN, lengths 0x7f7f7f7f); each test draws fresh
// random inputs (its seed is printed on failure). Without a compute-capability
// 9.0 GPU every GPU test is SKIPPED (never passed).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dsaib/host_tensor.hpp"
#include "dsaib/indexer_topk.hpp"
#include "gpu/device_problem.hpp"

namespace dsaib::test {
namespace {

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// How a row's visible keys are given.
enum class Ranges {
  causal,       // no starts/ends: options.causal_offset (auto or explicit)
  second_half,  // starts/ends: the rows are the last S_q positions of each sequence (a shard of a split in two)
  zigzag,       // starts/ends: the rows are chunks 0 and 3 of four (context-parallel rank 0 of 2, load-balanced)
  clipped,      // starts/ends: random ranges, many reaching outside the sequence, some empty
};

struct TopkSpec {
  Layout layout = Layout::bshd;
  IdMode id_mode = IdMode::local;
  TopkOrder order = TopkOrder::logit_descending;
  int64_t batch = 2, s_q = 24, s_kv = 300;    // bshd
  std::vector<int64_t> seqlens_q, seqlens_k;  // thd (batch = their count)
  int64_t heads = 64, dim = 128, topk = 100;
  Ranges ranges = Ranges::causal;
  int64_t causal_offset = kCausalOffsetAuto;
  DType weights_dtype = DType::bf16;
  bool with_logits = true, with_lengths = true;
  std::vector<int64_t> zero_weight_rows;  // flat query rows whose weights are all 0 (every logit exactly 0)
  bool negated_rows = false;              // keys >= 0, odd rows' index_q <= 0: every ReLU of those rows 0
  std::vector<int64_t> nan_rows;          // flat query rows with one NaN in index_q
  int64_t k_row_stride = 0;               // device index_k's row stride in elements (0: D, contiguous)
  bool seq_first = false;                 // bshd: device index_q and weights as views of (S_q, B, ...) storage
};

/// One problem on the host (index_k compact), with its device copies.
struct TopkProblem {
  TopkSpec s;
  uint64_t seed = 0;
  int64_t rows = 0, key_rows = 0, B = 0;
  std::vector<int64_t> q_start, k_start;
  HostTensor index_q, weights, index_k, starts, ends, cu_q, cu_k;

  bool thd() const { return s.layout == Layout::thd; }
  bool ranged() const { return s.ranges != Ranges::causal; }
  std::vector<int64_t> out_shape() const {
    return thd() ? std::vector<int64_t>{rows, s.topk} : std::vector<int64_t>{s.batch, s.s_q, s.topk};
  }
  std::vector<int64_t> row_shape() const {
    return thd() ? std::vector<int64_t>{rows} : std::vector<int64_t>{s.batch, s.s_q};
  }
  IndexerTopkOptions options(Backend backend) const {
    IndexerTopkOptions o;
    o.layout = s.layout;
    o.id_mode = s.id_mode;
    o.backend = backend;
    o.order = s.order;
    o.causal_offset = s.causal_offset;
    return o;
  }
  IndexerTopkInputs host_inputs() const {
    IndexerTopkInputs in;
    in.index_q = index_q.view();
    in.weights = weights.view();
    in.index_k = index_k.view();
    if (ranged()) {
      in.starts = starts.view();
      in.ends = ends.view();
    }
    if (thd()) {
      in.cu_seqlens_q = cu_q.view();
      in.cu_seqlens_k = cu_k.view();
    }
    return in;
  }
};

TopkProblem make_problem(const TopkSpec& spec, uint64_t seed) {
  TopkProblem p;
  p.s = spec;
  p.seed = seed;
  const TopkSpec& s = p.s;
  const bool thd = s.layout == Layout::thd;
  const int64_t B = thd ? static_cast<int64_t>(s.seqlens_q.size()) : s.batch;
  p.B = B;
  p.q_start.assign(B + 1, 0);
  p.k_start.assign(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    p.q_start[b + 1] = p.q_start[b] + (thd ? s.seqlens_q[b] : s.s_q);
    p.k_start[b + 1] = p.k_start[b] + (thd ? s.seqlens_k[b] : s.s_kv);
  }
  p.rows = p.q_start[B];
  p.key_rows = p.k_start[B];
  const int64_t H = s.heads, D = s.dim;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> uni(0.0, 1.0);

  p.index_q = thd ? HostTensor(DType::bf16, {p.rows, H, D}) : HostTensor(DType::bf16, {B, s.s_q, H, D});
  p.weights = thd ? HostTensor(s.weights_dtype, {p.rows, H}) : HostTensor(s.weights_dtype, {B, s.s_q, H});
  p.index_k = thd ? HostTensor(DType::bf16, {p.key_rows, D}) : HostTensor(DType::bf16, {B, s.s_kv, D});
  uint16_t* q = p.index_q.data<uint16_t>();
  uint16_t* k = p.index_k.data<uint16_t>();
  for (int64_t i = 0; i < p.rows * H * D; ++i) q[i] = to_bf16(normal(rng));
  for (int64_t i = 0; i < p.key_rows * D; ++i) {
    const float v = normal(rng);
    k[i] = to_bf16(s.negated_rows ? std::fabs(v) : v);
  }
  if (s.negated_rows) {
    for (int64_t r = 1; r < p.rows; r += 2) {
      for (int64_t i = 0; i < H * D; ++i) q[r * H * D + i] = to_bf16(-std::fabs(from_bf16(q[r * H * D + i])));
    }
  }
  // Weights ~ N(0, 1/H), some negative: I need not be monotone in any head.
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(H));
  for (int64_t i = 0; i < p.rows * H; ++i) {
    const float w = normal(rng) * w_scale;
    if (s.weights_dtype == DType::f32) p.weights.data<float>()[i] = w;
    else p.weights.data<uint16_t>()[i] = to_bf16(w);
  }
  for (int64_t r : s.zero_weight_rows) {
    for (int64_t h = 0; h < H; ++h) {
      if (s.weights_dtype == DType::f32) p.weights.data<float>()[r * H + h] = 0.0f;
      else p.weights.data<uint16_t>()[r * H + h] = 0;
    }
  }
  for (int64_t r : s.nan_rows) {
    const int64_t h = static_cast<int64_t>(uni(rng) * H) % H, d = static_cast<int64_t>(uni(rng) * D) % D;
    q[(r * H + h) * D + d] = 0x7fc0;  // bf16 quiet NaN
  }
  if (thd) {
    p.cu_q = HostTensor(DType::i32, {B + 1});
    p.cu_k = HostTensor(DType::i32, {B + 1});
    for (int64_t b = 0; b <= B; ++b) {
      p.cu_q.data<int32_t>()[b] = static_cast<int32_t>(p.q_start[b]);
      p.cu_k.data<int32_t>()[b] = static_cast<int32_t>(p.k_start[b]);
    }
  }
  if (p.ranged()) {
    p.starts = HostTensor(DType::i32, p.row_shape());
    p.ends = HostTensor(DType::i32, p.row_shape());
    int32_t* st = p.starts.data<int32_t>();
    int32_t* en = p.ends.data<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t nq = p.q_start[b + 1] - p.q_start[b], nk = p.k_start[b + 1] - p.k_start[b];
      const int64_t base = thd ? p.k_start[b] : 0;  // THD ranges are flat rows of index_k
      for (int64_t t = 0; t < nq; ++t) {
        const int64_t r = p.q_start[b] + t;
        int64_t lo = 0, hi = 0;
        if (s.ranges == Ranges::second_half) {
          lo = 0;
          hi = nk - nq + t + 1;
        } else if (s.ranges == Ranges::zigzag) {
          // rank 0 of 2 holds chunks 0 and 3 of four chunks of nk / 4 positions; nq = nk / 2
          const int64_t chunk = nk / 4;
          const int64_t pos = t < chunk ? t : 3 * chunk + (t - chunk);
          lo = 0;
          hi = pos + 1;
        } else {  // clipped: outside the sequence on either side, or empty
          lo = static_cast<int64_t>(uni(rng) * static_cast<double>(nk + 40)) - 20;
          hi = lo + static_cast<int64_t>(uni(rng) * static_cast<double>(nk + 40)) - 5;
        }
        st[r] = static_cast<int32_t>(base + lo);
        en[r] = static_cast<int32_t>(base + hi);
      }
    }
  }
  return p;
}

int64_t key_row_stride(const TopkProblem& p) { return p.s.k_row_stride > 0 ? p.s.k_row_stride : p.s.dim; }
std::size_t key_bytes(const TopkProblem& p) {
  return p.key_rows > 0 ? static_cast<std::size_t>((p.key_rows - 1) * key_row_stride(p) + p.s.dim) * 2 : 0;
}

/// BSHD index_q (B, S, H, D) or weights (B, S, H) reordered to sequence-first
/// storage (S, B, ...), as Megatron keeps them; `inner` elements per (b, s).
HostTensor sequence_first(const HostTensor& t, int64_t inner) {
  const int64_t B = t.shape[0], S = t.shape[1];
  const std::size_t es = dtype_size(t.dtype), row = static_cast<std::size_t>(inner) * es;
  HostTensor out(t.dtype, {S, B, inner});
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      std::memcpy(out.bytes.data() + (s * B + b) * row, t.bytes.data() + (b * S + s) * row, row);
    }
  }
  return out;
}

/// The problem's inputs and the outputs on the device.
struct DeviceTopk {
  const TopkProblem& p;
  DeviceTensor index_q, weights, starts, ends, cu_q, cu_k, ids, logits, lengths;
  DeviceBuffer key_storage;  // index_k, rows k_row_stride elements apart
  TensorView index_k;
  explicit DeviceTopk(const TopkProblem& prob)
      : p(prob),
        index_q(prob.s.seq_first ? sequence_first(prob.index_q, prob.s.heads * prob.s.dim) : prob.index_q),
        weights(prob.s.seq_first ? sequence_first(prob.weights, prob.s.heads) : prob.weights),
        starts(prob.starts), ends(prob.ends), cu_q(prob.cu_q),
        cu_k(prob.cu_k), ids(DType::i32, prob.out_shape()), logits(DType::f32, prob.out_shape()),
        lengths(DType::i32, prob.row_shape()), key_storage(key_bytes(prob)) {
    const int64_t D = p.s.dim, rs = key_row_stride(p);
    if (p.key_rows > 0) {
      check_cuda(cudaMemcpy2D(key_storage.ptr, static_cast<std::size_t>(rs) * 2, p.index_k.bytes.data(),
                              static_cast<std::size_t>(D) * 2, static_cast<std::size_t>(D) * 2,
                              static_cast<std::size_t>(p.key_rows), cudaMemcpyHostToDevice),
                 "cudaMemcpy2D (index_k)");
    }
    const std::vector<int64_t>& shape = p.index_k.shape;
    index_k = contiguous_view(key_storage.ptr, DType::bf16, shape.data(), static_cast<int32_t>(shape.size()),
                              DeviceType::cuda, 0);
    if (p.thd()) {
      index_k.strides[0] = rs;
    } else {
      index_k.strides[1] = rs;
      index_k.strides[0] = rs * p.s.s_kv;
    }
  }
  IndexerTopkInputs inputs() const {
    IndexerTopkInputs in;
    in.index_q = index_q.view;
    in.weights = weights.view;
    if (p.s.seq_first) {  // (B, S_q, ...) views of the (S_q, B, ...) storage: Megatron's x.transpose(0, 1)
      in.index_q = contiguous_view(index_q.buffer.ptr, DType::bf16, p.index_q.shape.data(), 4, DeviceType::cuda, 0);
      in.index_q.strides[0] = p.s.heads * p.s.dim;
      in.index_q.strides[1] = p.s.batch * p.s.heads * p.s.dim;
      in.weights = contiguous_view(weights.buffer.ptr, p.weights.dtype, p.weights.shape.data(), 3, DeviceType::cuda, 0);
      in.weights.strides[0] = p.s.heads;
      in.weights.strides[1] = p.s.batch * p.s.heads;
    }
    in.index_k = index_k;
    if (p.ranged()) {
      in.starts = starts.view;
      in.ends = ends.view;
    }
    if (p.thd()) {
      in.cu_seqlens_q = cu_q.view;
      in.cu_seqlens_k = cu_k.view;
    }
    return in;
  }
  IndexerTopkOutputs outputs(bool with_logits, bool with_lengths) const {
    IndexerTopkOutputs o;
    o.topk_indices = ids.view;
    if (with_logits) o.topk_logits = logits.view;
    if (with_lengths) o.topk_lengths = lengths.view;
    return o;
  }
  IndexerTopkOutputs outputs() const { return outputs(p.s.with_logits, p.s.with_lengths); }
  void poison() {
    ids.fill_bytes(0x7f);
    logits.fill_bytes(0xff);  // NaN
    lengths.fill_bytes(0x7f);
  }
};

/// Host copies of a run's outputs (the absent ones empty).
struct TopkResult {
  HostTensor ids, logits, lengths;
  IndexerTopkOutputs views() const {
    IndexerTopkOutputs o;
    o.topk_indices = ids.view();
    if (!logits.empty()) o.topk_logits = logits.view();
    if (!lengths.empty()) o.topk_lengths = lengths.view();
    return o;
  }
};

TopkResult copy_back(const DeviceTopk& d, bool with_logits, bool with_lengths) {
  TopkResult r;
  r.ids = d.ids.to_host();
  if (with_logits) r.logits = d.logits.to_host();
  if (with_lengths) r.lengths = d.lengths.to_host();
  return r;
}

/// Poisons, runs the cuda backend on `stream` with the given optional outputs (and
/// workspace), synchronises and copies back.
TopkResult run(DeviceTopk& d, bool with_logits, bool with_lengths, void* workspace = nullptr,
               std::size_t workspace_bytes = 0, cudaStream_t stream = nullptr) {
  d.poison();
  check_cuda(cudaDeviceSynchronize(), "poison");
  IndexerTopkOptions opt = d.p.options(Backend::cuda);
  opt.stream = stream;
  indexer_topk(d.inputs(), d.outputs(with_logits, with_lengths), opt, workspace, workspace_bytes);
  check_cuda(cudaDeviceSynchronize(), "indexer_topk");
  return copy_back(d, with_logits, with_lengths);
}
TopkResult run(DeviceTopk& d) { return run(d, d.p.s.with_logits, d.p.s.with_lengths); }

/// The checker's verdict on a result; EXPECTs a pass.
void expect_checked(const TopkProblem& p, const TopkResult& r, const std::string& what = "") {
  const TopkCheck c = check_indexer_topk(p.host_inputs(), p.options(Backend::cpu), r.views());
  EXPECT_TRUE(c.pass) << what << (what.empty() ? "" : ": ") << c.first_failure << " (rows " << c.rows
                      << ", exchanged ids " << c.exchanged_ids << ", max logit error " << c.max_logit_error
                      << " bounds)";
  EXPECT_EQ(c.rows, p.rows);
}

uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

/// Generates, runs on the GPU and checks; returns the result.
TopkResult check_case(const TopkSpec& spec, uint64_t seed) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  const TopkProblem p = make_problem(spec, seed);
  DeviceTopk d(p);
  const TopkResult r = run(d);
  expect_checked(p, r);
  return r;
}

/// Rows whose selection is fully determined by the id rule (every logit exactly
/// equal: the ties of zero weights, of all-zero ReLUs, of NaNs) must equal the
/// reference's bit for bit, ids and (given) logits, NaN as NaN.
void expect_rows_equal_reference(const TopkProblem& p, const TopkResult& r, const std::vector<int64_t>& rows) {
  const ReferenceTopk ref = reference_indexer_topk(p.host_inputs(), p.options(Backend::cpu), p.s.topk);
  const int64_t K = p.s.topk;
  const int32_t* ids = r.ids.data<int32_t>();
  for (int64_t row : rows) {
    ASSERT_GT(ref.topk_lengths[row], 0) << "row " << row << " sees no key: the test needs one that does";
    for (int64_t i = 0; i < K; ++i) {
      ASSERT_EQ(ids[row * K + i], ref.topk_indices[row * K + i]) << "row " << row << " slot " << i;
      if (r.logits.empty()) continue;
      const double got = r.logits.data<float>()[row * K + i], want = ref.topk_logits[row * K + i];
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << "row " << row << " slot " << i << ": expected NaN, got " << got;
      } else {
        ASSERT_EQ(got, want) << "row " << row << " slot " << i;
      }
    }
    if (!r.lengths.empty()) ASSERT_EQ(r.lengths.data<int32_t>()[row], ref.topk_lengths[row]) << "row " << row;
  }
}

class IndexerTopkGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  }
};

TopkSpec shape(int64_t heads, int64_t dim, int64_t topk) {
  TopkSpec s;
  s.heads = heads;
  s.dim = dim;
  s.topk = topk;
  return s;
}

TopkSpec thd_spec(int64_t heads, int64_t dim, int64_t topk) {
  TopkSpec s = shape(heads, dim, topk);
  s.layout = Layout::thd;
  // An empty query sequence, a sequence without keys, one of a single row, longer ones.
  s.seqlens_q = {0, 9, 1, 14, 30};
  s.seqlens_k = {7, 200, 0, 331, 30};
  return s;
}

TEST_F(IndexerTopkGpu, EveryHeadCountAndDim) {
  for (int64_t d : {128, 64}) {
    for (int64_t h : {64, 32, 128, 8}) {
      SCOPED_TRACE("H " + std::to_string(h) + " D " + std::to_string(d));
      check_case(shape(h, d, 100), fresh_seed());
    }
  }
  for (int64_t h : {16, 24, 40, 96, 120}) {  // head counts padded within a head tile
    SCOPED_TRACE("H " + std::to_string(h));
    TopkSpec s = shape(h, 128, 64);
    s.batch = 1;
    check_case(s, fresh_seed());
  }
}

TEST_F(IndexerTopkGpu, CausalExplicitOffsets) {
  // 0: the diagonal; positive: rows see keys past their position; negative: the
  // first rows see nothing (empty), later ones fewer keys than topk.
  for (int64_t offset : {int64_t{0}, int64_t{7}, int64_t{-3}, int64_t{-250}, int64_t{1} << 40}) {
    SCOPED_TRACE("causal_offset " + std::to_string(offset));
    TopkSpec s = shape(64, 128, 64);
    s.s_q = 40;
    s.s_kv = 200;
    s.causal_offset = offset;
    check_case(s, fresh_seed());
  }
}

TEST_F(IndexerTopkGpu, ThdCuSeqlens) {
  for (IdMode mode : {IdMode::local, IdMode::global}) {
    for (auto [h, d] : {std::pair<int64_t, int64_t>{64, 128}, {32, 64}, {128, 128}, {8, 64}}) {
      SCOPED_TRACE(std::string(mode == IdMode::global ? "global" : "local") + " H " + std::to_string(h) + " D " +
                   std::to_string(d));
      TopkSpec s = thd_spec(h, d, 50);
      s.id_mode = mode;
      check_case(s, fresh_seed());
    }
  }
  TopkSpec offset = thd_spec(64, 128, 20);  // an explicit offset applies to every sequence
  offset.causal_offset = 2;
  check_case(offset, fresh_seed());
}

TEST_F(IndexerTopkGpu, ContextParallelShard) {
  // BSHD: the rows of the second half of each sequence, and a zigzag rank's rows,
  // against all the (all-gathered) keys.
  for (Ranges ranges : {Ranges::second_half, Ranges::zigzag}) {
    for (IdMode mode : {IdMode::local, IdMode::global}) {
      SCOPED_TRACE(std::string(ranges == Ranges::zigzag ? "zigzag" : "second half") +
                   (mode == IdMode::global ? " global" : " local"));
      TopkSpec s = shape(64, 128, 256);
      s.ranges = ranges;
      s.id_mode = mode;
      s.s_kv = 1024;
      s.s_q = 512;
      check_case(s, fresh_seed());
    }
  }
  // THD: each sequence's second half of rows, ranges in flat rows of the keys.
  TopkSpec t = shape(32, 128, 128);
  t.layout = Layout::thd;
  t.seqlens_q = {100, 3, 400};
  t.seqlens_k = {200, 6, 800};
  t.ranges = Ranges::second_half;
  for (IdMode mode : {IdMode::local, IdMode::global}) {
    t.id_mode = mode;
    check_case(t, fresh_seed());
  }
  t.ranges = Ranges::zigzag;
  check_case(t, fresh_seed());
}

TEST_F(IndexerTopkGpu, ClippedAndEmptyRanges) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    for (TopkOrder order : {TopkOrder::logit_descending, TopkOrder::id_ascending}) {
      SCOPED_TRACE(std::string(layout == Layout::thd ? "thd" : "bshd") + " " + topk_order_name(order));
      TopkSpec s = layout == Layout::thd ? thd_spec(64, 128, 70) : shape(64, 128, 70);
      s.ranges = Ranges::clipped;
      s.order = order;
      check_case(s, fresh_seed());
    }
  }
}

TEST_F(IndexerTopkGpu, ExactTiesGoByIdAscending) {
  // Zero weights: every logit of those rows is exactly 0; negated index_q against
  // non-negative keys: every ReLU of the odd rows is 0. The selection is then the
  // first topk visible ids, logits 0.
  for (TopkOrder order : {TopkOrder::logit_descending, TopkOrder::id_ascending}) {
    for (Layout layout : {Layout::bshd, Layout::thd}) {
      SCOPED_TRACE(std::string(topk_order_name(order)) + (layout == Layout::thd ? " thd" : " bshd"));
      const uint64_t seed = fresh_seed();
      SCOPED_TRACE("seed " + std::to_string(seed));
      TopkSpec s = layout == Layout::thd ? thd_spec(64, 128, 64) : shape(64, 128, 64);
      s.order = order;
      if (layout == Layout::thd) {
        s.seqlens_q = {40, 30};
        s.seqlens_k = {300, 250};
      } else {
        s.s_q = 40;
        s.s_kv = 300;
      }
      s.zero_weight_rows = {0, 5, 38, 60};
      s.negated_rows = true;
      const TopkProblem p = make_problem(s, seed);
      DeviceTopk d(p);
      const TopkResult r = run(d);
      expect_checked(p, r);
      std::vector<int64_t> tie_rows = s.zero_weight_rows;
      for (int64_t row = 1; row < p.rows; row += 2) tie_rows.push_back(row);
      expect_rows_equal_reference(p, r, tie_rows);
    }
  }
}

TEST_F(IndexerTopkGpu, FewerKeysThanTopkAndEmptyRows) {
  // Every row sees fewer keys than topk (some none): -1 padding, the counts, -inf logits.
  TopkSpec s = shape(64, 128, 2048);
  s.s_q = 30;
  s.s_kv = 300;
  s.causal_offset = -5;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const TopkProblem p = make_problem(s, seed);
  DeviceTopk d(p);
  const TopkResult r = run(d);
  expect_checked(p, r);
  const int64_t K = s.topk;
  for (int64_t row = 0; row < p.rows; ++row) {
    const int64_t t = row % s.s_q, count = std::max<int64_t>(0, t - 5 + 1);
    ASSERT_EQ(r.lengths.data<int32_t>()[row], count) << "row " << row;
    for (int64_t i = count; i < K; ++i) {
      ASSERT_EQ(r.ids.data<int32_t>()[row * K + i], -1) << "row " << row << " slot " << i;
      const float l = r.logits.data<float>()[row * K + i];
      ASSERT_TRUE(std::isinf(l) && l < 0) << "row " << row << " slot " << i << ": " << l;
    }
  }
  check_case(thd_spec(32, 64, 1000), fresh_seed());  // THD: an empty sequence, one without keys
}

TEST_F(IndexerTopkGpu, TopkSizes) {
  for (int64_t topk : {1, 64, 100, 2048, 8192}) {
    SCOPED_TRACE("topk " + std::to_string(topk));
    TopkSpec s = shape(64, 128, topk);
    s.batch = 1;
    s.s_q = 12;
    s.s_kv = 12000;  // more keys than topk in every row: the candidate buffers are cut
    check_case(s, fresh_seed());
  }
  TopkSpec d64 = shape(32, 64, 8192);
  d64.batch = 1;
  d64.s_q = 6;
  d64.s_kv = 20000;
  d64.order = TopkOrder::id_ascending;
  check_case(d64, fresh_seed());
}

TEST_F(IndexerTopkGpu, LongSequence262144) {
  // Two query rows each: the fp64 checker's cost is every visible key of every row.
  for (auto [h, topk] : {std::pair<int64_t, int64_t>{64, 2048}, {32, 8192}}) {
    SCOPED_TRACE("H " + std::to_string(h) + " topk " + std::to_string(topk));
    TopkSpec s = shape(h, 128, topk);
    s.batch = 1;
    s.s_q = 2;
    s.s_kv = 262144;
    check_case(s, fresh_seed());
  }
  TopkSpec shard = shape(32, 128, 2048);  // the last rows of a 262144-key sequence, as starts/ends
  shard.batch = 1;
  shard.s_q = 2;
  shard.s_kv = 262144;
  shard.ranges = Ranges::second_half;
  shard.id_mode = IdMode::global;
  check_case(shard, fresh_seed());
}

TEST_F(IndexerTopkGpu, KeyOffsetsBeyond2To31Elements) {
  // index_k's rows 4 Mi elements apart: key 520 starts at element ~2.18e9 > 2^31
  // (about 4.4 GB of device memory, only the rows written).
  size_t free_b = 0, total_b = 0;
  check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  ASSERT_GT(free_b, size_t{6} << 30) << "the test needs about 4.4 GB of free device memory";
  for (TopkOrder order : {TopkOrder::logit_descending, TopkOrder::id_ascending}) {
    SCOPED_TRACE(topk_order_name(order));
    TopkSpec s = shape(32, 128, 64);
    s.batch = 1;
    s.s_q = 8;
    s.s_kv = 520;
    s.k_row_stride = int64_t{1} << 22;
    s.order = order;
    ASSERT_GT((s.s_kv - 1) * s.k_row_stride, int64_t{1} << 31);
    check_case(s, fresh_seed());
  }
  TopkSpec t = thd_spec(64, 128, 64);  // THD: flat rows
  t.seqlens_q = {4, 4};
  t.seqlens_k = {300, 300};
  t.k_row_stride = int64_t{1} << 22;
  t.id_mode = IdMode::global;
  check_case(t, fresh_seed());
}

TEST_F(IndexerTopkGpu, OrdersAndIdModes) {
  for (TopkOrder order : {TopkOrder::logit_descending, TopkOrder::id_ascending}) {
    for (IdMode mode : {IdMode::local, IdMode::global}) {
      for (Layout layout : {Layout::bshd, Layout::thd}) {
        SCOPED_TRACE(std::string(topk_order_name(order)) + (mode == IdMode::global ? " global" : " local") +
                     (layout == Layout::thd ? " thd" : " bshd"));
        TopkSpec s = layout == Layout::thd ? thd_spec(64, 128, 128) : shape(64, 128, 128);
        s.order = order;
        s.id_mode = mode;
        check_case(s, fresh_seed());
      }
    }
  }
}

TEST_F(IndexerTopkGpu, SequenceFirstViews) {
  // index_q and weights read in place from Megatron's sequence-first storage.
  for (auto [h, d] : {std::pair<int64_t, int64_t>{64, 128}, {8, 64}}) {
    SCOPED_TRACE("H " + std::to_string(h) + " D " + std::to_string(d));
    TopkSpec s = shape(h, d, 100);
    s.batch = 3;
    s.seq_first = true;
    check_case(s, fresh_seed());
    s.weights_dtype = DType::f32;
    s.ranges = Ranges::second_half;
    s.s_q = 150;
    check_case(s, fresh_seed());
  }
}

TEST_F(IndexerTopkGpu, WeightsF32) {
  TopkSpec s = shape(32, 128, 100);
  s.weights_dtype = DType::f32;
  check_case(s, fresh_seed());
  TopkSpec t = thd_spec(64, 64, 30);
  t.weights_dtype = DType::f32;
  check_case(t, fresh_seed());
}

TEST_F(IndexerTopkGpu, LogitsAndLengthsPresentOrAbsent) {
  // The same problem with each combination of the optional outputs: every one
  // passes the checker, and the ids are bitwise the same.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (TopkOrder order : {TopkOrder::logit_descending, TopkOrder::id_ascending}) {
    TopkSpec s = shape(64, 128, 200);
    s.s_q = 32;
    s.s_kv = 3000;
    s.order = order;
    const TopkProblem p = make_problem(s, seed);
    DeviceTopk d(p);
    HostTensor first;
    for (bool logits : {true, false}) {
      for (bool lengths : {true, false}) {
        const std::string what = std::string(topk_order_name(order)) + (logits ? " logits" : " no logits") +
                                 (lengths ? " lengths" : " no lengths");
        const TopkResult r = run(d, logits, lengths);
        expect_checked(p, r, what);
        if (first.empty()) first = r.ids;
        EXPECT_TRUE(bitwise_equal(first, r.ids)) << what << ": ids differ from the run with both outputs";
      }
    }
  }
}

TEST_F(IndexerTopkGpu, NanInOneRowOfIndexQ) {
  // That row: every logit NaN, ranked above +inf, NaNs by id: the first visible
  // ids, NaN logits. The other rows as without it.
  for (TopkOrder order : {TopkOrder::logit_descending, TopkOrder::id_ascending}) {
    for (Layout layout : {Layout::bshd, Layout::thd}) {
      SCOPED_TRACE(std::string(topk_order_name(order)) + (layout == Layout::thd ? " thd" : " bshd"));
      const uint64_t seed = fresh_seed();
      SCOPED_TRACE("seed " + std::to_string(seed));
      TopkSpec s = layout == Layout::thd ? thd_spec(64, 128, 80) : shape(64, 128, 80);
      s.order = order;
      s.nan_rows = {layout == Layout::thd ? int64_t{20} : int64_t{30}};
      const TopkProblem p = make_problem(s, seed);
      DeviceTopk d(p);
      const TopkResult r = run(d);
      expect_checked(p, r);
      expect_rows_equal_reference(p, r, s.nan_rows);
      const int64_t row = s.nan_rows[0], K = s.topk;
      const int32_t n = r.lengths.data<int32_t>()[row];
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_TRUE(std::isnan(r.logits.data<float>()[row * K + i])) << "slot " << i;
        if (i > 0) ASSERT_LT(r.ids.data<int32_t>()[row * K + i - 1], r.ids.data<int32_t>()[row * K + i]);
      }
      // The other rows do not see the NaN: the same problem without it gives the same rows.
      TopkSpec clean = s;
      clean.nan_rows.clear();
      const TopkProblem q = make_problem(clean, seed);
      DeviceTopk dq(q);
      const TopkResult rq = run(dq);
      for (int64_t other = 0; other < p.rows; ++other) {
        if (other == row) continue;
        ASSERT_EQ(0, std::memcmp(r.ids.data<int32_t>() + other * K, rq.ids.data<int32_t>() + other * K, K * 4))
            << "row " << other;
      }
    }
  }
}

TEST_F(IndexerTopkGpu, BitwiseDeterministic) {
  // Many keys per row (the buffers are cut many times) and many CTAs.
  for (auto [h, d] : {std::pair<int64_t, int64_t>{64, 128}, {128, 64}, {8, 128}}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed) + " H " + std::to_string(h));
    TopkSpec s = shape(h, d, 512);
    s.batch = 2;
    s.s_q = 128;
    s.s_kv = 6000;
    const TopkProblem p = make_problem(s, seed);
    DeviceTopk dev(p);
    const TopkResult a = run(dev);
    expect_checked(p, a);
    for (int i = 0; i < 2; ++i) {
      const TopkResult b = run(dev);
      EXPECT_TRUE(bitwise_equal(a.ids, b.ids)) << "run " << i + 2 << ": ids differ";
      EXPECT_TRUE(bitwise_equal(a.logits, b.logits)) << "run " << i + 2 << ": logits differ";
      EXPECT_TRUE(bitwise_equal(a.lengths, b.lengths)) << "run " << i + 2 << ": lengths differ";
    }
    const TopkResult no_logits = run(dev, false, true);
    EXPECT_TRUE(bitwise_equal(a.ids, no_logits.ids)) << "ids differ without topk_logits";
  }
}

void expect_graph_replays_equal_eager(const TopkSpec& spec) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const TopkProblem p = make_problem(spec, seed);
  DeviceTopk d(p);
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const TopkResult eager = run(d, true, true, nullptr, 0, stream);
  expect_checked(p, eager, "eager");
  IndexerTopkOptions opt = p.options(Backend::cuda);
  opt.stream = stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
  indexer_topk(d.inputs(), d.outputs(true, true), opt);
  check_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  for (int replay = 0; replay < 2; ++replay) {
    d.poison();
    check_cuda(cudaDeviceSynchronize(), "poison");
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check_cuda(cudaStreamSynchronize(stream), "graph replay");
    const TopkResult r = copy_back(d, true, true);
    EXPECT_TRUE(bitwise_equal(eager.ids, r.ids)) << "replay " << replay << ": ids differ from the eager run";
    EXPECT_TRUE(bitwise_equal(eager.logits, r.logits)) << "replay " << replay << ": logits differ";
    EXPECT_TRUE(bitwise_equal(eager.lengths, r.lengths)) << "replay " << replay << ": lengths differ";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST_F(IndexerTopkGpu, BshdCapturedInCudaGraph) {
  TopkSpec s = shape(64, 128, 256);
  s.s_q = 64;
  s.s_kv = 2000;
  expect_graph_replays_equal_eager(s);
  s.ranges = Ranges::second_half;
  s.s_q = 1000;
  expect_graph_replays_equal_eager(s);
}

TEST_F(IndexerTopkGpu, ThdCapturedInCudaGraph) {
  TopkSpec t = thd_spec(32, 128, 100);
  t.id_mode = IdMode::global;
  expect_graph_replays_equal_eager(t);
}

TEST_F(IndexerTopkGpu, CallerWorkspace) {
  // A workspace of exactly indexer_topk_workspace_size bytes gives the results of
  // the library's own allocation, with and without the optional outputs (which
  // change what the workspace holds).
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    TopkSpec s = layout == Layout::thd ? thd_spec(64, 128, 300) : shape(64, 128, 300);
    if (layout == Layout::bshd) s.s_kv = 4000;
    const TopkProblem p = make_problem(s, seed);
    DeviceTopk d(p);
    for (bool optional_outputs : {true, false}) {
      SCOPED_TRACE(std::string(layout == Layout::thd ? "thd" : "bshd") +
                   (optional_outputs ? " logits and lengths" : " ids alone"));
      const std::size_t bytes =
          indexer_topk_workspace_size(d.inputs(), d.outputs(optional_outputs, optional_outputs), p.options(Backend::cuda));
      EXPECT_GT(bytes, 0u);
      DeviceBuffer ws(bytes);
      const TopkResult own = run(d, optional_outputs, optional_outputs);
      const TopkResult given = run(d, optional_outputs, optional_outputs, ws.ptr, bytes);
      expect_checked(p, given);
      EXPECT_TRUE(bitwise_equal(own.ids, given.ids));
      EXPECT_TRUE(bitwise_equal(own.logits, given.logits));
      EXPECT_TRUE(bitwise_equal(own.lengths, given.lengths));
      if (bytes > 256) {  // one byte short is refused before anything is written
        d.poison();
        check_cuda(cudaDeviceSynchronize(), "poison");
        EXPECT_THROW(indexer_topk(d.inputs(), d.outputs(optional_outputs, optional_outputs), p.options(Backend::cuda),
                                  ws.ptr, bytes - 1),
                     Error);
        const HostTensor untouched = d.ids.to_host();
        for (int64_t i = 0; i < untouched.numel(); ++i) ASSERT_EQ(untouched.data<int32_t>()[i], 0x7f7f7f7f);
      }
    }
  }
}

// The checker itself, on the cpu backend's outputs (no GPU): a pass, then a
// changed id, a swapped pair, a wrong count, a NaN logit and a padding slot must
// each fail it.
TEST(IndexerTopkCheck, FlagsErrors) {
  TopkSpec s = shape(8, 64, 16);
  s.s_q = 12;
  s.s_kv = 100;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const TopkProblem p = make_problem(s, seed);
  TopkResult r;
  r.ids = HostTensor(DType::i32, p.out_shape());
  r.logits = HostTensor(DType::f32, p.out_shape());
  r.lengths = HostTensor(DType::i32, p.row_shape());
  indexer_topk(p.host_inputs(), r.views(), p.options(Backend::cpu));
  const IndexerTopkOptions opt = p.options(Backend::cpu);
  ASSERT_TRUE(check_indexer_topk(p.host_inputs(), opt, r.views()).pass);
  const int64_t K = s.topk, row = 20;  // batch 1, t 8: 100 - 12 + 8 + 1 = 97 keys, more than topk
  auto fails = [&](const char* what, auto&& mutate) {
    TopkResult bad = r;
    mutate(bad);
    EXPECT_FALSE(check_indexer_topk(p.host_inputs(), opt, bad.views()).pass) << what;
  };
  fails("an id outside the selection", [&](TopkResult& b) {
    int32_t* ids = b.ids.data<int32_t>() + row * K;
    // the lowest-ranked key not selected replaces the best one
    std::vector<bool> used(100, false);
    for (int64_t i = 0; i < K; ++i) used[ids[i]] = true;
    for (int32_t id = 0; id < 97; ++id) {
      if (!used[id]) {
        ids[0] = id;
        break;
      }
    }
  });
  fails("two slots swapped", [&](TopkResult& b) {
    std::swap(b.ids.data<int32_t>()[row * K], b.ids.data<int32_t>()[row * K + 1]);
    std::swap(b.logits.data<float>()[row * K], b.logits.data<float>()[row * K + 1]);
  });
  fails("a wrong count", [&](TopkResult& b) { b.lengths.data<int32_t>()[row] -= 1; });
  fails("a NaN logit", [&](TopkResult& b) { b.logits.data<float>()[row * K + 3] = NAN; });
  fails("a poisoned id", [&](TopkResult& b) { b.ids.data<int32_t>()[row * K + 5] = 0x7f7f7f7f; });
  fails("a duplicated id", [&](TopkResult& b) { b.ids.data<int32_t>()[row * K + 5] = b.ids.data<int32_t>()[row * K + 4]; });
}

// The sanitizer's cases (tests/sanitizer/run_sanitizer.sh runs Sanitized.*),
// small: many keys per row against a small topk (the candidate buffers are cut
// many times), both head tiles; and THD with global ids and no optional outputs
// (the selection's high words and counts in the workspace).
TEST(Sanitized, IndexerTopkCuts) {
  if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  TopkSpec s = shape(64, 128, 16);
  s.batch = 1;
  s.s_q = 8;
  s.s_kv = 2500;
  check_case(s, fresh_seed());
  TopkSpec t = shape(8, 64, 300);
  t.batch = 1;
  t.s_q = 5;
  t.s_kv = 1500;
  t.order = TopkOrder::id_ascending;
  check_case(t, fresh_seed());
}

TEST(Sanitized, IndexerTopkThd) {
  if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  TopkSpec t = thd_spec(128, 128, 40);
  t.id_mode = IdMode::global;
  t.with_logits = false;
  t.with_lengths = false;
  t.ranges = Ranges::clipped;
  check_case(t, fresh_seed());
}

}  // namespace
}  // namespace dsaib::test
