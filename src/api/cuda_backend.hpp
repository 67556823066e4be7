// The seam between the backend-neutral API and the Hopper backend.
// Implemented in src/hopper/launch.cu when built with CUDA, else by
// src/api/cuda_backend_stub.cpp.
#pragma once

#include <cstddef>

#include "core/problem.hpp"

namespace dsaib::detail {

/// True when the cuda backend is compiled in and device 0..n has compute capability 9.0.
bool cuda_backend_compiled();
bool cuda_device_present();

/// errors.md's order up to the tensors: the options (check_options), then, for
/// backend cuda, its availability (backend_unavailable). Touches no tensor; the C
/// ABI runs it before its own checks of the tensors' enum fields.
void check_options_and_backend(const IndexerBackwardOptions& opt);

/// Device-to-host copy used by validation (cu_seqlens, strict ids): on `stream`
/// (a cudaStream_t; null = legacy default stream), so it follows the caller's
/// queued work even on a non-blocking stream, then waits for it.
void cuda_copy_to_host(void* dst, const void* src, std::size_t row_bytes, std::size_t src_pitch,
                       std::size_t rows, void* stream);

/// Scratch bytes of a cuda call: the fp32 dK accumulator for a bf16 d_index_k, or
/// the deterministic mode's int64 accumulator and bound (fixed_point_dk.hpp).
std::size_t cuda_workspace_size(const IndexerBackwardOutputs& out, const IndexerBackwardOptions& opt,
                                const ProblemGeometry& g);

/// Launches the fused kernel on options.stream. `g` is validated.
void run_cuda_backend(const IndexerBackwardInputs& in, const IndexerBackwardOutputs& out,
                      const IndexerBackwardOptions& opt, const ProblemGeometry& g, void* workspace,
                      std::size_t workspace_bytes);

}  // namespace dsaib::detail
