// The cuda loss forward (label gpu) against the fp64 reference
// (dsaib::reference_kl_forward, itself checked against the definition by
// tests/cpu/test_kl_forward.cpp): BSHD/THD, local/global ids, invalid and
// out-of-range slots, rows without a valid slot, topk 1 to several slot
// chunks, H 8-128, D 64/128; logits with a large common part (|LSE| ~ 4700);
// bitwise reproducibility; a CUDA-graph capture;
// the time per row at H64 D128 topk 2048. Without a compute-capability-9.0
// GPU every test is SKIPPED (never passed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu/device_problem.hpp"
#include "support/kl_forward_check.hpp"

namespace dsaib::test {
namespace {

class KlForwardGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  }
};

// Tolerances against fp64 (docs/math.md's targets for the forward).
constexpr double kLossRel = 1e-6, kLseAbs = 1e-5, kPRel = 1e-5, kMassRel = 1e-5;
// P below this is compared absolutely (fp32 has no relative accuracy in its subnormals).
constexpr double kPFloor = 1e-30, kPAbsBelowFloor = 1e-35;

struct DeviceForwardOutputs {
  DeviceTensor loss, row_lse, row_target_mass, index_score;
  explicit DeviceForwardOutputs(const GeneratedProblem& p) : DeviceForwardOutputs(make_forward_buffers(p)) {}
  explicit DeviceForwardOutputs(const ForwardBuffers& h)  // NaN-poisoned host buffers
      : loss(h.loss), row_lse(h.row_lse), row_target_mass(h.row_target_mass), index_score(h.index_score) {}
  IndexerKLForwardOutputs views(bool with_p = true) const {
    return {loss.view, row_lse.view, row_target_mass.view, with_p ? index_score.view : TensorView{}};
  }
};

IndexerInputs device_forward_inputs(const DeviceProblem& d) {
  IndexerInputs in = d.inputs();
  in.index_score = TensorView{};
  return in;
}

struct GpuCase {
  std::string name;
  GenerateSpec spec;
  void (*mutate)(GeneratedProblem&) = nullptr;
};

void invalid_slots(GeneratedProblem& p) {
  invalidate_run(p, 0, Where::start, std::min<int64_t>(5, topk(p)));
  invalidate_run(p, 1, Where::middle, std::min<int64_t>(70, topk(p)));
  set_out_of_range(p, 2, 0, 0);
  set_out_of_range(p, 2, topk(p) - 1, 9);
  invalidate_row(p, 3);
  duplicate_slot(p, 4, 0, topk(p) - 1);
}

std::vector<GpuCase> cases() {
  const IdPattern perm = IdPattern::random_permutation, causal = IdPattern::causal_topk;
  return {
      {"bshd_h64_d128_causal", ragged_spec(Layout::bshd, 64, 128, 64, 96, 96, IdMode::local, causal, 1)},
      {"bshd_h8_d64", ragged_spec(Layout::bshd, 8, 64, 40, 33, 80, IdMode::local, perm, 2)},
      {"bshd_h128_d128_invalid", ragged_spec(Layout::bshd, 128, 128, 100, 20, 150, IdMode::local, perm, 3), invalid_slots},
      {"bshd_h120_d64_global", ragged_spec(Layout::bshd, 120, 64, 72, 17, 90, IdMode::global, perm, 4), invalid_slots},
      {"bshd_h72_d128_topk1", ragged_spec(Layout::bshd, 72, 128, 1, 40, 40, IdMode::local, perm, 5)},
      {"bshd_h32_d128_topk2500", ragged_spec(Layout::bshd, 32, 128, 2500, 6, 3000, IdMode::local, perm, 6), invalid_slots},
      {"bshd_h64_d64_topk_past_skv", ragged_spec(Layout::bshd, 64, 64, 300, 12, 200, IdMode::local, perm, 7)},
      {"thd_h16_d128_local", ragged_spec(Layout::thd, 16, 128, 48, 40, 70, IdMode::local, perm, 8), invalid_slots},
      {"thd_h128_d64_global", ragged_spec(Layout::thd, 128, 64, 1100, 9, 1500, IdMode::global, perm, 9), invalid_slots},
      {"thd_h48_d128_causal", ragged_spec(Layout::thd, 48, 128, 32, 50, 50, IdMode::global, causal, 10)},
  };
}

