"""The attention target without an lse (dsaib.attention_target and
dsaib.torch.attention_target with lse=None): each head's softmax over the row's
selected keys, against the definition in numpy and torch float64, head shards,
Megatron-Core's formulation, and the op's schema and compile."""
import math

import numpy as np
import pytest

import dsaib
from attention_target_cases import SOFTMAX_SCALE, make_numpy_problem
from attention_target_cases import devices as _devices, torch_or_skip as _torch


# ---- without an lse: each head's softmax over the row's selected keys ------------


def numpy_selected_target(q, kv, ids, valid_key, sm_scale, normalize=True):
    """T without a given lse, in float64: per row, each head's softmax over the
    row's valid slots (max-shifted), summed over the heads, L1-normalised."""
    R, K = ids.shape
    out = np.zeros((R, K))
    for r in range(R):
        rows = [valid_key(r, int(ids[r, i])) for i in range(K)]
        slots = [i for i in range(K) if rows[i] >= 0]
        if not slots:
            continue
        logits = sm_scale * (q[r].astype(np.float64) @ kv[[rows[i] for i in slots]].astype(np.float64).T)  # (H, n)
        logits -= logits.max(-1, keepdims=True)
        p = np.exp(logits)
        out[r, slots] = (p / p.sum(-1, keepdims=True)).sum(0)
        if normalize:
            out[r] /= out[r].sum()
    return out


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("normalize", [True, False])
def test_numpy_without_lse_against_definition(layout, normalize):
    p = make_numpy_problem(13, layout)
    kw = dict(sm_scale=SOFTMAX_SCALE, normalize=normalize, uint16_as_bf16=True, **p["options"])
    T = dsaib.attention_target(p["query"], p["kv"], None, p["ids_arg"], **kw)
    assert T.dtype == np.float32 and T.shape == p["ids_arg"].shape
    want = numpy_selected_target(p["q32"], p["kv32"], p["ids"], p["valid_key"], SOFTMAX_SCALE, normalize)
    got = T.reshape(want.shape).astype(np.float64)
    assert np.isfinite(got).all() and np.count_nonzero(want) > 5
    assert np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum()) < 1e-6
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    assert not got[1].any()  # the row without a valid slot
    sums = got.sum(-1)
    has_slot = (want != 0).any(-1)
    np.testing.assert_allclose(sums[has_slot], 1.0 if normalize else 16.0, rtol=1e-5)  # Hq = 16 heads
    # lse_base is not used without an lse; the dense lse of the problem gives another target
    assert np.array_equal(dsaib.attention_target(p["query"], p["kv"], None, p["ids_arg"], lse_base="base2", **kw), T)
    dense = dsaib.attention_target(p["query"], p["kv"], p["lse_arg"], p["ids_arg"], **kw)
    assert np.abs(dense - T).max() > 1e-3


def _selected_problem(torch, layout, seed=21, Hq=16, Dqk=64, K=8):
    """Torch tensors on our layouts: BSHD (2, 5, ...) over 9 keys per sequence or
    THD of sequences (3, 6) / (4, 10); ids with -1, in-range and past-the-end
    slots, and row 2 without a valid slot. Also the flat (R, Hq, Dqk), (Rk, Dqk)
    views and each row's first key row and key count."""
    g = torch.Generator().manual_seed(seed)
    q_lens, k_lens = ([5, 5], [9, 9]) if layout == "bshd" else ([3, 6], [4, 10])
    R, Rk = sum(q_lens), sum(k_lens)
    q = torch.randn(R, Hq, Dqk, generator=g).bfloat16()
    kv = torch.randn(Rk, Dqk, generator=g).bfloat16()
    k0 = torch.tensor([0] + k_lens[:-1]).cumsum(0)
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    klen = torch.tensor(k_lens)[seq]
    ids = torch.stack([torch.randint(-1, int(klen[r]) + 2, (K,), generator=g) for r in range(R)]).int()
    ids[2] = -1
    if layout == "bshd":
        args = (q.view(2, 5, Hq, Dqk), kv.view(2, 9, Dqk), ids.view(2, 5, K)), {}
    else:
        cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
        cu_k = torch.tensor([0] + k_lens).cumsum(0).int()
        args = (q, kv, ids), dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return (*args, q, kv, ids, k0[seq], klen)


