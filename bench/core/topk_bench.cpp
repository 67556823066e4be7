// dsaib_bench: the indexer's top-k (indexer_topk on the cuda backend) as a case of the
// bench: inputs made on the device, rotated over input sets, timed as every op
// (time_op); then the extra device memory of one call with the library's own workspace.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bench_core.hpp"
#include "cuda_check.hpp"
#include "dsaib/indexer_topk.hpp"

namespace dsaib::bench {
namespace {

bool ranged(const OpCase& c) { return c.ranges != TopkRanges::causal; }

constexpr int kBuffers = 8;

/// Byte sizes of the buffers of views_of: index_q, weights (bf16), index_k, starts and
/// ends, ids, logits, and with e4m3 inputs index_q_scale (per row and head) and
/// index_k_scale (per key row).
void buffer_bytes(const OpCase& c, uint64_t bytes[kBuffers]) {
  const uint64_t S = static_cast<uint64_t>(c.seq), Q = static_cast<uint64_t>(topk_query_rows(c.ranges, c.seq)),
                 H = static_cast<uint64_t>(c.heads), D = static_cast<uint64_t>(c.dim), K = static_cast<uint64_t>(c.topk);
  const uint64_t element = c.e4m3 ? 1 : 2;
  bytes[0] = Q * H * D * element;
  bytes[1] = Q * H * 2;
  bytes[2] = S * D * element;
  bytes[3] = ranged(c) ? Q * 8 : 0;
  bytes[4] = Q * K * 4;
  bytes[5] = Q * K * 4;
  bytes[6] = c.e4m3 ? Q * H * 4 : 0;
  bytes[7] = c.e4m3 ? S * 4 : 0;
}

/// One set's bytes.
uint64_t set_bytes_of(const OpCase& c) {
  uint64_t bytes[kBuffers], sum = 0;
  buffer_bytes(c, bytes);
  for (uint64_t b : bytes) sum += b;
  return sum;
}

/// The case's views over the buffers of buffer_bytes (or placeholder addresses), device `dev`.
struct TopkViews {
  IndexerTopkInputs in;
  IndexerTopkOutputs out;
};
TopkViews views_of(const OpCase& c, void* const ptr[kBuffers], DeviceType dev, int device_index) {
  const int64_t S = c.seq, Q = topk_query_rows(c.ranges, c.seq), H = c.heads, D = c.dim, K = c.topk;
  const DType qk = c.e4m3 ? DType::e4m3 : DType::bf16;
  TopkViews v;
  v.in.index_q = contiguous_view(ptr[0], qk, {1, Q, H, D}, dev, device_index);
  v.in.weights = contiguous_view(ptr[1], DType::bf16, {1, Q, H}, dev, device_index);
  v.in.index_k = contiguous_view(ptr[2], qk, {1, S, D}, dev, device_index);
  if (c.e4m3) {
    v.in.index_q_scale = contiguous_view(ptr[6], DType::f32, {1, Q, H}, dev, device_index);
    v.in.index_k_scale = contiguous_view(ptr[7], DType::f32, {1, S}, dev, device_index);
  }
  if (ranged(c)) {
    // starts and ends share one buffer: starts first, then ends.
    v.in.starts = contiguous_view(ptr[3], DType::i32, {1, Q}, dev, device_index);
    v.in.ends = contiguous_view(static_cast<int32_t*>(ptr[3]) + Q, DType::i32, {1, Q}, dev, device_index);
  }
  v.out.topk_indices = contiguous_view(ptr[4], DType::i32, {1, Q, K}, dev, device_index);
  v.out.topk_logits = contiguous_view(ptr[5], DType::f32, {1, Q, K}, dev, device_index);
  return v;
}

/// BSHD, local ids, logit_descending (the order torch.topk returns).
IndexerTopkOptions topk_options() {
  IndexerTopkOptions opt;
  opt.backend = Backend::cuda;
  opt.layout = Layout::bshd;
  opt.id_mode = IdMode::local;
  opt.order = TopkOrder::logit_descending;
  return opt;
}

/// One set of the case's tensors on the device: q, w, k of magnitude [0.25, 1) with
/// hashed signs (the weights too: some heads count negatively; e4m3: q and k rounded to
/// it, every scale 1), the ranges uploaded.
struct TopkSet {
  std::vector<DeviceBuffer> buf;
  TopkViews v;
  TopkSet(const OpCase& c, int device, uint32_t salt, const std::vector<int32_t>& ranges, cudaStream_t s) {
    uint64_t bytes[kBuffers];
    buffer_bytes(c, bytes);
    void* ptr[kBuffers];
    buf.reserve(kBuffers);
    for (int i = 0; i < kBuffers; ++i) {
      buf.emplace_back(bytes[i]);
      ptr[i] = buf.back().ptr;
    }
    if (c.e4m3) {
      fill_device_e4m3(ptr[0], bytes[0], salt, s);
      fill_device_e4m3(ptr[2], bytes[2], salt + 2, s);
      fill_device_f32(static_cast<float*>(ptr[6]), bytes[6] / 4, 1.0f, s);
      fill_device_f32(static_cast<float*>(ptr[7]), bytes[7] / 4, 1.0f, s);
    } else {
      fill_device_bf16(ptr[0], bytes[0] / 2, salt, s);
      fill_device_bf16(ptr[2], bytes[2] / 2, salt + 2, s);
    }
    fill_device_bf16(ptr[1], bytes[1] / 2, salt + 1, s);
    if (!ranges.empty()) {
      check_cuda(cudaMemcpyAsync(ptr[3], ranges.data(), ranges.size() * 4, cudaMemcpyHostToDevice, s),
                 "cudaMemcpyAsync (starts, ends)");
      check_cuda(cudaStreamSynchronize(s), "starts, ends");  // `ranges` is pageable and may go
    }
    v = views_of(c, ptr, DeviceType::cuda, device);
  }
};

/// TopkMemory's pool and cudaMemGetInfo measurements of one call of `v` with the
/// library's own workspace, on `stream`; the pool's release threshold is restored after.
void measure_extra_memory(const TopkViews& v, IndexerTopkOptions opt, cudaStream_t stream, TopkMemory* m) {
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  cudaMemPool_t pool = nullptr;
  check_cuda(cudaDeviceGetMemPool(&pool, dev), "cudaDeviceGetMemPool");
  opt.stream = stream;
  // One call first: what the first use of the pool or a module costs is not the call's.
  indexer_topk(v.in, v.out, opt);
  check_cuda(cudaStreamSynchronize(stream), "indexer_topk (memory warm-up)");
  uint64_t threshold_was = 0;
  check_cuda(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold_was), "cudaMemPoolGetAttribute");
  check_cuda(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
  uint64_t zero = 0, keep = std::numeric_limits<uint64_t>::max();
  check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero), "cudaMemPoolSetAttribute");
  check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero), "cudaMemPoolSetAttribute");
  check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
  size_t free_before = 0, free_after = 0, total = 0;
  cudaError_t e = cudaMemGetInfo(&free_before, &total);
  if (e == cudaSuccess) {
    try {
      indexer_topk(v.in, v.out, opt);
    } catch (...) {
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold_was);
      throw;
    }
    e = cudaStreamSynchronize(stream);
  }
  if (e == cudaSuccess) e = cudaMemGetInfo(&free_after, &total);
  uint64_t used_high = 0, reserved_high = 0;
  if (e == cudaSuccess) e = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used_high);
  if (e == cudaSuccess) e = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved_high);
  const cudaError_t restored = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold_was);
  check_cuda(e, "the memory measurement");
  check_cuda(restored, "cudaMemPoolSetAttribute (release threshold)");
  check_cuda(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
  m->pool_used_high_bytes = static_cast<int64_t>(used_high);
  m->pool_reserved_high_bytes = static_cast<int64_t>(reserved_high);
  m->mem_get_info_delta_bytes = static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after);
}

}  // namespace

