// The seam between the backend-neutral API and the Hopper backend.
// Implemented in src/hopper/indexer_backward/indexer_backward_backend.cu when built with CUDA, else by
// src/api/cuda_backend_stub.cpp.
#pragma once

#include <cstddef>

#include "core/problem.hpp"
#include "hopper/launch/launch_plan.hpp"

namespace dsaib::detail {

/// True when the cuda backend is compiled in and device 0..n has compute capability 9.0.
bool cuda_backend_compiled();
bool cuda_device_present();

/// errors.md's order up to the tensors: the options (check_options), then, for
/// backend cuda, its availability (backend_unavailable). Touches no tensor; the C
/// ABI runs it before its own checks of the tensors' enum fields.
void check_options_and_backend(const IndexerOptions& opt);

/// Device-to-host copy used by validation (cu_seqlens, strict ids): on `stream`
/// (a cudaStream_t; null = legacy default stream), so it follows the caller's
/// queued work even on a non-blocking stream, then waits for it.
void cuda_copy_to_host(void* dst, const void* src, std::size_t row_bytes, std::size_t src_pitch,
                       std::size_t rows, void* stream);

/// Whether `stream` (a cudaStream_t) is capturing a CUDA graph (cudaStreamIsCapturing).
bool cuda_stream_capturing(void* stream);

/// The P-free backward (index_score absent) runs the loss forward's kernel first
/// to write P into the workspace when the P-free kernels do not apply: H above
/// one task's 64 heads (z sums over every head of the row), or deterministic.
inline bool p_free_needs_prepass(const IndexerInputs& in, const ProblemGeometry& g,
                                 const IndexerOptions& opt) {
  return !in.index_score.present() && (g.heads > 64 || opt.deterministic);
}

/// Scratch bytes of a cuda backward: the fused kernel's (hopper::workspace_bytes)
/// rounded up to 256, plus, when p_free_needs_prepass, P (num_q_rows * topk f32),
/// the forward's row statistics and loss, and the forward's own scratch, each
/// rounded up to 256.
std::size_t cuda_backward_workspace_bytes(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                          const IndexerOptions& opt, const ProblemGeometry& g);

/// The launch plan of a call on the device of index_q (hopper::plan_launch with
/// that device's properties, queried as run_cuda_backend queries them). `g` is
/// validated. Launches, allocates and writes nothing.
hopper::LaunchPlan cuda_launch_plan(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                    const IndexerOptions& opt, const ProblemGeometry& g);

/// Plans the launch (cuda_launch_plan), then launches the fused kernel on
/// options.stream. `g` is validated.
void run_cuda_backend(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                      const IndexerOptions& opt, const ProblemGeometry& g, void* workspace,
                      std::size_t workspace_bytes);

/// The one-call loss and gradients on the cuda backend (backend.cu): its
/// workspace size and the run (the forward, then the backward; no host
/// synchronisation). `g` is validated.
std::size_t cuda_kl_loss_and_grad_workspace_bytes(const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                                                  const IndexerOptions& opt, const ProblemGeometry& g);
void run_cuda_kl_loss_and_grad(const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                               const IndexerOptions& opt, const ProblemGeometry& g, void* workspace,
                               std::size_t workspace_bytes);

}  // namespace dsaib::detail