def torch_selected_target(torch, q, kv, ids, key0, klen, sm_scale, normalize=True):
    """The independent float64 formulation: logits of each row's slots (R, Hq, K),
    -inf at invalid slots, torch.softmax over the slots per head (a row without a
    valid slot: zeros), summed over the heads, then each row / its sum."""
    valid = (ids >= 0) & (ids < klen[:, None])
    rows = torch.where(valid, key0[:, None] + ids.long(), torch.zeros_like(ids, dtype=torch.long))
    logits = sm_scale * torch.einsum("rhd,rkd->rhk", q.double(), kv.double()[rows])
    logits = logits.masked_fill(~valid[:, None, :], -math.inf)
    probs = torch.softmax(logits, -1).nan_to_num(0.0)  # all -inf: NaN -> 0
    u = probs.sum(1)
    if not normalize:
        return u
    total = u.sum(-1, keepdim=True)
    return torch.where(total > 0, u / total.clamp_min(1e-300), torch.zeros_like(u))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("normalize", [True, False])
def test_torch_without_lse_against_float64(device, layout, normalize):
    torch = _torch()
    import dsaib.torch as dt

    (q, kv, ids), kw, q_flat, kv_flat, ids_flat, key0, klen = _selected_problem(torch, layout)
    to = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    kw = {k: to(v) for k, v in kw.items()}
    T = dt.attention_target(to(q), to(kv), None, to(ids), sm_scale=SOFTMAX_SCALE, normalize=normalize, **kw)
    assert T.dtype == torch.float32 and T.shape == ids.shape and T.device.type == device
    got = T.cpu().double().reshape(ids_flat.shape)
    want = torch_selected_target(torch, q_flat, kv_flat, ids_flat, key0, klen, SOFTMAX_SCALE, normalize)
    assert torch.isfinite(got).all()
    assert (want != 0).sum() > 10
    rel_rms = ((got - want).norm() / want.norm()).item()
    max_rel = ((got - want).abs().max() / want.abs().max()).item()
    tol = 1e-6 if device == "cpu" else 1e-5
    assert rel_rms < tol and max_rel < tol, (rel_rms, max_rel)
    assert not got[2].any()  # the row without a valid slot
    # The fp64 reference on the cpu backend (numpy entry point) agrees.
    valid_key = lambda r, i: int(key0[r]) + i if 0 <= i < int(klen[r]) else -1  # noqa: E731
    ref = numpy_selected_target(q_flat.float().numpy(), kv_flat.float().numpy(), ids_flat.numpy(), valid_key,
                                SOFTMAX_SCALE, normalize)
    assert np.abs(ref - want.numpy()).max() < 1e-12


def test_torch_without_lse_head_shards_sum_then_normalize():
    """normalize=False over two head shards (tensor parallelism), summed (the
    all-reduce) and then normalised, equals the target over all heads: each
    shard's per-head lse is over the same selected keys."""
    torch = _torch()
    import dsaib.torch as dt

    (q, kv, ids), kw, *_ = _selected_problem(torch, "thd", seed=22, Hq=32)
    whole = dt.attention_target(q, kv, None, ids, sm_scale=SOFTMAX_SCALE, **kw)
    u = sum(dt.attention_target(q[:, h:h + 16].contiguous(), kv, None, ids, sm_scale=SOFTMAX_SCALE,
                                normalize=False, **kw) for h in (0, 16))
    T = u / u.sum(-1, keepdim=True).clamp_min(torch.finfo(u.dtype).tiny)
    assert torch.isfinite(T).all()
    assert ((T - whole).norm() / whole.norm()).item() < 1e-6


