#!/usr/bin/env python3
"""Peer benchmark: PyTorch eager autograd of the DSA lightning-indexer loss.

The loss is the one of docs/math.md:

    z[t,i] = sm_scale * sum_h w[t,h] * relu(q[t,h,:] . k[id_i,:])      (valid slots i)
    P      = softmax(z over the valid slots of row t)
    Loss   = -c * sum_rows sum_valid i  max(T_i, eps) * log(max(P_i, eps)),
    c      = grad_loss * loss_coeff / (B * S_q),  eps = exp(-100)

written the way users write it (gather + einsum + relu/weights + softmax +
log), in bf16 inputs with autograd to q, w and k. Only the backward
(loss.backward()) is timed, with torch.cuda.Event: warm-up, then the median of
--iters runs; the forward is re-run (untimed for the headline) before each.
Reported: ns per query row of the backward, the forward's time, and the peak
memory of forward + backward (torch.cuda.max_memory_allocated).

--check first compares the peer's gradients (same code, bf16, on the timing
device) on a tiny problem against a float64 CPU computation of the same loss:
the closed-form gradient of the math contract (stage 1 + stage 2), and float64
autograd of this very loss function as a second opinion.

Needs only torch (measured with torch 2.11).

  python3 bench/peers/torch_eager.py [--seq 4096,16384] [--ids causal,random] [--iters 10]
         [--warmup 3] [--heads 64] [--dim 128] [--topk 2048] [--batch 1] [--check]
         [--json FILE] [--device cuda|cpu]
Exit: 0 ok, 1 a failed --check, 2 bad arguments, 77 no torch or no CUDA device (with --device cuda;
a JSON record {"peer", "status": "unavailable", "reason"} is printed and written to --json).
Invalid (-1) slots gather distinct key rows (slot index mod S_kv) rather than row 0: the gradient
is the same, and the backward's index-add no longer serialises on one row (see indexer_loss).
"""

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

try:
    import torch
except ImportError:  # reported by main(): a peer that cannot run says why
    torch = None

EPS = math.exp(-100.0)  # an fp32 subnormal; CUDA torch does not flush it
NEG = -1.0e30  # logit of an invalid slot (finite, so a row without valid slots stays NaN-free)


# --------------------------------------------------------------------------- the peer

def indexer_loss(q, w, k, ids, target, sm_scale, c):
    """-c * sum T~ log(max(P, eps)) over valid slots; q (B,S,H,D), w (B,S,H), k (B,Skv,D),
    ids (B,S,K) int (-1 / out of range = invalid), target (B,S,K)."""
    B = q.shape[0]
    s_kv = k.shape[1]
    valid = (ids >= 0) & (ids < s_kv)
    # Invalid slots gather distinct rows (slot index mod S_kv), not all row 0: their
    # gradient is 0 either way, but the backward's index-add of thousands of padded
    # slots onto one row serialises (measured: 515,635 ns/row at S 4096, causal).
    spread = (torch.arange(ids.shape[-1], device=ids.device) % s_kv).to(ids.dtype).expand_as(ids)
    idx = torch.where(valid, ids, spread).long()
    bidx = torch.arange(B, device=q.device).view(B, 1, 1)
    k_sel = k[bidx, idx]  # (B,S,K,D): gather of the selected keys
    x = torch.einsum("bshd,bskd->bshk", q, k_sel)  # (B,S,H,K)
    z = (torch.relu(x) * w.unsqueeze(-1)).sum(dim=2)  # (B,S,K), in the inputs' dtype
    z = (z if z.dtype == torch.float64 else z.float()) * sm_scale
    z = z.masked_fill(~valid, NEG)
    p = torch.softmax(z, dim=-1)
    t = torch.where(valid, target.to(z.dtype).clamp_min(EPS), torch.zeros((), dtype=z.dtype, device=z.device))
    return -c * (t * torch.log(p.clamp_min(EPS))).sum()


# --------------------------------------------------------------------------- the oracle

def _reference_logits(q, w, k, ids, sm_scale):
    """Valid mask, gather indices, selected keys, x = q.k and z (float64 inputs, any device)."""
    B = q.shape[0]
    s_kv = k.shape[1]
    valid = (ids >= 0) & (ids < s_kv)
    idx = torch.where(valid, ids, torch.zeros_like(ids)).long()
    bidx = torch.arange(B, device=idx.device).view(B, 1, 1).expand_as(idx)
    k_sel = k[bidx, idx]
    x = torch.einsum("bshd,bskd->bshk", q, k_sel)
    z = sm_scale * (torch.relu(x) * w.unsqueeze(-1)).sum(dim=2)
    return valid, idx, bidx, k_sel, x, z


