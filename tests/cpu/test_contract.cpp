// The argument contract of dsaib::indexer_backward (docs/errors.md) with
// backend cpu: every bad input gives a dsaib::Error with the right code, whose
// argument() and message name the argument, whose message says "expected ...,
// got ...", and after which every input and output buffer (outputs pre-filled
// with a byte pattern) is bitwise unchanged. indexer_backward_workspace_size()
// must raise the same error.
//
// Each case mutates views/options of a small valid problem; buffers the views
// need (misaligned copies, bad cu_seqlens, ...) are extra buffers that are
// snapshotted too.
#include <gtest/gtest.h>

#include <cctype>
#include <climits>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <tuple>

#include <sys/mman.h>
#include <unistd.h>

#include "core/problem.hpp"
#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Env {
  GeneratedProblem p;
  OutputBuffers o;
  std::deque<HostTensor> extra;  // stable addresses
  IndexerInputs in;
  IndexerBackwardOutputs out;
  IndexerOptions opt;

  /// An extra zeroed buffer of at least `bytes` bytes (16-byte aligned storage).
  unsigned char* buffer(size_t bytes) {
    extra.emplace_back(DType::f32, std::vector<int64_t>{static_cast<int64_t>((bytes + 3) / 4 + 4)});
    return extra.back().bytes.data();
  }
  /// A copy of `v`'s contiguous data, `byte_offset` bytes into a fresh buffer.
  TensorView shifted(const TensorView& v, size_t byte_offset) {
    const size_t n = static_cast<size_t>(v.numel()) * dtype_size(v.dtype);
    unsigned char* b = buffer(n + byte_offset + 16);
    if (n) std::memcpy(b + byte_offset, v.data, n);
    TensorView w = v;
    w.data = b + byte_offset;
    return w;
  }
  /// A contiguous zero tensor view of the given dtype and shape in an extra buffer.
  TensorView zeros(DType dt, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return contiguous_view(buffer(static_cast<size_t>(n) * dtype_size(dt)), dt, shape);
  }
  /// An i32 vector in an extra buffer.
  TensorView ints(std::initializer_list<int32_t> values) {
    auto* b = reinterpret_cast<int32_t*>(buffer(values.size() * 4));
    std::copy(values.begin(), values.end(), b);
    return contiguous_view(b, DType::i32, {static_cast<int64_t>(values.size())});
  }
};

/// BSHD: B2, S_q 6, S_kv 9, H8, D64, topk 5. THD: sequences q {2, 5}, k {3, 6}.
/// Outputs f32, pre-filled with 0xA5 bytes.
std::unique_ptr<Env> make_env(Layout layout) {
  auto env = std::make_unique<Env>();
  GenerateSpec s = small_spec(51);
  s.layout = layout;
  s.s_q = 6;
  s.s_kv = 9;
  s.topk = 5;
  s.seqlens_q = {2, 5};
  s.seqlens_k = {3, 6};
  s.ids = IdPattern::random_permutation;
  env->p = make_problem(s);
  env->o = make_outputs(env->p);
  for (HostTensor* t : {&env->o.d_index_q, &env->o.d_weights, &env->o.d_index_k}) {
    std::fill(t->bytes.begin(), t->bytes.end(), 0xA5);
  }
  env->in = env->p.inputs();
  env->out = env->o.views();
  env->opt = env->p.options();
  env->opt.num_threads = 1;
  return env;
}

using Mutate = std::function<void(Env&)>;

struct Case {
  std::string name;
  Layout layout;
  std::string argument;
  Mutate mutate;
  ErrorCode code = ErrorCode::invalid_argument;
};

std::vector<Case>& cases() {
  static std::vector<Case> c;
  return c;
}

void add(const std::string& name, Layout layout, const std::string& arg, Mutate m,
         ErrorCode code = ErrorCode::invalid_argument) {
  cases().push_back({name, layout, arg, std::move(m), code});
}
void add_both(const std::string& name, const std::string& arg, const Mutate& m,
              ErrorCode code = ErrorCode::invalid_argument) {
  add(name + "_bshd", Layout::bshd, arg, m, code);
  add(name + "_thd", Layout::thd, arg, m, code);
}

// Accessors by name, so cases can be generated for every tensor.
const char* const kInputNames[] = {"index_q", "weights", "index_k", "topk_indices", "attn_score", "index_score"};
const char* const kOutputNames[] = {"d_index_q", "d_weights", "d_index_k"};
TensorView& view_of(Env& e, const std::string& n) {
  if (n == "index_q") return e.in.index_q;
  if (n == "weights") return e.in.weights;
  if (n == "index_k") return e.in.index_k;
  if (n == "topk_indices") return e.in.topk_indices;
  if (n == "attn_score") return e.in.attn_score;
  if (n == "index_score") return e.in.index_score;
  if (n == "cu_seqlens_q") return e.in.cu_seqlens_q;
  if (n == "cu_seqlens_k") return e.in.cu_seqlens_k;
  if (n == "d_index_q") return e.out.d_index_q;
  if (n == "d_weights") return e.out.d_weights;
  return e.out.d_index_k;
}
DType wrong_dtype(const std::string& n) {
  if (n == "topk_indices" || n == "cu_seqlens_q" || n == "cu_seqlens_k") return DType::f32;
  if (n == "attn_score" || n == "index_score") return DType::bf16;
  if (n == "index_q" || n == "index_k") return DType::f32;
  return DType::i32;  // weights and outputs accept bf16 and f32
}

