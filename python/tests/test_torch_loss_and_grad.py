"""torch CPU tests of the loss's wiring to the library: the autograd loss runs
the library's forward (indexer_kl_forward) and saves the row statistics, not P;
its backward is the P-free backward; the one-call loss and gradients
(indexer_kl_loss_and_grad). Skipped when torch is not installed."""
import math
import shutil

import pytest

torch = pytest.importorskip("torch")

import dsaib  # noqa: E402
import dsaib.torch as dt  # noqa: E402
from dsaib._torch import reference as torch_forward  # noqa: E402
from torch_reference import (  # noqa: E402
    EPS, assert_close_rms, make_torch_problem, reference_grads, reference_index_scores,
)

SM = 0.125
NAMES = ("d_index_q", "d_weights", "d_index_k")


def to_thd(q, w, k, ids, T):
    """The BSHD problem packed as THD with global ids: -1 stays -1, and a local id
    out of range becomes a row outside its sequence (still invalid)."""
    B, S = ids.shape[:2]
    S_kv = k.shape[1]
    flat = lambda x: x.reshape((-1,) + tuple(x.shape[2:]))  # noqa: E731
    base = S_kv * torch.arange(B).view(B, 1, 1)
    gids = torch.where(ids >= 0, ids.long() + base, torch.full_like(ids.long(), -1)).to(torch.int32)
    cu_q = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
    cu_k = torch.arange(0, (B + 1) * S_kv, S_kv, dtype=torch.int32)
    return (flat(q), flat(w), flat(k), flat(gids), flat(T),
            dict(layout="thd", id_mode="global", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))


def problem(layout, seed, **kw):
    """(q, w, k, ids, T, options) with invalid slots (-1, out of range, a row with none, a duplicate)."""
    q, w, k, ids, T = make_torch_problem(seed=seed, **kw)
    if layout == "thd":
        return to_thd(q, w, k, ids, T)
    return q, w, k, ids, T, {}


def reference_logits(q, w, k, ids):
    """z in float64 (BSHD, local ids), -inf at invalid slots."""
    q, w, k = (t.detach().double() for t in (q, w, k))
    B, S_kv = q.shape[0], k.shape[1]
    ids = ids.long()
    valid = (ids >= 0) & (ids < S_kv)
    b = torch.arange(B).view(B, 1, 1)
    x = torch.einsum("bshd,bsid->bshi", q, k[b, torch.where(valid, ids, torch.zeros_like(ids))])
    return (SM * torch.einsum("bsh,bshi->bsi", w, torch.relu(x))).masked_fill(~valid, float("-inf"))


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_loss_value_and_gradients_match_float64_reference(layout, w_dtype):
    q, w, k, ids, T = make_torch_problem(seed=21, w_dtype=w_dtype)
    want_loss, *want = reference_grads(q, w, k, ids, T, sm_scale=SM, loss_coeff=0.9)
    q2, w2, k2, ids2, T2, opts = problem(layout, 21, w_dtype=w_dtype)
    leaves = [x.detach().float().requires_grad_() for x in (q2, w2, k2)]
    loss = dt.indexer_kl_loss(*leaves, ids2, T2, sm_scale=SM, loss_coeff=0.9, **opts)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    # the library's loss: fp64 on the cpu backend, rounded once to float32
    assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item()), (loss.item(), want_loss.item())
    loss.backward(torch.tensor(1.5))
    for name, x, r in zip(NAMES, leaves, want):
        assert x.grad.dtype == torch.float32
        assert_close_rms(name, x.grad.reshape(r.shape), 1.5 * r, 1e-5, 1e-4)


