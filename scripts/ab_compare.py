#!/usr/bin/env python3
"""Paired A/B comparison of two benchmark binaries (two builds or variants).

Runs A and B alternately (ABAB..., or BABA.. on odd pairs to cancel drift) as
separate processes, N pairs, each run writing the bench's JSON report (dsaib-bench
--json FILE: an object whose "cases" list holds one record per case; a plain list
of case records is read too). For every case it reports the median ns/row of A
and B, the paired deltas (B - A) and a Student-t 95% confidence interval of the
mean delta. A case is named by its op (when not the backward), ids, B, S, H, D and
topk.

usage: ab_compare.py BIN_A BIN_B [--pairs 8] [--args "--seq 4096 --ids random"] [--out FILE]
                     [--metric ns_per_row | ns_per_row_sustained | both]

--metric ns_per_row_sustained compares the sustained runs' steady state (pass
a positive --sustained-ms in --args too): back to back the op runs at the H200's
power limit, where a change pays by its energy as much as by its latency.

Example: a build of the baseline (build-a) against a build of the change (build-b),
the loss forward (without the floors and the sustained run, which a paired A/B does
not need):
  python3 scripts/ab_compare.py build-a/bench/dsaib-bench build-b/bench/dsaib-bench --pairs 8 \
      --args "--op forward --seq 16384 --ids random --iters 15 --no-floor --sustained-ms 0" --out ab.json
B is faster when the 95% interval of B - A lies below 0. A or B can be any executable
that takes `--json FILE` and the --args, such as a two-line shell wrapper that runs one
build's bench with an option (`exec .../dsaib-bench --a-operand bf16x2 "$@"`).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

# two-sided 95% Student-t quantiles, df = 1..30
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
       2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
       2.045, 2.042]


def t95(df):
    """Two-sided 95% Student-t quantile: the table up to df 30, beyond it the
    Cornish-Fisher expansion around z = 1.959964 (within 1e-4 of the exact
    quantile from df 31: 2.0227 at df 39, 1.9840 at df 100)."""
    if df <= 30:
        return T95[df - 1]
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def fail(binary, what):
    raise SystemExit(f"{binary}: {what}")


METRICS = ("ns_per_row", "ns_per_row_sustained")


def metric_value(r, m):
    """Metric m of case record r: its own key, or for the sustained metric the
    report's "sustained": {"ns_per_row"} object."""
    if m in r:
        return r[m]
    if m == "ns_per_row_sustained" and isinstance(r.get("sustained"), dict):
        return r["sustained"].get("ns_per_row")
    return None


def case_name(r):
    """'random S16384 H64 D128 k2048', the op first when it is not the backward, the
    batch when it is not 1 (as in the README's speed table); the top-k's cases name
    their key ranges ('topk causal S16384 ...', 'topk causal e4m3 S16384 ...' for
    float8 inputs) where the others name their ids; a target case without an lse
    says so ('target random no-lse S16384 ...')."""
    batch = r.get("batch", 1)
    op = r.get("op", "backward")
    ids = r["ranges"] if op == "topk" else r["ids"]
    if op == "topk" and r.get("dtype", "bf16") != "bf16":
        ids += f' {r["dtype"]}'
    if op == "target" and r.get("lse", "given") != "given":
        ids += " no-lse"
    return (f'{"" if op == "backward" else f"{op} "}{ids}{"" if batch == 1 else f" B{batch}"} '
            f'S{r["seq"]} H{r["heads"]} D{r["dim"]} k{r["topk"]}')


