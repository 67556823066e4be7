"""scripts/plot_bench.py's reading of times (no plotting, no matplotlib): which
values become points, for the timed and the sustained (--sustained) series and
the bench subcommand's floor and traffic floor.
  python3 tests/cpu/plot_bench_times.py scripts/plot_bench.py
Exits non-zero on the first wrong answer."""
import importlib.util
import math
import sys

spec = importlib.util.spec_from_file_location("plot_bench", sys.argv[1])
pb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pb)

# time_value: finite positive numbers only
for v, want in [(300, 300.0), (1.5, 1.5), (0, None), (-3.0, None), (math.nan, None), (math.inf, None),
                (True, None), (False, None), ("300", None), (None, None), ([300], None)]:
    got = pb.time_value(v)
    assert got == want, f"time_value({v!r}) = {got!r}, expected {want!r}"

# timed: ns_per_row, else ns_per_row_median, else timing.median_ms per row of B*S
assert pb.ns_of({"ns_per_row": 310.0}) == 310.0
assert pb.ns_of({"ns_per_row": math.nan, "ns_per_row_median": 320.0}) == 320.0
assert pb.ns_of({"seq": 4096, "batch": 2, "timing": {"median_ms": 2.4576}}) == 2.4576e6 / 8192
assert pb.ns_of({"seq": 4096, "timing": {"median_ms": math.inf}}) is None
assert pb.ns_of({"seq": 4096, "timing": "n/a"}) is None

# sustained: the op bench's flat key, else the bench subcommand's "sustained" object
assert pb.sustained_ns_of({"ns_per_row_sustained": 350.0}) == 350.0
assert pb.sustained_ns_of({"ns_per_row_sustained": 0.0, "sustained": {"ns_per_row": 351.0}}) == 351.0
assert pb.sustained_ns_of({"ns_per_row_sustained": True}) is None
assert pb.sustained_ns_of({"sustained": None}) is None
assert pb.sustained_ns_of({"sustained": {"ns_per_row": -1}}) is None
assert pb.sustained_ns_of({"ns_per_row": 300.0}) is None

