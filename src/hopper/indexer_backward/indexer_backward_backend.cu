// The cuda backend behind src/api/cuda_backend.hpp: queries the device, plans
// the launch (launch_plan.hpp), builds the kernel params from a validated
// problem, zeroes the fp32 dK accumulator, launches one of the ten fused kernels
// and, for a bf16 d_index_k, the final cast. No host synchronisation.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "api/cuda_backend.hpp"
#include "api/cuda_kl_forward.hpp"
#include "hopper/common/cuda_check.hpp"
#include "hopper/common/device_cu_seqlens.hpp"
#include "hopper/indexer_backward/fixed_point_dk.hpp"
#include "hopper/indexer_backward/l2_policy.cuh"
#include "hopper/indexer_backward/launch.hpp"
#include "hopper/launch/launch_plan.hpp"
#include "hopper/loss_and_grad/loss_and_grad_kernel.cuh"
#include "hopper/common/tile_config.cuh"

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

/// THD cu_seqlens checked on the device (a call captured in a CUDA graph, where a
/// host copy is not allowed): the rules of validation (starting at 0,
/// non-decreasing, ending at T_q / T_k) over both arrays of n = B + 1 values.
/// Writes copies that the kernels read instead: the arrays themselves when
/// they are valid; else [0, ..., 0, T] (every row in the last sequence, every
/// key row in range), so that no kernel reads out of bounds, and *bad = 1.
__global__ void check_cu_seqlens_on_device(const int32_t* cu_q, const int32_t* cu_k, int64_t n, int64_t t_q,
                                           int64_t t_k, int32_t* copy_q, int32_t* copy_k, int32_t* bad) {
  __shared__ int any_bad;
  if (threadIdx.x == 0) any_bad = 0;
  __syncthreads();
  int mine = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t q = cu_q[i], k = cu_k[i];
    if (i == 0 && (q != 0 || k != 0)) mine = 1;
    if (i > 0 && (q < cu_q[i - 1] || k < cu_k[i - 1])) mine = 1;
    if (i == n - 1 && (q != t_q || k != t_k)) mine = 1;
  }
  if (mine) atomicOr(&any_bad, 1);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    copy_q[i] = any_bad ? (i == n - 1 ? static_cast<int32_t>(t_q) : 0) : cu_q[i];
    copy_k[i] = any_bad ? (i == n - 1 ? static_cast<int32_t>(t_k) : 0) : cu_k[i];
  }
  if (threadIdx.x == 0) *bad = any_bad;
}

/// NaN into every element of an output when *bad is set (check_cu_seqlens_on_device).
__global__ void poison_output_if_bad(const int32_t* bad, void* data, int64_t n, bool bf16) {
  if (*bad == 0) return;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (bf16) static_cast<uint16_t*>(data)[i] = 0x7fc0;
    else static_cast<float*>(data)[i] = __int_as_float(0x7fc00000);
  }
}

/// The P-free kernels' row statistics: (row_lse, row_target_mass) of flat row i
/// as out[i] (kernel_params.hpp), read through the tensors' strides.
__global__ void pack_row_statistics(const float* lse, int64_t lse_batch_stride, int64_t lse_row_stride,
                                    const float* mass, int64_t mass_batch_stride, int64_t mass_row_stride,
                                    int64_t rows_per_batch, int64_t n, float2* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / rows_per_batch, t = i % rows_per_batch;
    out[i] = make_float2(lse[b * lse_batch_stride + t * lse_row_stride], mass[b * mass_batch_stride + t * mass_row_stride]);
  }
}

}  // namespace

/// The loss forward's fixed-order sum of the row terms (forward_backend.cu).
void launch_sum_loss_terms(const double* terms, int64_t rows, double coeff_over_n, float* loss, cudaStream_t stream);

static_assert(TileConfig<64, false>::kHeadTile == kHeadsPerTask && TileConfig<128, true>::kHeadTile == kHeadsPerTask,
              "the launch plan's tasks are the kernels' head tiles");

