// indexer_topk()'s validation: every rule names its argument, in docs/errors.md's
// order, and nothing is written (outputs poisoned and compared byte for byte,
// inputs too); the workspace query, the reference and the checker raise the
// same errors; the cuda backend's availability and limits.
#include <gtest/gtest.h>

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "dsaib/indexer_topk.hpp"
#include "support/test_support.hpp"
#include "support/topk_check.hpp"

namespace dsaib::test {
namespace {

struct Call {
  IndexerTopkInputs in;
  IndexerTopkOutputs out;
  IndexerTopkOptions opt;
};

struct ErrorCase {
  std::string name;
  Layout layout;
  std::function<void(Call&)> mutate;
  const char* argument;
  const char* message_part;
  ErrorCode code = ErrorCode::invalid_argument;
};

std::vector<ErrorCase> error_cases() {
  const Layout S = Layout::bshd, T = Layout::thd;
  return {
      {"layout", S, [](Call& c) { c.opt.layout = static_cast<Layout>(7); }, "layout", "expected bshd or thd, got 7"},
      {"id_mode", S, [](Call& c) { c.opt.id_mode = static_cast<IdMode>(5); }, "id_mode", "expected local or global, got 5"},
      {"order", S, [](Call& c) { c.opt.order = static_cast<TopkOrder>(5); }, "order",
       "order: expected 0 (logit_descending) or 1 (id_ascending), got 5"},
      {"backend", S, [](Call& c) { c.opt.backend = static_cast<Backend>(3); }, "backend", "expected cpu or cuda, got 3"},
      {"index_q_absent", S, [](Call& c) { c.in.index_q = TensorView{}; }, "index_q", "expected a tensor, got nothing"},
      {"index_q_dtype", S, [](Call& c) { c.in.index_q.dtype = DType::f32; }, "index_q", "expected dtype bf16 or e4m3, got dtype f32"},
      {"index_k_dtype_unlike_index_q", S, [](Call& c) { c.in.index_q.dtype = DType::e4m3; }, "index_k",
       "index_k: expected dtype e4m3 (that of index_q), got dtype bf16"},
      {"scale_with_bf16", S, [](Call& c) { c.in.index_q_scale = c.in.weights; }, "index_q_scale",
       "expected absent with bf16 index_q and index_k (the scales of e4m3 inputs), got a tensor"},
      {"index_k_scale_dtype", S, [](Call& c) { c.in.index_q.dtype = c.in.index_k.dtype = DType::e4m3; c.in.index_k_scale = c.in.starts; },
       "index_k_scale", "expected dtype f32 or f64, got dtype i32"},
      {"index_q_scale_shape", T, [](Call& c) { c.in.index_q.dtype = c.in.index_k.dtype = DType::e4m3; c.in.index_q_scale = c.in.weights;
         c.in.index_q_scale.shape[1] = 2; }, "index_q_scale", "expected shape (11, 3) (T_q, H) like weights, got shape (11, 2)"},
      {"index_k_scale_shape", S, [](Call& c) { c.in.index_q.dtype = c.in.index_k.dtype = DType::e4m3; c.in.index_k_scale = c.in.weights;
         c.in.index_k_scale.rank = 2; }, "index_k_scale", "expected shape (2, 13) (B, S_kv), got shape (2, 5)"},
      {"output_overlaps_scale", S, [](Call& c) { c.in.index_q.dtype = c.in.index_k.dtype = DType::e4m3;
         c.in.index_k_scale = contiguous_view(c.out.topk_logits.data, DType::f32, {2, 13}); }, "topk_logits",
       "topk_logits: expected memory disjoint from input index_k_scale, got overlapping memory"},
      {"weights_dtype", S, [](Call& c) { c.in.weights.dtype = DType::i32; }, "weights", "expected dtype bf16 or f32 or f64, got dtype i32"},
      {"index_k_rank", S, [](Call& c) { c.in.index_k.rank = 2; }, "index_k", "expected rank 3, got rank 2"},
      {"starts_without_ends", S, [](Call& c) { c.in.ends = TensorView{}; }, "ends",
       "ends: expected a tensor (starts and ends come together, or neither), got nothing (absent) while starts is given"},
      {"ends_without_starts", S, [](Call& c) { c.in.starts = TensorView{}; }, "starts", "got nothing (absent) while ends is given"},
      {"starts_dtype", S, [](Call& c) { c.in.starts.dtype = DType::f32; }, "starts", "expected dtype i32, got dtype f32"},
      {"topk_indices_dtype", S, [](Call& c) { c.out.topk_indices.dtype = DType::f32; }, "topk_indices", "expected dtype i32"},
      {"topk_logits_dtype", S, [](Call& c) { c.out.topk_logits.dtype = DType::bf16; }, "topk_logits", "expected dtype f32 or f64, got dtype bf16"},
      {"topk_lengths_dtype", S, [](Call& c) { c.out.topk_lengths.dtype = DType::f32; }, "topk_lengths", "expected dtype i32"},
      {"cu_seqlens_bshd", S, [](Call& c) { c.in.cu_seqlens_q = c.in.starts; }, "cu_seqlens_q", "expected absent for layout bshd"},
      {"heads_zero", S, [](Call& c) { c.in.index_q.shape[2] = 0; }, "index_q", "expected H (heads, dim 2) >= 1, got H = 0"},
      {"dim_zero", T, [](Call& c) { c.in.index_q.shape[2] = 0; }, "index_q", "expected D (last dim) >= 1, got D = 0"},
      {"topk_zero", S, [](Call& c) { c.out.topk_indices.shape[2] = 0; }, "topk_indices", "expected topk (last dim) >= 1, got topk = 0"},
      {"weights_shape", S, [](Call& c) { c.in.weights.shape[2] = 4; }, "weights", "(B, S_q, H), got shape (2, 5, 4)"},
      {"index_k_batch", S, [](Call& c) { c.in.index_k.shape[0] = 1; }, "index_k", "(B, S_kv, D) with B and D of index_q"},
      {"index_k_dim_thd", T, [](Call& c) { c.in.index_k.shape[1] = 4; }, "index_k", "(T_k, D) with D of index_q"},
      {"ids_local_int32", S, [](Call& c) { c.in.index_k.shape[1] = (int64_t{1} << 31) + 1; c.in.index_k.strides[0] = c.in.index_k.strides[1] = 0; },
       "index_k", "index_k: expected S_kv at most 2^31 (int32 ids), got S_kv = 2147483649 (shape (2, 2147483649, 8))"},
      {"ids_global_int32", S, [](Call& c) { c.opt.id_mode = IdMode::global; c.in.index_k.shape[1] = (int64_t{1} << 30) + 1;
         c.in.index_k.strides[0] = c.in.index_k.strides[1] = 0; }, "index_k",
       "index_k: expected B*S_kv at most 2^31 with id_mode global (int32 ids), got B*S_kv = 2147483650 (shape (2, 1073741825, 8))"},
      {"starts_shape", S, [](Call& c) { c.in.starts.shape[1] = 4; }, "starts", "expected shape (2, 5) (B, S_q), got shape (2, 4)"},
      {"ends_shape_thd", T, [](Call& c) { c.in.ends.shape[0] = 3; }, "ends", "(T_q)"},
      {"topk_indices_shape", S, [](Call& c) { c.out.topk_indices.shape[1] = 4; }, "topk_indices", "(B, S_q, topk)"},
      {"topk_logits_shape", S, [](Call& c) { c.out.topk_logits.shape[2] = 3; }, "topk_logits", "(B, S_q, topk) like topk_indices"},
      {"topk_lengths_shape", T, [](Call& c) { c.out.topk_lengths.shape[0] = 2; }, "topk_lengths", "(T_q)"},
      {"index_q_last_stride", S, [](Call& c) { c.in.index_q.strides[3] = 2; c.in.index_q.shape[3] = 4; c.in.weights.shape[2] = 3; c.in.index_k.shape[2] = 4; }, "index_q",
       "expected a contiguous last dimension (stride 1)"},
      {"index_k_last_stride", T, [](Call& c) { c.in.index_k.strides[1] = 0; }, "index_k", "expected a contiguous last dimension (stride 1)"},
      {"starts_stride", T, [](Call& c) { c.in.starts.strides[0] = 0; }, "starts", "contiguous last dimension"},
      {"topk_indices_strided", S, [](Call& c) { c.out.topk_indices.shape[1] = 2; c.out.topk_indices.strides[0] = 100;
         c.out.topk_logits.shape[1] = 2; c.out.topk_lengths.shape[1] = 2; c.in.index_q.shape[1] = 2; c.in.weights.shape[1] = 2; c.in.starts.shape[1] = 2; c.in.ends.shape[1] = 2; },
       "topk_indices", "expected a contiguous (row-major) tensor"},
      {"outputs_overlap", S, [](Call& c) { c.out.topk_logits.data = c.out.topk_indices.data; }, "topk_indices",
       "expected memory disjoint from topk_logits, got overlapping memory"},
      {"output_overlaps_input", S, [](Call& c) { c.out.topk_lengths.data = c.in.index_k.data; }, "topk_lengths",
       "expected memory disjoint from input index_k, got overlapping memory"},
      {"output_overlaps_starts", T, [](Call& c) { c.out.topk_lengths.data = c.in.starts.data; }, "topk_lengths",
       "disjoint from input starts"},
      {"num_threads", S, [](Call& c) { c.opt.num_threads = -1; }, "num_threads", "expected >= 0 (0 = all hardware threads), got -1"},
      {"cu_seqlens_end", T, [](Call& c) { static_cast<int32_t*>(c.in.cu_seqlens_q.data)[4] = 12; }, "cu_seqlens_q",
       "expected last value equal to T_q (index_q dim 0) = 11, got 12"},
      {"cu_seqlens_k_length", T, [](Call& c) { c.in.cu_seqlens_k.shape[0] = 3; }, "cu_seqlens_k", "expected length B + 1 = 5"},
      {"strict_ranges", T, [](Call& c) { c.opt.strict_ranges = true; static_cast<int32_t*>(c.in.starts.data)[0] = -1; }, "starts",
       "strict mode found a range outside its sequence's keys at (b=0, t=0): expected 0 <= start <= end <= 9",
       ErrorCode::index_out_of_range},
  };
}

void PrintTo(const ErrorCase& c, std::ostream* os) { *os << c.name; }

class TopkValidation : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(TopkValidation, NamesTheArgumentAndWritesNothing) {
  const ErrorCase& ec = GetParam();
  TopkSpec s = ec.layout == Layout::thd ? thd_spec(TopkSpec{}) : TopkSpec{};
  s.ranges = true;
  TopkProblem p = make_topk_problem(s);
  for (int64_t r = 0; r < p.rows; ++r) {  // valid ranges, so that strict mode finds only the case's
    const int64_t b = p.seq_of(r), base = ec.layout == Layout::thd ? p.k_start[b] : 0;
    p.starts.data<int32_t>()[r] = int32_t(base);
    p.ends.data<int32_t>()[r] = int32_t(base + p.k_len[b]);
  }
  TopkOutputs out(p, s.topk);
  Call c{p.inputs(), out.views(), p.options()};
  const Snapshot ids(out.ids), logits(out.logits), lengths(out.lengths);
  ec.mutate(c);
  const Snapshot q(p.index_q), w(p.weights), k(p.index_k), st(p.starts), en(p.ends), cq(p.cu_q), ck(p.cu_k);
  auto expect_error = [&](const std::function<void()>& call, const char* who, bool full) {
    try {
      call();
      ADD_FAILURE() << who << " accepted it";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), ec.argument) << who << ": " << e.what();
      if (!full) return;
      EXPECT_EQ(e.code(), ec.code) << e.what();
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind(std::string(ec.argument) + ":", 0), 0u) << msg;
      EXPECT_NE(msg.find(ec.message_part), std::string::npos) << msg;
      EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
      EXPECT_NE(msg.find("got"), std::string::npos) << msg;
    }
  };
  expect_error([&] { indexer_topk(c.in, c.out, c.opt); }, "indexer_topk", true);
  EXPECT_TRUE(ids.unchanged() && logits.unchanged() && lengths.unchanged()) << "an output written before the error";
  EXPECT_TRUE(q.unchanged() && w.unchanged() && k.unchanged() && st.unchanged() && en.unchanged() && cq.unchanged() && ck.unchanged());
  expect_error([&] { indexer_topk_workspace_size(c.in, c.out, c.opt); }, "indexer_topk_workspace_size", false);
  const std::string arg = ec.argument;
  if (arg.rfind("topk_", 0) != 0) {  // the inputs-only validation has no output to name
    expect_error([&] { validate_indexer_topk_inputs(c.in, s.topk, c.opt); }, "validate_indexer_topk_inputs", true);
  }
  if (ec.name == "backend") return;  // the reference and the checker run on the host whatever the backend
  if (arg.rfind("topk_", 0) != 0) {  // the reference has no output
    expect_error([&] { reference_indexer_topk(c.in, c.opt, s.topk); }, "reference_indexer_topk", false);
  }
  expect_error([&] { check_indexer_topk(c.in, c.opt, c.out); }, "check_indexer_topk", false);
}

