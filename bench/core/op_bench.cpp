// dsaib_bench: the op under test (cuda backend, whole op: dK zeroing, fused kernel,
// bf16 cast), its inputs, their rotation over L2, and CUDA-event timing.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <thread>

#include "bench_core.hpp"
#include "cuda_check.hpp"
#include "core/threads.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "dsaib/indexer_kl_forward.hpp"

namespace dsaib::bench {
namespace {

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// One generated case on the host.
struct HostCase {
  std::vector<uint16_t> q, k, w;   // bf16 bits: (B,S,H,D), (B,S,D), (B,S,H)
  std::vector<int32_t> ids;        // (B,S,topk), -1 = empty slot
  std::vector<float> attn, pred;   // (B,S,topk), normalised over the valid slots
  int64_t valid_slots = 0;
};

/// Seed of row block `block` (splitmix64 of seed and block): every block draws
/// from its own generator, so the values do not depend on the thread count.
uint64_t block_seed(uint64_t seed, uint64_t block) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (block + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// The case's inputs, drawn on all host threads in blocks of kRowsPerBlock query
/// rows (S 65536 at H64 D128 took ~50 s on one thread): q, k ~ N(0, 1), w ~ N(0, 1/H)
/// in bf16; per row, min(avail, topk) distinct ids, uniform over the available keys
/// (causal: 0..t; random: the whole sequence), ascending or, for the -shuffled
/// patterns, in a random order (the same draw, permuted), and attn / pred
/// uniform, each normalised to sum 1 over the row's valid slots.
HostCase generate(const OpCase& c, uint64_t seed) {
  const int64_t B = c.batch, S = c.seq, H = c.heads, D = c.dim, K = c.topk;
  constexpr int64_t kRowsPerBlock = 64;
  const int64_t rows = B * S, blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  HostCase h;
  h.q.resize(rows * H * D);
  h.k.resize(rows * D);
  h.w.resize(rows * H);
  h.ids.assign(rows * K, -1);
  h.attn.assign(rows * K, 0.0f);
  h.pred.assign(rows * K, 0.0f);
  std::vector<int64_t> block_slots(blocks, 0);
  const int threads = static_cast<int>(std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, blocks));
  // A partial Fisher-Yates over an identity pool, undone after each row (the pool
  // stays the identity, so a row costs O(topk), not O(S)); one pool per thread.
  std::vector<std::vector<int32_t>> pools(threads);
  std::vector<std::vector<int64_t>> picks_of(threads);
  detail::parallel_for(threads, blocks, 1, [&](int64_t blk, int tid) {
    std::vector<int32_t>& pool = pools[tid];
    std::vector<int64_t>& picks = picks_of[tid];
    if (pool.empty()) {  // this thread's first block (S >= 1)
      pool.resize(S);
      for (int64_t s = 0; s < S; ++s) pool[s] = static_cast<int32_t>(s);
      picks.resize(std::min(S, K));
    }
    std::mt19937_64 rng(block_seed(seed, static_cast<uint64_t>(blk)));
    // The -shuffled patterns' order comes from a generator of its own, so that they
    // draw the same ids, q, k, w, attn and pred as their ascending patterns.
    std::mt19937_64 order_rng(block_seed(~seed, static_cast<uint64_t>(blk)));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uni(0.0f, 1.0f);
    const int64_t r0 = blk * kRowsPerBlock, r1 = std::min(rows, r0 + kRowsPerBlock);
    for (int64_t i = r0 * H * D; i < r1 * H * D; ++i) h.q[i] = to_bf16(normal(rng));
    for (int64_t i = r0 * D; i < r1 * D; ++i) h.k[i] = to_bf16(normal(rng));
    for (int64_t i = r0 * H; i < r1 * H; ++i) h.w[i] = to_bf16(normal(rng) / std::sqrt(static_cast<float>(H)));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r % S;
      // causal: keys 0..t (all of them when t < topk); random: any key of the sequence
      const int64_t avail = is_causal(c.ids) ? t + 1 : S;
      const int64_t n = std::min(avail, K);
      for (int64_t i = 0; i < n; ++i) {
        std::uniform_int_distribution<int64_t> pick(i, avail - 1);
        picks[i] = pick(rng);
        std::swap(pool[i], pool[picks[i]]);
      }
      const int64_t row = r * K;
      std::copy(pool.begin(), pool.begin() + n, h.ids.begin() + row);
      for (int64_t i = n - 1; i >= 0; --i) std::swap(pool[i], pool[picks[i]]);
      std::sort(h.ids.begin() + row, h.ids.begin() + row + n);
      if (is_shuffled(c.ids)) std::shuffle(h.ids.begin() + row, h.ids.begin() + row + n, order_rng);
      float st = 0, sp = 0;
      for (int64_t i = 0; i < n; ++i) {
        h.attn[row + i] = uni(rng);
        h.pred[row + i] = uni(rng);
        st += h.attn[row + i];
        sp += h.pred[row + i];
      }
      for (int64_t i = 0; i < n; ++i) {
        h.attn[row + i] /= st;
        h.pred[row + i] /= sp;
      }
      block_slots[blk] += n;
    }
  });
  for (int64_t v : block_slots) h.valid_slots += v;
  return h;
}

/// One set's tensors: q, w, k, ids, attn, pred, dq, dw, dk, and the top-k's
/// logits (OpCase::from_topk_logits; else 0 bytes).
inline constexpr int kSetBuffers = 10;
/// The buffers uploaded from the generated case: q, w, k, ids, attn, pred, and the logits (pred's values).
inline constexpr bool uploaded(int i) { return i < 6 || i == 9; }

/// Byte sizes of one set's tensors, in the order above.
struct Layout {
  uint64_t bytes[kSetBuffers];
  uint64_t total() const {
    uint64_t t = 0;
    for (uint64_t b : bytes) t += b;
    return t;
  }
};

/// step and one-call keep the loss and the row statistics in the P buffer, which
/// they do not read: loss at 0, row_lse and row_target_mass each 256-byte aligned.
uint64_t row_stats_offset(uint64_t rows) { return (rows * 4 + 255) / 256 * 256; }

Layout layout_of(const OpCase& c) {
  const uint64_t B = c.batch, S = c.seq, H = c.heads, D = c.dim, K = c.topk;
  uint64_t p_bytes = B * S * K * 4;
  if (c.op == BenchOp::step || c.op == BenchOp::one_call) p_bytes = std::max(p_bytes, 256 + 2 * row_stats_offset(B * S));
  return {{B * S * H * D * 2, B * S * H * 2, B * S * D * 2, B * S * K * 4, B * S * K * 4, p_bytes,
           B * S * H * D * 2, B * S * H * 2, B * S * D * 2, c.from_topk_logits ? B * S * K * 4 : 0}};
}

/// Views of one set: inputs and outputs as the op takes them.
struct SetViews {
  IndexerInputs in;      // the backward's (step: the P-free form)
  IndexerBackwardOutputs out;
  IndexerInputs fwd_in;  // the loss forward's and the one call's (no P)
  IndexerKLForwardOutputs fwd;   // the loss forward's outputs (kl_forward, step)
  IndexerKLLossAndGradOutputs one;  // the one call's outputs
};

/// Views over the buffers laid out as layout_of(c), with device `dev` (cpu for check_case).
SetViews views_of(const OpCase& c, void* const ptr[kSetBuffers], DeviceType dev, int device_index) {
  const int64_t B = c.batch, S = c.seq, H = c.heads, D = c.dim, K = c.topk;
  auto v = [&](int i, DType dt, std::initializer_list<int64_t> shape) {
    return contiguous_view(ptr[i], dt, shape, dev, device_index);
  };
  SetViews s;
  s.in = IndexerInputs{v(0, DType::bf16, {B, S, H, D}), v(1, DType::bf16, {B, S, H}),
                               v(2, DType::bf16, {B, S, D}),    v(3, DType::i32, {B, S, K}),
                               v(4, DType::f32, {B, S, K}),     v(5, DType::f32, {B, S, K}),
                               {},   // cu_seqlens_q
                               {},   // cu_seqlens_k
                               {},   // row_lse (the P form reads index_score)
                               {},   // row_target_mass
                               {}};  // topk_logits (the forward's input, below)
  s.out = IndexerBackwardOutputs{v(6, DType::bf16, {B, S, H, D}), v(7, DType::bf16, {B, S, H}),
                                 v(8, DType::bf16, {B, S, D})};
  if (c.op == BenchOp::kl_forward) {
    // The forward reads no index_score; it writes P into that buffer (same shape,
    // f32) and its small outputs into the backward's output buffers, each larger
    // than needed: loss (4 B) in the dw buffer, row_lse (B*S*4 B) in the dK one
    // (B*S*D*2 B), row_target_mass in the dQ one.
    s.in.index_score = {};
    s.fwd = IndexerKLForwardOutputs{v(7, DType::f32, {}), v(8, DType::f32, {B, S}), v(6, DType::f32, {B, S}),
                                    c.write_index_score ? v(5, DType::f32, {B, S, K}) : TensorView{}};
    s.fwd_in = s.in;
  } else if (c.op == BenchOp::step || c.op == BenchOp::one_call) {
    char* stats = static_cast<char*>(ptr[5]);
    const uint64_t off = row_stats_offset(static_cast<uint64_t>(B * S));
    const TensorView loss = contiguous_view(stats, DType::f32, {}, dev, device_index);
    const TensorView lse = contiguous_view(stats + 256, DType::f32, {B, S}, dev, device_index);
    const TensorView mass = contiguous_view(stats + 256 + off, DType::f32, {B, S}, dev, device_index);
    s.fwd_in = s.in;
    s.fwd_in.index_score = {};
    s.fwd = IndexerKLForwardOutputs{loss, lse, mass, TensorView{}};
    s.in = s.fwd_in;
    s.in.row_lse = lse;
    s.in.row_target_mass = mass;
    s.one = IndexerKLLossAndGradOutputs{loss, s.out.d_index_q, s.out.d_weights, s.out.d_index_k};
  }
  if (c.from_topk_logits) s.fwd_in.topk_logits = v(9, DType::f32, {B, S, K});
  return s;
}

/// The library's workspace for the case: step runs its two calls one after the other,
/// so the larger of the two.
std::size_t workspace_bytes_of(const OpCase& c, const SetViews& s, const IndexerOptions& opt) {
  switch (c.op) {
    case BenchOp::kl_forward: return indexer_kl_forward_workspace_size(s.fwd_in, s.fwd, opt);
    case BenchOp::step:
      return std::max(indexer_kl_forward_workspace_size(s.fwd_in, s.fwd, opt),
                      indexer_backward_workspace_size(s.in, s.out, opt));
    case BenchOp::one_call: return indexer_kl_loss_and_grad_workspace_size(s.fwd_in, s.one, opt);
    case BenchOp::backward:
    case BenchOp::target:  // the target's cases: target_bench.cpp
    case BenchOp::topk: break;  // the top-k's: topk_bench.cpp
  }
  return indexer_backward_workspace_size(s.in, s.out, opt);
}

void launch(const OpCase& c, const SetViews& s, const IndexerOptions& opt, void* ws, std::size_t bytes) {
  switch (c.op) {
    case BenchOp::kl_forward: indexer_kl_forward(s.fwd_in, s.fwd, opt, ws, bytes); return;
    case BenchOp::step:
      indexer_kl_forward(s.fwd_in, s.fwd, opt, ws, bytes);
      indexer_backward(s.in, s.out, opt, ws, bytes);
      return;
    case BenchOp::one_call: indexer_kl_loss_and_grad(s.fwd_in, s.one, opt, ws, bytes); return;
    case BenchOp::backward:
    case BenchOp::target:  // the target's cases: target_bench.cpp
    case BenchOp::topk: break;  // the top-k's: topk_bench.cpp
  }
  indexer_backward(s.in, s.out, opt, ws, bytes);
}

IndexerOptions options_of(const OpCase& c) {
  IndexerOptions opt;
  opt.backend = Backend::cuda;
  opt.sm_scale = 1.0f / std::sqrt(static_cast<float>(c.dim));
  opt.a_operand_precision = c.a_operand;
  opt.deterministic = c.deterministic;
  opt.l2_hints = c.l2_hints;
  opt.start_stagger = c.start_stagger;
  opt.forward_fusion = c.forward_fusion;
  return opt;
}

}  // namespace

