/* dsaib C ABI: a plain C view of dsaib::indexer_backward (include/dsaib/indexer_backward.hpp).
 * No C++ types cross this boundary. Every function returns a dsaib_status
 * (0 = ok); on failure dsaib_last_error() gives the message of the last error
 * raised on the calling thread (the same text as the C++ exception). */
#ifndef DSAIB_DSAIB_H_
#define DSAIB_DSAIB_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dsaib_status {
  DSAIB_OK = 0,
  DSAIB_INVALID_ARGUMENT = 1,
  DSAIB_UNSUPPORTED = 2,
  DSAIB_INDEX_OUT_OF_RANGE = 3,
  DSAIB_BACKEND_UNAVAILABLE = 4,
  DSAIB_CUDA_ERROR = 5,
  DSAIB_IO_ERROR = 6,
  DSAIB_INTERNAL = 7,
  DSAIB_OUT_OF_MEMORY = 8
} dsaib_status;

/* DSAIB_F64: the cpu backend only (its outputs, and the float inputs docs/api.md lists). */
/* DSAIB_E4M3: float8 e4m3 ("fn": no infinities), indexer_topk's index_q and index_k only. */
typedef enum dsaib_dtype { DSAIB_BF16 = 0, DSAIB_F32 = 1, DSAIB_I32 = 2, DSAIB_F64 = 3, DSAIB_E4M3 = 4 } dsaib_dtype;
typedef enum dsaib_device { DSAIB_CPU = 0, DSAIB_CUDA = 1 } dsaib_device;
typedef enum dsaib_layout { DSAIB_BSHD = 0, DSAIB_THD = 1 } dsaib_layout;
typedef enum dsaib_id_mode { DSAIB_IDS_LOCAL = 0, DSAIB_IDS_GLOBAL = 1 } dsaib_id_mode;
typedef enum dsaib_backend { DSAIB_BACKEND_CPU = 0, DSAIB_BACKEND_CUDA = 1 } dsaib_backend;
typedef enum dsaib_a_operand_precision {
  DSAIB_A_OPERAND_AUTOMATIC = 0, /* bf16x2 when d_index_q or d_index_k is f32, else bf16 */
  DSAIB_A_OPERAND_BF16X2 = 1,
  DSAIB_A_OPERAND_BF16 = 2
} dsaib_a_operand_precision;
typedef enum dsaib_l2_hints {
  DSAIB_L2_HINTS_AUTOMATIC = 0, /* hinted when dK and K outgrow half of the L2 */
  DSAIB_L2_HINTS_ON = 1,
  DSAIB_L2_HINTS_OFF = 2
} dsaib_l2_hints;
typedef enum dsaib_start_stagger {
  DSAIB_START_STAGGER_AUTOMATIC = 0, /* delay the CTAs with a task fewer */
  DSAIB_START_STAGGER_OFF = 1
} dsaib_start_stagger;
typedef enum dsaib_forward_fusion {
  DSAIB_FORWARD_FUSION_AUTOMATIC = 0, /* loss and gradients in one kernel where it applies */
  DSAIB_FORWARD_FUSION_OFF = 1
} dsaib_forward_fusion;

/* A strided tensor view; strides in elements. rank 0 and data NULL = absent. */
typedef struct dsaib_tensor {
  void* data;
  int32_t dtype;  /* dsaib_dtype */
  int32_t rank;   /* 0..4 */
  int64_t shape[4];
  int64_t strides[4];
  int32_t device; /* dsaib_device */
  int32_t device_index;
} dsaib_tensor;

/* P comes either as index_score or, in the P-free form, as row_lse and
   row_target_mass (f32, (B, S_q) / (T_q)) with index_score absent
   (dsaib::IndexerInputs). topk_logits (f32, like topk_indices; the loss
   forward's and the one call's input only): the selected keys' logits as
   dsaib_indexer_topk writes them, so the forward recomputes none. */
