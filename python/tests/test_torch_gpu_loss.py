"""dsaib.torch.indexer_kl_loss (the autograd loss) and the one call
(dsaib.torch.indexer_kl_loss_and_grad) on CUDA tensors (the sm_90a kernels):
against a float64 torch autograd reference, gradcheck, finite differences,
both gradient forms (BSHD and THD, H 64 and 128, the tensors saved for the
backward), the one call against the loss and its autograd gradients,
CUDA-graph capture, and the library's checks of GPU cu_seqlens before the
forward.

Skipped (never passed) without torch, without a CUDA device, or when the
installed dsaib has no cuda backend (`pip install .` builds CPU-only; see
docs/python.md for the CUDA build).

Tolerances are the library's acceptance criteria (docs/math.md section 6):
relative RMS error <= 3e-3 for bf16 outputs and <= 1e-3 for float32 outputs,
with the maximum elementwise error (relative to the largest reference value)
checked beside it; NaN never passes; outputs are poisoned before each run.
"""
import math

import pytest

torch = pytest.importorskip("torch")

from torch_reference import cuda_skip_reason  # noqa: E402

if cuda_skip_reason():
    pytest.skip(cuda_skip_reason(), allow_module_level=True)

import dsaib.torch as dt  # noqa: E402
from dsaib._torch import ops as dt_ops  # noqa: E402
from dsaib._torch.convert import CODES  # noqa: E402
from torch_reference import (  # noqa: E402
    DEV, LINEARITY_RTOL, NAMES, TOL, assert_close_rms, cuda_problem, deterministic_algorithms, poison_allocator,
    reference_grads, reference_loss, rel_rms, warm_up_on_side_stream,
)


def test_autograd_loss_on_cuda_matches_float64_reference():
    q, w, k, ids, T = cuda_problem(B=2, S=64, S_kv=128, H=64, D=128, topk=128, seed=6)
    sm = 128 ** -0.5
    want_loss, *want = reference_grads(q, w, k, ids, T, sm_scale=sm, loss_coeff=1.3)
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=sm, loss_coeff=1.3)
    assert loss.device.type == "cuda" and loss.dtype == torch.float32
    assert abs(loss.item() - want_loss.item()) <= 1e-4 * abs(want_loss.item())
    loss.backward()
    for name, x, r in zip(NAMES, leaves, want):
        assert x.grad.dtype == torch.float32
        assert_close_rms(name, x.grad, r, *TOL[torch.float32])
    # bf16 leaves get bf16 gradients
    leaves16 = [x.detach().clone().requires_grad_() for x in (q, w, k)]
    dt.indexer_kl_loss(*leaves16, ids, T, sm_scale=sm, loss_coeff=1.3).backward()
    assert [x.grad.dtype for x in leaves16] == [torch.bfloat16, torch.float32, torch.bfloat16]
    for name, x, r in zip(NAMES, leaves16, want):
        assert_close_rms(name, x.grad, r, *TOL[x.grad.dtype])


def test_gradcheck_float64_tiny_cuda():
    # float64 leaves on the bf16 grid: the forward runs in float64, the op sees the same values.
    q, w, k, ids, T = cuda_problem(B=1, S=4, S_kv=6, H=8, D=64, topk=4, seed=7)
    leaves = tuple(x.detach().double().requires_grad_() for x in (q, w.to(torch.bfloat16), k))
    f = lambda a, b, c: dt.indexer_kl_loss(a, b, c, ids, T, sm_scale=0.125)  # noqa: E731
    # nondet_tol: d_index_k is accumulated with fp32 atomics (not bitwise reproducible)
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-5, rtol=1e-3, nondet_tol=1e-6)