void check_case(const OpCase& c) {
  if (c.op == BenchOp::target) return check_target_case(c);
  if (c.op == BenchOp::topk) return check_topk_case(c);
  if (c.batch < 1 || c.seq < 1 || c.topk < 1) {
    throw Error(ErrorCode::invalid_argument, "case", "batch, seq and topk must be >= 1");
  }
  if (c.from_topk_logits && c.op != BenchOp::kl_forward && c.op != BenchOp::one_call) {
    throw Error(ErrorCode::invalid_argument, "topk_logits",
                std::string("topk_logits: expected the forward or one-call (the ops that take them), got ") +
                    bench_op_name(c.op));
  }
  // Validation of a bshd problem with non-strict ids reads no tensor data: check the
  // shapes against the library's own rules (on the cpu backend) with placeholder
  // addresses, disjoint and 256-byte aligned, that are never dereferenced.
  const Layout l = layout_of(c);
  void* ptr[kSetBuffers];
  uint64_t at = 1ull << 40;
  for (int i = 0; i < kSetBuffers; ++i) {
    ptr[i] = reinterpret_cast<void*>(static_cast<uintptr_t>(at));
    at += (l.bytes[i] + 511) / 256 * 256;
  }
  const SetViews s = views_of(c, ptr, DeviceType::cpu, 0);
  IndexerOptions opt = options_of(c);
  opt.backend = Backend::cpu;
  (void)workspace_bytes_of(c, s, opt);
}

