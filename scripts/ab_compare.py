#!/usr/bin/env python3
"""Paired A/B comparison of two benchmark binaries (two builds or variants).

Runs A and B alternately (ABAB..., or BABA.. on odd pairs to cancel drift) as
separate processes, N pairs, each run printing JSON (dsa-indexer-bwd-bench
--json). For every case it reports the median ns/row of A and B, the paired
deltas (B - A) and a Student-t 95% confidence interval of the mean delta.

usage: ab_compare.py BIN_A BIN_B [--pairs 8] [--args "--seq 4096 --ids random"] [--out FILE]
                     [--metric ns_per_row | ns_per_row_sustained]

--metric ns_per_row_sustained compares the sustained runs' steady state (pass
--sustained-ms in --args too): back to back the op runs at the H200's power
limit, where a change pays by its energy as much as by its latency
(docs/perf-log.md, nineteenth session).
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


def run(binary, extra, metric="ns_per_row"):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [binary, "--json", path] + extra
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        rows = json.load(f)
    os.unlink(path)
    out = {}
    for r in rows:
        v = r.get(metric)
        if not isinstance(v, (int, float)) or not v > 0:
            raise SystemExit(f"{binary}: no positive {metric!r} in its JSON" +
                             (" (does it take --sustained-ms?)" if metric == "ns_per_row_sustained" else ""))
        out[f'{r["ids"]} S{r["seq"]} H{r["heads"]} D{r["dim"]} k{r["topk"]}'] = v
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--args", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--metric", default="ns_per_row", choices=("ns_per_row", "ns_per_row_sustained"))
    o = ap.parse_args()
    if o.metric == "ns_per_row_sustained":
        toks = o.args.split()
        vals = [toks[i + 1] for i, t in enumerate(toks[:-1]) if t == "--sustained-ms"]
        try:
            positive = bool(vals) and float(vals[-1]) > 0
        except ValueError:
            positive = False
        if not positive:
            ap.error("--metric ns_per_row_sustained needs --sustained-ms with a positive value in --args")
    extra = o.args.split()
    samples = {}
    for i in range(o.pairs):
        order = [("A", o.a), ("B", o.b)] if i % 2 == 0 else [("B", o.b), ("A", o.a)]
        got = {}
        for tag, binary in order:
            got[tag] = run(binary, extra, o.metric)
        for case in got["A"]:
            samples.setdefault(case, []).append((got["A"][case], got["B"][case]))
    report = []
    print(f"metric: {o.metric}")
    print(f"{'case':34s} {'A ns/row':>9s} {'B ns/row':>9s} {'B-A mean':>9s} {'95% CI':>22s} {'B/A':>6s}")
    for case, pairs in samples.items():
        deltas = [b - a for a, b in pairs]
        n = len(deltas)
        mean = statistics.fmean(deltas)
        sd = statistics.stdev(deltas) if n > 1 else float("nan")
        half = T95[min(n - 1, 30) - 1] * sd / math.sqrt(n) if n > 1 else float("nan")
        ma = statistics.median(a for a, _ in pairs)
        mb = statistics.median(b for _, b in pairs)
        print(f"{case:34s} {ma:9.1f} {mb:9.1f} {mean:9.1f} [{mean - half:8.1f}, {mean + half:8.1f}] {mb / ma:6.3f}")
        report.append({"case": case, "metric": o.metric, "a_median": ma, "b_median": mb, "delta_mean": mean, "ci95": [mean - half, mean + half],
                       "pairs": pairs})
    if o.out:
        with open(o.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
