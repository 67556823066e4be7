"""One surface per operation: the option table (dsaib.OPTIONS) is the only
place option rules live, both front ends take its options for each operation
with its defaults, every option of the library is reachable from both, each
name means one thing in both; and the package's layout (no import cycle, no
module over 500 lines)."""
import ast
import importlib.util
import inspect
import pathlib
import re

import numpy as np
import pytest

import dsaib
from dsaib import _dsaib
from dsaib._options import REQUIRED
from conftest import make_problem

PACKAGE = pathlib.Path(dsaib.__file__).resolve().parent
SOURCE = pathlib.Path(__file__).resolve().parents[1] / "dsaib"
HAVE_TORCH = importlib.util.find_spec("torch") is not None
SM = 0.125

# Arguments of one front end only, besides the tensors: the DLPack front end's
# caller outputs and bf16 bit patterns (numpy, cupy have no bf16).
DLPACK_ONLY = {"indexer_backward": {"out", "uint16_as_bf16"}, "attention_target": {"out", "uint16_as_bf16"},
               "indexer_kl_forward": {"uint16_as_bf16"}, "indexer_kl_loss": {"uint16_as_bf16"},
               "indexer_kl_loss_and_grad": {"uint16_as_bf16"}, "indexer_topk": {"uint16_as_bf16", "uint8_as_e4m3"}}
TENSOR_KEYWORDS = {"cu_seqlens_q", "cu_seqlens_k", "row_lse", "row_target_mass", "starts", "ends", "topk_logits",
                   "index_q_scale", "index_k_scale"}


def keyword_defaults(fn):
    """{keyword-only argument, or a positional one the option table has (topk): default}
    of a function (REQUIRED where none)."""
    sig = inspect.signature(fn)
    return {n: (REQUIRED if p.default is inspect.Parameter.empty else p.default)
            for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY or n in dsaib.OPTIONS}


def front_ends():
    ends = [("dsaib", dsaib)]
    if HAVE_TORCH:
        import dsaib.torch as dt

        ends.append(("dsaib.torch", dt))
    return ends


@pytest.mark.parametrize("operation", sorted(dsaib.OPERATIONS))
def test_both_front_ends_take_the_tables_options_with_its_defaults(operation):
    want = {n: dsaib.OPTIONS[n].default for n in dsaib.OPERATIONS[operation]}
    for name, module in front_ends():
        got = keyword_defaults(getattr(module, operation))
        options = {n: d for n, d in got.items() if n not in TENSOR_KEYWORDS and
                   not (name == "dsaib" and n in DLPACK_ONLY[operation])}
        assert options == want, (name, operation, set(options) ^ set(want))
        doc = getattr(module, operation).__doc__
        assert all(f"      {n} (" in doc for n in want), (name, operation)  # documented from the table


@pytest.mark.skipif(not HAVE_TORCH, reason="needs torch")
@pytest.mark.parametrize("operation", sorted(dsaib.OPERATIONS))
def test_both_front_ends_take_the_same_optional_tensors(operation):
    import dsaib.torch as dt

    def tensors(fn):
        return {n for n in inspect.signature(fn).parameters if n in TENSOR_KEYWORDS}

    assert tensors(getattr(dsaib, operation)) == tensors(getattr(dt, operation)), operation
    if operation == "indexer_kl_loss":  # the module too: forward takes the loss's tensors
        assert tensors(dt.IndexerKLLoss.forward) == tensors(dt.indexer_kl_loss)


def test_every_library_option_is_reachable_from_both_front_ends():
    reachable = set().union(*dsaib.OPERATIONS.values())
    tables = [_dsaib.option_table(w) for w in ("indexer", "attention_target", "indexer_topk")]
    library = set().union(*tables)
    assert library <= reachable, library - reachable
    assert {n for n, o in dsaib.OPTIONS.items() if o.library} == library
    for name, o in dsaib.OPTIONS.items():  # the library's words and defaults, as the extension gives them
        for table in (t for t in tables if name in t and o.library):
            if table[name][0] == "word":
                assert o.words == table[name][2], name
                assert o.default == table[name][1] or name == "backend", name  # backend: None picks the device's
    # causal_offset's None is the library's per-sequence default (kCausalOffsetAuto, int64's least value)
    assert dsaib.OPTIONS["causal_offset"].default is None and tables[2]["causal_offset"][1] == -2**63


