"""The torch front end's argument rules that come before the library's: every
tensor argument a torch.Tensor and every converted input of a real floating
dtype (TypeError naming it, before anything runs), and every entry point
(the loss's, and indexer_topk) under torch.compile(fullgraph=True), static
and dynamic."""
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import dsaib  # noqa: E402
import dsaib.torch as dt  # noqa: E402
from bad_options import BAD_BACKWARD_OPTIONS, BAD_OPTIONS  # noqa: E402
from conftest import make_problem  # noqa: E402

SM = 0.125


def problem():
    p = make_problem(3)
    t = {}
    for k, v in p.items():
        if k in ("index_q", "index_k"):
            t[k] = torch.from_numpy(dsaib.bf16_to_f32(v)).to(torch.bfloat16)
        else:
            t[k] = torch.from_numpy(v)
    return t


def loss_args(t, **changes):
    args = dict(index_q=t["index_q"], weights=t["weights"], index_k=t["index_k"], topk_indices=t["topk_indices"],
                attn_score=t["attn_score"])
    args.update(changes)
    return args


@pytest.mark.parametrize("entry", [dt.indexer_kl_loss, dt.indexer_kl_loss_and_grad])
def test_loss_without_attn_score_names_it(entry):
    t = problem()
    with pytest.raises(TypeError, match=r"^attn_score: expected a torch.Tensor, got NoneType$"):
        entry(**loss_args(t, attn_score=None), sm_scale=SM)


@pytest.mark.parametrize("name, dtype", [("index_q", torch.int32), ("index_q", torch.complex64),
                                         ("index_q", torch.bool), ("index_k", torch.int64),
                                         ("weights", torch.int64), ("weights", torch.complex64)])
@pytest.mark.parametrize("entry", [dt.indexer_kl_loss, dt.indexer_kl_loss_and_grad])
def test_loss_refuses_inputs_it_would_convert_lossily(entry, name, dtype):
    t = problem()
    bad = t[name].to(torch.float32).to(dtype)
    with pytest.raises(TypeError, match=rf"^{name}: expected a floating-point dtype, got {dtype}$"):
        entry(**loss_args(t, **{name: bad}), sm_scale=SM)


@pytest.mark.parametrize("name", ["index_q", "weights", "index_k", "topk_indices", "attn_score", "index_score"])
def test_backward_op_names_a_missing_tensor(name):
    t = problem()
    args = loss_args(t, index_score=t["index_score"])
    args[name] = None if name != "index_score" else [0.5]
    got = "NoneType" if name != "index_score" else "list"
    with pytest.raises(TypeError, match=rf"^{name}: expected a torch.Tensor, got {got}$"):
        dt.indexer_backward(*args.values(), sm_scale=SM)


@pytest.mark.parametrize("name", ["index_q", "weights", "index_k", "topk_indices", "attn_score"])
def test_forward_op_names_a_missing_tensor(name):
    t = problem()
    args = loss_args(t)
    args[name] = "x"
    with pytest.raises(TypeError, match=rf"^{name}: expected a torch.Tensor, got str$"):
        dt.indexer_kl_forward(*args.values(), sm_scale=SM)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "float32"])
def test_index_scores_dtype_is_a_floating_torch_dtype(dtype):
    t = problem()
    with pytest.raises(TypeError, match=r"^dtype: expected a floating-point torch.dtype, got "):
        dt.index_scores(t["index_q"], t["weights"], t["index_k"], t["topk_indices"], sm_scale=SM, dtype=dtype)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("entry", ["indexer_backward", "indexer_kl_loss_and_grad", "indexer_kl_forward",
                                   "indexer_kl_loss", "indexer_topk"])
def test_every_entry_point_compiles_with_its_default_grad_loss(entry, dynamic):
    t = problem()
    torch._dynamo.reset()
    if entry == "indexer_topk":
        def f(q, w, k, starts, ends):
            ids = dt.indexer_topk(q, w, k, 3)
            return (ids,) + dt.indexer_topk(q, w, k, 4, starts=starts, ends=ends, order="id_ascending",
                                            return_logits=True, return_lengths=True)
        starts = torch.zeros(t["weights"].shape[:2], dtype=torch.int64)
        args = (t["index_q"], t["weights"], t["index_k"], starts, starts + t["index_k"].shape[1])
    elif entry == "indexer_backward":
        def f(q, w, k, ids, T, P):
            return dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM)
        args = (t["index_q"], t["weights"], t["index_k"], t["topk_indices"], t["attn_score"], t["index_score"])
    else:
        def f(q, w, k, ids, T):
            return getattr(dt, entry)(q, w, k, ids, T, sm_scale=SM)
        args = (t["index_q"], t["weights"], t["index_k"], t["topk_indices"], t["attn_score"])
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)(*args)
    for a, b in zip(eager if isinstance(eager, tuple) else (eager,),
                    compiled if isinstance(compiled, tuple) else (compiled,)):
        assert torch.equal(a, b)


