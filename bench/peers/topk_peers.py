#!/usr/bin/env python3
"""Peer benchmarks of the indexer's top-k, side by side on one problem with dsaib's own.

For query row t and every key s it sees:

    I[t, s] = sum_h w[t, h] * relu(q[t, h, :] . k[s, :]),   ids[t] = the topk keys of largest I

The problem: bf16 q (1, S_q, H, D), k (1, S, D) ~ N(0, 1) and w ~ N(0, 1)/sqrt(H), the
cases of `dsaib-bench --op topk` (B 1): `causal` (S_q = S rows, row t sees keys [0, t]) and
`cp-shard` (a context-parallel shard: the S/2 rows of the sequence's second half against all
S keys, row t seeing [0, S/2 + t]). A row that sees fewer than topk keys pads with -1 (-inf).

The peers, and exactly what each timed call computes (the JSON's "notes" repeat it):

- dsaib: `dsaib.torch.indexer_topk` (ids and logits, logit_descending; the cp-shard's ranges
  as starts/ends). Not available when the installed dsaib has no indexer_topk.
- torch_chunked: Megatron-Core's fallback: per chunk of query rows, relu(q @ k^T) per head
  (bf16 matmul, fp32 accumulation), weighted sum over the heads in fp32, keys past the row's
  range set to -inf, torch.topk; chunks keep the (rows, H, keys) scores within --chunk-mib.
- cudnn_frontend: cudnn-frontend's SM90 `indexer_forward_wrapper` (the dense (rows, keys) fp32
  logits with the causal mask, ratio 1, the chunk's first position as q_causal_offsets) then
  `indexer_top_k_wrapper` (per-row lengths) on each chunk of query rows.
- deep_gemm: DeepGEMM's `fp8_mqa_logits` (q and k cast to fp8 e4m3, k scales 1, fp32 weights,
  per-row [start, end) with clean_logits) then torch.topk, per chunk of query rows. FP8: its
  logits are not the bf16 ones, and its tensor rate is twice bf16's, so it is not held to the
  bf16 floor.

Each reports ns per query row (CUDA events around the whole call after a 3 ms GPU sleep;
median of --iters after --warmup) and its peak extra memory: torch.cuda.max_memory_allocated
over one call minus the memory allocated before it (outputs included; dsaib's own workspace,
taken with cudaMallocAsync outside torch's allocator, is not counted there: dsaib-bench --op
topk reports it). --check first compares each peer's selection on a small problem with the
float64 top-k (the share of the exact top-k's keys it selects).

  python3 bench/peers/topk_peers.py [--peers dsaib,torch_chunked,cudnn_frontend,deep_gemm]
         [--seq 16384,65536,131072] [--ranges causal,cp-shard] [--heads 64,32] [--dim 128]
         [--topk 2048] [--iters 10] [--warmup 2] [--chunk-mib 2048] [--check] [--check-only]
         [--check-seq 2048] [--site DIR] [--json FILE] [--device cuda|cpu]
Exit: 0 every available peer ran and passed its check, 1 a failed check or a case error,
2 bad arguments, 77 no peer can run here (no GPU: the JSON says why).
"""

import argparse
import gc
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import torch  # noqa: E402

PROBLEM = "indexer_topk"
PEERS = ("dsaib", "torch_chunked", "cudnn_frontend", "deep_gemm")
RANGES = ("causal", "cp-shard")
# The share of the float64 top-k's keys a peer must select on the check's problem: the
# bf16 and fp8 logits reorder near-ties at the k-th key.
MIN_RECALL = {"dsaib": 0.999, "torch_chunked": 0.95, "cudnn_frontend": 0.99, "deep_gemm": 0.8}


# --------------------------------------------------------------------------- the problem

def query_rows(ranges, S):
    return S // 2 if ranges == "cp-shard" else S