IndexerParams make_kernel_params(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                         const IndexerOptions& opt, const detail::ProblemGeometry& g,
                                         float* dk_accum) {
  const bool thd = g.layout == Layout::thd;
  // Flat-row addressing: BSHD (row / S) * stride0 + (row % S) * stride1; THD row * stride0.
  auto batch_stride = [&](const TensorView& v) { return thd ? int64_t{0} : v.strides[0]; };
  auto row_stride = [&](const TensorView& v) { return thd ? v.strides[0] : v.strides[1]; };
  IndexerParams p{};
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
  const int64_t head_groups = (g.heads + kHeadsPerTask - 1) / kHeadsPerTask;  // LaunchPlan::head_groups
  p.head_groups = static_cast<int32_t>(head_groups);
  p.num_tasks = g.num_q_rows * head_groups;
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

}  // namespace dsaib::hopper

namespace dsaib::detail {
using hopper::cuda_check;

bool cuda_backend_compiled() { return true; }

bool cuda_stream_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

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

/// The current device's properties for a plan (launch_plan.hpp), with the
/// occupancy of the fused kernel for `head_dim` and `split_a`.
static hopper::DeviceProperties query_device_properties(int64_t head_dim, bool split_a) {
  int device = 0, sms = 0, l2_bytes = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)");
  cuda_check(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device),
             "cudaDeviceGetAttribute(cudaDevAttrL2CacheSize)");
  hopper::DeviceProperties d;
  d.sm_count = sms;
  d.l2_bytes = l2_bytes;
  d.persisting_l2_bytes = l2_set_aside_bytes();
  if (head_dim == 64) {
    d.ctas_per_sm = split_a ? hopper::indexer_backward_ctas_per_sm<64, true>()
                            : hopper::indexer_backward_ctas_per_sm<64, false>();
  } else {
    d.ctas_per_sm = split_a ? hopper::indexer_backward_ctas_per_sm<128, true>()
                            : hopper::indexer_backward_ctas_per_sm<128, false>();
  }
  return d;
}

/// The plan of a call on the current device: its properties queried once.
static hopper::LaunchPlan plan_for_current_device(const IndexerBackwardOutputs& out, const IndexerOptions& opt,
                                                  const ProblemGeometry& g) {
  const bool split_a = hopper::a_operand_split(opt.a_operand_precision, out.d_index_q.dtype, out.d_index_k.dtype);
  return hopper::plan_launch(g, out.d_index_q.dtype, out.d_index_k.dtype, opt,
                             query_device_properties(g.head_dim, split_a));
}

hopper::LaunchPlan cuda_launch_plan(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                    const IndexerOptions& opt, const ProblemGeometry& g) {
  hopper::DeviceGuard guard(in.index_q.device_index);
  return plan_for_current_device(out, opt, g);
}

/// One of the ten fused kernels (hopper::BackwardKernel), as a type.
template <int kD, bool kSplit, bool kL2, bool kFixed = false>
struct KernelChoice {
  static constexpr int kHeadDim = kD;
  static constexpr bool kSplitA = kSplit, kL2KeepDk = kL2, kFixedPointDk = kFixed;
};

/// Launches the fused kernel `k` names (l2_keep_dk is never set with split_a or
/// fixed_point_dk: plan_launch).
static void launch_backward_kernel(const hopper::BackwardKernel& k, const hopper::IndexerParams& params,
                                int64_t grid, cudaStream_t stream, bool p_free = false) {
  if (p_free) {  // the P-free kernels (no L2 hint, no fixed-point dK: plan_p_free)
    if (k.head_dim == 64) {
      k.split_a ? hopper::launch_indexer_backward_p_free<64, true>(params, grid, stream)
                : hopper::launch_indexer_backward_p_free<64, false>(params, grid, stream);
    } else {
      k.split_a ? hopper::launch_indexer_backward_p_free<128, true>(params, grid, stream)
                : hopper::launch_indexer_backward_p_free<128, false>(params, grid, stream);
    }
    return;
  }
  const auto launch = [&](auto choice) {
    using K = decltype(choice);
    hopper::launch_indexer_backward<K::kHeadDim, K::kSplitA, K::kL2KeepDk, K::kFixedPointDk>(params, grid, stream);
  };
  if (k.head_dim == 64) {
    if (k.fixed_point_dk) k.split_a ? launch(KernelChoice<64, true, false, true>{}) : launch(KernelChoice<64, false, false, true>{});
    else if (k.split_a) launch(KernelChoice<64, true, false>{});
    else if (k.l2_keep_dk) launch(KernelChoice<64, false, true>{});
    else launch(KernelChoice<64, false, false>{});
  } else {
    if (k.fixed_point_dk) k.split_a ? launch(KernelChoice<128, true, false, true>{}) : launch(KernelChoice<128, false, false, true>{});
    else if (k.split_a) launch(KernelChoice<128, true, false>{});
    else if (k.l2_keep_dk) launch(KernelChoice<128, false, true>{});
    else launch(KernelChoice<128, false, false>{});
  }
}

