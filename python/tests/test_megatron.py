"""dsaib.megatron against Megatron-Core's own torch path (dsa_kernel_backend
"none") on the CPU, and the layer on one GPU where there is one
(docs/megatron.md).

* The layer (python/tests/megatron_layer.py, gloo ranks in subprocesses):
  Megatron's DSAttention and DSAIndexer with the same parameters and inputs,
  run once with "dsaib" and once with "none": BSHD and packed THD, one
  process, context parallelism over 2 and 4 ranks, tensor parallelism over 2
  (each rank its own attention heads, so the target needs the all-reduce).
  Compared: the ids under the exact top-k rule, the loss, the layer's
  output, the gradients of the indexer's q, k, weights and of its parameters.
* The hook alone, against Megatron's FusedDSAIndexerLoss on float32 tensors
  holding bf16 values (both then compute in float32 from the same numbers):
  where every selected P is far above 1e-10, and where many are below it.
* register()/unregister(): the config, its validation and the command line
  take "dsaib", and give it back; another megatron-core version is named.

Needs megatron-core 0.19 (Python >= 3.12): without it the module is skipped,
or fails with --require-megatron, as .ci/run runs it.
"""

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_layer  # noqa: E402  (the worker's helpers; imports no megatron at module level)
from rank_processes import run_ranks  # noqa: E402
from torch_reference import cuda_skip_reason  # noqa: E402

WORKER = HERE / "megatron_layer.py"
WORKER_TIMEOUT_S = 300


def fresh_seed():
    """A seed from the OS (torch's own generator starts from the same seed in every process)."""
    return int.from_bytes(os.urandom(4), "little") >> 1


def _megatron_problem():
    """Why megatron-core cannot be tested here, or None."""
    if sys.version_info < (3, 12):
        return f"megatron-core 0.19 needs Python >= 3.12, this is {sys.version.split()[0]}"
    try:
        from megatron.core import package_info
    except ImportError as e:
        return f"megatron-core is not importable ({e})"
    import dsaib.megatron as dm

    found = dm.megatron_version()
    return None if found in dm.SUPPORTED_VERSIONS else f"megatron-core {found} is not one of {dm.SUPPORTED_VERSIONS}"


@pytest.fixture(scope="module", autouse=True)
def megatron_required(request):
    problem = _megatron_problem()
    if problem is None:
        return
    if request.config.getoption("--require-megatron"):
        pytest.fail(f"--require-megatron: {problem}")
    pytest.skip(problem)


# ---- the layer ---------------------------------------------------------------

BASE = dict(lengths=[64], b=2, hidden=64, q_lora=32, kv_lora=32, rope=16, heads=4, H=8, D=64, topk=16,
            loss_coeff=0.5, init_std=0.05, thd=False, tp=1, cp=1)

# (name, world, case); every case gets a seed of its own from the run's generator
CASES = [
    ("bshd", 1, dict()),
    ("thd", 1, dict(thd=True, b=1, lengths=[40, 24, 64])),
    ("thd_padded_rows", 1, dict(thd=True, b=1, lengths=[40, 24, 64], pad=6)),
    ("bshd_per_token_loss", 1, dict(per_token=True)),
    ("bshd_wide_logits", 1, dict(weights_scale=12.0)),
    ("cp2_bshd", 2, dict(cp=2)),
    ("cp2_thd", 2, dict(cp=2, thd=True, b=1, lengths=[32, 64])),
    ("tp2_bshd", 2, dict(tp=2)),
    ("cp4_bshd", 4, dict(cp=4)),
    ("cp4_thd", 4, dict(cp=4, thd=True, b=1, lengths=[64, 32])),
]

