// The launch heuristics of the cuda backend in one place: which fused kernel, its
// persistent grid, the start delays, the L2 evict_last share and the workspace,
// computed by plan_launch() from the validated problem, the options and the
// device's properties. Host code only, without CUDA headers: the cuda backend
// (backend.cu) queries the device once per call and launches from the plan, and
// the CPU tests build plans for an H200-like device without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/problem.hpp"
#include "hopper/common/l2_hints.hpp"
#include "hopper/common/start_stagger.hpp"

namespace dsaib::hopper {

/// Heads per task (TileConfig::kHeadTile; backend.cu asserts they agree): a query
/// row with H heads is ceil(H / 64) tasks.
inline constexpr int64_t kHeadsPerTask = 64;

/// What a plan needs to know of the device, queried by the cuda backend per call.
struct DeviceProperties {
  /// SMs (cudaDevAttrMultiProcessorCount): 132 on the H200.
  int32_t sm_count = 0;
  /// L2 bytes (cudaDevAttrL2CacheSize): 60 MiB on the H200. 0 = unknown: no
  /// automatic L2 hints.
  int64_t l2_bytes = 0;
  /// The context's L2 set-aside for persisting lines in force
  /// (cudaLimitPersistingL2CacheSize): 11.25 MiB in a fresh context on the H200,
  /// at most 37.5 MiB. 0 when it cannot be queried.
  int64_t persisting_l2_bytes = 0;
  /// Resident CTAs per SM of the fused kernel for this head dim and a operand
  /// (cudaOccupancyMaxActiveBlocksPerMultiprocessor, indexer_backward_ctas_per_sm
  /// in launch.hpp; its L2-hinted and fixed-point variants have the same): 1 on
  /// the H200, where its 512 threads of 128 registers fill the register file.
  int32_t ctas_per_sm = 1;
};

/// One of the ten fused kernels: TileConfig<head_dim, split_a, l2_keep_dk,
/// fixed_point_dk>. Per head dim (64, 128): one bf16 term of a, two terms, one
/// term with the L2-hinted dK reds, and the fixed-point dK with one and with two
/// terms.
struct BackwardKernel {
  int32_t head_dim = 128;       // D
  bool split_a = false;         // a as two bf16 terms (AOperandPrecision)
  bool l2_keep_dk = false;      // dK reds with an L2 evict_last share (L2Hints; one term only)
  bool fixed_point_dk = false;  // deterministic d_index_k (IndexerOptions::deterministic)
};

/// Everything the cuda backend launches with for one call.
struct LaunchPlan {
  BackwardKernel kernel;
  /// Tasks per query row (ceil(H / kHeadsPerTask)) and in all (query rows x head_groups).
  int64_t head_groups = 0;
  int64_t num_tasks = 0;
  /// Persistent CTAs: min(num_tasks, sm_count x ctas_per_sm); 0 for no tasks.
  int64_t grid = 0;
  /// Start delays of the CTAs with a task fewer (start_stagger.hpp); none with
  /// StartStagger::off.
  StartDelays start_delays;
  /// The L2-hinted kernel's evict_last share of the dK reds (l2_hints.hpp);
  /// f035 (ignored) for the other kernels.
  L2KeepFraction l2_keep_fraction = L2KeepFraction::f035;
  /// Scratch bytes of the call (indexer_backward_workspace_size).
  std::size_t workspace_bytes = 0;
  /// The device it was planned for.
  DeviceProperties device;
};

/// Whether the a operand runs as two bf16 terms: bf16x2 always, bf16 never,
/// automatic when d_index_q or d_index_k is f32.
bool a_operand_split(AOperandPrecision precision, DType d_index_q, DType d_index_k);

/// Offset of the DkFixedBound in the deterministic workspace: after the int64
/// (num_k_rows, D) accumulator (fixed_point_dk.cuh), rounded up to 256 bytes.
std::size_t dk_fixed_bound_offset(int64_t num_k_rows, int64_t head_dim);

/// Bytes of the deterministic workspace: the accumulator, then the bound.
std::size_t dk_fixed_workspace_bytes(int64_t num_k_rows, int64_t head_dim);

/// Scratch bytes of a cuda call: deterministic, dk_fixed_workspace_bytes; else
/// the fp32 dK accumulator (num_k_rows x D x 4) for a bf16 d_index_k, 0 for f32.
std::size_t workspace_bytes(const detail::ProblemGeometry& g, DType d_index_k, bool deterministic);

/// The plan of one call on the cuda backend: `g` from validate_problem, the
/// output dtypes, the options (a_operand_precision, deterministic, l2_hints,
/// start_stagger) and the device. Reads nothing else, touches no device.
/// Throws Error(invalid_argument, "index_k") for 2^31 key rows or more (or a topk
/// that large), which the kernels' 32-bit row ids cannot address.
LaunchPlan plan_launch(const detail::ProblemGeometry& g, DType d_index_q, DType d_index_k,
                       const IndexerOptions& options, const DeviceProperties& device);

}  // namespace dsaib::hopper

namespace dsaib::detail {

/// The plan the cuda backend would launch for this call now: validates like
/// indexer_backward() (options.backend must be cuda), queries the device of
/// index_q as a call does (the persisting set-aside in force included), and
/// returns plan_launch()'s plan. Launches, allocates and writes nothing. Raises
/// indexer_backward()'s errors, and invalid_argument naming "backend" for a cpu
/// backend.
hopper::LaunchPlan plan_indexer_backward(const IndexerInputs& inputs, const IndexerBackwardOutputs& outputs,
                                         const IndexerOptions& options);

}  // namespace dsaib::detail
