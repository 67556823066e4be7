#!/usr/bin/env python3
"""Builds diagnostic ablations of the fused kernel (timing only, wrong results)
as dsa-indexer-bwd-bench binaries, for a device call that asks where the time
goes (docs/perf-log.md, "ablations"). Each ablation is a source edit of a
checkout of HEAD in its own git worktree (never this tree), guarded so that a
stale edit fails loudly instead of building the unchanged kernel.

  scripts/build_ablations.py [--out .device/ablations] [--only NAME ...] [--keep]
  scripts/build_ablations.py --check     # every edit still applies to this tree (no build;
                                         # ctest runs it, label cpu)

Then on the H200 (carry the output folder):
  for b in .device/ablations/bench_*; do $b --seq 16384 --iters 15 --json ...; done
or paired against HEAD with scripts/ab_compare.py. The edits keep every wait and
release, so the pipelines run as in the real kernel; a never-true runtime
predicate (`p.num_tasks < 0`) removes work without letting the compiler drop
the surrounding code (no_gemms clears the accumulators instead: a kept-but-
skipped wgmma makes the consumer spill). Only the bf16-output kernels (one a
term) are what the bench times by default; the split kernels are edited too. Predictions go into the perf log before the run.
"""
import argparse
import contextlib
import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

# name -> (what it measures, [(file, old, new)])
ABLATIONS = {
    "no_reds": (
        "scatter role loads, releases, issues no reds: the op without the dK reduce traffic",
        [("src/hopper/scatter_reduce.cuh",
          "        if (kr[s] >= 0) atomicAdd(",
          "        if (kr[s] >= 0 && p.num_tasks < 0) atomicAdd("),
         # the L2-hinted kernels' red (taken at B1 D128 from S_kv ~43 K on; until the
         # seventeenth session this edit was missing, and no_reds at S 65536 still reduced)
         ("src/hopper/scatter_reduce.cuh",
          "          if (kr[s] >= 0) red_add_f32x4(",
          "          if (kr[s] >= 0 && p.num_tasks < 0) red_add_f32x4(")]),
    "no_gemms": (
        "MMA roles issue no wgmma (S and dK cleared instead, dQ left): producer + scatter + the score role's "
        "A work and the dK role's staging",
        [("src/hopper/score_mma.cuh",
          "        warpgroup_gemm_rs<true>(mma_s, tSrQ, tSrK(_, _, _, ks), tSrS);  // GEMM1: S = Q K^T (Q from registers)",
          "        clear(tSrS);"),
         ("src/hopper/score_mma.cuh",
          "        warpgroup_gemm_rs<false>(mma_dq, tDQrA, tDQrKt(_, _, _, ks), tDQrDQ);",
          ""),
         ("src/hopper/score_mma.cuh",
          "        if constexpr (Config::kSplitA) warpgroup_gemm_rs<false>(mma_dq, tDQrAlo, tDQrKt(_, _, _, ks), tDQrDQ);",
          ""),
         ("src/hopper/dk_mma.cuh",
          "        warpgroup_gemm<true>(mma_dk, tDKrA(_, _, _, 0, b), tDKrQt(_, _, _, qs), tDKrDK);  // GEMM2: dK_blk = A^T Q",
          "        clear(tDKrDK);"),
         ("src/hopper/dk_mma.cuh",
          "        if constexpr (Config::kSplitA) warpgroup_gemm<false>(mma_dk, tDKrA(_, _, _, 1, b), tDKrQt(_, _, _, qs), tDKrDK);",
          "")]),
    "no_gather": (
        "producer issues no K row copies (stale sK): the op without the gather's L2 reads",
        [("src/hopper/producer_gather.cuh",
          "            copy16(src, &sK(gather_row0 + i, gather_col, ks), valid);",
          "            if (p.num_tasks < 0) copy16(src, &sK(gather_row0 + i, gather_col, ks), valid);")]),
    "no_staging": (
        "dK role stages nothing into dk_stage (still acquires / commits): the staging stores' cost",
        [("src/hopper/dk_mma.cuh",
          "          *reinterpret_cast<float2*>(&ss.dk_stage[buf][r0][c0 + 8 * j]) =",
          "          if (p.num_tasks < 0) *reinterpret_cast<float2*>(&ss.dk_stage[buf][r0][c0 + 8 * j]) ="),
         ("src/hopper/dk_mma.cuh",
          "          *reinterpret_cast<float2*>(&ss.dk_stage[buf][r0 + 8][c0 + 8 * j]) =",
          "          if (p.num_tasks < 0) *reinterpret_cast<float2*>(&ss.dk_stage[buf][r0 + 8][c0 + 8 * j]) =")]),
    # Not ablations: design alternatives built the same way (paired A/B against the op).
    "non_persistent": (
        "design check: one CTA per task (grid = num_tasks) instead of the persistent grid of one CTA per SM",
        [("src/hopper/launch_impl.cuh",
          "  return std::min<int64_t>(num_tasks, static_cast<int64_t>(sms) * blocks_per_sm);",
          "  return num_tasks + 0 * static_cast<int64_t>(sms) * blocks_per_sm;")]),
    "stages_k4": (
        "design check: K pipeline depth 4 instead of the landed 6 (5 in the split-A D=128 kernel; perf-log, "
        "fifth session: 6 measured -6.5 / -8.0 ns/row against 4 at S 16384)",
        [("src/hopper/tile_config.cuh",
          "  static constexpr int kStagesK = (kSplitA_ && kHeadDim_ == 128) ? 5 : 6;\n",
          "  static constexpr int kStagesK = 4;\n")]),
}