void register_cases() {
  std::vector<std::string> tensors(std::begin(kInputNames), std::end(kInputNames));
  tensors.insert(tensors.end(), std::begin(kOutputNames), std::end(kOutputNames));

  for (const std::string& n : tensors) {
    // dtype, rank (one less, one more, out of range), absent, null, negative size and stride.
    add_both("dtype_" + n, n, [n](Env& e) { view_of(e, n).dtype = wrong_dtype(n); });
    add_both("dtype_enum_" + n, n, [n](Env& e) { view_of(e, n).dtype = static_cast<DType>(7); });
    add_both("rank_minus_" + n, n, [n](Env& e) { view_of(e, n).rank -= 1; });
    add_both("rank_plus_" + n, n, [n](Env& e) {
      TensorView& v = view_of(e, n);
      if (v.rank < kMaxRank) {
        v.shape[v.rank] = 1;
        v.strides[v.rank] = 1;
        v.rank += 1;
      } else {
        v.rank = 3;
      }
    });
    add_both("rank_5_" + n, n, [n](Env& e) { view_of(e, n).rank = 5; });
    add_both("rank_negative_" + n, n, [n](Env& e) { view_of(e, n).rank = -1; });
    add_both("absent_" + n, n, [n](Env& e) { view_of(e, n) = TensorView{}; });
    add_both("null_" + n, n, [n](Env& e) { view_of(e, n).data = nullptr; });
    add_both("negative_size_" + n, n, [n](Env& e) { view_of(e, n).shape[0] = -1; });
    add_both("negative_stride_" + n, n, [n](Env& e) {
      TensorView& v = view_of(e, n);
      v.strides[v.rank - 1] = -1;
    });
    add_both("device_cuda_" + n, n, [n](Env& e) { view_of(e, n).device = DeviceType::cuda; });
    // Host memory has device index 0 (DLPack's for kDLCPU); any other is a bad view.
    add_both("device_index_cpu_" + n, n, [n](Env& e) { view_of(e, n).device_index = -5; });
    add_both("device_index_cpu_one_" + n, n, [n](Env& e) { view_of(e, n).device_index = 1; });
    // Misaligned: one byte off for 2-byte types, two bytes off for 4-byte ones.
    add_both("misaligned_" + n, n, [n](Env& e) {
      TensorView& v = view_of(e, n);
      v = e.shifted(v, dtype_size(v.dtype) / 2);
    });
  }
  // cu_seqlens views in THD.
  for (const std::string n : {"cu_seqlens_q", "cu_seqlens_k"}) {
    add("dtype_" + n, Layout::thd, n, [n](Env& e) { view_of(e, n).dtype = DType::f32; });
    add("rank_2_" + n, Layout::thd, n, [n](Env& e) {
      TensorView& v = view_of(e, n);
      v.rank = 2;
      v.shape[1] = 1;
      v.strides[1] = 1;
    });
    add("rank_5_" + n, Layout::thd, n, [n](Env& e) { view_of(e, n).rank = 5; });
    add("absent_" + n, Layout::thd, n, [n](Env& e) { view_of(e, n) = TensorView{}; });
    add("null_" + n, Layout::thd, n, [n](Env& e) { view_of(e, n).data = nullptr; });
    add("negative_size_" + n, Layout::thd, n, [n](Env& e) { view_of(e, n).shape[0] = -1; });
    add("misaligned_" + n, Layout::thd, n, [n](Env& e) { view_of(e, n) = e.shifted(view_of(e, n), 2); });
    add("present_for_bshd_" + n, Layout::bshd, n, [n](Env& e) { view_of(e, n) = e.ints({0, 6, 12}); });
  }

  // Shapes (BSHD: B2 S_q6 S_kv9 H8 D64 K5). Only shrinking changes, so a view
  // never covers more than its buffer.
  add("shape_weights_S", Layout::bshd, "weights", [](Env& e) { e.in.weights.shape[1] = 5; });
  add("shape_weights_B", Layout::bshd, "weights", [](Env& e) { e.in.weights.shape[0] = 1; });
  add("shape_index_k_B", Layout::bshd, "index_k", [](Env& e) { e.in.index_k.shape[0] = 1; });
  add("shape_index_k_D", Layout::bshd, "index_k", [](Env& e) { e.in.index_k.shape[2] = 32; });
  add("shape_topk_S", Layout::bshd, "topk_indices", [](Env& e) { e.in.topk_indices.shape[1] = 5; });
  add("shape_topk_B", Layout::bshd, "topk_indices", [](Env& e) { e.in.topk_indices.shape[0] = 1; });
  add("shape_attn_K", Layout::bshd, "attn_score", [](Env& e) { e.in.attn_score.shape[2] = 4; });
  add("shape_attn_S", Layout::bshd, "attn_score", [](Env& e) { e.in.attn_score.shape[1] = 1; });
  add("shape_index_score_K", Layout::bshd, "index_score", [](Env& e) { e.in.index_score.shape[2] = 4; });
  add("shape_d_index_q_S", Layout::bshd, "d_index_q", [](Env& e) { e.out.d_index_q.shape[1] = 5; });
  add("shape_d_index_q_D", Layout::bshd, "d_index_q", [](Env& e) { e.out.d_index_q.shape[3] = 32; });
  add("shape_d_weights_S", Layout::bshd, "d_weights", [](Env& e) { e.out.d_weights.shape[1] = 5; });
  add("shape_d_index_k_S", Layout::bshd, "d_index_k", [](Env& e) { e.out.d_index_k.shape[1] = 8; });
  add("shape_weights_T", Layout::thd, "weights", [](Env& e) { e.in.weights.shape[0] = 6; });
  add("shape_index_k_D_thd", Layout::thd, "index_k", [](Env& e) { e.in.index_k.shape[1] = 32; });
  add("shape_topk_T", Layout::thd, "topk_indices", [](Env& e) { e.in.topk_indices.shape[0] = 6; });
  add("shape_index_score_K_thd", Layout::thd, "index_score", [](Env& e) { e.in.index_score.shape[1] = 4; });
  add("shape_d_index_k_T", Layout::thd, "d_index_k", [](Env& e) { e.out.d_index_k.shape[0] = 8; });
  add("shape_d_weights_T", Layout::thd, "d_weights", [](Env& e) { e.out.d_weights.shape[0] = 6; });

  // Supported sizes: H a multiple of 8 in [8, 128], D in {64, 128}, topk >= 1.
  for (int64_t H : {0, 4, 12, 136}) {
    add("heads_" + std::to_string(H), Layout::bshd, "index_q", [H](Env& e) {
      e.in.index_q = e.zeros(DType::bf16, {2, 6, H, 64});
      e.in.weights = e.zeros(DType::bf16, {2, 6, H});
      e.out.d_index_q = e.zeros(DType::f32, {2, 6, H, 64});
      e.out.d_weights = e.zeros(DType::f32, {2, 6, H});
    });
  }
  for (int64_t D : {0, 32, 96, 256}) {
    add("head_dim_" + std::to_string(D), Layout::thd, "index_q", [D](Env& e) {
      e.in.index_q = e.zeros(DType::bf16, {7, 8, D});
      e.in.index_k = e.zeros(DType::bf16, {9, D});
      e.out.d_index_q = e.zeros(DType::f32, {7, 8, D});
      e.out.d_index_k = e.zeros(DType::f32, {9, D});
    });
  }
  add_both("topk_0", "topk_indices", [](Env& e) {
    for (TensorView* v : {&e.in.topk_indices, &e.in.attn_score, &e.in.index_score}) v->shape[v->rank - 1] = 0;
  });

  // Non-contiguous outputs (valid memory, wrong layout).
  add("noncontiguous_d_index_q", Layout::bshd, "d_index_q", [](Env& e) {
    StridedCopy c = strided_copy(e.o.d_index_q, {1, 1, 1, 2}, {0, 0, 0, 0});  // every other element
    e.extra.push_back(std::move(c.storage));
    c.view.data = e.extra.back().bytes.data();
    e.out.d_index_q = c.view;
  });
  add("noncontiguous_d_weights_transposed", Layout::thd, "d_weights", [](Env& e) {
    std::swap(e.out.d_weights.strides[0], e.out.d_weights.strides[1]);
    e.out.d_weights.strides[0] = 1;
    e.out.d_weights.strides[1] = 7;
  });
  add("noncontiguous_d_index_k_padded_rows", Layout::bshd, "d_index_k", [](Env& e) {
    TensorView v = e.out.d_index_k;
    v.data = e.buffer(2 * 10 * 64 * 4);
    v.strides[1] = 64;
    v.strides[0] = 10 * 64;
    e.out.d_index_k = v;
  });
  add("broadcast_d_weights_stride0", Layout::bshd, "d_weights", [](Env& e) { e.out.d_weights.strides[0] = 0; });

  // Overlaps: outputs with each other and with inputs (inside one extra buffer,
  // so a wrongly accepted case cannot write outside memory this test owns).
  add("overlap_dq_dk_same_pointer", Layout::bshd, "d_index_q", [](Env& e) {
    e.out.d_index_k.data = e.out.d_index_q.data;
  });
  add("overlap_dw_tail_of_dq", Layout::bshd, "d_index_q", [](Env& e) {
    const int64_t nq = e.out.d_index_q.numel(), nw = e.out.d_weights.numel();
    auto* b = reinterpret_cast<float*>(e.buffer((nq + nw) * 4));
    e.out.d_index_q.data = b;
    e.out.d_weights.data = b + nq - 1;  // one element shared
  });
  add("overlap_d_weights_is_weights", Layout::bshd, "d_weights", [](Env& e) {
    e.out.d_weights.data = e.in.weights.data;  // bf16 output over the bf16 input
    e.out.d_weights.dtype = DType::bf16;
  });
  add("overlap_d_index_q_inside_index_score", Layout::thd, "d_index_q", [](Env& e) {
    const int64_t ns = e.in.index_score.numel(), nq = e.out.d_index_q.numel();
    auto* b = reinterpret_cast<float*>(e.buffer((ns + nq) * 4));
    std::memcpy(b, e.in.index_score.data, ns * 4);
    e.in.index_score.data = b;
    e.out.d_index_q.data = b + ns / 2;
  });
  add("overlap_d_index_k_over_cu_seqlens_k", Layout::thd, "d_index_k", [](Env& e) {
    const int64_t nk = e.out.d_index_k.numel();
    auto* b = reinterpret_cast<int32_t*>(e.buffer((nk + 3) * 4));
    std::memcpy(b + nk, e.in.cu_seqlens_k.data, 12);
    e.in.cu_seqlens_k.data = b + nk;
    e.out.d_index_k.data = b + 2;
  });
  add("overlap_d_index_k_over_topk_indices", Layout::bshd, "d_index_k", [](Env& e) {
    const int64_t nk = e.out.d_index_k.numel(), ni = e.in.topk_indices.numel();
    auto* b = reinterpret_cast<int32_t*>(e.buffer((nk + ni) * 4));
    std::memcpy(b + nk - 1, e.in.topk_indices.data, ni * 4);
    e.in.topk_indices.data = b + nk - 1;
    e.out.d_index_k.data = b;
  });

  // Scalars.
  for (float bad : {kNaN, kInf, -kInf}) {
    const std::string tag = std::isnan(bad) ? "nan" : bad > 0 ? "inf" : "minus_inf";
    add_both("sm_scale_" + tag, "sm_scale", [bad](Env& e) { e.opt.sm_scale = bad; });
    add_both("loss_coeff_" + tag, "loss_coeff", [bad](Env& e) { e.opt.loss_coeff = bad; });
    add_both("grad_loss_" + tag, "grad_loss", [bad](Env& e) { e.opt.grad_loss = bad; });
    // cpu: the host scalar behind grad_loss_device is checked like grad_loss.
    add("grad_loss_device_" + tag, Layout::bshd, "grad_loss_device", [bad](Env& e) {
      auto* f = reinterpret_cast<float*>(e.buffer(4));
      *f = bad;
      e.opt.grad_loss_device = f;
    });
  }
  // grad_loss_device is an input: an output over it is rejected like any overlap
  // (the cuda kernel reads it while the outputs are written).
  add("overlap_d_index_q_over_grad_loss_device", Layout::bshd, "d_index_q", [](Env& e) {
    e.opt.grad_loss_device = static_cast<const float*>(e.out.d_index_q.data) + 3;
  });
  add("grad_loss_device_misaligned", Layout::bshd, "grad_loss_device", [](Env& e) {
    e.opt.grad_loss_device = reinterpret_cast<const float*>(e.buffer(8) + 2);
  });
  add("normalization_count_negative", Layout::bshd, "normalization_count", [](Env& e) { e.opt.normalization_count = -1; });
  add("num_threads_negative", Layout::thd, "num_threads", [](Env& e) { e.opt.num_threads = -2; });
  add("layout_enum", Layout::bshd, "layout", [](Env& e) { e.opt.layout = static_cast<Layout>(7); });
  add("id_mode_enum", Layout::bshd, "id_mode", [](Env& e) { e.opt.id_mode = static_cast<IdMode>(-1); });
  add("backend_enum", Layout::bshd, "backend", [](Env& e) { e.opt.backend = static_cast<Backend>(5); });
  add("a_operand_precision_enum", Layout::bshd, "a_operand_precision",
      [](Env& e) { e.opt.a_operand_precision = static_cast<AOperandPrecision>(3); });
  add("l2_hints_enum", Layout::bshd, "l2_hints", [](Env& e) { e.opt.l2_hints = static_cast<L2Hints>(3); });
  add("l2_hints_negative", Layout::bshd, "l2_hints", [](Env& e) { e.opt.l2_hints = static_cast<L2Hints>(-1); });
  add("start_stagger_enum", Layout::bshd, "start_stagger",
      [](Env& e) { e.opt.start_stagger = static_cast<StartStagger>(2); });
  add("forward_fusion_enum", Layout::bshd, "forward_fusion",
      [](Env& e) { e.opt.forward_fusion = static_cast<ForwardFusion>(-1); });
  add("layout_thd_given_bshd_tensors", Layout::bshd, "index_q", [](Env& e) { e.opt.layout = Layout::thd; });
  add("layout_bshd_given_thd_tensors", Layout::thd, "index_q", [](Env& e) { e.opt.layout = Layout::bshd; });

  // cu_seqlens values (THD: q {0, 2, 7}, k {0, 3, 9}).
  add("cu_seqlens_q_not_monotone", Layout::thd, "cu_seqlens_q", [](Env& e) { e.in.cu_seqlens_q = e.ints({0, 8, 7}); });
  add("cu_seqlens_k_not_monotone", Layout::thd, "cu_seqlens_k", [](Env& e) { e.in.cu_seqlens_k = e.ints({0, 10, 9}); });
  add("cu_seqlens_q_not_ending_at_total", Layout::thd, "cu_seqlens_q", [](Env& e) { e.in.cu_seqlens_q = e.ints({0, 2, 6}); });
  add("cu_seqlens_k_past_total", Layout::thd, "cu_seqlens_k", [](Env& e) { e.in.cu_seqlens_k = e.ints({0, 3, 10}); });
  add("cu_seqlens_q_not_starting_at_0", Layout::thd, "cu_seqlens_q", [](Env& e) { e.in.cu_seqlens_q = e.ints({1, 2, 7}); });
  add("cu_seqlens_k_negative_start", Layout::thd, "cu_seqlens_k", [](Env& e) { e.in.cu_seqlens_k = e.ints({-1, 3, 9}); });
  add("cu_seqlens_k_wrong_length", Layout::thd, "cu_seqlens_k", [](Env& e) { e.in.cu_seqlens_k = e.ints({0, 3, 9, 9}); });
  add("cu_seqlens_q_length_0", Layout::thd, "cu_seqlens_q", [](Env& e) {
    e.in.cu_seqlens_q.shape[0] = 0;
    e.in.cu_seqlens_k.shape[0] = 0;
  });
  add("cu_seqlens_q_int_overflow_values", Layout::thd, "cu_seqlens_q", [](Env& e) {
    e.in.cu_seqlens_q = e.ints({0, INT_MAX, 7});
  });

  // Backends.
  if (!cuda_backend_available()) {
    add_both("backend_cuda_unavailable", "backend", [](Env& e) { e.opt.backend = Backend::cuda; },
             ErrorCode::backend_unavailable);
    // errors.md's order: the option values come before the backend's availability.
    add_both("layout_before_backend_availability", "layout", [](Env& e) {
      e.opt.backend = Backend::cuda;
      e.opt.layout = static_cast<Layout>(7);
    });
    add_both("id_mode_before_backend_availability", "id_mode", [](Env& e) {
      e.opt.backend = Backend::cuda;
      e.opt.id_mode = static_cast<IdMode>(5);
    });
  }
}

