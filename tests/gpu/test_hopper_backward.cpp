// GPU tests (label gpu): the cuda backend against the fp64 CPU reference on
// shapes, tails, id patterns and output dtypes, the launch plan's choices
// (L2-hinted kernel, start delays), determinism, graph capture and the fp64 GPU
// reference kernel. Without a compute-capability-9.0 GPU every test is SKIPPED
// (never passed).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gpu/device_problem.hpp"
#include "hopper/launch/launch_plan.hpp"
#include "gpu/reference_kernel.hpp"

namespace dsaib::test {
namespace {

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  }
};

double tolerance(DType dt) { return dt == DType::bf16 ? 3e-3 : 1e-3; }

struct Case {
  std::string name;
  GenerateSpec spec;
  std::function<void(GeneratedProblem&)> mutate = nullptr;
  DType dq = DType::bf16, dw = DType::bf16, dk = DType::bf16;
  bool deterministic = false;  // options.deterministic: the fixed-point dK kernels
  L2Hints l2_hints = L2Hints::automatic;
  StartStagger start_stagger = StartStagger::automatic;
};

GenerateSpec spec_of(int64_t b, int64_t sq, int64_t skv, int64_t h, int64_t d, int64_t topk,
                     IdPattern ids = IdPattern::causal_topk, uint64_t seed = 7) {
  GenerateSpec s;
  s.batch = b;
  s.s_q = sq;
  s.s_kv = skv;
  s.heads = h;
  s.head_dim = d;
  s.topk = topk;
  s.ids = ids;
  s.seed = seed;
  s.num_threads = 0;
  return s;
}

/// Runs the cuda backend and checks every output against the fp64 CPU reference.
void check_against_cpu(const GeneratedProblem& p, DType dq, DType dw, DType dk, const IndexerOptions& opt,
                       const std::string& name) {
  IndexerOptions ref_opt = opt;
  ref_opt.backend = Backend::cpu;
  ref_opt.num_threads = 0;
  const ReferenceGradients ref = reference_backward(p.inputs(), ref_opt);
  const OutputBuffers got = run_cuda(p, opt, dq, dw, dk);
  const ErrorStats eq = compare(got.d_index_q, ref.d_index_q);
  const ErrorStats ew = compare(got.d_weights, ref.d_weights);
  const ErrorStats ek = compare(got.d_index_k, ref.d_index_k);
  std::printf("[numerics] %-34s dQ %s | dW %s | dK %s\n", name.c_str(), eq.str().c_str(), ew.str().c_str(), ek.str().c_str());
  EXPECT_TRUE(eq.ok(tolerance(dq))) << name << " d_index_q " << eq.str();
  EXPECT_TRUE(ew.ok(tolerance(dw))) << name << " d_weights " << ew.str();
  EXPECT_TRUE(ek.ok(tolerance(dk))) << name << " d_index_k " << ek.str();
}

/// The launch plan of `opt` on this device for `p` with outputs of these dtypes
/// (detail::plan_indexer_backward: what the cuda backend launches for that call).
hopper::BackwardPlan plan_of(const GeneratedProblem& p, const IndexerOptions& opt, DType dq, DType dw, DType dk) {
  const DeviceProblem dp(p);
  const DeviceOutputs out(p, dq, dw, dk);
  IndexerOptions o = opt;
  o.backend = Backend::cuda;
  return detail::plan_indexer_backward(dp.inputs(), out.views(), o);
}

/// Runs a case against the fp64 CPU reference; returns the launch plan its cuda
/// call ran with (which kernel, grid, start delays, L2 share).
hopper::BackwardPlan run_case(const Case& c) {
  GeneratedProblem p = make_problem(c.spec);
  if (c.mutate) c.mutate(p);
  IndexerOptions opt = p.options();
  opt.deterministic = c.deterministic;
  opt.l2_hints = c.l2_hints;
  opt.start_stagger = c.start_stagger;
  const hopper::BackwardPlan plan = plan_of(p, opt, c.dq, c.dw, c.dk);
  check_against_cpu(p, c.dq, c.dw, c.dk, opt, c.name);
  return plan;
}

// ------------------------------------------------------------ shapes ---

TEST_F(Gpu, RaceReportShapes) {
  run_case({"race1 b1 sq1 skv512 h64 topk128", spec_of(1, 1, 512, 64, 128, 128)});
  run_case({"race2 b3 sq64 skv2048 topk512", spec_of(3, 64, 2048, 64, 128, 512)});
  run_case({"race3 b1 sq512 skv512 topk128", spec_of(1, 512, 512, 64, 128, 128)});
}

TEST_F(Gpu, TopkNotMultipleOfTile) {
  for (int64_t topk : {1, 100, 129, 1000, 2176}) {
    run_case({"topk " + std::to_string(topk), spec_of(1, 48, 2300, 64, 128, topk, IdPattern::random_permutation)});
  }
}

TEST_F(Gpu, HeadCounts) {
  for (int64_t h : {8, 16, 32, 64, 72, 128}) {
    run_case({"heads " + std::to_string(h), spec_of(2, 40, 300, h, 128, 160)});
  }
}

TEST_F(Gpu, HeadDim64) {
  run_case({"d64 causal", spec_of(2, 64, 256, 64, 64, 100)});
  run_case({"d64 h8 perm", spec_of(1, 33, 500, 8, 64, 257, IdPattern::random_permutation)});
}

/// Automatic (IndexerOptions::l2_hints): key tables whose dK + K exceed
/// half the L2 take the hinted kernel, and its results match the fp64 CPU
/// reference. Which kernel ran is read from the launch plan (the two kernels
/// give the same results).
TEST_F(Gpu, L2HintedKernelChosenForLargeKeyTables) {
  for (const Case& c :
       {Case{"auto d128 sq48 skv49152", spec_of(1, 48, 49152, 64, 128, 2048, IdPattern::random_permutation)},
        Case{"auto d64 sq40 skv98304", spec_of(1, 40, 98304, 64, 64, 1000, IdPattern::random_permutation)},
        Case{"auto d128 b2 sq24 skv49152 causal", spec_of(2, 24, 49152, 64, 128, 300)}}) {
    EXPECT_TRUE(run_case(c).kernel.l2_keep_dk) << c.name << ": the unhinted kernel ran";
  }
  // A table that fits stays on the unhinted kernel.
  EXPECT_FALSE(run_case({"auto d128 sq64 skv4096", spec_of(1, 64, 4096, 64, 128, 512)}).kernel.l2_keep_dk);
  // So does every split-A call (fp32 outputs), whatever the size.
  Case f32{"auto d128 f32 sq16 skv49152", spec_of(1, 16, 49152, 64, 128, 256, IdPattern::random_permutation)};
  f32.dq = f32.dw = f32.dk = DType::f32;
  const hopper::BackwardPlan split = run_case(f32);
  EXPECT_TRUE(split.kernel.split_a);
  EXPECT_FALSE(split.kernel.l2_keep_dk);
  Case off{"off d128 sq48 skv49152", spec_of(1, 48, 49152, 64, 128, 2048)};
  off.l2_hints = L2Hints::off;
  EXPECT_FALSE(run_case(off).kernel.l2_keep_dk);
  Case on{"on d128 sq16 skv300", spec_of(1, 16, 300, 64, 128, 200)};
  on.l2_hints = L2Hints::on;
  const hopper::BackwardPlan forced = run_case(on);
  EXPECT_TRUE(forced.kernel.l2_keep_dk);
  // 300 key rows of dK (150 KiB) fit any set-aside but none: all reds evict_last.
  size_t set_aside = 0;
  ASSERT_EQ(cudaDeviceGetLimit(&set_aside, cudaLimitPersistingL2CacheSize), cudaSuccess);
  EXPECT_EQ(forced.device.persisting_l2_bytes, static_cast<int64_t>(set_aside));
  if (set_aside >= 300 * 128 * sizeof(float)) EXPECT_EQ(forced.l2_keep_fraction, hopper::L2KeepFraction::f100);
}

