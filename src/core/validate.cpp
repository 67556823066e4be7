// Argument validation for indexer_backward(). Every rule raises before any
// output is written. Messages follow one shape:
//   "<argument>: expected <what>, got <what>"
#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "core/allocation.hpp"
#include "core/problem.hpp"
#include "core/validate_rules.hpp"

namespace dsaib::detail {

[[noreturn]] void fail(const std::string& arg, const std::string& expected, const std::string& got) {
  throw Error(ErrorCode::invalid_argument, arg, arg + ": expected " + expected + ", got " + got);
}

namespace {
std::string dtype_list(std::initializer_list<DType> dts) {
  std::string s;
  for (DType d : dts) s += (s.empty() ? "" : " or ") + std::string(dtype_name(d));
  return s;
}

}  // namespace

void check_tensor(const TensorView& v, const TensorRule& rule, DeviceType device, int device_index) {
  const std::string name = rule.name;
  if (!v.present()) fail(name, "a tensor", "nothing (absent)");
  const bool f64_taken = rule.f64_on_cpu && device == DeviceType::cpu;
  if (std::find(rule.dtypes.begin(), rule.dtypes.end(), v.dtype) == rule.dtypes.end() &&
      !(f64_taken && v.dtype == DType::f64)) {
    const bool known = dtype_size(v.dtype) != 0;  // 0 for a value outside the enum
    if (rule.f64_on_cpu && v.dtype == DType::f64) {
      fail(name, "dtype " + dtype_list(rule.dtypes) + " on the cuda backend (f64 on the cpu backend only)",
           "dtype f64");
    }
    fail(name, "dtype " + dtype_list(rule.dtypes) + (f64_taken ? " or f64" : ""),
         known ? std::string("dtype ") + dtype_name(v.dtype)
               : "an unknown DType value " + std::to_string(static_cast<int>(v.dtype)));
  }
  if (v.rank != rule.rank) {
    fail(name, "rank " + std::to_string(rule.rank),
         "rank " + std::to_string(v.rank) + (v.rank >= 0 && v.rank <= kMaxRank ? " with shape " + v.shape_string() : ""));
  }
  for (int i = 0; i < v.rank; ++i) {
    if (v.shape[i] < 0) fail(name, "non-negative sizes", "shape " + v.shape_string());
    if (v.strides[i] < 0) fail(name, "non-negative strides", "strides " + v.strides_string());
  }
  // Sizes and strides must describe addressable memory: the element count and
  // the byte extent are computed without signed overflow and capped at 2^47
  // bytes. The count takes a size-0 dimension as 1, so that an empty tensor's
  // other sizes obey the same cap (stride 0 included) and no product of sizes
  // taken later (rows x topk, ...) can overflow or ask for absurd scratch.
  {
    constexpr int64_t kMaxBytes = int64_t{1} << 47;  // 128 TiB: the 47-bit user address space
    const int64_t esize = static_cast<int64_t>(dtype_size(v.dtype));
    int64_t numel = 1, last = 0;
    bool ok = true;
    for (int i = 0; i < v.rank && ok; ++i) {
      int64_t step = 0;
      ok = !__builtin_mul_overflow(numel, std::max<int64_t>(v.shape[i], 1), &numel) &&
           (v.shape[i] == 0 || (!__builtin_mul_overflow(v.shape[i] - 1, v.strides[i], &step) &&
                                !__builtin_add_overflow(last, step, &last)));
    }
    int64_t bytes = 0, element_bytes = 0;
    ok = ok && !__builtin_add_overflow(last, int64_t{1}, &bytes) && !__builtin_mul_overflow(bytes, esize, &bytes) &&
         bytes <= kMaxBytes && !__builtin_mul_overflow(numel, esize, &element_bytes) && element_bytes <= kMaxBytes;
    if (!ok) {
      fail(name, "sizes and strides that address at most 2^47 bytes", "shape " + v.shape_string() + " with strides " + v.strides_string());
    }
  }
  if (v.numel() > 0 && v.data == nullptr) fail(name, "a non-null data pointer", "null");
  const auto addr = reinterpret_cast<std::uintptr_t>(v.data);
  if (addr % dtype_size(v.dtype) != 0) {
    std::ostringstream s;
    s << "pointer 0x" << std::hex << addr << std::dec << " (not a multiple of " << dtype_size(v.dtype) << ")";
    fail(name, "data aligned to its element size " + std::to_string(dtype_size(v.dtype)) + " bytes", s.str());
  }
  if (v.device != device) {
    fail(name, std::string("memory on device '") + device_name(device) + "' (the chosen backend's)",
         std::string("device '") + device_name(v.device) + "'");
  }
  if (device == DeviceType::cuda && v.device_index != device_index) {
    fail(name, "device index " + std::to_string(device_index) + " (that of index_q)",
         std::to_string(v.device_index));
  }
}

void check_shape(const TensorView& v, const char* name, std::initializer_list<int64_t> expected,
                 const char* meaning) {
  int i = 0;
  bool ok = true;
  for (int64_t e : expected) ok = ok && v.shape[i++] == e;
  if (!ok) {
    int64_t tmp[kMaxRank] = {};
    int n = 0;
    for (int64_t e : expected) tmp[n++] = e;
    TensorView shown;
    shown.rank = n;
    std::copy(tmp, tmp + n, shown.shape);
    fail(name, std::string("shape ") + shown.shape_string() + " " + meaning, "shape " + v.shape_string());
  }
}

namespace {
/// Byte range [lo, hi) covered by a view (empty views cover nothing).
struct ByteRange {
  std::uintptr_t lo = 0, hi = 0;
};
ByteRange byte_range(const TensorView& v) {
  if (!v.present() || v.numel() == 0) return {};
  int64_t last = 0;
  for (int i = 0; i < v.rank; ++i) last += (v.shape[i] - 1) * v.strides[i];
  const auto lo = reinterpret_cast<std::uintptr_t>(v.data);
  return {lo, lo + static_cast<std::uintptr_t>((last + 1) * dtype_size(v.dtype))};
}
}  // namespace

bool overlaps(const TensorView& a, const TensorView& b) {
  const ByteRange ra = byte_range(a), rb = byte_range(b);
  if (ra.lo == ra.hi || rb.lo == rb.hi) return false;
  return ra.lo < rb.hi && rb.lo < ra.hi;
}

void check_finite(float v, const char* name) {
  if (!std::isfinite(v)) {
    std::ostringstream s;
    s << v;
    fail(name, "a finite value", s.str());
  }
}

namespace {
/// Host memory for `n` values of T; a failed allocation is an out_of_memory
/// error that names `name` and says how many `what` it wanted (never a
/// std::bad_alloc).
template <class T>
std::vector<T> host_vector(int64_t n, const char* name, const char* what) {
  try {
    if (static_cast<uint64_t>(n) > std::vector<T>().max_size()) throw std::bad_alloc();
    return std::vector<T>(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::out_of_memory, name,
                std::string(name) + ": expected host memory for " + std::to_string(n) + " " + what +
                    " to check it, got an allocation failure");
  }
}
std::vector<int32_t> host_int32(int64_t n, const char* name) { return host_vector<int32_t>(n, name, "int32 values"); }

/// Reads cu_seqlens (B + 1 int32) to the host: only its elements are read, never
/// the memory between them. Host memory is read in place (any stride); device
/// memory is copied in one piece (the cuda backend requires stride 1, checked
/// before) or, for any other stride, as one pitched copy of 4-byte rows.
std::vector<int64_t> read_cu_seqlens(const TensorView& v, const char* name, CopyToHost copy, void* stream) {
  const int64_t n = v.shape[0];
  const auto* src = static_cast<const int32_t*>(v.data);
  std::vector<int64_t> out = host_vector<int64_t>(n, name, "values");
  if (!copy) {
    for (int64_t i = 0; i < n; ++i) out[i] = src[i * v.strides[0]];
    return out;
  }
  std::vector<int32_t> host = host_int32(n, name);
  if (n > 0 && (v.strides[0] == 1 || n == 1)) {
    copy(host.data(), src, static_cast<size_t>(n) * sizeof(int32_t), static_cast<size_t>(n) * sizeof(int32_t), 1, stream);
  } else if (n > 0 && v.strides[0] >= 1 && v.strides[0] * 4 <= std::numeric_limits<int32_t>::max()) {
    // not on cuda (stride 1 checked before): one pitched copy of n values
    copy(host.data(), src, sizeof(int32_t), static_cast<size_t>(v.strides[0]) * sizeof(int32_t), static_cast<size_t>(n),
         stream);
  } else {  // stride 0, or beyond a pitched copy's 2^31 - 1 bytes: one value at a time
    for (int64_t i = 0; i < n; ++i) {
      copy(&host[static_cast<size_t>(i)], src + i * v.strides[0], sizeof(int32_t), sizeof(int32_t), 1, stream);
    }
  }
  for (int64_t i = 0; i < n; ++i) out[i] = host[static_cast<size_t>(i)];
  return out;
}

void check_cu_seqlens(const std::vector<int64_t>& cu, const char* name, int64_t total, const char* total_name) {
  if (cu.front() != 0) fail(name, "cu_seqlens starting at 0", "first value " + std::to_string(cu.front()));
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      fail(name, "non-decreasing values",
           "value " + std::to_string(cu[i]) + " at position " + std::to_string(i) + " after " +
               std::to_string(cu[i - 1]));
    }
  }
  if (cu.back() != total) {
    fail(name, std::string("last value equal to ") + total_name + " = " + std::to_string(total),
         std::to_string(cu.back()));
  }
}

}  // namespace

