// DLPack tensors (numpy, torch, cupy, jax, or any object with
// __dlpack__/__dlpack_device__, or a DLPack capsule, through nanobind::ndarray)
// as the library's dsaib::TensorView records and input/output structs
// (dlpack_views.cpp).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>
#include <string>

#include "dsaib/attention_target.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/indexer_topk.hpp"
#include "dsaib/tensor.hpp"

namespace dsaib_py {

namespace nb = nanobind;

/// An input tensor (read only) and an output tensor (written by the library).
using Array = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

/// DLPack's code of float8_e4m3fn (DLPack 1.1's kDLFloat8_e4m3fn), which
/// nanobind's dtype_code does not name.
inline constexpr uint8_t kDLFloat8E4m3fn = 10;

/// DLPack dtype as text: float32, bfloat16, int32, uint16, ...
std::string dtype_string(nb::dlpack::dtype dt);

/// "cpu", "cuda:N", or the DLPack device type for any other device.
std::string device_string(int dev_type, int dev_id);

/// The view of argument `name`: its dtype, shape, strides (in elements, as the
/// library counts them) and device. uint16_as_bf16: 16-bit integers are read
/// as bf16 bit patterns where the argument takes bf16.
dsaib::TensorView to_view(const char* name, const Array& a, bool uint16_as_bf16);
dsaib::TensorView to_view(const char* name, const OutArray& a, bool uint16_as_bf16);

/// The device a backend runs on, as "cpu" or "cuda:N" (N = index_q's device).
std::string backend_device(dsaib::Backend backend, const Array& index_q);

/// grad_loss given as a tensor: one float32 on the backend's device, read at run time.
const float* grad_loss_pointer(const Array& g, const std::string& want_device);

/// The inputs of the indexer's loss entry points; index_score, row_lse and
/// row_target_mass may be absent (the P-free form, or a forward), and
/// topk_logits is given only to the forward and the one call.
dsaib::IndexerInputs make_inputs(const Array& index_q, const Array& weights, const Array& index_k,
                                 const Array& topk_indices, const Array& attn_score,
                                 const std::optional<Array>& index_score, const std::optional<Array>& cu_seqlens_q,
                                 const std::optional<Array>& cu_seqlens_k, bool u16,
                                 const std::optional<Array>& row_lse = std::nullopt,
                                 const std::optional<Array>& row_target_mass = std::nullopt,
                                 const std::optional<Array>& topk_logits = std::nullopt);

dsaib::AttentionTargetInputs make_target_inputs(const Array& query, const Array& kv, const std::optional<Array>& lse,
                                                const Array& topk_indices, const std::optional<Array>& cu_seqlens_q,
                                                const std::optional<Array>& cu_seqlens_k, bool u16);

/// indexer_topk's inputs; index_q and index_k may be float8 e4m3 (DLPack's
/// float8_e4m3fn, or uint8 codes with u8 = uint8_as_e4m3), with their scales.
dsaib::IndexerTopkInputs make_topk_inputs(const Array& index_q, const Array& weights, const Array& index_k,
                                          const std::optional<Array>& starts, const std::optional<Array>& ends,
                                          const std::optional<Array>& cu_seqlens_q,
                                          const std::optional<Array>& cu_seqlens_k, bool u16,
                                          const std::optional<Array>& index_q_scale = std::nullopt,
                                          const std::optional<Array>& index_k_scale = std::nullopt, bool u8 = false);

dsaib::IndexerTopkOutputs make_topk_outputs(const OutArray& topk_indices, const std::optional<OutArray>& topk_logits,
                                            const std::optional<OutArray>& topk_lengths);

}  // namespace dsaib_py
