"""The arguments every rank of a context-parallel call must agree on.

Before the first collective whose sizes depend on the arguments, every rank
all-gathers one fixed-size int64 descriptor of its arguments and compares the
group's descriptors; a difference raises the same ValueError on every rank
(naming the first argument that differs and what each rank passed) instead of
a collective of mismatched sizes, which gloo aborts the process on and NCCL
may hang or corrupt on, or a loss normalised with another rank's sizes.
"""
import functools
import numbers
import struct

import torch
import torch.distributed as dist


def host_offsets(cu_seqlens_q, cu_seqlens_k):
    """The THD offsets on the host, both read in one transfer (one
    synchronisation on a GPU): (list, list), an entry None when its tensor is
    None, or "invalid" when it is not a 1-d integer tensor with an element (the
    plan names it)."""
    def valid(cu):
        return (isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 1
                and not (cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool))
    read = [cu for cu in (cu_seqlens_q, cu_seqlens_k) if valid(cu)]
    if len(read) == 2 and read[0].device != read[1].device:
        values = [read[0].tolist(), read[1].tolist()]
    elif read:
        values = torch.cat([cu.to(torch.int64) for cu in read]).tolist()
        values = [values[:read[0].numel()], values[read[0].numel():]][:len(read)]
    out = []
    for cu in (cu_seqlens_q, cu_seqlens_k):
        out.append(None if cu is None else values.pop(0) if valid(cu) else "invalid")
    return tuple(out)


def group_size_rank(group):
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


def _encode_offsets(offsets):
    """3 int64: the number of sequences, the last offset and a hash of all of them
    (-1 when None, -2 when not a 1-d integer tensor: the plan rejects those);
    `offsets` as host_offsets gives them."""
    if offsets is None:
        return [-1, 0, 0]
    if isinstance(offsets, str):
        return [-2, 0, 0]
    return [len(offsets) - 1, offsets[-1], _hash(offsets)]


def _grad_loss_value(grad_loss):
    """What the ranks compare of grad_loss: a real number as a float; a tensor
    only as being one; anything else as it is (its own check rejects it)."""
    if isinstance(grad_loss, torch.Tensor):
        return "a tensor"
    if isinstance(grad_loss, numbers.Real) and not isinstance(grad_loss, bool):
        return float(grad_loss)
    return grad_loss


def describe(function, index_q, weights, index_k, topk_indices, attn_score, index_score, sm_scale, cp_layout,
             loss_coeff, normalization_count, layout, id_mode, offsets_q, offsets_k, out_dtype,
             a_operand_precision, grad_loss=None, starts=None, ends=None, topk=0, order=None, causal_offset=None,
             strict_ranges=None, gradients=None):
    """[(argument, kind, int64 values)] in the order the comparison names them:
    the function and the split's words first, then the tensors, then the options
    (indexer_topk's too, the same words for every function: the descriptor's
    length never depends on which function a rank called)."""
    fields = [("function", "repr", _encode_repr(function)),
              ("layout", "repr", _encode_repr(layout)),
              ("cp_layout", "repr", _encode_repr(cp_layout))]
    for name, t in (("index_q", index_q), ("weights", weights), ("index_k", index_k),
                    ("topk_indices", topk_indices), ("attn_score", attn_score), ("index_score", index_score),
                    ("starts", starts), ("ends", ends)):
        fields.append((name, "dtype", _encode_repr(None if t is None else t.dtype)))
        fields.append((name, "shape", _encode_shape(t)))
    fields += [("cu_seqlens_q", "offsets", _encode_offsets(offsets_q)),
               ("cu_seqlens_k", "offsets", _encode_offsets(offsets_k)),
               ("id_mode", "repr", _encode_repr(id_mode)),
               ("sm_scale", "float", _encode_float(sm_scale)),
               ("loss_coeff", "float", _encode_float(loss_coeff)),
               ("normalization_count", "int", [int(normalization_count or 0)]),
               ("out_dtype", "repr", _encode_repr(out_dtype)),
               ("a_operand_precision", "repr", _encode_repr(a_operand_precision)),
               # a number is compared by its value (1, 1.0 and numpy's 1.0 are one
               # value); a tensor's value would need a synchronisation
               ("grad_loss", "repr", _encode_repr(_grad_loss_value(grad_loss))),
               ("topk", "int", [int(topk)]),
               ("order", "repr", _encode_repr(order)),
               ("causal_offset", "repr", _encode_repr(causal_offset)),
               ("strict_ranges", "repr", _encode_repr(strict_ranges)),
               ("gradients", "repr", _encode_repr(gradients))]
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
    """The descriptor's length: describe's words, the same for any arguments."""
    fields = describe("", None, None, None, None, None, None, 0.0, "", 0.0, 0, "", "", None, None, None, "")
    return sum(len(ints) for _, _, ints in fields)


