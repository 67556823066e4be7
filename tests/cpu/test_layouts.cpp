// Layouts and id modes (docs/math.md §5):
//   - THD with sequences of lengths 1, 37, 300 equals three separate BSHD runs
//     given the same N, in local and global id form;
//   - local ids with B >= 2 and the same problem in global form: identical.
#include <gtest/gtest.h>

#include <cstring>

#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

/// Sequence b of a THD problem as a standalone BSHD problem (B = 1), local ids.
GeneratedProblem slice_sequence(const GeneratedProblem& thd, int64_t b) {
  const int32_t* cq = thd.cu_seqlens_q.data<int32_t>();
  const int32_t* ck = thd.cu_seqlens_k.data<int32_t>();
  const int64_t q0 = cq[b], nq = cq[b + 1] - cq[b], k0 = ck[b], nk = ck[b + 1] - ck[b];
  const int64_t H = thd.spec.heads, D = thd.spec.head_dim, K = topk(thd);
  const GeneratedProblem local = with_id_mode(thd, IdMode::local);

  GeneratedProblem p;
  p.spec = thd.spec;
  p.spec.layout = Layout::bshd;
  p.spec.id_mode = IdMode::local;
  p.spec.batch = 1;
  p.spec.s_q = nq;
  p.spec.s_kv = nk;
  p.spec.seqlens_q.clear();
  p.spec.seqlens_k.clear();
  p.sm_scale = thd.sm_scale;
  auto slice = [](const HostTensor& src, std::vector<int64_t> shape, int64_t first_row, int64_t row_elems) {
    HostTensor t(src.dtype, std::move(shape));
    const size_t es = dtype_size(src.dtype);
    if (!t.bytes.empty()) std::memcpy(t.bytes.data(), src.bytes.data() + first_row * row_elems * es, t.bytes.size());
    return t;
  };
  p.index_q = slice(thd.index_q, {1, nq, H, D}, q0, H * D);
  p.weights = slice(thd.weights, {1, nq, H}, q0, H);
  p.index_k = slice(thd.index_k, {1, nk, D}, k0, D);
  p.topk_indices = slice(local.topk_indices, {1, nq, K}, q0, K);
  p.attn_score = slice(thd.attn_score, {1, nq, K}, q0, K);
  p.index_score = slice(thd.index_score, {1, nq, K}, q0, K);
  return p;
}

/// Bytes [first_row * row_elems, +rows * row_elems) of an output tensor.
std::vector<uint8_t> rows_bytes(const HostTensor& t, int64_t first_row, int64_t rows, int64_t row_elems) {
  const size_t es = dtype_size(t.dtype);
  const auto* b = t.bytes.data() + first_row * row_elems * es;
  return std::vector<uint8_t>(b, b + rows * row_elems * es);
}

void check_thd_equals_bshd_runs(const GenerateSpec& spec, int32_t threads) {
  const GeneratedProblem thd = make_problem(spec);
  const int64_t H = spec.heads, D = spec.head_dim;
  const int64_t N = num_q_rows(thd);
  IndexerOptions o = thd.options();
  o.num_threads = threads;
  o.loss_coeff = 0.5f;
  o.grad_loss = 3.0f;
  const OutputBuffers whole = run_cpu(thd, o);
  const ReferenceGradients whole_ref = reference_backward(thd.inputs(), o);
  const int32_t* cq = thd.cu_seqlens_q.data<int32_t>();
  const int32_t* ck = thd.cu_seqlens_k.data<int32_t>();
  for (int64_t b = 0; b + 1 < thd.cu_seqlens_q.numel(); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    const GeneratedProblem seq = slice_sequence(thd, b);
    IndexerOptions so = seq.options();
    so.num_threads = threads;
    so.loss_coeff = o.loss_coeff;
    so.grad_loss = o.grad_loss;
    so.normalization_count = N;  // the same N as the packed run
    const OutputBuffers part = run_cpu(seq, so);
    const int64_t q0 = cq[b], nq = cq[b + 1] - cq[b], k0 = ck[b], nk = ck[b + 1] - ck[b];
    // Rows of one sequence are computed alike in both runs (same order, same
    // arithmetic), and dK of a key row only gathers rows of its own sequence.
    EXPECT_EQ(rows_bytes(whole.d_index_q, q0, nq, H * D), part.d_index_q.bytes);
    EXPECT_EQ(rows_bytes(whole.d_weights, q0, nq, H), part.d_weights.bytes);
    if (threads == 1) {
      EXPECT_EQ(rows_bytes(whole.d_index_k, k0, nk, D), part.d_index_k.bytes);
    } else {  // per-thread dK partial sums may split differently: fp64-close
      const ReferenceGradients part_ref = reference_backward(seq.inputs(), so);
      const std::vector<double> want(whole_ref.d_index_k.begin() + k0 * D, whole_ref.d_index_k.begin() + (k0 + nk) * D);
      double err = 0, scale = 0;
      for (size_t e = 0; e < want.size(); ++e) {
        err = std::max(err, std::abs(want[e] - part_ref.d_index_k[e]));
        scale = std::max(scale, std::abs(want[e]));
      }
      EXPECT_LE(err, 1e-13 * scale);
    }
  }
}

