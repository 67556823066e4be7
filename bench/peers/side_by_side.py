#!/usr/bin/env python3
"""One table of ours and the peers on one problem, from the JSON files of one run.

  python3 bench/peers/side_by_side.py --peers PEERS.json [--ours OURS.json] [--title TEXT] [--out FILE.md]
  python3 bench/peers/side_by_side.py --peers PEERS.json --status-line

PEERS.json: what bench/peers/loss_forward_peers.py or attention_target_peers.py wrote
({"problem", "peers": {name: {status, reason, notes}}, "results": [rows]}).
OURS.json: our bench's JSON for the same cases (dsa-kl-forward-bench's list of cases, or any
list of records, or {"results" | "cases": [...]}, each with ids, seq, heads, dim, topk and
ns_per_row; with a floor: "floor": {"ns_per_row"} or "floor_ns_per_row").
Cases are matched on (ids, seq, heads, dim, topk). Prints the markdown table (and writes it
to --out): per case, ours and its floor, then each peer's ns/row and its ratio to ours (a
peer's extra timings, NAME_ns_per_row, get columns of their own), then every peer's status
and, for one that did not run, why. --status-line prints instead one line: each peer's status,
why it did not run, and its check's result. Exit: 0, 2 bad arguments or unreadable JSON.
"""

import argparse
import json
import sys

KEY = ("ids", "seq", "heads", "dim", "topk")
ALIASES = {"heads": ("heads", "hq", "num_heads"), "dim": ("dim", "dqk", "head_dim"), "seq": ("seq", "s", "seq_len"),
           "ids": ("ids", "id_pattern"), "topk": ("topk",)}


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


def fmt(x, digits=1):
    return "—" if x is None else f"{x:,.{digits}f}"


def build_table(peers_json, ours_json=None, title=None):
    """The markdown text."""
    ours = {}
    if ours_json is not None:
        for rec in records_of(ours_json):
            k = key_of(rec)
            if k is not None and isinstance(rec.get("ns_per_row"), (int, float)):
                ours[k] = rec
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
    bad = [r for r in peers_json.get("results", []) if r.get("status") not in (None, "ok")]
    for r in bad:
        lines.append(f"- {r.get('peer')} at {r.get('ids')} S{r.get('seq')} H{r.get('heads')} D{r.get('dim')}: "
                     f"{r.get('status')}: {r.get('reason', '')}")
    return "\n".join(lines) + "\n"


def status_line(peers_json):
    """'name status (reason), check passed|FAILED; ...' of every peer."""
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
    ap.add_argument("--peers", required=True, metavar="FILE", help="the peers script's JSON")
    ap.add_argument("--ours", metavar="FILE", help="our bench's JSON (absent or unreadable: ours not run)")
    ap.add_argument("--title", help="the table's heading (default: the problem's name)")
    ap.add_argument("--out", metavar="FILE", help="also write the table here")
    ap.add_argument("--status-line", action="store_true", help="print one line of the peers' statuses instead")
    a = ap.parse_args(argv)
    try:
        peers_json = load(a.peers)
        if not isinstance(peers_json, dict):
            raise ValueError("expected an object with peers and results")
    except (OSError, ValueError) as e:
        print(f"side_by_side: --peers {a.peers}: {e}", file=sys.stderr)
        return 2
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
    text = build_table(peers_json, ours_json, a.title)
    print(text, end="")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
