// The reports of `dsaib backward` (text and JSON), and what they say about non-finite values.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "operation.hpp"

namespace dsaib::cli {

std::string nonfinite_effect(const std::string& name) {
  // g_i = -c * max(T_i, eps) * [P_i >= eps], G = sum_i g_i, gs_i = g_i - P_i * G;
  // a slot and head contribute where the logit x = q_h . k is not <= 0 (NaN included).
  if (name == "index_q" || name == "index_k") {
    return name + ": a logit q.k that comes out NaN (a NaN entry, or inf * 0) propagates as torch's relu does "
                  "(relu(NaN) = NaN): the loss is NaN, and so are the gradients of that query row and of the keys it "
                  "selects; a logit of -inf counts as not positive (relu = 0), one of +inf propagates";
  }
  if (name == "weights") return "weights: propagate into d_index_q and d_index_k of the row's selected keys";
  if (name == "attn_score") {
    return "attn_score: at a valid slot whose index_score is >= eps (e^-100), NaN and +inf propagate through "
           "G = sum g_i into every gradient of that query row, -inf is clamped to eps (max(T, eps)); where "
           "index_score < eps it is ignored";
  }
  if (name == "index_score") {
    return "index_score: at a valid slot, NaN/inf propagates into that slot's gradients (a NaN one also drops its "
           "attn_score term, as NaN >= eps is false)";
  }
  return name + ": propagate";
}

std::string nonfinite_inputs(const Problem& p, const Geometry& g, LossOp op,
                             std::vector<std::pair<std::string, int64_t>>* found) {
  // attn_score and index_score count only at valid slots, index_k only in key rows
  // that a valid slot selects (the backends never read the others, so NaN padding
  // there is fine).
  std::string out;
  const HostTensor& ids = p.tensors.at("topk_indices");
  for (const char* name : {"index_q", "weights", "index_k", "attn_score", "index_score"}) {
    if (op != LossOp::backward && std::string(name) == "index_score") continue;  // not read: P is computed
    const auto it = p.tensors.find(name);
    if (it == p.tensors.end()) continue;
    const HostTensor& t = it->second;
    if (t.dtype == DType::i32) continue;
    const bool per_slot = std::string(name) == "attn_score" || std::string(name) == "index_score";
    const bool per_key_row = std::string(name) == "index_k" && g.head_dim > 0;
    // elements per query row of index_q / weights (0: not a per-query-row tensor)
    const int64_t per_q_row = std::string(name) == "index_q" ? g.heads * g.head_dim
                              : std::string(name) == "weights" ? g.heads
                                                               : 0;
    int64_t count = 0, first = -1;
    for (int64_t e = 0; e < t.numel(); ++e) {
      if (per_slot && g.topk > 0) {  // same (rows, topk) layout as topk_indices, contiguous
        int64_t b, tq;
        g.q_row_coords(e / g.topk, &b, &tq);
        if (g.key_row(b, ids.data<int32_t>()[e]) < 0) continue;
      }
      if (per_key_row && !g.key_selected[static_cast<size_t>(e / g.head_dim)]) continue;  // a key row no valid slot selects
      // a query row without a valid slot: its index_q and weights are never used (gradients 0)
      if (per_q_row > 0 && !g.q_row_used[static_cast<size_t>(e / per_q_row)]) continue;
      if (!std::isfinite(element(t, e))) {
        if (first < 0) first = e;
        ++count;
      }
    }
    if (count > 0) {
      if (found) found->emplace_back(name, count);
      out += (out.empty() ? "" : ", ") + std::string(name) + ": " + std::to_string(count) + " (first at element " +
             std::to_string(first) + ")";
    }
  }
  return out;
}

namespace {

/// Why outputs are not finite, as far as the run can tell: non-finite inputs; a
/// reference at or beyond the output dtype's rounding-to-infinity point
/// (overflow, as IEEE rounding gives); or, with finite inputs and a reference in
/// range, unexplained (in the sampled rows only, with --verify sample; none
/// computed with --verify none).
std::string nonfinite_outputs_cause(const std::string& input_nonfinite, const Verification& v) {
  if (!input_nonfinite.empty()) return "the inputs hold non-finite values: " + input_nonfinite;
  std::string overflowed;
  for (const Metric& m : v.metrics) {
    // Halfway between the largest finite value and the next power of two: from
    // there on, round-to-nearest-even gives infinity (bf16 0x7f7f8000, f32 2^128 (1 - 2^-25)).
    const double to_infinity = m.dtype == DType::bf16 ? 3.39617752923046e38 : 3.4028235677973366e38;
    if (m.nonfinite > 0 && m.ref_max_abs >= to_infinity) {
      overflowed += (overflowed.empty() ? "" : ", ") + m.name + " (|ref| up to " + format_float(m.ref_max_abs) + ")";
    }
  }
  if (!overflowed.empty()) return "the fp64 reference exceeds the output dtype's range: overflow in " + overflowed;
  if (v.mode == "none") return "the inputs are all finite; --verify tells an overflow of the output dtype from a defect";
  if (v.mode == "sample") {
    return "the inputs are all finite and the sampled rows' fp64 reference is within the output dtype's range; "
           "--verify all tells an overflow in other rows from a defect";
  }
  return "the inputs are all finite and the fp64 reference is within the output dtype's range: unexpected";
}

void print_metrics(std::ostream& s, const std::vector<Metric>& metrics) {
  char head[160];
  std::snprintf(head, sizeof head, "    %-16s %-20s %-5s %-9s %-9s %-9s %-6s %s\n", "output", "shape", "dtype", "rel_rms",
                "max_abs", "ref_rms", "tol", "result");
  s << head;
  for (const Metric& m : metrics) {
    char line[256];
    std::snprintf(line, sizeof line, "    %-16s %-20s %-5s %-9s %-9s %-9s %-6s %s", m.name.c_str(),
                  shape_string(m.shape).c_str(), dtype_name(m.dtype), sci(m.rel_rms).c_str(), sci(m.max_abs).c_str(),
                  sci(m.ref_rms).c_str(), sci(m.tol, 0).c_str(), m.pass ? "PASS" : "FAIL");
    s << line;
    if (m.nonfinite > 0) s << " (" << m.nonfinite << " non-finite elements)";
    if (m.ref_nonfinite > 0) s << " (" << m.ref_nonfinite << " non-finite reference elements)";
    s << "\n";
  }
}

nlohmann::ordered_json problem_json(const BackwardOutcome& o) {
  const Geometry& g = o.g;
  nlohmann::ordered_json j = {{"layout", layout_name(g.layout)},
                              {"id_mode", id_mode_name(g.id_mode)},
                              {"batch", g.batch},
                              {"s_q", g.s_q},
                              {"s_kv", g.s_kv},
                              {"num_q_rows", g.num_q_rows},
                              {"num_k_rows", g.num_k_rows},
                              {"heads", g.heads},
                              {"head_dim", g.head_dim},
                              {"topk", g.topk},
                              {"valid_slots", g.valid_slots}};
  // Each sequence's lengths: THD only (BSHD's are batch times s_q and s_kv,
  // which a list of B entries would only repeat).
  if (g.layout == Layout::thd) {
    j["q_lengths"] = g.q_len;
    j["k_lengths"] = g.k_len;
  }
  j["dtypes"] = tensor_dtypes(o.p);
  return j;
}

nlohmann::ordered_json timing_json(const BackwardOutcome& o) {
  const double mean = o.mean_seconds;
  return {{"timer", o.r.timer},
          {"warmup", o.warmup},
          {"seconds", o.r.seconds},
          {"mean_seconds", mean},
          {"min_seconds", o.best_seconds},
          {"per_query_row_seconds", o.g.num_q_rows > 0 ? mean / double(o.g.num_q_rows) : 0.0},
          {"useful_gflop", o.flops * 1e-9},
          {"gflop_per_second", mean > 0 ? o.flops * 1e-9 / mean : 0.0}};
}

nlohmann::ordered_json verify_json(const BackwardOutcome& o) {
  nlohmann::ordered_json outs = nlohmann::ordered_json::array();
  for (const Metric& m : o.v.metrics) {
    outs.push_back({{"name", m.name},
                    {"shape", m.shape},
                    {"dtype", dtype_name(m.dtype)},
                    {"compared", m.compared},
                    {"nonfinite", m.nonfinite},
                    {"ref_nonfinite", m.ref_nonfinite},
                    {"rel_rms", m.rel_rms},
                    {"max_abs", m.max_abs},
                    {"ref_rms", m.ref_rms},
                    {"ref_floor", m.ref_floor},
                    {"ref_max_abs", m.ref_max_abs},
                    {"tolerance", m.tol},
                    {"pass", m.pass}});
  }
  nlohmann::ordered_json st = nlohmann::ordered_json::array();
  for (const Metric& m : o.stored) {
    st.push_back({{"name", m.name}, {"rel_rms", m.rel_rms}, {"max_abs", m.max_abs}, {"tolerance", m.tol}, {"pass", m.pass}});
  }
  return {{"mode", o.v.mode},
          {"stored_gradients", st},
          {"seconds", o.v.seconds},
          {"sampled_q_rows", o.v.q_rows.size()},
          {"sampled_k_rows", o.v.k_rows.size()},
          {"outputs", outs}};
}

}  // namespace

void print_backward_json(const BackwardOutcome& o, const OperationArgs& a) {
  const IndexerOptions& opt = o.p.options;
  nlohmann::ordered_json j;
  j["op"] = loss_op_name(o.op);
  j["problem"] = problem_json(o);
  j["input"] = o.p.origin;
  j["scalars"] = {{"sm_scale", opt.sm_scale},
                  {"loss_coeff", opt.loss_coeff},
                  {"grad_loss", opt.grad_loss},
                  {"normalization_count", o.g.normalization_count}};  // as the library uses it: max(rows, 1) when 0
  j["backend"] = {{"name", backend_name(o.backend.backend)}, {"why", o.backend.why}, {"device", o.r.device}};
  j["out_dtype"] = dtype_name(o.out_dtype);
  j["a_operand"] = {{"requested", a_operand_precision_name(opt.a_operand_precision)}, {"used", o.a_operand_used}};
  j["deterministic"] = opt.deterministic;
  if (o.op != LossOp::backward) j["loss"] = element(o.r.loss, 0);
  j["timing"] = timing_json(o);
  j["verify"] = verify_json(o);
  nlohmann::ordered_json nfi = nlohmann::ordered_json::object();
  for (const auto& nf : o.nonfinite_found) nfi[nf.first] = nf.second;
  j["nonfinite_inputs"] = nfi;
  j["nonfinite_outputs"] = o.nonfinite_outputs;
  j["output_file"] = a.out;
  j["pass"] = o.pass;        // no check failed (true also when nothing was checked: see "result")
  j["result"] = o.verdict;   // the text report's verdict
  std::cout << report_json_text(j) << std::endl;
}

void print_backward_text(const BackwardOutcome& o, const OperationArgs& a, bool scalars_given) {
  const Geometry& g = o.g;
  const IndexerOptions& opt = o.p.options;
  const double mean = o.mean_seconds;
  const int64_t slots = g.num_q_rows * g.topk;
  std::ostringstream s;
  s << "dsaib " << loss_op_name(o.op) << "\n"
    << "  problem     " << g.summary() << "\n"
    << "  input       " << terminal_text(o.p.origin) << "\n"
    << "  dtypes      " << tensor_dtypes(o.p) << " -> outputs " << dtype_name(o.out_dtype) << "\n"
    << "  valid slots " << g.valid_slots << " of " << slots << " ("
    << fixed(slots > 0 ? 100.0 * double(g.valid_slots) / double(slots) : 0.0, 1) << "%)\n"
    << "  scalars     sm_scale=" << format_float(opt.sm_scale) << " loss_coeff=" << format_float(opt.loss_coeff)
    << " grad_loss=" << format_float(opt.grad_loss) << " N=" << g.normalization_count << "\n"
    << "  backend     " << o.backend.line() << ", " << o.r.device << "\n"
    << "  a operand   " << o.a_operand_line << "\n";
  if (opt.deterministic) {
    s << "  determinism "
      << (o.backend.backend == Backend::cuda ? "d_index_k in 64-bit fixed point (--deterministic)"
                                             : "requested (--deterministic; the cpu backend always is)")
      << "\n";
  }
  if (o.op != LossOp::backward) s << "  loss        " << format_float(element(o.r.loss, 0)) << "\n";
  char label[16];
  std::snprintf(label, sizeof label, "  %-12s", loss_op_name(o.op));
  s << label << human_seconds(mean);
  if (o.r.seconds.size() > 1) s << " mean, " << human_seconds(o.best_seconds) << " min of " << o.r.seconds.size() << " runs";
  s << " (" << human_seconds(g.num_q_rows > 0 ? mean / double(g.num_q_rows) : 0.0) << " per query row, "
    << fixed(mean > 0 ? o.flops * 1e-9 / mean : 0.0, 2) << " GFLOP/s useful; " << o.r.timer << ")\n";
  if (o.v.mode == "none") {
    s << "  verify      none\n";
  } else {
    s << "  verify      "
      << (o.v.mode == "all" ? "all rows"
                            : std::to_string(o.v.q_rows.size()) + " sampled query rows, " +
                                  std::to_string(o.v.k_rows.size()) + " sampled key rows")
      << " vs the fp64 reference (" << human_seconds(o.v.seconds) << ")\n";
    print_metrics(s, o.v.metrics);
  }
  const auto holds = [&](const char* name) { return o.p.tensors.count(name) > 0; };
  if (!o.stored.empty()) {
    s << "  stored      vs the gradients stored in the input file (torch_*: torch autograd)\n";
    print_metrics(s, o.stored);
  } else if (!a.in.empty() && scalars_given &&
             (holds("torch_d_index_q") || holds("torch_d_weights") || holds("torch_d_index_k"))) {
    s << "  stored      not compared: the scalar flags changed the problem the stored torch_* gradients are for\n";
  }
  if (o.nonfinite_outputs > 0) {
    s << "  non-finite  " << o.nonfinite_outputs << " output elements are NaN/inf ("
      << nonfinite_outputs_cause(o.input_nonfinite, o.v) << ")\n";
  }
  if (!a.out.empty()) s << "  output      " << terminal_text(a.out) << "\n";
  s << "  result      " << o.verdict << "\n";
  std::cout << s.str() << std::flush;
}

}  // namespace dsaib::cli
