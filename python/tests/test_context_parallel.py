"""Context parallelism over torch.distributed (dsaib.distributed) on the gloo
backend with the CPU backend: 2 and 4 processes, each holding its slice of the
sequence, against one process on the whole sequence (dsaib.torch on CPU).

The processes are this file run as a script (``--worker``), started with
subprocess and joined through a ``file://`` rendezvous; the test splits the
problem with its own code (torch.chunk), so that a wrong chunk order in the
library's reordering shows as a mismatch. In this process: the reordering of
the gathered keys, and the argument checks on a group of one. Arguments that
differ across the ranks: test_context_parallel_mismatch.py. Skipped when torch
(or its gloo backend) is not installed.
"""
import sys

import numpy
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)

import dsaib.distributed as dcp  # noqa: E402
import dsaib.torch as dt  # noqa: E402
from bad_options import BAD_BACKWARD_OPTIONS, BAD_OPTIONS  # noqa: E402
from host_syncs import HostSyncs  # noqa: E402
from rank_processes import run_ranks  # noqa: E402
from dsaib._torch import cp_plan  # noqa: E402

SM = 0.125
H, D, TOPK = 8, 64, 6
NAMES = ("d_index_q", "d_weights", "d_index_k")
WORKER_TIMEOUT_S = 300


# ---- the problem and the test's own split ------------------------------------


def rank_chunk_list(cp, cp_layout, rank):
    """Megatron's layouts: (number of chunks, the chunks rank holds, in order)."""
    if cp_layout == "contiguous":
        return cp, [rank]
    return 2 * cp, [rank, 2 * cp - 1 - rank]


