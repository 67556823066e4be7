// The cuda backend behind src/api/cuda_backend.hpp: builds the kernel params
// from a validated problem, zeroes the fp32 dK accumulator, launches the fused
// kernel and, for a bf16 d_index_k, the final cast. No host synchronisation.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <string>

#include "api/cuda_backend.hpp"
#include "hopper/cuda_check.hpp"
#include "hopper/fixed_point_dk.hpp"
#include "hopper/l2_hints.hpp"
#include "hopper/l2_policy.cuh"
#include "hopper/launch.hpp"
#include "hopper/start_stagger.hpp"

namespace dsaib::hopper {
namespace {

__global__ void cast_dk_to_bf16(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, int64_t n) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i + 3 < n) {
    const float4 v = *reinterpret_cast<const float4*>(src + i);
    *reinterpret_cast<__nv_bfloat162*>(dst + i) = __floats2bfloat162_rn(v.x, v.y);
    *reinterpret_cast<__nv_bfloat162*>(dst + i + 2) = __floats2bfloat162_rn(v.z, v.w);
  } else {
    for (int64_t j = i; j < n; ++j) dst[j] = __float2bfloat16_rn(src[j]);
  }
}

/// applypriority evict_normal on each of the `lines` 128-byte L2 lines from the
/// 128-byte aligned `first_line` (the lines of the dK accumulator after an
/// L2-hinted kernel; l2_policy.cuh).
__global__ void reset_l2_priority_to_normal(const char* first_line, int64_t lines) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < lines) l2_priority_to_normal(first_line + i * 128);
}

/// Restores the caller's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace

/// Tasks per query row: one per group of up to 64 heads (TileConfig::kHeadTile).
static int64_t head_groups_of(const detail::ProblemGeometry& g) { return (g.heads + 63) / 64; }

/// Tasks of one launch: query rows x head groups (IndexerBackwardParams::num_tasks).
static int64_t num_tasks_of(const detail::ProblemGeometry& g) { return g.num_q_rows * head_groups_of(g); }

IndexerBackwardParams make_kernel_params(const IndexerBackwardInputs& in, const IndexerBackwardOutputs& out,
                                         const IndexerBackwardOptions& opt, const detail::ProblemGeometry& g,
                                         float* dk_accum) {
  const bool thd = g.layout == Layout::thd;
  // Flat-row addressing: BSHD (row / S) * stride0 + (row % S) * stride1; THD row * stride0.
  auto batch_stride = [&](const TensorView& v) { return thd ? int64_t{0} : v.strides[0]; };
  auto row_stride = [&](const TensorView& v) { return thd ? v.strides[0] : v.strides[1]; };
  IndexerBackwardParams p{};
  p.index_q = static_cast<const uint16_t*>(in.index_q.data);
  p.q_batch_stride = batch_stride(in.index_q);
  p.q_row_stride = row_stride(in.index_q);
  p.q_head_stride = in.index_q.strides[thd ? 1 : 2];
  p.weights = in.weights.data;
  p.weights_f32 = in.weights.dtype == DType::f32;
  p.w_batch_stride = batch_stride(in.weights);
  p.w_row_stride = row_stride(in.weights);
  p.index_k = static_cast<const uint16_t*>(in.index_k.data);
  p.k_batch_stride = batch_stride(in.index_k);
  p.k_row_stride = row_stride(in.index_k);
  p.topk_indices = static_cast<const int32_t*>(in.topk_indices.data);
  p.ids_batch_stride = batch_stride(in.topk_indices);
  p.ids_row_stride = row_stride(in.topk_indices);
  p.attn_score = static_cast<const float*>(in.attn_score.data);
  p.attn_score_batch_stride = batch_stride(in.attn_score);
  p.attn_score_row_stride = row_stride(in.attn_score);
  p.index_score = static_cast<const float*>(in.index_score.data);
  p.index_score_batch_stride = batch_stride(in.index_score);
  p.index_score_row_stride = row_stride(in.index_score);
  p.cu_seqlens_q = thd ? static_cast<const int32_t*>(in.cu_seqlens_q.data) : nullptr;
  p.cu_seqlens_k = thd ? static_cast<const int32_t*>(in.cu_seqlens_k.data) : nullptr;
  p.num_q_rows = g.num_q_rows;
  p.q_rows_per_batch = std::max<int64_t>(thd ? g.num_q_rows : g.s_q, 1);
  p.num_k_rows = g.num_k_rows;
  p.k_rows_per_batch = std::max<int64_t>(thd ? g.num_k_rows : g.s_kv, 1);
  p.batch = static_cast<int32_t>(g.batch);
  p.heads = static_cast<int32_t>(g.heads);
  p.head_dim = static_cast<int32_t>(g.head_dim);
  p.topk = static_cast<int32_t>(g.topk);
  p.head_groups = static_cast<int32_t>(head_groups_of(g));
  p.num_tasks = num_tasks_of(g);
  p.thd = thd;
  p.global_ids = g.id_mode == IdMode::global;
  p.sm_scale = opt.sm_scale;
  p.loss_coeff_over_n = static_cast<float>(static_cast<double>(opt.loss_coeff) / static_cast<double>(g.normalization_count));
  p.grad_loss_ptr = opt.grad_loss_device;
  p.grad_loss_value = opt.grad_loss;
  p.d_index_q = out.d_index_q.data;
  p.d_weights = out.d_weights.data;
  p.dq_f32 = out.d_index_q.dtype == DType::f32;
  p.dw_f32 = out.d_weights.dtype == DType::f32;
  p.dk_accum = dk_accum;
  return p;
}

