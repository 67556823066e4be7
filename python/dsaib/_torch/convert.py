"""The torch layer's own argument rules and its conversions of tensors to what
the library takes (bf16 index_q/index_k, int32 ids, float32 scores, the fp64
mode of the cpu backend), shared by dsaib.torch, its autograd functions and
dsaib.distributed."""

import contextlib
import math

import torch

from .._args import _INT32_MAX, _INT32_MIN, _f32_value, _grad_loss

# float32 rounds every magnitude below FLT_MAX + half its last place to a finite value.
_F32_MAX = 3.4028234663852886e38
_F32_OVERFLOW = _F32_MAX + 2.0 ** 103

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f64": torch.float64}
CODES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def out_dtype(name: str, code: str) -> torch.dtype:
    try:
        return DTYPES[code]
    except KeyError:
        raise ValueError(f'{name}: expected "f32", "bf16" or "f64", got {code!r}') from None


def fp64(device: torch.device, *tensors) -> bool:
    """Whether the library runs in float64 end to end for these tensors: on the
    CPU backend (the only one that takes f64) when any of them is float64."""
    return device.type == "cpu" and any(t.dtype == torch.float64 for t in tensors)


def grad_code(dtype: torch.dtype, in_fp64: bool) -> str:
    """The library's output code for a gradient of a leaf of `dtype`: the leaf's
    own dtype where the library writes it (float64 only in the fp64 mode,
    unrounded), else float32."""
    if in_fp64 and dtype == torch.float64:
        return "f64"
    return CODES.get(dtype, "f32")


def check_same_device(index_q, **tensors):
    """ValueError naming the first tensor (None skipped) not on index_q's device."""
    for name, t in tensors.items():
        if t is not None and t.device != index_q.device:
            raise ValueError(f"{name}: expected memory on device '{index_q.device}' (that of index_q), "
                             f"got device '{t.device}'")


def check_tensor_types(optional=(), **tensors):
    """Every argument named a torch.Tensor (None allowed for those in
    `optional`): TypeError naming it otherwise, before anything runs."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name in optional):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def check_torch_arguments(index_q, weights, index_k, topk_indices, attn_score=None, cu_seqlens_q=None,
                          cu_seqlens_k=None, cu_seqlens_on_any_device=False, attn_score_required=True):
    """The torch layer's own rules, before the library's: every tensor argument a
    torch.Tensor, all on index_q's device (torch would compute with a meta tensor
    beside cpu ones, from uninitialised memory; the library cannot see meta
    tensors), topk_indices of an integer dtype and attn_score of a floating one
    (the loss converts them to int32 and float32), and index_q, weights,
    index_k of a real floating dtype (the loss converts them to bf16 and
    float32: an integer, bool or complex tensor would lose what it holds)."""
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    optional = ("cu_seqlens_q", "cu_seqlens_k") + (() if attn_score_required else ("attn_score",))
    check_tensor_types(optional, **tensors)
    for name in ("index_q", "weights", "index_k"):
        if not tensors[name].is_floating_point():
            raise TypeError(f"{name}: expected a floating-point dtype, got {tensors[name].dtype}")
        if tensors[name].dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            # the loss has no scales: float8 codes would lose the ones the top-k took
            raise TypeError(f"{name}: expected a dtype the loss rounds to bf16 (the dequantised values of float8 "
                            f"inputs), got {tensors[name].dtype}")
    same_device = {n: t for n, t in tensors.items() if n != "index_q"}
    if cu_seqlens_on_any_device:
        del same_device["cu_seqlens_q"], same_device["cu_seqlens_k"]
    check_same_device(index_q, **same_device)
    if topk_indices.is_floating_point() or topk_indices.is_complex() or topk_indices.dtype == torch.bool:
        raise TypeError(f"topk_indices: expected an integer dtype, got {topk_indices.dtype}")
    if attn_score is not None and not attn_score.is_floating_point():
        raise TypeError(f"attn_score: expected a floating-point dtype, got {attn_score.dtype}")


def gradients_in_forward(gradients: str, leaves) -> bool:
    """Whether a loss with the option ``gradients`` forms its gradients in its
    forward: "forward", a gradient wanted (grad mode on, a leaf requiring
    grad) and no float64 leaf (float64 leaves take the other form)."""
    return (gradients == "forward" and torch.is_grad_enabled() and any(t.requires_grad for t in leaves)
            and not any(t.dtype == torch.float64 for t in leaves))


def refuse_graph_of_gradient(function: str) -> None:
    """A loss's backward under create_graph=True (grad mode on inside the
    backward) is refused when it starts: its gradients have no graph."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{function}: expected a first-order backward, got create_graph=True (the loss is "
                           f"not twice differentiable)")


