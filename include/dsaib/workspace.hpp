// Scratch memory from the caller's allocator, asked for by the call itself.
//
// Each entry point also takes a workspace as (pointer, bytes), sized by its
// *_workspace_size() function; that function validates the arguments as the
// call does, so a caller that sizes, allocates and calls validates twice (and,
// on the cuda backend with THD or strict_indices, copies cu_seqlens and ids to
// the host twice). The overloads here validate once: the call checks its
// arguments, computes the bytes it needs and, when that is more than 0 on the
// cuda backend, asks the caller's allocator for them, before anything is
// written. A framework's caching allocator (stream-ordered, and a CUDA graph's
// private pool while one is captured) then serves the workspace.
#pragma once

#include <cstddef>

#include "dsaib/attention_target.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/indexer_kl_forward.hpp"
#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "dsaib/indexer_topk.hpp"

namespace dsaib {

/// A caller's allocator for a call's workspace.
///
/// allocate(context, bytes) is called at most once per call, after all
/// validation and before anything is written, on the calling thread, with
/// bytes > 0 (a call that needs no workspace, and the cpu backend, never call
/// it). It returns a 256-byte aligned pointer to at least `bytes` bytes on the
/// backend's device that work ordered on options.stream may use until it is
/// done (memory from a stream-ordered allocator on that stream qualifies), or
/// throws; its exception propagates out of the call with nothing written. A
/// null pointer or a misaligned one is refused (invalid_argument, argument()
/// "workspace"), nothing written. The caller frees the memory after the call
/// returns, in stream order.
///
/// An allocator whose `allocate` is null leaves the workspace to the call,
/// which allocates it itself, stream-ordered (as with a null workspace).
struct WorkspaceAllocator {
  void* (*allocate)(void* context, std::size_t bytes) = nullptr;
  void* context = nullptr;
};

/// indexer_backward() with its workspace from `allocator`.
void indexer_backward(const IndexerInputs& inputs, const IndexerBackwardOutputs& outputs,
                      const IndexerOptions& options, const WorkspaceAllocator& allocator);

/// indexer_kl_forward() with its workspace from `allocator`.
void indexer_kl_forward(const IndexerInputs& inputs, const IndexerKLForwardOutputs& outputs,
                        const IndexerOptions& options, const WorkspaceAllocator& allocator);

/// indexer_kl_loss_and_grad() with its workspace from `allocator`.
void indexer_kl_loss_and_grad(const IndexerInputs& inputs, const IndexerKLLossAndGradOutputs& outputs,
                              const IndexerOptions& options, const WorkspaceAllocator& allocator);

/// attention_target() with its workspace from `allocator`.
void attention_target(const AttentionTargetInputs& inputs, const AttentionTargetOutputs& outputs,
                      const AttentionTargetOptions& options, const WorkspaceAllocator& allocator);

/// indexer_topk() with its workspace from `allocator`.
void indexer_topk(const IndexerTopkInputs& inputs, const IndexerTopkOutputs& outputs,
                  const IndexerTopkOptions& options, const WorkspaceAllocator& allocator);

}  // namespace dsaib