# The indexer loss is float32 in both: a KL, the difference of a cross-entropy
# and an entropy of about log(topk) each (times loss_coeff), so its float32
# error scales with those terms, not with the small KL. The gradients are bf16
# in both (Megatron returns them in q/k/weights' dtype), one bf16 rounding
# apart at most, 2^-8 relative; the parameter gradients are bf16 products of those.
LOSS_ABS_PER_TERM = 1e-6
GRAD_REL_RMS = 4e-3
OUT_ABS = 0.0  # the same ids give the same sparse attention, bitwise


# The layer on one GPU: dsaib's cuda kernels against Megatron's torch path on
# CUDA tensors. The cuda attention target takes a multiple of 16 heads and a
# latent width that is a multiple of 64 (docs/api.md).
GPU_BASE = dict(BASE, heads=16, kv_lora=48, device="cuda")
GPU_CASES = [
    ("gpu_bshd", 1, dict()),
    ("gpu_thd", 1, dict(thd=True, b=1, lengths=[40, 24, 64])),
    ("gpu_bshd_wide_logits", 1, dict(weights_scale=12.0)),
]


def run_layer_cases(tmp_path_factory, base, case_list, tag):
    seeds = [fresh_seed() for _ in case_list]  # fresh inputs each run; each case's seed is in its failure message
    by_world = {}
    for (name, world, extra), seed in zip(case_list, seeds):
        by_world.setdefault(world, {})[name] = dict(base, seed=seed, **extra)
    results = {}
    for world, cases in by_world.items():
        tmp = tmp_path_factory.mktemp(f"{tag}world{world}")
        case_file = tmp / "cases.pt"
        torch.save(cases, case_file)
        outs = [tmp / f"out{r}.pt" for r in range(world)]
        rendezvous = str(tmp / "rendezvous")
        run_ranks([[sys.executable, "-W", "ignore", str(WORKER), str(r), str(world), rendezvous, str(case_file),
                    str(outs[r])] for r in range(world)], WORKER_TIMEOUT_S, rendezvous=rendezvous)
        for r, out in enumerate(outs):
            for name, got in torch.load(out).items():
                results[(name, r)] = (cases[name], got)
    return results


@pytest.fixture(scope="module")
def layer_results(tmp_path_factory):
    return run_layer_cases(tmp_path_factory, BASE, CASES, "cpu")


@pytest.fixture(scope="module")
def gpu_layer_results(tmp_path_factory):
    if cuda_skip_reason():
        pytest.skip(cuda_skip_reason())
    return run_layer_cases(tmp_path_factory, GPU_BASE, GPU_CASES, "gpu")


def topk_rule_violations(q, k, w, starts, ends, ids, topk, tol_rel):
    """Rows whose ids are not a top-k of the float64 logits within tol_rel of
    the row's largest |logit| (ids of keys outside the row's range, a wrong
    count, or a key left out that beats a selected one by more than that)."""
    logits = megatron_layer.float64_logits(q, k, w)  # [b, sq, skv]
    pos = torch.arange(k.shape[0])
    visible = (pos >= starts.long().unsqueeze(-1)) & (pos < ends.long().unsqueeze(-1))  # [sq, skv]
    bad = []
    for bi in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            row, vis = logits[bi, t], visible[t]
            sel = ids[bi, t][ids[bi, t] >= 0].long()
            if len(sel) != min(topk, int(vis.sum())) or len(set(sel.tolist())) != len(sel) or not vis[sel].all():
                bad.append((bi, t, "count or range"))
                continue
            if len(sel) == 0:
                continue
            tol = tol_rel * row[vis].abs().max().item()
            rest = vis.clone()
            rest[sel] = False
            if rest.any() and row[rest].max() > row[sel].min() + tol:
                bad.append((bi, t, "a better key left out"))
    return bad