class Inputs:
    """One case's tensors: q (1, Q, H, D), k (1, S, D), w (1, Q, H) bf16; row t's keys are
    [0, ends[t]) with ends[t] = S - Q + t + 1."""

    def __init__(self, ranges, S, H, D, K, device, seed):
        g = torch.Generator(device="cpu").manual_seed(seed)
        Q = query_rows(ranges, S)
        self.ranges, self.S, self.Q, self.H, self.D, self.K = ranges, S, Q, H, D, K
        self.q = torch.randn(1, Q, H, D, generator=g).to(device=device, dtype=torch.bfloat16)
        self.k = torch.randn(1, S, D, generator=g).to(device=device, dtype=torch.bfloat16)
        self.w = (torch.randn(1, Q, H, generator=g) / math.sqrt(H)).to(device=device, dtype=torch.bfloat16)
        self.offset = S - Q  # row t is position offset + t
        self.ends = torch.arange(self.offset + 1, S + 1, dtype=torch.int32, device=device)
        self.starts = torch.zeros(Q, dtype=torch.int32, device=device)
        self.visible_per_row = (self.offset + 1 + S) / 2.0


def reference_topk(inp):
    """The float64 logits (Q, S) with -inf outside each row's range, and each row's exact top
    min(topk, visible) ids as sets (small problems only)."""
    q, k, w = inp.q[0].double(), inp.k[0].double(), inp.w[0].double()
    logits = torch.einsum("qhs,qh->qs", torch.relu(torch.einsum("qhd,sd->qhs", q, k)), w)
    cols = torch.arange(inp.S, device=logits.device)
    logits = logits.masked_fill(cols[None, :] >= inp.ends[:, None].long(), float("-inf"))
    sets = []
    for t in range(inp.Q):
        n = min(inp.K, inp.offset + t + 1)
        sets.append(set(torch.topk(logits[t], n).indices.tolist()))
    return logits, sets


def recall(ids, sets):
    """The share of the exact top-k's ids among a peer's (Q, topk) ids (-1 ignored)."""
    hit = total = 0
    rows = ids.reshape(len(sets), -1).tolist()
    for row, want in zip(rows, sets):
        got = {i for i in row if i >= 0}
        hit += len(got & want)
        total += len(want)
    return hit / max(total, 1)


