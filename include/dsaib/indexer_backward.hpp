// dsaib: the training-time backward pass of the DeepSeek Sparse Attention
// "lightning indexer" (DeepSeek-V3.2, GLM-5).
//
// The math implemented is docs/math.md. In short, for every query row t and
// every VALID selected slot i (id in range for the row's sequence):
//
//   c     = grad_loss * loss_coeff / N
//   g_i   = -c * max(T_i, eps) * [P_i >= eps],   eps = exp(-100)
//   gs_i  = g_i - P_i * sum_j g_j                 (dLoss/dz_i)
//   x_hi  = q_h . k_{id_i}
//   dW_h  = sm_scale * sum_i gs_i * relu(x_hi)
//   a_hi  = gs_i * w_h * sm_scale * [x_hi > 0]
//   dQ_h  = sum_i a_hi * k_{id_i}
//   dK_j += sum_h a_hi * q_h   (scatter-add; duplicates add twice)
//
// which is the gradient of Loss = -c * sum_rows sum_valid T~_i log(max(P_i, eps))
// with P = softmax of z_i = sm_scale * sum_h w_h relu(x_hi) over the valid slots.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "dsaib/error.hpp"
#include "dsaib/tensor.hpp"

namespace dsaib {

/// Memory layout of a problem.
enum class Layout : int32_t {
  /// Batched, fixed lengths:
  ///   index_q (B, S_q, H, D), weights (B, S_q, H), index_k (B, S_kv, D),
  ///   topk_indices / attn_score / index_score (B, S_q, topk).
  bshd = 0,
  /// Packed variable lengths ("THD"):
  ///   index_q (T_q, H, D), weights (T_q, H), index_k (T_k, D),
  ///   topk_indices / attn_score / index_score (T_q, topk),
  ///   cu_seqlens_q and cu_seqlens_k int32 (B + 1), starting at 0, non-decreasing,
  ///   ending at T_q and T_k.
  thd = 1,
};

/// How a topk id names a key row.
enum class IdMode : int32_t {
  /// id is a row of the query's own sequence: valid iff 0 <= id < S_kv of that sequence.
  local = 0,
  /// id is a flat row of index_k viewed as (B*S_kv, D) (BSHD) or (T_k, D) (THD):
  /// valid iff it lies in the rows of the query's own sequence.
  global = 1,
};

/// Which implementation runs.
enum class Backend : int32_t {
  cpu = 0,   ///< fp64 reference on the host; always deterministic; all tensors on the host
  cuda = 1,  ///< sm_90a kernels; all tensors on one CUDA device
};

/// cuda: precision of the tensor-core operand a = gs * w * sm_scale * [q.k > 0]
/// (docs/math.md stage 2) in the dK and dQ GEMMs. wgmma takes it in bf16: one
/// bf16 term is within bf16 outputs' error budget but not fp32 outputs'; two
/// terms (a = a_hi + a_lo) run those GEMMs twice. d_index_k and d_index_q only;
/// the cpu backend ignores it. Errors and cost: docs/api.md.
enum class AOperandPrecision : int32_t {
  /// bf16x2 when d_index_q or d_index_k is f32, bf16 when both are bf16.
  automatic = 0,
  /// always two bf16 terms (most accurate, slower)
  bf16x2 = 1,
  /// always one bf16 term (fastest; do not combine with fp32 outputs that need 1e-3)
  bf16 = 2,
};

const char* layout_name(Layout);
/// "auto", "bf16x2" or "bf16".
const char* a_operand_precision_name(AOperandPrecision);
/// Parses a_operand_precision_name's words; false (and *out unchanged) for anything else.
bool parse_a_operand_precision(const std::string& word, AOperandPrecision* out);
const char* id_mode_name(IdMode);
const char* backend_name(Backend);

/// cuda: L2 eviction-policy hints on the backward kernel's d_index_k reductions.
/// When dK and K outgrow the L2, lines of the fp32 dK accumulator are evicted
/// between two atomic adds to them; the hinted kernel gives part of the adds an
/// evict_last priority (the share follows the context's persisting-L2
/// set-aside). Results are the same either way up to the order of the fp32
/// additions. Split-a (bf16x2) and deterministic launches never take it; the
/// cpu backend ignores it. When it pays: docs/api.md.
enum class L2Hints : int32_t {
  /// hinted when the key rows that the CTAs in flight can touch need more than
  /// half of the L2 for dK (fp32) and K (bf16), or when the persisting set-aside
  /// holds all of that dK and dK and K need more than half of the rest of the L2.
  automatic = 0,
  /// always hinted (one-term launches)
  on = 1,
  /// never hinted
  off = 2,
};

/// cuda: delayed start of the persistent CTAs that run one task fewer. When the
/// tasks do not divide evenly over the persistent grid, the CTAs with a task
/// fewer start up to 3/4 of a task late, spread over 32 steps, so the grid's
/// CTAs do not run the same phase (loads, gathers, reductions) at the same time.
/// Only launches of at least 4 waves with a remainder are delayed. Results are
/// the same either way up to the order of the fp32 additions. The cpu backend
/// ignores it.
enum class StartStagger : int32_t {
  /// delays as above
  automatic = 0,
  /// no delays
  off = 1,
};

/// cuda, indexer_kl_loss_and_grad(): whether the loss forward's pass over a
/// row runs inside the backward kernel (src/hopper/loss_and_grad/loss_and_grad_kernel.cuh:
/// one launch, the forward's gathers and GEMM under the backward's dK
/// reductions) or as a kernel of its own before it. Results are the same
/// either way (the loss, d_index_q and d_weights bitwise for the same grid;
/// d_index_k up to the order of its fp32 additions). The other entry points
/// and the cpu backend ignore it.
enum class ForwardFusion : int32_t {
  /// one kernel where it applies: H <= 64, one A term, not deterministic
  automatic = 0,
  /// two kernels: the loss forward, then the P-free backward
  off = 1,
};

/// "auto", "on" or "off".
const char* l2_hints_name(L2Hints);
/// Parses l2_hints_name's words; false (and *out unchanged) for anything else.
bool parse_l2_hints(const std::string& word, L2Hints* out);
/// "auto" or "off".
const char* start_stagger_name(StartStagger);
/// Parses start_stagger_name's words; false (and *out unchanged) for anything else.
bool parse_start_stagger(const std::string& word, StartStagger* out);
/// "auto" or "off".
const char* forward_fusion_name(ForwardFusion);
/// Parses forward_fusion_name's words; false (and *out unchanged) for anything else.
bool parse_forward_fusion(const std::string& word, ForwardFusion* out);

/// Input tensors (never modified): index_q, weights, index_k, topk_indices,
/// attn_score (the target T), index_score (the prediction P), cu_seqlens_q/k
/// (THD only), row_lse and row_target_mass (the P-free form). Shapes, dtypes,
/// strides and alignment: docs/api.md, "The problem".
///
/// H must be a multiple of 8 in [8, 128]; D must be 64 or 128; topk >= 1.
/// Any slot whose id is invalid (-1, or out of range for its sequence) is
/// ignored: its T and P count as 0 and no memory is touched for it.
///
/// P comes in one of two forms, exactly one of which is given:
/// - index_score: P itself (row_lse and row_target_mass absent);
/// - the P-free form: row_lse and row_target_mass (index_score absent), as
///   indexer_kl_forward() writes them. The backward then rebuilds
///   P_i = exp(z_i - row_lse) from its own logits
///   z_i = sm_scale * sum_h w_h relu(q_h . k_{id_i}), masks with that P
///   (m_i = [P_i >= eps]) and takes G = -c * row_target_mass, so no
///   (S_q, topk) tensor of P exists anywhere. A row without a valid slot
///   reads neither value. The rebuilt P carries the rounding of the f32
///   row_lse, the same factor sum_i P_i for every slot of the row, so
///   row_target_mass is sum_i T~_i m_i divided by sum_i P_i (both with this
///   rebuilt P): G / sum_i P_i times P_i is then exact to rounding.
///   indexer_kl_forward() writes it so (docs/kl-forward.md); statistics with
///   an exact LSE (sum_i P_i = 1) are the plain target mass.
///
/// topk_logits (optional; the inputs of indexer_kl_forward() and
/// indexer_kl_loss_and_grad() only, checked as they check it by
/// validate_indexer_kl_loss_inputs(); every other entry point refuses it): f32
/// (cpu: or f64), shaped like topk_indices, innermost stride 1 on the cuda
/// backend: the index logit I_i = sum_h w_h relu(q_h . k_{id_i}) of each
/// selected key, without sm_scale, as indexer_topk() writes them into its
/// topk_logits output. The forward then takes z_i = sm_scale * topk_logits_i
/// instead of gathering the keys and recomputing them (docs/kl-forward.md,
/// "From the top-k's logits"); validity still comes from the ids, and slots
/// that are invalid are not read. The backward always recomputes its logits.
struct IndexerInputs {
  TensorView index_q;
  TensorView weights;
  TensorView index_k;
  TensorView topk_indices;
  TensorView attn_score;
  TensorView index_score;
  TensorView cu_seqlens_q;
  TensorView cu_seqlens_k;
  TensorView row_lse;
  TensorView row_target_mass;
  TensorView topk_logits;
};

/// Output tensors, each bf16 or f32 (cpu: or f64, the fp64 results unrounded),
/// shaped like index_q, weights and index_k,
/// and contiguous. Every element is overwritten (rows whose slots are all
/// invalid get 0; key rows never selected get 0); incoming contents never matter.
/// Outputs must not overlap each other or any input (the 4 bytes at grad_loss_device included).
struct IndexerBackwardOutputs {
  TensorView d_index_q;
  TensorView d_weights;
  TensorView d_index_k;
};

struct IndexerOptions {
  Layout layout = Layout::bshd;
  IdMode id_mode = IdMode::local;
  Backend backend = Backend::cpu;
  /// Multiplies every logit. Any finite value.
  float sm_scale = 1.0f;
  /// Loss weight. Any finite value.
  float loss_coeff = 1.0f;
  /// Upstream gradient of the loss, used when grad_loss_device is null. Finite.
  float grad_loss = 1.0f;
  /// If non-null: a single f32 read at run time from memory on the backend's
  /// device (host memory for cpu), so CUDA-graph replays may change it.
  /// cpu: must be finite (checked before anything is written); cuda: not
  /// checked (reading it would synchronise), a non-finite value gives
  /// non-finite gradients.
  const float* grad_loss_device = nullptr;
  /// N in c = grad_loss * loss_coeff / N. 0 means "number of query tokens"
  /// (B*S_q for BSHD, T_q for THD). Must be >= 0.
  int64_t normalization_count = 0;
  /// If true, the first invalid id raises ErrorCode::index_out_of_range naming
  /// (b, t, slot, id) before anything is written. (cuda: costs one device
  /// scan and a host synchronisation.)
  bool strict_indices = false;
  /// Require bitwise run-to-run reproducible outputs. The cpu backend always is.
  /// The cuda backend's d_index_q and d_weights always are; its d_index_k is by
  /// default accumulated with fp32 atomics, whose order varies from run to run.
  /// With deterministic=true, cuda accumulates d_index_k in 64-bit fixed point
  /// instead (a bound pass sets the scale, integer sums do not depend on the
  /// order; the rounding is far below the fp32 output's), for twice the
  /// reduction bytes and a larger workspace (docs/api.md, "Determinism").
  bool deterministic = false;
  /// cuda: the cudaStream_t to run on (nullptr = legacy default stream).
  void* stream = nullptr;
  /// cpu: worker threads (0 = std::thread::hardware_concurrency()).
  int32_t num_threads = 0;
  /// cuda: precision of the a operand of the dK/dQ GEMMs (see AOperandPrecision).
  AOperandPrecision a_operand_precision = AOperandPrecision::automatic;
  /// cuda: L2 hints on the d_index_k reductions (see L2Hints).
  L2Hints l2_hints = L2Hints::automatic;
  /// cuda: delayed start of the CTAs with a task fewer (see StartStagger).
  StartStagger start_stagger = StartStagger::automatic;
  /// cuda, indexer_kl_loss_and_grad(): one kernel or two (see ForwardFusion).
  ForwardFusion forward_fusion = ForwardFusion::automatic;
};

/// The names these types had when the backward was the only entry point.
using IndexerBackwardInputs [[deprecated("use dsaib::IndexerInputs")]] = IndexerInputs;
using IndexerBackwardOptions [[deprecated("use dsaib::IndexerOptions")]] = IndexerOptions;

/// Bytes of scratch memory the backend needs for this problem, on the
/// backend's device. cpu: 0. cuda with deterministic: B*S_kv*D*8 (resp.
/// T_k*D*8) rounded up to a multiple of 256, plus 16 (the int64 fixed-point dK
/// and its bound). cuda otherwise: B*S_kv*D*4 (resp. T_k*D*4) when d_index_k
/// is bf16 (the fp32 dK accumulator), 0 when it is f32. The P-free form adds,
/// before it, 8 bytes per query row rounded up to 256 (the statistics packed
/// for the kernel), or with H > 64 or deterministic the loss forward's P,
/// statistics, loss and scratch (docs/api.md).
/// Validates like indexer_backward() and raises the same errors.
std::size_t indexer_backward_workspace_size(const IndexerInputs& inputs,
                                            const IndexerBackwardOutputs& outputs,
                                            const IndexerOptions& options);

/// Computes d_index_q, d_weights and d_index_k.
///
/// All validation happens before any output is written; on any error nothing
/// is written and no input is modified. Raises dsaib::Error:
/// - invalid_argument: wrong dtype/rank/shape/stride/device of any tensor, a
///   null or misaligned pointer, negative sizes, unsupported H/D/topk,
///   non-finite sm_scale/loss_coeff/grad_loss, bad cu_seqlens, overlapping
///   outputs, too small a workspace. The message names the argument and says
///   what was expected and what came.
/// - index_out_of_range: strict_indices and an invalid id (names b, t, slot, id).
/// - backend_unavailable: cuda requested but not built or no device.
/// - cuda_error: a CUDA call failed (after validation).
/// - out_of_memory: validation's host copies could not be allocated (strict
///   mode's topk_indices, cu_seqlens: argument() that tensor; the tables of a
///   huge cu_seqlens: ""), or the cpu backend's fp64 working set could not be allocated
///   (rows*H*(D+1) + key_rows*D doubles for the gradients, and per worker thread
///   about key_rows*D + 2*(H*D + topk) more: argument() is "num_threads" when the
///   per-thread part is most of it, else ""), nothing written; or a CUDA call
///   failed with cudaErrorMemoryAllocation (the workspace allocation comes
///   before any write; a kernel launch failing so late may have zeroed an fp32
///   d_index_k).
///
/// `workspace` must hold indexer_backward_workspace_size() bytes on the
/// backend's device, 256-byte aligned; it may be null when that size is 0,
/// in which case the cuda backend allocates it itself (stream-ordered).
void indexer_backward(const IndexerInputs& inputs, const IndexerBackwardOutputs& outputs,
                      const IndexerOptions& options, void* workspace = nullptr,
                      std::size_t workspace_bytes = 0);

/// The scalar loss whose gradient indexer_backward() computes, evaluated in
/// fp64 on the host from the inputs (cpu tensors only):
///   Loss = -c * sum_rows sum_valid i  max(T_i, eps) * log(max(P_i, eps))
/// where P is recomputed as softmax over valid slots of
///   z_i = sm_scale * sum_h w_h relu(q_h . k_{id_i})
/// when `recompute_p` is true, else taken from index_score.
double indexer_kl_loss(const IndexerInputs& inputs, const IndexerOptions& options,
                       bool recompute_p = true);

/// Whether the cuda backend was compiled in and a device of compute
/// capability 9.0 is present.
bool cuda_backend_available();

/// Runs indexer_backward()'s checks of the inputs and the options, in the same
/// order and with the same errors, and nothing else: no outputs, no workspace,
/// nothing computed or written. For a caller that computes index_score itself
/// (a framework's loss forward computes P) and wants the backward's errors
/// before it starts. index_score may be absent: it is then held to
/// attn_score's rules (dtype f32, shape like topk_indices), which the P that
/// the caller computes will meet. A given topk_logits, which indexer_backward()
/// refuses, is checked last, as indexer_kl_forward() checks it. Like
/// indexer_backward(), it reads cu_seqlens (THD) and, with strict_indices,
/// topk_indices; for the cuda backend through a copy to the host on
/// options.stream, waited for.
void validate_indexer_kl_loss_inputs(const IndexerInputs& inputs, const IndexerOptions& options);

}  // namespace dsaib
