"""Shared pieces of the peer benchmarks in bench/peers/ (torch_eager.py,
cudnn_frontend_dsa.py, tilelang_indexer_bwd.py).

- Inputs: the problem of bench/bench_indexer_backward.cpp: bf16 q, k ~ N(0, 1),
  w ~ N(0, 1)/sqrt(H); ids sorted and distinct per row, causal (row t selects
  min(t+1, topk) of the keys 0..t, the rest of the row is -1) or random (topk
  of all S_kv keys); fp32 attn_score T and index_score P uniform, normalised
  over each row's valid slots and 0 at -1 slots.
- The oracle: the closed form of shared/design/indexer-backward-math.md in
  float64 (reference_grads), on any torch device.
- Timing: CUDA events around the timed call only; an untimed `prepare` (for
  example restoring an input the peer overwrites) runs before each call, then
  a short GPU sleep so that the host's launch overhead of the timed call is
  hidden behind it rather than counted as idle GPU time between the events.
- Reporting: a peer that cannot run writes {"peer", "status": "unavailable",
  "reason"} and exits 77 (like our own bench without a GPU).

Importable without torch: `torch` is then None and callers report unavailable.
The inputs come from torch_eager.py (make_ids, make_inputs), which stays self-contained.
"""

import json
import math
import os
import site
import statistics
import sys
import time

# torch_eager.py stays self-contained (bench/CMakeLists.txt copies it alone next to the
# built benches); its input generator is the one every peer uses.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_eager import make_inputs, torch  # noqa: E402  (torch is None without torch)

EPS = math.exp(-100.0)  # an fp32 subnormal; CUDA torch does not flush it
UNAVAILABLE = 77  # exit status of a peer that cannot run here (its JSON says why)
DEFAULT_SITE = os.environ.get("DSAIB_PEERS_SITE", "/tmp/peers-site")


# --------------------------------------------------------------------------- environment

def add_site(path):
    """Put an unpacked peer payload (scripts/device/pack_peers.sh) first on sys.path and
    process its .pth files (nvidia-cutlass-dsl adds its dsl_packages folder that way).
    Returns the folders added, [] when `path` does not exist."""
    if not path or not os.path.isdir(path):
        return []
    before = list(sys.path)
    if path not in sys.path:
        sys.path.insert(0, path)
    site.addsitedir(path)
    return [p for p in sys.path if p not in before]


def cuda_reason():
    """None when torch sees a CUDA device, else why not."""
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    return None


def device_info():
    if torch is None or not torch.cuda.is_available():
        return {"device": None}
    p = torch.cuda.get_device_properties(0)
    return {"device": p.name, "sm": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
            "torch": torch.__version__, "torch_cuda": torch.version.cuda}


def short_error(e, limit=400):
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:limit]}"


def is_oom(e):
    if torch is None:
        return False
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    return isinstance(e, oom_types) or "out of memory" in str(e).lower()


def parse_list(s, conv):
    return [conv(x) for x in s.split(",") if x.strip()]


def write_json(path, obj):
    """Atomic rewrite (peers rewrite their file after every case, so a run that a
    timeout kills still leaves the cases it finished)."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def report_unavailable(peer, reason, json_path, **extra):
    rec = {"peer": peer, "status": "unavailable", "reason": reason, **extra}
    print(json.dumps({"peer": peer, "status": "unavailable", "reason": reason}), flush=True)
    write_json(json_path, rec)
    return UNAVAILABLE


# --------------------------------------------------------------------------- inputs

def make_problem(B, S, H, D, K, kind, device, seed):
    """make_inputs plus an index_score P drawn like T (uniform, normalised over the valid
    slots, 0 at -1 slots), as our C++ bench does: q, w, k, ids, T, P."""
    q, w, k, ids, target = make_inputs(B, S, H, D, K, kind, device, seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 7)
    pred = torch.rand((B, S, K), generator=gen, device=device) * (ids >= 0)
    pred = pred / pred.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return q, w, k, ids, target, pred


# --------------------------------------------------------------------------- the oracle

def _logits64(q, w, k, ids, sm_scale):
    B = q.shape[0]
    s_kv = k.shape[1]
    valid = (ids >= 0) & (ids < s_kv)
    idx = torch.where(valid, ids, torch.zeros_like(ids)).long()
    bidx = torch.arange(B, device=idx.device).view(B, 1, 1).expand_as(idx)
    k_sel = k[bidx, idx]
    x = torch.einsum("bshd,bskd->bshk", q, k_sel)
    z = sm_scale * (torch.relu(x) * w.unsqueeze(-1)).sum(dim=2)
    return valid, idx, bidx, k_sel, x, z


def reference_softmax(q, w, k, ids, sm_scale):
    """P = softmax of the true logits over each row's valid slots (0 elsewhere); inputs
    float64 (any device)."""
    valid, _, _, _, _, z = _logits64(q, w, k, ids, sm_scale)
    z = z.masked_fill(~valid, -math.inf)
    zmax = z.max(dim=-1, keepdim=True).values
    zmax = torch.where(torch.isfinite(zmax), zmax, torch.zeros_like(zmax))
    e = torch.exp(z - zmax)
    return e / e.sum(dim=-1, keepdim=True).clamp_min(1e-300)


def reference_grads(q, w, k, ids, target, sm_scale, c):
    """Closed form of indexer-backward-math.md, float64 (inputs already float64, any device).
    P is recomputed as the softmax of the true logits over the valid slots."""
    B, S, H, D = q.shape
    valid, idx, bidx, k_sel, x, _ = _logits64(q, w, k, ids, sm_scale)
    p = reference_softmax(q, w, k, ids, sm_scale)
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


def rel_err(got, want):
    """Relative RMS error ||got - want|| / ||want|| in float64."""
    got = got.detach().to(want.device, torch.float64)
    want = want.detach().to(torch.float64)
    den = want.norm().item()
    return (got - want).norm().item() / (den if den > 0 else 1.0)


def max_abs_err(got, want):
    return (got.detach().to(want.device, torch.float64) - want.detach().to(torch.float64)).abs().max().item()


# --------------------------------------------------------------------------- timing

def gpu_time(op, iters, warmup, prepare=None, sleep_ms=3.0):
    """Median-ready list of `iters` CUDA-event times (ms) of op() after `warmup` untimed
    calls. prepare() runs before each call outside the events; then the GPU sleeps
    ~sleep_ms so that op()'s host-side work is queued behind the sleep."""
    sleep = getattr(torch.cuda, "_sleep", None)
    cycles = int(sleep_ms * 2.0e6)  # ~2 GHz SM clock
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for it in range(warmup + iters):
        if prepare is not None:
            prepare()
        if sleep is not None and sleep_ms > 0:
            sleep(cycles)
        e0.record()
        op()
        e1.record()
        e1.synchronize()
        if it >= warmup:
            times.append(e0.elapsed_time(e1))
    return times


def first_call(op, prepare=None):
    """Wall seconds of the first (compiling) call, synchronised."""
    if prepare is not None:
        prepare()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    op()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def summarize(times_ms, rows):
    med = statistics.median(times_ms)
    return {"bwd_median_ms": med, "bwd_min_ms": min(times_ms), "bwd_max_ms": max(times_ms),
            "ns_per_row": med * 1e6 / rows, "samples": len(times_ms)}