def split_sequence(x, dim, cp, cp_layout, rank):
    """Rank's part of x along dim (one sequence)."""
    n, chunks = rank_chunk_list(cp, cp_layout, rank)
    parts = torch.chunk(x, n, dim=dim)
    assert all(p.shape[dim] == x.shape[dim] // n for p in parts)
    return torch.cat([parts[c] for c in chunks], dim=dim)


def split_packed(x, lengths, cp, cp_layout, rank):
    """Rank's part of a packed (THD) tensor: its chunks of every sequence, sequence after sequence."""
    return torch.cat([split_sequence(s, 0, cp, cp_layout, rank) for s in torch.split(x, lengths)])


def make_problem(layout, id_mode, dtype, seed):
    """A whole-sequence problem: q, w, k of `dtype` (values on the bf16 grid), int32
    ids with invalid slots (-1, out of range, a row with none), T (float64)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "bshd":
        B, S = 2, 16
        lengths = [S] * B
        q = torch.randn(B, S, H, D, generator=g)
        w = torch.randn(B, S, H, generator=g)
        k = torch.randn(B, S, D, generator=g)
        ids = torch.randint(0, S, (B, S, TOPK), generator=g)
        base = (S * torch.arange(B)).view(B, 1, 1)
    else:
        lengths = [8, 24, 16]
        T = sum(lengths)
        q = torch.randn(T, H, D, generator=g)
        w = torch.randn(T, H, generator=g)
        k = torch.randn(T, D, generator=g)
        seq_len = torch.repeat_interleave(torch.tensor(lengths), torch.tensor(lengths))
        ids = (torch.rand(T, TOPK, generator=g) * seq_len.view(T, 1)).long()
        starts = torch.cumsum(torch.tensor(lengths), 0) - torch.tensor(lengths)
        base = torch.repeat_interleave(starts, torch.tensor(lengths)).view(T, 1)
    flat = ids.view(-1, TOPK)
    flat[0, 0] = -1                  # the conventional empty slot
    flat[3, :] = -1                  # a row with no valid slot
    flat[5, 1] = 10_000              # out of range: invalid
    flat[7, 2] = -7                  # any negative id: invalid
    if id_mode == "global":
        ids = torch.where(ids >= 0, ids + base, ids)
    T_ = torch.rand(ids.shape, generator=g, dtype=torch.float64)
    T_ /= T_.sum(-1, keepdim=True)
    q, w, k = (t.to(torch.bfloat16).to(dtype) for t in (q, w, k))
    return dict(q=q, w=w, k=k, ids=ids.to(torch.int32), T=T_, lengths=lengths)


def rank_inputs(p, layout, cp, cp_layout, rank):
    """The rank's slices of q, w, k, ids, T (ids keep the whole sequence's numbering)."""
    if layout == "bshd":
        return [split_sequence(p[n], 1, cp, cp_layout, rank) for n in ("q", "w", "k", "ids", "T")]
    return [split_packed(p[n], p["lengths"], cp, cp_layout, rank) for n in ("q", "w", "k", "ids", "T")]


def cu_seqlens(lengths):
    return torch.tensor([0] + list(torch.cumsum(torch.tensor(lengths), 0)), dtype=torch.int32)


# Cases: (name, layout, cp_layout, id_mode, input dtype, op); op "loss" is the autograd
# loss, "backward" the backward-only op; "wrong_order" passes zig-zag slices as contiguous.
CASES = [
    ("bshd-contiguous", "bshd", "contiguous", "local", torch.float64, "loss"),
    ("bshd-zigzag", "bshd", "zigzag", "local", torch.float64, "loss"),
    ("bshd-zigzag-global-ids", "bshd", "zigzag", "global", torch.float64, "loss"),
    ("thd-contiguous", "thd", "contiguous", "local", torch.float64, "loss"),
    ("thd-zigzag", "thd", "zigzag", "local", torch.float64, "loss"),
    ("thd-zigzag-global-ids", "thd", "zigzag", "global", torch.float64, "loss"),
    ("bshd-zigzag-float32", "bshd", "zigzag", "local", torch.float32, "loss"),
    ("thd-zigzag-float32", "thd", "zigzag", "local", torch.float32, "loss"),
    ("bshd-zigzag-backward-op", "bshd", "zigzag", "local", torch.bfloat16, "backward"),
    ("thd-contiguous-backward-op", "thd", "contiguous", "local", torch.bfloat16, "backward"),
    ("thd-zigzag-backward-op-float64", "thd", "zigzag", "global", torch.float64, "backward"),
    ("wrong_order", "bshd", "zigzag", "local", torch.float64, "loss"),
]
# The loss's gradients formed by the backward, or by the forward's one call (float64
# leaves: by the backward either way).
GRADIENT_FORMS = ("backward", "forward")


def options(p, layout, id_mode):
    o = dict(sm_scale=SM, loss_coeff=0.7, layout=layout, id_mode=id_mode)
    if layout == "thd":
        cu = cu_seqlens(p["lengths"])
        o.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    return o


def backward_op_inputs(q, w, k, ids, T, dtype):
    """What the backward op takes: bf16 q/k, float32 w and T (float64 for float64)."""
    q16, k16 = q.to(torch.bfloat16), k.to(torch.bfloat16)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return q16, w.to(wide), k16, ids, T.to(wide)


def backward_out_dtype(dtype):
    """The backward op's out_dtype: float64 gradients (the CPU backend's, unrounded) for float64."""
    return "f64" if dtype == torch.float64 else "f32"


# ---- the worker (one rank) ----------------------------------------------------


def counted(syncs):
    """(library calls, reads of tensor data to the host through tolist) of a call
    (host_syncs.HostSyncs): what synchronises the host on a GPU besides the
    collectives (the reads on the CPU here would be synchronisations there)."""
    return syncs.library_calls, syncs.torch_reads["tolist"]



def run_worker(rank, world, init_file, problem_file, out_file):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    problems = torch.load(problem_file)
    results = {}
    try:
        for name, layout, cp_layout, id_mode, dtype, op in CASES:
            p = problems[name]
            q, w, k, ids, T = rank_inputs(p, layout, world, cp_layout, rank)
            opts = options(p, layout, id_mode)
            passed_layout = "contiguous" if name == "wrong_order" else cp_layout
            if op == "loss":
                for form in GRADIENT_FORMS:
                    leaves = [x.detach().clone().requires_grad_() for x in (q, w, k)]
                    with HostSyncs(cuda=False) as forward:
                        loss = dcp.context_parallel_indexer_kl_loss(*leaves, ids, T, group=None,
                                                                    cp_layout=passed_layout, gradients=form, **opts)
                    with HostSyncs(cuda=False) as backward:
                        loss.backward(torch.tensor(1.5, dtype=loss.dtype))
                    results[(name, form)] = dict(loss=loss.detach(), grads=[x.grad for x in leaves],
                                                 counts=[counted(forward), counted(backward)])
            else:
                P = p["P_parts"][rank]
                inputs = backward_op_inputs(q, w, k, ids, T, dtype)
                with HostSyncs(cuda=False) as call:
                    grads = dcp.context_parallel_indexer_backward(
                        *inputs, P, group=None, cp_layout=passed_layout, grad_loss=1.5,
                        out_dtype=backward_out_dtype(dtype), **opts)
                results[(name, None)] = dict(loss=None, grads=list(grads), counts=[counted(call)])
        torch.save(results, out_file)
        # every rank's sends done before any rank closes its connections (a peer that closes
        # first can abort the other in gloo's transport)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---- the parent: run the workers, compare ---------------------------------------


def reference(p, layout, id_mode, op, dtype=None, gradients="backward"):
    """loss and gradients of one process on the whole sequence (dsaib.torch, CPU backend),
    the loss's gradients formed where `gradients` says, as the context-parallel call's."""
    opts = options(p, layout, id_mode)
    if op == "loss":
        leaves = [x.detach().clone().requires_grad_() for x in (p["q"], p["w"], p["k"])]
        loss = dt.indexer_kl_loss(*leaves, p["ids"], p["T"], gradients=gradients, **opts)
        loss.backward(torch.tensor(1.5, dtype=loss.dtype))
        return loss.detach(), [x.grad for x in leaves]
    q16, w_op, k16, ids, T_op = backward_op_inputs(p["q"], p["w"], p["k"], p["ids"], p["T"], dtype)
    return None, list(dt.indexer_backward(q16, w_op, k16, ids, T_op, p["P"], grad_loss=1.5,
                                          out_dtype=backward_out_dtype(dtype), **opts))


def whole_from_parts(parts, p, layout, cp, cp_layout, like):
    """The ranks' slices of a q-, w- or k-shaped tensor put back in sequence order."""
    if layout == "bshd":
        S = like.shape[1]
        index = torch.arange(S)
        out = torch.empty_like(like)
        for rank, part in enumerate(parts):
            out.index_copy_(1, split_sequence(index, 0, cp, cp_layout, rank), part)
        return out
    index = torch.arange(like.shape[0])
    out = torch.empty_like(like)
    for rank, part in enumerate(parts):
        out.index_copy_(0, split_packed(index, p["lengths"], cp, cp_layout, rank), part)
    return out


