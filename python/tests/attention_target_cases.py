"""The attention target's test problems, shared by test_attention_target.py and
test_attention_target_without_lse.py: the definition in numpy float64, a
random problem for it, and the devices the torch tests run on."""
import math

import numpy as np
import pytest

import dsaib

SOFTMAX_SCALE = 0.1  # the main attention's


def numpy_target(q, kv, lse, ids, valid_key, sm_scale, lse_base="natural", normalize=True):
    """T from the definition in float64. q (R, H, D), kv (Rk, D), lse (R, H) as
    float arrays, ids (R, K); valid_key(r, id) -> flat key row or -1."""
    R, K = ids.shape
    out = np.zeros((R, K))
    for r in range(R):
        for i in range(K):
            j = valid_key(r, int(ids[r, i]))
            if j < 0:
                continue
            s = q[r].astype(np.float64) @ kv[j].astype(np.float64)  # (H,)
            if lse_base == "natural":
                out[r, i] = np.exp(sm_scale * s - lse[r]).sum()
            else:
                out[r, i] = np.exp2(sm_scale * math.log2(math.e) * s - lse[r]).sum()
        if normalize:
            total = out[r].sum()
            out[r] = out[r] / total if total > 0 else 0.0
    return out


def make_numpy_problem(seed, layout, H=16, D=64, K=6):
    """bf16 bit patterns for query and kv; lse the dense log-sum-exp over the row's sequence."""
    rng = np.random.default_rng(seed)
    q_lens, k_lens = ([4, 4], [7, 7]) if layout == "bshd" else ([3, 0, 5], [6, 2, 9])
    R, Rk = sum(q_lens), sum(k_lens)
    q32 = dsaib.bf16_to_f32(dsaib.bf16_bits(rng.standard_normal((R, H, D)).astype(np.float32)))
    kv32 = dsaib.bf16_to_f32(dsaib.bf16_bits(rng.standard_normal((Rk, D)).astype(np.float32)))
    q_start = np.concatenate([[0], np.cumsum(q_lens)])
    k_start = np.concatenate([[0], np.cumsum(k_lens)])
    seq = np.repeat(np.arange(len(q_lens)), q_lens)
    lse = np.zeros((R, H), np.float32)
    ids = np.zeros((R, K), np.int32)
    for r in range(R):
        b = seq[r]
        keys = kv32[k_start[b]:k_start[b + 1]].astype(np.float64)
        logits = SOFTMAX_SCALE * np.einsum("hd,kd->hk", q32[r].astype(np.float64), keys)
        lse[r] = np.log(np.exp(logits).sum(-1)) if len(keys) else 0.0
        ids[r] = rng.integers(-1, k_lens[b] + 2, K)  # -1, in range, and just past the sequence
    ids[1] = -1  # a row without a valid slot

    def valid_key(r, i):
        b = seq[r]
        return k_start[b] + i if 0 <= i < k_lens[b] else -1

    tensors = dict(q32=q32, kv32=kv32, lse=lse, ids=ids, valid_key=valid_key)
    if layout == "bshd":
        B = len(q_lens)
        tensors.update(query=dsaib.bf16_bits(q32).reshape(B, q_lens[0], H, D),
                       kv=dsaib.bf16_bits(kv32).reshape(B, k_lens[0], D), lse_arg=lse.reshape(B, q_lens[0], H),
                       ids_arg=ids.reshape(B, q_lens[0], K), options={})
    else:
        tensors.update(query=dsaib.bf16_bits(q32), kv=dsaib.bf16_bits(kv32), lse_arg=lse, ids_arg=ids,
                       options=dict(layout="thd", cu_seqlens_q=q_start.astype(np.int32),
                                    cu_seqlens_k=k_start.astype(np.int32)))
    return tensors


def torch_or_skip():
    return pytest.importorskip("torch")


def devices():
    """cpu, and cuda where a CUDA device with the cuda backend is present (at
    collection: without torch, the tests skip when they run)."""
    try:
        import torch
    except ImportError:
        cuda = False
    else:
        cuda = torch.cuda.is_available() and dsaib.cuda_backend_available()
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not cuda, reason="no CUDA device with the "
                                                                              "cuda backend"))]
