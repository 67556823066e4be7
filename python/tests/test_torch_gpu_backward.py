"""dsaib.indexer_backward on CUDA tensors (the sm_90a kernel): the op
(dsaib.torch.indexer_backward) and the generic function against a float64
torch autograd reference, the a operand's precision, grad_loss read on the
device, the current and an explicit stream, a second GPU, the deterministic
kernels, CUDA-graph capture, torch.compile, opcheck, THD, and the workspace
from the caller's allocator.

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

import dsaib  # noqa: E402

from torch_reference import cuda_skip_reason  # noqa: E402

if cuda_skip_reason():
    pytest.skip(cuda_skip_reason(), allow_module_level=True)

import dsaib.torch as dt  # noqa: E402
from torch_reference import (  # noqa: E402
    DEV, LINEARITY_RTOL, NAMES, TOL, assert_close_rms, cuda_problem, deterministic_algorithms, make_torch_problem,
    poison_allocator, reference_grads, reference_index_scores, rel_rms, warm_up_on_side_stream,
)


def check_against_reference(got, want, codes):
    for name, g, w, c in zip(NAMES, got, want, codes):
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[c]
        assert g.dtype == dtype and g.device.type == "cuda" and g.is_contiguous()
        assert_close_rms(name, g, w, *TOL[dtype])


CASES = {
    # name: (problem kwargs, out dtypes)
    "H64_D128_random_invalid_f32": (dict(B=2, S=64, S_kv=96, H=64, D=128, topk=64, seed=1), ("f32",) * 3),
    "H8_D64_topk33_causal_bf16w_bf16out": (
        dict(B=1, S=48, S_kv=48, H=8, D=64, topk=33, causal=True, w_dtype=torch.bfloat16, seed=2), ("bf16",) * 3),
    "H128_D128_mixed_out": (dict(B=1, S=128, S_kv=512, H=128, D=128, topk=256, seed=3), ("bf16", "f32", "bf16")),
    "H64_D128_topk2048_Skv4096": (dict(B=1, S=256, S_kv=4096, H=64, D=128, topk=2048, seed=4, invalid=False),
                                  ("bf16", "bf16", "f32")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_op_matches_float64_autograd_reference(case):
    kw, codes = CASES[case]
    q, w, k, ids, T = cuda_problem(**kw)
    sm = 1.0 / math.sqrt(q.shape[-1])
    P = reference_index_scores(q, w, k, ids, sm_scale=sm).float()
    _, *want = reference_grads(q, w, k, ids, T, sm_scale=sm, loss_coeff=0.8)
    poison_allocator((q.shape, torch.float32), (w.shape, torch.float32), (k.shape, torch.float32),
                     ((k.numel(),), torch.float32))
    got = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=sm, loss_coeff=0.8, out_dtype=codes)
    torch.cuda.synchronize()
    check_against_reference(got, want, codes)
    # the generic function with caller outputs prefilled with NaN
    out = tuple(torch.full(x.shape, float("nan"), dtype={"f32": torch.float32, "bf16": torch.bfloat16}[c], device=DEV)
                for x, c in zip((q, w, k), codes))
    got2 = dsaib.indexer_backward(q, w, k, ids, T, P, sm_scale=sm, loss_coeff=0.8, out=out)
    torch.cuda.synchronize()
    assert all(a is b for a, b in zip(got2, out))
    check_against_reference(got2, want, codes)
    # d_index_q and d_weights are bitwise reproducible on cuda
    assert torch.equal(got[0], got2[0]) and torch.equal(got[1], got2[1])


def test_a_operand_precision_bf16_vs_bf16x2_with_f32_outputs():
    # One bf16 term of the a operand adds ~1.3-1.6e-3 relative RMS error to
    # d_index_q/d_index_k (measured on the H200, DeepSeek shapes); two terms
    # ~2e-6. float32 outputs are held to 1e-3, so "auto" takes two terms there.
    q, w, k, ids, T = cuda_problem(B=2, S=64, S_kv=512, H=64, D=128, topk=256, seed=19)
    sm = 128 ** -0.5
    P = reference_index_scores(q, w, k, ids, sm_scale=sm).float()
    _, *want = reference_grads(q, w, k, ids, T, sm_scale=sm)
    got = {}
    for word in ("auto", "bf16x2", "bf16"):
        got[word] = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=sm, out_dtype="f32", a_operand_precision=word)
    torch.cuda.synchronize()
    err = {word: [rel_rms(g, r) for g, r in zip(got[word], want)] for word in got}
    one, two = err["bf16"][0], err["bf16x2"][0]
    assert one <= 3e-3 and two <= 1e-3, err
    assert one > 4 * two, err
    assert err["bf16"][2] <= 3e-3 and err["bf16x2"][2] <= 1e-3, err
    # d_weights does not depend on the a operand; "auto" is "bf16x2" for f32 outputs
    # (d_index_q is bitwise reproducible on cuda; d_index_k uses fp32 atomics).
    assert rel_rms(got["bf16"][1], got["bf16x2"][1]) < 1e-6, err
    assert torch.equal(got["auto"][0], got["bf16x2"][0]), err
    # ... and "bf16" when d_index_q and d_index_k are bf16
    bf = {word: dt.indexer_backward(q, w, k, ids, T, P, sm_scale=sm, out_dtype="bf16", a_operand_precision=word)
          for word in ("auto", "bf16")}
    torch.cuda.synchronize()
    assert torch.equal(bf["auto"][0], bf["bf16"][0])
    # the generic function passes it through as well
    generic = dsaib.indexer_backward(q, w, k, ids, T, P, sm_scale=sm, a_operand_precision="bf16")
    torch.cuda.synchronize()
    assert torch.equal(generic[0], got["bf16"][0])
    with pytest.raises(ValueError, match="^a_operand_precision: "):
        dsaib.indexer_backward(q, w, k, ids, T, P, sm_scale=sm, a_operand_precision="bf8")


def test_grad_loss_tensor_is_read_on_device_and_scales_linearly():
    q, w, k, ids, T = cuda_problem(B=1, S=32, S_kv=64, H=64, D=128, topk=64, seed=5)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)
    g = torch.full((), 1.0, device=DEV)
    a = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=g)
    g.fill_(-3.0)
    b = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=g)
    # Scaling grad_loss scales every output, up to rounding: c = grad_loss * coeff / N
    # is fp32, the a operand is bf16 (one term for bf16 outputs, hi + lo for fp32),
    # and d_index_k's fp32 atomics add in any order. Measured on the H200: ~3e-6.
    for x, y in zip(a, b):
        assert rel_rms(y, -3.0 * x) < LINEARITY_RTOL


def _sleep_available():
    return hasattr(torch.cuda, "_sleep")


@pytest.mark.skipif(not hasattr(torch.cuda, "_sleep"), reason="torch.cuda._sleep missing")
def test_runs_on_the_current_torch_stream():
    # On a side stream: a long sleep, then grad_loss := 3, then the op. If the op
    # ran on any other stream it would read grad_loss before the fill (1.0).
    q, w, k, ids, T = cuda_problem(B=1, S=64, S_kv=128, H=64, D=128, topk=128, seed=9)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)
    ref = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=3.0)
    g = torch.ones((), device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for api in ("op", "generic"):
        g.fill_(1.0)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
            g.fill_(3.0)
            if api == "op":
                got = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=g)
            else:
                got = dsaib.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=g)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for name, a, b in zip(NAMES, got, ref):
            assert rel_rms(a, b) < 1e-6, (api, name)


@pytest.mark.skipif(not hasattr(torch.cuda, "_sleep"), reason="torch.cuda._sleep missing")
def test_generic_function_explicit_stream():
    q, w, k, ids, T = cuda_problem(B=1, S=64, S_kv=128, H=64, D=128, topk=128, seed=10)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)
    ref = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=2.0)
    g = torch.ones((), device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        g.fill_(2.0)
    # called from the default stream, told to run on `side`
    got = dsaib.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=g, stream=side.cuda_stream)
    side.synchronize()
    for a, b in zip(got, ref):
        assert rel_rms(a, b) < 1e-6


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_the_second_gpu_while_the_first_is_current():
    # All tensors on cuda:1, torch's current device cuda:0: the op runs on cuda:1 (on
    # its current stream), its outputs live there, and cuda:0 stays current. d_index_q
    # and d_weights are bitwise those of the same problem on cuda:0.
    if torch.cuda.get_device_capability(1)[0] != 9:
        pytest.skip("cuda:1 is not a compute-capability-9.0 device")
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    q, w, k, ids, T = make_torch_problem(B=1, S=64, S_kv=256, H=64, D=128, topk=128, seed=23, device=d0)
    sm = 128 ** -0.5
    P = reference_index_scores(q, w, k, ids, sm_scale=sm).float()
    _, *want = reference_grads(q, w, k, ids, T, sm_scale=sm)
    on0 = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=sm, out_dtype="f32")
    torch.cuda.set_device(d0)
    args1 = [t.to(d1) for t in (q, w, k, ids, T, P)]
    for api in ("op", "generic"):
        if api == "op":
            on1 = dt.indexer_backward(*args1, sm_scale=sm, out_dtype="f32")
        else:
            on1 = dsaib.indexer_backward(*args1, sm_scale=sm)
        assert torch.cuda.current_device() == 0, api
        torch.cuda.synchronize(d1)
        for name, g, r in zip(NAMES, on1, want):
            assert g.device == d1, (api, name, g.device)
            assert_close_rms(name, g.to(d0), r, *TOL[g.dtype])
        if api == "op":
            assert torch.equal(on1[0].to(d0), on0[0]) and torch.equal(on1[1].to(d0), on0[1]), api
    # the autograd loss too: its gradients land on cuda:1
    leaves = [t.detach().float().requires_grad_() for t in args1[:3]]
    dt.indexer_kl_loss(*leaves, args1[3], args1[4], sm_scale=sm).backward()
    assert torch.cuda.current_device() == 0
    for name, x, r in zip(NAMES, leaves, want):
        assert x.grad.device == d1, name
        assert_close_rms(name, x.grad.to(d0), r, *TOL[torch.float32])


def test_use_deterministic_algorithms_runs_the_deterministic_kernels():
    # Under torch.use_deterministic_algorithms(True) the op (and the autograd loss's
    # backward) take the fixed-point d_index_k: bitwise-equal runs, no warning, the
    # generic function's deterministic=True result, and the fp64 reference's values.
    import warnings
    q, w, k, ids, T = cuda_problem(B=2, S=64, S_kv=512, H=64, D=128, topk=256, seed=29)
    sm = 128 ** -0.5
    P = reference_index_scores(q, w, k, ids, sm_scale=sm).float()
    _, *want = reference_grads(q, w, k, ids, T, sm_scale=sm)
    # The loss's forward runs before the switch: its bmm would need CUBLAS_WORKSPACE_CONFIG
    # under deterministic algorithms, set before the process's first cuBLAS call. Its
    # gradients are formed in the backward here, under the switch (with the default
    # gradients="forward" the switch would have to be on at the forward).
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=sm, gradients="backward")
    with deterministic_algorithms(), warnings.catch_warnings():
        warnings.simplefilter("error")
        runs = {codes: [dt.indexer_backward(q, w, k, ids, T, P, sm_scale=sm, out_dtype=codes) for _ in range(3)]
                for codes in ("f32", "bf16")}
        loss.backward()
        torch.cuda.synchronize()
    for codes, results in runs.items():
        for later in results[1:]:
            for name, a, b in zip(NAMES, later, results[0]):
                assert torch.equal(a, b), (codes, name)
        check_against_reference(results[0], want, (codes,) * 3)
    generic = dsaib.indexer_backward(q, w, k, ids, T, P, sm_scale=sm, deterministic=True)
    torch.cuda.synchronize()
    for name, a, b in zip(NAMES, generic, runs["f32"][0]):
        assert torch.equal(a, b), name
    for name, x, r in zip(NAMES, leaves, want):
        assert_close_rms(name, x.grad, r, *TOL[torch.float32])
    # bf16 d_index_k with deterministic=True in the generic function (a larger workspace)
    g16 = dsaib.indexer_backward(q, w, k, ids, T, P, sm_scale=sm, deterministic=True, out_dtype="bf16")
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(g16, runs["bf16"][0]))


def test_cuda_graph_capture_replays_with_new_grad_loss():
    q, w, k, ids, T = cuda_problem(B=2, S=64, S_kv=128, H=64, D=128, topk=128, seed=11)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)
    g = torch.ones((), device=DEV)
    eager = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=g, out_dtype=("f32", "f32", "bf16"))
    warm_up_on_side_stream(  # outside the capture
        lambda: dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=g, out_dtype=("f32", "f32", "bf16")))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=g, out_dtype=("f32", "f32", "bf16"))
    for value in (1.0, 2.5, -0.5):
        for s in static:
            s.fill_(float("nan"))
        g.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static[0], value * eager[0]) or rel_rms(static[0], value * eager[0]) < LINEARITY_RTOL
        assert rel_rms(static[1], value * eager[1]) < LINEARITY_RTOL
        assert rel_rms(static[2].float(), value * eager[2].float()) < 5e-3
        assert all(torch.isfinite(s).all() for s in static)


def test_torch_compile_fullgraph_cuda():
    q, w, k, ids, T = cuda_problem(B=1, S=64, S_kv=128, H=64, D=128, topk=128, seed=13)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)
    g = torch.full((), 2.0, device=DEV)

    def op(q, w, k, ids, T, P, g):
        return dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=g)

    want = op(q, w, k, ids, T, P, g)
    got = torch.compile(op, fullgraph=True)(q, w, k, ids, T, P, g)
    for a, b in zip(got, want):
        assert rel_rms(a, b) < 1e-6

    def loss_fn(q, w, k):
        return dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=0.1)

    a = [x.detach().float().requires_grad_() for x in (q, w, k)]
    b = [x.detach().float().requires_grad_() for x in (q, w, k)]
    la = torch.compile(loss_fn, fullgraph=True)(*a)
    lb = loss_fn(*b)
    la.backward()
    lb.backward()
    assert abs(la.item() - lb.item()) <= 1e-5 * abs(lb.item())
    for x, y in zip(a, b):
        assert rel_rms(x.grad, y.grad) < 1e-4


def test_torch_compile_reduce_overhead_cuda_graphs():
    q, w, k, ids, T = cuda_problem(B=1, S=32, S_kv=64, H=64, D=128, topk=64, seed=14)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)

    def op(q, w, k, ids, T, P, g):
        return [x.clone() for x in dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=g)]

    compiled = torch.compile(op, mode="reduce-overhead", fullgraph=True)
    base = op(q, w, k, ids, T, P, torch.ones((), device=DEV))
    for value in (1.0, 3.0, 0.5, 2.0):
        got = compiled(q, w, k, ids, T, P, torch.full((), value, device=DEV))
        torch.cuda.synchronize()
        for a, b in zip(got, base):
            assert rel_rms(a, value * b) < LINEARITY_RTOL


def test_cuda_errors_keep_the_cpp_message():
    q, w, k, ids, T = cuda_problem(seed=15)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"^index_k: "):
        dt.indexer_backward(q, w, k.cpu(), ids, T, P, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"^grad_loss: expected a tensor on cuda:0"):
        dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, grad_loss=torch.ones(()))


def test_generic_function_defaults_to_cuda_backend_for_cuda_tensors():
    q, w, k, ids, T = cuda_problem(B=1, S=32, S_kv=64, H=64, D=128, topk=64, seed=16)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)
    got = dsaib.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, out_dtype="bf16")
    assert all(x.device.type == "cuda" and x.dtype == torch.bfloat16 for x in got)
    cpu = dsaib.indexer_backward(*(x.cpu() for x in (q, w, k, ids, T, P)), sm_scale=0.1)
    for name, a, b in zip(NAMES, got, cpu):
        assert_close_rms(name, a.cpu(), b, *TOL[torch.bfloat16])


def test_opcheck_cuda():
    q, w, k, ids, T = cuda_problem(B=1, S=16, S_kv=32, H=64, D=128, topk=32, seed=17)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)
    g = torch.full((), 0.5, device=DEV)
    for codes in (("f32", "f32", "f32"), ("bf16", "f32", "bf16")):
        args = (q, w, k, ids, T, P, g, None, None, 0.1, 1.0, 0, "bshd", "local", *codes)
        result = torch.library.opcheck(torch.ops.dsaib.indexer_backward.default, args)
        assert all(v == "SUCCESS" for v in result.values()), result


def test_thd_global_ids_match_bshd_on_cuda():
    q, w, k, ids, T = cuda_problem(B=3, S=32, S_kv=48, H=64, D=128, topk=40, seed=18, invalid=False)
    B, S, H, D = q.shape
    S_kv = k.shape[1]
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)
    bshd = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1)
    gids = (ids.long() + S_kv * torch.arange(B, device=DEV).view(B, 1, 1)).to(torch.int32).reshape(B * S, -1)
    cu_q = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=DEV)
    cu_k = torch.arange(0, (B + 1) * S_kv, S_kv, dtype=torch.int32, device=DEV)
    thd = dt.indexer_backward(q.reshape(B * S, H, D), w.reshape(B * S, H), k.reshape(B * S_kv, D), gids,
                              T.reshape(B * S, -1), P.reshape(B * S, -1), sm_scale=0.1, layout="thd",
                              id_mode="global", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.cuda.synchronize()
    for a, b in zip(thd, bshd):
        assert rel_rms(a.reshape(b.shape), b) < 1e-6


def _raw_backward_args(q, w, k, ids, T, P, dk_dtype):
    """The extension's indexer_backward arguments for CUDA tensors (capsules, current stream)."""
    from dsaib._frameworks import _export

    outs = [torch.full(x.shape, float("nan"), dtype=d, device=DEV)
            for x, d in zip((q, w, k), (torch.float32, torch.float32, dk_dtype))]
    args = dict(index_q=q, weights=w, index_k=k, topk_indices=ids, attn_score=T, index_score=P, cu_seqlens_q=None,
                cu_seqlens_k=None, d_index_q=outs[0], d_weights=outs[1], d_index_k=outs[2])
    args = {n: _export(t) if t is not None else None for n, t in args.items()}
    args.update(backend="cuda", sm_scale=0.1, stream=int(torch.cuda.current_stream().cuda_stream))
    return args, outs