/// The kernel params of `plan`: make_kernel_params, then the plan's start delays
/// and L2 share.
static hopper::IndexerParams planned_params(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                                    const IndexerOptions& opt, const ProblemGeometry& g,
                                                    const hopper::LaunchPlan& plan, float* dk_accum,
                                                    const float* packed_stats = nullptr) {
  hopper::IndexerParams params = hopper::make_kernel_params(in, out, opt, g, dk_accum);
  if (!in.index_score.present()) {  // the P-free form: packed statistics (pack_row_statistics)
    params.index_score = packed_stats;
    params.index_score_batch_stride = params.index_score_row_stride = 0;
  }
  params.start_stagger_max_ns = plan.start_delays.max_ns;
  params.start_stagger_first_delayed_cta = plan.start_delays.first_delayed_cta;
  params.l2_keep_fraction = static_cast<int32_t>(plan.l2_keep_fraction);
  return params;
}

/// The deterministic path (options.deterministic; fixed_point_dk.cuh): the bound
/// pass, the fixed-point fused kernel, the finish kernel writing d_index_k. Its
/// workspace (the int64 accumulator and the bound) is the caller's or
/// stream-ordered memory of its own.
static void run_fixed_point_dk(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                               const IndexerOptions& opt, const ProblemGeometry& g,
                               const hopper::LaunchPlan& plan, void* workspace, std::size_t workspace_bytes,
                               cudaStream_t stream) {
  const std::size_t bytes = plan.workspace_bytes;
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
  hopper::IndexerParams params = planned_params(in, out, opt, g, plan, nullptr);
  params.dk_fixed = dk_fixed;
  params.dk_bound = bound;
  hopper::launch_dk_fixed_bound(params, dk_fixed, n, bound, stream);
  launch_backward_kernel(plan.kernel, params, plan.grid, stream);
  hopper::launch_dk_fixed_finish(dk_fixed, bound, g.num_q_rows, out.d_index_k.data,
                                 out.d_index_k.dtype == DType::bf16, n, stream);
  if (owns_workspace) cuda_check(cudaFreeAsync(base, stream), "cudaFreeAsync (deterministic dK accumulator)");
}

/// The fused backward of the P form, or of the P-free form when its kernels apply
/// (!p_free_needs_prepass): the plan, the dK accumulator, the kernel, the cast.
static std::size_t packed_stats_bytes(const ProblemGeometry& g) {
  return (static_cast<std::size_t>(g.num_q_rows) * 8 + 255) / 256 * 256;
}

