// dsaib_bench: the attention target (attention_target on the cuda backend) as a case of
// the bench: inputs made on the device, rotated over input sets, timed as every op
// (time_op).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bench_core.hpp"
#include "cuda_check.hpp"
#include "dsaib/attention_target.hpp"

namespace dsaib::bench {
namespace {

/// Valid slots over the case's rows (the ids of fill_device_gather_ids).
double valid_slots_of(const OpCase& c) {
  const int64_t max_slots = std::min(c.topk, c.seq);
  if (!is_causal(c.ids)) return static_cast<double>(max_slots) * static_cast<double>(c.seq);
  double s = 0;
  for (int64_t t = 0; t < c.seq; ++t) s += static_cast<double>(std::min(t + 1, max_slots));
  return s;
}

uint64_t set_bytes_of(const OpCase& c) {
  return static_cast<uint64_t>(c.seq) *
         static_cast<uint64_t>(c.heads * c.dim * 2 + c.dim * 2 + (c.lse_given ? c.heads * 4 : 0) + c.topk * 8);
}

/// One set of the case's tensors on the device.
struct TargetSet {
  DeviceBuffer query, kv, lse, ids, out;
  AttentionTargetInputs in;
  AttentionTargetOutputs outputs;
  TargetSet(const OpCase& c, int device, uint32_t salt, uint32_t ids_seed, cudaStream_t s)
      : query(static_cast<size_t>(c.seq * c.heads * c.dim) * 2),
        kv(static_cast<size_t>(c.seq * c.dim) * 2),
        lse(c.lse_given ? static_cast<size_t>(c.seq * c.heads) * 4 : 0),  // read only when given
        ids(static_cast<size_t>(c.seq * c.topk) * 4),
        out(static_cast<size_t>(c.seq * c.topk) * 4) {
    fill_device_bf16(query.ptr, static_cast<uint64_t>(c.seq * c.heads * c.dim), salt, s);
    fill_device_bf16(kv.ptr, static_cast<uint64_t>(c.seq * c.dim), salt + 1, s);
    if (c.lse_given) fill_device_f32(lse.as<float>(), static_cast<uint64_t>(c.seq * c.heads), 8.0f, s);
    fill_device_gather_ids(ids.as<int32_t>(), c.seq, c.topk, is_causal(c.ids), ids_seed, s);
    const int64_t B = 1;
    in.query = contiguous_view(query.ptr, DType::bf16, {B, c.seq, c.heads, c.dim}, DeviceType::cuda, device);
    in.kv = contiguous_view(kv.ptr, DType::bf16, {B, c.seq, c.dim}, DeviceType::cuda, device);
    if (c.lse_given) in.lse = contiguous_view(lse.ptr, DType::f32, {B, c.seq, c.heads}, DeviceType::cuda, device);
    in.topk_indices = contiguous_view(ids.ptr, DType::i32, {B, c.seq, c.topk}, DeviceType::cuda, device);
    outputs.attn_score = contiguous_view(out.ptr, DType::f32, {B, c.seq, c.topk}, DeviceType::cuda, device);
  }
};

AttentionTargetOptions target_options(const OpCase& c) {
  AttentionTargetOptions opt;
  opt.backend = Backend::cuda;
  opt.sm_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dim)));
  opt.lse_base = c.lse_base;
  opt.normalize = c.normalize;
  return opt;
}

}  // namespace

