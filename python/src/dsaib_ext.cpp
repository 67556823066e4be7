// _dsaib: the nanobind extension behind the `dsaib` Python package.
//
// It converts DLPack tensors (numpy, torch, cupy, jax, or any object with
// __dlpack__/__dlpack_device__, or a DLPack capsule, through nanobind::ndarray)
// into dsaib::TensorView records and calls the library, one library call per
// binding: indexer_backward (P given as index_score, or the P-free form with
// row_lse and row_target_mass), the loss forward (indexer_kl_forward), the loss
// and gradients in one call (indexer_kl_loss_and_grad), the attention target T
// from the main attention's tensors (attention_target), the validation alone
// (validate_indexer_kl_loss_inputs), the fp64 host loss (indexer_kl_loss) and the
// indexer's forward, its logits and exact top-k (indexer_topk, with its workspace
// size query indexer_topk_workspace_size).
//
// The workspace of a call comes from the caller's allocator, asked by the
// library after it has validated the arguments (dsaib::WorkspaceAllocator):
// `workspace` is a Python callable nbytes -> DLPack array on the backend's
// device (torch's caching allocator), or None (the library allocates it,
// stream-ordered). So the arguments are validated once per call.
//
// The library's options are keyword arguments (**options), read through one
// table per options struct (OptionTable below), which also tells Python each
// option's kind, default and words (option_table()). The Python layer
// (python/dsaib/) allocates outputs with the inputs' framework; for other
// producers it uses `empty`, which returns a Buffer: host or device memory
// owned by this module, exported through DLPack.
//
// Counters for tests: library_calls() (calls into the library made here) and
// host_waits() (the CUDA runtime's blocking calls made inside this module,
// counted through the linker's --wrap in CUDA builds; host_waits.cpp).
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
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
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
#include "dsaib/indexer_topk.hpp"
#include "dsaib/tensor.hpp"
#include "dsaib/workspace.hpp"
#include "host_waits.hpp"

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
  if (name == "topk_logits") return "f32 (or f64 on the cpu backend)";
  if (name == "topk_indices" || name == "cu_seqlens_q" || name == "cu_seqlens_k" || name == "starts" ||
      name == "ends" || name == "topk_lengths")
    return "i32";
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
  } else if (dtype == "i32") {
    dt = nb::dtype<int32_t>();
    elem = 4;
  } else {
    throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "dtype",
                       "dtype: expected \"f32\", \"bf16\", \"f64\" or \"i32\", got \"" + dtype + "\"");
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
// ---- options: one table per options struct ------------------------------------

/// `"a", "b" or "c"`: how the library's messages list an option's words.
std::string word_list(const std::vector<std::string>& words) {
  std::string s;
  for (size_t i = 0; i < words.size(); ++i) {
    if (i) s += i + 1 == words.size() ? " or " : ", ";
    s += "\"" + words[i] + "\"";
  }
  return s;
}

/// The library's options struct `Options` read from keyword arguments: each
/// field once, with its name, kind, words (the library's *_name functions of
/// the enum's values) and default (a default-constructed Options). The
/// bindings read **options through it, and option_table() shows it to Python,
/// which takes its words and defaults from there.
template <class Options>
class OptionTable {
 public:
  template <class E>
  OptionTable& word(const char* name, E Options::*member, std::initializer_list<E> values, const char* (*word_of)(E)) {
    std::vector<std::string> words;
    for (E v : values) words.emplace_back(word_of(v));
    const std::vector<E> vals(values);
    const std::string option = name;
    add(name, "word", words,
        [member, vals, words, option](Options& o, nb::handle h) {
          const auto s = cast<std::string>(option, h);
          for (size_t i = 0; i < vals.size(); ++i) {
            if (s == words[i]) {
              o.*member = vals[i];
              return;
            }
          }
          throw dsaib::Error(dsaib::ErrorCode::invalid_argument, option,
                             option + ": expected " + word_list(words) + ", got \"" + s + "\"");
        },
        [member, word_of](const Options& o) -> nb::object { return nb::str(word_of(o.*member)); });
    return *this;
  }
  /// A number or a flag (float, bool, int64_t, int32_t), or a pointer read as an int (uintptr_t).
  template <class T>
  OptionTable& value(const char* name, T Options::*member) {
    const std::string option = name;
    add(name, kind<T>(), {}, [member, option](Options& o, nb::handle h) { o.*member = cast<T>(option, h); },
        [member](const Options& o) -> nb::object { return nb::cast(o.*member); });
    return *this;
  }
  OptionTable& pointer(const char* name, void* Options::*member) {
    const std::string option = name;
    add(name, "pointer", {},
        [member, option](Options& o, nb::handle h) { o.*member = reinterpret_cast<void*>(cast<uintptr_t>(option, h)); },
        [member](const Options& o) -> nb::object { return nb::cast(reinterpret_cast<uintptr_t>(o.*member)); });
    return *this;
  }

