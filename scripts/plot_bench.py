#!/usr/bin/env python3
"""Plot ns per query row against S for our op, the peers and the floor.

Inputs (any mix):
  --merged FILE   one file holding a whole comparison: {"ours": {"results": [...]} or a list,
                  "floor": {"floor": [{"seq_kv", "floor_ns_per_row", ...}]}, "peers": [a peer's
                  JSON, ...]}; repeatable
  --ours FILE     dsaib-bench --json or `dsaib bench --json` (an object with a "cases"
                  list, whose per-case floors, measured in the same run as its times, are drawn
                  and label the ratios unless a --floor file has floors for the shape (they win
                  over a --merged file's floor), and whose traffic floors, the backward's K reads
                  and dK reduces alone, are drawn as a reference), or a plain list of case
                  records ({"ids", "seq", "ns_per_row", ...})
  --op OP         the op whose cases are drawn (default backward; a record without "op" counts as
                  any op): backward, forward, step, one-call or target
  --peers FILE    a peer's JSON (bench/peers/*.py --json): {"peer", "status", "results": [...]};
                  repeatable
  --floor FILE    floors per S of the shape ({"floor": [{"seq_kv", "floor_ns_per_row", "heads",
                  "dim", "topk"}]})
  --sustained     also draw the sustained timings (launches back to back, --sustained-ms) where
                  the JSON has them ("ns_per_row_sustained", or a case's "sustained": {"ns_per_row"}),
                  as thin lines with hollow markers and no value labels
Without a measured floor the backward's line is the fixed reference floor, 278 ns per row (the
DeepSeek shape's dK reduce at the H200's L2 scatter-add rate, 3.77 TB/s; see
kFixedFloorNsPerRow in bench/core/bench_core.hpp). Of two records of the same peer the one with the better status is drawn (ok, partial, error, ...); on a tie, a
--peers record wins over one from a --merged file. Times that are not finite positive numbers
(NaN, inf, 0, negative, true/false, strings) are never drawn.

Only the DeepSeek shape is drawn (--heads 64 --dim 128 --topk 2048 by default).
x: S = S_q = S_kv on a log2 axis; y: ns per query row (median) on a log axis.
Solid lines: causal ids; dashed: random ids. Peers that did not run are listed
under the plot with their reason.

  python3 scripts/plot_bench.py --ours out/bench/bench.json --peers out/peers/cudnn_frontend.json \
      --out bench_vs_s.png            (the files scripts/gpu_check.sh writes)
"""

import argparse
import json
import math
import sys

FIXED_FLOOR_NS = 278.0  # kFixedFloorNsPerRow of bench/core/bench_core.hpp: L2-resident dK

STYLE = {  # label, colour, marker
    "dsaib": ("dsaib (ours)", "#d62728", "o"),
    "cudnn_frontend_dsa_sm90": ("cudnn-frontend SM90", "#1f77b4", "s"),
    "tilelang_indexer_bwd_example": ("TileLang indexer_bwd example", "#2ca02c", "^"),
    "torch_eager_autograd": ("PyTorch eager autograd", "#7f7f7f", "D"),
}
EXTRA_COLOURS = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def load(path):
    """The JSON of `path`: an object or a list, else a clear exit naming the file."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise SystemExit(f"{path}: cannot read it ({e.strerror})")
    except ValueError as e:
        raise SystemExit(f"{path}: not valid JSON ({e})")
    if not isinstance(d, (dict, list)):
        raise SystemExit(f"{path}: expected a JSON object or list, got {type(d).__name__}")
    return d


def seq_value(v):
    """v as an int when it is a positive whole number (not a bool), else None."""
    v = time_value(v)
    return int(v) if v is not None and v == int(v) else None


def ours_rows(d):
    """Rows of our bench: the plain list, a {"results": [...]} record, or the bench subcommand's
    {"cases": [{"ids", "seq", "ns_per_row" | "timing"...}]}."""
    if d is None:
        return []
    if isinstance(d, list):
        return d
    for key in ("results", "cases"):
        if isinstance(d.get(key), list):
            return d[key]
    return []


def time_value(v):
    """v as a float when it is a finite positive number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v > 0 else None


def ns_of(r):
    for key in ("ns_per_row", "ns_per_row_median"):
        v = time_value(r.get(key))
        if v is not None:
            return v
    t = r.get("timing") or {}
    ms = time_value(t.get("median_ms")) if isinstance(t, dict) else None
    seq, batch = seq_value(r.get("seq")), seq_value(r.get("batch", 1))
    if ms is not None and seq is not None and batch is not None:
        return time_value(ms * 1e6 / (seq * batch))
    return None


