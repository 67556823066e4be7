// THD cu_seqlens checked on the device, for a call captured in a CUDA graph
// (ProblemGeometry::cu_seqlens_on_device_only), where validation could not copy
// them to the host. Used by the host code of every cuda entry point.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "core/problem.hpp"
#include "dsaib/indexer_backward.hpp"

namespace dsaib::detail {

/// Checks in.cu_seqlens_q / _k on the device (validation's rules) into
/// stream-ordered copies and returns `in` with the copies in their place: the
/// arrays themselves when valid, else [0, ..., 0, T] (every row in the last
/// sequence, so that no kernel reads out of bounds) and a flag. `*buffer` holds
/// the copies and the flag until finish_device_cu_seqlens.
IndexerInputs check_device_cu_seqlens(const IndexerInputs& in, const ProblemGeometry& g,
                                              cudaStream_t stream, int32_t** buffer);

/// After the kernels: NaN into every element of `outputs` when the check found
/// bad cu_seqlens (n = B + 1 values each), then frees `buffer`.
void finish_device_cu_seqlens(int32_t* buffer, int64_t n, std::initializer_list<const TensorView*> outputs,
                              cudaStream_t stream);

}  // namespace dsaib::detail
