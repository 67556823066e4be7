"""ctest scripts_peers_common_loop: bench/peers/common.py's time_cases and
run_check_into (the cudnn-frontend and TileLang peers' shared loop), on the
CPU with a stub torch: one row per case with the timings and the sustained
run, a failing case reported and the loop going on, non-finite gradients
caught, restore() before every timed call, no case alive while the next is
built (a bound restore() kept it, holding its GPU memory), and the --check
block's pass / fail / raise.
  usage: python3 peers_common_loop.py PATH/TO/bench/peers/common.py"""
import argparse
import gc
import importlib.util
import json
import os
import sys
import tempfile
import types
import weakref

path = sys.argv[1]
sys.path.insert(0, os.path.dirname(path))
spec = importlib.util.spec_from_file_location("peers_common", path)
common = importlib.util.module_from_spec(spec)
spec.loader.exec_module(common)
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


class Event:
    clock = 0.0

    def __init__(self, **_):
        self.t = None

    def record(self):
        Event.clock += 1.0  # every timed call takes 1 ms
        self.t = Event.clock

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.t - self.t


class Finite:
    def __init__(self, ok):
        self.ok = ok

    def float(self):
        return self

    def all(self):
        return self

    def item(self):
        return self.ok


common.torch = types.SimpleNamespace(
    cuda=types.SimpleNamespace(Event=Event, reset_peak_memory_stats=lambda: None,
                               max_memory_allocated=lambda: 2**30, synchronize=lambda: None,
                               empty_cache=lambda: None),
    isfinite=lambda x: x)

alive_at_make = []
cases = []


counts = {}  # S -> [runs, restores], kept outside the cases (a reference would keep them alive)


class Case:
    valid_per_row = 2048.0

    def __init__(self, S, finite=True):
        self.finite = finite
        self.counts = counts.setdefault(S, [0, 0])

    def run(self):
        self.counts[0] += 1

    def restore(self):
        self.counts[1] += 1

    def gradients(self):
        return (Finite(True), Finite(self.finite))


def make_case(kind, S):
    gc.collect()
    alive_at_make.append([r() is not None for r in cases])
    if S == 3:
        raise RuntimeError("unsupported shape")
    c = Case(S, finite=(S != 5))
    cases.append(weakref.ref(c))
    return c


with tempfile.TemporaryDirectory() as d:
    js = os.path.join(d, "peer.json")
    a = argparse.Namespace(batch=1, heads=64, dim=128, topk=2048, iters=3, warmup=1, json=js)
    info = {"results": [], "status": "ok"}
    rc = common.time_cases(a, info, ["random"], [4096, 3, 5, 8192], make_case, sustained_ms=10.0)
    check(rc == 1, f"rc {rc}, expected 1 (a case failed)")
    statuses = [r["status"] for r in info["results"]]
    check(statuses == ["ok", "error", "error", "ok"], f"statuses {statuses}")
    r0 = info["results"][0]
    check(abs(r0["ns_per_row"] - 1e6 / 4096) < 1e-9, f"ns_per_row {r0['ns_per_row']}")
    check(r0["samples"] == 3 and r0["sustained_launches"] >= 20, f"samples / sustained {r0}")
    check("unsupported shape" in info["results"][1]["reason"], info["results"][1].get("reason"))
    check(info["results"][2]["reason"].endswith("non-finite gradient"), info["results"][2].get("reason"))
    # the first call, 1 warm-up, 3 timed and n sustained calls: restore() before each
    runs, restores = counts[4096]
    check(runs == restores == 5 + r0["sustained_launches"], f"runs {runs} restores {restores}")
    check(all(not any(alive) for alive in alive_at_make), f"a case alive while the next was built: {alive_at_make}")
    with open(js) as f:
        check(len(json.load(f)["results"]) == 4, "JSON not rewritten with every case")
    check(info["status"] == "ok", "status should stay ok when some cases ran")
    info2 = {"results": [], "status": "ok"}
    common.time_cases(a, info2, ["causal"], [3], make_case)
    check(info2["status"] == "error" and "unsupported" in info2["reason"], f"all failed: {info2}")
    # --check
    check(common.run_check_into(info, lambda: {"ok": True}, js) == 0 and info["check"]["ok"], "check pass")
    check(common.run_check_into(info, lambda: {"ok": False}, js) == 1, "check fail")
    check(common.run_check_into(info, lambda: 1 / 0, js) == 1 and "ZeroDivisionError" in info["check"]["error"]
          and "wall_s" in info["check"], "check raise")

if failures:
    print("peers_common_loop: FAIL:\n  " + "\n  ".join(map(str, failures)))
    sys.exit(1)
print("peers_common_loop: time_cases and run_check_into behave")