def test_one_call_loss_dtype_follows_out_dtype_in_both_front_ends():
    t = problem()
    p = make_problem(3)
    args = loss_args(t)
    torch_loss = dt.indexer_kl_loss_and_grad(**args, sm_scale=SM, out_dtype="f64")[0]
    numpy_loss = dsaib.indexer_kl_loss_and_grad(
        **{k: p[k] for k in ("index_q", "weights", "index_k", "topk_indices", "attn_score")}, sm_scale=SM,
        out_dtype="f64", uint16_as_bf16=True)[0]
    assert torch_loss.dtype == torch.float64 and numpy_loss.dtype.name == "float64"
    assert float(torch_loss) == float(numpy_loss)
    assert dt.indexer_kl_loss_and_grad(**args, sm_scale=SM)[0].dtype == torch.float32


@pytest.mark.parametrize("stream", [torch.tensor(0.7), torch.tensor(0.0)])
def test_stream_refuses_a_float_tensor_in_both_front_ends(stream):
    import numpy as np
    t = problem()
    p = make_problem(3)
    with pytest.raises(TypeError, match=r"^stream: expected an int \(a cudaStream_t\), got Tensor"):
        dt.indexer_kl_loss_and_grad(**loss_args(t), sm_scale=SM, stream=stream)
    with pytest.raises(TypeError, match=r"^stream: expected an int \(a cudaStream_t\), got float32"):
        dsaib.indexer_kl_loss_and_grad(**{k: p[k] for k in ("index_q", "weights", "index_k", "topk_indices",
                                                          "attn_score")}, sm_scale=SM, uint16_as_bf16=True,
                                       stream=np.float32(0.9))


def test_a_positional_sm_scale_gets_pythons_message_not_the_old_call_guard():
    p = make_problem(3)
    args = [p[k] for k in ("index_q", "weights", "index_k", "topk_indices", "attn_score")]
    with pytest.raises(TypeError, match=r"takes 5 positional arguments"):
        dsaib.indexer_kl_loss(*args, 0.125, uint16_as_bf16=True)
    with pytest.raises(TypeError, match=r"reference_kl_loss"):
        dsaib.indexer_kl_loss(*args, p["index_score"], sm_scale=SM, uint16_as_bf16=True)


# Numbers and words each entry point takes from the options table (dsaib.OPTIONS):
# a TypeError or ValueError naming the argument, not a cast, a truncation or
# torch's own message (bad_options.py).
@pytest.mark.parametrize("name, value, error, message", BAD_OPTIONS, ids=lambda x: repr(x)[:20])
def test_the_loss_refuses_options_the_table_refuses(name, value, error, message):
    t = problem()
    with pytest.raises(error, match=message):
        dt.indexer_kl_loss(**loss_args(t), **dict(dict(sm_scale=SM), **{name: value}))


@pytest.mark.parametrize("name, value, error, message", BAD_OPTIONS + BAD_BACKWARD_OPTIONS,
                         ids=lambda x: repr(x)[:20])
@pytest.mark.parametrize("entry", ["indexer_kl_loss_and_grad", "indexer_backward"])
def test_the_gradient_entry_points_refuse_options_the_table_refuses(entry, name, value, error, message):
    t = problem()
    kw = dict(dict(sm_scale=SM), **{name: value})
    with pytest.raises(error, match=message):
        if entry == "indexer_backward":
            dt.indexer_backward(*loss_args(t, index_score=t["index_score"]).values(), **kw)
        else:
            dt.indexer_kl_loss_and_grad(**loss_args(t), **kw)


def test_the_loss_module_refuses_a_scale_the_table_refuses():
    with pytest.raises(TypeError, match=r"^sm_scale: expected a real number, got str 'abc'$"):
        dt.IndexerKLLoss(sm_scale="abc")


def test_the_documented_op_schemas_are_the_registered_ones():
    """docs/python.md's block of the torch ops' schemas is what torch registered."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "python.md").read_text(encoding="utf-8")
    block = text.split("## The torch custom ops", 1)[1].split("```\n", 2)[1]
    documented = {}
    for entry in re.split(r"\n(?=dsaib::)", block.strip()):
        flat = re.sub(r"\s+", " ", entry).replace("( ", "(").replace(" )", ")")
        documented[flat.split("(", 1)[0].split("::", 1)[1]] = flat
    assert sorted(documented) == ["attention_target", "indexer_backward", "indexer_kl_forward",
                                  "indexer_kl_loss_and_grad", "indexer_topk"]
    assert documented == {name: str(getattr(torch.ops.dsaib, name).default._schema) for name in documented}
