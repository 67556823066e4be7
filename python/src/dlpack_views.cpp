// DLPack tensors as the library's dsaib::TensorView records (dlpack_views.hpp).
// Each view is made under its argument's name, so that a dtype, rank or device
// the library cannot take is reported naming that argument.
//
// dtype mapping (DLPack -> dsaib::DType):
//   bfloat16 (16 bits)                          -> bf16
//   uint16 / int16, only if uint16_as_bf16=True -> bf16 (the raw bf16 bit pattern;
//                                                  numpy has no bfloat16)
//   float32                                     -> f32
//   float64                                     -> f64 (the library takes it on the
//                                                  cpu backend where docs/api.md says)
//   int32                                       -> i32
//   float8_e4m3fn (DLPack code 10, 8 bits)      -> e4m3 (indexer_topk's index_q and index_k)
//   uint8, only if uint8_as_e4m3=True           -> e4m3 (the raw code; numpy has no float8)
//   anything else                               -> TypeError "NAME: expected dtype X, got Y",
//                                                  X the dtypes NAME takes (src/core/validate.cpp)
#include "dlpack_views.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "dsaib/error.hpp"
#include "type_error.hpp"

namespace dsaib_py {

std::string dtype_string(nb::dlpack::dtype dt) {
  // DLPack 1.1's narrow float codes, which nanobind's dtype_code does not name,
  // with their bit counts (a code with other bits is named by number below)
  struct Narrow {
    const char* name;
    int bits;
  };
  static const Narrow kNarrowFloats[] = {
      {"float8_e3m4", 8},     {"float8_e4m3", 8},     {"float8_e4m3b11fnuz", 8}, {"float8_e4m3fn", 8},
      {"float8_e4m3fnuz", 8}, {"float8_e5m2", 8},     {"float8_e5m2fnuz", 8},    {"float8_e8m0fnu", 8},
      {"float6_e2m3fn", 6},   {"float6_e3m2fn", 6},   {"float4_e2m1fn", 4}};
  constexpr int kFirstNarrowFloat = 7;  // kDLFloat8_e3m4
  static_assert(kFirstNarrowFloat + 3 == kDLFloat8E4m3fn, "the table starts at kDLFloat8_e3m4");
  const int narrow = int(dt.code) - kFirstNarrowFloat;
  const std::string lanes = dt.lanes != 1 ? "x" + std::to_string(int(dt.lanes)) : "";
  if (narrow >= 0 && narrow < int(sizeof(kNarrowFloats) / sizeof(kNarrowFloats[0])) &&
      kNarrowFloats[narrow].bits == int(dt.bits)) {
    return kNarrowFloats[narrow].name + lanes;
  }
  std::string got;
  switch (static_cast<nb::dlpack::dtype_code>(dt.code)) {
    case nb::dlpack::dtype_code::Int: got = "int"; break;
    case nb::dlpack::dtype_code::UInt: got = "uint"; break;
    case nb::dlpack::dtype_code::Float: got = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: got = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: got = "complex"; break;
    case nb::dlpack::dtype_code::Bool: got = "bool"; break;
    default:
      return "DLPack dtype code " + std::to_string(int(dt.code)) + " of " + std::to_string(int(dt.bits)) + " bits" +
             (dt.lanes != 1 ? " x " + std::to_string(int(dt.lanes)) + " lanes" : "");
  }
  got += std::to_string(int(dt.bits));
  if (dt.lanes != 1) got += "x" + std::to_string(int(dt.lanes));
  return got;
}

namespace {

/// The dtypes argument `name` takes, as the library's validation lists them
/// (src/core/validate.cpp), for a DLPack dtype that is no dsaib::DType at all
/// (a float64 reaches the library, which names the backend that refuses it).
const char* expected_dtypes(const std::string& name) {
  if (name == "index_q" || name == "index_k" || name == "query" || name == "kv") return "bf16";
  if (name == "index_q_scale" || name == "index_k_scale") return "f32 (or f64 on the cpu backend)";
  if (name == "weights" || name == "d_index_q" || name == "d_weights" || name == "d_index_k") {
    return "bf16 or f32 (or f64 on the cpu backend)";
  }
  if (name == "grad_loss") return "f32";
  if (name == "attn_score" || name == "index_score" || name == "row_lse" || name == "row_target_mass" ||
      name == "loss" || name == "lse")
    return "f32 (or f64 on the cpu backend)";
  if (name == "topk_logits") return "f32 (or f64 on the cpu backend)";
  if (name == "topk_indices" || name == "cu_seqlens_q" || name == "cu_seqlens_k" || name == "starts" ||
      name == "ends" || name == "topk_lengths")
    return "i32";
  return "bf16, f32 or i32";
}

/// takes_e4m3: the argument takes float8 e4m3 (indexer_topk's index_q and
/// index_k), and with uint8_as_e4m3 reads uint8 codes as it.
dsaib::DType to_dtype(const char* name, nb::dlpack::dtype dt, bool uint16_as_bf16, bool takes_e4m3,
                      bool uint8_as_e4m3) {
  const auto code = static_cast<nb::dlpack::dtype_code>(dt.code);
  if (dt.lanes == 1) {
    if (dt.code == kDLFloat8E4m3fn && dt.bits == 8) return dsaib::DType::e4m3;  // the library names who refuses it
    if (takes_e4m3 && uint8_as_e4m3 && code == nb::dlpack::dtype_code::UInt && dt.bits == 8) return dsaib::DType::e4m3;
    if (code == nb::dlpack::dtype_code::Bfloat && dt.bits == 16) return dsaib::DType::bf16;
    if (code == nb::dlpack::dtype_code::Float && dt.bits == 32) return dsaib::DType::f32;
    if (code == nb::dlpack::dtype_code::Float && dt.bits == 64) return dsaib::DType::f64;
    if (code == nb::dlpack::dtype_code::Int && dt.bits == 32) return dsaib::DType::i32;
  }
  const std::string expected = std::string(expected_dtypes(name)) + (takes_e4m3 ? " or e4m3" : "");
  const bool takes_bf16 = expected.find("bf16") != std::string::npos;
  const bool int16 = dt.lanes == 1 && dt.bits == 16 &&
                     (code == nb::dlpack::dtype_code::UInt || code == nb::dlpack::dtype_code::Int);
  // 16-bit integers are bf16 bit patterns only where bf16 is taken: elsewhere (ids,
  // scores) the error names their own dtype, not "bf16".
  if (int16 && uint16_as_bf16 && takes_bf16) return dsaib::DType::bf16;
  std::string msg = std::string(name) + ": expected dtype " + expected + ", got " + dtype_string(dt);
  if (int16 && takes_bf16) msg += " (pass uint16_as_bf16=True to read 16-bit integers as bf16 bit patterns)";
  const bool uint8 = dt.lanes == 1 && dt.bits == 8 && code == nb::dlpack::dtype_code::UInt;
  if (uint8 && takes_e4m3) {
    msg += " (pass uint8_as_e4m3=True to read uint8 arrays as float8 e4m3 codes)";
  }
  throw PyTypeError{msg};
}

template <typename A>
dsaib::TensorView view_of(const char* name, const A& a, bool uint16_as_bf16, bool takes_e4m3 = false,
                          bool uint8_as_e4m3 = false) {
  dsaib::TensorView v;
  if (a.ndim() > static_cast<size_t>(dsaib::kMaxRank)) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, name,
                       std::string(name) + ": expected rank <= " + std::to_string(dsaib::kMaxRank) + ", got rank " +
                           std::to_string(a.ndim()));
  }
  v.dtype = to_dtype(name, a.dtype(), uint16_as_bf16, takes_e4m3, uint8_as_e4m3);
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

}  // namespace

