"""A tiny Megatron-Core GPT with DeepSeek Sparse Attention layers, trained on
one GPU (or, with --device cpu, the CPU) with the DSA indexer on a chosen
kernel backend (docs/megatron.md).

    python examples/megatron_dsa_gpt.py --backend dsaib --steps 300 --csv dsaib.csv
    python examples/megatron_dsa_gpt.py --backend none  --steps 300 --csv none.csv
    python examples/megatron_dsa_gpt.py --backend cudnn --steps 300 --csv cudnn.csv
    python examples/megatron_dsa_gpt.py --plot dsaib.csv none.csv cudnn.csv --png curves.png

Needs: Python >= 3.12, torch and megatron-core 0.19.x; an NVIDIA GPU with
dsaib built with its cuda backend for --backend dsaib; FlashMLA and
cudnn-frontend's DSA for --backend cudnn. --spec te builds the layers from
Transformer Engine's modules as Megatron's DSA spec does by default; --spec
local (the default) from Megatron's own, so that no Transformer Engine is
needed. --device cpu runs the same model on the CPU (dsaib's cpu backend; a
few steps of tiny dims, as the test suite does). Same seed, same data and same
initial weights for every backend, so the curves can be laid over each other.

The data is a synthetic language: tokens drawn from a fixed random bigram
table in which each token has a few likely successors, so the LM loss falls
from log(vocab) towards that table's entropy, and the indexer has real
attention to learn from. Every step prints and writes to the CSV the LM loss,
the indexer's KL loss (Megatron's, summed over the layers) and the step time;
the last --time-indexer-steps steps also time the indexer's top-k, loss and
gradients alone (synchronising around them; those steps' times are left out
of the mean step time, as are the first 10 steps, which compile and warm up:
a run of 10 steps or fewer besides the timed ones prints no mean step).
"""

