"""Context parallelism (CP) for the indexer loss over ``torch.distributed``.

A long sequence is split across the ranks of a process group (the CP group):
each rank holds a slice of the query rows and the same slice of the key rows.
The indexer loss of a query row needs every key its ids select, so:

* the forward all-gathers ``index_k`` over the group
  (``torch.distributed.all_gather_into_tensor``), puts the gathered slices in
  sequence order and runs the library's op on the rank's own query rows
  against the whole key sequence;
* the backward runs the library's backward on the same rows, which gives
  ``d_index_q`` and ``d_weights`` of the rank's rows and this rank's share of
  ``d_index_k`` for *every* key row, and reduce-scatters those shares
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
rank passed. It costs one extra small collective per call (with NCCL, one
host synchronisation); a group of one process skips it.

Overlap: the all-gather is started asynchronously before the arguments are
checked and converted and waited for just before the library's op; in the
backward, the reduce-scatter is started asynchronously and the conversion of
``d_index_q`` and ``d_weights`` runs while it is in flight. With NCCL, the
waits order the current CUDA stream after the collective without blocking
the host.
"""
import functools
import numbers
import struct
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ._args import _a_operand

__all__ = ["context_parallel_indexer_kl_loss", "context_parallel_indexer_backward", "rank_rows", "rank_chunks",
           "CP_LAYOUTS"]

#: The CP layouts: Megatron-Core's contiguous chunks and its load-balanced zig-zag split.
CP_LAYOUTS = ("contiguous", "zigzag")


def _group_size_rank(group):
    """(cp, rank) of the group (None: the default group), a RuntimeError when
    torch.distributed is not initialised, a ValueError when this process is not
    a member of the group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("group: expected a process group of an initialised torch.distributed "
                           "(torch.distributed.init_process_group), got torch.distributed not initialised")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group: expected a process group that this process is a member of, got a group "
                         f"without this process (global rank {dist.get_rank()})")
    return dist.get_world_size(group), rank


# ---- the arguments every rank must agree on -----------------------------------
#
# Before the first collective whose sizes depend on the arguments, every rank
# all-gathers one fixed-size int64 descriptor of its arguments and compares the
# group's descriptors; a difference raises the same ValueError on every rank
# (naming the first argument that differs and what each rank passed) instead of
# a collective of mismatched sizes, which gloo aborts the process on and NCCL
# may hang or corrupt on, or a loss normalised with another rank's sizes.

_HASH_MOD = (1 << 61) - 1                        # a Mersenne prime: the hash fits an int64
_STR_BYTES = 24                                  # the bytes of a value's repr kept in the descriptor
_MAX_DIMS = 5                                    # the dimensions of a tensor's shape kept in the descriptor


def _hash(values):
    h = 0
    for v in values:
        h = (h * 1_000_003 + int(v)) % _HASH_MOD
    return h


def _encode_repr(value):
    """4 int64: the first 24 bytes of repr(value) and a hash of all of it."""
    text = repr(value).encode("utf-8", "replace")
    head = text[:_STR_BYTES].ljust(_STR_BYTES, b"\0")
    return list(struct.unpack("<3q", head)) + [_hash(text)]


def _decode_repr(ints):
    text = struct.pack("<3q", *ints[:3]).rstrip(b"\0").decode("utf-8", "replace")
    return text if len(text) < _STR_BYTES else text + "..."


def _encode_float(value):
    return list(struct.unpack("<q", struct.pack("<d", float(value))))


def _encode_shape(t):
    """1 + 5 + 1 int64: the rank (-1: None), the first 5 sizes, a hash of the shape."""
    if t is None:
        return [-1] + [0] * _MAX_DIMS + [0]
    shape = list(t.shape)
    return [len(shape)] + (shape[:_MAX_DIMS] + [0] * _MAX_DIMS)[:_MAX_DIMS] + [_hash(shape)]


def _shape_of(ints):
    n = ints[0]
    return None if n < 0 else tuple(ints[1:1 + min(n, _MAX_DIMS)]) + (("...",) if n > _MAX_DIMS else ())


def _encode_offsets(cu):
    """3 int64: the number of sequences, the last offset and a hash of all of them
    (-1 when None, -2 when not a 1-d integer tensor: the plan rejects those)."""
    if cu is None:
        return [-1, 0, 0]
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1 or cu.is_floating_point():
        return [-2, 0, 0]
    offsets = cu.tolist()
    return [len(offsets) - 1, offsets[-1], _hash(offsets)]


def _describe(function, index_q, weights, index_k, topk_indices, attn_score, index_score, sm_scale, cp_layout,
              loss_coeff, normalization_count, layout, id_mode, cu_seqlens_q, cu_seqlens_k, out_dtype,
              a_operand_precision, grad_loss=None):
    """[(argument, kind, int64 values)] in the order the comparison names them:
    the function and the split's words first, then the tensors, then the options."""
    fields = [("function", "repr", _encode_repr(function)),
              ("layout", "repr", _encode_repr(layout)),
              ("cp_layout", "repr", _encode_repr(cp_layout))]
    for name, t in (("index_q", index_q), ("weights", weights), ("index_k", index_k),
                    ("topk_indices", topk_indices), ("attn_score", attn_score), ("index_score", index_score)):
        fields.append((name, "dtype", _encode_repr(None if t is None else t.dtype)))
        fields.append((name, "shape", _encode_shape(t)))
    fields += [("cu_seqlens_q", "offsets", _encode_offsets(cu_seqlens_q)),
               ("cu_seqlens_k", "offsets", _encode_offsets(cu_seqlens_k)),
               ("id_mode", "repr", _encode_repr(id_mode)),
               ("sm_scale", "float", _encode_float(sm_scale)),
               ("loss_coeff", "float", _encode_float(loss_coeff)),
               ("normalization_count", "int", [int(normalization_count or 0)]),
               ("out_dtype", "repr", _encode_repr(out_dtype)),
               ("a_operand_precision", "repr", _encode_repr(a_operand_precision)),
               # a number is compared; a tensor's value would need a synchronisation
               ("grad_loss", "repr", _encode_repr("a tensor" if isinstance(grad_loss, torch.Tensor)
                                                  else grad_loss))]
    return fields


