// Running the library calls on the cuda backend: host <-> device copies and cudaEvent timing.
// Compiled only when the project is built with CUDA (DSAIB_CLI_WITH_CUDA).
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>

#include "cli.hpp"
#include "topk.hpp"

namespace dsaib::cli {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw Error(ErrorCode::cuda_error, "cuda", std::string(what) + " failed: " + cudaGetErrorName(e) + " (" +
                                                   cudaGetErrorString(e) + ")");
  }
}

/// A device buffer freed on scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (n > 0) check(cudaMalloc(&ptr, n), "cudaMalloc");
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct Event {
  cudaEvent_t e = nullptr;
  Event() { check(cudaEventCreate(&e), "cudaEventCreate"); }
  ~Event() {
    if (e) cudaEventDestroy(e);
  }
};

}  // namespace

bool cli_built_with_cuda() { return true; }

std::string cuda_unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) return "no CUDA device visible";
  if (e != cudaSuccess) return std::string("no CUDA device visible (") + cudaGetErrorName(e) + ")";
  if (n == 0) return "no CUDA device visible";
  if (cuda_backend_available()) return "";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    return std::string("device 0 (") + prop.name + ") is sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
           ", the cuda backend needs sm_90";
  }
  return "the cuda backend is not available on this machine";
}

