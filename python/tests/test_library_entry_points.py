"""The extension's bindings as the Python layers use them: the validation alone
(validate_indexer_kl_loss_inputs) raises exactly what indexer_backward raises
for the same arguments (the same exception type and message) and answers for
valid ones; the option table the extension shows Python is the one it reads,
with the library's words and messages; each binding is one library call, and
the workspace is None or an allocator the library calls.
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
def test_validation_raises_what_the_backward_raises(case):
    kw = bad_cases()[case]
    if case == "cuda backend" and dsaib.cuda_backend_available():
        pytest.skip("cuda backend available here (the cpu arrays are then a device error: same rule)")
    want = raised(_dsaib.indexer_backward, **kw, workspace=None)
    assert want[0] in (TypeError, ValueError, RuntimeError), want
    assert want[1].split(":")[0] in kw or want[1].startswith("backend: "), want  # names the argument
    assert raised(_dsaib.validate_indexer_kl_loss_inputs, **validate_args(kw)) == want
    if case != "index_score dtype":  # index_score absent: checked as attn_score, which is fine
        assert raised(_dsaib.validate_indexer_kl_loss_inputs, **dict(validate_args(kw), index_score=None)) == want
    assert all((kw[out] == 7.0).all() for out in OUT_OF)  # nothing written


def test_valid_arguments_pass_and_the_cpu_backend_asks_for_no_workspace():
    p = make_problem(1)
    kw = backward_args(p)
    _dsaib.validate_indexer_kl_loss_inputs(**validate_args(kw))
    _dsaib.validate_indexer_kl_loss_inputs(**dict(validate_args(kw), index_score=None))
    thd, cu_q, cu_k = thd_problem()
    thd_kw = backward_args(thd, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    _dsaib.validate_indexer_kl_loss_inputs(**dict(validate_args(thd_kw), index_score=None))
    assert all((kw[out] == 7.0).all() for out in OUT_OF)
    asked = []
    _dsaib.indexer_backward(**kw, workspace=lambda n: asked.append(n))  # and the backward takes them
    assert not (kw["d_weights"] == 7.0).all()
    assert asked == []  # the cpu backend needs no workspace: the allocator is never called


def test_workspace_is_none_or_an_allocator():
    kw = backward_args(make_problem(1))
    with pytest.raises(TypeError, match=r"^workspace: expected None or a callable nbytes -> array \(an allocator\), "
                                        r"got ndarray$"):
        _dsaib.indexer_backward(**kw, workspace=np.empty(256, np.uint8))
    assert all((kw[out] == 7.0).all() for out in OUT_OF)


def test_each_binding_is_one_library_call():
    # Validation runs in the library, once per call: no binding calls it twice
    # (the workspace comes from the allocator the library calls after it).
    p = make_problem(1)
    kw = backward_args(p)
    before = _dsaib.library_calls()
    _dsaib.indexer_backward(**kw, workspace=None)
    assert _dsaib.library_calls() == before + 1
    _dsaib.validate_indexer_kl_loss_inputs(**validate_args(kw))
    assert _dsaib.library_calls() == before + 2
    with pytest.raises(ValueError):
        _dsaib.indexer_backward(**dict(kw, normalization_count=-1), workspace=None)
    assert _dsaib.library_calls() == before + 3
    with pytest.raises(TypeError):  # refused by the binding: the library is not called
        _dsaib.indexer_backward(**dict(kw, sm_scale="x"), workspace=None)
    assert _dsaib.library_calls() == before + 3
    assert _dsaib.host_waits() == 0 or _dsaib.cuda_compiled()  # nothing waits on a device without CUDA


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


WORD_OPTIONS = ("layout", "id_mode", "backend", "a_operand_precision", "l2_hints", "start_stagger", "forward_fusion")


def test_option_table_is_the_librarys_options_struct():
    # Every field of dsaib::IndexerOptions but grad_loss_device (a tensor
    # argument), and of dsaib::AttentionTargetOptions, with the struct's defaults.
    table = _dsaib.option_table("indexer")
    assert list(table) == ["layout", "id_mode", "backend", "sm_scale", "loss_coeff", "grad_loss",
                           "normalization_count", "strict_indices", "deterministic", "stream", "num_threads",
                           "a_operand_precision", "l2_hints", "start_stagger", "forward_fusion"]
    assert table["layout"] == ("word", "bshd", ("bshd", "thd"))
    assert table["forward_fusion"] == ("word", "auto", ("auto", "off"))
    assert table["a_operand_precision"] == ("word", "auto", ("auto", "bf16x2", "bf16"))
    assert table["normalization_count"] == ("int64", 0, ()) and table["num_threads"] == ("int32", 0, ())
    assert table["stream"] == ("pointer", 0, ()) and table["deterministic"] == ("bool", False, ())
    target = _dsaib.option_table("attention_target")
    assert list(target) == ["layout", "id_mode", "backend", "sm_scale", "lse_base", "normalize", "strict_indices",
                            "stream", "num_threads"]
    assert target["lse_base"] == ("word", "natural", ("natural", "base2")) and target["normalize"][1] is True
    with pytest.raises(ValueError, match=r'^which: expected "indexer", "attention_target" or "indexer_topk", got "x"$'):
        _dsaib.option_table("x")


@pytest.mark.parametrize("name", WORD_OPTIONS)
def test_python_checks_option_words_with_the_librarys_words_and_message(name):
    # The option table in Python takes the words from the extension; its message
    # for a bad word is the library's, so a fake kernel or a front end that
    # checks a word before the library says the same.
    table = _dsaib.option_table("indexer")
    assert dsaib.OPTIONS[name].words == table[name][2]
    for word in table[name][2]:
        assert dsaib.OPTIONS[name].check(word) == word
    want = raised(_dsaib.indexer_backward, **backward_args(make_problem(0), **{name: "nope"}), workspace=None)
    assert want[0] is ValueError and want[1].startswith(f"{name}: expected "), want
    assert raised(dsaib.OPTIONS[name].check, x="nope") == want


def test_python_checks_lse_base_with_the_librarys_message():
    q = np.zeros((1, 1, 16, 64), np.uint16)
    kw = dict(query=q, kv=np.zeros((1, 2, 64), np.uint16), lse=np.zeros((1, 1, 16), np.float32),
              topk_indices=np.zeros((1, 1, 1), np.int32), cu_seqlens_q=None, cu_seqlens_k=None,
              attn_score=np.zeros((1, 1, 1), np.float32), uint16_as_bf16=True, backend="cpu", lse_base="base10")
    want = raised(_dsaib.attention_target, **kw)
    assert want == (ValueError, 'lse_base: expected "natural" or "base2", got "base10"')
    assert raised(dsaib.OPTIONS["lse_base"].check, x="base10") == want


def test_options_are_keyword_arguments_checked_by_name():
    # The library's options reach every binding as **options: a misspelt one is an
    # error, not silently the default; one left out is the library's default.
    p = make_problem(3)
    kw = backward_args(p)
    for fn, args in ((_dsaib.indexer_backward, dict(kw, workspace=None)),
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
