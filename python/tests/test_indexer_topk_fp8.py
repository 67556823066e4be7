"""indexer_topk with float8 e4m3 index_q and index_k on the cpu backend:
torch float8_e4m3fn tensors and numpy uint8 codes (uint8_as_e4m3=True), with
and without their scales, against the selection computed in torch (float64)
from the dequantised values; negative scales; the errors naming the argument.
Skipped when torch is not installed."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsaib  # noqa: E402
import dsaib.torch as dt  # noqa: E402


def problem(seed=0, B=2, S=40, H=8, D=32, negative=False):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, S, H, D, generator=g) * 6).to(torch.float8_e4m3fn)
    k = (torch.randn(B, S, D, generator=g) * 6).to(torch.float8_e4m3fn)
    w = torch.randn(B, S, H, generator=g)
    qs = torch.rand(B, S, H, generator=g) + 0.25
    ks = torch.rand(B, S, generator=g) + 0.25
    if negative:
        ks = ks * torch.where(torch.rand(B, S, generator=g) < 0.5, -1.0, 1.0)
    return q, w, k, qs, ks


def reference(q, w, k, qs, ks, topk):
    """(logits sorted descending, ids) of each causal row, in float64, ties by id."""
    qd, kd = q.double(), k.double()
    scale = w.double() * (qs.double() if qs is not None else 1.0)
    logits = (scale.unsqueeze(-1) * torch.relu(torch.einsum("bshd,btd->bsht", qd, kd))).sum(2)
    if ks is not None:
        logits = logits * ks.double().unsqueeze(1)
    S = q.shape[1]
    visible = torch.arange(S).unsqueeze(0) <= torch.arange(S).unsqueeze(1)
    logits = logits.masked_fill(~visible, -float("inf"))
    # logit descending, then id ascending: sort by id first, then a stable sort by logit
    order = torch.sort(logits, dim=-1, descending=True, stable=True)
    return order.values[..., :topk], order.indices[..., :topk].to(torch.int32)


@pytest.mark.parametrize("scales", ["both", "k", "none"])
@pytest.mark.parametrize("negative", [False, True])
def test_torch_float8_matches_the_float64_selection(scales, negative):
    q, w, k, qs, ks = problem(seed=3, negative=negative)
    qs = qs if scales == "both" else None
    ks = ks if scales in ("both", "k") else None
    K = 12
    ids, logits = dt.indexer_topk(q, w, k, K, index_q_scale=qs, index_k_scale=ks, return_logits=True)
    want_logits, want_ids = reference(q, w, k, qs, ks, K)
    valid = want_logits > -float("inf")
    assert torch.equal(ids[valid], want_ids[valid])
    assert (ids[~valid] == -1).all()
    assert torch.allclose(logits[valid].double(), want_logits[valid], rtol=1e-6, atol=1e-30)


def test_numpy_uint8_codes_equal_the_torch_call():
    q, w, k, qs, ks = problem(seed=5)
    want = dt.indexer_topk(q, w, k, 8, index_q_scale=qs, index_k_scale=ks)
    got = dsaib.indexer_topk(q.view(torch.uint8).numpy(), w.numpy(), k.view(torch.uint8).numpy(), 8,
                             index_q_scale=qs.numpy(), index_k_scale=ks.numpy(), uint8_as_e4m3=True)
    assert np.array_equal(np.asarray(got), want.numpy())
    with pytest.raises(TypeError, match="uint8_as_e4m3=True"):
        dsaib.indexer_topk(q.view(torch.uint8).numpy(), w.numpy(), k.view(torch.uint8).numpy(), 8)


def test_errors_name_the_argument():
    q, w, k, qs, ks = problem(seed=7)
    with pytest.raises(TypeError, match="index_k: expected dtype torch.float8_e4m3fn \\(as index_q, "
                                        "torch.float8_e4m3fn\\), got torch.bfloat16"):
        dt.indexer_topk(q, w, k.to(torch.bfloat16), 8)
    with pytest.raises((TypeError, ValueError), match="index_k: expected dtype e4m3 \\(that of index_q\\)"):
        dsaib.indexer_topk(q, w, k.to(torch.bfloat16), 8)  # the library's own rule, through DLPack
    with pytest.raises(ValueError, match="index_q_scale: expected absent with bf16"):
        dt.indexer_topk(q.to(torch.bfloat16), w, k.to(torch.bfloat16), 8, index_q_scale=qs)
    with pytest.raises(ValueError, match="index_k_scale: expected shape"):
        dt.indexer_topk(q, w, k, 8, index_k_scale=ks[:, :5])
    with pytest.raises(TypeError, match="index_q_scale"):
        dt.indexer_topk(q, w, k, 8, index_q_scale=[1.0])


def test_float64_scales_reach_the_cpu_backend_unrounded():
    # a key scale of 1 + 2^-30 ranks key 1 above key 0 only in float64 (in float32 they tie, and id 0 goes first)
    q = torch.ones(1, 1, 1, 1).to(torch.float8_e4m3fn)
    k = torch.ones(1, 2, 1).to(torch.float8_e4m3fn)
    w = torch.ones(1, 1, 1)
    ks = torch.tensor([[1.0, 1.0 + 2.0 ** -30]], dtype=torch.float64)
    got = dt.indexer_topk(q, w, k, 2, index_k_scale=ks, causal_offset=1)
    assert got.tolist() == [[[1, 0]]]
    generic = dsaib.indexer_topk(q.view(torch.uint8).numpy(), w.numpy(), k.view(torch.uint8).numpy(), 2,
                                 index_k_scale=ks.numpy(), causal_offset=1, uint8_as_e4m3=True)
    assert np.asarray(generic).tolist() == [[[1, 0]]]


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_float8_index_k_with_another_index_q_is_refused(q_dtype):
    q, w, k, qs, ks = problem(seed=9)
    with pytest.raises(TypeError, match=f"index_k: expected a dtype other than torch.float8_e4m3fn \\(as index_q, "
                                        f"{q_dtype}\\), got torch.float8_e4m3fn"):
        dt.indexer_topk(q.to(q_dtype), w, k, 8)
    # the other way round, the index_k passed is named, not the bf16 it would be rounded to
    with pytest.raises(TypeError, match=f"index_k: expected dtype torch.float8_e4m3fn \\(as index_q, "
                                        f"torch.float8_e4m3fn\\), got {q_dtype}"):
        dt.indexer_topk(q, w, k.to(q_dtype), 8)


@pytest.mark.parametrize("dtype", [d for d in (getattr(torch, n, None) for n in (
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")) if d is not None])
def test_other_float8_formats_are_refused_by_name(dtype):
    """Their codes would be rounded to bf16 and their scales misread: named, with the dtype passed."""
    q, w, k, qs, ks = problem(seed=9)
    with pytest.raises(TypeError, match=f"index_q: expected bf16 \\(or a float dtype rounded to it\\) or "
                                        f"torch.float8_e4m3fn, got {dtype}"):
        dt.indexer_topk(q.float().to(dtype), w, k, 8, index_q_scale=qs, index_k_scale=ks)
    with pytest.raises(TypeError, match=f"index_k: .* got {dtype}"):
        dt.indexer_topk(q.float(), w, k.float().to(dtype), 8)


@pytest.mark.parametrize("name", ["index_q_scale", "index_k_scale"])
def test_integer_scales_are_refused_by_name(name):
    q, w, k, qs, ks = problem(seed=9)
    scales = dict(index_q_scale=qs, index_k_scale=ks)
    scales[name] = scales[name].to(torch.int32)
    with pytest.raises(TypeError, match=f"{name}: expected a floating-point dtype \\(float32\\), got torch.int32"):
        dt.indexer_topk(q, w, k, 8, **scales)


def test_other_dlpack_float8_dtypes_are_named():
    """float8_e5m2 reaches the library through DLPack (code 12): the message names it."""
    q, w, k, qs, ks = problem(seed=9)
    with pytest.raises(TypeError, match="index_q: expected dtype bf16 or e4m3.*got float8_e5m2"):
        dsaib.indexer_topk(q.to(torch.float8_e5m2), w, k.to(torch.float8_e5m2), 8)


def test_the_loss_refuses_float8_leaves_and_the_flag_is_a_bool():
    """The loss has no scales: float8 leaves would silently lose them."""
    q, w, k, qs, ks = problem(seed=9)
    ids = dt.indexer_topk(q, w, k, 8)
    T = torch.rand(ids.shape).masked_fill(ids < 0, 0)
    for fn in (dt.indexer_kl_loss, dt.indexer_kl_loss_and_grad):
        with pytest.raises(TypeError, match="index_q: expected a dtype the loss rounds to bf16"):
            fn(q, w, k, ids, T, sm_scale=1.0)
    with pytest.raises(TypeError, match="uint8_as_e4m3: expected a bool"):
        dsaib.indexer_topk(q.view(torch.uint8).numpy(), w.numpy(), k.view(torch.uint8).numpy(), 8,
                           uint8_as_e4m3="false")
