#!/usr/bin/env python3
"""The SASS instructions with the most warp-stall samples, from an ncu source-page CSV
(`ncu --import R.ncu-rep --page source --csv --print-source sass`).

usage: ncu_top_stalls.py SOURCE.csv [N]
Prints the total samples, then the N instructions with the most samples: address,
samples, share of all samples, and the SASS text. The column names are looked up
by substring, since ncu versions name them slightly differently.
"""
import csv
import sys


def number(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return 0.0


def read_source_csv(path):
    """The rows of an ncu source-page CSV (dicts by column name). ncu may print a
    kernel header before the table: reading starts at the header row."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, l in enumerate(lines) if "Address" in l and "Source" in l)
    return list(csv.DictReader(lines[start:]))


def main():
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    rows = read_source_csv(path)
    cols = rows[0].keys() if rows else []
    samp = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
    if samp is None:
        samp = next(c for c in cols if "Sampling" in c)
    addr = next(c for c in cols if "Address" in c)
    src = next(c for c in cols if c.strip() == "Source" or c.startswith("Source"))
    total = sum(number(r[samp]) for r in rows)
    print(f"columns: {list(cols)}")
    print(f"instructions: {len(rows)}, samples ({samp}): {total:.0f}")
    top = sorted(rows, key=lambda r: -number(r[samp]))[:n]
    for r in top:
        s = number(r[samp])
        print(f"{r[addr]:>8s} {s:8.0f} {100 * s / max(total, 1):5.1f}%  {r[src].strip()}")


if __name__ == "__main__":
    main()
