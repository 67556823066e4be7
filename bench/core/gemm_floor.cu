// dsaib_bench: the GEMM floors, each checked before it is timed: a few output entries against
// a host dot product of the same data.
//   - cuBLAS bf16 GEMM rate (cublasGemmEx, bf16 in/out, fp32 compute), square, by operand layout;
//   - cuBLAS bf16 GEMM rate at a given shape, batched (the attention target's per-row GEMM,
//     Hq x topk x Dqk);
//   - cuBLASLt float8 e4m3 GEMM rate (TN, the layout Hopper's fp8 GEMMs take; fp32 compute,
//     bf16 out).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "bench_core.hpp"
#include "bench_hash.cuh"
#include "core/bf16.hpp"
#include "cuda_check.hpp"

namespace dsaib::bench {
namespace {

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw Error(ErrorCode::cuda_error, "bench",
                std::string(what) + " failed: " + cublasGetStatusName(s) + " (" + cublasGetStatusString(s) + ")");
  }
}

float host_e4m3_round(float f) { return static_cast<float>(__nv_fp8_e4m3(f)); }

/// f rounded to bf16 (to nearest even, as __float2bfloat16_rn), as a float.
float host_bf16_round(float f) { return detail::bf16_to_float(detail::float_to_bf16(f)); }

// The salts of the operands A and B that fill_device_bf16 / fill_device_e4m3 fill.
constexpr uint32_t kSaltA = 0xA11CEu, kSaltB = 0xB0Bu;

/// Checks one bf16 entry of a GEMM's output (at device address `got_at`) against a host
/// dot product of x(kk) y(kk) over kk < k (the operands as the GEMM read them): clears
/// g.check_ok unless the relative error is <= 1e-2 of max(|dot|, the norm of its terms),
/// and raises g.max_rel_err.
template <class X, class Y>
void check_gemm_entry(GemmResult& g, int k, const __nv_bfloat16* got_at, X&& x, Y&& y) {
  double ref = 0, scale = 0;
  for (int kk = 0; kk < k; ++kk) {
    const double t = static_cast<double>(x(kk)) * static_cast<double>(y(kk));
    ref += t;
    scale += t * t;
  }
  uint16_t got_bits = 0;
  check_cuda(cudaMemcpy(&got_bits, got_at, 2, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  const double got = detail::bf16_to_float(got_bits);
  const double rel = std::fabs(got - ref) / std::max(std::fabs(ref), std::sqrt(scale));
  g.max_rel_err = std::max(g.max_rel_err, rel);
  if (!(rel <= 1e-2)) g.check_ok = false;
}

/// Entry p (0..7) of a GEMM check: hashed indices below rows and cols.
int hashed_row(int p, int rows) { return static_cast<int>(mix32(17u * p + 1u) % static_cast<uint32_t>(rows)); }
int hashed_col(int p, int cols) { return static_cast<int>(mix32(31u * p + 7u) % static_cast<uint32_t>(cols)); }

/// The GEMM floors' check: one launch of gemm(), then check(p) for the 8 hashed
/// entries p; g.check_ok starts true and each check_gemm_entry may clear it.
template <class Gemm, class Check>
void launch_and_check(GemmResult& g, Timer& timer, Gemm&& gemm, const char* what, Check&& check) {
  gemm();
  check_cuda(cudaStreamSynchronize(timer.stream), what);
  g.check_ok = true;
  for (int p = 0; p < 8; ++p) check(p);
}

/// The GEMM floors' timing after their check: `warmup` untimed launches of gemm(), then
/// `iters` timed ones; g.t and g.tflops (`flop` per launch).
template <class Gemm>
void time_gemm(GemmResult& g, Timer& timer, Gemm&& gemm, double flop, int iters, int warmup, const char* what) {
  for (int i = 0; i < warmup; ++i) gemm();
  check_cuda(cudaStreamSynchronize(timer.stream), what);
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) ms.push_back(timer.time(gemm));
  g.t = stats_of(ms);
  g.tflops = flop / (g.t.median_ms * 1e-3) / 1e12;
}

/// A cuBLAS handle on a stream, with its workspace; destroyed on scope exit.
struct Cublas {
  cublasHandle_t h = nullptr;
  DeviceBuffer ws{64ull << 20};
  explicit Cublas(cudaStream_t s) {
    check_cublas(cublasCreate(&h), "cublasCreate");
    check_cublas(cublasSetStream(h, s), "cublasSetStream");
    check_cublas(cublasSetWorkspace(h, ws.ptr, ws.bytes), "cublasSetWorkspace");
  }
  Cublas(const Cublas&) = delete;
  Cublas& operator=(const Cublas&) = delete;
  ~Cublas() {
    if (h) cublasDestroy(h);
  }
};
}  // namespace

