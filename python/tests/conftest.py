import os

# jax (when installed) must not take 75% of the GPU at import: torch and the
# dsaib cuda tests share the device in the same pytest process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

import dsaib


def pytest_addoption(parser):
    parser.addoption("--require-megatron", action="store_true",
                     help="fail test_megatron.py instead of skipping it when megatron-core 0.19 is not importable")


def make_problem(seed=0, B=2, S_q=5, S_kv=7, H=8, D=64, topk=4, invalid=True):
    """A small BSHD problem in numpy: bf16 inputs as uint16 bit patterns."""
    rng = np.random.default_rng(seed)
    q = dsaib.bf16_bits(rng.standard_normal((B, S_q, H, D)).astype(np.float32))
    w = rng.standard_normal((B, S_q, H)).astype(np.float32)
    k = dsaib.bf16_bits(rng.standard_normal((B, S_kv, D)).astype(np.float32))
    ids = rng.integers(0, S_kv, (B, S_q, topk)).astype(np.int32)
    if invalid:
        ids[0, 0, 0] = -1          # the conventional empty slot
        ids[1, 2, :] = -1          # a row with no valid slot
        ids[0, 1, 1] = S_kv + 3    # out of range: ignored (non-strict)
        ids[1, 3, 2] = ids[1, 3, 1]  # duplicate id in one row
    T = rng.random((B, S_q, topk)).astype(np.float32)
    T /= T.sum(-1, keepdims=True)
    P = rng.random((B, S_q, topk)).astype(np.float32)
    P /= P.sum(-1, keepdims=True)
    P[0, 3, 0] = 0.0               # below eps: masked out of g
    return dict(index_q=q, weights=w, index_k=k, topk_indices=ids, attn_score=T, index_score=P)


def numpy_reference(p, sm_scale, loss_coeff=1.0, grad_loss=1.0, normalization_count=0):
    """float64 implementation of docs/math.md (BSHD, local ids)."""
    q = dsaib.bf16_to_f32(p["index_q"]).astype(np.float64)
    k = dsaib.bf16_to_f32(p["index_k"]).astype(np.float64)
    w = p["weights"].astype(np.float64)
    ids = p["topk_indices"]
    T = p["attn_score"].astype(np.float64)
    P = p["index_score"].astype(np.float64)
    B, S_q, H, D = q.shape
    S_kv = k.shape[1]
    eps = np.exp(np.float64(-100.0))
    eps32 = float(np.float32(np.exp(-100.0)))
    N = normalization_count or B * S_q
    c = grad_loss * loss_coeff / N
    dq = np.zeros_like(q)
    dw = np.zeros_like(w)
    dk = np.zeros_like(k)
    for b in range(B):
        for t in range(S_q):
            valid = [(i, int(j)) for i, j in enumerate(ids[b, t]) if 0 <= j < S_kv]
            if not valid:
                continue
            g = {i: -c * max(T[b, t, i], eps) * (1.0 if P[b, t, i] >= eps32 else 0.0) for i, _ in valid}
            G = sum(g.values())
            for i, j in valid:
                gs = g[i] - P[b, t, i] * G
                x = q[b, t] @ k[b, j]  # (H,)
                dw[b, t] += sm_scale * gs * np.maximum(x, 0.0)
                a = gs * w[b, t] * sm_scale * (x > 0)  # (H,)
                dq[b, t] += a[:, None] * k[b, j][None, :]
                dk[b, j] += a @ q[b, t]
    return dq, dw, dk
