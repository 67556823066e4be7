"""ctest scripts_peers_forward_target: the pure-Python parts of the loss-forward and
attention-target peers (bench/peers/), on the CPU:
- side_by_side.py: the table of ours and the peers (values, ratios, a peer's extra timing, an
  unavailable peer's reason, a failed row), --status-line, one backward peer's JSON, our cases
  of one op, and the floor check (a peer faster than the floor it is compared with fails, naming
  the peer, its time and the floor; a peer that leaves the floor's work out is not held to it);
- attention_target_peers.parse_shapes, common.load_module_from (a package with a relative
  import, as Megatron-Core's TileLang files are loaded);
- with torch: the torch eager loss forward and attention target against the float64 closed
  forms (and a wrong sm_scale / lse caught: the checks can fail), the target's inputs (each
  row's unnormalised T sums to Hq, which TileLang's kernel relies on), the KL reference.
  usage: python3 peers_forward_target.py PATH/TO/bench/peers"""
import io
import json
import math
import os
import sys
import tempfile
from contextlib import redirect_stdout

peers_dir = sys.argv[1]
sys.path.insert(0, peers_dir)
import common  # noqa: E402
import side_by_side  # noqa: E402
import attention_target_peers  # noqa: E402
import loss_forward_peers  # noqa: E402

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


# --------------------------------------------------------------------------- side_by_side
peers_json = {
    "problem": "loss_forward",
    "peers": {"torch_eager": {"status": "ok", "notes": ["eager note"], "check": {"ok": True}},
              "cudnn_frontend": {"status": "ok", "notes": [], "check": {"ok": False}},
              "tilelang": {"status": "unavailable", "reason": "tilelang is not installed", "notes": []}},
    "results": [
        {"peer": "torch_eager", "ids": "causal", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048,
         "status": "ok", "ns_per_row": 3200.0, "valid_slots_per_row": 1536.0},
        {"peer": "cudnn_frontend", "ids": "causal", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048,
         "status": "ok", "ns_per_row": 400.0, "with_loss_ns_per_row": 520.0},
        {"peer": "torch_eager", "ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048,
         "status": "oom", "reason": "CUDA out of memory"},
    ]}
ours = [{"ids": "causal", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 160.0,
         "floor": {"ns_per_row": 80.0}},
        {"ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 200.0,
         "floor_ns_per_row": 100.0}]
text = side_by_side.build_table(peers_json, ours)
row = next((ln for ln in text.splitlines() if ln.startswith("| causal | 4096")), "")
check(row == "| causal | 4096 | 64 | 128 | 2048 | 1,536.0 | 160.0 | 80.0 | 2.00 | 3,200.0 | 20.00 | 400.0 | 2.50 | 520.0 |",
      f"causal row: {row!r}")
row = next((ln for ln in text.splitlines() if ln.startswith("| random | 4096")), "")
check(row.startswith("| random | 4096 | 64 | 128 | 2048 | — | 200.0 | 100.0 | 2.00 | oom | — | not run |"), f"random row: {row!r}")
check("tilelang ns/row" not in text, "an unavailable peer got a column")
check("**tilelang**: unavailable: tilelang is not installed." in text, "the unavailable peer's reason is missing")
check("**cudnn_frontend**: ok; check FAILED." in text, "a failed check is not said")
check("CUDA out of memory" in text, "the failed row's reason is missing")
head = next((ln for ln in text.splitlines() if ln.startswith("| ids")), "")
check("cudnn_frontend (with_loss) ns/row" in head, f"extra timing column missing: {head}")
check("Ours: not run" in side_by_side.build_table(peers_json, None), "ours absent is not said")
line = side_by_side.status_line(peers_json)
check(line == "torch_eager ok, check passed; cudnn_frontend ok, check FAILED; tilelang unavailable "
              "(tilelang is not installed)", f"status line {line!r}")
with tempfile.TemporaryDirectory() as d:
    pj, oj, md = (os.path.join(d, f) for f in ("p.json", "o.json", "t.md"))
    json.dump(peers_json, open(pj, "w"))
    json.dump({"results": ours}, open(oj, "w"))
    with redirect_stdout(io.StringIO()):
        rc = side_by_side.main(["--peers", pj, "--ours", oj, "--out", md])
    check(rc == 0 and "| causal | 4096" in open(md).read(), "side_by_side main --out")
    open(oj, "w").write("{not json")
    with redirect_stdout(io.StringIO()):
        rc = side_by_side.main(["--peers", pj, "--ours", oj])
    check(rc == 0, "an unreadable ours must not stop the table")
    with redirect_stdout(io.StringIO()):
        rc = side_by_side.main(["--peers", oj])
    check(rc == 2, "an unreadable peers JSON must be refused")

# the floor check: a peer faster than our floor fails the run, naming the peer, its time and the floor
below_floor = {"problem": "loss_forward",
        "peers": {"cudnn_frontend": {"status": "ok"},
                  "tilelang": {"status": "ok", "floor_bound": False, "floor_note": "starts from the logits"}},
        "results": [
            {"peer": "cudnn_frontend", "ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048,
             "status": "ok", "ns_per_row": 88.5},
            {"peer": "tilelang", "ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048,
             "status": "ok", "ns_per_row": 22.0}]}