/// Logits of -inf at valid slots: f32 weights with one head's weight -3e38, so
/// w sm_scale relu(q.k) overflows f32 to -inf wherever that head's q.k > 0
/// (about half the keys, slot 0 of about half the rows: the first key of a
/// score thread), while the fp64 reference's logit stays finite (~-1e39, P
/// exactly 0). Every row keeps finite logits (keys with q.k <= 0 there).
GeneratedProblem minus_inf_logits_problem() {
  GenerateSpec s = ragged_spec(Layout::bshd, 64, 128, 200, 24, 400, IdMode::local, IdPattern::random_permutation, 71);
  s.weights_f32 = true;
  GeneratedProblem p = make_problem(s);
  const int64_t H = p.spec.heads, R = num_q_rows(p);
  for (int64_t r = 0; r < R; ++r) p.weights.data<float>()[r * H + 3] = -3e38f;
  return p;
}

/// A wide spread of logits (give_logits_a_common_part with sm_scale 3/4, as
/// LargeCommonLogitPart's wide cases): rows with log P < -99 take the pass over
/// their slots for the loss term and mass.
GeneratedProblem wide_spread_problem() {
  GeneratedProblem p = make_problem(ragged_spec(Layout::thd, 64, 128, 300, 24, 600, IdMode::global,
                                            IdPattern::random_permutation, 72));
  give_logits_a_common_part(p, 2, 0, 72);
  p.sm_scale = p.spec.sm_scale = 0.75f;
  refresh_index_score(p);
  invalid_slots(p);
  return p;
}

struct Errors {
  double loss_rel, lse_abs, p_rel, p_abs_low, mass_rel;
};

Errors check_case(const GeneratedProblem& p, const IndexerOptions& opt_in, const std::string& name) {
  IndexerOptions opt = opt_in;
  opt.backend = Backend::cpu;
  const ReferenceKLForward ref = reference_kl_forward(forward_inputs(p), opt);
  DeviceProblem d(p);
  DeviceForwardOutputs out(p);
  opt.backend = Backend::cuda;
  indexer_kl_forward(device_forward_inputs(d), out.views(), opt);
  check_cuda(cudaDeviceSynchronize(), "forward");
  const std::vector<double> lse = to_doubles(out.row_lse.to_host()), mass = to_doubles(out.row_target_mass.to_host()),
                            pr = to_doubles(out.index_score.to_host());
  const double loss = to_doubles(out.loss.to_host())[0];
  // row_target_mass is defined with the LSE as written (f32): the fp64 mass
  // times exp(row_lse - LSE) (target_mass_for_lse).
  const std::vector<double> want_mass = target_mass_for_lse(ref.row_target_mass, ref.row_lse, lse);
  Errors e{rel_error(loss, ref.loss), max_error(lse, ref.row_lse, false), max_error(pr, ref.index_score, true, kPFloor),
           max_abs_error_below(pr, ref.index_score, kPFloor), max_error(mass, want_mass, true, 1e-30)};
  std::printf("[forward] %-28s loss %.6g (ref %.6g) rel %.2e | LSE abs %.2e | P rel %.2e (abs below 1e-30 %.1e) | mass rel %.2e\n",
              name.c_str(), loss, ref.loss, e.loss_rel, e.lse_abs, e.p_rel, e.p_abs_low, e.mass_rel);
  EXPECT_LE(e.loss_rel, kLossRel) << name;
  EXPECT_LE(e.lse_abs, kLseAbs) << name;
  EXPECT_LE(e.p_rel, kPRel) << name;
  EXPECT_LE(e.p_abs_low, kPAbsBelowFloor) << name;
  EXPECT_LE(e.mass_rel, kMassRel) << name;
  return e;
}

