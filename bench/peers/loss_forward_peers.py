#!/usr/bin/env python3
"""Peer benchmarks of the loss forward (indexer_kl_forward), side by side on one problem.

The problem is the backward benches' (bench/peers/common.py): bf16 index_q (B, S, H, D),
weights (B, S, H) and index_k (B, S, D), fp32 attn_score T normalised over each row's valid
slots, causal or random ids, sm_scale = D**-0.5. Our forward computes, per query row,

    z_i  = sm_scale * sum_h w_h * relu(q_h . k_{id_i})          (valid slots)
    LSE  = log sum_i exp(z_i),   loss = -(loss_coeff / N) * sum_rows sum_i max(T_i, eps) * log(max(P_i, eps))

and writes the loss, LSE and the target mass per row (no P). The peers, and exactly what
each timed call computes (the JSON's "notes" repeat it):

- torch_eager: the same loss and LSE per row, written as a user writes it: per block of rows
  a gather of the selected keys, a bf16 bmm with index_q, relu, the weighted head sum in fp32,
  logsumexp and the loss terms; blocks sized so that the (rows, H, topk) scores stay within
  about 2 GiB. Checked against the float64 closed form before timing.
- cudnn_frontend: cudnn-frontend's SM90 sparse indexer score recompute
  (cudnn.deepseek_sparse_attention.score_recompute, `sparse_indexer_score_recompute`): it
  writes P = softmax(z) over the selected slots, (B, S, topk) fp32, and no loss or LSE. Timed:
  that call (its (B,S,H) -> (B,H,S) copy of the weights included); `with_loss` also times the
  loss from that P in torch (log, product with T, sum), the nearest equivalent of our output.
- tilelang: Megatron-Core's TileLang `sparse_indexer_kl` (ops/tilelang_indexer_loss.py,
  `sparse_indexer_kl_interface`): from logits z already computed (fp32, (rows, topk)), the
  valid mask and T, it writes the KL divergence KL(T/sum T || P) per row (summed) and the
  logits' gradient P - T/sum T. It does not compute the logits: the gather and GEMM, most of
  the work of our forward, are outside its timed call (z is made once, untimed, by the
  torch_eager code). Its loss differs from ours by the entropy of T.

Each peer is first checked on a small problem (--check; B1 S --check-seq, the timed H, D and
topk, so the compiled kernels are the timed ones) against the float64 closed form, then timed:
CUDA events around the call after a 3 ms GPU sleep (host overhead hidden), --warmup untimed
calls, the median of --iters (torch_eager: --eager-iters / --eager-warmup).

  python3 bench/peers/loss_forward_peers.py [--peers torch_eager,cudnn_frontend,tilelang]
         [--seq 4096,16384,65536] [--ids causal,random] [--heads 64] [--topk 2048] [--dim 128]
         [--iters 10] [--warmup 2] [--eager-iters 3] [--eager-warmup 1] [--check] [--check-only]
         [--check-seq 2560] [--site DIR] [--megatron-dir .peers/megatron_tilelang] [--json FILE]
         [--device cuda|cpu]
Exit: 0 every available peer ran and passed its check, 1 a failed check or a case error,
2 bad arguments, 77 no peer can run here (the JSON says why for each).
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import EPS, torch  # noqa: E402

PROBLEM = "loss_forward"
PEERS = ("torch_eager", "cudnn_frontend", "tilelang")
LOSS_COEFF = 1.0


# --------------------------------------------------------------------------- torch eager

def eager_logits(q, w, k, ids, sm_scale):
    """z (R, topk) fp32 and the valid mask for a block of rows: q (R, H, D), w (R, H), k (S_kv, D)
    bf16, ids (R, topk). Invalid slots gather a distinct row (slot mod S_kv); their z is unused."""
    s_kv = k.shape[0]
    valid = (ids >= 0) & (ids < s_kv)
    spread = (torch.arange(ids.shape[-1], device=ids.device) % s_kv).to(ids.dtype).expand_as(ids)
    idx = torch.where(valid, ids, spread).long()
    x = torch.bmm(q, k[idx].transpose(1, 2))  # (R, H, topk), fp32 accumulation, bf16 result
    z = (torch.relu(x.float()) * w.float().unsqueeze(-1)).sum(dim=1) * sm_scale
    return z, valid


def eager_kl_forward(q, w, k, ids, target, sm_scale, loss_coeff, rows):
    """(loss, LSE (B, S)) of the loss forward, blocks of `rows` query rows."""
    B, S = ids.shape[0], ids.shape[1]
    lse = torch.empty((B, S), dtype=torch.float32, device=q.device)
    parts = []
    for b in range(B):
        for r0 in range(0, S, rows):
            r1 = min(S, r0 + rows)
            z, valid = eager_logits(q[b, r0:r1], w[b, r0:r1], k[b], ids[b, r0:r1], sm_scale)
            z = z.masked_fill(~valid, -math.inf)
            row_lse = torch.logsumexp(z, dim=-1)
            lse[b, r0:r1] = row_lse
            logp = torch.where(valid, (z - row_lse.unsqueeze(-1)).clamp_min(-100.0), torch.zeros_like(z))
            tt = torch.where(valid, target[b, r0:r1].clamp_min(EPS), torch.zeros_like(z))
            parts.append((tt * logp).sum(dtype=torch.float64))
    loss = -(loss_coeff / (B * S)) * torch.stack(parts).sum()
    return loss, lse


def eager_logits_all(q, w, k, ids, sm_scale, rows):
    """z (B*S, topk) fp32 and valid (B*S, topk) of the whole problem (the TileLang peer's input)."""
    B, S, K = ids.shape
    z = torch.empty((B * S, K), dtype=torch.float32, device=q.device)
    valid = torch.empty((B * S, K), dtype=torch.bool, device=q.device)
    for b in range(B):
        for r0 in range(0, S, rows):
            r1 = min(S, r0 + rows)
            zz, vv = eager_logits(q[b, r0:r1], w[b, r0:r1], k[b], ids[b, r0:r1], sm_scale)
            z[b * S + r0:b * S + r1] = zz
            valid[b * S + r0:b * S + r1] = vv
    return z, valid


class Inputs:
    def __init__(self, B, S, H, D, K, kind, device, seed):
        self.q, self.w, self.k, self.ids, self.t = common.make_inputs(B, S, H, D, K, kind, device, seed)
        self.ids = self.ids.contiguous()
        self.sm_scale = 1.0 / math.sqrt(D)
        self.valid_per_row = ((self.ids >= 0) & (self.ids < S)).sum().item() / (B * S)
        self.rows = common.rows_per_chunk(H, K, D)


class EagerOp:
    def __init__(self, inp):
        self.inp = inp
        self.out = None
        self.extra = {}
        self.restore = None

    def run(self):
        i = self.inp
        self.out = eager_kl_forward(i.q, i.w, i.k, i.ids, i.t, i.sm_scale, LOSS_COEFF, i.rows)

    def outputs(self):
        return (self.out[0], self.out[1].clamp_min(-1e30))  # LSE of a row without a valid slot is -inf


def check_against_reference(inp, loss, lse, p=None):
    """Errors of a peer's loss / LSE / P against the float64 closed form of the same inputs."""
    q64, w64, k64 = (x.double() for x in (inp.q, inp.w, inp.k))
    ref_loss, ref_lse, ref_p = common.reference_kl_forward(q64, w64, k64, inp.ids, inp.t.double(), inp.sm_scale,
                                                           LOSS_COEFF)
    out = {}
    if loss is not None:
        out["loss_rel_err"] = abs(float(loss) - ref_loss.item()) / max(abs(ref_loss.item()), 1e-300)
    if lse is not None:
        fin = torch.isfinite(ref_lse)
        out["lse_max_abs_err"] = (lse.double()[fin] - ref_lse[fin]).abs().max().item()
        out["lse_nonfinite_where_reference_finite"] = int((~torch.isfinite(lse[fin])).sum().item())
    if p is not None:
        out["p_rel_rms"] = common.rel_err(p, ref_p)
        out["p_max_abs_err"] = common.max_abs_err(p, ref_p)
        big = ref_p >= 1e-30
        out["p_max_rel_err"] = ((p.double()[big] - ref_p[big]).abs() / ref_p[big]).max().item()
    return out


def make_eager(a, device):
    def check():
        out = {"shape": {"batch": 1, "seq": a.check_seq, "heads": a.heads[0], "dim": a.dim, "topk": a.topk[0]},
               "cases": [], "ok": True, "tolerance": {"loss_rel_err": 1e-3, "lse_max_abs_err": 5e-2}}
        for kind in ("causal", "random"):
            inp = Inputs(1, a.check_seq, a.heads[0], a.dim, a.topk[0], kind, device, a.seed)
            loss, lse = eager_kl_forward(inp.q, inp.w, inp.k, inp.ids, inp.t, inp.sm_scale, LOSS_COEFF, inp.rows)
            rec = {"ids": kind, **check_against_reference(inp, loss, lse)}
            rec["ok"] = (rec["loss_rel_err"] < 1e-3 and rec["lse_max_abs_err"] < 5e-2
                         and rec["lse_nonfinite_where_reference_finite"] == 0)
            out["ok"] = out["ok"] and rec["ok"]
            out["cases"].append(rec)
            print(f"check torch_eager {kind:6s}: loss rel err {rec['loss_rel_err']:.2e}, LSE max abs err "
                  f"{rec['lse_max_abs_err']:.2e}" + ("  ok" if rec["ok"] else "  FAIL"), flush=True)
        return out
    notes = ["computes the loss and LSE per row (our forward's outputs, without the target mass)",
             "per block of rows: gather of the selected keys, bf16 bmm (fp32 accumulation, bf16 result), relu, "
             "weighted head sum in fp32, logsumexp, loss terms summed in fp64; blocks keep the (rows, H, topk) "
             "scores within about 2 GiB",
             "timed: the whole loss forward, one call"]
    return common.Peer("torch_eager", notes, make_op=EagerOp, check=check, iters=a.eager_iters,
                       warmup=a.eager_warmup)


# --------------------------------------------------------------------------- cudnn-frontend

class CudnnOp:
    def __init__(self, iface, inp):
        self.iface, self.inp = iface, inp
        self.p = torch.empty(inp.ids.shape, dtype=torch.float32, device=inp.q.device)
        valid = (inp.ids >= 0) & (inp.ids < inp.k.shape[1])
        self.tt = torch.where(valid, inp.t.clamp_min(EPS), torch.zeros_like(inp.t))
        self.c = LOSS_COEFF / (inp.ids.shape[0] * inp.ids.shape[1])
        self.loss = None
        self.restore = None
        self.extra = {"with_loss": self.run_with_loss}

    def run(self):
        i = self.inp
        self.iface.sparse_indexer_score_recompute(i.q, i.k, i.w, i.ids, self.p, sm_scale=i.sm_scale,
                                                  topk_indices_global=False)

    def run_with_loss(self):
        self.run()
        self.loss = -self.c * (self.tt * torch.log(self.p.clamp_min(EPS))).sum()

    def outputs(self):
        return (self.p,)


def make_cudnn(a, device):
    notes = ["computes P = softmax(z) over the selected slots, (B, S, topk) fp32; no loss, no LSE",
             "SM90 kernel of cudnn.deepseek_sparse_attention.score_recompute (sparse_indexer_score_recompute, "
             "the function its SparseIndexerScoreRecompute class runs on SM90, called with sm_scale; the public "
             "wrapper takes no sm_scale)",
             "timed (ns_per_row): that call, its (B,S,H)->(B,H,S) copy of the weights included; "
             "with_loss_ns_per_row: also the loss from that P in torch (log, product with T, sum)",
             "first call JIT-compiles the CuTe-DSL kernel (keyed by H, D, topk, not S): see first_call_s"]
    peer = common.Peer("cudnn_frontend", notes)
    reason = common.gpu_peer_reason(device)
    if reason:
        return peer.unavailable(reason)
    try:
        iface, versions = common.load_cudnn_score_recompute(a.site)
    except Exception as e:  # noqa: BLE001 (ImportError, a missing .so, another GPU: report and go on)
        return peer.unavailable(f"cannot load cudnn-frontend's score recompute: {common.short_error(e)}")
    peer.versions = versions

    def check():
        out = {"shape": {"batch": 1, "seq": a.check_seq, "heads": a.heads[0], "dim": a.dim, "topk": a.topk[0]},
               "cases": [], "ok": True, "tolerance": {"p_rel_rms": 1e-2, "loss_rel_err": 1e-3}}
        for kind in ("causal", "random"):
            inp = Inputs(1, a.check_seq, a.heads[0], a.dim, a.topk[0], kind, device, a.seed)
            op = CudnnOp(iface, inp)
            op.run_with_loss()
            torch.cuda.synchronize()
            rec = {"ids": kind, **check_against_reference(inp, op.loss.item(), None, op.p)}
            rec["p_finite"] = bool(torch.isfinite(op.p).all().item())
            rec["ok"] = rec["p_finite"] and rec["p_rel_rms"] < 1e-2 and rec["loss_rel_err"] < 1e-3
            out["ok"] = out["ok"] and rec["ok"]
            out["cases"].append(rec)
            print(f"check cudnn_frontend {kind:6s}: P rel RMS {rec['p_rel_rms']:.2e} (max rel {rec['p_max_rel_err']:.2e}"
                  f"), loss from P rel err {rec['loss_rel_err']:.2e}" + ("  ok" if rec["ok"] else "  FAIL"), flush=True)
        return out
    peer.make_op = lambda inp: CudnnOp(iface, inp)
    peer.check = check
    return peer


# --------------------------------------------------------------------------- TileLang (Megatron-Core)

class TileLangKLOp:
    def __init__(self, mod, inp):
        self.mod = mod
        B, S, K = inp.ids.shape
        self.z, self.valid = eager_logits_all(inp.q, inp.w, inp.k, inp.ids, inp.sm_scale, inp.rows)
        self.t = inp.t.reshape(B * S, K).contiguous()
        self.kl = self.grad = None
        self.restore = None
        self.extra = {}

    def run(self):
        self.kl, self.grad = self.mod.sparse_indexer_kl_interface(self.t, self.z, self.valid)

    def outputs(self):
        return (self.kl, self.grad)


def make_tilelang(a, device):
    notes = ["Megatron-Core's sparse_indexer_kl (ops/tilelang_indexer_loss.py, sparse_indexer_kl_interface): from "
             "precomputed fp32 logits z (rows, topk), the valid mask and T, the KL divergence KL(T/sum T || P) "
             "summed over rows, and the logits' gradient P - T/sum T (rows, topk) fp32",
             "does NOT compute the logits (key gather, GEMM, relu, head sum: most of our forward's work); they are "
             "made once, untimed, by the torch_eager code",
             "its loss is the KL divergence (ours: the cross-entropy -sum T log P, which differs by T's entropy); "
             "T is renormalised by its row sum, logs clipped at 1e-10, no exp(-100) clipping",
             "timed: sparse_indexer_kl_interface (the kernel and the sum of the per-row KL)",
             "first call JIT-compiles (keyed by topk, not S): see first_call_s"]
    peer = common.Peer("tilelang", notes, floor_bound=False,
                       floor_note="starts from the logits: the key gather and GEMM1, the floor's two terms, are "
                                  "outside its timed call")
    reason = common.gpu_peer_reason(device)
    if reason:
        return peer.unavailable(reason)
    try:
        mod, versions = common.load_megatron_tilelang(a.site, os.path.abspath(a.megatron_dir))
    except Exception as e:  # noqa: BLE001
        return peer.unavailable(common.short_error(e))
    peer.versions = versions

    def check():
        out = {"shape": {"batch": 1, "seq": a.check_seq, "heads": a.heads[0], "dim": a.dim, "topk": a.topk[0]},
               "cases": [], "ok": True, "tolerance": {"kl_rel_err": 1e-3, "grad_rel_rms": 1e-2}}
        for kind in ("causal", "random"):
            inp = Inputs(1, a.check_seq, a.heads[0], a.dim, a.topk[0], kind, device, a.seed)
            op = TileLangKLOp(mod, inp)
            op.run()
            torch.cuda.synchronize()
            # the reference of what it computes, from the same fp32 logits it was given
            kl_ref, grad_ref = common.reference_kl_divergence(op.t.double(), op.z.double(), op.valid)
            rec = {"ids": kind, "kl_rel_err": abs(op.kl.item() - kl_ref.sum().item()) / max(abs(kl_ref.sum().item()),
                                                                                              1e-300),
                   "grad_rel_rms": common.rel_err(op.grad, grad_ref),
                   "finite": bool(torch.isfinite(op.grad).all().item() and math.isfinite(op.kl.item()))}
            rec["ok"] = rec["finite"] and rec["kl_rel_err"] < 1e-3 and rec["grad_rel_rms"] < 1e-2
            out["ok"] = out["ok"] and rec["ok"]
            out["cases"].append(rec)
            print(f"check tilelang {kind:6s}: KL rel err {rec['kl_rel_err']:.2e}, logits' gradient rel RMS "
                  f"{rec['grad_rel_rms']:.2e}" + ("  ok" if rec["ok"] else "  FAIL"), flush=True)
        return out
    peer.make_op = lambda inp: TileLangKLOp(mod, inp)
    peer.check = check
    return peer


# --------------------------------------------------------------------------- main

def add_args(ap, seq="4096,16384,65536", heads="64", dim=128, topk="2048"):
    ap.add_argument("--peers", default=",".join(PEERS), help="comma list of " + ", ".join(PEERS))
    ap.add_argument("--seq", default=seq, help=f"comma list of S (S_q = S_kv), default {seq}")
    ap.add_argument("--ids", default="causal,random", help="comma list of " + ", ".join(common.ID_KINDS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=10, help="timed calls, median reported (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before them (default 2)")
    ap.add_argument("--eager-iters", type=int, default=3, help="timed calls of torch_eager (default 3)")
    ap.add_argument("--eager-warmup", type=int, default=1, help="untimed calls of torch_eager (default 1)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--check", action="store_true", help="check each peer on a small problem first")
    ap.add_argument("--check-only", action="store_true", help="run --check and stop")
    ap.add_argument("--check-seq", type=int, default=2560, help="S of the check's problem (default 2560)")
    ap.add_argument("--site", default=None, metavar="DIR", help="a folder of peer packages to put first on sys.path")
    ap.add_argument("--megatron-dir", default=common.DEFAULT_MEGATRON_DIR,
                    help="folder with Megatron-Core's tilelang_indexer_loss.py and tilelang_utils.py "
                         "(default .peers/megatron_tilelang)")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON (rewritten after every row)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (default), or cpu: torch_eager alone, perf_counter timing (smoke tests)")


def parse_common(ap, a, shape_keys):
    """seqs, kinds, peers of the parsed flags; ap.error() on bad values."""
    try:
        seqs = common.parse_list(a.seq, int)
        kinds = common.parse_list(a.ids, str)
        peers = common.parse_list(a.peers, str)
    except ValueError:
        ap.error("bad --seq")
    if not seqs or min(seqs) < 1 or any(k not in common.ID_KINDS for k in kinds) or not kinds:
        ap.error(f"bad --seq or --ids (ids: {', '.join(common.ID_KINDS)})")
    if not peers or any(p not in shape_keys for p in peers):
        ap.error(f"bad --peers: expected a comma list of {', '.join(shape_keys)}, got {a.peers!r}")
    if a.iters < 1 or a.warmup < 0 or a.eager_iters < 1 or a.eager_warmup < 0 or a.batch < 1 or a.check_seq < 1:
        ap.error("bad --iters/--warmup/--eager-iters/--eager-warmup/--batch/--check-seq")
    return seqs, kinds, peers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--heads", default="64", help="comma list of H (default 64)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", default="2048", help="comma list of topk (default 2048)")
    a = ap.parse_args(argv)
    seqs, kinds, names = parse_common(ap, a, PEERS)
    try:
        a.heads = common.parse_list(a.heads, int)
        a.topk = common.parse_list(a.topk, int)
    except ValueError:
        ap.error("bad --heads or --topk")
    if not a.heads or not a.topk or min(a.heads) < 1 or min(a.topk) < 1 or a.dim < 1:
        ap.error("bad --heads, --topk or --dim")

    info = {"problem": PROBLEM, "status": "ok", "iters": a.iters, "warmup": a.warmup,
            "eager_iters": a.eager_iters, "eager_warmup": a.eager_warmup, "loss_coeff": LOSS_COEFF,
            "sm_scale": "dim**-0.5",
            "timing": "CUDA events around the peer's call after a 3 ms GPU sleep; median of iters after warmup",
            "peers": {}, "results": []}
    makers = {"torch_eager": make_eager, "cudnn_frontend": make_cudnn, "tilelang": make_tilelang}
    cases = [{"ids": kind, "seq": S, "batch": a.batch, "heads": H, "dim": a.dim, "topk": K}
             for kind in kinds for S in seqs for H in a.heads for K in a.topk]

    def make_inputs_for(c):
        return Inputs(c["batch"], c["seq"], c["heads"], c["dim"], c["topk"], c["ids"], a.device, a.seed + c["seq"])
    return common.run_peers(a, info, names, lambda n: makers[n](a, a.device), cases, make_inputs_for, PROBLEM)


if __name__ == "__main__":
    sys.exit(main())