def rows_per_chunk(H, S, budget_mib, bytes_per=4):
    """Query rows whose (rows, H, S) scores fit the budget (at least 1)."""
    return max(1, (budget_mib << 20) // max(1, H * S * bytes_per))


# --------------------------------------------------------------------------- the peers' ops

class DsaibOp:
    def __init__(self, fn, inp):
        self.fn, self.inp = fn, inp
        self.ids = self.logits = None

    def run(self):
        i = self.inp
        kw = {"return_logits": True}
        if i.ranges == "cp-shard":
            kw.update(starts=i.starts[None], ends=i.ends[None])
        self.ids, self.logits = self.fn(i.q, i.w, i.k, i.K, **kw)

    def selection(self):
        return self.ids[0]

    def outputs(self):
        return (self.logits.masked_fill(self.ids < 0, 0.0),)


class TorchChunkedOp:
    def __init__(self, inp, chunk_mib):
        self.inp = inp
        self.rows = rows_per_chunk(inp.H, inp.S, chunk_mib)
        self.ids = self.vals = None

    def run(self):
        i = self.inp
        q, k, w = i.q[0], i.k[0], i.w[0]
        ids = torch.full((i.Q, i.K), -1, dtype=torch.int64, device=q.device)
        vals = torch.full((i.Q, i.K), float("-inf"), dtype=torch.float32, device=q.device)
        for r0 in range(0, i.Q, self.rows):
            r1 = min(i.Q, r0 + self.rows)
            n = i.offset + r1  # keys the chunk's last row sees
            s = torch.relu(torch.matmul(q[r0:r1], k[:n].t()))  # (rows, H, n) bf16, fp32 accumulation
            logits = torch.einsum("qhs,qh->qs", s.float(), w[r0:r1].float())
            cols = torch.arange(n, device=q.device)
            logits.masked_fill_(cols[None, :] >= i.ends[r0:r1, None].long(), float("-inf"))
            kk = min(i.K, n)
            v, x = torch.topk(logits, kk, dim=-1)
            x = x.masked_fill(torch.isinf(v) & (v < 0), -1)
            ids[r0:r1, :kk] = x
            vals[r0:r1, :kk] = v
        self.ids, self.vals = ids, vals

    def selection(self):
        return self.ids

    def outputs(self):
        return (self.vals.masked_fill(self.ids < 0, 0.0),)


class CudnnOp:
    def __init__(self, api, inp, chunk_mib):
        self.fwd, self.topk = api
        self.inp = inp
        self.rows = rows_per_chunk(1, inp.S, chunk_mib)  # the (rows, keys) fp32 logits
        self.k4 = inp.k[:, :, None, :]  # (1, S, 1, D): one key head
        self.ids = self.vals = None

    def run(self):
        i = self.inp
        ids = torch.full((i.Q, i.K), -1, dtype=torch.int32, device=i.q.device)
        vals = torch.full((i.Q, i.K), float("-inf"), dtype=torch.float32, device=i.q.device)
        for r0 in range(0, i.Q, self.rows):
            r1 = min(i.Q, r0 + self.rows)
            n = i.offset + r1
            offsets = torch.tensor([i.offset + r0], dtype=torch.int32, device=i.q.device)
            scores = self.fwd(i.q[:, r0:r1], self.k4[:, :n], i.w[:, r0:r1], ratio=1, sm_scale=1.0,
                              q_causal_offsets=offsets)["scores"][0]
            kk = min(i.K, n)
            # its top-k needs topk <= a row's length <= the columns: shorter rows read -inf columns
            lens = torch.clamp(i.ends[r0:r1], min=kk)
            out = self.topk(scores.contiguous(), lens, kk, next_n=1, return_val=True)
            v, x = out["values"], out["indices"]
            x = torch.where(torch.isinf(v) & (v < 0), torch.full_like(x, -1), x.to(torch.int32))
            ids[r0:r1, :kk] = x
            vals[r0:r1, :kk] = v
        self.ids, self.vals = ids, vals

    def selection(self):
        return self.ids

    def outputs(self):
        return (self.vals.masked_fill(self.ids < 0, 0.0),)


class DeepGemmOp:
    def __init__(self, dg, inp, chunk_mib):
        self.dg, self.inp = dg, inp
        self.rows = rows_per_chunk(1, inp.S, chunk_mib)
        fp8 = torch.float8_e4m3fn
        self.q8 = inp.q[0].to(fp8)  # (Q, H, D)
        self.k8 = inp.k[0].to(fp8)  # (S, D)
        self.ks = torch.ones(inp.S, dtype=torch.float32, device=inp.q.device)
        self.w = inp.w[0].float()
        self.ids = self.vals = None

    def logits(self, r0, r1, n):
        i = self.inp
        args = (self.q8[r0:r1], (self.k8[:n], self.ks[:n]), self.w[r0:r1], i.starts[r0:r1], i.ends[r0:r1])
        try:
            return self.dg.fp8_mqa_logits(*args, clean_logits=True)
        except TypeError:  # releases that take q as (values, scales)
            return self.dg.fp8_mqa_logits((args[0], None), *args[1:], clean_logits=True)

    def run(self):
        i = self.inp
        ids = torch.full((i.Q, i.K), -1, dtype=torch.int64, device=i.q.device)
        vals = torch.full((i.Q, i.K), float("-inf"), dtype=torch.float32, device=i.q.device)
        for r0 in range(0, i.Q, self.rows):
            r1 = min(i.Q, r0 + self.rows)
            n = i.offset + r1
            kk = min(i.K, n)
            v, x = torch.topk(self.logits(r0, r1, n), kk, dim=-1)
            x = x.masked_fill(torch.isinf(v) & (v < 0), -1)
            ids[r0:r1, :kk] = x
            vals[r0:r1, :kk] = v
        self.ids, self.vals = ids, vals

    def selection(self):
        return self.ids

    def outputs(self):
        return (self.vals.masked_fill(self.ids < 0, 0.0),)


NOTES = {
    "dsaib": ["dsaib.torch.indexer_topk: BSHD, local ids, logit_descending, topk_indices and topk_logits "
              "(cp-shard: starts/ends); the library's stream-ordered workspace is outside torch's allocator"],
    "torch_chunked": ["Megatron-Core's fallback: per chunk of query rows relu(q @ k^T) per head (bf16 matmul, fp32 "
                      "accumulation, bf16 result), fp32 weighted sum over heads, -inf past the row's range, "
                      "torch.topk (values and int64 indices)",
                      "timed: every chunk, one call"],
    "cudnn_frontend": ["cudnn-frontend SM90 indexer_forward_wrapper (dense fp32 (rows, keys) logits, ratio 1, causal "
                       "mask from q_causal_offsets) then indexer_top_k_wrapper (per-row lengths, values), per chunk",
                       "first call JIT-compiles the CuTe-DSL kernels: see first_call_s"],
    "deep_gemm": ["DeepGEMM fp8_mqa_logits (q, k in fp8 e4m3, k scales 1, fp32 weights, [start, end) per row, "
                  "clean_logits) then torch.topk, per chunk of query rows",
                  "the fp8 casts of q and k are made once, outside the timed call"],
}


def load_peer(name, a, device):
    """(a Peer, the callable(s) its op needs) or the Peer marked unavailable."""
    notes = NOTES[name]
    if name == "deep_gemm":
        peer = common.Peer(name, notes, floor_bound=False,
                           floor_note="fp8 tensor cores run at twice the bf16 rate the floor is measured at")
    else:
        peer = common.Peer(name, notes)
    if name == "torch_chunked":
        return peer, None
    if name == "dsaib":
        try:
            import dsaib.torch as dt  # noqa: PLC0415
        except Exception as e:  # noqa: BLE001
            return peer.unavailable(f"dsaib.torch does not import: {common.short_error(e)}"), None
        fn = getattr(dt, "indexer_topk", None)
        if fn is None:
            return peer.unavailable("not available: the installed dsaib has no dsaib.torch.indexer_topk"), None
        peer.versions = {"dsaib": getattr(sys.modules.get("dsaib"), "__version__", None)}
        if device == "cpu":
            return peer.unavailable("needs a CUDA device (--device cpu)"), None
        return peer, fn
    reason = common.gpu_peer_reason(device)
    if reason:
        return peer.unavailable(reason), None
    try:
        if name == "cudnn_frontend":
            common.add_site(a.site)
            import cudnn  # noqa: F401,PLC0415
            from cudnn.deepseek_sparse_attention.indexer_forward import api as fwd_api  # noqa: PLC0415
            from cudnn.deepseek_sparse_attention.indexer_top_k import api as topk_api  # noqa: PLC0415
            if torch.cuda.get_device_capability(0) != (9, 0):
                raise RuntimeError(f"the SM90 kernels need compute capability 9.0, device is "
                                   f"{torch.cuda.get_device_capability(0)}")
            peer.versions = common.package_versions(("nvidia-cudnn-frontend", "nvidia-cutlass-dsl"))
            return peer, (fwd_api.indexer_forward_wrapper, topk_api.indexer_top_k_wrapper)
        common.add_site(a.site)
        import deep_gemm  # noqa: PLC0415
        if not hasattr(deep_gemm, "fp8_mqa_logits"):
            raise RuntimeError("deep_gemm has no fp8_mqa_logits")
        peer.versions = {"deep_gemm": getattr(deep_gemm, "__version__", None)}
        return peer, deep_gemm
    except Exception as e:  # noqa: BLE001 (ImportError, a missing .so, another GPU)
        return peer.unavailable(common.short_error(e)), None


def make_op(name, handle, inp, a):
    if name == "dsaib":
        return DsaibOp(handle, inp)
    if name == "torch_chunked":
        return TorchChunkedOp(inp, a.chunk_mib)
    if name == "cudnn_frontend":
        return CudnnOp(handle, inp, a.chunk_mib)
    return DeepGemmOp(handle, inp, a.chunk_mib)


# --------------------------------------------------------------------------- the run

def check_peer(name, handle, a, device):
    out = {"seq": a.check_seq, "topk": a.check_topk, "min_recall": MIN_RECALL[name], "cases": [], "ok": True}
    for ranges in a.ranges:
        for H in a.heads:
            inp = Inputs(ranges, a.check_seq, H, a.dim, a.check_topk, device, a.seed)
            op = make_op(name, handle, inp, a)
            op.run()
            if device != "cpu":
                torch.cuda.synchronize()
            _, sets = reference_topk(inp)
            r = recall(op.selection().cpu(), sets)
            finite = all(bool(torch.isfinite(x.float()).all().item()) for x in op.outputs())
            rec = {"ranges": ranges, "heads": H, "recall": r, "finite": finite, "ok": finite and r >= MIN_RECALL[name]}
            out["ok"] = out["ok"] and rec["ok"]
            out["cases"].append(rec)
            print(f"check {name} {ranges} H{H}: recall {r:.4f}" + ("  ok" if rec["ok"] else "  FAIL"), flush=True)
            del op, inp
    return out


def time_case(name, handle, inp, a, device):
    """One row: first call, timed calls, peak extra memory, finiteness."""
    cuda = device != "cpu"
    op = make_op(name, handle, inp, a)
    row = {}
    if cuda:
        row["first_call_s"] = common.first_call(op.run)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        op.run()
        torch.cuda.synchronize()
        row["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
        times = common.gpu_time(op.run, a.iters, a.warmup)
    else:
        t0 = time.perf_counter()
        op.run()
        row["first_call_s"] = time.perf_counter() - t0
        row["peak_extra_bytes"] = None
        times = common.wall_time(op.run, a.iters, a.warmup)
    row.update(common.summarize_op(times, inp.Q))
    if not all(bool(torch.isfinite(x.float()).all().item()) for x in op.outputs()):
        raise RuntimeError("non-finite logit among the selected keys")
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=",".join(PEERS), help="comma list of " + ", ".join(PEERS))
    ap.add_argument("--seq", default="16384,65536,131072", help="comma list of S (keys; causal: S query rows)")
    ap.add_argument("--ranges", default="causal,cp-shard", help="comma list of " + ", ".join(RANGES))
    ap.add_argument("--heads", default="64,32", help="comma list of H (default 64,32)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10, help="timed calls, median reported (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before them (default 2)")
    ap.add_argument("--chunk-mib", type=int, default=2048,
                    help="MiB of scores per chunk of query rows of the chunked peers (default 2048)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--check", action="store_true", help="check each peer on a small problem first")
    ap.add_argument("--check-only", action="store_true", help="run --check and stop")
    ap.add_argument("--check-seq", type=int, default=2048, help="S of the check's problem (default 2048)")
    ap.add_argument("--check-topk", type=int, default=256, help="topk of the check's problem (default 256)")
    ap.add_argument("--site", default=None, metavar="DIR", help="a folder of peer packages to put first on sys.path")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON (rewritten after every row)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (default), or cpu: torch_chunked alone, perf_counter timing (smoke tests)")
    a = ap.parse_args(argv)
    try:
        seqs = common.parse_list(a.seq, int)
        a.heads = common.parse_list(a.heads, int)
        a.ranges = common.parse_list(a.ranges, str)
        names = common.parse_list(a.peers, str)
    except ValueError:
        ap.error("bad --seq or --heads")
    if not seqs or min(seqs) < 2 or not a.heads or min(a.heads) < 1 or a.dim < 1 or a.topk < 1:
        ap.error("bad --seq, --heads, --dim or --topk (S >= 2)")
    if not a.ranges or any(r not in RANGES for r in a.ranges):
        ap.error(f"bad --ranges: expected a comma list of {', '.join(RANGES)}, got {','.join(a.ranges)!r}")
    if not names or any(n not in PEERS for n in names):
        ap.error(f"bad --peers: expected a comma list of {', '.join(PEERS)}, got {a.peers!r}")
    if a.iters < 1 or a.warmup < 0 or a.chunk_mib < 1 or a.check_seq < 2 or a.check_topk < 1:
        ap.error("bad --iters/--warmup/--chunk-mib/--check-seq/--check-topk")

    info = {"problem": PROBLEM, "status": "ok", "iters": a.iters, "warmup": a.warmup, "chunk_mib": a.chunk_mib,
            "timing": "CUDA events around the peer's whole call after a 3 ms GPU sleep; median of iters after warmup",
            "memory": "peak_extra_bytes = torch.cuda.max_memory_allocated over one call minus memory_allocated "
                      "before it (outputs included)",
            "peers": {}, "results": []}
    rc = common.peers_unavailable(info, names, a.device, a.json, PROBLEM)
    if rc is not None:
        return rc
    info.update(common.device_info() if a.device == "cuda" else {"device": "cpu"})
    loaded = []
    for n in names:
        peer, handle = load_peer(n, a, a.device)
        loaded.append((peer, handle))
        info["peers"][n] = peer.record()
        print(f"{n}: {peer.status}" + (f" ({peer.reason})" if peer.reason else ""), flush=True)
    common.write_json(a.json, info)
    live = [(p, h) for p, h in loaded if p.status == "ok"]
    rc = 0
    if a.check or a.check_only:
        for p, h in live:
            rec = info["peers"][p.name]
            if common.run_check_into(rec, lambda p=p, h=h: check_peer(p.name, h, a, a.device), None) != 0:
                rc = 1
            common.write_json(a.json, info)
    if not a.check_only:
        for ranges in a.ranges:
            for H in a.heads:
                for S in seqs:
                    case = {"ranges": ranges, "batch": 1, "seq": S, "seq_q": query_rows(ranges, S), "heads": H,
                            "dim": a.dim, "topk": a.topk}
                    try:
                        inp = Inputs(ranges, S, H, a.dim, a.topk, a.device, a.seed + S)
                    except Exception as e:  # noqa: BLE001 (OOM while building: every peer of the case says so)
                        for p, _ in live:
                            info["results"].append({"peer": p.name, **case, "status": "error",
                                                    "reason": "inputs: " + common.short_error(e)})
                        rc = 1
                        continue
                    for p, h in live:
                        row = {"peer": p.name, **case, "visible_keys_per_row": inp.visible_per_row}
                        try:
                            row.update(time_case(p.name, h, inp, a, a.device))
                            row["status"] = "ok"
                            mem = row["peak_extra_bytes"]
                            print(f"  {p.name:15s} {ranges:8s} S{S} H{H} D{a.dim} topk{a.topk}: "
                                  f"{row['ns_per_row']:10.1f} ns/row (median {row['median_ms']:.3f} ms)"
                                  + (f", peak extra {mem / 2**20:.1f} MiB" if mem is not None else ""), flush=True)
                        except Exception as e:  # noqa: BLE001 (OOM, unsupported shape: report and go on)
                            row["status"] = "oom" if common.is_oom(e) else "error"
                            row["reason"] = common.short_error(e)
                            row["traceback"] = traceback.format_exc(limit=8)
                            print(f"  {p.name:15s} {ranges:8s} S{S} H{H}: {row['status'].upper()}: {row['reason']}",
                                  flush=True)
                            rc = 1
                        gc.collect()
                        if a.device == "cuda":
                            torch.cuda.empty_cache()
                        info["results"].append(row)
                        common.write_json(a.json, info)
                    del inp
                    gc.collect()
    peers = [p for p, _ in loaded]
    urc = common.finish_peer_run(info, peers, a.json)
    return urc if urc else rc


if __name__ == "__main__":
    sys.exit(main())
