"""Megatron-Core's DSA layer (DSAttention with its DSAIndexer) on the CPU or on
one GPU (a case's "device"), run once with dsa_kernel_backend="dsaib" and once
with "none" (Megatron's torch path) on the same parameters and inputs, for
python/tests/test_megatron.py.

Run as a script it is one rank of a process group (gloo; with NCCL beside it
for the collectives of CUDA tensors when the cases run on a GPU, all of a
case file's cases on one kind of device): ``python megatron_layer.py
RANK WORLD INIT_FILE CASE_FILE OUT_FILE`` runs every case of CASE_FILE and
saves what each backend gave (the loss, the ids the main attention got, the
layer's output, the indexer's parameter gradients, the indexer's q/k/weights).

The indexer's linear projections are plain bf16 linear stand-ins with the
build arguments Megatron passes (its DSA spec takes them from Transformer
Engine, which has no CPU build): the training example's DuplicatedLinear
(examples/megatron_duplicated_linear.py); everything else is Megatron's own
code.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

# The indexer's linear stand-in is the training example's, in examples/.
sys.path.append(str(Path(__file__).resolve().parents[2] / "examples"))
from megatron_duplicated_linear import DuplicatedLinear  # noqa: E402


def make_config(case, backend, tp, cp):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1, hidden_size=case["hidden"], num_attention_heads=case["heads"] * tp, ffn_hidden_size=64,
        multi_latent_attention=True, q_lora_rank=case["q_lora"], kv_lora_rank=case["kv_lora"],
        qk_head_dim=32, qk_pos_emb_head_dim=case["rope"], v_head_dim=32, rope_type="rope",
        experimental_attention_variant="dsa", dsa_indexer_n_heads=case["H"], dsa_indexer_head_dim=case["D"],
        dsa_indexer_topk=case["topk"], dsa_indexer_loss_coeff=case["loss_coeff"],
        dsa_indexer_use_sparse_loss=True, dsa_kernel_backend=backend, dsa_indexer_rotate_activation=False,
        calculate_per_token_loss=case.get("per_token", False),
        tensor_model_parallel_size=tp, context_parallel_size=cp, cp_comm_type="allgather",
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        # WrappedTorchNorm keeps float32 weights, which torch's CUDA layer_norm
        # refuses with bf16 keys: on a GPU the key norm runs on float32 keys.
        dsa_indexer_k_norm_fp32=case.get("device", "cpu") == "cuda",
        init_method_std=case["init_std"], use_cpu_initialization=True)


def make_layer(config, pg_collection):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant.dsa import (DSAIndexer, DSAIndexerSubmodules,
                                                                               DSAttention, DSAttentionSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    indexer = ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear, k_norm=WrappedTorchNorm,
        linear_weights_proj=DuplicatedLinear))
    return DSAttention(config, DSAttentionSubmodules(indexer=indexer), layer_number=None,
                       attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=None,
                       k_channels=config.kv_lora_rank + config.qk_pos_emb_head_dim, cp_comm_type="allgather",
                       pg_collection=pg_collection)


def rank_rows(lengths, cp, rank):
    """The rows of the whole (packed) sequence rank `rank` holds: Megatron's
    all-gather CP layout, each sequence cut in 2cp chunks, chunks rank and
    2cp-1-rank."""
    rows, start = [], 0
    for n in lengths:
        c = n // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            rows.extend(range(start + chunk * c, start + (chunk + 1) * c))
        start += n
    return torch.tensor(rows, dtype=torch.long)


class Capture:
    """Records, through patched Megatron functions, the indexer's q/k/weights,
    the ids its main attention received, and the indexer loss attached to the
    output."""

    def __init__(self):
        from megatron.core.transformer.experimental_attention_variant import dsa

        self.dsa, self.kernels = dsa, dsa.dsa_kernels
        self.before, self.attention, self.scaler = (dsa.DSAIndexer.forward_before_topk, dsa._run_sparse_attention,
                                                    dsa.DSAIndexerLossAutoScaler.apply)
        self.hook = self.kernels.run_fused_qk_topk_with_loss
        self.clear()

    def clear(self):
        self.record = {}

    def __enter__(self):
        rec = self

        def before(module, *a, **k):
            q, kk, w = rec.before(module, *a, **k)
            for name, t in (("dq", q), ("dk", kk), ("dw", w)):
                if t.requires_grad:
                    t.register_hook(lambda g, name=name: rec.record.__setitem__(name, g.detach().float().clone()))
            return q, kk, w

        def hook(config, q, k, weights, index_topk, starts, ends, *a, **kw):
            # what both paths select from: k gathered over CP, each row's [start, end)
            rec.record["topk_inputs"] = tuple(t.detach().clone() for t in (q, k, weights, starts, ends))
            return rec.hook(config, q, k, weights, index_topk, starts, ends, *a, **kw)

        def attention(**k):
            rec.record["ids"] = k["topk_indices"].detach().clone()
            return rec.attention(**k)

        def scaler(output, loss):
            rec.record["loss"] = loss.detach().clone()
            return rec.scaler(output, loss)

        self.dsa.DSAIndexer.forward_before_topk = before
        self.dsa._run_sparse_attention = attention
        self.dsa.DSAIndexerLossAutoScaler.apply = scaler
        self.kernels.run_fused_qk_topk_with_loss = hook
        return self

    def __exit__(self, *exc):
        self.dsa.DSAIndexer.forward_before_topk = self.before
        self.dsa._run_sparse_attention = self.attention
        self.dsa.DSAIndexerLossAutoScaler.apply = self.scaler
        self.kernels.run_fused_qk_topk_with_loss = self.hook


MAX_DRAWS = 4


def layer_inputs(case, tp, cp, tp_rank, cp_rank, draw=0):
    """This rank's slice of the case's whole inputs (made from its seed and the
    draw, the same on every rank): sequence rows by the CP layout, attention
    heads by the TP rank."""
    g = torch.Generator().manual_seed(case["seed"] + 7919 * draw)
    lengths = case["lengths"]
    S, b = sum(lengths), case["b"]
    heads, dqk = case["heads"] * tp, case["kv_lora"] + case["rope"]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    full = dict(x=rnd(S, b, case["hidden"]), qr=rnd(S, b, case["q_lora"]), query=rnd(S, b, heads, dqk),
                key=rnd(S, b, 1, dqk, scale=case.get("key_scale", 1.0)),
                up_v=rnd(heads, 32, case["kv_lora"]), grad_out=rnd(S, b, heads * 32))
    rows = rank_rows(lengths, cp, cp_rank) if cp > 1 else torch.arange(S)
    hs = slice(tp_rank * case["heads"], (tp_rank + 1) * case["heads"])
    out = {n: full[n].index_select(0, rows) for n in ("x", "qr", "key")}
    out["query"] = full["query"].index_select(0, rows)[:, :, hs]
    out["up_v"] = full["up_v"][hs]
    out["grad_out"] = full["grad_out"].index_select(0, rows).view(len(rows), b, heads, 32)[:, :, hs].reshape(
        len(rows), b, -1)
    return out


def float64_logits(q, k, w):
    """[b, sq, skv]: sum_h w * ReLU(q . k) in float64 from Megatron's [sq, b, H, D], [skv, b, D], [sq, b, H]."""
    return torch.einsum("sbhd,tbd->bsht", q.double(), k.double()).relu().mul(
        w.double().transpose(0, 1).unsqueeze(-1)).sum(2)


