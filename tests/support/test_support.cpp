// Shared test helpers; see test_support.hpp.
#include "support/test_support.hpp"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "core/bf16.hpp"
#include "core/element_access.hpp"

namespace dsaib::test {
namespace {

bool is_thd(const GeneratedProblem& p) { return p.spec.layout == Layout::thd; }

double load(DType dt, const unsigned char* base, int64_t off) { return detail::load_element(dt, base, off); }
void store(DType dt, unsigned char* base, int64_t off, double v) { detail::store_element(dt, base, off, v); }

/// Calls fn(row_major_index, strided_offset) for every element of a view.
template <class Fn>
void for_each_element(const TensorView& v, Fn fn) {
  if (v.rank < 0 || v.rank > kMaxRank) throw std::invalid_argument("for_each_element: bad rank");
  const int64_t n = v.numel();
  if (n <= 0) return;
  int64_t idx[kMaxRank] = {0, 0, 0, 0};
  for (int64_t e = 0; e < n; ++e) {
    int64_t off = 0;
    for (int i = 0; i < v.rank; ++i) off += idx[i] * v.strides[i];
    fn(e, off);
    for (int i = v.rank - 1; i >= 0; --i) {
      if (++idx[i] < v.shape[i]) break;
      idx[i] = 0;
    }
  }
}

}  // namespace

// ------------------------------------------------------------ problems ---

GenerateSpec small_spec(uint64_t seed) {
  GenerateSpec s;
  s.layout = Layout::bshd;
  s.batch = 2;
  s.s_q = 24;
  s.s_kv = 24;
  s.heads = 8;
  s.head_dim = 64;
  s.topk = 16;
  s.ids = IdPattern::causal_topk;
  s.seed = seed;
  s.num_threads = 2;
  return s;
}

GenerateSpec small_ragged_spec(Layout layout, int64_t heads, int64_t head_dim, int64_t topk, IdMode mode,
                               IdPattern ids, uint64_t seed) {
  GenerateSpec s = small_spec(seed);
  s.layout = layout;
  s.batch = 2;
  s.s_q = 9;
  s.s_kv = 40;
  s.seqlens_q = {7, 0, 11};
  s.seqlens_k = {40, 3, 26};
  s.heads = heads;
  s.head_dim = head_dim;
  s.topk = topk;
  s.id_mode = mode;
  s.ids = ids;
  return s;
}

GenerateSpec ragged_spec(Layout layout, int64_t heads, int64_t head_dim, int64_t topk, int64_t s_q, int64_t s_kv,
                         IdMode mode, IdPattern ids, uint64_t seed) {
  GenerateSpec s;
  s.layout = layout;
  s.batch = 2;
  s.s_q = s_q;
  s.s_kv = s_kv;
  s.seqlens_q = {s_q, 0, s_q / 2 + 3};
  s.seqlens_k = {s_kv, 5, s_kv / 2 + 1};
  s.heads = heads;
  s.head_dim = head_dim;
  s.topk = topk;
  s.id_mode = mode;
  s.ids = ids;
  s.seed = seed;
  s.num_threads = 0;
  return s;
}

GeneratedProblem make_problem(const GenerateSpec& spec) { return generate_problem(spec); }

int64_t num_q_rows(const GeneratedProblem& p) { return p.topk_indices.shape.empty() ? 0 : p.topk_indices.numel() / topk(p); }
int64_t num_k_rows(const GeneratedProblem& p) { return p.index_k.numel() / p.spec.head_dim; }
int64_t topk(const GeneratedProblem& p) { return p.topk_indices.shape.back(); }

int32_t get_id(const GeneratedProblem& p, int64_t row, int64_t slot) {
  return p.topk_indices.data<int32_t>()[row * topk(p) + slot];
}
void set_id(GeneratedProblem& p, int64_t row, int64_t slot, int32_t id) {
  p.topk_indices.data<int32_t>()[row * topk(p) + slot] = id;
}

void invalidate_run(GeneratedProblem& p, int64_t row, Where where, int64_t count) {
  const int64_t K = topk(p);
  count = std::min(count, K);
  const int64_t first = where == Where::start ? 0 : where == Where::end ? K - count : (K - count) / 2;
  for (int64_t i = first; i < first + count; ++i) set_id(p, row, i, -1);
}

void invalidate_row(GeneratedProblem& p, int64_t row) { invalidate_run(p, row, Where::start, topk(p)); }

void set_out_of_range(GeneratedProblem& p, int64_t row, int64_t slot, int32_t past) {
  int64_t lo, hi;
  key_range(p, row, &lo, &hi);
  set_id(p, row, slot, static_cast<int32_t>((p.spec.id_mode == IdMode::local ? hi - lo : hi) + past));
}

void duplicate_slot(GeneratedProblem& p, int64_t row, int64_t from, int64_t to) { set_id(p, row, to, get_id(p, row, from)); }

void key_range(const GeneratedProblem& p, int64_t row, int64_t* begin, int64_t* end) {
  if (is_thd(p)) {
    const int32_t* cq = p.cu_seqlens_q.data<int32_t>();
    const int32_t* ck = p.cu_seqlens_k.data<int32_t>();
    const int64_t nseq = p.cu_seqlens_q.numel() - 1;
    for (int64_t b = 0; b < nseq; ++b) {
      if (row >= cq[b] && row < cq[b + 1]) {
        *begin = ck[b];
        *end = ck[b + 1];
        return;
      }
    }
    throw std::out_of_range("key_range: row outside every sequence");
  }
  const int64_t b = row / p.spec.s_q;
  *begin = b * p.spec.s_kv;
  *end = (b + 1) * p.spec.s_kv;
}

bool slot_valid(const GeneratedProblem& p, int64_t row, int64_t slot) {
  int64_t lo, hi;
  key_range(p, row, &lo, &hi);
  const int64_t id = get_id(p, row, slot);
  if (p.spec.id_mode == IdMode::local) return id >= 0 && id < hi - lo;
  return id >= lo && id < hi;
}

void refresh_index_score(GeneratedProblem& p) {
  const std::vector<double> z = reference_index_logits(p.inputs(), p.options());
  const int64_t R = num_q_rows(p), K = topk(p);
  float* P = p.index_score.data<float>();
  for (int64_t r = 0; r < R; ++r) {
    double zmax = -std::numeric_limits<double>::infinity();
    bool nan = false;  // a NaN logit makes the row's P NaN, as torch's softmax
    for (int64_t i = 0; i < K; ++i) {
      nan = nan || std::isnan(z[r * K + i]);
      zmax = std::max(zmax, z[r * K + i]);
    }
    if (nan) {
      for (int64_t i = 0; i < K; ++i) P[r * K + i] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (!std::isfinite(zmax)) {
      for (int64_t i = 0; i < K; ++i) P[r * K + i] = 0.0f;
      continue;
    }
    double sum = 0;
    std::vector<double> e(static_cast<size_t>(K));
    for (int64_t i = 0; i < K; ++i) sum += (e[i] = std::exp(z[r * K + i] - zmax));
    for (int64_t i = 0; i < K; ++i) P[r * K + i] = static_cast<float>(e[i] / sum);
  }
}

void renormalize_attn_score(GeneratedProblem& p) {
  const int64_t R = num_q_rows(p), K = topk(p);
  float* T = p.attn_score.data<float>();
  for (int64_t r = 0; r < R; ++r) {
    double sum = 0;
    for (int64_t i = 0; i < K; ++i) {
      if (!slot_valid(p, r, i)) T[r * K + i] = 0.0f;
      sum += T[r * K + i];
    }
    for (int64_t i = 0; i < K; ++i) T[r * K + i] = sum > 0 ? static_cast<float>(T[r * K + i] / sum) : 0.0f;
  }
}

void refresh_scores(GeneratedProblem& p) {
  refresh_index_score(p);
  renormalize_attn_score(p);
}

void fill_invalid_scores(GeneratedProblem& p, float value) {
  const int64_t R = num_q_rows(p), K = topk(p);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < K; ++i) {
      if (slot_valid(p, r, i)) continue;
      p.attn_score.data<float>()[r * K + i] = value;
      p.index_score.data<float>()[r * K + i] = value;
    }
  }
}