def run(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def cutlass_include_dir() -> str:
    """$DSAIB_CUTLASS_INCLUDE_DIR, else the value this tree's build/CMakeCache.txt holds ("" if none)."""
    if os.environ.get("DSAIB_CUTLASS_INCLUDE_DIR"):
        return os.environ["DSAIB_CUTLASS_INCLUDE_DIR"]
    cache = REPO / "build" / "CMakeCache.txt"
    if cache.exists():
        for line in cache.read_text().splitlines():
            if line.startswith("DSAIB_CUTLASS_INCLUDE_DIR:"):
                return line.split("=", 1)[1]
    return ""


def remove_worktree(wt: pathlib.Path):
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)], check=False)
    shutil.rmtree(wt, ignore_errors=True)


@contextlib.contextmanager
def worktree_build(wt: pathlib.Path, prepare, targets, jobs, keep=False, log=None):
    """A git worktree of HEAD at wt (never this tree; one left there is replaced),
    edited by prepare(wt), then a Release CUDA build of targets in wt/build.
    Yields wt to copy from; removes it afterwards unless keep. log: a file for
    the build's output (its error and spill lines are printed if it fails)."""
    if wt.exists():
        remove_worktree(wt)
    run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(wt), "HEAD"])
    try:
        prepare(wt)
        cfg = ["cmake", "-S", str(wt), "-B", str(wt / "build"), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
               "-DDSAIB_ENABLE_CUDA=ON"]
        cutlass = cutlass_include_dir()
        if cutlass:
            cfg.append(f"-DDSAIB_CUTLASS_INCLUDE_DIR={cutlass}")
        run(cfg, stdout=subprocess.DEVNULL)
        build = ["cmake", "--build", str(wt / "build"), "-j", str(jobs), "--target", *targets]
        if log is None:
            run(build)
        else:
            with open(log, "w") as f:
                try:
                    run(build, stdout=f, stderr=subprocess.STDOUT)
                except subprocess.CalledProcessError:
                    lines = pathlib.Path(log).read_text().splitlines()
                    print("\n".join([line for line in lines if "error" in line or "spill" in line][:20]), flush=True)
                    raise
        yield wt
    finally:
        if not keep:
            remove_worktree(wt)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / ".device" / "ablations"))
    ap.add_argument("--only", nargs="*", choices=sorted(ABLATIONS))
    ap.add_argument("--keep", action="store_true", help="keep the worktrees under /tmp")
    ap.add_argument("--jobs", default=str(os.cpu_count() or 2))
    ap.add_argument("--check", action="store_true",
                    help="only check that every edit applies to this tree's sources (exactly one match), no build")
    a = ap.parse_args()
    if a.check:
        stale = [f"{name}: {rel}: {s.count(old)} matches of {old!r}"
                 for name, (_, edits) in sorted(ABLATIONS.items())
                 for rel, old, _ in edits for s in [(REPO / rel).read_text()] if s.count(old) != 1]
        print("\n".join(stale) if stale else f"all {len(ABLATIONS)} ablations apply to {REPO}")
        sys.exit(1 if stale else 0)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    for name in a.only or sorted(ABLATIONS):
        what, edits = ABLATIONS[name]

        def apply_edits(wt, name=name, edits=edits):
            for rel, old, new in edits:
                f = wt / rel
                s = f.read_text()
                if s.count(old) != 1:
                    sys.exit(f"{name}: the edit of {rel} no longer applies (expected exactly one of:\n{old})")
                f.write_text(s.replace(old, new))

        with worktree_build(pathlib.Path(f"/tmp/dsaib-ablation-{name}"), apply_edits, ["dsa-indexer-bwd-bench"],
                            a.jobs, a.keep) as wt:
            dst = out / f"bench_{name}"
            shutil.copy2(wt / "build" / "bench" / "dsa-indexer-bwd-bench", dst)
            subprocess.run(["strip", "--strip-debug", str(dst)], check=False)
            (out / f"bench_{name}.txt").write_text(f"{name} on {head}: {what}\n")
            print(f"{dst}: {what}", flush=True)


if __name__ == "__main__":
    main()
