// fp64 reference of the indexer's top-k (docs/indexer-topk.md), the cpu backend
// of indexer_topk() built on it, and the checker of another backend's selection.
//
// Per query row t, for every key s it sees:
//   I[t, s] = sum_h weights[t, h] * ReLU(index_q[t, h, :] . index_k[s, :])     (fp64)
// ranked by (I descending, id ascending), -0.0 as +0.0, NaN above +inf. Each
// row takes its top min(topk, keys seen) with a partial selection
// (std::nth_element, then a sort of the selected part), so a row of 262144
// keys costs its logits and O(S_kv) more. Rows are independent and each is
// computed by one thread in a fixed order, so every result is bitwise the same
// for any thread count.
#include "reference/topk_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "api/indexer_topk_problem.hpp"
#include "core/allocation.hpp"
#include "core/bf16.hpp"
#include "core/element_access.hpp"
#include "core/float_mode.hpp"
#include "core/threads.hpp"

namespace dsaib::detail {
namespace {

/// The rank of a logit as an unsigned integer, larger = better: NaN above
/// +inf, -0.0 equal to +0.0, else the order of the doubles.
uint64_t rank_key(double v) {
  if (std::isnan(v)) return std::numeric_limits<uint64_t>::max();
  v += 0.0;  // -0.0 + 0.0 = +0.0
  uint64_t u;
  std::memcpy(&u, &v, 8);
  return (u >> 63) ? ~u : (u | (uint64_t{1} << 63));
}

/// A key of the row: its rank and its position in its sequence's keys
/// (positions and ids are in the same order within a sequence).
struct Entry {
  uint64_t key;
  int64_t pos;
};
inline bool ranks_before(const Entry& a, const Entry& b) { return a.key > b.key || (a.key == b.key && a.pos < b.pos); }

/// One thread's row buffers.
struct TopkScratch {
  std::vector<double> q, w, k;     // the row's index_q (H*D) and weights (H; e4m3: times index_q_scale), one key row (D)
  double k_scale = 1.0;            // e4m3: the loaded key's index_k_scale
  std::vector<double> logits;      // per visible key, by position - lo
  std::vector<Entry> entries;      // per visible key
  std::vector<int64_t> mark, ref_mark;  // checker: per visible key, the row that marked it
  std::vector<int64_t> pos;             // checker: the candidate's keys (topk), as positions
  TopkScratch(const ProblemGeometry& g, int64_t max_keys, bool checker)
      : q(static_cast<size_t>(g.heads * g.head_dim)), w(static_cast<size_t>(g.heads)), k(static_cast<size_t>(g.head_dim)),
        logits(static_cast<size_t>(max_keys)), entries(static_cast<size_t>(max_keys)),
        mark(checker ? static_cast<size_t>(max_keys) : 0, -1), ref_mark(checker ? static_cast<size_t>(max_keys) : 0, -1),
        pos(checker ? static_cast<size_t>(std::min(g.topk, max_keys)) : 0) {}
};

int64_t max_keys_of(const ProblemGeometry& g) {
  int64_t m = 0;
  for (int64_t n : g.k_len) m = std::max(m, n);
  return m;
}

/// The row's view of the inputs: where its query, weights and keys are.
struct RowAccess {
  const IndexerTopkInputs& in;
  const ProblemGeometry& g;
  int64_t r = 0, b = 0, t = 0, lo = 0, hi = 0;