GeneratedProblem compacted(const GeneratedProblem& p) {
  GeneratedProblem c = p;
  const int64_t R = num_q_rows(p), K = topk(p);
  for (int64_t r = 0; r < R; ++r) {
    int64_t n = 0;
    for (int64_t i = 0; i < K; ++i) {
      if (!slot_valid(p, r, i)) continue;
      set_id(c, r, n, get_id(p, r, i));
      c.attn_score.data<float>()[r * K + n] = p.attn_score.data<float>()[r * K + i];
      c.index_score.data<float>()[r * K + n] = p.index_score.data<float>()[r * K + i];
      ++n;
    }
    for (; n < K; ++n) {
      set_id(c, r, n, -1);
      c.attn_score.data<float>()[r * K + n] = 0.0f;
      c.index_score.data<float>()[r * K + n] = 0.0f;
    }
  }
  return c;
}

GeneratedProblem with_id_mode(const GeneratedProblem& p, IdMode mode) {
  GeneratedProblem c = p;
  c.spec.id_mode = mode;
  const int64_t R = num_q_rows(p), K = topk(p);
  for (int64_t r = 0; r < R; ++r) {
    int64_t lo, hi;
    key_range(p, r, &lo, &hi);
    for (int64_t i = 0; i < K; ++i) {
      if (!slot_valid(p, r, i)) {
        set_id(c, r, i, -1);
        continue;
      }
      const int64_t local = get_id(p, r, i) - (p.spec.id_mode == IdMode::global ? lo : 0);
      set_id(c, r, i, static_cast<int32_t>(mode == IdMode::global ? lo + local : local));
    }
  }
  return c;
}

