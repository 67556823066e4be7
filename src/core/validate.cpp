// Argument validation of the indexer's entry points (indexer_backward, the
// loss forward, the loss and gradients) over the shared rules
// (validate_rules.cpp). Every rule raises before any output is written.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/allocation.hpp"
#include "core/problem.hpp"
#include "core/validate_rules.hpp"

namespace dsaib::detail {

namespace {
ProblemGeometry validate_problem_unguarded(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                           const IndexerOptions& opt, CopyToHost copy_to_host,
                                           bool check_outputs, bool stream_capturing = false) {
  ProblemGeometry g;
  g.layout = opt.layout;
  g.id_mode = opt.id_mode;

  check_options(opt);
  const DeviceType device = opt.backend == Backend::cpu ? DeviceType::cpu : DeviceType::cuda;
  const int device_index = in.index_q.device_index;
  const bool thd = opt.layout == Layout::thd;
  const int r = thd ? 1 : 0;  // rank offset: THD tensors have one dim fewer

  check_tensor(in.index_q, {"index_q", {DType::bf16}, 4 - r}, device, device_index);
  check_tensor(in.weights, {"weights", {DType::bf16, DType::f32}, 3 - r, true}, device, device_index);
  check_tensor(in.index_k, {"index_k", {DType::bf16}, 3 - r}, device, device_index);
  check_tensor(in.topk_indices, {"topk_indices", {DType::i32}, 3 - r}, device, device_index);
  check_tensor(in.attn_score, {"attn_score", {DType::f32}, 3 - r, true}, device, device_index);
  if (in.topk_logits.present()) {
    fail("topk_logits",
         "absent here (an input of indexer_kl_forward and indexer_kl_loss_and_grad only; the backward recomputes "
         "the logits)",
         "a tensor");
  }
  // P in one of two forms: index_score, or the P-free row statistics.
  const bool p_free = !in.index_score.present();
  if (!p_free) {
    for (const auto* v : {&in.row_lse, &in.row_target_mass}) {
      if (v->present()) {
        fail(v == &in.row_lse ? "row_lse" : "row_target_mass",
             "absent when index_score is given (P comes either as index_score or as row_lse and row_target_mass)",
             "a tensor");
      }
    }
    check_tensor(in.index_score, {"index_score", {DType::f32}, 3 - r, true}, device, device_index);
  } else if (!in.row_lse.present() && !in.row_target_mass.present()) {
    fail("index_score", "a tensor, or row_lse and row_target_mass instead (the P-free form)", "nothing (absent)");
  } else {
    check_tensor(in.row_lse, {"row_lse", {DType::f32}, 2 - r, true}, device, device_index);
    check_tensor(in.row_target_mass, {"row_target_mass", {DType::f32}, 2 - r, true}, device, device_index);
  }
  if (check_outputs) {
    check_tensor(out.d_index_q, {"d_index_q", {DType::bf16, DType::f32}, 4 - r, true}, device, device_index);
    check_tensor(out.d_weights, {"d_weights", {DType::bf16, DType::f32}, 3 - r, true}, device, device_index);
    check_tensor(out.d_index_k, {"d_index_k", {DType::bf16, DType::f32}, 3 - r, true}, device, device_index);
  }

  // cu_seqlens views are checked here, before anything (the overlap test below)
  // walks their shape.
  check_cu_seqlens_views(in.cu_seqlens_q, in.cu_seqlens_k, thd, device, device_index);

  const TensorView& q = in.index_q;
  read_problem_sizes(g, q, in.index_k, in.topk_indices, thd);

  if (g.heads < 8 || g.heads > 128 || g.heads % 8 != 0) {
    fail("index_q", "H (heads, dim " + std::to_string(2 - r) + ") a multiple of 8 in [8, 128]",
         "H = " + std::to_string(g.heads) + " (shape " + q.shape_string() + ")");
  }
  if (g.head_dim != 64 && g.head_dim != 128) {
    fail("index_q", "D (last dim) 64 or 128", "D = " + std::to_string(g.head_dim) + " (shape " + q.shape_string() + ")");
  }
  if (g.topk < 1) fail("topk_indices", "topk (last dim) >= 1", "topk = " + std::to_string(g.topk));

  const int64_t H = g.heads, D = g.head_dim, K = g.topk;
  if (thd) {
    const int64_t T = g.num_q_rows, Tk = g.num_k_rows;
    check_shape(in.weights, "weights", {T, H}, "(T_q, H)");
    check_shape(in.index_k, "index_k", {Tk, D}, "(T_k, D)");
    check_shape(in.topk_indices, "topk_indices", {T, K}, "(T_q, topk)");
    check_shape(in.attn_score, "attn_score", {T, K}, "(T_q, topk), topk from topk_indices");
    if (!p_free) check_shape(in.index_score, "index_score", {T, K}, "(T_q, topk), topk from topk_indices");
    if (p_free) {
      check_shape(in.row_lse, "row_lse", {T}, "(T_q)");
      check_shape(in.row_target_mass, "row_target_mass", {T}, "(T_q)");
    }
    if (check_outputs) {
      check_shape(out.d_index_q, "d_index_q", {T, H, D}, "(T_q, H, D) like index_q");
      check_shape(out.d_weights, "d_weights", {T, H}, "(T_q, H) like weights");
      check_shape(out.d_index_k, "d_index_k", {Tk, D}, "(T_k, D) like index_k");
    }
  } else {
    const int64_t B = g.batch, S = g.s_q;
    check_shape(in.weights, "weights", {B, S, H}, "(B, S_q, H)");
    check_shape(in.index_k, "index_k", {B, g.s_kv, D}, "(B, S_kv, D) with B and D of index_q");
    check_shape(in.topk_indices, "topk_indices", {B, S, K}, "(B, S_q, topk)");
    check_shape(in.attn_score, "attn_score", {B, S, K}, "(B, S_q, topk), topk from topk_indices");
    if (!p_free) check_shape(in.index_score, "index_score", {B, S, K}, "(B, S_q, topk), topk from topk_indices");
    if (p_free) {
      check_shape(in.row_lse, "row_lse", {B, S}, "(B, S_q)");
      check_shape(in.row_target_mass, "row_target_mass", {B, S}, "(B, S_q)");
    }
    if (check_outputs) {
      check_shape(out.d_index_q, "d_index_q", {B, S, H, D}, "(B, S_q, H, D) like index_q");
      check_shape(out.d_weights, "d_weights", {B, S, H}, "(B, S_q, H) like weights");
      check_shape(out.d_index_k, "d_index_k", {B, g.s_kv, D}, "(B, S_kv, D) like index_k");
    }
  }

  // Outputs: contiguous, disjoint from each other and from every input.
  const TensorView* outs[] = {&out.d_index_q, &out.d_weights, &out.d_index_k};
  const char* out_names[] = {"d_index_q", "d_weights", "d_index_k"};
  for (int i = 0; i < (check_outputs ? 3 : 0); ++i) {
    if (!outs[i]->is_contiguous()) {
      fail(out_names[i], "a contiguous (row-major) tensor", "strides " + outs[i]->strides_string() +
                                                                " for shape " + outs[i]->shape_string());
    }
  }
  // grad_loss_device is an input too (4 bytes; the cuda kernel reads it while the
  // outputs are written); absent (null) it overlaps nothing.
  const TensorView grad_loss_view =
      opt.grad_loss_device ? contiguous_view(const_cast<float*>(opt.grad_loss_device), DType::f32, {1}) : TensorView{};
  const TensorView* ins[] = {&in.index_q,     &in.weights,      &in.index_k,      &in.topk_indices,
                             &in.attn_score,  &in.index_score,  &in.cu_seqlens_q, &in.cu_seqlens_k,
                             &grad_loss_view, &in.row_lse,      &in.row_target_mass};
  const char* in_names[] = {"index_q",          "weights",     "index_k",      "topk_indices",
                            "attn_score",       "index_score", "cu_seqlens_q", "cu_seqlens_k",
                            "grad_loss_device", "row_lse",     "row_target_mass"};
  for (int i = 0; i < (check_outputs ? 3 : 0); ++i) {
    for (int j = i + 1; j < 3; ++j) {
      if (overlaps(*outs[i], *outs[j])) fail(out_names[i], std::string("memory disjoint from ") + out_names[j], "overlapping memory");
    }
    for (int j = 0; j < 11; ++j) {
      if (overlaps(*outs[i], *ins[j])) fail(out_names[i], std::string("memory disjoint from input ") + in_names[j], "overlapping memory");
    }
  }

  // The cuda backend reads rows with 16-byte vector loads: innermost stride 1,
  // row strides and base pointers 16-byte aligned.
  if (device == DeviceType::cuda) {
    for (int j = 0; j < 6; ++j) {
      const TensorView& v = *ins[j];
      if (!v.present()) continue;  // index_score in the P-free form
      if (v.strides[v.rank - 1] != 1 && v.shape[v.rank - 1] > 1) {
        fail(in_names[j], "innermost stride 1 on the cuda backend", "strides " + v.strides_string());
      }
    }
    // cu_seqlens are copied to the host in one piece below (THD; absent for BSHD).
    for (int j = 6; j < 8 && thd; ++j) {
      const TensorView& v = *ins[j];
      if (v.strides[0] != 1 && v.shape[0] > 1) {
        fail(in_names[j], "stride 1 on the cuda backend", "strides " + v.strides_string());
      }
    }
    for (const TensorView* v : {&in.index_q, &in.index_k, &out.d_index_q, &out.d_index_k}) {
      if (!v->present()) continue;
      const char* nm = v == &in.index_q ? "index_q" : v == &in.index_k ? "index_k" : v == &out.d_index_q ? "d_index_q" : "d_index_k";
      if (reinterpret_cast<std::uintptr_t>(v->data) % 16 != 0) {
        fail(nm, "a 16-byte aligned data pointer on the cuda backend", "misaligned pointer");
      }
      for (int i = 0; i + 1 < v->rank; ++i) {
        if ((v->strides[i] * static_cast<int64_t>(dtype_size(v->dtype))) % 16 != 0 && v->shape[i] > 1) {
          fail(nm, "row strides that are multiples of 16 bytes on the cuda backend", "strides " + v->strides_string());
        }
      }
    }
    // Here, not when the launch is planned, so that the workspace queries,
    // which plan nothing, raise it as the calls do.
    check_cuda_key_rows(g);
  }

  check_finite(opt.sm_scale, "sm_scale");
  check_finite(opt.loss_coeff, "loss_coeff");
  if (opt.grad_loss_device == nullptr) check_finite(opt.grad_loss, "grad_loss");
  else if (reinterpret_cast<std::uintptr_t>(opt.grad_loss_device) % 4 != 0) fail("grad_loss_device", "a 4-byte aligned pointer", "misaligned pointer");
  // cpu: the scalar is host memory and is read now, like grad_loss. (cuda: the
  // kernel reads it at run time, so that graph replays may change it; not checked.)
  else if (opt.backend == Backend::cpu) check_finite(*opt.grad_loss_device, "grad_loss_device");
  if (opt.normalization_count < 0) {
    fail("normalization_count", ">= 0 (0 = number of query tokens)", std::to_string(opt.normalization_count));
  }
  if (opt.num_threads < 0) fail("num_threads", ">= 0 (0 = all hardware threads)", std::to_string(opt.num_threads));
  {
    const auto a = static_cast<int32_t>(opt.a_operand_precision);
    if (a < 0 || a > 2) fail("a_operand_precision", "0 (automatic), 1 (bf16x2) or 2 (bf16)", std::to_string(a));
    const auto h = static_cast<int32_t>(opt.l2_hints);
    if (h < 0 || h > 2) fail("l2_hints", "0 (automatic), 1 (on) or 2 (off)", std::to_string(h));
    const auto s = static_cast<int32_t>(opt.start_stagger);
    if (s < 0 || s > 1) fail("start_stagger", "0 (automatic) or 1 (off)", std::to_string(s));
  }
  {
    const auto f = static_cast<int32_t>(opt.forward_fusion);
    if (f < 0 || f > 1) fail("forward_fusion", "0 (automatic) or 1 (off)", std::to_string(f));
  }

  // Sequences (the views were checked above).
  resolve_sequences(g, in.cu_seqlens_q, in.cu_seqlens_k, opt.strict_indices, copy_to_host, opt.stream, stream_capturing,
                    "T_q (index_q dim 0)", "T_k (index_k dim 0)");
  g.normalization_count = opt.normalization_count > 0 ? opt.normalization_count : std::max<int64_t>(g.num_q_rows, 1);
  if (g.cu_seqlens_on_device_only) return g;

  // Strict ids: -1 marks an empty slot and is allowed; any other id outside
  // the row's sequence is reported.
  if (opt.strict_indices) check_strict_ids(in.topk_indices, g, copy_to_host, opt.stream);
  return g;
}
}  // namespace

void check_topk_logits(const IndexerInputs& in, const IndexerOptions& opt, const ProblemGeometry& g) {
  const TensorView& v = in.topk_logits;
  if (!v.present()) return;
  const DeviceType device = opt.backend == Backend::cpu ? DeviceType::cpu : DeviceType::cuda;
  const bool thd = opt.layout == Layout::thd;
  check_tensor(v, {"topk_logits", {DType::f32}, thd ? 2 : 3, true}, device, in.index_q.device_index);
  if (thd) check_shape(v, "topk_logits", {g.num_q_rows, g.topk}, "(T_q, topk) like topk_indices");
  else check_shape(v, "topk_logits", {g.batch, g.s_q, g.topk}, "(B, S_q, topk) like topk_indices");
  if (device == DeviceType::cuda && v.strides[v.rank - 1] != 1 && v.shape[v.rank - 1] > 1) {
    fail("topk_logits", "innermost stride 1 on the cuda backend", "strides " + v.strides_string());
  }
}

ProblemGeometry validate_problem(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                 const IndexerOptions& opt, CopyToHost copy_to_host,
                                 bool check_outputs, bool stream_capturing) {
  // e.g. the per-sequence tables of a huge cu_seqlens
  return allocation_failure_as_out_of_memory(
      "out of memory: expected room in host memory to validate the arguments, got an allocation failure",
      [&] { return validate_problem_unguarded(in, out, opt, copy_to_host, check_outputs, stream_capturing); });
}

ProblemGeometry validate_kl_loss_and_grad_problem(const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                                                  const IndexerOptions& opt, CopyToHost copy_to_host,
                                                  bool stream_capturing) {
  return allocation_failure_as_out_of_memory(
      "out of memory: expected room in host memory to validate the arguments, got an allocation failure", [&] {
        check_options(opt);
        const char* why = "absent in the inputs of indexer_kl_loss_and_grad (its forward computes P)";
        if (in.index_score.present()) fail("index_score", why, "a tensor");
        if (in.row_lse.present()) fail("row_lse", why, "a tensor");
        if (in.row_target_mass.present()) fail("row_target_mass", why, "a tensor");
        IndexerInputs with_target = in;
        with_target.index_score = in.attn_score;  // stands in for P: same rules
        with_target.topk_logits = {};             // its own rule below, once the sizes are known
        const IndexerBackwardOutputs gradients{out.d_index_q, out.d_weights, out.d_index_k};
        ProblemGeometry g = validate_problem_unguarded(with_target, gradients, opt, copy_to_host, true, stream_capturing);
        check_topk_logits(in, opt, g);
        const DeviceType device = opt.backend == Backend::cpu ? DeviceType::cpu : DeviceType::cuda;
        check_tensor(out.loss, {"loss", {DType::f32}, 0, true}, device, in.index_q.device_index);
        for (const auto& [grad, name] : {std::pair{&out.d_index_q, "d_index_q"}, std::pair{&out.d_weights, "d_weights"},
                                         std::pair{&out.d_index_k, "d_index_k"}}) {
          if (overlaps(*grad, in.topk_logits)) fail(name, "memory disjoint from input topk_logits", "overlapping memory");
        }
        const TensorView* others[] = {&out.d_index_q,  &out.d_weights,    &out.d_index_k,    &in.index_q,
                                      &in.weights,     &in.index_k,       &in.topk_indices,  &in.attn_score,
                                      &in.cu_seqlens_q, &in.cu_seqlens_k, &in.topk_logits};
        const char* names[] = {"d_index_q", "d_weights",    "d_index_k",    "index_q",      "weights",     "index_k",
                               "topk_indices", "attn_score", "cu_seqlens_q", "cu_seqlens_k", "topk_logits"};
        for (int j = 0; j < 11; ++j) {
          if (overlaps(out.loss, *others[j])) {
            fail("loss", std::string("memory disjoint from ") + (j < 3 ? "" : "input ") + names[j], "overlapping memory");
          }
        }
        if (opt.grad_loss_device && overlaps(out.loss, contiguous_view(const_cast<float*>(opt.grad_loss_device), DType::f32, {1}))) {
          fail("loss", "memory disjoint from input grad_loss_device", "overlapping memory");
        }
        return g;
      });
}

}  // namespace dsaib::detail