dsaib::TensorView to_view(const char* name, const Array& a, bool uint16_as_bf16) {
  return view_of(name, a, uint16_as_bf16);
}

dsaib::TensorView to_view(const char* name, const OutArray& a, bool uint16_as_bf16) {
  return view_of(name, a, uint16_as_bf16);
}

std::string device_string(int dev_type, int dev_id) {
  if (dev_type == nb::device::cpu::value) return "cpu";
  if (dev_type == nb::device::cuda::value || dev_type == nb::device::cuda_managed::value)
    return "cuda:" + std::to_string(dev_id);
  return "DLPack device type " + std::to_string(dev_type);
}

std::string backend_device(dsaib::Backend backend, const Array& index_q) {
  if (backend == dsaib::Backend::cuda) return "cuda:" + std::to_string(index_q.device_id());
  return "cpu";
}

const float* grad_loss_pointer(const Array& g, const std::string& want_device) {
  const auto dt = g.dtype();
  if (!(static_cast<nb::dlpack::dtype_code>(dt.code) == nb::dlpack::dtype_code::Float && dt.bits == 32 && dt.lanes == 1)) {
    throw PyTypeError{"grad_loss: expected dtype float32 (one element), got " + dtype_string(dt)};
  }
  size_t n = 1;
  for (size_t i = 0; i < g.ndim(); ++i) n *= g.shape(i);
  if (n != 1) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "grad_loss",
                       "grad_loss: expected a tensor with one element, got " + std::to_string(n) + " elements");
  }
  const std::string got = device_string(g.device_type(), g.device_id());
  if (got != want_device) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "grad_loss",
                       "grad_loss: expected a tensor on " + want_device + " (the backend's device), got one on " + got);
  }
  const auto* p = static_cast<const float*>(g.data());
  // cpu: read now and checked like a Python float (the library would name
  // grad_loss_device); cuda: read by the kernel at run time, not checked.
  if (want_device == "cpu" && !std::isfinite(*p)) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "grad_loss",
                       "grad_loss: expected a finite value, got " + std::to_string(*p));
  }
  return p;
}