def test_finite_difference_of_reference_loss_vs_cuda_gradient():
    q, w, k, ids, T = cuda_problem(B=1, S=16, S_kv=64, H=64, D=128, topk=48, seed=8)
    sm = 128 ** -0.5
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    dt.indexer_kl_loss(*leaves, ids, T, sm_scale=sm).backward()
    g = torch.Generator(device="cpu").manual_seed(1)
    base = [x.detach().double() for x in (q, w, k)]
    h = 1e-6
    for _ in range(4):
        v = [torch.randn(x.shape, generator=g, dtype=torch.float64).to(DEV) for x in base]
        hi = reference_loss(*(x + h * d for x, d in zip(base, v)), ids, T, sm_scale=sm)
        lo = reference_loss(*(x - h * d for x, d in zip(base, v)), ids, T, sm_scale=sm)
        fd = ((hi - lo) / (2 * h)).item()
        an = sum((x.grad.double() * d).sum() for x, d in zip(leaves, v)).item()
        assert math.isfinite(an) and abs(fd - an) <= 1e-3 * max(abs(fd), 1e-3), (fd, an)


@pytest.mark.parametrize("gradients", ["forward", "backward"])
def test_cuda_graph_capture_of_autograd_loss_backward(gradients):
    q, w, k, ids, T = cuda_problem(B=1, S=64, S_kv=128, H=64, D=128, topk=128, seed=12)
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    # The upstream gradient reaches the backward through autograd: the loss is
    # scaled by a static device scalar g inside the graph, so autograd's
    # grad_loss is g (computed on the capture stream; a grad_outputs tensor made
    # outside the capture would tie the capture to the legacy stream).
    g = torch.ones((), device=DEV)

    def step():
        loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=0.1, gradients=gradients)
        return (loss, *torch.autograd.grad(loss * g, leaves))

    # Detached: a live loss from a run on another stream would keep that run's
    # AccumulateGrad nodes (made on the default stream) alive, and the capture
    # would then sync with the legacy stream (cudaErrorStreamCaptureImplicit;
    # torch warns about the stream mismatch). Such a failure is the test's
    # doing, not the op's.
    eager = tuple(t.detach() for t in step())
    warm_up_on_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    g.fill_(4.0)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_rms(static[0], eager[0]) < 1e-6
    for a, b in zip(static[1:], eager[1:]):
        assert rel_rms(a, 4.0 * b) < LINEARITY_RTOL


def test_loss_forward_checks_gpu_cu_seqlens_like_the_op():
    # Eager THD on the GPU: the library's validation reads cu_seqlens (a copy to
    # the host on the current stream) before the forward, with the op's message.
    q, w, k, ids, T = cuda_problem(B=2, S=32, S_kv=48, H=64, D=128, topk=40, seed=19, invalid=False)
    B, S, H, D = q.shape
    S_kv = k.shape[1]
    gids = (ids.long() + S_kv * torch.arange(B, device=DEV).view(B, 1, 1)).to(torch.int32).reshape(B * S, -1)
    cu_q = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=DEV)
    bad_cu_k = torch.arange(0, (B + 1) * S_kv, S_kv, dtype=torch.int32, device=DEV)
    bad_cu_k[-1] += 5
    thd = dict(layout="thd", id_mode="global", cu_seqlens_q=cu_q, cu_seqlens_k=bad_cu_k)
    qt, wt, kt, Tt = q.reshape(B * S, H, D), w.reshape(B * S, H), k.reshape(B * S_kv, D), T.reshape(B * S, -1)
    with pytest.raises(ValueError) as lib:
        dt.indexer_backward(qt, wt, kt, gids, Tt, Tt, sm_scale=0.1, **thd)
    assert str(lib.value).startswith("cu_seqlens_k: expected last value equal to T_k"), str(lib.value)
    leaf = qt.detach().float().requires_grad_()
    with pytest.raises(ValueError) as ours:
        dt.indexer_kl_loss(leaf, wt, kt, gids, Tt, sm_scale=0.1, **thd)
    assert str(ours.value) == str(lib.value)
    assert leaf.grad is None


