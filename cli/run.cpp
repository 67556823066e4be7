// Running the library calls (backward, loss forward, one-call step) on the host, and small utilities of the CLI.
#include <cstdio>
#include <iostream>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "core/bf16.hpp"
#include "core/e4m3.hpp"
#include "topk.hpp"
#include "dsaib/indexer_kl_loss_and_grad.hpp"

namespace dsaib::cli {
namespace {

const auto kStart = std::chrono::steady_clock::now();
std::mutex log_mutex;

}  // namespace

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void log_stage(const std::string& message) {
  char stamp[32];
  std::snprintf(stamp, sizeof stamp, "[%7.2f s] ", seconds_since(kStart));
  const std::string text = terminal_text(message);  // it may quote names read from a file
  std::lock_guard<std::mutex> lock(log_mutex);
  std::cerr << stamp << text << std::endl;
}

std::string report_json_text(const nlohmann::ordered_json& j) {
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

int32_t resolve_threads(int32_t threads) {
  if (threads > 0) return threads;
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int32_t>(n) : 1;
}

std::string human_seconds(double s) {
  char buf[64];
  if (s < 1e-3) std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  else if (s < 1.0) std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.3f s", s);
  return buf;
}

double element(const HostTensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::bf16: return detail::bf16_to_float(t.data<uint16_t>()[i]);
    case DType::f32: return t.data<float>()[i];
    case DType::i32: return t.data<int32_t>()[i];
    case DType::f64: return t.data<double>()[i];
    case DType::e4m3: return detail::e4m3_to_double(t.data<uint8_t>()[i]);
  }
  return 0;
}

int with_written_report(int status, int error_status) {
  std::cout.flush();
  if (std::cout.good() && std::fflush(stdout) == 0 && !std::ferror(stdout)) return status;
  std::cerr << "error: the report could not be written to standard output\n";
  return error_status;
}

const char* loss_op_name(LossOp op) {
  switch (op) {
    case LossOp::forward: return "forward";
    case LossOp::step: return "step";
    case LossOp::backward: break;
  }
  return "backward";
}

std::vector<HostTensor*> allocate_outputs(const Problem& p, LossOp op, DType out_dtype, RunResult& r) {
  std::vector<HostTensor*> outs;
  const std::vector<int64_t>& ids = p.tensors.at("topk_indices").shape;
  if (op != LossOp::backward) {
    r.loss = HostTensor(DType::f32, {});
    outs.push_back(&r.loss);
  }
  if (op == LossOp::forward) {
    const std::vector<int64_t> rows(ids.begin(), ids.end() - 1);
    r.row_lse = HostTensor(DType::f32, rows);
    r.row_target_mass = HostTensor(DType::f32, rows);
    r.index_score = HostTensor(DType::f32, ids);
    for (HostTensor* t : {&r.row_lse, &r.row_target_mass, &r.index_score}) outs.push_back(t);
    return outs;
  }
  r.d_index_q = HostTensor(out_dtype, p.tensors.at("index_q").shape);
  r.d_weights = HostTensor(out_dtype, p.tensors.at("weights").shape);
  r.d_index_k = HostTensor(out_dtype, p.tensors.at("index_k").shape);
  for (HostTensor* t : {&r.d_index_q, &r.d_weights, &r.d_index_k}) outs.push_back(t);
  return outs;
}

namespace {

/// The inputs of `op`: the forward and the one call take no index_score.
IndexerInputs op_inputs(LossOp op, IndexerInputs in) {
  if (op != LossOp::backward) in.index_score = TensorView{};
  return in;
}

}  // namespace

std::size_t op_workspace_size(LossOp op, const IndexerInputs& in, const std::vector<TensorView>& o,
                              const IndexerOptions& opt) {
  switch (op) {
    case LossOp::forward: return indexer_kl_forward_workspace_size(op_inputs(op, in), {o[0], o[1], o[2], o[3]}, opt);
    case LossOp::step: return indexer_kl_loss_and_grad_workspace_size(op_inputs(op, in), {o[0], o[1], o[2], o[3]}, opt);
    case LossOp::backward: break;
  }
  return indexer_backward_workspace_size(in, {o[0], o[1], o[2]}, opt);
}

void run_op(LossOp op, const IndexerInputs& in, const std::vector<TensorView>& o,
            const IndexerOptions& opt, void* workspace, std::size_t workspace_bytes) {
  switch (op) {
    case LossOp::forward:
      indexer_kl_forward(op_inputs(op, in), {o[0], o[1], o[2], o[3]}, opt, workspace, workspace_bytes);
      return;
    case LossOp::step:
      indexer_kl_loss_and_grad(op_inputs(op, in), {o[0], o[1], o[2], o[3]}, opt, workspace, workspace_bytes);
      return;
    case LossOp::backward: break;
  }
  indexer_backward(in, {o[0], o[1], o[2]}, opt, workspace, workspace_bytes);
}

RunResult run_cpu(const Problem& p, const Geometry&, DType out_dtype, int32_t threads, int warmup, int repeat,
                  LossOp op) {
  RunResult r;
  r.timer = "std::chrono::steady_clock (host)";
  r.device = "host, " + std::to_string(resolve_threads(threads)) + " threads";
  const IndexerInputs in = p.inputs();
  const std::vector<HostTensor*> outs = allocate_outputs(p, op, out_dtype, r);
  std::vector<TensorView> views;
  for (HostTensor* t : outs) views.push_back(t->view());
  IndexerOptions opt = p.options;
  opt.backend = Backend::cpu;
  opt.num_threads = threads;
  const std::string name = loss_op_name(op);
  for (int i = 0; i < warmup + repeat; ++i) {
    // Poison the outputs (all-ones bytes are NaN in bf16 and f32): every element must be written.
    for (HostTensor* t : outs) std::memset(t->bytes.data(), 0xff, t->bytes.size());
    const bool timed = i >= warmup;
    log_stage(name + ": cpu " + (timed ? "run " + std::to_string(i - warmup + 1) + "/" + std::to_string(repeat)
                                       : "warm-up " + std::to_string(i + 1) + "/" + std::to_string(warmup)) +
              " ...");
    const auto t0 = std::chrono::steady_clock::now();
    run_op(op, in, views, opt, nullptr, 0);
    const double s = seconds_since(t0);
    log_stage(name + ": done in " + human_seconds(s));
    if (timed) r.seconds.push_back(s);
  }
  return r;
}

#ifndef DSAIB_CLI_WITH_CUDA
bool cli_built_with_cuda() { return false; }
std::string cuda_unavailable_reason() { return "this build has no CUDA support"; }
RunResult run_cuda(const Problem& p, const Geometry&, DType out_dtype, int, int, LossOp op) {
  // Let the library give its own error for the request (backend_unavailable).
  RunResult r;
  std::vector<TensorView> views;
  for (HostTensor* t : allocate_outputs(p, op, out_dtype, r)) views.push_back(t->view());
  IndexerOptions opt = p.options;
  opt.backend = Backend::cuda;
  run_op(op, p.inputs(), views, opt, nullptr, 0);
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: this build has no CUDA support");
}
void run_topk_cuda(TopkRun& run, int, int) {
  // Let the library give its own error for the request (backend_unavailable).
  IndexerTopkOptions opt = run.options;
  opt.backend = Backend::cuda;
  indexer_topk(run.inputs(), run.outputs(), opt);
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: this build has no CUDA support");
}
int run_bench(const BenchArgs&) {
  throw Error(ErrorCode::backend_unavailable, "bench",
              "bench needs the CUDA backend and a GPU (compute capability 9.0): this build has no CUDA support "
              "(configure with -DDSAIB_ENABLE_CUDA=ON and nvcc on PATH)");
}
#endif

}  // namespace dsaib::cli
