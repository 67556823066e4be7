#!/usr/bin/env python3
"""Dump one PyTorch training step of a DSA lightning indexer as a dsaib problem file.

Given the indexer's forward tensors q (B, S, H, D), k (B, S, D) and w (B, S, H), this computes
what the forward pass and the main attention hand to the indexer's distillation loss:

  logits        z[b,t,s] = sm_scale * sum_h w[b,t,h] * relu(q[b,t,h,:] . k[b,s,:]),  causal (s <= t)
  topk_indices  the topk largest z of each row, -1 where the row has fewer than topk keys
  index_score   P = softmax of z over the selected slots (0 at empty slots), in fp32
  attn_score    T = a toy sparse attention over the same slots: random multi-head queries and
                keys, softmax per head over the selected slots, summed over heads, L1-normalised

and writes them with safetensors.torch.save_file under the names and metadata that
`dsaib backward --in FILE` reads (docs/math.md has the backward they feed):

  tensors   index_q bf16 (B,S,H,D), weights bf16 (B,S,H), index_k bf16 (B,S,D),
            topk_indices int32 (B,S,topk), attn_score f32 (B,S,topk), index_score f32 (B,S,topk)
  metadata  sm_scale, loss_coeff, grad_loss, layout ("bshd"), id_mode ("local"|"global"), ...

Examples (CPU, small default sizes):
  python3 scripts/dump_torch_step.py --out step.safetensors
  python3 scripts/dump_torch_step.py --qkw my_forward.safetensors --topk 2048 --out step.safetensors
  dsaib backward --in step.safetensors --verify all

--qkw FILE reads q, k and w (tensors index_q, index_k, weights) from a safetensors file instead of
drawing them at random. --with-grads also stores the loss's gradients computed by torch autograd
in fp64 (torch_d_index_q, torch_d_weights, torch_d_index_k; f32), an independent cross-check that
the CLI ignores. Needs torch and safetensors.
"""
import argparse
import math
import sys

try:
    import torch
    from safetensors.torch import load_file, save_file
except ImportError as e:  # --help and the error below need neither
    torch = None
    _IMPORT_ERROR = e

EPS = math.exp(-100.0)  # the loss's probability floor (docs/math.md)


def indexer_logits(q, k, w, sm_scale, block=128):
    """Causal indexer logits z (B, S, S) in fp32; -inf above the diagonal (s > t)."""
    B, S, H, D = q.shape
    qf, kf, wf = q.float(), k.float(), w.float()
    z = torch.empty(B, S, S, dtype=torch.float32, device=q.device)
    for t0 in range(0, S, block):  # blocks of query rows bound the (B, T, H, S) temporary
        t1 = min(S, t0 + block)
        x = torch.einsum("bthd,bsd->bths", qf[:, t0:t1], kf)
        z[:, t0:t1] = sm_scale * torch.einsum("bths,bth->bts", x.relu(), wf[:, t0:t1])
    t = torch.arange(S, device=q.device).view(1, S, 1)
    s = torch.arange(S, device=q.device).view(1, 1, S)
    return z.masked_fill(s > t, float("-inf"))


def select_topk(z, topk):
    """ids (B, S, topk) int64 with -1 at empty slots, their logits (-inf there), and the valid mask."""
    B, S, S_kv = z.shape
    k_eff = min(topk, S_kv)
    vals, ids = torch.topk(z, k_eff, dim=-1)  # largest first; row t has t+1 finite logits
    valid = torch.isfinite(vals)
    if k_eff < topk:  # fewer keys than topk: pad with empty slots
        pad = topk - k_eff
        vals = torch.cat([vals, vals.new_full((B, S, pad), float("-inf"))], dim=-1)
        ids = torch.cat([ids, ids.new_zeros((B, S, pad))], dim=-1)
        valid = torch.cat([valid, valid.new_zeros((B, S, pad))], dim=-1)
    ids = torch.where(valid, ids, torch.full_like(ids, -1))
    vals = vals.masked_fill(~valid, float("-inf"))
    return ids, vals, valid


def gather_rows(x, ids):
    """x (B, S_kv, ...) gathered at ids (B, S, K) (empty slots read row 0): (B, S, K, ...)."""
    b = torch.arange(x.shape[0], device=x.device).view(-1, 1, 1)
    return x[b, ids.clamp(min=0)]