def sustained_ns_of(r):
    """The sustained (back-to-back) ns per row of a row, or None."""
    v = time_value(r.get("ns_per_row_sustained"))
    if v is not None:
        return v
    st = r.get("sustained")
    return time_value(st.get("ns_per_row")) if isinstance(st, dict) else None


def op_matches(r, op):
    """Whether record r is of `op` (None: any; a record without "op" matches every op)."""
    return op is None or r.get("op", op) == op


def series(rows, heads, dim, topk, time_of=ns_of, op=None):
    """{ids: [(S, ns)]} for rows of the DeepSeek shape (and `op`) that have a time; a target
    row without an lse is its own series ('random no-lse')."""
    out = {}
    for r in rows:
        if not isinstance(r, dict) or r.get("status", "ok") not in ("ok",) or not op_matches(r, op):
            continue
        if (r.get("heads", heads), r.get("dim", dim), r.get("topk", topk)) != (heads, dim, topk):
            continue
        ns, seq = time_of(r), seq_value(r.get("seq"))
        if ns is None or seq is None:
            continue
        name = str(r.get("ids", "?")) + ("" if r.get("lse", "given") == "given" else " no-lse")
        out.setdefault(name, []).append((seq, ns))
    return {k: sorted(v) for k, v in out.items()}


def floor_points_of_bench(d, heads, dim, topk, key="floor", op=None):
    """Per-case floors of the bench's JSON report ({"cases": [{"seq_kv", key: {"ns_per_row"}}]}) for
    the shape (and `op`): key "floor" (the floor) or "traffic_floor" (the K reads and dK reduces alone)."""
    pts = {}
    for c in (d or {}).get("cases", []) if isinstance(d, dict) else []:
        if not isinstance(c, dict) or (c.get("heads"), c.get("dim"), c.get("topk")) != (heads, dim, topk):
            continue
        if not op_matches(c, op):
            continue
        f = c.get(key)
        ns = time_value(f.get("ns_per_row")) if isinstance(f, dict) else None
        seq = seq_value(c.get("seq_kv"))
        if ns is not None and seq is not None:
            pts[seq] = ns
    return sorted(pts.items())


def peer_status(p):
    """A peer record's status; a record without one counts as ok when any result row is ok."""
    if p.get("status"):
        return p["status"]
    return "ok" if any(r.get("status", "ok") == "ok" for r in p.get("results") or []) else None


def floor_points(d, heads, dim, topk):
    if not isinstance(d, dict):
        return []
    pts = []
    for r in d.get("floor", []) or []:
        if not isinstance(r, dict) or (r.get("heads"), r.get("dim"), r.get("topk")) != (heads, dim, topk):
            continue
        ns, seq = time_value(r.get("floor_ns_per_row")), seq_value(r.get("seq_kv"))
        if ns is not None and seq is not None:  # like the times: only finite positive floors are drawn
            pts.append((seq, ns))
    return sorted(set(pts))


