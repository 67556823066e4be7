// The seam between attention_target() and the Hopper target kernel.
// Implemented in src/hopper/attention_target/attention_target_backend.cu when built with CUDA,
// else by src/api/cuda_attention_target_stub.cpp.
#pragma once

#include <cstddef>

#include "core/problem.hpp"
#include "dsaib/attention_target.hpp"

namespace dsaib::detail {

/// `g` describes the problem as for the indexer: heads = Hq, head_dim = Dqk,
/// layout, id_mode, batch, topk, row counts and per-sequence tables
/// (cu_seqlens_on_device_only while a THD call is being captured).

/// Scratch bytes of a cuda target (attention_target_workspace_size) on device `device_index`.
std::size_t cuda_attention_target_workspace_size(const ProblemGeometry& g, const AttentionTargetOptions& opt,
                                                 int device_index);

/// Launches the target on options.stream. Everything is validated; `workspace`
/// null means stream-ordered memory of its own.
void run_cuda_attention_target(const AttentionTargetInputs& in, const AttentionTargetOutputs& out,
                               const AttentionTargetOptions& opt, const ProblemGeometry& g, void* workspace,
                               std::size_t workspace_bytes);

}  // namespace dsaib::detail
