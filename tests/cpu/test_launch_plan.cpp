// The cuda backend's launch plan (src/hopper/launch/launch_plan.hpp), host code only:
// which backward kernel, the grid, the start delays, the L2 share and the workspace
// for an H200-like device, without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/problem.hpp"
#include "hopper/launch/launch_plan.hpp"
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
  g.q_len.assign(static_cast<size_t>(batch), s_q);
  g.k_len.assign(static_cast<size_t>(batch), s_kv);
  for (int64_t b = 0; b < batch; ++b) {
    g.q_start.push_back(b * s_q);
    g.k_start.push_back(b * s_kv);
  }
  g.normalization_count = std::max<int64_t>(g.num_q_rows, 1);
  return g;
}

IndexerOptions options(L2Hints l2 = L2Hints::automatic, StartStagger stagger = StartStagger::automatic) {
  IndexerOptions o;
  o.backend = Backend::cuda;
  o.l2_hints = l2;
  o.start_stagger = stagger;
  return o;
}

TEST(LaunchPlan, DeepSeekShape) {
  // B1 S 4096 H64 D128 topk 2048, bf16 outputs: the one-term kernel, 4096 tasks
  // on 132 CTAs (31 waves and 4 tasks), the delays of start_stagger.hpp, the fp32
  // dK accumulator as the workspace, no L2 hint (dK + K 6 MiB).
  const detail::ProblemGeometry g = bshd(1, 4096, 4096, 64, 128, 2048);
  const LaunchPlan p = plan_launch(g, DType::bf16, DType::bf16, options(), h200());
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

TEST(LaunchPlan, StartStaggerOffPlansNoDelays) {
  const detail::ProblemGeometry g = bshd(1, 4096, 4096, 64, 128, 2048);
  const LaunchPlan automatic = plan_launch(g, DType::bf16, DType::bf16, options(), h200());
  const LaunchPlan off = plan_launch(g, DType::bf16, DType::bf16, options(L2Hints::automatic, StartStagger::off), h200());
  ASSERT_GT(automatic.start_delays.max_ns, 0u);
  EXPECT_EQ(off.start_delays.max_ns, 0u);
  EXPECT_EQ(off.start_delays.first_delayed_cta, 0);
  // Nothing else moves.
  EXPECT_EQ(off.grid, automatic.grid);
  EXPECT_EQ(off.kernel.l2_keep_dk, automatic.kernel.l2_keep_dk);
}

TEST(LaunchPlan, AOperandFollowsThePrecisionAndTheOutputs) {
  const detail::ProblemGeometry g = bshd(1, 64, 512, 64, 128, 200);
  EXPECT_FALSE(plan_launch(g, DType::bf16, DType::bf16, options(), h200()).kernel.split_a);
  EXPECT_TRUE(plan_launch(g, DType::f32, DType::bf16, options(), h200()).kernel.split_a);
  EXPECT_TRUE(plan_launch(g, DType::bf16, DType::f32, options(), h200()).kernel.split_a);
  IndexerOptions o = options();
  o.a_operand_precision = AOperandPrecision::bf16;
  EXPECT_FALSE(plan_launch(g, DType::f32, DType::f32, o, h200()).kernel.split_a);
  o.a_operand_precision = AOperandPrecision::bf16x2;
  EXPECT_TRUE(plan_launch(g, DType::bf16, DType::bf16, o, h200()).kernel.split_a);
  // An f32 d_index_k is its own accumulator: no workspace.
  EXPECT_EQ(plan_launch(g, DType::f32, DType::f32, options(), h200()).workspace_bytes, 0u);
}

TEST(LaunchPlan, L2HintsAutomaticOnAndOff) {
  // B1 S 65536 D128: dK + K 48 MiB, over half of the 60 MiB: hinted, share 0.35
  // at the default set-aside, 1.0 at the 37.5 MiB cap (which holds the 32 MiB dK).
  const detail::ProblemGeometry large = bshd(1, 65536, 65536, 64, 128, 2048);
  const LaunchPlan p = plan_launch(large, DType::bf16, DType::bf16, options(), h200());
  EXPECT_TRUE(p.kernel.l2_keep_dk);
  EXPECT_EQ(p.l2_keep_fraction, L2KeepFraction::f035);
  const LaunchPlan cap = plan_launch(large, DType::bf16, DType::bf16, options(), h200(37 * kMiB + kMiB / 2));
  EXPECT_TRUE(cap.kernel.l2_keep_dk);
  EXPECT_EQ(cap.l2_keep_fraction, L2KeepFraction::f100);
  EXPECT_FALSE(plan_launch(large, DType::bf16, DType::bf16, options(L2Hints::off), h200()).kernel.l2_keep_dk);
  // An unknown L2 size: no automatic hint.
  DeviceProperties unknown = h200();
  unknown.l2_bytes = 0;
  EXPECT_FALSE(plan_launch(large, DType::bf16, DType::bf16, options(), unknown).kernel.l2_keep_dk);

  // A small table: unhinted unless forced on; forced on, its 150 KiB of dK fit
  // the set-aside whole (share 1.0).
  const detail::ProblemGeometry small = bshd(1, 16, 300, 64, 128, 200);
  EXPECT_FALSE(plan_launch(small, DType::bf16, DType::bf16, options(), h200()).kernel.l2_keep_dk);
  const LaunchPlan on = plan_launch(small, DType::bf16, DType::bf16, options(L2Hints::on), h200());
  EXPECT_TRUE(on.kernel.l2_keep_dk);
  EXPECT_EQ(on.l2_keep_fraction, L2KeepFraction::f100);
  EXPECT_EQ(plan_launch(small, DType::bf16, DType::bf16, options(L2Hints::on), h200(0)).l2_keep_fraction,
            L2KeepFraction::f035);
}

TEST(LaunchPlan, SplitAAndDeterministicKernelsAreNeverHinted) {
  const detail::ProblemGeometry large = bshd(1, 65536, 65536, 64, 128, 2048);
  for (L2Hints mode : {L2Hints::automatic, L2Hints::on}) {
    const LaunchPlan split = plan_launch(large, DType::f32, DType::f32, options(mode), h200());
    EXPECT_TRUE(split.kernel.split_a);
    EXPECT_FALSE(split.kernel.l2_keep_dk) << l2_hints_name(mode);
    IndexerOptions o = options(mode);
    o.deterministic = true;
    const LaunchPlan det = plan_launch(large, DType::bf16, DType::bf16, o, h200());
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

TEST(LaunchPlan, GridAndTasks) {
  // H128: two tasks per query row.
  const LaunchPlan h128 = plan_launch(bshd(1, 4096, 4096, 128, 128, 2048), DType::bf16, DType::bf16, options(), h200());
  EXPECT_EQ(h128.head_groups, 2);
  EXPECT_EQ(h128.num_tasks, 8192);
  EXPECT_EQ(h128.start_delays.first_delayed_cta, 8192 % 132);
  // H72: two tasks per row too (64 + 8 heads).
  EXPECT_EQ(plan_launch(bshd(2, 40, 300, 72, 128, 160), DType::bf16, DType::bf16, options(), h200()).num_tasks, 160);
  // Fewer tasks than SMs: one CTA per task, no delays (one partial wave).
  const LaunchPlan few = plan_launch(bshd(1, 48, 512, 64, 64, 100), DType::bf16, DType::bf16, options(), h200());
  EXPECT_EQ(few.kernel.head_dim, 64);
  EXPECT_EQ(few.grid, 48);
  EXPECT_EQ(few.start_delays.max_ns, 0u);
  // No rows: no grid, no delays.
  const LaunchPlan none = plan_launch(bshd(1, 0, 512, 64, 128, 100), DType::bf16, DType::bf16, options(), h200());
  EXPECT_EQ(none.num_tasks, 0);
  EXPECT_EQ(none.grid, 0);
  EXPECT_EQ(none.start_delays.max_ns, 0u);
  // Two resident CTAs per SM: twice the grid.
  DeviceProperties two = h200();
  two.ctas_per_sm = 2;
  EXPECT_EQ(plan_launch(bshd(1, 4096, 4096, 64, 128, 2048), DType::bf16, DType::bf16, options(), two).grid, 264);
}

TEST(LaunchPlan, RefusesKeyRowsPastInt32) {
  detail::ProblemGeometry g = bshd(1, 1, 1, 64, 128, 1);
  g.num_k_rows = int64_t{1} << 31;
  g.k_len = {g.num_k_rows};
  try {
    (void)plan_launch(g, DType::bf16, DType::f32, options(), h200());
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_EQ(e.argument(), "index_k");
    EXPECT_NE(std::string(e.what()).find("got 2147483648"), std::string::npos) << e.what();
  }
}

TEST(LaunchPlan, FromAValidatedProblem) {
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
  const LaunchPlan plan = plan_launch(g, DType::bf16, DType::bf16, o, h200());
  EXPECT_EQ(plan.num_tasks, 68);
  EXPECT_EQ(plan.grid, 68);
  EXPECT_EQ(plan.workspace_bytes, std::size_t{68} * 128 * 4);
  EXPECT_TRUE(plan_launch(g, DType::bf16, DType::bf16, options(L2Hints::on), h200()).kernel.l2_keep_dk);
}

}  // namespace
}  // namespace dsaib::hopper
