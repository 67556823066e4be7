// The cuda loss forward behind src/api/cuda_kl_forward.hpp: the forward kernel
// (kl_forward_kernel.cuh) over the query rows, then one CTA that sums the per-row
// loss terms in a fixed order. No host synchronisation.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "api/cuda_kl_forward.hpp"
#include "hopper/common/cuda_check.hpp"
#include "hopper/kl_forward/kl_forward_kernel.cuh"

namespace dsaib::hopper {

// Built by the backward's launcher (backend.cu): the inputs' pointers, strides and sizes.
IndexerParams make_kernel_params(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                         const IndexerOptions& opt, const detail::ProblemGeometry& g,
                                         float* dk_accum);

namespace {

constexpr int kSumThreads = 1024;

/// loss = -(loss_coeff / N) * sum of the row terms: each thread sums rows
/// tid, tid + 1024, ... in order, then a fixed tree; fp64 throughout.
__global__ void __launch_bounds__(kSumThreads) sum_loss_terms(const double* __restrict__ terms, int64_t rows,
                                                               double coeff_over_n, float* __restrict__ loss) {
  __shared__ double part[kSumThreads];
  double s = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kSumThreads) s += terms[r];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int width = kSumThreads / 2; width > 0; width >>= 1) {
    if (static_cast<int>(threadIdx.x) < width) part[threadIdx.x] += part[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = static_cast<float>(0.0 - coeff_over_n * part[0]);  // +0 without terms
}

}  // namespace

void launch_sum_loss_terms(const double* terms, int64_t rows, double coeff_over_n, float* loss, cudaStream_t stream) {
  sum_loss_terms<<<1, kSumThreads, 0, stream>>>(terms, rows, coeff_over_n, loss);
  cuda_check_launch("sum_loss_terms");
}

namespace {

/// Calls f(ForwardTileConfig<D, head tile>{}) for the problem's head dim and heads.
template <class F>
void with_forward_config(int64_t head_dim, int64_t heads, F&& f) {
  if (head_dim == 64) {
    if (heads <= 64) f(ForwardTileConfig<64, 64>{});
    else f(ForwardTileConfig<64, 128>{});
  } else {
    if (heads <= 64) f(ForwardTileConfig<128, 64>{});
    else f(ForwardTileConfig<128, 128>{});
  }
}

/// The persistent grid: min(rows, SMs x resident CTAs per SM) of the kernel for `Config`.
template <class Config>
int64_t forward_grid(int64_t rows, int device) {
  if (rows <= 0) return 0;
  const int blocks_per_sm = resident_ctas_per_sm(indexer_kl_forward_kernel<Config>, Config::kThreads,
                                                 forward_shared_storage_bytes<Config>(), "indexer_kl_forward_kernel");
  int sms = 0;
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return std::min<int64_t>(rows, static_cast<int64_t>(sms) * blocks_per_sm);
}

int64_t grid_for(const detail::ProblemGeometry& g, int device) {
  int64_t grid = 0;
  with_forward_config(g.head_dim, g.heads, [&](auto c) { grid = forward_grid<decltype(c)>(g.num_q_rows, device); });
  return grid;
}

std::size_t round_up_256(std::size_t n) { return (n + 255) / 256 * 256; }

/// Workspace layout: the row terms, then the z scratch rows (topk rounded up to 64 floats).
struct ForwardWorkspace {
  std::size_t terms_bytes = 0, z_bytes = 0;
  int64_t z_stride = 0;
  std::size_t total() const { return terms_bytes + z_bytes; }
};
ForwardWorkspace workspace_layout(const detail::ProblemGeometry& g, int64_t grid) {
  ForwardWorkspace w;
  w.z_stride = (g.topk + 63) / 64 * 64;
  w.terms_bytes = round_up_256(static_cast<std::size_t>(g.num_q_rows) * sizeof(double));
  w.z_bytes = round_up_256(static_cast<std::size_t>(grid * w.z_stride) * sizeof(float));
  return w;
}

}  // namespace
}  // namespace dsaib::hopper

namespace dsaib::detail {
using hopper::cuda_check;

std::size_t cuda_kl_forward_workspace_size(const ProblemGeometry& g, int device_index) {
  hopper::DeviceGuard guard(device_index);
  return hopper::workspace_layout(g, hopper::grid_for(g, device_index)).total();
}

void run_cuda_kl_forward(const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                         const IndexerOptions& opt, const ProblemGeometry& g, void* workspace,
                         std::size_t workspace_bytes) {
  check_cuda_key_rows(g);  // validation raised it already
  const int device = in.index_q.device_index;
  hopper::DeviceGuard guard(device);
  const int64_t grid = hopper::grid_for(g, device);
  const hopper::ForwardWorkspace ws = hopper::workspace_layout(g, grid);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  char* base = static_cast<char*>(workspace);
  const bool owns_workspace = !(workspace != nullptr && workspace_bytes >= ws.total()) && ws.total() > 0;
  if (owns_workspace) {
    void* p = nullptr;
    cuda_check(cudaMallocAsync(&p, ws.total(), stream), "cudaMallocAsync (forward workspace)");
    base = static_cast<char*>(p);
  }
  hopper::IndexerKLForwardParams params{};
  params.in = hopper::make_kernel_params(in, IndexerBackwardOutputs{}, opt, g, nullptr);
  params.in.head_groups = 1;  // a task is a whole row (every head)
  params.in.num_tasks = g.num_q_rows;
  params.row_lse = static_cast<float*>(out.row_lse.data);
  params.row_target_mass = static_cast<float*>(out.row_target_mass.data);
  params.index_score = out.index_score.present() ? static_cast<float*>(out.index_score.data) : nullptr;
  params.loss_terms = reinterpret_cast<double*>(base);
  params.z_scratch = reinterpret_cast<float*>(base + ws.terms_bytes);
  params.z_stride = ws.z_stride;
  if (grid > 0) {
    hopper::with_forward_config(g.head_dim, g.heads, [&](auto c) {
      using Config = decltype(c);
      hopper::indexer_kl_forward_kernel<Config><<<static_cast<unsigned>(grid), Config::kThreads,
                                                  hopper::forward_shared_storage_bytes<Config>(), stream>>>(params);
    });
    hopper::cuda_check_launch("indexer_kl_forward_kernel");
  }
  const double coeff_over_n = static_cast<double>(opt.loss_coeff) / static_cast<double>(g.normalization_count);
  hopper::launch_sum_loss_terms(params.loss_terms, g.num_q_rows, coeff_over_n, static_cast<float*>(out.loss.data),
                                stream);
  if (owns_workspace) cuda_check(cudaFreeAsync(base, stream), "cudaFreeAsync (forward workspace)");
}

}  // namespace dsaib::detail