void check_topk_case(const OpCase& c) {
  if (c.batch != 1) {
    throw Error(ErrorCode::invalid_argument, "batch", "the top-k's cases are B 1, got " + std::to_string(c.batch));
  }
  if (c.seq < 1 || c.seq > std::numeric_limits<int32_t>::max()) {
    throw Error(ErrorCode::invalid_argument, "seq", "the top-k's cases: 1 <= S <= 2^31 - 1, got " + std::to_string(c.seq));
  }
  if (c.ranges == TopkRanges::cp_shard && c.seq < 2) {
    throw Error(ErrorCode::invalid_argument, "seq", "the top-k's cp-shard cases need S >= 2 (S / 2 query rows), got 1");
  }
  if (c.heads < 8 || c.heads > 128 || c.heads % 8 != 0 || (c.dim != 64 && c.dim != 128)) {
    throw Error(ErrorCode::invalid_argument, "shapes",
                "the top-k on the cuda backend: H a multiple of 8 up to 128, D 64 or 128, got " +
                    std::to_string(c.heads) + "x" + std::to_string(c.dim));
  }
  if (c.e4m3 && c.dim != 128) {
    throw Error(ErrorCode::invalid_argument, "shapes",
                "the top-k on the cuda backend with e4m3 inputs: D 128, got " + std::to_string(c.heads) + "x" +
                    std::to_string(c.dim));
  }
  if (c.topk < 1 || c.topk > 8192) {
    throw Error(ErrorCode::invalid_argument, "topk",
                "the top-k on the cuda backend: 1 <= topk <= 8192, got " + std::to_string(c.topk));
  }
  // The library's own rules, on the cpu backend, with placeholder addresses never dereferenced.
  uint64_t bytes[kBuffers];
  buffer_bytes(c, bytes);
  void* ptr[kBuffers];
  uint64_t at = 1ull << 40;
  for (int i = 0; i < kBuffers; ++i) {
    ptr[i] = reinterpret_cast<void*>(static_cast<uintptr_t>(at));
    at += (bytes[i] + 511) / 256 * 256;
  }
  const TopkViews v = views_of(c, ptr, DeviceType::cpu, 0);
  IndexerTopkOptions opt = topk_options();
  opt.backend = Backend::cpu;
  (void)indexer_topk_workspace_size(v.in, v.out, opt);
}