def max_rel(got, want):
    """max |got - want| / max |want| over the tensor, in float64."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


@pytest.fixture(scope="module")
def problems():
    out = {}
    for i, (name, layout, cp_layout, id_mode, dtype, op) in enumerate(CASES):
        p = make_problem(layout, id_mode, dtype, seed=100 + i)
        out[name] = p
    return out


def add_index_scores(p, layout, id_mode, cp, cp_layout, dtype):
    """P of the whole problem (from the bf16 values) and each rank's rows of it, for the backward op
    (float64 for float64 inputs)."""
    opts = options(p, layout, id_mode)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    P = dt.index_scores(p["q"].to(torch.bfloat16), p["w"].float(), p["k"].to(torch.bfloat16), p["ids"],
                        dtype=wide, **{k: v for k, v in opts.items() if k != "loss_coeff"})
    p = dict(p, P=P)
    if layout == "bshd":
        p["P_parts"] = [split_sequence(P, 1, cp, cp_layout, r) for r in range(cp)]
    else:
        p["P_parts"] = [split_packed(P, p["lengths"], cp, cp_layout, r) for r in range(cp)]
    return p


def run_world(world, problems, tmp_path):
    """Start `world` workers on the gloo backend; returns each rank's results."""
    probs = {}
    for name, layout, cp_layout, id_mode, dtype, op in CASES:
        p = problems[name]
        probs[name] = add_index_scores(p, layout, id_mode, world, cp_layout, dtype) if op == "backward" else p
    problem_file = str(tmp_path / "problem.pt")
    torch.save(probs, problem_file)
    init_file = str(tmp_path / "rendezvous")
    outs = [str(tmp_path / f"out{r}.pt") for r in range(world)]
    run_ranks([[sys.executable, __file__, "--worker", str(r), str(world), init_file, problem_file, outs[r]]
               for r in range(world)], WORKER_TIMEOUT_S, rendezvous=init_file)
    return probs, [torch.load(o) for o in outs]


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def world_results(request, problems, tmp_path_factory):
    world = request.param
    probs, results = run_world(world, problems, tmp_path_factory.mktemp(f"cp{world}"))
    return world, probs, results