  /// Options from keyword arguments: a name not in the table is a TypeError; one
  /// left out keeps the struct's default.
  Options read(const nb::kwargs& kw) const {
    Options o;
    for (auto item : kw) {
      const auto name = nb::cast<std::string>(nb::str(item.first));
      const Field* f = find(name);
      if (!f) throw PyTypeError{"options: unexpected keyword argument '" + name + "'"};
      f->set(o, item.second);
    }
    return o;
  }

  /// {name: (kind, default, words)}, in the struct's order.
  nb::dict describe() const {
    const Options defaults{};
    nb::dict d;
    for (const Field& f : fields_) {
      nb::list words;
      for (const auto& w : f.words) words.append(nb::str(w.c_str()));
      d[f.name.c_str()] = nb::make_tuple(nb::str(f.kind.c_str()), f.get(defaults), nb::tuple(words));
    }
    return d;
  }

 private:
  struct Field {
    std::string name, kind;
    std::vector<std::string> words;
    std::function<void(Options&, nb::handle)> set;
    std::function<nb::object(const Options&)> get;
  };
  void add(const char* name, const char* k, std::vector<std::string> words,
           std::function<void(Options&, nb::handle)> set, std::function<nb::object(const Options&)> get) {
    fields_.push_back({name, k, std::move(words), std::move(set), std::move(get)});
  }
  const Field* find(const std::string& name) const {
    for (const Field& f : fields_) {
      if (f.name == name) return &f;
    }
    return nullptr;
  }
  template <class T>
  static const char* kind() {
    if constexpr (std::is_same_v<T, bool>) return "bool";
    else if constexpr (std::is_floating_point_v<T>) return "float";
    else if constexpr (sizeof(T) == 4) return "int32";
    else return "int64";
  }
  template <class T>
  static T cast(const std::string& name, nb::handle h) {
    T v{};
    if (!nb::try_cast<T>(h, v)) {
      const char* what = std::is_same_v<T, std::string> ? "a str"
                         : std::is_same_v<T, bool>      ? "a bool"
                         : std::is_floating_point_v<T>  ? "a float"
                                                        : "an int in the range of its C type";
      throw PyTypeError{name + ": expected " + what + ", got " +
                        nb::cast<std::string>(nb::str(h.type().attr("__name__")))};
    }
    return v;
  }

  std::vector<Field> fields_;
};

using dsaib::AOperandPrecision;
using dsaib::Backend;
using dsaib::ForwardFusion;
using dsaib::IdMode;
using dsaib::L2Hints;
using dsaib::Layout;
using dsaib::LseBase;
using dsaib::StartStagger;

/// dsaib::IndexerOptions (grad_loss_device comes as a tensor argument).
const OptionTable<dsaib::IndexerOptions>& indexer_options() {
  using O = dsaib::IndexerOptions;
  static const OptionTable<O> table = [] {
    OptionTable<O> t;
    t.word("layout", &O::layout, {Layout::bshd, Layout::thd}, dsaib::layout_name)
        .word("id_mode", &O::id_mode, {IdMode::local, IdMode::global}, dsaib::id_mode_name)
        .word("backend", &O::backend, {Backend::cpu, Backend::cuda}, dsaib::backend_name)
        .value("sm_scale", &O::sm_scale)
        .value("loss_coeff", &O::loss_coeff)
        .value("grad_loss", &O::grad_loss)
        .value("normalization_count", &O::normalization_count)
        .value("strict_indices", &O::strict_indices)
        .value("deterministic", &O::deterministic)
        .pointer("stream", &O::stream)
        .value("num_threads", &O::num_threads)
        .word("a_operand_precision", &O::a_operand_precision,
              {AOperandPrecision::automatic, AOperandPrecision::bf16x2, AOperandPrecision::bf16},
              dsaib::a_operand_precision_name)
        .word("l2_hints", &O::l2_hints, {L2Hints::automatic, L2Hints::on, L2Hints::off}, dsaib::l2_hints_name)
        .word("start_stagger", &O::start_stagger, {StartStagger::automatic, StartStagger::off},
              dsaib::start_stagger_name)
        .word("forward_fusion", &O::forward_fusion, {ForwardFusion::automatic, ForwardFusion::off},
              dsaib::forward_fusion_name);
    return t;
  }();
  return table;
}

