// _dsaib: the nanobind extension behind the `dsaib` Python package, its module
// and bindings, one library call per binding: indexer_backward (P given as
// index_score, or the P-free form with row_lse and row_target_mass), the loss
// forward (indexer_kl_forward), the loss and gradients in one call
// (indexer_kl_loss_and_grad), the attention target T from the main attention's
// tensors (attention_target), the validation alone
// (validate_indexer_kl_loss_inputs), the fp64 host loss (indexer_kl_loss) and
// the indexer's forward, its logits and exact top-k (indexer_topk, with its
// workspace size query indexer_topk_workspace_size). One binding runs a kernel of
// this module instead: scale_gradient, the backward of the autograd losses that
// form their gradients in the forward (scale_gradient.hpp).
//
// Tensors are DLPack arrays made into dsaib::TensorView records
// (dlpack_views.hpp); the library's options are keyword arguments (**options),
// read through one table per options struct (options.hpp), which also tells
// Python each option's kind, default and words (option_table()).
//
// The workspace of a call comes from the caller's allocator, asked by the
// library after it has validated the arguments (dsaib::WorkspaceAllocator):
// `workspace` is a Python callable nbytes -> DLPack array on the backend's
// device (torch's caching allocator), or None (the library allocates it,
// stream-ordered). So the arguments are validated once per call. The Python
// layer (python/dsaib/) allocates outputs with the inputs' framework; for other
// producers it uses `empty`, which returns a Buffer: host or device memory
// owned by this module, exported through DLPack (dlpack_buffers.hpp).
//
// Counters for tests: library_calls() (calls into the library made here) and
// host_waits() (the CUDA runtime's blocking calls made inside this module,
// counted through the linker's --wrap in CUDA builds; host_waits.cpp).
//
// Errors: dsaib::Error is translated by its code:
//   invalid_argument whose message is about a dtype -> TypeError
//   invalid_argument, index_out_of_range            -> ValueError
//   out_of_memory                                   -> MemoryError
//   unsupported, backend_unavailable, cuda_error,
//   io_error, internal                              -> RuntimeError
// with what() unchanged, so Python sees the C++ message verbatim; the
// extension's own PyTypeError (type_error.hpp) -> TypeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#if DSAIB_PY_WITH_CUDA
#include <cuda_runtime.h>

#include "scale_gradient.hpp"
#endif

#include "dlpack_buffers.hpp"
#include "dlpack_views.hpp"
#include "dsaib/attention_target.hpp"
#include "dsaib/error.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/indexer_kl_forward.hpp"
#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "dsaib/indexer_topk.hpp"
#include "dsaib/tensor.hpp"
#include "dsaib/workspace.hpp"
#include "host_waits.hpp"
#include "options.hpp"
#include "type_error.hpp"

using namespace dsaib_py;

namespace {

/// Calls of the library made by this module (each validates its arguments once).
std::atomic<std::uint64_t> g_library_calls{0};

/// Runs one library call with the GIL released; a Python exception of the
/// workspace allocator comes back as itself.
template <class F>
void call_library(F&& f) {
  g_library_calls.fetch_add(1, std::memory_order_relaxed);
  try {
    nb::gil_scoped_release release;
    f();
  } catch (const PendingPythonError&) {
    throw nb::python_error();
  }
}

/// The "cpu" or "cuda:N" device of a call whose options name its backend.
template <class Options>
std::string device_of(const Options& opt, const Array& first) {
  return backend_device(opt.backend, first);
}

}  // namespace