static void run_backward_kernel(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                               const IndexerOptions& options, const ProblemGeometry& g, void* workspace_in,
                               std::size_t workspace_bytes) {
  IndexerOptions opt = options;
  const bool p_free = !in.index_score.present();
  if (p_free) opt.l2_hints = L2Hints::off;  // the P-free kernels have no hinted variant
  // Everything that decides the launch (device queries included, and the cuda-only
  // limits, which raise invalid_argument) comes before anything is allocated or written.
  const hopper::LaunchPlan plan = plan_for_current_device(out, opt, g);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  void* workspace = workspace_in;
  float* packed_stats = nullptr;
  bool owns_packed = false;
  if (p_free) {  // the workspace's first packed_stats_bytes, else memory of its own
    const std::size_t pb = packed_stats_bytes(g);
    if (workspace != nullptr && workspace_bytes >= pb) {
      packed_stats = static_cast<float*>(workspace);
      workspace = static_cast<char*>(workspace) + pb;
      workspace_bytes -= pb;
    } else {
      void* m = nullptr;
      cuda_check(cudaMallocAsync(&m, pb, stream), "cudaMallocAsync (row statistics)");
      packed_stats = static_cast<float*>(m);
      owns_packed = true;
    }
    const bool thd = g.layout == Layout::thd;
    const TensorView& l = in.row_lse;
    const TensorView& m = in.row_target_mass;
    const int64_t n = g.num_q_rows, rpb = std::max<int64_t>(thd ? n : g.s_q, 1);
    if (n > 0) {
      hopper::pack_row_statistics<<<static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 1024)), 256, 0, stream>>>(
          static_cast<const float*>(l.data), thd ? 0 : l.strides[0], thd ? l.strides[0] : l.strides[1],
          static_cast<const float*>(m.data), thd ? 0 : m.strides[0], thd ? m.strides[0] : m.strides[1], rpb, n,
          reinterpret_cast<float2*>(packed_stats));
      hopper::cuda_check_launch("pack_row_statistics");
    }
  }
  if (plan.kernel.fixed_point_dk) {
    run_fixed_point_dk(in, out, opt, g, plan, workspace, workspace_bytes, stream);
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
  const hopper::IndexerParams params = planned_params(in, out, opt, g, plan, dk_accum, packed_stats);
  if (dk_bytes > 0) cuda_check(cudaMemsetAsync(dk_accum, 0, dk_bytes, stream), "cudaMemsetAsync (dK accumulator)");
  launch_backward_kernel(plan.kernel, params, plan.grid, stream, p_free);
  if (plan.kernel.l2_keep_dk && dk_bytes > 0) {
    // No evict_last line of the accumulator outlives the call (l2_policy.cuh). Every
    // 128-byte line that holds a byte of it (an fp32 d_index_k need not be 128-byte aligned).
    const uintptr_t begin = reinterpret_cast<uintptr_t>(dk_accum) & ~uintptr_t{127};
    const uintptr_t end = reinterpret_cast<uintptr_t>(dk_accum) + dk_bytes;
    const int64_t lines = static_cast<int64_t>((end - begin + 127) / 128), threads = 256;
    hopper::reset_l2_priority_to_normal<<<static_cast<unsigned>((lines + threads - 1) / threads), threads, 0, stream>>>(
        reinterpret_cast<const char*>(begin), lines);
    hopper::cuda_check_launch("reset_l2_priority_to_normal");
  }
  if (dk_bf16 && dk_bytes > 0) {
    const int64_t n = g.num_k_rows * g.head_dim;
    const int64_t threads = 256, per_block = threads * 4;
    hopper::cast_dk_to_bf16<<<static_cast<unsigned>((n + per_block - 1) / per_block), threads, 0, stream>>>(
        dk_accum, static_cast<__nv_bfloat16*>(out.d_index_k.data), n);
    hopper::cuda_check_launch("cast_dk_to_bf16");
  }
  if (owns_workspace) cuda_check(cudaFreeAsync(dk_accum, stream), "cudaFreeAsync (dK accumulator)");
  if (owns_packed) cuda_check(cudaFreeAsync(packed_stats, stream), "cudaFreeAsync (row statistics)");
}