TEST_F(KlForwardGpu, MatchesTheFp64Reference) {
  for (const GpuCase& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    if (c.mutate) c.mutate(p);
    IndexerOptions opt = p.options();
    opt.loss_coeff = 0.3f;
    check_case(p, opt, c.name);
  }
}

/// Logits with a large common part (give_logits_a_common_part): every z_i ~ 37
/// or ~ 4700 with a spread of a few units. Its inputs make z exact in f32, so
/// the forward's own rounding after the logits is what is measured, and P
/// keeps the 1e-5 bound at any |z|. (With arbitrary inputs the f32 logits
/// themselves are off by ~|z| 2^-24 each, a relative error of P of that size:
/// ~3e-4 at |z| 4700; no bound on P can be tighter than that.) The written
/// LSE is held to 1e-5 plus its own f32 rounding, |LSE| 2^-24. Before P, the
/// loss terms and the target mass took the rounding of the f32 LSE (up to
/// 2.4e-4 at 4700, common to the row): P's error was up to 2.4e-4, the
/// loss's ~2e-5, the mass's ~1e-4 against this definition.
/// The wide-spread cases (sm_scale 3/4: z ~ 7000 with a spread of hundreds)
/// have slots with log P < -99 in their rows: the kernel's rows then take the
/// pass over their slots (clipped loss terms, masks of 0), which the narrow
/// cases never need. Their sm_scale keeps z - LSE off the clip at -100 (a grid
/// of 3/8 with LSE = max z where one slot dominates; a power of two would put
/// slots exactly on it), and a row with a slot within 0.01 of the clip is left
/// out of the mass comparison: there the f32 mask [exp(z - LSE) >= eps] may
/// differ from the fp64 one (kl-forward.md, "Precision"). Every case also runs
/// without P: the loss, LSE and mass must be bitwise those of the run with P.
TEST_F(KlForwardGpu, LargeCommonLogitPart) {
  struct C {
    std::string name;
    Layout layout;
    int64_t h, d, topk;
    int q_common, sm_scale_log2;
    double lse_min;
    bool clipped;  // slots with log P < -99
  };
  const C cases[] = {{"bshd_h64_d128_z4700", Layout::bshd, 64, 128, 256, 16, -4, 4000, false},
                     {"thd_h128_d64_z4700", Layout::thd, 128, 64, 200, 16, -4, 4000, false},
                     {"bshd_h64_d64_topk2048_z4700", Layout::bshd, 64, 64, 2048, 32, -4, 4000, false},
                     {"bshd_h64_d128_z37", Layout::bshd, 64, 128, 256, 2, -8, 30, false},
                     {"bshd_h64_d128_wide_spread", Layout::bshd, 64, 128, 256, 2, 0, 1000, true},
                     {"thd_h96_d64_topk1100_wide_spread", Layout::thd, 96, 64, 1100, 2, 0, 1000, true}};
  const double eps = std::exp(-100.0);
  uint64_t seed = 61;
  for (const C& c : cases) {
    GeneratedProblem p = make_problem(ragged_spec(c.layout, c.h, c.d, c.topk, 24, c.topk + 300, IdMode::local,
                                              IdPattern::random_permutation, seed));
    give_logits_a_common_part(p, c.q_common, c.sm_scale_log2, seed++);
    if (c.clipped) {
      p.sm_scale = p.spec.sm_scale = 0.75f;  // w sm_scale and its partial sums stay exact in f32
      refresh_index_score(p);
    }
    invalid_slots(p);
    IndexerOptions opt = p.options();
    opt.loss_coeff = 0.9f;
    const ReferenceKLForward ref = reference_kl_forward(forward_inputs(p), opt);
    DeviceProblem d(p);
    DeviceForwardOutputs out(p);  // NaN-poisoned
    opt.backend = Backend::cuda;
    indexer_kl_forward(device_forward_inputs(d), out.views(), opt);
    check_cuda(cudaDeviceSynchronize(), "forward");
    const std::vector<double> lse = to_doubles(out.row_lse.to_host()), mass = to_doubles(out.row_target_mass.to_host()),
                              pr = to_doubles(out.index_score.to_host());
    const double loss = to_doubles(out.loss.to_host())[0];
    double lse_excess = 0, lse_lo = std::numeric_limits<double>::infinity();
    for (size_t r = 0; r < lse.size(); ++r) {
      if (!std::isfinite(ref.row_lse[r])) {
        EXPECT_EQ(lse[r], ref.row_lse[r]) << c.name << " row " << r;  // -inf, not NaN
        continue;
      }
      lse_lo = std::min(lse_lo, ref.row_lse[r]);
      const double bound = 1e-5 + std::abs(ref.row_lse[r]) * std::ldexp(1.0, -24), err = std::abs(lse[r] - ref.row_lse[r]);
      lse_excess = err <= bound ? std::max(lse_excess, err / bound) : std::numeric_limits<double>::infinity();  // NaN: inf
    }
    const double p_rel = max_error(pr, ref.index_score, true, kPFloor);
    std::vector<double> want_mass = target_mass_for_lse(ref.row_target_mass, ref.row_lse, lse), got_mass = mass;
    int64_t rows_at_clip = 0;
    for (size_t r = 0; r < lse.size(); ++r) {
      bool at_clip = false;
      for (int64_t i = 0; i < c.topk; ++i) {
        const double pv = ref.index_score[r * c.topk + i];
        at_clip = at_clip || (pv > 0.0 && std::abs(std::log(pv / eps)) < 0.01);
      }
      if (at_clip) {
        want_mass[r] = got_mass[r] = 0.0;
        ++rows_at_clip;
      }
    }
    EXPECT_LE(rows_at_clip, static_cast<int64_t>(lse.size()) / 8) << c.name;
    const double mass_rel = max_error(got_mass, want_mass, true, 1e-30);
    std::printf("[forward large LSE] %-28s LSE >= %.1f | loss rel %.2e | LSE err / bound %.2f | P rel %.2e | mass rel %.2e (%lld rows at the clip left out)\n",
                c.name.c_str(), lse_lo, rel_error(loss, ref.loss), lse_excess, p_rel, mass_rel, static_cast<long long>(rows_at_clip));
    EXPECT_GT(lse_lo, c.lse_min) << c.name;  // the case is the one intended
    EXPECT_LE(rel_error(loss, ref.loss), kLossRel) << c.name;
    EXPECT_LE(lse_excess, 1.0) << c.name;
    EXPECT_LE(p_rel, kPRel) << c.name;
    EXPECT_LE(max_abs_error_below(pr, ref.index_score, kPFloor), kPAbsBelowFloor) << c.name;
    EXPECT_LE(mass_rel, kMassRel) << c.name;
    int64_t clipped = 0;  // valid slots with log P < -99 (invalid ones have P = 0 exactly)
    for (double v : ref.index_score) clipped += v > 0.0 && v < std::exp(-99.0);
    EXPECT_EQ(clipped > 0, c.clipped) << c.name << ": " << clipped << " slots with log P < -99";
    DeviceForwardOutputs no_p(p);
    indexer_kl_forward(device_forward_inputs(d), no_p.views(false), opt);
    EXPECT_TRUE(bitwise_equal(out.loss.to_host(), no_p.loss.to_host())) << c.name;
    EXPECT_TRUE(bitwise_equal(out.row_lse.to_host(), no_p.row_lse.to_host())) << c.name;
    EXPECT_TRUE(bitwise_equal(out.row_target_mass.to_host(), no_p.row_target_mass.to_host())) << c.name;
  }
}