typedef struct dsaib_inputs {
  dsaib_tensor index_q, weights, index_k, topk_indices, attn_score, index_score, cu_seqlens_q, cu_seqlens_k;
  dsaib_tensor row_lse, row_target_mass;
  dsaib_tensor topk_logits;
} dsaib_inputs;

typedef struct dsaib_outputs {
  dsaib_tensor d_index_q, d_weights, d_index_k;
} dsaib_outputs;

typedef struct dsaib_options {
  int32_t layout;  /* dsaib_layout */
  int32_t id_mode; /* dsaib_id_mode */
  int32_t backend; /* dsaib_backend */
  float sm_scale;
  float loss_coeff;
  float grad_loss;
  const float* grad_loss_device; /* NULL: use grad_loss */
  int64_t normalization_count;   /* 0: number of query tokens */
  int32_t strict_indices; /* flags here and in the other option structs: 0 false, any other value true, as C's */
  int32_t deterministic;
  void* stream; /* cudaStream_t */
  int32_t num_threads;
  int32_t a_operand_precision; /* dsaib_a_operand_precision (cuda; see dsaib::AOperandPrecision) */
  int32_t l2_hints;            /* dsaib_l2_hints (cuda; see dsaib::L2Hints) */
  int32_t start_stagger;       /* dsaib_start_stagger (cuda; see dsaib::StartStagger) */
  int32_t forward_fusion;      /* dsaib_forward_fusion (cuda loss and gradients; see dsaib::ForwardFusion) */
} dsaib_options;

/* Fills *options with the C++ defaults (bshd, local ids, cpu, sm_scale 1, ...).
   Always start from it: dsaib_options may gain fields at its end between
   versions of this library (0.x: no ABI stability; rebuild against the header
   of the library you link). */
void dsaib_default_options(dsaib_options* options);

/* Fills *view as a row-major contiguous tensor: shape[0..rank) (sizes >= 0,
   element count below 2^63), strides in elements (the last one 1), data not
   read. DSAIB_INVALID_ARGUMENT, *view unchanged and the message naming the
   argument, for: view NULL; rank outside 0..4 (checked before shape); shape
   NULL with rank > 0; dtype or device outside their enums; a negative size;
   sizes whose product overflows (never with a size-0 dimension: the strides of
   such an empty view saturate at INT64_MAX). */
dsaib_status dsaib_contiguous_tensor(dsaib_tensor* view, void* data, dsaib_dtype dtype, const int64_t* shape,
                                     int32_t rank, dsaib_device device, int32_t device_index);

/* *bytes = the scratch memory dsaib_indexer_backward needs, on the backend's
   device: 0 on cpu; on cuda with options->deterministic B*S_kv*D*8 (THD:
   T_k*D*8) rounded up to a multiple of 256, plus 16 (the int64 fixed-point dK
   and its bound); otherwise on cuda B*S_kv*D*4 (THD: T_k*D*4) when d_index_k
   is bf16 (the fp32 dK accumulator), 0 when it is f32. Validates the problem like
   dsaib_indexer_backward and fails with the same statuses; *bytes is
   written only on DSAIB_OK. C++: dsaib::indexer_backward_workspace_size. */
dsaib_status dsaib_indexer_backward_workspace_size(const dsaib_inputs* inputs, const dsaib_outputs* outputs,
                                                   const dsaib_options* options, size_t* bytes);

/* Computes d_index_q, d_weights and d_index_k (shapes, dtypes and the math:
   dsaib::indexer_backward in include/dsaib/indexer_backward.hpp and
   docs/math.md). Absent tensors: rank 0 and data NULL (cu_seqlens for BSHD).
   Every check runs before any output is written; inputs are never modified.
   Statuses: DSAIB_INVALID_ARGUMENT (a tensor's dtype, rank, shape, stride,
   device, alignment or overlap; H, D, topk, a scalar option, cu_seqlens, too
   small a workspace), DSAIB_INDEX_OUT_OF_RANGE (strict_indices and an invalid
   id), DSAIB_BACKEND_UNAVAILABLE,
   DSAIB_CUDA_ERROR, DSAIB_OUT_OF_MEMORY; dsaib_last_error() gives the message.
   workspace: NULL with workspace_bytes 0 lets the cuda backend allocate it
   (stream-ordered); otherwise at least the workspace size, 256-byte aligned,
   on the backend's device. cuda runs asynchronously on options->stream. */
