"""dsaib as a Megatron-Core DSA kernel backend (docs/megatron.md).

::

    import dsaib.megatron
    dsaib.megatron.register()                 # once, before the model is built
    config = TransformerConfig(..., experimental_attention_variant="dsa",
                               dsa_indexer_use_sparse_loss=True, dsa_kernel_backend="dsaib")

After :func:`register`, Megatron's DSA layer runs its indexer's top-k and its
sparse KL loss (with the gradients of the indexer's q, k and weights) on
dsaib; the main sparse attention runs on the backend named by
``register(attention=...)``, or on Megatron's torch code. This module is
also the backend module Megatron imports for that name: the hooks below are
what it looks up. ``python -m dsaib.megatron SCRIPT ARGS`` runs a Megatron
training script with the backend registered, so that the command line takes
``--dsa-kernel-backend dsaib``.

Supported: megatron-core :data:`SUPPORTED_VERSIONS` (Python >= 3.12, as
megatron-core requires); register() names any other version it finds.
"""

from ._hooks import (run_fused_absorbed_sparse_attention, run_fused_dsa_attention, run_fused_qk_topk,
                     run_fused_qk_topk_with_loss)
from ._register import SUPPORTED_VERSIONS, megatron_version, register, registered, unregister

__all__ = [
    "register",
    "unregister",
    "registered",
    "megatron_version",
    "SUPPORTED_VERSIONS",
    "run_fused_qk_topk",
    "run_fused_qk_topk_with_loss",
    "run_fused_absorbed_sparse_attention",
    "run_fused_dsa_attention",
]
