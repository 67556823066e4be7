// attention_target(): validate, then dispatch to a backend
// (docs/attention-target.md). The rules are validate_problem()'s wherever the
// indexer has the same one (src/core/validate_rules.hpp); the target adds its
// own tensors, sizes and the lse base.
#include "dsaib/attention_target.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

#include "api/attention_target_problem.hpp"
#include "api/cuda_backend.hpp"
#include "api/workspace_allocator.hpp"
#include "core/allocation.hpp"
#include "core/option_words.hpp"
#include "core/validate_rules.hpp"
#include "reference/attention_target_reference.hpp"

namespace dsaib {

const char* lse_base_name(LseBase base) {
  switch (base) {
    case LseBase::natural:
      return "natural";
    case LseBase::base2:
      return "base2";
  }
  return "unknown";
}

bool parse_lse_base(const std::string& word, LseBase* out) {
  return detail::parse_option_word(word, {LseBase::natural, LseBase::base2}, lse_base_name, out);
}

namespace detail {

IndexerOptions as_indexer_options(const AttentionTargetOptions& opt) {
  IndexerOptions o;
  o.layout = opt.layout;
  o.id_mode = opt.id_mode;
  o.backend = opt.backend;
  o.sm_scale = opt.sm_scale;
  o.strict_indices = opt.strict_indices;
  o.stream = opt.stream;
  o.num_threads = opt.num_threads;
  return o;
}

void check_attention_target_options_and_backend(const AttentionTargetOptions& opt) {
  const IndexerOptions indexer_opt = as_indexer_options(opt);
  check_options(indexer_opt);
  const auto b = static_cast<int32_t>(opt.lse_base);
  if (b != 0 && b != 1) fail("lse_base", "0 (natural) or 1 (base2)", std::to_string(b));
  check_options_and_backend(indexer_opt);
}

namespace {

ProblemGeometry validate_unguarded(const AttentionTargetInputs& in, const AttentionTargetOutputs* out,
                                   const AttentionTargetOptions& opt, CopyToHost copy_to_host, bool stream_capturing) {
  check_attention_target_options_and_backend(opt);

  ProblemGeometry g;
  g.layout = opt.layout;
  g.id_mode = opt.id_mode;
  const bool cuda = opt.backend == Backend::cuda;
  const DeviceType device = cuda ? DeviceType::cuda : DeviceType::cpu;
  const int device_index = in.query.device_index;
  const bool thd = opt.layout == Layout::thd;
  const int r = thd ? 1 : 0;  // rank offset: THD tensors have one dim fewer

  // Each tensor.
  check_tensor(in.query, {"query", {DType::bf16}, 4 - r}, device, device_index);
  check_tensor(in.kv, {"kv", {DType::bf16}, 3 - r}, device, device_index);
  // lse absent: the target computes each head's lse over the row's selected keys.
  const bool has_lse = in.lse.present();
  if (has_lse) check_tensor(in.lse, {"lse", {DType::f32}, 3 - r, true}, device, device_index);
  check_tensor(in.topk_indices, {"topk_indices", {DType::i32}, 3 - r}, device, device_index);
  if (out) check_tensor(out->attn_score, {"attn_score", {DType::f32}, 3 - r, true}, device, device_index);
  check_cu_seqlens_views(in.cu_seqlens_q, in.cu_seqlens_k, thd, device, device_index);

  // Sizes and shapes.
  const TensorView& q = in.query;
  read_problem_sizes(g, q, in.kv, in.topk_indices, thd);
  const std::string heads_dim = "Hq (heads, dim " + std::to_string(2 - r) + ")";
  const std::string got_heads = "Hq = " + std::to_string(g.heads) + " (shape " + q.shape_string() + ")";
  const std::string got_dim = "Dqk = " + std::to_string(g.head_dim) + " (shape " + q.shape_string() + ")";
  if (g.heads < 1) fail("query", heads_dim + " >= 1", got_heads);
  if (g.head_dim < 1) fail("query", "Dqk (last dim) >= 1", got_dim);
  if (cuda && (g.heads % 16 != 0 || g.heads > 128)) {
    fail("query", heads_dim + " a multiple of 16 in [16, 128] on the cuda backend", got_heads);
  }
  if (cuda && (g.head_dim % 64 != 0 || g.head_dim > 576)) {
    fail("query", "Dqk (last dim) a multiple of 64 in [64, 576] on the cuda backend", got_dim);
  }
  if (g.topk < 1) fail("topk_indices", "topk (last dim) >= 1", "topk = " + std::to_string(g.topk));
  const int64_t H = g.heads, D = g.head_dim, K = g.topk;
  if (thd) {
    const int64_t T = g.num_q_rows;
    check_shape(in.kv, "kv", {g.num_k_rows, D}, "(T_k, Dqk) with Dqk of query");
    if (has_lse) check_shape(in.lse, "lse", {T, H}, "(T_q, Hq)");
    check_shape(in.topk_indices, "topk_indices", {T, K}, "(T_q, topk)");
    if (out) check_shape(out->attn_score, "attn_score", {T, K}, "(T_q, topk), topk from topk_indices");
  } else {
    const int64_t B = g.batch, S = g.s_q;
    check_shape(in.kv, "kv", {B, g.s_kv, D}, "(B, S_kv, Dqk) with B and Dqk of query");
    if (has_lse) check_shape(in.lse, "lse", {B, S, H}, "(B, S_q, Hq)");
    check_shape(in.topk_indices, "topk_indices", {B, S, K}, "(B, S_q, topk)");
    if (out) check_shape(out->attn_score, "attn_score", {B, S, K}, "(B, S_q, topk), topk from topk_indices");
  }

  // Layouts: query, kv, topk_indices and the output row-major; lse any strides.
  const auto contiguous = [](const TensorView& v, const char* name) {
    if (!v.is_contiguous()) {
      fail(name, "a contiguous (row-major) tensor", "strides " + v.strides_string() + " for shape " + v.shape_string());
    }
  };
  contiguous(in.query, "query");
  contiguous(in.kv, "kv");
  contiguous(in.topk_indices, "topk_indices");
  if (out) {
    contiguous(out->attn_score, "attn_score");
    const TensorView* ins[] = {&in.query, &in.kv, &in.lse, &in.topk_indices, &in.cu_seqlens_q, &in.cu_seqlens_k};
    const char* in_names[] = {"query", "kv", "lse", "topk_indices", "cu_seqlens_q", "cu_seqlens_k"};
    for (int j = 0; j < 6; ++j) {
      if (overlaps(out->attn_score, *ins[j])) {
        fail("attn_score", std::string("memory disjoint from input ") + in_names[j], "overlapping memory");
      }
    }
  }

  // cuda only: cu_seqlens are copied to the host in one piece; query and kv
  // rows are read with 16-byte vector loads (their rows, Dqk a multiple of 64
  // bf16, are multiples of 16 bytes once the base is aligned).
  if (cuda) {
    for (const TensorView* v : {&in.cu_seqlens_q, &in.cu_seqlens_k}) {
      if (thd && v->strides[0] != 1 && v->shape[0] > 1) {
        fail(v == &in.cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k", "stride 1 on the cuda backend",
             "strides " + v->strides_string());
      }
    }
    for (const TensorView* v : {&in.query, &in.kv}) {
      if (reinterpret_cast<std::uintptr_t>(v->data) % 16 != 0) {
        fail(v == &in.query ? "query" : "kv", "a 16-byte aligned data pointer on the cuda backend", "misaligned pointer");
      }
    }
  }

  // Scalars.
  check_finite(opt.sm_scale, "sm_scale");
  if (opt.num_threads < 0) fail("num_threads", ">= 0 (0 = all hardware threads)", std::to_string(opt.num_threads));

  // Sequences, then strict ids.
  resolve_sequences(g, in.cu_seqlens_q, in.cu_seqlens_k, opt.strict_indices, copy_to_host, opt.stream,
                    stream_capturing, "T_q (query dim 0)", "T_k (kv dim 0)");
  g.normalization_count = std::max<int64_t>(g.num_q_rows, 1);
  if (!g.cu_seqlens_on_device_only && opt.strict_indices) check_strict_ids(in.topk_indices, g, copy_to_host, opt.stream);
  return g;
}

}  // namespace

ProblemGeometry validate_attention_target_problem(const AttentionTargetInputs& in, const AttentionTargetOutputs* out,
                                                  const AttentionTargetOptions& opt, CopyToHost copy_to_host,
                                                  bool stream_capturing) {
  // e.g. the per-sequence tables of a huge cu_seqlens
  return allocation_failure_as_out_of_memory(
      "out of memory: expected room in host memory to validate the arguments, got an allocation failure",
      [&] { return validate_unguarded(in, out, opt, copy_to_host, stream_capturing); });
}

namespace {

ProblemGeometry validate_for_backend(const AttentionTargetInputs& in, const AttentionTargetOutputs& out,
                                     const AttentionTargetOptions& opt) {
  const bool cuda = opt.backend == Backend::cuda;
  // Availability first: cuda_stream_capturing needs a cuda build. An invalid
  // option is reported by validate_attention_target_problem before it.
  bool capturing = false;
  if (cuda && opt.layout == Layout::thd && cuda_backend_compiled() && cuda_device_present()) {
    capturing = cuda_stream_capturing(opt.stream);  // THD inside a capture: cu_seqlens checked on the device
  }
  return validate_attention_target_problem(in, &out, opt, cuda ? &cuda_copy_to_host : nullptr, capturing);
}

}  // namespace
}  // namespace detail

std::size_t attention_target_workspace_size(const AttentionTargetInputs& inputs, const AttentionTargetOutputs& outputs,
                                            const AttentionTargetOptions& options) {
  const detail::ProblemGeometry g = detail::validate_for_backend(inputs, outputs, options);
  return options.backend == Backend::cuda ? detail::plan_cuda_attention_target(inputs, g).workspace_bytes : 0;
}

namespace {

/// The call after validation (`g`): the cpu backend, or the cuda backend's plan,
/// its workspace (the caller's, from `allocator`, or, with neither, the
/// backend's own) checked against it, and the run.
void run_validated(const AttentionTargetInputs& inputs, const AttentionTargetOutputs& outputs,
                   const AttentionTargetOptions& options, const detail::ProblemGeometry& g, void* workspace,
                   std::size_t workspace_bytes,
                   const WorkspaceAllocator* allocator = nullptr) {
  if (options.backend == Backend::cpu) {
    detail::run_cpu_attention_target(inputs, outputs, options, g);
    return;
  }
  const hopper::TargetPlan plan = detail::plan_cuda_attention_target(inputs, g);
  if (allocator != nullptr && allocator->allocate != nullptr && plan.workspace_bytes > 0) {
    workspace = detail::allocate_workspace(*allocator, plan.workspace_bytes);
    workspace_bytes = plan.workspace_bytes;
  }
  detail::check_caller_workspace(workspace, workspace_bytes, plan.workspace_bytes, "attention_target_workspace_size");
  detail::run_cuda_attention_target(plan, inputs, outputs, options, g, workspace, workspace_bytes);
}

}  // namespace

void attention_target(const AttentionTargetInputs& inputs, const AttentionTargetOutputs& outputs,
                      const AttentionTargetOptions& options, void* workspace, std::size_t workspace_bytes) {
  run_validated(inputs, outputs, options, detail::validate_for_backend(inputs, outputs, options), workspace,
                workspace_bytes);
}

void attention_target(const AttentionTargetInputs& inputs, const AttentionTargetOutputs& outputs,
                      const AttentionTargetOptions& options, const WorkspaceAllocator& allocator) {
  run_validated(inputs, outputs, options, detail::validate_for_backend(inputs, outputs, options), nullptr, 0, &allocator);
}

}  // namespace dsaib