dsaib_status dsaib_indexer_backward(const dsaib_inputs* inputs, const dsaib_outputs* outputs,
                                    const dsaib_options* options, void* workspace, size_t workspace_bytes);

/* Outputs of dsaib_indexer_kl_forward, all f32 (cpu: or f64) and contiguous: loss rank 0
   (shape ()), row_lse and row_target_mass (B, S_q) / (T_q), index_score
   (B, S_q, topk) / (T_q, topk) or absent (P not written). */
typedef struct dsaib_kl_forward_outputs {
  dsaib_tensor loss, row_lse, row_target_mass, index_score;
} dsaib_kl_forward_outputs;

/* *bytes = the scratch memory dsaib_indexer_kl_forward needs on the backend's
   device (0 on cpu). Validates like dsaib_indexer_kl_forward; *bytes is written
   only on DSAIB_OK. C++: dsaib::indexer_kl_forward_workspace_size. */
dsaib_status dsaib_indexer_kl_forward_workspace_size(const dsaib_inputs* inputs, const dsaib_kl_forward_outputs* outputs,
                                                     const dsaib_options* options, size_t* bytes);

/* The forward of the indexer KL loss: the loss, per-row LSE and target mass,
   optionally P (dsaib::indexer_kl_forward in include/dsaib/indexer_kl_forward.hpp).
   inputs->index_score must be absent. Statuses and workspace as for
   dsaib_indexer_backward; every check runs before any output is written. */
dsaib_status dsaib_indexer_kl_forward(const dsaib_inputs* inputs, const dsaib_kl_forward_outputs* outputs,
                                      const dsaib_options* options, void* workspace, size_t workspace_bytes);

/* Outputs of dsaib_indexer_kl_loss_and_grad: loss (f32, cpu: or f64; rank 0) and the three
   gradients as in dsaib_outputs. */
typedef struct dsaib_kl_loss_and_grad_outputs {
  dsaib_tensor loss, d_index_q, d_weights, d_index_k;
} dsaib_kl_loss_and_grad_outputs;

/* *bytes = the scratch memory dsaib_indexer_kl_loss_and_grad needs on the
   backend's device (0 on cpu). C++: dsaib::indexer_kl_loss_and_grad_workspace_size. */
dsaib_status dsaib_indexer_kl_loss_and_grad_workspace_size(const dsaib_inputs* inputs,
                                                           const dsaib_kl_loss_and_grad_outputs* outputs,
                                                           const dsaib_options* options, size_t* bytes);

/* The loss and its gradients in one call (the loss forward, then the P-free
   backward; dsaib::indexer_kl_loss_and_grad in include/dsaib/indexer_kl_loss_and_grad.hpp).
   inputs->index_score, row_lse and row_target_mass must be absent. Statuses
   and workspace as for dsaib_indexer_backward. */
dsaib_status dsaib_indexer_kl_loss_and_grad(const dsaib_inputs* inputs, const dsaib_kl_loss_and_grad_outputs* outputs,
                                            const dsaib_options* options, void* workspace, size_t workspace_bytes);

/* The attention target T (attn_score) from the main attention's tensors
   (dsaib::attention_target in include/dsaib/attention_target.hpp and
   docs/attention-target.md). Absent tensors: rank 0 and data NULL (cu_seqlens
   for BSHD). */
typedef enum dsaib_lse_base {
  DSAIB_LSE_NATURAL = 0, /* lse = log sum exp(sm_scale * s) */
  DSAIB_LSE_BASE2 = 1    /* lse = log2 sum exp2(sm_scale * log2(e) * s) (FlashMLA) */
} dsaib_lse_base;

