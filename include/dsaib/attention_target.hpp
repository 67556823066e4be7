// The attention target T (attn_score) of the indexer KL loss, computed from the
// main attention's own tensors (MLA in its absorbed form: every head of a query
// row attends to one shared latent key row per token), docs/attention-target.md.
//
// Per query row t and VALID selected slot i with key row j (validity as for
// indexer_backward(): the id lies in the row's own sequence; invalid slots are
// never dereferenced):
//
//   U_i = sum_h exp(sm_scale * (query[t, h, :] . kv[j, :]) - lse[t, h])     (lse natural)
//   U_i = sum_h exp2(sm_scale * log2(e) * (query[t, h, :] . kv[j, :]) - lse[t, h])   (lse base 2)
//   T_i = U_i / sum_i' U_i'          (normalize = true; a row whose sum is 0 gives 0)
//
// and 0 at invalid slots. lse[t, h] is the main attention's log-sum-exp of
// query row t, head h (FlashMLA writes it in base 2). With the heads split
// across tensor-parallel ranks, each rank computes the unnormalised U over its
// heads (normalize = false), the ranks all-reduce U, and the caller divides by
// each row's sum.
//
// lse absent: lse[t, h] = log sum_{valid i} exp(sm_scale * (query[t, h, :] .
// kv[j_i, :])) over the row's valid slots (each head's softmax over the
// selected keys, Megatron-Core's sparse indexer loss), then U and T as above
// (natural); lse_base is not used. A row without a valid slot gives 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dsaib/indexer_backward.hpp"

namespace dsaib {

/// The base of the lse input's logarithm.
enum class LseBase : int32_t {
  natural = 0,  ///< lse = log sum exp(sm_scale * s)
  base2 = 1,    ///< lse = log2 sum exp2(sm_scale * log2(e) * s) (FlashMLA)
};
const char* lse_base_name(LseBase);                         // "natural", "base2"
bool parse_lse_base(const std::string& word, LseBase* out);  // false, *out unchanged, otherwise

/// Inputs of attention_target(): query (Hq heads of width Dqk), kv, lse,
/// topk_indices, cu_seqlens_q/k (THD only). Shapes and dtypes:
/// docs/attention-target.md, "Shapes". query, kv and topk_indices are
/// contiguous; lse may have any strides (a transposed view of a (B, Hq, S_q) or
/// (Hq, T_q) tensor is accepted as is), or be absent (the target computes it
/// over each row's selected keys).
struct AttentionTargetInputs {
  TensorView query;
  TensorView kv;
  TensorView lse;
  TensorView topk_indices;
  TensorView cu_seqlens_q;
  TensorView cu_seqlens_k;
};

/// attn_score: f32 (cpu: or f64, unrounded), (B, S_q, topk) / (T_q, topk), contiguous, disjoint from
/// every input. Every element is overwritten.
struct AttentionTargetOutputs {
  TensorView attn_score;
};

struct AttentionTargetOptions {
  Layout layout = Layout::bshd;
  IdMode id_mode = IdMode::local;
  Backend backend = Backend::cpu;
  /// The main attention's softmax scale (multiplies query . kv). Finite.
  float sm_scale = 1.0f;
  /// The base of a given lse; not used when lse is absent.
  LseBase lse_base = LseBase::natural;
  /// true: T = U / sum U per row; false: U itself (for a tensor-parallel all-reduce).
  bool normalize = true;
  /// As IndexerOptions::strict_indices.
  bool strict_indices = false;
  /// cuda: the cudaStream_t to run on (nullptr = legacy default stream).
  void* stream = nullptr;
  /// cpu: worker threads (0 = std::thread::hardware_concurrency()).
  int32_t num_threads = 0;
};

/// Bytes of scratch memory attention_target() needs on the backend's device.
/// Validates like attention_target() and raises the same errors.
std::size_t attention_target_workspace_size(const AttentionTargetInputs& inputs,
                                            const AttentionTargetOutputs& outputs,
                                            const AttentionTargetOptions& options);

/// Computes attn_score. cpu: any Hq >= 1 and Dqk >= 1. cuda (sm_90a): Hq a
/// multiple of 16 up to 128, Dqk a multiple of 64 up to 576; THD captures in a
/// CUDA graph (cu_seqlens checked on the device while capturing), no host sync.
/// All validation happens before any output is written; errors as
/// indexer_backward(), naming the argument. `workspace` as for indexer_backward().
void attention_target(const AttentionTargetInputs& inputs, const AttentionTargetOutputs& outputs,
                      const AttentionTargetOptions& options, void* workspace = nullptr,
                      std::size_t workspace_bytes = 0);

/// attn_score in fp64 on the host (cpu tensors), row-major (num_q_rows, topk).
struct ReferenceAttentionTarget {
  int64_t num_q_rows = 0, topk = 0;
  std::vector<double> attn_score;
};
/// Raises the input and option errors of attention_target(); options.backend is ignored.
ReferenceAttentionTarget reference_attention_target(const AttentionTargetInputs& inputs,
                                                    const AttentionTargetOptions& options);

}  // namespace dsaib