std::string sanitize(std::string s) {
  for (char& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return s;
}

class Contract : public ::testing::TestWithParam<size_t> {};

void expect_error(const std::function<void()>& call, const Case& c, const char* entry) {
  SCOPED_TRACE(entry);
  try {
    call();
    ADD_FAILURE() << "no error raised; expected " << error_code_name(c.code) << " naming '" << c.argument << "'";
  } catch (const Error& err) {
    const std::string msg = err.what();
    EXPECT_EQ(error_code_name(err.code()), std::string(error_code_name(c.code))) << msg;
    EXPECT_EQ(err.argument(), c.argument) << msg;
    EXPECT_EQ(msg.rfind(c.argument, 0), 0u) << "message should start with the argument: " << msg;
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
    EXPECT_NE(msg.find("got"), std::string::npos) << msg;
    EXPECT_LT(msg.find("expected"), msg.rfind("got")) << msg;
  } catch (const std::exception& other) {
    ADD_FAILURE() << "not a dsaib::Error: " << other.what();
  }
}

TEST_P(Contract, RejectsAndTouchesNothing) {
  const Case& c = cases()[GetParam()];
  std::unique_ptr<Env> env = make_env(c.layout);
  c.mutate(*env);
  const SnapshotAll snap(env->p, env->o);
  std::vector<Snapshot> extra_snaps;
  for (const HostTensor& t : env->extra) extra_snaps.emplace_back(t);

  expect_error([&] { indexer_backward(env->in, env->out, env->opt); }, c, "indexer_backward");
  expect_error([&] { (void)indexer_backward_workspace_size(env->in, env->out, env->opt); }, c,
               "indexer_backward_workspace_size");
  EXPECT_EQ(snap.changed(), "") << "buffers changed by a failing call";
  for (size_t i = 0; i < extra_snaps.size(); ++i) EXPECT_TRUE(extra_snaps[i].unchanged()) << "extra buffer " << i;
}

INSTANTIATE_TEST_SUITE_P(Cases, Contract, ::testing::Range<size_t>(0, [] {
                           register_cases();
                           return cases().size();
                         }()),
                         [](const ::testing::TestParamInfo<size_t>& info) { return sanitize(cases()[info.param].name); });

// topk comes from topk_indices: when the scores disagree with it, the message says so.
TEST(Messages, ScoresAgainstTopkOfTopkIndices) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    std::unique_ptr<Env> env = make_env(layout);
    TensorView& ids = env->in.topk_indices;
    ids.shape[ids.rank - 1] -= 1;
    try {
      indexer_backward(env->in, env->out, env->opt);
      ADD_FAILURE() << "no error raised";
    } catch (const Error& err) {
      EXPECT_EQ(err.argument(), "attn_score") << err.what();
      EXPECT_NE(std::string(err.what()).find("topk from topk_indices"), std::string::npos) << err.what();
    }
  }
}