// The sanitizer's case (tests/sanitizer/run_sanitizer.sh runs Sanitized.* of this
// binary under racecheck, synccheck, memcheck and initcheck, requiring no report):
// every layout, id mode and tail case above, then rows that walk their slots
// (a wide spread, -inf logits), with and without P, each checked against the
// fp64 reference as above.
TEST(Sanitized, KlForwardEveryCase) {
  if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  for (const GpuCase& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    if (c.mutate) c.mutate(p);
    const IndexerOptions opt = p.options();
    check_case(p, opt, c.name);
    DeviceProblem d(p);
    DeviceForwardOutputs out(p);
    IndexerOptions cuda_opt = opt;
    cuda_opt.backend = Backend::cuda;
    indexer_kl_forward(device_forward_inputs(d), out.views(false), cuda_opt);
    check_cuda(cudaDeviceSynchronize(), "forward without P");
    EXPECT_FALSE(std::isnan(to_doubles(out.loss.to_host())[0])) << c.name;
  }
  // Rows that walk their slots (clipped slots, -inf logits), with and without P:
  // the loss against the reference (the mass of a wide-spread row near the clip
  // is LargeCommonLogitPart's to check), and the statistics bitwise the same.
  for (GeneratedProblem p : {wide_spread_problem(), minus_inf_logits_problem()}) {
    IndexerOptions opt = p.options();
    const ReferenceKLForward ref = reference_kl_forward(forward_inputs(p), opt);
    opt.backend = Backend::cuda;
    DeviceProblem d(p);
    DeviceForwardOutputs with_p(p), without_p(p);
    indexer_kl_forward(device_forward_inputs(d), with_p.views(), opt);
    indexer_kl_forward(device_forward_inputs(d), without_p.views(false), opt);
    check_cuda(cudaDeviceSynchronize(), "forward");
    EXPECT_LE(rel_error(to_doubles(with_p.loss.to_host())[0], ref.loss), kLossRel);
    EXPECT_TRUE(bitwise_equal(with_p.loss.to_host(), without_p.loss.to_host()));
    EXPECT_TRUE(bitwise_equal(with_p.row_target_mass.to_host(), without_p.row_target_mass.to_host()));
  }
}