import argparse
import csv
import math
import os
import sys
import time


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", choices=("none", "dsaib", "cudnn", "tilelang"), default="dsaib",
                   help="Megatron's dsa_kernel_backend (dsaib is registered first)")
    p.add_argument("--attention", choices=("torch", "cudnn", "tilelang"), default="torch",
                   help="with --backend dsaib: the main sparse attention's backend")
    p.add_argument("--spec", choices=("local", "te"), default="local",
                   help="the layers' modules: Megatron's own (local) or Transformer Engine's (te)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=16, help="attention heads (cuDNN/FlashMLA and dsaib's cuda target: "
                                                           "a multiple of 16)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--topk", type=int, default=256, help="keys each query row selects")
    p.add_argument("--indexer-heads", type=int, default=16)
    p.add_argument("--indexer-loss-coeff", type=float, default=0.01)
    p.add_argument("--rotate-activation", action="store_true",
                   help="the indexer's Hadamard rotation of q and k (Megatron's default; needs fast_hadamard_transform)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--time-indexer-steps", type=int, default=20)
    p.add_argument("--csv", default=None, help="write step, lm_loss, indexer_loss, step_ms here")
    p.add_argument("--site", default=None, metavar="DIR",
                   help="a folder of packages (pip install --target DIR) put first on sys.path, its .pth files read; "
                        "for --backend cudnn on a machine without a package index")
    p.add_argument("--plot", nargs="+", default=None, metavar="CSV", help="plot these CSVs instead of training")
    p.add_argument("--png", default="megatron_dsa_curves.png")
    return p.parse_args(argv)


def plot(paths, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for path in paths:
        rows = list(csv.DictReader(open(path)))
        steps = [int(r["step"]) for r in rows]
        label = os.path.splitext(os.path.basename(path))[0]
        axes[0].plot(steps, [float(r["lm_loss"]) for r in rows], label=label)
        axes[1].plot(steps, [float(r["indexer_loss"]) for r in rows], label=label)
    axes[0].set_title("LM loss")
    axes[1].set_title("indexer KL loss (sum over layers)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def local_block_spec(config):
    """Megatron's DSA block spec with Megatron's own modules instead of
    Transformer Engine's: LocalSpecProvider's, its column-parallel linear for
    MLA's down projections (what MLA takes besides TELinear), and for the
    indexer's three projections (built "duplicated") a plain linear layer
    initialised by Megatron's init_method, as TE's duplicated linear is
    (megatron_duplicated_linear.py)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron_duplicated_linear import DuplicatedLinear  # beside this file

    class Provider(LocalSpecProvider):
        def linear(self):
            return ColumnParallelLinear

    provider = Provider()
    layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=provider)
    for layer in layers:
        indexer = layer.submodules.self_attention.submodules.core_attention.submodules.indexer.submodules
        indexer.linear_wq_b = indexer.linear_wk = indexer.linear_weights_proj = DuplicatedLinear
    return TransformerBlockSubmodules(layer_specs=layers,
                                      layer_norm=provider.layer_norm(rms_norm=config.normalization == "RMSNorm"))


def build(args, torch):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    if args.device == "cuda":
        model_parallel_cuda_manual_seed(args.seed)
    config = MLATransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, multi_latent_attention=True, q_lora_rank=256, kv_lora_rank=512,
        qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, rope_type="rope",
        experimental_attention_variant="dsa", dsa_indexer_n_heads=args.indexer_heads, dsa_indexer_head_dim=128,
        dsa_indexer_topk=args.topk, dsa_indexer_loss_coeff=args.indexer_loss_coeff,
        dsa_indexer_use_sparse_loss=True, dsa_kernel_backend=args.backend,
        dsa_indexer_rotate_activation=args.rotate_activation, normalization="RMSNorm",
        # Megatron's own LayerNorm (the local spec's indexer key norm) keeps float32
        # weights, which torch's CUDA layer_norm refuses with bf16 inputs: the key
        # norm runs on float32 keys, cast back after it.
        dsa_indexer_k_norm_fp32=args.spec == "local",
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        transformer_impl="transformer_engine" if args.spec == "te" else "local",
        use_cpu_initialization=args.device == "cpu")
    spec = (get_transformer_block_with_experimental_attention_variant_spec(config) if args.spec == "te"
            else local_block_spec(config))
    model = GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=args.seq,
                     position_embedding_type="rope").to(args.device)
    return config, model


def bigram_batches(args, torch):
    """An endless stream of (tokens, labels) [batch, seq] from a fixed random
    bigram table with 4 likely successors per token."""
    dev = args.device
    g = torch.Generator(device=dev).manual_seed(args.seed)
    logits = torch.full((args.vocab, args.vocab), -4.0, device=dev)
    succ = torch.randint(0, args.vocab, (args.vocab, 4), generator=g, device=dev)
    logits.scatter_(1, succ, 4.0)
    probs = torch.softmax(logits, -1)
    while True:
        x = torch.empty(args.batch, args.seq + 1, dtype=torch.long, device=dev)
        x[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g, device=dev)
        for t in range(args.seq):
            x[:, t + 1] = torch.multinomial(probs[x[:, t]], 1, generator=g).squeeze(1)
        yield x[:, :-1].contiguous(), x[:, 1:].contiguous()


class IndexerTimer:
    """Times the indexer's top-k, loss and gradients while on: Megatron's hook
    (dsaib, cudnn: the backward only scales saved gradients) or, for backend
    none, its FusedDSAIndexerLoss forward and backward. A backend that takes
    run_fused_dsa_attention (cudnn) runs its indexer inside the main
    attention's hook: that hook's time is kept apart, as the attention with
    its indexer."""

    def __init__(self, torch, sync):
        from megatron.core.transformer.experimental_attention_variant import dsa, dsa_kernels

        self.torch, self.sync, self.on = torch, sync, False
        self.ms = {"indexer": 0.0, "attention_with_indexer": 0.0}
        for obj, name, part in [(dsa_kernels, "run_fused_qk_topk_with_loss", "indexer"),
                                (dsa.FusedDSAIndexerLoss, "forward", "indexer"),
                                (dsa.FusedDSAIndexerLoss, "backward", "indexer"),
                                (dsa_kernels, "run_fused_dsa_attention", "attention_with_indexer")]:
            setattr(obj, name, self.timed(getattr(obj, name), part))

    def reset(self, on):
        self.on = on
        for part in self.ms:
            self.ms[part] = 0.0

    def timed(self, fn, part):
        def wrapper(*a, **k):
            if not self.on:
                return fn(*a, **k)
            self.sync()
            start = time.perf_counter()
            out = fn(*a, **k)
            self.sync()
            if out is not None or part == "indexer":  # a declined fused hook (None) ran nothing
                self.ms[part] += (time.perf_counter() - start) * 1e3
            return out
        return staticmethod(wrapper) if fn.__name__ in ("forward", "backward") else wrapper


def run_on_cpu(torch):
    """Megatron's RoPE puts its frequencies on torch.cuda.current_device(): on
    the CPU, there."""
    torch.cuda.current_device = lambda: torch.device("cpu")


def train(args):
    import torch
    import torch.distributed as dist

    if args.backend == "dsaib":
        import dsaib.megatron

        dsaib.megatron.register(attention=None if args.attention == "torch" else args.attention)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)
    else:
        run_on_cpu(torch)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    torch.manual_seed(args.seed)
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    config, model = build(args, torch)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    timer = IndexerTimer(torch, sync)
    data = bigram_batches(args, torch)
    position_ids = torch.arange(args.seq, device=args.device).unsqueeze(0).expand(args.batch, -1)
    out = csv.writer(open(args.csv, "w", newline="")) if args.csv else None
    if out:
        out.writerow(["step", "lm_loss", "indexer_loss", "step_ms"])
    step_ms, indexer_ms = [], []
    for step in range(1, args.steps + 1):
        tokens, labels = next(data)
        timing_indexer = step > args.steps - args.time_indexer_steps
        timer.reset(timing_indexer)
        sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        per_token = model(tokens, position_ids, None, labels=labels)
        lm_loss = per_token.float().mean()
        lm_loss.backward()
        opt.step()
        sync()
        ms = (time.perf_counter() - start) * 1e3
        tracker = DSAIndexerLossLoggingHelper.tracker
        indexer_loss = float(tracker["values"].sum()) if "values" in tracker else float("nan")
        DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
        if timing_indexer:
            indexer_ms.append((timer.ms["indexer"], timer.ms["attention_with_indexer"], ms))
        elif step > 10:  # the first steps compile and warm up
            step_ms.append(ms)
        if out:
            out.writerow([step, f"{lm_loss.item():.9e}", f"{indexer_loss:.9e}", f"{ms:.3f}"])
        if step % 10 == 0 or step == 1:
            print(f"step {step:5d}  lm_loss {lm_loss.item():.4f}  indexer_loss {indexer_loss:.4e}  {ms:.1f} ms",
                  flush=True)
    if step_ms:
        print(f"backend {args.backend}: mean step {sum(step_ms) / len(step_ms):.2f} ms over {len(step_ms)} steps")
    if indexer_ms:
        total = sum(s for *_, s in indexer_ms)
        for col, what in ((0, "indexer top-k + loss + gradients"),
                          (1, "main attention with its indexer (run_fused_dsa_attention's forward; its backward "
                              "is not hooked)")):
            part = sum(row[col] for row in indexer_ms)
            if part > 0:
                print(f"{what}: {part / len(indexer_ms):.2f} ms per step, {100 * part / total:.1f}% of the step "
                      f"(over {len(indexer_ms)} synchronised steps)")
        if all(row[0] == 0 and row[1] == 0 for row in indexer_ms):
            print("the indexer was not timed: no hook this example times ran")
    dist.destroy_process_group()


def add_site(path):
    """The --site folder first on sys.path, its .pth files read (nvidia-cutlass-dsl
    adds its dsl_packages folder by one)."""
    import site

    if not os.path.isdir(path):
        raise SystemExit(f"--site: expected a folder, got {path!r}")
    path = os.path.abspath(path)
    sys.path.insert(0, path)  # site.addsitedir appends; first, so that the folder's packages win
    site.addsitedir(path)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.site is not None:
        add_site(args.site)
    if args.plot:
        plot(args.plot, args.png)
        return
    if args.attention != "torch" and args.backend != "dsaib":
        raise SystemExit(f"--attention: expected torch unless --backend dsaib, got {args.attention}")
    if not math.isfinite(args.indexer_loss_coeff) or args.indexer_loss_coeff <= 0:
        raise SystemExit(f"--indexer-loss-coeff: expected a positive number, got {args.indexer_loss_coeff}")
    train(args)


if __name__ == "__main__":
    main()