OpResult run_topk_case(const OpCase& c, const OpConfig& cfg) {
  if (cfg.iters < 1 || cfg.warmup < 0 || cfg.input_sets < 0) {
    throw Error(ErrorCode::invalid_argument, "iters", "iters >= 1, warmup >= 0, input_sets >= 0");
  }
  (void)sustained_launches(cfg.sustained_ms, 1.0);  // rejects a bad sustained_ms before any work
  check_topk_case(c);
  OpResult r;
  r.c = c;
  const int64_t S = c.seq, Q = topk_query_rows(c.ranges, c.seq);
  r.query_rows = Q;
  const double visible = topk_visible_keys(c.ranges, S);
  r.visible_keys_per_row = visible / static_cast<double>(Q);
  // starts (all 0) then ends (S - Q + t + 1): the rows of the second half against every key.
  std::vector<int32_t> ranges;
  if (ranged(c)) {
    ranges.assign(static_cast<size_t>(2 * Q), 0);
    for (int64_t t = 0; t < Q; ++t) ranges[Q + t] = static_cast<int32_t>(S - Q + t + 1);
  }
  double slots = 0;  // selected keys: min(topk, visible) per row
  for (int64_t t = 0; t < Q; ++t) slots += static_cast<double>(std::min<int64_t>(c.topk, S - Q + t + 1));
  r.valid_slots = static_cast<int64_t>(slots);
  r.valid_slots_per_row = slots / static_cast<double>(Q);

  int dev = 0, l2 = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "cudaDeviceGetAttribute");
  size_t free_b = 0, total_b = 0;
  check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  r.set_bytes = set_bytes_of(c);
  r.input_sets = cfg.input_sets > 0 ? cfg.input_sets : auto_input_sets(r.set_bytes, l2, free_b);
  Timer timer;
  std::vector<TopkSet> sets;
  sets.reserve(static_cast<size_t>(r.input_sets));
  const uint32_t salt = 0x70C4u + static_cast<uint32_t>(cfg.seed);
  // Every set holds the same values (the same salt) at other addresses.
  for (int s = 0; s < r.input_sets; ++s) sets.emplace_back(c, dev, salt, ranges, timer.stream);
  check_cuda(cudaStreamSynchronize(timer.stream), "input generation");

  IndexerTopkOptions opt = topk_options();
  opt.stream = timer.stream;
  r.workspace_bytes = indexer_topk_workspace_size(sets[0].v.in, sets[0].v.out, opt);
  IndexerTopkOutputs ids_only = sets[0].v.out;
  ids_only.topk_logits = {};
  r.topk_memory.workspace_bytes = r.workspace_bytes;
  r.topk_memory.workspace_bytes_ids_only = indexer_topk_workspace_size(sets[0].v.in, ids_only, opt);
  {
    DeviceBuffer ws(r.workspace_bytes);
    int launches = 0;
    time_op(timer, [&] {
      const TopkSet& s = sets[launches++ % r.input_sets];
      indexer_topk(s.v.in, s.v.out, opt, ws.ptr, ws.bytes);
    }, cfg, Q, r);
  }
  r.tflops = 2.0 * static_cast<double>(c.heads) * static_cast<double>(c.dim) * visible / (r.t.median_ms * 1e-3) / 1e12;
  measure_extra_memory(sets[0].v, topk_options(), timer.stream, &r.topk_memory);
  return r;
}

}  // namespace dsaib::bench
