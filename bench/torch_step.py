#!/usr/bin/env python3
"""The training step of dsaib.torch's autograd loss against the loss and gradients in one call.

Times, side by side on one problem (the peer benches' inputs, bench/peers/common.py: bf16
index_q (B, S, H, D), weights (B, S, H), index_k (B, S, D), fp32 attn_score, causal or random
ids, sm_scale = D**-0.5), what a user's step of the indexer loss runs:

- autograd_forward:  loss = dsaib.torch.indexer_kl_loss(..., gradients="forward"); loss.backward()
                     (the default: the forward's one library call forms the gradients, the
                     backward scales them)
- autograd_backward: the same with gradients="backward" (the loss forward, then the P-free
                     backward)
- one_call:          dsaib.torch.indexer_kl_loss_and_grad(...) (no autograd)

Each timed call is the whole step (fresh leaves, forward and backward), with CUDA events after
a 3 ms GPU sleep, --warmup untimed calls and the median of --iters. Reported per case: ns per
query row of each form, each autograd form's ratio to the one call, and the peak memory of a
step. --check (also alone, with --check-only, on any device) first runs the three forms on a
small problem with deterministic=True (d_index_k's fixed-point reduction, so that runs can be
compared bitwise on a GPU): the gradients of autograd_forward must equal the one call's
(bitwise: the upstream gradient is 1), those of autograd_backward must lie within 1e-2 relative
RMS of them, every loss within 1e-5. --topk-logits gives every form the selected keys' logits
(topk_logits, as indexer_topk returns them; random values here, which take the same path), so
that each forward reads them instead of recomputing them.

  python3 bench/torch_step.py [--seq 16384,65536] [--ids causal,random] [--heads 64] [--dim 128]
         [--topk 2048] [--batch 1] [--iters 10] [--warmup 3] [--check] [--check-only]
         [--topk-logits] [--device cuda|cpu] [--json FILE]
Exit: 0 ok, 1 a failed check, 2 bad arguments, 77 no CUDA device for the timing (a JSON record
with "status": "unavailable" and the reason is written to --json).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import common  # noqa: E402
from common import torch  # noqa: E402

FORMS = ("autograd_forward", "autograd_backward", "one_call")


def step(form, q, w, k, ids, T, sm_scale, deterministic=False, logits=None):
    """One training step of the loss in `form` (given the top-k's `logits`, or
    recomputing them); returns (loss, d_index_q, d_weights, d_index_k)."""
    import dsaib.torch as dt

    if form == "one_call":
        return dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=sm_scale, deterministic=deterministic,
                                           topk_logits=logits)
    leaves = [x.detach().requires_grad_() for x in (q, w, k)]
    loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=sm_scale, deterministic=deterministic,
                              gradients="forward" if form == "autograd_forward" else "backward", topk_logits=logits)
    loss.backward()
    return (loss.detach(),) + tuple(x.grad for x in leaves)


def random_logits(ids, on):
    """Finite float32 logits shaped like ids (the --topk-logits forms), or None."""
    return torch.randn(ids.shape, device=ids.device, generator=None) if on else None


def check(device, heads, dim, topk, with_logits=False):
    """The three forms on a small problem: (ok, lines)."""
    q, w, k, ids, T, _ = common.make_problem(1, 256, heads, dim, min(topk, 64), "causal", device, seed=11)
    logits = random_logits(ids, with_logits)
    got = {f: step(f, q, w, k, ids, T, dim ** -0.5, deterministic=True, logits=logits) for f in FORMS}
    ref = got["one_call"]
    lines, ok = [], True
    for form in ("autograd_forward", "autograd_backward"):
        loss_err = abs(got[form][0].item() - ref[0].item()) / max(abs(ref[0].item()), 1e-30)
        rms = [common.rel_rms(a, b) for a, b in zip(got[form][1:], ref[1:])]
        exact = all(torch.equal(a, b) for a, b in zip(got[form][1:], ref[1:]))
        good = loss_err <= 1e-5 and (exact if form == "autograd_forward" else max(rms) <= 1e-2)
        ok &= good
        lines.append(f"check {form}: loss rel err {loss_err:.1e}, gradients rel RMS vs one_call "
                     f"{', '.join(f'{r:.1e}' for r in rms)}{' (bitwise equal)' if exact else ''}: "
                     f"{'ok' if good else 'FAILED'}")
    return ok, lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", default="16384,65536")
    ap.add_argument("--ids", default="causal,random")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--topk-logits", action="store_true",
                    help="give every form the selected keys' logits (topk_logits) instead of recomputing them")
    common.add_run_args(ap)
    a = ap.parse_args(argv)
    seqs, kinds = common.parse_cases(ap, a)
    info = {"bench": "torch_step", "forms": list(FORMS), "topk_logits": a.topk_logits, "results": [],
            "status": "ok"}
    reason = common.gpu_peer_reason(a.device) if a.device == "cuda" else None
    if reason is None and torch is None:
        reason = "torch is not importable"
    if reason is not None and not (a.check_only and torch is not None):
        return common.report_unavailable("torch_step", reason, a.json)
    if a.check or a.check_only:
        ok, lines = check(a.device, a.heads, a.dim, a.topk, a.topk_logits)
        print("\n".join(lines), flush=True)
        info["check"] = {"ok": ok, "lines": lines}
        if not ok or a.check_only:
            common.write_json(a.json, info)
            return 0 if ok else 1
    if a.device != "cuda":
        return common.report_unavailable("torch_step", "the timing needs --device cuda", a.json)
    info.update(common.device_info())
    print(f"{'ids':8s} {'S':>6s} " + " ".join(f"{f + ' ns/row':>24s}" for f in FORMS) + "   fwd/one  bwd/one",
          flush=True)
    for kind in kinds:
        for S in seqs:
            q, w, k, ids, T, _ = common.make_problem(a.batch, S, a.heads, a.dim, a.topk, kind, "cuda", seed=S)
            logits = random_logits(ids, a.topk_logits)
            row = {"ids": kind, "seq": S, "batch": a.batch, "heads": a.heads, "dim": a.dim, "topk": a.topk}
            for form in FORMS:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                times = common.gpu_time(lambda: step(form, q, w, k, ids, T, a.dim ** -0.5, logits=logits), a.iters,
                                        a.warmup)
                row[form] = common.summarize_op(times, a.batch * S)
                row[form]["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            ns = [row[f]["ns_per_row"] for f in FORMS]
            row["autograd_forward_over_one_call"] = ns[0] / ns[2]
            row["autograd_backward_over_one_call"] = ns[1] / ns[2]
            info["results"].append(row)
            print(f"{kind:8s} {S:6d} " + " ".join(f"{x:24.1f}" for x in ns) +
                  f"   {ns[0] / ns[2]:7.3f}  {ns[1] / ns[2]:7.3f}", flush=True)
            common.write_json(a.json, info)
            del q, w, k, ids, T
            torch.cuda.empty_cache()
    common.write_json(a.json, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