def case_forms():
    """(case, gradients form) of the comparisons: the loss in both forms, the backward-only op once."""
    return [(c, form) for c in CASES if c[0] != "wrong_order"
            for form in (GRADIENT_FORMS if c[5] == "loss" else (None,))]


@pytest.mark.parametrize("case,form", case_forms(), ids=lambda x: x[0] if isinstance(x, tuple) else str(x))
def test_split_sequence_matches_one_process(world_results, case, form):
    world, probs, results = world_results
    name, layout, cp_layout, id_mode, dtype, op = case
    p = probs[name]
    want_loss, want = reference(p, layout, id_mode, op, dtype, gradients=form)
    if op == "loss":
        # float64 inputs: the forward runs in float64 (loss to rounding); float32: the
        # library's float32 loss of each rank's rows, summed over the ranks
        loss_tol = 1e-12 if dtype == torch.float64 else 1e-6
        for r, res in enumerate(results):
            got = res[(name, form)]["loss"]
            assert got.dtype == want_loss.dtype
            assert abs(got.item() - want_loss.item()) <= loss_tol * abs(want_loss.item()), (r, got, want_loss)
    for i, (gname, like) in enumerate(zip(NAMES, want)):
        got = whole_from_parts([res[(name, form)]["grads"][i] for res in results], p, layout, world, cp_layout,
                               like)
        assert got.dtype == like.dtype, gname
        err = max_rel(got, like)
        # d_index_q, d_weights: the same rows, keys and arithmetic as one process:
        # equal to 1e-12 (in practice bitwise). d_index_k: float64 (the fp64 CPU
        # backend's shares written unrounded, summed in float64 by the
        # reduce-scatter) to 1e-12 too; float32/bf16 leaves: each rank's share is
        # written in float32 and the shares summed in float32, where one process
        # rounds the whole (float64) sum once: a few float32 roundings, world *
        # 2^-24 twice over (gradients formed in the forward: each share scaled by the
        # upstream gradient before the sum, one process after it: one rounding more).
        tol = 1e-12 if gname != "d_index_k" or dtype == torch.float64 else (2 * world + 1) * 2.0 ** -24
        assert err <= tol, (gname, err)


@pytest.mark.parametrize("case,form", case_forms(), ids=lambda x: x[0] if isinstance(x, tuple) else str(x))
def test_each_call_makes_one_library_call_and_its_documented_host_reads(world_results, case, form):
    """docs/python.md, "Context parallelism": the library's validation before the
    exchange (one call), then the loss's forward one library call (the float64
    forward runs in torch) and its backward one (gradients="backward"; float64
    leaves either way) or none (gradients="forward": the forward's call formed
    them), the backward-only function one; the host reads the agreement's
    descriptor (and, THD, both cu_seqlens in one transfer)."""
    world, probs, results = world_results
    name, layout, cp_layout, id_mode, dtype, op = case
    reads = 1 + (layout == "thd")
    forward_calls = 1 + (dtype != torch.float64)
    backward_calls = 0 if form == "forward" and dtype != torch.float64 else 1
    want = [(forward_calls, reads), (backward_calls, 0)] if op == "loss" else [(2, reads)]
    for r, res in enumerate(results):
        assert [tuple(c) for c in res[(name, form)]["counts"]] == want, (r, res[(name, form)]["counts"])