def check_layer_agreement(results, name, ours_tol_rel):
    """ours_tol_rel: how far from the float64 top-k rule dsaib's ids may be
    (the cpu backend's logits are float64; the cuda kernel's float32)."""
    ranks = sorted(r for (n, r) in results if n == name)
    assert ranks, name
    for r in ranks:
        case, got = results[(name, r)]
        ours, theirs = got["dsaib"], got["none"]
        where = f"{name} rank {r} seed {case['seed']}"
        # ids: both a top-k of the same logits, theirs within float32's rounding
        q, k, w, starts, ends = ours["topk_inputs"]
        assert not topk_rule_violations(q, k, w, starts, ends, ours["ids"], case["topk"], ours_tol_rel), where
        assert not topk_rule_violations(q, k, w, starts, ends, theirs["ids"], case["topk"], 1e-5), where
        # inputs with a row near a tie at its boundary were redrawn (megatron_layer.AMBIGUOUS_GAP): the sets are equal
        assert megatron_layer.ambiguous_rows(q, k, w, starts, ends, case["topk"]) == 0, (where, got["draws"])
        differ = (ours["ids"].sort(-1).values.long() != theirs["ids"].sort(-1).values.long()).any(-1)
        assert not differ.any(), f"{where}: {int(differ.sum())} rows select other keys"
        # the loss: Megatron's KL in both
        lo, lt = ours["loss"].item(), theirs["loss"].item()
        rows = case["b"] * sum(case["lengths"]) // case["cp"] if case.get("per_token") else 1  # a sum, not a mean
        terms = case["loss_coeff"] * math.log(case["topk"]) * rows
        assert torch.isfinite(ours["loss"]) and abs(lo - lt) <= LOSS_ABS_PER_TERM * terms, (where, lo, lt)
        assert (ours["out"] - theirs["out"]).abs().max().item() <= OUT_ABS, where
        grads = dict(zip(("d_q", "d_k", "d_weights"), zip(ours["dqkw"], theirs["dqkw"])))
        grads.update({n: (ours["grads"][n], theirs["grads"][n]) for n in theirs["grads"]})
        assert set(ours["grads"]) == set(theirs["grads"]), where
        for n, (a, b) in grads.items():
            assert a is not None and b is not None and a.shape == b.shape, (where, n)
            assert torch.isfinite(a).all(), (where, n)
            scale = b.norm().item()
            assert scale > 0, (where, n, "a zero reference gradient tests nothing")
            assert (a - b).norm().item() <= GRAD_REL_RMS * scale, (where, n, (a - b).norm().item() / scale)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_layer_agrees_with_megatron_torch_path(layer_results, name):
    check_layer_agreement(layer_results, name, 1e-12)  # the cpu backend: float64 logits, the exact top-k


@pytest.mark.parametrize("name", [c[0] for c in GPU_CASES])
def test_layer_on_a_gpu_agrees_with_megatron_torch_path(gpu_layer_results, name):
    check_layer_agreement(gpu_layer_results, name, 1e-5)  # the kernel's float32 logits, as Megatron's


def test_tensor_parallel_ranks_hold_other_heads(layer_results):
    """The TP case tests the all-reduce only if the ranks' own heads alone
    would give another target: their losses differ without it."""
    (_, a), (_, b) = layer_results[("tp2_bshd", 0)], layer_results[("tp2_bshd", 1)]
    assert torch.equal(a["dsaib"]["loss"], b["dsaib"]["loss"])  # one target after the all-reduce
    assert not torch.equal(a["dsaib"]["out"], b["dsaib"]["out"])  # the heads differ


# ---- the hook alone, in float32 ------------------------------------------------


def bf16_valued(x):
    return x.to(torch.bfloat16).float()


def hook_problem(gen, weights_scale, sq=48, b=2, H=8, D=64, heads=4, dqk=48):
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = bf16_valued(rnd(sq, b, H, D)), bf16_valued(rnd(sq, b, D))
    w = rnd(sq, b, H) * weights_scale * H ** -0.5 * D ** -0.5
    query, key = bf16_valued(rnd(sq, b, heads, dqk)), bf16_valued(rnd(sq, b, 1, dqk))
    ends = torch.arange(1, sq + 1, dtype=torch.int32)
    return q, k, w, query, key, torch.zeros_like(ends), ends


