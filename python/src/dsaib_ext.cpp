// _dsaib: the nanobind extension behind the `dsaib` Python package.
//
// It converts DLPack tensors (numpy, torch, cupy, jax, or any object with
// __dlpack__/__dlpack_device__, or a DLPack capsule, through nanobind::ndarray)
// into dsaib::TensorView records and calls the library: indexer_backward (P
// given as index_score, or the P-free form with row_lse and row_target_mass),
// the loss forward (indexer_kl_forward), the loss and gradients in one call
// (indexer_kl_loss_and_grad), each with its workspace size, the validation
// alone (validate_indexer_kl_loss_inputs), the fp64 loss, and the attention
// target T from the main attention's tensors (attention_target). The Python layer
// (python/dsaib/) allocates outputs with the inputs' framework; for other
// producers it uses `empty`, which returns a Buffer: host or device memory
// owned by this module, exported through DLPack. Sizes and argument rules are
// the library's: nothing here or in Python re-derives them.
//
// dtype mapping (DLPack -> dsaib::DType):
//   bfloat16 (16 bits)                          -> bf16
//   uint16 / int16, only if uint16_as_bf16=True -> bf16 (the raw bf16 bit pattern;
//                                                  numpy has no bfloat16)
//   float32                                     -> f32
//   float64                                     -> f64 (the library takes it on the
//                                                  cpu backend where docs/api.md says)
//   int32                                       -> i32
//   anything else                               -> TypeError "NAME: expected dtype X, got Y",
//                                                  X the dtypes NAME takes (src/core/validate.cpp)
//
// Errors: dsaib::Error is translated by its code:
//   invalid_argument whose message is about a dtype -> TypeError
//   invalid_argument, index_out_of_range            -> ValueError
//   out_of_memory                                   -> MemoryError
//   unsupported, backend_unavailable, cuda_error,
//   io_error, internal                              -> RuntimeError
// with what() unchanged, so Python sees the C++ message verbatim.
#include <cmath>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if DSAIB_PY_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "dsaib/attention_target.hpp"
#include "dsaib/error.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/indexer_kl_forward.hpp"
#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "dsaib/tensor.hpp"

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

struct PyTypeError {
  std::string message;
};

