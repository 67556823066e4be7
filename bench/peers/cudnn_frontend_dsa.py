#!/usr/bin/env python3
"""Peer benchmark: cudnn-frontend's DSA indexer backward (CuTe-DSL, SM90 path).

What runs: `cudnn.deepseek_sparse_attention.indexer_backward.indexer_backward_wrapper`
of nvidia-cudnn-frontend 1.32.0 (with nvidia-cutlass-dsl 4.8.1, cu13 flavour) on
an H200. On compute capability 9.0 it is three stages on one stream:
  1. `ScoreGradSm90`: the score gradient g - P*sum(g) with T clamped at exp(-100)
     and P < exp(-100) masked, written IN PLACE over attn_score;
  2. the warp-specialised GEMM kernel (one CTA per query row: recompute S = Q K^T,
     dW, A, dK = A^T Q scattered with cp.reduce.async.bulk into an fp32 buffer,
     dQ += A K), after a memset of that fp32 dK buffer;
  3. a torch cast of the fp32 dK into the bf16 d_index_k.
That is the whole op dsaib-bench --op backward times (dK zeroing, fused kernel,
bf16 cast), and the problem is the same: bf16 q/w/k, fp32 T and P, B1 H64 D128
topk 2048, S_q = S_kv, causal ids (row t < topk has t+1 valid ids, then -1) or
random ids (topk distinct keys per row), local ids, bf16 outputs.

Contract differences from dsaib (docs/math.md section 7), and how they are handled:
- attn_score is overwritten: it is restored from a pristine copy before every
  call, outside the timed region (CUDA events around the wrapper call only).
- The score stage ignores topk_indices: a P > 0 at a -1 slot would still enter
  sum(g). Our inputs have T = P = 0 at -1 slots, where cudnn's mask (P < eps)
  gives g = 0 and P*sum(g) = 0, so the result equals ours.
- topk % 128 == 0, H >= 64, D == 128, bf16 d_index_q and d_weights only (the
  SM90 default backend rounds dW to bf16 and rejects fp32 there).
- The first call JIT-compiles both CuTe-DSL kernels (keyed by H, D, topk,
  block_I, not by S): its wall time is reported as "first_call_s".

--check compares the three gradients on a small problem (B1 S2560 H64 D128
topk 2048, both id kinds, so the timed kernels are the ones checked) with the
float64 closed form of the math contract (bench/peers/common.py), computed on the
GPU; index_score is the float64 softmax of the true logits there, so the
reference and the peer see the same P.

  python3 bench/peers/cudnn_frontend_dsa.py [--seq 4096,16384,65536] [--ids causal,random]
         [--iters 10] [--warmup 2] [--check] [--json FILE] [--site DIR]
         [--dk-dtype bf16|fp32]
Exit: 0 ok, 1 a failed --check or a case error, 2 bad arguments, 77 unavailable
(cudnn-frontend or CUDA missing: the JSON says why).
"""

import argparse
import gc
import math
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import torch  # noqa: E402

PEER = "cudnn_frontend_dsa_sm90"
NOTES = [
    "whole op timed: memset of the fp32 dK accumulator + ScoreGradSm90 (in place over attn_score) "
    "+ IndexerBackwardSm90 GEMM kernel + fp32->bf16 dK cast, as cudnn's indexer_backward_wrapper runs them",
    "attn_score is overwritten by cudnn; restored from a pristine copy before each call, outside the CUDA events",
    "score stage ignores topk_indices; equal to dsaib here because T = P = 0 at -1 slots",
    "requires topk % 128 == 0, H >= 64, D == 128; d_index_q and d_weights bf16 only on SM90",
    "first call JIT-compiles the CuTe-DSL kernels (compile keyed by H, D, topk, not S): see first_call_s",
    "host overhead of the Python wrapper is hidden behind a GPU sleep before the start event",
]


def load_cudnn(site_dir):
    """Import the peer; returns (module, versions) or raises with the reason."""
    added = common.add_site(site_dir)
    import cudnn  # loads the pybind module and libcudnn (e.g. from the nvidia-cudnn-cu13 wheel)
    from cudnn.deepseek_sparse_attention.indexer_backward import api as ib_api
    versions = {"site_paths_added": added, "cudnn_module": cudnn.__file__}
    try:
        from importlib import metadata
        for name in ("nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
                     "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi", "cuda-bindings"):
            try:
                versions[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                versions[name] = None
    except Exception:  # noqa: BLE001 (versions are informational)
        pass
    return ib_api, versions


class Case:
    """One problem on the GPU with cudnn's preallocated outputs and workspace."""

    def __init__(self, ib, B, S, H, D, K, kind, seed, dk_dtype, pred=None, inputs=None):
        self.ib = ib
        if inputs is None:
            q, w, k, ids, t, p = common.make_problem(B, S, H, D, K, kind, "cuda", seed)
        else:
            q, w, k, ids, t, p = inputs
        if pred is not None:
            p = pred
        self.q, self.w, self.k, self.ids, self.p = q, w, k, ids.contiguous(), p.contiguous()
        self.t_pristine = t.contiguous()
        self.t = self.t_pristine.clone()  # cudnn overwrites it with the score gradient
        self.sm_scale = 1.0 / math.sqrt(D)
        self.dq = torch.empty_like(q)
        self.dw = torch.empty_like(w)
        self.dk = torch.empty(k.shape, dtype=dk_dtype, device=k.device)
        self.grad_loss = torch.ones(1, dtype=torch.float32, device=q.device)
        self.loss_coeff = 1.0
        ws_bytes = 0 if dk_dtype == torch.float32 else (B * S * D * 4 + 1023) // 1024 * 1024 + 1024
        self.workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=q.device) if ws_bytes else None
        self.valid_per_row = (self.ids >= 0).sum().item() / (B * S)

    def restore(self):
        self.t.copy_(self.t_pristine)

    def gradients(self):
        return (self.dq, self.dw, self.dk)

    def run(self):
        kwargs = {}
        if self.workspace is not None:
            kwargs["workspace"] = self.workspace
        self.ib.indexer_backward_wrapper(
            self.q, self.w, self.k, self.t, self.p, self.ids, self.grad_loss,
            sm_scale=self.sm_scale, loss_coeff=self.loss_coeff, block_I=128, topk_indices_global=False,
            d_index_q=self.dq, d_weights=self.dw, d_index_k=self.dk, **kwargs)


