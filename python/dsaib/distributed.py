"""Context parallelism (CP) for the indexer loss over ``torch.distributed``.

A long sequence is split across the ranks of a process group (the CP group):
each rank holds a slice of the query rows and the same slice of the key rows.
The indexer loss of a query row needs every key its ids select, so:

* the forward all-gathers ``index_k`` over the group
  (``torch.distributed.all_gather_into_tensor``), puts the gathered slices in
  sequence order and runs the library's op on the rank's own query rows
  against the whole key sequence;
* the library's backward on the same rows (in the loss's forward, by the one
  call of loss and gradients, with ``gradients="forward"``; in its backward
  with ``"backward"``) gives ``d_index_q`` and ``d_weights`` of the rank's
  rows and this rank's share of ``d_index_k`` for *every* key row, and the
  backward reduce-scatters those shares
  (``torch.distributed.reduce_scatter_tensor``, a sum in float32, or in
  float64 for float64 inputs on CPU) so that each rank gets the whole
  gradient of the key rows it holds.

Float64 inputs on CPU tensors run in float64 end to end: the keys are gathered
in float64, the forward is the float64 one of :func:`dsaib.torch.indexer_kl_loss`,
the library's fp64 CPU backend reads the float64 row statistics, weights and
``attn_score`` and writes each rank's float64 gradients unrounded, and the
shares of ``d_index_k`` are summed in float64.

The split follows Megatron-Core's two CP layouts (``cp_layout``), for a group
of ``cp`` ranks, rank ``r`` being ``torch.distributed.get_rank(group)``:

* ``"contiguous"``: the sequence in ``cp`` equal chunks; rank ``r`` holds
  chunk ``r``;
* ``"zigzag"`` (load-balanced for causal attention): the sequence in ``2*cp``
  equal chunks; rank ``r`` holds chunk ``r`` followed by chunk ``2*cp-1-r``.

BSHD (``layout="bshd"``): the split is along the sequence dimension of every
batch row; ``index_q`` is ``(B, S_q/cp, H, D)`` and ``index_k``
``(B, S_kv/cp, D)`` on each rank. THD (``layout="thd"``): every packed
sequence is split the same way (its length a multiple of ``cp``, or of
``2*cp`` for zig-zag, as Megatron pads them), and a rank's packed tensors hold,
sequence after sequence, its chunk(s) of that sequence. ``cu_seqlens_q`` and
``cu_seqlens_k`` are those of the *whole* packed batch, the same on every rank
(as Megatron's ``PackedSeqParams`` carries them); the rank's own offsets are
those divided by ``cp``.

``topk_indices`` number the keys of the whole, unsplit sequence exactly as the
single-GPU op numbers them: ``id_mode="local"``, the position in the query's
own sequence; ``id_mode="global"``, the flat row of the whole ``index_k``
(``b*S_kv + position`` or the packed row). ``-1`` and other invalid ids are
invalid slots as on one GPU. The queries are never moved: a rank passes the
ids and ``attn_score`` of its own query rows.

The loss is normalised over the global number of query rows (``B*S_q`` or
``T_q`` of the whole batch; ``normalization_count`` when given is that global
count). Every rank returns the global loss (its share, all-reduced over the
group, as Megatron reports its loss under CP); the gradient that ``backward()``
on a rank propagates is that of the rank's own share, so summing parameter
gradients over the CP group gives the gradient of the global loss.

Agreement: before the all-gather of ``index_k``, every rank all-gathers one
small fixed-size int64 descriptor of its arguments (the function, layouts,
every tensor's dtype and shape, a hash of ``cu_seqlens_q``/``cu_seqlens_k``,
``id_mode``, ``sm_scale``, ``loss_coeff``, ``normalization_count``,
``out_dtype``, ``a_operand_precision``) and compares them: an argument that
differs raises the same ValueError on every rank, naming it and what each
rank passed. Before it, each rank runs the library's own validation of what
its library call will get (dsaib::validate_indexer_kl_loss_inputs: one call
that reads only metadata, and for THD cu_seqlens) and sends its error, if any,
with the descriptor: when the descriptors agree, that rank raises its error
and every other rank a ValueError naming the rank and its error, instead of
the others waiting out the group's timeout in the next collective. It costs
one extra small collective per call (with NCCL, one host synchronisation) and
one validation call (microseconds of host time; with THD on a GPU it reads
cu_seqlens to the host: one more synchronisation); a group of one process
skips the collective.

Overlap: the all-gather is started asynchronously before the local tensors
are converted and waited for just before the library's op; in the backward, the reduce-scatter is started
asynchronously and the conversion of ``d_index_q`` and ``d_weights`` runs
while it is in flight. With NCCL, the waits order the current CUDA stream
after the collective without blocking the host.

The indexer's forward, :func:`context_parallel_indexer_topk`, selects each of
the rank's query rows' top-k keys against the all-gathered ``index_k`` (the
same all-gather), with ranges in the whole sequence's key coordinates: the
ids, logits and counts of the rank's rows are bitwise those of one process on
the whole sequence.

Host synchronisations besides the collectives: the agreement's descriptor
read back (one with NCCL), THD's cu_seqlens read to the host in one transfer
(one), the validation before the exchange (THD on a GPU: one), and those of
the library's calls (one in the loss's forward, one in its backward with
gradients="backward", one in the backward-only function; docs/python.md).
"""
from typing import Optional, Tuple