def test_the_library_asks_the_allocator_once_after_validation():
    # A bf16 d_index_k needs the fp32 dK accumulator: the library asks for it
    # once, after validating, and the array comes from the caller (here torch).
    from dsaib import _dsaib
    from dsaib._frameworks import _export

    q, w, k, ids, T = cuda_problem(B=1, S=32, S_kv=64, H=64, D=128, topk=64, seed=40)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)
    asked = []

    def allocate(nbytes):
        asked.append(nbytes)
        return _export(torch.empty(nbytes, dtype=torch.uint8, device=DEV))

    args, outs = _raw_backward_args(q, w, k, ids, T, P, torch.bfloat16)
    _dsaib.indexer_backward(**args, workspace=allocate)
    torch.cuda.synchronize()
    assert len(asked) == 1 and asked[0] >= k.numel() * 4, asked
    want = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=0.1, out_dtype=("f32", "f32", "bf16"))
    torch.cuda.synchronize()
    assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1])
    assert rel_rms(outs[2].float(), want[2].float()) < 5e-3
    # an invalid argument is refused before the allocator is asked
    asked.clear()
    bad, _ = _raw_backward_args(q, w, k, ids, T, P, torch.bfloat16)
    with pytest.raises(ValueError, match="^normalization_count: "):
        _dsaib.indexer_backward(**bad, workspace=allocate, normalization_count=-1)
    assert asked == []


