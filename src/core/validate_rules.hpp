// The rules validate_problem() is built from (src/core/validate.cpp), shared by
// every entry point's validation so that one rule has one implementation and
// one message. Each raises Error(invalid_argument) shaped
//   "<argument>: expected <what>, got <what>"
// and never writes anything.
#pragma once

#include <initializer_list>
#include <string>

#include "core/problem.hpp"

namespace dsaib::detail {

/// Raises Error(invalid_argument, arg, "<arg>: expected <expected>, got <got>").
[[noreturn]] void fail(const std::string& arg, const std::string& expected, const std::string& got);

struct TensorRule {
  const char* name;
  std::initializer_list<DType> dtypes;  ///< on every backend
  int rank;
  /// f64 is taken too on the cpu backend (its fp64 results written unrounded,
  /// or fp64 values read as they are); the cuda backend refuses it by name.
  bool f64_on_cpu = false;
};

/// Checks presence, dtype (`rule.dtypes`, and f64 on the cpu backend when
/// `rule.f64_on_cpu`), rank, non-negative sizes and strides, an addressable
/// extent, null and misaligned pointers, and the device (cuda: `device_index`).
void check_tensor(const TensorView& v, const TensorRule& rule, DeviceType device, int device_index);

/// The leading sizes of `v` equal `expected`; else "<name>: expected shape
/// (<expected>) <meaning>, got shape (...)".
void check_shape(const TensorView& v, const char* name, std::initializer_list<int64_t> expected, const char* meaning);

/// Whether the byte ranges the two views address intersect (absent or empty views: never).
bool overlaps(const TensorView& a, const TensorView& b);

/// `v` is finite; else "<name>: expected a finite value, got <v>".
void check_finite(float v, const char* name);

/// THD: cu_seqlens_q / cu_seqlens_k must be 1-d int32 tensors on `device`;
/// BSHD: both must be absent.
void check_cu_seqlens_views(const TensorView& cu_q, const TensorView& cu_k, bool thd, DeviceType device,
                            int device_index);

/// g's sizes from a (B, S_q, H, D) / (T_q, H, D) query, the (B, S_kv, .) /
/// (T_k, .) keys and the ids' topk (their last dim); their ranks checked before.
void read_problem_sizes(ProblemGeometry& g, const TensorView& q, const TensorView& k, const TensorView& ids, bool thd);

/// The per-sequence tables of `g`, whose layout, id_mode, row counts (and BSHD's
/// batch, s_q, s_kv) are set and whose cu_seqlens views were checked by
/// check_tensor. THD: the lengths of cu_seqlens_q/k (B + 1 >= 1, equal), then
/// their values read through `copy` (null: host memory read in place) and
/// checked (start at 0, non-decreasing, end at num_q_rows / num_k_rows, named
/// by `q_total_name` / `k_total_name` in the message). While `stream_capturing`
/// (and `copy` is given) nothing is read: g.cu_seqlens_on_device_only is set,
/// the tables describe one sequence of all rows, and strict_indices is refused.
void resolve_sequences(ProblemGeometry& g, const TensorView& cu_q, const TensorView& cu_k, bool strict_indices,
                       CopyToHost copy, void* stream, bool stream_capturing, const char* q_total_name,
                       const char* k_total_name);

/// Strict mode: raises Error(index_out_of_range) for the first id in row-major
/// order that is neither -1 nor in its row's sequence. `ids` is topk_indices
/// (rank 3 BSHD / 2 THD); device memory is read through `copy` (see validate_problem()).
void check_strict_ids(const TensorView& ids, const ProblemGeometry& g, CopyToHost copy, void* stream);

}  // namespace dsaib::detail