# series: the DeepSeek shape only, status ok only, sorted by S, per id pattern
rows = [
    {"ids": "random", "seq": 16384, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 331.0, "ns_per_row_sustained": 348.0},
    {"ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 342.0, "ns_per_row_sustained": math.nan},
    {"ids": "random", "seq": 8192, "heads": 32, "dim": 128, "topk": 2048, "ns_per_row": 300.0},
    {"ids": "causal", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 273.0, "status": "error"},
]
assert pb.series(rows, 64, 128, 2048) == {"random": [(4096, 342.0), (16384, 331.0)]}
assert pb.series(rows, 64, 128, 2048, pb.sustained_ns_of) == {"random": [(16384, 348.0)]}
# the bench subcommand's per-case floors: "floor" and "traffic_floor", DeepSeek shape, finite positive only
bench = {"cases": [
    {"seq_kv": 16384, "heads": 64, "dim": 128, "topk": 2048, "floor": {"ns_per_row": 275.2},
     "traffic_floor": {"ns_per_row": 293.6}},
    {"seq_kv": 4096, "heads": 64, "dim": 128, "topk": 2048, "floor": {"ns_per_row": 276.3},
     "traffic_floor": {"ns_per_row": 295.9}},
    {"seq_kv": 65536, "heads": 64, "dim": 128, "topk": 2048, "floor": None, "traffic_floor": {"ns_per_row": math.nan}},
    {"seq_kv": 8192, "heads": 32, "dim": 128, "topk": 2048, "floor": {"ns_per_row": 270.0},
     "traffic_floor": {"ns_per_row": 290.0}},
]}
assert pb.floor_points_of_bench(bench, 64, 128, 2048) == [(4096, 276.3), (16384, 275.2)]
assert pb.floor_points_of_bench(bench, 64, 128, 2048, "traffic_floor") == [(4096, 295.9), (16384, 293.6)]
assert pb.floor_points_of_bench([], 64, 128, 2048, "traffic_floor") == []
# which floor is drawn: --floor's, else the bench JSON's (same run as ours), else a --merged file's
f, b, m = [(4096, 281.0)], [(4096, 276.3)], [(4096, 279.9)]
assert pb.choose_floor(f, b, m) == f
assert pb.choose_floor([], b, m) == b
assert pb.choose_floor([], [], m) == m
assert pb.choose_floor([], [], []) == []
# floors of --floor / --merged files: finite positive only (a NaN, negative, bool or
# text floor is skipped like a time; it used to be drawn and to label the ratios)
merged = {"floor": [
    {"seq_kv": 4096, "heads": 64, "dim": 128, "topk": 2048, "floor_ns_per_row": 277.0},
    {"seq_kv": 8192, "heads": 64, "dim": 128, "topk": 2048, "floor_ns_per_row": math.nan},
    {"seq_kv": 16384, "heads": 64, "dim": 128, "topk": 2048, "floor_ns_per_row": -5},
    {"seq_kv": 32768, "heads": 64, "dim": 128, "topk": 2048, "floor_ns_per_row": True},
    {"seq_kv": 49152, "heads": 64, "dim": 128, "topk": 2048, "floor_ns_per_row": "n/a"},
    {"seq_kv": 65536, "heads": 64, "dim": 128, "topk": 2048, "floor_ns_per_row": math.inf},
    {"seq_kv": math.nan, "heads": 64, "dim": 128, "topk": 2048, "floor_ns_per_row": 275.0},
    "not a row",
]}
assert pb.floor_points(merged, 64, 128, 2048) == [(4096, 277.0)], pb.floor_points(merged, 64, 128, 2048)
# --op: a report of several ops draws the chosen op's cases and floors; a record without "op" is any op's
ops = [{"op": "backward", "ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 330.0,
        "seq_kv": 4096, "floor": {"ns_per_row": 276.0}},
       {"op": "forward", "ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 150.0,
        "seq_kv": 4096, "floor": {"ns_per_row": 80.0}},
       {"ids": "causal", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 140.0}]
assert pb.series(ops, 64, 128, 2048, op="forward") == {"random": [(4096, 150.0)], "causal": [(4096, 140.0)]}
assert pb.series(ops, 64, 128, 2048, op="backward") == {"random": [(4096, 330.0)], "causal": [(4096, 140.0)]}
assert pb.floor_points_of_bench({"cases": ops}, 64, 128, 2048, op="forward") == [(4096, 80.0)]
assert pb.floor_points_of_bench({"cases": ops}, 64, 128, 2048, op="backward") == [(4096, 276.0)]
# a target row without an lse is its own series
lse_rows = [{"op": "target", "ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "lse": lse,
             "ns_per_row": ns} for lse, ns in (("given", 350.0), ("absent", 650.0))]
assert pb.series(lse_rows, 64, 128, 2048, op="target") == {"random": [(4096, 350.0)], "random no-lse": [(4096, 650.0)]}
# rows with a bad S or batch give no point, not an exception
assert pb.series([{"ids": "random", "seq": math.nan, "ns_per_row": 300.0}, "x"], 64, 128, 2048) == {}
assert pb.ns_of({"seq": 4096, "batch": 0, "timing": {"median_ms": 1.0}}) is None
# malformed files: a clear exit naming the file
import json, os, tempfile
with tempfile.TemporaryDirectory() as d:
    for name, text in (("bad.json", '{"ids": '), ("number.json", "3")):
        path = os.path.join(d, name)
        with open(path, "w") as f:
            f.write(text)
        try:
            pb.load(path)
            raise AssertionError(f"load({name}) did not exit")
        except SystemExit as e:
            assert str(e).startswith(path + ": "), e
print("plot_bench times: all checks passed")
