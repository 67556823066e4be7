"""Arguments that differ across the ranks of a context-parallel group
(dsaib.distributed): a ValueError (or the rank's own error) on every rank
within seconds, naming the difference, instead of a hang, an aborted gloo
process or a wrong loss. Each case runs in 2 processes on the gloo backend
with the CPU backend: this file run as a script (``--mismatch``), started with
subprocess and joined through a ``file://`` rendezvous. Skipped when torch (or
its gloo backend) is not installed.
"""
import datetime
import re
import sys
import time

import numpy
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)

import dsaib.distributed as dcp  # noqa: E402
from rank_processes import run_ranks  # noqa: E402

SM = 0.125
H, D, TOPK = 8, 64, 6
WORKER_TIMEOUT_S = 300


# ---- arguments that differ across the ranks: ValueError on every rank ------------
#
# Each case runs in 2 worker processes (gloo, a 60 s timeout: a rank that raised
# alone would leave the other waiting, and the test would fail on the timeout).
# A collective of mismatched sizes aborts a gloo process (SIGABRT); the other
# cases would otherwise give a wrong loss without an error.


def mismatch_inputs(case, rank):
    """(function, positional tensors, options) of rank for a mismatch case (2 ranks)."""
    g = torch.Generator().manual_seed(11)
    layout = "thd" if case in ("different-cu-seqlens", "one-rank-cu-seqlens-int64") else "bshd"
    B, S, T = 2, 16, 24
    shape = (B, S) if layout == "bshd" else (T,)
    q = torch.randn(*shape, H, D, generator=g).to(torch.bfloat16).double()
    w = torch.randn(*shape, H, generator=g).double()
    k = torch.randn(*shape, D, generator=g).to(torch.bfloat16).double()
    ids = torch.randint(0, 4, shape + (TOPK,), generator=g, dtype=torch.int32)
    T_ = torch.rand(shape + (TOPK,), generator=g, dtype=torch.float64)
    opts = dict(sm_scale=SM, group=None, cp_layout="contiguous", layout=layout)
    half = slice(0, 8) if rank == 0 else slice(8, 16)
    q_rows, k_rows = half, half
    if case.startswith("unequal-key-slices"):
        k_rows = slice(0, 6) if rank == 0 else slice(6, 16)
    elif case == "unequal-query-slices":
        q_rows = slice(0, 4) if rank == 0 else slice(4, 16)
    elif case == "different-cp-layout":
        opts["cp_layout"] = "zigzag" if rank == 0 else "contiguous"
    if layout == "bshd":
        args = [q[:, q_rows], w[:, q_rows], k[:, k_rows], ids[:, q_rows], T_[:, q_rows]]
    else:
        cu = torch.tensor([0, 4, 12, 24] if rank == 0 or case != "different-cu-seqlens" else [0, 8, 12, 24],
                          dtype=torch.int32)
        opts.update(cp_layout="zigzag", cu_seqlens_q=cu, cu_seqlens_k=cu)
        args = [q[:12], w[:12], k[:12], ids[:12], T_[:12]]
    if case == "different-dtypes" and rank == 1:
        args[:3] = [x.float() for x in args[:3]]
    if case == "not-a-member":
        opts["group"] = dist.new_group([0])          # every rank takes part in new_group
        if rank == 0:
            args, opts = [x[:, :] for x in (q, w, k, ids, T_)], dict(opts, cp_layout="zigzag")
    if case.endswith("backward-op"):
        args = [args[0].to(torch.bfloat16), args[1].float(), args[2].to(torch.bfloat16), args[3],
                args[4].float(), None]
    if case == "one-rank-index-q-float16" and rank == 1:
        args[0] = args[0].to(torch.float16)          # index_q: a dtype the library does not take
    if case == "one-rank-cu-seqlens-int64" and rank == 1:
        opts["cu_seqlens_q"] = opts["cu_seqlens_q"].to(torch.int64)   # the same offsets in int64
    if case.startswith("one-rank-rejects") and rank == 1:
        args[2] = args[2].tolist()                   # index_k: not a tensor, on rank 1 only
    if case.endswith("backward-op"):
        if case == "different-grad-loss-backward-op":
            opts["grad_loss"] = 1.0 if rank == 0 else 2.0
        if case == "equal-grad-loss-of-other-types-backward-op":
            opts["grad_loss"] = 1 if rank == 0 else numpy.float64(1.0)
        if case == "one-rank-bad-grad-loss-tensor-backward-op" and rank == 1:
            opts["grad_loss"] = torch.ones(2)
        if case == "one-rank-float16-row-lse-backward-op" and rank == 1:
            return dcp.context_parallel_indexer_backward, args, dict(
                opts, row_lse=torch.zeros(args[3].shape[:-1], dtype=torch.float16),
                row_target_mass=torch.ones(args[3].shape[:-1]))
        if case == "one-rank-bad-row-lse-backward-op" and rank == 1:
            return dcp.context_parallel_indexer_backward, args, dict(
                opts, row_lse=torch.zeros(args[3].shape[:-1] + (2,)), row_target_mass=torch.ones(args[3].shape[:-1]))
        return dcp.context_parallel_indexer_backward, args, dict(opts, row_lse=torch.zeros(args[3].shape[:-1]),
                                                               row_target_mass=torch.ones(args[3].shape[:-1]))
    return dcp.context_parallel_indexer_kl_loss, args, opts


# A short group timeout: a rank left waiting for another that raised alone fails
# the test on the elapsed time (MISMATCH_SECONDS) instead of hanging it.
MISMATCH_TIMEOUT_S = 20
MISMATCH_SECONDS = 10


