// The launch plans of every kernel family (src/hopper/launch/launch_plan.hpp),
// host code only: which kernel, the grid, the start delays, the L2 share and
// where each part of the workspace lies, for an H200-like device, without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/problem.hpp"
#include "hopper/launch/launch_plan.hpp"
#include "hopper/launch/workspace.hpp"
#include "support/test_support.hpp"

namespace dsaib::hopper {
namespace {

constexpr int64_t kMiB = 1 << 20;

/// The H200 as the cuda backend queries it in a fresh context.
DeviceProperties h200(int64_t set_aside = 11 * kMiB + kMiB / 4) {
  DeviceProperties d;
  d.sm_count = 132;
  d.l2_bytes = 60 * kMiB;
  d.persisting_l2_bytes = set_aside;
  d.ctas_per_sm = 1;
  return d;
}

/// The geometry validate_problem gives a BSHD problem (only what a plan reads).
detail::ProblemGeometry bshd(int64_t batch, int64_t s_q, int64_t s_kv, int64_t heads, int64_t head_dim, int64_t topk) {
  detail::ProblemGeometry g;
  g.batch = batch;
  g.heads = heads;
  g.head_dim = head_dim;
  g.topk = topk;
  g.s_q = s_q;
  g.s_kv = s_kv;
  g.num_q_rows = batch * s_q;
  g.num_k_rows = batch * s_kv;
  g.normalization_count = std::max<int64_t>(g.num_q_rows, 1);
  if (g.num_q_rows == 0) return g;  // no query rows: no per-sequence tables
  g.q_len.assign(static_cast<size_t>(batch), s_q);
  g.k_len.assign(static_cast<size_t>(batch), s_kv);
  for (int64_t b = 0; b < batch; ++b) {
    g.q_start.push_back(b * s_q);
    g.k_start.push_back(b * s_kv);
  }
  return g;
}

IndexerOptions options(L2Hints l2 = L2Hints::automatic, StartStagger stagger = StartStagger::automatic) {
  IndexerOptions o;
  o.backend = Backend::cuda;
  o.l2_hints = l2;
  o.start_stagger = stagger;
  return o;
}

TEST(BackwardPlan, DeepSeekShape) {
  // B1 S 4096 H64 D128 topk 2048, bf16 outputs: the one-term kernel, 4096 tasks
  // on 132 CTAs (31 waves and 4 tasks), the delays of start_stagger.hpp, the fp32
  // dK accumulator as the workspace, no L2 hint (dK + K 6 MiB).
  const detail::ProblemGeometry g = bshd(1, 4096, 4096, 64, 128, 2048);
  const BackwardPlan p = plan_backward(g, DType::bf16, DType::bf16, options(), h200());
  EXPECT_EQ(p.kernel.head_dim, 128);
  EXPECT_FALSE(p.kernel.split_a);
  EXPECT_FALSE(p.kernel.l2_keep_dk);
  EXPECT_FALSE(p.kernel.fixed_point_dk);
  EXPECT_EQ(p.head_groups, 1);
  EXPECT_EQ(p.num_tasks, 4096);
  EXPECT_EQ(p.grid, 132);
  EXPECT_EQ(p.start_delays.first_delayed_cta, 4);
  EXPECT_EQ(p.start_delays.max_ns, start_delays_for_launch(4096, 132, 1, 2048, {4096}, {4096}, 128).max_ns);
  EXPECT_GT(p.start_delays.max_ns, 0u);
  EXPECT_EQ(p.l2_keep_fraction, L2KeepFraction::f035);
  EXPECT_EQ(p.workspace_bytes, std::size_t{4096} * 128 * 4);
  EXPECT_EQ(p.device.sm_count, 132);
}

TEST(BackwardPlan, StartStaggerOffPlansNoDelays) {
  const detail::ProblemGeometry g = bshd(1, 4096, 4096, 64, 128, 2048);
  const BackwardPlan automatic = plan_backward(g, DType::bf16, DType::bf16, options(), h200());
  const BackwardPlan off = plan_backward(g, DType::bf16, DType::bf16, options(L2Hints::automatic, StartStagger::off), h200());
  ASSERT_GT(automatic.start_delays.max_ns, 0u);
  EXPECT_EQ(off.start_delays.max_ns, 0u);
  EXPECT_EQ(off.start_delays.first_delayed_cta, 0);
  // Nothing else moves.
  EXPECT_EQ(off.grid, automatic.grid);
  EXPECT_EQ(off.kernel.l2_keep_dk, automatic.kernel.l2_keep_dk);
}

TEST(BackwardPlan, AOperandFollowsThePrecisionAndTheOutputs) {
  const detail::ProblemGeometry g = bshd(1, 64, 512, 64, 128, 200);
  EXPECT_FALSE(plan_backward(g, DType::bf16, DType::bf16, options(), h200()).kernel.split_a);
  EXPECT_TRUE(plan_backward(g, DType::f32, DType::bf16, options(), h200()).kernel.split_a);
  EXPECT_TRUE(plan_backward(g, DType::bf16, DType::f32, options(), h200()).kernel.split_a);
  IndexerOptions o = options();
  o.a_operand_precision = AOperandPrecision::bf16;
  EXPECT_FALSE(plan_backward(g, DType::f32, DType::f32, o, h200()).kernel.split_a);
  o.a_operand_precision = AOperandPrecision::bf16x2;
  EXPECT_TRUE(plan_backward(g, DType::bf16, DType::bf16, o, h200()).kernel.split_a);
  // An f32 d_index_k is its own accumulator: no workspace.
  EXPECT_EQ(plan_backward(g, DType::f32, DType::f32, options(), h200()).workspace_bytes, 0u);
}

TEST(BackwardPlan, L2HintsAutomaticOnAndOff) {
  // B1 S 65536 D128: dK + K 48 MiB, over half of the 60 MiB: hinted, share 0.35
  // at the default set-aside, 1.0 at the 37.5 MiB cap (which holds the 32 MiB dK).
  const detail::ProblemGeometry large = bshd(1, 65536, 65536, 64, 128, 2048);
  const BackwardPlan p = plan_backward(large, DType::bf16, DType::bf16, options(), h200());
  EXPECT_TRUE(p.kernel.l2_keep_dk);
  EXPECT_EQ(p.l2_keep_fraction, L2KeepFraction::f035);
  const BackwardPlan cap = plan_backward(large, DType::bf16, DType::bf16, options(), h200(37 * kMiB + kMiB / 2));
  EXPECT_TRUE(cap.kernel.l2_keep_dk);
  EXPECT_EQ(cap.l2_keep_fraction, L2KeepFraction::f100);
  EXPECT_FALSE(plan_backward(large, DType::bf16, DType::bf16, options(L2Hints::off), h200()).kernel.l2_keep_dk);
  // An unknown L2 size: no automatic hint.
  DeviceProperties unknown = h200();
  unknown.l2_bytes = 0;
  EXPECT_FALSE(plan_backward(large, DType::bf16, DType::bf16, options(), unknown).kernel.l2_keep_dk);

  // A small table: unhinted unless forced on; forced on, its 150 KiB of dK fit
  // the set-aside whole (share 1.0).
  const detail::ProblemGeometry small = bshd(1, 16, 300, 64, 128, 200);
  EXPECT_FALSE(plan_backward(small, DType::bf16, DType::bf16, options(), h200()).kernel.l2_keep_dk);
  const BackwardPlan on = plan_backward(small, DType::bf16, DType::bf16, options(L2Hints::on), h200());
  EXPECT_TRUE(on.kernel.l2_keep_dk);
  EXPECT_EQ(on.l2_keep_fraction, L2KeepFraction::f100);
  EXPECT_EQ(plan_backward(small, DType::bf16, DType::bf16, options(L2Hints::on), h200(0)).l2_keep_fraction,
            L2KeepFraction::f035);
}

TEST(BackwardPlan, SplitAAndDeterministicKernelsAreNeverHinted) {
  const detail::ProblemGeometry large = bshd(1, 65536, 65536, 64, 128, 2048);
  for (L2Hints mode : {L2Hints::automatic, L2Hints::on}) {
    const BackwardPlan split = plan_backward(large, DType::f32, DType::f32, options(mode), h200());
    EXPECT_TRUE(split.kernel.split_a);
    EXPECT_FALSE(split.kernel.l2_keep_dk) << l2_hints_name(mode);
    IndexerOptions o = options(mode);
    o.deterministic = true;
    const BackwardPlan det = plan_backward(large, DType::bf16, DType::bf16, o, h200());
    EXPECT_TRUE(det.kernel.fixed_point_dk);
    EXPECT_FALSE(det.kernel.l2_keep_dk) << l2_hints_name(mode);
    EXPECT_EQ(det.l2_keep_fraction, L2KeepFraction::f035);
    // The int64 accumulator (rounded up to 256 bytes) and its 16-byte bound.
    EXPECT_EQ(det.workspace_bytes, std::size_t{65536} * 128 * 8 + 16);
    EXPECT_EQ(det.workspace_bytes, dk_fixed_workspace_bytes(65536, 128));
  }
  EXPECT_EQ(dk_fixed_workspace_bytes(3, 64), std::size_t{1536} + 16);
  EXPECT_EQ(dk_fixed_bound_offset(1, 64), std::size_t{512});
  EXPECT_EQ(dk_fixed_bound_offset(1, 1), std::size_t{256});
}

TEST(BackwardPlan, GridAndTasks) {
  // H128: two tasks per query row.
  const BackwardPlan h128 = plan_backward(bshd(1, 4096, 4096, 128, 128, 2048), DType::bf16, DType::bf16, options(), h200());
  EXPECT_EQ(h128.head_groups, 2);
  EXPECT_EQ(h128.num_tasks, 8192);
  EXPECT_EQ(h128.start_delays.first_delayed_cta, 8192 % 132);
  // H72: two tasks per row too (64 + 8 heads).
  EXPECT_EQ(plan_backward(bshd(2, 40, 300, 72, 128, 160), DType::bf16, DType::bf16, options(), h200()).num_tasks, 160);
  // Fewer tasks than SMs: one CTA per task, no delays (one partial wave).
  const BackwardPlan few = plan_backward(bshd(1, 48, 512, 64, 64, 100), DType::bf16, DType::bf16, options(), h200());
  EXPECT_EQ(few.kernel.head_dim, 64);
  EXPECT_EQ(few.grid, 48);
  EXPECT_EQ(few.start_delays.max_ns, 0u);
  // No rows: no grid, no delays.
  const BackwardPlan none = plan_backward(bshd(1, 0, 512, 64, 128, 100), DType::bf16, DType::bf16, options(), h200());
  EXPECT_EQ(none.num_tasks, 0);
  EXPECT_EQ(none.grid, 0);
  EXPECT_EQ(none.start_delays.max_ns, 0u);
  // Two resident CTAs per SM: twice the grid.
  DeviceProperties two = h200();
  two.ctas_per_sm = 2;
  EXPECT_EQ(plan_backward(bshd(1, 4096, 4096, 64, 128, 2048), DType::bf16, DType::bf16, options(), two).grid, 264);
}

TEST(EveryPlan, NoQueryRowsOfAnyBatchPlanNothing) {
  // BSHD without query rows: validate_problem builds no per-sequence tables,
  // whatever B is; every plan has no grid and no workspace for rows.
  const detail::ProblemGeometry g = bshd((int64_t{1} << 31) - 1, 0, 0, 64, 128, 2048);
  ASSERT_TRUE(g.q_len.empty());
  const BackwardPlan b = plan_backward(g, DType::bf16, DType::bf16, options(), h200());
  EXPECT_EQ(b.num_tasks, 0);
  EXPECT_EQ(b.grid, 0);
  EXPECT_EQ(b.start_delays.max_ns, 0u);
  EXPECT_EQ(plan_kl_forward(g, h200()).grid, 0);
  EXPECT_EQ(plan_loss_and_grad(g, DType::bf16, DType::bf16, options(), h200(), h200()).kernel.grid, 0);
  const TopkPlan t = plan_indexer_topk(g, true, true, h200());
  EXPECT_EQ(t.num_tasks, 0);
  EXPECT_EQ(t.order_grid, 0);
  const detail::ProblemGeometry target = bshd((int64_t{1} << 31) - 1, 0, 0, 128, 576, 2048);
  EXPECT_EQ(plan_attention_target(target, h200()).grid, 0);
}

TEST(BackwardPlan, RefusesKeyRowsPastInt32) {
  detail::ProblemGeometry g = bshd(1, 1, 1, 64, 128, 1);
  g.num_k_rows = int64_t{1} << 31;
  g.k_len = {g.num_k_rows};
  try {
    (void)plan_backward(g, DType::bf16, DType::f32, options(), h200());
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_EQ(e.argument(), "index_k");
    EXPECT_NE(std::string(e.what()).find("got 2147483648"), std::string::npos) << e.what();
  }
}

TEST(BackwardPlan, FromAValidatedProblem) {
  // THD with sequences of 1, 37 and 30 rows through validate_problem: the plan
  // reads the per-sequence lengths (the delays' cheapest task, the L2 windows).
  GenerateSpec spec = test::small_spec(3);
  spec.layout = Layout::thd;
  spec.batch = 0;
  spec.s_q = spec.s_kv = 0;
  spec.seqlens_q = {1, 37, 30};
  spec.seqlens_k = {1, 37, 30};
  spec.heads = 64;
  spec.head_dim = 128;
  spec.topk = 64;
  const GeneratedProblem p = test::make_problem(spec);
  const test::OutputBuffers out = test::make_outputs(p, DType::bf16, DType::f32, DType::bf16);
  IndexerOptions o = p.options();  // cpu: validation reads the host cu_seqlens in place
  const detail::ProblemGeometry g = detail::validate_problem(p.inputs(), out.views(), o);
  o.backend = Backend::cuda;
  const BackwardPlan plan = plan_backward(g, DType::bf16, DType::bf16, o, h200());
  EXPECT_EQ(plan.num_tasks, 68);
  EXPECT_EQ(plan.grid, 68);
  EXPECT_EQ(plan.workspace_bytes, std::size_t{68} * 128 * 4);
  EXPECT_TRUE(plan_backward(g, DType::bf16, DType::bf16, options(L2Hints::on), h200()).kernel.l2_keep_dk);
}

TEST(WorkspaceCarver, PartsAt256ByteBoundaries) {
  WorkspaceCarver ws;
  EXPECT_EQ(ws.add(10), 0u);
  EXPECT_EQ(ws.add(0), 256u);
  EXPECT_EQ(ws.add(512), 256u);  // an empty part takes no room
  EXPECT_EQ(ws.add(1), 768u);
  EXPECT_EQ(ws.total(), 769u);   // the end of the last part, not rounded
  EXPECT_EQ(WorkspaceCarver{}.total(), 0u);
}

/// Every part of a plan's workspace lies inside it, at a 256-byte boundary.
void expect_inside(std::size_t at, std::size_t bytes, std::size_t total, const char* what) {
  EXPECT_EQ(at % 256, 0u) << what;
  EXPECT_LE(at + bytes, total) << what;
}

TEST(ForwardPlan, KernelGridAndWorkspace) {
  const detail::ProblemGeometry g = bshd(2, 1000, 1000, 64, 128, 2048);
  const ForwardPlan p = plan_kl_forward(g, h200());
  EXPECT_EQ(p.kernel.head_dim, 128);
  EXPECT_EQ(p.kernel.head_tile, 64);
  EXPECT_EQ(p.grid, 132);
  EXPECT_EQ(p.z_stride, 2048);
  EXPECT_EQ(p.loss_terms_at, 0u);
  EXPECT_EQ(p.z_scratch_at, 16128u);  // after 2000 fp64 terms (16000 bytes), at the next 256-byte boundary
  EXPECT_EQ(p.workspace_bytes, 16128u + std::size_t{132} * 2048 * 4);
  // Every head of a row in one task: H 72 takes the 128-head tile; topk 100 is 128 floats of z.
  const ForwardPlan h72 = plan_kl_forward(bshd(1, 10, 300, 72, 64, 100), h200());
  EXPECT_EQ(h72.kernel.head_dim, 64);
  EXPECT_EQ(h72.kernel.head_tile, 128);
  EXPECT_EQ(h72.grid, 10);
  EXPECT_EQ(h72.z_stride, 128);
  EXPECT_EQ(plan_kl_forward(bshd(1, 0, 300, 64, 64, 100), h200()).grid, 0);
  // 32 heads or fewer take the 32-head tile (GLM-5's 32), 33 the 64-head one.
  EXPECT_EQ(plan_kl_forward(bshd(1, 10, 300, 32, 128, 512), h200()).kernel.head_tile, 32);
  EXPECT_EQ(plan_kl_forward(bshd(1, 10, 300, 8, 64, 512), h200()).kernel.head_tile, 32);
  EXPECT_EQ(plan_kl_forward(bshd(1, 10, 300, 33, 128, 512), h200()).kernel.head_tile, 64);
}

TEST(ForwardPlan, FromTheTopkLogitsNoZScratch) {
  const detail::ProblemGeometry g = bshd(2, 1000, 1000, 64, 128, 2048);
  DeviceProperties device = h200();
  device.ctas_per_sm = 7;  // the from-logits kernel's occupancy
  const ForwardPlan p = plan_kl_forward(g, device, /*from_logits=*/true);
  EXPECT_TRUE(p.kernel.from_logits);
  EXPECT_EQ(p.grid, 132 * 7);
  EXPECT_EQ(p.z_stride, 0);  // the given logits are read where they lie
  EXPECT_EQ(p.loss_terms_at, 0u);
  EXPECT_EQ(p.workspace_bytes, 2000u * 8);
  EXPECT_FALSE(plan_kl_forward(g, h200()).kernel.from_logits);
}

TEST(BackwardCallPlan, TheThreeFormsOfTheCall) {
  const detail::ProblemGeometry g = bshd(1, 4096, 4096, 64, 128, 2048);
  // P form: the kernel's workspace alone (the fp32 dK accumulator of a bf16 d_index_k).
  const BackwardCallPlan p_form = plan_backward_call(g, DType::bf16, DType::bf16, options(L2Hints::on), false, h200(), h200());
  EXPECT_FALSE(p_form.p_free_kernels);
  EXPECT_FALSE(p_form.prepass);
  EXPECT_TRUE(p_form.kernel.kernel.l2_keep_dk);
  EXPECT_EQ(p_form.kernel_at, 0u);
  EXPECT_EQ(p_form.workspace_bytes, std::size_t{4096} * 128 * 4);
  // P-free, H <= 64: the P-free kernels, the packed statistics first, never L2-hinted.
  const BackwardCallPlan p_free = plan_backward_call(g, DType::bf16, DType::bf16, options(L2Hints::on), true, h200(), h200());
  EXPECT_TRUE(p_free.p_free_kernels);
  EXPECT_FALSE(p_free.prepass);
  EXPECT_FALSE(p_free.kernel.kernel.l2_keep_dk);
  EXPECT_EQ(p_free.packed_stats_at, 0u);
  EXPECT_EQ(p_free.kernel_at, std::size_t{4096} * 8);
  EXPECT_EQ(p_free.workspace_bytes, std::size_t{4096} * 8 + std::size_t{4096} * 128 * 4);
  // P-free, H > 64 (or deterministic): the forward writes P first, then the P form.
  const detail::ProblemGeometry h128 = bshd(1, 512, 512, 128, 128, 256);
  const BackwardCallPlan pre = plan_backward_call(h128, DType::bf16, DType::bf16, options(), true, h200(), h200());
  EXPECT_TRUE(pre.prepass);
  EXPECT_FALSE(pre.p_free_kernels);
  EXPECT_EQ(pre.forward.kernel.head_tile, 128);
  const std::size_t rows = 512 * 4;
  expect_inside(pre.kernel_at, pre.kernel.workspace_bytes, pre.workspace_bytes, "kernel");
  expect_inside(pre.p_at, rows * 256, pre.workspace_bytes, "P");
  expect_inside(pre.lse_at, rows, pre.workspace_bytes, "row_lse");
  expect_inside(pre.mass_at, rows, pre.workspace_bytes, "row_target_mass");
  expect_inside(pre.loss_at, 4, pre.workspace_bytes, "loss");
  expect_inside(pre.forward_at, pre.forward.workspace_bytes, pre.workspace_bytes, "forward");
  EXPECT_EQ(pre.workspace_bytes, pre.forward_at + pre.forward.workspace_bytes);
  IndexerOptions det = options();
  det.deterministic = true;
  EXPECT_TRUE(plan_backward_call(g, DType::bf16, DType::bf16, det, true, h200(), h200()).prepass);
  EXPECT_FALSE(plan_backward_call(g, DType::bf16, DType::bf16, det, false, h200(), h200()).prepass);
}

TEST(LossAndGradPlan, OneKernelWhereItApplies) {
  const detail::ProblemGeometry g = bshd(1, 4096, 4096, 64, 128, 2048);
  const LossAndGradPlan one = plan_loss_and_grad(g, DType::bf16, DType::bf16, options(L2Hints::on), h200(), h200());
  EXPECT_TRUE(one.one_kernel);
  EXPECT_FALSE(one.kernel.kernel.l2_keep_dk);  // the P-free backward's plan
  EXPECT_EQ(one.kernel.grid, 132);
  EXPECT_EQ(one.z_stride, 2048);
  const std::size_t rows = 4096 * 4;
  expect_inside(one.lse_at, rows, one.workspace_bytes, "row_lse");
  expect_inside(one.mass_at, rows, one.workspace_bytes, "row_target_mass");
  expect_inside(one.loss_terms_at, 4096 * 8, one.workspace_bytes, "loss terms");
  expect_inside(one.z_scratch_at, std::size_t{132} * 2048 * 4, one.workspace_bytes, "z scratch");
  expect_inside(one.dk_at, std::size_t{4096} * 128 * 4, one.workspace_bytes, "dK accumulator");
  EXPECT_EQ(one.workspace_bytes, one.dk_at + std::size_t{4096} * 128 * 4);
  // An f32 d_index_k is its own accumulator.
  const LossAndGradPlan f32 = plan_loss_and_grad(g, DType::bf16, DType::f32, [] {
    IndexerOptions o = options();
    o.a_operand_precision = AOperandPrecision::bf16;
    return o;
  }(), h200(), h200());
  EXPECT_TRUE(f32.one_kernel);
  EXPECT_EQ(f32.workspace_bytes, f32.z_scratch_at + std::size_t{132} * 2048 * 4);
}

TEST(LossAndGradPlan, TwoKernelsOtherwise) {
  const detail::ProblemGeometry g = bshd(1, 4096, 4096, 64, 128, 2048);
  IndexerOptions off = options();
  off.forward_fusion = ForwardFusion::off;
  const LossAndGradPlan two = plan_loss_and_grad(g, DType::bf16, DType::bf16, off, h200(), h200());
  EXPECT_FALSE(two.one_kernel);
  EXPECT_FALSE(two.with_p);
  EXPECT_TRUE(two.backward.p_free_kernels);  // from the forward's row statistics
  EXPECT_EQ(two.workspace_bytes, two.scratch_at + std::max(two.forward.workspace_bytes, two.backward.workspace_bytes));
  // Two A terms (an f32 gradient, automatic), H > 64 or deterministic: not one kernel.
  EXPECT_FALSE(plan_loss_and_grad(g, DType::f32, DType::bf16, options(), h200(), h200()).one_kernel);
  IndexerOptions det = options();
  det.deterministic = true;
  const LossAndGradPlan with_p = plan_loss_and_grad(g, DType::bf16, DType::bf16, det, h200(), h200());
  EXPECT_FALSE(with_p.one_kernel);
  EXPECT_TRUE(with_p.with_p);  // P in the workspace, then the P form
  EXPECT_FALSE(with_p.backward.p_free_kernels);
  EXPECT_FALSE(with_p.backward.prepass);
  expect_inside(with_p.p_at, std::size_t{4096} * 2048 * 4, with_p.workspace_bytes, "P");
  EXPECT_TRUE(plan_loss_and_grad(bshd(1, 64, 64, 128, 128, 64), DType::bf16, DType::bf16, options(), h200(), h200()).with_p);
}

TEST(LossAndGradPlan, FromTheTopkLogitsTheirForwardThenTheBackward) {
  const detail::ProblemGeometry g = bshd(1, 4096, 4096, 64, 128, 2048);
  EXPECT_FALSE(loss_and_grad_in_one_kernel(g, DType::bf16, DType::bf16, options(), /*from_logits=*/true));
  const LossAndGradPlan p =
      plan_loss_and_grad(g, DType::bf16, DType::bf16, options(), h200(), h200(), /*from_logits=*/true);
  EXPECT_FALSE(p.one_kernel);
  EXPECT_TRUE(p.forward.kernel.from_logits);
  EXPECT_EQ(p.forward.z_stride, 0);
  EXPECT_FALSE(p.with_p);
  EXPECT_TRUE(p.backward.p_free_kernels);  // from the forward's row statistics
  EXPECT_EQ(p.workspace_bytes, p.scratch_at + std::max(p.forward.workspace_bytes, p.backward.workspace_bytes));
  IndexerOptions det = options();
  det.deterministic = true;
  EXPECT_TRUE(plan_loss_and_grad(g, DType::bf16, DType::bf16, det, h200(), h200(), true).with_p);
}

TEST(TargetPlan, KernelGridAndLimits) {
  detail::ProblemGeometry g = bshd(1, 4096, 4096, 128, 576, 2048);  // Hq 128, Dqk 576
  const TargetPlan p = plan_attention_target(g, h200());
  EXPECT_EQ(p.kernel.heads_padded, 128);
  EXPECT_EQ(p.kernel.max_slices, 9);
  EXPECT_EQ(p.grid, 132);
  EXPECT_EQ(p.workspace_bytes, 0u);
  const TargetPlan small = plan_attention_target(bshd(1, 7, 64, 16, 192, 64), h200());
  EXPECT_EQ(small.kernel.heads_padded, 64);
  EXPECT_EQ(small.kernel.max_slices, 3);
  EXPECT_EQ(small.grid, 7);
  g.num_k_rows = int64_t{1} << 31;
  try {
    (void)plan_attention_target(g, h200());
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "kv");
  }
  g = bshd(1, 1, 1, 64, 576, int64_t{1} << 30);
  try {
    check_attention_target_limits(g);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "topk_indices");
  }
}