/// DLPack dtype as text: float32, bfloat16, int32, uint16, ...
std::string dtype_string(nb::dlpack::dtype dt) {
  std::string got;
  switch (static_cast<nb::dlpack::dtype_code>(dt.code)) {
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
  return got;
}

/// The dtypes argument `name` takes, as the library's validation lists them
/// (src/core/validate.cpp), for a DLPack dtype that is no dsaib::DType at all
/// (a float64 reaches the library, which names the backend that refuses it).
const char* expected_dtypes(const std::string& name) {
  if (name == "index_q" || name == "index_k" || name == "query" || name == "kv") return "bf16";
  if (name == "weights" || name == "d_index_q" || name == "d_weights" || name == "d_index_k") {
    return "bf16 or f32 (or f64 on the cpu backend)";
  }
  if (name == "grad_loss") return "f32";
  if (name == "attn_score" || name == "index_score" || name == "row_lse" || name == "row_target_mass" ||
      name == "loss" || name == "lse")
    return "f32 (or f64 on the cpu backend)";
  if (name == "topk_indices" || name == "cu_seqlens_q" || name == "cu_seqlens_k") return "i32";
  return "bf16, f32 or i32";
}

dsaib::DType to_dtype(const char* name, nb::dlpack::dtype dt, bool uint16_as_bf16) {
  const auto code = static_cast<nb::dlpack::dtype_code>(dt.code);
  if (dt.lanes == 1) {
    if (code == nb::dlpack::dtype_code::Bfloat && dt.bits == 16) return dsaib::DType::bf16;
    if (code == nb::dlpack::dtype_code::Float && dt.bits == 32) return dsaib::DType::f32;
    if (code == nb::dlpack::dtype_code::Float && dt.bits == 64) return dsaib::DType::f64;
    if (code == nb::dlpack::dtype_code::Int && dt.bits == 32) return dsaib::DType::i32;
  }
  const std::string expected = expected_dtypes(name);
  const bool takes_bf16 = expected.find("bf16") != std::string::npos;
  const bool int16 = dt.lanes == 1 && dt.bits == 16 &&
                     (code == nb::dlpack::dtype_code::UInt || code == nb::dlpack::dtype_code::Int);
  // 16-bit integers are bf16 bit patterns only where bf16 is taken: elsewhere (ids,
  // scores) the error names their own dtype, not "bf16".
  if (int16 && uint16_as_bf16 && takes_bf16) return dsaib::DType::bf16;
  std::string msg = std::string(name) + ": expected dtype " + expected + ", got " + dtype_string(dt);
  if (int16 && takes_bf16) msg += " (pass uint16_as_bf16=True to read 16-bit integers as bf16 bit patterns)";
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

std::string device_string(int dev_type, int dev_id) {
  if (dev_type == nb::device::cpu::value) return "cpu";
  if (dev_type == nb::device::cuda::value || dev_type == nb::device::cuda_managed::value)
    return "cuda:" + std::to_string(dev_id);
  return "DLPack device type " + std::to_string(dev_type);
}

/// The device a backend runs on, as "cpu" or "cuda:N" (N = index_q's device).
std::string backend_device(dsaib::Backend backend, const Array& index_q) {
  if (backend == dsaib::Backend::cuda) return "cuda:" + std::to_string(index_q.device_id());
  return "cpu";
}

/// grad_loss given as a tensor: one float32 on the backend's device, read at run time.
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

// ---- Buffer: memory owned by this module, exported through DLPack -----------

struct Allocation {
  void* ptr = nullptr;
  int device_type = nb::device::cpu::value;
  int device_id = 0;
};

void free_allocation(void* p) noexcept {
  auto* a = static_cast<Allocation*>(p);
  if (a->device_type == nb::device::cpu::value) {
    std::free(a->ptr);
  } else {
#if DSAIB_PY_WITH_CUDA
    int prev = 0;
    if (cudaGetDevice(&prev) == cudaSuccess) {
      if (prev != a->device_id) cudaSetDevice(a->device_id);
      cudaFree(a->ptr);
      if (prev != a->device_id) cudaSetDevice(prev);
    }
#endif
  }
  delete a;
}

void cuda_call(bool ok_status, const char* what, const char* detail) {
  if (!ok_status) {
    throw dsaib::Error(dsaib::ErrorCode::cuda_error, what, std::string(what) + ": " + detail);
  }
}

/// A contiguous array in memory owned by this module, host or CUDA. Python
/// sees an object with __dlpack__ and __dlpack_device__ (so numpy.from_dlpack,
/// torch.from_dlpack, cupy.from_dlpack, jax.dlpack.from_dlpack take it
/// without copying), shape and dtype.
struct Buffer {
  nb::ndarray<> array;
  std::vector<int64_t> shape;
  std::string dtype;
  int device_type = 0;
  int device_id = 0;
};

Buffer make_buffer(const std::vector<int64_t>& shape, const std::string& dtype, const std::string& device) {
  nb::dlpack::dtype dt;
  size_t elem = 0;
  if (dtype == "f32") {
    dt = nb::dtype<float>();
    elem = 4;
  } else if (dtype == "bf16") {
    dt = nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    elem = 2;
  } else if (dtype == "f64") {
    dt = nb::dtype<double>();
    elem = 8;
  } else {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "dtype",
                       "dtype: expected \"f32\", \"bf16\" or \"f64\", got \"" + dtype + "\"");
  }
  if (shape.size() > static_cast<size_t>(dsaib::kMaxRank)) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "shape",
                       "shape: expected rank <= " + std::to_string(dsaib::kMaxRank) + ", got rank " +
                           std::to_string(shape.size()));
  }
  std::vector<size_t> ushape;
  size_t n = 1;
  for (int64_t s : shape) {
    if (s < 0 || s > (int64_t{1} << 40)) {
      throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "shape", "shape: expected sizes in [0, 2^40], got " + std::to_string(s));
    }
    ushape.push_back(static_cast<size_t>(s));
    n *= static_cast<size_t>(s);
  }
  const size_t bytes = ((n * elem + 255) / 256) * 256 + 256;  // never 0; 256-byte multiple
  auto* a = new Allocation;
  if (device == "cpu") {
    a->ptr = std::aligned_alloc(256, bytes);
    if (!a->ptr) {
      delete a;
      throw std::bad_alloc();
    }
  } else if (device.rfind("cuda:", 0) == 0) {
    a->device_type = nb::device::cuda::value;
    a->device_id = std::stoi(device.substr(5));
#if DSAIB_PY_WITH_CUDA
    int prev = 0;
    cudaError_t st = cudaGetDevice(&prev);
    if (st == cudaSuccess && prev != a->device_id) st = cudaSetDevice(a->device_id);
    if (st == cudaSuccess) st = cudaMalloc(&a->ptr, bytes);
    if (prev != a->device_id) cudaSetDevice(prev);
    if (st != cudaSuccess) {
      delete a;
      (void)cudaGetLastError();
      if (st == cudaErrorMemoryAllocation) {  // MemoryError, as the library's out_of_memory
        throw dsaib::Error(dsaib::ErrorCode::out_of_memory, "cudaMalloc",
                           std::string("cudaMalloc: expected ") + std::to_string(bytes) +
                               " bytes of device memory for an output, got " + cudaGetErrorString(st));
      }
      cuda_call(false, "cudaMalloc", cudaGetErrorString(st));
    }
#else
    delete a;
    throw dsaib::Error(dsaib::ErrorCode::backend_unavailable, "device",
                       "device: expected cpu (this build has no CUDA support), got " + device);
#endif
  } else {
    delete a;
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "device",
                       "device: expected \"cpu\" or \"cuda:N\", got \"" + device + "\"");
  }
  nb::capsule owner(a, &free_allocation);
  Buffer b;
  b.array = nb::ndarray<>(a->ptr, ushape.size(), ushape.data(), owner, nullptr, dt, a->device_type, a->device_id);
  b.shape = shape;
  b.dtype = dtype;
  b.device_type = a->device_type;
  b.device_id = a->device_id;
  return b;
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

