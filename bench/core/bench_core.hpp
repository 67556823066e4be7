// dsaib_bench: the benchmark core shared by `dsaib bench` (cli/bench.cpp),
// dsa-indexer-bwd-bench (bench/bench_indexer_backward.cpp), dsa-kl-forward-bench
// (bench/bench_kl_forward.cpp) and dsa-floor-bench (bench/floor/floor_bench.cpp).
// Built only with the cuda backend; its device code is sm_90a only. Every
// function here runs on device 0, on a stream of its own, and raises
// dsaib::Error (cuda_error) when a CUDA or cuBLAS call fails. Nothing here
// exposes CUDA types, so callers need no CUDA headers.
//
//   op_bench.cpp       the op: case setup (ids patterns, input-set rotation), CUDA-event timing
//   floor_kernels.cu   floor micro-benchmarks: fp32 scatter-add rate (three ways), cuBLAS bf16 GEMM rate,
//                      the loss forward's key gather
//   bench_core.cpp     statistics, device probe, the floor formula
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_names.hpp"
#include "dsaib/indexer_backward.hpp"

namespace dsaib::bench {

// ---------------------------------------------------------------- statistics, device

/// Median, minimum and maximum of timed launches, in milliseconds.
struct Stats {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  int runs = 0;
};
/// The median of an even count is the mean of the two middle values.
Stats stats_of(std::vector<float> ms);

/// Device 0 as the benchmarks see it.
struct DeviceInfo {
  bool usable = false;  // a compute-capability-9.0 device (the kernels are sm_90a only)
  std::string reason;   // why not usable; empty when usable
  std::string name;
  int cc_major = 0, cc_minor = 0, sm_count = 0;
  int64_t l2_bytes = 0;
  // L2 set aside for persisting (evict_last) lines in this context
  // (cudaLimitPersistingL2CacheSize; -1 when the query failed). The dK reds' L2
  // hint (src/hopper/indexer_backward/l2_policy.cuh) keeps about this much of dK resident, so its
  // gain depends on it.
  int64_t l2_persisting_bytes = -1;
  uint64_t free_bytes = 0, total_bytes = 0;
  int driver_version = 0, runtime_version = 0;  // e.g. 13000
};
/// Never throws: a machine without a GPU or driver gives usable = false and a reason.
DeviceInfo probe_device();

// ---------------------------------------------------------------- floor micro-benchmarks

/// How a row is added into the fp32 table:
///   float4  atomicAdd(float4*) per thread (RED.E.ADD.F32x4), a warp (D128) or half a warp (D64) per row;
///   scalar  atomicAdd(float) per thread, a warp per row;
///   bulk    cp.reduce.async.bulk .add.f32 of one row from shared memory (a warp restages a group of
///           8 rows, lane 0 issues one bulk reduce per row, a ring of 4 groups stays in flight).
/// float4_fragment is not one of the floor's ways: it adds with the pattern of a
/// wgmma accumulator scattered from registers (each warp instruction adds 32 B to
/// each of 16 rows; 16 instructions complete the 16 rows), to measure what that
/// pattern costs against whole-row adds.
/// gather_float4 is not one of the floor's ways either: each float4 row-add first
/// reads the row's key (D bf16 = D*2 bytes, `ld.global.cg`) from a bf16 key table of
/// 1.0 with as many rows as the fp32 table, and adds it to the payload, so each
/// 512-B add (D128) waits on a 256-B read of the same key, as the fused op's K
/// gathers and dK reds touch the same keys. Its rate is the scatter rate that is
/// left when the key reads share the L2 and crossbar (the traffic floor below).
enum class ScatterWay { float4_atomic, scalar_atomic, bulk_reduce, float4_fragment, gather_float4 };
inline const std::vector<ScatterWay> kAllScatterWays = {ScatterWay::float4_atomic, ScatterWay::scalar_atomic,
                                                        ScatterWay::bulk_reduce};
const char* scatter_way_name(ScatterWay w);  // "float4", "scalar", "bulk", "fragment", "gather"

/// The scatter-add micro-benchmark: rows of `row_floats` fp32 values (the dK row, D)
/// added into rows of an fp32 table chosen by a hash of the row-add index (uniform,
/// like random top-k ids). Payload values are made in registers (no source read).
struct ScatterConfig {
  uint64_t table_bytes = 0;              // the fp32 table: the dK accumulator, B*S_kv*D*4 bytes
  int row_floats = 128;                  // 64 or 128
  uint64_t payload_bytes = 1ull << 30;   // bytes added per launch
  int iters = 25, warmup = 3;
  uint32_t seed = 12345;
};
struct ScatterResult {
  uint64_t table_bytes = 0, rows = 0;
  int row_floats = 0;
  ScatterWay way = ScatterWay::float4_atomic;
  uint64_t payload_bytes = 0;  // as measured (a multiple of 8 rows)
  int grid = 0, block = 0;
  Stats t;
  double tbps = 0;             // payload bytes / median time, 1e12 B/s
  bool check_ok = false;       // exact column sums after one launch into a zeroed table
};
/// Allocates the table once and measures each way (check, warm-up, timed launches).
std::vector<ScatterResult> measure_scatter(const ScatterConfig& c, const std::vector<ScatterWay>& ways = kAllScatterWays);
/// The entry with the highest rate (the floor uses the best way).
const ScatterResult& fastest(const std::vector<ScatterResult>& results);

/// cuBLAS bf16 GEMM (cublasGemmEx, bf16 in and out, fp32 compute), size^3, random non-zero
/// data; a few entries checked against a host dot product.
struct GemmResult {
  int m = 0, n = 0, k = 0;
  int batch = 1;
  Stats t;
  double tflops = 0;
  bool check_ok = false;
  double max_rel_err = 0;
};
GemmResult measure_gemm(int size = 8192, int iters = 25, int warmup = 3);
/// cuBLAS bf16 GEMM at a given shape, `batch` entries in one strided-batched call:
/// entry b multiplies its own m x k operand (query rows of one token: Hq x Dqk) by one
/// n x k operand shared by every entry (n keys), giving m x n (fp32 compute, bf16 out).
/// The attention target's GEMM per query row is m = Hq, n = topk, k = Dqk: this is
/// the tensor-core rate at that shape with no gather. A few entries are checked.
GemmResult measure_gemm_batched(int m, int n, int k, int batch, int iters = 20, int warmup = 3);

/// Device data for the benchmarks, written on `stream` (a cudaStream_t):
/// n bf16 values of magnitude [0.25, 1) with hashed signs (index and salt);
void fill_device_bf16(void* data, uint64_t n, uint32_t salt, void* stream);
/// n copies of `value`;
void fill_device_f32(float* data, uint64_t n, float value, void* stream);
/// the key-gather micro-benchmark's (seq, topk) ids (KeyGatherConfig: random or causal).
void fill_device_gather_ids(int32_t* ids, int64_t seq, int64_t topk, bool causal, uint32_t seed, void* stream);

/// The key-gather micro-benchmark (the loss forward's and the attention target's
/// floor): per query row of a (S, topk) id table, its valid slots' bf16 key rows (D*2
/// bytes each, from an (S, D) table: 16 MiB at S 65536 D128, resident in the L2)
/// copied with cp.async into a shared-memory ring, as the producers gather them; one
/// CTA of 128 threads per SM. D 64 and 128: 64-row blocks of whole rows, 2, 4 and 6
/// blocks in flight per CTA; any other multiple of 64 up to 576 (the attention
/// target's latent keys, e.g. 576 dims = 1152 B, 192 = 384 B): 8 KiB stages of 64
/// keys x 64 dims, 4, 8 and 12 stages in flight. Ids: random
/// (topk hashed keys of [0, S) per row) or causal (row t: min(t+1, topk) keys of
/// [0, t], the rest -1). Each thread reads its slots' ids from global memory just
/// before it issues their copies (the forward's producer reads 1024 slots' ids in
/// one batch ahead of its copies): when the id table (S*topk*4 bytes) does not
/// fit in the L2, these reads' latency sets the rate, and 2, 4 and 6 blocks in
/// flight run alike. So at such sizes it is an upper bound of the gather's floor.
struct KeyGatherConfig {
  int64_t seq = 4096, topk = 2048;
  int dim = 128;
  bool causal = false;
  int iters = 25, warmup = 3;
  uint32_t seed = 4321;
};
struct KeyGatherResult {
  int64_t seq = 0, topk = 0;
  int dim = 0, in_flight = 0, grid = 0;
  bool causal = false;
  double valid_slots_per_row = 0;
  Stats t;
  double ns_per_row = 0;  // median launch time / S
  double tbps = 0;        // key bytes copied / median time, 1e12 B/s
};
/// One result per in-flight depth.
std::vector<KeyGatherResult> measure_key_gather(const KeyGatherConfig& c);
/// The depth with the lowest time (the forward's floor uses the best).
const KeyGatherResult& fastest(const std::vector<KeyGatherResult>& results);

/// Floor of the loss forward for one query row with `slots` valid keys:
///   gather_ns = the key-gather micro-benchmark's time per row (same ids pattern, S, D, topk)
///   gemm_ns   = 2*H*D*slots FLOP / GEMM rate        (GEMM1, the logits)
///   ns        = max(gather_ns, gemm_ns)             (they overlap in a fused kernel)
struct ForwardFloor {
  double gather_ns = 0, gemm_ns = 0, ns = 0;
  const char* bound = "";  // "gather" or "gemm"
};
ForwardFloor forward_floor_per_row(double gather_ns, double slots, int64_t heads, int64_t dim, double gemm_tflops);

/// A fixed reference floor, the same number on every machine and run, so that times of
/// different runs compare: the dK reduce of one DeepSeek-shape row (H64 D128 topk 2048,
/// all slots valid: 2048*128*4 B = 1 MiB) at 3.77 TB/s, the fp32 scatter-add rate into an
/// L2-resident table that dsa-floor-bench measures on an H200 (float4 way), is 278 ns; the
/// GEMMs (127 ns at ~794 TFLOP/s) hide under it. Reports call the ratio to it
/// "fixed_floor_ratio" (x278); the floor measured in the run itself (floor_per_row, at the
/// case's own dK size and shape) is `dsaib bench`'s "floor_ratio" (xfloor).
inline constexpr double kFixedFloorNsPerRow = 278.0;

/// Floor of one query row with `slots` selected keys, from measured rates:
///   scatter_ns = slots*D*4 B / scatter rate        (the dK reduce, fp32)
///   gemm_ns    = 6*H*D*slots FLOP / GEMM rate      (the score, dK and dQ GEMMs)
///   ns         = max(scatter_ns, gemm_ns)          (the two overlap in a fused kernel)
struct Floor {
  double scatter_ns = 0, gemm_ns = 0, ns = 0;
  const char* bound = "";  // "scatter" or "gemm"
};
Floor floor_per_row(double slots, int64_t heads, int64_t dim, double scatter_tbps, double gemm_tflops);

/// The traffic floor of one query row (not the floor above; a second reference):
///   ns = slots*D*4 B / key-read scatter rate
/// where the rate is ScatterWay::gather_float4's (payload bytes of fp32 adds per second,
/// each add after a D*2-byte key read). That is the time of the op's dK reduce and K
/// gathers alone, with no GEMM, staging or scheduling; 0 when the rate is not positive.
double traffic_floor_ns_per_row(double slots, int64_t dim, double key_read_scatter_tbps);

// ---------------------------------------------------------------- the op

// IdPattern, kIdPatterns, id_pattern_name / _list, is_causal, is_shuffled,
// parse_id_pattern: bench_names.hpp (no CUDA).

/// The op a case times: the backward (indexer_backward given P: dK zeroing, fused
/// kernel, bf16 cast), the loss forward (indexer_kl_forward: the fused forward kernel
/// and the fixed-order sum of the loss terms; P written only with
/// OpCase::write_index_score), the training step of an autograd loss (the forward,
/// then the P-free indexer_backward from its row statistics: two library calls), or
/// the loss and gradients in one call (indexer_kl_loss_and_grad).
enum class BenchOp { backward, kl_forward, step, one_call };
/// "backward", "forward", "step", "one-call" (the CLI's --op words).
const char* bench_op_name(BenchOp op);

/// One benchmark case: bf16 inputs, bshd, local ids, S_q = S_kv = seq, bf16 outputs.
struct OpCase {
  BenchOp op = BenchOp::backward;
  bool write_index_score = false;  // kl_forward: also write P (the (B, S, topk) f32 index_score)
  IdPattern ids = IdPattern::random;
  int64_t batch = 1, seq = 4096, heads = 64, dim = 128, topk = 2048;
  AOperandPrecision a_operand = AOperandPrecision::automatic;  // automatic = one bf16 term (bf16 outputs)
  bool deterministic = false;  // IndexerOptions::deterministic (the fixed-point dK)
  L2Hints l2_hints = L2Hints::automatic;                // IndexerOptions::l2_hints
  StartStagger start_stagger = StartStagger::automatic;  // IndexerOptions::start_stagger
  ForwardFusion forward_fusion = ForwardFusion::automatic;  // IndexerOptions::forward_fusion (one-call)
  uint64_t dk_table_bytes() const { return static_cast<uint64_t>(batch * seq * dim) * 4; }
};

struct OpConfig {
  int iters = 20, warmup = 3;
  int input_sets = 0;        // 0: automatic (see auto_input_sets), else this many
  uint64_t seed = 1234;      // the case's generator seed is seed + seq
  /// Milliseconds of back-to-back launches after the timed ones (0: none). See
  /// OpResult::ns_per_row_sustained.
  double sustained_ms = 0;
};

/// Launches of a sustained run: ceil(sustained_ms / launch_ms), at least
/// kSustainedMinLaunches, at most kSustainedMaxLaunches (so a run on a small shape can be
/// shorter, and on a tiny one longer, than sustained_ms). Raises dsaib::Error
/// (invalid_argument) naming "sustained_ms" when it is negative or not finite, and
/// "launch_ms" when that is not a positive finite time.
inline constexpr int kSustainedMinLaunches = 20;
inline constexpr int kSustainedMaxLaunches = 20000;
int sustained_launches(double sustained_ms, double launch_ms);

/// Input-set rotation: a case keeps N sets (inputs and outputs; copies of one generated
/// set at different addresses) and launch i uses set i mod N, so consecutive launches touch
/// different memory and a set comes back only after the others went through L2.
/// Automatic N = clamp(ceil(2*L2 / set_bytes), 2, 64), lowered (to 1 at least) until all
/// sets fit in half of the free device memory.
int auto_input_sets(uint64_t set_bytes, int64_t l2_bytes, uint64_t free_bytes);
/// One sentence on the rotation, for reports.
std::string rotation_method();

struct OpResult {
  OpCase c;
  int64_t valid_slots = 0;          // over all B*S query rows
  double valid_slots_per_row = 0;
  int input_sets = 1;
  uint64_t set_bytes = 0;           // inputs + outputs of one set
  uint64_t workspace_bytes = 0;     // the fp32 dK accumulator, shared by the sets (zeroed by every launch)
  std::vector<float> ms;            // every timed launch, in order
  Stats t;
  double ns_per_row = 0, ns_per_row_min = 0, ns_per_row_max = 0;  // median / min / max time over B*S rows
  double tflops = 0;                // 6*H*D FLOP (kl_forward: 2*H*D; step, one_call: 8*H*D) per valid slot / median time
  double dk_gbps = 0;               // D*4 B of dK reduce per valid slot / median time
  // Sustained run (OpConfig::sustained_ms > 0): `sustained_launches` launches back to
  // back, an event recorded between each two, no host wait and no pre-roll in between,
  // as a training step runs them. The GPU's power management has then had the whole
  // run to act: on the H200 the op reaches the 700 W limit at S 65536 and the SM clock
  // drops. ns_per_row_sustained is the median
  // over the second half of the launches (the steady state), _first_half over the first.
  // The per-launch times above, each after a 3 ms pre-roll (Timer::time), are what the
  // peers' timer measures; these are what a loop of back-to-back launches gets.
  int sustained_launches = 0;
  double sustained_seconds = 0;     // GPU time of the whole sustained run
  double ns_per_row_sustained = 0, ns_per_row_sustained_first_half = 0;
};

/// Raises dsaib::Error with the library's own message when the case is not a valid
/// problem (heads, dim, topk, ...). Touches no device.
void check_case(const OpCase& c);

/// Generates the case on the host, uploads it (and its copies), times the whole op
/// (dK zeroing, fused kernel, bf16 cast) with CUDA events around each launch:
/// `warmup` untimed launches, then `iters` timed ones, then (sustained_ms > 0) the
/// sustained run.
OpResult run_op_case(const OpCase& c, const OpConfig& cfg);

}  // namespace dsaib::bench