// ------------------------------------------------------------- outputs ---

IndexerBackwardOutputs OutputBuffers::views() const { return {d_index_q.view(), d_weights.view(), d_index_k.view()}; }

OutputBuffers make_outputs(const GeneratedProblem& p, DType dq, DType dw, DType dk) {
  OutputBuffers o;
  o.d_index_q = HostTensor(dq, p.index_q.shape);
  o.d_weights = HostTensor(dw, p.weights.shape);
  o.d_index_k = HostTensor(dk, p.index_k.shape);
  return o;
}

void poison(HostTensor& t) {
  if (t.dtype == DType::i32) {
    for (int64_t e = 0; e < t.numel(); ++e) t.data<int32_t>()[e] = 0x7fc00000;
    return;
  }
  fill(t, std::numeric_limits<double>::quiet_NaN());
}

void fill(HostTensor& t, double value) {
  for (int64_t e = 0; e < t.numel(); ++e) store(t.dtype, t.bytes.data(), e, value);
}

void poison(OutputBuffers& o) {
  poison(o.d_index_q);
  poison(o.d_weights);
  poison(o.d_index_k);
}

OutputBuffers run_cpu(const GeneratedProblem& p, const IndexerOptions& options, DType dq, DType dw, DType dk) {
  OutputBuffers o = make_outputs(p, dq, dw, dk);
  poison(o);
  IndexerOptions opt = options;
  opt.backend = Backend::cpu;
  indexer_backward(p.inputs(), o.views(), opt);
  return o;
}

// ------------------------------------------------------------- metrics ---

std::vector<double> to_doubles(const TensorView& v) {
  std::vector<double> out(static_cast<size_t>(std::max<int64_t>(v.numel(), 0)));
  const auto* base = static_cast<const unsigned char*>(v.data);
  for_each_element(v, [&](int64_t e, int64_t off) { out[e] = load(v.dtype, base, off); });
  return out;
}

std::vector<double> to_doubles(const HostTensor& t) { return to_doubles(t.view()); }

std::string ErrorStats::str() const {
  std::ostringstream s;
  s << "rel_rms=" << rel_rms << " max_abs=" << max_abs << " max_abs_ref=" << max_abs_ref
    << " all_finite=" << (all_finite ? "yes" : "NO") << " n=" << count;
  return s.str();
}

ErrorStats compare(const TensorView& out, const std::vector<double>& ref) {
  const std::vector<double> o = to_doubles(out);
  ErrorStats st;
  st.count = static_cast<int64_t>(o.size());
  if (o.size() != ref.size()) {
    st.all_finite = false;
    st.rel_rms = st.max_abs = std::numeric_limits<double>::infinity();
    return st;
  }
  double err2 = 0, ref2 = 0;
  for (size_t e = 0; e < o.size(); ++e) {
    if (!std::isfinite(o[e])) st.all_finite = false;
    const double d = std::abs(o[e] - ref[e]);
    err2 += d * d;
    ref2 += ref[e] * ref[e];
    st.max_abs = std::max(st.max_abs, d);  // std::max ignores NaN d: handled by all_finite below
    st.max_abs_ref = std::max(st.max_abs_ref, std::abs(ref[e]));
  }
  if (!st.all_finite || !std::isfinite(err2)) {
    st.all_finite = false;
    st.rel_rms = st.max_abs = std::numeric_limits<double>::infinity();
    return st;
  }
  st.rel_rms = ref2 > 0 ? std::sqrt(err2 / ref2) : (err2 > 0 ? std::numeric_limits<double>::infinity() : 0.0);
  return st;
}

ErrorStats compare(const HostTensor& out, const std::vector<double>& ref) { return compare(out.view(), ref); }

bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes;
}

// ----------------------------------------------------------- snapshots ---

Snapshot::Snapshot(const void* data, std::size_t bytes) : data_(static_cast<const unsigned char*>(data)) {
  if (data_ && bytes) copy_.assign(data_, data_ + bytes);
}

Snapshot::Snapshot(const HostTensor& t) : Snapshot(t.bytes.data(), t.bytes.size()) {}

