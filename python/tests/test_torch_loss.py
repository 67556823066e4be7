"""dsaib.torch.indexer_kl_loss (the autograd loss) and dsaib.torch.index_scores
on CPU tensors: against the float64 torch autograd reference (value, gradients,
gradcheck, finite differences), BSHD and THD, the gradients' dtypes, the
checks made before the forward with the library's messages, strided and wider
inputs, meta tensors, autocast, float64 with an inexact sm_scale. Skipped when
torch is not installed."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsaib  # noqa: E402
import dsaib.torch as dt  # noqa: E402
from torch_reference import (  # noqa: E402
    assert_close_rms, make_torch_problem, reference_grads, reference_index_scores, reference_loss,
)

SM = 0.125


def test_autograd_loss_passes_a_operand_precision_to_the_backward():
    q, w, k, ids, T = make_torch_problem(seed=13)
    grads = {}
    for word in ("auto", "bf16x2", "bf16"):
        leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
        dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM, a_operand_precision=word).backward()
        grads[word] = [x.grad for x in leaves]
        mod_leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
        mod = dt.IndexerKLLoss(sm_scale=SM, a_operand_precision=word)
        assert f"a_operand_precision={word}" in repr(mod)
        mod(*mod_leaves, ids, T).backward()
        for a, b in zip(mod_leaves, grads[word]):
            assert torch.equal(a.grad, b)
    for word in ("bf16x2", "bf16"):  # the CPU backend ignores it
        for a, b in zip(grads[word], grads["auto"]):
            assert torch.equal(a, b)
    msg = r'^a_operand_precision: expected "auto", "bf16x2" or "bf16", got "half"$'
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    with pytest.raises(ValueError, match=msg):
        dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM, a_operand_precision="half")
    with pytest.raises(ValueError, match=msg):
        dt.IndexerKLLoss(sm_scale=SM, a_operand_precision="half")


def test_index_scores_match_reference():
    q, w, k, ids, T = make_torch_problem(seed=5)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM, dtype=torch.float64)
    torch.testing.assert_close(P, reference_index_scores(q, w, k, ids, sm_scale=SM), rtol=1e-12, atol=1e-14)
    assert torch.all(P[-1, 2] == 0)  # the row with no valid slot


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_autograd_loss_matches_float64_reference(w_dtype):
    q, w, k, ids, T = make_torch_problem(seed=6, w_dtype=w_dtype)
    want_loss, *want = reference_grads(q, w, k, ids, T, sm_scale=SM, loss_coeff=0.9)
    qq, ww, kk = (x.detach().clone().requires_grad_() for x in (q, w, k))
    loss = dt.indexer_kl_loss(qq, ww, kk, ids, T, sm_scale=SM, loss_coeff=0.9)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * abs(want_loss.item())
    loss.backward()
    got = (qq.grad, ww.grad, kk.grad)
    assert [g.dtype for g in got] == [torch.bfloat16, w_dtype, torch.bfloat16]
    tol = 5e-3  # bf16 gradients (and bf16 weights) round the fp64 result
    for name, g, r in zip(("d_index_q", "d_weights", "d_index_k"), got, want):
        assert_close_rms(name, g, r, tol if g.dtype == torch.bfloat16 else 1e-5, 2 * tol)


@pytest.mark.parametrize("gradients", ["forward", "backward"])
def test_autograd_loss_f32_leaves_get_f32_gradients_equal_to_the_op(gradients):
    q, w, k, ids, T = make_torch_problem(seed=7)
    qq, ww, kk = (x.detach().float().requires_grad_() for x in (q, w, k))
    loss = dt.indexer_kl_loss(qq, ww, kk, ids, T, sm_scale=SM, gradients=gradients)
    loss.backward(torch.tensor(2.0))
    if gradients == "backward":
        # the library's P-free backward, fed with the forward's row statistics
        _, row_lse, row_target_mass = dsaib.indexer_kl_forward(q, w, k, ids, T, sm_scale=SM)
        want = dt.indexer_backward(q, w, k, ids, T, None, sm_scale=SM, grad_loss=2.0, row_lse=row_lse,
                                   row_target_mass=row_target_mass)
    else:
        # the loss and gradients in one call at grad_loss 1, then times 2 (exact in float32)
        one_call = dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM, out_dtype="f32")
        assert torch.equal(loss.detach(), one_call[0])
        want = tuple(2 * d for d in one_call[1:])
    for g, x in zip((qq.grad, ww.grad, kk.grad), want):
        assert g.dtype == torch.float32
        assert torch.equal(g, x)
    # and equals the backward given P, up to P's float32 rounding
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    with_p = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, grad_loss=2.0)
    for name, g, x in zip(("d_index_q", "d_weights", "d_index_k"), (qq.grad, ww.grad, kk.grad), with_p):
        assert_close_rms(name, g, x, 1e-6, 1e-6)


def test_autograd_loss_module_and_thd_match_bshd():
    q, w, k, ids, T = make_torch_problem(seed=8, invalid=False)
    B, S, H, D = q.shape
    S_kv = k.shape[1]
    mod = dt.IndexerKLLoss(sm_scale=SM, loss_coeff=1.0)
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    mod(*leaves, ids, T).backward()
    # the same problem packed as THD with global ids
    thd = [x.detach().float().reshape((-1,) + tuple(x.shape[2:])).requires_grad_() for x in (q, w, k)]
    gids = (ids.long() + S_kv * torch.arange(B).view(B, 1, 1)).to(torch.int32).reshape(B * S, -1)
    cu_q = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
    cu_k = torch.arange(0, (B + 1) * S_kv, S_kv, dtype=torch.int32)
    loss = dt.indexer_kl_loss(*thd, gids, T.reshape(B * S, -1), sm_scale=SM, layout="thd", id_mode="global",
                              cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    loss.backward()
    for a, b in zip(leaves, thd):
        torch.testing.assert_close(a.grad.reshape(b.grad.shape), b.grad, rtol=1e-6, atol=1e-9)


def test_autograd_loss_gradcheck_float64():
    # Values on the bf16 grid, so the op's bf16 view equals the float64 point.
    q, w, k, ids, T = make_torch_problem(B=1, S=4, S_kv=6, topk=4, seed=9)
    leaves = tuple(x.detach().double().requires_grad_() for x in (q, w.to(torch.bfloat16), k))
    f = lambda a, b, c: dt.indexer_kl_loss(a, b, c, ids, T, sm_scale=SM)  # noqa: E731
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_autograd_loss_finite_difference_of_reference():
    # directional derivative of the float64 reference loss vs the op's gradient
    q, w, k, ids, T = make_torch_problem(seed=10)
    qq, ww, kk = (x.detach().float().requires_grad_() for x in (q, w, k))
    dt.indexer_kl_loss(qq, ww, kk, ids, T, sm_scale=SM).backward()
    g = torch.Generator().manual_seed(0)
    base = [x.detach().double() for x in (q, w, k)]
    h = 1e-6
    for _ in range(3):
        v = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in base]
        hi = reference_loss(*(x + h * d for x, d in zip(base, v)), ids, T, sm_scale=SM)
        lo = reference_loss(*(x - h * d for x, d in zip(base, v)), ids, T, sm_scale=SM)
        fd = ((hi - lo) / (2 * h)).item()
        an = sum((gr.double() * d).sum() for gr, d in zip((qq.grad, ww.grad, kk.grad), v)).item()
        assert abs(fd - an) <= 1e-5 * max(abs(fd), 1e-3), (fd, an)


def test_autograd_loss_shape_errors_raise_before_the_forward_with_the_cpp_message():
    q, w, k, ids, T = make_torch_problem(seed=0)  # B2 S5 S_kv7 H8 D64 topk4
    qq = q.detach().float()[:, :, :4].contiguous().requires_grad_()  # H = 4: not a multiple of 8
    with pytest.raises(ValueError, match=r"^index_q: expected H \(heads, dim 2\) a multiple of 8 in \[8, 128\], got H = 4 \(shape \(2, 5, 4, 64\)\)$"):
        dt.indexer_kl_loss(qq, w[:, :, :4], k, ids, T, sm_scale=SM)
    cases = [
        (dict(attn_score=T[:, :, :3]), r"^attn_score: expected shape \(2, 5, 4\) \(B, S_q, topk\), topk from topk_indices, got shape \(2, 5, 3\)$"),
        (dict(weights=w[:, :2]), r"^weights: expected shape \(2, 5, 8\) \(B, S_q, H\), got shape \(2, 2, 8\)$"),
        (dict(index_k=k[:1]), r"^index_k: expected shape \(2, 7, 64\) \(B, S_kv, D\) with B and D of index_q, got shape \(1, 7, 64\)$"),
        (dict(topk_indices=ids[:, :3]), r"^topk_indices: expected shape \(2, 5, 4\) \(B, S_q, topk\), got shape \(2, 3, 4\)$"),
        (dict(index_q=q[0]), r"^index_q: expected rank 4, got rank 3 with shape \(5, 8, 64\)$"),
    ]
    args = dict(index_q=q, weights=w, index_k=k, topk_indices=ids, attn_score=T)
    for change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            dt.indexer_kl_loss(**dict(args, **change), sm_scale=SM)
    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite value, got nan$"):
        dt.indexer_kl_loss(**args, sm_scale=float("nan"))
    with pytest.raises(TypeError, match=r"^topk_indices: expected an integer dtype, got torch.float32$"):
        dt.indexer_kl_loss(**dict(args, topk_indices=ids.float()), sm_scale=SM)
    # the torch layer's dtype rules come before the library's rank and shape checks
    # (the op raises TypeError for the dtype too)
    with pytest.raises(TypeError, match=r"^attn_score: expected a floating-point dtype, got torch.int64$"):
        dt.indexer_kl_loss(**dict(args, attn_score=T[0].long()), sm_scale=SM)
    with pytest.raises(TypeError, match=r"^attn_score: "):
        dt.indexer_backward(q, w, k, ids, T[0].long(), T, sm_scale=SM)
    with pytest.raises(ValueError, match=r"^index_k: expected shape"):
        dt.index_scores(q, w, k[:1], ids, sm_scale=SM)
    # The same messages as the library's own validation (the op, all checks at once).
    with pytest.raises(ValueError, match=cases[1][1]):
        dt.indexer_backward(q, w[:, :2], k, ids, T, T, sm_scale=SM)


def test_autograd_loss_thd_cu_seqlens_errors_match_the_library():
    q, w, k, ids, T = make_torch_problem(seed=8, invalid=False)  # B2 S5 S_kv7
    B, S, H, D = q.shape
    S_kv = k.shape[1]
    qt, wt, kt = (x.reshape((-1,) + tuple(x.shape[2:])) for x in (q, w, k))
    gids = (ids.long() + S_kv * torch.arange(B).view(B, 1, 1)).to(torch.int32).reshape(B * S, -1)
    Tt = T.reshape(B * S, -1)
    cu_q = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
    cu_k = torch.arange(0, (B + 1) * S_kv, S_kv, dtype=torch.int32)
    base = dict(index_q=qt, weights=wt, index_k=kt, topk_indices=gids, attn_score=Tt, index_score=Tt,
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    bad_cu_k = cu_k.clone()
    bad_cu_k[-1] = 100
    cases = [
        dict(cu_seqlens_q=None),
        dict(cu_seqlens_q=cu_q.view(1, -1)),
        dict(cu_seqlens_q=cu_q[:0], cu_seqlens_k=cu_k[:0]),
        dict(cu_seqlens_k=torch.cat([cu_k, cu_k[-1:]])),
        dict(cu_seqlens_k=bad_cu_k),  # values: the forward must not index out of bounds
        dict(cu_seqlens_q=cu_q.flip(0)),
    ]
    for change in cases:
        a = dict(base, **change)
        with pytest.raises(ValueError) as lib:  # the library's own validation (the op)
            dt.indexer_backward(**a, sm_scale=SM, layout="thd", id_mode="global")
        loss_args = {n: a[n] for n in ("index_q", "weights", "index_k", "topk_indices", "attn_score",
                                       "cu_seqlens_q", "cu_seqlens_k")}
        with pytest.raises(ValueError) as ours:
            dt.indexer_kl_loss(**loss_args, sm_scale=SM, layout="thd", id_mode="global")
        assert str(ours.value) == str(lib.value), change
        with pytest.raises(ValueError) as ours:
            dt.index_scores(**{n: loss_args[n] for n in loss_args if n != "attn_score"}, sm_scale=SM,
                            layout="thd", id_mode="global")
        assert str(ours.value) == str(lib.value), change


def test_autograd_loss_sm_scale_must_be_finite_in_float32():
    q, w, k, ids, T = make_torch_problem(seed=0)
    with pytest.raises(ValueError) as lib:
        dt.indexer_backward(q, w, k, ids, T, T, sm_scale=1e39)
    with pytest.raises(ValueError) as ours:
        dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=1e39)
    assert str(ours.value) == str(lib.value) == "sm_scale: expected a finite value, got inf"


def test_autograd_loss_checks_loss_coeff_before_the_forward():
    # the library's message at the call, not first at backward()
    q, w, k, ids, T = make_torch_problem(seed=0)
    qq = q.detach().float().requires_grad_()
    with pytest.raises(ValueError, match=r"^loss_coeff: expected a finite value, got inf$"):
        dt.indexer_kl_loss(qq, w, k, ids, T, sm_scale=SM, loss_coeff=float("inf"))
    assert qq.grad is None


def test_loss_and_index_scores_refuse_meta_tensors_mixed_with_real_ones():
    # torch computes with a meta tensor beside cpu ones without an error (from
    # uninitialised memory); the forward checks devices first.
    q, w, k, ids, T = make_torch_problem(seed=8)
    with pytest.raises(ValueError, match=r"^weights: expected memory on device 'meta' \(that of index_q\), got device 'cpu'$"):
        dt.indexer_kl_loss(q.to("meta"), w, k, ids, T, sm_scale=SM)
    with pytest.raises(ValueError, match=r"^index_k: expected memory on device 'cpu' \(that of index_q\), got device 'meta'$"):
        dt.index_scores(q, w, k.to("meta"), ids, sm_scale=SM)


def test_index_scores_takes_any_integer_cu_seqlens():
    # no backward: int64 cu_seqlens (torch's default) are fine here; the library
    # validates them as int32
    q, w, k, ids, T = make_torch_problem(seed=9)
    B, S = q.shape[:2]
    S_kv = k.shape[1]
    P32 = dt.index_scores(q[0], w[0], k[0], ids[0], sm_scale=SM, layout="thd",
                          cu_seqlens_q=torch.tensor([0, S], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, S_kv], dtype=torch.int32))
    P64 = dt.index_scores(q[0], w[0], k[0], ids[0], sm_scale=SM, layout="thd",
                          cu_seqlens_q=torch.tensor([0, S]), cu_seqlens_k=torch.tensor([0, S_kv]))
    assert torch.equal(P32, P64)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: expected last value equal to T_k \(index_k dim 0\) = 7, "
                                         r"got 9$"):
        dt.index_scores(q[0], w[0], k[0], ids[0], sm_scale=SM, layout="thd",
                        cu_seqlens_q=torch.tensor([0, S]), cu_seqlens_k=torch.tensor([0, S_kv + 2]))


def _strided(t):
    """t's values in a non-contiguous tensor (its last two dims stored transposed)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else t[::1]


