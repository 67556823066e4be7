// The resolved geometry of a validated problem, shared by every backend.
// Produced only by validate_problem() (src/core/validate.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dsaib/indexer_backward.hpp"

namespace dsaib::detail {

/// A validated problem: sizes, per-sequence row ranges and the scale c.
///
/// Rows are FLAT: query row r in [0, num_q_rows) and key row j in
/// [0, num_k_rows). For BSHD, query row r = b*S_q + t and key row j = b*S_kv + s;
/// for THD they are the packed rows. Element offsets go through the strides of
/// the views (see q_row_offset() etc.), so non-contiguous inputs are read
/// correctly by the cpu backend.
struct ProblemGeometry {
  Layout layout = Layout::bshd;
  IdMode id_mode = IdMode::local;
  int64_t batch = 0;       // B (number of sequences)
  int64_t heads = 0;       // H
  int64_t head_dim = 0;    // D
  int64_t topk = 0;
  int64_t num_q_rows = 0;  // B*S_q or T_q
  int64_t num_k_rows = 0;  // B*S_kv or T_k
  int64_t s_q = 0;         // BSHD only
  int64_t s_kv = 0;        // BSHD only
  // Per sequence, in flat rows; empty for BSHD without query rows (loop over
  // their size, not over batch).
  std::vector<int64_t> q_start, q_len;
  std::vector<int64_t> k_start, k_len;
  std::vector<int32_t> seq_of_q_row;    // (num_q_rows) sequence of each flat query row
  int64_t normalization_count = 0;      // N
  /// THD on a cuda stream that is capturing a CUDA graph: cu_seqlens were not
  /// read on the host (a copy would invalidate the capture). The per-sequence
  /// tables then describe one sequence of all rows (they only tune the launch)
  /// and the cuda backend checks cu_seqlens on the device
  /// (src/hopper/common/device_cu_seqlens.hpp).
  bool cu_seqlens_on_device_only = false;

  /// Flat key row for slot id of a query in sequence b, or -1 if the slot is invalid.
  int64_t key_row(int64_t b, int64_t id) const {
    if (id_mode == IdMode::local) {
      return (id >= 0 && id < k_len[b]) ? k_start[b] + id : -1;
    }
    return (id >= k_start[b] && id < k_start[b] + k_len[b]) ? id : -1;
  }
  /// (b, t) of a flat query row, t local to its sequence.
  void q_row_coords(int64_t r, int64_t* b, int64_t* t) const {
    *b = seq_of_q_row[r];
    *t = r - q_start[*b];
  }
};

/// Element offsets of the first element of a flat row, in elements, for a view
/// whose leading dims are (B, S, ...) in BSHD or (T, ...) in THD.
inline int64_t row_offset(const TensorView& v, Layout layout, int64_t row, int64_t rows_per_seq) {
  if (layout == Layout::bshd) {
    return (row / rows_per_seq) * v.strides[0] + (row % rows_per_seq) * v.strides[1];
  }
  return row * v.strides[0];
}

/// The option rules checked first (errors.md "Options"): layout, id_mode and
/// backend are values of their enums. Raises invalid_argument naming the option.
void check_options(const IndexerOptions& opt);

/// The cuda backend's limit: key rows (and topk) below 2^31, since its kernels
/// address key rows with int32. Raises invalid_argument naming index_k.
/// validate_problem() applies it on the cuda backend.
void check_cuda_key_rows(const ProblemGeometry& g);

/// Validates every argument (see indexer_backward() for the rules) and returns
/// the geometry. Reads cu_seqlens and, in strict mode, topk_indices: on the host
/// in place through their strides (only their elements); from the device in one
/// piece when the view's byte span is at most twice its elements' bytes plus
/// 1 MiB (the span, gaps included, lies within the view's bounding box), else
/// one pitched copy per group of evenly spaced rows (all rows, or each batch's;
/// overlapping rows as their group's span), never the memory between rows.
/// Never writes anything.
/// `copy_to_host` copies `rows` rows of `row_bytes` bytes, `src_pitch` bytes
/// apart in the backend's device memory, to consecutive rows at `dst` on the
/// host (cudaMemcpy2DAsync's semantics; rows = 1: one piece), ordered after the
/// work already queued on `stream` (opt.stream) and waited for (null: the
/// tensors are host memory and are read directly).
using CopyToHost = void (*)(void* dst, const void* src, std::size_t row_bytes, std::size_t src_pitch,
                            std::size_t rows, void* stream);
/// `stream_capturing`: the cuda backend's options.stream is capturing a CUDA
/// graph; THD cu_seqlens are then not read (ProblemGeometry::cu_seqlens_on_device_only)
/// and strict_indices is refused.
ProblemGeometry validate_problem(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                 const IndexerOptions& opt, CopyToHost copy_to_host = nullptr,
                                 bool check_outputs = true, bool stream_capturing = false);

/// The rule of a given topk_logits (the loss forward's and the one call's
/// input; IndexerInputs): f32 (cpu: or f64), shaped like topk_indices (`g`),
/// innermost stride 1 on the cuda backend. Absent: nothing to check.
void check_topk_logits(const IndexerInputs& in, const IndexerOptions& opt, const ProblemGeometry& g);

/// c = grad_loss * loss_coeff / N with grad_loss taken from the host value.
double scale_from_host(const ProblemGeometry& g, const IndexerOptions& opt, double grad_loss);

}  // namespace dsaib::detail

#include "dsaib/indexer_kl_forward.hpp"

namespace dsaib::detail {

/// Validates the arguments of indexer_kl_forward(): the options, the inputs by
/// validate_problem()'s rules with index_score absent, then the outputs (f32,
/// shapes, contiguity, disjoint from each other and from every input). Never writes.
ProblemGeometry validate_kl_forward_problem(const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                                            const IndexerOptions& opt, CopyToHost copy_to_host = nullptr);

}  // namespace dsaib::detail

#include "dsaib/indexer_kl_loss_and_grad.hpp"

namespace dsaib::detail {

/// Validates the arguments of indexer_kl_loss_and_grad(): index_score, row_lse
/// and row_target_mass absent, the inputs and the gradients by validate_problem()'s
/// rules, then loss (f32, rank 0, disjoint from the gradients and every input).
ProblemGeometry validate_kl_loss_and_grad_problem(const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                                                  const IndexerOptions& opt, CopyToHost copy_to_host,
                                                  bool stream_capturing);

}  // namespace dsaib::detail