namespace {
std::atomic<uint64_t> l2_hinted_launch_count{0};
std::atomic<int32_t> l2_last_keep_fraction_value{0};
}  // namespace

uint64_t l2_hinted_launches() { return l2_hinted_launch_count.load(std::memory_order_relaxed); }
L2KeepFraction l2_last_keep_fraction() {
  return static_cast<L2KeepFraction>(l2_last_keep_fraction_value.load(std::memory_order_relaxed));
}

}  // namespace dsaib::hopper

namespace dsaib::detail {
using hopper::cuda_check;

bool cuda_backend_compiled() { return true; }

bool cuda_device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  for (int d = 0; d < count; ++d) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) == cudaSuccess && major == 9) return true;
  }
  return false;
}

void cuda_copy_to_host(void* dst, const void* src, std::size_t row_bytes, std::size_t src_pitch, std::size_t rows,
                       void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (rows == 1) {
    cuda_check(cudaMemcpyAsync(dst, src, row_bytes, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync (validation read)");
  } else if (rows > 1) {
    cuda_check(cudaMemcpy2DAsync(dst, row_bytes, src, src_pitch, row_bytes, rows, cudaMemcpyDeviceToHost, s),
               "cudaMemcpy2DAsync (validation read)");
  }
  cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize (validation read)");
}

std::size_t cuda_workspace_size(const IndexerBackwardOutputs& out, const IndexerBackwardOptions& opt,
                                const ProblemGeometry& g) {
  if (opt.deterministic) return hopper::dk_fixed_workspace_bytes(g.num_k_rows, g.head_dim);
  return out.d_index_k.dtype == DType::bf16 ? static_cast<std::size_t>(g.num_k_rows * g.head_dim) * sizeof(float) : 0;
}

/// Whether the a operand runs as two bf16 terms (IndexerBackwardOptions::a_operand_precision).
static bool a_operand_split(AOperandPrecision precision, const IndexerBackwardOutputs& out) {
  switch (precision) {
    case AOperandPrecision::bf16x2: return true;
    case AOperandPrecision::bf16: return false;
    case AOperandPrecision::automatic: break;
  }
  return out.d_index_q.dtype == DType::f32 || out.d_index_k.dtype == DType::f32;
}

/// The context's L2 set-aside for persisting lines (cudaLimitPersistingL2CacheSize),
/// read per call: the application may change it between calls (a CUDA graph
/// keeps the choice made at capture). It only tunes a cache hint, so a failed
/// query counts as no set-aside (its error cleared) instead of failing the call.
static int64_t l2_set_aside_bytes() {
  size_t set_aside = 0;
  if (cudaDeviceGetLimit(&set_aside, cudaLimitPersistingL2CacheSize) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return static_cast<int64_t>(set_aside);
}

/// The L2 side of a launch (l2_hints.hpp): whether it takes the hinted kernel and,
/// if so, its evict_last share.
struct L2Plan {
  bool keep_dk = false;
  hopper::L2KeepFraction fraction = hopper::L2KeepFraction::f035;
};

/// l2_hints.hpp's decisions for this launch, on this device's SM count and L2 size
/// and the context's set-aside, each queried once. The split-A kernels have no
/// hinted variant (launch.hpp).
static L2Plan l2_plan_for_launch(hopper::L2Hints mode, const ProblemGeometry& g, int64_t head_groups, bool split_a) {
  if (split_a || mode == hopper::L2Hints::off) return {};
  int device = 0, sms = 0, l2_bytes = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)");
  if (mode == hopper::L2Hints::automatic) {
    cuda_check(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device),
               "cudaDeviceGetAttribute(cudaDevAttrL2CacheSize)");
  }
  const int64_t set_aside = l2_set_aside_bytes();
  if (!hopper::l2_hints_for_launch(mode, g.q_len, g.k_len, head_groups, sms, l2_bytes, g.head_dim, set_aside)) return {};
  const int64_t key_rows =
      hopper::key_rows_for_launch(g.q_len, g.k_len, head_groups, sms, hopper::WindowStart::first_row);
  return {true, hopper::l2_keep_fraction(set_aside, key_rows, g.head_dim)};
}

/// One of the ten fused kernels, as a type: head dim, split a operand, L2 hint,
/// fixed-point (deterministic) dK.
template <int kD, bool kSplit, bool kL2, bool kFixed = false>
struct KernelChoice {
  static constexpr int kHeadDim = kD;
  static constexpr bool kSplitA = kSplit, kL2KeepDk = kL2, kFixedPointDk = kFixed;
};

/// Calls f(KernelChoice<...>{}) for the kernel that serves head_dim, split_a,
/// l2_keep_dk and fixed_point_dk (which excludes the L2 hint: run_cuda_backend).
template <class F>
static void with_kernel_choice(int64_t head_dim, bool split_a, bool l2_keep_dk, bool fixed_point_dk, F&& f) {
  if (head_dim == 64) {
    if (fixed_point_dk) split_a ? f(KernelChoice<64, true, false, true>{}) : f(KernelChoice<64, false, false, true>{});
    else if (split_a) f(KernelChoice<64, true, false>{});
    else if (l2_keep_dk) f(KernelChoice<64, false, true>{});
    else f(KernelChoice<64, false, false>{});
  } else {
    if (fixed_point_dk) split_a ? f(KernelChoice<128, true, false, true>{}) : f(KernelChoice<128, false, false, true>{});
    else if (split_a) f(KernelChoice<128, true, false>{});
    else if (l2_keep_dk) f(KernelChoice<128, false, true>{});
    else f(KernelChoice<128, false, false>{});
  }
}

/// Launches the fused kernel that with_kernel_choice picks for these flags.
static void launch_fused_kernel(int64_t head_dim, bool split_a, bool l2_keep_dk, bool fixed_point_dk,
                                const hopper::IndexerBackwardParams& params, int64_t grid, cudaStream_t stream) {
  with_kernel_choice(head_dim, split_a, l2_keep_dk, fixed_point_dk, [&](auto k) {
    using K = decltype(k);
    hopper::launch_indexer_backward<K::kHeadDim, K::kSplitA, K::kL2KeepDk, K::kFixedPointDk>(params, grid, stream);
  });
}

/// The deterministic path (options.deterministic; fixed_point_dk.cuh): the bound
/// pass, the fixed-point fused kernel, the finish kernel writing d_index_k. Its
/// workspace (the int64 accumulator and the bound) is the caller's or
/// stream-ordered memory of its own. `grid` and `stagger` as run_cuda_backend
/// planned them for that kernel.
static void run_fixed_point_dk(const IndexerBackwardInputs& in, const IndexerBackwardOutputs& out,
                               const IndexerBackwardOptions& opt, const ProblemGeometry& g, int64_t grid,
                               const hopper::StartStagger& stagger, bool split_a, void* workspace,
                               std::size_t workspace_bytes, cudaStream_t stream) {
  const std::size_t bytes = hopper::dk_fixed_workspace_bytes(g.num_k_rows, g.head_dim);
  char* base = static_cast<char*>(workspace);
  const bool owns_workspace = !(workspace != nullptr && workspace_bytes >= bytes);
  if (owns_workspace) {
    void* ws = nullptr;
    cuda_check(cudaMallocAsync(&ws, bytes, stream), "cudaMallocAsync (deterministic dK accumulator)");
    base = static_cast<char*>(ws);
  }
  auto* dk_fixed = reinterpret_cast<unsigned long long*>(base);
  auto* bound = reinterpret_cast<hopper::DkFixedBound*>(base + hopper::dk_fixed_bound_offset(g.num_k_rows, g.head_dim));
  const int64_t n = g.num_k_rows * g.head_dim;
  hopper::IndexerBackwardParams params = hopper::make_kernel_params(in, out, opt, g, nullptr);
  params.start_stagger_max_ns = stagger.max_ns;
  params.start_stagger_first_delayed_cta = stagger.first_delayed_cta;
  params.dk_fixed = dk_fixed;
  params.dk_bound = bound;
  hopper::launch_dk_fixed_bound(params, dk_fixed, n, bound, stream);
  launch_fused_kernel(g.head_dim, split_a, false, true, params, grid, stream);
  hopper::launch_dk_fixed_finish(dk_fixed, bound, g.num_q_rows, out.d_index_k.data,
                                 out.d_index_k.dtype == DType::bf16, n, stream);
  if (owns_workspace) cuda_check(cudaFreeAsync(base, stream), "cudaFreeAsync (deterministic dK accumulator)");
}

void run_cuda_backend(const IndexerBackwardInputs& in, const IndexerBackwardOutputs& out,
                      const IndexerBackwardOptions& opt, const ProblemGeometry& g, void* workspace,
                      std::size_t workspace_bytes) {
  // Remaining cuda-only limits, checked before anything is written (cu_seqlens'
  // stride 1: validate_problem, before it copies them).
  if (g.num_k_rows > std::numeric_limits<int32_t>::max() || g.topk > std::numeric_limits<int32_t>::max()) {
    throw Error(ErrorCode::invalid_argument, "index_k",
                "index_k: expected fewer than 2^31 key rows on the cuda backend, got " + std::to_string(g.num_k_rows));
  }
  const hopper::L2Hints l2_mode = hopper::l2_hints_from_env();  // throws on a bad value, before any write
  const bool stagger_on = hopper::start_stagger_enabled_from_env();  // likewise
  hopper::DeviceGuard guard(in.index_q.device_index);
  // Which kernel and its grid: decided (device queries included) before anything is
  // allocated or written.
  const bool split_a = a_operand_split(opt.a_operand_precision, out);
  const int64_t head_groups = hopper::head_groups_of(g);
  // Deterministic: the fixed-point dK kernels (fixed_point_dk.cuh), which have no L2 hint.
  const bool fixed_point_dk = opt.deterministic;
  const L2Plan l2 = fixed_point_dk ? L2Plan{} : l2_plan_for_launch(l2_mode, g, head_groups, split_a);
  const bool l2_keep_dk = l2.keep_dk;
  // The persistent grid (occupancy query) and the start delays for it (start_stagger.hpp, v44).
  const int64_t num_tasks = hopper::num_tasks_of(g);
  int64_t grid = 0;
  with_kernel_choice(g.head_dim, split_a, l2_keep_dk, fixed_point_dk, [&](auto k) {
    using K = decltype(k);
    grid = hopper::indexer_backward_grid<K::kHeadDim, K::kSplitA, K::kL2KeepDk, K::kFixedPointDk>(num_tasks);
  });
  const hopper::StartStagger stagger =
      stagger_on ? hopper::start_stagger_for_launch(num_tasks, grid, head_groups, g.topk, g.q_len,
                                                    g.k_len, g.head_dim)
                 : hopper::StartStagger{};
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  if (fixed_point_dk) {
    run_fixed_point_dk(in, out, opt, g, grid, stagger, split_a, workspace, workspace_bytes, stream);
    return;
  }
  const std::size_t dk_bytes = static_cast<std::size_t>(g.num_k_rows * g.head_dim) * sizeof(float);
  const bool dk_bf16 = out.d_index_k.dtype == DType::bf16;
  float* dk_accum = static_cast<float*>(out.d_index_k.data);
  bool owns_workspace = false;
  if (dk_bf16) {
    if (workspace != nullptr && workspace_bytes >= dk_bytes) {
      dk_accum = static_cast<float*>(workspace);
    } else if (dk_bytes > 0) {
      void* ws = nullptr;
      cuda_check(cudaMallocAsync(&ws, dk_bytes, stream), "cudaMallocAsync (dK accumulator)");
      dk_accum = static_cast<float*>(ws);
      owns_workspace = true;
    }
  }
  (void)workspace_bytes;
  hopper::IndexerBackwardParams params = hopper::make_kernel_params(in, out, opt, g, dk_accum);
  params.start_stagger_max_ns = stagger.max_ns;
  params.start_stagger_first_delayed_cta = stagger.first_delayed_cta;
  params.l2_keep_fraction = static_cast<int32_t>(l2.fraction);
  if (dk_bytes > 0) cuda_check(cudaMemsetAsync(dk_accum, 0, dk_bytes, stream), "cudaMemsetAsync (dK accumulator)");
  launch_fused_kernel(g.head_dim, split_a, l2_keep_dk, false, params, grid, stream);
  if (l2_keep_dk && dk_bytes > 0) {
    // No evict_last line of the accumulator outlives the call (l2_policy.cuh). Every
    // 128-byte line that holds a byte of it (an fp32 d_index_k need not be 128-byte aligned).
    const uintptr_t begin = reinterpret_cast<uintptr_t>(dk_accum) & ~uintptr_t{127};
    const uintptr_t end = reinterpret_cast<uintptr_t>(dk_accum) + dk_bytes;
    const int64_t lines = static_cast<int64_t>((end - begin + 127) / 128), threads = 256;
    hopper::reset_l2_priority_to_normal<<<static_cast<unsigned>((lines + threads - 1) / threads), threads, 0, stream>>>(
        reinterpret_cast<const char*>(begin), lines);
    hopper::cuda_check_launch("reset_l2_priority_to_normal");
    hopper::l2_hinted_launch_count.fetch_add(1, std::memory_order_relaxed);
    hopper::l2_last_keep_fraction_value.store(params.l2_keep_fraction, std::memory_order_relaxed);  // what the kernel got
  }
  if (dk_bf16 && dk_bytes > 0) {
    const int64_t n = g.num_k_rows * g.head_dim;
    const int64_t threads = 256, per_block = threads * 4;
    hopper::cast_dk_to_bf16<<<static_cast<unsigned>((n + per_block - 1) / per_block), threads, 0, stream>>>(
        dk_accum, static_cast<__nv_bfloat16*>(out.d_index_k.data), n);
    hopper::cuda_check_launch("cast_dk_to_bf16");
  }
  if (owns_workspace) cuda_check(cudaFreeAsync(dk_accum, stream), "cudaFreeAsync (dK accumulator)");
}

}  // namespace dsaib::detail