GemmResult measure_gemm(int size, int iters, int warmup, GemmLayout layout) {
  if (size < 64 || iters < 1 || warmup < 0) {
    throw Error(ErrorCode::invalid_argument, "gemm", "GEMM size >= 64, iters >= 1, warmup >= 0");
  }
  const int n = size;
  GemmResult g;
  g.m = g.n = g.k = n;
  g.layout = layout;
  const size_t elems = static_cast<size_t>(n) * n;
  DeviceBuffer A(elems * 2), B(elems * 2), C(elems * 2);
  Timer timer;
  fill_device_bf16(A.ptr, elems, kSaltA, timer.stream);
  fill_device_bf16(B.ptr, elems, kSaltB, timer.stream);
  Cublas blas(timer.stream);
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major C (n x n) = op(A) op(B), every leading dimension n. op T: A stored (k x m),
  // B stored (n x k); op N: A stored (m x k), B stored (k x n).
  const bool ta = layout == GemmLayout::tn || layout == GemmLayout::tt;
  const bool tb = layout == GemmLayout::nt || layout == GemmLayout::tt;
  auto gemm = [&]() {
    check_cublas(cublasGemmEx(blas.h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, n, n, n, &alpha,
                              A.ptr, CUDA_R_16BF, n, B.ptr, CUDA_R_16BF, n, &beta, C.ptr, CUDA_R_16BF, n,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  };
  // Element (i, kk) of op(A) and (kk, j) of op(B) in their storage.
  auto a_at = [&](int i, int kk) { return ta ? static_cast<uint64_t>(i) * n + kk : static_cast<uint64_t>(kk) * n + i; };
  auto b_at = [&](int kk, int j) { return tb ? static_cast<uint64_t>(kk) * n + j : static_cast<uint64_t>(j) * n + kk; };
  // Check a few entries against a host dot product of the same (bf16-rounded) data.
  launch_and_check(g, timer, gemm, "GEMM check launch", [&](int p) {
    const int i = hashed_row(p, n), j = hashed_col(p, n);
    check_gemm_entry(g, n, C.as<__nv_bfloat16>() + static_cast<size_t>(j) * n + i,
                     [&](int kk) { return host_bf16_round(gemm_value(a_at(i, kk), kSaltA)); },
                     [&](int kk) { return host_bf16_round(gemm_value(b_at(kk, j), kSaltB)); });
  });
  time_gemm(g, timer, gemm, 2.0 * n * static_cast<double>(n) * n, iters, warmup, "GEMM warm-up");
  return g;
}

/// A cuBLASLt handle and the descriptors of one fp8 GEMM; destroyed on scope exit.
struct CublasLtE4m3 {
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  CublasLtE4m3() = default;
  CublasLtE4m3(const CublasLtE4m3&) = delete;
  CublasLtE4m3& operator=(const CublasLtE4m3&) = delete;
  ~CublasLtE4m3() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
    if (h) cublasLtDestroy(h);
  }
};

GemmResult measure_gemm_e4m3(int size, int iters, int warmup) {
  if (size < 64 || size % 16 != 0 || iters < 1 || warmup < 0) {
    throw Error(ErrorCode::invalid_argument, "gemm", "e4m3 GEMM size >= 64 and a multiple of 16, iters >= 1, warmup >= 0");
  }
  const int n = size;
  GemmResult g;
  g.m = g.n = g.k = n;
  g.layout = GemmLayout::tn;
  g.e4m3 = true;
  const size_t elems = static_cast<size_t>(n) * n;
  DeviceBuffer A(elems), B(elems), C(elems * 2);
  Timer timer;
  fill_device_e4m3(A.ptr, elems, kSaltA, timer.stream);
  fill_device_e4m3(B.ptr, elems, kSaltB, timer.stream);
  // Column-major C (n x n, bf16) = A^T B: A stored (k x m), B stored (k x n), every
  // leading dimension n; no scales (1).
  CublasLtE4m3 lt;
  check_cublas(cublasLtCreate(&lt.h), "cublasLtCreate");
  check_cublas(cublasLtMatmulDescCreate(&lt.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  check_cublas(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t), "TRANSA");
  check_cublas(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn), "TRANSB");
  check_cublas(cublasLtMatrixLayoutCreate(&lt.a, CUDA_R_8F_E4M3, n, n, n), "cublasLtMatrixLayoutCreate (A)");
  check_cublas(cublasLtMatrixLayoutCreate(&lt.b, CUDA_R_8F_E4M3, n, n, n), "cublasLtMatrixLayoutCreate (B)");
  check_cublas(cublasLtMatrixLayoutCreate(&lt.c, CUDA_R_16BF, n, n, n), "cublasLtMatrixLayoutCreate (C)");
  DeviceBuffer ws(64ull << 20);
  cublasLtMatmulPreference_t pref = nullptr;
  check_cublas(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const size_t ws_bytes = ws.bytes;
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                           sizeof ws_bytes);
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(lt.h, lt.op, lt.a, lt.b, lt.c, lt.c, pref, 1, &heuristic, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  check_cublas(st, "cublasLtMatmulAlgoGetHeuristic");
  if (found < 1) throw Error(ErrorCode::internal, "gemm", "cuBLASLt offers no e4m3 GEMM for this device");
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&]() {
    check_cublas(cublasLtMatmul(lt.h, lt.op, &alpha, A.ptr, lt.a, B.ptr, lt.b, &beta, C.ptr, lt.c, C.ptr, lt.c,
                                &heuristic.algo, ws.ptr, ws.bytes, timer.stream),
                 "cublasLtMatmul");
  };
  launch_and_check(g, timer, gemm, "GEMM check launch", [&](int p) {
    const int i = hashed_row(p, n), j = hashed_col(p, n);
    check_gemm_entry(g, n, C.as<__nv_bfloat16>() + static_cast<size_t>(j) * n + i,
                     [&](int kk) { return host_e4m3_round(gemm_value(static_cast<uint64_t>(i) * n + kk, kSaltA)); },
                     [&](int kk) { return host_e4m3_round(gemm_value(static_cast<uint64_t>(j) * n + kk, kSaltB)); });
  });
  time_gemm(g, timer, gemm, 2.0 * n * static_cast<double>(n) * n, iters, warmup, "GEMM warm-up");
  return g;
}

std::vector<GemmResult> measure_gemm_layouts(int size, int iters, int warmup) {
  std::vector<GemmResult> out;
  for (GemmLayout l : kAllGemmLayouts) out.push_back(measure_gemm(size, iters, warmup, l));
  return out;
}

const GemmResult& fastest(const std::vector<GemmResult>& results) {
  const GemmResult* best = nullptr;
  for (const GemmResult& r : results) {
    if (r.check_ok && (!best || r.tflops > best->tflops)) best = &r;
  }
  if (!best) throw Error(ErrorCode::internal, "bench", "GEMM: no layout passed its check");
  return *best;
}

const char* gemm_layout_name(GemmLayout l) {
  switch (l) {
    case GemmLayout::tn: return "TN";
    case GemmLayout::nn: return "NN";
    case GemmLayout::nt: return "NT";
    case GemmLayout::tt: return "TT";
  }
  return "?";
}

GemmResult measure_gemm_batched(int m, int n, int k, int batch, int iters, int warmup) {
  if (m < 1 || n < 1 || k < 1 || batch < 1 || iters < 1 || warmup < 0) {
    throw Error(ErrorCode::invalid_argument, "gemm", "batched GEMM: m, n, k, batch >= 1, iters >= 1, warmup >= 0");
  }
  GemmResult g;
  g.m = m, g.n = n, g.k = k, g.batch = batch;
  // Per entry b: C_b (n x m, column-major: m columns of n) = B^T A_b with B (n keys x k)
  // shared by every entry and A_b (m heads x k) its own: "TN" with the keys as cuBLAS's M.
  const size_t a_elems = static_cast<size_t>(m) * k * batch, b_elems = static_cast<size_t>(n) * k;
  const size_t c_elems = static_cast<size_t>(m) * n * batch;
  DeviceBuffer A(a_elems * 2), B(b_elems * 2), C(c_elems * 2);
  Timer timer;
  fill_device_bf16(A.ptr, a_elems, kSaltA, timer.stream);
  fill_device_bf16(B.ptr, b_elems, kSaltB, timer.stream);
  Cublas blas(timer.stream);
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&]() {
    check_cublas(cublasGemmStridedBatchedEx(blas.h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, B.ptr, CUDA_R_16BF, k, 0,
                                            A.ptr, CUDA_R_16BF, k, static_cast<long long>(m) * k, &beta, C.ptr,
                                            CUDA_R_16BF, n, static_cast<long long>(m) * n, batch, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT),
                 "cublasGemmStridedBatchedEx");
  };
  launch_and_check(g, timer, gemm, "batched GEMM check launch", [&](int p) {
    const int key = hashed_row(p, n), head = hashed_col(p, m);
    const int b = p % 2 == 0 ? 0 : batch - 1;
    check_gemm_entry(g, k, C.as<__nv_bfloat16>() + (static_cast<size_t>(b) * m + head) * n + key,
                     [&](int kk) { return host_bf16_round(gemm_value((static_cast<uint64_t>(b) * m + head) * k + kk, kSaltA)); },
                     [&](int kk) { return host_bf16_round(gemm_value(static_cast<uint64_t>(key) * k + kk, kSaltB)); });
  });
  time_gemm(g, timer, gemm, 2.0 * m * static_cast<double>(n) * k * batch, iters, warmup, "batched GEMM warm-up");
  return g;
}

}  // namespace dsaib::bench
