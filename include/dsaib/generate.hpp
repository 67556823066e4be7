// Realistic input generator: what one forward pass of a DSA indexer produces.
#pragma once

#include <cstdint>
#include <vector>

#include "dsaib/host_tensor.hpp"
#include "dsaib/indexer_backward.hpp"

namespace dsaib {

enum class IdPattern : int32_t {
  /// Causal top-k from the true indexer logits: row t selects the topk largest
  /// z over the keys of its own sequence that its bottom-right-aligned causal
  /// mask lets it see, s < t + (S_kv - S_q) + 1 (s <= t when S_q == S_kv; with
  /// S_q > S_kv the first S_q - S_kv rows see none), -1 where fewer exist.
  causal_topk = 0,
  /// A random permutation of the sequence's keys (no duplicates), -1 where
  /// S_kv < topk. For stress tests.
  random_permutation = 1,
};

struct GenerateSpec {
  Layout layout = Layout::bshd;
  int64_t batch = 1, s_q = 128, s_kv = 128;  // BSHD sizes
  std::vector<int64_t> seqlens_q, seqlens_k; // THD: per-sequence lengths (batch ignored)
  int64_t heads = 64, head_dim = 128, topk = 64;
  IdPattern ids = IdPattern::causal_topk;
  IdMode id_mode = IdMode::local;  // ids written as local or global
  bool weights_f32 = false;        // weights dtype f32 instead of bf16
  float sm_scale = 0.0f;           // 0: 1/sqrt(head_dim)
  uint64_t seed = 0;
  int32_t num_threads = 0;
};

struct GeneratedProblem {
  GenerateSpec spec;
  float sm_scale = 1.0f;
  HostTensor index_q, weights, index_k, topk_indices, attn_score, index_score, cu_seqlens_q, cu_seqlens_k;
  /// Views of the tensors above (cu_seqlens absent for BSHD).
  IndexerInputs inputs() const;
  /// Options matching the spec: layout, id_mode, sm_scale.
  IndexerOptions options() const;
};

/// Draws q, k ~ N(0,1) and w ~ N(0,1)/sqrt(H) (rounded to bf16), selects ids
/// per spec.ids, sets index_score = softmax of the true logits over the valid
/// slots and attn_score = a genuine sparse-attention distribution over the same
/// slots (random multi-head queries/keys, softmax per head over the selected
/// slots, summed over heads, L1-normalised); 0 at invalid slots.
/// Raises dsaib::Error(invalid_argument) for bad sizes, and
/// dsaib::Error(out_of_memory) before allocating anything when the problem
/// (its tensors and each thread's scratch) needs more host memory than the
/// machine's memory and swap (Linux sysinfo), or, when an allocation fails
/// anyway (a container's cgroup limit or ulimit -v, which sysinfo does not see),
/// after it. Runs with IEEE subnormals whatever the caller's FTZ/DAZ mode
/// (x86-64 and aarch64: src/core/float_mode.hpp).
GeneratedProblem generate_problem(const GenerateSpec& spec);

}  // namespace dsaib
