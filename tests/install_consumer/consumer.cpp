// The C++ API through the installed package (ctest install_and_consume): a generated
// problem on the cpu backend against the fp64 reference, and one argument error.
// Built against a package with the cuda backend (DSAIB_CONSUMER_WITH_CUDA), it also
// runs the problem on the cuda backend where one is available (an sm_90 GPU), and
// says that it skipped it where not: the sm_90a kernels reach a foreign executable
// through the installed static library.
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "dsaib/generate.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/reference.hpp"

#if DSAIB_CONSUMER_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

// Relative RMS of got against ref; NaN when got holds a non-finite value.
double relative_rms(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::nan("");
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::nan("");
}

#if DSAIB_CONSUMER_WITH_CUDA
// Copies of the problem's inputs on the GPU, the backward with f32 outputs there, and
// the outputs against the fp64 reference. 0 on success.
int run_cuda_backend(const dsaib::GeneratedProblem& p, const dsaib::ReferenceGradients& ref) {
  using namespace dsaib;
  std::vector<void*> buffers;
  auto device_copy = [&](const TensorView& host) {
    TensorView v = host;
    if (!host.present()) return v;
    const size_t bytes = static_cast<size_t>(host.numel()) * (host.dtype == DType::bf16 ? 2 : 4);
    void* d = nullptr;
    if (cudaMalloc(&d, bytes) != cudaSuccess || cudaMemcpy(d, host.data, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cudaMalloc / cudaMemcpy failed");
    buffers.push_back(d);
    v.data = d;
    v.device = DeviceType::cuda;
    return v;
  };
  IndexerInputs in = p.inputs();
  for (TensorView* t : {&in.index_q, &in.weights, &in.index_k, &in.topk_indices, &in.attn_score, &in.index_score})
    *t = device_copy(*t);
  const int64_t B = p.spec.batch, S = p.spec.s_q, Skv = p.spec.s_kv, H = p.spec.heads, D = p.spec.head_dim;
  std::vector<float> dq(B * S * H * D, std::nanf("")), dw(B * S * H, std::nanf("")), dk(B * Skv * D, std::nanf(""));
  IndexerBackwardOutputs out{device_copy(contiguous_view(dq.data(), DType::f32, {B, S, H, D})),
                             device_copy(contiguous_view(dw.data(), DType::f32, {B, S, H})),
                             device_copy(contiguous_view(dk.data(), DType::f32, {B, Skv, D}))};
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  indexer_backward(in, out, opt);
  bool ok = cudaDeviceSynchronize() == cudaSuccess;
  ok = ok && cudaMemcpy(dq.data(), out.d_index_q.data, dq.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
  ok = ok && cudaMemcpy(dw.data(), out.d_weights.data, dw.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
  ok = ok && cudaMemcpy(dk.data(), out.d_index_k.data, dk.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
  for (void* d : buffers) cudaFree(d);
  if (!ok) {
    std::printf("consumer_cxx: FAIL: a CUDA call after the cuda backend failed\n");
    return 1;
  }
  const double e_q = relative_rms(dq, ref.d_index_q), e_w = relative_rms(dw, ref.d_weights),
               e_k = relative_rms(dk, ref.d_index_k);
  std::printf("consumer_cxx: cuda backend against the fp64 reference, relative RMS dQ %.3g dW %.3g dK %.3g\n", e_q,
              e_w, e_k);
  // f32 outputs of the cuda backend (the split a operand): ~2.5e-6 (tests/gpu).
  if (!(e_q < 1e-4 && e_w < 1e-4 && e_k < 1e-4)) {
    std::printf("consumer_cxx: FAIL: cuda backend relative RMS above 1e-4 or not finite\n");
    return 1;
  }
  return 0;
}
#endif

}  // namespace

int main() {
  using namespace dsaib;
  GenerateSpec spec;
  spec.s_q = 48; spec.s_kv = 64; spec.heads = 8; spec.head_dim = 64; spec.topk = 16; spec.seed = 7;
  const GeneratedProblem p = generate_problem(spec);
  const int64_t B = spec.batch, S = spec.s_q, Skv = spec.s_kv, H = spec.heads, D = spec.head_dim;
  // Poisoned outputs: every element must be overwritten.
  std::vector<float> dq(B * S * H * D, std::nanf("")), dw(B * S * H, std::nanf("")), dk(B * Skv * D, std::nanf(""));
  IndexerBackwardOutputs out{contiguous_view(dq.data(), DType::f32, {B, S, H, D}),
                             contiguous_view(dw.data(), DType::f32, {B, S, H}),
                             contiguous_view(dk.data(), DType::f32, {B, Skv, D})};
  IndexerOptions opt = p.options();
  indexer_backward(p.inputs(), out, opt);
  const ReferenceGradients ref = reference_backward(p.inputs(), opt);
  const double e_q = relative_rms(dq, ref.d_index_q), e_w = relative_rms(dw, ref.d_weights),
               e_k = relative_rms(dk, ref.d_index_k);
  std::printf("consumer_cxx: cpu backend against the fp64 reference, relative RMS dQ %.3g dW %.3g dK %.3g\n", e_q, e_w,
              e_k);
  // f32 outputs of the cpu backend: ~1e-7 (tests/cpu); NaN (a non-finite output) fails too.
  if (!(e_q < 1e-5 && e_w < 1e-5 && e_k < 1e-5)) {
    std::printf("consumer_cxx: FAIL: relative RMS above 1e-5 or not finite\n");
    return 1;
  }
  // A wrong rank for index_q: dsaib::Error naming it, outputs untouched.
  std::vector<float> dw_before = dw;
  IndexerInputs bad = p.inputs();
  bad.index_q = contiguous_view(bad.index_q.data, DType::bf16, {B, S, H * D});
  try {
    indexer_backward(bad, out, opt);
    std::printf("consumer_cxx: FAIL: a rank-3 index_q was accepted\n");
    return 1;
  } catch (const Error& e) {
    std::printf("consumer_cxx: rank-3 index_q refused: %s\n", e.what());
    if (e.code() != ErrorCode::invalid_argument || e.argument() != "index_q" || dw != dw_before) {
      std::printf("consumer_cxx: FAIL: expected invalid_argument naming index_q, outputs untouched\n");
      return 1;
    }
  }
#if DSAIB_CONSUMER_WITH_CUDA
  if (cuda_backend_available()) {
    if (run_cuda_backend(p, ref) != 0) return 1;
    std::printf("consumer_cxx: PASS (cpu and cuda backends)\n");
  } else {
    std::printf("consumer_cxx: PASS (cpu backend; cuda backend compiled in, SKIPPED: no sm_90 GPU here)\n");
  }
#else
  std::printf("consumer_cxx: PASS (cpu backend; package without the cuda backend)\n");
#endif
  return 0;
}