// A DType value outside the enum is reported by its number, not as a name.
TEST(Messages, UnknownDtypeValueByNumber) {
  std::unique_ptr<Env> env = make_env(Layout::bshd);
  env->in.index_q.dtype = static_cast<DType>(9);
  try {
    indexer_backward(env->in, env->out, env->opt);
    ADD_FAILURE() << "no error raised";
  } catch (const Error& err) {
    EXPECT_STREQ(err.what(), "index_q: expected dtype bf16, got an unknown DType value 9");
  }
}

// ---- strict mode ------------------------------------------------------------

TEST(Strict, ReportsFirstOffendingSlot) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    for (IdMode mode : {IdMode::local, IdMode::global}) {
      std::unique_ptr<Env> env = make_env(layout);
      GeneratedProblem& p = env->p;
      p = with_id_mode(p, mode);
      env->in = p.inputs();
      env->opt = p.options();
      env->opt.strict_indices = true;
      // -1 anywhere is fine; the first invalid non -1 id is (row 4, slot 2).
      set_id(p, 0, 0, -1);
      set_id(p, 3, 4, -1);
      const bool thd = layout == Layout::thd;
      // Row 4: BSHD (b=0, t=4), THD (b=1, t=2). Key count of that sequence: 9 resp. 6.
      const int32_t bad = mode == IdMode::local ? (thd ? 6 : 9) : (thd ? 0 : 9 + 9);
      set_id(p, 4, 2, bad);
      set_id(p, 5, 1, -7);  // later: not reported
      const SnapshotAll snap(p, env->o);
      try {
        indexer_backward(env->in, env->out, env->opt);
        ADD_FAILURE() << "no error";
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_EQ(e.code(), ErrorCode::index_out_of_range) << msg;
        EXPECT_EQ(e.argument(), "topk_indices");
        const std::string where = thd ? "(b=1, t=2, slot=2)" : "(b=0, t=4, slot=2)";
        EXPECT_NE(msg.find(where), std::string::npos) << msg;
        EXPECT_NE(msg.find("got id " + std::to_string(bad)), std::string::npos) << msg;
        EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
        EXPECT_NE(msg.find(id_mode_name(mode)), std::string::npos) << msg;
      }
      EXPECT_EQ(snap.changed(), "");
    }
  }
}

