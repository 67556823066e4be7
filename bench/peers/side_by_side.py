#!/usr/bin/env python3
"""One table of ours and the peers on one problem, from the JSON files of one run, and the
floor check: a peer must not run faster than the floor it is compared with.

  python3 bench/peers/side_by_side.py --peers PEERS.json [--peers ...] [--ours OURS.json] [--op OP]
                                      [--title TEXT] [--out FILE.md]
  python3 bench/peers/side_by_side.py --peers PEERS.json --status-line

PEERS.json: what bench/peers/loss_forward_peers.py or attention_target_peers.py wrote
({"problem", "peers": {name: {status, reason, notes, floor_bound}}, "results": [rows]}), or
what one backward peer (cudnn_frontend_dsa.py, tilelang_indexer_bwd.py, torch_eager.py) wrote
(topk_peers.py too: its rows' "ranges" match on ids)
({"peer", "status", "notes", "floor_bound", "results": [rows]}); --peers repeats.
OURS.json: our bench's JSON for the same cases (dsaib-bench's report, {"cases": [...]}, or any
list of records, or {"results": [...]}), each with ids, seq, heads, dim, topk and ns_per_row;
with a floor: "floor": {"ns_per_row"} or "floor_ns_per_row". --op picks our cases of one op
(default: forward for the loss-forward peers, target for the attention-target peers, topk for
the top-k peers, else backward; a record without "op" is any op's).
Cases are matched on (ids, seq, heads, dim, topk). Prints the markdown table (and writes it
to --out): per case, ours and its floor, then each peer's ns/row and its ratio to ours (a
peer's extra timings, NAME_ns_per_row, get columns of their own), then every peer's status
and, for one that did not run, why. --status-line prints instead one line: each peer's status,
why it did not run, and its check's result.
The floor check: a peer row that ran (status ok) at a case where ours has a floor, of a peer
whose timed call does at least the floor's work (floor_bound, true unless the peer's record
says false, and why, in floor_note), must not be faster than that floor (the floor of the
case's valid slots where ours' record has it: floor.valid_slots_ns_per_row): the floor would
be wrong. Each such row is named on stderr and in the table (peer, case, its ns/row, the floor).
Exit: 0, 1 a peer ran faster than the floor it is compared with, 2 bad arguments or an
unreadable --peers JSON.
"""

import argparse
import json
import sys

KEY = ("ids", "seq", "heads", "dim", "topk")
ALIASES = {"heads": ("heads", "hq", "num_heads"), "dim": ("dim", "dqk", "head_dim"), "seq": ("seq", "s", "seq_len"),
           "ids": ("ids", "id_pattern", "ranges"), "topk": ("topk",)}


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def records_of(obj):
    """The list of case records in one of our benches' JSON files."""
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        for k in ("results", "cases"):
            if isinstance(obj.get(k), list):
                return obj[k]
    raise ValueError("expected a list of cases, or an object with a list under results or cases")


def key_of(rec):
    """(ids, seq, heads, dim, topk) of a record, None when one is missing."""
    out = []
    for k in KEY:
        v = next((rec[a] for a in ALIASES[k] if a in rec), None)
        if v is None:
            return None
        out.append(str(v) if k == "ids" else int(v))
    return tuple(out)


def floor_of(rec):
    f = rec.get("floor")
    if isinstance(f, dict) and isinstance(f.get("ns_per_row"), (int, float)):
        return float(f["ns_per_row"])
    v = rec.get("floor_ns_per_row")
    return float(v) if isinstance(v, (int, float)) else None


PROBLEM_OP = {"loss_forward": "forward", "attention_target": "target", "indexer_topk": "topk"}


def normalize_peers(obj):
    """A peers JSON as {"problem", "peers": {name: record}, "results": [rows with "peer"], ...}:
    the multi-peer form as it is, the one-peer form ({"peer", "status", "results"}) wrapped."""
    if not isinstance(obj, dict):
        raise ValueError("expected an object with peers and results, or one peer's {peer, results}")
    if "peers" in obj or "peer" not in obj:
        return obj
    name = obj["peer"]
    record = {k: obj[k] for k in ("status", "reason", "notes", "check", "versions", "floor_bound", "floor_note")
              if k in obj}
    record.setdefault("status", "ok" if any(r.get("status") == "ok" for r in obj.get("results") or []) else "?")
    rows = [{**r, "peer": name} for r in obj.get("results") or [] if isinstance(r, dict)]
    out = {k: v for k, v in obj.items() if k not in ("peer", "results", "notes", "check", "versions")}
    out.update(peers={name: record}, results=rows)
    return out


