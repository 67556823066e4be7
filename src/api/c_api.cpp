// extern "C" wrapper over dsaib::indexer_backward. Exceptions never cross it.
#include "dsaib/dsaib.h"

#include <new>
#include <string>

#include "api/attention_target_problem.hpp"
#include "api/cuda_backend.hpp"
#include "api/indexer_topk_problem.hpp"
#include "dsaib/attention_target.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/indexer_kl_forward.hpp"
#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "dsaib/indexer_topk.hpp"

namespace {

// guarded() returns an Error's code as the status: the two enums must agree.
static_assert(DSAIB_OK == static_cast<int>(dsaib::ErrorCode::ok) &&
                  DSAIB_INVALID_ARGUMENT == static_cast<int>(dsaib::ErrorCode::invalid_argument) &&
                  DSAIB_UNSUPPORTED == static_cast<int>(dsaib::ErrorCode::unsupported) &&
                  DSAIB_INDEX_OUT_OF_RANGE == static_cast<int>(dsaib::ErrorCode::index_out_of_range) &&
                  DSAIB_BACKEND_UNAVAILABLE == static_cast<int>(dsaib::ErrorCode::backend_unavailable) &&
                  DSAIB_CUDA_ERROR == static_cast<int>(dsaib::ErrorCode::cuda_error) &&
                  DSAIB_IO_ERROR == static_cast<int>(dsaib::ErrorCode::io_error) &&
                  DSAIB_INTERNAL == static_cast<int>(dsaib::ErrorCode::internal) &&
                  DSAIB_OUT_OF_MEMORY == static_cast<int>(dsaib::ErrorCode::out_of_memory),
              "dsaib_status (dsaib.h) and dsaib::ErrorCode (error.hpp) must have the same values");
// convert() casts the options' enum fields: the C and C++ enums must agree.
static_assert(DSAIB_A_OPERAND_AUTOMATIC == static_cast<int>(dsaib::AOperandPrecision::automatic) &&
                  DSAIB_A_OPERAND_BF16X2 == static_cast<int>(dsaib::AOperandPrecision::bf16x2) &&
                  DSAIB_A_OPERAND_BF16 == static_cast<int>(dsaib::AOperandPrecision::bf16) &&
                  DSAIB_L2_HINTS_AUTOMATIC == static_cast<int>(dsaib::L2Hints::automatic) &&
                  DSAIB_L2_HINTS_ON == static_cast<int>(dsaib::L2Hints::on) &&
                  DSAIB_L2_HINTS_OFF == static_cast<int>(dsaib::L2Hints::off) &&
                  DSAIB_START_STAGGER_AUTOMATIC == static_cast<int>(dsaib::StartStagger::automatic) &&
                  DSAIB_START_STAGGER_OFF == static_cast<int>(dsaib::StartStagger::off) &&
                  DSAIB_FORWARD_FUSION_AUTOMATIC == static_cast<int>(dsaib::ForwardFusion::automatic) &&
                  DSAIB_FORWARD_FUSION_OFF == static_cast<int>(dsaib::ForwardFusion::off),
              "the option enums of dsaib.h and indexer_backward.hpp must have the same values");
static_assert(DSAIB_LSE_NATURAL == static_cast<int>(dsaib::LseBase::natural) &&
                  DSAIB_LSE_BASE2 == static_cast<int>(dsaib::LseBase::base2),
              "dsaib_lse_base (dsaib.h) and dsaib::LseBase (attention_target.hpp) must have the same values");

static_assert(DSAIB_TOPK_LOGIT_DESCENDING == static_cast<int>(dsaib::TopkOrder::logit_descending) &&
                  DSAIB_TOPK_ID_ASCENDING == static_cast<int>(dsaib::TopkOrder::id_ascending) &&
                  DSAIB_CAUSAL_OFFSET_AUTO == dsaib::kCausalOffsetAuto,
              "dsaib_topk_order and DSAIB_CAUSAL_OFFSET_AUTO (dsaib.h) must match indexer_topk.hpp");

thread_local std::string g_last_error;

dsaib::TensorView to_view(const dsaib_tensor& t) {
  dsaib::TensorView v;
  v.data = t.data;
  v.dtype = static_cast<dsaib::DType>(t.dtype);
  v.rank = t.rank;
  for (int i = 0; i < 4; ++i) {
    v.shape[i] = t.shape[i];
    v.strides[i] = t.strides[i];
  }
  v.device = static_cast<dsaib::DeviceType>(t.device);
  v.device_index = t.device_index;
  return v;
}

void check_enums(const dsaib_tensor& t, const char* name) {
  if (t.rank < 0 || t.rank > 4) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, name,
                       std::string(name) + ": expected rank 0..4, got " + std::to_string(t.rank));
  }
  if (t.dtype < 0 || t.dtype > 4) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, name,
                       std::string(name) + ": expected dtype 0 (bf16), 1 (f32), 2 (i32), 3 (f64) or 4 (e4m3), got " + std::to_string(t.dtype));
  }
  if (t.device < 0 || t.device > 1) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, name,
                       std::string(name) + ": expected device 0 (cpu) or 1 (cuda), got " + std::to_string(t.device));
  }
}