def held_gradient_scale(grad_loss, function: str) -> torch.Tensor:
    """autograd's upstream gradient, as the float32 0-dim factor of gradients
    that a loss's forward formed at grad_loss 1; a backward with
    create_graph=True is refused (the held gradients have no graph)."""
    refuse_graph_of_gradient(function)
    return grad_loss.detach().reshape(()).to(torch.float32)


def grad_loss_tensor(checked, device) -> torch.Tensor:
    """grad_loss as the ops take it, from the option table's (value, tensor): a
    one-element float32 tensor (the caller's, read when the work runs), or a
    number finite as float32 (the library's message; on CUDA the library does
    not read a device grad_loss before it runs) put on the device."""
    value, tensor = checked
    if tensor is None:
        # The float32 rounding is torch.full's, and the finiteness test two
        # comparisons (false for nan): torch.compile(dynamic=True) traces this
        # with a symbolic value, which neither struct-based rounding nor
        # math.isfinite can take.
        value = _f32_value("grad_loss", value)
        if not -_F32_OVERFLOW < value < _F32_OVERFLOW:
            shown = value if math.isnan(value) else math.copysign(math.inf, value)
            raise ValueError(f"grad_loss: expected a finite value, got {shown}")
        if value > _F32_MAX or value < -_F32_MAX:  # rounds to float32's largest (torch.full refuses it unrounded)
            value = _F32_MAX if value > 0 else -_F32_MAX
        return torch.full((), value, dtype=torch.float32, device=device)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"grad_loss: expected a real number or a one-element float32 torch.Tensor, got "
                        f"{type(tensor).__name__}")
    return tensor.detach()


def checked_grad_loss(x, device) -> torch.Tensor:
    return grad_loss_tensor(_grad_loss(x), device)


def on_stream(stream, device: torch.device):
    """The context in which an op runs on the stream option: None, the current
    stream; an int (a cudaStream_t) on CUDA, that stream (its outputs and
    workspace are then allocated for it); on the CPU only None or 0."""
    if stream is None:
        return contextlib.nullcontext()
    if device.type != "cuda":
        if stream != 0:
            raise ValueError(f"stream: expected None or 0 on the cpu backend (it runs on host threads), got {stream!r}")
        return contextlib.nullcontext()
    if stream == int(torch.cuda.current_stream(device).cuda_stream):
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device))


def library_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the library's validation is shown of a tensor that the forward hands
    to the backward as ``t.to(dtype).contiguous()``: t itself when that is t,
    else a stand-in of that dtype and t's shape, one row broadcast over the
    others (no copy of t; its values are never read by the validation)."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return torch.empty(t.shape[-1:], dtype=dtype, device=t.device).expand(t.shape)


