// The lightning indexer's forward: its logits over every key a query row may
// see, and the topk best of them (docs/indexer-topk.md).
//
// For query row t and every key s visible to it:
//
//   I[t, s]         = sum_h weights[t, h] * ReLU(index_q[t, h, :] . index_k[s, :])
//   topk_indices[t] = the topk keys s in [start_t, end_t) with the largest I[t, s]
//
// weights already carry any scale (DeepSeek-V3.2 folds H^-0.5 * D^-0.5 into
// them); there is no sm_scale here.
//
// Order. Keys are ranked by I descending, and keys with equal I by id
// ascending, so the selection is one total order: the returned set is unique
// and bitwise the same on every run and grid. -0.0 ranks as +0.0. A NaN logit
// ranks above +inf (as torch.topk ranks it), NaNs among themselves by id; a NaN
// in index_q, weights or index_k therefore reaches the selected logits, and a
// loss computed from them, instead of being dropped.
//
// Exactness. The set is the exact top-k of the logits as the backend computes
// them: fp64 on the cpu backend, fp32 accumulation of the bf16 products on the
// cuda backend. Against exact arithmetic, an fp32 logit differs by at most
//   beta[t, s] = 2^-21 * (D + H) * sum_h |weights[t, h]| * sum_d |index_q[t, h, d] * index_k[s, d]|
// (e4m3 inputs: 2^-21 * (17 D + H + 2) * |index_k_scale[s]| * sum_h |weights[t, h] * index_q_scale[t, h]|
//  * sum_d |index_q[t, h, d] * index_k[s, d]|: the two scale products rounded once each, and Hopper's
//  fp8 wgmma accumulating each k32 block with fewer mantissa bits than fp32, 2^-12 per block)
// so the cuda set can differ from the fp64 one only by keys whose logits lie
// within the sum of their two bounds (check_indexer_topk()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "dsaib/indexer_backward.hpp"

