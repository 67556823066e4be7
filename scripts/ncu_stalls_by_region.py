#!/usr/bin/env python3
"""Warp-stall samples of an ncu source-page CSV (`ncu --import R.ncu-rep --page
source --csv --print-source sass`, as `gpu_check.sh ncu-source` writes it) summed
over SASS address ranges, e.g. the kernel's roles (between their USETMAXREG /
EXIT) or the code regions of one role, with the top stall reasons of each range.

usage: ncu_stalls_by_region.py SOURCE.csv OFFSET=NAME [OFFSET=NAME ...] [--end OFFSET]
OFFSETs are hex, relative to the kernel's first instruction; a range runs from
its offset to the next one (the last to --end, or to the end of the kernel).
Shares are of the samples inside all the ranges.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_top_stalls import number, read_source_csv  # noqa: E402


def main():
    args = sys.argv[1:]
    end = None
    if "--end" in args:
        i = args.index("--end")
        end = int(args[i + 1], 16)
        del args[i:i + 2]
    path, specs = args[0], args[1:]
    rows = read_source_csv(path)
    samples = next(c for c in rows[0] if "Warp Stall Sampling (All" in c)
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    base = int(rows[0]["Address"], 16)
    bounds = sorted((int(a, 16), name) for a, name in (s.split("=", 1) for s in specs))
    agg = {name: {"total": 0.0} for _, name in bounds}
    for r in rows:
        off = int(r["Address"], 16) - base
        if off < bounds[0][0] or (end is not None and off >= end):
            continue
        name = [n for a, n in bounds if off >= a][-1]
        d = agg[name]
        d["total"] += number(r[samples])
        for c in reasons:
            d[c] = d.get(c, 0.0) + number(r[c])
    total = sum(d["total"] for d in agg.values()) or 1.0
    for a, name in bounds:
        d = agg[name]
        top = sorted(((v, c) for c, v in d.items() if c != "total"), reverse=True)[:5]
        why = ", ".join(f"{c[6:]} {100 * v / max(d['total'], 1):.0f}%" for v, c in top if v > 0)
        print(f"{a:6x} {name:24s} {d['total']:8.0f} {100 * d['total'] / total:5.1f}%  {why}")


if __name__ == "__main__":
    main()
