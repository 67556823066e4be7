#!/usr/bin/env python3
"""Train a small lightning indexer with dsaib's backward: the loss falls, and a PNG shows it.

A fixed random input X (B, S, M) feeds two projections, the indexer's queries
and keys, and a third one, its per-head weights:

    index_q = X Wq  (B, S, H, D)     index_k = X Wk  (B, S, D)     weights = X Ww  (B, S, H)

A random *teacher* indexer of the same form picks, for every query token, the
top-k earlier keys by its own score (causal; -1 where a token has fewer than
topk earlier keys) and defines the target distribution T over them (its
softmax). The *student* (Wq, Wk, Ww) starts elsewhere and is fitted to T by
gradient descent on dsaib.torch.indexer_kl_loss, whose gradients the dsaib
custom ops form (the sm_90a kernels on --device cuda, the fp64 CPU backend on
--device cpu). The loss is a cross-entropy; KL = loss - H(T) goes towards 0.

    python3 python/examples/train_indexer.py --device cpu                      # toy size, seconds
    python3 python/examples/train_indexer.py --device cuda --preset deepseek   # H64 D128 topk 2048, S 4096

Writes a PNG of the loss curve (matplotlib if installed, else a plain plot
drawn by this script) and a CSV of the values. Exit status: 0 when the KL fell
by at least --min-drop (default 50%), 1 otherwise, 2 on error.
"""
import argparse
import csv
import math
import os
import struct
import sys
import time
import zlib

PRESETS = {
    # batch, seq, heads, head_dim, topk, model_dim, steps, lr
    "toy": dict(batch=1, seq=64, heads=8, head_dim=64, topk=16, model_dim=32, steps=80, lr=3e-2),
    "deepseek": dict(batch=1, seq=4096, heads=64, head_dim=128, topk=2048, model_dim=256, steps=150, lr=1e-2),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="sizes: toy (default on cpu) or deepseek (default on cuda: B1 S4096 H64 D128 topk2048)")
    for name in ("batch", "seq", "heads", "head_dim", "topk", "model_dim", "steps"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"override the preset's {name}")
    ap.add_argument("--lr", type=float, default=None, help="Adam learning rate (preset's by default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--print-every", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="torch.compile the loss (forward and backward)")
    ap.add_argument("--out", default="indexer_loss.png", help="PNG of the loss curve (default indexer_loss.png)")
    ap.add_argument("--csv", default=None, help="CSV of the loss values (default: beside the PNG, .csv)")
    ap.add_argument("--min-drop", type=float, default=0.5,
                    help="exit 1 unless the final KL is at most (1 - min_drop) times the first (default 0.5)")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset or ("deepseek" if args.device.startswith("cuda") else "toy")]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


# ---- the problem --------------------------------------------------------------


