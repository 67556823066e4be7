"""Shared pieces of the peer benchmarks in bench/peers/ (torch_eager.py,
cudnn_frontend_dsa.py, tilelang_indexer_bwd.py for the backward; loss_forward_peers.py
and attention_target_peers.py for the loss forward and the attention target).

- Inputs: the problem of the bench's cases (bench/core/op_bench.cpp): bf16 q, k ~ N(0, 1),
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
    EPS, ID_KINDS, _reference_logits, add_problem_args, is_oom, make_ids, make_inputs, parse_list, reference_grads,
    reference_softmax, rel_err, torch, write_json)

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


def gpu_peer_reason(device):
    """None when a GPU peer can run on `device`, else why not (CPU runs, or no CUDA device)."""
    return "needs a CUDA device (--device cpu)" if device == "cpu" else cuda_reason()


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
                             "management, as dsaib-bench --sustained-ms: 20 to 20000 calls "
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
    """The sustained run of dsaib-bench --sustained-ms (bench/core/op_bench.cpp time_op,
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
    """The sustained run's keys: the steady state is the second half's median (dsaib-bench's
    report: a case's "sustained" object, "ns_per_row" there)."""
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


# --------------------------------------------------------------------------- the loss forward and the attention target

def reference_kl_forward(q, w, k, ids, target, sm_scale, loss_coeff=1.0):
    """The loss forward of docs/kl-forward.md in float64 (inputs already float64, any device):
    (loss, LSE per row (B, S), P (B, S, topk)). loss = -(loss_coeff / (B*S_q)) * sum over rows
    and valid slots of max(T, eps) * log(max(P, eps)); a row without a valid slot has LSE -inf."""
    valid, _, _, _, _, z = _reference_logits(q, w, k, ids, sm_scale)
    zm = z.masked_fill(~valid, -math.inf)
    lse = torch.logsumexp(zm, dim=-1)
    p = torch.where(valid, torch.exp(zm - lse.unsqueeze(-1)), torch.zeros_like(zm))
    logp = torch.where(valid, (zm - lse.unsqueeze(-1)).clamp_min(-100.0), torch.zeros_like(zm))
    tt = torch.where(valid, target.clamp_min(EPS), torch.zeros_like(target))
    B, S = ids.shape[0], ids.shape[1]
    loss = -(loss_coeff / (B * S)) * (tt * logp).sum()
    return loss, lse, p


def reference_kl_divergence(target, z, valid):
    """KL(T_n || P) per row in float64, T_n = T / sum(T) over the valid slots (TileLang's
    sparse_indexer_kl): (kl per row (rows,), P - T_n (rows, topk)); z (rows, topk) logits."""
    zm = z.masked_fill(~valid, -math.inf)
    lse = torch.logsumexp(zm, dim=-1, keepdim=True)
    p = torch.where(valid, torch.exp(zm - lse), torch.zeros_like(zm))
    t = torch.where(valid, target, torch.zeros_like(target))
    tn = t / t.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    pos = valid & (tn > 0)
    terms = torch.where(pos, tn * (torch.log(tn.clamp_min(1e-300)) - (zm - lse)), torch.zeros_like(tn))
    return terms.sum(dim=-1), p - tn


def target_logits_chunk(q, kv, ids, softmax_scale, exact=False):
    """softmax_scale * q[t,h,:] . kv[id_i,:] for a block of rows: q (R, Hq, Dqk), kv (S_kv, Dqk),
    ids (R, topk) -> (valid (R, topk), s (R, Hq, topk)); invalid slots gather a distinct row
    (slot mod S_kv) and their logits are not used. bf16 inputs: a bf16 bmm (fp32 accumulation,
    bf16 result) made fp32, as a user writes it; with exact, the bmm of the inputs made fp32
    (fp32 result). float64 inputs: float64."""
    s_kv = kv.shape[0]
    valid = (ids >= 0) & (ids < s_kv)
    spread = (torch.arange(ids.shape[-1], device=ids.device) % s_kv).to(ids.dtype).expand_as(ids)
    idx = torch.where(valid, ids, spread).long()
    kv_sel = kv[idx]  # (R, topk, Dqk)
    if q.dtype == torch.float64:
        s = torch.bmm(q, kv_sel.transpose(1, 2))
    elif exact:
        s = torch.bmm(q.float(), kv_sel.float().transpose(1, 2))
    else:
        s = torch.bmm(q, kv_sel.transpose(1, 2)).float()
    return valid, s * softmax_scale


def rows_per_chunk(heads, topk, dim, budget_bytes=2 << 30):
    """Rows per block of the chunked torch computations: the (rows, heads, topk) fp32 logits and
    the (rows, topk, dim) bf16 gather within about budget_bytes."""
    per_row = heads * topk * 4 * 2 + topk * dim * 2
    return max(1, budget_bytes // per_row)


def make_target_problem(B, S, Hq, Dqk, K, kind, device, seed, softmax_scale):
    """The attention target's inputs: bf16 main query q (B, S, Hq, Dqk) and latent kv
    (B, S, Dqk) ~ N(0, 1), ids as make_inputs (make_ids, S_kv = S), and lse (B, S, Hq) fp32 the
    natural-log LSE of the sparse attention over each row's valid selected keys (what a sparse
    MLA forward over these ids saves), computed in fp32 from the bf16 inputs made fp32 (no bf16
    rounding of the logits: sum_i exp(s_i - lse) is 1 per head to fp32 accuracy, which a peer
    that recomputes each head's softmax instead of reading lse relies on to compute the same T).
    Rows without a valid slot get lse 0 (their T is 0 whatever it is)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q = torch.randn((B, S, Hq, Dqk), generator=gen, device=device).to(torch.bfloat16)
    kv = torch.randn((B, S, Dqk), generator=gen, device=device).to(torch.bfloat16)
    ids = make_ids(B, S, S, K, kind, gen, device)
    lse = torch.zeros((B, S, Hq), dtype=torch.float32, device=device)
    rows = rows_per_chunk(Hq, K, Dqk * 3)  # the fp32 copies of q and the gathered rows too
    for b in range(B):
        for r0 in range(0, S, rows):
            r1 = min(S, r0 + rows)
            valid, s = target_logits_chunk(q[b, r0:r1], kv[b], ids[b, r0:r1], softmax_scale, exact=True)
            s = s.masked_fill(~valid.unsqueeze(1), -math.inf)
            l = torch.logsumexp(s, dim=-1)
            lse[b, r0:r1] = torch.where(torch.isfinite(l), l, torch.zeros_like(l))
            del s, valid, l
    return q, kv, ids, lse


def reference_target(q, kv, ids, lse, softmax_scale):
    """The attention target in float64 (inputs float64, any device): (T unnormalised, T) with
    T_i = sum_h exp(softmax_scale * q_h . kv_{id_i} - lse_h) at valid slots, 0 elsewhere, and T
    its L1 normalisation over the row (0 for a row without a valid slot)."""
    B, S = ids.shape[0], ids.shape[1]
    tu = torch.zeros(ids.shape, dtype=q.dtype, device=q.device)
    rows = rows_per_chunk(q.shape[2], ids.shape[2], q.shape[3] * 4)  # float64: twice the bytes
    for b in range(B):
        for r0 in range(0, S, rows):
            r1 = min(S, r0 + rows)
            valid, s = target_logits_chunk(q[b, r0:r1], kv[b], ids[b, r0:r1], softmax_scale)
            e = torch.exp(s - lse[b, r0:r1].unsqueeze(-1)).sum(dim=1)
            tu[b, r0:r1] = torch.where(valid, e, torch.zeros_like(e))
    return tu, tu / tu.sum(dim=-1, keepdim=True).clamp_min(1e-300)


def rel_rms(got, want):
    """rel_err under the name the target's accuracy bound uses (relative RMS)."""
    return rel_err(got, want)


def summarize_op(times_ms, rows):
    """median / min / max ms and ns per query row of one op's timed calls."""
    med = statistics.median(times_ms)
    return {"median_ms": med, "min_ms": min(times_ms), "max_ms": max(times_ms),
            "ns_per_row": med * 1e6 / rows, "samples": len(times_ms)}


def load_module_from(folder, files, package):
    """Import files[0] of `folder` as a module of a package named `package` whose other
    modules are the other files (for peer code that uses relative imports, copied out of its
    repository). Raises FileNotFoundError naming the missing file."""
    import importlib.util
    import types
    for f in files:
        if not os.path.isfile(os.path.join(folder, f)):
            raise FileNotFoundError(f"{os.path.join(folder, f)} is missing")
    if package not in sys.modules:
        pkg = types.ModuleType(package)
        pkg.__path__ = [folder]
        sys.modules[package] = pkg
    name = f"{package}.{os.path.splitext(files[0])[0]}"
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, files[0]))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def file_sha256(path):
    import hashlib
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def package_versions(names):
    """{name: installed version or None}."""
    from importlib import metadata
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