/// The hinted kernel's evict_last share follows the context's L2 set-aside for
/// persisting lines (l2_hints.hpp): set to the device's maximum, a 24 MiB dK
/// (S_kv 49152, D128) takes 1.0 where the maximum holds it, and a 12 MiB dK
/// (S_kv 24576) takes the hinted kernel as well; set to 0, 0.35 and the unhinted
/// kernel. All match the fp64 reference; the test restores the limit it found.
TEST_F(Gpu, L2KeepFractionFollowsTheSetAside) {
  size_t before = 0;
  int max_set_aside = 0;
  ASSERT_EQ(cudaDeviceGetLimit(&before, cudaLimitPersistingL2CacheSize), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&max_set_aside, cudaDevAttrMaxPersistingL2CacheSize, 0), cudaSuccess);
  struct Restore {
    size_t bytes;
    ~Restore() { EXPECT_EQ(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, bytes), cudaSuccess); }
  } restore{before};
  const Case c{"set-aside d128 sq48 skv49152", spec_of(1, 48, 49152, 64, 128, 2048, IdPattern::random_permutation)};
  const int64_t dk_bytes = int64_t{49152} * 128 * 4;
  ASSERT_EQ(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, static_cast<size_t>(max_set_aside)), cudaSuccess);
  size_t now = 0;
  ASSERT_EQ(cudaDeviceGetLimit(&now, cudaLimitPersistingL2CacheSize), cudaSuccess);
  const hopper::BackwardPlan at_max = run_case(c);
  EXPECT_EQ(at_max.device.persisting_l2_bytes, static_cast<int64_t>(now)) << "the plan reads the set-aside in force";
  ASSERT_TRUE(at_max.kernel.l2_keep_dk) << "the case no longer takes the hinted kernel";
  EXPECT_EQ(at_max.l2_keep_fraction, hopper::l2_keep_fraction(static_cast<int64_t>(now), 49152, 128));
  if (static_cast<int64_t>(now) >= dk_bytes) EXPECT_EQ(at_max.l2_keep_fraction, hopper::L2KeepFraction::f100);
  // A table under the default gate (dK + K 18 MiB) takes the hinted kernel too
  // when the set-aside holds its dK and leaves less than twice dK + K to the
  // other lines (l2_hints_pay): at the H200's 37.5 MiB, with fraction 1.0.
  const Case small{"set-aside d128 sq48 skv24576", spec_of(1, 48, 24576, 64, 128, 2048, IdPattern::random_permutation)};
  int l2_bytes = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, 0), cudaSuccess);
  const bool expect_small_hinted =
      hopper::l2_hints_pay(L2Hints::automatic, 24576, 128, l2_bytes, static_cast<int64_t>(now));
  const hopper::BackwardPlan small_at_max = run_case(small);
  EXPECT_EQ(small_at_max.kernel.l2_keep_dk, expect_small_hinted);
  if (expect_small_hinted) EXPECT_EQ(small_at_max.l2_keep_fraction, hopper::L2KeepFraction::f100);
  ASSERT_EQ(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0), cudaSuccess);
  const hopper::BackwardPlan at_zero = run_case(c);
  EXPECT_EQ(at_zero.device.persisting_l2_bytes, 0);
  EXPECT_TRUE(at_zero.kernel.l2_keep_dk);
  EXPECT_EQ(at_zero.l2_keep_fraction, hopper::L2KeepFraction::f035);
  // With no set-aside the small table stays on the unhinted kernel.
  EXPECT_FALSE(run_case(small).kernel.l2_keep_dk);
}

/// A shape on which the start stagger delays CTAs (at least 4 waves of the
/// persistent grid and a remainder; start_stagger.hpp), with the delays planned
/// (automatic) and off (IndexerOptions::start_stagger): both match the
/// fp64 CPU reference, and the plans say which ran.
TEST_F(Gpu, StartStaggerOnAndOff) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const int64_t rows = 4 * int64_t{sms} + 5;  // one CTA per SM at D 128: 4 waves and a tail of 5
  const hopper::StartDelays expected = hopper::start_delays_for_launch(rows, sms, 1, 512, {rows}, {2048}, 128);
  ASSERT_GT(expected.max_ns, 0u) << "the case no longer exercises the delays";
  for (StartStagger mode : {StartStagger::automatic, StartStagger::off}) {
    Case c{std::string("stagger ") + start_stagger_name(mode) + " sq" + std::to_string(rows) + " skv2048 topk512",
           spec_of(1, rows, 2048, 64, 128, 512, IdPattern::random_permutation)};
    c.start_stagger = mode;
    const hopper::BackwardPlan plan = run_case(c);
    EXPECT_EQ(plan.grid, sms) << c.name;
    EXPECT_EQ(plan.start_delays.max_ns, mode == StartStagger::off ? 0u : expected.max_ns) << c.name;
    EXPECT_EQ(plan.start_delays.first_delayed_cta, mode == StartStagger::off ? 0 : 5) << c.name;
  }
}

TEST_F(Gpu, Tiny) { run_case({"sq1 skv1", spec_of(1, 1, 1, 64, 128, 4)}); }

TEST_F(Gpu, OutputDtypes) {
  Case c{"f32 outputs", spec_of(1, 64, 512, 64, 128, 200)};
  c.dq = c.dw = c.dk = DType::f32;
  run_case(c);
  Case m{"mixed outputs, f32 weights", spec_of(1, 64, 512, 32, 128, 200)};
  m.spec.weights_f32 = true;
  m.dq = DType::f32;
  m.dk = DType::bf16;
  m.dw = DType::f32;
  run_case(m);
  // D=64 with fp32 outputs: the split-A D=64 kernel (scatter role, two a terms).
  Case d64{"d64 f32 outputs", spec_of(1, 64, 512, 64, 64, 200, IdPattern::random_permutation)};
  d64.dq = d64.dw = d64.dk = DType::f32;
  run_case(d64);
}

