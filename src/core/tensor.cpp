#include <limits>
#include <sstream>

#include "core/option_words.hpp"
#include "dsaib/error.hpp"
#include "dsaib/host_tensor.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/tensor.hpp"

namespace dsaib {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::bf16: return 2;
    case DType::f32: return 4;
    case DType::i32: return 4;
    case DType::f64: return 8;
    case DType::e4m3: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::i32: return "i32";
    case DType::f64: return "f64";
    case DType::e4m3: return "e4m3";
  }
  return "unknown-dtype";
}

const char* device_name(DeviceType device) {
  switch (device) {
    case DeviceType::cpu: return "cpu";
    case DeviceType::cuda: return "cuda";
  }
  return "unknown-device";
}

const char* layout_name(Layout l) { return l == Layout::bshd ? "bshd" : "thd"; }
const char* id_mode_name(IdMode m) { return m == IdMode::local ? "local" : "global"; }
const char* backend_name(Backend b) { return b == Backend::cpu ? "cpu" : "cuda"; }

const char* a_operand_precision_name(AOperandPrecision a) {
  switch (a) {
    case AOperandPrecision::automatic: return "auto";
    case AOperandPrecision::bf16x2: return "bf16x2";
    case AOperandPrecision::bf16: return "bf16";
  }
  return "invalid";
}

bool parse_a_operand_precision(const std::string& word, AOperandPrecision* out) {
  return detail::parse_option_word(word, {AOperandPrecision::automatic, AOperandPrecision::bf16x2, AOperandPrecision::bf16}, a_operand_precision_name, out);
}

const char* l2_hints_name(L2Hints h) {
  switch (h) {
    case L2Hints::automatic: return "auto";
    case L2Hints::on: return "on";
    case L2Hints::off: return "off";
  }
  return "invalid";
}

bool parse_l2_hints(const std::string& word, L2Hints* out) {
  return detail::parse_option_word(word, {L2Hints::automatic, L2Hints::on, L2Hints::off}, l2_hints_name, out);
}

const char* start_stagger_name(StartStagger s) {
  switch (s) {
    case StartStagger::automatic: return "auto";
    case StartStagger::off: return "off";
  }
  return "invalid";
}

bool parse_start_stagger(const std::string& word, StartStagger* out) {
  return detail::parse_option_word(word, {StartStagger::automatic, StartStagger::off}, start_stagger_name, out);
}

const char* forward_fusion_name(ForwardFusion f) {
  switch (f) {
    case ForwardFusion::automatic: return "auto";
    case ForwardFusion::off: return "off";
  }
  return "invalid";
}

bool parse_forward_fusion(const std::string& word, ForwardFusion* out) {
  return detail::parse_option_word(word, {ForwardFusion::automatic, ForwardFusion::off}, forward_fusion_name, out);
}

int64_t TensorView::numel() const {
  for (int i = 0; i < rank; ++i) {
    if (shape[i] == 0) return 0;  // before any product: other sizes may be huge
  }
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  // An empty tensor is contiguous whatever its strides (as in torch); this also
  // keeps contiguous_view(), which steps over size-0 dims as if they were 1, consistent.
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

static std::string tuple_string(const int64_t* v, int n) {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < n; ++i) s << (i ? ", " : "") << v[i];
  if (n == 1) s << ",";
  s << ")";
  return s.str();
}

std::string TensorView::shape_string() const { return tuple_string(shape, rank); }
std::string shape_string(const std::vector<int64_t>& shape) {
  return tuple_string(shape.data(), static_cast<int>(shape.size()));
}
std::string TensorView::strides_string() const { return tuple_string(strides, rank); }

TensorView contiguous_view(void* data, DType dtype, const int64_t* shape, int32_t rank,
                           DeviceType device, int32_t device_index) {
  if (rank < 0 || rank > kMaxRank) {
    throw Error(ErrorCode::invalid_argument, "rank",
                "rank: expected 0.." + std::to_string(kMaxRank) + ", got " + std::to_string(rank));
  }
  for (int32_t i = 0; i < rank; ++i) {
    if (shape[i] < 0) {
      throw Error(ErrorCode::invalid_argument, "shape",
                  "shape: expected sizes >= 0, got " + std::to_string(shape[i]) + " at dimension " + std::to_string(i));
    }
  }
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.rank = rank;
  v.device = device;
  v.device_index = device_index;
  // A zero-element view holds nothing to address: its strides saturate at
  // INT64_MAX instead of overflowing, whatever its other sizes.
  bool zero_elements = false;
  for (int32_t i = 0; i < rank; ++i) zero_elements = zero_elements || shape[i] == 0;
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    v.shape[i] = shape[i];
    v.strides[i] = stride;
    if (__builtin_mul_overflow(stride, shape[i] > 0 ? shape[i] : 1, &stride)) {
      if (zero_elements) {
        stride = std::numeric_limits<int64_t>::max();
        continue;
      }
      throw Error(ErrorCode::invalid_argument, "shape",
                  "shape: expected an element count below 2^63, got sizes that overflow it at dimension " +
                      std::to_string(i));
    }
  }
  return v;
}

TensorView contiguous_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                           DeviceType device, int32_t device_index) {
  return contiguous_view(data, dtype, shape.begin(), static_cast<int32_t>(shape.size()), device,
                         device_index);
}

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::ok: return "ok";
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::index_out_of_range: return "index_out_of_range";
    case ErrorCode::backend_unavailable: return "backend_unavailable";
    case ErrorCode::cuda_error: return "cuda_error";
    case ErrorCode::io_error: return "io_error";
    case ErrorCode::internal: return "internal";
    case ErrorCode::out_of_memory: return "out_of_memory";
  }
  return "unknown";
}

Error::Error(ErrorCode code, std::string argument, const std::string& message)
    : std::runtime_error(message), code_(code), argument_(std::move(argument)) {}

}  // namespace dsaib