def test_torch_without_lse_megatron_formulation():
    """Megatron-Core's formulation (compute_dsa_indexer_loss, sparse_loss=True)
    written out in float64 on its dense grid: scores = softmax_scale * q . k over
    every key, -inf except at the row's selected causal keys, softmax per head,
    summed over heads, divided by the row's sum clamped at 1e-10. With distinct
    causal ids our target without an lse equals it."""
    torch = _torch()
    import dsaib.torch as dt

    g = torch.Generator().manual_seed(23)
    b, s, heads, hn, topk = 2, 12, 16, 64, 5
    query = torch.randn(b, s, heads, hn, generator=g).bfloat16()
    kv = torch.randn(b, s, hn, generator=g).bfloat16()
    ids = torch.full((b, s, topk), -1, dtype=torch.int32)
    for bi in range(b):
        for t in range(s):
            c = min(t + 1, topk)
            ids[bi, t, :c] = torch.randperm(t + 1, generator=g)[:c].int()
    scores = SOFTMAX_SCALE * torch.einsum("bshd,bkd->bhsk", query.double(), kv.double())  # (b, heads, s, s)
    # megatron's index mask: 0 at the selected keys (scattered; -1 slots go to a spare column), -inf elsewhere
    selected = torch.zeros(b, s, s + 1, dtype=torch.bool)
    selected.scatter_(-1, torch.where(ids >= 0, ids, s).long(), True)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = torch.where(selected[..., :s] & causal, 0.0, -math.inf).double()
    probs = torch.softmax(scores + mask[:, None], dim=-1).sum(1)  # (b, s, s)
    target = probs / probs.sum(-1, keepdim=True).clamp_min(1e-10)
    want = torch.where(ids >= 0, target.gather(-1, ids.long().clamp_min(0)), torch.zeros(ids.shape).double())
    got = dt.attention_target(query, kv, None, ids, sm_scale=SOFTMAX_SCALE).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-6
    assert (got - want).abs().max().item() < 1e-6


def test_torch_without_lse_op_schema_and_compile():
    torch = _torch()
    import dsaib.torch as dt

    (q, kv, ids), kw, *_ = _selected_problem(torch, "thd", seed=24)
    args = (q, kv, None, ids, kw["cu_seqlens_q"], kw["cu_seqlens_k"], SOFTMAX_SCALE, "natural", True, "thd", "local")
    torch.library.opcheck(torch.ops.dsaib.attention_target.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with mode:
        fake = torch.ops.dsaib.attention_target(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                  for a in args])
    assert fake.shape == ids.shape and fake.dtype == torch.float32

    def f(q, kv, ids, cu_q, cu_k):
        return dt.attention_target(q, kv, None, ids, sm_scale=SOFTMAX_SCALE, layout="thd", cu_seqlens_q=cu_q,
                                   cu_seqlens_k=cu_k)

    eager = f(q, kv, ids, kw["cu_seqlens_q"], kw["cu_seqlens_k"])
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(q, kv, ids, kw["cu_seqlens_q"],
                                                                         kw["cu_seqlens_k"]), eager)
    # the chain to the loss takes lse=None too
    g = torch.Generator().manual_seed(25)
    R = q.shape[0]
    index_q = torch.randn(R, 8, 64, generator=g).bfloat16()
    weights = torch.randn(R, 8, generator=g)
    index_k = torch.randn(kv.shape[0], 64, generator=g).bfloat16()
    loss, *_ = dt.indexer_kl_loss_and_grad_from_attention(index_q, weights, index_k, q, kv, None, ids,
                                                          sm_scale=0.125, softmax_scale=SOFTMAX_SCALE, **kw)
    want, *_ = dt.indexer_kl_loss_and_grad(index_q, weights, index_k, ids, eager, sm_scale=0.125, **kw)
    assert torch.equal(loss, want) and torch.isfinite(loss)
