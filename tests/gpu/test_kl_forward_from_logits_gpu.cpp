// The cuda loss forward and one call given the top-k's logits (label gpu):
// against the cpu backend's fp64 forward from the same f32 logits (itself
// checked by tests/cpu/test_kl_forward_from_logits.cpp), BSHD/THD,
// local/global ids, invalid slots whose logits are NaN (never read), topk 1
// to several thousand, H 8-128; bitwise reproducibility with and without P;
// logits read through their strides (padded rows, BSHD's batch not outermost);
// the one call's gradients against the fp64 reference; the logits of
// indexer_topk on the device passed straight on. Without a
// compute-capability-9.0 GPU every test is SKIPPED (never passed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "dsaib/indexer_topk.hpp"
#include "gpu/device_problem.hpp"
#include "support/kl_forward_check.hpp"

namespace dsaib::test {
namespace {

// The same tolerances as the forward that recomputes the logits: the row end is the same code.
constexpr double kLossRel = 1e-6, kLseAbs = 1e-5, kPRel = 1e-5, kMassRel = 1e-5;
constexpr double kPFloor = 1e-30, kPAbsBelowFloor = 1e-35;

void invalid_slots(GeneratedProblem& p) {
  invalidate_run(p, 0, Where::start, std::min<int64_t>(5, topk(p)));
  set_out_of_range(p, 2, 0, 0);
  invalidate_row(p, 3);
  duplicate_slot(p, 4, 0, topk(p) - 1);
}

struct Case {
  std::string name;
  GenerateSpec spec;
};

std::vector<Case> cases() {
  const IdPattern perm = IdPattern::random_permutation, causal = IdPattern::causal_topk;
  return {
      {"bshd_h64_d128_causal", ragged_spec(Layout::bshd, 64, 128, 64, 96, 96, IdMode::local, causal, 101)},
      {"bshd_h8_d64", ragged_spec(Layout::bshd, 8, 64, 40, 33, 80, IdMode::local, perm, 102)},
      {"bshd_h128_d128_global", ragged_spec(Layout::bshd, 128, 128, 100, 20, 150, IdMode::global, perm, 103)},
      {"bshd_h72_d128_topk1", ragged_spec(Layout::bshd, 72, 128, 1, 40, 40, IdMode::local, perm, 104)},
      {"bshd_h32_d128_topk2500", ragged_spec(Layout::bshd, 32, 128, 2500, 6, 3000, IdMode::local, perm, 105)},
      {"thd_h16_d128_local", ragged_spec(Layout::thd, 16, 128, 48, 40, 70, IdMode::local, perm, 106)},
      {"thd_h128_d64_global", ragged_spec(Layout::thd, 128, 64, 1100, 9, 1500, IdMode::global, perm, 107)},
  };
}

/// f32 logits I of the selected keys (no sm_scale) from the fp64 reference,
/// shaped like topk_indices; NaN at the invalid slots, which no backend reads.
HostTensor logits_of(const GeneratedProblem& p) {
  IndexerOptions unscaled = p.options();
  unscaled.sm_scale = 1.0f;
  const std::vector<double> z = reference_index_logits(p.inputs(), unscaled);
  HostTensor t(DType::f32, p.topk_indices.shape);
  for (size_t e = 0; e < z.size(); ++e) {
    t.data<float>()[e] = std::isinf(z[e]) && z[e] < 0 ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(z[e]);
  }
  return t;
}

struct DeviceForwardOutputs {
  DeviceTensor loss, row_lse, row_target_mass, index_score;
  explicit DeviceForwardOutputs(const ForwardBuffers& h)  // NaN-poisoned host buffers
      : loss(h.loss), row_lse(h.row_lse), row_target_mass(h.row_target_mass), index_score(h.index_score) {}
  IndexerKLForwardOutputs views(bool with_p = true) const {
    return {loss.view, row_lse.view, row_target_mass.view, with_p ? index_score.view : TensorView{}};
  }
};

IndexerInputs device_inputs(const DeviceProblem& d, const DeviceTensor& logits) {
  IndexerInputs in = d.inputs();
  in.index_score = TensorView{};
  in.topk_logits = logits.view;
  return in;
}

/// The cuda forward from `p`'s f32 logits against the cpu backend's fp64 forward from the same logits.
void check_forward(const GeneratedProblem& p, const std::string& name) {
  const HostTensor logits = logits_of(p);
  IndexerOptions opt = p.options();
  IndexerInputs host_in = forward_inputs(p);
  host_in.topk_logits = logits.view();
  const ReferenceKLForward ref = reference_kl_forward(host_in, opt);
  DeviceProblem d(p);
  const DeviceTensor dlogits(logits);
  DeviceForwardOutputs out(make_forward_buffers(p));
  opt.backend = Backend::cuda;
  indexer_kl_forward(device_inputs(d, dlogits), out.views(), opt);
  check_cuda(cudaDeviceSynchronize(), "forward from logits");
  const std::vector<double> lse = to_doubles(out.row_lse.to_host()), mass = to_doubles(out.row_target_mass.to_host()),
                            pr = to_doubles(out.index_score.to_host());
  const double loss = to_doubles(out.loss.to_host())[0];
  const double loss_rel = rel_error(loss, ref.loss), lse_abs = max_error(lse, ref.row_lse, false),
               p_rel = max_error(pr, ref.index_score, true, kPFloor),
               mass_rel = max_error(mass, target_mass_for_lse(ref.row_target_mass, ref.row_lse, lse), true, 1e-30);
  std::printf("[forward from logits] %-26s loss rel %.2e | LSE abs %.2e | P rel %.2e | mass rel %.2e\n", name.c_str(),
              loss_rel, lse_abs, p_rel, mass_rel);
  EXPECT_LE(loss_rel, kLossRel) << name;
  EXPECT_LE(lse_abs, kLseAbs) << name;
  EXPECT_LE(p_rel, kPRel) << name;
  EXPECT_LE(max_abs_error_below(pr, ref.index_score, kPFloor), kPAbsBelowFloor) << name;
  EXPECT_LE(mass_rel, kMassRel) << name;
}

class KlForwardFromLogitsGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  }
};