TEST(Strict, MinusOneAllowedAndSameResult) {
  std::unique_ptr<Env> env = make_env(Layout::bshd);
  invalidate_run(env->p, 3, Where::middle, 2);
  invalidate_row(env->p, 7);
  refresh_scores(env->p);
  IndexerOptions strict = env->opt;
  strict.strict_indices = true;
  const OutputBuffers a = run_cpu(env->p, env->opt), b = run_cpu(env->p, strict);
  EXPECT_TRUE(bitwise_equal(a.d_index_q, b.d_index_q));
  EXPECT_TRUE(bitwise_equal(a.d_weights, b.d_weights));
  EXPECT_TRUE(bitwise_equal(a.d_index_k, b.d_index_k));
}

// ---- strided views are read element by element, never across their gaps --------

/// Host memory in which whole pages can be made unreadable: `pages` pages, of
/// which those in `holes` are PROT_NONE. Unmapped on destruction.
struct GuardedPages {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t bytes = 0;
  unsigned char* base = nullptr;
  GuardedPages(size_t pages, std::initializer_list<size_t> holes) : bytes(pages * page) {
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return;
    base = static_cast<unsigned char*>(m);
    for (size_t h : holes) {
      if (mprotect(base + h * page, page, PROT_NONE) != 0) {
        munmap(base, bytes);
        base = nullptr;
        return;
      }
    }
  }
  ~GuardedPages() {
    if (base) munmap(base, bytes);
  }
  int32_t* at_page(size_t i) const { return reinterpret_cast<int32_t*>(base + i * page); }
};

/// Strict ids (BSHD) whose two batches sit on readable pages with an unreadable
/// page between them: the view's byte span crosses the hole, its elements do not.
/// Validation read the whole span once (a crash here); the result must equal that
/// of the contiguous ids.
TEST(StridedViews, StrictIdsAcrossAnUnreadablePage) {
  std::unique_ptr<Env> env = make_env(Layout::bshd);
  const TensorView& ids = env->in.topk_indices;  // (2, 6, 5), contiguous
  GuardedPages mem(3, {1});
  ASSERT_NE(mem.base, nullptr);
  const int64_t per_batch = ids.shape[1] * ids.shape[2];
  std::memcpy(mem.at_page(0), ids.data, static_cast<size_t>(per_batch) * 4);
  std::memcpy(mem.at_page(2), static_cast<const int32_t*>(ids.data) + per_batch, static_cast<size_t>(per_batch) * 4);
  IndexerInputs in = env->in;
  in.topk_indices.data = mem.at_page(0);
  in.topk_indices.strides[0] = static_cast<int64_t>(2 * mem.page / 4);
  IndexerOptions strict = env->opt;
  strict.strict_indices = true;
  const OutputBuffers want = run_cpu(env->p, env->opt);
  OutputBuffers got = make_outputs(env->p);
  indexer_backward(in, got.views(), strict);
  EXPECT_TRUE(bitwise_equal(want.d_index_q, got.d_index_q));
  EXPECT_TRUE(bitwise_equal(want.d_weights, got.d_weights));
  EXPECT_TRUE(bitwise_equal(want.d_index_k, got.d_index_k));
}

/// THD cu_seqlens with one element per readable page, unreadable pages between.
TEST(StridedViews, CuSeqlensAcrossUnreadablePages) {
  std::unique_ptr<Env> env = make_env(Layout::thd);
  GuardedPages mem(10, {1, 3, 6, 8});
  ASSERT_NE(mem.base, nullptr);
  const int64_t stride = static_cast<int64_t>(2 * mem.page / 4);
  IndexerInputs in = env->in;
  for (auto [view, first_page] : {std::pair{&in.cu_seqlens_q, size_t{0}}, std::pair{&in.cu_seqlens_k, size_t{5}}}) {
    ASSERT_EQ(view->shape[0], 3);
    const auto* src = static_cast<const int32_t*>(view->data);
    for (int64_t i = 0; i < 3; ++i) *mem.at_page(first_page + 2 * static_cast<size_t>(i)) = src[i * view->strides[0]];
    view->data = mem.at_page(first_page);
    view->strides[0] = stride;
  }
  for (bool strict_ids : {false, true}) {
    IndexerOptions opt = env->opt;
    opt.strict_indices = strict_ids;
    const OutputBuffers want = run_cpu(env->p, opt);
    OutputBuffers got = make_outputs(env->p);
    indexer_backward(in, got.views(), opt);
    EXPECT_TRUE(bitwise_equal(want.d_index_q, got.d_index_q)) << "strict " << strict_ids;
    EXPECT_TRUE(bitwise_equal(want.d_weights, got.d_weights)) << "strict " << strict_ids;
    EXPECT_TRUE(bitwise_equal(want.d_index_k, got.d_index_k)) << "strict " << strict_ids;
  }
}

/// The copies validation makes from a backend's device memory (the cuda
/// backend's path), run here on host memory with a counting pitched memcpy:
/// strict ids whose batches are far apart (an unreadable page and more than
/// 1 MiB between them) are copied as one pitched copy of the batches, never
/// across the gap; packed ids in one piece; cu_seqlens of stride 1 in one piece, of
/// another stride as one pitched copy. The geometry and the verdict match the
/// in-place (cpu) reads.
struct CopyCount {
  static inline int calls = 0;
  static inline size_t bytes = 0;
  static inline int pitch_rule_breaks = 0;  // cudaMemcpy2D's rules: row_bytes <= src_pitch <= 2^31 - 1
  static void copy(void* dst, const void* src, size_t row_bytes, size_t src_pitch, size_t rows, void*) {
    ++calls;
    bytes += row_bytes * rows;
    if (rows > 1 && (src_pitch < row_bytes || src_pitch > static_cast<size_t>(INT32_MAX))) ++pitch_rule_breaks;
    for (size_t r = 0; r < rows; ++r) {
      std::memcpy(static_cast<unsigned char*>(dst) + r * row_bytes, static_cast<const unsigned char*>(src) + r * src_pitch,
                  row_bytes);
    }
  }
  static void reset() { calls = 0, bytes = 0, pitch_rule_breaks = 0; }
};