def unambiguous_problem(weights_scale, topk=16):
    """(seed, problem) from a fresh seed, redrawn while a row's top-k boundary
    is near a tie (megatron_layer.AMBIGUOUS_GAP), where float32 and float64
    may each rightly pick another key."""
    for _ in range(megatron_layer.MAX_DRAWS):
        seed = fresh_seed()
        problem = hook_problem(torch.Generator().manual_seed(seed), weights_scale)
        q, k, w, _, _, starts, ends = problem
        if megatron_layer.ambiguous_rows(q, k, w, starts, ends, topk) == 0:
            print(f"seed {seed}")
            return seed, problem
    raise AssertionError(f"{megatron_layer.MAX_DRAWS} draws each had a near-tie at a top-k boundary")


class _OneRankTP:
    @staticmethod
    def size():
        return 1


def run_both(problem, topk=16, loss_coeff=0.7, grad=1.3):
    """(ours, Megatron's FusedDSAIndexerLoss): each (ids, loss, dq, dk, dw)."""
    import dsaib.megatron as dm
    from megatron.core.transformer.experimental_attention_variant.dsa import FusedDSAIndexerLoss

    q, k, w, query, key, starts, ends = problem
    scale = query.shape[-1] ** -0.5
    a = [t.clone().requires_grad_() for t in (q, k, w)]
    ids, _, loss = dm.run_fused_qk_topk_with_loss(
        q=a[0], k=a[1], weights=a[2], index_topk=topk, starts=starts, ends=ends, block_size=64, query=query,
        key=key, softmax_scale=scale, loss_coeff=loss_coeff, pg_collection=SimpleNamespace(tp=None))
    loss.backward(torch.tensor(grad))
    m = [t.clone().requires_grad_() for t in (q, k, w)]
    mids, mloss = FusedDSAIndexerLoss.apply(
        m[0], m[2], m[1], query, key.expand(-1, -1, query.shape[2], -1), scale, topk, loss_coeff, None, True,
        SimpleNamespace(tp=_OneRankTP), starts.long(), ends.long(), None, None, False, True)
    mloss.backward(torch.tensor(grad))
    return (ids, loss, *(t.grad for t in a)), (mids, mloss, *(t.grad for t in m))


def selected_p(q, k, w, ids):
    logits = megatron_layer.float64_logits(q, k, w)
    sel = logits.gather(-1, ids.long().clamp_min(0)).masked_fill(ids < 0, float("-inf"))
    return torch.softmax(sel, -1)[ids >= 0]


@pytest.mark.parametrize("regime", ["P_above_1e-10", "P_below_1e-10"])
def test_hook_agrees_in_float32(regime):
    """Megatron-Core 0.19's gradient is the exact c (P - T) (its backward
    forms it so) and ours is too, down to P = exp(-100): they agree where
    every selected P is far above 1e-10 and where many are far below it."""
    seed, problem = unambiguous_problem(1.0 if regime == "P_above_1e-10" else 14.0)
    ours, theirs = run_both(problem)
    q, k, w = problem[:3]
    p = selected_p(q, k, w, ours[0])
    if regime == "P_above_1e-10":
        assert p.min() > 1e-8, p.min()
    else:
        assert (p < 1e-10).float().mean() > 0.02 and p.min() > 1e-40, (p.min(), (p < 1e-10).float().mean())
    assert torch.equal(ours[0].sort(-1).values.long(), theirs[0].sort(-1).values)
    assert abs(ours[1].item() - theirs[1].item()) <= 2e-6 * abs(theirs[1].item()), (ours[1], theirs[1])
    for name, a, b in zip(("d_q", "d_k", "d_weights"), ours[2:], theirs[2:]):
        assert torch.isfinite(a).all(), name
        assert (a - b).norm() <= 5e-6 * b.norm(), (name, ((a - b).norm() / b.norm()).item())