GenerateSpec thd_spec(IdMode mode, IdPattern ids, std::vector<int64_t> lq, std::vector<int64_t> lk) {
  GenerateSpec s;
  s.layout = Layout::thd;
  s.seqlens_q = std::move(lq);
  s.seqlens_k = std::move(lk);
  s.heads = 8;
  s.head_dim = 64;
  s.topk = 129;
  s.ids = ids;
  s.id_mode = mode;
  s.seed = 21;
  s.num_threads = 2;
  return s;
}

TEST(Layouts, ThdEqualsSeparateBshdRunsLocalIds) {
  check_thd_equals_bshd_runs(thd_spec(IdMode::local, IdPattern::causal_topk, {1, 37, 300}, {}), 1);
}

TEST(Layouts, ThdEqualsSeparateBshdRunsGlobalIds) {
  check_thd_equals_bshd_runs(thd_spec(IdMode::global, IdPattern::causal_topk, {1, 37, 300}, {}), 1);
}

TEST(Layouts, ThdEqualsSeparateBshdRunsThreaded) {
  check_thd_equals_bshd_runs(thd_spec(IdMode::global, IdPattern::causal_topk, {1, 37, 300}, {}), 3);
}

TEST(Layouts, ThdUnequalKeyLengthsAndEmptySequence) {
  check_thd_equals_bshd_runs(thd_spec(IdMode::global, IdPattern::random_permutation, {1, 0, 37, 300}, {3, 5, 150, 280}), 1);
  check_thd_equals_bshd_runs(thd_spec(IdMode::local, IdPattern::causal_topk, {4, 37, 300}, {1, 60, 200}), 1);
}

TEST(Layouts, ThdLocalAndGlobalFormsIdentical) {
  const GeneratedProblem local = make_problem(thd_spec(IdMode::local, IdPattern::causal_topk, {1, 37, 300}, {}));
  const GeneratedProblem global = with_id_mode(local, IdMode::global);
  const OutputBuffers a = run_cpu(local, local.options());
  const OutputBuffers b = run_cpu(global, global.options());
  EXPECT_TRUE(bitwise_equal(a.d_index_q, b.d_index_q));
  EXPECT_TRUE(bitwise_equal(a.d_weights, b.d_weights));
  EXPECT_TRUE(bitwise_equal(a.d_index_k, b.d_index_k));
}

TEST(Layouts, LocalAndGlobalIdsIdenticalBatched) {
  for (IdPattern ids : {IdPattern::causal_topk, IdPattern::random_permutation}) {
    GenerateSpec s = small_spec(31);
    s.batch = 3;
    s.s_q = 20;
    s.s_kv = 33;
    s.topk = 100;
    s.heads = 16;
    s.ids = ids;
    GeneratedProblem local = make_problem(s);
    // Holes, a whole -1 row, and an out-of-range id in later batches too.
    invalidate_run(local, 0, Where::start, 3);
    invalidate_row(local, 25);
    invalidate_run(local, 47, Where::end, 10);
    set_id(local, 59, 2, 33);
    refresh_scores(local);
    const GeneratedProblem global = with_id_mode(local, IdMode::global);
    EXPECT_EQ(get_id(global, 47, 0), get_id(local, 47, 0) + 2 * 33);
    for (DType dt : {DType::f32, DType::bf16}) {
      const OutputBuffers a = run_cpu(local, local.options(), dt, dt, dt);
      const OutputBuffers b = run_cpu(global, global.options(), dt, dt, dt);
      EXPECT_TRUE(bitwise_equal(a.d_index_q, b.d_index_q));
      EXPECT_TRUE(bitwise_equal(a.d_weights, b.d_weights));
      EXPECT_TRUE(bitwise_equal(a.d_index_k, b.d_index_k));
    }
  }
}

TEST(Layouts, GeneratorGlobalFormMatchesConvertedLocalForm) {
  GenerateSpec s = small_spec(32);
  s.batch = 3;
  const GeneratedProblem local = make_problem(s);
  s.id_mode = IdMode::global;
  const GeneratedProblem global = make_problem(s);
  EXPECT_TRUE(bitwise_equal(with_id_mode(local, IdMode::global).topk_indices, global.topk_indices));
  EXPECT_TRUE(bitwise_equal(local.index_score, global.index_score));
  EXPECT_TRUE(bitwise_equal(local.attn_score, global.attn_score));
}

/// A global id that is a valid row of ANOTHER sequence is invalid, like -1.
TEST(Layouts, GlobalIdOfAnotherSequenceIsInvalid) {
  GenerateSpec s = small_spec(33);
  s.id_mode = IdMode::global;
  GeneratedProblem p = make_problem(s);
  refresh_scores(p);
  GeneratedProblem q = p;
  set_id(q, 30, 0, 3);  // row of batch 1 naming key 3 of batch 0
  set_id(q, 5, 0, 40);  // row of batch 0 naming key 16 of batch 1
  GeneratedProblem r = p;
  set_id(r, 30, 0, -1);
  set_id(r, 5, 0, -1);
  const OutputBuffers a = run_cpu(q, q.options());
  const OutputBuffers b = run_cpu(r, r.options());
  EXPECT_TRUE(bitwise_equal(a.d_index_q, b.d_index_q));
  EXPECT_TRUE(bitwise_equal(a.d_weights, b.d_weights));
  EXPECT_TRUE(bitwise_equal(a.d_index_k, b.d_index_k));
}

}  // namespace
}  // namespace dsaib::test
