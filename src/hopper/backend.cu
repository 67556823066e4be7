// The cuda backend behind src/api/cuda_backend.hpp: queries the device, plans
// the launch (launch_plan.hpp), builds the kernel params from a validated
// problem, zeroes the fp32 dK accumulator, launches one of the ten fused kernels
// and, for a bf16 d_index_k, the final cast. No host synchronisation.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "api/cuda_backend.hpp"
#include "hopper/cuda_check.hpp"
#include "hopper/fixed_point_dk.hpp"
#include "hopper/l2_policy.cuh"
#include "hopper/launch.hpp"
#include "hopper/launch_plan.hpp"
#include "hopper/tile_config.cuh"

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

static_assert(TileConfig<64, false>::kHeadTile == kHeadsPerTask && TileConfig<128, true>::kHeadTile == kHeadsPerTask,
              "the launch plan's tasks are the kernels' head tiles");

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
static hopper::LaunchPlan plan_for_current_device(const IndexerBackwardOutputs& out, const IndexerBackwardOptions& opt,
                                                  const ProblemGeometry& g) {
  const bool split_a = hopper::a_operand_split(opt.a_operand_precision, out.d_index_q.dtype, out.d_index_k.dtype);
  return hopper::plan_launch(g, out.d_index_q.dtype, out.d_index_k.dtype, opt,
                             query_device_properties(g.head_dim, split_a));
}

hopper::LaunchPlan cuda_launch_plan(const IndexerBackwardInputs& in, const IndexerBackwardOutputs& out,
                                    const IndexerBackwardOptions& opt, const ProblemGeometry& g) {
  hopper::DeviceGuard guard(in.index_q.device_index);
  return plan_for_current_device(out, opt, g);
}

/// One of the ten fused kernels (hopper::FusedKernel), as a type.
template <int kD, bool kSplit, bool kL2, bool kFixed = false>
struct KernelChoice {
  static constexpr int kHeadDim = kD;
  static constexpr bool kSplitA = kSplit, kL2KeepDk = kL2, kFixedPointDk = kFixed;
};

/// Launches the fused kernel `k` names (l2_keep_dk is never set with split_a or
/// fixed_point_dk: plan_launch).
static void launch_fused_kernel(const hopper::FusedKernel& k, const hopper::IndexerBackwardParams& params,
                                int64_t grid, cudaStream_t stream) {
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
static hopper::IndexerBackwardParams planned_params(const IndexerBackwardInputs& in, const IndexerBackwardOutputs& out,
                                                    const IndexerBackwardOptions& opt, const ProblemGeometry& g,
                                                    const hopper::LaunchPlan& plan, float* dk_accum) {
  hopper::IndexerBackwardParams params = hopper::make_kernel_params(in, out, opt, g, dk_accum);
  params.start_stagger_max_ns = plan.start_delays.max_ns;
  params.start_stagger_first_delayed_cta = plan.start_delays.first_delayed_cta;
  params.l2_keep_fraction = static_cast<int32_t>(plan.l2_keep_fraction);
  return params;
}

/// The deterministic path (options.deterministic; fixed_point_dk.cuh): the bound
/// pass, the fixed-point fused kernel, the finish kernel writing d_index_k. Its
/// workspace (the int64 accumulator and the bound) is the caller's or
/// stream-ordered memory of its own.
static void run_fixed_point_dk(const IndexerBackwardInputs& in, const IndexerBackwardOutputs& out,
                               const IndexerBackwardOptions& opt, const ProblemGeometry& g,
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
  hopper::IndexerBackwardParams params = planned_params(in, out, opt, g, plan, nullptr);
  params.dk_fixed = dk_fixed;
  params.dk_bound = bound;
  hopper::launch_dk_fixed_bound(params, dk_fixed, n, bound, stream);
  launch_fused_kernel(plan.kernel, params, plan.grid, stream);
  hopper::launch_dk_fixed_finish(dk_fixed, bound, g.num_q_rows, out.d_index_k.data,
                                 out.d_index_k.dtype == DType::bf16, n, stream);
  if (owns_workspace) cuda_check(cudaFreeAsync(base, stream), "cudaFreeAsync (deterministic dK accumulator)");
}

void run_cuda_backend(const IndexerBackwardInputs& in, const IndexerBackwardOutputs& out,
                      const IndexerBackwardOptions& opt, const ProblemGeometry& g, void* workspace,
                      std::size_t workspace_bytes) {
  hopper::DeviceGuard guard(in.index_q.device_index);
  // Everything that decides the launch (device queries included, and the cuda-only
  // limits, which raise invalid_argument) comes before anything is allocated or written.
  const hopper::LaunchPlan plan = plan_for_current_device(out, opt, g);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
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
  const hopper::IndexerBackwardParams params = planned_params(in, out, opt, g, plan, dk_accum);
  if (dk_bytes > 0) cuda_check(cudaMemsetAsync(dk_accum, 0, dk_bytes, stream), "cudaMemsetAsync (dK accumulator)");
  launch_fused_kernel(plan.kernel, params, plan.grid, stream);
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
}

}  // namespace dsaib::detail