namespace {
std::pair<const void*, std::size_t> view_span(const TensorView& v) {
  if (!v.present() || v.data == nullptr || v.rank < 0 || v.rank > kMaxRank) return {nullptr, 0};
  int64_t lo = 0, hi = 0;
  for (int i = 0; i < v.rank; ++i) {
    if (v.shape[i] <= 0) return {nullptr, 0};
    const int64_t span = (v.shape[i] - 1) * v.strides[i];
    (span < 0 ? lo : hi) += span;
  }
  const int64_t es = static_cast<int64_t>(dtype_size(v.dtype));
  return {static_cast<const unsigned char*>(v.data) + lo * es, static_cast<std::size_t>((hi - lo + 1) * es)};
}
}  // namespace

Snapshot::Snapshot(const TensorView& v) : Snapshot(view_span(v).first, view_span(v).second) {}

bool Snapshot::unchanged() const { return copy_.empty() || std::memcmp(data_, copy_.data(), copy_.size()) == 0; }

SnapshotAll::SnapshotAll(const GeneratedProblem& p, const OutputBuffers& o) {
  const std::pair<const char*, const HostTensor*> all[] = {
      {"index_q", &p.index_q},         {"weights", &p.weights},         {"index_k", &p.index_k},
      {"topk_indices", &p.topk_indices}, {"attn_score", &p.attn_score}, {"index_score", &p.index_score},
      {"cu_seqlens_q", &p.cu_seqlens_q}, {"cu_seqlens_k", &p.cu_seqlens_k}, {"d_index_q", &o.d_index_q},
      {"d_weights", &o.d_weights},     {"d_index_k", &o.d_index_k}};
  for (const auto& [name, t] : all) snaps_.emplace_back(name, Snapshot(*t));
}

std::string SnapshotAll::changed() const {
  std::string s;
  for (const auto& [name, snap] : snaps_) {
    if (!snap.unchanged()) s += (s.empty() ? "" : ", ") + name;
  }
  return s;
}

// ------------------------------------------------------------- strided ---

StridedCopy strided_copy(const HostTensor& src, const std::vector<int64_t>& step, const std::vector<int64_t>& pad,
                         int32_t gap_id) {
  const int rank = static_cast<int>(src.shape.size());
  if (static_cast<int>(step.size()) != rank || static_cast<int>(pad.size()) != rank) {
    throw std::invalid_argument("strided_copy: step and pad need one entry per dimension");
  }
  std::vector<int64_t> stored(rank);
  for (int i = 0; i < rank; ++i) stored[i] = src.shape[i] * step[i] + pad[i];
  StridedCopy c;
  c.storage = HostTensor(src.dtype, stored);
  if (src.dtype == DType::i32) {
    fill(c.storage, gap_id);
  } else {
    poison(c.storage);
  }
  const TensorView dense = c.storage.view();
  c.view = dense;
  for (int i = 0; i < rank; ++i) {
    c.view.shape[i] = src.shape[i];
    c.view.strides[i] = dense.strides[i] * step[i];
  }
  const TensorView from = src.view();
  const auto* in = static_cast<const unsigned char*>(from.data);
  auto* out = static_cast<unsigned char*>(c.view.data);
  const std::size_t es = dtype_size(src.dtype);
  for_each_element(c.view, [&](int64_t e, int64_t off) { std::memcpy(out + off * es, in + e * es, es); });
  return c;
}

// ----------------------------------------------------------- processes ---

CommandResult run_command(const std::string& command) {
  CommandResult r;
  FILE* p = ::popen(command.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string shell_quote(const std::string& s) { return "'" + s + "'"; }

bool limit_address_space(size_t headroom) {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  unsigned long pages = 0;
  if (f) {
    if (std::fscanf(f, "%lu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  const rlim_t limit = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) + headroom;
  const rlimit r{limit, limit};
  return setrlimit(RLIMIT_AS, &r) == 0;
}

void exit_with_call_status_under_address_limit(size_t headroom, const std::function<void()>& call) {
  if (!limit_address_space(headroom)) std::_Exit(11);
  try {
    call();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::_Exit(12);
  }
  std::_Exit(0);
}

void set_batch(std::initializer_list<TensorView*> views, int64_t b) {
  for (TensorView* v : views) {
    if (v->present()) v->shape[0] = b;
  }
}

dsaib_tensor to_c(const TensorView& v) {
  dsaib_tensor t;
  std::memset(&t, 0, sizeof t);
  t.data = v.data;
  t.dtype = static_cast<int32_t>(v.dtype);
  t.rank = v.rank;
  for (int i = 0; i < 4; ++i) {
    t.shape[i] = v.shape[i];
    t.strides[i] = v.strides[i];
  }
  t.device = static_cast<int32_t>(v.device);
  t.device_index = v.device_index;
  return t;
}

}  // namespace dsaib::test
