// fp64 reference of the DSA indexer backward (docs/math.md).
//
// Per query row r (sequence b), over its valid slots i:
//   stage 1: g_i = -c*max(T_i,eps)*[P_i>=eps], G = sum g_i, gs_i = g_i - P_i*G
//            (P-free form: P_i = exp(z_i - row_lse) from the logits, G = -c*row_target_mass)
//   stage 2: x_hi = q_h.k_{id_i}; dW_h = sm_scale*sum gs_i relu(x_hi);
//            a_hi = gs_i*w_h*sm_scale*[x_hi>0]; dQ_h = sum a_hi k; dK_{id_i} += sum_h a_hi q_h
// Threads split query rows statically; each owns an fp64 dK accumulator, and
// the accumulators are summed in thread order, so a run is bitwise
// reproducible for a given thread count.
#include "reference/cpu_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "core/element_access.hpp"
#include "core/float_mode.hpp"
#include "core/threads.hpp"
#include "dsaib/reference.hpp"

namespace dsaib::detail {
namespace {

const double kEps = std::exp(-100.0);

// relu as torch computes it, NaN kept: relu(NaN) = NaN, so a NaN in index_q,
// weights or index_k reaches the logits, the loss and every gradient of its row
// (docs/math.md, "NaN and infinities"). One select, no branch.
inline double relu_keeping_nan(double x) { return x < 0 ? 0.0 : x; }

// relu's derivative is 0 at this x (torch's threshold_backward: x <= 0); a NaN x
// passes the gradient on, as torch's does.
inline bool relu_blocks(double x) { return x <= 0; }

double load(const TensorView& v, int64_t offset) { return load_element(v.dtype, v.data, offset); }

void store(const TensorView& v, int64_t offset, double value) { store_element(v.dtype, v.data, offset, value); }

/// Host-side reader of one problem: flat rows to doubles through strides.
struct ProblemReader {
  const IndexerInputs& in;
  const ProblemGeometry& g;
  /// The P-free form's row statistics in fp64 (the one-call function's forward),
  /// read instead of the row_lse / row_target_mass tensors when set.
  const RowStatistics* stats = nullptr;
  bool thd() const { return g.layout == Layout::thd; }
  bool p_free() const { return stats != nullptr || in.row_lse.present(); }
  double row_lse(int64_t r) const {
    return stats ? stats->lse[r] : load(in.row_lse, row_offset(in.row_lse, g.layout, r, g.s_q));
  }
  double row_target_mass(int64_t r) const {
    return stats ? stats->target_mass[r] : load(in.row_target_mass, row_offset(in.row_target_mass, g.layout, r, g.s_q));
  }