# --------------------------------------------------------------------------- the peers' packages

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MEGATRON_DIR = os.path.join(REPO_ROOT, ".peers", "megatron_tilelang")
MEGATRON_FILES = ("tilelang_indexer_loss.py", "tilelang_utils.py")


def load_megatron_tilelang(site_dir, folder):
    """Megatron-Core's TileLang sparse indexer-loss kernels: the module tilelang_indexer_loss.py
    (sparse_indexer_target_interface, sparse_indexer_kl_interface) with its tilelang_utils.py,
    copied from github.com/NVIDIA/Megatron-LM's
    megatron/core/transformer/experimental_attention_variant/ops/ into `folder` (they are not in
    any megatron-core release on PyPI, whose newest is 0.16.1). tilelang_utils imports
    megatron.core.utils for one function (round_up_to_nearest_multiple); without megatron-core
    installed that module is given as a stub with that function alone, which the two kernels
    used here never call. Returns (module, versions); raises with the reason."""
    import importlib.util
    import shutil
    import types
    added = add_site(site_dir)
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
        os.environ["PATH"] = "/usr/local/cuda/bin" + os.pathsep + os.environ.get("PATH", "")
    if importlib.util.find_spec("tilelang") is None:
        where = (f"; --site {site_dir!r} " + ("is absent" if not os.path.isdir(site_dir) else "has no tilelang")
                 if site_dir else "")
        raise ImportError(f"tilelang is not installed{where}")
    for f in MEGATRON_FILES:
        if not os.path.isfile(os.path.join(folder, f)):
            raise FileNotFoundError(
                f"{os.path.join(folder, f)} is missing: copy {' and '.join(MEGATRON_FILES)} of github.com/NVIDIA/"
                f"Megatron-LM's megatron/core/transformer/experimental_attention_variant/ops/ there (or pass "
                f"--megatron-dir)")
    stub = False
    try:
        import megatron.core.utils  # noqa: F401
    except Exception:  # noqa: BLE001 (absent, or a dependency of megatron-core missing)
        stub = True
        for name in ("megatron", "megatron.core"):
            m = types.ModuleType(name)
            m.__path__ = []
            sys.modules[name] = m
        utils = types.ModuleType("megatron.core.utils")
        utils.round_up_to_nearest_multiple = lambda x, m: (x + m - 1) // m * m
        sys.modules["megatron.core.utils"] = utils
    import tilelang
    mod = load_module_from(folder, MEGATRON_FILES, "megatron_tilelang_ops")
    if not getattr(mod, "HAVE_TILELANG", True):
        raise ImportError("megatron's tilelang_utils could not import tilelang")
    versions = {"site_paths_added": added, "tilelang_module": tilelang.__file__,
                "megatron_dir": folder, "megatron_core_utils_stub": stub,
                **{f"{f}_sha256": file_sha256(os.path.join(folder, f)) for f in MEGATRON_FILES},
                **package_versions(("tilelang", "apache-tvm-ffi", "z3-solver", "torch-c-dlpack-ext", "megatron-core"))}
    return mod, versions


