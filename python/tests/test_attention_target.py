"""The attention target T (dsaib.attention_target, dsaib.torch.attention_target):
against the definition in numpy float64 (BSHD/THD, invalid slots, lse in natural
log and base 2, normalised or not); the torch op and its chain to the loss and
gradients; and against megatron-core's own torch implementation of the DSA
indexer loss (compute_dsa_indexer_loss, sparse_loss=True) on its seq-first
layouts: its target read out through the gradient of its loss, and its loss.
The megatron tests skip when megatron-core is not importable; the cuda variants
skip without a CUDA device with the cuda backend."""
import math

import numpy as np
import pytest

import dsaib
from attention_target_cases import SOFTMAX_SCALE, make_numpy_problem, numpy_target
from attention_target_cases import devices as _devices, torch_or_skip as _torch

Di_SCALE = 64 ** -0.5  # the indexer's


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("lse_base", ["natural", "base2"])
@pytest.mark.parametrize("normalize", [True, False])
def test_numpy_against_definition(layout, lse_base, normalize):
    p = make_numpy_problem(3, layout)
    lse = p["lse_arg"] if lse_base == "natural" else (p["lse_arg"] / np.float32(math.log(2))).astype(np.float32)
    T = dsaib.attention_target(p["query"], p["kv"], lse, p["ids_arg"], sm_scale=SOFTMAX_SCALE, lse_base=lse_base,
                               normalize=normalize, uint16_as_bf16=True, **p["options"])
    assert T.dtype == np.float32 and T.shape == p["ids_arg"].shape
    flat_lse = lse.reshape(p["lse"].shape).astype(np.float64)
    want = numpy_target(p["q32"], p["kv32"], flat_lse, p["ids"], p["valid_key"], SOFTMAX_SCALE, lse_base, normalize)
    got = T.reshape(want.shape).astype(np.float64)
    assert np.count_nonzero(want) > 5
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    assert not got[1].any()  # the row without a valid slot


def test_numpy_errors_and_out():
    p = make_numpy_problem(4, "bshd")
    args = (p["query"], p["kv"], p["lse_arg"], p["ids_arg"])
    out = np.full(p["ids_arg"].shape, np.nan, np.float32)
    got = dsaib.attention_target(*args, sm_scale=SOFTMAX_SCALE, uint16_as_bf16=True, out=out)
    assert got is out and np.isfinite(out).all()
    with pytest.raises(ValueError, match=r'^lse_base: expected "natural" or "base2", got "e"$'):
        dsaib.attention_target(*args, sm_scale=SOFTMAX_SCALE, uint16_as_bf16=True, lse_base="e")
    with pytest.raises(TypeError, match=r"^lse: expected dtype f32 \(or f64 on the cpu backend\), got float16$"):
        dsaib.attention_target(p["query"], p["kv"], p["lse_arg"].astype(np.float16), p["ids_arg"],
                               sm_scale=SOFTMAX_SCALE, uint16_as_bf16=True)
    with pytest.raises(ValueError, match=r"^lse: expected shape \(2, 4, 16\) \(B, S_q, Hq\), got shape \(2, 4, 8\)$"):
        dsaib.attention_target(p["query"], p["kv"], p["lse_arg"][..., :8], p["ids_arg"], sm_scale=SOFTMAX_SCALE,
                               uint16_as_bf16=True)
    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite value, got inf$"):
        dsaib.attention_target(*args, sm_scale=math.inf, uint16_as_bf16=True)
    with pytest.raises(TypeError, match=r"^normalize: expected a bool"):
        dsaib.attention_target(*args, sm_scale=SOFTMAX_SCALE, uint16_as_bf16=True, normalize=1)
    with pytest.raises(TypeError, match=r"^kv: expected an array"):
        dsaib.attention_target(p["query"], None, p["lse_arg"], p["ids_arg"], sm_scale=SOFTMAX_SCALE)
    bad = np.full(p["ids_arg"].shape, np.nan, np.float32)
    with pytest.raises(ValueError, match=r"^attn_score: expected shape"):
        dsaib.attention_target(*args, sm_scale=SOFTMAX_SCALE, uint16_as_bf16=True, out=bad[..., :3])
    assert np.isnan(bad).all()  # nothing written
    read_only = np.full(p["ids_arg"].shape, np.nan, np.float32)
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match=r"^out: expected writable arrays, got a read-only attn_score$"):
        dsaib.attention_target(*args, sm_scale=SOFTMAX_SCALE, uint16_as_bf16=True, out=read_only)
    with pytest.raises(TypeError, match=r"^out: expected a float32 array shaped like topk_indices, got str for "
                                        r"attn_score$"):
        dsaib.attention_target(*args, sm_scale=SOFTMAX_SCALE, uint16_as_bf16=True, out="attn_score")
    assert np.isnan(read_only).all()