#: A row whose k-th and (k+1)-th visible logits lie closer than this (relative
#: to its largest |logit|) may select other keys in float32 (Megatron) than in
#: float64 (dsaib) without either being wrong; its loss then differs by more
#: than rounding. Inputs with such a row are redrawn.
AMBIGUOUS_GAP = 1e-5


def ambiguous_rows(q, k, w, starts, ends, topk):
    """How many rows have their top-k boundary within AMBIGUOUS_GAP of a tie."""
    logits = float64_logits(q, k, w)
    pos = torch.arange(k.shape[0])
    visible = (pos >= starts.long().unsqueeze(-1)) & (pos < ends.long().unsqueeze(-1))
    count = 0
    for bi in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            row = logits[bi, t][visible[t]]
            if len(row) <= topk:
                continue
            top = row.topk(topk + 1).values
            count += int(top[-2] - top[-1] <= AMBIGUOUS_GAP * row.abs().max())
    return count


def run_layer(layer, case, inputs, capture):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    packed = None
    device = inputs["x"].device
    if case["thd"]:
        cu = torch.tensor([0] + list(torch.tensor(case["lengths"]).cumsum(0)), dtype=torch.int32, device=device)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(case["lengths"]),
                                 max_seqlen_kv=max(case["lengths"]))
        if case.get("pad"):
            # padding at the end of each sequence: rows Megatron leaves out of the
            # loss and its mean (real_token_mask_q -> query_valid_rows)
            real = torch.ones(int(cu[-1]), dtype=torch.bool, device=device)
            for end in cu[1:].tolist():
                real[end - case["pad"]:end] = False
            packed.real_token_mask_q = real
    layer.zero_grad(set_to_none=True)
    capture.clear()
    query = inputs["query"].clone().requires_grad_()
    key = inputs["key"].clone().requires_grad_()
    out = layer(query, key, None, attention_mask=None, x=inputs["x"], qr=inputs["qr"], packed_seq_params=packed,
                attn_mask_type=AttnMaskType.causal, up_v_weight=inputs["up_v"])
    out.backward(inputs["grad_out"].view_as(out))
    grads = {n: p.grad.detach().float().cpu() for n, p in layer.indexer.named_parameters() if p.grad is not None}
    rec = dict(capture.record)

    def cpu(t):  # what is compared, on the CPU whatever the layer ran on
        return None if t is None else tuple(map(cpu, t)) if isinstance(t, tuple) else t.cpu()

    return dict(loss=cpu(rec.get("loss")), ids=cpu(rec["ids"]), topk_inputs=cpu(rec.get("topk_inputs")),
                out=cpu(out.detach().float()), grads=grads, dqkw=cpu(tuple(rec.get(n) for n in ("dq", "dk", "dw"))))


