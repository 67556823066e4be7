// Shared helpers for the CPU and GPU tests (library dsaib_test_support).
//
//   problems   make_problem(spec): generate_problem() with the defaults the tests
//              like (small, seeded); id mutations (invalid runs, whole rows,
//              duplicates, out-of-range ids) and score refreshes after them.
//   outputs    OutputBuffers: host output tensors of any dtype, poisoned or filled.
//   metrics    ErrorStats compare(output, fp64 reference): rel RMS, max abs error;
//              NaN/Inf never passes.
//   snapshots  Snapshot: a byte copy of a buffer; unchanged() compares.
//   strided    StridedCopy: a copy of a tensor inside a larger buffer, viewed
//              through non-contiguous strides, with NaN / garbage between.
//   processes  run_command: a shell command's exit code and output (CLI tests).
//
// Rows are FLAT query rows (BSHD: b*S_q + t; THD: packed row), as in
// dsaib::ReferenceGradients.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "dsaib/dsaib.h"
#include "dsaib/generate.hpp"
#include "dsaib/host_tensor.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/reference.hpp"

namespace dsaib::test {

// ------------------------------------------------------------ problems ---

/// A small default spec: BSHD, B2, S 24, H8, D64, topk 16, causal ids, 2 threads.
GenerateSpec small_spec(uint64_t seed = 1);
/// small_spec's problem made ragged, at the given shape, id mode and ids: BSHD B 2
/// (S_q 9, S_kv 40), or THD sequences of q {7, 0, 11} and k {40, 3, 26} rows.
GenerateSpec small_ragged_spec(Layout layout, int64_t heads, int64_t head_dim, int64_t topk, IdMode mode,
                               IdPattern ids, uint64_t seed);
/// A ragged problem of any size on all threads: BSHD B 2 (s_q x s_kv), or THD sequences
/// of q {s_q, 0, s_q / 2 + 3} and k {s_kv, 5, s_kv / 2 + 1} rows.
GenerateSpec ragged_spec(Layout layout, int64_t heads, int64_t head_dim, int64_t topk, int64_t s_q, int64_t s_kv,
                         IdMode mode, IdPattern ids, uint64_t seed);

/// generate_problem(spec).
GeneratedProblem make_problem(const GenerateSpec& spec);

/// Number of query rows / key rows / topk of a problem.
int64_t num_q_rows(const GeneratedProblem& p);
int64_t num_k_rows(const GeneratedProblem& p);
int64_t topk(const GeneratedProblem& p);

/// Read/write one id (flat query row, slot).
int32_t get_id(const GeneratedProblem& p, int64_t row, int64_t slot);
void set_id(GeneratedProblem& p, int64_t row, int64_t slot, int32_t id);

enum class Where { start, middle, end };
/// Sets `count` consecutive slots of `row` to -1, at the start, the middle or the end of the row.
void invalidate_run(GeneratedProblem& p, int64_t row, Where where, int64_t count);
/// Sets every slot of `row` to -1.
void invalidate_row(GeneratedProblem& p, int64_t row);
/// Sets slot `slot` of `row` to an id just past the row's sequence (`past` = 0:
/// the first id beyond it; larger values go further), invalid in either id mode.
void set_out_of_range(GeneratedProblem& p, int64_t row, int64_t slot, int32_t past = 0);
/// Copies the id of slot `from` into slot `to` of the same row (a duplicate).
void duplicate_slot(GeneratedProblem& p, int64_t row, int64_t from, int64_t to);

/// The key-row range [begin, end) (flat rows) of the sequence of query row `row`.
void key_range(const GeneratedProblem& p, int64_t row, int64_t* begin, int64_t* end);
/// Whether slot `slot` of `row` holds a valid id under the problem's id mode.
bool slot_valid(const GeneratedProblem& p, int64_t row, int64_t slot);

/// Recomputes index_score as the fp64 softmax of the true logits over the
/// valid slots (0 at invalid slots), via dsaib::reference_index_logits.
void refresh_index_score(GeneratedProblem& p);
/// Zeroes attn_score at invalid slots and L1-normalises it over the valid ones.
void renormalize_attn_score(GeneratedProblem& p);
/// Both of the above: the scores a forward pass would have produced for the current ids.
void refresh_scores(GeneratedProblem& p);

/// Writes `value` into attn_score and index_score at every invalid slot
/// (they must be ignored; use NaN or 1e30 to prove it).
void fill_invalid_scores(GeneratedProblem& p, float value);

/// The same problem with the valid slots of every row moved to the front (in
/// their order) and -1 after them, with T = P = 0 at those -1 slots.
GeneratedProblem compacted(const GeneratedProblem& p);

/// Converts the ids between local and global form (invalid ids become -1);
/// also updates spec.id_mode, so options() follows.
GeneratedProblem with_id_mode(const GeneratedProblem& p, IdMode mode);

// ------------------------------------------------------------- outputs ---

/// Host output buffers shaped for a problem.
struct OutputBuffers {
  HostTensor d_index_q, d_weights, d_index_k;
  IndexerBackwardOutputs views() const;
};
OutputBuffers make_outputs(const GeneratedProblem& p, DType dq = DType::f32, DType dw = DType::f32,
                           DType dk = DType::f32);

/// Fills every element with NaN (bf16/f32) or 0x7fc0... bit patterns (i32).
void poison(HostTensor& t);
/// Fills every element with `value` (converted to the dtype).
void fill(HostTensor& t, double value);
void poison(OutputBuffers& o);

/// Runs the cpu backend on the problem with `options` into fresh poisoned outputs.
OutputBuffers run_cpu(const GeneratedProblem& p, const IndexerOptions& options, DType dq = DType::f32,
                      DType dw = DType::f32, DType dk = DType::f32);

// ------------------------------------------------------------- metrics ---

/// A tensor's elements as doubles, read through its strides, in row-major order.
std::vector<double> to_doubles(const TensorView& v);
std::vector<double> to_doubles(const HostTensor& t);

struct ErrorStats {
  double rel_rms = 0;      ///< ||out - ref||_2 / ||ref||_2 (0/0 = 0; x/0 = inf; inf if any non-finite output)
  double max_abs = 0;      ///< max |out - ref| (inf if any non-finite output)
  double max_abs_ref = 0;  ///< max |ref|
  bool all_finite = true;  ///< every output element finite
  int64_t count = 0;       ///< elements compared
  /// all_finite && rel_rms <= tol (NaN never passes).
  bool ok(double tol) const { return all_finite && rel_rms <= tol; }
  std::string str() const;
};
/// Compares a bf16/f32 output (any strides) against fp64 reference values in row-major order.
ErrorStats compare(const TensorView& out, const std::vector<double>& ref);
ErrorStats compare(const HostTensor& out, const std::vector<double>& ref);

/// Whether two host tensors have the same dtype, shape and bytes.
bool bitwise_equal(const HostTensor& a, const HostTensor& b);

// ----------------------------------------------------------- snapshots ---

/// A byte copy of memory; unchanged() says whether it still holds the same bytes.
class Snapshot {
 public:
  Snapshot(const void* data, std::size_t bytes);
  explicit Snapshot(const HostTensor& t);
  /// Every byte a view can address (from its lowest to its highest element); absent views: none.
  explicit Snapshot(const TensorView& v);
  bool unchanged() const;