def test_generic_out_that_requires_grad_is_refused():
    torch = pytest.importorskip("torch")
    p = make_numpy_problem(4, "bshd")
    args = (p["query"], p["kv"], p["lse_arg"], p["ids_arg"])
    args = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in args)
    leaf = torch.full(tuple(p["ids_arg"].shape), 7.0, requires_grad=True)
    with pytest.raises(ValueError, match=r"^out: expected tensors that do not require grad \(they are written in "
                                        r"place\), got attn_score with requires_grad=True$"):
        dsaib.attention_target(*args, sm_scale=SOFTMAX_SCALE, uint16_as_bf16=True, out=leaf)
    assert (leaf.detach() == 7.0).all()


# ---- torch -------------------------------------------------------------------


def test_torch_op_matches_numpy_api_and_lse_strides():
    torch = _torch()
    import dsaib.torch as dt

    p = make_numpy_problem(5, "bshd")
    q = torch.from_numpy(p["query"].view(np.int16)).view(torch.bfloat16)
    kv = torch.from_numpy(p["kv"].view(np.int16)).view(torch.bfloat16)
    lse = torch.from_numpy(p["lse_arg"])
    ids = torch.from_numpy(p["ids_arg"])
    want = dsaib.attention_target(p["query"], p["kv"], p["lse_arg"], p["ids_arg"], sm_scale=SOFTMAX_SCALE,
                                  uint16_as_bf16=True)
    got = dt.attention_target(q, kv, lse, ids, sm_scale=SOFTMAX_SCALE)
    assert torch.equal(got, torch.from_numpy(want))
    # lse as the transposed view of a (B, Hq, S_q) tensor (FlashMLA's layout), int64 ids.
    lse_t = lse.permute(0, 2, 1).contiguous().permute(0, 2, 1)
    assert not lse_t.is_contiguous()
    assert torch.equal(dt.attention_target(q, kv, lse_t, ids.long(), sm_scale=SOFTMAX_SCALE), got)
    u = dt.attention_target(q, kv, lse, ids, sm_scale=SOFTMAX_SCALE, normalize=False)
    assert torch.allclose(u / u.sum(-1, keepdim=True).clamp_min(1e-30), got, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"^query: expected rank 4"):
        dt.attention_target(q[0], kv, lse, ids, sm_scale=SOFTMAX_SCALE)