def teacher_targets(torch, dt, X, Wq, Wk, Ww, H, D, topk, sm_scale):
    """Causal top-k ids of the teacher's scores and its softmax T over them."""
    B, S, _ = X.shape
    q = (X @ Wq).view(B, S, H, D).to(torch.bfloat16)
    k = (X @ Wk).to(torch.bfloat16)
    w = X @ Ww
    ids = torch.empty(B, S, topk, dtype=torch.int32, device=X.device)
    chunk = max(1, (1 << 25) // (H * S))
    pos = torch.arange(S, device=X.device)
    for b in range(B):
        kf = k[b].float()
        for t0 in range(0, S, chunk):
            t1 = min(S, t0 + chunk)
            x = torch.einsum("thd,sd->ths", q[b, t0:t1].float(), kf)          # (c, H, S)
            z = sm_scale * torch.einsum("th,ths->ts", w[b, t0:t1], torch.relu(x))
            z = z.masked_fill(pos[None, :] > pos[t0:t1, None], float("-inf"))  # causal
            val, idx = torch.topk(z, min(topk, S), dim=-1)
            idx = torch.where(torch.isfinite(val), idx, torch.full_like(idx, -1)).to(torch.int32)
            if topk > S:
                idx = torch.cat([idx, idx.new_full((t1 - t0, topk - S), -1)], dim=-1)
            ids[b, t0:t1] = idx
    T = dt.index_scores(q, w, k, ids, sm_scale=sm_scale)
    return ids, T


def entropy(torch, T, ids, normalization):
    valid = ids >= 0
    Tc = T.double().clamp_min(math.exp(-100.0))
    return (-(torch.where(valid, Tc * Tc.log(), torch.zeros_like(Tc)).sum()) / normalization).item()


# ---- the plot -------------------------------------------------------------------


def save_plot(path, steps, losses, kls, title):
    """matplotlib if available; else a plain PNG drawn here. Returns a line saying which."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ax[0].plot(steps, losses, color="tab:blue")
        ax[0].set_xlabel("step")
        ax[0].set_ylabel("loss (cross-entropy)")
        ax[0].set_title("indexer KL loss")
        ax[1].semilogy(steps, [max(v, 1e-12) for v in kls], color="tab:red")
        ax[1].set_xlabel("step")
        ax[1].set_ylabel("KL(T || P) = loss - H(T)")
        ax[1].set_title("distance to the teacher")
        for a in ax:
            a.grid(True, alpha=0.3)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return f"wrote {path} (matplotlib)"
    except ImportError:
        write_plain_png(path, losses)
        return f"matplotlib is not installed: wrote {path} as a plain line plot (no labels); values in the CSV"


def write_plain_png(path, values, width=640, height=400, margin=40):
    """A white canvas, axes, and the curve in blue; no text (no font without matplotlib)."""
    img = [[(255, 255, 255)] * width for _ in range(height)]

    def dot(x, y, c):
        if 0 <= x < width and 0 <= y < height:
            img[y][x] = c

    def line(x0, y0, x1, y1, c):
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for ox in (0, 1):
                for oy in (0, 1):
                    dot(x0 + ox, y0 + oy, c)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    grey, black, blue = (220, 220, 220), (0, 0, 0), (31, 119, 180)
    for i in range(1, 5):
        y = margin + i * (height - 2 * margin) // 5
        line(margin, y, width - margin, y, grey)
    line(margin, height - margin, width - margin, height - margin, black)
    line(margin, margin, margin, height - margin, black)
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    n = max(len(values) - 1, 1)
    pts = [(margin + i * (width - 2 * margin) // n,
            height - margin - int((v - lo) / span * (height - 2 * margin))) for i, v in enumerate(values)]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        line(x0, y0, x1, y1, blue)
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


# ---- main -------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("train_indexer.py needs torch (pip install torch); the dsaib package itself does not", file=sys.stderr)
        return 2
    import dsaib
    import dsaib.torch as dt

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: torch sees no CUDA device", file=sys.stderr)
            return 2
        if not dsaib.cuda_backend_available():
            print("--device cuda: this dsaib has no usable cuda backend (a CPU-only build, or no sm_90 GPU); "
                  "build it with -C cmake.define.DSAIB_ENABLE_CUDA=ON (docs/python.md)", file=sys.stderr)
            return 2
    B, S, H, D, K, M = args.batch, args.seq, args.heads, args.head_dim, args.topk, args.model_dim
    sm_scale = D ** -0.5
    torch.manual_seed(args.seed)

    def init(*shape, scale):
        return (torch.randn(*shape, device=device) * scale).requires_grad_()

    X = torch.randn(B, S, M, device=device)
    with torch.no_grad():
        tWq, tWk, tWw = (torch.randn(M, H * D, device=device) * M ** -0.5,
                         torch.randn(M, D, device=device) * M ** -0.5,
                         torch.randn(M, H, device=device) * M ** -0.5)
        t0 = time.perf_counter()
        ids, T = teacher_targets(torch, dt, X, tWq, tWk, tWw, H, D, K, sm_scale)
        if device.type == "cuda":
            torch.cuda.synchronize()
        setup_s = time.perf_counter() - t0
    N = B * S
    h_T = entropy(torch, T, ids, N)
    Wq, Wk, Ww = init(M, H * D, scale=M ** -0.5), init(M, D, scale=M ** -0.5), init(M, H, scale=M ** -0.5)
    opt = torch.optim.Adam([Wq, Wk, Ww], lr=args.lr)

    def loss_fn(Wq, Wk, Ww):
        q = (X @ Wq).view(B, S, H, D)          # rounded to bf16 inside the loss (straight-through)
        k = X @ Wk
        w = X @ Ww
        return dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=sm_scale)

    step_fn = torch.compile(loss_fn, fullgraph=True) if args.compile else loss_fn
    backend = "cuda (sm_90a kernel)" if device.type == "cuda" else "cpu (fp64 reference backend)"
    valid = int((ids >= 0).sum())
    print(f"dsaib {dsaib.__version__} | torch {torch.__version__} | device {device} | backward backend {backend}")
    print(f"B={B} S={S} H={H} D={D} topk={K} model_dim={M} | valid slots {valid} of {ids.numel()} | "
          f"H(T)={h_T:.4f} | teacher setup {setup_s:.2f} s")
    steps, losses, kls = [], [], []
    t_start = time.perf_counter()
    t_last = t_start
    for step in range(args.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = step_fn(Wq, Wk, Ww)
        loss.backward()
        value = loss.item()  # one host sync per step, for the log
        if not math.isfinite(value):
            print(f"step {step}: non-finite loss {value}", file=sys.stderr)
            return 1
        steps.append(step)
        losses.append(value)
        kls.append(value - h_T)
        if step % args.print_every == 0 or step == args.steps:
            now = time.perf_counter()
            per = (now - t_last) / (args.print_every if step else 1) * 1e3
            t_last = now
            print(f"step {step:5d}  loss {value:.5f}  KL {value - h_T:.5f}  ({per:.1f} ms/step)", flush=True)
        if step < args.steps:
            opt.step()
    total = time.perf_counter() - t_start

    csv_path = args.csv or os.path.splitext(args.out)[0] + ".csv"
    for path in (args.out, csv_path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["step", "loss", "kl"])
        wr.writerows(zip(steps, losses, kls))
    title = (f"dsaib indexer training: {device.type}, B{B} S{S} H{H} D{D} topk{K}, Adam lr {args.lr}, "
             f"{args.steps} steps, {total:.1f} s")
    print(save_plot(args.out, steps, losses, kls, title))
    print(f"wrote {csv_path}")
    first, last = kls[0], kls[-1]
    drop = 1.0 - last / first if first > 0 else 0.0
    print(f"KL {first:.5f} -> {last:.5f} ({100 * drop:.1f}% lower) in {args.steps} steps, {total:.2f} s")
    if drop < args.min_drop:
        print(f"FAIL: the KL fell by {100 * drop:.1f}%, less than --min-drop {100 * args.min_drop:.0f}%")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