/// dsaib::AttentionTargetOptions.
const OptionTable<dsaib::AttentionTargetOptions>& target_options() {
  using O = dsaib::AttentionTargetOptions;
  static const OptionTable<O> table = [] {
    OptionTable<O> t;
    t.word("layout", &O::layout, {Layout::bshd, Layout::thd}, dsaib::layout_name)
        .word("id_mode", &O::id_mode, {IdMode::local, IdMode::global}, dsaib::id_mode_name)
        .word("backend", &O::backend, {Backend::cpu, Backend::cuda}, dsaib::backend_name)
        .value("sm_scale", &O::sm_scale)
        .word("lse_base", &O::lse_base, {LseBase::natural, LseBase::base2}, dsaib::lse_base_name)
        .value("normalize", &O::normalize)
        .value("strict_indices", &O::strict_indices)
        .pointer("stream", &O::stream)
        .value("num_threads", &O::num_threads);
    return t;
  }();
  return table;
}

/// dsaib::IndexerTopkOptions (causal_offset's default, kCausalOffsetAuto, is
/// Python's None: the keyword is then left out).
const OptionTable<dsaib::IndexerTopkOptions>& topk_options() {
  using O = dsaib::IndexerTopkOptions;
  static const OptionTable<O> table = [] {
    OptionTable<O> t;
    t.word("layout", &O::layout, {Layout::bshd, Layout::thd}, dsaib::layout_name)
        .word("id_mode", &O::id_mode, {IdMode::local, IdMode::global}, dsaib::id_mode_name)
        .word("backend", &O::backend, {Backend::cpu, Backend::cuda}, dsaib::backend_name)
        .word("order", &O::order, {dsaib::TopkOrder::logit_descending, dsaib::TopkOrder::id_ascending},
              dsaib::topk_order_name)
        .value("causal_offset", &O::causal_offset)
        .value("strict_ranges", &O::strict_ranges)
        .pointer("stream", &O::stream)
        .value("num_threads", &O::num_threads);
    return t;
  }();
  return table;
}