def to_thd(q, w, k, ids, T):
    """The BSHD problem packed as THD with global ids (-1 stays -1; a local id out
    of range becomes a row outside its sequence, still invalid)."""
    B, S = ids.shape[:2]
    S_kv = k.shape[1]
    flat = lambda x: x.reshape((-1,) + tuple(x.shape[2:]))  # noqa: E731
    base = S_kv * torch.arange(B, device=DEV).view(B, 1, 1)
    gids = torch.where(ids >= 0, ids.long() + base, torch.full_like(ids.long(), -1)).to(torch.int32)
    cu_q = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=DEV)
    cu_k = torch.arange(0, (B + 1) * S_kv, S_kv, dtype=torch.int32, device=DEV)
    return (flat(q), flat(w), flat(k), flat(gids), flat(T),
            dict(layout="thd", id_mode="global", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))


# H 64 runs the P-free backward's own P rebuild; H 128 its forward pre-pass.
LOSS_CASES = [(layout, H) for layout in ("bshd", "thd") for H in (64, 128)]


@pytest.mark.parametrize("gradients", ["backward", "forward"])
@pytest.mark.parametrize("layout,H", LOSS_CASES)
def test_loss_on_cuda_in_both_gradient_forms(layout, H, gradients):
    """gradients="backward": the fused forward and the P-free backward;
    "forward": the one call in the forward, its gradients held and scaled."""
    q, w, k, ids, T = cuda_problem(B=2, S=64, S_kv=96, H=H, D=128, topk=80, seed=30)
    sm = 128 ** -0.5
    want_loss, *want = reference_grads(q, w, k, ids, T, sm_scale=sm, loss_coeff=0.9)
    args = (q, w, k, ids, T) if layout == "bshd" else to_thd(q, w, k, ids, T)
    opts = {} if layout == "bshd" else args[5]
    q2, w2, k2, ids2, T2 = args[:5]
    leaves = [x.detach().float().requires_grad_() for x in (q2, w2, k2)]
    loss = dt.indexer_kl_loss(*leaves, ids2, T2, sm_scale=sm, loss_coeff=0.9, gradients=gradients, **opts)
    assert loss.device.type == "cuda" and loss.dtype == torch.float32
    assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item()), (loss.item(), want_loss.item())
    saved = [t for t in loss.grad_fn.saved_tensors if t is not None]
    if gradients == "backward":
        # the forward saved the row statistics and, of size S_q x topk, only the caller's ids and T
        topk_sized = [t for t in saved if tuple(t.shape) == tuple(ids2.shape)]
        assert sorted(t.data_ptr() for t in topk_sized) == sorted([ids2.data_ptr(), T2.data_ptr()])
        assert len([t for t in saved if tuple(t.shape) == tuple(ids2.shape[:-1])]) == 2
    else:
        # the gradients alone, shaped and typed as the leaves
        assert [(t.shape, t.dtype, t.device) for t in saved] == [(x.shape, x.dtype, x.device) for x in leaves]
    loss.backward()
    for name, x, r in zip(NAMES, leaves, want):
        assert_close_rms(name, x.grad.reshape(r.shape), r, *TOL[torch.float32])


@pytest.mark.parametrize("layout,H", LOSS_CASES)
def test_one_call_on_cuda_equals_loss_and_autograd_gradients(layout, H):
    q, w, k, ids, T = cuda_problem(B=2, S=64, S_kv=96, H=H, D=128, topk=80, seed=31)
    args = (q, w, k, ids, T) if layout == "bshd" else to_thd(q, w, k, ids, T)
    opts = {} if layout == "bshd" else args[5]
    q2, w2, k2, ids2, T2 = args[:5]
    g = torch.tensor(1.75, device=DEV)
    with deterministic_algorithms():  # the fixed-point d_index_k on both sides
        leaves = [x.detach().clone().requires_grad_() for x in (q2, w2, k2)]  # bf16, f32, bf16
        loss = dt.indexer_kl_loss(*leaves, ids2, T2, sm_scale=0.1, gradients="backward", **opts)  # the two-step path
        loss.backward(g)
        poison_allocator((q2.shape, torch.bfloat16), (k2.shape, torch.bfloat16), (w2.shape, torch.float32))
        got = dt.indexer_kl_loss_and_grad(q2, w2, k2, ids2, T2, sm_scale=0.1, grad_loss=g, **opts)
    torch.cuda.synchronize()
    assert torch.isfinite(got[0]) and rel_rms(got[0], loss.detach()) <= 1e-6
    for name, d, x in zip(NAMES, got[1:], leaves):
        assert d.dtype == x.grad.dtype and d.shape == x.shape
        assert_close_rms(name, d.float(), x.grad.float(), 1e-3 if d.dtype == torch.float32 else 4e-3, 8e-3)
    want_loss, *want = reference_grads(q, w, k, ids, T, sm_scale=0.1)
    for name, d, r in zip(NAMES, got[1:], want):
        assert_close_rms(name, d.reshape(r.shape), 1.75 * r, *TOL[d.dtype])