template <class Fn>
dsaib_status guarded(Fn fn) {
  try {
    fn();
    g_last_error.clear();
    return DSAIB_OK;
  } catch (const dsaib::Error& e) {
    g_last_error = e.what();
    return static_cast<dsaib_status>(e.code());
  } catch (const std::bad_alloc& e) {
    g_last_error = std::string("out of memory: ") + e.what();
    return DSAIB_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    g_last_error = std::string("internal: ") + e.what();
    return DSAIB_INTERNAL;
  } catch (...) {
    g_last_error = "internal: unknown exception";
    return DSAIB_INTERNAL;
  }
}

void require(const void* p, const char* name) {
  if (!p) throw dsaib::Error(dsaib::ErrorCode::invalid_argument, name, std::string(name) + ": expected a non-null pointer, got NULL");
}

void convert(const dsaib_inputs* in, const dsaib_outputs* out, const dsaib_options* opt, dsaib::IndexerInputs& i,
             dsaib::IndexerBackwardOutputs& o, dsaib::IndexerOptions& p) {
  require(in, "inputs");
  require(out, "outputs");
  require(opt, "options");
  const dsaib_tensor* ts[] = {&in->index_q, &in->weights, &in->index_k, &in->topk_indices, &in->attn_score,
                              &in->index_score, &in->cu_seqlens_q, &in->cu_seqlens_k, &out->d_index_q,
                              &out->d_weights, &out->d_index_k, &in->row_lse, &in->row_target_mass,
                              &in->topk_logits};
  const char* names[] = {"index_q", "weights", "index_k", "topk_indices", "attn_score", "index_score",
                         "cu_seqlens_q", "cu_seqlens_k", "d_index_q", "d_weights", "d_index_k", "row_lse",
                         "row_target_mass", "topk_logits"};
  p.layout = static_cast<dsaib::Layout>(opt->layout);
  p.id_mode = static_cast<dsaib::IdMode>(opt->id_mode);
  p.backend = static_cast<dsaib::Backend>(opt->backend);
  p.sm_scale = opt->sm_scale;
  p.loss_coeff = opt->loss_coeff;
  p.grad_loss = opt->grad_loss;
  p.grad_loss_device = opt->grad_loss_device;
  p.normalization_count = opt->normalization_count;
  p.strict_indices = opt->strict_indices != 0;
  p.deterministic = opt->deterministic != 0;
  p.stream = opt->stream;
  p.num_threads = opt->num_threads;
  p.a_operand_precision = static_cast<dsaib::AOperandPrecision>(opt->a_operand_precision);
  p.l2_hints = static_cast<dsaib::L2Hints>(opt->l2_hints);
  p.start_stagger = static_cast<dsaib::StartStagger>(opt->start_stagger);
  p.forward_fusion = static_cast<dsaib::ForwardFusion>(opt->forward_fusion);
  // The C++ order (errors.md): options and the backend first, then the tensors,
  // whose enum fields C can set to anything (checked before any view is used).
  dsaib::detail::check_options_and_backend(p);
  for (int k = 0; k < 14; ++k) check_enums(*ts[k], names[k]);
  i = {to_view(in->index_q),      to_view(in->weights),      to_view(in->index_k),
       to_view(in->topk_indices), to_view(in->attn_score),   to_view(in->index_score),
       to_view(in->cu_seqlens_q), to_view(in->cu_seqlens_k), to_view(in->row_lse),
       to_view(in->row_target_mass), to_view(in->topk_logits)};
  o = {to_view(out->d_index_q), to_view(out->d_weights), to_view(out->d_index_k)};
}