INSTANTIATE_TEST_SUITE_P(Rules, TopkValidation, ::testing::ValuesIn(error_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(IndexerTopk, ReferenceTopkMustBePositive) {
  const TopkProblem p = make_topk_problem(TopkSpec{});
  try {
    reference_indexer_topk(p.inputs(), p.options(), 0);
    ADD_FAILURE() << "topk 0 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "topk");
    EXPECT_STREQ(e.what(), "topk: expected topk >= 1, got topk = 0");
  }
}

TEST(IndexerTopk, ValidateInputsAcceptsAValidCallAndNamesTopk) {
  TopkSpec s;
  s.ranges = true;
  const TopkProblem p = make_topk_problem(s);
  EXPECT_NO_THROW(validate_indexer_topk_inputs(p.inputs(), s.topk, p.options()));
  try {
    validate_indexer_topk_inputs(p.inputs(), 0, p.options());
    ADD_FAILURE() << "topk 0 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "topk");
    EXPECT_STREQ(e.what(), "topk: expected topk >= 1, got topk = 0");
  }
}

// cuda without a usable device is refused before any tensor is read.
TEST(IndexerTopk, CudaUnavailable) {
  if (cuda_backend_available()) GTEST_SKIP() << "a cuda device is present";
  const TopkProblem p = make_topk_problem(TopkSpec{});
  TopkOutputs out(p, 4);
  IndexerTopkOptions opt = p.options();
  opt.backend = Backend::cuda;
  IndexerTopkInputs in = p.inputs();
  in.index_q = TensorView{};  // not reached
  const Snapshot ids(out.ids);
  try {
    indexer_topk(in, out.views(), opt);
    ADD_FAILURE() << "cuda accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::backend_unavailable) << e.what();
    EXPECT_EQ(e.argument(), "backend");
  }
  EXPECT_TRUE(ids.unchanged());
  // The reference and the checker run on the host whatever the backend.
  EXPECT_NO_THROW(reference_indexer_topk(p.inputs(), opt, 4));
}

// With a cuda device, its limits (H a multiple of 8 up to 128, D 64 or 128,
// topk up to 8192) are checked before any memory is read (views marked cuda
// over host memory).
TEST(IndexerTopk, CudaLimits) {
  if (!cuda_backend_available()) GTEST_SKIP() << "no cuda device: the cuda limits are not reachable";
  const TopkProblem p = make_topk_problem(TopkSpec{});
  TopkOutputs out(p, 4);
  IndexerTopkOptions opt = p.options();
  opt.backend = Backend::cuda;
  struct Limit {
    int64_t heads, dim, topk;
    const char* argument;
    const char* part;
  };
  for (const Limit& l : {Limit{12, 64, 4, "index_q", "H (heads, dim 2) a multiple of 8 in [8, 128] on the cuda backend, got H = 12"},
                         Limit{136, 64, 4, "index_q", "got H = 136"},
                         Limit{8, 96, 4, "index_q", "D (last dim) 64 or 128 on the cuda backend, got D = 96"},
                         Limit{8, 64, 8193, "topk_indices", "topk (last dim) at most 8192 on the cuda backend, got topk = 8193"}}) {
    IndexerTopkInputs in = p.inputs();
    IndexerTopkOutputs o = out.views();
    in.index_q = contiguous_view(in.index_q.data, DType::bf16, {2, 5, l.heads, l.dim}, DeviceType::cuda);
    in.weights = contiguous_view(in.weights.data, DType::f32, {2, 5, l.heads}, DeviceType::cuda);
    in.index_k = contiguous_view(in.index_k.data, DType::bf16, {2, 13, l.dim}, DeviceType::cuda);
    o.topk_indices = contiguous_view(o.topk_indices.data, DType::i32, {2, 5, l.topk}, DeviceType::cuda);
    o.topk_logits = o.topk_lengths = TensorView{};
    try {
      indexer_topk(in, o, opt);
      ADD_FAILURE() << "accepted " << l.heads << " x " << l.dim << ", topk " << l.topk;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), l.argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(l.part), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace dsaib::test