def _softmax_valid(z, valid):
    z = z.masked_fill(~valid, -math.inf)
    zmax = z.max(dim=-1, keepdim=True).values
    zmax = torch.where(torch.isfinite(zmax), zmax, torch.zeros_like(zmax))
    e = torch.exp(z - zmax)
    return e / e.sum(dim=-1, keepdim=True).clamp_min(1e-300)


def reference_softmax(q, w, k, ids, sm_scale):
    """P = softmax of the true logits over each row's valid slots (0 elsewhere); inputs
    float64 (any device)."""
    valid, _, _, _, _, z = _reference_logits(q, w, k, ids, sm_scale)
    return _softmax_valid(z, valid)


def reference_grads(q, w, k, ids, target, sm_scale, c):
    """Closed form of docs/math.md, float64 (inputs already float64, any device).
    P is the softmax of the true logits over the valid slots."""
    D = q.shape[3]
    valid, idx, bidx, k_sel, x, z = _reference_logits(q, w, k, ids, sm_scale)
    p = _softmax_valid(z, valid)
    tt = target.clamp_min(EPS)
    m = p >= EPS
    g = torch.where(valid & m, -c * tt, torch.zeros_like(tt))
    G = g.sum(dim=-1, keepdim=True)
    gs = torch.where(valid, g - p * G, torch.zeros_like(g))  # dLoss/dz
    dw = sm_scale * torch.einsum("bsk,bshk->bsh", gs, torch.relu(x))
    a = gs.unsqueeze(2) * w.unsqueeze(-1) * sm_scale * (x > 0).to(x.dtype)  # (B,S,H,K)
    dq = torch.einsum("bshk,bskd->bshd", a, k_sel)
    dk_sel = torch.einsum("bshk,bshd->bskd", a, q) * valid.unsqueeze(-1).to(q.dtype)
    dk = torch.zeros_like(k).index_put_((bidx.reshape(-1), idx.reshape(-1)), dk_sel.reshape(-1, D), accumulate=True)
    return dq, dw, dk


# --------------------------------------------------------------------------- inputs

# The id patterns (--ids), as named by our bench (bench/core/bench_core.hpp).
ID_KINDS = ("causal", "random", "causal-shuffled", "random-shuffled")