void time_op(Timer& timer, const std::function<void()>& launch, const OpConfig& cfg, int64_t rows, OpResult& r) {
  for (int i = 0; i < cfg.warmup; ++i) launch();
  check_cuda(cudaStreamSynchronize(timer.stream), "warm-up launches");
  for (int i = 0; i < cfg.iters; ++i) r.ms.push_back(timer.time(launch));
  check_cuda(cudaGetLastError(), "after the timed launches");

  r.t = stats_of(r.ms);
  const double ns_per_ms_row = 1e6 / static_cast<double>(rows);
  r.ns_per_row = r.t.median_ms * ns_per_ms_row;
  r.ns_per_row_min = r.t.min_ms * ns_per_ms_row;
  r.ns_per_row_max = r.t.max_ms * ns_per_ms_row;

  if (cfg.sustained_ms > 0) {
    // Back to back: an event between each two launches, no host wait until the end.
    const int n = sustained_launches(cfg.sustained_ms, r.t.median_ms);
    std::vector<cudaEvent_t> ev(static_cast<size_t>(n) + 1, nullptr);
    struct Events {
      std::vector<cudaEvent_t>& v;
      ~Events() {
        for (cudaEvent_t e : v)
          if (e) cudaEventDestroy(e);
      }
    } guard{ev};
    for (auto& e : ev) check_cuda(cudaEventCreate(&e), "cudaEventCreate (sustained run)");
    check_cuda(cudaEventRecord(ev[0], timer.stream), "cudaEventRecord");
    for (int i = 0; i < n; ++i) {
      launch();
      check_cuda(cudaEventRecord(ev[i + 1], timer.stream), "cudaEventRecord");
    }
    check_cuda(cudaEventSynchronize(ev[n]), "the sustained run");
    check_cuda(cudaGetLastError(), "after the sustained run");
    std::vector<float> first, second;
    for (int i = 0; i < n; ++i) {
      float ms = 0;
      check_cuda(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]), "cudaEventElapsedTime");
      (i < n / 2 ? first : second).push_back(ms);
    }
    float total = 0;
    check_cuda(cudaEventElapsedTime(&total, ev[0], ev[n]), "cudaEventElapsedTime");
    r.sustained_launches = n;
    r.sustained_seconds = total * 1e-3;
    r.ns_per_row_sustained = stats_of(second).median_ms * ns_per_ms_row;
    r.ns_per_row_sustained_first_half = stats_of(first).median_ms * ns_per_ms_row;
  }
}

