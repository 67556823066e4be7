// _dsaib: the nanobind extension behind the `dsaib` Python package.
//
// It converts DLPack tensors (numpy, torch, ... through nanobind::ndarray) into
// dsaib::TensorView records and calls dsaib::indexer_backward. No allocation
// happens here: the Python layer (python/dsaib/__init__.py) allocates outputs.
//
// dtype mapping (DLPack -> dsaib::DType):
//   bfloat16 (16 bits)                          -> bf16
//   uint16 / int16, only if uint16_as_bf16=True -> bf16 (the raw bf16 bit pattern;
//                                                  numpy has no bfloat16)
//   float32                                     -> f32
//   int32                                       -> i32
//   anything else                               -> TypeError
//
// Errors: dsaib::Error is translated by its code:
//   invalid_argument whose message is about a dtype -> TypeError
//   invalid_argument, index_out_of_range            -> ValueError
//   unsupported, backend_unavailable, cuda_error,
//   io_error, internal                              -> RuntimeError
// with what() unchanged, so Python sees the C++ message verbatim.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>

#include "dsaib/error.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/tensor.hpp"

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

struct PyTypeError {
  std::string message;
};

dsaib::DType to_dtype(const char* name, nb::dlpack::dtype dt, bool uint16_as_bf16) {
  const auto code = static_cast<nb::dlpack::dtype_code>(dt.code);
  if (dt.lanes == 1) {
    if (code == nb::dlpack::dtype_code::Bfloat && dt.bits == 16) return dsaib::DType::bf16;
    if (code == nb::dlpack::dtype_code::Float && dt.bits == 32) return dsaib::DType::f32;
    if (code == nb::dlpack::dtype_code::Int && dt.bits == 32) return dsaib::DType::i32;
    if ((code == nb::dlpack::dtype_code::UInt || code == nb::dlpack::dtype_code::Int) && dt.bits == 16 &&
        uint16_as_bf16)
      return dsaib::DType::bf16;
  }
  std::string got;
  switch (code) {
    case nb::dlpack::dtype_code::Int: got = "int"; break;
    case nb::dlpack::dtype_code::UInt: got = "uint"; break;
    case nb::dlpack::dtype_code::Float: got = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: got = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: got = "complex"; break;
    case nb::dlpack::dtype_code::Bool: got = "bool"; break;
    default: got = "dlpack-code-" + std::to_string(int(dt.code)); break;
  }
  got += std::to_string(int(dt.bits));
  if (dt.lanes != 1) got += "x" + std::to_string(int(dt.lanes));
  std::string msg = std::string(name) + ": expected dtype bf16, f32 or i32, got " + got;
  if (code == nb::dlpack::dtype_code::UInt && dt.bits == 16)
    msg += " (pass uint16_as_bf16=True to read uint16 as bf16 bit patterns)";
  throw PyTypeError{msg};
}

template <typename A>
dsaib::TensorView to_view(const char* name, const A& a, bool uint16_as_bf16) {
  dsaib::TensorView v;
  if (a.ndim() > static_cast<size_t>(dsaib::kMaxRank)) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, name,
                       std::string(name) + ": expected rank <= " + std::to_string(dsaib::kMaxRank) + ", got rank " +
                           std::to_string(a.ndim()));
  }
  v.dtype = to_dtype(name, a.dtype(), uint16_as_bf16);
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.rank = static_cast<int32_t>(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    v.shape[i] = static_cast<int64_t>(a.shape(i));
    v.strides[i] = static_cast<int64_t>(a.stride(i));  // elements, like dsaib
  }
  const int dev = a.device_type();
  if (dev == nb::device::cpu::value) {
    v.device = dsaib::DeviceType::cpu;
  } else if (dev == nb::device::cuda::value || dev == nb::device::cuda_managed::value) {
    v.device = dsaib::DeviceType::cuda;
  } else {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, name,
                       std::string(name) + ": expected a cpu or cuda tensor, got DLPack device type " +
                           std::to_string(dev));
  }
  v.device_index = a.device_id();
  return v;
}

dsaib::TensorView opt_view(const char* name, const std::optional<Array>& a, bool uint16_as_bf16) {
  return a ? to_view(name, *a, uint16_as_bf16) : dsaib::TensorView{};
}

dsaib::Layout parse_layout(const std::string& s) {
  if (s == "bshd") return dsaib::Layout::bshd;
  if (s == "thd") return dsaib::Layout::thd;
  throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "layout",
                     "layout: expected \"bshd\" or \"thd\", got \"" + s + "\"");
}
dsaib::IdMode parse_id_mode(const std::string& s) {
  if (s == "local") return dsaib::IdMode::local;
  if (s == "global") return dsaib::IdMode::global;
  throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "id_mode",
                     "id_mode: expected \"local\" or \"global\", got \"" + s + "\"");
}
dsaib::Backend parse_backend(const std::string& s) {
  if (s == "cpu") return dsaib::Backend::cpu;
  if (s == "cuda") return dsaib::Backend::cuda;
  throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "backend",
                     "backend: expected \"cpu\" or \"cuda\", got \"" + s + "\"");
}