def make_ids(B, S, s_kv, K, kind, gen, device):
    """Distinct key ids per row, -1 padded. causal: keys 0..t (row t < K keeps t+1);
    random: K of all s_kv keys. Ascending within the row, or for causal-shuffled /
    random-shuffled in the order the top-k returns them (by its random score, which is
    unrelated to the id)."""
    ids = torch.full((B, S, K), -1, dtype=torch.int32, device=device)
    kk = min(K, s_kv)
    chunk = max(1, (1 << 26) // s_kv)
    cols = torch.arange(s_kv, device=device).view(1, s_kv)
    for b in range(B):
        for t0 in range(0, S, chunk):
            t1 = min(S, t0 + chunk)
            r = torch.rand((t1 - t0, s_kv), generator=gen, device=device)
            if kind.startswith("causal"):
                rows = torch.arange(t0, t1, device=device).view(-1, 1)
                r = r.masked_fill(cols > rows, -1.0)
            val, idx = r.topk(kk, dim=-1)
            idx = torch.where(val < 0, torch.full_like(idx, s_kv), idx)
            if not kind.endswith("-shuffled"):
                idx = idx.sort(dim=-1).values
            idx = torch.where(idx == s_kv, torch.full_like(idx, -1), idx)
            ids[b, t0:t1, :kk] = idx.to(torch.int32)
    return ids


def make_inputs(B, S, H, D, K, kind, device, seed):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q = torch.randn((B, S, H, D), generator=gen, device=device).to(torch.bfloat16)
    k = torch.randn((B, S, D), generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn((B, S, H), generator=gen, device=device) / math.sqrt(H)).to(torch.bfloat16)
    ids = make_ids(B, S, S, K, kind, gen, device)
    valid = ids >= 0
    target = torch.rand((B, S, K), generator=gen, device=device) * valid
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return q, w, k, ids, target


# --------------------------------------------------------------------------- --check

def rel_err(got, want):
    """Relative RMS error ||got - want|| / ||want|| in float64, on want's device."""
    got = got.detach().to(want.device, torch.float64)
    want = want.detach().to(torch.float64)
    den = want.norm().item()
    return (got - want).norm().item() / (den if den > 0 else 1.0)


def run_check(device, seed):
    """Tiny problems (causal with -1 padding, random with a duplicate and an out-of-range id)."""
    B, S, H, D, K = 2, 48, 8, 32, 20
    sm_scale, grad_loss, loss_coeff = 0.37, 1.5, 0.8
    c = grad_loss * loss_coeff / (B * S)
    out = {"shape": {"batch": B, "seq": S, "heads": H, "dim": D, "topk": K}, "cases": [], "ok": True}
    for kind in ("causal", "random"):
        q, w, k, ids, target = make_inputs(B, S, H, D, K, kind, device, seed)
        if kind == "random":
            ids = ids.clone()
            ids[:, ::5, 1] = ids[:, ::5, 0]  # duplicate id: adds twice
            ids[:, 3::7, 2] = S + 3  # out of range: invalid slot
            valid = (ids >= 0) & (ids < S)
            target = torch.where(valid, target, torch.zeros_like(target))
            target = target / target.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        # the peer, as timed: bf16 on the device
        leaves = [t.clone().requires_grad_(True) for t in (q, w, k)]
        indexer_loss(leaves[0], leaves[1], leaves[2], ids, target, sm_scale, c).backward()
        peer = [t.grad for t in leaves]
        # float64 CPU: the closed form, and autograd of the same loss
        q64, w64, k64 = (t.detach().to("cpu", torch.float64) for t in (q, w, k))
        ids_c, tgt64 = ids.cpu(), target.to("cpu", torch.float64)
        ref = reference_grads(q64, w64, k64, ids_c, tgt64, sm_scale, c)
        leaves64 = [t.clone().requires_grad_(True) for t in (q64, w64, k64)]
        indexer_loss(leaves64[0], leaves64[1], leaves64[2], ids_c, tgt64, sm_scale, c).backward()
        auto64 = [t.grad for t in leaves64]
        case = {"ids": kind}
        for name, p, a, r in zip(("dq", "dw", "dk"), peer, auto64, ref):
            case[f"{name}_rel_err_peer_bf16"] = rel_err(p, r)
            case[f"{name}_rel_err_autograd_f64"] = rel_err(a, r)
        ok = all(case[f"{n}_rel_err_autograd_f64"] < 1e-10 for n in ("dq", "dw", "dk")) and all(
            case[f"{n}_rel_err_peer_bf16"] < 5e-2 for n in ("dq", "dw", "dk"))
        case["ok"] = ok
        out["ok"] = out["ok"] and ok
        out["cases"].append(case)
        print(f"check {kind:6s} (B{B} S{S} H{H} D{D} topk{K}, {device}): rel err vs float64 closed form  "
              + "  ".join(f"{n}: peer {case[f'{n}_rel_err_peer_bf16']:.2e} / f64 autograd "
                          f"{case[f'{n}_rel_err_autograd_f64']:.1e}" for n in ("dq", "dw", "dk"))
              + ("  ok" if ok else "  FAIL"), flush=True)
    return out


# --------------------------------------------------------------------------- timing

def time_case(B, S, H, D, K, kind, iters, warmup, device, seed):
    cuda = device.type == "cuda"
    q, w, k, ids, target = make_inputs(B, S, H, D, K, kind, device, seed)
    valid_per_row = ((ids >= 0) & (ids < S)).sum().item() / (B * S)
    sm_scale = 1.0 / math.sqrt(D)
    c = 1.0 * 1.0 / (B * S)  # grad_loss * loss_coeff / N
    leaves = [t.requires_grad_(True) for t in (q, w, k)]
    fwd_ms, bwd_ms = [], []
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    for it in range(warmup + iters):
        for t in leaves:
            t.grad = None
        if cuda:
            ev[0].record()
            loss = indexer_loss(*leaves, ids, target, sm_scale, c)
            ev[1].record()
            loss.backward()
            ev[2].record()
            ev[2].synchronize()
            f, b = ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])
        else:
            t0 = time.perf_counter()
            loss = indexer_loss(*leaves, ids, target, sm_scale, c)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            f, b = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        del loss
        if it >= warmup:
            fwd_ms.append(f)
            bwd_ms.append(b)
    for t in leaves:
        if not torch.isfinite(t.grad.float()).all():
            raise RuntimeError("non-finite gradient")
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    med = statistics.median(bwd_ms)
    return {
        "valid_slots_per_row": round(valid_per_row, 2),
        "bwd_median_ms": med,
        "bwd_min_ms": min(bwd_ms),
        "bwd_max_ms": max(bwd_ms),
        "fwd_median_ms": statistics.median(fwd_ms),
        "ns_per_row": med * 1e6 / (B * S),
        "peak_mem_bytes": peak,
        "peak_mem_gib": None if peak is None else peak / 2**30,
    }


def is_oom(e):
    if torch is None:
        return False
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    return isinstance(e, oom_types) or "out of memory" in str(e).lower()


def write_json(path, obj):
    """Atomic rewrite; called after every case, so a run cut short keeps what it measured."""
    if not path:
        return
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)


