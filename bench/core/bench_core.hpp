// dsaib_bench: the benchmark core of the bench (dsaib-bench and `dsaib bench`,
// whose run and report are cli/bench.cpp). Built only with the cuda backend; its device
// code is sm_90a only. Every function here runs on device 0, on a stream of its own, and
// raises dsaib::Error (cuda_error) when a CUDA or cuBLAS call fails. Nothing here exposes
// CUDA types, so callers need no CUDA headers.
//
//   op_bench.cpp       the ops of the indexer loss: case setup (ids patterns, input-set rotation),
//                      CUDA-event timing
//   target_bench.cpp   the attention target's case, timed the same way
//   topk_bench.cpp     the indexer's top-k case, timed the same way, and its extra memory
//   scatter_floor.cu   the fp32 scatter-add floor (three ways)
//   gemm_floor.cu      the GEMM floors: cuBLAS bf16 (square and batched), cuBLASLt e4m3
//   device_fill.cu     the device fills of the inputs, the spin kernel
//   gather_floor.cu    the key-gather floor (three ways, each at a few depths and CTA counts)
//   bench_core.cpp     statistics, device probe, the floor formulas
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_names.hpp"
#include "dsaib/attention_target.hpp"
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

/// The operand layouts of a cuBLAS GEMM (cublasGemmEx's transa, transb): cuBLAS runs another
/// kernel for each, so the GEMM rate is the best of them.
enum class GemmLayout { tn, nn, nt, tt };
inline const std::vector<GemmLayout> kAllGemmLayouts = {GemmLayout::tn, GemmLayout::nn, GemmLayout::nt,
                                                        GemmLayout::tt};
const char* gemm_layout_name(GemmLayout l);  // "TN", "NN", "NT", "TT"

/// cuBLAS bf16 GEMM (cublasGemmEx, bf16 in and out, fp32 compute), size^3, random non-zero
/// data; a few entries checked against a host dot product.
struct GemmResult {
  int m = 0, n = 0, k = 0;
  int batch = 1;
  GemmLayout layout = GemmLayout::tn;
  Stats t;
  double tflops = 0;
  bool check_ok = false;
  double max_rel_err = 0;
  bool e4m3 = false;  // float8 e4m3 operands (measure_gemm_e4m3)
};
GemmResult measure_gemm(int size = 8192, int iters = 25, int warmup = 3, GemmLayout layout = GemmLayout::tn);
/// cuBLASLt float8 e4m3 GEMM (TN, fp32 compute, bf16 out, no scales), size^3, random
/// non-zero data; a few entries checked against a host dot product: the fp8 floor's rate.
GemmResult measure_gemm_e4m3(int size = 8192, int iters = 25, int warmup = 3);
/// measure_gemm at every layout (the GEMM floor's ways).
std::vector<GemmResult> measure_gemm_layouts(int size = 8192, int iters = 25, int warmup = 3);
/// The fastest layout that passed its check (raises dsaib::Error when none did).
const GemmResult& fastest(const std::vector<GemmResult>& results);
/// cuBLAS bf16 GEMM at a given shape, `batch` entries in one strided-batched call:
/// entry b multiplies its own m x k operand (query rows of one token: Hq x Dqk) by one
/// n x k operand shared by every entry (n keys), giving m x n (fp32 compute, bf16 out).
/// The attention target's GEMM per query row is m = Hq, n = topk, k = Dqk: this is
/// the tensor-core rate at that shape with no gather. A few entries are checked.
GemmResult measure_gemm_batched(int m, int n, int k, int batch, int iters = 20, int warmup = 3);

/// Device data for the benchmarks, written on `stream` (a cudaStream_t):
/// n bf16 values of magnitude [0.25, 1) with hashed signs (index and salt);
void fill_device_bf16(void* data, uint64_t n, uint32_t salt, void* stream);
/// n float8 e4m3 values, the same values rounded to e4m3;
void fill_device_e4m3(void* data, uint64_t n, uint32_t salt, void* stream);
/// n copies of `value`;
void fill_device_f32(float* data, uint64_t n, float value, void* stream);
/// the key-gather micro-benchmark's (seq, topk) ids (KeyGatherConfig: random or causal).
void fill_device_gather_ids(int32_t* ids, int64_t seq, int64_t topk, bool causal, uint32_t seed, void* stream);