def test_forward_saves_row_statistics_and_no_topk_sized_tensor_beyond_ids_and_T():
    q, w, k, ids, T = make_torch_problem(seed=22)  # int32 ids, float32 T: taken as they are
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM, gradients="backward")
    saved = [t for t in loss.grad_fn.saved_tensors if t is not None]
    topk_sized = [t for t in saved if tuple(t.shape) == tuple(ids.shape)]
    # the caller's own ids and T, not copies, and no P
    assert sorted(t.data_ptr() for t in topk_sized) == sorted([ids.data_ptr(), T.data_ptr()])
    per_row = [t for t in saved if tuple(t.shape) == tuple(ids.shape[:-1])]
    assert len(per_row) == 2 and all(t.dtype == torch.float32 for t in per_row)
    assert sum(t.numel() for t in saved) == sum(x.numel() for x in (q, w, k, ids, T)) + 2 * ids[..., 0].numel()
    # the row statistics: LSE of the logits and the target mass, against float64
    row_lse, row_target_mass = per_row
    z = reference_logits(q, w, k, ids)
    want_lse = torch.logsumexp(z, dim=-1)
    assert torch.equal(torch.isinf(row_lse), torch.isinf(want_lse))  # the row with no valid slot: -inf
    finite = torch.isfinite(want_lse)
    assert (row_lse[finite].double() - want_lse[finite]).abs().max().item() <= 1e-5
    P = reference_index_scores(q, w, k, ids, sm_scale=SM)
    valid = torch.isfinite(z)
    want_mass = torch.where(valid & (P >= EPS), T.double().clamp_min(EPS), torch.zeros_like(P)).sum(-1)
    # divided by sum_i exp(z_i - row_lse) = exp(LSE - row_lse): the P the backward rebuilds from the f32 LSE
    want_mass[finite] *= torch.exp(row_lse[finite].double() - want_lse[finite])
    torch.testing.assert_close(row_target_mass.double(), want_mass, rtol=1e-6, atol=0)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_gradients_in_forward_hold_the_gradients_alone(w_dtype):
    q, w, k, ids, T = make_torch_problem(seed=24)
    leaves = [x.detach().clone().to(dt_).requires_grad_() for x, dt_ in ((q, q.dtype), (w, w_dtype), (k, k.dtype))]
    loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM)  # gradients="forward", the default
    saved = loss.grad_fn.saved_tensors
    # d_index_q, d_weights, d_index_k in the leaves' dtypes and shapes; no input, no row statistics
    assert [(t.shape, t.dtype) for t in saved] == [(x.shape, x.dtype) for x in leaves]
    assert not {t.data_ptr() for t in saved} & {x.data_ptr() for x in (*leaves, ids, T)}
    want = dt.indexer_kl_loss_and_grad(q, w.to(w_dtype), k, ids, T, sm_scale=SM, grad_loss=1.0)
    assert torch.equal(loss.detach(), want[0])
    loss.backward(torch.tensor(0.5))  # a power of two: exact in bf16
    for g, x in zip((x.grad for x in leaves), want[1:]):
        assert torch.equal(g, 0.5 * x)
    # a leaf that needs no gradient: its gradient is not held
    # (the loss held: a graph whose outputs are gone may free what it saved)
    part = [leaves[0].detach(), leaves[1], leaves[2].detach()]
    part_loss = dt.indexer_kl_loss(*part, ids, T, sm_scale=SM)
    assert [t is None for t in part_loss.grad_fn.saved_tensors] == [True, False, True]
    # no gradient wanted: the loss alone, nothing held
    with torch.no_grad():
        assert dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM).grad_fn is None
    plain = dt.indexer_kl_loss(*(x.detach() for x in leaves), ids, T, sm_scale=SM)
    assert plain.grad_fn is None and torch.equal(plain, want[0])


def test_gradients_in_forward_scale_in_float32_and_refuse_a_graph_of_the_gradient():
    q, w, k, ids, T = make_torch_problem(seed=25)
    leaves = [x.detach().clone().requires_grad_() for x in (q, w, k)]  # bf16 q and k
    want = dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM, out_dtype="f32")
    g = 1.0 / 3.0  # not a power of two: one rounding of the float32 product
    dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM).backward(torch.tensor(g))
    one = dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM)  # the held gradients, in the leaves' dtypes
    for x, d in zip(leaves, one[1:]):
        assert torch.equal(x.grad, (d.float() * torch.tensor(g)).to(x.dtype))
    for x, r in zip(leaves, want[1:]):
        assert_close_rms("grad", x.grad.float(), r * g, 2 ** -8, 2 ** -7)
    # a graph of the gradient (for a second derivative) is refused when the
    # backward starts, in both forms and for float64 leaves
    for form, dtype in (("forward", None), ("backward", None), ("forward", torch.float64)):
        w2 = w.detach().to(dtype or w.dtype).clone().requires_grad_()
        args = (q, w2, k) if dtype is None else (q.double(), w2, k.double())
        loss = dt.indexer_kl_loss(*args, ids, T, sm_scale=SM, gradients=form)
        with pytest.raises(RuntimeError, match=r"^dsaib.torch.indexer_kl_loss: expected a first-order backward"):
            torch.autograd.grad(loss, w2, create_graph=True)