TEST_F(KlForwardFromLogitsGpu, MatchesTheFp64ForwardFromTheSameLogits) {
  for (const Case& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    invalid_slots(p);
    check_forward(p, c.name);
  }
}

TEST(Sanitized, KlForwardFromLogits) {
  if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  for (const Case& c : {cases()[1], cases()[6]}) {
    GeneratedProblem p = make_problem(c.spec);
    invalid_slots(p);
    check_forward(p, c.name);
  }
}

TEST_F(KlForwardFromLogitsGpu, BitwiseReproducibleAndIndexScoreOptional) {
  GeneratedProblem p = make_problem(ragged_spec(Layout::bshd, 64, 128, 512, 200, 700, IdMode::local,
                                            IdPattern::random_permutation, 111));
  const HostTensor logits = logits_of(p);
  DeviceProblem d(p);
  const DeviceTensor dlogits(logits);
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  DeviceForwardOutputs first(make_forward_buffers(p));
  indexer_kl_forward(device_inputs(d, dlogits), first.views(), opt);
  const HostTensor loss0 = first.loss.to_host(), lse0 = first.row_lse.to_host(), mass0 = first.row_target_mass.to_host(),
                   p0 = first.index_score.to_host();
  for (int rep = 0; rep < 4; ++rep) {
    DeviceForwardOutputs again(make_forward_buffers(p));
    indexer_kl_forward(device_inputs(d, dlogits), again.views(rep % 2 == 0), opt);
    EXPECT_TRUE(bitwise_equal(loss0, again.loss.to_host())) << rep;
    EXPECT_TRUE(bitwise_equal(lse0, again.row_lse.to_host())) << rep;
    EXPECT_TRUE(bitwise_equal(mass0, again.row_target_mass.to_host())) << rep;
    if (rep % 2 == 0) EXPECT_TRUE(bitwise_equal(p0, again.index_score.to_host())) << rep;
    else EXPECT_TRUE(std::isnan(to_doubles(again.index_score.to_host())[0])) << "P written though absent";
  }
}