def _per_rank(values, unit=""):
    """'rank 0 has 6 key rows, rank 1 has 10' (the first 8 ranks)."""
    shown = [f"rank {r} has {v}" + (f" {unit}" if unit and r == 0 else "") for r, v in enumerate(values[:8])]
    return ", ".join(shown) + (f", ... ({len(values)} ranks)" if len(values) > 8 else "")


def _difference(name, kind, rows, layout):
    """The ValueError's message for an argument whose descriptor differs across the ranks."""
    doc = "(docs/context-parallel.md)"
    if kind == "shape":
        shapes = [_shape_of(r) for r in rows]
        dim = 1 if layout == "bshd" else 0
        ranks = {len(s) if s is not None else -1 for s in shapes}
        if len(ranks) == 1 and None not in shapes and len(shapes[0]) > dim and \
                all(s[:dim] + s[dim + 1:] == shapes[0][:dim] + shapes[0][dim + 1:] for s in shapes):
            unit = "key rows" if name == "index_k" else "query rows"
            return (f"{name}: the slices differ across the group: "
                    f"{_per_rank([s[dim] for s in shapes], unit)}; expected equal slices {doc}")
        return (f"{name}: the shapes differ across the group: {_per_rank(shapes)}; "
                f"expected the same shape on every rank {doc}")
    if kind == "offsets":
        def offsets(r):
            return {-1: "None", -2: "not a 1-d integer tensor"}.get(
                r[0], f"{r[0]} sequences ending at {r[1]} (hash {r[2]:#x})")
        return (f"{name}: the offsets differ across the group: {_per_rank([offsets(r) for r in rows])}; "
                f"expected the whole batch's offsets, the same on every rank {doc}")
    if kind == "float":
        values = [struct.unpack("<d", struct.pack("<q", r[0]))[0] for r in rows]
    elif kind == "int":
        values = [r[0] for r in rows]
    else:
        values = [_decode_repr(r) for r in rows]
    what = "dtypes" if kind == "dtype" else "values"
    return f"{name}: the {what} differ across the group: {_per_rank(values)}; expected the same on every rank {doc}"


_ERROR_BYTES = 120                               # the bytes of a rank's own error kept in the descriptor


