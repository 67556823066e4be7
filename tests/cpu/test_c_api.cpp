// The C ABI (include/dsaib/dsaib.h): status codes, dsaib_last_error()
// messages (per thread, cleared on success), results identical to the C++ API,
// buffers untouched on failure.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "dsaib/attention_target.hpp"
#include "dsaib/dsaib.h"
#include "dsaib/reference.hpp"
#include "support/attention_target_check.hpp"
#include "support/test_support.hpp"
#include "support/topk_check.hpp"

namespace dsaib::test {
namespace {

struct CProblem {
  GeneratedProblem p;
  OutputBuffers o;
  dsaib_inputs in;
  dsaib_outputs out;
  dsaib_options opt;
  explicit CProblem(Layout layout) {
    GenerateSpec s = small_spec(71);
    s.layout = layout;
    s.seqlens_q = {3, 17};
    s.seqlens_k = {4, 30};
    p = make_problem(s);
    o = make_outputs(p, DType::bf16, DType::f32, DType::f32);
    poison(o);
    const IndexerInputs i = p.inputs();
    in = {to_c(i.index_q),    to_c(i.weights),     to_c(i.index_k),      to_c(i.topk_indices),
          to_c(i.attn_score), to_c(i.index_score), to_c(i.cu_seqlens_q), to_c(i.cu_seqlens_k)};
    const IndexerBackwardOutputs v = o.views();
    out = {to_c(v.d_index_q), to_c(v.d_weights), to_c(v.d_index_k)};
    dsaib_default_options(&opt);
    opt.layout = static_cast<int32_t>(layout);
    opt.sm_scale = p.sm_scale;
  }
};

TEST(CApi, StatusCodesMirrorErrorCodes) {
  EXPECT_EQ(DSAIB_OK, static_cast<int>(ErrorCode::ok));
  EXPECT_EQ(DSAIB_INVALID_ARGUMENT, static_cast<int>(ErrorCode::invalid_argument));
  EXPECT_EQ(DSAIB_UNSUPPORTED, static_cast<int>(ErrorCode::unsupported));
  EXPECT_EQ(DSAIB_INDEX_OUT_OF_RANGE, static_cast<int>(ErrorCode::index_out_of_range));
  EXPECT_EQ(DSAIB_BACKEND_UNAVAILABLE, static_cast<int>(ErrorCode::backend_unavailable));
  EXPECT_EQ(DSAIB_CUDA_ERROR, static_cast<int>(ErrorCode::cuda_error));
  EXPECT_EQ(DSAIB_IO_ERROR, static_cast<int>(ErrorCode::io_error));
  EXPECT_EQ(DSAIB_INTERNAL, static_cast<int>(ErrorCode::internal));
}

TEST(CApi, DefaultOptionsMatchCpp) {
  dsaib_options o;
  std::memset(&o, 0x7f, sizeof o);
  dsaib_default_options(&o);
  const IndexerOptions d;
  EXPECT_EQ(o.layout, DSAIB_BSHD);
  EXPECT_EQ(o.id_mode, DSAIB_IDS_LOCAL);
  EXPECT_EQ(o.backend, DSAIB_BACKEND_CPU);
  EXPECT_EQ(o.sm_scale, d.sm_scale);
  EXPECT_EQ(o.loss_coeff, d.loss_coeff);
  EXPECT_EQ(o.grad_loss, d.grad_loss);
  EXPECT_EQ(o.grad_loss_device, nullptr);
  EXPECT_EQ(o.normalization_count, 0);
  EXPECT_EQ(o.strict_indices, 0);
  EXPECT_EQ(o.deterministic, 0);
  EXPECT_EQ(o.stream, nullptr);
  EXPECT_EQ(o.num_threads, 0);
  EXPECT_EQ(o.a_operand_precision, DSAIB_A_OPERAND_AUTOMATIC);
  EXPECT_EQ(o.l2_hints, DSAIB_L2_HINTS_AUTOMATIC);
  EXPECT_EQ(o.l2_hints, static_cast<int32_t>(d.l2_hints));
  EXPECT_EQ(o.start_stagger, DSAIB_START_STAGGER_AUTOMATIC);
  EXPECT_EQ(o.start_stagger, static_cast<int32_t>(d.start_stagger));
  EXPECT_EQ(o.forward_fusion, DSAIB_FORWARD_FUSION_AUTOMATIC);
  EXPECT_EQ(o.forward_fusion, static_cast<int32_t>(d.forward_fusion));
  dsaib_default_options(nullptr);  // tolerated
}

TEST(CApi, ContiguousTensor) {
  float buf[24];
  const int64_t shape[3] = {2, 3, 4};
  dsaib_tensor t;
  ASSERT_EQ(dsaib_contiguous_tensor(&t, buf, DSAIB_F32, shape, 3, DSAIB_CPU, 0), DSAIB_OK);
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_STREQ(dsaib_last_error(), "");
  EXPECT_EQ(dsaib_contiguous_tensor(&t, buf, DSAIB_F32, shape, 5, DSAIB_CPU, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dsaib_last_error()).find("rank: expected"), std::string::npos) << dsaib_last_error();
  EXPECT_EQ(dsaib_contiguous_tensor(nullptr, buf, DSAIB_F32, shape, 3, DSAIB_CPU, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dsaib_last_error()).find("view: expected"), std::string::npos) << dsaib_last_error();
  EXPECT_EQ(dsaib_contiguous_tensor(&t, buf, DSAIB_F32, nullptr, 3, DSAIB_CPU, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dsaib_last_error()).find("shape: expected"), std::string::npos) << dsaib_last_error();
  // A bad rank is the error named, also when shape is null.
  EXPECT_EQ(dsaib_contiguous_tensor(&t, buf, DSAIB_F32, nullptr, 7, DSAIB_CPU, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(dsaib_last_error()), "rank: expected 0..4, got 7");
  EXPECT_EQ(dsaib_contiguous_tensor(&t, buf, DSAIB_F32, nullptr, -1, DSAIB_CPU, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(dsaib_last_error()), "rank: expected 0..4, got -1");
  dsaib_tensor before;
  std::memcpy(&before, &t, sizeof t);
  EXPECT_EQ(dsaib_contiguous_tensor(&t, buf, static_cast<dsaib_dtype>(42), shape, 3, DSAIB_CPU, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "dtype: expected 0 (bf16), 1 (f32), 2 (i32), 3 (f64) or 4 (e4m3), got 42");
  EXPECT_EQ(dsaib_contiguous_tensor(&t, buf, DSAIB_F32, shape, 3, static_cast<dsaib_device>(-1), 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "device: expected 0 (cpu) or 1 (cuda), got -1");
  const int64_t negative[3] = {2, -3, 4};
  EXPECT_EQ(dsaib_contiguous_tensor(&t, buf, DSAIB_F32, negative, 3, DSAIB_CPU, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "shape: expected sizes >= 0, got -3 at dimension 1");
  const int64_t huge[4] = {int64_t{1} << 40, int64_t{1} << 40, int64_t{1} << 40, 4};
  EXPECT_EQ(dsaib_contiguous_tensor(&t, buf, DSAIB_F32, huge, 4, DSAIB_CPU, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dsaib_last_error()).find("shape: expected an element count below 2^63"), std::string::npos)
      << dsaib_last_error();
  EXPECT_EQ(std::memcmp(&before, &t, sizeof t), 0) << "nothing is written on an error";
  // Zero elements: huge other sizes are no overflow (the count is 0).
  const int64_t empty_huge[4] = {int64_t{1} << 62, 0, int64_t{1} << 40, int64_t{1} << 40};
  ASSERT_EQ(dsaib_contiguous_tensor(&t, buf, DSAIB_F32, empty_huge, 4, DSAIB_CPU, 0), DSAIB_OK) << dsaib_last_error();
  EXPECT_EQ(t.shape[0], int64_t{1} << 62);
  EXPECT_EQ(t.strides[3], 1);
  EXPECT_EQ(t.strides[2], int64_t{1} << 40);
  EXPECT_EQ(t.strides[1], std::numeric_limits<int64_t>::max());
  EXPECT_EQ(t.strides[0], std::numeric_limits<int64_t>::max());
}

TEST(CApi, SuccessMatchesCppAndClearsLastError) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    CProblem c(layout);
    // Valid values of the cuda tuning options pass (the cpu backend ignores them).
    c.opt.l2_hints = layout == Layout::bshd ? DSAIB_L2_HINTS_ON : DSAIB_L2_HINTS_OFF;
    c.opt.start_stagger = DSAIB_START_STAGGER_OFF;
    // Leave an error behind first.
    ASSERT_EQ(dsaib_indexer_backward(nullptr, &c.out, &c.opt, nullptr, 0), DSAIB_INVALID_ARGUMENT);
    ASSERT_STRNE(dsaib_last_error(), "");
    size_t bytes = 123;
    ASSERT_EQ(dsaib_indexer_backward_workspace_size(&c.in, &c.out, &c.opt, &bytes), DSAIB_OK) << dsaib_last_error();
    EXPECT_EQ(bytes, 0u);
    ASSERT_EQ(dsaib_indexer_backward(&c.in, &c.out, &c.opt, nullptr, 0), DSAIB_OK) << dsaib_last_error();
    EXPECT_STREQ(dsaib_last_error(), "");
    const OutputBuffers want = run_cpu(c.p, c.p.options(), DType::bf16, DType::f32, DType::f32);
    EXPECT_TRUE(bitwise_equal(want.d_index_q, c.o.d_index_q));
    EXPECT_TRUE(bitwise_equal(want.d_weights, c.o.d_weights));
    EXPECT_TRUE(bitwise_equal(want.d_index_k, c.o.d_index_k));
  }
}

// DSAIB_F64: the cpu backend writes its fp64 results unrounded (the reference's
// values bitwise); the dtype values of dsaib.h are those of dsaib::DType.
TEST(CApi, F64OutputsHoldTheFp64Reference) {
  EXPECT_EQ(DSAIB_BF16, static_cast<int>(DType::bf16));
  EXPECT_EQ(DSAIB_F32, static_cast<int>(DType::f32));
  EXPECT_EQ(DSAIB_I32, static_cast<int>(DType::i32));
  EXPECT_EQ(DSAIB_F64, static_cast<int>(DType::f64));
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    CProblem c(layout);
    OutputBuffers o = make_outputs(c.p, DType::f64, DType::f64, DType::f64);
    poison(o);
    HostTensor* outs[] = {&o.d_index_q, &o.d_weights, &o.d_index_k};
    dsaib_tensor* views[] = {&c.out.d_index_q, &c.out.d_weights, &c.out.d_index_k};
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(dsaib_contiguous_tensor(views[i], outs[i]->bytes.data(), DSAIB_F64, outs[i]->shape.data(),
                                        static_cast<int32_t>(outs[i]->shape.size()), DSAIB_CPU, 0),
                DSAIB_OK)
          << dsaib_last_error();
    }
    ASSERT_EQ(dsaib_indexer_backward(&c.in, &c.out, &c.opt, nullptr, 0), DSAIB_OK) << dsaib_last_error();
    const ReferenceGradients ref = reference_backward(c.p.inputs(), c.p.options());
    const std::vector<double>* want[] = {&ref.d_index_q, &ref.d_weights, &ref.d_index_k};
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(static_cast<size_t>(outs[i]->numel()), want[i]->size());
      EXPECT_EQ(std::memcmp(outs[i]->bytes.data(), want[i]->data(), want[i]->size() * 8), 0) << i;
    }
    // A dtype the cpu backend does not take: its message lists f64 among those it does.
    c.out.d_index_q.dtype = DSAIB_I32;
    EXPECT_EQ(dsaib_indexer_backward(&c.in, &c.out, &c.opt, nullptr, 0), DSAIB_INVALID_ARGUMENT);
    EXPECT_STREQ(dsaib_last_error(), "d_index_q: expected dtype bf16 or f32 or f64, got dtype i32");
  }
}

struct CFailure {
  const char* name;
  dsaib_status status;
  const char* message_start;
  void (*mutate)(CProblem&);
};

TEST(CApi, FailuresReportStatusAndMessageAndTouchNothing) {
  const CFailure failures[] = {
      {"wrong dtype", DSAIB_INVALID_ARGUMENT, "index_q: expected dtype bf16",
       [](CProblem& c) { c.in.index_q.dtype = DSAIB_F32; }},
      {"dtype enum", DSAIB_INVALID_ARGUMENT, "weights: expected dtype 0 (bf16), 1 (f32), 2 (i32), 3 (f64) or 4 (e4m3), got 9",
       [](CProblem& c) { c.in.weights.dtype = 9; }},
      {"rank enum", DSAIB_INVALID_ARGUMENT, "index_k: expected rank 0..4, got 7", [](CProblem& c) { c.in.index_k.rank = 7; }},
      {"device enum", DSAIB_INVALID_ARGUMENT, "d_index_k: expected device 0 (cpu) or 1 (cuda), got 3",
       [](CProblem& c) { c.out.d_index_k.device = 3; }},
      {"shape", DSAIB_INVALID_ARGUMENT, "attn_score: expected shape", [](CProblem& c) { c.in.attn_score.shape[0] = 1; }},
      {"sm_scale", DSAIB_INVALID_ARGUMENT, "sm_scale: expected a finite value, got",
       [](CProblem& c) { c.opt.sm_scale = std::numeric_limits<float>::infinity(); }},
      {"layout enum", DSAIB_INVALID_ARGUMENT, "layout: expected bshd or thd, got 4", [](CProblem& c) { c.opt.layout = 4; }},
      {"l2_hints enum", DSAIB_INVALID_ARGUMENT, "l2_hints: expected 0 (automatic), 1 (on) or 2 (off), got 3",
       [](CProblem& c) { c.opt.l2_hints = 3; }},
      {"start_stagger enum", DSAIB_INVALID_ARGUMENT, "start_stagger: expected 0 (automatic) or 1 (off), got -1",
       [](CProblem& c) { c.opt.start_stagger = -1; }},
      {"forward_fusion enum", DSAIB_INVALID_ARGUMENT, "forward_fusion: expected 0 (automatic) or 1 (off), got 2",
       [](CProblem& c) { c.opt.forward_fusion = 2; }},
      // errors.md's order, as in C++: the options before the tensors' enum fields...
      {"layout before a rank enum", DSAIB_INVALID_ARGUMENT, "layout: expected bshd or thd, got 4",
       [](CProblem& c) {
         c.opt.layout = 4;
         c.in.cu_seqlens_q.rank = 7;
       }},
      // ...and the backend's availability too.
      {"cuda before a dtype enum", DSAIB_BACKEND_UNAVAILABLE, "backend: expected cpu",
       [](CProblem& c) {
         c.opt.backend = DSAIB_BACKEND_CUDA;
         c.in.weights.dtype = 9;
       }},
      {"strict", DSAIB_INDEX_OUT_OF_RANGE, "topk_indices: strict mode found an out-of-range id at (b=0, t=2, slot=1)",
       [](CProblem& c) {
         c.opt.strict_indices = 1;
         set_id(c.p, 2, 1, 1000);
       }},
      {"cuda", DSAIB_BACKEND_UNAVAILABLE, "backend: expected cpu", [](CProblem& c) { c.opt.backend = DSAIB_BACKEND_CUDA; }},
  };
  for (const CFailure& f : failures) {
    SCOPED_TRACE(f.name);
    if (f.status == DSAIB_BACKEND_UNAVAILABLE && dsaib_cuda_backend_available()) continue;
    CProblem c(Layout::bshd);
    f.mutate(c);
    const SnapshotAll snap(c.p, c.o);
    EXPECT_EQ(dsaib_indexer_backward(&c.in, &c.out, &c.opt, nullptr, 0), f.status);
    const std::string msg = dsaib_last_error();
    EXPECT_EQ(msg.rfind(f.message_start, 0), 0u) << msg;
    EXPECT_NE(msg.find("got"), std::string::npos) << msg;
    size_t bytes = 0;
    EXPECT_EQ(dsaib_indexer_backward_workspace_size(&c.in, &c.out, &c.opt, &bytes), f.status);
    EXPECT_EQ(std::string(dsaib_last_error()), msg);
    EXPECT_EQ(snap.changed(), "");
  }
}

TEST(CApi, NullArguments) {
  CProblem c(Layout::bshd);
  EXPECT_EQ(dsaib_indexer_backward(&c.in, nullptr, &c.opt, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "outputs: expected a non-null pointer, got NULL");
  EXPECT_EQ(dsaib_indexer_backward(&c.in, &c.out, nullptr, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "options: expected a non-null pointer, got NULL");
  EXPECT_EQ(dsaib_indexer_backward_workspace_size(&c.in, &c.out, &c.opt, nullptr), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "bytes: expected a non-null pointer, got NULL");
  // Every pointer NULL: every entry point names its first argument, `inputs`,
  // and leaves *bytes alone.
  size_t bytes = 7;
  const std::vector<std::function<dsaib_status()>> all_null = {
      [] { return dsaib_indexer_backward(nullptr, nullptr, nullptr, nullptr, 0); },
      [&] { return dsaib_indexer_backward_workspace_size(nullptr, nullptr, nullptr, &bytes); },
      [] { return dsaib_indexer_kl_forward(nullptr, nullptr, nullptr, nullptr, 0); },
      [&] { return dsaib_indexer_kl_forward_workspace_size(nullptr, nullptr, nullptr, &bytes); },
      [] { return dsaib_indexer_kl_loss_and_grad(nullptr, nullptr, nullptr, nullptr, 0); },
      [&] { return dsaib_indexer_kl_loss_and_grad_workspace_size(nullptr, nullptr, nullptr, &bytes); },
      [] { return dsaib_attention_target(nullptr, nullptr, nullptr, nullptr, 0); },
      [&] { return dsaib_attention_target_workspace_size(nullptr, nullptr, nullptr, &bytes); },
      [] { return dsaib_indexer_topk(nullptr, nullptr, nullptr, nullptr, 0); },
      [&] { return dsaib_indexer_topk_workspace_size(nullptr, nullptr, nullptr, &bytes); },
  };
  for (size_t k = 0; k < all_null.size(); ++k) {
    EXPECT_EQ(all_null[k](), DSAIB_INVALID_ARGUMENT) << "entry point " << k;
    EXPECT_STREQ(dsaib_last_error(), "inputs: expected a non-null pointer, got NULL") << "entry point " << k;
  }
  EXPECT_EQ(bytes, 7u) << "written on an error";
}

TEST(CApi, LastErrorIsPerThread) {
  ASSERT_EQ(dsaib_indexer_backward(nullptr, nullptr, nullptr, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  const std::string mine = dsaib_last_error();
  ASSERT_FALSE(mine.empty());
  std::string other = "unset";
  std::thread([&] { other = dsaib_last_error(); }).join();
  EXPECT_EQ(other, "");
  EXPECT_EQ(std::string(dsaib_last_error()), mine);
}

// ---------------------------------------------------------- attention target ---

struct CTarget {
  TargetProblem p;
  HostTensor out;
  dsaib_attention_target_inputs in;
  dsaib_attention_target_outputs c_out;
  dsaib_attention_target_options opt;
  explicit CTarget(Layout layout) {
    TargetSpec s;
    s.layout = layout;
    s.heads = 16;
    s.head_dim = 192;
    s.topk = 8;
    s.lse_base = LseBase::base2;
    s.q_lens = {3, 5};
    s.k_lens = {4, 9};
    s.seed = 72;
    p = make_target_problem(s);
    out = p.make_output();
    poison(out);
    const AttentionTargetInputs i = p.inputs();
    in = {to_c(i.query), to_c(i.kv), to_c(i.lse), to_c(i.topk_indices), to_c(i.cu_seqlens_q), to_c(i.cu_seqlens_k)};
    c_out = {to_c(out.view())};
    dsaib_default_attention_target_options(&opt);
    opt.layout = static_cast<int32_t>(layout);
    opt.sm_scale = p.sm_scale;
    opt.lse_base = DSAIB_LSE_BASE2;
  }
};

TEST(CApi, AttentionTargetDefaultOptionsMatchCpp) {
  dsaib_attention_target_options o;
  std::memset(&o, 0x7f, sizeof o);
  dsaib_default_attention_target_options(&o);
  const AttentionTargetOptions d;
  EXPECT_EQ(o.layout, DSAIB_BSHD);
  EXPECT_EQ(o.id_mode, DSAIB_IDS_LOCAL);
  EXPECT_EQ(o.backend, DSAIB_BACKEND_CPU);
  EXPECT_EQ(o.sm_scale, d.sm_scale);
  EXPECT_EQ(o.lse_base, DSAIB_LSE_NATURAL);
  EXPECT_EQ(o.normalize, 1);
  EXPECT_EQ(o.strict_indices, 0);
  EXPECT_EQ(o.stream, nullptr);
  EXPECT_EQ(o.num_threads, 0);
  EXPECT_EQ(DSAIB_LSE_BASE2, static_cast<int>(LseBase::base2));
  dsaib_default_attention_target_options(nullptr);  // tolerated
}

TEST(CApi, AttentionTargetMatchesCpp) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    for (int normalize : {1, 0}) {
      CTarget c(layout);
      c.opt.normalize = normalize;
      ASSERT_EQ(dsaib_attention_target(nullptr, &c.c_out, &c.opt, nullptr, 0), DSAIB_INVALID_ARGUMENT);
      ASSERT_STRNE(dsaib_last_error(), "");
      size_t bytes = 123;
      ASSERT_EQ(dsaib_attention_target_workspace_size(&c.in, &c.c_out, &c.opt, &bytes), DSAIB_OK) << dsaib_last_error();
      EXPECT_EQ(bytes, 0u);
      ASSERT_EQ(dsaib_attention_target(&c.in, &c.c_out, &c.opt, nullptr, 0), DSAIB_OK) << dsaib_last_error();
      EXPECT_STREQ(dsaib_last_error(), "");
      HostTensor want = c.p.make_output();
      attention_target(c.p.inputs(), {want.view()}, c.p.options(normalize != 0));
      EXPECT_TRUE(bitwise_equal(want, c.out));
      const std::vector<double> naive = naive_attention_target(c.p, normalize != 0);
      EXPECT_TRUE(compare(c.out, naive).ok(1e-6)) << compare(c.out, naive).str();
    }
  }
}

// An absent lse (rank 0, data NULL): the target computes each head's lse over
// the row's selected keys, as the C++ entry does.
TEST(CApi, AttentionTargetWithoutLse) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    CTarget c(layout);
    std::memset(&c.in.lse, 0, sizeof c.in.lse);
    ASSERT_EQ(dsaib_attention_target(&c.in, &c.c_out, &c.opt, nullptr, 0), DSAIB_OK) << dsaib_last_error();
    HostTensor want = c.p.make_output();
    AttentionTargetInputs i = c.p.inputs();
    i.lse = TensorView{};
    attention_target(i, {want.view()}, c.p.options());
    EXPECT_TRUE(bitwise_equal(want, c.out));
    const std::vector<double> naive = naive_selected_attention_target(c.p, true);
    EXPECT_TRUE(compare(c.out, naive).ok(1e-6)) << compare(c.out, naive).str();
  }
}

TEST(CApi, AttentionTargetFailures) {
  struct TargetFailure {
    const char* name;
    dsaib_status status;
    const char* message_start;
    void (*mutate)(CTarget&);
  };
  const TargetFailure failures[] = {
      {"query dtype", DSAIB_INVALID_ARGUMENT, "query: expected dtype bf16, got dtype f32",
       [](CTarget& c) { c.in.query.dtype = DSAIB_F32; }},
      {"dtype enum", DSAIB_INVALID_ARGUMENT, "lse: expected dtype 0 (bf16), 1 (f32), 2 (i32), 3 (f64) or 4 (e4m3), got 9",
       [](CTarget& c) { c.in.lse.dtype = 9; }},
      {"rank enum", DSAIB_INVALID_ARGUMENT, "attn_score: expected rank 0..4, got 7",
       [](CTarget& c) { c.c_out.attn_score.rank = 7; }},
      {"device enum", DSAIB_INVALID_ARGUMENT, "kv: expected device 0 (cpu) or 1 (cuda), got 3",
       [](CTarget& c) { c.in.kv.device = 3; }},
      {"lse_base enum", DSAIB_INVALID_ARGUMENT, "lse_base: expected 0 (natural) or 1 (base2), got 2",
       [](CTarget& c) { c.opt.lse_base = 2; }},
      {"lse_base before a rank enum", DSAIB_INVALID_ARGUMENT, "lse_base: expected 0 (natural) or 1 (base2), got -1",
       [](CTarget& c) {
         c.opt.lse_base = -1;
         c.in.query.rank = 9;
       }},
      {"lse shape", DSAIB_INVALID_ARGUMENT, "lse: expected shape", [](CTarget& c) { c.in.lse.shape[2] = 3; }},
      {"sm_scale", DSAIB_INVALID_ARGUMENT, "sm_scale: expected a finite value, got",
       [](CTarget& c) { c.opt.sm_scale = std::numeric_limits<float>::quiet_NaN(); }},
      {"strict", DSAIB_INDEX_OUT_OF_RANGE, "topk_indices: strict mode found an out-of-range id",
       [](CTarget& c) {
         c.opt.strict_indices = 1;
         c.p.ids()[5] = 1000;
       }},
      {"cuda before a dtype enum", DSAIB_BACKEND_UNAVAILABLE, "backend: expected cpu",
       [](CTarget& c) {
         c.opt.backend = DSAIB_BACKEND_CUDA;
         c.in.kv.dtype = 9;
       }},
  };
  for (const TargetFailure& f : failures) {
    SCOPED_TRACE(f.name);
    if (f.status == DSAIB_BACKEND_UNAVAILABLE && dsaib_cuda_backend_available()) continue;
    CTarget c(Layout::bshd);
    f.mutate(c);
    const Snapshot out(c.out), q(c.p.query), kv(c.p.kv), lse(c.p.lse), ids(c.p.topk_indices);
    EXPECT_EQ(dsaib_attention_target(&c.in, &c.c_out, &c.opt, nullptr, 0), f.status);
    const std::string msg = dsaib_last_error();
    EXPECT_EQ(msg.rfind(f.message_start, 0), 0u) << msg;
    EXPECT_NE(msg.find("got"), std::string::npos) << msg;
    size_t bytes = 7;
    EXPECT_EQ(dsaib_attention_target_workspace_size(&c.in, &c.c_out, &c.opt, &bytes), f.status);
    EXPECT_EQ(std::string(dsaib_last_error()), msg);
    EXPECT_EQ(bytes, 7u);
    EXPECT_TRUE(out.unchanged() && q.unchanged() && kv.unchanged() && lse.unchanged() && ids.unchanged());
  }
  CTarget c(Layout::thd);
  EXPECT_EQ(dsaib_attention_target(&c.in, nullptr, &c.opt, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "outputs: expected a non-null pointer, got NULL");
  EXPECT_EQ(dsaib_attention_target(&c.in, &c.c_out, nullptr, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "options: expected a non-null pointer, got NULL");
  EXPECT_EQ(dsaib_attention_target_workspace_size(&c.in, &c.c_out, &c.opt, nullptr), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "bytes: expected a non-null pointer, got NULL");
}

// ---------------------------------------------------------- top-k ---

struct CTopk {
  TopkProblem p;
  TopkOutputs out;
  dsaib_indexer_topk_inputs in;
  dsaib_indexer_topk_outputs c_out;
  dsaib_indexer_topk_options opt;
  explicit CTopk(Layout layout, bool ranges = false, bool e4m3 = false)
      : p(make_topk_problem([&] {
          TopkSpec s;
          s.layout = layout;
          s.e4m3 = e4m3;  // with both scales
          s.q_lens = {4, 6};
          s.k_lens = {7, 12};
          s.ranges = ranges;
          s.topk = 5;
          s.seed = 91;
          return s;
        }())),
        out(p, 5) {
    const IndexerTopkInputs i = p.inputs();
    in = {to_c(i.index_q),      to_c(i.weights),      to_c(i.index_k),       to_c(i.starts),       to_c(i.ends),
          to_c(i.cu_seqlens_q), to_c(i.cu_seqlens_k), to_c(i.index_q_scale), to_c(i.index_k_scale)};
    const IndexerTopkOutputs o = out.views();
    c_out = {to_c(o.topk_indices), to_c(o.topk_logits), to_c(o.topk_lengths)};
    dsaib_default_indexer_topk_options(&opt);
    opt.layout = static_cast<int32_t>(layout);
  }
};

TEST(CApi, IndexerTopkDefaultOptionsMatchCpp) {
  dsaib_indexer_topk_options o;
  std::memset(&o, 0x7f, sizeof o);
  dsaib_default_indexer_topk_options(&o);
  const IndexerTopkOptions d;
  EXPECT_EQ(o.layout, DSAIB_BSHD);
  EXPECT_EQ(o.id_mode, DSAIB_IDS_LOCAL);
  EXPECT_EQ(o.backend, DSAIB_BACKEND_CPU);
  EXPECT_EQ(o.order, DSAIB_TOPK_LOGIT_DESCENDING);
  EXPECT_EQ(o.causal_offset, DSAIB_CAUSAL_OFFSET_AUTO);
  EXPECT_EQ(o.causal_offset, d.causal_offset);
  EXPECT_EQ(o.strict_ranges, 0);
  EXPECT_EQ(o.stream, nullptr);
  EXPECT_EQ(o.num_threads, 0);
  EXPECT_EQ(DSAIB_TOPK_ID_ASCENDING, static_cast<int>(TopkOrder::id_ascending));
  dsaib_default_indexer_topk_options(nullptr);  // tolerated
}

TEST(CApi, IndexerTopkMatchesCpp) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    for (int order : {DSAIB_TOPK_LOGIT_DESCENDING, DSAIB_TOPK_ID_ASCENDING}) {
      for (bool e4m3 : {false, true}) {  // e4m3: DSAIB_E4M3 index_q and index_k with both scales
        CTopk c(layout, layout == Layout::thd, e4m3);
        if (e4m3) {
          ASSERT_EQ(c.in.index_q.dtype, DSAIB_E4M3);
          ASSERT_NE(c.in.index_q_scale.data, nullptr);
          ASSERT_NE(c.in.index_k_scale.data, nullptr);
        }
        c.opt.order = order;
        c.opt.id_mode = DSAIB_IDS_GLOBAL;
        size_t bytes = 123;
        ASSERT_EQ(dsaib_indexer_topk_workspace_size(&c.in, &c.c_out, &c.opt, &bytes), DSAIB_OK) << dsaib_last_error();
        EXPECT_EQ(bytes, 0u);
        ASSERT_EQ(dsaib_indexer_topk(&c.in, &c.c_out, &c.opt, nullptr, 0), DSAIB_OK) << dsaib_last_error();
        EXPECT_STREQ(dsaib_last_error(), "");
        IndexerTopkOptions opt = c.p.options();
        opt.order = static_cast<TopkOrder>(order);
        opt.id_mode = IdMode::global;
        TopkOutputs want(c.p, 5);
        indexer_topk(c.p.inputs(), want.views(), opt);
        EXPECT_TRUE(bitwise_equal(want.ids, c.out.ids));
        EXPECT_TRUE(bitwise_equal(want.logits, c.out.logits));
        EXPECT_TRUE(bitwise_equal(want.lengths, c.out.lengths));
        const BruteTopk brute = brute_force_topk(c.p, opt, 5);
        for (size_t k = 0; k < brute.ids.size(); ++k) EXPECT_EQ(c.out.ids.data<int32_t>()[k], brute.ids[k]) << k;
      }
    }
  }
}

TEST(CApi, IndexerTopkFailures) {
  struct TopkFailure {
    const char* name;
    dsaib_status status;
    const char* message_start;
    void (*mutate)(CTopk&);
  };
  const TopkFailure failures[] = {
      {"order enum", DSAIB_INVALID_ARGUMENT, "order: expected 0 (logit_descending) or 1 (id_ascending), got 2",
       [](CTopk& c) { c.opt.order = 2; }},
      {"order before a rank enum", DSAIB_INVALID_ARGUMENT, "order: expected", [](CTopk& c) {
         c.opt.order = -1;
         c.in.index_q.rank = 9;
       }},
      {"rank enum", DSAIB_INVALID_ARGUMENT, "topk_lengths: expected rank 0..4, got 7",
       [](CTopk& c) { c.c_out.topk_lengths.rank = 7; }},
      {"dtype enum", DSAIB_INVALID_ARGUMENT, "ends: expected dtype 0 (bf16), 1 (f32), 2 (i32), 3 (f64) or 4 (e4m3), got 9",
       [](CTopk& c) { c.in.ends.dtype = 9; }},
      {"ends absent", DSAIB_INVALID_ARGUMENT, "ends: expected a tensor (starts and ends come together, or neither)",
       [](CTopk& c) { c.in.ends = dsaib_tensor{}; }},
      {"index_k dtype", DSAIB_INVALID_ARGUMENT, "index_k: expected dtype bf16 or e4m3, got dtype f32",
       [](CTopk& c) { c.in.index_k.dtype = DSAIB_F32; }},
      {"strict ranges", DSAIB_INDEX_OUT_OF_RANGE, "ends: strict mode found a range outside its sequence's keys",
       [](CTopk& c) {
         c.opt.strict_ranges = 1;
         c.p.starts.data<int32_t>()[1] = 0;
         c.p.ends.data<int32_t>()[1] = 100;
       }},
      {"cuda before a dtype enum", DSAIB_BACKEND_UNAVAILABLE, "backend: expected cpu", [](CTopk& c) {
         c.opt.backend = DSAIB_BACKEND_CUDA;
         c.in.index_k.dtype = 9;
       }},
  };
  for (const TopkFailure& f : failures) {
    SCOPED_TRACE(f.name);
    if (f.status == DSAIB_BACKEND_UNAVAILABLE && dsaib_cuda_backend_available()) continue;
    CTopk c(Layout::bshd, true);
    f.mutate(c);
    const Snapshot ids(c.out.ids), logits(c.out.logits), lengths(c.out.lengths), q(c.p.index_q), k(c.p.index_k);
    EXPECT_EQ(dsaib_indexer_topk(&c.in, &c.c_out, &c.opt, nullptr, 0), f.status);
    const std::string msg = dsaib_last_error();
    EXPECT_EQ(msg.rfind(f.message_start, 0), 0u) << msg;
    EXPECT_NE(msg.find("got"), std::string::npos) << msg;
    size_t bytes = 7;
    EXPECT_EQ(dsaib_indexer_topk_workspace_size(&c.in, &c.c_out, &c.opt, &bytes), f.status);
    EXPECT_EQ(std::string(dsaib_last_error()), msg);
    EXPECT_EQ(bytes, 7u);
    EXPECT_TRUE(ids.unchanged() && logits.unchanged() && lengths.unchanged() && q.unchanged() && k.unchanged());
  }
  CTopk c(Layout::thd);
  EXPECT_EQ(dsaib_indexer_topk(nullptr, &c.c_out, &c.opt, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "inputs: expected a non-null pointer, got NULL");
  EXPECT_EQ(dsaib_indexer_topk(&c.in, nullptr, &c.opt, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "outputs: expected a non-null pointer, got NULL");
  EXPECT_EQ(dsaib_indexer_topk(&c.in, &c.c_out, nullptr, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "options: expected a non-null pointer, got NULL");
  EXPECT_EQ(dsaib_indexer_topk_workspace_size(&c.in, &c.c_out, &c.opt, nullptr), DSAIB_INVALID_ARGUMENT);
  EXPECT_STREQ(dsaib_last_error(), "bytes: expected a non-null pointer, got NULL");
}

TEST(CApi, CudaAvailabilityAgreesWithCpp) {
  EXPECT_EQ(dsaib_cuda_backend_available() != 0, cuda_backend_available());
}

}  // namespace
}  // namespace dsaib::test
