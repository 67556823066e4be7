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

SOFTMAX_SCALE = 0.1  # the main attention's
Di_SCALE = 64 ** -0.5  # the indexer's


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


def _torch():
    return pytest.importorskip("torch")


def _devices():
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
