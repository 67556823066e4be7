"""The loss given the top-k's logits (``topk_logits``) on CPU tensors: the
forward, the autograd loss (both gradient forms, float64 leaves) and the one
call agree with their forms that recompute the logits, to the float32
logits' rounding; the chain indexer_topk -> loss; the numpy/DLPack entry
points; torch.compile; errors naming the argument before anything runs.
Skipped when torch is not installed."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsaib  # noqa: E402
import dsaib.torch as dt  # noqa: E402

SM = 0.3


def chain(seed=3, B=2, S=48, H=16, D=64, K=16):
    """A problem whose ids and logits come from indexer_topk (causal), with a
    target T over the selected slots."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).bfloat16()
    k = torch.randn(B, S, D, generator=g).bfloat16()
    w = torch.randn(B, S, H, generator=g) / 4
    ids, logits = dt.indexer_topk(q, w, k, K, return_logits=True)
    T = torch.rand(B, S, K, generator=g)
    T = torch.where(ids >= 0, T, torch.zeros_like(T))
    return q, w, k, ids, T / T.sum(-1, keepdim=True), logits


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_forward_from_the_logits_equals_the_recomputed_forward():
    q, w, k, ids, T, logits = chain()
    want = dt.indexer_kl_forward(q, w, k, ids, T, sm_scale=SM, return_index_score=True)
    got = dt.indexer_kl_forward(q, w, k, ids, T, sm_scale=SM, return_index_score=True, topk_logits=logits)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # the given logits are what is read: other logits, another loss
    other = dt.indexer_kl_forward(q, w, k, ids, T, sm_scale=SM, topk_logits=logits * 2)
    assert abs(other[0].item() - want[0].item()) > 1e-3


@pytest.mark.parametrize("gradients", ["forward", "backward"])
def test_autograd_loss_from_the_logits(gradients):
    q, w, k, ids, T, logits = chain(seed=5)
    grads = []
    for given in (None, logits):
        leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
        loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM, gradients=gradients, topk_logits=given)
        grads.append((loss.detach(), torch.autograd.grad(loss, leaves)))
    (l0, g0), (l1, g1) = grads
    assert abs(l1.item() - l0.item()) <= 1e-6 * abs(l0.item())
    for a, b in zip(g1, g0):
        assert rel(a, b) < 1e-5
    # a constant: no gradient reaches the logits
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    lg = logits.clone().requires_grad_()
    dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM, gradients=gradients, topk_logits=lg).backward()
    assert lg.grad is None


def test_float64_leaves_take_the_logits_too():
    q, w, k, ids, T, logits = chain(seed=7)
    leaves = [x.detach().double().requires_grad_() for x in (q, w, k)]
    loss = dt.indexer_kl_loss(*leaves, ids, T.double(), sm_scale=SM, topk_logits=logits.double())
    loss.backward()
    want = dt.indexer_kl_loss(*[x.detach().double() for x in (q, w, k)], ids, T.double(), sm_scale=SM)
    assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item())
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("bad", ["row_of_minus_inf", "plus_inf", "nan"])
def test_float64_leaves_keep_the_librarys_rule_for_undefined_rows(bad):
    """A row whose valid logits give no softmax (all -inf, a +inf one, a NaN
    one) makes the loss and the gradients NaN, with float64 leaves (whose
    forward runs in torch) as with float32 ones (the library's forward)."""
    q, w, k, ids, T, logits = chain(seed=23)
    given = logits.clone()
    row = given[1, 30]
    assert (ids[1, 30] >= 0).all()
    if bad == "row_of_minus_inf":
        row.fill_(float("-inf"))
    else:
        row[2] = float("inf") if bad == "plus_inf" else float("nan")
    for dtype in (torch.float32, torch.float64):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, w, k)]
        loss = dt.indexer_kl_loss(*leaves, ids, T.to(dtype), sm_scale=SM, topk_logits=given, gradients="backward")
        loss.backward()
        assert torch.isnan(loss), (bad, dtype)
        assert all(torch.isnan(x.grad).any() for x in leaves), (bad, dtype)