def test_wrong_chunk_order_is_detected(world_results):
    """Zig-zag slices passed as contiguous: the keys land in the wrong order and the
    comparison fails (the comparison is able to fail)."""
    world, probs, results = world_results
    p = probs["wrong_order"]
    _, want = reference(p, "bshd", "local", "loss")
    errors = [max_rel(whole_from_parts([res[("wrong_order", "backward")]["grads"][i] for res in results], p, "bshd", world,
                                       "zigzag", like), like)
              for i, like in enumerate(want)]
    assert min(errors) > 1e-3, errors


# ---- in-process unit tests: the reordering and the argument checks ----------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
def test_rank_rows_are_the_test_split(cp, cp_layout):
    lengths = [4 * cp, 0, 2 * cp, 6 * cp]
    index = torch.arange(sum(lengths))
    want = torch.stack([split_packed(index, lengths, cp, cp_layout, r) for r in range(cp)])
    assert torch.equal(dcp.rank_rows(lengths, cp, cp_layout), want)


def test_rank_rows_rejects_lengths_the_layout_does_not_divide():
    with pytest.raises(ValueError, match=r"lengths: expected every length a multiple of 4 \(zigzag over 2 ranks\), "
                                         r"got 6 for sequence 1"):
        dcp.rank_rows([8, 6], 2, "zigzag")
    rows = dcp.rank_rows([8], 2, "zigzag")
    rows.zero_()                                   # a copy: the cached rows are not changed
    assert dcp.rank_rows([8], 2, "zigzag").tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_rank_rows_rejects_lengths_that_are_not_integers():
    for bad in ([8.5], [8.0], ["8"], [True], torch.tensor([8.0]), torch.tensor([[8]])):
        with pytest.raises(ValueError, match="lengths: expected"):
            dcp.rank_rows(bad, 2, "zigzag")
    assert dcp.rank_rows(torch.tensor([8]), 2, "zigzag").tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert dcp.rank_rows((numpy.int64(8),), 2, "contiguous").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_rank_rows_known_answer():
    assert dcp.rank_rows([8], 2, "zigzag").tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert dcp.rank_rows([8], 2, "contiguous").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dcp.rank_rows([4, 8], 2, "zigzag").tolist() == [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]


def _plan(cp, cp_layout, layout, q, k, cu=None):
    offsets = (cu.tolist(), cu.tolist()) if cu is not None else (None, None)
    return cp_plan.Plan(None, cp, 0, cp_layout, layout, q, k, cu, cu, offsets)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("cp", [2, 4])