def choose_floor(explicit, bench, merged):
    """The floor points drawn and used for the ratio labels: the first non-empty of a --floor
    file's, the --ours bench JSON's (measured in the same run as its times) and the first
    --merged file's that has floors for the shape; [] draws the fixed 278 ns line."""
    return explicit or bench or merged or []


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--merged", action="append", default=[],
                    help="a combined file {\"ours\", \"floor\", \"peers\": [...]} (repeatable: runs are combined; "
                         "ours and the floor come from the first file that has them, unless --ours / --floor "
                         "give them)")
    ap.add_argument("--ours", help="our bench JSON")
    ap.add_argument("--peers", action="append", default=[], help="a peer JSON (repeatable)")
    ap.add_argument("--floor", help="a JSON of floors per S ({\"floor\": [...]})")
    ap.add_argument("--op", default="backward", choices=("backward", "forward", "step", "one-call", "target"),
                    help="the op of --ours whose cases and floors are drawn (default backward)")
    ap.add_argument("--out", default="bench_vs_s.png", help="PNG to write (default bench_vs_s.png)")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--title", default=None)
    ap.add_argument("--sustained", action="store_true",
                    help="also draw the sustained (back-to-back) timings where the JSON has them")
    a = ap.parse_args(argv)
    if not (a.merged or a.ours or a.peers):
        ap.error("give --merged, or --ours and/or --peers")

    ours, merged_floor, peers, gpu = [], [], [], None
    for path in a.merged:
        m = load(path)
        if not ours:
            ours = ours_rows(m.get("ours"))
        if not merged_floor:
            merged_floor = floor_points(m.get("floor"), a.heads, a.dim, a.topk)
        peers += list(m.get("peers", []))
        gpu = gpu or m.get("gpu")
    bench_floor, traffic_floor = [], []
    if a.ours:
        ours_json = load(a.ours)
        ours = ours_rows(ours_json)
        bench_floor = floor_points_of_bench(ours_json, a.heads, a.dim, a.topk, op=a.op)
        traffic_floor = floor_points_of_bench(ours_json, a.heads, a.dim, a.topk, "traffic_floor", op=a.op)
    explicit_floor = floor_points(load(a.floor), a.heads, a.dim, a.topk) if a.floor else []
    fpts = choose_floor(explicit_floor, bench_floor, merged_floor)
    peers = [load(p) for p in a.peers] + peers  # explicit --peers records first: they win ties
    # one record per peer: the first that ran wins over "not selected" / unavailable ones
    rank = {"ok": 0, "partial": 1, "error": 2, "unavailable": 3, "not_selected": 4}
    best = {}
    for p in peers:
        p["status"] = peer_status(p)
        name = p.get("peer", "peer")
        if name not in best or rank.get(p.get("status"), 5) < rank.get(best[name].get("status"), 5):
            best[name] = p
    peers = [p for p in best.values() if p.get("status") != "not_selected"]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(13, 6.5), dpi=120)
    all_s, all_ns = set(), []
    missing = []
    floor_at = dict(fpts)

    labels = []  # point annotations; spread apart per S once the axes are final (spread_labels)

    extra_colour = {}  # peers without a STYLE entry: one colour each, in the order they are drawn

    def draw(key, rows, label_extra="", ratio=False, op=None):
        if key not in STYLE and key not in extra_colour:
            extra_colour[key] = EXTRA_COLOURS[len(extra_colour) % len(EXTRA_COLOURS)]
        label, colour, marker = STYLE.get(key, (key, extra_colour.get(key), "v"))
        drawn = False
        for ids, pts in sorted(series(rows, a.heads, a.dim, a.topk, op=op).items()):
            xs, ys = zip(*pts)
            all_s.update(xs)
            all_ns.extend(ys)
            causal = ids.startswith("causal")  # causal and causal-shuffled: solid, labels below
            ax.plot(xs, ys, linestyle="-" if causal else "--", marker=marker, color=colour, linewidth=2,
                    markersize=6, label=f"{label}{label_extra}, {ids} ids")
            for x, y in pts:
                text = f"{y:,.0f}"
                if ratio and (x in floor_at or a.op == "backward"):
                    text += f" ({y / floor_at.get(x, FIXED_FLOOR_NS):.2f}x floor)"
                labels.append(ax.annotate(text, (x, y), textcoords="offset points",
                                          xytext=(7, -11 if causal else 4), fontsize=7, color=colour))
            drawn = True
        if a.sustained:
            for ids, pts in sorted(series(rows, a.heads, a.dim, a.topk, sustained_ns_of, op=op).items()):
                xs, ys = zip(*pts)
                all_s.update(xs)
                all_ns.extend(ys)
                ax.plot(xs, ys, linestyle="-" if ids.startswith("causal") else "--", marker=marker,
                        markerfacecolor="none", color=colour, linewidth=1, alpha=0.6, markersize=6,
                        label=f"{label}{label_extra}, {ids} ids, sustained")
                drawn = True
        for r in rows:  # cases that ran but have no time: say so under the plot
            if isinstance(r, dict) and r.get("status", "ok") != "ok":
                missing.append(f"{label} {r.get('ids', '')} S{r.get('seq', '')}: {r.get('status')}"
                               + (f" ({str(r.get('reason'))[:80]})" if r.get("reason") else ""))
        return drawn

    if not draw("dsaib", ours, ratio=True, op=a.op):
        missing.append("dsaib (ours): no results")
    for p in peers:
        name = p.get("peer", "peer")
        status = p.get("status")
        extra = " (partial)" if status == "partial" else ""
        if (p.get("check") or {}).get("ok") is False:  # timed, but its gradients missed the fp64 tolerance
            extra += " (FAILED its accuracy check)"
        if status not in ("ok", "partial") or not draw(name, p.get("results", []), extra):
            label = STYLE.get(name, (name,))[0]
            reason = p.get("reason") or next((r.get("reason") for r in p.get("results", []) if r.get("reason")), "")
            missing.append(f"{label}: {status or 'no results'}" + (f" ({reason})" if reason else ""))

    if fpts:
        xs, ys = zip(*fpts)
        all_s.update(xs)
        what = {"backward": "dK scatter-add at the measured L2 reduce rate",
                "forward": "key gather or GEMM1, the best way of each measured"}.get(a.op, "its terms measured")
        ax.plot(xs, ys, color="black", linestyle=":", linewidth=2, marker="x",
                label=f"floor, measured in this run ({what})")
        all_ns.extend(ys)
    elif a.op == "backward":  # the fixed reference floor is the backward's
        ax.axhline(FIXED_FLOOR_NS, color="black", linestyle=":", linewidth=2,
                   label=f"fixed reference floor {FIXED_FLOOR_NS:.0f} ns/row (not measured in this run)")
        all_ns.append(FIXED_FLOOR_NS)

    if traffic_floor:  # drawn only with the bench subcommand's JSON, which measures it in the same run
        xs, ys = zip(*traffic_floor)
        all_s.update(xs)
        ax.plot(xs, ys, color="#555555", linestyle=(0, (1, 3)), linewidth=1.5, marker="+",
                label="traffic floor, same run (K reads + dK reduces alone; a reference, not the floor)")
        all_ns.extend(ys)

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if all_s:
        ticks = sorted(all_s)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v):,}"))
        ax.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)
    if all_ns:
        lo, hi = min(all_ns) / 1.6, max(all_ns) * 1.8
        ax.set_ylim(lo, hi)
        ticks = [m * 10 ** e for e in range(0, 9) for m in (1, 2, 3, 5) if lo <= m * 10 ** e <= hi]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("S = S_q = S_kv (log2)")
    ax.set_ylabel("ns per query row (median, log)")
    op_title = {"backward": "indexer backward", "forward": "indexer loss forward", "step": "indexer loss step",
                "one-call": "indexer loss and gradients in one call", "target": "attention target"}[a.op]
    ax.set_title(a.title or f"DSA {op_title}, B1 H{a.heads} D{a.dim} topk {a.topk}, bf16 inputs"
                 + (f"\n{gpu.split(',')[0]}" if gpu else ""))
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", axis="y", alpha=0.12)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9,
              title="solid: causal ids, dashed: random ids", title_fontsize=8)
    bottom = 0.0
    if missing:
        lines = ["not plotted:"] + [f"  {m[:160]}" for m in missing[:8]]
        fig.text(0.01, 0.01, "\n".join(lines), fontsize=7, color="#444444", va="bottom", family="monospace")
        bottom = 0.035 * len(lines)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    spread_labels(fig, ax, labels)
    fig.savefig(a.out)
    print(f"wrote {a.out}")
    return 0