def test_held_gradients_scale_by_a_float32_factor_rounded_once():
    """The default form's backward multiplies each held gradient by autograd's
    factor in float32 and rounds once: at 1/3 (not a bf16 value) a multiply
    that rounded the factor to bf16 first would differ."""
    q, w, k, ids, T = cuda_problem(B=1, S=64, S_kv=96, H=64, D=128, topk=80, seed=33)
    g = torch.tensor(1.0 / 3.0, device=DEV)
    assert g.item() != g.to(torch.bfloat16).item()
    with deterministic_algorithms():
        leaves = [x.detach().clone().requires_grad_() for x in (q, w.to(torch.bfloat16), k)]
        dt.indexer_kl_loss(*leaves, ids, T, sm_scale=0.1).backward(g)
        held = dt.indexer_kl_loss_and_grad(q, w.to(torch.bfloat16), k, ids, T, sm_scale=0.1)
    for name, x, d in zip(NAMES, leaves, held[1:]):
        assert x.grad.dtype == d.dtype == torch.bfloat16, name
        assert torch.equal(x.grad, (d.float() * g).to(d.dtype)), name  # widened, multiplied, narrowed
        assert not torch.equal(x.grad, d * g.to(torch.bfloat16)), name  # the check sees a bf16 factor


@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_scale_gradient_kernel_rounds_once_at_every_size(in_dtype, out_dtype):
    """The extension's kernel behind the held gradients' scaling: bitwise the
    float32 product rounded once, at sizes around its 8-element vector steps
    and beyond one grid's reach, for factors that are not bf16 values, signed,
    zero and non-finite (the same IEEE results as torch's float32 multiply)."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    for n in (0, 1, 7, 8, 9, 8 * 256 + 3, 4096 * 256 * 8 + 8 * 5 + 1):
        d = (torch.randn(n, device=DEV, generator=gen) * 1e3).to(in_dtype)
        if n > 2:
            d[1], d[2] = float("inf"), float("nan")
        for value in (1.0 / 3.0, -2.5, 0.0, 1.0, float("inf")):
            g = torch.tensor(value, device=DEV)
            poison_allocator(((max(n, 1),), out_dtype))
            got = dt_ops.scaled_gradient(d, g, out_dtype)
            want = (d.float() * g).to(out_dtype)
            assert got.dtype == out_dtype and got.shape == d.shape
            assert torch.equal(got.isnan(), want.isnan()), (n, value)
            assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), (n, value)
    d = torch.randn(4, 33, device=DEV).to(in_dtype)
    torch.library.opcheck(torch.ops.dsaib.scale_gradient.default,
                          (d, torch.full((1,), 0.75, device=DEV), CODES[out_dtype]))


def test_scale_gradient_kernel_refuses_what_it_cannot_read():
    """The binding's checks, before anything runs: dtypes, devices, shapes,
    layout and overlap each named; the op's fallback takes strided and
    unaligned gradients."""
    from dsaib import _dsaib
    from dsaib._frameworks import _export

    d = torch.ones(64, device=DEV, dtype=torch.bfloat16)
    g = torch.ones(1, device=DEV)
    out = torch.full_like(d, 7.0)
    s = torch.cuda.current_stream().cuda_stream
    run = lambda a, o, f=g: _dsaib.scale_gradient(_export(a), _export(o), _export(f), s)  # noqa: E731
    with pytest.raises(TypeError, match="gradient: expected dtype bfloat16 or float32"):
        run(d.half(), out)
    with pytest.raises(TypeError, match="out: expected dtype bfloat16 or float32"):
        run(d, out.half())
    with pytest.raises(ValueError, match="gradient: expected a tensor on a cuda device"):
        run(d.cpu(), out)
    with pytest.raises(ValueError, match=r"out: expected shape \(64,\)"):
        run(d, out[:32])
    with pytest.raises(ValueError, match="gradient: expected a contiguous tensor whose data is 16-byte aligned"):
        run(d[1:33], out[:32])
    with pytest.raises(ValueError, match="out: expected memory disjoint from gradient's"):
        run(d, d)
    with pytest.raises(TypeError, match="grad_loss: expected dtype float32"):
        run(d, out, g.double())
    torch.cuda.synchronize()
    assert bool((out == 7.0).all()) and bool((d == 1.0).all())  # nothing written by a refused call
    run(d, out)
    assert torch.equal(out, d)
    strided = torch.randn(8, 16, device=DEV).t()
    got = dt_ops.scaled_gradient(strided, torch.tensor(0.5, device=DEV), torch.bfloat16)
    assert torch.equal(got, (strided * 0.5).to(torch.bfloat16))
    unaligned = torch.randn(65, device=DEV).to(torch.bfloat16)[1:]
    got = dt_ops.scaled_gradient(unaligned, torch.tensor(1.0 / 3.0, device=DEV), torch.bfloat16)
    assert torch.equal(got, (unaligned.float() * (1.0 / 3.0)).to(torch.bfloat16))


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_cuda_graph_capture_of_one_call_replays_with_new_grad_loss(layout):
    # THD too: the library checks device cu_seqlens on the device while capturing.
    q, w, k, ids, T = cuda_problem(B=2, S=64, S_kv=128, H=64, D=128, topk=128, seed=32)
    args = (q, w, k, ids, T) if layout == "bshd" else to_thd(q, w, k, ids, T)
    opts = {} if layout == "bshd" else args[5]
    g = torch.ones((), device=DEV)

    def step():
        return dt.indexer_kl_loss_and_grad(*args[:5], sm_scale=0.1, grad_loss=g, **opts)

    eager = step()
    warm_up_on_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for value in (1.0, 2.5, -0.5):
        for s in static:
            s.fill_(float("nan"))
        g.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static[0], eager[0])  # the loss: bitwise reproducible, not scaled by grad_loss
        for s, e in zip(static[1:], eager[1:]):
            assert torch.isfinite(s).all()
            assert rel_rms(s.float(), value * e.float()) < (LINEARITY_RTOL if s.dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("gradients", ["forward", "backward"])
def test_loss_on_cuda_from_the_topk_logits(gradients):
    """indexer_topk's ids and logits on the device straight into the loss: the
    loss and gradients against the float64 reference of those ids, as the
    loss that recomputes the logits is held to."""
    g = torch.Generator(device="cpu").manual_seed(21)
    B, S, H, D, K = 2, 256, 64, 128, 128
    q = torch.randn(B, S, H, D, generator=g).bfloat16().to(DEV)
    k = torch.randn(B, S, D, generator=g).bfloat16().to(DEV)
    w = (torch.randn(B, S, H, generator=g) / 8).to(DEV)
    ids, logits = dt.indexer_topk(q, w, k, K, return_logits=True)
    T = torch.rand(B, S, K, generator=g).to(DEV).masked_fill(ids < 0, 0)
    T = T / T.sum(-1, keepdim=True)
    want_loss, *want = reference_grads(q, w, k, ids, T, sm_scale=1.0)
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=1.0, gradients=gradients, topk_logits=logits)
    assert abs(loss.item() - want_loss.item()) <= 1e-4 * abs(want_loss.item())
    loss.backward()
    for name, x, r in zip(NAMES, leaves, want):
        assert_close_rms(name, x.grad, r, *TOL[torch.float32])