def load_cudnn_score_recompute(site_dir):
    """cudnn-frontend's DSA score recompute (cudnn.deepseek_sparse_attention.score_recompute):
    returns (its SM90 interface module, versions); raises with the reason when it cannot load or
    the device is not compute capability 9.0 (the SM90 kernels are the ones timed)."""
    added = add_site(site_dir)
    import cudnn  # noqa: F401  (loads the pybind module and libcudnn)
    from cudnn.deepseek_sparse_attention.score_recompute import _interface_sm90 as iface
    if torch.cuda.get_device_capability(0) != (9, 0):
        raise RuntimeError(f"the SM90 score-recompute kernel needs compute capability 9.0, device is "
                           f"{torch.cuda.get_device_capability(0)}")
    versions = {"site_paths_added": added, "cudnn_module": cudnn.__file__,
                **package_versions(("nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
                                    "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi", "cuda-bindings"))}
    return iface, versions


# --------------------------------------------------------------------------- several peers, one problem

def wall_time(op, iters, warmup, prepare=None):
    """gpu_time's list for a CPU run (perf_counter around op(); smoke runs only)."""
    times = []
    for it in range(warmup + iters):
        if prepare is not None:
            prepare()
        t0 = time.perf_counter()
        op()
        t1 = time.perf_counter()
        if it >= warmup:
            times.append((t1 - t0) * 1e3)
    return times