TEST(TopkPlan, TilesGridAndWorkspace) {
  // H 64: 4 rows per task, heads padded to 64; one CTA per SM over the tasks.
  const detail::ProblemGeometry g = bshd(1, 16384, 16384, 64, 128, 2048);
  const TopkPlan p = plan_indexer_topk(g, /*with_logits=*/true, /*with_lengths=*/true, h200());
  EXPECT_EQ(p.head_tile, 64);
  EXPECT_EQ(p.rows_per_task, 4);
  EXPECT_EQ(p.candidate_capacity, 2 * 2048 + 64);
  EXPECT_EQ(p.num_tasks, 4096);
  EXPECT_EQ(p.grid, 132);
  EXPECT_EQ(p.order_grid, 132 * 16);
  // The candidate buffers alone (33.5 MiB at this shape): 132 CTAs x
  // 4 rows x 2 halves x 4160 keys x 8 bytes, independent of S.
  const std::size_t buffers = std::size_t{132} * 4 * 2 * 4160 * 8;
  EXPECT_FALSE(p.key_hi_in_workspace);
  EXPECT_FALSE(p.row_count_in_workspace);
  EXPECT_EQ(p.candidates_at, 0u);
  EXPECT_EQ(p.workspace_bytes, buffers);
  EXPECT_EQ(plan_indexer_topk(bshd(1, 131072, 131072, 64, 128, 2048), true, true, h200()).workspace_bytes, buffers);

  // Without topk_logits and topk_lengths the selection's high words and the
  // rows' counts follow the buffers, each at a 256-byte boundary.
  const TopkPlan bare = plan_indexer_topk(bshd(1, 1000, 1000, 64, 128, 100), false, false, h200());
  EXPECT_EQ(bare.candidate_capacity, 2 * 128 + 64);  // topk below 128 keeps 128's room
  ASSERT_TRUE(bare.key_hi_in_workspace);
  ASSERT_TRUE(bare.row_count_in_workspace);
  const std::size_t bare_buffers = std::size_t{132} * 4 * 2 * 320 * 8;
  EXPECT_EQ(bare.key_hi_at, round_up_256(bare_buffers));
  EXPECT_EQ(bare.row_count_at, round_up_256(bare.key_hi_at + std::size_t{1000} * 100 * 4));
  EXPECT_EQ(bare.workspace_bytes, bare.row_count_at + std::size_t{1000} * 4);

  // Heads padded to 32 (8 rows per task) and 128 (2 rows); few rows: one CTA per task.
  const TopkPlan h8 = plan_indexer_topk(bshd(1, 20, 64, 8, 64, 16), true, true, h200());
  EXPECT_EQ(h8.head_tile, 32);
  EXPECT_EQ(h8.rows_per_task, 8);
  EXPECT_EQ(h8.num_tasks, 3);
  EXPECT_EQ(h8.grid, 3);
  EXPECT_EQ(h8.order_grid, 20);
  const TopkPlan h128 = plan_indexer_topk(bshd(2, 3, 64, 128, 128, 16), true, true, h200());
  EXPECT_EQ(h128.head_tile, 128);
  EXPECT_EQ(h128.rows_per_task, 2);
  EXPECT_EQ(h128.num_tasks, 3);  // 6 rows over the batch, tasks cross it

  // No query rows: nothing to launch and no workspace.
  const TopkPlan empty = plan_indexer_topk(bshd(1, 0, 64, 64, 128, 16), false, false, h200());
  EXPECT_EQ(empty.grid, 0);
  EXPECT_EQ(empty.workspace_bytes, 0u);
}

}  // namespace
}  // namespace dsaib::hopper