def merge_peers(objs):
    """Several peers JSON files (normalize_peers each) as one."""
    merged = {"peers": {}, "results": []}
    for obj in objs:
        obj = normalize_peers(obj)
        for k, v in obj.items():
            if k not in ("peers", "results"):
                merged.setdefault(k, v)
        merged["peers"].update(obj.get("peers", {}))
        merged["results"] += list(obj.get("results", []))
    return merged


def ours_records(ours_json, op):
    """{case key: record} of our cases of `op` that have a time; of the target only the
    cases with an lse given, as the peers are given one."""
    ours = {}
    for rec in records_of(ours_json):
        if not isinstance(rec, dict) or (op is not None and rec.get("op", op) != op):
            continue
        if rec.get("lse", "given") != "given":
            continue
        k = key_of(rec)
        if k is not None and isinstance(rec.get("ns_per_row"), (int, float)):
            ours[k] = rec
    return ours


def check_floor_of(rec):
    """The floor a peer is held to: the floor of the case's valid slots where our record has it
    (the backward's floor counts topk slots per row, more than a causal row holds), else the floor."""
    f = rec.get("floor")
    if isinstance(f, dict) and isinstance(f.get("valid_slots_ns_per_row"), (int, float)):
        return float(f["valid_slots_ns_per_row"])
    return floor_of(rec)


def floor_violations(peers_json, ours):
    """[(peer, case key, peer ns/row, floor ns/row)] of peer rows faster than our floor."""
    out = []
    peers = peers_json.get("peers", {})
    for r in peers_json.get("results", []):
        name = r.get("peer")
        if r.get("status") != "ok" or peers.get(name, {}).get("floor_bound", True) is False:
            continue
        k = key_of(r)
        ns = r.get("ns_per_row")
        fl = check_floor_of(ours[k]) if k in ours else None
        if isinstance(ns, bool) or not isinstance(ns, (int, float)) or fl is None:
            continue
        if ns < fl:
            out.append((name, k, float(ns), fl))
    return out


def case_text(k):
    return f"{k[0]} S{k[1]} H{k[2]} D{k[3]} topk {k[4]}"


def violation_text(v):
    name, k, ns, fl = v
    return (f"peer {name} ran {case_text(k)} in {ns:,.1f} ns/row, faster than the floor it is compared with, "
            f"{fl:,.1f} ns/row: that floor is wrong")


def fmt(x, digits=1):
    return "—" if x is None else f"{x:,.{digits}f}"


def default_op(peers_json):
    return PROBLEM_OP.get(peers_json.get("problem"), "backward")