def ids_int32(topk_indices: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """topk_indices as the library takes them: int32, contiguous (itself when
    already so). An id that int32 cannot hold (int64, uint32 or uint64 ids) is
    out of range for every sequence, so an invalid slot: it becomes -1, where a
    plain cast would wrap it onto a valid id (2**32 + 1 would read as 1). Done
    on the device with torch.where: no host synchronisation, so CUDA graphs
    capture it and torch.compile traces it. strict (the library's
    strict_indices): ValueError naming the first such id instead, which reads
    the ids to the host (one synchronisation on a GPU, two when one is found)."""
    ids = topk_indices
    if ids.dtype == torch.int32:
        return ids.contiguous()
    if ids.dtype in (torch.int8, torch.int16, torch.uint8, torch.uint16):
        return ids.to(torch.int32).contiguous()
    unsigned = ids.dtype in (torch.uint32, torch.uint64)
    # torch compares unsigned types wider than 8 bits on no device: compare in
    # int64, where a uint64 id of 2**63 or more turns negative (marked below).
    wide = ids.to(torch.int64)
    outside = (wide < _INT32_MIN) | (wide > _INT32_MAX)
    if unsigned:
        outside = outside | (wide < 0)
    if strict and bool(outside.any()):
        at = tuple(int(i) for i in outside.nonzero()[0])
        value = int(wide[at])
        value = value + 2**64 if value < 0 and unsigned else value
        # named as the library names a position: (b, t, slot) for BSHD, (t, slot) for THD
        names = ("b", "t", "slot")[-len(at):] if 1 < len(at) <= 3 else tuple(f"dim{d}" for d in range(len(at)))
        where = ", ".join(f"{n}={i}" for n, i in zip(names, at))
        raise ValueError(f"topk_indices: strict mode found an out-of-range id at ({where}): expected -1 or an id "
                         f"that fits int32, the library's id type ([-2^31, 2^31-1]), got id {value}")
    return torch.where(outside, torch.full((), -1, dtype=torch.int32, device=ids.device),
                       wide.to(torch.int32)).contiguous()


def library_float_dtypes(weights, in_fp64):
    """(weights, attn_score) dtypes the library is given: weights bf16 or float32
    as they are, others as float32; attn_score float32. In the fp64 mode
    (fp64(): the CPU backend) float64 weights and attn_score stay float64."""
    kept = (torch.bfloat16, torch.float32, torch.float64) if in_fp64 else (torch.bfloat16, torch.float32)
    return (weights.dtype if weights.dtype in kept else torch.float32), (torch.float64 if in_fp64 else torch.float32)


def library_inputs(index_q, weights, index_k, topk_indices, attn_score, in_fp64=False, strict=False):
    """The tensors as the library takes them: bf16 index_q/index_k, float32 (or
    bf16) weights, int32 topk_indices, float32 attn_score, all contiguous; in
    the fp64 mode float64 weights and a float64 attn_score (unrounded). A
    tensor already so is passed as it is (no copy)."""
    w_dtype, T_dtype = library_float_dtypes(weights, in_fp64)
    return (index_q.to(torch.bfloat16).contiguous(), weights.to(w_dtype).contiguous(),
            index_k.to(torch.bfloat16).contiguous(), ids_int32(topk_indices, strict),
            attn_score.to(T_dtype).contiguous())


def logits_operand(topk_logits, in_fp64=False):
    """topk_logits as the loss's library calls take them: None as it is; a
    float tensor as float32 (float64 in the fp64 mode), detached (a constant:
    the gradient flows through the logits the backward recomputes), its last
    dimension contiguous. TypeError for anything else, naming the argument."""
    if topk_logits is None:
        return None
    if not isinstance(topk_logits, torch.Tensor):
        raise TypeError(f"topk_logits: expected a torch.Tensor or None, got {type(topk_logits).__name__}")
    if not topk_logits.is_floating_point():
        raise TypeError(f"topk_logits: expected a floating-point tensor, got dtype {topk_logits.dtype}")
    t = topk_logits.detach().to(torch.float64 if in_fp64 else torch.float32)
    return t if t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def topk_operand(t: torch.Tensor, dtypes, cuda: bool) -> torch.Tensor:
    """index_q, weights or index_k as dsaib::indexer_topk reads it, without a
    copy where its strides are acceptable: ``t`` itself when its dtype is one of
    ``dtypes`` (the first is what other float dtypes are converted to), its last
    dimension contiguous and, on CUDA, its other strides and its storage offset
    multiples of 16 bytes (the cuda backend's rule: 8 bf16 or 16 float8
    elements; the storage's own base is aligned); else a contiguous copy in
    that dtype.
    Megatron's sequence-first views (``x.transpose(0, 1)`` of an
    ``[sq, b, H, D]`` tensor) pass as they are."""
    if t.dtype not in dtypes:
        t = t.to(dtypes[0])
    if t.dim() == 0:
        return t  # the library names the rank
    ok = t.stride(-1) == 1 or t.shape[-1] == 1
    if ok and cuda:
        per_16_bytes = max(16 // t.element_size(), 1)
        ok = t.storage_offset() % per_16_bytes == 0 and all(s % per_16_bytes == 0 for s in t.stride()[:-1])
    return t if ok else t.contiguous()


def range_int32(name: str, x, strict: bool = False):
    """starts or ends (``name``) as int32, read by the library in place when its
    last dimension is contiguous, else a contiguous copy (the rule of
    :func:`topk_operand`): an integer tensor's values outside int32 clamped
    (a range reaching outside its sequence is clipped by the library alike),
    on the device, no host synchronisation. ``strict`` (strict_ranges): such a
    value is a ValueError naming the argument, the row and the value passed,
    which reads the ranges to the host (one synchronisation on a GPU)."""
    if x is None:
        return x
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer dtype, got {x.dtype}")
    if x.dtype != torch.int32:
        raw = x.to(torch.int64)
        wide = raw
        if x.dtype == torch.uint64:  # 2**63 or more reads as negative in int64: above int32 all the same
            wide = torch.where(raw < 0, torch.full((), _INT32_MAX, dtype=torch.int64, device=raw.device), raw)
        if strict and x.dtype in (torch.int64, torch.uint32, torch.uint64):
            outside = (wide < _INT32_MIN) | (wide > _INT32_MAX)
            if bool(outside.any()):
                at = tuple(int(i) for i in outside.nonzero()[0])
                raise ValueError(f"{name}: strict mode found a range outside its sequence's keys at row {at}: "
                                 f"expected a value in [-2^31, 2^31-1] (int32) within its sequence, got "
                                 f"{int(raw[at]) % 2**64 if x.dtype == torch.uint64 else int(raw[at])}")
        x = wide.clamp(_INT32_MIN, _INT32_MAX).to(torch.int32)
    return topk_operand(x, (torch.int32,), False)