/// The key gather (the loss forward's and the attention target's floor, gather_floor.cu):
/// per query row of an (S, topk) id table, its valid slots' bf16 key rows (D*2 bytes each,
/// D a multiple of 64 up to 576) brought into the SM, each of three ways at a few depths
/// and CTA counts:
///   vector    16-byte ld.global.cg per lane into registers, `depth` loads in flight per
///             lane (256 threads per CTA; a warp instruction reads two 256-byte rows);
///   cp.async  16-byte cp.async.cg per lane into a shared-memory ring of `depth` 512-byte
///             stages per warp, one commit group per warp step (256 threads per CTA);
///   bulk      one cp.async.bulk global -> shared per row (no tensor map) into a ring of
///             `depth` stages of up to 32 rows per warp, each on its own mbarrier (128
///             threads per CTA).
/// Ids: random (topk hashed keys of [0, S) per row) or causal (row t: min(t+1, topk) keys
/// of [0, t], the rest -1). Each warp reads the next 64 slots' ids (coalesced) before it
/// gathers the current ones. Keys and ids are rotated over input sets (auto_input_sets) as
/// the op's inputs are. Each variant is checked once (the words it read, summed, against a
/// plain reference over the same ids), then timed: warm-up, `iters` launches with CUDA
/// events, median. The floor is the fastest variant that passed its check.
enum class GatherMethod { vector_loads, cp_async_ring, bulk_copy };
inline const std::vector<GatherMethod> kAllGatherMethods = {GatherMethod::vector_loads, GatherMethod::cp_async_ring,
                                                            GatherMethod::bulk_copy};
const char* gather_method_name(GatherMethod m);  // "vector", "cp.async", "bulk"

struct KeyGatherConfig {
  int64_t seq = 4096, topk = 2048;
  int dim = 128;
  bool causal = false;
  int iters = 25, warmup = 3;
  int input_sets = 0;  // 0: automatic (auto_input_sets of keys + ids), else this many
  uint32_t seed = 4321;
};
struct KeyGatherResult {
  GatherMethod method = GatherMethod::cp_async_ring;
  int depth = 0;        // vector: loads in flight per lane; cp.async, bulk: stages per warp
  int ctas_per_sm = 0, grid = 0, block = 0, smem_bytes = 0;
  int64_t seq = 0, topk = 0;
  int dim = 0;
  bool causal = false;
  int input_sets = 0;
  double valid_slots_per_row = 0;
  Stats t;
  double ns_per_row = 0;  // median launch time / S
  double tbps = 0;        // key bytes read / median time, 1e12 B/s
  bool check_ok = false;
};
/// "cp.async, 8 stages per warp, 256 threads x 2 CTAs per SM".
std::string gather_variant_name(const KeyGatherResult& r);
/// One result per variant.
std::vector<KeyGatherResult> measure_key_gather(const KeyGatherConfig& c);
/// The fastest variant that passed its check (raises dsaib::Error when none did).
const KeyGatherResult& fastest(const std::vector<KeyGatherResult>& results);
/// The fastest checked variant of one way, or nullptr.
const KeyGatherResult* fastest_of(const std::vector<KeyGatherResult>& results, GatherMethod m);

/// Floor of one query row that gathers its keys and multiplies them (the loss forward,
/// the attention target) with `slots` valid keys of D dims against H heads:
///   gather_ns = the key gather's time per row (its fastest way; same ids pattern, S, D, topk)
///   gemm_ns   = 2*H*D*slots FLOP / GEMM rate
///   ns        = max(gather_ns, gemm_ns)             (they overlap in a fused kernel)
struct ForwardFloor {
  double gather_ns = 0, gemm_ns = 0, ns = 0;
  const char* bound = "";  // "gather" or "gemm"
};
ForwardFloor forward_floor_per_row(double gather_ns, double slots, int64_t heads, int64_t dim, double gemm_tflops);

/// A fixed reference floor, the same number on every machine and run, so that times of
/// different runs compare: the dK reduce of one DeepSeek-shape row (H64 D128 topk 2048,
/// all slots valid: 2048*128*4 B = 1 MiB) at 3.77 TB/s, the fp32 scatter-add rate into an
/// L2-resident table measured on an H200 (float4 way), is 278 ns; the GEMMs (127 ns at
/// ~794 TFLOP/s) hide under it. Reports call the ratio to it "fixed_floor_ratio" (x278); the
/// floor measured in the run itself (floor_per_row, at the case's own dK size and shape) is
/// the report's "floor_ratio" (xfloor).
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

/// Floor of one query row of the loss and its gradients (the forward, then the P-free
/// backward, or both in one kernel): the same terms, with the forward's GEMM1 and its key
/// gather added:
///   scatter_ns = slots*D*4 B / scatter rate
///   gemm_ns    = 8*H*D*slots FLOP / GEMM rate      (GEMM1, and the backward's three)
///   gather_ns  = the key gather's time per row
///   ns         = max(scatter_ns, gemm_ns, gather_ns)
struct StepFloor {
  double scatter_ns = 0, gemm_ns = 0, gather_ns = 0, ns = 0;
  const char* bound = "";  // "scatter", "gemm" or "gather"
};
StepFloor step_floor_per_row(double slots, int64_t heads, int64_t dim, double scatter_tbps, double gemm_tflops,
                             double gather_ns);

/// Floor of one query row of the indexer's top-k: the logits' FLOPs at the GEMM rate,
///   ns = visible_keys_per_row * H * D * 2 FLOP / GEMM rate
/// (every visible key's dot product with every head; the ReLU, the weighted sum over
/// heads and the selection are not counted).
double topk_floor_ns_per_row(double visible_keys_per_row, int64_t heads, int64_t dim, double gemm_tflops);