report = {"tool": "dsaib-bench", "cases": [
    {"op": "backward", "ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 330.0,
     "floor": {"ns_per_row": 276.0}},
    {"op": "forward", "ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 150.0,
     "floor": {"ns_per_row": 125.0}}]}
ours_fwd = side_by_side.ours_records(report, "forward")
# the target's cases without an lse are not ours beside the peers (they are given an lse)
target_cases = {"cases": [
    {"op": "target", "ids": "random", "seq": 4096, "heads": 64, "dim": 192, "topk": 2048, "lse": lse, "ns_per_row": ns}
    for lse, ns in (("given", 350.0), ("absent", 650.0))]}
ours_target = side_by_side.ours_records(target_cases, "target")
check([r["ns_per_row"] for r in ours_target.values()] == [350.0], f"target records {ours_target!r}")
bad = side_by_side.floor_violations(below_floor, ours_fwd)
check([(v[0], v[2], v[3]) for v in bad] == [("cudnn_frontend", 88.5, 125.0)], f"floor violations {bad!r}")
text = side_by_side.build_table(below_floor, report)
check("| random | 4096 | 64 | 128 | 2048 | — | 150.0 | 125.0 | 1.20 |" in text, "ours' forward case (not the backward's)")
check("**floor check FAILED**: peer cudnn_frontend ran random S4096 H64 D128 topk 2048 in 88.5 ns/row, faster than "
      "the floor it is compared with, 125.0 ns/row" in text, f"violation not in the table:\n{text}")