import torch

from . import _options
from ._options import OPTIONS
from ._torch import ops as _ops  # noqa: F401  (registers torch.ops.dsaib.*)
from ._torch import reference
from ._torch.convert import (check_same_device, check_tensor_types, check_torch_arguments, checked_grad_loss,
                             gradients_in_forward, logits_operand, out_dtype as _out_dtype, range_int32,
                             topk_operand)
from ._torch.cp_agreement import describe, host_offsets
from ._torch.cp_loss import ContextParallelKLLoss as _ContextParallelKLLoss, resolved_a_operand as _resolved_a_operand
from ._torch.cp_plan import (CP_LAYOUTS, causal_ranges, finish, normalization, plan as _plan, rank_chunks,
                             rank_rows, start_gather, start_reduce_scatter)

__all__ = ["context_parallel_indexer_kl_loss", "context_parallel_indexer_backward", "context_parallel_indexer_topk",
           "rank_rows", "rank_chunks", "CP_LAYOUTS"]


def context_parallel_indexer_kl_loss(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    attn_score: torch.Tensor,
    *,
    group,
    sm_scale: float,
    cp_layout: str = "contiguous",
    loss_coeff: float = 1.0,
    normalization_count: int = 0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    a_operand_precision: str = "auto",
    gradients: str = "forward",
    topk_logits: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The indexer KL loss of a sequence split over the CP group ``group``
    (a ``torch.distributed`` process group; ``None`` is the default group).

    Called on every rank of the group with the rank's own slices (see the
    module's docstring for the split): ``index_q`` ``(B, S_q/cp, H, D)``
    (THD ``(T_q/cp, H, D)``), ``weights``, ``topk_indices`` and
    ``attn_score`` of the same rows, ``index_k`` ``(B, S_kv/cp, D)``
    (THD ``(T_k/cp, D)``), ids numbering the keys of the whole sequence as
    :func:`dsaib.torch.indexer_kl_loss` does. THD: ``cu_seqlens_q`` and
    ``cu_seqlens_k`` of the whole packed batch, the same on every rank.

    Returns the global loss (every rank the same value), normalised over the
    global number of query rows (or ``normalization_count``). Differentiable
    w.r.t. ``index_q``, ``weights`` and ``index_k`` as
    :func:`dsaib.torch.indexer_kl_loss`: ``backward()`` on a rank gives the
    gradients of the rank's own share of the loss for its query rows and, after
    the reduce-scatter, the whole gradient of the key rows it holds.

    Dtypes, options and errors as :func:`dsaib.torch.indexer_kl_loss` (the
    library's validation, given the whole ``index_k``'s shape), plus:
    ``cp_layout`` (``"contiguous"`` or ``"zigzag"``), the split's sizes and THD
    offsets (ValueError naming the argument). Every rank must pass the same
    arguments apart from its slices' values: sizes, dtypes, layouts, THD
    offsets and options that differ across the group raise a ValueError on
    every rank, naming the first that differs (one small all-gather before
    the keys'). A rank whose own checks fail (a non-tensor argument, a bad
    word or number) still takes part in that all-gather: it raises its own
    error, and every other rank a ValueError naming that rank and its error.

    ``gradients`` as in :func:`dsaib.torch.indexer_kl_loss`: with
    ``"forward"`` (the default, where a gradient is wanted and the leaves are
    not float64) the forward's one library call (``indexer_kl_loss_and_grad``
    at ``grad_loss`` 1) forms this rank's gradients, and the backward scales
    them by the rank's upstream gradient and reduce-scatters ``d_index_k``; with
    ``"backward"`` the forward is the loss alone and the backward the P-free
    backward, then the reduce-scatter.

    ``topk_logits`` (optional): this rank's rows of the selected keys'
    logits, as :func:`context_parallel_indexer_topk` (or
    :func:`dsaib.torch.indexer_topk`) returns them; the forward reads them
    instead of recomputing the logits, as in :func:`dsaib.torch.indexer_kl_loss`.

    Memory: ``"forward"`` holds this rank's ``d_index_q`` and ``d_weights`` and
    its float32 share of ``d_index_k`` for the whole sequence from the forward
    to the backward; ``"backward"`` keeps the gathered ``index_k`` (bf16, the
    whole sequence) for the backward, which then makes that float32
    ``d_index_k`` for the reduce-scatter (float64 for float64 inputs on CPU). THD reads both
    cu_seqlens to the host in one transfer (one synchronisation on a GPU; the
    library's calls add theirs, docs/python.md).
    """
    fields, error, offsets = None, None, (None, None)
    try:
        sm_scale, loss_coeff, normalization_count, a_operand_precision, gradients = _options.check_each(
            sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count,
            a_operand_precision=a_operand_precision, gradients=gradients).values()
        check_torch_arguments(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k)
        logits_operand(topk_logits)  # its TypeError
        offsets = host_offsets(cu_seqlens_q, cu_seqlens_k)
        fields = describe("context_parallel_indexer_kl_loss", index_q, weights, index_k, topk_indices, attn_score,
                          None, sm_scale, cp_layout, loss_coeff, normalization_count, layout, id_mode, *offsets, None,
                          a_operand_precision, gradients=gradients)
    except (TypeError, ValueError) as e:  # raised on every rank by the exchange in plan
        error = e

    def validate(plan):
        # The library's validation of what this rank's forward gives it (and its
        # backward will): index_q, weights, ids and attn_score as the forward
        # converts them, the whole index_k by its shape alone.
        k_standin = torch.empty(plan.k_full_shape[-1:], dtype=torch.bfloat16,
                                device=index_k.device).expand(plan.k_full_shape)
        reference.validate(index_q, weights, k_standin, topk_indices, attn_score, sm_scale=sm_scale,
                           layout=plan.layout, id_mode=id_mode, cu_seqlens_q=plan.cu_q_local, cu_seqlens_k=plan.cu_k,
                           loss_coeff=loss_coeff, normalization_count=normalization(plan, normalization_count),
                           topk_logits=topk_logits)

    plan = _plan(group, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k, offsets, fields, error,
                 validate)
    return _ContextParallelKLLoss.apply(index_q, weights, index_k, topk_indices, attn_score, plan, float(sm_scale),
                                        float(loss_coeff), int(normalization_count), id_mode, a_operand_precision,
                                        gradients_in_forward(gradients, (index_q, weights, index_k)), topk_logits)


def _check_local_backward_arguments(index_q, layout, grad_loss, row_lse, row_target_mass):
    """The backward's arguments that no other rank's descriptor compares: a
    grad_loss tensor (one float32 element on index_q's device) and the row
    statistics (one value per query row of this rank, on index_q's device)."""
    if isinstance(grad_loss, torch.Tensor):
        if grad_loss.dtype != torch.float32:
            raise TypeError(f"grad_loss: expected dtype float32 (one element), got {grad_loss.dtype}")
        if grad_loss.numel() != 1:
            raise ValueError(f"grad_loss: expected a tensor with one element, got {grad_loss.numel()} elements")
        if grad_loss.device != index_q.device:
            raise ValueError(f"grad_loss: expected a tensor on {index_q.device} (index_q's device), "
                             f"got one on {grad_loss.device}")
    rows = tuple(index_q.shape[:-2])  # (B, S_q) or (T_q)
    for name, t in (("row_lse", row_lse), ("row_target_mass", row_target_mass)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != rows:
            raise ValueError(f"{name}: expected shape {list(rows)} (one value per query row of this rank, "
                             f"layout {layout}), got {list(t.shape)}")
        if t.device != index_q.device:
            raise ValueError(f"{name}: expected a tensor on {index_q.device} (index_q's device), got one on {t.device}")


def context_parallel_indexer_backward(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    attn_score: torch.Tensor,
    index_score: Optional[torch.Tensor],
    *,
    group,
    sm_scale: float,
    cp_layout: str = "contiguous",
    grad_loss=1.0,
    loss_coeff: float = 1.0,
    normalization_count: int = 0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    out_dtype="f32",
    a_operand_precision: str = "auto",
    row_lse: Optional[torch.Tensor] = None,
    row_target_mass: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_index_q, d_weights, d_index_k)`` of a sequence split over the CP
    group ``group``: :func:`dsaib.torch.indexer_backward` on the rank's own
    query rows against the all-gathered ``index_k``.

    Every rank passes its slices (the split, ids and THD offsets as
    :func:`context_parallel_indexer_kl_loss`), with ``index_score`` (or
    ``row_lse``/``row_target_mass``) of its own rows. ``d_index_q`` and
    ``d_weights`` are those of the rank's rows; ``d_index_k`` is the rank's
    slice of the whole gradient (every rank's share summed in float32 by
    ``reduce_scatter_tensor``, then given ``out_dtype``; ``"f64"`` on CPU
    tensors: float64 shares summed in float64). The loss is
    normalised over the global number of query rows unless
    ``normalization_count`` is given. Tensors, dtypes and the other options as
    :func:`dsaib.torch.indexer_backward`; the library checks them when it runs
    (after the all-gather).
    """
    fields, error, offsets = None, None, (None, None)
    try:
        check_torch_arguments(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k)
        # What only this rank's arguments decide is checked here, before the
        # exchange, so that an error of one rank reaches every rank (through the
        # exchange) instead of leaving the others waiting in the reduce-scatter.
        sm_scale, loss_coeff, normalization_count, out_dtype, _, a_operand_precision = _options.check_each(
            sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count, out_dtype=out_dtype,
            grad_loss=grad_loss, a_operand_precision=a_operand_precision).values()
        out_dtype = out_dtype or ("f32",) * 3  # None: f32, as dsaib.torch.indexer_backward
        _check_local_backward_arguments(index_q, layout, grad_loss, row_lse, row_target_mass)
        offsets = host_offsets(cu_seqlens_q, cu_seqlens_k)
        fields = describe("context_parallel_indexer_backward", index_q, weights, index_k, topk_indices, attn_score,
                          index_score, sm_scale, cp_layout, loss_coeff, normalization_count, layout, id_mode, *offsets,
                          out_dtype, a_operand_precision, grad_loss)
    except (TypeError, ValueError) as e:  # raised on every rank by the exchange in plan
        error = e
    checked = {}

    def validate(plan):
        # Everything this rank's library call would check, before the exchange:
        # the options, grad_loss, and the library's validation of the tensors as
        # the call passes them (the whole index_k by its shape alone).
        dq_dtype, dw_dtype, dk_dtype = out_dtype
        for name, code in (("dq_dtype", dq_dtype), ("dw_dtype", dw_dtype), ("dk_dtype", dk_dtype)):
            _out_dtype(name, code)
        checked["precision"] = _resolved_a_operand(OPTIONS["a_operand_precision"].check(a_operand_precision),
                                                   dq_dtype, dk_dtype)
        checked["g"] = checked_grad_loss(grad_loss, index_q.device)
        checked["sm_scale"] = float(OPTIONS["sm_scale"].check(sm_scale))
        checked["loss_coeff"] = float(OPTIONS["loss_coeff"].check(loss_coeff))
        checked["n"] = normalization(plan, normalization_count)
        k_standin = torch.empty(plan.k_full_shape[-1:], dtype=index_k.dtype,
                                device=index_k.device).expand(plan.k_full_shape)
        reference.validate_as_given(index_q, weights, k_standin, topk_indices, attn_score, index_score,
                                    sm_scale=checked["sm_scale"], layout=layout, id_mode=id_mode,
                                    cu_seqlens_q=plan.cu_q_local, cu_seqlens_k=plan.cu_k,
                                    loss_coeff=checked["loss_coeff"], normalization_count=checked["n"],
                                    row_lse=row_lse, row_target_mass=row_target_mass)

    plan = _plan(group, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k, offsets, fields, error,
                 validate)
    dq_dtype, dw_dtype, dk_dtype = out_dtype
    k_dt = _out_dtype("dk_dtype", dk_dtype)
    gathered, work = start_gather(plan, index_k)
    finish(work)
    # The rank's share of every key row's gradient: d_index_k in float32 (float64) for the sum over the ranks.
    dq, dw, dk_whole = torch.ops.dsaib.indexer_backward(
        index_q, weights, plan.to_sequence_order(gathered).contiguous(), topk_indices, attn_score, index_score,
        checked["g"], plan.cu_q_local, plan.cu_k, checked["sm_scale"], checked["loss_coeff"], checked["n"], layout,
        id_mode, dq_dtype, dw_dtype, "f64" if dk_dtype == "f64" else "f32", checked["precision"], row_lse,
        row_target_mass)
    dk, work = start_reduce_scatter(plan, dk_whole)
    finish(work)
    return dq, dw, dk.to(k_dt)


def context_parallel_indexer_topk(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk: int,
    *,
    group,
    cp_layout: str = "contiguous",
    starts: Optional[torch.Tensor] = None,
    ends: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    layout: str = "bshd",
    id_mode: str = "local",
    order: str = "logit_descending",
    causal_offset: Optional[int] = None,
    strict_ranges: bool = False,
    return_logits: bool = False,
    return_lengths: bool = False,
    num_threads: int = 0,
):
    """:func:`dsaib.torch.indexer_topk` of a sequence split over the CP group
    ``group``: the rank's own query rows against the whole ``index_k``,
    all-gathered over the group as for the loss (the split, THD offsets and
    the agreement of the ranks' arguments as
    :func:`context_parallel_indexer_kl_loss`).

    Ranges are in the whole sequence's key coordinates: ``starts``/``ends`` of
    the rank's rows (BSHD ``(B, S_q/cp)``: key positions of the whole
    sequence; THD ``(T_q/cp,)``: flat rows of the whole packed ``index_k``),
    or, without them, each row's causal keys by its position in the whole
    sequence (``causal_offset`` as the single-process call: None is
    ``S_kv - S_q`` of each whole sequence). Ids number the keys of the whole
    sequence (``id_mode`` as on one process). Returns what
    :func:`dsaib.torch.indexer_topk` returns, for the rank's rows; the union of
    the ranks' rows is bitwise the single-process result. Not differentiable.
    """
    fields, error, offsets, o = None, None, (None, None), None
    try:
        o = _options.check("indexer_topk", dict(
            topk=topk, layout=layout, id_mode=id_mode, order=order, causal_offset=causal_offset,
            strict_ranges=strict_ranges, return_logits=return_logits, return_lengths=return_lengths, backend=None,
            num_threads=num_threads, stream=None))
        check_tensor_types(("starts", "ends", "cu_seqlens_q", "cu_seqlens_k"), index_q=index_q, weights=weights,
                           index_k=index_k, starts=starts, ends=ends, cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_k=cu_seqlens_k)
        for name, t in (("index_q", index_q), ("weights", weights), ("index_k", index_k)):
            if not t.is_floating_point():
                raise TypeError(f"{name}: expected a floating-point dtype, got {t.dtype}")
            if t.dtype == torch.float8_e4m3fn:  # the keys travel as bf16, which would drop their scales
                raise TypeError(f"{name}: expected a dtype the keys' all-gather takes (bf16 or another float that "
                                f"converts to it), got {t.dtype} (float8 inputs: dsaib.torch.indexer_topk)")
        check_same_device(index_q, weights=weights, index_k=index_k, starts=starts, ends=ends)
        if (starts is None) != (ends is None):
            raise ValueError(f"{'ends' if starts is not None else 'starts'}: expected a tensor (starts and ends "
                             f"come together, or neither), got None")
        offsets = host_offsets(cu_seqlens_q, cu_seqlens_k)
        fields = describe("context_parallel_indexer_topk", index_q, weights, index_k, None, None, None, 0.0,
                          cp_layout, 0.0, 0, layout, id_mode, *offsets, None, None, starts=starts, ends=ends,
                          topk=o["topk"], order=o["order"], causal_offset=o["causal_offset"],
                          strict_ranges=o["strict_ranges"])
    except (TypeError, ValueError) as e:  # raised on every rank by the exchange in plan
        error = e
    ranges = {}

    def validate(plan):
        # The library's validation of what this rank's call will get, before the
        # exchange (so that its error reaches every rank): the rank's rows and
        # their ranges (made here, used after the exchange), the whole index_k
        # by its shape alone.
        if starts is None:
            ranges["starts"], ranges["ends"] = causal_ranges(plan, index_q, o["causal_offset"])
        else:
            ranges["starts"], ranges["ends"] = range_int32("starts", starts), range_int32("ends", ends)
        k_standin = torch.empty(plan.k_full_shape[-1:], dtype=torch.bfloat16,
                                device=index_k.device).expand(plan.k_full_shape)
        reference.validate_topk(index_q, weights, k_standin, o["topk"], starts=ranges["starts"],
                                ends=ranges["ends"], cu_seqlens_q=plan.cu_q_local, cu_seqlens_k=plan.cu_k,
                                options=dict(layout=o["layout"], id_mode=o["id_mode"], order=o["order"],
                                             strict_ranges=o["strict_ranges"], num_threads=o["num_threads"]))

    plan = _plan(group, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k, offsets, fields, error,
                 validate)
    # not differentiable: the keys travel without their autograd history (a
    # leaf that requires grad cannot be the all-gather's source)
    gathered, work = start_gather(plan, index_k.detach().to(torch.bfloat16))
    try:
        # While the keys travel: the rank's query rows as the library reads them.
        cuda = index_q.device.type == "cuda"
        q16 = topk_operand(index_q, (torch.bfloat16,), cuda)
        w_op = topk_operand(weights, (torch.float32, torch.bfloat16), False)
        starts32, ends32 = ranges["starts"], ranges["ends"]
    finally:
        finish(work)
    with torch.no_grad():
        ids, logits, lengths = torch.ops.dsaib.indexer_topk(
            q16, w_op, plan.to_sequence_order(gathered), o["topk"], starts32, ends32, plan.cu_q_local, plan.cu_k,
            o["layout"], o["id_mode"], o["order"], None, o["strict_ranges"], o["return_logits"],
            o["return_lengths"], o["num_threads"])
    out = (ids,) + ((logits,) if o["return_logits"] else ()) + ((lengths,) if o["return_lengths"] else ())
    return out if len(out) > 1 else ids