def run(binary, extra, metrics=("ns_per_row",)):
    """{metric: {case: value}} of one run of `binary --json FILE extra...`.
    Exits with a message naming the binary for a failed run or a JSON that is
    not the bench's (case objects with a finite positive metric, each case once,
    as a list or under "cases")."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        cmd = [binary, "--json", path] + extra
        try:
            rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
        except OSError as e:
            fail(binary, f"cannot run it ({e.strerror})")
        if rc != 0:
            fail(binary, f"exited with status {rc} ({' '.join(cmd)})")
        try:
            with open(path) as f:
                rows = json.load(f)
        except ValueError as e:
            fail(binary, f"its --json file is not valid JSON ({e})")
    finally:
        os.unlink(path)
    if isinstance(rows, dict):
        rows = rows.get("cases")
    if not isinstance(rows, list) or not rows:
        fail(binary, "expected its JSON to hold a non-empty list of cases")
    out = {m: {} for m in metrics}
    for r in rows:
        if not isinstance(r, dict):
            fail(binary, f"expected each case to be an object, got {r!r}")
        try:
            case = case_name(r)
        except KeyError as e:
            fail(binary, f"a case without {e} in its JSON")
        for m in metrics:
            v = metric_value(r, m)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
                fail(binary, f"no finite positive {m!r} for {case} in its JSON" +
                     (" (does it take --sustained-ms?)" if m == "ns_per_row_sustained" else ""))
            if case in out[m]:
                fail(binary, f"case {case} twice in its JSON (the pairs would mix them)")
            out[m][case] = v
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--args", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--metric", default="ns_per_row", choices=METRICS + ("both",),
                    help="which ns/row the deltas are of (both: one table each, from the same runs)")
    o = ap.parse_args()
    if o.pairs < 1:
        ap.error(f"--pairs: expected >= 1, got {o.pairs}")
    metrics = METRICS if o.metric == "both" else (o.metric,)
    if "ns_per_row_sustained" in metrics:
        toks = o.args.split()
        vals = [toks[i + 1] for i, t in enumerate(toks[:-1]) if t == "--sustained-ms"]
        try:
            positive = bool(vals) and float(vals[-1]) > 0
        except ValueError:
            positive = False
        if not positive:
            ap.error(f"--metric {o.metric} needs --sustained-ms with a positive value in --args")
    extra = o.args.split()
    samples = {m: {} for m in metrics}
    for i in range(o.pairs):
        order = [("A", o.a), ("B", o.b)] if i % 2 == 0 else [("B", o.b), ("A", o.a)]
        got = {}
        for tag, binary in order:
            got[tag] = run(binary, extra, metrics)
        for m in metrics:
            if set(got["A"][m]) != set(got["B"][m]):
                only_a = sorted(set(got["A"][m]) - set(got["B"][m]))
                only_b = sorted(set(got["B"][m]) - set(got["A"][m]))
                raise SystemExit(f"A and B ran different cases: only in A {only_a}, only in B {only_b}")
            for case in got["A"][m]:
                samples[m].setdefault(case, []).append((got["A"][m][case], got["B"][m][case]))
    report = []
    for m in metrics:
        print(f"metric: {m}")
        print(f"{'case':34s} {'A ns/row':>9s} {'B ns/row':>9s} {'B-A mean':>9s} {'95% CI':>22s} {'B/A':>6s}")
        for case, pairs in samples[m].items():
            deltas = [b - a for a, b in pairs]
            n = len(deltas)
            mean = statistics.fmean(deltas)
            sd = statistics.stdev(deltas) if n > 1 else float("nan")
            half = t95(n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
            ma = statistics.median(a for a, _ in pairs)
            mb = statistics.median(b for _, b in pairs)
            print(f"{case:34s} {ma:9.1f} {mb:9.1f} {mean:9.1f} [{mean - half:8.1f}, {mean + half:8.1f}] {mb / ma:6.3f}")
            ci = [mean - half, mean + half] if n > 1 else None  # JSON null: one pair has no interval
            report.append({"case": case, "metric": m, "a_median": ma, "b_median": mb, "delta_mean": mean,
                           "ci95": ci, "pairs": pairs})
    if o.out:
        with open(o.out, "w") as f:
            json.dump(report, f, indent=1, allow_nan=False)


if __name__ == "__main__":
    sys.exit(main())
