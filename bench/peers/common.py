"""Shared pieces of the peer benchmarks in bench/peers/ (torch_eager.py,
cudnn_frontend_dsa.py, tilelang_indexer_bwd.py).

- Inputs: the problem of bench/bench_indexer_backward.cpp: bf16 q, k ~ N(0, 1),
  w ~ N(0, 1)/sqrt(H); ids distinct per row, causal (row t selects
  min(t+1, topk) of the keys 0..t, the rest of the row is -1) or random (topk
  of all S_kv keys), ascending, or for causal-shuffled / random-shuffled in the
  top-k's score order (unrelated to the id); fp32 attn_score T and index_score P uniform, normalised
  over each row's valid slots and 0 at -1 slots.
- The oracle: the closed form of docs/math.md in
  float64 (reference_grads), on any torch device.
- Timing: CUDA events around the timed call only; an untimed `prepare` (for
  example restoring an input the peer overwrites) runs before each call, then
  a short GPU sleep so that the host's launch overhead of the timed call is
  hidden behind it rather than counted as idle GPU time between the events.
- Reporting: a peer that cannot run writes {"peer", "status": "unavailable",
  "reason"} and exits 77 (like our own bench without a GPU).

Importable without torch: `torch` is then None and callers report unavailable.
The inputs (make_inputs), the float64 oracle (reference_softmax, reference_grads,
rel_err) and the JSON/list helpers come from torch_eager.py, which stays
self-contained; this module re-exports them.
"""

import argparse
import gc
import json
import math
import os
import site
import statistics
import sys
import time
import traceback

# torch_eager.py stays self-contained (bench/CMakeLists.txt copies it alone next to the
# built benches); its input generator is the one every peer uses.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The inputs and the float64 oracle live there too (one copy of each).
from torch_eager import (  # noqa: E402,F401  (torch is None without torch)
    EPS, ID_KINDS, add_problem_args, is_oom, make_inputs, parse_list, reference_grads, reference_softmax, rel_err, torch,
    write_json)

UNAVAILABLE = 77  # exit status of a peer that cannot run here (its JSON says why)


# --------------------------------------------------------------------------- environment

def add_site(path):
    """Put a folder of peer packages (for instance wheels installed with
    `pip install --target DIR`, for a machine without a package index) first on
    sys.path and process its .pth files (nvidia-cutlass-dsl adds its dsl_packages
    folder that way). Returns the folders added, [] when `path` is None or absent."""
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


def report_unavailable(peer, reason, json_path, **extra):
    rec = {"peer": peer, "status": "unavailable", "reason": reason, **extra}
    print(json.dumps({"peer": peer, "status": "unavailable", "reason": reason}), flush=True)
    write_json(json_path, rec)
    return UNAVAILABLE


# --------------------------------------------------------------------------- command line

SUSTAINED_MS_MAX = 600000.0


def sustained_ms_arg(text):
    """argparse type of --sustained-ms: a decimal number of ms in [0, 600000], as the
    C++ tools take it (no blanks, hex, underscores, inf or nan)."""
    v = None
    if text and text == text.strip() and not any(c in text for c in "_xXpP"):
        try:
            v = float(text)
        except ValueError:
            pass
    if v is None or not math.isfinite(v) or not 0.0 <= v <= SUSTAINED_MS_MAX:
        raise argparse.ArgumentTypeError(
            f"expected a number of milliseconds from 0 to {int(SUSTAINED_MS_MAX)}, got {text!r}")
    return v + 0.0  # -0 -> 0


def add_run_args(ap, sustained=False):
    """--check, --check-only, --site and --json (after a peer's own flags); with
    `sustained`, --sustained-ms too (only peers that run gpu_time_sustained)."""
    ap.add_argument("--check", action="store_true", help="check the gradients first (small problem)")
    ap.add_argument("--check-only", action="store_true", help="run --check and stop")
    ap.add_argument("--site", default=None, metavar="DIR",
                    help="a folder of peer packages to put first on sys.path (default: none, the installed "
                         "packages are used)")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON (rewritten after every case)")
    if sustained:
        ap.add_argument("--sustained-ms", type=sustained_ms_arg, default=0.0, metavar="MS",
                        help="after the timed calls, about MS ms of calls back to back (no sleep, no host "
                             "wait; prepare() between them): the steady state under the GPU's power "
                             "management, as dsa-indexer-bwd-bench --sustained-ms: 20 to 20000 calls "
                             "(0: not run)")


def parse_cases(ap, a):
    """(seqs, kinds) of the parsed flags; ap.error() on bad values."""
    try:
        seqs = parse_list(a.seq, int)
        kinds = parse_list(a.ids, str)
    except ValueError:
        ap.error("bad --seq")
    if any(k not in ID_KINDS for k in kinds) or not seqs or min(seqs) < 1:
        ap.error("bad --ids or --seq")
    if a.iters < 1 or a.warmup < 0 or a.batch < 1:
        ap.error("bad --iters/--warmup/--batch")
    return seqs, kinds


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


