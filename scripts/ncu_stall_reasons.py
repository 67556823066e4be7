#!/usr/bin/env python3
"""Stall reasons of one ncu run, largest first, from ncu's text output of
`--metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"`.

usage: ncu_stall_reasons.py NCU_OUTPUT.txt
Each metric is the average number of warps stalled for that reason per issued
instruction (the numbers behind the WarpStateStats chart); the share is of their sum.
"""
import re
import sys


def main():
    pat = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+(?:\S+\s+)?([0-9.,]+)\s*$")
    reasons = {}
    for line in open(sys.argv[1]):
        m = pat.search(line.strip())
        if m:
            reasons[m.group(1)] = float(m.group(2).replace(",", ""))
    if not reasons:
        print("no stall metrics found")
        return 1
    total = sum(reasons.values())
    print(f"stall reasons (warps stalled per issued instruction; sum {total:.2f}):")
    for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {v:7.3f}  {100 * v / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