def test_forward_fusion_reaches_the_library_from_both_front_ends():
    p = make_problem(2, invalid=False)
    fwd = {n: p[n] for n in ("index_q", "weights", "index_k", "topk_indices", "attn_score")}
    runs = [dsaib.indexer_kl_loss_and_grad(**fwd, sm_scale=SM, uint16_as_bf16=True, forward_fusion=word)
            for word in ("auto", "off")]
    for a, b in zip(*runs):  # the cpu backend ignores it
        np.testing.assert_array_equal(a, b)
    msg = r'^forward_fusion: expected "auto" or "off", got "on"$'
    with pytest.raises(ValueError, match=msg):
        dsaib.indexer_kl_loss_and_grad(**fwd, sm_scale=SM, uint16_as_bf16=True, forward_fusion="on")
    with pytest.raises(ValueError, match=msg):  # the library's own message, without the Python check
        _dsaib.indexer_kl_loss_and_grad(
            **{n: fwd[n] for n in fwd}, cu_seqlens_q=None, cu_seqlens_k=None, loss=np.empty((), np.float32),
            d_index_q=np.empty(p["index_q"].shape, np.float32), d_weights=np.empty(p["weights"].shape, np.float32),
            d_index_k=np.empty(p["index_k"].shape, np.float32), uint16_as_bf16=True, backend="cpu", sm_scale=SM,
            forward_fusion="on")
    with pytest.raises(TypeError, match=r'^forward_fusion: expected a str \("auto" or "off"\), got bool True$'):
        dsaib.indexer_kl_loss_and_grad(**fwd, sm_scale=SM, uint16_as_bf16=True, forward_fusion=True)
    if HAVE_TORCH:
        import torch
        import dsaib.torch as dt

        t = {n: torch.from_numpy(dsaib.bf16_to_f32(v)).to(torch.bfloat16) if n in ("index_q", "index_k")
             else torch.from_numpy(v) for n, v in fwd.items()}
        a, b = (dt.indexer_kl_loss_and_grad(*t.values(), sm_scale=SM, forward_fusion=w) for w in ("auto", "off"))
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        with pytest.raises(ValueError, match=msg):
            dt.indexer_kl_loss_and_grad(*t.values(), sm_scale=SM, forward_fusion="on")
        with pytest.raises(ValueError, match=msg):  # the fake kernel checks it (torch.compile)
            with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
                fake = [mode.from_tensor(x) for x in t.values()]
                torch.ops.dsaib.indexer_kl_loss_and_grad(*fake, mode.from_tensor(torch.tensor(1.0)), None, None, SM,
                                                         1.0, 0, "bshd", "local", "f32", "f32", "f32",
                                                         forward_fusion="on")


def test_indexer_kl_loss_means_the_same_in_both_front_ends():
    p = make_problem(5)
    fwd = {n: p[n] for n in ("index_q", "weights", "index_k", "topk_indices", "attn_score")}
    loss = dsaib.indexer_kl_loss(**fwd, sm_scale=SM, loss_coeff=0.7, uint16_as_bf16=True)
    assert isinstance(loss, np.ndarray) and loss.shape == () and loss.dtype == np.float32
    assert loss == dsaib.indexer_kl_forward(**fwd, sm_scale=SM, loss_coeff=0.7, uint16_as_bf16=True)[0]
    # the fp64 host evaluation from the given P: reference_kl_loss, to the float32 rounding of the loss
    host = dsaib.reference_kl_loss(**fwd, index_score=p["index_score"], sm_scale=SM, loss_coeff=0.7,
                                   uint16_as_bf16=True)
    assert isinstance(host, float) and abs(float(loss) - host) <= 1e-6 * abs(host)
    if HAVE_TORCH:
        import torch
        import dsaib.torch as dt

        t = [torch.from_numpy(dsaib.bf16_to_f32(fwd[n])).to(torch.bfloat16) if n in ("index_q", "index_k")
             else torch.from_numpy(fwd[n]) for n in fwd]
        assert dt.indexer_kl_loss(*t, sm_scale=SM, loss_coeff=0.7).item() == float(loss)
        assert dsaib.indexer_kl_loss(*t, sm_scale=SM, loss_coeff=0.7).item() == float(loss)