void check_target_case(const OpCase& c) {
  if (c.batch != 1) {
    throw Error(ErrorCode::invalid_argument, "batch", "the attention target's cases are B 1, got " + std::to_string(c.batch));
  }
  if (c.ids != IdPattern::causal && c.ids != IdPattern::random) {
    throw Error(ErrorCode::invalid_argument, "ids",
                std::string("the attention target's ids are causal or random, got ") + id_pattern_name(c.ids));
  }
  if (c.seq < 1 || c.seq > (1ll << 30) || c.topk < 1 || c.topk > (1ll << 20)) {
    throw Error(ErrorCode::invalid_argument, "seq", "the attention target's cases: 1 <= S <= 2^30, 1 <= topk <= 2^20");
  }
  if (c.heads < 16 || c.heads > 128 || c.heads % 16 != 0 || c.dim < 64 || c.dim > 576 || c.dim % 64 != 0) {
    throw Error(ErrorCode::invalid_argument, "shapes",
                "the attention target on the cuda backend: Hq a multiple of 16 up to 128, Dqk a multiple of 64 up to "
                "576, got " + std::to_string(c.heads) + "x" + std::to_string(c.dim));
  }
  // The library's own rules, on the cpu backend, with placeholder addresses never dereferenced.
  uint64_t at = 1ull << 40;
  auto view = [&](DType dt, std::initializer_list<int64_t> shape, uint64_t bytes) {
    void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(at));
    at += (bytes + 511) / 256 * 256;
    return contiguous_view(p, dt, shape, DeviceType::cpu, 0);
  };
  const uint64_t S = static_cast<uint64_t>(c.seq), H = static_cast<uint64_t>(c.heads), D = static_cast<uint64_t>(c.dim),
                 K = static_cast<uint64_t>(c.topk);
  AttentionTargetInputs in;
  in.query = view(DType::bf16, {1, c.seq, c.heads, c.dim}, S * H * D * 2);
  in.kv = view(DType::bf16, {1, c.seq, c.dim}, S * D * 2);
  if (c.lse_given) in.lse = view(DType::f32, {1, c.seq, c.heads}, S * H * 4);
  in.topk_indices = view(DType::i32, {1, c.seq, c.topk}, S * K * 4);
  AttentionTargetOutputs out;
  out.attn_score = view(DType::f32, {1, c.seq, c.topk}, S * K * 4);
  AttentionTargetOptions opt = target_options(c);
  opt.backend = Backend::cpu;
  (void)attention_target_workspace_size(in, out, opt);
}

OpResult run_target_case(const OpCase& c, const OpConfig& cfg) {
  if (cfg.iters < 1 || cfg.warmup < 0 || cfg.input_sets < 0) {
    throw Error(ErrorCode::invalid_argument, "iters", "iters >= 1, warmup >= 0, input_sets >= 0");
  }
  (void)sustained_launches(cfg.sustained_ms, 1.0);  // rejects a bad sustained_ms before any work
  check_target_case(c);
  OpResult r;
  r.c = c;
  const double slots = valid_slots_of(c);
  r.valid_slots = static_cast<int64_t>(slots);
  r.valid_slots_per_row = slots / static_cast<double>(c.seq);
  r.query_rows = c.seq;
  int dev = 0, l2 = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "cudaDeviceGetAttribute");
  size_t free_b = 0, total_b = 0;
  check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  r.set_bytes = set_bytes_of(c);
  r.input_sets = cfg.input_sets > 0 ? cfg.input_sets : auto_input_sets(r.set_bytes, l2, free_b);
  Timer timer;
  std::vector<TargetSet> sets;
  sets.reserve(r.input_sets);
  const uint32_t salt = 0x5EEDu + static_cast<uint32_t>(cfg.seed), ids_seed = 4321u + static_cast<uint32_t>(cfg.seed);
  for (int s = 0; s < r.input_sets; ++s) sets.emplace_back(c, dev, salt, ids_seed, timer.stream);
  check_cuda(cudaStreamSynchronize(timer.stream), "input generation");
  AttentionTargetOptions opt = target_options(c);
  opt.stream = timer.stream;
  int launches = 0;
  time_op(timer, [&] {
    const TargetSet& s = sets[launches++ % r.input_sets];
    attention_target(s.in, s.outputs, opt);
  }, cfg, c.seq, r);
  r.tflops = 2.0 * c.heads * c.dim * slots / (r.t.median_ms * 1e-3) / 1e12;
  return r;
}

}  // namespace dsaib::bench