def test_torch_opcheck_and_compile():
    torch = _torch()
    import dsaib.torch as dt

    p = make_numpy_problem(6, "thd")
    q = torch.from_numpy(p["query"].view(np.int16)).view(torch.bfloat16)
    kv = torch.from_numpy(p["kv"].view(np.int16)).view(torch.bfloat16)
    cu_q = torch.from_numpy(p["options"]["cu_seqlens_q"])
    cu_k = torch.from_numpy(p["options"]["cu_seqlens_k"])
    args = (q, kv, torch.from_numpy(p["lse_arg"]), torch.from_numpy(p["ids_arg"]), cu_q, cu_k, SOFTMAX_SCALE,
            "base2", True, "thd", "local")
    torch.library.opcheck(torch.ops.dsaib.attention_target.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        fake = torch.ops.dsaib.attention_target(*fake_args)
    assert fake.shape == args[3].shape and fake.dtype == torch.float32

    def f(*a):
        return dt.attention_target(*a[:4], sm_scale=SOFTMAX_SCALE, lse_base="base2", layout="thd",
                                   cu_seqlens_q=a[4], cu_seqlens_k=a[5])

    eager = f(*args[:6])
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(*args[:6]), eager)


@pytest.mark.parametrize("device", _devices())
def test_chain_equals_target_then_loss_and_grad(device):
    torch = _torch()
    import dsaib.torch as dt

    g = torch.Generator().manual_seed(7)
    B, S, Hi, Di, Hq, Dqk, K = 2, 6, 8, 64, 16, 128, 4
    index_q = torch.randn(B, S, Hi, Di, generator=g).bfloat16().to(device)
    weights = torch.randn(B, S, Hi, generator=g).to(device)
    index_k = torch.randn(B, S, Di, generator=g).bfloat16().to(device)
    query = torch.randn(B, S, Hq, Dqk, generator=g).bfloat16().to(device)
    kv = torch.randn(B, S, Dqk, generator=g).bfloat16().to(device)
    lse = (torch.rand(B, S, Hq, generator=g) * 3 + 2).to(device)
    ids = torch.randint(-1, S, (B, S, K), generator=g, dtype=torch.int32).to(device)
    loss, dq, dw, dk = dt.indexer_kl_loss_and_grad_from_attention(
        index_q, weights, index_k, query, kv, lse, ids, sm_scale=Di ** -0.5, softmax_scale=Dqk ** -0.5,
        lse_base="base2", loss_coeff=0.5)
    T = dt.attention_target(query, kv, lse, ids, sm_scale=Dqk ** -0.5, lse_base="base2")
    want = dt.indexer_kl_loss_and_grad(index_q, weights, index_k, ids, T, sm_scale=Di ** -0.5, loss_coeff=0.5)
    assert loss.device == index_q.device and dq.dtype == torch.bfloat16 and dw.dtype == torch.float32
    for a, b in zip((loss, dq, dw, dk), want):
        assert torch.equal(a, b) if device == "cpu" else torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-6)
    assert torch.isfinite(loss) and loss.item() > 0


# ---- megatron-core -------------------------------------------------------------


def _megatron_loss():
    pytest.importorskip("torch")
    mod = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa",
                              reason="megatron-core is not importable")
    return mod.compute_dsa_indexer_loss


class _NoTensorParallel:
    class tp:  # noqa: N801 (megatron's ProcessGroupCollection.tp)
        @staticmethod
        def size():
            return 1


