// The seam between the backend-neutral entry points and the cuda backend, for
// every kernel family. Implemented under src/hopper/ when built with CUDA, else
// by cuda_backend_stub.cpp, which reports backend_unavailable.
//
// Each family's cuda call is a plan, then a run from that plan: plan_cuda_*
// queries the device once (launch/device.hpp) and returns the launch plan with
// its workspace size (launch/launch_plan.hpp); the entry point checks a
// caller's workspace against it (check_caller_workspace) before run_cuda_*
// allocates or writes anything. `g` is always validated.
#pragma once

#include <cstddef>

#include "core/problem.hpp"
#include "dsaib/attention_target.hpp"
#include "dsaib/indexer_kl_forward.hpp"
#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "dsaib/indexer_topk.hpp"
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

/// The one check of a caller's workspace, before anything is written: none
/// (null and 0 bytes: the backend's own stream-ordered memory), or at least
/// `need` bytes at a non-null 256-byte aligned address. `size_function` names
/// the query that gives `need`.
void check_caller_workspace(const void* workspace, std::size_t workspace_bytes, std::size_t need,
                            const char* size_function);

/// indexer_backward(): the P form, or the P-free form with its kernels or its
/// prepass (hopper::plan_backward_call).
hopper::BackwardCallPlan plan_cuda_backward(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                            const IndexerOptions& opt, const ProblemGeometry& g);
void run_cuda_backward(const hopper::BackwardCallPlan& plan, const IndexerInputs& in, const IndexerBackwardOutputs& out,
                       const IndexerOptions& opt, const ProblemGeometry& g, void* workspace, std::size_t workspace_bytes);

/// indexer_kl_forward().
hopper::ForwardPlan plan_cuda_kl_forward(const IndexerInputs& in, const ProblemGeometry& g);
void run_cuda_kl_forward(const hopper::ForwardPlan& plan, const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                         const IndexerOptions& opt, const ProblemGeometry& g, void* workspace, std::size_t workspace_bytes);

/// indexer_kl_loss_and_grad(): one kernel, or the forward then the backward.
hopper::LossAndGradPlan plan_cuda_loss_and_grad(const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                                                const IndexerOptions& opt, const ProblemGeometry& g);
void run_cuda_loss_and_grad(const hopper::LossAndGradPlan& plan, const IndexerInputs& in,
                            const IndexerKLLossAndGradOutputs& out, const IndexerOptions& opt, const ProblemGeometry& g,
                            void* workspace, std::size_t workspace_bytes);

/// attention_target(). `g` describes the problem as for the indexer: heads = Hq,
/// head_dim = Dqk, layout, id_mode, batch, topk, row counts and per-sequence
/// tables (cu_seqlens_on_device_only while a THD call is being captured).
hopper::TargetPlan plan_cuda_attention_target(const AttentionTargetInputs& in, const ProblemGeometry& g);
void run_cuda_attention_target(const hopper::TargetPlan& plan, const AttentionTargetInputs& in,
                               const AttentionTargetOutputs& out, const AttentionTargetOptions& opt,
                               const ProblemGeometry& g, void* workspace, std::size_t workspace_bytes);

/// indexer_topk(). `g` as validate_topk_problem() returns it: topk = the
/// outputs' last dimension, heads = H, head_dim = D, the per-sequence tables.
hopper::TopkPlan plan_cuda_indexer_topk(const IndexerTopkInputs& in, const IndexerTopkOutputs& out,
                                        const ProblemGeometry& g);
void run_cuda_indexer_topk(const hopper::TopkPlan& plan, const IndexerTopkInputs& in, const IndexerTopkOutputs& out,
                           const IndexerTopkOptions& opt, const ProblemGeometry& g, void* workspace,
                           std::size_t workspace_bytes);

}  // namespace dsaib::detail