def test_scaled_gradient_keeps_the_shape_and_rounds_once_on_the_cpu():
    """The held gradients' scaling off the kernel (cpu, strided): the float32
    product rounded once to the asked dtype, in d's shape, 0-dim included."""
    from dsaib._torch.ops import scaled_gradient

    g = torch.tensor(1.0 / 3.0)
    for d in (torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(-2.25), torch.randn(3, 5).to(torch.bfloat16),
              torch.randn(5, 3).t()):
        for dtype in (torch.bfloat16, torch.float32):
            got = scaled_gradient(d, g, dtype)
            assert got.shape == d.shape and got.dtype == dtype
            assert torch.equal(got, (d.float() * g).to(dtype))


def test_forward_is_the_library_not_torch_logits(monkeypatch):
    q, w, k, ids, T = make_torch_problem(seed=23)

    def no_torch_logits(*a, **kw):
        raise AssertionError("the loss forward computed the logits in torch")

    monkeypatch.setattr(torch_forward, "logits", no_torch_logits)
    loss = dt.indexer_kl_loss(q.float(), w, k.float(), ids, T, sm_scale=SM, loss_coeff=0.7)
    want = dsaib.indexer_kl_forward(q, w, k, ids, T, sm_scale=SM, loss_coeff=0.7)[0]
    assert torch.equal(loss, want)


def test_float64_leaves_save_row_statistics_too():
    # float64: the forward runs in torch on the unrounded values (finite-difference
    # checks), and still hands the backward row statistics, not P. On CPU the
    # library runs in float64 too: float64 row statistics and attn_score in, float64
    # gradients out, unrounded, so they are the float64 reference's to rounding.
    q, w, k, ids, T = make_torch_problem(seed=24)
    leaves = [x.detach().double().requires_grad_() for x in (q, w.to(torch.bfloat16), k)]
    loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM)
    assert loss.dtype == torch.float64
    saved = [t for t in loss.grad_fn.saved_tensors if t is not None]
    by_ids_shape = [t for t in saved if tuple(t.shape) == tuple(ids.shape)]
    assert len(by_ids_shape) == 2 and by_ids_shape[0].data_ptr() == ids.data_ptr()
    assert by_ids_shape[1].dtype == torch.float64 and torch.equal(by_ids_shape[1], T.double())
    row_stats = [t for t in saved if tuple(t.shape) == tuple(ids.shape[:-1])]
    assert len(row_stats) == 2 and all(t.dtype == torch.float64 for t in row_stats)
    want_loss, *want = reference_grads(q, w.to(torch.bfloat16), k, ids, T, sm_scale=SM)
    assert abs(loss.item() - want_loss.item()) <= 1e-12 * abs(want_loss.item())
    loss.backward()
    for name, x, r in zip(NAMES, leaves, want):
        assert x.grad.dtype == torch.float64
        assert_close_rms(name, x.grad, r, 1e-12, 1e-12)
    # the one call: a float64 loss and gradients from the library's fp64 forward
    got = dt.indexer_kl_loss_and_grad(*(x.detach() for x in leaves), ids, T, sm_scale=SM)
    assert all(t.dtype == torch.float64 for t in got)
    assert abs(got[0].item() - want_loss.item()) <= 1e-12 * abs(want_loss.item())
    for name, d, r in zip(NAMES, got[1:], want):
        assert_close_rms(name, d, r, 1e-12, 1e-12)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("leaf_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_loss", [1.0, 2.5, "tensor"])