def _megatron_problem(torch, device, seed=11, b=2, s=16, heads=16, hn=64, topk=6, hi=8, di=64):
    """Tensors on megatron's layouts (query/key seq-first, key per head) and on
    ours; each row's ids are distinct, min(t + 1, topk) causal ones first, then
    keys after t, which megatron's causal mask drops and which are -1 in ours."""
    g = torch.Generator().manual_seed(seed)
    query_sbhd = torch.randn(s, b, heads, hn, generator=g).bfloat16()
    kv = torch.randn(b, s, hn, generator=g).bfloat16()
    ids_mc = torch.zeros(b, s, topk, dtype=torch.int64)
    for bi in range(b):
        for t in range(s):
            c = min(t + 1, topk)
            causal = torch.randperm(t + 1, generator=g)[:c]
            later = t + 1 + torch.randperm(s - t - 1, generator=g)[:topk - c]
            ids_mc[bi, t] = torch.cat([causal, later])
    t_pos = torch.arange(s).view(1, s, 1)
    ids = torch.where(ids_mc <= t_pos, ids_mc, torch.full_like(ids_mc, -1)).to(torch.int32)
    query = query_sbhd.permute(1, 0, 2, 3).contiguous()  # (b, s, heads, hn)
    # lse over each row's selected causal keys: the per-head softmax of sparse_loss=True.
    logits = SOFTMAX_SCALE * torch.einsum("bthd,btkd->bthk", query.double(),
                                          kv.double()[torch.arange(b).view(b, 1, 1), ids_mc.clamp_min(0)])
    valid = (ids >= 0).unsqueeze(2)
    lse = torch.logsumexp(logits.masked_fill(~valid, -math.inf), dim=-1).float()  # (b, s, heads)
    index_q = torch.randn(b, s, hi, di, generator=g).bfloat16()
    weights = torch.randn(b, s, hi, generator=g)
    index_k = torch.randn(b, s, di, generator=g).bfloat16()
    key_sbhd = kv.permute(1, 0, 2).unsqueeze(2).expand(s, b, heads, hn)
    to = lambda x: x.to(device)  # noqa: E731
    return dict(query_sbhd=to(query_sbhd), key_sbhd=to(key_sbhd), ids_mc=to(ids_mc), query=to(query), kv=to(kv),
                lse=to(lse), ids=to(ids), index_q=to(index_q), weights=to(weights), index_k=to(index_k))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("lse_base", ["natural", "base2", "none"])
def test_against_megatron_core(device, lse_base):
    compute_dsa_indexer_loss = _megatron_loss()
    torch = _torch()
    import dsaib.torch as dt

    p = _megatron_problem(torch, device)
    b, s, topk = p["ids"].shape
    loss_coeff = 0.7
    # "none": no lse given, the library takes each head's softmax over the selected keys itself
    lse = dict(natural=p["lse"], base2=p["lse"] / math.log(2), none=None)[lse_base]
    lse_base = "natural" if lse_base == "none" else lse_base
    T = dt.attention_target(p["query"], p["kv"], lse, p["ids"], sm_scale=SOFTMAX_SCALE, lse_base=lse_base)
    # P: the indexer's softmax over the valid slots; megatron takes logits on the
    # dense (b, s, s) grid: log P at the selected causal keys, -inf elsewhere.
    P = dt.index_scores(p["index_q"], p["weights"], p["index_k"], p["ids"], sm_scale=Di_SCALE)
    valid = p["ids"] >= 0
    dense = torch.full((b, s, s), -math.inf, device=device)
    dense.scatter_(-1, p["ids_mc"], torch.where(valid, P.log(), torch.full_like(P, -math.inf)))
    index_scores = dense.clone().requires_grad_(True)
    loss_mc = compute_dsa_indexer_loss(index_scores.clone(), p["ids_mc"], p["query_sbhd"], p["key_sbhd"],
                                       SOFTMAX_SCALE, loss_coeff, True, _NoTensorParallel())
    loss_mc.backward()
    # d(KL)/d(logits) = (loss_coeff / N) (P - T) at the selected keys: megatron's T.
    n = b * s
    grad = index_scores.grad.gather(-1, p["ids_mc"])
    T_mc = torch.where(valid, P - grad * n / loss_coeff, torch.zeros_like(P))
    rel = ((T - T_mc).norm() / T_mc.norm()).item()
    assert rel <= 1e-5, rel
    assert torch.isfinite(T).all() and (T[~valid] == 0).all()

    # The loss: ours is the cross entropy -sum T log P, megatron's the KL
    # sum T (log(T + 1e-10) - log(P + 1e-10)); the difference is its entropy term.
    loss, *_ = dt.indexer_kl_loss_and_grad_from_attention(
        p["index_q"], p["weights"], p["index_k"], p["query"], p["kv"], lse, p["ids"], sm_scale=Di_SCALE,
        softmax_scale=SOFTMAX_SCALE, lse_base=lse_base, loss_coeff=loss_coeff)
    Td, Pd = T.double(), P.double()
    entropy = torch.where(valid, Td * (Td + 1e-10).log(), torch.zeros_like(Td)).sum()
    clamp = torch.where(valid, Td * ((Pd + 1e-10).log() - Pd.log()), torch.zeros_like(Td)).sum()
    want = loss.double() + loss_coeff / n * (entropy - clamp)
    assert abs(want.item() - loss_mc.item()) <= 1e-5 * abs(loss_mc.item()), (want.item(), loss_mc.item())