/// The logits in a NaN-filled buffer whose rows are `row_pad` floats wider
/// than topk and (BSHD) whose batch dimension is not the outermost in memory
/// (a (S, B, topk) buffer seen as (B, S, topk)); innermost stride 1, as the
/// cuda backend takes them. Read with the wrong strides, the view gives NaN.
struct StridedLogits {
  HostTensor buffer;
  std::vector<int64_t> strides;
};
StridedLogits strided_copy(const HostTensor& logits, int64_t row_pad) {
  const bool bshd = logits.shape.size() == 3;
  const int64_t K = logits.shape.back(), B = bshd ? logits.shape[0] : 1, S = bshd ? logits.shape[1] : logits.shape[0];
  const int64_t row = K + row_pad;
  StridedLogits out;
  out.buffer = HostTensor(DType::f32, {S * B * row});
  float* buf = out.buffer.data<float>();
  for (int64_t e = 0; e < out.buffer.numel(); ++e) buf[e] = std::numeric_limits<float>::quiet_NaN();
  const float* src = logits.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < K; ++i) buf[(s * B + b) * row + i] = src[(b * S + s) * K + i];
    }
  }
  out.strides = bshd ? std::vector<int64_t>{row, B * row, 1} : std::vector<int64_t>{row, 1};
  return out;
}

TEST_F(KlForwardFromLogitsGpu, StridedLogitsAreReadThroughTheirStrides) {
  for (const Case& c : {cases()[1], cases()[5]}) {
    GeneratedProblem p = make_problem(c.spec);
    invalid_slots(p);
    const HostTensor logits = logits_of(p);
    DeviceProblem d(p);
    const DeviceTensor dlogits(logits);
    IndexerOptions opt = p.options();
    opt.backend = Backend::cuda;
    DeviceForwardOutputs want(make_forward_buffers(p));
    indexer_kl_forward(device_inputs(d, dlogits), want.views(), opt);
    const StridedLogits strided = strided_copy(logits, 3);
    DeviceTensor dstrided(strided.buffer);
    dstrided.view.rank = static_cast<int32_t>(logits.shape.size());
    for (size_t i = 0; i < logits.shape.size(); ++i) {
      dstrided.view.shape[i] = logits.shape[i];
      dstrided.view.strides[i] = strided.strides[i];
    }
    DeviceForwardOutputs got(make_forward_buffers(p));
    indexer_kl_forward(device_inputs(d, dstrided), got.views(), opt);
    EXPECT_TRUE(bitwise_equal(want.loss.to_host(), got.loss.to_host())) << c.name;
    EXPECT_TRUE(bitwise_equal(want.row_lse.to_host(), got.row_lse.to_host())) << c.name;
    EXPECT_TRUE(bitwise_equal(want.row_target_mass.to_host(), got.row_target_mass.to_host())) << c.name;
    EXPECT_TRUE(bitwise_equal(want.index_score.to_host(), got.index_score.to_host())) << c.name;
  }
}