namespace {

constexpr std::size_t round256(std::size_t b) { return (b + 255) / 256 * 256; }

/// The pre-pass of the P-free backward (p_free_needs_prepass): where its pieces lie.
struct PrepassLayout {
  std::size_t p, lse, mass, loss, forward, total;
  PrepassLayout(const ProblemGeometry& g, int device) {
    p = round256(static_cast<std::size_t>(g.num_q_rows * g.topk) * 4);
    lse = mass = round256(static_cast<std::size_t>(g.num_q_rows) * 4);
    loss = 256;
    forward = round256(cuda_kl_forward_workspace_size(g, device));
    total = p + lse + mass + loss + forward;
  }
};

TensorView rows_view(void* data, const ProblemGeometry& g, int device, std::initializer_list<int64_t> extra = {}) {
  std::vector<int64_t> shape;
  if (g.layout == Layout::thd) shape = {g.num_q_rows};
  else shape = {g.batch, g.s_q};
  shape.insert(shape.end(), extra.begin(), extra.end());
  return contiguous_view(data, DType::f32, shape.data(), static_cast<int32_t>(shape.size()), DeviceType::cuda, device);
}

}  // namespace

IndexerInputs check_device_cu_seqlens(const IndexerInputs& in, const ProblemGeometry& g,
                                              cudaStream_t stream, int32_t** buffer) {
  const int64_t n = in.cu_seqlens_q.shape[0];
  void* p = nullptr;
  cuda_check(cudaMallocAsync(&p, static_cast<std::size_t>(2 * n + 1) * sizeof(int32_t), stream),
             "cudaMallocAsync (cu_seqlens check)");
  *buffer = static_cast<int32_t*>(p);
  hopper::check_cu_seqlens_on_device<<<1, 256, 0, stream>>>(
      static_cast<const int32_t*>(in.cu_seqlens_q.data), static_cast<const int32_t*>(in.cu_seqlens_k.data), n,
      g.num_q_rows, g.num_k_rows, *buffer, *buffer + n, *buffer + 2 * n);
  hopper::cuda_check_launch("check_cu_seqlens_on_device");
  IndexerInputs checked = in;
  checked.cu_seqlens_q.data = *buffer;
  checked.cu_seqlens_k.data = *buffer + n;
  return checked;
}

void finish_device_cu_seqlens(int32_t* buffer, int64_t n, std::initializer_list<const TensorView*> outputs,
                              cudaStream_t stream) {
  for (const TensorView* v : outputs) {
    if (!v->present() || v->numel() == 0) continue;
    hopper::poison_output_if_bad<<<132, 256, 0, stream>>>(buffer + 2 * n, v->data, v->numel(), v->dtype == DType::bf16);
    hopper::cuda_check_launch("poison_output_if_bad");
  }
  cuda_check(cudaFreeAsync(buffer, stream), "cudaFreeAsync (cu_seqlens check)");
}

std::size_t cuda_backward_workspace_bytes(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                          const IndexerOptions& opt, const ProblemGeometry& g) {
  const std::size_t base = hopper::workspace_bytes(g, out.d_index_k.dtype, opt.deterministic);
  if (!in.index_score.present() && !p_free_needs_prepass(in, g, opt)) return packed_stats_bytes(g) + base;
  if (!p_free_needs_prepass(in, g, opt)) return base;
  hopper::DeviceGuard guard(in.index_q.device_index);
  return round256(base) + PrepassLayout(g, in.index_q.device_index).total;
}