def test_a_call_with_the_fp64_host_evaluations_arguments_gets_an_error_naming_it():
    p = make_problem(5)
    fwd = [p[n] for n in ("index_q", "weights", "index_k", "topk_indices", "attn_score")]
    msg = (r"^indexer_kl_loss: expected \(index_q, weights, index_k, topk_indices, attn_score, \*, sm_scale, \.\.\.\), "
           r"the arguments of dsaib.torch.indexer_kl_loss, got %s \(the fp64 host evaluation that takes index_score "
           r"and recompute_p is dsaib.reference_kl_loss\)$")
    with pytest.raises(TypeError, match=msg % "index_score"):
        dsaib.indexer_kl_loss(*fwd, p["index_score"], sm_scale=SM, uint16_as_bf16=True)
    with pytest.raises(TypeError, match=msg % "index_score"):
        dsaib.indexer_kl_loss(*fwd, index_score=p["index_score"], sm_scale=SM, uint16_as_bf16=True)
    with pytest.raises(TypeError, match=msg % "recompute_p"):
        dsaib.indexer_kl_loss(*fwd, sm_scale=SM, uint16_as_bf16=True, recompute_p=False)
    assert "index_score" not in inspect.signature(dsaib.indexer_kl_loss).parameters


@pytest.mark.skipif(not HAVE_TORCH, reason="needs torch")
def test_the_loss_module_takes_every_option_of_the_loss():
    import dsaib.torch as dt

    params = inspect.signature(dt.IndexerKLLoss).parameters
    assert set(dsaib.OPERATIONS["indexer_kl_loss"]) <= set(params)
    for name in dsaib.OPERATIONS["indexer_kl_loss"]:
        assert params[name].default is inspect.Parameter.empty or params[name].default == dsaib.OPTIONS[name].default
    with pytest.raises(ValueError, match=r'^l2_hints: expected "auto", "on" or "off", got "no"$'):
        dt.IndexerKLLoss(sm_scale=SM, l2_hints="no")  # checked when made, not at the first forward


def _imports(path):
    """The package modules a module imports (absolute names)."""
    rel = path.relative_to(SOURCE).with_suffix("")
    parts = ["dsaib"] + [p for p in rel.parts if p != "__init__"]
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + (node.module.split(".") if node.module else []))
            if mod.startswith("dsaib"):
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dsaib"))
    return found


def test_the_package_has_no_import_cycle():
    modules = {}
    for path in SOURCE.rglob("*.py"):
        rel = path.relative_to(SOURCE).with_suffix("")
        name = ".".join(["dsaib"] + [p for p in rel.parts if p != "__init__"])
        modules[name] = path
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    # dsaib.torch <-> dsaib.distributed used to import each other; nothing may now
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if n == "dsaib" or n.count(".") < m.count(".") and m.startswith(n + "."):
                continue  # a module's own package being imported first: no cycle of modules
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack + [m, n]))
            if n not in state:
                visit(n, stack + [m])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert "dsaib.torch" not in graph["dsaib.distributed"] and "dsaib.distributed" in graph["dsaib.torch"]


def test_no_module_of_the_package_is_over_500_lines():
    sizes = {str(p.relative_to(SOURCE)): len(p.read_text().splitlines()) for p in SOURCE.rglob("*.py")}
    assert sizes and max(sizes.values()) <= 500, {n: s for n, s in sizes.items() if s > 500}


def test_the_entry_points_docs_python_md_says_take_out_are_those_that_do():
    """docs/python.md names the DLPack entry points that take ``out=``; the
    others refuse it as an unexpected keyword."""
    text = " ".join((SOURCE.parents[1] / "docs" / "python.md").read_text().split())
    said = text.split("The two front ends differ only where a framework does:", 1)[1].split(" only, `out=`", 1)[0]
    named = set(re.findall(r"`(\w+)`", said.rsplit(", in ", 1)[1]))
    taking = {name for name in DLPACK_ONLY if "out" in inspect.signature(getattr(dsaib, name)).parameters}
    assert named == taking == {n for n, extra in DLPACK_ONLY.items() if "out" in extra}
    q, w, k = (np.zeros((1, 2, 8, 64), np.float32), np.zeros((1, 2, 8), np.float32), np.zeros((1, 2, 64), np.float32))
    with pytest.raises(TypeError, match="unexpected keyword argument 'out'"):
        dsaib.indexer_topk(q, w, k, 1, out=np.zeros((1, 2, 1), np.int32))