def toy_attention_scores(ids, valid, attn_heads, attn_dim, gen):
    """T: the main attention's distribution over the selected slots, summed over heads, L1-normalised."""
    B, S, K = ids.shape
    qa = torch.randn(B, S, attn_heads, attn_dim, generator=gen)
    ka = torch.randn(B, S, attn_dim, generator=gen)  # one shared (MQA/MLA-like) key per token
    logits = torch.einsum("bthd,btkd->bthk", qa, gather_rows(ka, ids)) / math.sqrt(attn_dim)
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=2)  # (B, S, K)
    probs = torch.where(valid, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def torch_gradients(q, k, w, ids, valid, attn_score, sm_scale, loss_coeff, grad_loss, norm):
    """Autograd (fp64) of Loss = -c * sum_valid max(T, eps) * log(max(P, eps)), P = softmax of z over valid slots."""
    qd = q.double().requires_grad_()
    kd = k.double().requires_grad_()
    wd = w.double().requires_grad_()
    x = torch.einsum("bthd,btkd->bthk", qd, gather_rows(kd, ids))
    z = sm_scale * torch.einsum("bthk,bth->btk", x.relu(), wd)
    z = z.masked_fill(~valid, float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    # log(max(P, eps)): slots with P < eps are clipped out of the gradient.
    logp = torch.where(p >= EPS, logp, torch.full_like(logp, math.log(EPS)))
    t = attn_score.double().clamp_min(EPS)
    per_slot = torch.where(valid, t * logp, torch.zeros_like(logp))
    loss = -(grad_loss * loss_coeff / norm) * per_slot.sum()
    loss.backward()
    return qd.grad.float(), wd.grad.float(), kd.grad.float()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="torch_step.safetensors", help="output problem file")
    ap.add_argument("--qkw", help="read index_q, index_k, weights from this safetensors file")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256, help="S = S_q = S_kv")
    ap.add_argument("--heads", type=int, default=16, help="index heads H (multiple of 8, <= 128)")
    ap.add_argument("--head-dim", type=int, default=64, choices=[64, 128])
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--attn-heads", type=int, default=4, help="heads of the toy main attention")
    ap.add_argument("--attn-dim", type=int, default=32, help="head dim of the toy main attention")
    ap.add_argument("--sm-scale", type=float, default=None, help="default 1/sqrt(head_dim)")
    ap.add_argument("--loss-coeff", type=float, default=1.0)
    ap.add_argument("--grad-loss", type=float, default=1.0)
    ap.add_argument("--id-mode", choices=["local", "global"], default="local")
    ap.add_argument("--weights-f32", action="store_true", help="store weights as f32 instead of bf16")
    ap.add_argument("--with-grads", action="store_true", help="also store torch autograd gradients (fp64 -> f32)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if torch is None:
        sys.exit(f"dump_torch_step.py: needs torch and safetensors (pip install torch safetensors): {_IMPORT_ERROR}")

    gen = torch.Generator().manual_seed(args.seed)
    if args.qkw:
        src = load_file(args.qkw)
        q, k, w = src["index_q"], src["index_k"], src["weights"]
        if q.dim() != 4 or k.dim() != 3 or w.dim() != 3 or k.shape[:2] != q.shape[:2] or w.shape != q.shape[:3]:
            raise SystemExit(f"{args.qkw}: expected index_q (B,S,H,D), index_k (B,S,D), weights (B,S,H); "
                             f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(w.shape)}")
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    else:
        B, S, H, D = args.batch, args.seq, args.heads, args.head_dim
        q = torch.randn(B, S, H, D, generator=gen).to(torch.bfloat16)
        k = torch.randn(B, S, D, generator=gen).to(torch.bfloat16)
        w = torch.randn(B, S, H, generator=gen) / math.sqrt(H)
    w = w.to(torch.float32 if args.weights_f32 else torch.bfloat16)
    B, S, H, D = q.shape
    sm_scale = args.sm_scale if args.sm_scale is not None else 1.0 / math.sqrt(D)

    with torch.no_grad():
        z = indexer_logits(q, k, w, sm_scale)
        ids, vals, valid = select_topk(z, args.topk)
        index_score = torch.softmax(vals, dim=-1).nan_to_num(0.0)
        index_score = torch.where(valid, index_score, torch.zeros_like(index_score))
        attn_score = toy_attention_scores(ids, valid, args.attn_heads, args.attn_dim, gen)

    stored_ids = ids
    if args.id_mode == "global":  # flat rows of index_k viewed as (B*S, D)
        offset = (torch.arange(B) * S).view(B, 1, 1)
        stored_ids = torch.where(valid, ids + offset, ids)
    tensors = {
        "index_q": q.contiguous(),
        "weights": w.contiguous(),
        "index_k": k.contiguous(),
        "topk_indices": stored_ids.to(torch.int32).contiguous(),
        "attn_score": attn_score.float().contiguous(),
        "index_score": index_score.float().contiguous(),
    }
    if args.with_grads:
        dq, dw, dk = torch_gradients(q, k, w, ids, valid, attn_score, sm_scale, args.loss_coeff, args.grad_loss,
                                     norm=B * S)
        tensors.update(torch_d_index_q=dq.contiguous(), torch_d_weights=dw.contiguous(),
                       torch_d_index_k=dk.contiguous())
    metadata = {
        "sm_scale": repr(float(sm_scale)),
        "loss_coeff": repr(float(args.loss_coeff)),
        "grad_loss": repr(float(args.grad_loss)),
        "layout": "bshd",
        "id_mode": args.id_mode,
        "ids": "causal",
        "seed": str(args.seed),
        "generator": "scripts/dump_torch_step.py",
    }
    save_file(tensors, args.out, metadata=metadata)
    n_valid = int(valid.sum())
    print(f"wrote {args.out}: B={B} S={S} H={H} D={D} topk={args.topk} ids {args.id_mode}, "
          f"{n_valid} valid slots of {B * S * args.topk}, sm_scale={sm_scale:.6g}")


if __name__ == "__main__":
    main()