  RowAccess(const IndexerTopkInputs& in_, const IndexerTopkOptions& opt, const ProblemGeometry& g_, int64_t r_)
      : in(in_), g(g_), r(r_) {
    g.q_row_coords(r, &b, &t);
    topk_visible_range(in, opt, g, r, &lo, &hi);
  }
  /// Loads the row's index_q and weights into s (fp64; e4m3: the weights times index_q_scale).
  void load_row(TopkScratch& s) const {
    const bool thd = g.layout == Layout::thd;
    const int64_t H = g.heads, D = g.head_dim;
    const TensorView& q = in.index_q;
    const int64_t q_row = row_offset(q, g.layout, r, g.s_q), q_hs = q.strides[thd ? 1 : 2], q_ds = q.strides[thd ? 2 : 3];
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d) s.q[h * D + d] = load_element(q.dtype, q.data, q_row + h * q_hs + d * q_ds);
    }
    const TensorView& w = in.weights;
    const int64_t w_row = row_offset(w, g.layout, r, g.s_q), w_hs = w.strides[thd ? 1 : 2];
    for (int64_t h = 0; h < H; ++h) s.w[h] = load_element(w.dtype, w.data, w_row + h * w_hs);
    const TensorView& qs = in.index_q_scale;
    if (qs.present()) {
      const int64_t qs_row = row_offset(qs, g.layout, r, g.s_q), qs_hs = qs.strides[thd ? 1 : 2];
      for (int64_t h = 0; h < H; ++h) s.w[h] *= load_element(qs.dtype, qs.data, qs_row + h * qs_hs);
    }
  }
  /// Loads the key at position `pos` of the row's sequence into s.k (and its
  /// index_k_scale into s.k_scale: 1 when absent).
  void load_key(TopkScratch& s, int64_t pos) const {
    const TensorView& k = in.index_k;
    const int64_t key_row = g.k_start[b] + pos;
    const int64_t off = row_offset(k, g.layout, key_row, g.s_kv);
    const int64_t k_ds = k.strides[g.layout == Layout::thd ? 1 : 2];
    for (int64_t d = 0; d < g.head_dim; ++d) s.k[d] = load_element(k.dtype, k.data, off + d * k_ds);
    const TensorView& ks = in.index_k_scale;
    s.k_scale = 1.0;
    if (ks.present()) {
      const int64_t ks_off = g.layout == Layout::thd ? key_row * ks.strides[0]
                                                     : (key_row / g.s_kv) * ks.strides[0] + (key_row % g.s_kv) * ks.strides[1];
      s.k_scale = load_element(ks.dtype, ks.data, ks_off);
    }
  }
  /// I of the key loaded in s.k. ReLU keeps NaN (x < 0 is false for it).
  double logit(const TopkScratch& s) const {
    const int64_t H = g.heads, D = g.head_dim;
    double sum = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      const double* qh = &s.q[h * D];
      double dot = 0.0;
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * s.k[d];
      sum += s.w[h] * (dot < 0.0 ? 0.0 : dot);
    }
    return in.index_k_scale.present() ? s.k_scale * sum : sum;
  }
  /// The header's bound beta of the key loaded in s.k:
  /// 2^-21 (D + H) sum_h |w_h| sum_d |q_hd k_d| (e4m3: 17 D + H + 2, times |k_scale|,
  /// w_h including index_q_scale: fp8 wgmma's accumulation, 2^-12 per k32 block).
  double beta(const TopkScratch& s) const {
    const int64_t H = g.heads, D = g.head_dim;
    double sum = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      const double* qh = &s.q[h * D];
      double a = 0.0;
      for (int64_t d = 0; d < D; ++d) a += std::fabs(qh[d] * s.k[d]);
      sum += std::fabs(s.w[h]) * a;
    }
    if (in.index_q.dtype == DType::e4m3) {
      return std::ldexp(static_cast<double>(17 * D + H + 2), -21) * std::fabs(s.k_scale) * sum;
    }
    return std::ldexp(static_cast<double>(D + H), -21) * sum;
  }
  double beta_at(TopkScratch& s, int64_t pos) const {
    load_key(s, pos);
    return beta(s);
  }
  int64_t id_of(int64_t pos) const { return g.id_mode == IdMode::local ? pos : g.k_start[b] + pos; }
  /// The position of `id` in the row's sequence, or -1 when it is not one of its keys.
  int64_t pos_of(int64_t id) const {
    const int64_t pos = g.id_mode == IdMode::local ? id : id - g.k_start[b];
    return (pos >= 0 && pos < g.k_len[b]) ? pos : -1;
  }
};