void run_cuda_backend(const IndexerInputs& inputs, const IndexerBackwardOutputs& out,
                      const IndexerOptions& opt, const ProblemGeometry& g, void* workspace,
                      std::size_t workspace_bytes) {
  hopper::DeviceGuard guard(inputs.index_q.device_index);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  const int device = inputs.index_q.device_index;
  if (!p_free_needs_prepass(inputs, g, opt)) {
    if (!g.cu_seqlens_on_device_only) {
      run_backward_kernel(inputs, out, opt, g, workspace, workspace_bytes);
      return;
    }
    (void)plan_for_current_device(out, opt, g);  // its errors before anything is allocated
    int32_t* buffer = nullptr;
    const IndexerInputs in = check_device_cu_seqlens(inputs, g, stream, &buffer);
    run_backward_kernel(in, out, opt, g, workspace, workspace_bytes);
    finish_device_cu_seqlens(buffer, inputs.cu_seqlens_q.shape[0], {&out.d_index_q, &out.d_weights, &out.d_index_k},
                             stream);
    return;
  }
  // P-free with H > 64 or deterministic: the loss forward's kernel writes P (and
  // its own row statistics, unused) into the workspace, then the P form runs.
  (void)plan_for_current_device(out, opt, g);
  const std::size_t base = round256(hopper::workspace_bytes(g, out.d_index_k.dtype, opt.deterministic));
  const PrepassLayout lay(g, device);
  char* ws = static_cast<char*>(workspace);
  const bool owns = !(workspace != nullptr && workspace_bytes >= base + lay.total);
  if (owns) {
    void* p = nullptr;
    cuda_check(cudaMallocAsync(&p, base + lay.total, stream), "cudaMallocAsync (P-free pre-pass)");
    ws = static_cast<char*>(p);
  }
  int32_t* buffer = nullptr;
  IndexerInputs in = g.cu_seqlens_on_device_only ? check_device_cu_seqlens(inputs, g, stream, &buffer) : inputs;
  char* pre = ws + base;
  IndexerKLForwardOutputs fwd;
  fwd.index_score = rows_view(pre, g, device, {g.topk});
  fwd.row_lse = rows_view(pre + lay.p, g, device);
  fwd.row_target_mass = rows_view(pre + lay.p + lay.lse, g, device);
  fwd.loss = contiguous_view(pre + lay.p + lay.lse + lay.mass, DType::f32, {}, DeviceType::cuda, device);
  IndexerInputs fwd_in = in;
  fwd_in.row_lse = {};
  fwd_in.row_target_mass = {};
  run_cuda_kl_forward(fwd_in, fwd, opt, g, pre + lay.p + lay.lse + lay.mass + lay.loss, lay.forward);
  IndexerInputs with_p = fwd_in;
  with_p.index_score = fwd.index_score;
  run_backward_kernel(with_p, out, opt, g, base > 0 ? ws : nullptr, base);
  if (buffer) {
    finish_device_cu_seqlens(buffer, inputs.cu_seqlens_q.shape[0], {&out.d_index_q, &out.d_weights, &out.d_index_k},
                             stream);
  }
  if (owns) cuda_check(cudaFreeAsync(ws, stream), "cudaFreeAsync (P-free pre-pass)");
}

/// The one-call loss and gradients (indexer_kl_loss_and_grad.hpp): the row
/// statistics (and, when the P-free kernels do not apply, P), then the scratch
/// shared by the forward and the backward, which run one after the other.
namespace {

/// The loss-and-gradient kernel (loss_and_grad_kernel.cuh) applies: P-free
/// (H <= 64), one A term, the fp32 dK of atomics, and not turned off.
bool fused_loss_and_grad(const IndexerBackwardOutputs& grads, const IndexerOptions& opt,
                         const ProblemGeometry& g) {
  return opt.forward_fusion == ForwardFusion::automatic && g.heads <= 64 && !opt.deterministic &&
         !hopper::a_operand_split(opt.a_operand_precision, grads.d_index_q.dtype, grads.d_index_k.dtype);
}

/// Its workspace: the row statistics (LSE, target mass), the row loss terms, the
/// z scratch rows of its grid and the fp32 dK accumulator (bf16 d_index_k).
struct FusedLayout {
  std::size_t rows, terms, z, dk, total;
  int64_t z_stride;
  FusedLayout(const ProblemGeometry& g, int64_t grid, DType dk_dtype) {
    rows = round256(static_cast<std::size_t>(g.num_q_rows) * 4);
    terms = round256(static_cast<std::size_t>(g.num_q_rows) * 8);
    z_stride = (g.topk + 63) / 64 * 64;
    z = round256(static_cast<std::size_t>(grid * z_stride) * 4);
    dk = dk_dtype == DType::bf16 ? round256(static_cast<std::size_t>(g.num_k_rows * g.head_dim) * 4) : 0;
    total = 2 * rows + terms + z + dk;
  }
};

/// The plan of the P-free backward, whose grid and start delays the fused kernel takes.
hopper::LaunchPlan fused_plan(const IndexerBackwardOutputs& grads, const IndexerOptions& options,
                              const ProblemGeometry& g) {
  IndexerOptions opt = options;
  opt.l2_hints = L2Hints::off;  // as the P-free kernels (run_backward_kernel)
  return plan_for_current_device(grads, opt, g);
}

/// The two kernels' workspace: the row statistics (2 parts of `rows` bytes),
/// with H > 64 or deterministic P (`p` bytes), then the scratch the forward
/// and the backward use one after the other.
struct TwoKernelLayout {
  bool with_p;
  std::size_t rows, p;
  TwoKernelLayout(const ProblemGeometry& g, const IndexerOptions& opt)
      : with_p(g.heads > 64 || opt.deterministic),
        rows(round256(static_cast<std::size_t>(g.num_q_rows) * 4)),
        p(with_p ? round256(static_cast<std::size_t>(g.num_q_rows * g.topk) * 4) : 0) {}
  std::size_t scratch_offset() const { return 2 * rows + p; }
};

}  // namespace