def spread_labels(fig, ax, labels, gap_pt=9.0, offsets_pt=(4.0, -11.0, 13.0, -20.0)):
    """Keeps the point labels at one S apart and in the order of their points:
    each label sits at one of `offsets_pt` from its own point (points above or
    below it); of all choices (up to 8 labels per S) the one with the fewest
    order inversions wins (a label never sits above the label of a higher
    point), then the fewest overlaps (baselines closer than gap_pt), then the
    least movement from each label's default. Labels of different S never meet."""
    import itertools

    to_pt = 72.0 / fig.dpi
    by_x = {}
    for t in labels:
        by_x.setdefault(t.xy[0], []).append((ax.transData.transform(t.xy)[1] * to_pt, t))
    for group in by_x.values():
        if len(group) > 8:
            continue
        defaults = [t.xyann[1] for _, t in group]
        best = None
        for sides in itertools.product(offsets_pt, repeat=len(group)):
            ys = [base + dy for (base, _), dy in zip(group, sides)]
            inversions = sum(1 for a, b in itertools.combinations(range(len(group)), 2)
                             if (group[a][0] - group[b][0]) * (ys[a] - ys[b]) < 0)
            order = sorted(ys)
            overlaps = sum(hi - lo < gap_pt for lo, hi in zip(order, order[1:]))
            moved = sum(abs(dy - d) for dy, d in zip(sides, defaults))
            if best is None or (inversions, overlaps, moved) < best[0]:
                best = ((inversions, overlaps, moved), sides)
        for (_, t), dy in zip(group, best[1]):
            t.xyann = (t.xyann[0], dy)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (AttributeError, TypeError, KeyError) as e:  # a JSON of another shape than the benches write
        sys.exit(f"plot_bench.py: malformed input ({type(e).__name__}: {e})")