def test_gathered_keys_reordered_into_sequence_order_and_back(layout, cp):
    """The all-gather's rank-major buffer, built by the test's own split, is put in
    sequence order (forward) and back (backward, before the reduce-scatter); a
    plan of the other layout gets the order wrong."""
    g = torch.Generator().manual_seed(cp)
    if layout == "bshd":
        whole = torch.randn(3, 8 * cp, 4, generator=g)
        parts = [split_sequence(whole, 1, cp, "zigzag", r) for r in range(cp)]
        q = torch.empty(3, 8, 8, 4)
        cu = None
    else:
        lengths = [2 * cp, 6 * cp, 4 * cp]
        whole = torch.randn(sum(lengths), 4, generator=g)
        parts = [split_packed(whole, lengths, cp, "zigzag", r) for r in range(cp)]
        q = torch.empty(sum(lengths) // cp, 8, 4)
        cu = cu_seqlens(lengths)
    gathered = torch.cat(parts)                     # all_gather_into_tensor's output
    plan = _plan(cp, "zigzag", layout, q, parts[0], cu)
    assert torch.equal(plan.to_sequence_order(gathered), whole)
    assert torch.equal(plan.to_rank_order(whole), gathered)
    wrong = _plan(cp, "contiguous", layout, q, parts[0], cu)
    assert not torch.equal(wrong.to_sequence_order(gathered), whole)
    assert not torch.equal(wrong.to_rank_order(whole), gathered)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this one process (a CP group of size 1)."""
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "rendezvous"), rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("form", GRADIENT_FORMS)
def test_a_group_of_one_equals_the_single_process_loss(one_rank_group, layout, form):
    p = make_problem(layout, "local", torch.float32, seed=7)
    opts = options(p, layout, "local")
    want_loss, want = reference(p, layout, "local", "loss", gradients=form)
    leaves = [x.detach().clone().requires_grad_() for x in (p["q"], p["w"], p["k"])]
    loss = dcp.context_parallel_indexer_kl_loss(*leaves, p["ids"], p["T"], group=one_rank_group,
                                                cp_layout="zigzag", gradients=form, **opts)
    loss.backward(torch.tensor(1.5))
    assert torch.equal(loss.detach(), want_loss)
    for gname, x, r in zip(NAMES, leaves, want):
        assert torch.equal(x.grad, r), gname


def _selected_logits(p):
    """I of each selected key of a BSHD problem (float32, torch), as indexer_topk writes them."""
    q, w, k, ids = p["q"].bfloat16().float(), p["w"].float(), p["k"].bfloat16().float(), p["ids"].long()
    # invalid slots (out of range) read key 0: their logits are never read
    safe = torch.where((ids >= 0) & (ids < k.shape[1]), ids, 0)
    keys = torch.stack([k[b][safe[b]] for b in range(k.shape[0])])  # (B, S, K, D)
    return (w.unsqueeze(-1) * torch.relu(torch.einsum("bshd,bskd->bshk", q, keys))).sum(2)


@pytest.mark.parametrize("form", GRADIENT_FORMS)
def test_a_group_of_one_takes_the_topk_logits_as_the_single_process_loss(one_rank_group, form):
    p = make_problem("bshd", "local", torch.float32, seed=9)
    opts = options(p, "bshd", "local")
    logits = _selected_logits(p)
    results = []
    for fn, extra in ((dt.indexer_kl_loss, {}), (dcp.context_parallel_indexer_kl_loss,
                                                dict(group=one_rank_group, cp_layout="zigzag"))):
        leaves = [x.detach().clone().requires_grad_() for x in (p["q"], p["w"], p["k"])]
        loss = fn(*leaves, p["ids"], p["T"], gradients=form, topk_logits=logits, **extra, **opts)
        loss.backward(torch.tensor(1.5))
        results.append((loss.detach(), [x.grad for x in leaves]))
    (want_loss, want), (got_loss, got) = results
    assert torch.equal(got_loss, want_loss)
    for gname, x, r in zip(NAMES, got, want):
        assert torch.equal(x, r), gname
    other = dcp.context_parallel_indexer_kl_loss(p["q"], p["w"], p["k"], p["ids"], p["T"], group=one_rank_group,
                                                 topk_logits=logits * 2, **opts)
    assert not torch.equal(other, want_loss)  # the logits are what the forward reads


def test_errors_name_the_argument(one_rank_group):
    p = make_problem("thd", "local", torch.float32, seed=8)
    opts = options(p, "thd", "local")
    args = (p["q"], p["w"], p["k"], p["ids"], p["T"])
    loss = dcp.context_parallel_indexer_kl_loss
    with pytest.raises(ValueError, match='cp_layout: expected "contiguous" or "zigzag", got \'ring\''):
        loss(*args, group=None, cp_layout="ring", **opts)
    with pytest.raises(ValueError, match="layout: expected \"bshd\" or \"thd\", got 'sbhd'"):
        loss(*args, group=None, **dict(opts, layout="sbhd"))
    bad = torch.tensor([0, 8, 31, 48], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected every sequence length a multiple of 2 .*"
                                         "got length 23 for sequence 1"):
        loss(*args, group=None, cp_layout="zigzag", **dict(opts, cu_seqlens_k=bad))
    short = torch.tensor([0, 8, 32, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"index_q: expected 40 rows \(cu_seqlens_q\[-1\] = 40 over 1 ranks\), got 48"):
        loss(*args, group=None, **dict(opts, cu_seqlens_q=short))
    with pytest.raises(ValueError, match="cu_seqlens_k: expected the whole batch's offsets for layout thd"):
        loss(*args, group=None, **dict(opts, cu_seqlens_k=None))
    bshd = make_problem("bshd", "local", torch.float32, seed=8)
    odd = bshd["k"][:, :15]
    with pytest.raises(ValueError, match=r"index_k: expected a local sequence length that is a multiple of 2 "
                                         r"\(zigzag over 1 ranks\), got 15"):
        loss(bshd["q"], bshd["w"], odd, bshd["ids"], bshd["T"], group=None, cp_layout="zigzag", sm_scale=SM)
    # the library's own validation, given the whole index_k's shape
    with pytest.raises(ValueError, match="sm_scale"):
        loss(*args, group=None, **dict(opts, sm_scale=float("inf")))


# Numbers and words that the options table refuses, as dsaib.torch's entry points
# refuse them (bad_options.py; layout is compared across the ranks instead).
CP_BAD_OPTIONS = [case for case in BAD_OPTIONS if case[0] != "layout"]


@pytest.mark.parametrize("name, value, error, message", CP_BAD_OPTIONS, ids=lambda x: repr(x)[:20])
def test_the_losss_options_follow_the_options_table(one_rank_group, name, value, error, message):
    p = make_problem("bshd", "local", torch.float32, seed=10)
    with pytest.raises(error, match=message):
        dcp.context_parallel_indexer_kl_loss(p["q"], p["w"], p["k"], p["ids"], p["T"], group=None,
                                             **dict(options(p, "bshd", "local"), **{name: value}))


@pytest.mark.parametrize("name, value, error, message", CP_BAD_OPTIONS + BAD_BACKWARD_OPTIONS,
                         ids=lambda x: repr(x)[:20])
def test_the_backwards_options_follow_the_options_table(one_rank_group, name, value, error, message):
    p = make_problem("bshd", "local", torch.float32, seed=11)
    inputs = backward_op_inputs(p["q"], p["w"], p["k"], p["ids"], p["T"], torch.float32)
    P = torch.softmax(torch.randn(p["T"].shape), -1)
    with pytest.raises(error, match=message):
        dcp.context_parallel_indexer_backward(*inputs, P, group=None,
                                              **dict(options(p, "bshd", "local"), **{name: value}))


def test_a_missing_attn_score_is_named(one_rank_group):
    p = make_problem("bshd", "local", torch.float32, seed=13)
    with pytest.raises(TypeError, match=r"^attn_score: expected a torch.Tensor, got NoneType$"):
        dcp.context_parallel_indexer_kl_loss(p["q"], p["w"], p["k"], p["ids"], None, group=None,
                                             **options(p, "bshd", "local"))


def test_the_backwards_out_dtype_none_is_f32(one_rank_group):
    p = make_problem("bshd", "local", torch.float32, seed=12)
    inputs = backward_op_inputs(p["q"], p["w"], p["k"], p["ids"], p["T"], torch.float32)
    P = torch.softmax(torch.randn(p["T"].shape), -1).masked_fill(p["ids"] < 0, 0)
    grads = dcp.context_parallel_indexer_backward(*inputs, P, group=None, out_dtype=None,
                                                  **options(p, "bshd", "local"))
    assert [g.dtype for g in grads] == [torch.float32] * 3


def test_without_an_initialised_process_group_raises():
    assert not dist.is_initialized()
    p = make_problem("bshd", "local", torch.float32, seed=9)
    with pytest.raises(RuntimeError, match="group: expected a process group"):
        dcp.context_parallel_indexer_kl_loss(p["q"], p["w"], p["k"], p["ids"], p["T"], group=None, sm_scale=SM)


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "--worker":
    torch.set_num_threads(1)
    run_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