std::size_t cuda_kl_loss_and_grad_workspace_bytes(const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                                                  const IndexerOptions& opt, const ProblemGeometry& g) {
  hopper::DeviceGuard guard(in.index_q.device_index);
  const IndexerBackwardOutputs grads{out.d_index_q, out.d_weights, out.d_index_k};
  if (fused_loss_and_grad(grads, opt, g)) return FusedLayout(g, fused_plan(grads, opt, g).grid, out.d_index_k.dtype).total;
  const TwoKernelLayout lay(g, opt);
  const std::size_t fwd = round256(cuda_kl_forward_workspace_size(g, in.index_q.device_index));
  const std::size_t bwd = round256(hopper::workspace_bytes(g, out.d_index_k.dtype, opt.deterministic)) +
                          (lay.with_p ? 0 : packed_stats_bytes(g));
  return lay.scratch_offset() + std::max(fwd, bwd);
}

/// The loss and gradients in the loss-and-gradient kernel: dK zeroed, the
/// kernel, the loss terms' sum, the bf16 cast of dK. `ws` holds FusedLayout.
static void run_fused_loss_and_grad(const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                                    const IndexerOptions& opt, const ProblemGeometry& g,
                                    const hopper::LaunchPlan& plan, char* ws, cudaStream_t stream) {
  const IndexerBackwardOutputs grads{out.d_index_q, out.d_weights, out.d_index_k};
  const FusedLayout lay(g, plan.grid, out.d_index_k.dtype);
  const bool dk_bf16 = out.d_index_k.dtype == DType::bf16;
  float* dk_accum = dk_bf16 ? reinterpret_cast<float*>(ws + 2 * lay.rows + lay.terms + lay.z)
                            : static_cast<float*>(out.d_index_k.data);
  const std::size_t dk_bytes = static_cast<std::size_t>(g.num_k_rows * g.head_dim) * sizeof(float);
  hopper::IndexerKLForwardParams params{};
  IndexerInputs p_free = in;
  p_free.index_score = {};
  params.in = planned_params(p_free, grads, opt, g, plan, dk_accum, nullptr);
  params.row_lse = reinterpret_cast<float*>(ws);
  params.row_target_mass = reinterpret_cast<float*>(ws + lay.rows);
  params.index_score = nullptr;
  params.loss_terms = reinterpret_cast<double*>(ws + 2 * lay.rows);
  params.z_scratch = reinterpret_cast<float*>(ws + 2 * lay.rows + lay.terms);
  params.z_stride = lay.z_stride;
  if (dk_bytes > 0) cuda_check(cudaMemsetAsync(dk_accum, 0, dk_bytes, stream), "cudaMemsetAsync (dK accumulator)");
  if (g.head_dim == 64) hopper::launch_indexer_kl_loss_and_grad<64>(params, plan.grid, stream);
  else hopper::launch_indexer_kl_loss_and_grad<128>(params, plan.grid, stream);
  const double coeff_over_n = static_cast<double>(opt.loss_coeff) / static_cast<double>(g.normalization_count);
  hopper::launch_sum_loss_terms(params.loss_terms, g.num_q_rows, coeff_over_n, static_cast<float*>(out.loss.data),
                                stream);
  if (dk_bf16 && dk_bytes > 0) {
    const int64_t n = g.num_k_rows * g.head_dim;
    const int64_t threads = 256, per_block = threads * 4;
    hopper::cast_dk_to_bf16<<<static_cast<unsigned>((n + per_block - 1) / per_block), threads, 0, stream>>>(
        dk_accum, static_cast<__nv_bfloat16*>(out.d_index_k.data), n);
    hopper::cuda_check_launch("cast_dk_to_bf16");
  }
}