def _encode_error(error):
    text = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:_ERROR_BYTES]
    return list(struct.unpack(f"<{_ERROR_BYTES // 8}q", text.ljust(_ERROR_BYTES, b"\0")))


def _decode_error(ints):
    text = struct.pack(f"<{_ERROR_BYTES // 8}q", *ints[:_ERROR_BYTES // 8]).rstrip(b"\0")
    return text.decode("utf-8", "replace") + ("..." if len(text) == _ERROR_BYTES else "")


def exchange_device(group, index_k):
    """Where the descriptor goes: index_k's device, or for a rank whose index_k
    is no tensor, the current CUDA device under NCCL and the CPU otherwise."""
    if isinstance(index_k, torch.Tensor):
        return index_k.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_same_across_group(group, cp, device, fields, layout, local_error=None, library_error=None):
    """All-gathers the descriptor (one small collective) and raises the same
    ValueError on every rank when an argument differs across the group. A rank
    whose own checks failed (local_error) takes part with its error instead of
    a descriptor: it raises that error, every other rank a ValueError naming it
    (instead of waiting in the all-gather for a rank that never comes). A rank
    whose arguments the library's own validation rejected (library_error: what
    its library call would raise after the exchange, alone, while the others
    wait in the next collective) sends its descriptor and that error: when the
    descriptors agree, it raises its error and every other rank a ValueError
    naming it."""
    if cp == 1:
        if local_error is not None:
            raise local_error
        if library_error is not None:
            raise library_error
        return
    n = _descriptor_words()
    error_words = _ERROR_BYTES // 8
    if local_error is None:
        words = [2 if library_error is not None else 0] + [v for _, _, ints in fields for v in ints]
        words += _encode_error(library_error) if library_error is not None else [0] * error_words
    else:
        words = [1] + [0] * n + _encode_error(local_error)
    local = torch.tensor(words, dtype=torch.int64, device=device)
    gathered = local.new_empty((cp * local.numel(),))
    dist.all_gather_into_tensor(gathered, local, group=group)
    rows = gathered.view(cp, -1).tolist()
    if local_error is not None:
        raise local_error

    def rejected(failed):
        shown = "; ".join(f"rank {r}: {_decode_error(rows[r][1 + n:])}" for r in failed[:4])
        return (f"{len(failed)} rank(s) rejected their own arguments before the exchange "
                f"({shown}{'; ...' if len(failed) > 4 else ''})")

    failed = [r for r, row in enumerate(rows) if row[0] == 1]
    if failed:
        raise ValueError(f"the group's arguments: {rejected(failed)}; expected every rank's to pass "
                         f"(docs/context-parallel.md)")
    descriptors = [row[1:1 + n] for row in rows]
    start = 0
    for name, kind, ints in fields:
        stop = start + len(ints)
        mine = [r[start:stop] for r in descriptors]
        if any(m != mine[0] for m in mine):
            raise ValueError(_difference(name, kind, mine, layout))
        start = stop
    if library_error is not None:
        raise library_error
    failed = [r for r, row in enumerate(rows) if row[0] == 2]
    if failed:
        raise ValueError(f"the group's arguments: {rejected(failed)} by the library's validation; expected every "
                         f"rank's to pass (docs/context-parallel.md)")