RunResult run_cuda(const Problem& p, const Geometry&, DType out_dtype, int warmup, int repeat, LossOp op) {
  if (!cuda_backend_available()) {
    throw Error(ErrorCode::backend_unavailable, "backend", "backend cuda: " + cuda_unavailable_reason());
  }
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  RunResult r;
  r.timer = "cudaEvent";
  r.device = std::string(prop.name) + " (device " + std::to_string(dev) + ", sm_" + std::to_string(prop.major) +
             std::to_string(prop.minor) + ")";

  // Inputs to the device.
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  auto upload = [&](const char* name) -> TensorView {
    const auto it = p.tensors.find(name);
    if (it == p.tensors.end()) return TensorView{};
    const HostTensor& t = it->second;
    buffers.push_back(std::make_unique<DeviceBuffer>(t.bytes.size()));
    if (!t.bytes.empty()) {
      check(cudaMemcpy(buffers.back()->ptr, t.bytes.data(), t.bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    }
    TensorView v = t.view();
    v.data = buffers.back()->ptr;
    v.device = DeviceType::cuda;
    v.device_index = dev;
    return v;
  };
  IndexerInputs in;
  in.index_q = upload("index_q");
  in.weights = upload("weights");
  in.index_k = upload("index_k");
  in.topk_indices = upload("topk_indices");
  in.attn_score = upload("attn_score");
  if (op == LossOp::backward) in.index_score = upload("index_score");
  in.cu_seqlens_q = upload("cu_seqlens_q");
  in.cu_seqlens_k = upload("cu_seqlens_k");

  // Outputs on the device.
  const std::vector<HostTensor*> host_out = allocate_outputs(p, op, out_dtype, r);
  std::vector<std::unique_ptr<DeviceBuffer>> dev_out;
  std::vector<TensorView> out_views;
  for (HostTensor* t : host_out) {
    dev_out.push_back(std::make_unique<DeviceBuffer>(t->bytes.size()));
    TensorView v = t->view();
    v.data = dev_out.back()->ptr;
    v.device = DeviceType::cuda;
    v.device_index = dev;
    out_views.push_back(v);
  }

  IndexerOptions opt = p.options;
  opt.backend = Backend::cuda;
  opt.stream = nullptr;
  const size_t ws_bytes = op_workspace_size(op, in, out_views, opt);
  DeviceBuffer ws(ws_bytes);  // cudaMalloc is 256-byte aligned

  Event start, stop;
  const std::string sync_what = std::string("cudaEventSynchronize (the ") + loss_op_name(op) + " kernels)";
  for (int i = 0; i < warmup + repeat; ++i) {
    // Poison the outputs (all-ones bytes are NaN in bf16 and f32): every element must be written.
    for (const auto& b : dev_out) {
      if (b->bytes) check(cudaMemsetAsync(b->ptr, 0xff, b->bytes, nullptr), "cudaMemsetAsync");
    }
    check(cudaEventRecord(start.e, nullptr), "cudaEventRecord");
    run_op(op, in, out_views, opt, ws.ptr, ws.bytes);
    check(cudaEventRecord(stop.e, nullptr), "cudaEventRecord");
    check(cudaEventSynchronize(stop.e), sync_what.c_str());
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start.e, stop.e), "cudaEventElapsedTime");
    if (i >= warmup) r.seconds.push_back(ms * 1e-3);
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (size_t i = 0; i < host_out.size(); ++i) {
    if (!host_out[i]->bytes.empty()) {
      check(cudaMemcpy(host_out[i]->bytes.data(), dev_out[i]->ptr, host_out[i]->bytes.size(), cudaMemcpyDeviceToHost),
            "cudaMemcpy D2H");
    }
  }
  return r;
}

void run_topk_cuda(TopkRun& run, int warmup, int repeat) {
  if (!cuda_backend_available()) {
    throw Error(ErrorCode::backend_unavailable, "backend", "backend cuda: " + cuda_unavailable_reason());
  }
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  run.timer = "cudaEvent";
  run.device = std::string(prop.name) + " (device " + std::to_string(dev) + ", sm_" + std::to_string(prop.major) +
               std::to_string(prop.minor) + ")";
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  auto on_device = [&](const HostTensor& t, bool upload) -> TensorView {
    if (t.empty()) return TensorView{};
    buffers.push_back(std::make_unique<DeviceBuffer>(t.bytes.size()));
    if (upload && !t.bytes.empty()) {
      check(cudaMemcpy(buffers.back()->ptr, t.bytes.data(), t.bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    }
    TensorView v = t.view();
    v.data = buffers.back()->ptr;
    v.device = DeviceType::cuda;
    v.device_index = dev;
    return v;
  };
  IndexerTopkInputs in{on_device(run.index_q, true),      on_device(run.weights, true),
                       on_device(run.index_k, true),      on_device(run.starts, true),
                       on_device(run.ends, true),         on_device(run.cu_seqlens_q, true),
                       on_device(run.cu_seqlens_k, true), on_device(run.index_q_scale, true),
                       on_device(run.index_k_scale, true)};
  HostTensor* host_out[] = {&run.topk_indices, &run.topk_logits, &run.topk_lengths};
  const size_t first_out = buffers.size();
  IndexerTopkOutputs out{on_device(run.topk_indices, false), on_device(run.topk_logits, false),
                         on_device(run.topk_lengths, false)};
  IndexerTopkOptions opt = run.options;
  opt.backend = Backend::cuda;
  opt.stream = nullptr;
  DeviceBuffer ws(indexer_topk_workspace_size(in, out, opt));  // cudaMalloc is 256-byte aligned
  Event start, stop;
  for (int i = 0; i < warmup + repeat; ++i) {
    // Poison the outputs (all-ones bytes: -1 ids and NaN logits): every element must be written.
    for (size_t b = first_out; b < buffers.size(); ++b) {
      if (buffers[b]->bytes) check(cudaMemsetAsync(buffers[b]->ptr, 0xff, buffers[b]->bytes, nullptr), "cudaMemsetAsync");
    }
    check(cudaEventRecord(start.e, nullptr), "cudaEventRecord");
    indexer_topk(in, out, opt, ws.ptr, ws.bytes);
    check(cudaEventRecord(stop.e, nullptr), "cudaEventRecord");
    check(cudaEventSynchronize(stop.e), "cudaEventSynchronize (the indexer_topk kernel)");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start.e, stop.e), "cudaEventElapsedTime");
    if (i >= warmup) run.seconds.push_back(ms * 1e-3);
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const TensorView dev_out[] = {out.topk_indices, out.topk_logits, out.topk_lengths};
  for (int k = 0; k < 3; ++k) {
    if (!host_out[k]->bytes.empty()) {
      check(cudaMemcpy(host_out[k]->bytes.data(), dev_out[k].data, host_out[k]->bytes.size(), cudaMemcpyDeviceToHost),
            "cudaMemcpy D2H");
    }
  }
}

}  // namespace dsaib::cli