/// convert() for the forward: its inputs and options, then its four outputs.
void convert_forward(const dsaib_inputs* in, const dsaib_kl_forward_outputs* out, const dsaib_options* opt,
                     dsaib::IndexerInputs& i, dsaib::IndexerKLForwardOutputs& o, dsaib::IndexerOptions& p) {
  require(in, "inputs");  // the order of convert(): inputs, outputs, options
  require(out, "outputs");
  const dsaib_outputs no_gradients{};
  dsaib::IndexerBackwardOutputs unused;
  convert(in, &no_gradients, opt, i, unused, p);
  const dsaib_tensor* ts[] = {&out->loss, &out->row_lse, &out->row_target_mass, &out->index_score};
  const char* names[] = {"loss", "row_lse", "row_target_mass", "index_score"};
  for (int k = 0; k < 4; ++k) check_enums(*ts[k], names[k]);
  o = {to_view(out->loss), to_view(out->row_lse), to_view(out->row_target_mass), to_view(out->index_score)};
}

/// convert() for the one-call loss and gradients: its inputs, options and gradients, then loss.
void convert_loss_and_grad(const dsaib_inputs* in, const dsaib_kl_loss_and_grad_outputs* out, const dsaib_options* opt,
                           dsaib::IndexerInputs& i, dsaib::IndexerKLLossAndGradOutputs& o,
                           dsaib::IndexerOptions& p) {
  require(in, "inputs");  // the order of convert(): inputs, outputs, options
  require(out, "outputs");
  const dsaib_outputs gradients{out->d_index_q, out->d_weights, out->d_index_k};
  dsaib::IndexerBackwardOutputs g;
  convert(in, &gradients, opt, i, g, p);
  check_enums(out->loss, "loss");
  o = {to_view(out->loss), g.d_index_q, g.d_weights, g.d_index_k};
}

/// convert() for the attention target: options (then the backend's
/// availability), then the tensors' enum fields, as the other entries.
void convert_target(const dsaib_attention_target_inputs* in, const dsaib_attention_target_outputs* out,
                    const dsaib_attention_target_options* opt, dsaib::AttentionTargetInputs& i,
                    dsaib::AttentionTargetOutputs& o, dsaib::AttentionTargetOptions& p) {
  require(in, "inputs");
  require(out, "outputs");
  require(opt, "options");
  p.layout = static_cast<dsaib::Layout>(opt->layout);
  p.id_mode = static_cast<dsaib::IdMode>(opt->id_mode);
  p.backend = static_cast<dsaib::Backend>(opt->backend);
  p.sm_scale = opt->sm_scale;
  p.lse_base = static_cast<dsaib::LseBase>(opt->lse_base);
  p.normalize = opt->normalize != 0;
  p.strict_indices = opt->strict_indices != 0;
  p.stream = opt->stream;
  p.num_threads = opt->num_threads;
  dsaib::detail::check_attention_target_options_and_backend(p);
  const dsaib_tensor* ts[] = {&in->query, &in->kv, &in->lse, &in->topk_indices, &out->attn_score,
                              &in->cu_seqlens_q, &in->cu_seqlens_k};
  const char* names[] = {"query", "kv", "lse", "topk_indices", "attn_score", "cu_seqlens_q", "cu_seqlens_k"};
  for (int k = 0; k < 7; ++k) check_enums(*ts[k], names[k]);
  i = {to_view(in->query),        to_view(in->kv),           to_view(in->lse),
       to_view(in->topk_indices), to_view(in->cu_seqlens_q), to_view(in->cu_seqlens_k)};
  o = {to_view(out->attn_score)};
}