def run_check(ib, seed, dk_dtype, shape=(1, 2560, 64, 128, 2048), device="cuda"):
    """B1 S2560 H64 D128 topk2048 (the timed compile keys), causal and random ids, against the
    float64 closed form on the GPU. grad_loss 1.5 and loss_coeff 0.8 exercise cudnn's scale."""
    B, S, H, D, K = shape
    out = {"shape": {"batch": B, "seq": S, "heads": H, "dim": D, "topk": K}, "cases": [], "ok": True,
           "tolerance_rel_rms": 2e-2}
    for kind in ("causal", "random"):
        q, w, k, ids, t, _ = common.make_problem(B, S, H, D, K, kind, device, seed)
        q64, w64, k64 = (x.double() for x in (q, w, k))
        sm_scale = 1.0 / math.sqrt(D)
        p64 = common.reference_softmax(q64, w64, k64, ids, sm_scale)
        case = Case(ib, B, S, H, D, K, kind, seed, dk_dtype, pred=p64.float(), inputs=(q, w, k, ids, t, None))
        case.grad_loss.fill_(1.5)
        case.loss_coeff = 0.8
        case.run()
        if device != "cpu":
            torch.cuda.synchronize()
        c = 1.5 * 0.8 / (B * S)
        ref = common.reference_grads(q64, w64, k64, ids, t.double(), sm_scale, c)
        rec = {"ids": kind, "attn_score_overwritten": bool((case.t != case.t_pristine).any().item())}
        for name, got, want in zip(("dq", "dw", "dk"), (case.dq, case.dw, case.dk), ref):
            rec[f"{name}_rel_rms"] = common.rel_err(got, want)
            rec[f"{name}_max_abs_err"] = common.max_abs_err(got, want)
            rec[f"{name}_finite"] = bool(torch.isfinite(got.float()).all().item())
        ok = all(rec[f"{n}_finite"] and rec[f"{n}_rel_rms"] < out["tolerance_rel_rms"] for n in ("dq", "dw", "dk"))
        rec["ok"] = ok
        out["ok"] = out["ok"] and ok
        out["cases"].append(rec)
        print(f"check {kind:6s} (B{B} S{S} H{H} D{D} topk{K}): rel RMS vs float64 "
              + "  ".join(f"{n} {rec[f'{n}_rel_rms']:.2e}" for n in ("dq", "dw", "dk"))
              + f"  attn_score overwritten: {rec['attn_score_overwritten']}" + ("  ok" if ok else "  FAIL"),
              flush=True)
        del case, ref, q64, w64, k64, p64
        gc.collect()
        if device != "cpu":
            torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_problem_args(ap)
    ap.add_argument("--dk-dtype", default="bf16", choices=("bf16", "fp32"),
                    help="d_index_k dtype (bf16: fp32 workspace + cast, like our bench; fp32: no cast)")
    common.add_run_args(ap, sustained=True)
    a = ap.parse_args(argv)
    seqs, kinds = common.parse_cases(ap, a)

    reason = common.cuda_reason()
    if reason:
        return common.report_unavailable(PEER, reason, a.json)
    try:
        ib, versions = load_cudnn(a.site)
    except Exception as e:  # noqa: BLE001 (ImportError, a missing .so, a driver mismatch: report and stop)
        return common.report_unavailable(PEER, f"cannot import cudnn-frontend's indexer backward: "
                                               f"{common.short_error(e)}", a.json, site=a.site,
                                         traceback=traceback.format_exc(limit=6))
    if torch.cuda.get_device_capability(0) != (9, 0):
        return common.report_unavailable(PEER, f"the SM90 kernel needs compute capability 9.0, device is "
                                               f"{torch.cuda.get_device_capability(0)}", a.json)
    dk_dtype = torch.bfloat16 if a.dk_dtype == "bf16" else torch.float32
    info = {"peer": PEER, "status": "ok", "versions": versions, **common.device_info(),
            "timing": "CUDA events around indexer_backward_wrapper only (attn_score restored before, untimed); "
                      "median of iters; with sustained_ms > 0 then calls back to back for that long (the "
                      "restore copy between them, outside the events): median of the second half",
            "iters": a.iters, "warmup": a.warmup, "sustained_ms": a.sustained_ms, "dk_dtype": a.dk_dtype,
            "notes": NOTES, "results": []}
    print(f"{PEER}: cudnn-frontend {versions.get('nvidia-cudnn-frontend')}, cutlass-dsl "
          f"{versions.get('nvidia-cutlass-dsl-libs-base')} on {info['device']}", flush=True)
    rc = 0
    if a.check or a.check_only:
        rc = common.run_check_into(info, lambda: run_check(ib, a.seed, dk_dtype), a.json)
    if a.check_only:
        return rc
    def make_case(kind, S):
        return Case(ib, a.batch, S, a.heads, a.dim, a.topk, kind, a.seed + S, dk_dtype)
    return max(rc, common.time_cases(a, info, kinds, seqs, make_case, sustained_ms=a.sustained_ms))

if __name__ == "__main__":
    sys.exit(main())