def gpu_time_sustained(op, sustained_ms, median_ms, prepare=None):
    """The sustained run of dsa-indexer-bwd-bench --sustained-ms (bench/core/op_bench.cpp,
    sustained_launches): max(20, ceil(sustained_ms / median_ms)) calls (at most 20000)
    back to back, CUDA events around each op() only, prepare() between them on the same
    stream, one host wait at the end. Returns (every call's time in ms, in order; the whole run's GPU seconds), for
    summarize_sustained."""
    if not (0.0 <= sustained_ms <= SUSTAINED_MS_MAX):
        raise ValueError(f"--sustained-ms: expected a number of milliseconds from 0 to 600000, got {sustained_ms}")
    if not (median_ms > 0.0) or not math.isfinite(median_ms):
        raise ValueError(f"the timed median must be a positive time to size the sustained run, got {median_ms} ms")
    n = min(20000, max(20, math.ceil(sustained_ms / median_ms)))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for e0, e1 in ev:
        if prepare is not None:
            prepare()
        e0.record()
        op()
        e1.record()
    ev[-1][1].synchronize()
    times = [e0.elapsed_time(e1) for e0, e1 in ev]
    return times, ev[0][0].elapsed_time(ev[-1][1]) * 1e-3


def summarize_sustained(times_ms, seconds, rows):
    """Keys of dsa-indexer-bwd-bench's JSON: the steady state is the second half's median."""
    half = len(times_ms) // 2
    return {"sustained_launches": len(times_ms), "sustained_seconds": seconds,
            "ns_per_row_sustained": statistics.median(times_ms[half:]) * 1e6 / rows,
            "ns_per_row_sustained_first_half": statistics.median(times_ms[:half]) * 1e6 / rows}


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


# --------------------------------------------------------------------------- the peers' main loops

def run_check_into(info, check, json_path):
    """A peer's --check: runs check() (its gradients at a small problem against the float64
    oracle, a dict with "ok") into info["check"], with the error instead when it raises, and
    its wall time; writes the JSON. Returns 0 when the check passed, else 1."""
    t0 = time.perf_counter()
    rc = 0
    try:
        info["check"] = check()
        if not info["check"]["ok"]:
            rc = 1
    except Exception as e:  # noqa: BLE001 (report the failure in the JSON and go on)
        info["check"] = {"ok": False, "error": short_error(e), "traceback": traceback.format_exc(limit=8)}
        print(f"check ERROR: {short_error(e)}", flush=True)
        rc = 1
    info["check"]["wall_s"] = time.perf_counter() - t0
    write_json(json_path, info)
    return rc


def time_cases(a, info, kinds, seqs, make_case, sustained_ms=0.0):
    """The timed loop every package peer runs: for each ids kind and S, make_case(kind, S)
    builds the problem (an object with valid_per_row, run(), restore() or None, and
    gradients(): the tensors that must come out finite); then the first call, `a.iters`
    CUDA-event timings after `a.warmup` (restore() before each, untimed), with sustained_ms > 0
    the sustained run, the finiteness check and the peak memory. One row per case goes into
    info["results"] (status "ok", or "oom" / "error" with the reason: the loop goes on), the
    JSON is rewritten after each, and info's status becomes "error" when no case ran.
    Returns 0 when every case ran, else 1."""
    rc = 0
    print(f"{'ids':15s} {'S':>6s} {'valid/r':>8s} {'median_ms':>10s} {'ns/row':>9s} {'first_call_s':>12s}",
          flush=True)
    for kind in kinds:
        for S in seqs:
            row = {"ids": kind, "seq": S, "batch": a.batch, "heads": a.heads, "dim": a.dim, "topk": a.topk}
            case = restore = None  # restore (a bound method) holds the case too: both go before the next
            try:
                case = make_case(kind, S)
                restore = getattr(case, "restore", None)
                torch.cuda.reset_peak_memory_stats()
                row["valid_slots_per_row"] = round(case.valid_per_row, 2)
                row["first_call_s"] = first_call(case.run, restore)
                times = gpu_time(case.run, a.iters, a.warmup, prepare=restore)
                row.update(summarize(times, a.batch * S))
                if sustained_ms > 0:
                    st, secs = gpu_time_sustained(case.run, sustained_ms, row["bwd_median_ms"], prepare=restore)
                    row.update(summarize_sustained(st, secs, a.batch * S))
                if not all(bool(torch.isfinite(x.float()).all().item()) for x in case.gradients()):
                    raise RuntimeError("non-finite gradient")
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                row["status"] = "ok"
                print(f"{kind:15s} {S:6d} {row['valid_slots_per_row']:8.1f} {row['bwd_median_ms']:10.3f} "
                      f"{row['ns_per_row']:9.1f} {row['first_call_s']:12.2f}   (min {row['bwd_min_ms']:.3f} "
                      f"max {row['bwd_max_ms']:.3f} ms)", flush=True)
                if sustained_ms > 0:
                    print(f"{'':15s} {'':6s}   sustained: {row['sustained_launches']} calls back to back over "
                          f"{row['sustained_seconds']:.2f} s: {row['ns_per_row_sustained']:.1f} ns/row in the "
                          f"second half, {row['ns_per_row_sustained_first_half']:.1f} in the first", flush=True)
            except Exception as e:  # noqa: BLE001 (OOM, unsupported shape, compile error: report and go on)
                row["status"] = "oom" if is_oom(e) else "error"
                row["reason"] = short_error(e)
                row["traceback"] = traceback.format_exc(limit=8)
                print(f"{kind:15s} {S:6d}  {row['status'].upper()}: {row['reason']}", flush=True)
                rc = 1
            del case, restore  # nothing may keep this case's GPU memory while the next one is built
            gc.collect()
            torch.cuda.empty_cache()
            info["results"].append(row)
            write_json(a.json, info)
    if info["results"] and all(r["status"] != "ok" for r in info["results"]):
        info["status"] = "error"
        info["reason"] = info["results"][0].get("reason")
    write_json(a.json, info)
    return rc