def kl_float64(problem, ids, loss_coeff):
    """Megatron's KL(T || P) on the given ids, in float64 throughout
    (FusedDSAIndexerLoss casts its inputs to float32): the indexer's softmax
    P and the heads' summed, normalised softmax T over each row's selected
    keys, its mean over the b*sq rows times loss_coeff."""
    q, k, w, query, key = problem[:5]
    query, key = query.double(), key.double()
    ok = ids >= 0
    slots = ids.long().clamp_min(0)
    logits = megatron_layer.float64_logits(q, k, w)
    log_p = torch.log_softmax(logits.gather(-1, slots).masked_fill(~ok, float("-inf")), -1)
    scores = torch.einsum("sbhd,tbd->bhst", query, key[:, :, 0]) * query.shape[-1] ** -0.5
    picked = scores.gather(-1, slots.unsqueeze(1).expand(-1, scores.shape[1], -1, -1))
    t = torch.softmax(picked.masked_fill(~ok.unsqueeze(1), float("-inf")), -1).sum(1)
    t = t / t.sum(-1, keepdim=True).clamp_min(1e-10)
    kl = torch.where(ok, t * (torch.log(t.clamp_min(1e-10)) - log_p), torch.zeros_like(t))
    return loss_coeff * kl.sum().item() / (ids.shape[0] * ids.shape[1])


# A draw whose T log T summed in float32 put the KL 1.3 float32 roundings of
# its terms away from the float64 one.
_CANCELLING_SEED = 278882274


@pytest.mark.parametrize("draw", ["fixed", "fresh"])
def test_hook_loss_is_its_terms_rounded_once(draw):
    """Where P is close to T the KL (about 0.15 here) is the difference of two
    terms of about loss_coeff * log(topk) (2 here): the loss is within one
    float32 rounding of their size of the KL in float64."""
    if draw == "fixed":
        problem = hook_problem(torch.Generator().manual_seed(_CANCELLING_SEED), 1.0)
        assert megatron_layer.ambiguous_rows(*problem[:3], *problem[5:], 16) == 0
    else:
        _, problem = unambiguous_problem(1.0)
    ours, _ = run_both(problem)
    exact = kl_float64(problem, ours[0], 0.7)
    bound = torch.finfo(torch.float32).eps * (0.7 * math.log(16) + exact)
    assert abs(ours[1].item() - exact) <= bound, (ours[1].item(), exact, bound)


def test_the_wide_regime_is_where_smoothing_would_differ():
    """The P < 1e-10 case does test that regime: the gradient of older
    Megatron-Core's KL, T (log T - log(P + 1e-10)), whose 1e-10 damps the
    slots of tiny P, differs there from the exact one by far more than the
    agreement above."""
    seed, (q, k, w, query, key, starts, ends) = unambiguous_problem(14.0)
    ours, _ = run_both((q, k, w, query, key, starts, ends), grad=1.0)
    ids = ours[0]
    wl = w.clone().requires_grad_()
    logits = torch.einsum("sbhd,tbd->bsht", q, k).relu().mul(wl.transpose(0, 1).unsqueeze(-1)).sum(2)
    z = logits.gather(-1, ids.long().clamp_min(0)).masked_fill(ids < 0, float("-inf"))
    p = torch.softmax(z, -1)
    import dsaib.torch as dt

    t = dt.attention_target(query.transpose(0, 1), key.squeeze(2).transpose(0, 1), None, ids,
                            sm_scale=query.shape[-1] ** -0.5)
    smoothed = (0.7 / ids.shape[0] / ids.shape[1]) * (t * (torch.log(t + 1e-10) - torch.log(p + 1e-10))).sum()
    smoothed.backward()
    diff = ((ours[4] - wl.grad).norm() / ours[4].norm()).item()
    print(f"exact against smoothed d_weights: {diff:.2e} relative RMS")
    assert diff > 1e-3, diff


# ---- register ------------------------------------------------------------------