dsaib::AOperandPrecision parse_a_operand(const std::string& s) {
  dsaib::AOperandPrecision a = dsaib::AOperandPrecision::automatic;
  if (dsaib::parse_a_operand_precision(s, &a)) return a;
  throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "a_operand_precision",
                     "a_operand_precision: expected \"auto\", \"bf16x2\" or \"bf16\", got \"" + s + "\"");
}

dsaib::L2Hints parse_l2_hints_word(const std::string& s) {
  dsaib::L2Hints v = dsaib::L2Hints::automatic;
  if (dsaib::parse_l2_hints(s, &v)) return v;
  throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "l2_hints",
                     "l2_hints: expected \"auto\", \"on\" or \"off\", got \"" + s + "\"");
}

dsaib::StartStagger parse_start_stagger_word(const std::string& s) {
  dsaib::StartStagger v = dsaib::StartStagger::automatic;
  if (dsaib::parse_start_stagger(s, &v)) return v;
  throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "start_stagger",
                     "start_stagger: expected \"auto\" or \"off\", got \"" + s + "\"");
}

dsaib::IndexerInputs make_inputs(const Array& index_q, const Array& weights, const Array& index_k,
                                         const Array& topk_indices, const Array& attn_score,
                                         const std::optional<Array>& index_score,
                                         const std::optional<Array>& cu_seqlens_q,
                                         const std::optional<Array>& cu_seqlens_k, bool u16,
                                         const std::optional<Array>& row_lse = std::nullopt,
                                         const std::optional<Array>& row_target_mass = std::nullopt) {
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
  return in;
}

/// The library's options from a binding's keyword arguments (**options): the
/// one place that maps them, so that a new option is one entry here and one in
/// the Python layer's options. An option not given keeps its default in
/// dsaib::IndexerOptions; a name not known here is a TypeError.
class OptionReader {
 public:
  explicit OptionReader(const nb::kwargs& kw) : kw_(kw) {}

  /// Whether option `name` was given (it then counts as known).
  bool given(const char* name) {
    if (!kw_.contains(name)) return false;
    known_.emplace_back(name);
    return true;
  }
  template <class T>
  T value(const char* name) const {
    T v{};
    if (!nb::try_cast<T>(kw_[name], v)) {
      throw PyTypeError{std::string(name) + ": expected " + what<T>() + ", got " +
                        nb::cast<std::string>(nb::str(nb::handle(kw_[name]).type().attr("__name__")))};
    }
    return v;
  }
  /// TypeError naming a keyword argument that is no option.
  void check_all_known() const {
    for (auto item : kw_) {
      const auto name = nb::cast<std::string>(nb::str(item.first));
      if (std::find(known_.begin(), known_.end(), name) == known_.end()) {
        throw PyTypeError{"options: unexpected keyword argument '" + name + "'"};
      }
    }
  }