/// Every visible key's logit (s.logits) and the row's selection: s.entries'
/// first min(topk, keys seen) in rank order; returns that count.
int64_t select_row(const RowAccess& a, TopkScratch& s, int64_t topk) {
  const int64_t n = a.hi - a.lo;
  if (n == 0) return 0;
  a.load_row(s);
  for (int64_t i = 0; i < n; ++i) {
    a.load_key(s, a.lo + i);
    s.logits[i] = a.logit(s);
    s.entries[i] = {rank_key(s.logits[i]), a.lo + i};
  }
  const int64_t c = std::min(topk, n);
  Entry* e = s.entries.data();
  if (c < n) std::nth_element(e, e + (c - 1), e + n, ranks_before);
  std::sort(e, e + c, ranks_before);
  return c;
}

/// The selection's entries in options.order.
void order_selection(TopkScratch& s, int64_t c, TopkOrder order) {
  if (order == TopkOrder::id_ascending) {
    std::sort(s.entries.begin(), s.entries.begin() + c, [](const Entry& x, const Entry& y) { return x.pos < y.pos; });
  }
}

std::vector<TopkScratch> make_scratch(const ProblemGeometry& g, int threads, bool checker) {
  std::vector<TopkScratch> scratch;
  scratch.reserve(static_cast<size_t>(threads));
  const int64_t m = max_keys_of(g);
  for (int t = 0; t < threads; ++t) scratch.emplace_back(g, m, checker);
  return scratch;
}

const char* const kOutOfMemory =
    "out of memory: expected room in host memory for the fp64 top-k (each worker thread holds the logits of its "
    "row's keys), got an allocation failure";

}  // namespace

void run_cpu_indexer_topk(const IndexerTopkInputs& in, const IndexerTopkOutputs& out, const IndexerTopkOptions& opt,
                          const ProblemGeometry& g) {
  const IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ would read subnormals as 0 (float_mode.hpp)
  const int threads = thread_count(opt.num_threads, g.num_q_rows);
  // Every buffer is allocated here, before any worker runs or anything is written.
  std::vector<TopkScratch> scratch;
  allocation_failure_as_out_of_memory(kOutOfMemory, [&] {
    scratch = make_scratch(g, threads, false);
    return 0;
  });
  const int64_t K = g.topk;
  auto* ids = static_cast<int32_t*>(out.topk_indices.data);
  auto* lengths = static_cast<int32_t*>(out.topk_lengths.data);
  const bool logits = out.topk_logits.present();
  // The outputs are contiguous (validated): row r starts at element r * K.
  parallel_for(threads, g.num_q_rows, 4, [&](int64_t r, int tid) {
    TopkScratch& s = scratch[tid];
    const RowAccess a(in, opt, g, r);
    const int64_t c = select_row(a, s, K);
    order_selection(s, c, opt.order);
    for (int64_t i = 0; i < K; ++i) {
      ids[r * K + i] = i < c ? static_cast<int32_t>(a.id_of(s.entries[i].pos)) : -1;
      if (logits) {
        const double v = i < c ? s.logits[s.entries[i].pos - a.lo] : -std::numeric_limits<double>::infinity();
        store_element(out.topk_logits.dtype, out.topk_logits.data, r * K + i, v);
      }
    }
    if (lengths) lengths[r] = static_cast<int32_t>(c);
  });
}