def test_loss_validates_what_the_backward_gets_from_strided_and_wider_inputs():
    # The forward converts (float -> bf16 q/k, float64 -> float32 w and T, int64 -> int32
    # ids, contiguous): the library's validation is shown tensors of those dtypes and
    # shapes, so strided and wider inputs pass and a bad shape among them gets the
    # op's message for the converted tensors.
    q, w, k, ids, T = make_torch_problem(seed=21)
    wide = [_strided(q.float()), _strided(w.double()), _strided(k.float()), _strided(ids.long()),
            _strided(T.double())]
    assert not any(t.is_contiguous() for t in wide)
    leaves = [x.detach().requires_grad_() for x in wide[:3]]
    loss = dt.indexer_kl_loss(*leaves, *wide[3:], sm_scale=SM)
    loss.backward()
    base = [x.detach().float().requires_grad_() for x in (q, w, k)]
    want = dt.indexer_kl_loss(*base, ids, T, sm_scale=SM)
    want.backward()
    torch.testing.assert_close(loss.float(), want, rtol=1e-6, atol=0)
    for a, b in zip(leaves, base):
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dt.index_scores(*wide[:4], sm_scale=SM).float(),
                               dt.index_scores(q, w, k, ids, sm_scale=SM), rtol=1e-6, atol=1e-7)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    with pytest.raises(ValueError) as lib:  # the op on the converted tensors
        dt.indexer_backward(q, w, k[:1], ids, T, P, sm_scale=SM)
    with pytest.raises(ValueError) as ours:
        dt.indexer_kl_loss(wide[0], wide[1], _strided(k.float()[:1]), *wide[3:], sm_scale=SM)
    assert str(ours.value) == str(lib.value)
    with pytest.raises(ValueError) as ours:
        dt.index_scores(wide[0], wide[1], _strided(k.float()[:1]), wide[3], sm_scale=SM)
    assert str(ours.value) == str(lib.value)


