"""torch CPU tests: skipped when torch is not installed."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsaib  # noqa: E402
from conftest import make_problem, numpy_reference  # noqa: E402


def to_torch(p):
    t = {}
    for k, v in p.items():
        if k in ("index_q", "index_k"):
            t[k] = torch.from_numpy(dsaib.bf16_to_f32(v)).to(torch.bfloat16)
        else:
            t[k] = torch.from_numpy(v)
    return t


def test_torch_bf16_matches_reference():
    p = make_problem(0)
    got = dsaib.indexer_backward(**to_torch(p), sm_scale=0.125)
    assert all(isinstance(g, torch.Tensor) and g.dtype == torch.float32 for g in got)
    for g, w in zip(got, numpy_reference(p, 0.125)):
        np.testing.assert_allclose(g.double().numpy(), w, rtol=1e-5, atol=1e-7)


def test_torch_bf16_outputs_and_bf16_weights():
    p = to_torch(make_problem(1))
    p["weights"] = p["weights"].to(torch.bfloat16)
    got = dsaib.indexer_backward(**p, sm_scale=0.125, out_dtype="bf16")
    assert all(g.dtype == torch.bfloat16 for g in got)


def test_torch_wrong_dtype_is_type_error():
    p = to_torch(make_problem(0))
    p["attn_score"] = p["attn_score"].half()
    with pytest.raises(TypeError, match="^attn_score: "):
        dsaib.indexer_backward(**p, sm_scale=0.125)


# --- dsaib.torch on CPU tensors (the CPU backend) ----------------------------

import dsaib.torch as dt  # noqa: E402
from dsaib._torch import reference as torch_forward  # noqa: E402
from dsaib._torch.convert import ids_int32  # noqa: E402
from torch_reference import (  # noqa: E402
    assert_close_rms, deterministic_algorithms, make_torch_problem, reference_grads, reference_index_scores,
    reference_loss,
)

SM = 0.125


def test_import_dsaib_alone_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, dsaib; dsaib.cuda_backend_available(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_custom_op_is_registered_and_passes_opcheck():
    q, w, k, ids, T = make_torch_problem(seed=1)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    g = torch.tensor(1.5)
    for codes in (("f32", "f32", "f32"), ("bf16", "f32", "bf16")):
        args = (q, w, k, ids, T, P, g, None, None, SM, 0.7, 0, "bshd", "local", *codes)
        result = torch.library.opcheck(torch.ops.dsaib.indexer_backward.default, args)
        assert all(v == "SUCCESS" for v in result.values()), result


def test_cpu_op_runs_under_use_deterministic_algorithms():
    # The CPU backend is deterministic: no error and no warning in torch's deterministic
    # mode (CUDA tensors take the fixed-point d_index_k there: test_torch_gpu.py), and
    # bitwise the same result.
    import warnings
    q, w, k, ids, T = make_torch_problem(seed=2)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    want = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM)
    with deterministic_algorithms(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM)
    assert not torch.are_deterministic_algorithms_enabled()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _schema_defaults(op):
    """{argument: (type, default)} of the op's arguments that have defaults, and
    whether they all come after the ones without."""
    args = op.default._schema.arguments
    first = next(i for i, a in enumerate(args) if a.has_default_value())
    return ({a.name: (str(a.type), a.default_value) for a in args[first:]},
            all(a.has_default_value() for a in args[first:]))


def test_custom_op_a_operand_precision_argument():
    # Arguments with defaults after the required ones: callers without them keep working.
    defaults, trailing = _schema_defaults(torch.ops.dsaib.indexer_backward)
    assert trailing, defaults
    assert list(defaults)[:6] == ["a_operand_precision", "row_lse", "row_target_mass", "l2_hints",
                                  "start_stagger", "strict_indices"], defaults
    assert defaults["a_operand_precision"] == ("str", "auto")
    assert defaults["row_lse"] == defaults["row_target_mass"] == ("Optional[Tensor]", None)
    assert defaults["strict_indices"] == ("bool", False)
    q, w, k, ids, T = make_torch_problem(seed=1)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    g = torch.tensor(1.5)
    base = (q, w, k, ids, T, P, g, None, None, SM, 0.7, 0, "bshd", "local", "f32", "f32", "bf16")
    want = torch.ops.dsaib.indexer_backward(*base)
    for word in ("auto", "bf16x2", "bf16"):
        args = base + (word,)
        result = torch.library.opcheck(torch.ops.dsaib.indexer_backward.default, args)
        assert all(v == "SUCCESS" for v in result.values()), (word, result)
        # the CPU backend (float64) ignores it
        for a, b in zip(torch.ops.dsaib.indexer_backward(*args), want):
            assert torch.equal(a, b), word
        for a, b in zip(dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, grad_loss=g, loss_coeff=0.7,
                                            out_dtype=("f32", "f32", "bf16"), a_operand_precision=word), want):
            assert torch.equal(a, b), word
    msg = r'^a_operand_precision: expected "auto", "bf16x2" or "bf16", got "fp8"$'
    with pytest.raises(ValueError, match=msg):
        torch.ops.dsaib.indexer_backward(*base, "fp8")
    with pytest.raises(ValueError, match=msg):
        dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, a_operand_precision="fp8")
    with pytest.raises(ValueError, match=msg):  # the fake kernel checks it too (torch.compile)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in base]
            torch.ops.dsaib.indexer_backward(*fake, "fp8")


def test_custom_op_takes_the_launch_options_as_words():
    # l2_hints and start_stagger, as dsaib.indexer_backward takes them: arguments
    # of the op with defaults; the library parses the words.
    defaults, _ = _schema_defaults(torch.ops.dsaib.indexer_backward)
    assert defaults["l2_hints"] == defaults["start_stagger"] == ("str", "auto"), defaults
    assert list(defaults).index("start_stagger") == list(defaults).index("l2_hints") + 1
    q, w, k, ids, T = make_torch_problem(seed=2)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    g = torch.tensor(0.5)
    base = (q, w, k, ids, T, P, g, None, None, SM, 1.1, 0, "bshd", "local", "f32", "bf16", "f32", "auto", None, None)
    want = torch.ops.dsaib.indexer_backward(*base)
    for l2_hints in ("auto", "on", "off"):
        for start_stagger in ("auto", "off"):
            args = base + (l2_hints, start_stagger)
            result = torch.library.opcheck(torch.ops.dsaib.indexer_backward.default, args)
            assert all(v == "SUCCESS" for v in result.values()), (l2_hints, start_stagger, result)
            # launch choices only: the CPU backend's result is the same
            for a, b in zip(torch.ops.dsaib.indexer_backward(*args), want):
                assert torch.equal(a, b), (l2_hints, start_stagger)
            got = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, grad_loss=g, loss_coeff=1.1,
                                      out_dtype=("f32", "bf16", "f32"), l2_hints=l2_hints, start_stagger=start_stagger)
            for a, b in zip(got, want):
                assert torch.equal(a, b), (l2_hints, start_stagger)
    bad = ((("yes", "auto"), r'^l2_hints: expected "auto", "on" or "off", got "yes"$'),
           (("auto", "on"), r'^start_stagger: expected "auto" or "off", got "on"$'))
    for (l2_hints, start_stagger), msg in bad:
        with pytest.raises(ValueError, match=msg):
            torch.ops.dsaib.indexer_backward(*base, l2_hints, start_stagger)
        with pytest.raises(ValueError, match=msg):
            dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, l2_hints=l2_hints, start_stagger=start_stagger)
        with pytest.raises(ValueError, match=msg):  # the fake kernel checks them too (torch.compile)
            with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
                fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in base]
                torch.ops.dsaib.indexer_backward(*fake, l2_hints, start_stagger)
    with pytest.raises(TypeError, match=r"^l2_hints: expected a str"):
        dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, l2_hints=1)
    with pytest.raises(TypeError, match=r"^start_stagger: expected a str"):
        dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, start_stagger=None)


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


def test_op_matches_numpy_reference_and_generic_function():
    p = make_problem(3)
    t = to_torch(p)
    got = dt.indexer_backward(**t, sm_scale=SM, grad_loss=torch.tensor(1.5), loss_coeff=0.7)
    want = numpy_reference(p, SM, loss_coeff=0.7, grad_loss=1.5)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.is_contiguous()
        np.testing.assert_allclose(g.double().numpy(), w, rtol=1e-5, atol=1e-7)
    generic = dsaib.indexer_backward(**t, sm_scale=SM, grad_loss=1.5, loss_coeff=0.7)
    for a, b in zip(got, generic):
        assert torch.equal(a, b)


def test_op_grad_loss_is_read_from_the_tensor():
    q, w, k, ids, T = make_torch_problem(seed=2)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    g = torch.tensor(1.0)
    a = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, grad_loss=g)
    g.fill_(-2.0)
    b = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, grad_loss=g)
    for x, y in zip(a, b):
        torch.testing.assert_close(-2.0 * x, y, rtol=1e-6, atol=0)


def test_op_mixed_output_dtypes():
    q, w, k, ids, T = make_torch_problem(seed=4)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    f32 = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM)
    mixed = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, out_dtype=("bf16", "f32", "bf16"))
    assert [m.dtype for m in mixed] == [torch.bfloat16, torch.float32, torch.bfloat16]
    assert torch.equal(mixed[0], f32[0].to(torch.bfloat16))
    assert torch.equal(mixed[1], f32[1])
    assert torch.equal(mixed[2], f32[2].to(torch.bfloat16))


def test_op_errors_keep_the_cpp_message():
    q, w, k, ids, T = make_torch_problem(seed=0)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    with pytest.raises(ValueError, match=r"^weights: expected shape \(2, 5, 8\) \(B, S_q, H\), got shape \(2, 5, 7\)$"):
        dt.indexer_backward(q, w[..., :7], k, ids, T, P, sm_scale=SM)
    with pytest.raises(TypeError, match=r"^index_score: expected dtype f32 or f64, got dtype "):
        dt.indexer_backward(q, w, k, ids, T, P.to(torch.bfloat16), sm_scale=SM)
    with pytest.raises(TypeError, match=r"^index_score: expected dtype f32 \(or f64 on the cpu backend\), got float16$"):
        dt.indexer_backward(q, w, k, ids, T, P.half(), sm_scale=SM)
    with pytest.raises(ValueError, match=r"^grad_loss: expected a tensor with one element, got 2 elements$"):
        dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, grad_loss=torch.ones(2))
    with pytest.raises(TypeError, match=r"^grad_loss: expected dtype float32"):
        dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, grad_loss=torch.ones((), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^out_dtype: expected .*got \('f16', 'f32', 'f32'\)$"):
        dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, out_dtype=("f16", "f32", "f32"))
    with pytest.raises(ValueError, match=r"^dq_dtype: expected \"f32\", \"bf16\" or \"f64\", got 'f16'$"):
        torch.ops.dsaib.indexer_backward(q, w, k, ids, T, P, torch.tensor(1.0), None, None, SM, 1.0, 0, "bshd",
                                         "local", "f16", "f32", "f32")


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
    # (it surfaced only at backward() before): the library's message, at the call
    q, w, k, ids, T = make_torch_problem(seed=0)
    qq = q.detach().float().requires_grad_()
    with pytest.raises(ValueError, match=r"^loss_coeff: expected a finite value, got inf$"):
        dt.indexer_kl_loss(qq, w, k, ids, T, sm_scale=SM, loss_coeff=float("inf"))
    assert qq.grad is None


def _have_cxx():
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.skipif(not _have_cxx(), reason="torch.compile on CPU needs a C++ compiler (inductor)")
@pytest.mark.parametrize("gradients", ["forward", "backward"])
def test_torch_compile_fullgraph_cpu(gradients):
    q, w, k, ids, T = make_torch_problem(seed=11)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    g = torch.tensor(2.0)

    def op(q, w, k, ids, T, P, g):
        return dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, grad_loss=g)

    compiled = torch.compile(op, fullgraph=True)
    for a, b in zip(compiled(q, w, k, ids, T, P, g), op(q, w, k, ids, T, P, g)):
        assert torch.equal(a, b)

    def loss_fn(q, w, k, ids, T):
        return dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, gradients=gradients)

    closs = torch.compile(loss_fn, fullgraph=True)
    a = [x.detach().float().requires_grad_() for x in (q, w, k)]
    b = [x.detach().float().requires_grad_() for x in (q, w, k)]
    la, lb = closs(*a, ids, T), loss_fn(*b, ids, T)
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=0)
    for x, y in zip(a, b):  # inductor's fused softmax rounds P slightly differently
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk_elements", [None, 6 * 64 * 2])
def test_loss_compiles_with_dynamic_shapes_in_one_graph(monkeypatch, chunk_elements):
    # The library's argument checks do not run while dynamo traces (the backward
    # op runs them), so nothing in the loss specialises the shapes. The
    # logits are one opaque op (dsaib::index_logits), so the Python loop over
    # row chunks is not traced: with chunk_elements set, 2 rows per chunk (torch
    # 2.11's dynamo failed on that loop with an AssertionError, even unchunked).
    if chunk_elements is not None:
        monkeypatch.setattr(torch_forward, "LOGITS_CHUNK_ELEMENTS", chunk_elements)

    def loss_fn(q, w, k, ids, T):
        return dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, loss_coeff=0.5)

    closs = torch.compile(loss_fn, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(5)
    for s_q in (5, 7, 9):
        q = torch.randn(1, s_q, 8, 64, generator=g)
        w = torch.randn(1, s_q, 8, generator=g)
        k = torch.randn(1, 11, 64, generator=g)
        ids = torch.randint(-1, 11, (1, s_q, 6), generator=g, dtype=torch.int32)
        T = torch.softmax(torch.randn(1, s_q, 6, generator=g), -1)
        a = [x.clone().requires_grad_() for x in (q, w, k)]
        b = [x.clone().requires_grad_() for x in (q, w, k)]
        la, lb = closs(*a, ids, T), loss_fn(*b, ids, T)
        la.backward()
        lb.backward()
        # the bf16 q/k are the opaque op's inputs, so inductor keeps their
        # rounding (seen: <= 1.3e-7 apart, fused softmax rounding)
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=0)
        for x, y in zip(a, b):
            assert torch.isfinite(x.grad).all()
            rel_rms = float((x.grad - y.grad).pow(2).mean().sqrt() / y.grad.pow(2).mean().sqrt())
            assert rel_rms < 1e-5, rel_rms


def test_thd_loss_compiles_in_one_graph_static_and_dynamic():
    # The library's checks, cu_seqlens values included, run before the forward in
    # eager mode only (compiled: in the backward op), so THD traces without a break.
    import itertools

    def loss_fn(q, w, k, ids, T, cq, ck):
        return dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM, layout="thd", cu_seqlens_q=cq, cu_seqlens_k=ck)

    g = torch.Generator().manual_seed(6)
    for dynamic in (False, True):
        closs = torch.compile(loss_fn, dynamic=dynamic, fullgraph=True)
        for lens_q, lens_k in (((3, 4), (5, 6)), ((2, 5), (7, 5))):
            Tq, Tk = sum(lens_q), sum(lens_k)
            q, w, k = torch.randn(Tq, 8, 64, generator=g), torch.randn(Tq, 8, generator=g), torch.randn(Tk, 64, generator=g)
            ids = torch.randint(-1, min(lens_k), (Tq, 4), generator=g, dtype=torch.int32)
            T = torch.softmax(torch.randn(Tq, 4, generator=g), -1)
            cq = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
            ck = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
            a = [x.clone().requires_grad_() for x in (q, w, k)]
            b = [x.clone().requires_grad_() for x in (q, w, k)]
            la, lb = closs(*a, ids, T, cq, ck), loss_fn(*b, ids, T, cq, ck)
            la.backward()
            lb.backward()
            torch.testing.assert_close(la, lb, rtol=1e-5, atol=0)  # seen: <= 1.1e-7 apart
            for x, y in zip(a, b):
                rel_rms = float((x.grad - y.grad).pow(2).mean().sqrt() / y.grad.pow(2).mean().sqrt())
                assert rel_rms < 1e-5, rel_rms


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


def test_op_refuses_meta_tensors_mixed_with_real_ones():
    # The fake kernel is also the Meta kernel: a meta index_k beside cpu tensors
    # must raise (it returned uninitialised cpu tensors before), all-meta calls
    # propagate shapes.
    q, w, k, ids, T = make_torch_problem(seed=4)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    with pytest.raises(ValueError, match=r"^index_k: expected memory on device 'cpu' \(that of index_q\), got device 'meta'$"):
        dt.indexer_backward(q, w, k.to("meta"), ids, T, P, sm_scale=SM)
    outs = dt.indexer_backward(*(x.to("meta") for x in (q, w, k, ids, T, P)), sm_scale=SM)
    assert [o.device.type for o in outs] == ["meta"] * 3
    assert [o.shape for o in outs] == [q.shape, w.shape, k.shape]


def test_generic_function_accepts_tensors_that_require_grad_and_non_contiguous_views():
    p = make_problem(12)
    t = to_torch(p)
    t["weights"] = t["weights"].clone().requires_grad_()
    t["index_q"] = t["index_q"].transpose(1, 2).contiguous().transpose(1, 2)  # strided view
    got = dsaib.indexer_backward(**t, sm_scale=SM)
    for g, w in zip(got, numpy_reference(p, SM)):
        assert not g.requires_grad
        np.testing.assert_allclose(g.double().numpy(), w, rtol=1e-5, atol=1e-7)


def test_generic_function_int64_topk_names_what_topk_indices_takes():
    # torch.topk returns int64 ids: the binding says topk_indices takes i32 (not "bf16, f32 or i32").
    t = to_torch(make_problem(13))
    t["topk_indices"] = t["topk_indices"].long()
    with pytest.raises(TypeError, match=r"^topk_indices: expected dtype i32, got int64$"):
        dsaib.indexer_backward(**t, sm_scale=0.125)
    t = to_torch(make_problem(13))
    with pytest.raises(TypeError, match=r"^grad_loss: expected a real number or a one-element float32 tensor, got bool"):
        dsaib.indexer_backward(**t, sm_scale=0.125, grad_loss=True)
    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite value, got inf$"):
        dsaib.indexer_backward(**t, sm_scale=1e300)


def test_out_tensors_that_require_grad_are_refused():
    t = to_torch(make_problem(3))
    out = tuple(torch.empty(t[n].shape, dtype=torch.float32) for n in ("index_q", "weights", "index_k"))
    out[1].requires_grad_()
    with pytest.raises(ValueError, match=r"^out: expected tensors that do not require grad \(they are written in "
                                         r"place\), got d_weights with requires_grad=True$"):
        dsaib.indexer_backward(**t, sm_scale=SM, out=out)


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


def _ids_beyond_int32(ids):
    """(int64 ids with some slots set to ids outside int32, the same ids with those slots -1)."""
    far = ids.long().clone()
    far[0, 0, :4] = torch.tensor([2**32, 2**32 + 1, -(2**32) + 3, 2**31])
    far[1, 2, 1] = -(2**31) - 1
    invalid = far.clone()
    invalid[0, 0, :4] = -1
    invalid[1, 2, 1] = -1
    return far, invalid


def test_ids_outside_int32_are_invalid_slots_not_wrapped():
    q, w, k, ids, T = make_torch_problem(seed=22, invalid=False)
    far, invalid = _ids_beyond_int32(ids)
    # wrapped, 2**32 and 2**32 + 1 would read as the valid ids 0 and 1
    assert not torch.equal(far.to(torch.int32), invalid.to(torch.int32))
    leaves = lambda: [x.detach().float().requires_grad_() for x in (q, w, k)]  # noqa: E731
    a, b = leaves(), leaves()
    la = dt.indexer_kl_loss(*a, far, T, sm_scale=SM)
    lb = dt.indexer_kl_loss(*b, invalid, T, sm_scale=SM)
    assert torch.equal(la, lb)
    la.backward()
    lb.backward()
    for x, y in zip(a, b):
        assert torch.equal(x.grad, y.grad)
    # the float64 forward (torch) and the fp64 library agree on them too
    for f in (dt.indexer_kl_loss, dt.indexer_kl_loss_and_grad):
        got = f(q.double(), w.double(), k.double(), far, T.double(), sm_scale=SM)
        want = f(q.double(), w.double(), k.double(), invalid, T.double(), sm_scale=SM)
        for x, y in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(x, y)
    for x, y in zip(dt.indexer_kl_loss_and_grad(q, w, k, far, T, sm_scale=SM),
                    dt.indexer_kl_loss_and_grad(q, w, k, invalid, T, sm_scale=SM)):
        assert torch.equal(x, y)
    assert torch.equal(dt.index_scores(q, w, k, far, sm_scale=SM), dt.index_scores(q, w, k, invalid, sm_scale=SM))


def test_ids_conversion_of_every_integer_dtype():
    got = ids_int32(torch.tensor([2**32, 2**32 + 1, -(2**31) - 1, -(2**31), 2**31 - 1, 2**31, 5, -1]))
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert got.tolist() == [-1, -1, -1, -(2**31), 2**31 - 1, -1, 5, -1]
    assert ids_int32(torch.tensor([2**32 - 1, 7], dtype=torch.uint32)).tolist() == [-1, 7]
    assert ids_int32(torch.tensor([2**63 + 5, 2**64 - 1, 7, 2**32], dtype=torch.uint64)).tolist() == [-1, -1, 7, -1]
    for dtype in (torch.int8, torch.int16, torch.uint8):
        assert ids_int32(torch.tensor([-1, 3, 100], dtype=torch.int16).to(dtype)).tolist() == (
            torch.tensor([-1, 3, 100], dtype=torch.int16).to(dtype).tolist())
    ids32 = torch.tensor([[1, -1], [3, 4]], dtype=torch.int32)
    assert ids_int32(ids32) is ids32
    strided = torch.arange(12, dtype=torch.int64).view(3, 4).t()
    assert torch.equal(ids_int32(strided), strided.to(torch.int32)) and ids_int32(strided).is_contiguous()


def test_ids_conversion_strict_names_the_first_id_outside_int32():
    ids = torch.tensor([[1, -1], [2**40, -(2**33)]])
    with pytest.raises(ValueError, match=r"^topk_indices: strict mode found an out-of-range id at \(1, 0\): "
                                         r"expected -1 or an id in \[-2\^31, 2\^31-1\] \(int32\), got id 1099511627776$"):
        ids_int32(ids, strict=True)
    with pytest.raises(ValueError, match=r"got id 9223372036854775813$"):
        ids_int32(torch.tensor([2**63 + 5], dtype=torch.uint64), strict=True)
    assert ids_int32(torch.tensor([[1, -1], [-(2**31), 2**31 - 1]]), strict=True).tolist() == [
        [1, -1], [-(2**31), 2**31 - 1]]


def test_ids_outside_int32_compile_in_one_graph():
    # the conversion runs on the device (torch.where): no graph break, no host read
    q, w, k, ids, T = make_torch_problem(seed=23, invalid=False)
    far, invalid = _ids_beyond_int32(ids)

    def loss_fn(q, w, k, ids, T):
        return dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM)

    got = torch.compile(loss_fn, fullgraph=True, backend="eager")(q.float(), w, k.float(), far, T)
    assert torch.equal(got, loss_fn(q.float(), w, k.float(), invalid, T))