namespace {

/// Checks one row of a candidate; returns "" or why it fails, and adds to the
/// row's counts.
struct RowVerdict {
  std::string failure;
  int64_t exchanged = 0;
  double max_logit_error = 0;
  bool logit_error = false;
};

std::string fmt(double v) {
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

RowVerdict check_row(const RowAccess& a, TopkScratch& s, const IndexerTopkOptions& opt, const IndexerTopkOutputs& cand,
                     int64_t K) {
  RowVerdict v;
  const int64_t r = a.r;
  const int64_t c = select_row(a, s, K);
  const int64_t n = a.hi - a.lo;
  const int32_t* ids = static_cast<const int32_t*>(cand.topk_indices.data) + r * K;
  auto fail = [&](const std::string& why) {
    if (v.failure.empty()) v.failure = why;
  };
  // Count.
  if (cand.topk_lengths.present()) {
    const int32_t len = static_cast<const int32_t*>(cand.topk_lengths.data)[r];
    if (len != c) {
      fail("topk_lengths: expected " + std::to_string(c) + " (min(topk, " + std::to_string(n) + " keys seen)), got " +
           std::to_string(len));
      return v;
    }
  }
  // Ids: visible and distinct before the count, -1 after it.
  std::vector<int64_t>& pos = s.pos;  // c <= min(topk, max keys) entries
  for (int64_t i = 0; i < K; ++i) {
    const int64_t id = ids[i];
    if (i >= c) {
      if (id != -1) fail("topk_indices: slot " + std::to_string(i) + ": expected -1 past the count " + std::to_string(c) + ", got id " + std::to_string(id));
      continue;
    }
    const int64_t p = a.pos_of(id);
    if (id == -1 || p < a.lo || p >= a.hi) {
      fail("topk_indices: slot " + std::to_string(i) + ": expected an id the row sees (" + std::to_string(n) +
           " keys, positions [" + std::to_string(a.lo) + ", " + std::to_string(a.hi) + ")), got id " + std::to_string(id));
      return v;
    }
    if (s.mark[p - a.lo] == r) {
      fail("topk_indices: slot " + std::to_string(i) + ": expected distinct ids, got id " + std::to_string(id) + " again");
      return v;
    }
    s.mark[p - a.lo] = r;
    pos[i] = p;
  }
  if (!v.failure.empty()) return v;
  for (int64_t i = 0; i < c; ++i) s.ref_mark[s.entries[i].pos - a.lo] = r;
  auto exact = [&](int64_t p) { return s.logits[p - a.lo]; };

  // The set: every exchanged key a near-tie.
  if (c > 0) {
    const int64_t kth = s.entries[c - 1].pos;
    const double lk = exact(kth);
    double beta_k = -1;
    // Every pair of a selected x and a left-out y: y - beta_y <= x + beta_x,
    // and not y >= x when both bounds are 0 (those logits are exact, so the
    // tie goes by id): over the extremes, max_y <= min_x and max_y0 < min_x0
    // (the same over the keys of bound 0).
    double max_y = -INFINITY, min_x = INFINITY, max_y0 = -INFINITY, min_x0 = INFINITY;
    auto exchanged_key = [&](int64_t p, bool in_candidate) {
      const double e = exact(p);
      if (!std::isfinite(e) || !std::isfinite(lk)) {
        fail(std::string("topk_indices: expected the reference's keys of non-finite logits exactly, got key ") +
             std::to_string(a.id_of(p)) + (in_candidate ? " selected" : " left out") + " (exact logit " + fmt(e) + ")");
        return;
      }
      if (beta_k < 0) beta_k = a.beta_at(s, kth);
      const double b = a.beta_at(s, p);
      if (in_candidate) {
        if (e < lk - (b + beta_k)) {
          fail("topk_indices: expected a near-tie of the k-th logit " + fmt(lk) + " (within " + fmt(b + beta_k) +
               "), got key " + std::to_string(a.id_of(p)) + " of exact logit " + fmt(e) + " selected");
        }
        min_x = std::min(min_x, e + b);
        if (b == 0) min_x0 = std::min(min_x0, e);
      } else {
        if (e > lk + (b + beta_k)) {
          fail("topk_indices: expected a near-tie of the k-th logit " + fmt(lk) + " (within " + fmt(b + beta_k) +
               "), got key " + std::to_string(a.id_of(p)) + " of exact logit " + fmt(e) + " left out");
        }
        max_y = std::max(max_y, e - b);
        if (b == 0) max_y0 = std::max(max_y0, e);
      }
    };
    for (int64_t i = 0; i < c; ++i) {
      if (s.ref_mark[pos[i] - a.lo] != r) {
        ++v.exchanged;
        exchanged_key(pos[i], true);
      }
    }
    for (int64_t i = 0; i < c; ++i) {
      if (s.mark[s.entries[i].pos - a.lo] != r) exchanged_key(s.entries[i].pos, false);
    }
    if (v.failure.empty() && (max_y > min_x || max_y0 >= min_x0)) {
      fail("topk_indices: expected every key left out within the bounds of every key selected in its place, got a "
           "left-out key of exact logit minus bound " + fmt(max_y) + " above a selected one's plus bound " + fmt(min_x));
    }
    if (!v.failure.empty()) return v;
  }

  // The order.
  const bool with_logits = cand.topk_logits.present();
  std::vector<double> cl(with_logits ? static_cast<size_t>(K) : 0);
  for (int64_t i = 0; i < (with_logits ? K : 0); ++i) cl[i] = load_element(cand.topk_logits.dtype, cand.topk_logits.data, r * K + i);
  for (int64_t i = 0; i + 1 < c; ++i) {
    const std::string where = "topk_indices: slots " + std::to_string(i) + ", " + std::to_string(i + 1) + ": expected ";
    if (opt.order == TopkOrder::id_ascending) {
      if (ids[i] >= ids[i + 1]) fail(where + "ids ascending, got " + std::to_string(ids[i]) + ", " + std::to_string(ids[i + 1]));
      continue;
    }
    if (with_logits) {
      const Entry x{rank_key(cl[i]), ids[i]}, y{rank_key(cl[i + 1]), ids[i + 1]};
      if (ranks_before(x, y)) continue;
      // The cpu backend ranks by fp64 logits and may write them as f32: two
      // keys whose fp64 logits differ can round to one f32 value, and their
      // order is then the fp64 one.
      if (opt.backend == Backend::cpu && x.key == y.key) {
        const Entry ex{rank_key(exact(pos[i])), pos[i]}, ey{rank_key(exact(pos[i + 1])), pos[i + 1]};
        if (ranks_before(ex, ey)) continue;
      }
      fail(where + "the candidate's logits descending, equal ones by id, got (" + fmt(cl[i]) + ", id " +
           std::to_string(ids[i]) + ") before (" + fmt(cl[i + 1]) + ", id " + std::to_string(ids[i + 1]) + ")");
      continue;
    }
    const Entry x{rank_key(exact(pos[i])), pos[i]}, y{rank_key(exact(pos[i + 1])), pos[i + 1]};
    if (ranks_before(x, y)) continue;
    const double bound = a.beta_at(s, pos[i]) + a.beta_at(s, pos[i + 1]);
    const double gap = exact(pos[i + 1]) - exact(pos[i]);
    if (!(gap <= bound && bound > 0)) {
      fail(where + "logits descending (equal ones by id), got exact logits " + fmt(exact(pos[i])) + ", " +
           fmt(exact(pos[i + 1])) + " (bound " + fmt(bound) + ")");
    }
  }
  if (!v.failure.empty()) return v;

  // The logits: each within its key's bound of the exact one, -inf past the count.
  for (int64_t i = 0; i < (with_logits ? K : 0); ++i) {
    const double got = cl[i];
    if (i >= c) {
      if (!(std::isinf(got) && got < 0)) fail("topk_logits: slot " + std::to_string(i) + ": expected -inf past the count, got " + fmt(got));
      continue;
    }
    const double e = exact(pos[i]);
    double ratio;
    if (std::isnan(e) || std::isnan(got) || std::isinf(e) || std::isinf(got)) {
      ratio = (std::isnan(e) && std::isnan(got)) || e == got ? 0.0 : INFINITY;
    } else {
      const double b = a.beta_at(s, pos[i]);
      const double err = std::fabs(got - e);
      ratio = err == 0 ? 0.0 : (b > 0 ? err / b : INFINITY);
    }
    v.max_logit_error = std::max(v.max_logit_error, ratio);
    if (ratio > 1.0) {
      v.logit_error = true;
      fail("topk_logits: slot " + std::to_string(i) + " (id " + std::to_string(ids[i]) + "): expected " + fmt(e) +
           " within its bound, got " + fmt(got) + " (" + fmt(ratio) + " bounds away)");
    }
  }
  return v;
}

}  // namespace
}  // namespace dsaib::detail