def _torch_target_problem(torch, seed=8, B=2, S=5, S_kv=7, Hq=16, Dqk=64, K=4):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, S, Hq, Dqk, generator=g).bfloat16()
    kv = torch.randn(B, S_kv, Dqk, generator=g).bfloat16()
    lse = torch.rand(B, S, Hq, generator=g) * 3 + 2
    ids = torch.randint(0, S_kv, (B, S, K), generator=g, dtype=torch.int32)
    return query, kv, lse, ids


@pytest.mark.parametrize("kw, message", [
    (dict(normalize="false"), "normalize: expected a bool, got str 'false'"),
    (dict(normalize=0), "normalize: expected a bool, got int 0"),
    (dict(layout=None), 'layout: expected a str ("bshd" or "thd"), got NoneType None'),
    (dict(id_mode=3), 'id_mode: expected a str ("local" or "global"), got int 3'),
    (dict(lse_base=None), 'lse_base: expected a str ("natural" or "base2"), got NoneType None'),
    (dict(sm_scale="0.1"), "sm_scale: expected a real number, got str '0.1'"),
])
def test_torch_attention_target_argument_types(kw, message):
    torch = _torch()
    import dsaib.torch as dt

    query, kv, lse, ids = _torch_target_problem(torch)
    kw = dict(dict(sm_scale=SOFTMAX_SCALE), **kw)
    with pytest.raises(TypeError) as e:
        dt.attention_target(query, kv, lse, ids, **kw)
    assert str(e.value) == message
    # as the numpy entry point says it
    with pytest.raises(TypeError) as e_np:
        dsaib.attention_target(query.float().numpy(), kv.float().numpy(), lse.numpy(), ids.numpy(), **kw)
    assert str(e_np.value) == message
    # the words still reach the library's own check
    with pytest.raises(ValueError, match=r'^layout: expected "bshd" or "thd", got "BSHD"'):
        dt.attention_target(query, kv, lse, ids, sm_scale=SOFTMAX_SCALE, layout="BSHD")


def test_torch_attention_target_ids_outside_int32_are_invalid_slots():
    torch = _torch()
    import dsaib.torch as dt

    query, kv, lse, ids = _torch_target_problem(torch, seed=9)
    far, invalid = ids.long(), ids.long()
    far[0, 0, :3] = torch.tensor([2**32, 2**32 + 1, -(2**32) + 2])  # wrapped: 0, 1, 2
    invalid[0, 0, :3] = -1
    got = dt.attention_target(query, kv, lse, far, sm_scale=SOFTMAX_SCALE)
    assert torch.equal(got, dt.attention_target(query, kv, lse, invalid, sm_scale=SOFTMAX_SCALE))
    assert torch.all(got[0, 0, :3] == 0)
    assert not torch.equal(got, dt.attention_target(query, kv, lse, far.to(torch.int32), sm_scale=SOFTMAX_SCALE))