// The a operand's precision (IndexerOptions::a_operand_precision): with
// fp32 outputs, one bf16 term must cost measurably more error than two (so the
// option reaches the kernel), and each choice must fit its budget: bf16x2 the
// 1e-3 of fp32 outputs, bf16 the 3e-3 of bf16 outputs (also forced on bf16 outputs).
TEST_F(Gpu, AOperandPrecisionChoices) {
  GeneratedProblem p = make_problem(spec_of(1, 128, 1024, 64, 128, 512, IdPattern::random_permutation, 11));
  IndexerOptions ref_opt = p.options();
  ref_opt.backend = Backend::cpu;
  const ReferenceGradients ref = reference_backward(p.inputs(), ref_opt);
  auto errors = [&](AOperandPrecision a, DType dt) {
    IndexerOptions opt = p.options();
    opt.a_operand_precision = a;
    const OutputBuffers got = run_cuda(p, opt, dt, dt, dt);
    const ErrorStats eq = compare(got.d_index_q, ref.d_index_q);
    const ErrorStats ek = compare(got.d_index_k, ref.d_index_k);
    std::printf("[numerics] a_operand %-6s %s outputs: dQ %s | dK %s\n", a_operand_precision_name(a), dtype_name(dt),
                eq.str().c_str(), ek.str().c_str());
    return std::make_pair(eq, ek);
  };
  const auto [q2, k2] = errors(AOperandPrecision::bf16x2, DType::f32);
  const auto [q1, k1] = errors(AOperandPrecision::bf16, DType::f32);
  const auto [qa, ka] = errors(AOperandPrecision::automatic, DType::f32);
  EXPECT_TRUE(q2.ok(1e-3) && k2.ok(1e-3)) << q2.str() << " " << k2.str();
  EXPECT_TRUE(qa.ok(1e-3) && ka.ok(1e-3)) << "automatic with fp32 outputs must split: " << qa.str() << " " << ka.str();
  EXPECT_TRUE(q1.ok(3e-3) && k1.ok(3e-3)) << q1.str() << " " << k1.str();
  EXPECT_GT(q1.rel_rms, 4 * q2.rel_rms) << "bf16 vs bf16x2 a operand: no measurable difference in d_index_q";
  EXPECT_GT(k1.rel_rms, 4 * k2.rel_rms) << "bf16 vs bf16x2 a operand: no measurable difference in d_index_k";
  const auto [qb, kb] = errors(AOperandPrecision::bf16, DType::bf16);
  EXPECT_TRUE(qb.ok(3e-3) && kb.ok(3e-3)) << qb.str() << " " << kb.str();
}

// ------------------------------------------------------- index patterns ---

TEST_F(Gpu, IndexPatterns) {
  run_case({"permutation", spec_of(2, 64, 700, 64, 128, 256, IdPattern::random_permutation)});
  Case holes{"-1 start/middle/end, whole rows, batches", spec_of(2, 64, 700, 64, 128, 256, IdPattern::random_permutation)};
  holes.mutate = [](GeneratedProblem& p) {
    invalidate_run(p, 0, Where::start, 17);
    invalidate_run(p, 1, Where::middle, 40);
    invalidate_run(p, 2, Where::end, 100);
    invalidate_row(p, 3);
    invalidate_row(p, 64);  // batch 1
    invalidate_run(p, 70, Where::start, 255);
    duplicate_slot(p, 5, 0, 1);
    duplicate_slot(p, 5, 0, 2);
    set_id(p, 6, 3, 100000);  // out of range: an invalid slot
    set_id(p, 6, 4, -7);
    refresh_scores(p);
    fill_invalid_scores(p, 0.5f);  // must be ignored
  };
  run_case(holes);
  run_case({"skv 100 < topk 2048", spec_of(1, 16, 100, 64, 128, 2048, IdPattern::random_permutation)});
  Case global{"global ids b3", spec_of(3, 40, 300, 64, 128, 128)};
  global.spec.id_mode = IdMode::global;
  run_case(global);
}

TEST_F(Gpu, LocalAndGlobalIdsAgree) {
  GeneratedProblem local = make_problem(spec_of(2, 50, 400, 64, 128, 150, IdPattern::random_permutation));
  GeneratedProblem global = with_id_mode(local, IdMode::global);
  const OutputBuffers a = run_cuda(local, local.options(), DType::f32, DType::f32, DType::f32);
  const OutputBuffers b = run_cuda(global, global.options(), DType::f32, DType::f32, DType::f32);
  EXPECT_TRUE(bitwise_equal(a.d_index_q, b.d_index_q));
  EXPECT_TRUE(bitwise_equal(a.d_weights, b.d_weights));
  const ErrorStats ek = compare(b.d_index_k, to_doubles(a.d_index_k));
  EXPECT_TRUE(ek.ok(1e-6)) << ek.str();
}

TEST_F(Gpu, ThdMatchesReferenceLocalAndGlobal) {
  for (IdMode mode : {IdMode::local, IdMode::global}) {
    GenerateSpec s = spec_of(1, 0, 0, 64, 128, 128);
    s.layout = Layout::thd;
    s.seqlens_q = {1, 37, 300};
    s.seqlens_k = {1, 37, 300};
    s.id_mode = mode;
    run_case({std::string("thd 1/37/300 ") + id_mode_name(mode), s});
  }
}

// ------------------------------------------------------------ contract ---

TEST_F(Gpu, PrefilledFp32DkDoesNotMatter) {
  GeneratedProblem p = make_problem(spec_of(1, 64, 300, 64, 128, 128));
  DeviceProblem dp(p);
  HostTensor results[3];
  const double fills[3] = {0.0, 999.0, std::nan("")};
  for (int k = 0; k < 3; ++k) {
    DeviceOutputs out(p, DType::f32, DType::f32, DType::f32);
    out.d_index_k.fill(fills[k]);
    IndexerOptions opt = p.options();
    opt.backend = Backend::cuda;
    indexer_backward(dp.inputs(), out.views(), opt);
    check_cuda(cudaDeviceSynchronize(), "sync");
    results[k] = out.d_index_k.to_host();
  }
  const ErrorStats e1 = compare(results[1], to_doubles(results[0]));
  const ErrorStats e2 = compare(results[2], to_doubles(results[0]));
  EXPECT_TRUE(e1.ok(1e-6)) << e1.str();
  EXPECT_TRUE(e2.ok(1e-6)) << e2.str();
}

