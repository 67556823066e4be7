// indexer_topk(): validate, then dispatch to a backend (docs/indexer-topk.md).
// The rules are validate_problem()'s wherever the indexer has the same one
// (src/core/validate_rules.hpp); the top-k adds its ranges, its outputs and
// strict_ranges.
#include "dsaib/indexer_topk.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "api/cuda_backend.hpp"
#include "api/indexer_topk_problem.hpp"
#include "api/workspace_allocator.hpp"
#include "core/allocation.hpp"
#include "core/option_words.hpp"
#include "core/validate_rules.hpp"
#include "reference/topk_reference.hpp"

namespace dsaib {

const char* topk_order_name(TopkOrder order) {
  switch (order) {
    case TopkOrder::logit_descending:
      return "logit_descending";
    case TopkOrder::id_ascending:
      return "id_ascending";
  }
  return "unknown";
}

bool parse_topk_order(const std::string& word, TopkOrder* out) {
  return detail::parse_option_word(word, {TopkOrder::logit_descending, TopkOrder::id_ascending}, topk_order_name, out);
}

namespace detail {

IndexerOptions as_indexer_options(const IndexerTopkOptions& opt) {
  IndexerOptions o;
  o.layout = opt.layout;
  o.id_mode = opt.id_mode;
  o.backend = opt.backend;
  o.stream = opt.stream;
  o.num_threads = opt.num_threads;
  return o;
}

void check_topk_options_and_backend(const IndexerTopkOptions& opt) {
  const IndexerOptions indexer_opt = as_indexer_options(opt);
  check_options(indexer_opt);
  const auto o = static_cast<int32_t>(opt.order);
  if (o != 0 && o != 1) fail("order", "0 (logit_descending) or 1 (id_ascending)", std::to_string(o));
  check_options_and_backend(indexer_opt);
}

void topk_visible_range(const IndexerTopkInputs& in, const IndexerTopkOptions& opt, const ProblemGeometry& g,
                        int64_t r, int64_t* lo, int64_t* hi) {
  int64_t b, t;
  g.q_row_coords(r, &b, &t);
  const int64_t n = g.k_len[b];
  if (in.starts.present()) {
    const auto* s = static_cast<const int32_t*>(in.starts.data);
    const auto* e = static_cast<const int32_t*>(in.ends.data);
    // THD ranges are flat rows of index_k: positions in the sequence after the shift.
    const int64_t shift = g.layout == Layout::thd ? g.k_start[b] : 0;
    const int64_t start = s[row_offset(in.starts, g.layout, r, g.s_q)] - shift;
    const int64_t end = e[row_offset(in.ends, g.layout, r, g.s_q)] - shift;
    *lo = std::clamp<int64_t>(start, 0, n);
    *hi = std::max(*lo, std::clamp<int64_t>(end, 0, n));
    return;
  }
  // Causal: [0, t + offset + 1), in 128 bits (any int64 offset), clipped to [0, n).
  const __int128 offset = opt.causal_offset == kCausalOffsetAuto ? __int128(n) - g.q_len[b] : __int128(opt.causal_offset);
  const __int128 end = __int128(t) + offset + 1;
  *lo = 0;
  *hi = static_cast<int64_t>(std::clamp<__int128>(end, 0, n));
}

namespace {

const char* const kOutOfMemoryValidate =
    "out of memory: expected room in host memory to validate the arguments, got an allocation failure";

/// starts or ends ((B, S_q) / (T_q), last dimension contiguous, checked before)
/// on the host, one value per flat query row: read in place (copy null) or
/// copied from the device.
std::vector<int32_t> range_values_on_host(const TensorView& v, const ProblemGeometry& g, CopyToHost copy, void* stream) {
  std::vector<int32_t> out(static_cast<size_t>(g.num_q_rows));
  if (g.num_q_rows == 0) return out;
  const auto* src = static_cast<const int32_t*>(v.data);
  if (!copy) {
    for (int64_t r = 0; r < g.num_q_rows; ++r) out[r] = src[row_offset(v, g.layout, r, g.s_q)];
    return out;
  }
  if (g.layout == Layout::thd || g.batch == 1 || v.strides[0] == g.s_q) {  // one piece
    copy(out.data(), src, out.size() * 4, out.size() * 4, 1, stream);
    return out;
  }
  const size_t row_bytes = static_cast<size_t>(g.s_q) * 4;
  const int64_t pitch = v.strides[0];
  if (pitch >= g.s_q && pitch * 4 <= std::numeric_limits<int32_t>::max()) {  // one pitched copy of the batches
    copy(out.data(), src, row_bytes, static_cast<size_t>(pitch) * 4, static_cast<size_t>(g.batch), stream);
    return out;
  }
  for (int64_t b = 0; b < g.batch; ++b) copy(out.data() + b * g.s_q, src + b * pitch, row_bytes, row_bytes, 1, stream);
  return out;
}

/// strict_ranges: index_out_of_range for the first row whose [start, end) is
/// not 0 <= start <= end <= its key count (BSHD positions; THD flat rows).
void check_strict_ranges(const IndexerTopkInputs& in, const ProblemGeometry& g, CopyToHost copy, void* stream) {
  const std::vector<int32_t> s = range_values_on_host(in.starts, g, copy, stream);
  const std::vector<int32_t> e = range_values_on_host(in.ends, g, copy, stream);
  for (int64_t r = 0; r < g.num_q_rows; ++r) {
    int64_t b, t;
    g.q_row_coords(r, &b, &t);
    const int64_t lo = g.layout == Layout::thd ? g.k_start[b] : 0;
    const int64_t hi = lo + g.k_len[b];
    const int64_t start = s[r], end = e[r];
    if (lo <= start && start <= end && end <= hi) continue;
    const char* arg = (start < lo || start > hi) ? "starts" : "ends";
    std::ostringstream m;
    m << arg << ": strict mode found a range outside its sequence's keys at (b=" << b << ", t=" << t
      << "): expected " << lo << " <= start <= end <= " << hi
      << (g.layout == Layout::thd ? " (flat rows of index_k)" : " (key positions)") << ", got start " << start
      << ", end " << end;
    throw Error(ErrorCode::index_out_of_range, arg, m.str());
  }
}

ProblemGeometry validate_unguarded(const IndexerTopkInputs& in, const IndexerTopkOutputs* out,
                                   const IndexerTopkOptions& opt, CopyToHost copy_to_host, bool stream_capturing,
                                   int64_t reference_topk) {
  check_topk_options_and_backend(opt);

  ProblemGeometry g;
  g.layout = opt.layout;
  g.id_mode = opt.id_mode;
  const bool cuda = opt.backend == Backend::cuda;
  const DeviceType device = cuda ? DeviceType::cuda : DeviceType::cpu;
  const int device_index = in.index_q.device_index;
  const bool thd = opt.layout == Layout::thd;
  const int r = thd ? 1 : 0;  // rank offset: THD tensors have one dim fewer

  // Each tensor: the inputs, the outputs, then the THD cu_seqlens.
  check_tensor(in.index_q, {"index_q", {DType::bf16, DType::e4m3}, 4 - r}, device, device_index);
  check_tensor(in.weights, {"weights", {DType::bf16, DType::f32}, 3 - r, true}, device, device_index);
  check_tensor(in.index_k, {"index_k", {DType::bf16, DType::e4m3}, 3 - r}, device, device_index);
  const bool fp8 = in.index_q.dtype == DType::e4m3;
  if (in.index_k.dtype != in.index_q.dtype) {
    fail("index_k", std::string("dtype ") + dtype_name(in.index_q.dtype) + " (that of index_q)",
         std::string("dtype ") + dtype_name(in.index_k.dtype));
  }
  for (const auto& [scale, name, rank] : {std::tuple{&in.index_q_scale, "index_q_scale", 3 - r},
                                          std::tuple{&in.index_k_scale, "index_k_scale", 2 - r}}) {
    if (!scale->present()) continue;
    if (!fp8) fail(name, "absent with bf16 index_q and index_k (the scales of e4m3 inputs)", "a tensor");
    check_tensor(*scale, {name, {DType::f32}, rank, true}, device, device_index);
  }
  const bool ranges = in.starts.present() || in.ends.present();
  if (ranges) {
    const char* both = "a tensor (starts and ends come together, or neither)";
    if (!in.starts.present()) fail("starts", both, "nothing (absent) while ends is given");
    check_tensor(in.starts, {"starts", {DType::i32}, 2 - r}, device, device_index);
    if (!in.ends.present()) fail("ends", both, "nothing (absent) while starts is given");
    check_tensor(in.ends, {"ends", {DType::i32}, 2 - r}, device, device_index);
  }
  if (out) {
    check_tensor(out->topk_indices, {"topk_indices", {DType::i32}, 3 - r}, device, device_index);
    if (out->topk_logits.present()) {
      check_tensor(out->topk_logits, {"topk_logits", {DType::f32}, 3 - r, true}, device, device_index);
    }
    if (out->topk_lengths.present()) {
      check_tensor(out->topk_lengths, {"topk_lengths", {DType::i32}, 2 - r}, device, device_index);
    }
  }
  check_cu_seqlens_views(in.cu_seqlens_q, in.cu_seqlens_k, thd, device, device_index);

  // Sizes.
  const TensorView& q = in.index_q;
  if (out) {
    read_problem_sizes(g, q, in.index_k, out->topk_indices, thd);
  } else {
    TensorView sized;  // read_problem_sizes takes topk from a view's last dim
    sized.rank = 3 - r;
    sized.shape[2 - r] = reference_topk;
    read_problem_sizes(g, q, in.index_k, sized, thd);
  }
  const std::string heads_dim = "H (heads, dim " + std::to_string(2 - r) + ")";
  const std::string got_heads = "H = " + std::to_string(g.heads) + " (shape " + q.shape_string() + ")";
  const std::string got_dim = "D = " + std::to_string(g.head_dim) + " (shape " + q.shape_string() + ")";
  if (g.heads < 1) fail("index_q", heads_dim + " >= 1", got_heads);
  if (g.head_dim < 1) fail("index_q", "D (last dim) >= 1", got_dim);
  if (cuda && (g.heads % 8 != 0 || g.heads > 128)) {
    fail("index_q", heads_dim + " a multiple of 8 in [8, 128] on the cuda backend", got_heads);
  }
  if (cuda && fp8 && g.head_dim != 128) {
    fail("index_q", "D (last dim) 128 on the cuda backend with e4m3 inputs", got_dim);
  }
  if (cuda && g.head_dim != 64 && g.head_dim != 128) fail("index_q", "D (last dim) 64 or 128 on the cuda backend", got_dim);
  const char* topk_name = out ? "topk_indices" : "topk";
  const std::string topk_what = out ? "topk (last dim)" : "topk";
  if (g.topk < 1) fail(topk_name, topk_what + " >= 1", "topk = " + std::to_string(g.topk));
  if (cuda && g.topk > hopper::kMaxCudaTopk) {
    fail(topk_name, topk_what + " at most " + std::to_string(hopper::kMaxCudaTopk) + " on the cuda backend",
         "topk = " + std::to_string(g.topk));
  }

  // Shapes.
  const int64_t H = g.heads, D = g.head_dim, K = g.topk;
  if (thd) {
    const int64_t T = g.num_q_rows;
    check_shape(in.weights, "weights", {T, H}, "(T_q, H)");
    check_shape(in.index_k, "index_k", {g.num_k_rows, D}, "(T_k, D) with D of index_q");
    if (in.index_q_scale.present()) check_shape(in.index_q_scale, "index_q_scale", {T, H}, "(T_q, H) like weights");
    if (in.index_k_scale.present()) check_shape(in.index_k_scale, "index_k_scale", {g.num_k_rows}, "(T_k)");
    if (ranges) {
      check_shape(in.starts, "starts", {T}, "(T_q)");
      check_shape(in.ends, "ends", {T}, "(T_q)");
    }
    if (out) {
      check_shape(out->topk_indices, "topk_indices", {T, K}, "(T_q, topk)");
      if (out->topk_logits.present()) check_shape(out->topk_logits, "topk_logits", {T, K}, "(T_q, topk) like topk_indices");
      if (out->topk_lengths.present()) check_shape(out->topk_lengths, "topk_lengths", {T}, "(T_q)");
    }
  } else {
    const int64_t B = g.batch, S = g.s_q;
    check_shape(in.weights, "weights", {B, S, H}, "(B, S_q, H)");
    check_shape(in.index_k, "index_k", {B, g.s_kv, D}, "(B, S_kv, D) with B and D of index_q");
    if (in.index_q_scale.present()) {
      check_shape(in.index_q_scale, "index_q_scale", {B, S, H}, "(B, S_q, H) like weights");
    }
    if (in.index_k_scale.present()) check_shape(in.index_k_scale, "index_k_scale", {B, g.s_kv}, "(B, S_kv)");
    if (ranges) {
      check_shape(in.starts, "starts", {B, S}, "(B, S_q)");
      check_shape(in.ends, "ends", {B, S}, "(B, S_q)");
    }
    if (out) {
      check_shape(out->topk_indices, "topk_indices", {B, S, K}, "(B, S_q, topk)");
      if (out->topk_logits.present()) {
        check_shape(out->topk_logits, "topk_logits", {B, S, K}, "(B, S_q, topk) like topk_indices");
      }
      if (out->topk_lengths.present()) check_shape(out->topk_lengths, "topk_lengths", {B, S}, "(B, S_q)");
    }
    // The ids are int32: every key id the op can write must fit (THD: T_k, the
    // last int32 of cu_seqlens_k, always does).
    const bool global = opt.id_mode == IdMode::global;
    const int64_t ids = global ? g.num_k_rows : g.s_kv;
    if (ids > int64_t{1} << 31) {
      fail("index_k",
           global ? "B*S_kv at most 2^31 with id_mode global (int32 ids)" : "S_kv at most 2^31 (int32 ids)",
           (global ? "B*S_kv = " : "S_kv = ") + std::to_string(ids) + " (shape " + in.index_k.shape_string() + ")");
    }
  }

  // Inputs: any strides with a contiguous last dimension (a zero-element one:
  // any strides, as is_contiguous() takes it).
  const TensorView* ins[] = {&in.index_q,      &in.weights,      &in.index_k,       &in.starts,       &in.ends,
                             &in.cu_seqlens_q, &in.cu_seqlens_k, &in.index_q_scale, &in.index_k_scale};
  const char* in_names[] = {"index_q",      "weights",      "index_k",       "starts",       "ends",
                            "cu_seqlens_q", "cu_seqlens_k", "index_q_scale", "index_k_scale"};
  for (int j : {0, 1, 2, 3, 4, 7, 8}) {
    const TensorView& v = *ins[j];
    if (v.present() && v.strides[v.rank - 1] != 1 && v.shape[v.rank - 1] > 1 && v.numel() > 0) {
      fail(in_names[j], "a contiguous last dimension (stride 1)", "strides " + v.strides_string() + " for shape " + v.shape_string());
    }
  }
  // Outputs: contiguous, disjoint from each other and from every input.
  if (out) {
    const TensorView* outs[] = {&out->topk_indices, &out->topk_logits, &out->topk_lengths};
    const char* out_names[] = {"topk_indices", "topk_logits", "topk_lengths"};
    for (int i = 0; i < 3; ++i) {
      if (outs[i]->present() && !outs[i]->is_contiguous()) {
        fail(out_names[i], "a contiguous (row-major) tensor",
             "strides " + outs[i]->strides_string() + " for shape " + outs[i]->shape_string());
      }
    }
    for (int i = 0; i < 3; ++i) {
      for (int j = i + 1; j < 3; ++j) {
        if (overlaps(*outs[i], *outs[j])) fail(out_names[i], std::string("memory disjoint from ") + out_names[j], "overlapping memory");
      }
      for (int j = 0; j < 9; ++j) {
        if (overlaps(*outs[i], *ins[j])) {
          fail(out_names[i], std::string("memory disjoint from input ") + in_names[j], "overlapping memory");
        }
      }
    }
  }

  // cuda only: cu_seqlens are copied to the host in one piece; index_q and
  // index_k rows are read with 16-byte vector loads.
  if (cuda) {
    for (int j = 5; j < 7 && thd; ++j) {
      const TensorView& v = *ins[j];
      if (v.strides[0] != 1 && v.shape[0] > 1) fail(in_names[j], "stride 1 on the cuda backend", "strides " + v.strides_string());
    }
    for (int j : {0, 2}) {
      const TensorView& v = *ins[j];
      if (reinterpret_cast<std::uintptr_t>(v.data) % 16 != 0) {
        fail(in_names[j], "a 16-byte aligned data pointer on the cuda backend", "misaligned pointer");
      }
      const int64_t per_16_bytes = 16 / static_cast<int64_t>(dtype_size(v.dtype));  // 8 bf16, 16 e4m3
      for (int i = 0; i + 1 < v.rank; ++i) {
        if (v.strides[i] % per_16_bytes != 0 && v.shape[i] > 1) {
          fail(in_names[j], "strides other than the last multiples of " + std::to_string(per_16_bytes) +
                                " elements (16 bytes) on the cuda backend",
               "strides " + v.strides_string());
        }
      }
    }
    check_cuda_key_rows(g);
  }

  // Scalars (causal_offset: any value; strict_ranges: a bool).
  if (opt.num_threads < 0) fail("num_threads", ">= 0 (0 = all hardware threads)", std::to_string(opt.num_threads));

  // Sequences, then strict ranges.
  const bool strict = opt.strict_ranges && ranges;
  if (strict && stream_capturing && copy_to_host) {
    fail("strict_ranges", "false while options.stream captures a CUDA graph (strict mode reads starts and ends on the host)",
         "true");
  }
  resolve_sequences(g, in.cu_seqlens_q, in.cu_seqlens_k, false, copy_to_host, opt.stream, stream_capturing,
                    "T_q (index_q dim 0)", "T_k (index_k dim 0)");
  g.normalization_count = std::max<int64_t>(g.num_q_rows, 1);
  if (strict) check_strict_ranges(in, g, copy_to_host, opt.stream);
  return g;
}

}  // namespace

ProblemGeometry validate_topk_problem(const IndexerTopkInputs& in, const IndexerTopkOutputs* out,
                                      const IndexerTopkOptions& opt, CopyToHost copy_to_host, bool stream_capturing,
                                      int64_t topk) {
  // e.g. the per-sequence tables of a huge cu_seqlens, the host copy of starts and ends
  return allocation_failure_as_out_of_memory(
      kOutOfMemoryValidate, [&] { return validate_unguarded(in, out, opt, copy_to_host, stream_capturing, topk); });
}

namespace {

/// The validation of a call on its backend: `out` null checks the inputs alone,
/// for a selection of `topk` keys.
ProblemGeometry validate_for_backend(const IndexerTopkInputs& in, const IndexerTopkOutputs* out,
                                     const IndexerTopkOptions& opt, int64_t topk = 0) {
  const bool cuda = opt.backend == Backend::cuda;
  // Availability first: cuda_stream_capturing needs a cuda build. An invalid
  // option is reported by validate_topk_problem before it.
  bool capturing = false;
  const bool reads_host = opt.layout == Layout::thd || opt.strict_ranges;
  if (cuda && reads_host && cuda_backend_compiled() && cuda_device_present()) {
    capturing = cuda_stream_capturing(opt.stream);
  }
  return validate_topk_problem(in, out, opt, cuda ? &cuda_copy_to_host : nullptr, capturing, topk);
}

}  // namespace
}  // namespace detail

void validate_indexer_topk_inputs(const IndexerTopkInputs& inputs, int64_t topk, const IndexerTopkOptions& options) {
  (void)detail::validate_for_backend(inputs, nullptr, options, topk);
}

std::size_t indexer_topk_workspace_size(const IndexerTopkInputs& inputs, const IndexerTopkOutputs& outputs,
                                        const IndexerTopkOptions& options) {
  const detail::ProblemGeometry g = detail::validate_for_backend(inputs, &outputs, options);
  return options.backend == Backend::cuda ? detail::plan_cuda_indexer_topk(inputs, outputs, g).workspace_bytes : 0;
}

namespace {

/// The call after validation (`g`): the cpu backend, or the cuda backend's plan,
/// its workspace (the caller's, from `allocator`, or, with neither, the
/// backend's own) checked against it, and the run.
void run_validated(const IndexerTopkInputs& inputs, const IndexerTopkOutputs& outputs,
                   const IndexerTopkOptions& options, const detail::ProblemGeometry& g, void* workspace,
                   std::size_t workspace_bytes, const WorkspaceAllocator* allocator = nullptr) {
  if (options.backend == Backend::cpu) {
    detail::run_cpu_indexer_topk(inputs, outputs, options, g);
    return;
  }
  const hopper::TopkPlan plan = detail::plan_cuda_indexer_topk(inputs, outputs, g);
  if (allocator != nullptr && allocator->allocate != nullptr && plan.workspace_bytes > 0) {
    workspace = detail::allocate_workspace(*allocator, plan.workspace_bytes);
    workspace_bytes = plan.workspace_bytes;
  }
  detail::check_caller_workspace(workspace, workspace_bytes, plan.workspace_bytes, "indexer_topk_workspace_size");
  detail::run_cuda_indexer_topk(plan, inputs, outputs, options, g, workspace, workspace_bytes);
}

}  // namespace

void indexer_topk(const IndexerTopkInputs& inputs, const IndexerTopkOutputs& outputs, const IndexerTopkOptions& options,
                  void* workspace, std::size_t workspace_bytes) {
  run_validated(inputs, outputs, options, detail::validate_for_backend(inputs, &outputs, options), workspace,
                workspace_bytes);
}

void indexer_topk(const IndexerTopkInputs& inputs, const IndexerTopkOutputs& outputs, const IndexerTopkOptions& options,
                  const WorkspaceAllocator& allocator) {
  run_validated(inputs, outputs, options, detail::validate_for_backend(inputs, &outputs, options), nullptr, 0,
                &allocator);
}

}  // namespace dsaib