namespace dsaib::detail {

ProblemGeometry validate_kl_forward_problem(const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                                            const IndexerOptions& opt, CopyToHost copy_to_host) {
  return allocation_failure_as_out_of_memory(
      "out of memory: expected room in host memory to validate the arguments, got an allocation failure", [&] {
        check_options(opt);
        if (in.index_score.present()) {
          fail("index_score", "absent in the inputs of the forward (it writes P to outputs.index_score)", "a tensor");
        }
        if (in.row_lse.present()) fail("row_lse", "absent in the inputs of the forward (it writes outputs.row_lse)", "a tensor");
        if (in.row_target_mass.present()) {
          fail("row_target_mass", "absent in the inputs of the forward (it writes outputs.row_target_mass)", "a tensor");
        }
        // The inputs' rules are the backward's; attn_score stands in for the
        // absent index_score (same dtype and shape, already checked before it).
        IndexerInputs with_target = in;
        with_target.index_score = in.attn_score;
        with_target.topk_logits = {};  // its own rule below, once the sizes are known
        ProblemGeometry g = validate_problem_unguarded(with_target, {}, opt, copy_to_host, false);
        check_topk_logits(in, opt, g);

        const DeviceType device = opt.backend == Backend::cpu ? DeviceType::cpu : DeviceType::cuda;
        const int device_index = in.index_q.device_index;
        const bool thd = opt.layout == Layout::thd;
        check_tensor(out.loss, {"loss", {DType::f32}, 0, true}, device, device_index);
        check_tensor(out.row_lse, {"row_lse", {DType::f32}, thd ? 1 : 2, true}, device, device_index);
        check_tensor(out.row_target_mass, {"row_target_mass", {DType::f32}, thd ? 1 : 2, true}, device, device_index);
        if (out.index_score.present()) {
          check_tensor(out.index_score, {"index_score", {DType::f32}, thd ? 2 : 3, true}, device, device_index);
        }
        if (thd) {
          check_shape(out.row_lse, "row_lse", {g.num_q_rows}, "(T_q)");
          check_shape(out.row_target_mass, "row_target_mass", {g.num_q_rows}, "(T_q)");
          if (out.index_score.present()) {
            check_shape(out.index_score, "index_score", {g.num_q_rows, g.topk}, "(T_q, topk) like topk_indices");
          }
        } else {
          check_shape(out.row_lse, "row_lse", {g.batch, g.s_q}, "(B, S_q)");
          check_shape(out.row_target_mass, "row_target_mass", {g.batch, g.s_q}, "(B, S_q)");
          if (out.index_score.present()) {
            check_shape(out.index_score, "index_score", {g.batch, g.s_q, g.topk}, "(B, S_q, topk) like topk_indices");
          }
        }
        const TensorView* outs[] = {&out.loss, &out.row_lse, &out.row_target_mass, &out.index_score};
        const char* out_names[] = {"loss", "row_lse", "row_target_mass", "index_score"};
        const TensorView* ins[] = {&in.index_q,    &in.weights,      &in.index_k,      &in.topk_indices,
                                   &in.attn_score, &in.cu_seqlens_q, &in.cu_seqlens_k, &in.topk_logits};
        const char* in_names[] = {"index_q",    "weights",      "index_k",      "topk_indices",
                                  "attn_score", "cu_seqlens_q", "cu_seqlens_k", "topk_logits"};
        for (int i = 0; i < 4; ++i) {
          if (outs[i]->present() && !outs[i]->is_contiguous()) {
            fail(out_names[i], "a contiguous (row-major) tensor",
                 "strides " + outs[i]->strides_string() + " for shape " + outs[i]->shape_string());
          }
        }
        for (int i = 0; i < 4; ++i) {
          for (int j = i + 1; j < 4; ++j) {
            if (overlaps(*outs[i], *outs[j])) {
              fail(out_names[i], std::string("memory disjoint from ") + out_names[j], "overlapping memory");
            }
          }
          for (int j = 0; j < 8; ++j) {
            if (overlaps(*outs[i], *ins[j])) {
              fail(out_names[i], std::string("memory disjoint from input ") + in_names[j], "overlapping memory");
            }
          }
        }
        return g;
      });
}

}  // namespace dsaib::detail
