#!/usr/bin/env python3
"""Peer benchmarks of the attention target T (attn_score), side by side on one problem.

The target of the loss, for MLA in its absorbed form: the main query has Hq heads of width
Dqk, the key is one shared latent row per token (width Dqk), the main attention saved
lse[t, h]. For row t and valid slot i with key id j:

    T_i = sum_h exp(softmax_scale * q[t,h,:] . kv[j,:] - lse[t,h]),   T <- T / sum_i T_i   (0 at invalid slots)

The problem: bf16 q (B, S, Hq, Dqk) and kv (B, S, Dqk) ~ N(0, 1), causal or random ids as
the other peers' (bench/peers/common.py), softmax_scale = Dqk**-0.5 (--softmax-scale), and
lse the natural-log LSE of the sparse attention over each row's valid selected keys (what a
sparse MLA forward over these ids saves), computed in fp32 from the bf16 inputs. With that
lse every peer below computes the same T. Shapes (--shapes HqxDqk): DeepSeek-V3.2's 128x576
and 64x192.

The peers, and exactly what each timed call computes (the JSON's "notes" repeat it):

- torch_eager: per block of rows, a gather of the selected latent rows, a bf16 bmm with q,
  fp32 scale and subtraction of lse, exp, the head sum, the mask and the L1 normalisation;
  blocks keep the (rows, Hq, topk) fp32 scores within about 2 GiB.
- cudnn_frontend: cudnn-frontend's SM90 sparse attention score recompute
  (cudnn.deepseek_sparse_attention.score_recompute, `sparse_attn_score_recompute`): the
  normalised T, (B, S, topk) fp32, from q, kv, lse and the ids. Timed: that call, its
  (B,S,H) -> (B,H,S) copy of lse included.
- tilelang: Megatron-Core's TileLang `sparse_indexer_target` (ops/tilelang_indexer_loss.py,
  `sparse_indexer_target_interface`): it takes no lse; per head it recomputes the softmax over
  the selected keys (a running max and sum, then a second pass) and sums it over the heads,
  unnormalised (each row sums to Hq). That equals sum_h exp(s - lse_h) because lse is the
  sparse attention's here. One sequence (B = 1). Timed: the call; `normalised` also times the
  L1 normalisation in torch.

Each peer is first checked on a small problem (--check; B1 S --check-seq, the timed shapes and
topk, so the compiled kernels are the timed ones) against the float64 closed form, then timed
with CUDA events around the call after a 3 ms GPU sleep, --warmup untimed calls, the median of
--iters (torch_eager: --eager-iters / --eager-warmup).

  python3 bench/peers/attention_target_peers.py [--peers torch_eager,cudnn_frontend,tilelang]
         [--shapes 128x576,64x192] [--seq 4096,16384,65536] [--ids causal,random] [--topk 2048]
         [--softmax-scale X] [--iters 10] [--warmup 2] [--eager-iters 3] [--eager-warmup 1]
         [--check] [--check-only] [--check-seq 2560] [--site DIR]
         [--megatron-dir .peers/megatron_tilelang] [--json FILE] [--device cuda|cpu]
Exit: 0 every available peer ran and passed its check, 1 a failed check or a case error,
2 bad arguments, 77 no peer can run here (the JSON says why for each).
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import torch  # noqa: E402
from loss_forward_peers import add_args, parse_common  # noqa: E402

PROBLEM = "attention_target"
PEERS = ("torch_eager", "cudnn_frontend", "tilelang")
TOLERANCE_REL_RMS = {"torch_eager": 2e-2, "cudnn_frontend": 1e-2, "tilelang": 1e-2}


def parse_shapes(text):
    """'128x576,64x192' -> [(128, 576), (64, 192)]; ValueError on anything else."""
    out = []
    for item in text.split(","):
        h, sep, d = item.strip().lower().partition("x")
        if not sep:
            raise ValueError(item)
        h, d = int(h), int(d)
        if h < 1 or d < 1:
            raise ValueError(item)
        out.append((h, d))
    if not out:
        raise ValueError(text)
    return out


# --------------------------------------------------------------------------- torch eager

def eager_target(q, kv, ids, lse, softmax_scale, rows, out):
    """The normalised T into out (B, S, topk) fp32, blocks of `rows` query rows."""
    B, S = ids.shape[0], ids.shape[1]
    for b in range(B):
        for r0 in range(0, S, rows):
            r1 = min(S, r0 + rows)
            valid, s = common.target_logits_chunk(q[b, r0:r1], kv[b], ids[b, r0:r1], softmax_scale)
            e = torch.exp(s - lse[b, r0:r1].unsqueeze(-1)).sum(dim=1)
            e = torch.where(valid, e, torch.zeros_like(e))
            out[b, r0:r1] = e / e.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return out


class Inputs:
    def __init__(self, B, S, Hq, Dqk, K, kind, device, seed, softmax_scale):
        self.softmax_scale = softmax_scale if softmax_scale else 1.0 / math.sqrt(Dqk)
        self.q, self.kv, self.ids, self.lse = common.make_target_problem(B, S, Hq, Dqk, K, kind, device, seed,
                                                                         self.softmax_scale)
        self.ids = self.ids.contiguous()
        self.valid_per_row = ((self.ids >= 0) & (self.ids < S)).sum().item() / (B * S)
        self.rows = common.rows_per_chunk(Hq, K, Dqk)


class EagerOp:
    def __init__(self, inp):
        self.inp = inp
        self.t = torch.empty(inp.ids.shape, dtype=torch.float32, device=inp.q.device)
        self.restore = None
        self.extra = {}

    def run(self):
        i = self.inp
        eager_target(i.q, i.kv, i.ids, i.lse, i.softmax_scale, i.rows, self.t)

    def outputs(self):
        return (self.t,)


class CudnnOp:
    def __init__(self, iface, inp):
        self.iface, self.inp = iface, inp
        self.t = torch.empty(inp.ids.shape, dtype=torch.float32, device=inp.q.device)
        self.restore = None
        self.extra = {}

    def run(self):
        i = self.inp
        self.iface.sparse_attn_score_recompute(i.q, i.kv, i.lse, i.ids, i.softmax_scale, self.t,
                                               topk_indices_global=False)

    def outputs(self):
        return (self.t,)


class TileLangOp:
    def __init__(self, mod, inp):
        B, S, Hq, Dqk = inp.q.shape
        if B != 1:
            raise ValueError(f"batch: TileLang's sparse_indexer_target takes one sequence, got batch {B}")
        self.mod, self.inp = mod, inp
        self.q = inp.q[0]
        self.kv = inp.kv[0]
        self.ids = inp.ids[0]
        self.raw = None
        self.t = None
        self.restore = None
        self.extra = {"normalised": self.run_normalised}

    def run(self):
        self.raw = self.mod.sparse_indexer_target_interface(self.q, self.kv, self.ids, self.inp.softmax_scale)

    def run_normalised(self):
        self.run()
        self.t = self.raw / self.raw.sum(dim=-1, keepdim=True).clamp_min(1e-30)

    def outputs(self):
        return (self.raw,)


NOTES = {
    "torch_eager": ["computes the normalised T, (B, S, topk) fp32",
                    "per block of rows: gather of the selected latent rows, bf16 bmm with q (fp32 accumulation, "
                    "bf16 result), fp32 scale and lse subtraction, exp, head sum, mask, L1 normalisation; blocks "
                    "keep the (rows, Hq, topk) scores within about 2 GiB",
                    "timed: the whole target, one call"],
    "cudnn_frontend": ["computes the normalised T, (B, S, topk) fp32, from q, kv, lse (natural log) and the ids",
                       "SM90 kernel of cudnn.deepseek_sparse_attention.score_recompute (sparse_attn_score_recompute, "
                       "the function its SparseAttnScoreRecompute class runs on SM90)",
                       "timed: that call, its (B,S,H)->(B,H,S) copy of lse included",
                       "first call JIT-compiles the CuTe-DSL kernel (keyed by Hq, Dqk, topk, not S): see first_call_s"],
    "tilelang": ["Megatron-Core's sparse_indexer_target (ops/tilelang_indexer_loss.py, "
                 "sparse_indexer_target_interface): sum over heads of each head's softmax over the selected keys, "
                 "unnormalised (rows sum to Hq), fp32 (S, topk)",
                 "takes no lse: recomputes each head's max and sum over the selected keys (two passes over the "
                 "keys); equal to sum_h exp(s - lse_h) when lse is the sparse attention's over the same ids, as here",
                 "one sequence (B = 1); block_h 32, block_i 64, 2 stages, 256 threads (its defaults)",
                 "timed (ns_per_row): the call; normalised_ns_per_row: also the L1 normalisation in torch",
                 "first call JIT-compiles (keyed by Hq, Dqk, topk, softmax_scale, not S): see first_call_s"],
}


def make_peer(name, a, device):
    peer = common.Peer(name, NOTES[name])
    mod = iface = None
    if name == "torch_eager":
        peer.iters, peer.warmup = a.eager_iters, a.eager_warmup
    else:
        reason = common.gpu_peer_reason(device)
        if reason:
            return peer.unavailable(reason)
        try:
            if name == "cudnn_frontend":
                iface, peer.versions = common.load_cudnn_score_recompute(a.site)
            else:
                mod, peer.versions = common.load_megatron_tilelang(a.site, os.path.abspath(a.megatron_dir))
        except Exception as e:  # noqa: BLE001 (ImportError, a missing .so or file, another GPU)
            return peer.unavailable(common.short_error(e))

    def make_op(inp):
        if name == "torch_eager":
            return EagerOp(inp)
        if name == "cudnn_frontend":
            return CudnnOp(iface, inp)
        return TileLangOp(mod, inp)

    def check():
        tol = TOLERANCE_REL_RMS[name]
        out = {"seq": a.check_seq, "topk": a.topk, "cases": [], "ok": True, "tolerance_rel_rms": tol}
        for hq, dqk in a.shapes:
            for kind in ("causal", "random"):
                inp = Inputs(1, a.check_seq, hq, dqk, a.topk, kind, device, a.seed, a.softmax_scale)
                op = make_op(inp)
                if name == "tilelang":
                    op.run_normalised()
                else:
                    op.run()
                if device != "cpu":
                    torch.cuda.synchronize()
                tu, t = common.reference_target(inp.q.double(), inp.kv.double(), inp.ids, inp.lse.double(),
                                                inp.softmax_scale)
                rec = {"heads": hq, "dim": dqk, "ids": kind, "t_rel_rms": common.rel_err(op.t, t),
                       "t_max_abs_err": common.max_abs_err(op.t, t), "finite": bool(torch.isfinite(op.t).all().item())}
                if name == "tilelang":
                    rec["unnormalised_rel_rms"] = common.rel_err(op.raw, tu)
                rec["ok"] = rec["finite"] and rec["t_rel_rms"] < tol
                out["ok"] = out["ok"] and rec["ok"]
                out["cases"].append(rec)
                print(f"check {name} Hq{hq} Dqk{dqk} {kind:6s}: T rel RMS {rec['t_rel_rms']:.2e}, max abs err "
                      f"{rec['t_max_abs_err']:.2e}" + ("  ok" if rec["ok"] else "  FAIL"), flush=True)
                del op, inp, tu, t
        return out

    peer.make_op, peer.check = make_op, check
    return peer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--shapes", default="128x576,64x192", help="comma list of HqxDqk (default 128x576,64x192)")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--softmax-scale", type=float, default=None, help="default Dqk**-0.5")
    a = ap.parse_args(argv)
    seqs, kinds, names = parse_common(ap, a, PEERS)
    try:
        a.shapes = parse_shapes(a.shapes)
    except ValueError:
        ap.error(f"bad --shapes: expected a comma list of HqxDqk (e.g. 128x576), got {a.shapes!r}")
    if a.topk < 1 or (a.softmax_scale is not None and not (a.softmax_scale > 0 and math.isfinite(a.softmax_scale))):
        ap.error("bad --topk or --softmax-scale")

    info = {"problem": PROBLEM, "status": "ok", "iters": a.iters, "warmup": a.warmup,
            "eager_iters": a.eager_iters, "eager_warmup": a.eager_warmup,
            "softmax_scale": a.softmax_scale if a.softmax_scale else "dim**-0.5",
            "lse": "natural log, the sparse attention's over each row's valid selected keys (fp32)",
            "timing": "CUDA events around the peer's call after a 3 ms GPU sleep; median of iters after warmup",
            "peers": {}, "results": []}
    cases = [{"ids": kind, "seq": S, "batch": a.batch, "heads": hq, "dim": dqk, "topk": a.topk}
             for hq, dqk in a.shapes for kind in kinds for S in seqs]

    def make_inputs_for(c):
        return Inputs(c["batch"], c["seq"], c["heads"], c["dim"], c["topk"], c["ids"], a.device,
                      a.seed + c["seq"], a.softmax_scale)
    return common.run_peers(a, info, names, lambda n: make_peer(n, a, a.device), cases, make_inputs_for, PROBLEM)


if __name__ == "__main__":
    sys.exit(main())