double scale_from_host(const ProblemGeometry& g, const IndexerOptions& opt, double grad_loss) {
  return grad_loss * static_cast<double>(opt.loss_coeff) / static_cast<double>(g.normalization_count);
}

void check_cuda_key_rows(const ProblemGeometry& g) {
  if (g.num_k_rows > std::numeric_limits<int32_t>::max() || g.topk > std::numeric_limits<int32_t>::max()) {
    fail("index_k", "fewer than 2^31 key rows on the cuda backend", std::to_string(g.num_k_rows));
  }
}

void check_options(const IndexerOptions& opt) {
  if (opt.layout != Layout::bshd && opt.layout != Layout::thd) {
    fail("layout", "bshd or thd", std::to_string(static_cast<int>(opt.layout)));
  }
  if (opt.id_mode != IdMode::local && opt.id_mode != IdMode::global) {
    fail("id_mode", "local or global", std::to_string(static_cast<int>(opt.id_mode)));
  }
  if (opt.backend != Backend::cpu && opt.backend != Backend::cuda) {
    fail("backend", "cpu or cuda", std::to_string(static_cast<int>(opt.backend)));
  }
}

void check_cu_seqlens_views(const TensorView& cu_q, const TensorView& cu_k, bool thd, DeviceType device,
                            int device_index) {
  if (thd) {
    check_tensor(cu_q, {"cu_seqlens_q", {DType::i32}, 1}, device, device_index);
    check_tensor(cu_k, {"cu_seqlens_k", {DType::i32}, 1}, device, device_index);
  } else {
    if (cu_q.present()) fail("cu_seqlens_q", "absent for layout bshd", "a tensor");
    if (cu_k.present()) fail("cu_seqlens_k", "absent for layout bshd", "a tensor");
  }
}

