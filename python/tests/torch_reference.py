"""float64 torch autograd reference of the indexer KL loss (docs/math.md), for the torch tests.

Written independently of dsaib.torch: gather the selected keys, recompute the
logits, a masked softmax, the clipped cross-entropy; torch.autograd gives the
gradients. BSHD layout, local or global ids.

Beside it: the error measures (relative RMS and max), torch's deterministic
mode for a block, the warm-up before a CUDA-graph capture, and what the CUDA
tests (test_torch_gpu_backward.py, test_torch_gpu_loss.py) share: the device,
the tolerances, problems on the device, a caching allocator poisoned with NaN.
"""
import contextlib
import math

import torch

EPS = math.exp(-100.0)


def cuda_skip_reason():
    """Why the CUDA tests cannot run here (None when they can): no CUDA device
    visible to torch, or an installed dsaib without a usable cuda backend."""
    import dsaib

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not dsaib.cuda_backend_available():
        return "dsaib has no usable cuda backend here (CPU-only build, or no compute capability 9.0 device)"
    return None


def reference_loss(q, w, k, ids, T, *, sm_scale, loss_coeff=1.0, normalization_count=0, id_mode="local"):
    """Loss = -(loss_coeff/N) sum_rows sum_valid max(T,eps) log(max(P,eps)), P = softmax of the logits.

    q (B,S,H,D), w (B,S,H), k (B,S_kv,D): float64 (requires_grad as needed);
    ids (B,S,topk) integer; T (B,S,topk) float.
    """
    B, S, H, D = q.shape
    S_kv = k.shape[1]
    ids = ids.to(device=q.device, dtype=torch.int64)
    b = torch.arange(B, device=q.device).view(B, 1, 1)
    local = ids - b * S_kv if id_mode == "global" else ids
    valid = (local >= 0) & (local < S_kv)
    safe = torch.where(valid, local, torch.zeros_like(local))
    kg = k[b, safe]                                         # (B, S, topk, D)
    x = torch.einsum("bshd,bsid->bshi", q, kg)              # (B, S, H, topk)
    z = sm_scale * torch.einsum("bsh,bshi->bsi", w, torch.relu(x))
    z = z.masked_fill(~valid, float("-inf"))
    z = torch.where(valid.any(-1, keepdim=True), z, torch.zeros_like(z))  # rows with no valid slot
    P = torch.softmax(z, dim=-1)
    terms = T.to(q).clamp_min(EPS) * torch.log(P.clamp_min(EPS))
    N = normalization_count or B * S
    return -(loss_coeff / N) * torch.where(valid, terms, torch.zeros_like(terms)).sum()


def reference_grads(q, w, k, ids, T, **kw):
    """(loss, dq, dw, dk, P) in float64 at the given values (any float dtype; converted to float64)."""
    q64 = q.detach().to(torch.float64).requires_grad_()
    w64 = w.detach().to(torch.float64).requires_grad_()
    k64 = k.detach().to(torch.float64).requires_grad_()
    loss = reference_loss(q64, w64, k64, ids, T, **kw)
    dq, dw, dk = torch.autograd.grad(loss, (q64, w64, k64))
    return loss.detach(), dq, dw, dk


def reference_index_scores(q, w, k, ids, *, sm_scale, id_mode="local"):
    """P in float64 (0 at invalid slots)."""
    q, w, k = (t.detach().to(torch.float64) for t in (q, w, k))
    B, S, H, D = q.shape
    S_kv = k.shape[1]
    ids = ids.to(device=q.device, dtype=torch.int64)
    b = torch.arange(B, device=q.device).view(B, 1, 1)
    local = ids - b * S_kv if id_mode == "global" else ids
    valid = (local >= 0) & (local < S_kv)
    safe = torch.where(valid, local, torch.zeros_like(local))
    x = torch.einsum("bshd,bsid->bshi", q, k[b, safe])
    z = (sm_scale * torch.einsum("bsh,bshi->bsi", w, torch.relu(x))).masked_fill(~valid, float("-inf"))
    z = torch.where(valid.any(-1, keepdim=True), z, torch.zeros_like(z))
    return torch.where(valid, torch.softmax(z, dim=-1), torch.zeros_like(z))


def make_torch_problem(*, B=2, S=5, S_kv=7, H=8, D=64, topk=4, seed=0, device="cpu", invalid=True,
                       causal=False, w_dtype=torch.float32, scale=1.0):
    """bf16 q/k, w (w_dtype), int32 ids (with invalid slots), a normalised float32 T."""
    g = torch.Generator().manual_seed(seed)
    q = (scale * torch.randn(B, S, H, D, generator=g)).to(torch.bfloat16)
    w = torch.randn(B, S, H, generator=g).to(w_dtype)
    k = (scale * torch.randn(B, S_kv, D, generator=g)).to(torch.bfloat16)
    if causal:
        # row t selects among keys 0..t (S == S_kv), -1 for the surplus slots
        ids = torch.full((B, S, topk), -1, dtype=torch.int32)
        for t in range(S):
            n = min(topk, t + 1)
            for bb in range(B):
                ids[bb, t, :n] = torch.randperm(t + 1, generator=g)[:n].to(torch.int32)
    else:
        ids = torch.randint(0, S_kv, (B, S, topk), generator=g, dtype=torch.int32)
    if invalid and S >= 4 and topk >= 3:
        ids[0, 0, 0] = -1                  # the conventional empty slot
        ids[-1, 2, :] = -1                 # a row with no valid slot
        ids[0, 1, 1] = S_kv + 3            # out of range (ignored)
        ids[-1, 3, 2] = ids[-1, 3, 1]      # a duplicate id
    T = torch.rand(B, S, topk, generator=g)
    T = T / T.sum(-1, keepdim=True)
    return [t.to(device) for t in (q, w, k, ids, T)]


def rel_rms(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def rel_max(got, want):
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def assert_close_rms(name, got, want, rms_tol, max_tol):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values (NaN never passes)"
    r, m = rel_rms(got, want), rel_max(got, want)
    assert r <= rms_tol and m <= max_tol, f"{name}: rel RMS {r:.3e} (tol {rms_tol:.1e}), rel max {m:.3e} (tol {max_tol:.1e})"
    return r, m


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) inside the block; the previous
    setting (and its warn_only) after it."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def warm_up_on_side_stream(step, runs=2):
    """Runs `step` `runs` times on a fresh side stream ordered after the current
    stream, then orders the current stream after it: the warm-up that torch asks
    for before a CUDA-graph capture (caching allocator, lazy initialisation)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(runs):
            step()
    torch.cuda.current_stream().wait_stream(side)


# ---- the CUDA tests' device, tolerances and problems ----------------------------

DEV = torch.device("cuda")
# Relative RMS allowed between a run and a rescaled run (grad_loss linearity).
LINEARITY_RTOL = 1e-4
# The library's acceptance criteria (docs/math.md section 6) per output dtype.
TOL = {torch.bfloat16: (3e-3, 1.5e-2), torch.float32: (1e-3, 5e-3)}  # (rel RMS, rel max)
NAMES = ("d_index_q", "d_weights", "d_index_k")


def cuda_problem(**kw):
    """make_torch_problem's tensors on the CUDA device."""
    return make_torch_problem(device=DEV, **kw)


def poison_allocator(*shapes_dtypes):
    """Fill blocks the caching allocator will hand out next with NaN, then free them."""
    blocks = [torch.full(s, float("nan"), dtype=d, device=DEV) for s, d in shapes_dtypes]
    torch.cuda.synchronize()
    del blocks