class Peer:
    """One implementation of a problem: `name`, `status` ("ok" or "unavailable" with
    `reason`), `versions`, `notes` (what it computes and what its timed call covers), `iters` /
    `warmup` (None: the run's), make_op(inputs) -> an object with run(), restore() or None,
    outputs() (tensors that must come out finite) and `extra` ({name: callable} timed like run,
    reported as NAME_ns_per_row), and check() -> {"ok": bool, ...} on a small problem.
    `floor_bound` (default True): its timed call does at least the work our floor counts, so it
    cannot run faster than the floor (bench/peers/side_by_side.py fails when it does); False,
    with `floor_note` saying why, for a peer whose timed call leaves part of that work out."""

    def __init__(self, name, notes, make_op=None, check=None, iters=None, warmup=None, floor_bound=True,
                 floor_note=None):
        self.name, self.notes, self.make_op, self.check = name, list(notes), make_op, check
        self.iters, self.warmup = iters, warmup
        self.floor_bound, self.floor_note = floor_bound, floor_note
        self.status, self.reason, self.versions = "ok", None, {}

    def unavailable(self, reason, **extra):
        self.status, self.reason = "unavailable", reason
        self.versions.update(extra)
        return self

    def record(self):
        rec = {"status": self.status, "notes": self.notes, "versions": self.versions, "floor_bound": self.floor_bound}
        if self.floor_note:
            rec["floor_note"] = self.floor_note
        if self.reason:
            rec["reason"] = self.reason
        return rec


def time_peer_cases(a, info, peers, cases, make_inputs_for, device="cuda"):
    """For each case (a dict of the row's keys, with "batch" and "seq"), make_inputs_for(case)
    builds the inputs once (an object with valid_per_row); then each available peer's op: the
    first call's wall time, `iters` timed calls after `warmup` (restore() before each, untimed;
    CUDA events, or perf_counter on the cpu), each of op.extra timed the same way, the finiteness
    of op.outputs() and the peak memory. One row per (case, peer) goes into info["results"]
    (status "ok", "oom" or "error" with the reason: the loop goes on), the JSON is rewritten
    after each. Returns 0 when every row ran, else 1."""
    rc = 0
    cuda = device != "cpu"
    timer = gpu_time if cuda else wall_time
    live = [p for p in peers if p.status == "ok"]
    for case in cases:
        rows = case["batch"] * case["seq"]
        inputs = None
        try:
            inputs = make_inputs_for(case)
        except Exception as e:  # noqa: BLE001 (OOM while building: every peer of the case says so)
            for p in live:
                info["results"].append({"peer": p.name, **case, "status": "oom" if is_oom(e) else "error",
                                        "reason": "inputs: " + short_error(e)})
            print(f"{case}: inputs {short_error(e)}", flush=True)
            rc = 1
            inputs = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            write_json(a.json, info)
            continue
        for p in live:
            row = {"peer": p.name, **case, "valid_slots_per_row": round(inputs.valid_per_row, 2)}
            op = restore = None
            try:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                op = p.make_op(inputs)
                restore = getattr(op, "restore", None)
                iters = p.iters or a.iters
                warmup = a.warmup if p.warmup is None else p.warmup
                row["first_call_s"] = first_call(op.run, restore) if cuda else None
                row.update(summarize_op(timer(op.run, iters, warmup, prepare=restore), rows))
                for name, fn in getattr(op, "extra", {}).items():
                    row[f"{name}_ns_per_row"] = summarize_op(timer(fn, iters, warmup, prepare=restore),
                                                             rows)["ns_per_row"]
                if not all(bool(torch.isfinite(x.float()).all().item()) for x in op.outputs()):
                    raise RuntimeError("non-finite output")
                if cuda:
                    row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                row["status"] = "ok"
                extra = "  ".join(f"{k[:-11]} {v:.1f}" for k, v in row.items() if k.endswith("_ns_per_row"))
                print(f"  {p.name:15s} {case_label(case):38s} {row['ns_per_row']:10.1f} ns/row  "
                      f"(median {row['median_ms']:.3f} ms, min {row['min_ms']:.3f}, max {row['max_ms']:.3f})"
                      + (f"  {extra}" if extra else ""), flush=True)
            except Exception as e:  # noqa: BLE001 (OOM, unsupported shape, compile error: report and go on)
                row["status"] = "oom" if is_oom(e) else "error"
                row["reason"] = short_error(e)
                row["traceback"] = traceback.format_exc(limit=8)
                print(f"  {p.name:15s} {case_label(case):38s} {row['status'].upper()}: {row['reason']}", flush=True)
                rc = 1
            del op, restore
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            info["results"].append(row)
            write_json(a.json, info)
        del inputs
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return rc