def unavailable(reason, json_path, **extra):
    """A peer that cannot run says why: one JSON line on stdout, the same record in --json; exit 77."""
    rec = {"peer": "torch_eager_autograd", "status": "unavailable", "reason": reason, **extra}
    print(json.dumps(rec), flush=True)
    write_json(json_path, rec)
    return 77


def parse_list(s, conv):
    return [conv(x) for x in s.split(",") if x.strip()]


def add_problem_args(ap, seq="4096,16384,65536", warmup=2):
    """The problem and timing flags of every peer (same names as our bench); common.py re-exports it."""
    ap.add_argument("--seq", default=seq, help=f"comma list of S (S_q = S_kv), default {seq}")
    ap.add_argument("--ids", default="causal,random", help="comma list of " + ", ".join(ID_KINDS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10, help="timed calls, median reported (default 10)")
    ap.add_argument("--warmup", type=int, default=warmup,
                    help=f"untimed warm-up calls before the timed ones (default {warmup})")
    ap.add_argument("--seed", type=int, default=1234)


def main(argv=None):
    ap = argparse.ArgumentParser(description="PyTorch eager autograd peer of the DSA indexer backward "
                                             "(times loss.backward() only).")
    add_problem_args(ap, seq="4096", warmup=3)
    ap.add_argument("--check", action="store_true", help="check the gradients on a tiny size first")
    ap.add_argument("--check-only", action="store_true", help="run --check and stop")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (default; exit 77 without one) or cpu (smoke tests only)")
    a = ap.parse_args(argv)
    if torch is None:
        print("torch is not installed: the PyTorch eager peer cannot run", file=sys.stderr)
        return unavailable("torch is not installed", a.json)
    try:
        seqs = parse_list(a.seq, int)
        kinds = parse_list(a.ids, str)
    except ValueError:
        ap.error("bad --seq")
    if any(k not in ID_KINDS for k in kinds) or not seqs or min(seqs) < 1:
        ap.error("bad --ids or --seq")
    if a.iters < 1 or a.warmup < 0 or a.topk < 1 or a.heads < 1 or a.dim < 1 or a.batch < 1:
        ap.error("bad sizes")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch: nothing to time", file=sys.stderr)
        return unavailable("no CUDA device visible to torch", a.json, torch=torch.__version__)
    device = torch.device(a.device)
    info = {
        "peer": "torch_eager_autograd",
        "status": "ok",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "timing": "loss.backward() only, torch.cuda.Event, median" if device.type == "cuda" else "perf_counter (cpu)",
        "iters": a.iters,
        "warmup": a.warmup,
    }
    print(f"torch {torch.__version__} (cuda {torch.version.cuda}) on {info['device']}", flush=True)
    rc = 0
    if a.check or a.check_only:
        info["check"] = run_check(device, a.seed)
        if not info["check"]["ok"]:
            rc = 1
    results = []
    if not a.check_only:
        print(f"{'ids':15s} {'S':>6s} {'H':>4s} {'D':>4s} {'topk':>5s} {'valid/r':>8s} {'bwd_ms':>9s} "
              f"{'ns/row':>9s} {'fwd_ms':>8s} {'peak GiB':>9s}", flush=True)
        for kind in kinds:
            for S in seqs:
                row = {"ids": kind, "seq": S, "batch": a.batch, "heads": a.heads, "dim": a.dim, "topk": a.topk}
                err = None
                try:
                    row.update(time_case(a.batch, S, a.heads, a.dim, a.topk, kind, a.iters, a.warmup, device,
                                         a.seed + S))
                    row["status"] = "ok"
                except Exception as e:  # noqa: BLE001 (OOM and friends: report and go on)
                    err = ("oom" if is_oom(e) else "error", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
                if err is not None:
                    row["status"], row["reason"] = err
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    print(f"{kind:15s} {S:6d} {a.heads:4d} {a.dim:4d} {a.topk:5d}  {row['status'].upper()}: "
                          f"{row['reason']}", flush=True)
                else:
                    peak = "-" if row["peak_mem_gib"] is None else f"{row['peak_mem_gib']:.2f}"
                    print(f"{kind:15s} {S:6d} {a.heads:4d} {a.dim:4d} {a.topk:5d} {row['valid_slots_per_row']:8.1f} "
                          f"{row['bwd_median_ms']:9.3f} {row['ns_per_row']:9.1f} {row['fwd_median_ms']:8.3f} "
                          f"{peak:>9s}   (bwd min {row['bwd_min_ms']:.3f} max {row['bwd_max_ms']:.3f} ms)",
                          flush=True)
                results.append(row)
                info["results"] = results
                write_json(a.json, info)
    info["results"] = results
    if results and all(r["status"] != "ok" for r in results):
        info["status"] = "error"  # as cudnn_frontend_dsa.py: no case ran
    write_json(a.json, info)
    return rc


if __name__ == "__main__":
    sys.exit(main())
