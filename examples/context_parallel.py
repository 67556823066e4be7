#!/usr/bin/env python3
"""The indexer loss of one sequence split across the ranks of a context-parallel group.

    torchrun --nproc-per-node 2 examples/context_parallel.py                  # 2 ranks
    torchrun --nproc-per-node 4 examples/context_parallel.py --layout thd     # packed sequences

Every rank builds the same problem (causal top-k ids, -1 where a query has
fewer earlier keys than topk, a target distribution T), keeps its slice of the
sequence in Megatron's zig-zag (default) or contiguous layout, and runs
dsaib.distributed.context_parallel_indexer_kl_loss and its backward: index_k
is all-gathered, d_index_k reduce-scattered. It then runs the single-process
loss (dsaib.torch.indexer_kl_loss) on the whole sequence and checks that the
loss and the rank's slices of the three gradients agree.

Devices: with one GPU per rank and a cuda build of dsaib (sm_90a), CUDA
tensors and the NCCL backend; otherwise CPU tensors, the gloo backend and the
library's CPU backend (--device picks). Exit status 0 when every rank agrees
within --tol, 1 otherwise.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import dsaib
import dsaib.distributed as dcp
import dsaib.torch as dt


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: cuda when every rank has a GPU and dsaib has its cuda backend, else cpu")
    ap.add_argument("--cp-layout", choices=dcp.CP_LAYOUTS, default="zigzag")
    ap.add_argument("--layout", choices=("bshd", "thd"), default="bshd")
    ap.add_argument("--seq", type=int, default=None,
                    help="sequence length (THD: the longest of three packed sequences); "
                         "default 256 on cpu, 8192 on cuda")
    ap.add_argument("--heads", type=int, default=None, help="H (default 8 on cpu, 64 on cuda)")
    ap.add_argument("--dim", type=int, default=None, help="D (default 64 on cpu, 128 on cuda)")
    ap.add_argument("--topk", type=int, default=None, help="default 32 on cpu, 2048 on cuda")
    ap.add_argument("--iters", type=int, default=3, help="timed steps (forward + backward)")
    ap.add_argument("--tol", type=float, default=1e-4,
                    help="largest relative difference (to the largest magnitude) from the single process")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def pick_device(choice, local_rank, local_world):
    usable = torch.cuda.is_available() and torch.cuda.device_count() >= local_world and \
        dsaib.cuda_backend_available()
    if choice == "cuda" and not usable:
        raise SystemExit("--device cuda: needs one GPU per local rank and dsaib's cuda backend")
    if choice == "cuda" or (choice == "auto" and usable):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def causal_problem(lengths, H, D, topk, seed, device):
    """The whole packed problem: q (T, H, D), w (T, H), k (T, D) float32 on the
    bf16 grid, ids (T, topk) int32 numbering keys within each sequence (causal,
    -1 past a query's earlier keys), T (T, topk) float32 summing to 1 over the
    valid slots. The same on every rank (one seed)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = sum(lengths)
    q = torch.randn(n, H, D, generator=g).to(torch.bfloat16).float()
    w = torch.randn(n, H, generator=g)
    k = torch.randn(n, D, generator=g).to(torch.bfloat16).float()
    ids, target = [], []
    for L in lengths:
        score = torch.rand(L, L, generator=g).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -1.0)
        top, idx = score.topk(min(topk, L), dim=-1)
        idx = torch.where(top >= 0, idx, torch.full_like(idx, -1))
        idx = torch.cat([idx, torch.full((L, topk - idx.shape[1]), -1, dtype=idx.dtype)], dim=1)
        logits = torch.randn(L, topk, generator=g).masked_fill(idx < 0, -math.inf)
        ids.append(idx)
        target.append(torch.softmax(logits, dim=-1).nan_to_num(0.0))
    return [t.to(device) for t in (q, w, k, torch.cat(ids).to(torch.int32), torch.cat(target))]


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(args.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    cp, rank = dist.get_world_size(), dist.get_rank()
    S = args.seq or (8192 if cuda else 256)
    H = args.heads or (64 if cuda else 8)
    D = args.dim or (128 if cuda else 64)
    topk = args.topk or (2048 if cuda else 32)
    n_chunks = 2 * cp if args.cp_layout == "zigzag" else cp
    if args.layout == "bshd":
        lengths = [S]
    else:  # three packed sequences, each a multiple of the layout's chunk count
        lengths = [max(n_chunks, S // d // n_chunks * n_chunks) for d in (1, 2, 4)]
    if any(L % n_chunks for L in lengths):
        raise SystemExit(f"--seq: expected a multiple of {n_chunks} ({args.cp_layout} over {cp} ranks), got {S}")

    q, w, k, ids, T = causal_problem(lengths, H, D, topk, args.seed, device)
    opts = dict(sm_scale=D ** -0.5, layout=args.layout)
    if args.layout == "thd":
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
        opts.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:  # BSHD with one batch row
        q, w, k, ids, T = (t.unsqueeze(0) for t in (q, w, k, ids, T))

    # This rank's slice: the rows rank_rows names (the same split for queries and keys).
    rows = dcp.rank_rows(lengths, cp, args.cp_layout)[rank].to(device)
    dim = 1 if args.layout == "bshd" else 0
    mine = [t.index_select(dim, rows) for t in (q, w, k, ids, T)]

    times = []
    for _ in range(args.iters + 1):
        leaves = [t.detach().clone().requires_grad_() for t in mine[:3]]
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        loss = dcp.context_parallel_indexer_kl_loss(*leaves, mine[3], mine[4], group=None,
                                                    cp_layout=args.cp_layout, **opts)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)

    # The single process on the whole sequence, and this rank's rows of its gradients.
    whole = [t.detach().clone().requires_grad_() for t in (q, w, k)]
    want_loss = dt.indexer_kl_loss(*whole, ids, T, **opts)
    want_loss.backward()
    errors = {"loss": abs(loss.item() - want_loss.item()) / abs(want_loss.item())}
    for name, got, ref in zip(("d_index_q", "d_weights", "d_index_k"), leaves, whole):
        want = ref.grad.index_select(dim, rows)
        errors[name] = ((got.grad - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    ok = all(e <= args.tol for e in errors.values())

    step_ms = 1e3 * min(times[1:]) if len(times) > 1 else 1e3 * times[0]
    for r in range(cp):
        if r == rank:
            print(f"rank {rank}/{cp} ({device}, {args.cp_layout}, {args.layout}, S {sum(lengths)}, H {H}, D {D}, "
                  f"topk {topk}): loss {loss.item():.6f}, step {step_ms:.2f} ms, vs one process: "
                  + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()) + ("" if ok else "  FAIL"), flush=True)
        dist.barrier()
    status = torch.tensor(0 if ok else 1, device=device)
    dist.all_reduce(status, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return int(status.item())


if __name__ == "__main__":
    sys.exit(main())