OpResult run_op_case(const OpCase& c, const OpConfig& cfg) {
  if (c.op == BenchOp::target) return run_target_case(c, cfg);
  if (c.op == BenchOp::topk) return run_topk_case(c, cfg);
  if (cfg.iters < 1 || cfg.warmup < 0 || cfg.input_sets < 0) {
    throw Error(ErrorCode::invalid_argument, "iters", "iters >= 1, warmup >= 0, input_sets >= 0");
  }
  (void)sustained_launches(cfg.sustained_ms, 1.0);  // rejects a bad sustained_ms before any work
  check_case(c);
  OpResult r;
  r.c = c;
  const HostCase h = generate(c, cfg.seed + static_cast<uint64_t>(c.seq));
  r.valid_slots = h.valid_slots;
  const int64_t rows = c.batch * c.seq;
  r.query_rows = rows;
  r.valid_slots_per_row = static_cast<double>(h.valid_slots) / static_cast<double>(rows);

  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  int l2 = 0;
  check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "cudaDeviceGetAttribute");
  size_t free_b = 0, total_b = 0;
  check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const Layout l = layout_of(c);
  r.set_bytes = l.total();
  r.input_sets = cfg.input_sets > 0 ? cfg.input_sets : auto_input_sets(r.set_bytes, l2, free_b);

  // Set 0 from the host, the others as device copies of it (same values, other addresses).
  // The top-k's logits: P's values (any finite logits take the same path).
  const void* host_src[kSetBuffers] = {h.q.data(), h.w.data(), h.k.data(), h.ids.data(), h.attn.data(),
                                       h.pred.data(), nullptr, nullptr, nullptr, h.pred.data()};
  std::vector<std::vector<DeviceBuffer>> sets(r.input_sets);
  std::vector<SetViews> views;
  for (int s = 0; s < r.input_sets; ++s) {
    void* ptr[kSetBuffers];
    sets[s].reserve(kSetBuffers);
    for (int i = 0; i < kSetBuffers; ++i) {
      sets[s].emplace_back(l.bytes[i]);
      ptr[i] = sets[s].back().ptr;
      if (uploaded(i) && l.bytes[i] > 0) {
        const void* src = s == 0 ? host_src[i] : sets[0][i].ptr;
        check_cuda(cudaMemcpy(ptr[i], src, l.bytes[i], s == 0 ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToDevice),
                   "cudaMemcpy (inputs)");
      }
    }
    views.push_back(views_of(c, ptr, DeviceType::cuda, dev));
  }

  Timer timer;
  IndexerOptions opt = options_of(c);
  opt.stream = timer.stream;
  r.workspace_bytes = workspace_bytes_of(c, views[0], opt);
  DeviceBuffer ws(r.workspace_bytes);
  int launches = 0;
  time_op(timer, [&] { launch(c, views[launches++ % r.input_sets], opt, ws.ptr, ws.bytes); }, cfg, rows, r);

  const double sec = r.t.median_ms * 1e-3;
  // useful FLOP per valid slot: GEMM1 (2*H*D) for the forward, 6*H*D for the backward's three GEMMs
  // (given the top-k's logits, the forward runs none)
  const double forward_flop = c.from_topk_logits ? 0.0 : 2.0;
  const double flop_per_slot = c.op == BenchOp::kl_forward ? forward_flop : (c.op == BenchOp::backward ? 6.0 : 6.0 + forward_flop);
  r.tflops = flop_per_slot * c.heads * c.dim * static_cast<double>(h.valid_slots) / sec / 1e12;
  r.dk_gbps = c.op == BenchOp::kl_forward ? 0.0 : static_cast<double>(h.valid_slots) * c.dim * 4.0 / sec / 1e9;
  return r;
}

}  // namespace dsaib::bench
