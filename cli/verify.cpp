// Verification of backward outputs against the fp64 reference.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "cli.hpp"
#include "dsaib/reference.hpp"
#include "core/threads.hpp"

namespace dsaib::cli {
namespace {

double tolerance(DType dt) { return dt == DType::bf16 ? 3e-3 : 1e-3; }

/// The smallest positive (subnormal) value of an output dtype: 2^-133 (bf16), 2^-149
/// (fp32). Rounding to the dtype may err by up to this much where the reference
/// lies below the dtype's normal range (a result of 1e-48 is 0 in either), so an
/// element's error counts only beyond it (docs/math.md §6).
double subnormal_spacing(DType dt) { return dt == DType::bf16 ? 0x1p-133 : 0x1p-149; }

/// Accumulates |got - ref| statistics; got is element `out_index` of the output tensor.
struct Accumulator {
  Metric m;
  double err2 = 0, ref2 = 0, spacing = 0;
  int64_t ref_counted = 0;  // elements with a finite reference value (in ref2)
  Accumulator(const char* name, const HostTensor& out, double ref_floor = 0) {
    m.name = name;
    m.ref_floor = ref_floor;
    m.shape = out.shape;
    m.dtype = out.dtype;
    m.tol = tolerance(out.dtype);
    spacing = subnormal_spacing(out.dtype);
  }
  void add(double got, double ref) {
    ++m.compared;
    // The reference's size is reported also where the output is not finite (an
    // overflow of the output dtype shows as a reference beyond its range).
    if (std::isfinite(ref)) {
      ref2 += ref * ref;
      ++ref_counted;
      m.ref_max_abs = std::max(m.ref_max_abs, std::abs(ref));
    } else {
      ++m.ref_nonfinite;
    }
    if (!std::isfinite(got)) ++m.nonfinite;
    if (!std::isfinite(got) || !std::isfinite(ref)) return;
    const double e = got - ref;
    const double counted = std::max(std::abs(e) - spacing, 0.0);  // beyond the dtype's resolution at 0
    err2 += counted * counted;
    m.max_abs = std::max(m.max_abs, std::abs(e));
  }
  Metric finish() {
    m.ref_rms = std::sqrt(ref2 / static_cast<double>(std::max<int64_t>(ref_counted, 1)));
    if (m.nonfinite > 0 || m.ref_nonfinite > 0) {
      m.rel_rms = std::numeric_limits<double>::quiet_NaN();
      m.max_abs = std::numeric_limits<double>::quiet_NaN();
    } else {
      // A reference of (near) zero norm, such as exact gradients of 0 that the
      // fp64 reference only approaches to its own rounding, is measured against
      // the floor instead of itself.
      const double n = static_cast<double>(std::max<int64_t>(ref_counted, 1));
      const double denominator = std::max(ref2, m.ref_floor * m.ref_floor * n);
      m.rel_rms = denominator > 0 ? std::sqrt(err2 / denominator)
                                  : (err2 > 0 ? std::numeric_limits<double>::infinity() : 0.0);
    }
    m.pass = m.nonfinite == 0 && m.ref_nonfinite == 0 && m.rel_rms <= m.tol;  // NaN never passes
    return m;
  }
};

IndexerOptions reference_options(const Problem& p, int32_t threads) {
  IndexerOptions opt = p.options;
  opt.backend = Backend::cpu;
  opt.num_threads = threads;
  return opt;
}

/// `count` distinct values drawn at random from `pool`.
std::vector<int64_t> pick(std::vector<int64_t> pool, size_t count, std::mt19937_64& rng) {
  std::shuffle(pool.begin(), pool.end(), rng);
  if (pool.size() > count) pool.resize(count);
  return pool;
}

/// The reference floors of d_index_q, d_weights and d_index_k: 2^-24 (the fp32
/// rounding of one term) times the largest size one valid slot's term can have
/// in the rows the operation reads,
///   d_index_q: |c| sm_scale max|w| max|k|,  d_weights: |c| sm_scale max|q_h| max|k|,
///   d_index_k: |c| sm_scale max|w| max|q_h|   (|q_h|, |k|: Euclidean norms of rows),
/// with c = grad_loss * loss_coeff / N (|gs| <= 2|c| bounds a slot's score gradient).
std::array<double, 3> reference_floors(const Problem& p, const Geometry& g) {
  const IndexerOptions& o = p.options;
  const double n = static_cast<double>(std::max<int64_t>(g.normalization_count, 1));
  const double c = std::abs(static_cast<double>(o.grad_loss) * static_cast<double>(o.loss_coeff) / n);
  const double scale = 2.0 * c * std::abs(static_cast<double>(o.sm_scale)) * 0x1p-24;
  // Over the rows the operation reads (as the non-finite check counts them): a
  // query row's heads when it holds a valid slot, a key row when a valid slot
  // selects it. `per_row` vectors of `row` elements per flat row.
  const auto max_norm = [&](const char* name, int64_t row, int64_t per_row, const std::vector<uint8_t>& read) {
    const auto it = p.tensors.find(name);
    if (it == p.tensors.end() || row <= 0) return 0.0;
    double best = 0;
    for (int64_t v = 0; v * row < it->second.numel(); ++v) {
      const size_t flat_row = static_cast<size_t>(v / per_row);
      if (flat_row >= read.size() || !read[flat_row]) continue;
      double s = 0;
      for (int64_t e = 0; e < row; ++e) s += element(it->second, v * row + e) * element(it->second, v * row + e);
      if (std::isfinite(s)) best = std::max(best, s);
    }
    return std::sqrt(best);
  };
  const double q = max_norm("index_q", g.head_dim, g.heads, g.q_row_used),
               k = max_norm("index_k", g.head_dim, 1, g.key_selected), w = max_norm("weights", 1, g.heads, g.q_row_used);
  return {scale * w * k, scale * q * k, scale * w * q};
}

}  // namespace

bool Verification::pass() const {
  return std::all_of(metrics.begin(), metrics.end(), [](const Metric& m) { return m.pass; });
}

Verification verify_all(const Problem& p, const Geometry& g, const RunResult& r, int32_t threads) {
  Verification v;
  v.mode = "all";
  const auto t0 = std::chrono::steady_clock::now();
  log_stage("verify: fp64 reference of all " + std::to_string(g.num_q_rows) + " query rows (" +
            std::to_string(resolve_threads(threads)) + " threads) ...");
  const ReferenceGradients ref = reference_backward(p.inputs(), reference_options(p, threads));
  log_stage("verify: reference done in " + human_seconds(seconds_since(t0)));
  const std::pair<const char*, const HostTensor*> outs[3] = {
      {"d_index_q", &r.d_index_q}, {"d_weights", &r.d_weights}, {"d_index_k", &r.d_index_k}};
  const std::vector<double>* refs[3] = {&ref.d_index_q, &ref.d_weights, &ref.d_index_k};
  const std::array<double, 3> floors = reference_floors(p, g);
  for (int i = 0; i < 3; ++i) {
    Accumulator acc(outs[i].first, *outs[i].second, floors[static_cast<size_t>(i)]);
    const int64_t n = outs[i].second->numel();
    for (int64_t e = 0; e < n; ++e) acc.add(element(*outs[i].second, e), (*refs[i])[static_cast<size_t>(e)]);
    v.metrics.push_back(acc.finish());
  }
  v.seconds = seconds_since(t0);
  return v;
}

Verification verify_sampled(const Problem& p, const Geometry& g, const RunResult& r, int64_t sample_rows,
                            uint64_t seed, int32_t threads) {
  Verification v;
  v.mode = "sample";
  const auto t0 = std::chrono::steady_clock::now();
  std::mt19937_64 rng(seed ^ 0x5eed5eedULL);
  const size_t want = static_cast<size_t>(std::max<int64_t>(sample_rows, 1));

  // Query rows: the first and the last row, and random others.
  if (g.num_q_rows > 0) {
    std::vector<int64_t> pool;
    for (int64_t row = 1; row + 1 < g.num_q_rows; ++row) pool.push_back(row);
    v.q_rows = pick(pool, want > 2 ? want - 2 : 0, rng);
    v.q_rows.push_back(0);
    if (g.num_q_rows > 1) v.q_rows.push_back(g.num_q_rows - 1);
    std::sort(v.q_rows.begin(), v.q_rows.end());
  }
  // Key rows: mostly selected ones (their dK is nonzero), plus up to 2 never selected (dK must be 0).
  // At least one selected row whenever there is one: with --sample-rows 1 or 2 the never-selected
  // rows alone would be compared, whose reference is 0, and no dK value could fail the check.
  std::vector<int64_t> selected, unselected;
  for (int64_t j = 0; j < g.num_k_rows; ++j) (g.key_selected[static_cast<size_t>(j)] ? selected : unselected).push_back(j);
  // When fewer rows are selected than that leaves room for, never-selected rows fill the rest
  // (the sample has `want` rows whenever the table has them).
  const size_t room_for_unselected = selected.empty() ? want : want - 1;
  const size_t n_unsel = std::min<size_t>({unselected.size(), 2, room_for_unselected});
  const size_t n_sel = std::min(selected.size(), want - n_unsel);
  v.k_rows = pick(selected, n_sel, rng);
  const auto extra = pick(unselected, std::min(unselected.size(), want - n_sel), rng);
  v.k_rows.insert(v.k_rows.end(), extra.begin(), extra.end());
  std::sort(v.k_rows.begin(), v.k_rows.end());

  const int64_t H = g.heads, D = g.head_dim;
  const IndexerInputs in = p.inputs();
  const IndexerOptions opt = reference_options(p, 1);
  log_stage("verify: fp64 reference of " + std::to_string(v.q_rows.size()) + " sampled query rows and " +
            std::to_string(v.k_rows.size()) + " sampled key rows ...");

  // Work items: chunks of query rows, and the key rows as one item (its cost is a scan of all ids).
  const int T = resolve_threads(threads);
  const size_t chunk = std::max<size_t>(1, v.q_rows.size() / (4 * static_cast<size_t>(T)));
  std::vector<std::pair<size_t, size_t>> items;
  for (size_t b = 0; b < v.q_rows.size(); b += chunk) items.emplace_back(b, std::min(v.q_rows.size(), b + chunk));
  const size_t key_item = items.size();
  items.emplace_back(0, 0);
  std::vector<double> ref_dq(v.q_rows.size() * H * D), ref_dw(v.q_rows.size() * H), ref_dk;
  std::atomic<size_t> next{0};
  std::atomic<size_t> rows_done{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto last_log = std::chrono::steady_clock::now();
  std::mutex log_mutex;
  auto worker = [&] {
    for (size_t it; !failed && (it = next++) < items.size();) {
      try {
        if (it == key_item) {
          const auto res = reference_backward_sampled(in, opt, {}, v.k_rows);
          ref_dk = res.d_index_k;
        } else {
          const std::vector<int64_t> rows(v.q_rows.begin() + items[it].first, v.q_rows.begin() + items[it].second);
          const auto res = reference_backward_sampled(in, opt, rows, {});
          std::copy(res.d_index_q.begin(), res.d_index_q.end(), ref_dq.begin() + items[it].first * H * D);
          std::copy(res.d_weights.begin(), res.d_weights.end(), ref_dw.begin() + items[it].first * H);
          const size_t done = rows_done += rows.size();
          std::lock_guard<std::mutex> lock(log_mutex);
          if (seconds_since(last_log) > 2.0) {
            last_log = std::chrono::steady_clock::now();
            log_stage("verify: " + std::to_string(done) + "/" + std::to_string(v.q_rows.size()) + " query rows");
          }
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  };
  // At most one thread per work item; a thread the system refuses leaves its
  // items to the running ones (detail::run_items_on_threads).
  const int workers = static_cast<int>(std::min<size_t>(static_cast<size_t>(T), items.size()));
  detail::run_items_on_threads(workers, [&](int) { worker(); });
  if (error) std::rethrow_exception(error);
  log_stage("verify: reference done in " + human_seconds(seconds_since(t0)));

  const std::array<double, 3> floors = reference_floors(p, g);
  Accumulator aq("d_index_q", r.d_index_q, floors[0]), aw("d_weights", r.d_weights, floors[1]),
      ak("d_index_k", r.d_index_k, floors[2]);
  for (size_t n = 0; n < v.q_rows.size(); ++n) {
    const int64_t row = v.q_rows[n];
    for (int64_t e = 0; e < H * D; ++e) aq.add(element(r.d_index_q, row * H * D + e), ref_dq[n * H * D + e]);
    for (int64_t h = 0; h < H; ++h) aw.add(element(r.d_weights, row * H + h), ref_dw[n * H + h]);
  }
  for (size_t n = 0; n < v.k_rows.size(); ++n) {
    for (int64_t d = 0; d < D; ++d) ak.add(element(r.d_index_k, v.k_rows[n] * D + d), ref_dk[n * D + d]);
  }
  v.metrics = {aq.finish(), aw.finish(), ak.finish()};
  v.seconds = seconds_since(t0);
  return v;
}

Verification verify_forward(const Problem& p, const RunResult& r, int32_t threads, ReferenceKLForward* reference) {
  Verification v;
  v.mode = "all";
  const auto t0 = std::chrono::steady_clock::now();
  log_stage("verify: fp64 reference forward (" + std::to_string(resolve_threads(threads)) + " threads) ...");
  IndexerInputs in = p.inputs();
  in.index_score = TensorView{};
  *reference = reference_kl_forward(in, reference_options(p, threads));
  const ReferenceKLForward& ref = *reference;
  log_stage("verify: reference done in " + human_seconds(seconds_since(t0)));

  // The loss: its relative error.
  Accumulator loss("loss", r.loss);
  loss.add(element(r.loss, 0), ref.loss);
  Metric ml = loss.finish();
  ml.tol = 1e-6;
  // Beyond f32's resolution at 0, as for every output (a loss of 1e-42 is a
  // subnormal of a few significant bits).
  ml.rel_rms = std::max(ml.max_abs - subnormal_spacing(DType::f32), 0.0) / std::max(std::abs(ref.loss), 1e-300);
  ml.pass = ml.nonfinite == 0 && ml.ref_nonfinite == 0 && ml.rel_rms <= ml.tol;
  v.metrics.push_back(ml);
  if (r.row_lse.empty()) {
    v.seconds = seconds_since(t0);
    return v;
  }

  // row_lse: the largest absolute error over rows with a valid slot; the others -inf.
  // The bound is 1e-5 plus the f32 rounding of the largest |LSE| (|LSE|·2^-24):
  // an f32 LSE of 4700 cannot be nearer than 2.8e-4 to the exact one.
  Accumulator lse("row_lse", r.row_lse);
  int64_t wrong_empty_rows = 0;
  double largest_lse = 0.0;
  for (int64_t row = 0; row < r.row_lse.numel(); ++row) {
    const double got = element(r.row_lse, row), want = ref.row_lse[static_cast<size_t>(row)];
    if (std::isinf(want) && want < 0) {
      wrong_empty_rows += got == want ? 0 : 1;
      continue;
    }
    if (std::isfinite(want)) largest_lse = std::max(largest_lse, std::abs(want));
    lse.add(got, want);
  }
  Metric mlse = lse.finish();
  mlse.tol = 1e-5 + largest_lse * 0x1p-24;
  mlse.nonfinite += wrong_empty_rows;
  mlse.pass = mlse.nonfinite == 0 && mlse.ref_nonfinite == 0 && mlse.max_abs <= mlse.tol;
  v.metrics.push_back(mlse);

  // row_target_mass: relative RMS, against its definition for the LSE as
  // written (the f32 row_lse): the mass divided by sum_i exp(z_i - row_lse) =
  // exp(LSE - row_lse), i.e. the fp64 mass times exp(row_lse - LSE).
  Accumulator mass("row_target_mass", r.row_target_mass);
  for (int64_t row = 0; row < r.row_target_mass.numel(); ++row) {
    const auto i = static_cast<size_t>(row);
    const double lse_got = element(r.row_lse, row);
    double want = ref.row_target_mass[i];
    if (std::isfinite(lse_got) && std::isfinite(ref.row_lse[i])) want *= std::exp(lse_got - ref.row_lse[i]);
    mass.add(element(r.row_target_mass, row), want);
  }
  Metric mm = mass.finish();
  mm.tol = 1e-5;
  mm.pass = mm.nonfinite == 0 && mm.ref_nonfinite == 0 && mm.rel_rms <= mm.tol;
  v.metrics.push_back(mm);

  // P: the largest relative error where the reference is >= 1e-30, absolute 1e-30 below.
  Accumulator score("index_score", r.index_score);
  double max_rel = 0;
  bool small_ok = true;
  for (int64_t e = 0; e < r.index_score.numel(); ++e) {
    const double got = element(r.index_score, e), want = ref.index_score[static_cast<size_t>(e)];
    score.add(got, want);
    if (!std::isfinite(got)) continue;
    if (want >= 1e-30) max_rel = std::max(max_rel, std::abs(got - want) / want);
    else small_ok = small_ok && std::abs(got - want) <= 1e-30;
  }
  Metric mp = score.finish();
  mp.tol = 1e-5;
  mp.pass = mp.nonfinite == 0 && mp.ref_nonfinite == 0 && max_rel <= mp.tol && small_ok;
  v.metrics.push_back(mp);
  v.seconds = seconds_since(t0);
  return v;
}

std::vector<Metric> verify_against_stored(const Problem& p, const RunResult& r, const std::string& prefix) {
  std::vector<Metric> out;
  const std::pair<const char*, const HostTensor*> outs[3] = {
      {"d_index_q", &r.d_index_q}, {"d_weights", &r.d_weights}, {"d_index_k", &r.d_index_k}};
  for (const auto& [name, t] : outs) {
    const auto it = p.tensors.find(prefix + name);
    if (it == p.tensors.end()) continue;  // shape and dtype were checked by load_problem
    Accumulator acc(name, *t);
    acc.m.name = prefix + name;
    for (int64_t e = 0; e < t->numel(); ++e) acc.add(element(*t, e), element(it->second, e));
    out.push_back(acc.finish());
  }
  return out;
}

}  // namespace dsaib::cli