TEST_F(KlForwardGpu, WeightsF32AndStrictIds) {
  GenerateSpec s = ragged_spec(Layout::bshd, 40, 128, 64, 30, 64, IdMode::local, IdPattern::random_permutation, 21);
  s.weights_f32 = true;
  GeneratedProblem p = make_problem(s);
  IndexerOptions opt = p.options();
  opt.strict_indices = true;
  opt.normalization_count = 7;
  check_case(p, opt, "bshd_h40_weights_f32_strict");
  set_out_of_range(p, 3, 2, 1);
  DeviceProblem d(p);
  DeviceForwardOutputs out(p);
  opt.backend = Backend::cuda;
  EXPECT_THROW(indexer_kl_forward(device_forward_inputs(d), out.views(), opt), Error);
  EXPECT_TRUE(std::isnan(to_doubles(out.loss.to_host())[0]));  // nothing written
}

TEST_F(KlForwardGpu, NanNeverPasses) {
  GeneratedProblem p = make_problem(ragged_spec(Layout::bshd, 64, 128, 64, 16, 64, IdMode::local, IdPattern::random_permutation, 31));
  p.attn_score.data<float>()[5 * topk(p) + 3] = std::numeric_limits<float>::quiet_NaN();
  DeviceProblem d(p);
  DeviceForwardOutputs out(p);
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  indexer_kl_forward(device_forward_inputs(d), out.views(), opt);
  EXPECT_TRUE(std::isnan(to_doubles(out.loss.to_host())[0]));
  EXPECT_TRUE(std::isnan(to_doubles(out.row_target_mass.to_host())[5]));
}