/// The traffic floor of one query row (not the floor above; a second reference):
///   ns = slots*D*4 B / key-read scatter rate
/// where the rate is ScatterWay::gather_float4's (payload bytes of fp32 adds per second,
/// each add after a D*2-byte key read). That is the time of the op's dK reduce and K
/// gathers alone, with no GEMM, staging or scheduling; 0 when the rate is not positive.
double traffic_floor_ns_per_row(double slots, int64_t dim, double key_read_scatter_tbps);

// ---------------------------------------------------------------- the op

// IdPattern, kIdPatterns, id_pattern_name / _list, is_causal, is_shuffled,
// parse_id_pattern: bench_names.hpp (no CUDA).
// BenchOp, kBenchOps, bench_op_name, parse_bench_op: bench_names.hpp (no CUDA).

/// One benchmark case: bf16 inputs, bshd, local ids, S_q = S_kv = seq, bf16 outputs.
/// The attention target's case: query (1, S, Hq = heads, Dqk = dim) and kv (1, S, Dqk)
/// bf16 of magnitude [0.25, 1) with hashed signs, lse 8 (every exponential finite and
/// non-zero) or no lse, ids as the key gather's (causal or random, hashed), made on the device.
struct OpCase {
  BenchOp op = BenchOp::backward;
  bool write_index_score = false;  // kl_forward: also write P (the (B, S, topk) f32 index_score)
  /// kl_forward, one_call: the selected keys' logits given as the top-k writes them
  /// (IndexerInputs::topk_logits), so the forward gathers no key and runs no GEMM
  bool from_topk_logits = false;
  LseBase lse_base = LseBase::natural;  // target
  bool normalize = true;                // target
  bool lse_given = true;  // target: an lse input, else none (each head's softmax over the selected keys)
  IdPattern ids = IdPattern::random;
  int64_t batch = 1, seq = 4096, heads = 64, dim = 128, topk = 2048;
  AOperandPrecision a_operand = AOperandPrecision::automatic;  // automatic = one bf16 term (bf16 outputs)
  bool deterministic = false;  // IndexerOptions::deterministic (the fixed-point dK)
  L2Hints l2_hints = L2Hints::automatic;                // IndexerOptions::l2_hints
  StartStagger start_stagger = StartStagger::automatic;  // IndexerOptions::start_stagger
  ForwardFusion forward_fusion = ForwardFusion::automatic;  // IndexerOptions::forward_fusion (one-call)
  TopkRanges ranges = TopkRanges::causal;                   // topk: the keys each query row sees
  bool e4m3 = false;  // topk: index_q and index_k in float8 e4m3, with per-token scales
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

/// The extra device memory of one indexer_topk call with the library's own workspace
/// (workspace null), beyond its inputs and outputs.
struct TopkMemory {
  uint64_t workspace_bytes = 0;           // indexer_topk_workspace_size, the case's outputs (ids and logits)
  uint64_t workspace_bytes_ids_only = 0;  // the same without topk_logits
  // The device's current memory pool (cudaMallocAsync's) over the call: its high-water
  // marks of used and reserved bytes, reset before the call (-1 when not measured).
  int64_t pool_used_high_bytes = -1, pool_reserved_high_bytes = -1;
  // cudaMemGetInfo's free bytes before the call minus after it, the pool keeping what it
  // reserved (release threshold raised for the call): the memory the call took from the
  // device, at the pool's granularity (-1 when not measured).
  int64_t mem_get_info_delta_bytes = -1;
};

struct OpResult {
  OpCase c;
  int64_t query_rows = 0;           // rows timed: B*S, or topk's S_q (S / 2 for cp-shard)
  double visible_keys_per_row = 0;  // topk: keys a query row sees, on average
  TopkMemory topk_memory;           // topk
  int64_t valid_slots = 0;          // over all B*S query rows
  double valid_slots_per_row = 0;
  int input_sets = 1;
  uint64_t set_bytes = 0;           // inputs + outputs of one set
  uint64_t workspace_bytes = 0;     // the fp32 dK accumulator, shared by the sets (zeroed by every launch)
  std::vector<float> ms;            // every timed launch, in order
  Stats t;
  double ns_per_row = 0, ns_per_row_min = 0, ns_per_row_max = 0;  // median / min / max time over B*S rows
  double tflops = 0;                // 6*H*D FLOP (kl_forward, target: 2*H*D; step, one_call: 8*H*D) per valid slot / median time;
                                    // topk: 2*H*D per visible key
  double dk_gbps = 0;               // D*4 B of dK reduce per valid slot / median time (0 for kl_forward and target)
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

/// Generates the case (on the host, then uploaded; the target's on the device) and its
/// copies, times the whole op (for the backward: dK zeroing, fused kernel, bf16 cast) with
/// CUDA events around each launch: `warmup` untimed launches, then `iters` timed ones, then
/// (sustained_ms > 0) the sustained run.
OpResult run_op_case(const OpCase& c, const OpConfig& cfg);

}  // namespace dsaib::bench