def test_one_call_equals_loss_and_autograd_gradients(layout, leaf_dtype, grad_loss):
    q, w, k, ids, T, opts = problem(layout, 25)
    g = torch.tensor(-0.75) if grad_loss == "tensor" else grad_loss
    leaves = [x.detach().to(leaf_dtype).requires_grad_() for x in (q, w, k)]
    # the two-step path (the loss forward, then the P-free backward); the default
    # form runs the one call itself (test_gradients_in_forward_hold_the_gradients_alone)
    loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=SM, loss_coeff=1.1, gradients="backward", **opts)
    loss.backward(g if isinstance(g, torch.Tensor) else torch.tensor(g))
    got = dt.indexer_kl_loss_and_grad(*(x.detach() for x in leaves), ids, T, sm_scale=SM, loss_coeff=1.1,
                                      grad_loss=g, **opts)
    assert len(got) == 4
    assert torch.equal(got[0], loss.detach())  # the same forward; grad_loss does not scale the loss
    for name, d, x in zip(NAMES, got[1:], leaves):
        assert d.dtype == x.grad.dtype == leaf_dtype and d.shape == x.shape and not d.requires_grad
        if leaf_dtype == torch.float32:
            # the one call keeps the row statistics in float64 on the cpu backend, the
            # two-step path passes them as float32 (seen: <= 1.5e-7 relative to the largest)
            assert_close_rms(name, d, x.grad, 1e-6, 1e-6)
        else:
            assert_close_rms(name, d, x.grad, 4e-3, 8e-3)  # one bf16 rounding apart at most


def test_one_call_errors_are_the_librarys():
    q, w, k, ids, T = make_torch_problem(seed=26)
    with pytest.raises(ValueError) as lib:
        dt.indexer_backward(q, w[:, :2], k, ids, T, T, sm_scale=SM)
    with pytest.raises(ValueError) as ours:
        dt.indexer_kl_loss_and_grad(q, w[:, :2], k, ids, T, sm_scale=SM)
    assert str(ours.value) == str(lib.value)
    assert str(ours.value).startswith("weights: expected shape (2, 5, 8)")
    with pytest.raises(ValueError) as lib:
        dsaib.indexer_backward(q, w, k, ids, T, T, sm_scale=SM, grad_loss=math.inf)
    with pytest.raises(ValueError) as ours:
        dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM, grad_loss=1e39)
    assert str(ours.value) == str(lib.value) == "grad_loss: expected a finite value, got inf"
    with pytest.raises(ValueError, match=r"^layout: expected \"bshd\" or \"thd\", got \"bhsd\"$"):
        dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM, layout="bhsd")
    with pytest.raises(TypeError, match=r"^topk_indices: expected an integer dtype, got torch.float32$"):
        dt.indexer_kl_loss_and_grad(q, w, k, ids.float(), T, sm_scale=SM)
    with pytest.raises(TypeError, match=r"^grad_loss: expected dtype float32"):
        dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM, grad_loss=torch.tensor(1.0, dtype=torch.float64))


def test_backward_op_takes_the_p_free_form_or_p_not_both():
    q, w, k, ids, T = make_torch_problem(seed=27)
    _, row_lse, row_target_mass = dsaib.indexer_kl_forward(q, w, k, ids, T, sm_scale=SM)
    with pytest.raises(ValueError, match=r"^row_lse: expected absent when index_score is given"):
        dt.indexer_backward(q, w, k, ids, T, T, sm_scale=SM, row_lse=row_lse, row_target_mass=row_target_mass)
    with pytest.raises(ValueError, match=r"^index_score: expected a tensor, or row_lse and row_target_mass"):
        dt.indexer_backward(q, w, k, ids, T, None, sm_scale=SM)
    with pytest.raises(ValueError, match=r"^row_lse: expected shape"):
        dt.indexer_backward(q, w, k, ids, T, None, sm_scale=SM, row_lse=row_lse[:1], row_target_mass=row_target_mass)