/// convert() for the top-k: options (then the backend's availability), then
/// the tensors' enum fields, as the other entries.
void convert_topk(const dsaib_indexer_topk_inputs* in, const dsaib_indexer_topk_outputs* out,
                  const dsaib_indexer_topk_options* opt, dsaib::IndexerTopkInputs& i, dsaib::IndexerTopkOutputs& o,
                  dsaib::IndexerTopkOptions& p) {
  require(in, "inputs");
  require(out, "outputs");
  require(opt, "options");
  p.layout = static_cast<dsaib::Layout>(opt->layout);
  p.id_mode = static_cast<dsaib::IdMode>(opt->id_mode);
  p.backend = static_cast<dsaib::Backend>(opt->backend);
  p.order = static_cast<dsaib::TopkOrder>(opt->order);
  p.causal_offset = opt->causal_offset;
  p.strict_ranges = opt->strict_ranges != 0;
  p.stream = opt->stream;
  p.num_threads = opt->num_threads;
  dsaib::detail::check_topk_options_and_backend(p);
  const dsaib_tensor* ts[] = {&in->index_q,      &in->weights,       &in->index_k,        &in->starts,
                              &in->ends,         &out->topk_indices, &out->topk_logits,   &out->topk_lengths,
                              &in->cu_seqlens_q, &in->cu_seqlens_k, &in->index_q_scale, &in->index_k_scale};
  const char* names[] = {"index_q", "weights",      "index_k",      "starts",       "ends",
                         "topk_indices", "topk_logits", "topk_lengths", "cu_seqlens_q", "cu_seqlens_k",
                         "index_q_scale", "index_k_scale"};
  for (int k = 0; k < 12; ++k) check_enums(*ts[k], names[k]);
  i = {to_view(in->index_q), to_view(in->weights),      to_view(in->index_k),     to_view(in->starts),
       to_view(in->ends),    to_view(in->cu_seqlens_q), to_view(in->cu_seqlens_k), to_view(in->index_q_scale),
       to_view(in->index_k_scale)};
  o = {to_view(out->topk_indices), to_view(out->topk_logits), to_view(out->topk_lengths)};
}

/// The C++ views of one operation's C arguments.
template <class Inputs, class Outputs, class Options>
struct Views {
  Inputs i;
  Outputs o;
  Options p;
};
using BackwardViews = Views<dsaib::IndexerInputs, dsaib::IndexerBackwardOutputs, dsaib::IndexerOptions>;
using KLForwardViews = Views<dsaib::IndexerInputs, dsaib::IndexerKLForwardOutputs, dsaib::IndexerOptions>;
using LossAndGradViews = Views<dsaib::IndexerInputs, dsaib::IndexerKLLossAndGradOutputs, dsaib::IndexerOptions>;
using TargetViews = Views<dsaib::AttentionTargetInputs, dsaib::AttentionTargetOutputs, dsaib::AttentionTargetOptions>;
using TopkViews = Views<dsaib::IndexerTopkInputs, dsaib::IndexerTopkOutputs, dsaib::IndexerTopkOptions>;

/// An operation's entry point: its C arguments converted (`convert` checks
/// them in the documented order), then `run` on the views; an exception
/// becomes the status and the last error.
template <class V, class CIn, class COut, class COpt, class Convert, class Run>
dsaib_status run_converted(const CIn* in, const COut* out, const COpt* opt, Convert convert, Run run) {
  return guarded([&] {
    V v;
    convert(in, out, opt, v.i, v.o, v.p);
    run(v);
  });
}

/// An operation's workspace-size entry point: `bytes` is checked first, then as
/// run_converted, and *bytes is written only on success.
template <class V, class CIn, class COut, class COpt, class Convert, class Size>
dsaib_status size_converted(const CIn* in, const COut* out, const COpt* opt, size_t* bytes, Convert convert,
                            Size size) {
  return guarded([&] {
    require(bytes, "bytes");
    V v;
    convert(in, out, opt, v.i, v.o, v.p);
    *bytes = size(v.i, v.o, v.p);
  });
}

}  // namespace

