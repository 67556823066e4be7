"""The extension's bindings of the library's workspace size and validation
(indexer_backward_workspace_size, validate_indexer_kl_loss_inputs).

The Python layers ask these instead of re-deriving the rules: each must raise
exactly what indexer_backward raises for the same arguments (the same
exception type and message), and answer for valid ones.
"""
import numpy as np
import pytest

import dsaib
from dsaib import _dsaib
from conftest import make_problem

SM = 0.125
OUT_OF = {"d_index_q": "index_q", "d_weights": "weights", "d_index_k": "index_k"}
# What validate_indexer_kl_loss_inputs does not take: the outputs and what only a run needs.
NOT_VALIDATED = ("d_index_q", "d_weights", "d_index_k", "grad_loss_device", "out_uint16_as_bf16")


def backward_args(p, **change):
    """indexer_backward's keyword arguments (without workspace) for problem p, with changes."""
    kw = dict(p, cu_seqlens_q=None, cu_seqlens_k=None, layout="bshd", id_mode="local", backend="cpu", sm_scale=SM,
              loss_coeff=1.0, grad_loss=1.0, grad_loss_device=None, normalization_count=0, strict_indices=False,
              deterministic=False, stream=0, num_threads=0, uint16_as_bf16=True, out_uint16_as_bf16=False,
              a_operand_precision="auto")
    kw.update({out: np.full(p[arg].shape, 7.0, np.float32) for out, arg in OUT_OF.items()})
    kw.update(change)
    return kw


def validate_args(kw):
    return {n: v for n, v in kw.items() if n not in NOT_VALIDATED}


def raised(fn, **kw):
    with pytest.raises(Exception) as e:
        fn(**kw)
    return type(e.value), str(e.value)


def thd_problem():
    p = make_problem(6, invalid=False)
    B, S_q = p["index_q"].shape[:2]
    S_kv = p["index_k"].shape[1]
    thd = {k: np.ascontiguousarray(v.reshape((-1,) + v.shape[2:])) for k, v in p.items()}
    cu_q = np.arange(0, (B + 1) * S_q, S_q, dtype=np.int32)
    cu_k = np.arange(0, (B + 1) * S_kv, S_kv, dtype=np.int32)
    return thd, cu_q, cu_k


def bad_cases():
    p = make_problem(0)
    thd, cu_q, cu_k = thd_problem()
    bad_cu_k = cu_k.copy()
    bad_cu_k[-1] += 3
    thd_args = dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return {
        "weights shape": backward_args(p, weights=p["weights"][:, :2]),
        "H": backward_args(p, index_q=np.ascontiguousarray(p["index_q"][:, :, :4]),
                           weights=np.ascontiguousarray(p["weights"][:, :, :4])),
        "topk dtype": backward_args(p, topk_indices=p["topk_indices"].astype(np.int64)),
        "attn_score shape": backward_args(p, attn_score=p["attn_score"][:, :, :3]),
        "index_score dtype": backward_args(p, index_score=p["index_score"].astype(np.int32)),
        "sm_scale": backward_args(p, sm_scale=float("nan")),
        "loss_coeff": backward_args(p, loss_coeff=1e39),
        "grad_loss": backward_args(p, grad_loss=float("inf")),
        "normalization_count": backward_args(p, normalization_count=-1),
        "num_threads": backward_args(p, num_threads=-1),
        "layout word": backward_args(p, layout="sbhd"),
        "a_operand_precision": backward_args(p, a_operand_precision="fp8"),
        "cu_seqlens with bshd": backward_args(p, cu_seqlens_q=cu_q),
        "strict id": backward_args(p, strict_indices=True),
        "cuda backend": backward_args(p, backend="cuda"),
        "thd cu_seqlens value": backward_args(thd, **dict(thd_args, cu_seqlens_k=bad_cu_k)),
        "thd cu_seqlens absent": backward_args(thd, **dict(thd_args, cu_seqlens_q=None)),
        "thd cu_seqlens dtype": backward_args(thd, **dict(thd_args, cu_seqlens_q=cu_q.astype(np.int64))),
    }


@pytest.mark.parametrize("case", sorted(bad_cases()))
def test_size_and_validation_raise_what_the_backward_raises(case):
    kw = bad_cases()[case]
    if case == "cuda backend" and dsaib.cuda_backend_available():
        pytest.skip("cuda backend available here (the cpu arrays are then a device error: same rule)")
    want = raised(_dsaib.indexer_backward, **kw, workspace=None)
    assert want[0] in (TypeError, ValueError, RuntimeError), want
    assert want[1].split(":")[0] in kw or want[1].startswith("backend: "), want  # names the argument
    assert raised(_dsaib.indexer_backward_workspace_size, **kw) == want
    assert raised(_dsaib.validate_indexer_kl_loss_inputs, **validate_args(kw)) == want
    if case != "index_score dtype":  # index_score absent: checked as attn_score, which is fine
        assert raised(_dsaib.validate_indexer_kl_loss_inputs, **dict(validate_args(kw), index_score=None)) == want
    assert all((kw[out] == 7.0).all() for out in OUT_OF)  # nothing written