namespace dsaib {

/// The order of each row's selected keys in topk_indices.
enum class TopkOrder : int32_t {
  /// by logit descending, equal logits by id ascending (the rank order above)
  logit_descending = 0,
  /// by id ascending (FlashMLA's sparse kernels read them so)
  id_ascending = 1,
};
/// "logit_descending", "id_ascending".
const char* topk_order_name(TopkOrder);
/// Parses topk_order_name's words; false (and *out unchanged) for anything else.
bool parse_topk_order(const std::string& word, TopkOrder* out);

/// options.causal_offset's default: each sequence's S_kv - S_q (its query rows
/// are its last S_q positions).
inline constexpr int64_t kCausalOffsetAuto = std::numeric_limits<int64_t>::min();

/// Inputs of indexer_topk() (never modified).
///
/// - index_q: bf16 or e4m3, (B, S_q, H, D) BSHD or (T_q, H, D) THD;
/// - weights: bf16 or f32 (cpu: or f64, read as it is), (B, S_q, H) or (T_q, H);
/// - index_k: of index_q's dtype, (B, S_kv, D) or (T_k, D);
/// - index_q_scale, index_k_scale (e4m3 only, each optional; absent: 1): f32
///   (cpu: or f64), (B, S_q, H) / (T_q, H) and (B, S_kv) / (T_k): the
///   per-token (and, for queries, per-head) scales of the float8 form that
///   cuDNN's SM90 fp8 indexer and DeepGEMM take. The logit is then
///     I[t, s] = index_k_scale[s] * sum_h weights[t, h] * index_q_scale[t, h]
///                                      * ReLU(index_q[t, h, :] . index_k[s, :])
///   (for non-negative scales, the bf16 formula on the dequantised inputs);
/// - starts, ends: int32, (B, S_q) or (T_q), both present or both absent. Row
///   t sees the keys [starts[t], ends[t]), in the key coordinates of its own
///   sequence's keys: BSHD positions 0..S_kv of its batch; THD flat rows of
///   index_k, inside [cu_seqlens_k[b], cu_seqlens_k[b + 1]). This is
///   Megatron-Core's form; it covers causal rows, packed sequences and a
///   context-parallel shard's rows against all-gathered keys. Absent: causal,
///   row t (0-based in its sequence) sees the keys [0, t + causal_offset + 1)
///   of its sequence, clipped to the sequence.
/// - cu_seqlens_q, cu_seqlens_k: THD only, as for indexer_backward().
///
/// Strided views are taken as they are (Megatron's sequence-first [sq, b, H, D]
/// tensors need no copy): index_q, weights, index_k, starts and ends may have
/// any strides with a contiguous last dimension; the cuda backend also needs the other
/// strides of index_q and index_k to be multiples of 8 elements and their
/// pointers 16-byte aligned.
struct IndexerTopkInputs {
  TensorView index_q;
  TensorView weights;
  TensorView index_k;
  TensorView starts;
  TensorView ends;
  TensorView cu_seqlens_q;
  TensorView cu_seqlens_k;
  TensorView index_q_scale;
  TensorView index_k_scale;
};

/// Outputs, contiguous, on the backend's device, disjoint from each other and
/// from every input; every element is overwritten.
///
/// - topk_indices: int32, (B, S_q, topk) or (T_q, topk); its last dimension is
///   topk (>= 1). Ids as options.id_mode says (local: the key's position in its
///   sequence; global: its flat row of index_k viewed as (B*S_kv, D) or
///   (T_k, D)), in options.order; -1 in the slots past a row's count.
/// - topk_logits (optional): f32 (cpu: or f64), shaped like topk_indices: I of
///   each selected key (the value the selection ranked), -inf past the count.
/// - topk_lengths (optional): int32, (B, S_q) or (T_q): each row's count,
///   min(topk, number of keys it sees).
struct IndexerTopkOutputs {
  TensorView topk_indices;
  TensorView topk_logits;
  TensorView topk_lengths;
};

struct IndexerTopkOptions {
  Layout layout = Layout::bshd;
  IdMode id_mode = IdMode::local;
  Backend backend = Backend::cpu;
  TopkOrder order = TopkOrder::logit_descending;
  /// Without starts/ends: row t of a sequence sees its keys [0, t + causal_offset + 1).
  /// kCausalOffsetAuto: S_kv - S_q of each sequence. Ignored with starts/ends.
  int64_t causal_offset = kCausalOffsetAuto;
  /// With starts/ends: false (default) takes each row's [start, end) as it
  /// lies within its sequence's keys (a range reaching outside is clipped to
  /// them; start >= end is an empty row), reading nothing on the host. true
  /// raises ErrorCode::index_out_of_range naming (b, t, start, end) for the
  /// first row whose range is not 0 <= start <= end <= its sequence's key
  /// count (BSHD coordinates; THD in flat rows), before anything is written
  /// (cuda: one copy to the host and a synchronisation; refused while the
  /// stream captures a CUDA graph).
  bool strict_ranges = false;
  /// cuda: the cudaStream_t to run on (nullptr = legacy default stream).
  void* stream = nullptr;
  /// cpu: worker threads (0 = std::thread::hardware_concurrency()).
  int32_t num_threads = 0;
};

/// Bytes of scratch memory indexer_topk() needs on the backend's device (cpu: 0).
/// Validates like indexer_topk() and raises the same errors.
std::size_t indexer_topk_workspace_size(const IndexerTopkInputs& inputs, const IndexerTopkOutputs& outputs,
                                        const IndexerTopkOptions& options);

/// Runs indexer_topk()'s checks of the inputs and the options for a selection
/// of `topk` keys per row, in the same order and with the same errors (`topk`
/// named "topk"), and nothing else: no outputs, no workspace, nothing computed
/// or written. For a caller that wants the call's errors before it starts (a
/// context-parallel rank, before the exchange of the keys). Like indexer_topk(),
/// it reads cu_seqlens (THD) and, with strict_ranges, starts and ends; for the
/// cuda backend through a copy to the host on options.stream, waited for.
void validate_indexer_topk_inputs(const IndexerTopkInputs& inputs, int64_t topk, const IndexerTopkOptions& options);

/// Computes topk_indices and, when given, topk_logits and topk_lengths.
/// cpu: any H >= 1, D >= 1, topk >= 1, bf16 or e4m3 inputs, logits in fp64.
/// cuda (sm_90a): H a multiple of 8 up to 128, D 64 or 128 (e4m3: 128), topk up to 8192; no host
/// synchronisation (unless strict_ranges or THD cu_seqlens are read, as for
/// the other entry points), CUDA-graph capturable.
///
/// All validation happens before any output is written; errors as
/// indexer_backward(), naming the argument. `workspace` as for
/// indexer_backward(): null with workspace_bytes 0 lets the cuda backend
/// allocate it (stream-ordered), else at least indexer_topk_workspace_size()
/// bytes, 256-byte aligned.
void indexer_topk(const IndexerTopkInputs& inputs, const IndexerTopkOutputs& outputs,
                  const IndexerTopkOptions& options, void* workspace = nullptr, std::size_t workspace_bytes = 0);

/// The fp64 reference (cpu tensors; options.backend ignored): for every row its
/// exact selection in options.order and the logits and bounds of the selected
/// keys, row-major (num_q_rows, topk), -1 / -inf / 0 past each row's count,
/// and each row's count. Raises indexer_topk()'s input and option errors
/// (topk < 1 names "topk").
struct ReferenceTopk {
  int64_t num_q_rows = 0, topk = 0;
  std::vector<int32_t> topk_indices;  ///< ids as options.id_mode says, -1 past the count
  std::vector<double> topk_logits;    ///< I of each selected key, -inf past the count
  std::vector<double> topk_bounds;    ///< beta of each selected key (the header's bound), 0 past the count
  std::vector<int32_t> topk_lengths;  ///< (num_q_rows): min(topk, keys seen)
};
ReferenceTopk reference_indexer_topk(const IndexerTopkInputs& inputs, const IndexerTopkOptions& options,
                                     int64_t topk);

/// The verdict of check_indexer_topk().
struct TopkCheck {
  bool pass = false;
  int64_t rows = 0;               ///< rows checked
  int64_t exchanged_ids = 0;      ///< ids in the candidate's set and not the reference's (all near-ties)
  int64_t max_logit_error_rows = 0;  ///< rows whose returned logits exceed their bound (0 on a pass)
  double max_logit_error = 0;     ///< max |logit - exact| / beta over returned logits (given topk_logits)
  std::string first_failure;      ///< "" on a pass, else the first row that failed and why
};

/// Checks a candidate selection (host copies of another backend's outputs, in
/// options.layout's shapes; topk_logits and topk_lengths may be absent) against
/// the fp64 reference: each row's count is min(topk, keys seen), its ids are
/// distinct, visible and -1 past the count, in options.order; every id in the
/// candidate's set and not the reference's, and every id the other way round,
/// is a near-tie (exact logits within the sum of their bounds beta of each
/// other, and of the reference's k-th logit); given topk_logits, each lies
/// within its key's beta of the exact logit and (logit_descending) the ids are
/// in the candidate's own logit order, ties by id. NaN logits: the rank rule above.
TopkCheck check_indexer_topk(const IndexerTopkInputs& inputs, const IndexerTopkOptions& options,
                             const IndexerTopkOutputs& candidate);

}  // namespace dsaib