extern "C" {

void dsaib_default_options(dsaib_options* options) {
  if (!options) return;
  const dsaib::IndexerOptions d;
  options->layout = static_cast<int32_t>(d.layout);
  options->id_mode = static_cast<int32_t>(d.id_mode);
  options->backend = static_cast<int32_t>(d.backend);
  options->sm_scale = d.sm_scale;
  options->loss_coeff = d.loss_coeff;
  options->grad_loss = d.grad_loss;
  options->grad_loss_device = d.grad_loss_device;
  options->normalization_count = d.normalization_count;
  options->strict_indices = d.strict_indices;
  options->deterministic = d.deterministic;
  options->stream = d.stream;
  options->num_threads = d.num_threads;
  options->a_operand_precision = static_cast<int32_t>(d.a_operand_precision);
  options->l2_hints = static_cast<int32_t>(d.l2_hints);
  options->start_stagger = static_cast<int32_t>(d.start_stagger);
  options->forward_fusion = static_cast<int32_t>(d.forward_fusion);
}

dsaib_status dsaib_contiguous_tensor(dsaib_tensor* view, void* data, dsaib_dtype dtype, const int64_t* shape,
                                     int32_t rank, dsaib_device device, int32_t device_index) {
  return guarded([&] {
    require(view, "view");
    if (rank > 0 && rank <= 4) require(shape, "shape");  // a bad rank is named first (contiguous_view)
    if (static_cast<int32_t>(dtype) < 0 || static_cast<int32_t>(dtype) > 4) {
      throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "dtype",
                         "dtype: expected 0 (bf16), 1 (f32), 2 (i32), 3 (f64) or 4 (e4m3), got " + std::to_string(static_cast<int32_t>(dtype)));
    }
    if (static_cast<int32_t>(device) < 0 || static_cast<int32_t>(device) > 1) {
      throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "device",
                         "device: expected 0 (cpu) or 1 (cuda), got " + std::to_string(static_cast<int32_t>(device)));
    }
    const dsaib::TensorView v = dsaib::contiguous_view(data, static_cast<dsaib::DType>(dtype), shape, rank,
                                                      static_cast<dsaib::DeviceType>(device), device_index);
    view->data = v.data;
    view->dtype = static_cast<int32_t>(v.dtype);
    view->rank = v.rank;
    for (int i = 0; i < 4; ++i) {
      view->shape[i] = v.shape[i];
      view->strides[i] = v.strides[i];
    }
    view->device = static_cast<int32_t>(v.device);
    view->device_index = v.device_index;
  });
}

dsaib_status dsaib_indexer_backward_workspace_size(const dsaib_inputs* inputs, const dsaib_outputs* outputs,
                                                   const dsaib_options* options, size_t* bytes) {
  return size_converted<BackwardViews>(inputs, outputs, options, bytes, convert,
                                       [](auto&... a) { return dsaib::indexer_backward_workspace_size(a...); });
}

dsaib_status dsaib_indexer_backward(const dsaib_inputs* inputs, const dsaib_outputs* outputs,
                                    const dsaib_options* options, void* workspace, size_t workspace_bytes) {
  return run_converted<BackwardViews>(inputs, outputs, options, convert, [&](BackwardViews& v) {
    dsaib::indexer_backward(v.i, v.o, v.p, workspace, workspace_bytes);
  });
}

dsaib_status dsaib_indexer_kl_forward_workspace_size(const dsaib_inputs* inputs, const dsaib_kl_forward_outputs* outputs,
                                                     const dsaib_options* options, size_t* bytes) {
  return size_converted<KLForwardViews>(inputs, outputs, options, bytes, convert_forward,
                                        [](auto&... a) { return dsaib::indexer_kl_forward_workspace_size(a...); });
}

dsaib_status dsaib_indexer_kl_forward(const dsaib_inputs* inputs, const dsaib_kl_forward_outputs* outputs,
                                      const dsaib_options* options, void* workspace, size_t workspace_bytes) {
  return run_converted<KLForwardViews>(inputs, outputs, options, convert_forward, [&](KLForwardViews& v) {
    dsaib::indexer_kl_forward(v.i, v.o, v.p, workspace, workspace_bytes);
  });
}