TEST(StridedViews, DeviceCopyPathReadsOnlyElements) {
  std::unique_ptr<Env> env = make_env(Layout::bshd);
  IndexerOptions strict = env->opt;
  strict.strict_indices = true;
  const size_t id_bytes = static_cast<size_t>(env->in.topk_indices.numel()) * 4;  // 2 x 6 x 5 ids
  // Packed: one copy of the ids' bytes.
  CopyCount::reset();
  (void)detail::validate_problem(env->in, env->out, strict, &CopyCount::copy);
  EXPECT_EQ(CopyCount::calls, 1);
  EXPECT_EQ(CopyCount::bytes, id_bytes);
  // Batches 2 MiB apart, an unreadable page right after batch 0's rows.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t gap_pages = (size_t{2} << 20) / page;
  GuardedPages mem(gap_pages + 1, {1});
  ASSERT_NE(mem.base, nullptr);
  const TensorView& ids = env->in.topk_indices;
  const int64_t per_batch = ids.shape[1] * ids.shape[2];
  std::memcpy(mem.at_page(0), ids.data, static_cast<size_t>(per_batch) * 4);
  std::memcpy(mem.at_page(gap_pages), static_cast<const int32_t*>(ids.data) + per_batch,
              static_cast<size_t>(per_batch) * 4);
  IndexerInputs in = env->in;
  in.topk_indices.data = mem.at_page(0);
  in.topk_indices.strides[0] = static_cast<int64_t>(gap_pages * page / 4);
  CopyCount::reset();
  (void)detail::validate_problem(in, env->out, strict, &CopyCount::copy);
  EXPECT_EQ(CopyCount::calls, 1);  // one pitched copy, a batch's packed rows per pitch
  EXPECT_EQ(CopyCount::bytes, id_bytes);
  // An out-of-range id in batch 1 is found through those copies.
  mem.at_page(gap_pages)[3 * 5 + 2] = 99;  // (b=1, t=3, slot=2)
  try {
    (void)detail::validate_problem(in, env->out, strict, &CopyCount::copy);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::index_out_of_range);
    EXPECT_NE(std::string(e.what()).find("(b=1, t=3, slot=2)"), std::string::npos) << e.what();
  }

  // THD cu_seqlens: stride 1 in one copy each; stride 2 one pitched copy each.
  std::unique_ptr<Env> thd = make_env(Layout::thd);
  CopyCount::reset();
  const detail::ProblemGeometry g1 = detail::validate_problem(thd->in, thd->out, thd->opt, &CopyCount::copy);
  EXPECT_EQ(CopyCount::calls, 2);
  EXPECT_EQ(CopyCount::bytes, size_t{24});
  IndexerInputs strided = thd->in;
  for (TensorView* v : {&strided.cu_seqlens_q, &strided.cu_seqlens_k}) {
    auto* b = reinterpret_cast<int32_t*>(thd->buffer(6 * 4));
    for (int i = 0; i < 3; ++i) b[2 * i] = static_cast<const int32_t*>(v->data)[i], b[2 * i + 1] = -5;
    v->data = b;
    v->strides[0] = 2;
  }
  CopyCount::reset();
  const detail::ProblemGeometry g2 = detail::validate_problem(strided, thd->out, thd->opt, &CopyCount::copy);
  EXPECT_EQ(CopyCount::calls, 2);
  EXPECT_EQ(CopyCount::bytes, size_t{24});
  EXPECT_EQ(g1.q_start, g2.q_start);
  EXPECT_EQ(g1.q_len, g2.q_len);
  EXPECT_EQ(g1.k_start, g2.k_start);
  EXPECT_EQ(g1.k_len, g2.k_len);
}

/// Strict mode finds the first bad id through every way validation reads the
/// ids: in place (cpu) and through the device copies (one piece, or pitched
/// groups), with padded rows, slots 2 apart, a broadcast (stride 0) query
/// dimension, and THD rows 3 MiB apart.
TEST(StridedViews, StrictFindsTheBadIdThroughEveryRead) {
  struct Layouts {
    const char* name;
    Layout layout;
    std::vector<int64_t> strides;  // of topk_indices, in elements
    int64_t bad_row, bad_slot;     // where the bad id goes (a flat query row)
    std::string where;             // what the message must name
    int copies;                    // device copies validation makes
  };
  const int64_t far = int64_t{3} << 18;  // 3 MiB of int32
  const std::vector<Layouts> cases = {
      {"bshd padded rows", Layout::bshd, {6 * 8, 8, 1}, 9, 4, "(b=1, t=3, slot=4)", 1},
      {"bshd slots 2 apart", Layout::bshd, {6 * 10, 10, 2}, 7, 1, "(b=1, t=1, slot=1)", 1},
      {"bshd broadcast over S", Layout::bshd, {5, 0, 1}, 6, 3, "(b=1, t=0, slot=3)", 1},
      {"bshd batches far apart", Layout::bshd, {far, 5, 1}, 8, 0, "(b=1, t=2, slot=0)", 1},
      {"bshd rows far apart, batches unevenly", Layout::bshd, {6 * far + 1024, far, 1}, 8, 0, "(b=1, t=2, slot=0)", 2},
      {"bshd rows far apart", Layout::bshd, {6 * far, far, 1}, 10, 2, "(b=1, t=4, slot=2)", 1},
      {"thd rows far apart", Layout::thd, {far, 1}, 5, 2, "(b=1, t=3, slot=2)", 2 + 1},
      {"thd padded rows", Layout::thd, {8, 1}, 6, 4, "(b=1, t=4, slot=4)", 2 + 1},
      // batches apart, rows overlapping within each (stride 0): a copy of each batch's span
      {"bshd batches far apart, broadcast over S", Layout::bshd, {far, 0, 1}, 6, 3, "(b=1, t=0, slot=3)", 1},
      // rows further apart than cudaMemcpy2D's pitch limit (2^31 - 1 bytes): one copy per row
      // (THD counts its two cu_seqlens copies too)
      {"thd rows 3 GiB apart", Layout::thd, {int64_t{3} << 28, 1}, 4, 1, "(b=1, t=2, slot=1)", 2 + 7},
  };
  for (const Layouts& c : cases) {
    SCOPED_TRACE(c.name);
    std::unique_ptr<Env> env = make_env(c.layout);
    TensorView ids = env->in.topk_indices;
    const bool thd = c.layout == Layout::thd;
    const int64_t rows = thd ? ids.shape[0] : ids.shape[0] * ids.shape[1], K = ids.shape[thd ? 1 : 2];
    const int64_t S = thd ? 1 : ids.shape[1];
    auto offset = [&](int64_t row, int64_t i) {
      return thd ? row * c.strides[0] + i * c.strides[1]
                 : (row / S) * c.strides[0] + (row % S) * c.strides[1] + i * c.strides[2];
    };
    const int64_t last = offset(rows - 1, K - 1);
    // Small views: readable throughout (their span is copied in one piece). Large
    // ones: reserved unreadable (PROT_NONE costs no commit charge, whatever the
    // overcommit policy) and only the pages holding ids made readable, so any read
    // between rows faults. A machine that cannot reserve the range skips the case.
    const size_t map_bytes = static_cast<size_t>(last + 1) * 4;
    const bool reserve_only = map_bytes > (size_t{64} << 20);
    void* m = mmap(nullptr, map_bytes, reserve_only ? PROT_NONE : PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      std::printf("[ skipped case ] %s: cannot reserve %zu bytes of address space\n", c.name, map_bytes);
      continue;
    }
    auto* mem = static_cast<int32_t*>(m);
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    auto writable = [&](int64_t element) {
      if (!reserve_only) return true;
      const auto addr = reinterpret_cast<std::uintptr_t>(mem + element) & ~(static_cast<std::uintptr_t>(page) - 1);
      return mprotect(reinterpret_cast<void*>(addr), page, PROT_READ | PROT_WRITE) == 0;
    };
    const auto* src = static_cast<const int32_t*>(ids.data);
    for (int64_t row = 0; row < rows; ++row) {  // broadcast rows: the last write wins; all rows are then valid ids
      for (int64_t i = 0; i < K; ++i) {
        ASSERT_TRUE(writable(offset(row, i)));
        mem[offset(row, i)] = src[row * K + i];
      }
    }
    mem[offset(c.bad_row, c.bad_slot)] = 1000;
    IndexerInputs in = env->in;
    in.topk_indices.data = mem;
    std::copy(c.strides.begin(), c.strides.end(), in.topk_indices.strides);
    IndexerOptions strict = env->opt;
    strict.strict_indices = true;
    for (bool device_copy : {false, true}) {
      SCOPED_TRACE(device_copy ? "device copy" : "in place");
      CopyCount::reset();
      try {
        (void)detail::validate_problem(in, env->out, strict, device_copy ? &CopyCount::copy : nullptr);
        ADD_FAILURE() << "no error";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::index_out_of_range) << e.what();
        EXPECT_NE(std::string(e.what()).find(c.where), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("got id 1000"), std::string::npos) << e.what();
      }
      // Never more than the ids' bytes twice plus 1 MiB copied (the one-piece rule),
      // and every pitched copy within cudaMemcpy2D's rules.
      if (device_copy) {
        EXPECT_LE(CopyCount::bytes, static_cast<size_t>(2 * rows * K * 4 + (1 << 20)));
        EXPECT_EQ(CopyCount::pitch_rule_breaks, 0);
        EXPECT_EQ(CopyCount::calls, c.copies);
      }
    }
    munmap(mem, map_bytes);
  }
}