/// Strict mode on the cuda backend: validation copies the ids to the host in one
/// piece (packed) or, for rows far apart, with pitched copies (cudaMemcpy2DAsync):
/// one for all rows, one per batch, or one of all batches' spans when each
/// batch's rows overlap (stride 0). Clean views run as the packed one does; a bad id is reported
/// where it is, before any write.
TEST_F(Gpu, StrictIdsPackedAndFarApart) {
  GeneratedProblem p = make_problem(spec_of(2, 16, 64, 64, 128, 32, IdPattern::random_permutation));
  DeviceProblem dp(p);
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  opt.strict_indices = true;
  const int64_t S = 16, rows = 32, K = 32;
  const int64_t far = int64_t{3} << 18;  // 3 MiB of int32 between rows
  struct View {
    const char* name;
    int64_t s0, s1;  // batch and row strides (slot stride 1)
    bool same_ids;   // the packed ids (else each batch's rows are its first row's)
    std::string where;
  };
  const View views[] = {
      {"rows far apart (one pitched copy)", S * far, far, true, "(b=1, t=5, slot=7)"},
      {"batches uneven (a pitched copy per batch)", S * far + 4096, far, true, "(b=1, t=5, slot=7)"},
      {"rows overlapping, batches far apart (one pitched copy of the batches)", far, 0, false, "(b=1, t=0, slot=7)"},
  };
  const int32_t bad = 64;  // == S_kv: out of range for local ids
  const auto* ids = reinterpret_cast<const int32_t*>(p.topk_indices.bytes.data());
  HostTensor dq0, dw0;
  {
    DeviceOutputs out(p, DType::f32, DType::f32, DType::f32);
    out.poison();
    indexer_backward(dp.inputs(), out.views(), opt);
    check_cuda(cudaDeviceSynchronize(), "sync");
    dq0 = out.d_index_q.to_host();
    dw0 = out.d_weights.to_host();
  }
  for (const View& v : views) {
    SCOPED_TRACE(v.name);
    const int64_t last = (2 - 1) * v.s0 + (S - 1) * v.s1 + K - 1;
    DeviceBuffer buf(static_cast<size_t>(last + 1) * 4);
    for (int64_t r = 0; r < rows; ++r) {
      check_cuda(cudaMemcpy(static_cast<int32_t*>(buf.ptr) + (r / S) * v.s0 + (r % S) * v.s1, ids + r * K, K * 4,
                            cudaMemcpyHostToDevice),
                 "upload ids");
    }
    IndexerInputs in = dp.inputs();
    in.topk_indices.data = buf.ptr;
    in.topk_indices.strides[0] = v.s0;
    in.topk_indices.strides[1] = v.s1;
    if (v.same_ids) {  // a clean run: dQ and dW as with the packed ids
      DeviceOutputs out(p, DType::f32, DType::f32, DType::f32);
      out.poison();
      indexer_backward(in, out.views(), opt);
      check_cuda(cudaDeviceSynchronize(), "sync");
      EXPECT_TRUE(bitwise_equal(out.d_index_q.to_host(), dq0));
      EXPECT_TRUE(bitwise_equal(out.d_weights.to_host(), dw0));
    }
    // A bad id at (b=1, t=5, slot=7): with overlapping rows, every row of batch 1.
    check_cuda(cudaMemcpy(static_cast<int32_t*>(buf.ptr) + v.s0 + 5 * v.s1 + 7, &bad, 4, cudaMemcpyHostToDevice),
               "bad id");
    DeviceOutputs out(p, DType::f32, DType::f32, DType::f32);
    out.d_index_k.fill(3.0);
    const auto before = out.d_index_k.buffer.to_host();
    try {
      indexer_backward(in, out.views(), opt);
      ADD_FAILURE() << "bad id accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::index_out_of_range) << e.what();
      EXPECT_NE(std::string(e.what()).find(v.where), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("got id 64"), std::string::npos) << e.what();
    }
    check_cuda(cudaDeviceSynchronize(), "sync");
    EXPECT_EQ(out.d_index_k.buffer.to_host(), before);
  }
  // And in the packed ids (the one-piece copy).
  check_cuda(cudaMemcpy(static_cast<int32_t*>(dp.topk_indices.buffer.ptr) + (S + 5) * K + 7, &bad, 4,
                        cudaMemcpyHostToDevice),
             "bad id");
  DeviceOutputs out(p, DType::f32, DType::f32, DType::f32);
  try {
    indexer_backward(dp.inputs(), out.views(), opt);
    ADD_FAILURE() << "bad id accepted (packed)";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::index_out_of_range) << e.what();
    EXPECT_NE(std::string(e.what()).find("(b=1, t=5, slot=7)"), std::string::npos) << e.what();
  }
}

TEST_F(Gpu, GradLossFromDeviceAndNormalizationCount) {
  GeneratedProblem p = make_problem(spec_of(1, 64, 300, 64, 128, 128));
  DeviceBuffer g(sizeof(float));
  const float grad_loss = -2.5f;
  check_cuda(cudaMemcpy(g.ptr, &grad_loss, sizeof(float), cudaMemcpyHostToDevice), "H2D");
  IndexerOptions opt = p.options();
  opt.grad_loss_device = static_cast<const float*>(g.ptr);
  opt.normalization_count = 17;
  opt.loss_coeff = 0.3f;
  opt.sm_scale = -0.7f;
  // The CPU reference reads grad_loss from host memory.
  IndexerOptions ref_opt = opt;
  ref_opt.grad_loss_device = nullptr;
  ref_opt.grad_loss = grad_loss;
  ref_opt.backend = Backend::cpu;
  const ReferenceGradients ref = reference_backward(p.inputs(), ref_opt);
  const OutputBuffers got = run_cuda(p, opt, DType::f32, DType::f32, DType::f32);
  for (auto [name, e] : {std::pair{"dQ", compare(got.d_index_q, ref.d_index_q)}, std::pair{"dW", compare(got.d_weights, ref.d_weights)},
                         std::pair{"dK", compare(got.d_index_k, ref.d_index_k)}}) {
    EXPECT_TRUE(e.ok(1e-3)) << name << " " << e.str();
  }
}