def run_cases(rank, world, cases):
    import dsaib.megatron
    from megatron.core.process_groups_config import ProcessGroupCollection

    dsaib.megatron.register()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    results = {}
    for name, case in cases.items():
        tp, cp = case["tp"], case["cp"]
        assert tp * cp == world, (name, tp, cp, world)
        pgs = ProcessGroupCollection()
        pgs.tp = dist.group.WORLD if tp > 1 else singles[rank]
        pgs.cp = dist.group.WORLD if cp > 1 else singles[rank]
        torch.manual_seed(case["seed"] + 1)  # the same parameters on every rank and for both backends
        config = make_config(case, "dsaib", tp, cp)
        device = torch.device(case.get("device", "cpu"))
        layer = make_layer(config, pgs).to(device)
        if case.get("weights_scale"):
            with torch.no_grad():
                layer.indexer.linear_weights_proj.weight.mul_(case["weights_scale"])
        layer.train()
        for draw in range(MAX_DRAWS):
            inputs = {n: t.to(device) for n, t in
                      layer_inputs(case, tp, cp, rank if tp > 1 else 0, rank if cp > 1 else 0, draw).items()}
            with Capture() as capture:
                got = {}
                for backend in ("dsaib", "none"):
                    config.dsa_kernel_backend = backend
                    got[backend] = run_layer(layer, case, inputs, capture)
            ambiguous = torch.tensor(ambiguous_rows(*got["dsaib"]["topk_inputs"], case["topk"]))
            dist.all_reduce(ambiguous)  # every rank redraws together
            if ambiguous.item() == 0:
                break
        got["draws"] = draw + 1
        results[name] = got
    return results


def cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """rope_utils.get_pos_emb_on_this_cp_rank with its chunk ids on the CPU (the
    original pins them and moves them to the GPU): chunks r and 2cp-1-r."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1])
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1):])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2):])


def run_on_cpu():
    """What Megatron's RoPE needs to run in a CPU process: its frequencies go to
    torch.cuda.current_device() (when built and at each forward), here the CPU,
    and its CP chunk selection without the GPU copy."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    torch.cuda.current_device = lambda: torch.device("cpu")
    rope_utils.get_pos_emb_on_this_cp_rank = cpu_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = cpu_pos_emb_on_this_cp_rank


def main(argv):
    rank, world, init_file, case_file, out_file = int(argv[1]), int(argv[2]), argv[3], argv[4], argv[5]
    cases = torch.load(case_file)
    devices = {c.get("device", "cpu") for c in cases.values()}
    assert len(devices) == 1, f"one kind of device per case file, got {sorted(devices)}"
    on_gpu = devices == {"cuda"}
    if on_gpu:  # the collectives of CUDA tensors (the target's TP all-reduce) need NCCL
        torch.cuda.set_device(rank)
    else:
        run_on_cpu()
    dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", init_method="file://" + init_file,
                            rank=rank, world_size=world)
    try:
        torch.save(run_cases(rank, world, cases), out_file)
        dist.barrier()  # every rank's sends done before any rank closes its connections
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv)