def test_compiled_float64_loss_checks_the_logits_shape():
    """torch.compile skips the library's validation of a float64 loss's
    arguments (its forward runs in torch): logits of another shape with as
    many elements are refused by name, not read in the wrong order."""
    q, w, k, ids, T, logits = chain(seed=29)
    leaves = [x.detach().double().requires_grad_() for x in (q, w, k)]

    def step(q, w, k, ids, T, logits):
        return dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, topk_logits=logits)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    # the ValueError, or dynamo's RuntimeError that carries its message
    with pytest.raises((ValueError, RuntimeError), match=r"topk_logits: expected shape \(2, 48, 16\)"):
        compiled(*leaves, ids, T.double(), logits.transpose(0, 1).contiguous())


def test_one_call_from_the_logits():
    q, w, k, ids, T, logits = chain(seed=9)
    want = dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM, grad_loss=0.5, out_dtype="f32")
    got = dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM, grad_loss=0.5, out_dtype="f32",
                                      topk_logits=logits)
    assert abs(got[0].item() - want[0].item()) <= 1e-6 * abs(want[0].item())
    for a, b in zip(got[1:], want[1:]):
        assert rel(a, b) < 1e-5


def test_numpy_entry_points_take_the_logits():
    q, w, k, ids, T, logits = chain(seed=11)
    u16 = lambda t: t.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    args = (u16(q), w.numpy(), u16(k), ids.numpy(), T.numpy())
    want = dsaib.indexer_kl_forward(*args, sm_scale=SM, uint16_as_bf16=True)
    got = dsaib.indexer_kl_forward(*args, sm_scale=SM, uint16_as_bf16=True, topk_logits=logits.numpy())
    assert abs(float(np.asarray(got[0])) - float(np.asarray(want[0]))) <= 1e-6 * abs(float(np.asarray(want[0])))
    one = dsaib.indexer_kl_loss_and_grad(*args, sm_scale=SM, uint16_as_bf16=True, topk_logits=logits.numpy())
    assert np.isfinite(np.asarray(one[0]))
    with pytest.raises(TypeError, match="topk_logits"):
        dsaib.indexer_kl_forward(*args, sm_scale=SM, uint16_as_bf16=True, topk_logits=[1.0])


def test_every_form_of_the_loss_takes_the_logits():
    """dsaib.indexer_kl_loss (any DLPack producer) and the IndexerKLLoss module
    read the logits as dsaib.torch.indexer_kl_loss does."""
    q, w, k, ids, T, logits = chain(seed=19)
    want = dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, topk_logits=logits * 2)
    u16 = lambda t: t.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    got = dsaib.indexer_kl_loss(u16(q), w.numpy(), u16(k), ids.numpy(), T.numpy(), sm_scale=SM,
                                uint16_as_bf16=True, topk_logits=(logits * 2).numpy())
    assert float(np.asarray(got)) == want.item()
    assert dsaib.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, topk_logits=logits * 2).item() == want.item()
    module = dt.IndexerKLLoss(sm_scale=SM)
    assert module(q, w, k, ids, T, topk_logits=logits * 2).item() == want.item()
    assert module(q, w, k, ids, T).item() != want.item()  # the doubled logits were read


def test_compiled_loss_takes_the_logits():
    q, w, k, ids, T, logits = chain(seed=13, B=1, S=32)
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]

    def step(q, w, k, ids, T, logits):
        return dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, topk_logits=logits)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    loss = compiled(*leaves, ids, T, logits)
    assert abs(loss.item() - step(*leaves, ids, T, logits).item()) < 1e-6


def test_errors_name_topk_logits_before_anything_runs():
    q, w, k, ids, T, logits = chain(seed=17)
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    with pytest.raises(ValueError, match=r"topk_logits: expected shape \(2, 48, 16\)"):
        dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM, topk_logits=logits[..., :3])
    with pytest.raises(TypeError, match="topk_logits: expected a floating-point tensor"):
        dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM, topk_logits=ids)
    with pytest.raises(TypeError, match="topk_logits"):
        dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM, topk_logits="logits")
    with pytest.raises(ValueError, match="topk_logits"):
        dt.indexer_kl_forward(q, w, k, ids, T, sm_scale=SM, topk_logits=logits[:1])
    assert all(x.grad is None for x in leaves)