 private:
  template <class T>
  static std::string what() {
    if constexpr (std::is_same_v<T, std::string>) return "a str";
    else if constexpr (std::is_same_v<T, bool>) return "a bool";
    else if constexpr (std::is_floating_point_v<T>) return "a float";
    else return "an int in the range of its C type";
  }
  const nb::kwargs& kw_;
  std::vector<std::string> known_;
};

dsaib::IndexerOptions make_options(const nb::kwargs& kw) {
  OptionReader r(kw);
  dsaib::IndexerOptions o;
  if (r.given("layout")) o.layout = parse_layout(r.value<std::string>("layout"));
  if (r.given("id_mode")) o.id_mode = parse_id_mode(r.value<std::string>("id_mode"));
  if (r.given("backend")) o.backend = parse_backend(r.value<std::string>("backend"));
  if (r.given("sm_scale")) o.sm_scale = r.value<float>("sm_scale");
  if (r.given("loss_coeff")) o.loss_coeff = r.value<float>("loss_coeff");
  if (r.given("grad_loss")) o.grad_loss = r.value<float>("grad_loss");
  if (r.given("normalization_count")) o.normalization_count = r.value<int64_t>("normalization_count");
  if (r.given("strict_indices")) o.strict_indices = r.value<bool>("strict_indices");
  if (r.given("deterministic")) o.deterministic = r.value<bool>("deterministic");
  if (r.given("stream")) o.stream = reinterpret_cast<void*>(r.value<uintptr_t>("stream"));
  if (r.given("num_threads")) o.num_threads = r.value<int32_t>("num_threads");
  if (r.given("a_operand_precision")) {
    o.a_operand_precision = parse_a_operand(r.value<std::string>("a_operand_precision"));
  }
  if (r.given("l2_hints")) o.l2_hints = parse_l2_hints_word(r.value<std::string>("l2_hints"));
  if (r.given("start_stagger")) o.start_stagger = parse_start_stagger_word(r.value<std::string>("start_stagger"));
  r.check_all_known();
  return o;
}

dsaib::IndexerBackwardOutputs make_outputs(const OutArray& d_index_q, const OutArray& d_weights,
                                           const OutArray& d_index_k, bool out_uint16_as_bf16) {
  dsaib::IndexerBackwardOutputs out;
  out.d_index_q = to_view("d_index_q", d_index_q, out_uint16_as_bf16);
  out.d_weights = to_view("d_weights", d_weights, out_uint16_as_bf16);
  out.d_index_k = to_view("d_index_k", d_index_k, out_uint16_as_bf16);
  return out;
}

/// Outputs of the loss forward; index_score (P) is optional.
dsaib::IndexerKLForwardOutputs make_forward_outputs(const OutArray& loss, const OutArray& row_lse,
                                                    const OutArray& row_target_mass,
                                                    const std::optional<OutArray>& index_score) {
  dsaib::IndexerKLForwardOutputs out;
  out.loss = to_view("loss", loss, false);
  out.row_lse = to_view("row_lse", row_lse, false);
  out.row_target_mass = to_view("row_target_mass", row_target_mass, false);
  if (index_score) out.index_score = to_view("index_score", *index_score, false);
  return out;
}

dsaib::IndexerKLLossAndGradOutputs make_loss_and_grad_outputs(const OutArray& loss, const OutArray& d_index_q,
                                                              const OutArray& d_weights, const OutArray& d_index_k,
                                                              bool out_uint16_as_bf16) {
  dsaib::IndexerKLLossAndGradOutputs out;
  out.loss = to_view("loss", loss, false);
  out.d_index_q = to_view("d_index_q", d_index_q, out_uint16_as_bf16);
  out.d_weights = to_view("d_weights", d_weights, out_uint16_as_bf16);
  out.d_index_k = to_view("d_index_k", d_index_k, out_uint16_as_bf16);
  return out;
}