/// A -inf logit is a slot of P 0 (clipped loss term -100 T~, mask 0), wherever
/// it falls in the gather order, also as the first key a score thread sees.
TEST_F(KlForwardGpu, MinusInfinityLogitsAreSlotsOfZeroProbability) {
  GeneratedProblem p = minus_inf_logits_problem();
  IndexerOptions opt = p.options();
  const ReferenceKLForward ref = reference_kl_forward(forward_inputs(p), opt);
  int64_t zero_p = 0;  // valid slots whose reference P underflows to 0 (the -inf ones here)
  for (int64_t r = 0; r < num_q_rows(p); ++r) {
    for (int64_t i = 0; i < topk(p); ++i) zero_p += ref.index_score[r * topk(p) + i] == 0.0 && ref.row_lse[r] > -1e30;
  }
  EXPECT_GT(zero_p, num_q_rows(p) * topk(p) / 8) << "the case is the one intended";
  const Errors e = check_case(p, opt, "bshd_h64_minus_inf_logits");
  EXPECT_FALSE(std::isnan(e.loss_rel));
}

TEST_F(KlForwardGpu, BitwiseReproducibleAndIndexScoreOptional) {
  GeneratedProblem p = make_problem(ragged_spec(Layout::bshd, 64, 128, 512, 200, 700, IdMode::local, IdPattern::random_permutation, 41));
  DeviceProblem d(p);
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  DeviceForwardOutputs first(p);
  indexer_kl_forward(device_forward_inputs(d), first.views(), opt);
  const HostTensor loss0 = first.loss.to_host(), lse0 = first.row_lse.to_host(), mass0 = first.row_target_mass.to_host(),
                   p0 = first.index_score.to_host();
  for (int rep = 0; rep < 5; ++rep) {
    DeviceForwardOutputs again(p);
    indexer_kl_forward(device_forward_inputs(d), again.views(rep % 2 == 0), opt);
    EXPECT_TRUE(bitwise_equal(loss0, again.loss.to_host())) << rep;
    EXPECT_TRUE(bitwise_equal(lse0, again.row_lse.to_host())) << rep;
    EXPECT_TRUE(bitwise_equal(mass0, again.row_target_mass.to_host())) << rep;
    if (rep % 2 == 0) EXPECT_TRUE(bitwise_equal(p0, again.index_score.to_host())) << rep;
    else EXPECT_TRUE(std::isnan(to_doubles(again.index_score.to_host())[0])) << "P written though absent";
  }
}

