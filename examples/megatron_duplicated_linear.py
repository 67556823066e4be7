"""The DSA indexer's three projections (linear_wq_b, linear_wk,
linear_weights_proj), which Megatron-Core builds "duplicated", as a plain
linear layer initialised by Megatron's init_method: the stand-in for
Transformer Engine's duplicated linear where the layer is built from
Megatron's own modules, in megatron_dsa_gpt.py (--spec local) and in
python/tests/megatron_layer.py (on the CPU, which Transformer Engine does not
build for).

A module of its own, imported only where a model is built, so that
megatron_dsa_gpt.py --plot imports no torch.
"""
import torch


class DuplicatedLinear(torch.nn.Module):
    """What build_module(linear, in, out, config=..., parallel_mode="duplicated")
    builds: the whole weight on every rank; forward returns (output, None) as
    Megatron's linears return (output, bias)."""

    def __init__(self, input_size, output_size, *, config, init_method, bias, parallel_mode, **kwargs):
        super().__init__()
        if parallel_mode != "duplicated" or bias:
            raise ValueError(f"the indexer's projections: expected a duplicated linear without bias, got "
                             f"parallel_mode={parallel_mode!r}, bias={bias!r}")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None