// ---- tensors --------------------------------------------------------------------

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
                                          const std::optional<Array>& cu_seqlens_k, bool u16) {
  dsaib::IndexerTopkInputs in;
  in.index_q = to_view("index_q", index_q, u16);
  in.weights = to_view("weights", weights, u16);
  in.index_k = to_view("index_k", index_k, u16);
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

// ---- the workspace: the caller's allocator, asked by the library --------------

/// A Python exception raised by the allocator, restored as the pending error
/// (with the GIL held) and raised again once the library call has returned.
struct PendingPythonError {};

/// dsaib::WorkspaceAllocator over a Python callable nbytes -> DLPack array. The
/// array is held until the call returns (the caller's allocator orders its
/// reuse after the work on the call's stream).
class PyWorkspace {
 public:
  PyWorkspace(const std::optional<nb::object>& allocate, std::string device)
      : allocate_(allocate), device_(std::move(device)) {
    if (allocate_ && !allocate_->is_none() && !PyCallable_Check(allocate_->ptr())) {
      throw PyTypeError{"workspace: expected None or a callable nbytes -> array (an allocator), got " +
                        nb::cast<std::string>(nb::str(allocate_->type().attr("__name__")))};
    }
  }
  dsaib::WorkspaceAllocator allocator() {
    if (!allocate_ || allocate_->is_none()) return {};  // the library allocates it, stream-ordered
    return {&PyWorkspace::allocate, this};
  }

 private:
  static void* allocate(void* self, std::size_t bytes) {
    auto* w = static_cast<PyWorkspace*>(self);
    nb::gil_scoped_acquire gil;
    try {
      OutArray a = nb::cast<OutArray>((*w->allocate_)(bytes));
      const std::string got = device_string(a.device_type(), a.device_id());
      if (got != w->device_) {
        throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "workspace",
                           "workspace: expected the allocator's array on " + w->device_ +
                               " (the backend's device), got one on " + got);
      }
      if (a.nbytes() < bytes) {
        throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "workspace",
                           "workspace: expected the allocator's array to hold >= " + std::to_string(bytes) +
                               " bytes, got " + std::to_string(a.nbytes()));
      }
      w->held_ = a;
      return a.data();
    } catch (nb::python_error& e) {
      e.restore();
      throw PendingPythonError{};
    } catch (const nb::cast_error&) {
      throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "workspace",
                         "workspace: expected the allocator to return an array (DLPack), got another object");
    }
  }

  std::optional<nb::object> allocate_;
  std::string device_;
  std::optional<OutArray> held_;
};

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

  m.def(
      "option_table",
      [](const std::string& which) {
        if (which == "indexer") return indexer_options().describe();
        if (which == "attention_target") return target_options().describe();
        if (which == "indexer_topk") return topk_options().describe();
        throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "which",
                           "which: expected \"indexer\", \"attention_target\" or \"indexer_topk\", got \"" +
                               which + "\"");
      },
      nb::arg("which"),
      "The library's options of the indexer's entry points (\"indexer\": dsaib::IndexerOptions), of\n"
      "attention_target (\"attention_target\") or of indexer_topk (\"indexer_topk\"): {name: (kind,\n"
      "default, words)}, kind one of \"word\",\n"
      "\"float\", \"bool\", \"int32\", \"int64\", \"pointer\"; words the values a \"word\" option takes.\n"
      "The bindings take exactly these names as keyword arguments.");

  // Every library call takes the tensors as named arguments and the library's
  // options as **options (the tables above). `workspace` is None or a
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
        auto opt = indexer_options().read(options);
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
         const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, std::nullopt, cu_seqlens_q,
                                    cu_seqlens_k, uint16_as_bf16);
        dsaib::IndexerKLForwardOutputs out;
        out.loss = to_view("loss", loss, false);
        out.row_lse = to_view("row_lse", row_lse, false);
        out.row_target_mass = to_view("row_target_mass", row_target_mass, false);
        if (index_score) out.index_score = to_view("index_score", *index_score, false);
        const auto opt = indexer_options().read(options);
        PyWorkspace ws(workspace, device_of(opt, index_q));
        call_library([&] { dsaib::indexer_kl_forward(in, out, opt, ws.allocator()); });
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("loss"), nb::arg("row_lse"),
      nb::arg("row_target_mass"), nb::arg("index_score").none() = nb::none(),
      nb::arg("workspace").none() = nb::none(), nb::arg("uint16_as_bf16") = false, nb::arg("options"),
      "Calls dsaib::indexer_kl_forward: writes the loss (float32, shape ()), row_lse and row_target_mass\n"
      "(float32, one per query row) and, if given, index_score (P, float32, shaped like topk_indices).\n"
      "workspace as for indexer_backward.");

  m.def(
      "indexer_kl_loss_and_grad",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& loss, const OutArray& d_index_q, const OutArray& d_weights, const OutArray& d_index_k,
         const std::optional<Array>& grad_loss_device, const std::optional<nb::object>& workspace,
         bool uint16_as_bf16, bool out_uint16_as_bf16, const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, std::nullopt, cu_seqlens_q,
                                    cu_seqlens_k, uint16_as_bf16);
        const dsaib::IndexerKLLossAndGradOutputs out{to_view("loss", loss, false),
                                                     to_view("d_index_q", d_index_q, out_uint16_as_bf16),
                                                     to_view("d_weights", d_weights, out_uint16_as_bf16),
                                                     to_view("d_index_k", d_index_k, out_uint16_as_bf16)};
        auto opt = indexer_options().read(options);
        const std::string device = device_of(opt, index_q);
        if (grad_loss_device) opt.grad_loss_device = grad_loss_pointer(*grad_loss_device, device);
        PyWorkspace ws(workspace, device);
        call_library([&] { dsaib::indexer_kl_loss_and_grad(in, out, opt, ws.allocator()); });
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("loss"), nb::arg("d_index_q"),
      nb::arg("d_weights"), nb::arg("d_index_k"), nb::arg("grad_loss_device").none() = nb::none(),
      nb::arg("workspace").none() = nb::none(), nb::arg("uint16_as_bf16") = false,
      nb::arg("out_uint16_as_bf16") = false, nb::arg("options"),
      "Calls dsaib::indexer_kl_loss_and_grad: the loss (float32, shape ()) and d_index_q, d_weights, d_index_k\n"
      "in one call, without P. grad_loss_device and workspace as for indexer_backward.");

  m.def(
      "attention_target",
      [](const Array& query, const Array& kv, const std::optional<Array>& lse, const Array& topk_indices,
         const std::optional<Array>& cu_seqlens_q, const std::optional<Array>& cu_seqlens_k,
         const OutArray& attn_score, const std::optional<nb::object>& workspace, bool uint16_as_bf16,
         const nb::kwargs& options) {
        const auto in = make_target_inputs(query, kv, lse, topk_indices, cu_seqlens_q, cu_seqlens_k, uint16_as_bf16);
        const dsaib::AttentionTargetOutputs out{to_view("attn_score", attn_score, false)};
        const auto opt = target_options().read(options);
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
         const std::optional<nb::object>& workspace, bool uint16_as_bf16, const nb::kwargs& options) {
        const auto in = make_topk_inputs(index_q, weights, index_k, starts, ends, cu_seqlens_q, cu_seqlens_k,
                                         uint16_as_bf16);
        const auto out = make_topk_outputs(topk_indices, topk_logits, topk_lengths);
        const auto opt = topk_options().read(options);
        PyWorkspace ws(workspace, device_of(opt, index_q));
        const dsaib::WorkspaceAllocator allocator = ws.allocator();
        call_library([&] { dsaib::indexer_topk(in, out, opt, allocator); });
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("starts").none(), nb::arg("ends").none(),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("topk_indices"),
      nb::arg("topk_logits").none() = nb::none(), nb::arg("topk_lengths").none() = nb::none(),
      nb::arg("workspace").none() = nb::none(), nb::arg("uint16_as_bf16") = false, nb::arg("options"),
      "Calls dsaib::indexer_topk: writes topk_indices (int32, (B, S_q, topk) or (T_q, topk); -1 past each\n"
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
         bool uint16_as_bf16, const nb::kwargs& options) {
        const auto in = make_topk_inputs(index_q, weights, index_k, starts, ends, cu_seqlens_q, cu_seqlens_k,
                                         uint16_as_bf16);
        const auto out = make_topk_outputs(topk_indices, topk_logits, topk_lengths);
        const auto opt = topk_options().read(options);
        std::size_t bytes = 0;
        call_library([&] { bytes = dsaib::indexer_topk_workspace_size(in, out, opt); });
        return bytes;
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("starts").none(), nb::arg("ends").none(),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("topk_indices"),
      nb::arg("topk_logits").none() = nb::none(), nb::arg("topk_lengths").none() = nb::none(),
      nb::arg("uint16_as_bf16") = false, nb::arg("options"),
      "dsaib::indexer_topk_workspace_size: the bytes of scratch memory indexer_topk needs on the backend's\n"
      "device for these arguments (cpu: 0), after the same validation and with the same errors.");

  m.def(
      "validate_indexer_topk_inputs",
      [](const Array& index_q, const Array& weights, const Array& index_k, const std::optional<Array>& starts,
         const std::optional<Array>& ends, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, int64_t topk, bool uint16_as_bf16, const nb::kwargs& options) {
        const auto in = make_topk_inputs(index_q, weights, index_k, starts, ends, cu_seqlens_q, cu_seqlens_k,
                                         uint16_as_bf16);
        const auto opt = topk_options().read(options);
        call_library([&] { dsaib::validate_indexer_topk_inputs(in, topk, opt); });  // THD on cuda: reads cu_seqlens
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("starts").none() = nb::none(),
      nb::arg("ends").none() = nb::none(), nb::arg("cu_seqlens_q").none() = nb::none(),
      nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("topk"), nb::arg("uint16_as_bf16") = false,
      nb::arg("options"),
      "dsaib::validate_indexer_topk_inputs: indexer_topk's checks of the inputs and options for a selection\n"
      "of topk keys per row, without outputs and without computing anything (a context-parallel rank's\n"
      "check before the exchange of the keys).");

  m.def(
      "validate_indexer_kl_loss_inputs",
      [](const Array& index_q, const Array& weights, const Array& index_k, const Array& topk_indices,
         const Array& attn_score, const std::optional<Array>& index_score, const std::optional<Array>& cu_seqlens_q,
         const std::optional<Array>& cu_seqlens_k, const std::optional<Array>& row_lse,
         const std::optional<Array>& row_target_mass, bool uint16_as_bf16, const nb::kwargs& options) {
        const auto in = make_inputs(index_q, weights, index_k, topk_indices, attn_score, index_score,
                                    cu_seqlens_q, cu_seqlens_k, uint16_as_bf16, row_lse, row_target_mass);
        const auto opt = indexer_options().read(options);
        call_library([&] { dsaib::validate_indexer_kl_loss_inputs(in, opt); });  // THD on cuda: reads cu_seqlens
      },
      nb::arg("index_q"), nb::arg("weights"), nb::arg("index_k"), nb::arg("topk_indices"), nb::arg("attn_score"),
      nb::arg("index_score").none() = nb::none(), nb::arg("cu_seqlens_q").none() = nb::none(),
      nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("row_lse").none() = nb::none(),
      nb::arg("row_target_mass").none() = nb::none(), nb::arg("uint16_as_bf16") = false, nb::arg("options"),
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
        const auto opt = indexer_options().read(options);  // the library takes cpu tensors here, whatever `backend` says
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
