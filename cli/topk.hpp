// The `topk` subcommand's problem and its run on a backend (cli/topk_command.cpp,
// cli/cuda.cpp).
#pragma once

#include <string>
#include <vector>

#include "dsaib/host_tensor.hpp"
#include "dsaib/indexer_topk.hpp"

namespace dsaib::cli {

/// A generated indexer_topk() problem on the host, its outputs beside it.
struct TopkRun {
  HostTensor index_q, weights, index_k, starts, ends, cu_seqlens_q, cu_seqlens_k;
  HostTensor index_q_scale, index_k_scale;  // e4m3 inputs only
  HostTensor topk_indices, topk_logits, topk_lengths;
  IndexerTopkOptions options;
  std::vector<double> seconds;  // per timed call
  std::string timer, device;

  /// Host views (absent tensors absent).
  IndexerTopkInputs inputs() const {
    return {index_q.view(),      weights.view(),      index_k.view(),       starts.view(),       ends.view(),
            cu_seqlens_q.view(), cu_seqlens_k.view(), index_q_scale.view(), index_k_scale.view()};
  }
  IndexerTopkOutputs outputs() const { return {topk_indices.view(), topk_logits.view(), topk_lengths.view()}; }
};

/// Copies the inputs to the device, runs indexer_topk on the cuda backend
/// `repeat` times after `warmup` untimed runs (cudaEvent timing), copies the
/// outputs back into `r`. Raises dsaib::Error (backend_unavailable in a build
/// without CUDA, through the library's own check).
void run_topk_cuda(TopkRun& r, int warmup, int repeat);

}  // namespace dsaib::cli