@pytest.fixture
def registered():
    import dsaib.megatron as dm

    dm.register()
    yield dm
    dm.unregister()


def _config(backend):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, multi_latent_attention=True,
                                experimental_attention_variant="dsa", dsa_kernel_backend=backend,
                                add_bias_linear=False, dsa_indexer_n_heads=8, dsa_indexer_head_dim=64,
                                dsa_indexer_topk=16)


def test_register_adds_the_name_and_unregister_gives_it_back(registered):
    from megatron.core import utils
    from megatron.core.transformer.experimental_attention_variant import dsa_kernels

    assert _config("dsaib").dsa_kernel_backend == "dsaib"
    assert dsa_kernels._BACKEND_MODULE_NAME_BY_BACKEND["dsaib"] == "dsaib.megatron"
    assert "dsaib" in utils._VALID_DSA_KERNEL_BACKENDS
    import dsaib.megatron

    assert dsa_kernels._load_backend(_config("dsaib")) is dsaib.megatron
    registered.register()  # twice: the settings change, nothing is patched twice
    registered.unregister()
    assert "dsaib" not in dsa_kernels._BACKEND_MODULE_NAME_BY_BACKEND
    assert "dsaib" not in utils._VALID_DSA_KERNEL_BACKENDS
    with pytest.raises(ValueError, match="dsa_kernel_backend must be one of"):
        _config("dsaib")
    _config("none")


def test_the_command_line_takes_dsaib(registered, monkeypatch):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--dsa-kernel-backend", "dsaib"])
    assert parse_args().dsa_kernel_backend == "dsaib"
    registered.unregister()
    with pytest.raises(SystemExit):
        parse_args()


def test_another_megatron_version_is_named(monkeypatch):
    import dsaib.megatron as dm
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "VERSION", (0, 18, 1, ""))
    with pytest.raises(RuntimeError, match=r"expected megatron-core 0\.19\.0, 0\.19\.1, 0\.19\.2 .*got megatron-core "
                                           r"0\.18\.1$"):
        dm.register()
    assert not dm.registered()


def test_register_arguments_are_checked():
    import dsaib.megatron as dm

    with pytest.raises(ValueError, match=r'^attention: expected "cudnn", "tilelang" or None .*got \'flash\'$'):
        dm.register(attention="flash")
    with pytest.raises(ValueError, match=r'^order: expected "logit_descending", "id_ascending" or None, got 3$'):
        dm.register(order=3)
    with pytest.raises(ValueError, match=r"^attention: expected .*got \['cudnn'\]$"):  # unhashable
        dm.register(attention=["cudnn"])
    with pytest.raises(ValueError, match=r"^order: expected .*got \['id_ascending'\]$"):
        dm.register(order=["id_ascending"])
    assert not dm.registered()


def test_the_hooks_decline_or_refuse_what_they_do_not_do(registered):
    import dsaib.megatron as dm

    assert dm.run_fused_dsa_attention(config=None) is None  # the split path: our top-k and loss
    assert dm.run_fused_absorbed_sparse_attention(None, None, None, 1.0, 32) is None  # Megatron's torch attention
    q, k, w, *_ , starts, ends = hook_problem(torch.Generator().manual_seed(0), 1.0)
    with pytest.raises(ValueError, match=r"^dsa_indexer_scoring_relu: expected True"):
        dm.run_fused_qk_topk(q=q, k=k, weights=w, index_topk=4, starts=starts, ends=ends, block_size=1,
                             use_relu=False)
    with pytest.raises(ValueError, match=r"^starts: expected shape \(48,\)"):
        dm.run_fused_qk_topk(q=q, k=k, weights=w, index_topk=4, starts=starts[:5], ends=ends, block_size=1)
    ids, lengths = dm.run_fused_qk_topk(q=q, k=k, weights=w, index_topk=4, starts=starts, ends=ends, block_size=1)
    assert ids.shape == (2, 48, 4) and ids.dtype == torch.int32 and lengths.tolist()[0][:5] == [1, 2, 3, 4, 4]