TEST_F(Gpu, RejectsBadInputBeforeWriting) {
  GeneratedProblem p = make_problem(spec_of(1, 16, 64, 64, 128, 32));
  DeviceProblem dp(p);
  DeviceOutputs out(p, DType::f32, DType::f32, DType::f32);
  out.d_index_q.fill(3.0);
  out.d_weights.fill(3.0);
  out.d_index_k.fill(3.0);
  const auto before_q = out.d_index_q.buffer.to_host(), before_k = out.d_index_k.buffer.to_host();
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  // index_k misaligned to 16 bytes (2-byte aligned)
  IndexerInputs in = dp.inputs();
  in.index_k.data = static_cast<char*>(in.index_k.data) + 2;
  in.index_k.shape[1] -= 1;
  IndexerBackwardOutputs o = out.views();
  try {
    indexer_backward(in, o, opt);
    ADD_FAILURE() << "misaligned index_k accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("index_k"), std::string::npos) << e.what();
  }
  // host tensors on the cuda backend
  try {
    indexer_backward(p.inputs(), out.views(), opt);
    ADD_FAILURE() << "host tensors accepted on cuda";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
  }
  // an out-of-range value of either tuning option (the C ABI passes any int); the
  // fp32 d_index_k is the accumulator the backend zeroes first, so a late check
  // would show here
  for (const char* name : {"l2_hints", "start_stagger"}) {
    IndexerOptions bad = opt;
    if (std::string(name) == "l2_hints") bad.l2_hints = static_cast<L2Hints>(3);
    else bad.start_stagger = static_cast<StartStagger>(2);
    try {
      indexer_backward(dp.inputs(), out.views(), bad);
      ADD_FAILURE() << name << " out of range accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_EQ(e.argument(), name);
      EXPECT_NE(std::string(e.what()).find("got"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(out.d_index_q.buffer.to_host(), before_q);
  EXPECT_EQ(out.d_index_k.buffer.to_host(), before_k);
}

// --------------------------------------------------------- determinism ---

TEST_F(Gpu, ThirtyReplaysBitwiseIdenticalDqDw) {
  GeneratedProblem p = make_problem(spec_of(1, 256, 2048, 64, 128, 512));
  DeviceProblem dp(p);
  DeviceOutputs out(p, DType::bf16, DType::bf16, DType::f32);
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  uint64_t hq = 0, hw = 0;
  HostTensor dk0;
  double max_dev = 0.0;
  for (int run = 0; run < 30; ++run) {
    out.poison();
    indexer_backward(dp.inputs(), out.views(), opt);
    check_cuda(cudaDeviceSynchronize(), "sync");
    const HostTensor q = out.d_index_q.to_host(), w = out.d_weights.to_host(), k = out.d_index_k.to_host();
    if (run == 0) {
      hq = hash_bytes(q);
      hw = hash_bytes(w);
      dk0 = k;
      continue;
    }
    EXPECT_EQ(hash_bytes(q), hq) << "d_index_q differs in replay " << run;
    EXPECT_EQ(hash_bytes(w), hw) << "d_weights differs in replay " << run;
    const ErrorStats e = compare(k, to_doubles(dk0));
    max_dev = std::max(max_dev, e.max_abs / std::max(e.max_abs_ref, 1e-300));
  }
  std::printf("[determinism] 30 replays: d_index_q/d_weights hashes identical; d_index_k max |dev| / max |dK| = %.3g\n", max_dev);
}

// ------------------------------------------------- deterministic d_index_k ---

/// options.deterministic on cuda (fixed_point_dk.cuh): ten runs of each output dtype
/// give bitwise-equal d_index_q, d_weights and d_index_k, within the tolerances of
/// the fp64 CPU reference; the caller's workspace of indexer_backward_workspace_size
/// bytes is used (one byte less is refused); with fp32 outputs the fixed-point dK
/// agrees with the fp32-atomic one to fp32 rounding.
TEST_F(Gpu, DeterministicDkBitwiseAcrossRuns) {
  GeneratedProblem p = make_problem(spec_of(1, 256, 2048, 64, 128, 512, IdPattern::random_permutation));
  IndexerOptions ref_opt = p.options();
  const ReferenceGradients ref = reference_backward(p.inputs(), ref_opt);
  DeviceProblem dp(p);
  for (const DType dt : {DType::bf16, DType::f32}) {
    const std::string name = std::string("deterministic ") + (dt == DType::bf16 ? "bf16" : "f32") + " outputs";
    DeviceOutputs out(p, dt, dt, dt);
    IndexerOptions opt = p.options();
    opt.backend = Backend::cuda;
    opt.deterministic = true;
    const std::size_t need = indexer_backward_workspace_size(dp.inputs(), out.views(), opt);
    EXPECT_GE(need, static_cast<std::size_t>(p.index_k.shape[1] * p.index_k.shape[2]) * 8) << name;
    DeviceBuffer ws(need);
    try {
      indexer_backward(dp.inputs(), out.views(), opt, ws.ptr, need - 1);
      ADD_FAILURE() << name << ": a workspace one byte short was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_EQ(e.argument(), "workspace_bytes") << e.what();
    }
    uint64_t hq = 0, hw = 0, hk = 0;
    for (int run = 0; run < 10; ++run) {
      out.poison();
      // Odd runs: the backend's own stream-ordered workspace; even runs: the caller's.
      if (run % 2) indexer_backward(dp.inputs(), out.views(), opt);
      else indexer_backward(dp.inputs(), out.views(), opt, ws.ptr, ws.bytes);
      check_cuda(cudaDeviceSynchronize(), "sync");
      const HostTensor q = out.d_index_q.to_host(), w = out.d_weights.to_host(), k = out.d_index_k.to_host();
      if (run == 0) {
        const ErrorStats eq = compare(q, ref.d_index_q), ew = compare(w, ref.d_weights), ek = compare(k, ref.d_index_k);
        std::printf("[numerics] %-34s dQ %s | dW %s | dK %s\n", name.c_str(), eq.str().c_str(), ew.str().c_str(),
                    ek.str().c_str());
        EXPECT_TRUE(eq.ok(tolerance(dt))) << name << " d_index_q " << eq.str();
        EXPECT_TRUE(ew.ok(tolerance(dt))) << name << " d_weights " << ew.str();
        EXPECT_TRUE(ek.ok(tolerance(dt))) << name << " d_index_k " << ek.str();
        hq = hash_bytes(q), hw = hash_bytes(w), hk = hash_bytes(k);
        if (dt == DType::f32) {
          IndexerOptions atomic = opt;
          atomic.deterministic = false;
          const OutputBuffers fp32_atomics = run_cuda(p, atomic, dt, dt, dt);
          const ErrorStats between = compare(k, to_doubles(fp32_atomics.d_index_k));
          std::printf("[determinism] fixed-point dK against fp32-atomic dK: %s\n", between.str().c_str());
          EXPECT_LE(between.rel_rms, 1e-6) << between.str();
        }
        continue;
      }
      EXPECT_EQ(hash_bytes(q), hq) << name << ": d_index_q differs in run " << run;
      EXPECT_EQ(hash_bytes(w), hw) << name << ": d_weights differs in run " << run;
      EXPECT_EQ(hash_bytes(k), hk) << name << ": d_index_k differs in run " << run;
    }
    std::printf("[determinism] %s: 10 runs, d_index_q / d_weights / d_index_k hashes identical\n", name.c_str());
  }
}

/// The deterministic path captured in a CUDA graph, grad_loss read from the device:
/// the bound pass reads it too, so doubling grad_loss between replays halves the
/// scale 2^E and doubles every output exactly (powers of two scale the whole
/// computation exactly). Invalid slots holding NaN T and P stay out of the bound.
TEST_F(Gpu, DeterministicDkInACudaGraph) {
  GeneratedProblem p = make_problem(spec_of(1, 64, 300, 64, 128, 128, IdPattern::random_permutation));
  invalidate_run(p, 3, Where::middle, 40);
  refresh_scores(p);
  {  // NaN T and P at the invalid slots: ignored, as if 0 (docs/math.md)
    auto* t = reinterpret_cast<float*>(p.attn_score.bytes.data());
    auto* pr = reinterpret_cast<float*>(p.index_score.bytes.data());
    const auto* ids = reinterpret_cast<const int32_t*>(p.topk_indices.bytes.data());
    for (std::size_t i = 0; i < p.topk_indices.bytes.size() / 4; ++i) {
      if (ids[i] < 0) t[i] = pr[i] = std::nanf("");
    }
  }
  DeviceProblem dp(p);
  DeviceOutputs out(p, DType::f32, DType::f32, DType::f32);
  DeviceBuffer g(sizeof(float));
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "stream");
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  opt.deterministic = true;
  opt.stream = stream;
  opt.grad_loss_device = static_cast<const float*>(g.ptr);
  DeviceBuffer ws(indexer_backward_workspace_size(dp.inputs(), out.views(), opt));
  cudaGraph_t graph;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  indexer_backward(dp.inputs(), out.views(), opt, ws.ptr, ws.bytes);
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec;
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  OutputBuffers at[2];
  for (int i = 0; i < 2; ++i) {
    const float value = i == 0 ? 1.0f : 2.0f;
    check_cuda(cudaMemcpy(g.ptr, &value, sizeof value, cudaMemcpyHostToDevice), "grad_loss");
    out.poison();
    check_cuda(cudaGraphLaunch(exec, stream), "graph launch");
    check_cuda(cudaStreamSynchronize(stream), "sync");
    at[i].d_index_q = out.d_index_q.to_host();
    at[i].d_weights = out.d_weights.to_host();
    at[i].d_index_k = out.d_index_k.to_host();
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  IndexerOptions ref_opt = p.options();
  const ReferenceGradients ref = reference_backward(p.inputs(), ref_opt);
  const ErrorStats ek = compare(at[0].d_index_k, ref.d_index_k);
  std::printf("[numerics] %-34s dK %s\n", "deterministic graph, grad_loss 1", ek.str().c_str());
  EXPECT_TRUE(ek.ok(tolerance(DType::f32))) << ek.str();
  const std::vector<double> k1 = to_doubles(at[0].d_index_k), k2 = to_doubles(at[1].d_index_k);
  ASSERT_EQ(k1.size(), k2.size());
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < k1.size(); ++i) mismatches += !(k2[i] == 2.0 * k1[i]);
  EXPECT_EQ(mismatches, 0u) << "d_index_k with grad_loss 2 is not exactly twice that with grad_loss 1";
}

// ---------------------------------------------------------- two GPUs ---

/// Tensors on device 1 while the caller's current device is 0: the backend runs on
/// the tensors' device (index_q.device_index), with the legacy default stream and with
/// a stream of device 1, allocates its bf16-dK accumulator there, and gives the
/// caller back device 0. Against the same problem on device 0: d_index_q and
/// d_weights bitwise equal (both deterministic), d_index_k within fp32 atomic-order
/// noise; and against the fp64 CPU reference. Skips without two sm_90 GPUs.
TEST_F(Gpu, TensorsOnTheSecondGpu) {
  int n = 0, major1 = 0;
  check_cuda(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  if (n >= 2) check_cuda(cudaDeviceGetAttribute(&major1, cudaDevAttrComputeCapabilityMajor, 1), "attribute");
  if (n < 2 || major1 != 9) GTEST_SKIP() << "needs two compute-capability-9.0 GPUs (" << n << " visible)";
  GeneratedProblem p = make_problem(spec_of(1, 256, 2048, 64, 128, 512));
  check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
  const IndexerOptions opt0 = p.options();
  IndexerOptions ref_opt = opt0;
  ref_opt.backend = Backend::cpu;
  const ReferenceGradients ref = reference_backward(p.inputs(), ref_opt);
  for (const DType dk_dtype : {DType::f32, DType::bf16}) {
    const OutputBuffers on0 = run_cuda(p, opt0, DType::f32, DType::f32, dk_dtype);
    for (const bool own_stream : {false, true}) {
      const std::string name = std::string("device 1, dK ") + (dk_dtype == DType::f32 ? "f32" : "bf16") +
                               (own_stream ? ", its stream" : ", default stream");
      check_cuda(cudaSetDevice(1), "cudaSetDevice(1)");
      OutputBuffers on1;
      {
        DeviceProblem dp(p);  // allocated on device 1
        DeviceOutputs out(p, DType::f32, DType::f32, dk_dtype);
        out.poison();
        IndexerInputs in = dp.inputs();
        IndexerBackwardOutputs o = out.views();
        for (TensorView* v : {&in.index_q, &in.weights, &in.index_k, &in.topk_indices, &in.attn_score,
                              &in.index_score, &o.d_index_q, &o.d_weights, &o.d_index_k})
          v->device_index = 1;
        cudaStream_t stream = nullptr;
        if (own_stream) check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream on device 1");
        check_cuda(cudaDeviceSynchronize(), "sync device 1 before the call");
        check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");  // the caller's current device
        IndexerOptions opt = opt0;
        opt.backend = Backend::cuda;
        opt.stream = stream;
        indexer_backward(in, o, opt);
        int current = -1;
        check_cuda(cudaGetDevice(&current), "cudaGetDevice");
        EXPECT_EQ(current, 0) << name << ": the caller's current device was not restored";
        check_cuda(cudaSetDevice(1), "cudaSetDevice(1)");
        check_cuda(cudaDeviceSynchronize(), "sync device 1 after the call");
        if (stream) check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
        on1.d_index_q = out.d_index_q.to_host();
        on1.d_weights = out.d_weights.to_host();
        on1.d_index_k = out.d_index_k.to_host();
      }
      check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
      EXPECT_EQ(hash_bytes(on1.d_index_q), hash_bytes(on0.d_index_q)) << name << ": d_index_q differs from device 0's";
      EXPECT_EQ(hash_bytes(on1.d_weights), hash_bytes(on0.d_weights)) << name << ": d_weights differs from device 0's";
      const ErrorStats between = compare(on1.d_index_k, to_doubles(on0.d_index_k));
      const ErrorStats eq = compare(on1.d_index_q, ref.d_index_q);
      const ErrorStats ew = compare(on1.d_weights, ref.d_weights);
      const ErrorStats ek = compare(on1.d_index_k, ref.d_index_k);
      std::printf("[numerics] %-34s dQ %s | dW %s | dK %s | dK vs device 0 max |dev| / max |dK| %.3g\n",
                  name.c_str(), eq.str().c_str(), ew.str().c_str(), ek.str().c_str(),
                  between.max_abs / std::max(between.max_abs_ref, 1e-300));
      EXPECT_TRUE(eq.ok(tolerance(DType::f32))) << name << " d_index_q " << eq.str();
      EXPECT_TRUE(ew.ok(tolerance(DType::f32))) << name << " d_weights " << ew.str();
      EXPECT_TRUE(ek.ok(tolerance(dk_dtype))) << name << " d_index_k " << ek.str();
      EXPECT_TRUE(between.ok(tolerance(dk_dtype))) << name << " d_index_k against device 0's " << between.str();
    }
  }
}

// ------------------------------------------------------------- graphs ---

TEST_F(Gpu, CudaGraphReplayReadsGradLossFromDevice) {
  GeneratedProblem p = make_problem(spec_of(1, 64, 300, 64, 128, 128));
  DeviceProblem dp(p);
  DeviceOutputs out(p, DType::f32, DType::f32, DType::f32);
  DeviceBuffer g(sizeof(float));
  float one = 1.0f, three = 3.0f;
  check_cuda(cudaMemcpy(g.ptr, &one, 4, cudaMemcpyHostToDevice), "H2D");
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "stream");
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  opt.stream = stream;
  opt.grad_loss_device = static_cast<const float*>(g.ptr);
  DeviceBuffer ws(indexer_backward_workspace_size(dp.inputs(), out.views(), opt) + 256);
  cudaGraph_t graph;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  indexer_backward(dp.inputs(), out.views(), opt, ws.ptr, ws.bytes);
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec;
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  check_cuda(cudaGraphLaunch(exec, stream), "launch");
  check_cuda(cudaStreamSynchronize(stream), "sync");
  const HostTensor q1 = out.d_index_q.to_host();
  check_cuda(cudaMemcpy(g.ptr, &three, 4, cudaMemcpyHostToDevice), "H2D");
  check_cuda(cudaGraphLaunch(exec, stream), "launch");
  check_cuda(cudaStreamSynchronize(stream), "sync");
  const HostTensor q3 = out.d_index_q.to_host();
  std::vector<double> expect = to_doubles(q1);
  for (double& v : expect) v *= 3.0;
  const ErrorStats e = compare(q3, expect);
  EXPECT_TRUE(e.ok(1e-5)) << e.str();  // fp32 c = 3 * grad_loss... differs from 3 * (c ...) by rounding only
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

/// The L2-hinted kernel (forced with options.l2_hints = on) captured into a CUDA
/// graph: the capture plans as an eager call does (the hinted kernel, the same
/// evict_last share), the graph replays twice, and each replay gives the eager
/// call's d_index_q / d_weights bit for bit and its d_index_k up to the order of
/// the fp32 reds. The evict_last fraction is chosen when the launch is captured
/// (from the set-aside in force then) and travels in the kernel's parameters, so
/// a replay keeps it; this is what the graph holds, not re-decided per replay.
TEST_F(Gpu, CudaGraphCaptureOfTheL2HintedKernel) {
  const GenerateSpec spec = spec_of(1, 48, 1100, 64, 128, 512, IdPattern::random_permutation);
  Case hinted{"graph hinted, eager against the fp64 reference", spec};
  hinted.l2_hints = L2Hints::on;
  ASSERT_TRUE(run_case(hinted).kernel.l2_keep_dk);  // the hinted kernel is right here
  GeneratedProblem p = make_problem(spec);
  DeviceProblem dp(p);
  DeviceOutputs eager(p, DType::bf16, DType::bf16, DType::f32);
  DeviceOutputs graphed(p, DType::bf16, DType::bf16, DType::f32);
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "stream");
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  opt.stream = stream;
  opt.l2_hints = L2Hints::on;
  // fp32 dK (exact comparisons of the replays) with one bf16 a term: automatic would take
  // the split-A kernels for an fp32 output, which never take the hint.
  opt.a_operand_precision = AOperandPrecision::bf16;
  DeviceBuffer ws(indexer_backward_workspace_size(dp.inputs(), eager.views(), opt));

  eager.poison();
  const hopper::BackwardPlan eager_plan = detail::plan_indexer_backward(dp.inputs(), eager.views(), opt);
  ASSERT_TRUE(eager_plan.kernel.l2_keep_dk) << "the eager call does not take the hinted kernel";
  indexer_backward(dp.inputs(), eager.views(), opt, ws.ptr, ws.bytes);
  check_cuda(cudaStreamSynchronize(stream), "sync");
  const HostTensor q0 = eager.d_index_q.to_host(), w0 = eager.d_weights.to_host(), k0 = eager.d_index_k.to_host();

  cudaGraph_t graph;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  // The captured call's plan, made as the call makes it (device queries under capture).
  const hopper::BackwardPlan captured_plan = detail::plan_indexer_backward(dp.inputs(), graphed.views(), opt);
  indexer_backward(dp.inputs(), graphed.views(), opt, ws.ptr, ws.bytes);
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  EXPECT_TRUE(captured_plan.kernel.l2_keep_dk) << "the captured call did not take the hinted kernel";
  EXPECT_EQ(captured_plan.l2_keep_fraction, eager_plan.l2_keep_fraction);
  EXPECT_EQ(captured_plan.grid, eager_plan.grid);
  cudaGraphExec_t exec;
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int replay = 0; replay < 2; ++replay) {
    graphed.poison();
    check_cuda(cudaGraphLaunch(exec, stream), "graph launch");
    check_cuda(cudaStreamSynchronize(stream), "sync");
    EXPECT_EQ(hash_bytes(graphed.d_index_q.to_host()), hash_bytes(q0)) << "d_index_q, replay " << replay;
    EXPECT_EQ(hash_bytes(graphed.d_weights.to_host()), hash_bytes(w0)) << "d_weights, replay " << replay;
    const ErrorStats e = compare(graphed.d_index_k.to_host(), to_doubles(k0));
    EXPECT_LE(e.max_abs, 1e-5 * e.max_abs_ref) << "d_index_k, replay " << replay << ": " << e.str();
    EXPECT_TRUE(e.all_finite) << "d_index_k, replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---------------------------------------- the sanitizer's shapes (label sanitizer) ---
// tests/sanitizer/run_sanitizer.sh runs this suite under racecheck, synccheck,
// memcheck and initcheck. Each case also checks numerics, so the suite is a
// normal GPU test too.

class Sanitized : public Gpu {};

TEST_F(Sanitized, RaceReportShapes) {
  run_case({"san race1", spec_of(1, 1, 512, 64, 128, 128)});
  run_case({"san race2", spec_of(3, 64, 2048, 64, 128, 512)});
  run_case({"san race3", spec_of(1, 512, 512, 64, 128, 128)});
}

/// The sanitizer's small cases, named "<tag> ...": chunk tails, H < 64 and H > 64,
/// D 64, invalid slots, fp32 outputs (the split-A kernels), THD with local and global ids.
void run_tail_cases(const std::string& tag, bool deterministic = false, L2Hints l2_hints = L2Hints::automatic) {
  const auto run_case = [deterministic, l2_hints](Case c) {
    c.deterministic = deterministic;
    c.l2_hints = l2_hints;
    const hopper::BackwardPlan plan = dsaib::test::run_case(c);
    EXPECT_EQ(plan.kernel.fixed_point_dk, deterministic) << c.name;
    // Forced on, every one-term kernel is the hinted one (the split-A and
    // deterministic kernels have none).
    if (l2_hints == L2Hints::on) {
      EXPECT_EQ(plan.kernel.l2_keep_dk, !plan.kernel.split_a && !deterministic) << c.name;
    }
  };
  for (int64_t topk : {1, 100, 129, 1000}) {
    run_case({tag + " topk " + std::to_string(topk), spec_of(1, 8, 1100, 64, 128, topk, IdPattern::random_permutation)});
  }
  run_case({tag + " h8", spec_of(1, 16, 300, 8, 128, 200)});
  run_case({tag + " h72", spec_of(1, 16, 300, 72, 128, 160)});
  run_case({tag + " d64", spec_of(1, 16, 300, 64, 64, 200)});
  // The split-A D=64 kernel (scatter role, two a terms) with invalid slots.
  Case d64f32{tag + " d64 f32 + holes", spec_of(1, 16, 300, 64, 64, 200, IdPattern::random_permutation)};
  d64f32.dq = d64f32.dw = d64f32.dk = DType::f32;
  d64f32.mutate = [](GeneratedProblem& p) {
    invalidate_row(p, 5);
    refresh_scores(p);
  };
  run_case(d64f32);
  Case f32{tag + " f32 outputs + holes", spec_of(2, 16, 300, 64, 128, 200, IdPattern::random_permutation)};
  f32.dq = f32.dw = f32.dk = DType::f32;
  f32.mutate = [](GeneratedProblem& p) {
    invalidate_run(p, 0, Where::middle, 50);
    invalidate_row(p, 17);
    refresh_scores(p);
  };
  run_case(f32);
  Case holes{tag + " bf16 outputs + holes", f32.spec};
  holes.mutate = f32.mutate;
  run_case(holes);
  for (IdMode mode : {IdMode::local, IdMode::global}) {
    GenerateSpec thd = spec_of(1, 0, 0, 64, 128, 64);
    thd.layout = Layout::thd;
    thd.id_mode = mode;
    thd.seqlens_q = {1, 37, 30};
    thd.seqlens_k = {1, 37, 30};
    run_case({tag + (mode == IdMode::local ? " thd" : " thd global"), thd});
  }
}

TEST_F(Sanitized, TailCases) { run_tail_cases("san"); }

/// The same cases with options.deterministic: the bound pass, the fixed-point
/// kernels (TileConfig<..., kFixedPointDk = true>, one-term and split-A, D 64 and
/// 128) and the finish kernel.
TEST_F(Sanitized, DeterministicDk) { run_tail_cases("san det", true); }

/// The same cases with options.l2_hints = on: the hinted kernels (TileConfig<...,
/// kL2KeepDk = true>) where a one-term kernel runs; the split-A cases stay unhinted.
TEST_F(Sanitized, L2HintedKernel) { run_tail_cases("san hinted", false, L2Hints::on); }

/// B1, S_q = S_kv = 4096, H64, D128, topk 2048: run once, every output finite.
TEST_F(Sanitized, DeepSeekShape) {
  GenerateSpec s = spec_of(1, 4096, 4096, 64, 128, 2048, IdPattern::random_permutation);
  const GeneratedProblem p = make_problem(s);
  const OutputBuffers got = run_cuda(p, p.options(), DType::bf16, DType::bf16, DType::bf16);
  for (const HostTensor* t : {&got.d_index_q, &got.d_weights, &got.d_index_k}) {
    for (double v : to_doubles(*t)) ASSERT_TRUE(std::isfinite(v));
  }
}

// ------------------------------------------- fp64 GPU reference kernel ---

std::vector<double> device_doubles(const DeviceBuffer& b) {
  const auto bytes = b.to_host();
  std::vector<double> v(bytes.size() / sizeof(double));
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

TEST_F(Gpu, ReferenceKernelMatchesCpuReference) {
  GeneratedProblem p = make_problem(spec_of(2, 48, 300, 64, 128, 100, IdPattern::random_permutation));
  invalidate_run(p, 3, Where::middle, 20);
  refresh_scores(p);
  DeviceProblem dp(p);
  const int64_t nq = num_q_rows(p), nk = num_k_rows(p), H = 64, D = 128;
  DeviceBuffer dq(nq * H * D * 8), dw(nq * H * 8), dk(nk * D * 8);
  hopper::reference_backward_device(dp.inputs(), p.options(), static_cast<double*>(dq.ptr), static_cast<double*>(dw.ptr),
                                    static_cast<double*>(dk.ptr), nullptr);
  IndexerOptions ref_opt = p.options();
  const ReferenceGradients ref = reference_backward(p.inputs(), ref_opt);
  auto rel = [](const std::vector<double>& a, const std::vector<double>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (a[i] - b[i]) * (a[i] - b[i]);
      den += b[i] * b[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
  };
  EXPECT_LT(rel(device_doubles(dq), ref.d_index_q), 1e-12);
  EXPECT_LT(rel(device_doubles(dw), ref.d_weights), 1e-12);
  EXPECT_LT(rel(device_doubles(dk), ref.d_index_k), 1e-12);
}

/// DeepSeek shape (too large for the CPU reference in a test): against the fp64 GPU reference.
TEST_F(Gpu, DeepSeekShapeAgainstGpuReference) {
  GenerateSpec s = spec_of(1, 4096, 4096, 64, 128, 2048);
  s.ids = IdPattern::random_permutation;  // causal top-k selection would cost O(S^2) on the host
  GeneratedProblem p = make_problem(s);
  DeviceProblem dp(p);
  const int64_t nq = num_q_rows(p), nk = num_k_rows(p), H = 64, D = 128;
  DeviceBuffer dq(nq * H * D * 8), dw(nq * H * 8), dk(nk * D * 8);
  hopper::reference_backward_device(dp.inputs(), p.options(), static_cast<double*>(dq.ptr), static_cast<double*>(dw.ptr),
                                    static_cast<double*>(dk.ptr), nullptr);
  const OutputBuffers got = run_cuda(p, p.options(), DType::bf16, DType::bf16, DType::bf16);
  const ErrorStats eq = compare(got.d_index_q, device_doubles(dq));
  const ErrorStats ew = compare(got.d_weights, device_doubles(dw));
  const ErrorStats ek = compare(got.d_index_k, device_doubles(dk));
  std::printf("[numerics] %-34s dQ %s | dW %s | dK %s\n", "deepseek b1 s4096 topk2048 (gpu ref)", eq.str().c_str(),
              ew.str().c_str(), ek.str().c_str());
  EXPECT_TRUE(eq.ok(3e-3)) << eq.str();
  EXPECT_TRUE(ew.ok(3e-3)) << ew.str();
  EXPECT_TRUE(ek.ok(3e-3)) << ek.str();
}

}  // namespace
}  // namespace dsaib::test