namespace dsaib {

ReferenceTopk reference_indexer_topk(const IndexerTopkInputs& inputs, const IndexerTopkOptions& options, int64_t topk) {
  const detail::IeeeSubnormalsScope ieee;
  IndexerTopkOptions opt = options;
  opt.backend = Backend::cpu;
  const detail::ProblemGeometry g = detail::validate_topk_problem(inputs, nullptr, opt, nullptr, false, topk);
  const int threads = detail::thread_count(opt.num_threads, g.num_q_rows);
  ReferenceTopk res;
  res.num_q_rows = g.num_q_rows;
  res.topk = g.topk;
  const int64_t K = g.topk;
  std::vector<detail::TopkScratch> scratch;
  detail::allocation_failure_as_out_of_memory(detail::kOutOfMemory, [&] {
    const auto n = static_cast<size_t>(g.num_q_rows * K);
    res.topk_indices.assign(n, -1);
    res.topk_logits.assign(n, -std::numeric_limits<double>::infinity());
    res.topk_bounds.assign(n, 0.0);
    res.topk_lengths.assign(static_cast<size_t>(g.num_q_rows), 0);
    scratch = detail::make_scratch(g, threads, false);
    return 0;
  });
  detail::parallel_for(threads, g.num_q_rows, 4, [&](int64_t r, int tid) {
    detail::TopkScratch& s = scratch[tid];
    const detail::RowAccess a(inputs, opt, g, r);
    const int64_t c = detail::select_row(a, s, K);
    detail::order_selection(s, c, opt.order);
    for (int64_t i = 0; i < c; ++i) {
      const int64_t p = s.entries[i].pos;
      res.topk_indices[r * K + i] = static_cast<int32_t>(a.id_of(p));
      res.topk_logits[r * K + i] = s.logits[p - a.lo];
      res.topk_bounds[r * K + i] = a.beta_at(s, p);
    }
    res.topk_lengths[r] = static_cast<int32_t>(c);
  });
  return res;
}

TopkCheck check_indexer_topk(const IndexerTopkInputs& inputs, const IndexerTopkOptions& options,
                             const IndexerTopkOutputs& candidate) {
  const detail::IeeeSubnormalsScope ieee;
  IndexerTopkOptions opt = options;
  opt.backend = Backend::cpu;
  const detail::ProblemGeometry g = detail::validate_topk_problem(inputs, &candidate, opt, nullptr, false);
  const int threads = detail::thread_count(opt.num_threads, g.num_q_rows);
  std::vector<detail::TopkScratch> scratch;
  std::vector<detail::RowVerdict> rows;
  detail::allocation_failure_as_out_of_memory(detail::kOutOfMemory, [&] {
    scratch = detail::make_scratch(g, threads, true);
    rows.resize(static_cast<size_t>(g.num_q_rows));
    return 0;
  });
  detail::parallel_for(threads, g.num_q_rows, 4, [&](int64_t r, int tid) {
    const detail::RowAccess a(inputs, opt, g, r);
    rows[r] = detail::check_row(a, scratch[tid], opt, candidate, g.topk);
  });
  TopkCheck res;
  res.rows = g.num_q_rows;
  for (int64_t r = 0; r < g.num_q_rows; ++r) {
    const detail::RowVerdict& v = rows[r];
    res.exchanged_ids += v.exchanged;
    res.max_logit_error = std::max(res.max_logit_error, v.max_logit_error);
    res.max_logit_error_rows += v.logit_error ? 1 : 0;
    if (!v.failure.empty() && res.first_failure.empty()) {
      int64_t b, t;
      g.q_row_coords(r, &b, &t);
      res.first_failure = "row " + std::to_string(r) + " (b=" + std::to_string(b) + ", t=" + std::to_string(t) + "): " + v.failure;
    }
  }
  res.pass = res.first_failure.empty();
  return res;
}

}  // namespace dsaib
