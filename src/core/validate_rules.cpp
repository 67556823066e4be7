// The validation rules every entry point shares (validate_rules.hpp): each
// tensor, shapes, overlap, the options, the sequences, strict ids. Every rule
// raises before any output is written. Messages follow one shape:
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
  if (device == DeviceType::cpu && v.device_index != 0) {
    fail(name, "device index 0 on device 'cpu' (DLPack's for host memory)", std::to_string(v.device_index));
  }
  if (device == DeviceType::cuda && v.device_index < 0) {
    fail(name, "a device index >= 0 on device 'cuda'", std::to_string(v.device_index));
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
    // No query rows (S_q or B zero): no sequence has work, and the tables stay
    // empty, so that host memory does not grow with B for inputs of no bytes.
    if (g.num_q_rows == 0) return;
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

}  // namespace dsaib::detail