dsaib::LseBase parse_lse_base_word(const std::string& s) {
  dsaib::LseBase v = dsaib::LseBase::natural;
  if (dsaib::parse_lse_base(s, &v)) return v;
  throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "lse_base",
                     "lse_base: expected \"natural\" or \"base2\", got \"" + s + "\"");
}

/// attention_target()'s options from keyword arguments, as make_options does for the indexer's.
dsaib::AttentionTargetOptions make_target_options(const nb::kwargs& kw) {
  OptionReader r(kw);
  dsaib::AttentionTargetOptions o;
  if (r.given("layout")) o.layout = parse_layout(r.value<std::string>("layout"));
  if (r.given("id_mode")) o.id_mode = parse_id_mode(r.value<std::string>("id_mode"));
  if (r.given("backend")) o.backend = parse_backend(r.value<std::string>("backend"));
  if (r.given("sm_scale")) o.sm_scale = r.value<float>("sm_scale");
  if (r.given("lse_base")) o.lse_base = parse_lse_base_word(r.value<std::string>("lse_base"));
  if (r.given("normalize")) o.normalize = r.value<bool>("normalize");
  if (r.given("strict_indices")) o.strict_indices = r.value<bool>("strict_indices");
  if (r.given("stream")) o.stream = reinterpret_cast<void*>(r.value<uintptr_t>("stream"));
  if (r.given("num_threads")) o.num_threads = r.value<int32_t>("num_threads");
  r.check_all_known();
  return o;
}

dsaib::AttentionTargetInputs make_target_inputs(const Array& query, const Array& kv, const Array& lse,
                                                const Array& topk_indices, const std::optional<Array>& cu_seqlens_q,
                                                const std::optional<Array>& cu_seqlens_k, bool u16) {
  dsaib::AttentionTargetInputs in;
  in.query = to_view("query", query, u16);
  in.kv = to_view("kv", kv, u16);
  in.lse = to_view("lse", lse, u16);
  in.topk_indices = to_view("topk_indices", topk_indices, u16);
  in.cu_seqlens_q = opt_view("cu_seqlens_q", cu_seqlens_q, u16);
  in.cu_seqlens_k = opt_view("cu_seqlens_k", cu_seqlens_k, u16);
  return in;
}