 private:
  const unsigned char* data_ = nullptr;
  std::vector<unsigned char> copy_;
};

/// Snapshots of every tensor of a problem and of output buffers.
class SnapshotAll {
 public:
  SnapshotAll(const GeneratedProblem& p, const OutputBuffers& o);
  /// Names of the tensors whose bytes changed ("" = none).
  std::string changed() const;

 private:
  std::vector<std::pair<std::string, Snapshot>> snaps_;
};

// ------------------------------------------------------------- strided ---

/// A copy of `src` stored inside a larger buffer and viewed with strides:
/// dimension i is stored with step[i] (1 = dense) and padded by pad[i] extra
/// elements; the gaps hold NaN (floats) or `gap_id` (i32).
struct StridedCopy {
  HostTensor storage;
  TensorView view;
};
StridedCopy strided_copy(const HostTensor& src, const std::vector<int64_t>& step, const std::vector<int64_t>& pad,
                         int32_t gap_id = 0);

// ----------------------------------------------------------- processes ---

struct CommandResult {
  int exit_code = -1;  // -1: did not exit normally (crashed)
  std::string output;  // what the command wrote to stdout (redirect stderr in `command` to capture it)
};
/// Runs `command` through /bin/sh (popen).
CommandResult run_command(const std::string& command);
/// `s` in single quotes for the shell (s must hold no single quote).
std::string shell_quote(const std::string& s);

/// Limits this process's address space (RLIMIT_AS) to what it maps now (from
/// /proc/self/statm) plus `headroom` bytes, for the out-of-memory tests (run it in
/// a forked child). False when setrlimit failed.
bool limit_address_space(size_t headroom);

/// For EXPECT_EXIT: limits the address space to `headroom` bytes above what is
/// mapped, runs `call` and exits 0 when it returned, 12 when it raised (its
/// message on stderr), 11 when the limit could not be set.
[[noreturn]] void exit_with_call_status_under_address_limit(size_t headroom, const std::function<void()>& call);

/// BSHD inputs and outputs of no query rows with batch `b`: shape[0] of each
/// present view set to b (a problem of no bytes whatever b is).
void set_batch(std::initializer_list<TensorView*> views, int64_t b);

#if defined(__has_feature)
#define DSAIB_HAS_FEATURE(x) __has_feature(x)
#else
#define DSAIB_HAS_FEATURE(x) 0
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || DSAIB_HAS_FEATURE(address_sanitizer) || \
    DSAIB_HAS_FEATURE(thread_sanitizer) || DSAIB_HAS_FEATURE(memory_sanitizer)
/// A sanitizer build: its shadow memory needs more address space than an RLIMIT_AS limit leaves.
constexpr bool kSanitizedBuild = true;
#else
constexpr bool kSanitizedBuild = false;
#endif

/// The C ABI's view of a tensor (dsaib.h) with the same data, dtype, shape, strides and device.
dsaib_tensor to_c(const TensorView& v);

}  // namespace dsaib::test