/// The loss forward into `ws` (the row statistics, with H > 64 or
/// deterministic P too, then its scratch), then the backward from them.
static void run_two_kernel_loss_and_grad(const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                                         const IndexerOptions& opt, const ProblemGeometry& g, char* ws,
                                         std::size_t total) {
  const int device = in.index_q.device_index;
  const TwoKernelLayout lay(g, opt);
  IndexerKLForwardOutputs fwd;
  fwd.loss = out.loss;
  fwd.row_lse = rows_view(ws, g, device);
  fwd.row_target_mass = rows_view(ws + lay.rows, g, device);
  if (lay.with_p) fwd.index_score = rows_view(ws + 2 * lay.rows, g, device, {g.topk});
  char* scratch = ws + lay.scratch_offset();
  const std::size_t scratch_bytes = total - lay.scratch_offset();
  run_cuda_kl_forward(in, fwd, opt, g, scratch, scratch_bytes);
  IndexerInputs bwd_in = in;
  if (lay.with_p) {
    bwd_in.index_score = fwd.index_score;
  } else {
    bwd_in.row_lse = fwd.row_lse;
    bwd_in.row_target_mass = fwd.row_target_mass;
  }
  run_backward_kernel(bwd_in, {out.d_index_q, out.d_weights, out.d_index_k}, opt, g, scratch, scratch_bytes);
}

void run_cuda_kl_loss_and_grad(const IndexerInputs& inputs, const IndexerKLLossAndGradOutputs& out,
                               const IndexerOptions& opt, const ProblemGeometry& g, void* workspace,
                               std::size_t workspace_bytes) {
  hopper::DeviceGuard guard(inputs.index_q.device_index);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  const IndexerBackwardOutputs grads{out.d_index_q, out.d_weights, out.d_index_k};
  (void)plan_for_current_device(grads, opt, g);  // its errors before anything is allocated
  const bool fused = fused_loss_and_grad(grads, opt, g);
  hopper::LaunchPlan plan{};
  if (fused) {
    plan = fused_plan(grads, opt, g);
    // The kernel's attribute and occupancy before anything is allocated or written.
    if (g.head_dim == 64) hopper::prepare_indexer_kl_loss_and_grad<64>();
    else hopper::prepare_indexer_kl_loss_and_grad<128>();
  }
  const std::size_t total = fused ? FusedLayout(g, plan.grid, out.d_index_k.dtype).total
                                  : cuda_kl_loss_and_grad_workspace_bytes(inputs, out, opt, g);
  char* ws = static_cast<char*>(workspace);
  const bool owns = !(workspace != nullptr && workspace_bytes >= total);
  if (owns) {
    void* m = nullptr;
    cuda_check(cudaMallocAsync(&m, total, stream), "cudaMallocAsync (loss and gradients workspace)");
    ws = static_cast<char*>(m);
  }
  int32_t* buffer = nullptr;
  const IndexerInputs in =
      g.cu_seqlens_on_device_only ? check_device_cu_seqlens(inputs, g, stream, &buffer) : inputs;
  if (fused) run_fused_loss_and_grad(in, out, opt, g, plan, ws, stream);
  else run_two_kernel_loss_and_grad(in, out, opt, g, ws, total);
  if (buffer) {
    finish_device_cu_seqlens(buffer, inputs.cu_seqlens_q.shape[0],
                             {&out.loss, &out.d_index_q, &out.d_weights, &out.d_index_k}, stream);
  }
  if (owns) cuda_check(cudaFreeAsync(ws, stream), "cudaFreeAsync (loss and gradients workspace)");
}

}  // namespace dsaib::detail