/* query bf16 (B, S_q, Hq, Dqk) / (T_q, Hq, Dqk); kv bf16 (B, S_kv, Dqk) / (T_k, Dqk);
   lse f32 (cpu: or f64) (B, S_q, Hq) / (T_q, Hq), any strides, or absent (each head's lse over the
   row's selected keys, computed by the library; lse_base not used); topk_indices i32 (B, S_q, topk) /
   (T_q, topk); cu_seqlens_q/k i32 (B + 1) for THD. */
typedef struct dsaib_attention_target_inputs {
  dsaib_tensor query, kv, lse, topk_indices, cu_seqlens_q, cu_seqlens_k;
} dsaib_attention_target_inputs;

/* attn_score f32 (cpu: or f64) (B, S_q, topk) / (T_q, topk), contiguous, disjoint from every input. */
typedef struct dsaib_attention_target_outputs {
  dsaib_tensor attn_score;
} dsaib_attention_target_outputs;

typedef struct dsaib_attention_target_options {
  int32_t layout;   /* dsaib_layout */
  int32_t id_mode;  /* dsaib_id_mode */
  int32_t backend;  /* dsaib_backend */
  float sm_scale;   /* the main attention's softmax scale */
  int32_t lse_base; /* dsaib_lse_base */
  int32_t normalize; /* 1: T = U / sum U per row; 0: U (tensor-parallel partial sums) */
  int32_t strict_indices;
  void* stream; /* cudaStream_t */
  int32_t num_threads;
} dsaib_attention_target_options;

/* Fills *options with the C++ defaults (bshd, local ids, cpu, sm_scale 1,
   natural lse, normalize 1). Always start from it (fields may be added at its end). */
void dsaib_default_attention_target_options(dsaib_attention_target_options* options);

/* *bytes = the scratch memory dsaib_attention_target needs on the backend's
   device (0 on cpu). Validates like dsaib_attention_target; *bytes is written
   only on DSAIB_OK. C++: dsaib::attention_target_workspace_size. */
dsaib_status dsaib_attention_target_workspace_size(const dsaib_attention_target_inputs* inputs,
                                                   const dsaib_attention_target_outputs* outputs,
                                                   const dsaib_attention_target_options* options, size_t* bytes);

/* Computes attn_score. Every check runs before it is written; inputs are never
   modified. Statuses as for dsaib_indexer_backward (the cuda backend needs Hq
   a multiple of 16 up to 128 and Dqk a multiple of 64 up to 576); workspace as
   for dsaib_indexer_backward. cuda runs asynchronously on options->stream. */
dsaib_status dsaib_attention_target(const dsaib_attention_target_inputs* inputs,
                                    const dsaib_attention_target_outputs* outputs,
                                    const dsaib_attention_target_options* options, void* workspace,
                                    size_t workspace_bytes);

/* The indexer's top-k forward: each query row's logits over the keys it sees
   and the topk best of them (dsaib::indexer_topk in include/dsaib/indexer_topk.hpp
   and docs/indexer-topk.md). Absent tensors: rank 0 and data NULL (starts/ends
   together or neither; cu_seqlens for BSHD; the optional outputs). */
typedef enum dsaib_topk_order {
  DSAIB_TOPK_LOGIT_DESCENDING = 0, /* by logit descending, equal logits by id ascending */
  DSAIB_TOPK_ID_ASCENDING = 1      /* by id ascending */
} dsaib_topk_order;

/* dsaib_indexer_topk_options.causal_offset's default: each sequence's S_kv - S_q. */
#define DSAIB_CAUSAL_OFFSET_AUTO (-INT64_MAX - 1)