check("not held to our floor: starts from the logits" in text, "floor_note not shown")
with tempfile.TemporaryDirectory() as d:
    pj, oj = os.path.join(d, "p.json"), os.path.join(d, "o.json")
    json.dump(below_floor, open(pj, "w"))
    json.dump(report, open(oj, "w"))
    err = io.StringIO()
    from contextlib import redirect_stderr
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        rc = side_by_side.main(["--peers", pj, "--ours", oj])
    check(rc == 1, f"a peer faster than the floor must fail the check, rc {rc}")
    check("floor check FAILED: peer cudnn_frontend ran random S4096 H64 D128 topk 2048 in 88.5 ns/row" in err.getvalue()
          and "125.0 ns/row" in err.getvalue(), f"stderr: {err.getvalue()!r}")
    # at or above the floor: no failure
    below_floor["results"][0]["ns_per_row"] = 125.0
    json.dump(below_floor, open(pj, "w"))
    with redirect_stdout(io.StringIO()):
        rc = side_by_side.main(["--peers", pj, "--ours", oj])
    check(rc == 0, f"a peer at the floor must pass, rc {rc}")
    # one backward peer's JSON (cudnn_frontend_dsa.py's), against ours' backward floor; --op picks it
    one = {"peer": "cudnn_frontend_dsa_sm90", "status": "ok", "notes": ["whole op"],
           "results": [{"ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "status": "ok",
                        "ns_per_row": 270.0}]}
    json.dump(one, open(pj, "w"))
    err = io.StringIO()
    with redirect_stdout(io.StringIO()) as out, redirect_stderr(err):
        rc = side_by_side.main(["--peers", pj, "--ours", oj])
    check(rc == 1 and "peer cudnn_frontend_dsa_sm90 ran random S4096 H64 D128 topk 2048 in 270.0 ns/row" in err.getvalue()
          and "276.0 ns/row" in err.getvalue(), f"one backward peer: rc {rc}, {err.getvalue()!r}")
    check("| random | 4096 | 64 | 128 | 2048 | — | 330.0 | 276.0 | 1.20 | 270.0 | 0.82 |" in out.getvalue(),
          f"one backward peer's row: {out.getvalue()!r}")
    # the backward's floor of the valid slots, where ours has it, is the one a peer is held to
    report["cases"][0]["floor"]["valid_slots_ns_per_row"] = 260.0
    json.dump(report, open(oj, "w"))
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        rc = side_by_side.main(["--peers", pj, "--ours", oj])
    check(rc == 0, f"a peer above the valid slots' floor failed the check, rc {rc}")
    one["results"][0]["ns_per_row"] = 250.0
    json.dump(one, open(pj, "w"))
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        rc = side_by_side.main(["--peers", pj, "--ours", oj])
    check(rc == 1 and "260.0 ns/row" in err.getvalue(), f"valid slots' floor: rc {rc}, {err.getvalue()!r}")
    # a peer that leaves the floor's work out (floor_bound false) is not held to it
    one["floor_bound"] = False
    json.dump(one, open(pj, "w"))
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        rc = side_by_side.main(["--peers", pj, "--ours", oj])
    check(rc == 0, f"a peer not held to the floor failed the check, rc {rc}")
    # two files at once: the peers of both, one table
    two = os.path.join(d, "two.json")
    one["floor_bound"] = True
    one["results"][0]["ns_per_row"] = 900.0
    json.dump(one, open(pj, "w"))
    json.dump({"peer": "torch_eager_autograd", "status": "ok", "results": [
        {"ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048, "status": "ok", "ns_per_row": 2700.0}]},
        open(two, "w"))
    with redirect_stdout(io.StringIO()) as out:
        rc = side_by_side.main(["--peers", pj, "--peers", two, "--ours", oj])
    check(rc == 0 and "| 900.0 | 2.73 | 2,700.0 | 8.18 |" in out.getvalue(), f"two peers: rc {rc}, {out.getvalue()!r}")

# --------------------------------------------------------------------------- parsing, loading
check(attention_target_peers.parse_shapes("128x576, 64X192") == [(128, 576), (64, 192)], "parse_shapes")
for bad in ("128", "128x", "0x64", "ax64", ""):
    try:
        attention_target_peers.parse_shapes(bad)
        failures.append(f"parse_shapes accepted {bad!r}")
    except ValueError:
        pass
with tempfile.TemporaryDirectory() as d:
    open(os.path.join(d, "main_mod.py"), "w").write("from .helper import VALUE\nDOUBLE = 2 * VALUE\n")
    open(os.path.join(d, "helper.py"), "w").write("VALUE = 21\n")
    mod = common.load_module_from(d, ("main_mod.py", "helper.py"), "peers_test_pkg")
    check(mod.DOUBLE == 42, "load_module_from: relative import")
    try:
        common.load_module_from(d, ("main_mod.py", "absent.py"), "peers_test_pkg2")
        failures.append("load_module_from: a missing file was not reported")
    except FileNotFoundError as e:
        check("absent.py" in str(e), f"load_module_from's error names the file: {e}")

# --------------------------------------------------------------------------- numerics (torch)
torch = common.torch
if torch is None:
    print("peers_forward_target: torch not installed: the numeric checks are not run")
else:
    torch.manual_seed(0)
    B, S, H, D, K = 1, 40, 8, 32, 24
    q, w, k, ids, t = common.make_inputs(B, S, H, D, K, "causal", "cpu", 7)
    sm = 1.0 / math.sqrt(D)
    rows = 7  # several blocks, the last one short
    loss, lse = loss_forward_peers.eager_kl_forward(q, w, k, ids, t, sm, 0.8, rows)
    ref_loss, ref_lse, _ = common.reference_kl_forward(q.double(), w.double(), k.double(), ids, t.double(), sm, 0.8)
    err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    check(err < 1e-3, f"eager loss rel err {err}")
    check((lse.double() - ref_lse).abs().max().item() < 5e-2, "eager LSE")
    bad_loss, _ = loss_forward_peers.eager_kl_forward(q, w, k, ids, t, 2 * sm, 0.8, rows)
    check(abs(bad_loss.item() - ref_loss.item()) / abs(ref_loss.item()) > 1e-3, "a wrong sm_scale is not caught")
    # the KL reference: 0 when T = P, positive otherwise
    valid, _, _, _, _, z = common._reference_logits(q.double(), w.double(), k.double(), ids, sm)
    p = common.reference_softmax(q.double(), w.double(), k.double(), ids, sm)
    kl, grad = common.reference_kl_divergence(p[0], z[0], valid[0])
    check(kl.abs().max().item() < 1e-12 and grad.abs().max().item() < 1e-12, "KL(P || P) != 0")
    kl, _ = common.reference_kl_divergence(t[0].double(), z[0], valid[0])
    several = valid[0].sum(dim=-1) > 1
    check(bool((kl[several] > 0).all()) and kl.min().item() > -1e-12, "KL(T || P) not positive")
    # the attention target
    Hq, Dqk = 4, 64
    for kind in ("causal", "random"):
        sc = 1.0 / math.sqrt(Dqk)
        q2, kv, ids2, lse2 = common.make_target_problem(1, S, Hq, Dqk, K, kind, "cpu", 11, sc)
        tu, tref = common.reference_target(q2.double(), kv.double(), ids2, lse2.double(), sc)
        sums = tu.sum(dim=-1)
        check((sums - Hq).abs().max().item() < 1e-4, f"{kind}: unnormalised T rows sum to {sums.min()}..{sums.max()}, not Hq")
        out = torch.empty(ids2.shape, dtype=torch.float32)
        attention_target_peers.eager_target(q2, kv, ids2, lse2, sc, rows, out)
        e = common.rel_err(out, tref)
        check(e < 2e-2, f"{kind}: eager T rel RMS {e}")
        check(bool((out[ids2 < 0] == 0).all()), f"{kind}: T not 0 at -1 slots")
        attention_target_peers.eager_target(q2, kv, ids2, lse2, 3 * sc, rows, out)
        check(common.rel_err(out, tref) > 2e-2, f"{kind}: a wrong softmax_scale is not caught")

if failures:
    print("peers_forward_target: FAIL:\n  " + "\n  ".join(map(str, failures)))
    sys.exit(1)
print("peers_forward_target: side_by_side, parsing, loading" + ("" if torch is None else ", eager vs float64")
      + " behave")