def test_valid_arguments_pass_and_the_cpu_backend_needs_no_workspace():
    p = make_problem(1)
    kw = backward_args(p)
    assert _dsaib.indexer_backward_workspace_size(**kw) == 0
    _dsaib.validate_indexer_kl_loss_inputs(**validate_args(kw))
    _dsaib.validate_indexer_kl_loss_inputs(**dict(validate_args(kw), index_score=None))
    thd, cu_q, cu_k = thd_problem()
    thd_kw = backward_args(thd, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert _dsaib.indexer_backward_workspace_size(**thd_kw) == 0
    _dsaib.validate_indexer_kl_loss_inputs(**dict(validate_args(thd_kw), index_score=None))
    assert all((kw[out] == 7.0).all() for out in OUT_OF)
    _dsaib.indexer_backward(**kw, workspace=None)  # and the backward takes them
    assert not (kw["d_weights"] == 7.0).all()


def test_an_absent_index_score_is_held_to_attn_scores_rules():
    # P is what a loss forward computes: absent, the checks of attn_score stand for it.
    p = make_problem(2)
    kw = validate_args(backward_args(p, index_score=None))
    _dsaib.validate_indexer_kl_loss_inputs(**kw)
    with pytest.raises(ValueError, match=r"^attn_score: expected shape \(2, 5, 4\) \(B, S_q, topk\), topk from "
                                         r"topk_indices, got shape \(2, 5, 3\)$"):
        _dsaib.validate_indexer_kl_loss_inputs(**dict(kw, attn_score=p["attn_score"][:, :, :3]))
    with pytest.raises(TypeError, match=r"^attn_score: expected dtype f32 or f64, got dtype i32$"):
        _dsaib.validate_indexer_kl_loss_inputs(**dict(kw, attn_score=p["attn_score"].astype(np.int32)))


def test_a_operand_precision_check_is_the_librarys():
    for word in ("auto", "bf16x2", "bf16"):
        _dsaib.check_a_operand_precision(word)
    want = raised(_dsaib.indexer_backward, **backward_args(make_problem(0), a_operand_precision="half"), workspace=None)
    assert raised(_dsaib.check_a_operand_precision, word="half") == want
    assert want == (ValueError, 'a_operand_precision: expected "auto", "bf16x2" or "bf16", got "half"')


def test_launch_option_word_checks_are_the_librarys():
    # The torch op's fake kernel checks l2_hints and start_stagger with these.
    for word in ("auto", "on", "off"):
        _dsaib.check_l2_hints(word)
    for word in ("auto", "off"):
        _dsaib.check_start_stagger(word)
    for name, check, bad in (("l2_hints", _dsaib.check_l2_hints, "yes"),
                             ("start_stagger", _dsaib.check_start_stagger, "on")):
        want = raised(_dsaib.indexer_backward, **backward_args(make_problem(0), **{name: bad}), workspace=None)
        assert raised(check, word=bad) == want
        assert want[0] is ValueError and want[1].startswith(f'{name}: expected "auto"'), want


def test_options_are_keyword_arguments_checked_by_name():
    # The library's options reach every binding as **options: a misspelt one is an
    # error, not silently the default; one left out is the library's default.
    p = make_problem(3)
    kw = backward_args(p)
    for fn, args in ((_dsaib.indexer_backward_workspace_size, kw),
                     (_dsaib.validate_indexer_kl_loss_inputs, validate_args(kw))):
        with pytest.raises(TypeError, match=r"^options: unexpected keyword argument 'sm_scal'$"):
            fn(**args, sm_scal=1.0)
        with pytest.raises(TypeError, match=r"^sm_scale: expected a float, got str$"):
            fn(**dict(args, sm_scale="0.5"))
        with pytest.raises(TypeError, match=r"^layout: expected a str, got int$"):
            fn(**dict(args, layout=1))
    left_out = {n: v for n, v in backward_args(p).items() if n not in ("normalization_count", "loss_coeff")}
    _dsaib.indexer_backward(**left_out, workspace=None)  # N = query rows, loss_coeff 1
    _dsaib.indexer_backward(**kw, workspace=None)
    doubled = backward_args(p, loss_coeff=2.0)
    _dsaib.indexer_backward(**doubled, workspace=None)
    for out in OUT_OF:
        np.testing.assert_array_equal(left_out[out], kw[out])
        np.testing.assert_array_equal(doubled[out], 2 * kw[out])
        assert np.abs(kw[out]).max() > 0