/// The one call from the logits: the loss of the forward from them, and the
/// gradients of the fp64 one call given the same logits, within the bounds of
/// the one call that recomputes them.
TEST_F(KlForwardFromLogitsGpu, OneCallMatchesTheFp64OneCall) {
  for (const Case& c : cases()) {
    if (c.spec.heads > 64 && c.spec.topk > 1000) continue;  // the fp64 reference's time
    GeneratedProblem p = make_problem(c.spec);
    invalid_slots(p);
    const HostTensor logits = logits_of(p);
    IndexerOptions opt = p.options();
    opt.grad_loss = 0.75f;
    IndexerInputs host_in = forward_inputs(p);
    host_in.topk_logits = logits.view();
    HostTensor ref_loss(DType::f64, {});
    OutputBuffers ref = make_outputs(p, DType::f64, DType::f64, DType::f64);
    indexer_kl_loss_and_grad(host_in, {ref_loss.view(), ref.d_index_q.view(), ref.d_weights.view(),
                                       ref.d_index_k.view()}, opt);
    DeviceProblem d(p);
    const DeviceTensor dlogits(logits);
    DeviceOutputs out(p, DType::f32, DType::f32, DType::f32);
    out.poison();
    DeviceTensor loss(DType::f32, {});
    loss.fill(std::numeric_limits<double>::quiet_NaN());
    opt.backend = Backend::cuda;
    const IndexerBackwardOutputs g = out.views();
    indexer_kl_loss_and_grad(device_inputs(d, dlogits), {loss.view, g.d_index_q, g.d_weights, g.d_index_k}, opt);
    check_cuda(cudaDeviceSynchronize(), "one call from logits");
    EXPECT_LE(rel_error(to_doubles(loss.to_host())[0], to_doubles(ref_loss)[0]), kLossRel) << c.name;
    const ErrorStats dq = compare(out.d_index_q.to_host(), to_doubles(ref.d_index_q)),
                     dw = compare(out.d_weights.to_host(), to_doubles(ref.d_weights)),
                     dk = compare(out.d_index_k.to_host(), to_doubles(ref.d_index_k));
    std::printf("[one call from logits] %-26s rel RMS dQ %.3g dW %.3g dK %.3g\n", c.name.c_str(), dq.rel_rms,
                dw.rel_rms, dk.rel_rms);
    if (c.spec.topk == 1) continue;  // P = 1: gradients of ~0, compared by neither rule
    EXPECT_TRUE(dq.ok(1e-3)) << c.name << " d_index_q " << dq.str();
    EXPECT_TRUE(dw.ok(1e-3)) << c.name << " d_weights " << dw.str();
    EXPECT_TRUE(dk.ok(1e-3)) << c.name << " d_index_k " << dk.str();
  }
}

/// indexer_topk's device outputs feed the loss directly: ids and logits as written.
TEST_F(KlForwardFromLogitsGpu, FollowsTheDeviceTopk) {
  GeneratedProblem p = make_problem(ragged_spec(Layout::bshd, 64, 128, 256, 300, 300, IdMode::local,
                                            IdPattern::causal_topk, 121));
  DeviceProblem d(p);
  DeviceTensor ids(DType::i32, p.topk_indices.shape), logits(DType::f32, p.topk_indices.shape);
  IndexerTopkOptions topt;
  topt.backend = Backend::cuda;
  indexer_topk({d.index_q.view, d.weights.view, d.index_k.view, {}, {}, {}, {}}, {ids.view, logits.view, {}}, topt);
  check_cuda(cudaDeviceSynchronize(), "topk");
  p.topk_indices = ids.to_host();
  renormalize_attn_score(p);
  const HostTensor host_logits = logits.to_host();
  IndexerOptions opt = p.options();
  IndexerInputs host_in = forward_inputs(p);
  host_in.topk_logits = host_logits.view();
  const ReferenceKLForward from_logits = reference_kl_forward(host_in, opt);
  const ReferenceKLForward recomputed = reference_kl_forward(forward_inputs(p), opt);
  EXPECT_LE(rel_error(from_logits.loss, recomputed.loss), 1e-5);  // the top-k's logits: within their bound
  DeviceProblem d2(p);
  DeviceForwardOutputs out(make_forward_buffers(p));
  opt.backend = Backend::cuda;
  indexer_kl_forward(device_inputs(d2, logits), out.views(), opt);
  check_cuda(cudaDeviceSynchronize(), "forward from the top-k's logits");
  EXPECT_LE(rel_error(to_doubles(out.loss.to_host())[0], from_logits.loss), kLossRel);
}

}  // namespace
}  // namespace dsaib::test