NB_MODULE(_dsaib, m) {
  m.doc() = "Low-level bindings of the dsaib C++ library; use the `dsaib` package instead.";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const PyTypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.message.c_str());
    } catch (const dsaib::Error& e) {
      const std::string msg = e.what();
      switch (e.code()) {
        case dsaib::ErrorCode::invalid_argument:
          // A dtype mismatch is reported by validation as "<arg>: expected dtype ..., got dtype ...".
          if (msg.find("expected dtype") != std::string::npos)
            PyErr_SetString(PyExc_TypeError, msg.c_str());
          else
            PyErr_SetString(PyExc_ValueError, msg.c_str());
          break;
        case dsaib::ErrorCode::index_out_of_range:
          PyErr_SetString(PyExc_ValueError, msg.c_str());
          break;
        case dsaib::ErrorCode::out_of_memory:
          PyErr_SetString(PyExc_MemoryError, msg.c_str());
          break;
        default:
          PyErr_SetString(PyExc_RuntimeError, msg.c_str());
          break;
      }
    }
  });

  m.def("cuda_backend_available", &dsaib::cuda_backend_available,
        "Whether the cuda backend was compiled in and an sm_90 device is present.");

  m.def("option_table", &option_table, nb::arg("which"),
        "The library's options of the indexer's entry points (\"indexer\": dsaib::IndexerOptions), of\n"
        "attention_target (\"attention_target\") or of indexer_topk (\"indexer_topk\"): {name: (kind,\n"
        "default, words)}, kind one of \"word\",\n"
        "\"float\", \"bool\", \"int32\", \"int64\", \"pointer\"; words the values a \"word\" option takes.\n"
        "The bindings take exactly these names as keyword arguments.");

  // Every library call takes the tensors as named arguments and the library's
  // options as **options (the tables of options.cpp). `workspace` is None or a
  // callable nbytes -> array that the library calls once, after validation.
  m.def(
      "indexer_backward",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& index_score, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, const OutArray& d_index_q, const OutArray& d_weights,
         const OutArray& d_index_k, const std::optional<Array>& grad_loss_device,
         const std::optional<nb::object>& workspace, const std::optional<Array>& row_lse,
         const std::optional<Array>& row_target_mass, bool uint16_as_bf16, bool out_uint16_as_bf16,
         const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, index_score,
                                    cu_seqlens_q, cu_seqlens_k, uint16_as_bf16, row_lse, row_target_mass);
        const dsaib::IndexerBackwardOutputs out{to_view("d_index_q", d_index_q, out_uint16_as_bf16),
                                                to_view("d_weights", d_weights, out_uint16_as_bf16),
                                                to_view("d_index_k", d_index_k, out_uint16_as_bf16)};
        auto opt = read_indexer_options(options);
        const std::string device = device_of(opt, index_q);
        if (grad_loss_device) opt.grad_loss_device = grad_loss_pointer(*grad_loss_device, device);
        PyWorkspace ws(workspace, device);
        call_library([&] { dsaib::indexer_backward(in, out, opt, ws.allocator()); });
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("index_score").none(), nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(),
      nb::arg("d_index_q"), nb::arg("d_weights"), nb::arg("d_index_k"),
      nb::arg("grad_loss_device").none() = nb::none(), nb::arg("workspace").none() = nb::none(),
      nb::arg("row_lse").none() = nb::none(), nb::arg("row_target_mass").none() = nb::none(),
      nb::arg("uint16_as_bf16") = false, nb::arg("out_uint16_as_bf16") = false, nb::arg("options"),
      "Calls dsaib::indexer_backward on caller-provided outputs, with the library's options as keyword\n"
      "arguments. P is index_score, or (index_score None) the P-free form: row_lse and row_target_mass as\n"
      "indexer_kl_forward writes them. grad_loss_device (optional) is a one-element float32 tensor on the\n"
      "backend's device, read when the work runs. workspace: None (the library allocates its scratch memory,\n"
      "stream-ordered) or a callable nbytes -> array on the backend's device, called at most once, after\n"
      "validation. Raises ValueError/TypeError/RuntimeError.");

  m.def(
      "indexer_kl_forward",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& loss, const OutArray& row_lse, const OutArray& row_target_mass,
         const std::optional<OutArray>& index_score, const std::optional<nb::object>& workspace, bool uint16_as_bf16,
         const std::optional<Array>& topk_logits, const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, std::nullopt, cu_seqlens_q,
                                    cu_seqlens_k, uint16_as_bf16, std::nullopt, std::nullopt, topk_logits);
        dsaib::IndexerKLForwardOutputs out;
        out.loss = to_view("loss", loss, false);
        out.row_lse = to_view("row_lse", row_lse, false);
        out.row_target_mass = to_view("row_target_mass", row_target_mass, false);
        if (index_score) out.index_score = to_view("index_score", *index_score, false);
        const auto opt = read_indexer_options(options);
        PyWorkspace ws(workspace, device_of(opt, index_q));
        call_library([&] { dsaib::indexer_kl_forward(in, out, opt, ws.allocator()); });
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("loss"), nb::arg("row_lse"),
      nb::arg("row_target_mass"), nb::arg("index_score").none() = nb::none(),
      nb::arg("workspace").none() = nb::none(), nb::arg("uint16_as_bf16") = false,
      nb::arg("topk_logits").none() = nb::none(), nb::arg("options"),
      "Calls dsaib::indexer_kl_forward: writes the loss (float32, shape ()), row_lse and row_target_mass\n"
      "(float32, one per query row) and, if given, index_score (P, float32, shaped like topk_indices).\n"
      "topk_logits (optional): the selected keys' logits as indexer_topk writes them; the forward then\n"
      "takes sm_scale times them instead of recomputing the logits. workspace as for indexer_backward.");

  m.def(
      "indexer_kl_loss_and_grad",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& loss, const OutArray& d_index_q, const OutArray& d_weights, const OutArray& d_index_k,
         const std::optional<Array>& grad_loss_device, const std::optional<nb::object>& workspace,
         bool uint16_as_bf16, bool out_uint16_as_bf16, const std::optional<Array>& topk_logits,
         const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, std::nullopt, cu_seqlens_q,
                                    cu_seqlens_k, uint16_as_bf16, std::nullopt, std::nullopt, topk_logits);
        const dsaib::IndexerKLLossAndGradOutputs out{to_view("loss", loss, false),
                                                     to_view("d_index_q", d_index_q, out_uint16_as_bf16),
                                                     to_view("d_weights", d_weights, out_uint16_as_bf16),
                                                     to_view("d_index_k", d_index_k, out_uint16_as_bf16)};
        auto opt = read_indexer_options(options);
        const std::string device = device_of(opt, index_q);
        if (grad_loss_device) opt.grad_loss_device = grad_loss_pointer(*grad_loss_device, device);
        PyWorkspace ws(workspace, device);
        call_library([&] { dsaib::indexer_kl_loss_and_grad(in, out, opt, ws.allocator()); });
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("loss"), nb::arg("d_index_q"),
      nb::arg("d_weights"), nb::arg("d_index_k"), nb::arg("grad_loss_device").none() = nb::none(),
      nb::arg("workspace").none() = nb::none(), nb::arg("uint16_as_bf16") = false,
      nb::arg("out_uint16_as_bf16") = false, nb::arg("topk_logits").none() = nb::none(), nb::arg("options"),
      "Calls dsaib::indexer_kl_loss_and_grad: the loss (float32, shape ()) and d_index_q, d_weights, d_index_k\n"
      "in one call, without P. topk_logits as for indexer_kl_forward (the backward recomputes its logits).\n"
      "grad_loss_device and workspace as for indexer_backward.");

  m.def(
      "attention_target",
      [](const Array& query, const Array& kv, const std::optional<Array>& lse, const Array& topk_indices,
         const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& attn_score, const std::optional<nb::object>& workspace, bool uint16_as_bf16,
         const nb::kwargs& options) {
        const auto in = make_target_inputs(query, kv, lse, topk_indices, cu_seqlens_q, cu_seqlens_k, uint16_as_bf16);
        const dsaib::AttentionTargetOutputs out{to_view("attn_score", attn_score, false)};
        const auto opt = read_target_options(options);
        PyWorkspace ws(workspace, device_of(opt, query));
        call_library([&] { dsaib::attention_target(in, out, opt, ws.allocator()); });
      },
      nb::arg("query"), nb::arg("kv"), nb::arg("lse").none(), nb::arg("topk_indices"), nb::arg("cu_seqlens_q").none(),
      nb::arg("cu_seqlens_k").none(), nb::arg("attn_score"), nb::arg("workspace").none() = nb::none(),
      nb::arg("uint16_as_bf16") = false, nb::arg("options"),
      "Calls dsaib::attention_target: writes attn_score (float32, shaped like topk_indices), the main\n"
      "attention's probability of each selected key summed over its heads (normalised per row unless\n"
      "normalize=False); lse None: each head's lse over the row's selected keys, computed here. workspace as\n"
      "for indexer_backward.");

  m.def(
      "indexer_topk",
      [](const Array& index_q, const Array& weights, const Array& index_k, const std::optional<Array>& starts,
         const std::optional<Array>& ends, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, const OutArray& topk_indices,
         const std::optional<OutArray>& topk_logits, const std::optional<OutArray>& topk_lengths,
         const std::optional<nb::object>& workspace, bool uint16_as_bf16, const std::optional<Array>& index_q_scale,
         const std::optional<Array>& index_k_scale, bool uint8_as_e4m3, const nb::kwargs& options) {
        const auto in = make_topk_inputs(index_q, weights, index_k, starts, ends, cu_seqlens_q, cu_seqlens_k,
                                         uint16_as_bf16, index_q_scale, index_k_scale, uint8_as_e4m3);
        const auto out = make_topk_outputs(topk_indices, topk_logits, topk_lengths);
        const auto opt = read_topk_options(options);
        PyWorkspace ws(workspace, device_of(opt, index_q));
        const dsaib::WorkspaceAllocator allocator = ws.allocator();
        call_library([&] { dsaib::indexer_topk(in, out, opt, allocator); });
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("starts").none(), nb::arg("ends").none(),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("topk_indices"),
      nb::arg("topk_logits").none() = nb::none(), nb::arg("topk_lengths").none() = nb::none(),
      nb::arg("workspace").none() = nb::none(), nb::arg("uint16_as_bf16") = false,
      nb::arg("index_q_scale").none() = nb::none(), nb::arg("index_k_scale").none() = nb::none(),
      nb::arg("uint8_as_e4m3") = false, nb::arg("options"),
      "Calls dsaib::indexer_topk (index_q and index_k bf16, or float8_e4m3fn (uint8 codes with\n"
      "uint8_as_e4m3=True) with their optional float32 index_q_scale and index_k_scale): writes topk_indices\n"
      "(int32, (B, S_q, topk) or (T_q, topk); -1 past each\n"
      "row's count) and, when given, topk_logits (float32, or float64 on the cpu backend, shaped like\n"
      "topk_indices; -inf past the count) and topk_lengths (int32, one per query row). The library's\n"
      "IndexerTopkOptions as keyword arguments (option_table(\"indexer_topk\")). workspace as for\n"
      "indexer_backward.");

  m.def(
      "indexer_topk_workspace_size",
      [](const Array& index_q, const Array& weights, const Array& index_k, const std::optional<Array>& starts,
         const std::optional<Array>& ends, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, const OutArray& topk_indices,
         const std::optional<OutArray>& topk_logits, const std::optional<OutArray>& topk_lengths,
         bool uint16_as_bf16, const std::optional<Array>& index_q_scale, const std::optional<Array>& index_k_scale,
         bool uint8_as_e4m3, const nb::kwargs& options) {
        const auto in = make_topk_inputs(index_q, weights, index_k, starts, ends, cu_seqlens_q, cu_seqlens_k,
                                         uint16_as_bf16, index_q_scale, index_k_scale, uint8_as_e4m3);
        const auto out = make_topk_outputs(topk_indices, topk_logits, topk_lengths);
        const auto opt = read_topk_options(options);
        std::size_t bytes = 0;
        call_library([&] { bytes = dsaib::indexer_topk_workspace_size(in, out, opt); });
        return bytes;
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("starts").none(), nb::arg("ends").none(),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("topk_indices"),
      nb::arg("topk_logits").none() = nb::none(), nb::arg("topk_lengths").none() = nb::none(),
      nb::arg("uint16_as_bf16") = false, nb::arg("index_q_scale").none() = nb::none(),
      nb::arg("index_k_scale").none() = nb::none(), nb::arg("uint8_as_e4m3") = false, nb::arg("options"),
      "dsaib::indexer_topk_workspace_size: the bytes of scratch memory indexer_topk needs on the backend's\n"
      "device for these arguments (cpu: 0), after the same validation and with the same errors.");

  m.def(
      "validate_indexer_topk_inputs",
      [](const Array& index_q, const Array& weights, const Array& index_k, const std::optional<Array>& starts,
         const std::optional<Array>& ends, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, int64_t topk, bool uint16_as_bf16,
         const std::optional<Array>& index_q_scale, const std::optional<Array>& index_k_scale, bool uint8_as_e4m3,
         const nb::kwargs& options) {
        const auto in = make_topk_inputs(index_q, weights, index_k, starts, ends, cu_seqlens_q, cu_seqlens_k,
                                         uint16_as_bf16, index_q_scale, index_k_scale, uint8_as_e4m3);
        const auto opt = read_topk_options(options);
        call_library([&] { dsaib::validate_indexer_topk_inputs(in, topk, opt); });  // THD on cuda: reads cu_seqlens
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("starts").none() = nb::none(),
      nb::arg("ends").none() = nb::none(), nb::arg("cu_seqlens_q").none() = nb::none(),
      nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("topk"), nb::arg("uint16_as_bf16") = false,
      nb::arg("index_q_scale").none() = nb::none(), nb::arg("index_k_scale").none() = nb::none(),
      nb::arg("uint8_as_e4m3") = false, nb::arg("options"),
      "dsaib::validate_indexer_topk_inputs: indexer_topk's checks of the inputs and options for a selection\n"
      "of topk keys per row, without outputs and without computing anything (a context-parallel rank's\n"
      "check before the exchange of the keys).");

  m.def(
      "validate_indexer_kl_loss_inputs",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& index_score, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, const std::optional<Array>& row_lse,
         const std::optional<Array>& row_target_mass, bool uint16_as_bf16, const std::optional<Array>& topk_logits,
         const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, index_score,
                                    cu_seqlens_q, cu_seqlens_k, uint16_as_bf16, row_lse, row_target_mass, topk_logits);
        const auto opt = read_indexer_options(options);
        call_library([&] { dsaib::validate_indexer_kl_loss_inputs(in, opt); });  // THD on cuda: reads cu_seqlens
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("index_score").none() = nb::none(), nb::arg("cu_seqlens_q").none() = nb::none(),
      nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("row_lse").none() = nb::none(),
      nb::arg("row_target_mass").none() = nb::none(), nb::arg("uint16_as_bf16") = false,
      nb::arg("topk_logits").none() = nb::none(), nb::arg("options"),
      "dsaib::validate_indexer_kl_loss_inputs: indexer_backward's checks of the inputs and options, without\n"
      "outputs and without computing anything; index_score may be None (then held to attn_score's rules,\n"
      "unless row_lse and row_target_mass give the P-free form).\n"
      "For the torch layer's forwards that compute in torch (float64, index_scores).");

  m.def(
      "indexer_kl_loss",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const Array& index_score, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, bool recompute_p, bool uint16_as_bf16,
         const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, index_score,
                                    cu_seqlens_q, cu_seqlens_k, uint16_as_bf16);
        const auto opt = read_indexer_options(options);  // the library takes cpu tensors here, whatever `backend` says
        double loss = 0;
        call_library([&] { loss = dsaib::indexer_kl_loss(in, opt, recompute_p); });
        return loss;
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("index_score"), nb::arg("cu_seqlens_q").none() = nb::none(), nb::arg("cu_seqlens_k").none() = nb::none(),
      nb::arg("recompute_p") = true, nb::arg("uint16_as_bf16") = false, nb::arg("options"),
      "dsaib::indexer_kl_loss: the fp64 host evaluation of the loss whose gradient indexer_backward computes\n"
      "(cpu tensors only).");

  m.def("cuda_compiled", []() {
#if DSAIB_PY_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether this build of the extension contains the cuda backend (a device may still be missing).");

  m.def("library_calls", []() { return g_library_calls.load(); },
        "The number of calls into the library made by this module so far (each validates its arguments once).");
  m.def("host_waits", []() { return dsaib_py::host_waits(); },
        "The number of the CUDA runtime's blocking calls (stream, event and device synchronisations,\n"
        "synchronous copies) made inside this module so far: the library's validation reads and this\n"
        "module's own stream_synchronize. 0 in a build without CUDA, where nothing waits on a device.");
  m.attr("counts_host_waits") = nb::bool_(dsaib_py::counts_host_waits());

  nb::class_<Buffer>(m, "Buffer",
                     "A contiguous array in memory owned by dsaib (host or CUDA), exported through DLPack:\n"
                     "numpy.from_dlpack, torch.from_dlpack, cupy.from_dlpack and jax.dlpack.from_dlpack take it\n"
                     "without a copy. Returned by dsaib's functions for inputs of frameworks dsaib\n"
                     "cannot allocate with.")
      .def("__dlpack__", [](const Buffer& b, nb::kwargs) { return b.array; },
           "A new DLPack capsule viewing this buffer (stream and version arguments are accepted and ignored;\n"
           "dsaib has finished writing the buffer when the call that returned it returns, except on the\n"
           "cuda backend, where the work is ordered on the stream it ran on).")
      .def("__dlpack_device__", [](const Buffer& b) { return nb::make_tuple(b.device_type, b.device_id); })
      .def_prop_ro("shape", [](const Buffer& b) {
        nb::list l;
        for (int64_t s : b.shape) l.append(s);
        return nb::tuple(l);
      })
      .def_prop_ro("dtype", [](const Buffer& b) { return b.dtype; })
      .def_prop_ro("device", [](const Buffer& b) { return device_string(b.device_type, b.device_id); })
      .def("__repr__", [](const Buffer& b) {
        std::string s = "dsaib.Buffer(shape=(";
        for (size_t i = 0; i < b.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(b.shape[i]);
        if (b.shape.size() == 1) s += ",";
        return s + "), dtype=" + b.dtype + ", device=" + device_string(b.device_type, b.device_id) + ")";
      });

  m.def("empty", &make_buffer, nb::arg("shape"), nb::arg("dtype"), nb::arg("device"),
        "An uninitialised contiguous Buffer: dtype \"f32\", \"bf16\", \"f64\" or \"i32\", device \"cpu\" or \"cuda:N\".");

  m.def(
      "scale_gradient",
      [](const Array& gradient, const OutArray& out, const Array& grad_loss, uintptr_t stream) {
        // Checked before the views, which take more dtypes.
        const auto check_dtype = [](const char* name, nb::dlpack::dtype dt) {
          const auto code = static_cast<nb::dlpack::dtype_code>(dt.code);
          const bool bf16 = code == nb::dlpack::dtype_code::Bfloat && dt.bits == 16;
          const bool f32 = code == nb::dlpack::dtype_code::Float && dt.bits == 32;
          if (dt.lanes != 1 || !(bf16 || f32)) {
            throw PyTypeError{std::string(name) + ": expected dtype bfloat16 or float32, got " + dtype_string(dt)};
          }
        };
        check_dtype("gradient", gradient.dtype());
        check_dtype("out", out.dtype());
        const dsaib::TensorView in = to_view("gradient", gradient, false);
        const dsaib::TensorView o = to_view("out", out, false);
        const std::string dev = device_string(gradient.device_type(), gradient.device_id());
        if (in.device != dsaib::DeviceType::cuda) {
          throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "gradient",
                             "gradient: expected a tensor on a cuda device, got one on " + dev);
        }
        const std::string odev = device_string(out.device_type(), out.device_id());
        if (odev != dev) {
          throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "out",
                             "out: expected a tensor on " + dev + " (gradient's device), got one on " + odev);
        }
        if (o.shape_string() != in.shape_string()) {
          throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "out",
                             "out: expected shape " + in.shape_string() + " (gradient's), got " + o.shape_string());
        }
        for (const auto* v : {&in, &o}) {
          const char* name = v == &in ? "gradient" : "out";
          if (!v->is_contiguous() || reinterpret_cast<uintptr_t>(v->data) % 16 != 0) {
            throw dsaib::Error(dsaib::ErrorCode::invalid_argument, name,
                               std::string(name) + ": expected a contiguous tensor whose data is 16-byte aligned, got strides " +
                                   v->strides_string());
          }
        }
        const int64_t n = in.numel();
        const auto* bytes_in = static_cast<const char*>(in.data);
        const auto* bytes_out = static_cast<const char*>(o.data);
        const auto in_bytes = static_cast<int64_t>(n * dsaib::dtype_size(in.dtype));
        const auto out_bytes = static_cast<int64_t>(n * dsaib::dtype_size(o.dtype));
        if (n > 0 && bytes_in < bytes_out + out_bytes && bytes_out < bytes_in + in_bytes) {
          throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "out", "out: expected memory disjoint from gradient's");
        }
        const float* g = grad_loss_pointer(grad_loss, dev);
#if DSAIB_PY_WITH_CUDA
        using dsaib_py::ScaleType;
        const auto scale_type = [](dsaib::DType t) { return t == dsaib::DType::bf16 ? ScaleType::bf16 : ScaleType::f32; };
        const cudaError_t st = dsaib_py::scale_gradient(in.data, scale_type(in.dtype), o.data, scale_type(o.dtype), n, g,
                                                        reinterpret_cast<cudaStream_t>(stream));
        if (st != cudaSuccess) cuda_call(false, "scale_gradient", cudaGetErrorString(st));
#else
        (void)g;
        (void)stream;
        throw dsaib::Error(dsaib::ErrorCode::backend_unavailable, "gradient",
                           "gradient: this build has no CUDA support");
#endif
      },
      nb::arg("gradient"), nb::arg("out"), nb::arg("grad_loss"), nb::arg("stream"),
      "out = gradient * grad_loss on gradient's CUDA device, on `stream`: the product in float32, rounded once "
      "to out's dtype (bfloat16 or float32); grad_loss (one float32 on that device) is read when the kernel "
      "runs. Both contiguous, 16-byte aligned, disjoint, of one shape. No host synchronisation.");

  m.def(
      "stream_synchronize",
      [](uintptr_t stream) {
#if DSAIB_PY_WITH_CUDA
        cudaError_t st;
        {
          nb::gil_scoped_release release;
          st = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
        }
        if (st != cudaSuccess) {
          (void)cudaGetLastError();
          cuda_call(false, "cudaStreamSynchronize", cudaGetErrorString(st));
        }
#else
        (void)stream;
        throw dsaib::Error(dsaib::ErrorCode::backend_unavailable, "stream",
                           "stream: this build has no CUDA support");
#endif
      },
      nb::arg("stream"), "Waits for all work on a CUDA stream (0 = the legacy default stream).");
}