TEST_F(KlForwardGpu, CapturedInACudaGraph) {
  GeneratedProblem p = make_problem(ragged_spec(Layout::bshd, 64, 128, 128, 64, 256, IdMode::local, IdPattern::random_permutation, 51));
  DeviceProblem d(p);
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  DeviceForwardOutputs direct(p), graphed(p), graphed_ws(p);
  indexer_kl_forward(device_forward_inputs(d), direct.views(), opt);
  const std::size_t bytes = indexer_kl_forward_workspace_size(device_forward_inputs(d), graphed_ws.views(), opt);
  EXPECT_GT(bytes, 0u);
  DeviceBuffer ws(bytes);
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  opt.stream = stream;
  for (int with_ws = 0; with_ws < 2; ++with_ws) {
    DeviceForwardOutputs& out = with_ws ? graphed_ws : graphed;
    cudaGraph_t graph;
    check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    indexer_kl_forward(device_forward_inputs(d), out.views(), opt, with_ws ? ws.ptr : nullptr, with_ws ? bytes : 0);
    check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
    cudaGraphExec_t exec;
    check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    for (int i = 0; i < 3; ++i) check_cuda(cudaGraphLaunch(exec, stream), "graph launch");
    check_cuda(cudaStreamSynchronize(stream), "sync");
    EXPECT_TRUE(bitwise_equal(direct.loss.to_host(), out.loss.to_host())) << with_ws;
    EXPECT_TRUE(bitwise_equal(direct.row_lse.to_host(), out.row_lse.to_host())) << with_ws;
    EXPECT_TRUE(bitwise_equal(direct.index_score.to_host(), out.index_score.to_host())) << with_ws;
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

/// Time per row at B1 S 4096 H64 D128 topk 2048, random distinct-free ids over
/// the row's causal prefix (ascending), CUDA events, median of 15 after warm-up.
TEST_F(KlForwardGpu, TimePerRowH64D128Topk2048) {
  const int64_t S = 4096, H = 64, D = 128, K = 2048;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd;
  auto bf16 = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  };
  HostTensor q(DType::bf16, {1, S, H, D}), w(DType::bf16, {1, S, H}), k(DType::bf16, {1, S, D}),
      ids(DType::i32, {1, S, K}), t(DType::f32, {1, S, K});
  for (int64_t e = 0; e < q.numel(); ++e) q.data<uint16_t>()[e] = bf16(nd(rng));
  for (int64_t e = 0; e < w.numel(); ++e) w.data<uint16_t>()[e] = bf16(nd(rng) / 8.0f);
  for (int64_t e = 0; e < k.numel(); ++e) k.data<uint16_t>()[e] = bf16(nd(rng));
  for (int64_t r = 0; r < S; ++r) {
    for (int64_t i = 0; i < K; ++i) {
      // causal: row r sees keys 0..r; slots past r are -1 (as a causal top-k)
      ids.data<int32_t>()[r * K + i] = i <= r ? static_cast<int32_t>(r <= K ? i : (i * (r + 1)) / K) : -1;
      t.data<float>()[r * K + i] = i <= r ? 1.0f / static_cast<float>(std::min<int64_t>(r + 1, K)) : 0.0f;
    }
  }
  DeviceTensor dq(q), dw(w), dk(k), dids(ids), dt(t);
  IndexerInputs in{dq.view, dw.view, dk.view, dids.view, dt.view, {}, {}, {}};
  DeviceTensor loss(DType::f32, {}), lse(DType::f32, {1, S}), mass(DType::f32, {1, S});
  IndexerKLForwardOutputs out{loss.view, lse.view, mass.view, {}};
  IndexerOptions opt;
  opt.backend = Backend::cuda;
  opt.sm_scale = 1.0f / std::sqrt(static_cast<float>(D));
  const std::size_t bytes = indexer_kl_forward_workspace_size(in, out, opt);
  DeviceBuffer ws(bytes);
  cudaEvent_t a, b;
  check_cuda(cudaEventCreate(&a), "event");
  check_cuda(cudaEventCreate(&b), "event");
  for (int i = 0; i < 3; ++i) indexer_kl_forward(in, out, opt, ws.ptr, bytes);
  std::vector<float> ms;
  for (int i = 0; i < 15; ++i) {
    check_cuda(cudaEventRecord(a), "record");
    indexer_kl_forward(in, out, opt, ws.ptr, bytes);
    check_cuda(cudaEventRecord(b), "record");
    check_cuda(cudaEventSynchronize(b), "sync");
    float t_ms = 0;
    check_cuda(cudaEventElapsedTime(&t_ms, a, b), "elapsed");
    ms.push_back(t_ms);
  }
  std::sort(ms.begin(), ms.end());
  std::printf("[forward time] B1 S %lld H%lld D%lld topk %lld causal: median %.1f ns/row (min %.1f, max %.1f; %zu runs)\n",
              static_cast<long long>(S), static_cast<long long>(H), static_cast<long long>(D), static_cast<long long>(K),
              ms[ms.size() / 2] * 1e6 / S, ms.front() * 1e6 / S, ms.back() * 1e6 / S, ms.size());
  EXPECT_TRUE(std::isfinite(to_doubles(loss.to_host())[0]));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

}  // namespace
}  // namespace dsaib::test