dsaib::IndexerInputs make_inputs(const Array& index_q, const Array& weights, const Array& index_k,
                                         const Array& topk_indices, const Array& attn_score,
                                         const std::optional<Array>& index_score,
                                         const std::optional<Array>& cu_seqlens_q,
                                         const std::optional<Array>& cu_seqlens_k, bool u16,
                                         const std::optional<Array>& row_lse,
                                         const std::optional<Array>& row_target_mass,
                                         const std::optional<Array>& topk_logits) {
  dsaib::IndexerInputs in;
  in.index_q = to_view("index_q", index_q, u16);
  in.weights = to_view("weights", weights, u16);
  in.index_k = to_view("index_k", index_k, u16);
  in.topk_indices = to_view("topk_indices", topk_indices, u16);
  in.attn_score = to_view("attn_score", attn_score, u16);
  in.index_score = opt_view("index_score", index_score, u16);
  in.cu_seqlens_q = opt_view("cu_seqlens_q", cu_seqlens_q, u16);
  in.cu_seqlens_k = opt_view("cu_seqlens_k", cu_seqlens_k, u16);
  in.row_lse = opt_view("row_lse", row_lse, u16);
  in.row_target_mass = opt_view("row_target_mass", row_target_mass, u16);
  in.topk_logits = opt_view("topk_logits", topk_logits, u16);
  return in;
}

dsaib::AttentionTargetInputs make_target_inputs(const Array& query, const Array& kv, const std::optional<Array>& lse,
                                                const Array& topk_indices, const std::optional<Array>& cu_seqlens_q,
                                                const std::optional<Array>& cu_seqlens_k, bool u16) {
  dsaib::AttentionTargetInputs in;
  in.query = to_view("query", query, u16);
  in.kv = to_view("kv", kv, u16);
  in.lse = opt_view("lse", lse, u16);  // None: the library computes it over the selected keys
  in.topk_indices = to_view("topk_indices", topk_indices, u16);
  in.cu_seqlens_q = opt_view("cu_seqlens_q", cu_seqlens_q, u16);
  in.cu_seqlens_k = opt_view("cu_seqlens_k", cu_seqlens_k, u16);
  return in;
}

dsaib::IndexerTopkInputs make_topk_inputs(const Array& index_q, const Array& weights, const Array& index_k,
                                          const std::optional<Array>& starts, const std::optional<Array>& ends,
                                          const std::optional<Array>& cu_seqlens_q,
                                          const std::optional<Array>& cu_seqlens_k, bool u16,
                                          const std::optional<Array>& index_q_scale,
                                          const std::optional<Array>& index_k_scale, bool u8) {
  dsaib::IndexerTopkInputs in;
  in.index_q = view_of("index_q", index_q, u16, true, u8);
  in.weights = to_view("weights", weights, u16);
  in.index_k = view_of("index_k", index_k, u16, true, u8);
  in.index_q_scale = opt_view("index_q_scale", index_q_scale, false);
  in.index_k_scale = opt_view("index_k_scale", index_k_scale, false);
  in.starts = opt_view("starts", starts, u16);
  in.ends = opt_view("ends", ends, u16);
  in.cu_seqlens_q = opt_view("cu_seqlens_q", cu_seqlens_q, u16);
  in.cu_seqlens_k = opt_view("cu_seqlens_k", cu_seqlens_k, u16);
  return in;
}

dsaib::IndexerTopkOutputs make_topk_outputs(const OutArray& topk_indices, const std::optional<OutArray>& topk_logits,
                                            const std::optional<OutArray>& topk_lengths) {
  dsaib::IndexerTopkOutputs out;
  out.topk_indices = to_view("topk_indices", topk_indices, false);
  if (topk_logits) out.topk_logits = to_view("topk_logits", *topk_logits, false);
  if (topk_lengths) out.topk_lengths = to_view("topk_lengths", *topk_lengths, false);
  return out;
}

}  // namespace dsaib_py