/* index_q bf16 or e4m3 (B, S_q, H, D) / (T_q, H, D); weights bf16 or f32 (cpu: or f64) (B, S_q, H) / (T_q, H);
   index_k of index_q's dtype (B, S_kv, D) / (T_k, D); any strides with a contiguous last dimension.
   starts, ends i32 (B, S_q) / (T_q), optional: row t sees the keys [starts[t], ends[t]) of its sequence
   (THD: flat rows of index_k); absent: causal rows. cu_seqlens_q/k i32 (B + 1) for THD.
   index_q_scale (B, S_q, H) / (T_q, H) and index_k_scale (B, S_kv) / (T_k), each f32 (cpu: or f64): e4m3 inputs only,
   each optional (dsaib::IndexerTopkInputs). */
typedef struct dsaib_indexer_topk_inputs {
  dsaib_tensor index_q, weights, index_k, starts, ends, cu_seqlens_q, cu_seqlens_k;
  dsaib_tensor index_q_scale, index_k_scale;
} dsaib_indexer_topk_inputs;

/* topk_indices i32 (B, S_q, topk) / (T_q, topk), -1 past each row's count; topk_logits f32 (cpu: or f64)
   shaped like it, -inf past the count (optional); topk_lengths i32 (B, S_q) / (T_q) (optional).
   Contiguous, disjoint from each other and from every input. */
typedef struct dsaib_indexer_topk_outputs {
  dsaib_tensor topk_indices, topk_logits, topk_lengths;
} dsaib_indexer_topk_outputs;

typedef struct dsaib_indexer_topk_options {
  int32_t layout;        /* dsaib_layout */
  int32_t id_mode;       /* dsaib_id_mode */
  int32_t backend;       /* dsaib_backend */
  int32_t order;         /* dsaib_topk_order */
  int64_t causal_offset; /* without starts/ends: row t sees keys [0, t + causal_offset + 1); DSAIB_CAUSAL_OFFSET_AUTO */
  int32_t strict_ranges; /* 1: a range outside its sequence's keys is DSAIB_INDEX_OUT_OF_RANGE; 0: clipped */
  void* stream;          /* cudaStream_t */
  int32_t num_threads;
} dsaib_indexer_topk_options;

/* Fills *options with the C++ defaults (bshd, local ids, cpu, logit order,
   DSAIB_CAUSAL_OFFSET_AUTO, strict_ranges 0). Always start from it (fields may be added at its end). */
void dsaib_default_indexer_topk_options(dsaib_indexer_topk_options* options);

/* *bytes = the scratch memory dsaib_indexer_topk needs on the backend's device
   (0 on cpu). Validates like dsaib_indexer_topk; *bytes is written only on
   DSAIB_OK. C++: dsaib::indexer_topk_workspace_size. */
dsaib_status dsaib_indexer_topk_workspace_size(const dsaib_indexer_topk_inputs* inputs,
                                               const dsaib_indexer_topk_outputs* outputs,
                                               const dsaib_indexer_topk_options* options, size_t* bytes);

/* Computes topk_indices (and topk_logits, topk_lengths when given). Every check
   runs before an output is written; inputs are never modified. Statuses as for
   dsaib_indexer_backward (the cuda backend needs H a multiple of 8 up to 128,
   D 64 or 128, topk up to 8192); workspace as for dsaib_indexer_backward. cuda
   runs asynchronously on options->stream. */
dsaib_status dsaib_indexer_topk(const dsaib_indexer_topk_inputs* inputs, const dsaib_indexer_topk_outputs* outputs,
                                const dsaib_indexer_topk_options* options, void* workspace, size_t workspace_bytes);

/* Message of the last failure of a dsaib_status function on this thread: "" after such a call
 * succeeded (each of them sets it) or before any. Valid until the next such call on this thread. */
const char* dsaib_last_error(void);

/* 1 if the cuda backend is compiled in and a compute-capability-9.0 device is visible. */
int dsaib_cuda_backend_available(void);

#ifdef __cplusplus
}
#endif

#endif /* DSAIB_DSAIB_H_ */