void read_problem_sizes(ProblemGeometry& g, const TensorView& q, const TensorView& k, const TensorView& ids, bool thd) {
  if (thd) {
    g.num_q_rows = q.shape[0];
    g.heads = q.shape[1];
    g.head_dim = q.shape[2];
    g.num_k_rows = k.shape[0];
  } else {
    g.batch = q.shape[0];
    g.s_q = q.shape[1];
    g.heads = q.shape[2];
    g.head_dim = q.shape[3];
    g.s_kv = k.shape[1];
    g.num_q_rows = g.batch * g.s_q;
    g.num_k_rows = g.batch * g.s_kv;
  }
  g.topk = ids.shape[thd ? 1 : 2];
}

void resolve_sequences(ProblemGeometry& g, const TensorView& cu_q, const TensorView& cu_k, bool strict_indices,
                       CopyToHost copy, void* stream, bool stream_capturing, const char* q_total_name,
                       const char* k_total_name) {
  if (g.layout == Layout::thd) {
    if (cu_q.shape[0] < 1) fail("cu_seqlens_q", "length B + 1 >= 1", "length 0");
    if (cu_k.shape[0] != cu_q.shape[0]) {
      fail("cu_seqlens_k", "length B + 1 = " + std::to_string(cu_q.shape[0]) + " (that of cu_seqlens_q)",
           "length " + std::to_string(cu_k.shape[0]));
    }
    if (stream_capturing && copy) {
      // No host copy inside a capture: the backend checks them on the device.
      if (strict_indices) {
        fail("strict_indices", "false while options.stream captures a CUDA graph (strict mode reads topk_indices on the host)",
             "true");
      }
      g.cu_seqlens_on_device_only = true;
      g.batch = cu_q.shape[0] - 1;
      g.q_start = {0};
      g.q_len = {g.num_q_rows};
      g.k_start = {0};
      g.k_len = {g.num_k_rows};
      g.seq_of_q_row.assign(static_cast<size_t>(g.num_q_rows), 0);
      return;
    }
    const auto cq = read_cu_seqlens(cu_q, "cu_seqlens_q", copy, stream);
    const auto ck = read_cu_seqlens(cu_k, "cu_seqlens_k", copy, stream);
    check_cu_seqlens(cq, "cu_seqlens_q", g.num_q_rows, q_total_name);
    check_cu_seqlens(ck, "cu_seqlens_k", g.num_k_rows, k_total_name);
    g.batch = static_cast<int64_t>(cq.size()) - 1;
    for (int64_t b = 0; b < g.batch; ++b) {
      g.q_start.push_back(cq[b]);
      g.q_len.push_back(cq[b + 1] - cq[b]);
      g.k_start.push_back(ck[b]);
      g.k_len.push_back(ck[b + 1] - ck[b]);
    }
  } else {
    for (int64_t b = 0; b < g.batch; ++b) {
      g.q_start.push_back(b * g.s_q);
      g.q_len.push_back(g.s_q);
      g.k_start.push_back(b * g.s_kv);
      g.k_len.push_back(g.s_kv);
    }
  }
  g.seq_of_q_row.resize(static_cast<size_t>(g.num_q_rows));
  for (int64_t b = 0; b < g.batch; ++b) {
    for (int64_t t = 0; t < g.q_len[b]; ++t) g.seq_of_q_row[g.q_start[b] + t] = static_cast<int32_t>(b);
  }
}