def test_the_allocators_errors_reach_the_caller_and_nothing_is_written():
    from dsaib import _dsaib
    from dsaib._frameworks import _export

    q, w, k, ids, T = cuda_problem(B=1, S=32, S_kv=64, H=64, D=128, topk=64, seed=41)
    P = dt.index_scores(q, w, k, ids, sm_scale=0.1)

    class Refused(Exception):
        pass

    def refuse(nbytes):
        raise Refused(f"no {nbytes} bytes")

    cases = [(refuse, Refused, r"^no \d+ bytes$"),
             (lambda n: _export(torch.empty(n, dtype=torch.uint8)), ValueError,
              r"^workspace: expected the allocator's array on cuda:0 \(the backend's device\), got one on cpu$"),
             (lambda n: _export(torch.empty(1, dtype=torch.uint8, device=DEV)), ValueError,
              r"^workspace: expected the allocator's array to hold >= \d+ bytes, got 1$"),
             (lambda n: 7, ValueError, r"^workspace: expected the allocator to return an array \(DLPack\)")]
    for allocate, error, message in cases:
        args, outs = _raw_backward_args(q, w, k, ids, T, P, torch.bfloat16)
        with pytest.raises(error, match=message):
            _dsaib.indexer_backward(**args, workspace=allocate)
        torch.cuda.synchronize()
        assert all(torch.isnan(o.float()).all() for o in outs)
