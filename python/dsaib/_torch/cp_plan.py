"""How a context-parallel call splits its sequence over the group: each rank's
rows (Megatron-Core's contiguous and zig-zag layouts), the plan of a call (the
whole key tensor's shape, the THD offsets the library gets, where the
all-gathered key rows go) and the collectives that move the key rows and the
shares of d_index_k."""
import functools
import numbers
from typing import Tuple

import torch
import torch.distributed as dist

from .cp_agreement import check_same_across_group, exchange_device, group_size_rank

#: The CP layouts: Megatron-Core's contiguous chunks and its load-balanced zig-zag split.
CP_LAYOUTS = ("contiguous", "zigzag")


def check_words(cp_layout, layout):
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


class Plan:
    """What a call needs to know about the split: the group, its size and this
    rank, the layouts, where the gathered key rows go (positions, on the
    tensors' device), the key tensor's shapes (local, whole), the THD offsets
    the library gets (local for the queries, whole for the keys) and the global
    number of query rows."""

    def __init__(self, group, cp, rank, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k, offsets):
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
            lengths_q = self._lengths("cu_seqlens_q", cu_seqlens_q, offsets[0], n_chunks, how)
            lengths_k = self._lengths("cu_seqlens_k", cu_seqlens_k, offsets[1], n_chunks, how)
            for name, t, lengths, cu in (("index_q", index_q, lengths_q, "cu_seqlens_q"),
                                         ("index_k", index_k, lengths_k, "cu_seqlens_k")):
                if t.dim() >= 1 and t.shape[0] * cp != sum(lengths):
                    raise ValueError(f"{name}: expected {sum(lengths) // cp} rows ({cu}[-1] = {sum(lengths)} "
                                     f"over {cp} ranks), got {t.shape[0]}")
            self.k_full_shape = (sum(lengths_k),) + tuple(index_k.shape[1:])
            self.lengths = tuple(lengths_k)
            self.lengths_q = tuple(lengths_q)
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
    def _lengths(name, cu, offsets, n_chunks, how):
        if isinstance(offsets, str):
            raise ValueError(f"{name}: expected a 1-d integer tensor of the whole batch's offsets, got "
                             f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__}")
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


def start_gather(plan, index_k):
    """(output buffer, async work) of the all-gather of index_k (contiguous) over the group."""
    local = index_k.contiguous()
    out = plan.gathered_buffer(local)
    return out, dist.all_gather_into_tensor(out, local, group=plan.group, async_op=True)


def finish(work):
    """Waits for the collective (with NCCL: orders the current stream after it)."""
    work.wait()


def normalization(plan, normalization_count):
    return int(normalization_count) if normalization_count else plan.global_rows


def start_reduce_scatter(plan, dk_whole):
    """(local d_index_k, async work): the sum over the group of every rank's
    share of the whole d_index_k (float32; float64 shares are summed in
    float64), scattered back to the key rows each rank holds."""
    wide = torch.float64 if dk_whole.dtype == torch.float64 else torch.float32
    send = plan.to_rank_order(dk_whole.to(wide))
    out = send.new_empty((send.shape[0] // plan.cp,) + tuple(send.shape[1:]))
    return out, dist.reduce_scatter_tensor(out, send, op=dist.ReduceOp.SUM, group=plan.group, async_op=True)


def plan(group, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k, offsets, fields, local_error=None,
         validate=None):
    """The split's plan, after the group has compared every rank's arguments
    (``fields``, cp_agreement.describe; or this rank's own error, ``local_error``;
    ``offsets``: cp_agreement.host_offsets of the cu_seqlens). Before the
    exchange, ``validate(plan)`` runs the library's validation of what this
    rank's library call will get; its error goes into the exchange, so that
    every rank raises (this one its error, the others a ValueError naming it)
    instead of this one alone after the exchange, while the others wait in the
    next collective. The checks then see the same sizes and words on every
    rank, and raise on every rank alike."""
    cp, rank = group_size_rank(group)
    built, library_error = None, None
    if local_error is None:
        try:
            check_words(cp_layout, layout)
            built = Plan(group, cp, rank, cp_layout, layout, index_q, index_k, cu_seqlens_q, cu_seqlens_k, offsets)
            if validate is not None:
                validate(built)
        except (TypeError, ValueError) as e:
            library_error = e
    check_same_across_group(group, cp, exchange_device(group, index_k), fields, layout, local_error, library_error)
    return built


def _bounded_offset(causal_offset: int) -> int:
    """causal_offset clipped to [-2^40, 2^40]: positions and sequence lengths are
    below 2^31, so p + offset + 1 clipped to the sequence is the same, and the
    int64 sum cannot overflow (an offset near 2^63 - 1 wrapped to negative)."""
    return max(min(int(causal_offset), 2**40), -(2**40))


def causal_ranges(plan, index_q, causal_offset):
    """(starts, ends) int32 of the rank's query rows in the whole sequence's key
    coordinates (BSHD: positions; THD: flat rows of the whole index_k): the keys
    [0, p + causal_offset + 1) of the row's sequence, p its position in the whole
    sequence, clipped to the sequence; causal_offset None: S_kv - S_q of each
    sequence, as the single-process call. Made on the host from the plan's
    sizes (no read of device data), then copied to index_q's device."""
    if plan.layout == "bshd":
        B, s_local = index_q.shape[0], index_q.shape[1]
        s_q, s_kv = s_local * plan.cp, plan.k_full_shape[1]
        pos = rank_rows([s_q], plan.cp, plan.cp_layout)[plan.rank]
        off = s_kv - s_q if causal_offset is None else _bounded_offset(causal_offset)
        ends = (pos + off + 1).clamp(0, s_kv)
        starts = torch.zeros_like(ends)
        starts, ends = (x.expand(B, s_local) for x in (starts, ends))
    else:
        lengths_q = plan.lengths_q
        lengths_k = torch.tensor(plan.lengths, dtype=torch.int64)
        packed = rank_rows(lengths_q, plan.cp, plan.cp_layout)[plan.rank]        # rows of the whole packed q
        first_q = torch.cumsum(torch.tensor(lengths_q, dtype=torch.int64), 0)
        seq = torch.searchsorted(first_q, packed, right=True)                    # each row's sequence
        first_q = first_q - torch.tensor(lengths_q, dtype=torch.int64)
        first_k = torch.cumsum(lengths_k, 0) - lengths_k
        pos = packed - first_q[seq]
        off = ((lengths_k - torch.tensor(lengths_q, dtype=torch.int64))[seq] if causal_offset is None
               else _bounded_offset(causal_offset))
        starts = first_k[seq]
        ends = starts + (pos + off + 1).clamp(min=0).minimum(lengths_k[seq])
    return (starts.to(torch.int32).to(index_q.device, non_blocking=True),
            ends.clamp(max=2**31 - 1).to(torch.int32).to(index_q.device, non_blocking=True))