@functools.lru_cache(maxsize=1)
def _descriptor_words():
    """The descriptor's length: _describe's words, the same for any arguments."""
    fields = _describe("", None, None, None, None, None, None, 0.0, "", 0.0, 0, "", "", None, None, None, "")
    return sum(len(ints) for _, _, ints in fields)


def _encode_error(error):
    text = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:_ERROR_BYTES]
    return list(struct.unpack(f"<{_ERROR_BYTES // 8}q", text.ljust(_ERROR_BYTES, b"\0")))


def _decode_error(ints):
    text = struct.pack(f"<{_ERROR_BYTES // 8}q", *ints[:_ERROR_BYTES // 8]).rstrip(b"\0")
    return text.decode("utf-8", "replace") + ("..." if len(text) == _ERROR_BYTES else "")


def _exchange_device(group, index_k):
    """Where the descriptor goes: index_k's device, or for a rank whose index_k
    is no tensor, the current CUDA device under NCCL and the CPU otherwise."""
    if isinstance(index_k, torch.Tensor):
        return index_k.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_same_across_group(group, cp, device, fields, layout, local_error=None):
    """All-gathers the descriptor (one small collective) and raises the same
    ValueError on every rank when an argument differs across the group. A rank
    whose own checks failed (local_error) takes part with its error instead of
    a descriptor: it raises that error, every other rank a ValueError naming it
    (instead of waiting in the all-gather for a rank that never comes)."""
    if cp == 1:
        if local_error is not None:
            raise local_error
        return
    n = _descriptor_words()
    if local_error is None:
        words = [0] + [v for _, _, ints in fields for v in ints]
    else:
        words = [1] + _encode_error(local_error)
        words += [0] * (n + 1 - len(words))
    local = torch.tensor(words, dtype=torch.int64, device=device)
    gathered = local.new_empty((cp * local.numel(),))
    dist.all_gather_into_tensor(gathered, local, group=group)
    rows = gathered.view(cp, -1).tolist()
    failed = [r for r, row in enumerate(rows) if row[0] != 0]
    if local_error is not None:
        raise local_error
    if failed:
        shown = "; ".join(f"rank {r}: {_decode_error(rows[r][1:])}" for r in failed[:4])
        raise ValueError(f"the group's arguments: {len(failed)} rank(s) rejected their own arguments before the "
                         f"exchange ({shown}{'; ...' if len(failed) > 4 else ''}); expected every rank's to pass "
                         f"(docs/context-parallel.md)")
    rows = [row[1:] for row in rows]
    start = 0
    for name, kind, ints in fields:
        stop = start + len(ints)
        mine = [r[start:stop] for r in rows]
        if any(m != mine[0] for m in mine):
            raise ValueError(_difference(name, kind, mine, layout))
        start = stop


def _check_words(cp_layout, layout):
    if not isinstance(cp_layout, str) or cp_layout not in CP_LAYOUTS:
        raise ValueError(f'cp_layout: expected "contiguous" or "zigzag", got {cp_layout!r}')
    if not isinstance(layout, str) or layout not in ("bshd", "thd"):
        raise ValueError(f'layout: expected "bshd" or "thd", got {layout!r}')


def rank_chunks(cp: int, cp_layout: str, rank: int) -> Tuple[int, Tuple[int, ...]]:
    """``(n_chunks, chunks)``: a sequence is cut in ``n_chunks`` equal chunks and
    ``rank`` holds ``chunks`` (in this order): ``(cp, (rank,))`` for contiguous,
    ``(2*cp, (rank, 2*cp-1-rank))`` for zig-zag."""
    if cp_layout == "contiguous":
        return cp, (rank,)
    if cp_layout == "zigzag":
        return 2 * cp, (rank, 2 * cp - 1 - rank)
    raise ValueError(f'cp_layout: expected "contiguous" or "zigzag", got {cp_layout!r}')


@functools.lru_cache(maxsize=16)
def _positions_cached(lengths: Tuple[int, ...], cp: int, cp_layout: str) -> torch.Tensor:
    n_chunks, _ = rank_chunks(cp, cp_layout, 0)
    length = torch.tensor(lengths, dtype=torch.int64)
    start = torch.cumsum(length, 0) - length                  # each sequence's first row
    chunk_len = length // n_chunks
    local_len = length // cp                                  # a rank's rows of each sequence
    local_start = torch.cumsum(local_len, 0) - local_len
    n_local = int(local_len.sum())
    seq = torch.repeat_interleave(torch.arange(len(lengths)), local_len)          # (n_local,)
    j = torch.arange(n_local) - local_start[seq]              # row within the rank's part of its sequence
    cl = chunk_len[seq].clamp_min(1)
    k, offset = j // cl, j % cl                               # which of the rank's chunks, row in it
    rows = []
    for r in range(cp):
        chunks = torch.tensor(rank_chunks(cp, cp_layout, r)[1], dtype=torch.int64)
        rows.append(start[seq] + chunks[k] * chunk_len[seq] + offset)
    return torch.stack(rows) if rows else torch.empty(0, n_local, dtype=torch.int64)


def rank_rows(lengths, cp: int, cp_layout: str) -> torch.Tensor:
    """``(cp, n_local)`` int64 (CPU): for each rank and each of its local rows,
    the row of the whole sequence (or packed batch) it holds; rank ``r``'s
    slice of a whole tensor ``x`` is ``x.index_select(dim, rank_rows(...)[r])``.

    ``lengths`` are the lengths of the sequences one after another (BSHD: the
    one sequence dimension, ``[S]``; THD: every packed sequence), each a
    multiple of the layout's chunk count (ValueError otherwise). A rank's
    local rows are, sequence after sequence, its chunks of that sequence (see
    :func:`rank_chunks`)."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp: expected a positive int, got {cp!r}")
    n_chunks, _ = rank_chunks(cp, cp_layout, 0)
    if isinstance(lengths, torch.Tensor):
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dim() != 1:
            raise ValueError(f"lengths: expected a 1-d integer tensor or a sequence of ints, got a {lengths.dim()}-d "
                             f"{lengths.dtype} tensor")
        lengths = lengths.tolist()
    checked = []
    for b, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise ValueError(f"lengths: expected integer lengths, got {n!r} for sequence {b}")
        checked.append(int(n))
    lengths = tuple(checked)
    for b, n in enumerate(lengths):
        if n < 0 or n % n_chunks:
            raise ValueError(f"lengths: expected every length a multiple of {n_chunks} ({cp_layout} over {cp} "
                             f"ranks), got {n} for sequence {b}")
    return _positions_cached(lengths, cp, cp_layout).clone()


class _Plan:
    """What a call needs to know about the split: the group, its size and this
    rank, the layouts, where the gathered key rows go (positions, on the
    tensors' device), the key tensor's shapes (local, whole), the THD offsets
    the library gets (local for the queries, whole for the keys) and the global
    number of query rows."""

    def __init__(self, group, cp, rank, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k):
        self.group, self.cp, self.rank, self.cp_layout, self.layout = group, cp, rank, cp_layout, layout
        n_chunks, _ = rank_chunks(cp, cp_layout, rank)
        how = f"{cp_layout} over {cp} ranks"
        dev = index_q.device
        if layout == "bshd":
            if index_k.dim() != 3:
                raise ValueError(f"index_k: expected rank 3 (B, S_kv/cp, D), got rank {index_k.dim()}")
            if index_q.dim() != 4:
                raise ValueError(f"index_q: expected rank 4 (B, S_q/cp, H, D), got rank {index_q.dim()}")
            B, s_local, D = index_k.shape
            if s_local * cp % n_chunks:
                raise ValueError(f"index_k: expected a local sequence length that is a multiple of "
                                 f"{n_chunks // cp} ({how}), got {s_local}")
            self.k_full_shape = (B, s_local * cp, D)
            self.lengths = (s_local * cp,)
            self.global_rows = index_q.shape[0] * index_q.shape[1] * cp
            self.cu_q_local = self.cu_k = None
        else:
            for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
                if cu is None:
                    raise ValueError(f"{name}: expected the whole batch's offsets for layout thd (the same on "
                                     f"every rank), got None")
            if index_k.dim() != 2:
                raise ValueError(f"index_k: expected rank 2 (T_k/cp, D), got rank {index_k.dim()}")
            lengths_q = self._lengths("cu_seqlens_q", cu_seqlens_q, n_chunks, how)
            lengths_k = self._lengths("cu_seqlens_k", cu_seqlens_k, n_chunks, how)
            for name, t, lengths, cu in (("index_q", index_q, lengths_q, "cu_seqlens_q"),
                                         ("index_k", index_k, lengths_k, "cu_seqlens_k")):
                if t.dim() >= 1 and t.shape[0] * cp != sum(lengths):
                    raise ValueError(f"{name}: expected {sum(lengths) // cp} rows ({cu}[-1] = {sum(lengths)} "
                                     f"over {cp} ranks), got {t.shape[0]}")
            self.k_full_shape = (sum(lengths_k),) + tuple(index_k.shape[1:])
            self.lengths = tuple(lengths_k)
            self.global_rows = sum(lengths_q)
            self.cu_q_local = torch.div(cu_seqlens_q, cp, rounding_mode="floor").to(cu_seqlens_q.dtype)
            self.cu_k = cu_seqlens_k
        # BSHD contiguous: the rank-major rows are already in sequence order.
        self.identity = cp_layout == "contiguous" and layout == "bshd"
        self.positions = self.inverse = None
        if not self.identity:
            positions = _positions_cached(self.lengths, cp, cp_layout).reshape(-1)
            inverse = torch.empty_like(positions)
            inverse[positions] = torch.arange(positions.numel())
            self.positions = positions.to(dev)                  # rank-major row -> whole-sequence row
            self.inverse = inverse.to(dev)                      # whole-sequence row -> rank-major row

    @staticmethod
    def _lengths(name, cu, n_chunks, how):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1 or cu.is_floating_point():
            raise ValueError(f"{name}: expected a 1-d integer tensor of the whole batch's offsets, got "
                             f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__}")
        offsets = cu.tolist()
        lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        if offsets[0] != 0 or any(n < 0 for n in lengths):
            raise ValueError(f"{name}: expected non-decreasing offsets from 0, got {offsets}")
        for b, n in enumerate(lengths):
            if n % n_chunks:
                raise ValueError(f"{name}: expected every sequence length a multiple of {n_chunks} ({how}), "
                                 f"got length {n} for sequence {b}")
        return lengths

    # -- moving key rows between the rank-major gathered order and sequence order --

    def gathered_buffer(self, local):
        """The all-gather's output for the local tensor: cp copies of its shape, rank-major."""
        return local.new_empty((self.cp * local.shape[0],) + tuple(local.shape[1:]))

    def to_sequence_order(self, gathered):
        """The all-gathered key rows (rank-major) as the whole index_k, rows in sequence order."""
        if self.layout == "thd":
            return gathered.index_select(0, self.inverse)
        B = self.k_full_shape[0]
        rank_major = gathered.view((self.cp, B) + tuple(gathered.shape[1:])).transpose(0, 1)
        whole = rank_major.reshape(self.k_full_shape)          # a view when B == 1
        return whole if self.identity else whole.index_select(1, self.inverse)

    def to_rank_order(self, whole):
        """The inverse of to_sequence_order: a contiguous (cp * local rows, ...) tensor, rank r's rows r-th."""
        if self.layout == "thd":
            return whole.index_select(0, self.positions)
        B, S, D = whole.shape
        if not self.identity:
            whole = whole.index_select(1, self.positions)
        rank_major = whole.view(B, self.cp, S // self.cp, D).transpose(0, 1)
        return rank_major.reshape(self.cp * B, S // self.cp, D).contiguous()


def _start_gather(plan, index_k):
    """(output buffer, async work) of the all-gather of index_k (contiguous) over the group."""
    local = index_k.contiguous()
    out = plan.gathered_buffer(local)
    return out, dist.all_gather_into_tensor(out, local, group=plan.group, async_op=True)


def _finish(work):
    """Waits for the collective (with NCCL: orders the current stream after it)."""
    work.wait()


def _normalization(plan, normalization_count):
    return int(normalization_count) if normalization_count else plan.global_rows


def _resolved_a_operand(a_operand_precision, q_code, k_code):
    """'auto' as the single-GPU op resolves it for these leaves (the CP backward
    always writes d_index_k in float32 (or float64) for the reduction, which
    would otherwise turn 'auto' into two terms for bf16 leaves)."""
    if a_operand_precision != "auto":
        return a_operand_precision
    return "bf16x2" if ("f32" in (q_code, k_code) or "f64" in (q_code, k_code)) else "bf16"


class _ContextParallelKLLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, index_q, weights, index_k, topk_indices, attn_score, plan, sm_scale, loss_coeff,
                normalization_count, id_mode, a_operand_precision):
        fp64 = any(t.dtype == torch.float64 for t in (index_q, weights, index_k))
        # CPU float64: through the library in float64 too (its fp64 CPU backend).
        library_fp64 = _dt._fp64(index_q.device, index_q, weights, index_k)
        k_send = index_k if fp64 else index_k.to(torch.bfloat16)
        gathered, work = _start_gather(plan, k_send)
        try:
            # While the keys travel: the library's checks of what the backward will
            # get (the whole index_k by its shape alone) and the local conversions.
            k_standin = torch.empty(plan.k_full_shape[-1:], dtype=torch.bfloat16,
                                    device=index_k.device).expand(plan.k_full_shape)
            n = _normalization(plan, normalization_count)
            _dt._validate_forward(index_q, weights, k_standin, topk_indices, attn_score, sm_scale=sm_scale,
                                  layout=plan.layout, id_mode=id_mode, cu_seqlens_q=plan.cu_q_local,
                                  cu_seqlens_k=plan.cu_k, loss_coeff=loss_coeff, normalization_count=n,
                                  a_operand_precision=a_operand_precision)
            # (index_k itself is converted whole after the gather; an empty slice stands in here)
            q16, w_op, _, ids32, T32 = _dt._library_inputs(index_q, weights, index_k[:0], topk_indices,
                                                           attn_score, library_fp64)
        finally:
            _finish(work)
        k_whole = plan.to_sequence_order(gathered)
        k16 = k_whole.to(torch.bfloat16).contiguous()
        if fp64:
            loss, row_lse, row_target_mass = _dt._float64_forward(
                index_q, weights, k_whole, topk_indices, attn_score, sm_scale, loss_coeff, n, plan.layout,
                id_mode, plan.cu_q_local, plan.cu_k)
        else:
            loss, row_lse, row_target_mass = torch.ops.dsaib.indexer_kl_forward(
                q16, w_op, k16, ids32, T32, plan.cu_q_local, plan.cu_k, float(sm_scale), float(loss_coeff), n,
                plan.layout, id_mode)
        # Every rank returns the global loss; backward() on a rank carries its own share.
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=plan.group)
        stats = torch.float64 if library_fp64 else torch.float32
        ctx.save_for_backward(q16, w_op, k16, ids32, T32, row_lse.to(stats), row_target_mass.to(stats))
        ctx.plan = plan
        ctx.in_dtypes = (index_q.dtype, weights.dtype, index_k.dtype)
        ctx.fp64 = library_fp64
        ctx.options = (float(sm_scale), float(loss_coeff), n, id_mode, a_operand_precision)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        q16, w_op, k16, ids32, T32, row_lse, row_target_mass = ctx.saved_tensors
        plan = ctx.plan
        sm_scale, loss_coeff, n, id_mode, a_operand_precision = ctx.options
        q_dt, w_dt, k_dt = ctx.in_dtypes
        q_code, w_code, k_code = (_dt._grad_code(dt, ctx.fp64) for dt in (q_dt, w_dt, k_dt))
        g = grad_loss.detach().reshape(()).to(torch.float32)
        # d_index_k's shares: float32 (float64 in the fp64 mode) for the sum over the ranks.
        dk_code = "f64" if ctx.fp64 else "f32"
        dq, dw, dk_whole = torch.ops.dsaib.indexer_backward(
            q16, w_op, k16, ids32, T32, None, g, plan.cu_q_local, plan.cu_k, sm_scale, loss_coeff, n,
            plan.layout, id_mode, q_code, w_code, dk_code, _resolved_a_operand(a_operand_precision, q_code, k_code),
            row_lse, row_target_mass)
        dk, work = _start_reduce_scatter(plan, dk_whole)
        need = ctx.needs_input_grad
        dq = dq.to(q_dt) if need[0] else None
        dw = dw.to(w_dt) if need[1] else None
        _finish(work)
        return dq, dw, dk.to(k_dt) if need[2] else None, None, None, None, None, None, None, None, None


def _start_reduce_scatter(plan, dk_whole):
    """(local d_index_k, async work): the sum over the group of every rank's
    share of the whole d_index_k (float32; float64 shares are summed in
    float64), scattered back to the key rows each rank holds."""
    wide = torch.float64 if dk_whole.dtype == torch.float64 else torch.float32
    send = plan.to_rank_order(dk_whole.to(wide))
    out = send.new_empty((send.shape[0] // plan.cp,) + tuple(send.shape[1:]))
    return out, dist.reduce_scatter_tensor(out, send, op=dist.ReduceOp.SUM, group=plan.group, async_op=True)


def _plan(group, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k, fields, local_error=None):
    """The split's plan, after the group has compared every rank's arguments
    (``fields``, :func:`_describe`; or this rank's own error, ``local_error``):
    the checks that follow then see the same sizes and words on every rank, and
    raise on every rank alike."""
    cp, rank = _group_size_rank(group)
    _check_same_across_group(group, cp, _exchange_device(group, index_k), fields, layout, local_error)
    _check_words(cp_layout, layout)
    return _Plan(group, cp, rank, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k)


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

    Memory: the gathered ``index_k`` (bf16, the whole sequence) is kept for the
    backward, which also makes a float32 ``d_index_k`` of the whole sequence
    for the reduce-scatter (float64 for float64 inputs on CPU). THD reads cu_seqlens to the host (one
    synchronisation on a GPU).
    """
    fields, error = None, None
    try:
        a_operand_precision = _a_operand(a_operand_precision)
        _dt._check_torch_arguments(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k)
        fields = _describe("context_parallel_indexer_kl_loss", index_q, weights, index_k, topk_indices, attn_score,
                           None, sm_scale, cp_layout, loss_coeff, normalization_count, layout, id_mode, cu_seqlens_q,
                           cu_seqlens_k, None, a_operand_precision)
    except (TypeError, ValueError) as e:  # raised on every rank by the exchange in _plan
        error = e
    plan = _plan(group, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k, fields, error)
    return _ContextParallelKLLoss.apply(index_q, weights, index_k, topk_indices, attn_score, plan, float(sm_scale),
                                        float(loss_coeff), int(normalization_count), id_mode, a_operand_precision)


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
    fields, error = None, None
    try:
        _dt._check_torch_arguments(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k)
        if isinstance(out_dtype, str):
            out_dtype = (out_dtype,) * 3
        fields = _describe("context_parallel_indexer_backward", index_q, weights, index_k, topk_indices, attn_score,
                           index_score, sm_scale, cp_layout, loss_coeff, normalization_count, layout, id_mode,
                           cu_seqlens_q, cu_seqlens_k, out_dtype, a_operand_precision, grad_loss)
    except (TypeError, ValueError) as e:  # raised on every rank by the exchange in _plan
        error = e
    plan = _plan(group, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k, fields, error)
    dq_dtype, dw_dtype, dk_dtype = out_dtype
    k_dt = _dt._out_dtype("dk_dtype", dk_dtype)
    gathered, work = _start_gather(plan, index_k)
    try:
        precision = _resolved_a_operand(_a_operand(a_operand_precision), dq_dtype, dk_dtype)
        if not isinstance(grad_loss, torch.Tensor):
            grad_loss = torch.full((), _dt._finite_grad_loss(grad_loss), dtype=torch.float32,
                                   device=index_q.device)
    finally:
        _finish(work)
    dq, dw, dk_whole = _dt.indexer_backward(
        index_q, weights, plan.to_sequence_order(gathered).contiguous(), topk_indices, attn_score, index_score,
        sm_scale=sm_scale, grad_loss=grad_loss, loss_coeff=loss_coeff,
        normalization_count=_normalization(plan, normalization_count), layout=layout, id_mode=id_mode,
        cu_seqlens_q=plan.cu_q_local, cu_seqlens_k=plan.cu_k,
        out_dtype=(dq_dtype, dw_dtype, "f64" if dk_dtype == "f64" else "f32"),
        a_operand_precision=precision, row_lse=row_lse, row_target_mass=row_target_mass)
    dk, work = _start_reduce_scatter(plan, dk_whole)
    _finish(work)
    return dq, dw, dk.to(k_dt)


# At the end: dsaib.torch re-exports this module's functions, so whichever of
# the two is imported first, the other finds it complete (used at call time).
from . import torch as _dt  # noqa: E402