dsaib_status dsaib_indexer_kl_loss_and_grad_workspace_size(const dsaib_inputs* inputs,
                                                           const dsaib_kl_loss_and_grad_outputs* outputs,
                                                           const dsaib_options* options, size_t* bytes) {
  return size_converted<LossAndGradViews>(inputs, outputs, options, bytes, convert_loss_and_grad, [](auto&... a) {
    return dsaib::indexer_kl_loss_and_grad_workspace_size(a...);
  });
}

dsaib_status dsaib_indexer_kl_loss_and_grad(const dsaib_inputs* inputs, const dsaib_kl_loss_and_grad_outputs* outputs,
                                            const dsaib_options* options, void* workspace, size_t workspace_bytes) {
  return run_converted<LossAndGradViews>(inputs, outputs, options, convert_loss_and_grad, [&](LossAndGradViews& v) {
    dsaib::indexer_kl_loss_and_grad(v.i, v.o, v.p, workspace, workspace_bytes);
  });
}

void dsaib_default_attention_target_options(dsaib_attention_target_options* options) {
  if (!options) return;
  const dsaib::AttentionTargetOptions d;
  options->layout = static_cast<int32_t>(d.layout);
  options->id_mode = static_cast<int32_t>(d.id_mode);
  options->backend = static_cast<int32_t>(d.backend);
  options->sm_scale = d.sm_scale;
  options->lse_base = static_cast<int32_t>(d.lse_base);
  options->normalize = d.normalize ? 1 : 0;
  options->strict_indices = d.strict_indices ? 1 : 0;
  options->stream = d.stream;
  options->num_threads = d.num_threads;
}

dsaib_status dsaib_attention_target_workspace_size(const dsaib_attention_target_inputs* inputs,
                                                   const dsaib_attention_target_outputs* outputs,
                                                   const dsaib_attention_target_options* options, size_t* bytes) {
  return size_converted<TargetViews>(inputs, outputs, options, bytes, convert_target,
                                     [](auto&... a) { return dsaib::attention_target_workspace_size(a...); });
}

dsaib_status dsaib_attention_target(const dsaib_attention_target_inputs* inputs,
                                    const dsaib_attention_target_outputs* outputs,
                                    const dsaib_attention_target_options* options, void* workspace,
                                    size_t workspace_bytes) {
  return run_converted<TargetViews>(inputs, outputs, options, convert_target, [&](TargetViews& v) {
    dsaib::attention_target(v.i, v.o, v.p, workspace, workspace_bytes);
  });
}

void dsaib_default_indexer_topk_options(dsaib_indexer_topk_options* options) {
  if (!options) return;
  const dsaib::IndexerTopkOptions d;
  options->layout = static_cast<int32_t>(d.layout);
  options->id_mode = static_cast<int32_t>(d.id_mode);
  options->backend = static_cast<int32_t>(d.backend);
  options->order = static_cast<int32_t>(d.order);
  options->causal_offset = d.causal_offset;
  options->strict_ranges = d.strict_ranges ? 1 : 0;
  options->stream = d.stream;
  options->num_threads = d.num_threads;
}

dsaib_status dsaib_indexer_topk_workspace_size(const dsaib_indexer_topk_inputs* inputs,
                                               const dsaib_indexer_topk_outputs* outputs,
                                               const dsaib_indexer_topk_options* options, size_t* bytes) {
  return size_converted<TopkViews>(inputs, outputs, options, bytes, convert_topk,
                                   [](auto&... a) { return dsaib::indexer_topk_workspace_size(a...); });
}

dsaib_status dsaib_indexer_topk(const dsaib_indexer_topk_inputs* inputs, const dsaib_indexer_topk_outputs* outputs,
                                const dsaib_indexer_topk_options* options, void* workspace, size_t workspace_bytes) {
  return run_converted<TopkViews>(inputs, outputs, options, convert_topk, [&](TopkViews& v) {
    dsaib::indexer_topk(v.i, v.o, v.p, workspace, workspace_bytes);
  });
}

const char* dsaib_last_error(void) { return g_last_error.c_str(); }

int dsaib_cuda_backend_available(void) { return dsaib::cuda_backend_available() ? 1 : 0; }

}  // extern "C"