def test_python_m_dsaib_megatron_runs_a_script_that_parses_the_command_line(tmp_path):
    script = tmp_path / "pretrain.py"
    script.write_text("import sys\nfrom megatron.training.arguments import parse_args\n"
                      "print('backend', parse_args().dsa_kernel_backend, sys.argv[0].endswith('pretrain.py'))\n")
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "dsaib.megatron", str(script), "--dsa-kernel-backend",
                          "dsaib"], capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "backend dsaib True" in run.stdout, run.stdout
    plain = subprocess.run([sys.executable, "-W", "ignore", str(script), "--dsa-kernel-backend", "dsaib"],
                           capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert plain.returncode != 0 and "invalid choice" in plain.stderr, plain.stderr[-500:]


# ---- the training example ------------------------------------------------------

EXAMPLE = HERE.parent.parent / "examples" / "megatron_dsa_gpt.py"


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_example_puts_its_site_folder_first_and_reads_its_pth_files(tmp_path, monkeypatch):
    """--site DIR (peer packages without a package index): DIR first on
    sys.path, a .pth file in it read; a missing folder refused by name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron_dsa_gpt_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "extra").mkdir()
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "peer.pth").write_text(str(tmp_path / "extra") + "\n")
    example.add_site(str(tmp_path / "site"))
    assert sys.path[0] == str(tmp_path / "site") and str(tmp_path / "extra") in sys.path
    with pytest.raises(SystemExit, match="--site: expected a folder, got .*absent"):
        example.main(["--site", str(tmp_path / "absent")])


def test_the_example_trains_on_the_cpu_with_either_backend(tmp_path):
    """examples/megatron_dsa_gpt.py on the CPU, a few steps of tiny dims, with
    dsaib and with Megatron's torch path: the same model, data and initial
    weights. The first step's indexer loss agrees to float32 rounding and its
    LM loss to 1e-4 relative: at the initial weights (std 0.02) the indexer's
    logits lie close together, and where two are within float32's rounding of
    each other the float64 and float32 top-k may keep another key, which moves
    the main attention a little. Later steps drift apart by such choices and
    the bf16 roundings of the two gradients."""
    import csv

    steps, topk, layers, coeff = 6, 16, 2, 0.01
    curves = {}
    for backend in ("dsaib", "none"):
        out = tmp_path / f"{backend}.csv"
        run = subprocess.run(
            [sys.executable, "-W", "ignore", str(EXAMPLE), "--device", "cpu", "--backend", backend,
             "--steps", str(steps), "--seq", "128", "--hidden", "64", "--heads", "16", "--vocab", "128",
             "--topk", str(topk), "--indexer-heads", "8", "--layers", str(layers), "--indexer-loss-coeff",
             str(coeff), "--time-indexer-steps", "1", "--csv", str(out)],
            capture_output=True, text=True, timeout=WORKER_TIMEOUT_S,
            env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port())))
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        assert "indexer top-k + loss + gradients: " in run.stdout, run.stdout[-2000:]
        curves[backend] = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(open(out))]
    ours, theirs = curves["dsaib"], curves["none"]
    assert len(ours) == len(theirs) == steps
    assert abs(ours[0]["lm_loss"] - theirs[0]["lm_loss"]) <= 1e-4 * theirs[0]["lm_loss"], (ours[0], theirs[0])
    terms = coeff * math.log(topk) * layers
    assert 0 < ours[0]["indexer_loss"] and abs(ours[0]["indexer_loss"] - theirs[0]["indexer_loss"]) <= (
        LOSS_ABS_PER_TERM * terms), (ours[0], theirs[0])
    for a, b in zip(ours, theirs):
        assert math.isfinite(a["lm_loss"]) and abs(a["lm_loss"] - b["lm_loss"]) <= 1e-2, (a, b)
