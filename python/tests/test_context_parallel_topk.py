"""dsaib.distributed.context_parallel_indexer_topk on the gloo backend with the
CPU backend: 2 processes, each with its slice of the query rows (and of the
keys, all-gathered by the call), against one process on the whole problem
(dsaib.torch.indexer_topk): the ranks' rows, split with the test's own code
(torch.chunk), are bitwise the single-process rows. The processes are this
file run as a script (``--worker``), as in test_context_parallel.py.
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)

import dsaib.distributed as dcp  # noqa: E402
import dsaib.torch as dt  # noqa: E402
from rank_processes import run_ranks  # noqa: E402

H, D, TOPK = 8, 64, 5
WORKER_TIMEOUT_S = 300

# (name, layout, cp_layout, id_mode, order, causal_offset, explicit ranges)
CASES = [
    ("bshd-contiguous", "bshd", "contiguous", "local", "logit_descending", None, False),
    ("bshd-zigzag", "bshd", "zigzag", "local", "logit_descending", None, False),
    ("bshd-zigzag-global-offset", "bshd", "zigzag", "global", "id_ascending", 3, False),
    ("bshd-zigzag-ranges", "bshd", "zigzag", "local", "logit_descending", None, True),
    ("thd-contiguous", "thd", "contiguous", "local", "logit_descending", None, False),
    ("thd-zigzag-global", "thd", "zigzag", "global", "logit_descending", None, False),
    ("thd-zigzag-ranges", "thd", "zigzag", "global", "id_ascending", None, True),
]


def chunks(cp_layout, cp, rank):
    return (cp, [rank]) if cp_layout == "contiguous" else (2 * cp, [rank, 2 * cp - 1 - rank])


def split_sequence(x, dim, cp, cp_layout, rank):
    n, mine = chunks(cp_layout, cp, rank)
    parts = torch.chunk(x, n, dim=dim)
    return torch.cat([parts[c] for c in mine], dim=dim)


def split(x, p, cp, cp_layout, rank):
    """The rank's rows of a whole tensor (BSHD: along the sequence; THD: each packed sequence)."""
    if p["layout"] == "bshd":
        return split_sequence(x, 1, cp, cp_layout, rank)
    return torch.cat([split_sequence(s, 0, cp, cp_layout, rank) for s in torch.split(x, p["lengths"])])


def make_problem(layout, seed):
    g = torch.Generator().manual_seed(seed)
    if layout == "bshd":
        B, S = 2, 16
        q, w, k = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, H, generator=g), torch.randn(B, S, D, generator=g)
        starts = torch.randint(-2, S, (B, S), generator=g)
        ends = starts + torch.randint(0, 9, (B, S), generator=g)
        return dict(layout=layout, q=q.to(torch.bfloat16), w=w, k=k.to(torch.bfloat16), starts=starts, ends=ends)
    lengths = [8, 24, 16]
    T = sum(lengths)
    q, w, k = torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g), torch.randn(T, D, generator=g)
    first = torch.repeat_interleave(torch.cumsum(torch.tensor(lengths), 0) - torch.tensor(lengths),
                                    torch.tensor(lengths))
    starts = first + torch.randint(0, 6, (T,), generator=g)
    ends = starts + torch.randint(0, 12, (T,), generator=g)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist(), dtype=torch.int32)
    return dict(layout=layout, q=q.to(torch.bfloat16), w=w, k=k.to(torch.bfloat16), starts=starts.to(torch.int32),
                ends=ends.to(torch.int32), lengths=lengths, cu=cu)


def options(p, case):
    _, layout, _, id_mode, order, causal_offset, _ = case
    o = dict(layout=layout, id_mode=id_mode, order=order, causal_offset=causal_offset, return_logits=True,
             return_lengths=True)
    if layout == "thd":
        o.update(cu_seqlens_q=p["cu"], cu_seqlens_k=p["cu"])
    return o


