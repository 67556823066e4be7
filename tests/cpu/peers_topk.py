"""ctest scripts_peers_topk: the pure-Python parts of bench/peers/topk_peers.py, on the CPU:
- its row counts and visible keys (causal and cp-shard, as dsaib-bench --op topk counts them);
- the recall of a selection against the float64 top-k (a wrong selection scores low: the
  check can fail);
- side_by_side.py matches its rows ("ranges") with dsaib-bench's topk cases, and holds every
  peer but an fp8 one (floor_bound false) to our floor;
- without a GPU, the default run is a no-op that says so and exits 77 (every peer
  unavailable in its JSON);
- with torch: the torch_chunked peer on the cpu (--device cpu) against the float64 top-k,
  with chunks of one row and of all rows (the same ids).
  usage: python3 peers_topk.py PATH/TO/bench/peers"""
import io
import json
import os
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout

peers_dir = sys.argv[1]
sys.path.insert(0, peers_dir)
import common  # noqa: E402
import side_by_side  # noqa: E402
import topk_peers  # noqa: E402

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


# --------------------------------------------------------------------------- counts
check(topk_peers.query_rows("causal", 1000) == 1000 and topk_peers.query_rows("cp-shard", 1000) == 500,
      "query rows")

# --------------------------------------------------------------------------- side_by_side on the top-k's rows
peers_json = {"problem": "indexer_topk",
              "peers": {"torch_chunked": {"status": "ok"},
                        "deep_gemm": {"status": "ok", "floor_bound": False, "floor_note": "fp8"}},
              "results": [
                  {"peer": "torch_chunked", "ranges": "cp-shard", "seq": 16384, "heads": 64, "dim": 128,
                   "topk": 2048, "status": "ok", "ns_per_row": 900.0},
                  {"peer": "deep_gemm", "ranges": "cp-shard", "seq": 16384, "heads": 64, "dim": 128,
                   "topk": 2048, "status": "ok", "ns_per_row": 50.0}]}
report = {"tool": "dsaib-bench", "cases": [
    {"op": "topk", "ranges": "cp-shard", "seq": 16384, "seq_q": 8192, "heads": 64, "dim": 128, "topk": 2048,
     "ns_per_row": 300.0, "floor": {"ns_per_row": 200.0}},
    {"op": "backward", "ids": "causal", "seq": 16384, "heads": 64, "dim": 128, "topk": 2048, "ns_per_row": 1.0,
     "floor": {"ns_per_row": 1.0}}]}
ours = side_by_side.ours_records(report, side_by_side.default_op(peers_json))
check(len(ours) == 1 and list(ours.values())[0]["op"] == "topk", f"ours' topk cases: {ours!r}")
check(side_by_side.floor_violations(peers_json, ours) == [], "a peer at or above the floor, or fp8, was flagged")
text = side_by_side.build_table(peers_json, report)
check("| cp-shard | 16384 | 64 | 128 | 2048 |" in text and "| 300.0 | 200.0 | 1.50 | 900.0 | 3.00 |" in text,
      f"the topk row:\n{text}")
peers_json["results"][0]["ns_per_row"] = 150.0  # faster than the floor: the floor would be wrong
bad = side_by_side.floor_violations(peers_json, ours)
check([(v[0], v[2], v[3]) for v in bad] == [("torch_chunked", 150.0, 200.0)], f"floor violations {bad!r}")

# --------------------------------------------------------------------------- without a GPU: a no-op, exit 77
if common.torch is None or not common.torch.cuda.is_available():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        out = io.StringIO()
        with redirect_stdout(out), redirect_stderr(io.StringIO()):
            rc = topk_peers.main(["--json", path])
        check(rc == common.UNAVAILABLE, f"no GPU: exit {rc}, expected {common.UNAVAILABLE}")
        rec = json.load(open(path))
        check(rec["status"] == "unavailable" and all(p["status"] == "unavailable" for p in rec["peers"].values())
              and set(rec["peers"]) == set(topk_peers.PEERS), f"no GPU JSON: {rec!r}")
        check("no peer can run" in out.getvalue(), f"no GPU message: {out.getvalue()!r}")
# bad arguments: exit 2
for args in (["--ranges", "random"], ["--peers", "flashmla"], ["--seq", "1"], ["--iters", "0"]):
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        try:
            topk_peers.main(args)
            check(False, f"{args} accepted")
        except SystemExit as e:
            check(e.code == 2, f"{args}: exit {e.code}")

# --------------------------------------------------------------------------- with torch: the chunked peer
torch = common.torch
if torch is not None:
    class A:
        chunk_mib = 2048
    for ranges in ("causal", "cp-shard"):
        inp = topk_peers.Inputs(ranges, 160, 8, 32, 24, "cpu", 7)
        check(inp.Q == topk_peers.query_rows(ranges, 160) and int(inp.ends[-1]) == 160 and int(inp.ends[0]) == 161 - inp.Q,
              f"{ranges}: ranges")
        check(abs(inp.visible_per_row - (inp.ends.double().mean().item())) < 1e-9, f"{ranges}: visible keys per row")
        logits, sets = topk_peers.reference_topk(inp)
        check(all(len(s) == min(24, int(e)) for s, e in zip(sets, inp.ends.tolist())), f"{ranges}: reference counts")
        op = topk_peers.TorchChunkedOp(inp, A.chunk_mib)
        op.run()
        r = topk_peers.recall(op.selection(), sets)
        check(r >= topk_peers.MIN_RECALL["torch_chunked"], f"{ranges}: torch_chunked recall {r}")
        # rows seeing fewer keys than topk: -1 past their count
        ids = op.selection()
        for t in range(inp.Q):
            n = min(24, int(inp.ends[t]))
            if not (bool((ids[t, :n] >= 0).all()) and bool((ids[t, n:] == -1).all())):
                check(False, f"{ranges}: row {t} padding")
                break
        one = topk_peers.TorchChunkedOp(inp, A.chunk_mib)
        one.rows = 1
        one.run()
        # the same sets (torch.topk orders exact ties, such as rows' all-zero ReLUs, as it likes)
        check(torch.equal(one.selection().sort(dim=1).values, ids.sort(dim=1).values),
              f"{ranges}: chunks of one row select other keys")
        # a wrong selection (the lowest-ranked keys) scores low: the check can fail
        worst = torch.topk(logits.masked_fill(torch.isinf(logits), float("inf")), 24, largest=False).indices
        check(topk_peers.recall(worst, sets) < 0.5, f"{ranges}: a wrong selection passed")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        with redirect_stdout(io.StringIO()):
            rc = topk_peers.main(["--device", "cpu", "--peers", "torch_chunked,deep_gemm", "--seq", "96",
                                  "--heads", "8", "--dim", "32", "--topk", "16", "--iters", "1", "--warmup", "0",
                                  "--check", "--check-seq", "96", "--check-topk", "16", "--json", path])
        rec = json.load(open(path))
        check(rc == 0 and rec["peers"]["torch_chunked"]["check"]["ok"], f"cpu run: rc {rc}, {rec['peers']!r}")
        check(rec["peers"]["deep_gemm"]["status"] == "unavailable", "deep_gemm on the cpu")
        rows = [r for r in rec["results"] if r["peer"] == "torch_chunked"]
        check(len(rows) == 2 and all(r["status"] == "ok" and r["ns_per_row"] > 0 for r in rows), f"rows {rows!r}")

if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("topk peers: counts, recall, side-by-side matching and floor check, no-GPU exit, cpu torch peer ok")