def test_loss_checks_loss_coeff_normalization_count_and_cu_seqlens_before_the_forward():
    q, w, k, ids, T = make_torch_problem(seed=3)
    with pytest.raises(ValueError, match=r"^loss_coeff: expected a finite value, got nan$"):
        dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, loss_coeff=float("nan"))
    with pytest.raises(ValueError, match=r"^loss_coeff: expected a finite value, got inf$"):
        dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, loss_coeff=1e39)
    with pytest.raises(ValueError, match=r"^normalization_count: expected >= 0 \(0 = number of query tokens\), got -2$"):
        dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, normalization_count=-2)
    with pytest.raises(ValueError, match=r"^normalization_count: expected an int in \[0, 2\^63-1\], got 9223372036854775808$"):
        dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, normalization_count=2**63)
    B, S, H, D = q.shape
    cu = torch.tensor([0, S], dtype=torch.int64)
    cu_k = torch.tensor([0, k.shape[1]], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^cu_seqlens_q: expected dtype i32, got int64$"):
        dt.indexer_kl_loss(q[0], w[0], k[0], ids[0], T[0], sm_scale=SM, layout="thd",
                           cu_seqlens_q=cu, cu_seqlens_k=cu_k)


def test_logits_stay_in_their_dtype_under_autocast():
    # dsaib::index_logits turns autocast off inside: eager returns the dtype its
    # fake kernel promises, which compiled graphs get (float32 here, not
    # autocast's bf16 bmm), and the loss under autocast equals the loss without it.
    g = torch.Generator().manual_seed(8)
    q, w, k = torch.randn(1, 4, 8, 64, generator=g), torch.randn(1, 4, 8, generator=g), torch.randn(1, 6, 64, generator=g)
    ids = torch.randint(-1, 6, (1, 4, 3), generator=g, dtype=torch.int32)
    T = torch.softmax(torch.randn(1, 4, 3, generator=g), -1)
    plain = dt.index_scores(q, w, k, ids, sm_scale=SM)
    plain_loss = dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = dt.index_scores(q, w, k, ids, sm_scale=SM)
        loss = dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, plain, rtol=0, atol=0)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)