void check_strict_ids(const TensorView& ids, const ProblemGeometry& g, CopyToHost copy, void* stream) {
  const int64_t K = g.topk;
  const int64_t slot_stride = ids.strides[g.layout == Layout::thd ? 1 : 2];
  // Host memory is read in place through the strides. Device memory is copied
  // in one piece when its byte span is at most twice its ids' bytes plus 1 MiB
  // (packed, padded or broadcast rows; the span lies within the view's bounding
  // box), else as groups of evenly spaced rows, one pitched copy per group:
  // THD's rows; BSHD's rows when the batches are evenly spaced too, else each
  // batch's. Then only the rows are read, never the memory between them.
  const int32_t* host = static_cast<const int32_t*>(ids.data);
  std::vector<int32_t> copied;
  // Where row (b, t)'s ids are in `host`: (multi ? b : 0) * group_elems +
  // (multi ? t : row) * row_pitch + i * slot_stride; in place: row_offset.
  bool grouped = false, multi = false;
  int64_t group_elems = 0, row_pitch = 0;
  if (copy && g.num_q_rows > 0) {
    const int64_t span = static_cast<int64_t>(byte_range(ids).hi - byte_range(ids).lo);
    const int64_t id_bytes = g.num_q_rows * g.topk * static_cast<int64_t>(sizeof(int32_t));
    if (span <= 2 * id_bytes + (int64_t{1} << 20)) {
      copied = host_int32(span / 4, "topk_indices");
      copy(copied.data(), ids.data, static_cast<size_t>(span), static_cast<size_t>(span), 1, stream);
    } else {
      grouped = true;
      int64_t rows = g.num_q_rows, pitch = 0, groups = 1, group_stride = 0;
      if (g.layout == Layout::thd) {
        pitch = ids.strides[0];
      } else if (g.s_q == 1) {
        pitch = ids.strides[0];
      } else if (g.batch == 1 || ids.strides[0] == g.s_q * ids.strides[1]) {
        pitch = ids.strides[1];
      } else {
        multi = true;
        rows = g.s_q, pitch = ids.strides[1], groups = g.batch, group_stride = ids.strides[0];
      }
      const int64_t row_span = (K - 1) * slot_stride + 1;  // one row's elements, gaps between slots included
      // Rows that do not overlap are copied pitched (row_span each); overlapping
      // ones (pitch < row_span, e.g. stride 0) as the group's span, which is then
      // no larger than its rows.
      // (A pitch beyond cudaMemcpy2D's 2^31 - 1 bytes: one copy per row.)
      const bool apart = pitch >= row_span;
      const bool pitched = apart && pitch * 4 <= std::numeric_limits<int32_t>::max();
      group_elems = apart ? rows * row_span : (rows - 1) * pitch + row_span;
      row_pitch = apart ? row_span : pitch;
      int64_t total = 0;  // overflows only with a slot stride above 1, which cuda refuses
      if (__builtin_mul_overflow(groups, group_elems, &total)) total = std::numeric_limits<int64_t>::max();
      copied = host_int32(total, "topk_indices");
      const size_t row_bytes = static_cast<size_t>(row_span) * 4;
      // Groups that are themselves evenly spaced, apart and within the pitch limit,
      // each with its rows back to back or overlapping (its elements in
      // group_elems): one pitched copy of all groups.
      const bool groups_pitched = groups > 1 && (!apart || pitch == row_span) && group_stride >= group_elems &&
                                  group_stride * 4 <= std::numeric_limits<int32_t>::max();
      if (groups_pitched) {
        copy(copied.data(), ids.data, static_cast<size_t>(group_elems) * 4,
             static_cast<size_t>(group_stride) * 4, static_cast<size_t>(groups), stream);
      }
      for (int64_t gi = 0; gi < (groups_pitched ? 0 : groups); ++gi) {
        const int32_t* src = static_cast<const int32_t*>(ids.data) + gi * group_stride;
        int32_t* dst = copied.data() + gi * group_elems;
        if (pitched) {
          copy(dst, src, row_bytes, static_cast<size_t>(pitch) * 4, static_cast<size_t>(rows), stream);
        } else if (apart) {
          for (int64_t r = 0; r < rows; ++r) copy(dst + r * row_span, src + r * pitch, row_bytes, row_bytes, 1, stream);
        } else {
          const size_t bytes = static_cast<size_t>(group_elems) * 4;
          copy(dst, src, bytes, bytes, 1, stream);
        }
      }
    }
    host = copied.data();
  }
  for (int64_t row = 0; row < g.num_q_rows; ++row) {
    int64_t b, t;
    g.q_row_coords(row, &b, &t);
    const int64_t base = grouped ? (multi ? b * group_elems + t * row_pitch : row * row_pitch)
                                 : row_offset(ids, g.layout, row, g.s_q);
    for (int64_t i = 0; i < K; ++i) {
      const int64_t id = host[base + i * slot_stride];
      if (id != -1 && g.key_row(b, id) < 0) {
        std::ostringstream s;
        s << "topk_indices: strict mode found an out-of-range id at (b=" << b << ", t=" << t << ", slot=" << i
          << "): expected -1 or an id in [";
        if (g.id_mode == IdMode::local) s << "0, " << g.k_len[b];
        else s << g.k_start[b] << ", " << g.k_start[b] + g.k_len[b];
        s << ") (" << id_mode_name(g.id_mode) << " ids), got id " << id;
        throw Error(ErrorCode::index_out_of_range, "topk_indices", s.str());
      }
    }
  }
}

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
        const IndexerBackwardOutputs gradients{out.d_index_q, out.d_weights, out.d_index_k};
        ProblemGeometry g = validate_problem_unguarded(with_target, gradients, opt, copy_to_host, true, stream_capturing);
        const DeviceType device = opt.backend == Backend::cpu ? DeviceType::cpu : DeviceType::cuda;
        check_tensor(out.loss, {"loss", {DType::f32}, 0, true}, device, in.index_q.device_index);
        const TensorView* others[] = {&out.d_index_q,  &out.d_weights,    &out.d_index_k,    &in.index_q,
                                      &in.weights,     &in.index_k,       &in.topk_indices,  &in.attn_score,
                                      &in.cu_seqlens_q, &in.cu_seqlens_k};
        const char* names[] = {"d_index_q", "d_weights",    "d_index_k",    "index_q",      "weights",
                               "index_k",   "topk_indices", "attn_score",   "cu_seqlens_q", "cu_seqlens_k"};
        for (int j = 0; j < 10; ++j) {
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
        ProblemGeometry g = validate_problem_unguarded(with_target, {}, opt, copy_to_host, false);

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
        const TensorView* ins[] = {&in.index_q,    &in.weights,      &in.index_k,     &in.topk_indices,
                                   &in.attn_score, &in.cu_seqlens_q, &in.cu_seqlens_k};
        const char* in_names[] = {"index_q",    "weights",      "index_k",     "topk_indices",
                                  "attn_score", "cu_seqlens_q", "cu_seqlens_k"};
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
          for (int j = 0; j < 7; ++j) {
            if (overlaps(*outs[i], *ins[j])) {
              fail(out_names[i], std::string("memory disjoint from input ") + in_names[j], "overlapping memory");
            }
          }
        }
        return g;
      });
}

}  // namespace dsaib::detail