def run_worker(rank, world, init_file, problem_file, out_file):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    problems = torch.load(problem_file)
    results = {}
    try:
        for case in CASES:
            name, layout, cp_layout, _, _, _, ranges = case
            p = problems[name]
            q, w, k = (split(p[n], p, world, cp_layout, rank) for n in ("q", "w", "k"))
            extra = {}
            if ranges:
                extra = dict(starts=split(p["starts"], p, world, cp_layout, rank),
                             ends=split(p["ends"], p, world, cp_layout, rank))
            results[name] = dcp.context_parallel_indexer_topk(q, w, k, TOPK, group=None, cp_layout=cp_layout,
                                                              **options(p, case), **extra)
        # arguments that differ across the ranks: the same ValueError on every rank
        p = problems["bshd-contiguous"]
        q, w, k = (split(p[n], p, world, "contiguous", rank) for n in ("q", "w", "k"))
        try:
            dcp.context_parallel_indexer_topk(q, w, k, TOPK + rank, group=None)
            results["mismatch"] = None
        except ValueError as e:
            results["mismatch"] = str(e)
        # what only the rank's library call would reject (a strict range past its
        # sequence on rank 1): its validation runs before the exchange, so every
        # rank raises (before, rank 1 alone did, after the exchange)
        starts = torch.zeros(q.shape[:2], dtype=torch.int32)
        ends = torch.full(q.shape[:2], k.shape[1] * world, dtype=torch.int32)
        if rank == 1:
            ends[0, 2] += 1
        try:
            dcp.context_parallel_indexer_topk(q, w, k, TOPK, group=None, starts=starts, ends=ends,
                                              strict_ranges=True)
            results["one-rank-strict-range"] = None
        except ValueError as e:
            results["one-rank-strict-range"] = str(e)
        torch.save(results, out_file)
        # every rank's sends done before any rank closes its connections (a peer that closes
        # first can abort the other in gloo's transport)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp_topk")
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"test_context_parallel_topk seed {seed}")
    problems = {c[0]: make_problem(c[1], seed + i) for i, c in enumerate(CASES)}
    problem_file, init_file = str(tmp / "problem.pt"), str(tmp / "rendezvous")
    torch.save(problems, problem_file)
    world = 2
    outs = [str(tmp / f"out{r}.pt") for r in range(world)]
    run_ranks([[sys.executable, __file__, "--worker", str(r), str(world), init_file, problem_file, outs[r]]
               for r in range(world)], WORKER_TIMEOUT_S, rendezvous=init_file)
    return world, problems, [torch.load(o) for o in outs]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_the_ranks_rows_are_bitwise_the_single_process_rows(world_results, case):
    world, problems, results = world_results
    name, layout, cp_layout, _, _, _, ranges = case
    p = problems[name]
    extra = dict(starts=p["starts"], ends=p["ends"]) if ranges else {}
    whole = dt.indexer_topk(p["q"], p["w"], p["k"], TOPK, **options(p, case), **extra)
    assert (whole[0] >= 0).any() and (whole[0] == -1).any()  # selected keys and padded slots both occur
    for rank in range(world):
        got = results[rank][name]
        for a, b in zip(got, whole):
            want = split(b, p, world, cp_layout, rank)
            assert a.dtype == b.dtype and torch.equal(a, want), (name, rank)


def test_a_topk_that_differs_across_the_ranks_raises_on_every_rank(world_results):
    world, _, results = world_results
    for rank in range(world):
        message = results[rank]["mismatch"]
        assert message is not None and message.startswith("topk: the values differ across the group: "
                                                           "rank 0 has 5, rank 1 has 6"), message


def test_a_range_only_one_ranks_library_call_would_reject_raises_on_every_rank(world_results):
    world, _, results = world_results
    mine = results[1]["one-rank-strict-range"]
    assert mine is not None and mine.startswith("ends: strict mode found a range outside its sequence's keys at "
                                                "(b=0, t=2)"), mine
    other = results[0]["one-rank-strict-range"]
    assert other is not None and other.startswith(
        "the group's arguments: 1 rank(s) rejected their own arguments before the exchange (rank 1: "
        "ValueError: ends: strict mode found a range outside"), other



@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this one process (a CP group of size 1)."""
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "rendezvous"), rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


@pytest.mark.parametrize("causal_offset", [2**63 - 1, 2**63 - 5, 2**40 + 3, -(2**63) + 1, -(2**40) - 3])
def test_an_offset_near_int64s_ends_selects_as_one_process(one_rank_group, causal_offset):
    # the rows' causal ends are clipped to the sequence, not wrapped
    g = torch.Generator().manual_seed(5)
    q, w = torch.randn(1, 8, 8, 64, generator=g), torch.randn(1, 8, 8, generator=g)
    k = torch.randn(1, 8, 64, generator=g)
    got = dcp.context_parallel_indexer_topk(q, w, k, 3, group=None, causal_offset=causal_offset, return_lengths=True)
    want = dt.indexer_topk(q, w, k, 3, causal_offset=causal_offset, return_lengths=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_that_require_grad_select_as_one_process(one_rank_group, dtype):
    g = torch.Generator().manual_seed(6)
    q, w = torch.randn(1, 8, 8, 64, generator=g), torch.randn(1, 8, 8, generator=g)
    k = torch.randn(1, 8, 64, generator=g).to(dtype)
    leaves = [x.clone().requires_grad_() for x in (q, w, k)]
    got = dcp.context_parallel_indexer_topk(*leaves, 3, group=None)
    assert torch.equal(got, dt.indexer_topk(q, w, k, 3))


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "--worker":
    torch.set_num_threads(1)
    run_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