def case_label(case):
    keys = [k for k in ("ids", "seq", "heads", "dim", "topk") if k in case]
    names = {"ids": "", "seq": "S", "heads": "H", "dim": "D", "topk": "topk"}
    return " ".join(f"{names[k]}{case[k]}" for k in keys)


def run_peer_checks(info, peers, json_path):
    """Each available peer's check() into info["peers"][name]["check"] (an exception is its
    check's error); returns 0 when all passed, else 1."""
    rc = 0
    for p in peers:
        if p.status != "ok" or p.check is None:
            continue
        rec = info["peers"][p.name]
        if run_check_into(rec, p.check, None) != 0:
            rc = 1
        write_json(json_path, info)
    return rc


def peers_unavailable(info, names, device, json_path, problem):
    """When no peer can run here (torch missing, or device "cuda" without a usable GPU): records
    the reason for each peer of `names` and for the run, writes the JSON, says so and returns
    UNAVAILABLE; else None."""
    if torch is None:
        reason = "torch is not installed"
        line = f"{reason}: no peer can run"
    elif device == "cuda" and (reason := cuda_reason()):
        line = f"{problem}: {reason}: no peer can run"
    else:
        return None
    for n in names:
        info["peers"][n] = {"status": "unavailable", "reason": reason}
    info.update(status="unavailable", reason=reason)
    write_json(json_path, info)
    print(line, flush=True)
    return UNAVAILABLE


def run_peers(a, info, names, make_peer, cases, make_inputs_for, problem):
    """A peers script's run after its arguments: the peers of `names` (make_peer(name)) recorded,
    checked (--check, --check-only) and timed on `cases` (make_inputs_for(case) builds a case's
    inputs), the JSON written at each step. Returns the exit status (UNAVAILABLE when no peer
    can run)."""
    device = a.device
    rc = peers_unavailable(info, names, device, a.json, problem)
    if rc is not None:
        return rc
    info.update(device_info() if device == "cuda" else {"device": "cpu"})
    peers = [make_peer(n) for n in names]
    for p in peers:
        info["peers"][p.name] = p.record()
        print(f"{p.name}: {p.status}" + (f" ({p.reason})" if p.reason else ""), flush=True)
    write_json(a.json, info)
    rc = 0
    if a.check or a.check_only:
        rc = run_peer_checks(info, peers, a.json)
    if not a.check_only:
        rc = max(rc, time_peer_cases(a, info, peers, cases, make_inputs_for, device=device))
    urc = finish_peer_run(info, peers, a.json)
    return urc if urc else rc


def finish_peer_run(info, peers, json_path):
    """info["status"]: "unavailable" when no peer could run (exit 77), "error" when no timed row
    ran, else "ok"."""
    for p in peers:
        info["peers"][p.name] = {**p.record(), **({"check": info["peers"][p.name]["check"]}
                                                  if "check" in info["peers"].get(p.name, {}) else {})}
    if all(p.status != "ok" for p in peers):
        info["status"] = "unavailable"
        info["reason"] = "; ".join(f"{p.name}: {p.reason}" for p in peers)
    elif info["results"] and all(r["status"] != "ok" for r in info["results"]):
        info["status"] = "error"
    write_json(json_path, info)
    return UNAVAILABLE if info["status"] == "unavailable" else 0