def build_table(peers_json, ours_json=None, title=None, op=None):
    """The markdown text (op: our cases of this op; None: the peers' problem's)."""
    peers_json = normalize_peers(peers_json)
    op = op or default_op(peers_json)
    ours = ours_records(ours_json, op) if ours_json is not None else {}
    peers = peers_json.get("peers", {})
    names = list(peers)
    rows = {}
    extras = {n: [] for n in names}
    for r in peers_json.get("results", []):
        k = key_of(r)
        if k is None or r.get("peer") not in peers:
            continue
        rows.setdefault(k, {})[r["peer"]] = r
        for field in r:
            if field.endswith("_ns_per_row") and field[:-11] not in extras[r["peer"]]:
                extras[r["peer"]].append(field[:-11])
    keys = sorted(set(rows) | set(ours), key=lambda k: (k[2], k[3], k[4], k[0], k[1]))
    head = ["ids", "S", "H", "D", "topk", "valid/row", "ours ns/row", "floor ns/row", "ours × floor"]
    for n in names:
        if peers[n].get("status") != "ok":
            continue
        head += [f"{n} ns/row", f"{n} ÷ ours"]
        head += [f"{n} ({e}) ns/row" for e in extras[n]]
    lines = []
    problem = peers_json.get("problem", "")
    lines.append(f"### {title or problem}")
    lines.append("")
    if peers_json.get("device"):
        lines.append(f"{peers_json['device']}, torch {peers_json.get('torch', '?')}; "
                     f"{peers_json.get('timing', '')}.")
        lines.append("")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for k in keys:
        o = ours.get(k)
        o_ns = float(o["ns_per_row"]) if o else None
        fl = floor_of(o) if o else None
        valid = (o or {}).get("valid_slots_per_row")
        if valid is None:
            valid = next((r.get("valid_slots_per_row") for r in rows.get(k, {}).values()), None)
        cells = [k[0], str(k[1]), str(k[2]), str(k[3]), str(k[4]), fmt(valid), fmt(o_ns), fmt(fl),
                 fmt(o_ns / fl if o_ns and fl else None, 2)]
        for n in names:
            if peers[n].get("status") != "ok":
                continue
            r = rows.get(k, {}).get(n)
            if r is None:
                cells += ["not run", "—"] + ["—"] * len(extras[n])
                continue
            if r.get("status") != "ok":
                cells += [r.get("status", "error"), "—"] + ["—"] * len(extras[n])
                continue
            ns = float(r["ns_per_row"])
            cells += [fmt(ns), fmt(ns / o_ns if o_ns else None, 2)]
            cells += [fmt(r.get(f"{e}_ns_per_row")) for e in extras[n]]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if ours_json is None:
        lines.append("Ours: not run (no JSON of our bench).")
    elif any(floor_of(o) is not None for o in ours.values()):
        bad = floor_violations(peers_json, ours)
        for v in bad:
            lines.append(f"- **floor check FAILED**: {violation_text(v)}.")
        if not bad:
            lines.append("Floor check: every peer whose timed call does the floor's work ran at or above ours' floor.")
        lines.append("")
    for n in names:
        p = peers[n]
        status = p.get("status", "?")
        check = p.get("check")
        check_txt = "" if not isinstance(check, dict) else (
            "; check passed" if check.get("ok") else f"; check FAILED{': ' + check['error'] if check.get('error') else ''}")
        why = f": {p.get('reason')}" if status != "ok" and p.get("reason") else ""
        lines.append(f"- **{n}**: {status}{why}{check_txt}.")
        for note in p.get("notes", []):
            lines.append(f"  - {note}")
        if p.get("floor_bound", True) is False:
            lines.append(f"  - not held to our floor: {p.get('floor_note') or 'its timed call leaves part of its work out'}")
    bad = [r for r in peers_json.get("results", []) if r.get("status") not in (None, "ok")]
    for r in bad:
        lines.append(f"- {r.get('peer')} at {r.get('ids')} S{r.get('seq')} H{r.get('heads')} D{r.get('dim')}: "
                     f"{r.get('status')}: {r.get('reason', '')}")
    return "\n".join(lines) + "\n"


def status_line(peers_json):
    """'name status (reason), check passed|FAILED; ...' of every peer."""
    peers_json = normalize_peers(peers_json)
    parts = []
    for n, p in peers_json.get("peers", {}).items():
        txt = f"{n} {p.get('status', '?')}"
        if p.get("reason"):
            txt += f" ({p['reason']})"
        if isinstance(p.get("check"), dict):
            txt += ", check passed" if p["check"].get("ok") else ", check FAILED"
        parts.append(txt)
    return "; ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", required=True, action="append", metavar="FILE",
                    help="a peers script's JSON, or one backward peer's (repeatable)")
    ap.add_argument("--ours", metavar="FILE", help="our bench's JSON (absent or unreadable: ours not run)")
    ap.add_argument("--op", choices=("backward", "forward", "step", "one-call", "target", "topk"),
                    help="our cases of this op (default: the peers' problem's)")
    ap.add_argument("--title", help="the table's heading (default: the problem's name)")
    ap.add_argument("--out", metavar="FILE", help="also write the table here")
    ap.add_argument("--status-line", action="store_true", help="print one line of the peers' statuses instead")
    a = ap.parse_args(argv)
    objs = []
    for path in a.peers:
        try:
            obj = load(path)
            normalize_peers(obj)
        except (OSError, ValueError) as e:
            print(f"side_by_side: --peers {path}: {e}", file=sys.stderr)
            return 2
        objs.append(obj)
    peers_json = objs[0] if len(objs) == 1 else merge_peers(objs)
    if a.status_line:
        print(status_line(peers_json))
        return 0
    ours_json = None
    if a.ours:
        try:
            ours_json = load(a.ours)
            records_of(ours_json)
        except (OSError, ValueError) as e:
            print(f"side_by_side: --ours {a.ours}: {e}: ours not shown", file=sys.stderr)
            ours_json = None
    text = build_table(peers_json, ours_json, a.title, a.op)
    print(text, end="")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    bad = []
    if ours_json is not None:
        normalized = normalize_peers(peers_json)
        bad = floor_violations(normalized, ours_records(ours_json, a.op or default_op(normalized)))
    for v in bad:
        print(f"side_by_side: floor check FAILED: {violation_text(v)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