def test_torch_float64_lse_on_cpu_is_not_rounded():
    """lse ~ 1000 (scores ~ 1000): float32 would move each head's share by up to
    |lse| 2^-24 ~ 6e-5; a float64 lse on CPU reaches the library unrounded."""
    torch = _torch()
    import dsaib.torch as dt

    g = torch.Generator().manual_seed(12)
    B, S, Hq, D, K, scale = 1, 6, 16, 64, 5, 16.0
    query = (1 + 0.05 * torch.randn(B, S, Hq, D, generator=g)).bfloat16()
    kv = (1 + 0.05 * torch.randn(B, S, D, generator=g)).bfloat16()
    ids = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(S)]).reshape(B, S, K).int()
    s = scale * torch.einsum("bthd,bkd->bthk", query.double(), kv.double())      # (B, S, Hq, S_kv)
    lse = torch.logsumexp(s, -1) + 0.3 * torch.rand(B, S, Hq, generator=g, dtype=torch.float64)
    assert lse.min() > 900
    picked = torch.gather(s, 3, ids.long()[:, :, None, :].expand(B, S, Hq, K))  # (B, S, Hq, K)
    u = torch.exp(picked - lse[..., None]).sum(2)
    want = u / u.sum(-1, keepdim=True)
    got = dt.attention_target(query, kv, lse, ids, sm_scale=scale).double()
    assert ((got - want).abs() / want).max() < 1e-6
    rounded = dt.attention_target(query, kv, lse.float(), ids, sm_scale=scale).double()
    assert ((rounded - want).abs() / want).max() > 1e-5  # what the float64 lse avoids


@pytest.mark.parametrize("softmax_scale, error, message", [
    (float("nan"), ValueError, "softmax_scale: expected a finite value, got nan"),
    (1e39, ValueError, "softmax_scale: expected a finite value, got inf"),
    ("0.1", TypeError, "softmax_scale: expected a real number, got str '0.1'"),
    (True, TypeError, "softmax_scale: expected a real number, got bool True"),
])
def test_torch_loss_from_attention_names_softmax_scale(softmax_scale, error, message):
    torch = _torch()
    import dsaib.torch as dt

    query, kv, lse, ids = _torch_target_problem(torch, seed=10)
    g = torch.Generator().manual_seed(10)
    index_q = torch.randn(2, 5, 8, 64, generator=g).bfloat16()
    weights = torch.randn(2, 5, 8, generator=g)
    index_k = torch.randn(2, 7, 64, generator=g).bfloat16()
    with pytest.raises(error) as e:
        dt.indexer_kl_loss_and_grad_from_attention(index_q, weights, index_k, query, kv, lse, ids, sm_scale=0.125,
                                                   softmax_scale=softmax_scale)
    assert str(e.value) == message
    # the indexer's own scale keeps its name
    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite value, got nan"):
        dt.indexer_kl_loss_and_grad_from_attention(index_q, weights, index_k, query, kv, lse, ids,
                                                   sm_scale=float("nan"), softmax_scale=SOFTMAX_SCALE)


def test_torch_attention_target_strict_indices():
    torch = _torch()
    import dsaib.torch as dt

    query, kv, lse, ids = _torch_target_problem(torch, seed=10)
    bad = ids.clone()
    bad[1, 2, 0] = kv.shape[1] + 1  # outside the sequence
    as_minus_one = ids.clone()
    as_minus_one[1, 2, 0] = -1
    with pytest.raises(ValueError, match=r"^topk_indices: strict mode found an out-of-range id"):
        dt.attention_target(query, kv, lse, bad, sm_scale=SOFTMAX_SCALE, strict_indices=True)
    with pytest.raises(ValueError, match=r"^topk_indices: strict mode found an out-of-range id"):
        dt.attention_target(query, kv, lse, bad.long() + 2**40, sm_scale=SOFTMAX_SCALE, strict_indices=True)
    assert torch.equal(dt.attention_target(query, kv, lse, bad, sm_scale=SOFTMAX_SCALE),
                       dt.attention_target(query, kv, lse, as_minus_one, sm_scale=SOFTMAX_SCALE))
    dt.attention_target(query, kv, lse, ids, sm_scale=SOFTMAX_SCALE, strict_indices=True)