def test_float64_loss_gradient_is_that_of_the_returned_loss_with_an_inexact_sm_scale():
    # The library applies sm_scale (and loss_coeff) as float32 and its backward
    # rebuilds P with that scale from row_lse; 128**-0.5 and 0.3 are not exact in
    # float32, so a float64 forward with the unrounded values would return a loss
    # whose gradient is not the one the backward gives (off by up to ~1e-5).
    sm_scale, loss_coeff = 128 ** -0.5, 0.3
    sm32, lc32 = float(np.float32(sm_scale)), float(np.float32(loss_coeff))
    assert sm32 != sm_scale and lc32 != loss_coeff
    q, w, k, ids, T = make_torch_problem(seed=21, scale=4.0)
    leaves = [x.detach().double().requires_grad_() for x in (q, w.to(torch.bfloat16), k)]  # on the bf16 grid
    T64 = T.double()
    loss = dt.indexer_kl_loss(*leaves, ids, T64, sm_scale=sm_scale, loss_coeff=loss_coeff)
    assert loss.dtype == torch.float64
    loss.backward()
    want_loss, *want = reference_grads(*leaves, ids, T64, sm_scale=sm32, loss_coeff=lc32)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    for name, g, r in zip(("d_index_q", "d_weights", "d_index_k"), (x.grad for x in leaves), want):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12 * r.abs().max().item(), msg=name)
    # the one call agrees with it
    one = dt.indexer_kl_loss_and_grad(*(x.detach() for x in leaves), ids, T64, sm_scale=sm_scale,
                                      loss_coeff=loss_coeff)
    for a, b in zip(one, (want_loss, *want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item())


@pytest.mark.parametrize("gradients", ["forward", "backward"])
def test_attn_score_is_a_constant_to_autograd(gradients):
    # docs/python.md: T is the distillation target; no gradient reaches it.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 8, 64, generator=gen).requires_grad_()
    w = torch.randn(1, 4, 8, generator=gen)
    k = torch.randn(1, 4, 64, generator=gen)
    ids = torch.tensor([[[0, 1], [1, 0], [2, 0], [3, 1]]], dtype=torch.int32)
    T = torch.full((1, 4, 2), 0.5, requires_grad=True)
    loss = dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=0.1, gradients=gradients)
    loss.backward()
    assert T.grad is None
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