def test_opcheck_of_the_forward_the_one_call_and_the_p_free_backward():
    q, w, k, ids, T = make_torch_problem(seed=28)
    fwd = (q, w, k, ids, T, None, None, SM, 0.8, 0, "bshd", "local")
    result = torch.library.opcheck(torch.ops.dsaib.indexer_kl_forward.default, fwd)
    assert all(v == "SUCCESS" for v in result.values()), result
    with_p = fwd + (False, 0, None, True)
    result = torch.library.opcheck(torch.ops.dsaib.indexer_kl_forward.default, with_p)
    assert all(v == "SUCCESS" for v in result.values()), result
    _, row_lse, row_target_mass, none = torch.ops.dsaib.indexer_kl_forward(*fwd)
    assert none.shape == (0,)
    assert torch.ops.dsaib.indexer_kl_forward(*with_p)[3].shape == ids.shape
    g = torch.tensor(1.25)
    bwd = (q, w, k, ids, T, None, g, None, None, SM, 0.8, 0, "bshd", "local", "f32", "f32", "bf16", "auto",
           row_lse, row_target_mass)
    result = torch.library.opcheck(torch.ops.dsaib.indexer_backward.default, bwd)
    assert all(v == "SUCCESS" for v in result.values()), result
    one = (q, w, k, ids, T, g, None, None, SM, 0.8, 0, "bshd", "local", "f32", "f32", "bf16", "auto")
    result = torch.library.opcheck(torch.ops.dsaib.indexer_kl_loss_and_grad.default, one)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="torch.compile on CPU needs a C++ compiler (inductor)")
def test_one_call_compiles_in_one_graph():
    q, w, k, ids, T = make_torch_problem(seed=29)
    g = torch.tensor(2.0)

    def step(q, w, k, ids, T, g):
        return dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM, grad_loss=g)

    compiled = torch.compile(step, fullgraph=True)
    for a, b in zip(compiled(q, w, k, ids, T, g), step(q, w, k, ids, T, g)):
        assert torch.equal(a, b)


def test_strict_indices_raises_on_an_invalid_id_every_entry_point():
    """strict_indices=True: an id outside its sequence (or beyond int32) raises
    ValueError naming topk_indices before any output exists; without it the slot
    is ignored (the same result as -1 there)."""
    q, w, k, ids, T = make_torch_problem(seed=31)
    S_kv = k.shape[1]
    clean = torch.where(ids >= S_kv, torch.full_like(ids, -1), ids)
    bad = clean.clone()
    bad[0, 2, 1] = S_kv + 3
    far = clean.long()
    far[0, 2, 1] = 2**40
    as_minus_one = clean.clone()
    as_minus_one[0, 2, 1] = -1
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    calls = {
        "indexer_kl_loss": lambda i, **kw: dt.indexer_kl_loss(*leaves, i, T, sm_scale=SM, **kw),
        "indexer_kl_loss_and_grad": lambda i, **kw: dt.indexer_kl_loss_and_grad(q, w, k, i, T, sm_scale=SM, **kw),
        "indexer_backward": lambda i, **kw: dt.indexer_backward(q, w.float(), k, i.int(), T,
                                                                torch.full(T.shape, 0.25), sm_scale=SM, **kw),
        "IndexerKLLoss": lambda i, **kw: dt.IndexerKLLoss(sm_scale=SM, **kw)(*leaves, i, T),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"^topk_indices: strict mode found an out-of-range id"):
            call(bad, strict_indices=True)
        if name != "indexer_backward":  # takes int32 ids only
            with pytest.raises(ValueError, match=r"^topk_indices: strict mode found an out-of-range id"):
                call(far, strict_indices=True)
        got, want = call(bad), call(as_minus_one)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, b), name
        call(clean, strict_indices=True)  # valid ids pass
    with pytest.raises(TypeError, match=r"^strict_indices: expected a bool"):
        dt.indexer_kl_loss(*leaves, clean, T, sm_scale=SM, strict_indices="yes")


def test_the_step_bench_checks_the_three_forms_and_needs_cuda_to_time(tmp_path):
    """bench/torch_step.py: its --check on the CPU (the autograd step with the
    gradients formed in the forward equals the one call bitwise), and without a
    CUDA device its timing reports unavailable (exit 77) instead of running."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "torch_step.py"
    run = subprocess.run([sys.executable, str(bench), "--check-only", "--device", "cpu", "--heads", "8", "--dim", "64",
                          "--topk", "32", "--json", str(tmp_path / "check.json")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "check autograd_forward" in run.stdout and "(bitwise equal): ok" in run.stdout, run.stdout
    assert "check autograd_backward" in run.stdout, run.stdout
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, str(bench), "--seq", "256"], capture_output=True, text=True, timeout=300)
        assert run.returncode == 77 and '"status": "unavailable"' in run.stdout, run.stdout + run.stderr