/// The workspace argument of a library call: (pointer, bytes), after checking
/// that it lives on the backend's device; (nullptr, 0) when none is given.
std::pair<void*, std::size_t> workspace_of(const std::optional<OutArray>& workspace, const std::string& device) {
  if (!workspace) return {nullptr, 0};
  const std::string got = device_string(workspace->device_type(), workspace->device_id());
  if (got != device) {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "workspace",
                       "workspace: expected a tensor on " + device + " (the backend's device), got one on " + got);
  }
  return {workspace->data(), workspace->nbytes()};
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

  // Every library call takes the tensors as named arguments and the library's
  // options as **options (make_options): layout, id_mode, backend, sm_scale,
  // loss_coeff, grad_loss, normalization_count, strict_indices, deterministic,
  // stream, num_threads, a_operand_precision. indexer_backward and
  // indexer_backward_workspace_size take the same arguments (the second
  // without workspace), so that Python passes one set to both.
  m.def(
      "indexer_backward",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& index_score, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, const OutArray& d_index_q, const OutArray& d_weights,
         const OutArray& d_index_k, const std::optional<Array>& grad_loss_device,
         const std::optional<OutArray>& workspace, const std::optional<Array>& row_lse,
         const std::optional<Array>& row_target_mass, bool uint16_as_bf16, bool out_uint16_as_bf16,
         const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, index_score,
                                    cu_seqlens_q, cu_seqlens_k, uint16_as_bf16, row_lse, row_target_mass);
        const auto out = make_outputs(d_index_q, d_weights, d_index_k, out_uint16_as_bf16);
        auto opt = make_options(options);
        const std::string device = backend_device(opt.backend, index_q);
        if (grad_loss_device) opt.grad_loss_device = grad_loss_pointer(*grad_loss_device, device);
        const auto [ws, ws_bytes] = workspace_of(workspace, device);
        nb::gil_scoped_release release;
        dsaib::indexer_backward(in, out, opt, ws, ws_bytes);
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
      "backend's device, read when the work runs; workspace (optional) is scratch memory on that device (see\n"
      "indexer_backward_workspace_size). Raises ValueError/TypeError/RuntimeError.");

  m.def(
      "indexer_backward_workspace_size",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& index_score, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, const OutArray& d_index_q, const OutArray& d_weights,
         const OutArray& d_index_k, const std::optional<Array>& grad_loss_device,
         const std::optional<Array>& row_lse, const std::optional<Array>& row_target_mass, bool uint16_as_bf16,
         bool out_uint16_as_bf16, const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, index_score,
                                    cu_seqlens_q, cu_seqlens_k, uint16_as_bf16, row_lse, row_target_mass);
        const auto out = make_outputs(d_index_q, d_weights, d_index_k, out_uint16_as_bf16);
        auto opt = make_options(options);
        if (grad_loss_device) opt.grad_loss_device = grad_loss_pointer(*grad_loss_device, backend_device(opt.backend, index_q));
        nb::gil_scoped_release release;
        return dsaib::indexer_backward_workspace_size(in, out, opt);
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("index_score").none(), nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(),
      nb::arg("d_index_q"), nb::arg("d_weights"), nb::arg("d_index_k"),
      nb::arg("grad_loss_device").none() = nb::none(), nb::arg("row_lse").none() = nb::none(),
      nb::arg("row_target_mass").none() = nb::none(), nb::arg("uint16_as_bf16") = false,
      nb::arg("out_uint16_as_bf16") = false, nb::arg("options"),
      "dsaib::indexer_backward_workspace_size: the bytes of scratch memory indexer_backward needs with the same\n"
      "arguments (0 on the cpu backend). Validates them as indexer_backward does and raises the same errors.");

  m.def(
      "indexer_kl_forward",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& loss, const OutArray& row_lse, const OutArray& row_target_mass,
         const std::optional<OutArray>& index_score, const std::optional<OutArray>& workspace, bool uint16_as_bf16,
         const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, std::nullopt, cu_seqlens_q,
                                    cu_seqlens_k, uint16_as_bf16);
        const auto out = make_forward_outputs(loss, row_lse, row_target_mass, index_score);
        const auto opt = make_options(options);
        const auto [ws, ws_bytes] = workspace_of(workspace, backend_device(opt.backend, index_q));
        nb::gil_scoped_release release;
        dsaib::indexer_kl_forward(in, out, opt, ws, ws_bytes);
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("loss"), nb::arg("row_lse"),
      nb::arg("row_target_mass"), nb::arg("index_score").none() = nb::none(),
      nb::arg("workspace").none() = nb::none(), nb::arg("uint16_as_bf16") = false, nb::arg("options"),
      "Calls dsaib::indexer_kl_forward: writes the loss (float32, shape ()), row_lse and row_target_mass\n"
      "(float32, one per query row) and, if given, index_score (P, float32, shaped like topk_indices).\n"
      "workspace (optional) is scratch memory on the backend's device (see indexer_kl_forward_workspace_size).");

  m.def(
      "indexer_kl_forward_workspace_size",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& loss, const OutArray& row_lse, const OutArray& row_target_mass,
         const std::optional<OutArray>& index_score, bool uint16_as_bf16, const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, std::nullopt, cu_seqlens_q,
                                    cu_seqlens_k, uint16_as_bf16);
        const auto out = make_forward_outputs(loss, row_lse, row_target_mass, index_score);
        const auto opt = make_options(options);
        nb::gil_scoped_release release;
        return dsaib::indexer_kl_forward_workspace_size(in, out, opt);
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("loss"), nb::arg("row_lse"),
      nb::arg("row_target_mass"), nb::arg("index_score").none() = nb::none(), nb::arg("uint16_as_bf16") = false,
      nb::arg("options"),
      "dsaib::indexer_kl_forward_workspace_size: the bytes of scratch memory indexer_kl_forward needs with the\n"
      "same arguments (0 on the cpu backend). Validates them as indexer_kl_forward does.");

  m.def(
      "indexer_kl_loss_and_grad",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& loss, const OutArray& d_index_q, const OutArray& d_weights, const OutArray& d_index_k,
         const std::optional<Array>& grad_loss_device, const std::optional<OutArray>& workspace,
         bool uint16_as_bf16, bool out_uint16_as_bf16, const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, std::nullopt, cu_seqlens_q,
                                    cu_seqlens_k, uint16_as_bf16);
        const auto out = make_loss_and_grad_outputs(loss, d_index_q, d_weights, d_index_k, out_uint16_as_bf16);
        auto opt = make_options(options);
        const std::string device = backend_device(opt.backend, index_q);
        if (grad_loss_device) opt.grad_loss_device = grad_loss_pointer(*grad_loss_device, device);
        const auto [ws, ws_bytes] = workspace_of(workspace, device);
        nb::gil_scoped_release release;
        dsaib::indexer_kl_loss_and_grad(in, out, opt, ws, ws_bytes);
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("loss"), nb::arg("d_index_q"),
      nb::arg("d_weights"), nb::arg("d_index_k"), nb::arg("grad_loss_device").none() = nb::none(),
      nb::arg("workspace").none() = nb::none(), nb::arg("uint16_as_bf16") = false,
      nb::arg("out_uint16_as_bf16") = false, nb::arg("options"),
      "Calls dsaib::indexer_kl_loss_and_grad: the loss (float32, shape ()) and d_index_q, d_weights, d_index_k\n"
      "in one call, without P. grad_loss_device and workspace as for indexer_backward.");

  m.def(
      "indexer_kl_loss_and_grad_workspace_size",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& loss, const OutArray& d_index_q, const OutArray& d_weights, const OutArray& d_index_k,
         const std::optional<Array>& grad_loss_device, bool uint16_as_bf16, bool out_uint16_as_bf16,
         const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, std::nullopt, cu_seqlens_q,
                                    cu_seqlens_k, uint16_as_bf16);
        const auto out = make_loss_and_grad_outputs(loss, d_index_q, d_weights, d_index_k, out_uint16_as_bf16);
        auto opt = make_options(options);
        if (grad_loss_device) opt.grad_loss_device = grad_loss_pointer(*grad_loss_device, backend_device(opt.backend, index_q));
        nb::gil_scoped_release release;
        return dsaib::indexer_kl_loss_and_grad_workspace_size(in, out, opt);
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("loss"), nb::arg("d_index_q"),
      nb::arg("d_weights"), nb::arg("d_index_k"), nb::arg("grad_loss_device").none() = nb::none(),
      nb::arg("uint16_as_bf16") = false, nb::arg("out_uint16_as_bf16") = false, nb::arg("options"),
      "dsaib::indexer_kl_loss_and_grad_workspace_size: the bytes of scratch memory indexer_kl_loss_and_grad\n"
      "needs with the same arguments (0 on the cpu backend). Validates them as that call does.");

  m.def(
      "attention_target",
      [](const Array& query, const Array& kv, const Array& lse, const Array& topk_indices,
         const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& attn_score, const std::optional<OutArray>& workspace, bool uint16_as_bf16,
         const nb::kwargs& options) {
        const auto in = make_target_inputs(query, kv, lse, topk_indices, cu_seqlens_q, cu_seqlens_k, uint16_as_bf16);
        const dsaib::AttentionTargetOutputs out{to_view("attn_score", attn_score, false)};
        const auto opt = make_target_options(options);
        const auto [ws, ws_bytes] = workspace_of(workspace, backend_device(opt.backend, query));
        nb::gil_scoped_release release;
        dsaib::attention_target(in, out, opt, ws, ws_bytes);
      },
      nb::arg("query"), nb::arg("kv"), nb::arg("lse"), nb::arg("topk_indices"), nb::arg("cu_seqlens_q").none(),
      nb::arg("cu_seqlens_k").none(), nb::arg("attn_score"), nb::arg("workspace").none() = nb::none(),
      nb::arg("uint16_as_bf16") = false, nb::arg("options"),
      "Calls dsaib::attention_target: writes attn_score (float32, shaped like topk_indices), the main\n"
      "attention's probability of each selected key summed over its heads (normalised per row unless\n"
      "normalize=False). Options: layout, id_mode, backend, sm_scale, lse_base (\"natural\" or \"base2\"),\n"
      "normalize, strict_indices, stream, num_threads.");

  m.def(
      "attention_target_workspace_size",
      [](const Array& query, const Array& kv, const Array& lse, const Array& topk_indices,
         const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& attn_score, bool uint16_as_bf16, const nb::kwargs& options) {
        const auto in = make_target_inputs(query, kv, lse, topk_indices, cu_seqlens_q, cu_seqlens_k, uint16_as_bf16);
        const dsaib::AttentionTargetOutputs out{to_view("attn_score", attn_score, false)};
        const auto opt = make_target_options(options);
        nb::gil_scoped_release release;
        return dsaib::attention_target_workspace_size(in, out, opt);
      },
      nb::arg("query"), nb::arg("kv"), nb::arg("lse"), nb::arg("topk_indices"), nb::arg("cu_seqlens_q").none(),
      nb::arg("cu_seqlens_k").none(), nb::arg("attn_score"), nb::arg("uint16_as_bf16") = false, nb::arg("options"),
      "dsaib::attention_target_workspace_size: the bytes of scratch memory attention_target needs with the\n"
      "same arguments (0 on the cpu backend). Validates them as attention_target does.");

  m.def(
      "validate_indexer_kl_loss_inputs",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& index_score, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, bool uint16_as_bf16, const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, index_score,
                                    cu_seqlens_q, cu_seqlens_k, uint16_as_bf16);
        const auto opt = make_options(options);
        nb::gil_scoped_release release;  // THD on cuda waits for the copy of cu_seqlens
        dsaib::validate_indexer_kl_loss_inputs(in, opt);
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("index_score").none() = nb::none(), nb::arg("cu_seqlens_q").none() = nb::none(),
      nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("uint16_as_bf16") = false, nb::arg("options"),
      "dsaib::validate_indexer_kl_loss_inputs: indexer_backward's checks of the inputs and options, without\n"
      "outputs and without computing anything; index_score may be None (then held to attn_score's rules).\n"
      "Reads only the tensors' metadata and, for layout thd, cu_seqlens (cuda: copied to the host on the\n"
      "stream option, waited for). Raises what indexer_backward would, with its messages.");

  m.def(
      "check_a_operand_precision",
      [](const std::string& word) { (void)parse_a_operand(word); }, nb::arg("word"),
      "Raises ValueError (the message indexer_backward gives) unless word is \"auto\", \"bf16x2\" or \"bf16\".");
  m.def(
      "check_l2_hints", [](const std::string& word) { (void)parse_l2_hints_word(word); }, nb::arg("word"),
      "Raises ValueError (the message indexer_backward gives) unless word is \"auto\", \"on\" or \"off\".");
  m.def(
      "check_start_stagger", [](const std::string& word) { (void)parse_start_stagger_word(word); }, nb::arg("word"),
      "Raises ValueError (the message indexer_backward gives) unless word is \"auto\" or \"off\".");

  m.def(
      "indexer_kl_loss",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const Array& index_score, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, bool recompute_p, bool uint16_as_bf16,
         const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, index_score,
                                    cu_seqlens_q, cu_seqlens_k, uint16_as_bf16);
        const auto opt = make_options(options);  // the library takes cpu tensors here, whatever `backend` says
        nb::gil_scoped_release release;
        return dsaib::indexer_kl_loss(in, opt, recompute_p);
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("index_score"), nb::arg("cu_seqlens_q").none() = nb::none(), nb::arg("cu_seqlens_k").none() = nb::none(),
      nb::arg("recompute_p") = true, nb::arg("uint16_as_bf16") = false, nb::arg("options"),
      "fp64 host evaluation of the loss whose gradient indexer_backward computes (cpu tensors only).");

  m.def("cuda_compiled", []() {
#if DSAIB_PY_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether this build of the extension contains the cuda backend (a device may still be missing).");

  nb::class_<Buffer>(m, "Buffer",
                     "A contiguous array in memory owned by dsaib (host or CUDA), exported through DLPack:\n"
                     "numpy.from_dlpack, torch.from_dlpack, cupy.from_dlpack and jax.dlpack.from_dlpack take it\n"
                     "without a copy. Returned by dsaib.indexer_backward for inputs of frameworks dsaib\n"
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
        "An uninitialised contiguous Buffer: dtype \"f32\" or \"bf16\", device \"cpu\" or \"cuda:N\".");

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
