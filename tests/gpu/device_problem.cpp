#include "gpu/device_problem.hpp"

#include <stdexcept>

namespace dsaib::test {

bool gpu_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return false;
  }
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  return major == 9;
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

DeviceBuffer::DeviceBuffer(std::size_t n) : bytes(n) {
  if (n) check_cuda(cudaMalloc(&ptr, n), "cudaMalloc");
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr) cudaFree(ptr);
}
std::vector<unsigned char> DeviceBuffer::to_host() const {
  std::vector<unsigned char> h(bytes);
  if (bytes) check_cuda(cudaMemcpy(h.data(), ptr, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  return h;
}

DeviceTensor::DeviceTensor(const HostTensor& host) : buffer(host.bytes.size()) {
  if (host.empty()) return;
  if (!host.bytes.empty()) {
    check_cuda(cudaMemcpy(buffer.ptr, host.bytes.data(), host.bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  view = contiguous_view(buffer.ptr, host.dtype, host.shape.data(), static_cast<int32_t>(host.shape.size()),
                         DeviceType::cuda, 0);
}

DeviceTensor::DeviceTensor(DType dtype, const std::vector<int64_t>& shape) : DeviceTensor(HostTensor(dtype, shape)) {}

HostTensor DeviceTensor::to_host() const {
  HostTensor h(view.dtype, std::vector<int64_t>(view.shape, view.shape + view.rank));
  if (!h.bytes.empty()) check_cuda(cudaMemcpy(h.bytes.data(), buffer.ptr, h.bytes.size(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  return h;
}

void DeviceTensor::fill_bytes(unsigned char byte) {
  if (buffer.bytes) check_cuda(cudaMemset(buffer.ptr, byte, buffer.bytes), "cudaMemset");
}

void DeviceTensor::fill(double value) {
  HostTensor h(view.dtype, std::vector<int64_t>(view.shape, view.shape + view.rank));
  dsaib::test::fill(h, value);
  if (!h.bytes.empty()) check_cuda(cudaMemcpy(buffer.ptr, h.bytes.data(), h.bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}

DeviceProblem::DeviceProblem(const GeneratedProblem& p)
    : index_q(p.index_q), weights(p.weights), index_k(p.index_k), topk_indices(p.topk_indices),
      attn_score(p.attn_score), index_score(p.index_score), cu_seqlens_q(p.cu_seqlens_q), cu_seqlens_k(p.cu_seqlens_k) {}

IndexerInputs DeviceProblem::inputs() const {
  return {index_q.view, weights.view, index_k.view, topk_indices.view, attn_score.view, index_score.view,
          cu_seqlens_q.view, cu_seqlens_k.view};
}

DeviceOutputs::DeviceOutputs(const GeneratedProblem& p, DType dq, DType dw, DType dk)
    : d_index_q(dq, p.index_q.shape), d_weights(dw, p.weights.shape), d_index_k(dk, p.index_k.shape) {}

IndexerBackwardOutputs DeviceOutputs::views() const { return {d_index_q.view, d_weights.view, d_index_k.view}; }

void DeviceOutputs::poison() {
  d_index_q.fill_bytes(0xff);  // 0xffff / 0xffffffff: NaN in bf16 and f32
  d_weights.fill_bytes(0xff);
  d_index_k.fill_bytes(0xff);
}

OutputBuffers run_cuda(const GeneratedProblem& p, const IndexerOptions& options, DType dq, DType dw, DType dk) {
  DeviceProblem dp(p);
  DeviceOutputs out(p, dq, dw, dk);
  out.poison();
  IndexerOptions opt = options;
  opt.backend = Backend::cuda;
  indexer_backward(dp.inputs(), out.views(), opt);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize after indexer_backward");
  OutputBuffers host;
  host.d_index_q = out.d_index_q.to_host();
  host.d_weights = out.d_weights.to_host();
  host.d_index_k = out.d_index_k.to_host();
  return host;
}

uint64_t hash_bytes(const HostTensor& t) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : t.bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace dsaib::test
