// THD cu_seqlens checked on the device, for a call captured in a CUDA graph
// (ProblemGeometry::cu_seqlens_on_device_only), where validation could not copy
// them to the host. Every cuda entry point takes this path then.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "core/problem.hpp"
#include "dsaib/tensor.hpp"

namespace dsaib::detail {

/// Stream-ordered copies of cu_seqlens_q / _k that the kernels read instead of
/// the caller's: the arrays themselves when valid, else [0, ..., 0, T] (every
/// row in the last sequence, so that no kernel reads out of bounds), and a
/// flag. Null members: no check (the host validated cu_seqlens).
struct DeviceCuSeqlens {
  int32_t* buffer = nullptr;  // copies and flag, until finish_device_cu_seqlens
  int64_t n = 0;              // B + 1
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
};

/// Checks cu_seqlens_q / _k on the device (validation's rules) on `stream`.
DeviceCuSeqlens check_device_cu_seqlens(const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                        const ProblemGeometry& g, cudaStream_t stream);

/// `in` with the checked copies of `c` in place of its cu_seqlens (`in` as it is
/// for a default DeviceCuSeqlens).
IndexerInputs with_checked_cu_seqlens(IndexerInputs in, const DeviceCuSeqlens& c);

/// After the kernels: NaN into every element of `outputs` when the check found
/// bad cu_seqlens, then frees the copies. Nothing for a default DeviceCuSeqlens.
void finish_device_cu_seqlens(const DeviceCuSeqlens& c, std::initializer_list<const TensorView*> outputs,
                              cudaStream_t stream);

}  // namespace dsaib::detail