struct Options {
  std::string layout, id_mode, backend;
  float sm_scale, loss_coeff, grad_loss;
  int64_t normalization_count;
  bool strict_indices, deterministic;
  uintptr_t stream;
  int32_t num_threads;
};

dsaib::IndexerBackwardInputs make_inputs(const Array& index_q, const Array& weights, const Array& index_k,
                                         const Array& topk_indices, const Array& attn_score,
                                         const Array& index_score, const std::optional<Array>& cu_seqlens_q,
                                         const std::optional<Array>& cu_seqlens_k, bool u16) {
  dsaib::IndexerBackwardInputs in;
  in.index_q = to_view("index_q", index_q, u16);
  in.weights = to_view("weights", weights, u16);
  in.index_k = to_view("index_k", index_k, u16);
  in.topk_indices = to_view("topk_indices", topk_indices, u16);
  in.attn_score = to_view("attn_score", attn_score, u16);
  in.index_score = to_view("index_score", index_score, u16);
  in.cu_seqlens_q = opt_view("cu_seqlens_q", cu_seqlens_q, u16);
  in.cu_seqlens_k = opt_view("cu_seqlens_k", cu_seqlens_k, u16);
  return in;
}

dsaib::IndexerBackwardOptions make_options(const std::string& layout, const std::string& id_mode,
                                           const std::string& backend, float sm_scale, float loss_coeff,
                                           float grad_loss, int64_t normalization_count, bool strict_indices,
                                           bool deterministic, uintptr_t stream, int32_t num_threads) {
  dsaib::IndexerBackwardOptions o;
  o.layout = parse_layout(layout);
  o.id_mode = parse_id_mode(id_mode);
  o.backend = parse_backend(backend);
  o.sm_scale = sm_scale;
  o.loss_coeff = loss_coeff;
  o.grad_loss = grad_loss;
  o.normalization_count = normalization_count;
  o.strict_indices = strict_indices;
  o.deterministic = deterministic;
  o.stream = reinterpret_cast<void*>(stream);
  o.num_threads = num_threads;
  return o;
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
        default:
          PyErr_SetString(PyExc_RuntimeError, msg.c_str());
          break;
      }
    }
  });

  m.def("cuda_backend_available", &dsaib::cuda_backend_available,
        "Whether the cuda backend was compiled in and an sm_90 device is present.");

  m.def(
      "indexer_backward",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const Array& index_score, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, OutArray d_index_q, OutArray d_weights, OutArray d_index_k,
         const std::string& layout, const std::string& id_mode, const std::string& backend, float sm_scale,
         float loss_coeff, float grad_loss, int64_t normalization_count, bool strict_indices, bool deterministic,
         uintptr_t stream, int32_t num_threads, bool uint16_as_bf16, bool out_uint16_as_bf16) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, index_score,
                                    cu_seqlens_q, cu_seqlens_k, uint16_as_bf16);
        dsaib::IndexerBackwardOutputs out;
        out.d_index_q = to_view("d_index_q", d_index_q, out_uint16_as_bf16);
        out.d_weights = to_view("d_weights", d_weights, out_uint16_as_bf16);
        out.d_index_k = to_view("d_index_k", d_index_k, out_uint16_as_bf16);
        const auto opt = make_options(layout, id_mode, backend, sm_scale, loss_coeff, grad_loss,
                                      normalization_count, strict_indices, deterministic, stream, num_threads);
        nb::gil_scoped_release release;
        dsaib::indexer_backward(in, out, opt);
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("index_score"), nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("d_index_q"),
      nb::arg("d_weights"), nb::arg("d_index_k"), nb::arg("layout"), nb::arg("id_mode"), nb::arg("backend"),
      nb::arg("sm_scale"), nb::arg("loss_coeff"), nb::arg("grad_loss"), nb::arg("normalization_count"),
      nb::arg("strict_indices"), nb::arg("deterministic"), nb::arg("stream"), nb::arg("num_threads"),
      nb::arg("uint16_as_bf16"), nb::arg("out_uint16_as_bf16"),
      "Calls dsaib::indexer_backward on caller-provided outputs. Raises ValueError/TypeError/RuntimeError.");

  m.def(
      "indexer_kl_loss",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const Array& index_score, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, const std::string& layout, const std::string& id_mode,
         float sm_scale, float loss_coeff, float grad_loss, int64_t normalization_count, bool recompute_p,
         bool uint16_as_bf16) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, index_score,
                                    cu_seqlens_q, cu_seqlens_k, uint16_as_bf16);
        const auto opt = make_options(layout, id_mode, "cpu", sm_scale, loss_coeff, grad_loss,
                                      normalization_count, false, false, 0, 0);
        nb::gil_scoped_release release;
        return dsaib::indexer_kl_loss(in, opt, recompute_p);
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("index_score"), nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("layout"),
      nb::arg("id_mode"), nb::arg("sm_scale"), nb::arg("loss_coeff"), nb::arg("grad_loss"),
      nb::arg("normalization_count"), nb::arg("recompute_p"), nb::arg("uint16_as_bf16"),
      "fp64 host evaluation of the loss whose gradient indexer_backward computes (cpu tensors only).");
}