def run_mismatch_worker(case, rank, world, init_file, out_file):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=MISMATCH_TIMEOUT_S))
    try:
        fn, args, opts = mismatch_inputs(case, rank)
        dist.barrier()  # both ranks start the call together: the elapsed time is the call's
        start = time.monotonic()
        try:
            fn(*args, **opts)
            error = None
        except (TypeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        except RuntimeError as e:  # a collective that timed out: the failure this test is for
            error = f"{type(e).__name__}: {e}"
        torch.save(dict(error=error, seconds=time.monotonic() - start), out_file)
        if error is None or not error.startswith("RuntimeError"):  # a timed-out peer may be gone
            dist.barrier()  # every rank's sends done before any rank closes its connections
    finally:
        dist.destroy_process_group()


MISMATCHES = {
    "unequal-key-slices": [r"index_k: the slices differ across the group: rank 0 has 6 key rows, rank 1 has 10; "
                           r"expected equal slices \(docs/context-parallel.md\)"] * 2,
    "unequal-key-slices-backward-op": [r"index_k: the slices differ across the group: rank 0 has 6 key rows, "
                                       r"rank 1 has 10"] * 2,
    "different-dtypes": [r"index_q: the dtypes differ across the group: rank 0 has torch.float64, "
                         r"rank 1 has torch.float32"] * 2,
    "unequal-query-slices": [r"index_q: the slices differ across the group: rank 0 has 4 query rows, "
                             r"rank 1 has 12"] * 2,
    "different-cu-seqlens": [r"cu_seqlens_q: the offsets differ across the group: rank 0 has 3 sequences ending "
                             r"at 24 \(hash 0x[0-9a-f]+\), rank 1 has 3 sequences ending at 24 \(hash "
                             r"0x[0-9a-f]+\); expected the whole batch's offsets, the same on every rank"] * 2,
    "different-cp-layout": [r"cp_layout: the values differ across the group: rank 0 has 'zigzag', "
                            r"rank 1 has 'contiguous'"] * 2,
    "not-a-member": [None, r"group: expected a process group that this process is a member of, got a group "
                           r"without this process \(global rank 1\)"],
    "different-grad-loss-backward-op": [r"grad_loss: the values differ across the group: rank 0 has 1.0, "
                                        r"rank 1 has 2.0"] * 2,
    # an int, a float and a numpy float of one value are one value
    "equal-grad-loss-of-other-types-backward-op": [None, None],
    # an argument only the rank's own library call would check: every rank
    # raises at once (instead of the others waiting out the group's timeout)
    "one-rank-bad-grad-loss-tensor-backward-op": [
        r"^ValueError: the group's arguments: 1 rank\(s\) rejected their own arguments before the exchange "
        r"\(rank 1: ValueError: grad_loss: expected a tensor with one element, got 2 elements\)",
        r"^ValueError: grad_loss: expected a tensor with one element, got 2 elements$"],
    "one-rank-bad-row-lse-backward-op": [
        r"^ValueError: the group's arguments: 1 rank\(s\) rejected their own arguments before the exchange "
        r"\(rank 1: ValueError: row_lse: expected shape",
        r"^ValueError: row_lse: expected shape \[2, 8\] \(one value per query row of this rank, layout bshd\), "
        r"got \[2, 8, 2\]$"],
    # what only the rank's library call would reject (its validation runs before
    # the exchange): every rank raises within seconds
    # a dtype the descriptors compare: the difference, on every rank
    "one-rank-index-q-float16": [r"^ValueError: index_q: the dtypes differ across the group: rank 0 has "
                                 r"torch.float64, rank 1 has torch.float16"] * 2,
    "one-rank-cu-seqlens-int64": [
        r"^ValueError: the group's arguments: 1 rank\(s\) rejected their own arguments before the exchange "
        r"\(rank 1: TypeError: cu_seqlens_q.*by the library's validation",
        r"^TypeError: cu_seqlens_q: expected dtype i32, got int64$"],
    "one-rank-float16-row-lse-backward-op": [
        r"^ValueError: the group's arguments: 1 rank\(s\) rejected their own arguments before the exchange "
        r"\(rank 1: TypeError: row_lse.*by the library's validation",
        r"^TypeError: row_lse: .*float16"],
    # a rank's own check fails before the exchange: it raises its error, the other
    # rank a ValueError naming it (instead of waiting out the timeout)
    "one-rank-rejects": [r"^ValueError: the group's arguments: 1 rank\(s\) rejected their own arguments before "
                         r"the exchange \(rank 1: TypeError: index_k: expected a torch.Tensor, got list\)",
                         r"^TypeError: index_k: expected a torch.Tensor, got list$"],
    "one-rank-rejects-backward-op": [r"^ValueError: the group's arguments: 1 rank\(s\) rejected their own "
                                     r"arguments before the exchange \(rank 1: TypeError: index_k",
                                     r"^TypeError: index_k: expected a torch.Tensor, got list$"],
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_arguments_that_differ_across_ranks_raise_on_every_rank(case, tmp_path):
    world = 2
    init_file = str(tmp_path / "rendezvous")
    outs = [str(tmp_path / f"out{r}.pt") for r in range(world)]
    run_ranks([[sys.executable, __file__, "--mismatch", case, str(r), str(world), init_file, outs[r]]
               for r in range(world)], WORKER_TIMEOUT_S, rendezvous=init_file)
    for r, (out, want) in enumerate(zip(outs, MISMATCHES[case])):
        result = torch.load(out)
        error = result["error"]
        assert result["seconds"] < MISMATCH_SECONDS, f"rank {r}: {result['seconds']:.1f} s ({error})"
        if want is None:
            assert error is None, (r, error)
        else:
            assert error is not None, f"rank {r}: no error"
            assert re.search(want, error), (r, error)


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "--mismatch":
    torch.set_num_threads(1)
    run_mismatch_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
