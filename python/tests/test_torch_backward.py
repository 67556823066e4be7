"""dsaib.indexer_backward on torch CPU tensors (the CPU backend): the generic
function and the custom op (dsaib.torch.indexer_backward) against the float64
numpy reference, opcheck, the op's options and their words, output dtypes,
grad_loss read from its tensor, errors keeping the library's message, meta
tensors, and dsaib imported alone importing no torch. Skipped when torch is
not installed."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsaib  # noqa: E402
import dsaib.torch as dt  # noqa: E402
from conftest import make_problem, numpy_reference  # noqa: E402
from torch_reference import deterministic_algorithms, make_torch_problem  # noqa: E402

SM = 0.125


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
    # mode (CUDA tensors take the fixed-point d_index_k there: test_torch_gpu_backward.py), and
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


def test_op_refuses_meta_tensors_mixed_with_real_ones():
    # The fake kernel is also the Meta kernel: a meta index_k beside cpu tensors
    # must raise (not return uninitialised cpu tensors), all-meta calls
    # propagate shapes.
    q, w, k, ids, T = make_torch_problem(seed=4)
    P = dt.index_scores(q, w, k, ids, sm_scale=SM)
    with pytest.raises(ValueError, match=r"^index_k: expected memory on device 'cpu' \(that of index_q\), got device 'meta'$"):
        dt.indexer_backward(q, w, k.to("meta"), ids, T, P, sm_scale=SM)
    outs = dt.indexer_backward(*(x.to("meta") for x in (q, w, k, ids, T, P)), sm_scale=SM)
    assert [o.device.type for o in outs] == ["meta"] * 3
    assert [o.shape for o in outs] == [q.shape, w.shape, k.shape]
    # the generic (DLPack) function has no meta path: refused naming the argument
    t = to_torch(make_problem(4))
    t["index_k"] = t["index_k"].to("meta")
    with pytest.raises(TypeError, match=r"^index_k: expected an array in memory \(cpu or cuda\), got a tensor on the "
                                        r"meta device$"):
        dsaib.indexer_backward(**t, sm_scale=SM)


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