  void q_row(int64_t r, std::vector<double>& q) const {  // (H*D)
    const TensorView& v = in.index_q;
    const int64_t base = row_offset(v, g.layout, r, g.s_q);
    const int hs = thd() ? 1 : 2;
    for (int64_t h = 0; h < g.heads; ++h)
      for (int64_t d = 0; d < g.head_dim; ++d)
        q[h * g.head_dim + d] = load(v, base + h * v.strides[hs] + d * v.strides[hs + 1]);
  }
  void w_row(int64_t r, std::vector<double>& w) const {
    const TensorView& v = in.weights;
    const int64_t base = row_offset(v, g.layout, r, g.s_q);
    for (int64_t h = 0; h < g.heads; ++h) w[h] = load(v, base + h * v.strides[thd() ? 1 : 2]);
  }
  void k_row(int64_t j, double* k) const {
    const TensorView& v = in.index_k;
    const int64_t base = row_offset(v, g.layout, j, g.s_kv);
    for (int64_t d = 0; d < g.head_dim; ++d) k[d] = load(v, base + d * v.strides[thd() ? 1 : 2]);
  }
  double slot(const TensorView& v, int64_t r, int64_t i) const {
    return load(v, row_offset(v, g.layout, r, g.s_q) + i * v.strides[thd() ? 1 : 2]);
  }
};

/// Stage 1 of one row: key rows (-1 = invalid) and gs_i. The P-free form
/// rebuilds P_i = exp(z_i - LSE) from the row's q and w (already in q, w) and
/// the keys, and takes G = -c * row_target_mass.
void score_gradient(const ProblemReader& rd, int64_t r, double c, double sm_scale, const std::vector<double>& q,
                    const std::vector<double>& w, std::vector<double>& k, std::vector<int64_t>& krow,
                    std::vector<double>& gs) {
  int64_t b, t;
  rd.g.q_row_coords(r, &b, &t);
  if (rd.p_free()) {
    const int64_t H = rd.g.heads, D = rd.g.head_dim;
    const double lse = rd.row_lse(r);
    const double G = -c * rd.row_target_mass(r);
    for (int64_t i = 0; i < rd.g.topk; ++i) {
      krow[i] = rd.g.key_row(b, static_cast<int64_t>(rd.slot(rd.in.topk_indices, r, i)));
      if (krow[i] < 0) {
        gs[i] = 0;
        continue;
      }
      rd.k_row(krow[i], k.data());
      double z = 0;
      for (int64_t h = 0; h < H; ++h) {
        double x = 0;
        for (int64_t d = 0; d < D; ++d) x += q[h * D + d] * k[d];
        z += w[h] * relu_keeping_nan(x);
      }
      const double P = std::exp(sm_scale * z - lse);
      const double T = rd.slot(rd.in.attn_score, r, i);
      gs[i] = (P >= kEps ? -c * std::max(T, kEps) : 0.0) - P * G;
    }
    return;
  }
  double G = 0;
  for (int64_t i = 0; i < rd.g.topk; ++i) {
    krow[i] = rd.g.key_row(b, static_cast<int64_t>(rd.slot(rd.in.topk_indices, r, i)));
    if (krow[i] < 0) {
      gs[i] = 0;
      continue;
    }
    const double T = rd.slot(rd.in.attn_score, r, i);
    const double P = rd.slot(rd.in.index_score, r, i);
    gs[i] = P >= kEps ? -c * std::max(T, kEps) : 0.0;  // g_i for now
    G += gs[i];
  }
  for (int64_t i = 0; i < rd.g.topk; ++i) {
    if (krow[i] >= 0) gs[i] -= rd.slot(rd.in.index_score, r, i) * G;
  }
}

struct RowScratch {
  std::vector<double> q, w, k, dq, dw, gs;
  std::vector<int64_t> krow;
  explicit RowScratch(const ProblemGeometry& g)
      : q(g.heads * g.head_dim), w(g.heads), k(g.head_dim), dq(g.heads * g.head_dim), dw(g.heads),
        gs(g.topk), krow(g.topk) {}
  /// Its size in 8-byte elements (the constructor's vectors).
  static double elements(const ProblemGeometry& g) {
    return 2.0 * g.heads * g.head_dim + 2.0 * g.heads + g.head_dim + 2.0 * g.topk;
  }
};

/// Stage 2 of one row. dk (num_k_rows*D) may be null (no dK wanted).
void row_backward(const ProblemReader& rd, int64_t r, double c, double sm_scale, RowScratch& s, double* dk) {
  const int64_t H = rd.g.heads, D = rd.g.head_dim;
  rd.q_row(r, s.q);
  rd.w_row(r, s.w);
  score_gradient(rd, r, c, sm_scale, s.q, s.w, s.k, s.krow, s.gs);
  std::fill(s.dq.begin(), s.dq.end(), 0.0);
  std::fill(s.dw.begin(), s.dw.end(), 0.0);
  for (int64_t i = 0; i < rd.g.topk; ++i) {
    if (s.krow[i] < 0) continue;
    rd.k_row(s.krow[i], s.k.data());
    for (int64_t h = 0; h < H; ++h) {
      const double* qh = &s.q[h * D];
      double x = 0;
      for (int64_t d = 0; d < D; ++d) x += qh[d] * s.k[d];
      // every slot adds to dW, as torch's product does: a NaN gs_i times relu(x) = 0 is NaN
      s.dw[h] += s.gs[i] * relu_keeping_nan(x);
      if (relu_blocks(x)) continue;  // a = 0: nothing to add (a NaN x passes, as torch's relu backward)
      const double a = s.gs[i] * s.w[h] * sm_scale;
      double* dqh = &s.dq[h * D];
      for (int64_t d = 0; d < D; ++d) dqh[d] += a * s.k[d];
      if (dk) {
        double* dkj = dk + s.krow[i] * D;
        for (int64_t d = 0; d < D; ++d) dkj[d] += a * qh[d];
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) s.dw[h] *= sm_scale;
}

double read_grad_loss(const IndexerOptions& opt) {
  return opt.grad_loss_device ? static_cast<double>(*opt.grad_loss_device) : static_cast<double>(opt.grad_loss);
}

/// Runs fn(part, row_begin, row_end) once for each of `parts` static parts of
/// [0, rows), on up to `parts` threads (detail::run_items_on_threads: a thread
/// the system refuses leaves its parts to the running ones).
template <class Fn>
void parallel_rows(int parts, int64_t rows, Fn fn) {
  detail::run_items_on_threads(parts, [&](int t) { fn(t, rows * t / parts, rows * (t + 1) / parts); });
}

/// out_of_memory for compute_full's working set. The per-thread parts are named
/// (argument num_threads) when they are most of it and there is more than one;
/// otherwise the problem's size is the cause and no argument is blamed.
[[noreturn]] void throw_working_set_out_of_memory(const ProblemGeometry& g, int threads) {
  const double H = static_cast<double>(g.heads), D = static_cast<double>(g.head_dim);
  const double gradients = static_cast<double>(g.num_q_rows) * H * (D + 1) + static_cast<double>(g.num_k_rows) * D;
  const double per_thread = static_cast<double>(g.num_k_rows) * D + RowScratch::elements(g);
  const double mib = (gradients + threads * per_thread) * 8.0 / (1 << 20);
  const bool threads_dominate = threads > 1 && threads * per_thread > gradients;
  const std::string what = "room in host memory for the cpu backend's fp64 working set (" +
                           std::to_string(static_cast<long long>(mib)) +
                           " MiB: d_index_q, d_weights and d_index_k, and per worker thread one fp64 d_index_k "
                           "partial and its row scratch; " +
                           std::to_string(threads) + (threads == 1 ? " worker thread" : " worker threads") +
                           "), got an allocation failure";
  if (threads_dominate) {
    throw Error(ErrorCode::out_of_memory, "num_threads",
                "num_threads: expected " + what + " (fewer threads need less)");
  }
  throw Error(ErrorCode::out_of_memory, "", "out of memory: expected " + what);
}

ReferenceGradients compute_full(const IndexerInputs& in, const IndexerOptions& opt,
                                const ProblemGeometry& g, const RowStatistics* stats = nullptr) {
  ReferenceGradients res;
  res.num_q_rows = g.num_q_rows;
  res.num_k_rows = g.num_k_rows;
  res.heads = g.heads;
  res.head_dim = g.head_dim;
  const int64_t H = g.heads, D = g.head_dim;
  const int threads = thread_count(opt.num_threads, g.num_q_rows);
  // The fp64 working set: the three gradients, and per part (worker thread) a
  // dK partial (num_k_rows * D * 8 bytes) and its row scratch (~(2 H D + 2 topk)
  // * 8 bytes), all allocated here, so that running out of memory is an
  // out_of_memory error of this call, never a failure inside a worker thread.
  std::vector<std::vector<double>> dk_parts;
  std::vector<RowScratch> scratch;
  try {
    res.d_index_q.assign(g.num_q_rows * H * D, 0.0);
    res.d_weights.assign(g.num_q_rows * H, 0.0);
    res.d_index_k.assign(g.num_k_rows * D, 0.0);
    dk_parts.resize(threads);
    for (std::vector<double>& part : dk_parts) part.assign(g.num_k_rows * D, 0.0);
    scratch.reserve(threads);
    for (int t = 0; t < threads; ++t) scratch.emplace_back(g);
  } catch (const std::bad_alloc&) {
    throw_working_set_out_of_memory(g, threads);
  }
  const ProblemReader rd{in, g, stats};
  const double c = scale_from_host(g, opt, read_grad_loss(opt));
  parallel_rows(threads, g.num_q_rows, [&](int t, int64_t lo, int64_t hi) {
    RowScratch& s = scratch[t];
    for (int64_t r = lo; r < hi; ++r) {
      row_backward(rd, r, c, opt.sm_scale, s, dk_parts[t].data());
      std::copy(s.dq.begin(), s.dq.end(), res.d_index_q.begin() + r * H * D);
      std::copy(s.dw.begin(), s.dw.end(), res.d_weights.begin() + r * H);
    }
  });
  // Sum the per-thread dK parts in thread order (deterministic), split over key rows.
  parallel_rows(threads, g.num_k_rows, [&](int, int64_t lo, int64_t hi) {
    for (int p = 0; p < threads; ++p) {
      for (int64_t e = lo * D; e < hi * D; ++e) res.d_index_k[e] += dk_parts[p][e];
    }
  });
  return res;
}

}  // namespace

void run_cpu_backend(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                     const IndexerOptions& opt, const ProblemGeometry& g, const RowStatistics* stats) {
  const IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ would read subnormals as 0 (float_mode.hpp)
  const ReferenceGradients ref = compute_full(in, opt, g, stats);
  // Outputs are contiguous (validated), so flat element e is offset e.
  for (size_t e = 0; e < ref.d_index_q.size(); ++e) store(out.d_index_q, static_cast<int64_t>(e), ref.d_index_q[e]);
  for (size_t e = 0; e < ref.d_weights.size(); ++e) store(out.d_weights, static_cast<int64_t>(e), ref.d_weights[e]);
  for (size_t e = 0; e < ref.d_index_k.size(); ++e) store(out.d_index_k, static_cast<int64_t>(e), ref.d_index_k[e]);
}

}  // namespace dsaib::detail

namespace dsaib {
using namespace detail;

ReferenceGradients reference_backward(const IndexerInputs& inputs, const IndexerOptions& options) {
  const IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ would read subnormals as 0 (float_mode.hpp)
  IndexerOptions opt = options;
  opt.backend = Backend::cpu;
  opt.deterministic = false;
  const ProblemGeometry g = validate_problem(inputs, {}, opt, nullptr, /*check_outputs=*/false);
  return compute_full(inputs, opt, g);
}

SampledReferenceGradients reference_backward_sampled(const IndexerInputs& inputs,
                                                     const IndexerOptions& options,
                                                     const std::vector<int64_t>& q_rows,
                                                     const std::vector<int64_t>& k_rows) {
  const IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ would read subnormals as 0 (float_mode.hpp)
  IndexerOptions opt = options;
  opt.backend = Backend::cpu;
  opt.deterministic = false;
  const ProblemGeometry g = validate_problem(inputs, {}, opt, nullptr, false);
  const int64_t H = g.heads, D = g.head_dim;
  for (int64_t r : q_rows) {
    if (r < 0 || r >= g.num_q_rows) {
      throw Error(ErrorCode::invalid_argument, "q_rows",
                  "q_rows: expected rows in [0, " + std::to_string(g.num_q_rows) + "), got " + std::to_string(r));
    }
  }
  for (int64_t j : k_rows) {
    if (j < 0 || j >= g.num_k_rows) {
      throw Error(ErrorCode::invalid_argument, "k_rows",
                  "k_rows: expected rows in [0, " + std::to_string(g.num_k_rows) + "), got " + std::to_string(j));
    }
  }
  SampledReferenceGradients res;
  res.q_rows = q_rows;
  res.k_rows = k_rows;
  res.heads = H;
  res.head_dim = D;
  res.d_index_q.assign(q_rows.size() * H * D, 0.0);
  res.d_weights.assign(q_rows.size() * H, 0.0);
  res.d_index_k.assign(k_rows.size() * D, 0.0);
  const ProblemReader rd{inputs, g};
  const double c = scale_from_host(g, opt, read_grad_loss(opt));
  RowScratch s(g);
  for (size_t n = 0; n < q_rows.size(); ++n) {
    row_backward(rd, q_rows[n], c, opt.sm_scale, s, nullptr);
    std::copy(s.dq.begin(), s.dq.end(), res.d_index_q.begin() + n * H * D);
    std::copy(s.dw.begin(), s.dw.end(), res.d_weights.begin() + n * H);
  }
  if (k_rows.empty()) return res;
  // dK of selected key rows: scan every row's ids, in row order, for hits.
  // A row requested more than once is computed at its first position and copied to the others.
  std::vector<int64_t> slot_of_key(g.num_k_rows, -1);
  for (size_t n = 0; n < k_rows.size(); ++n) {
    if (slot_of_key[k_rows[n]] < 0) slot_of_key[k_rows[n]] = static_cast<int64_t>(n);
  }
  std::vector<double> k(D);
  for (int64_t r = 0; r < g.num_q_rows; ++r) {
    int64_t b, t;
    g.q_row_coords(r, &b, &t);
    bool hit = false;
    for (int64_t i = 0; i < g.topk && !hit; ++i) {
      const int64_t kr = g.key_row(b, static_cast<int64_t>(rd.slot(inputs.topk_indices, r, i)));
      hit = kr >= 0 && slot_of_key[kr] >= 0;
    }
    if (!hit) continue;
    rd.q_row(r, s.q);
    rd.w_row(r, s.w);
    score_gradient(rd, r, c, opt.sm_scale, s.q, s.w, s.k, s.krow, s.gs);
    for (int64_t i = 0; i < g.topk; ++i) {
      if (s.krow[i] < 0 || slot_of_key[s.krow[i]] < 0) continue;
      double* dkj = &res.d_index_k[slot_of_key[s.krow[i]] * D];
      rd.k_row(s.krow[i], k.data());
      for (int64_t h = 0; h < H; ++h) {
        double x = 0;
        for (int64_t d = 0; d < D; ++d) x += s.q[h * D + d] * k[d];
        if (relu_blocks(x)) continue;
        const double a = s.gs[i] * s.w[h] * opt.sm_scale;
        for (int64_t d = 0; d < D; ++d) dkj[d] += a * s.q[h * D + d];
      }
    }
  }
  for (size_t n = 0; n < k_rows.size(); ++n) {
    const auto first = static_cast<size_t>(slot_of_key[k_rows[n]]);
    if (first != n) std::copy_n(res.d_index_k.begin() + first * D, D, res.d_index_k.begin() + n * D);
  }
  return res;
}

std::vector<double> reference_index_logits(const IndexerInputs& inputs, const IndexerOptions& options) {
  const IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ would read subnormals as 0 (float_mode.hpp)
  IndexerOptions opt = options;
  opt.backend = Backend::cpu;
  opt.deterministic = false;
  const ProblemGeometry g = validate_problem(inputs, {}, opt, nullptr, false);
  const int64_t H = g.heads, D = g.head_dim;
  const ProblemReader rd{inputs, g};
  std::vector<double> z(g.num_q_rows * g.topk, -std::numeric_limits<double>::infinity());
  const int threads = thread_count(opt.num_threads, g.num_q_rows);
  parallel_rows(threads, g.num_q_rows, [&](int, int64_t lo, int64_t hi) {
    std::vector<double> q(H * D), w(H), k(D);
    for (int64_t r = lo; r < hi; ++r) {
      int64_t b, t;
      g.q_row_coords(r, &b, &t);
      rd.q_row(r, q);
      rd.w_row(r, w);
      for (int64_t i = 0; i < g.topk; ++i) {
        const int64_t kr = g.key_row(b, static_cast<int64_t>(rd.slot(inputs.topk_indices, r, i)));
        if (kr < 0) continue;
        rd.k_row(kr, k.data());
        double zi = 0;
        for (int64_t h = 0; h < H; ++h) {
          double x = 0;
          for (int64_t d = 0; d < D; ++d) x += q[h * D + d] * k[d];
          zi += w[h] * relu_keeping_nan(x);
        }
        z[r * g.topk + i] = opt.sm_scale * zi;
      }
    }
  });
  return z;
}

double indexer_kl_loss(const IndexerInputs& inputs, const IndexerOptions& options, bool recompute_p) {
  const IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ would read subnormals as 0 (float_mode.hpp)
  IndexerOptions opt = options;
  opt.backend = Backend::cpu;
  opt.deterministic = false;
  const ProblemGeometry g = validate_problem(inputs, {}, opt, nullptr, false);
  const ProblemReader rd{inputs, g};
  const double c = scale_from_host(g, opt, read_grad_loss(opt));
  // The P-free form without recompute_p: P_i = exp(z_i - row_lse), as its backward.
  const bool from_row_lse = !recompute_p && !inputs.index_score.present();
  std::vector<double> z;
  if (recompute_p || from_row_lse) z = reference_index_logits(inputs, opt);
  double loss = 0;
  std::vector<double> p(g.topk);
  for (int64_t r = 0; r < g.num_q_rows; ++r) {
    int64_t b, t;
    g.q_row_coords(r, &b, &t);
    if (recompute_p) {
      // Validity from the ids (a valid slot's logit may itself be -inf): a row
      // with a valid slot goes on even if its logits are not finite (the loss is
      // then NaN, not the row silently dropped).
      double zmax = -std::numeric_limits<double>::infinity();
      bool any_valid = false;
      for (int64_t i = 0; i < g.topk; ++i) {
        if (g.key_row(b, static_cast<int64_t>(rd.slot(inputs.topk_indices, r, i))) < 0) continue;
        const double zi = z[r * g.topk + i];
        any_valid = true;
        zmax = std::isnan(zi) || std::isnan(zmax) ? std::numeric_limits<double>::quiet_NaN() : std::max(zmax, zi);
      }
      if (!any_valid) continue;  // no valid slot
      double sum = 0;
      for (int64_t i = 0; i < g.topk; ++i) sum += (p[i] = std::exp(z[r * g.topk + i] - zmax));
      for (int64_t i = 0; i < g.topk; ++i) p[i] /= sum;
    }
    for (int64_t i = 0; i < g.topk; ++i) {
      const int64_t kr = g.key_row(b, static_cast<int64_t>(rd.slot(inputs.topk_indices, r, i)));
      if (kr < 0) continue;
      const double P = recompute_p    ? p[i]
                       : from_row_lse ? std::exp(z[r * g.topk + i] - rd.row_lse(r))
                                      : rd.slot(inputs.index_score, r, i);
      const double T = rd.slot(inputs.attn_score, r, i);
      loss += std::max(T, kEps) * std::log(std::max(P, kEps));
    }
  }
  return 0.0 - c * loss;  // -(c * loss), but +0 (not -0) for a problem without terms
}

}  // namespace dsaib