/// Every view of a problem labelled as memory of cuda device `index` (host
/// memory: for validate_problem called directly, which reads no value of it
/// through the device before its checks).
void label_cuda(IndexerInputs& in, IndexerBackwardOutputs& out, int index) {
  for (TensorView* v : {&in.index_q, &in.weights, &in.index_k, &in.topk_indices, &in.attn_score, &in.index_score,
                        &in.cu_seqlens_q, &in.cu_seqlens_k, &out.d_index_q, &out.d_weights, &out.d_index_k}) {
    v->device = DeviceType::cuda;
    v->device_index = index;
  }
}

/// On cuda, cu_seqlens of stride 2 are refused before they are read
/// (validate_problem called directly with views labelled cuda, on host memory).
TEST(StridedViews, CudaRefusesStridedCuSeqlensBeforeReadingThem) {
  std::unique_ptr<Env> env = make_env(Layout::thd);
  IndexerInputs in = env->in;
  IndexerBackwardOutputs out = env->out;
  label_cuda(in, out, 0);
  auto* b = reinterpret_cast<int32_t*>(env->buffer(6 * 4));
  for (int i = 0; i < 3; ++i) b[2 * i] = static_cast<const int32_t*>(in.cu_seqlens_q.data)[i];
  in.cu_seqlens_q.data = b;
  in.cu_seqlens_q.strides[0] = 2;
  IndexerOptions opt = env->opt;
  opt.backend = Backend::cuda;
  CopyCount::reset();
  try {
    (void)detail::validate_problem(in, out, opt, &CopyCount::copy);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_EQ(e.argument(), "cu_seqlens_q") << e.what();
    EXPECT_STREQ(e.what(), "cu_seqlens_q: expected stride 1 on the cuda backend, got strides (2,)");
  }
  EXPECT_EQ(CopyCount::calls, 0);
}

/// On cuda every tensor's device index is index_q's, and index_q's is >= 0
/// (validate_problem called directly with views labelled cuda, on host memory).
TEST(DeviceIndex, CudaRefusesANegativeIndexAndAnotherDevice) {
  for (int index_q_device : {-1, 0}) {
    std::unique_ptr<Env> env = make_env(Layout::bshd);
    IndexerInputs in = env->in;
    IndexerBackwardOutputs out = env->out;
    label_cuda(in, out, index_q_device);
    if (index_q_device == 0) in.index_k.device_index = 1;
    IndexerOptions opt = env->opt;
    opt.backend = Backend::cuda;
    try {
      (void)detail::validate_problem(in, out, opt, &CopyCount::copy);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      if (index_q_device < 0) {
        EXPECT_STREQ(e.what(), "index_q: expected a device index >= 0 on device 'cuda', got -1");
      } else {
        EXPECT_STREQ(e.what(), "index_k: expected device index 0 (that of index_q), got 1");
      }
    }
  }
}

/// A cu_seqlens of 2^45 values (stride 0: 4 bytes of memory) passes the byte
/// rules; the host tables for that many sequences cannot be allocated, which is
/// an out_of_memory error of the call, not a std::bad_alloc.
TEST(StridedViews, HugeBroadcastCuSeqlensIsOutOfMemory) {
  if (kSanitizedBuild) GTEST_SKIP() << "sanitizers abort on allocations this large";
  std::unique_ptr<Env> env = make_env(Layout::thd);
  IndexerInputs in = env->in;
  for (TensorView* v : {&in.cu_seqlens_q, &in.cu_seqlens_k}) {
    v->shape[0] = int64_t{1} << 45;
    v->strides[0] = 0;
  }
  try {
    indexer_backward(in, env->out, env->opt);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << e.what();
    EXPECT_EQ(e.argument(), "cu_seqlens_q") << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a dsaib::Error: " << e.what();
  }
}

/// Scores and ids of one query row (`batch` 1) or of none (`batch` 0) with
/// 2^61 broadcast (stride 0) slots: their element count times 4 bytes overflows
/// int64 while their byte span is 4 bytes. Rejected by the 2^47-byte rule,
/// naming the first such tensor, before any backend allocates for them, and
/// nothing written.
void expect_broadcast_slots_rejected(int64_t batch, uint64_t seed) {
  GenerateSpec s = small_spec(seed);
  s.batch = batch;
  s.s_q = 1;
  s.s_kv = 4;
  s.topk = 2;
  GeneratedProblem p = make_problem(s);
  OutputBuffers o = make_outputs(p);
  IndexerInputs in = p.inputs();
  const int64_t huge = int64_t{1} << 61;  // 2^61 elements of 4 bytes: 2^63 bytes
  for (TensorView* v : {&in.topk_indices, &in.attn_score, &in.index_score}) {
    ASSERT_EQ(v->shape[0], batch);
    v->shape[2] = huge;
    v->strides[0] = v->strides[1] = v->strides[2] = 0;
  }
  const SnapshotAll snap(p, o);
  try {
    indexer_backward(in, o.views(), p.options());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_EQ(e.argument(), "topk_indices") << e.what();
    EXPECT_NE(std::string(e.what()).find("at most 2^47 bytes"), std::string::npos) << e.what();
  }
  EXPECT_EQ(snap.changed(), "");
}

TEST(StridedViews, ElementBytesOverflowIsRejected) { expect_broadcast_slots_rejected(1, 54); }

