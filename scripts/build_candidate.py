#!/usr/bin/env python3
"""Builds a kernel candidate from its patch in docs/kernel-ladder/ into
.device/cand/<name>/ (ignored by git) for scripts/device/candidate_check.sh:
a git worktree of HEAD in /tmp (never this tree; scripts/build_ablations.py's
worktree_build), `git apply` of the patch, a Release CUDA build of the four
binaries the check runs (bench, CLI, GPU tests, sync_calibration), stripped,
and ptxas's register/spill lines of the fused kernels. Exits non-zero when the
patch does not apply or the build fails (the project builds with -Werror on
spills, and cmake/ptxas_gate.sh fails a compile on C7512, serialised wgmma).

  scripts/build_candidate.py docs/kernel-ladder/v19-bulk-reduce-scatter-role.patch v19 [--keep]

CUTLASS headers: $DSAIB_CUTLASS_INCLUDE_DIR, else the value in build/CMakeCache.txt.
"""
import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_ablations import REPO, cutlass_include_dir, run, worktree_build  # noqa: E402

TARGETS = {  # target -> its path in the build tree
    "dsa-indexer-bwd-bench": "bench/dsa-indexer-bwd-bench",
    "dsa-indexer-bwd": "cli/dsa-indexer-bwd",
    "test_gpu_hopper": "tests/gpu/test_gpu_hopper",
    "sync_calibration": "tests/sanitizer/sync_calibration",
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("patch")
    ap.add_argument("name")
    ap.add_argument("--keep", action="store_true", help="keep the worktree /tmp/cand-<name>")
    ap.add_argument("--jobs", default=str(os.cpu_count() or 2))
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help="comma-separated subset of the binaries (screening an A/B: dsa-indexer-bwd-bench,dsa-indexer-bwd)")
    a = ap.parse_args()
    if not a.targets or set(a.targets.split(",")) - set(TARGETS):
        sys.exit(f"build_candidate: --targets: expected names from {', '.join(TARGETS)}, got '{a.targets}'")
    targets = {t: TARGETS[t] for t in a.targets.split(",")}
    patch = pathlib.Path(a.patch).resolve()
    if not cutlass_include_dir():
        sys.exit("build_candidate: set DSAIB_CUTLASS_INCLUDE_DIR (no build/CMakeCache.txt to read it from)")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    print(f"build_candidate: {a.name} = {head} + {patch.name}", flush=True)
    wt = pathlib.Path(f"/tmp/cand-{a.name}")
    log = pathlib.Path(f"/tmp/cand-{a.name}-build.log")
    try:
        with worktree_build(wt, lambda w: run(["git", "-C", str(w), "apply", str(patch)]), list(targets), a.jobs,
                            a.keep, log=log) as w:
            out = REPO / ".device" / "cand" / a.name
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            for rel in targets.values():
                shutil.copy2(w / "build" / rel, out)
            subprocess.run(["strip", "--strip-debug", *map(str, out.iterdir())], check=False)
    except subprocess.CalledProcessError as e:
        sys.exit(f"build_candidate: failed: {' '.join(map(str, e.cmd))}")
    text = log.read_text()
    # ptxas prints a kernel's spill line, then its register line: the fused kernels use 168 or 2xx registers.
    spills = re.findall(r"^\s*(\d+ bytes stack frame.*)$", text, re.M)
    regs = re.findall(r"(Used \d+ registers.*)$", text, re.M)
    for sp, rg in zip(spills, regs):
        if re.search(r"Used (168|2\d\d) registers", rg):
            print(f"{sp}\t{rg}")
    if set(targets) == set(TARGETS):
        print(f"build_candidate: device run, carry [\".device/bin\", \".device/cand/{a.name}\"]: "
              f"CAND={a.name} bash scripts/device/candidate_check.sh")
    else:  # candidate_check.sh needs the GPU tests; a subset is for a paired A/B alone
        print(f"build_candidate: device run, carry [\".device/bin\", \".device/cand/{a.name}\"]: "
              f"python3 scripts/ab_compare.py .device/bin/dsa-indexer-bwd-bench "
              f".device/cand/{a.name}/dsa-indexer-bwd-bench --pairs 3 --args \"--seq 16384 --iters 10\"")


if __name__ == "__main__":
    main()