/// The same with B = 0: an empty tensor counts its size-0 dimension as 1 in the
/// element cap. Before, this passed validation and the cpu backend failed
/// inside std::vector (an internal error) or asked for terabytes of scratch.
TEST(StridedViews, EmptyTensorWithUnaddressableSizesIsRejected) { expect_broadcast_slots_rejected(0, 55); }

// ---- valid corner cases are accepted ------------------------------------------

TEST(Accepted, DeterministicOnCpu) {
  std::unique_ptr<Env> env = make_env(Layout::thd);
  IndexerOptions det = env->opt;
  det.deterministic = true;
  const OutputBuffers a = run_cpu(env->p, env->opt), b = run_cpu(env->p, det);
  EXPECT_TRUE(bitwise_equal(a.d_index_k, b.d_index_k));
  EXPECT_EQ(indexer_backward_workspace_size(env->in, env->out, det), 0u);
}

TEST(Accepted, EmptyProblems) {
  for (auto [b, sq, skv] : {std::tuple{0, 4, 4}, std::tuple{2, 0, 4}, std::tuple{2, 3, 0}}) {
    GenerateSpec s = small_spec(52);
    s.batch = b;
    s.s_q = sq;
    s.s_kv = skv;
    const GeneratedProblem p = make_problem(s);
    const OutputBuffers o = run_cpu(p, p.options());
    const double loss = indexer_kl_loss(p.inputs(), p.options());
    EXPECT_EQ(loss, 0.0);
    EXPECT_FALSE(std::signbit(loss)) << "a loss of -0";
    for (double v : to_doubles(o.d_index_q)) ASSERT_EQ(v, 0.0);
    for (double v : to_doubles(o.d_weights)) ASSERT_EQ(v, 0.0);
    for (double v : to_doubles(o.d_index_k)) ASSERT_EQ(v, 0.0);
  }
}

// BSHD without query rows holds no bytes whatever B is: the call needs no host
// memory that grows with B (before, per-sequence tables of 32 bytes per batch
// entry: 64 GiB at B = 2^31 - 1 from a safetensors file of 633 bytes).
TEST(Accepted, EmptyProblemOfHugeBatchNeedsNoMemoryPerBatch) {
  if (kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  GenerateSpec s = small_spec(57);
  s.batch = 1, s.s_q = 0, s.s_kv = 0;
  const GeneratedProblem p = make_problem(s);
  OutputBuffers o = make_outputs(p);
  IndexerInputs in = p.inputs();
  IndexerBackwardOutputs out = o.views();
  set_batch({&in.index_q, &in.weights, &in.index_k, &in.topk_indices, &in.attn_score, &in.index_score,
             &out.d_index_q, &out.d_weights, &out.d_index_k},
            (int64_t{1} << 31) - 1);
  EXPECT_EXIT(exit_with_call_status_under_address_limit(size_t{64} << 20,
                                                        [&] {
                                                          indexer_backward(in, out, p.options());
                                                          if (indexer_kl_loss(in, p.options()) != 0.0) std::_Exit(13);
                                                        }),
              ::testing::ExitedWithCode(0), "");
}

// ---- running out of memory is an error of the call, not a crash ---------------

/// In a child process: index_k and d_index_k of 2^20 key rows, left unmapped
/// by the kernel (mmap: no page is touched but the few the ids select), then
/// an address-space limit 64 MiB above what is mapped, so the cpu backend's
/// fp64 working set (0.5 GiB of gradients and 0.5 GiB per thread here) cannot
/// be allocated. Exits 0 when indexer_backward() raised out_of_memory with
/// argument `argument` and a message starting with `prefix`, and wrote nothing
/// (the poisoned first and last output bytes unchanged), else a code that says
/// which check failed.
[[noreturn]] void run_out_of_memory_child(int threads, const std::string& argument, const std::string& prefix) {
  GenerateSpec s = small_spec(53);
  s.batch = 1;
  s.s_q = 6;
  s.s_kv = 9;
  s.topk = 5;
  const GeneratedProblem p = make_problem(s);
  constexpr int64_t kKeys = int64_t{1} << 20;
  const int64_t D = p.index_k.shape[2];
  const size_t k_bytes = static_cast<size_t>(kKeys * D) * 2;
  auto* k = static_cast<unsigned char*>(mmap(nullptr, k_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  auto* dk = static_cast<unsigned char*>(mmap(nullptr, k_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (k == MAP_FAILED || dk == MAP_FAILED) std::_Exit(10);
  std::memcpy(k, p.index_k.bytes.data(), p.index_k.bytes.size());  // the 9 real key rows first
  OutputBuffers o = make_outputs(p, DType::f32, DType::f32, DType::bf16);
  IndexerInputs in = p.inputs();
  in.index_k = contiguous_view(k, DType::bf16, {1, kKeys, D});
  IndexerBackwardOutputs out = o.views();
  out.d_index_k = contiguous_view(dk, DType::bf16, {1, kKeys, D});
  for (HostTensor* t : {&o.d_index_q, &o.d_weights}) std::fill(t->bytes.begin(), t->bytes.end(), 0xA5);
  dk[0] = dk[k_bytes - 1] = 0xA5;
  const Snapshot dq_before(o.d_index_q), dw_before(o.d_weights);
  IndexerOptions opt = p.options();
  opt.num_threads = threads;  // one fp64 d_index_k partial (512 MiB) per thread
  if (!limit_address_space(size_t{64} << 20)) std::_Exit(11);
  try {
    indexer_backward(in, out, opt);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::out_of_memory) std::_Exit(12);
    if (e.argument() != argument || std::string(e.what()).find(prefix) != 0) std::_Exit(13);
    if (!dq_before.unchanged() || !dw_before.unchanged() ||
        dk[0] != 0xA5 || dk[k_bytes - 1] != 0xA5 || dk[1] != 0)
      std::_Exit(14);
    std::_Exit(0);
  } catch (...) {
    std::_Exit(15);
  }
  std::_Exit(16);  // it ran: the limit did not bite
}

TEST(Resources, CpuOutOfMemoryIsAnErrorAndWritesNothing) {
  if (kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // Six threads: the per-thread dK partials are most of it, num_threads is named.
  EXPECT_EXIT(run_out_of_memory_child(6, "num_threads", "num_threads: expected room in host memory"),
              ::testing::ExitedWithCode(0), "");
  // One thread: the problem's size is the cause; no argument is blamed.
  EXPECT_EXIT(run_out_of_memory_child(1, "", "out of memory: expected room in host memory"),
              ::testing::ExitedWithCode(0), "");
}

TEST(Resources, OutOfMemoryHasItsName) {
  EXPECT_STREQ(error_code_name(ErrorCode::out_of_memory), "out_of_memory");
  EXPECT_EQ(static_cast<int>(ErrorCode::out_of_memory), 8);
}

TEST(Accepted, BackendCudaWithoutDeviceIsUnavailable) {
  if (cuda_backend_available()) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(cuda_backend_available());
}

}  // namespace
}  // namespace dsaib::test
