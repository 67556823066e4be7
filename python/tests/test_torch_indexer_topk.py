"""dsaib.torch.indexer_topk and torch.ops.dsaib.indexer_topk: opcheck and the
fake kernel's shapes, the same selection as the DLPack front end, sequence-first
strided views read without a copy, outputs that carry no gradient, and the chain
top-k -> loss (the ids of the top-k, -1 padded, taken by the loss), its loss
against the fp64 references. CUDA cases skip without a GPU."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsaib  # noqa: E402
import dsaib.torch as dt  # noqa: E402
from dsaib._torch import ops as dsaib_ops  # noqa: E402
from dsaib._torch.convert import topk_operand  # noqa: E402
from torch_reference import cuda_skip_reason, reference_loss  # noqa: E402

SEED = int(np.random.SeedSequence().entropy % 2**62)
print(f"test_torch_indexer_topk seed {SEED}")
GPU = cuda_skip_reason() is None


def gen(salt):
    return torch.Generator().manual_seed(SEED + salt)


def bshd(salt, B=2, S_q=6, S_kv=9, H=8, D=64, device="cpu"):
    g = gen(salt)
    q = torch.randn(B, S_q, H, D, generator=g).to(torch.bfloat16)
    w = torch.randn(B, S_q, H, generator=g) * (H * D) ** -0.5
    k = torch.randn(B, S_kv, D, generator=g).to(torch.bfloat16)
    return q.to(device), w.to(device), k.to(device)


def thd(salt, lengths=(4, 7, 5), H=8, D=64):
    g = gen(salt)
    T = sum(lengths)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    w = torch.randn(T, H, generator=g)
    k = torch.randn(T, D, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32)
    return q, w, k, cu


def numpy_front_end(q, w, k, topk, **kw):
    return dsaib.indexer_topk(q.view(torch.int16).numpy().view(np.uint16), w.numpy(),
                              k.view(torch.int16).numpy().view(np.uint16), topk, uint16_as_bf16=True, **kw)


def test_opcheck_bshd_and_thd():
    q, w, k = bshd(1)
    starts = torch.zeros(2, 6, dtype=torch.int32)
    ends = torch.randint(0, 10, (2, 6), generator=gen(2), dtype=torch.int32)
    for args in [(q, w, k, 4, None, None, None, None, "bshd", "local"),
                 (q, w, k, 4, starts, ends, None, None, "bshd", "global", "id_ascending", None, False, True, True),
                 (q, w, k, 3, None, None, None, None, "bshd", "local", "logit_descending", 2, False, True, False)]:
        torch.library.opcheck(torch.ops.dsaib.indexer_topk.default, args)
    tq, tw, tk, cu = thd(3)
    torch.library.opcheck(torch.ops.dsaib.indexer_topk.default,
                          (tq, tw, tk, 5, None, None, cu, cu, "thd", "global", "logit_descending", None, False, True,
                           True))


def test_the_fake_kernel_gives_the_outputs_shapes_and_dtypes():
    q, w, k = bshd(4)
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    fq, fw, fk = (mode.from_tensor(x) for x in (q, w, k))
    with mode:
        ids, logits, lengths = torch.ops.dsaib.indexer_topk(fq, fw, fk, 7, None, None, None, None, "bshd", "local",
                                                            with_logits=True, with_lengths=True)
        only_ids = torch.ops.dsaib.indexer_topk(fq, fw, fk, 7, None, None, None, None, "bshd", "local")
    assert (ids.shape, ids.dtype) == ((2, 6, 7), torch.int32)
    assert (logits.shape, logits.dtype) == ((2, 6, 7), torch.float32)
    assert (lengths.shape, lengths.dtype) == ((2, 6), torch.int32)
    assert only_ids[1].shape == (0,) and only_ids[2].shape == (0,)
    with pytest.raises(ValueError, match=r'^order: expected "logit_descending" or "id_ascending", got "x"$'):
        with mode:
            torch.ops.dsaib.indexer_topk(fq, fw, fk, 7, None, None, None, None, "bshd", "local", "x")


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_the_torch_op_selects_what_the_dlpack_front_end_does(layout):
    if layout == "bshd":
        q, w, k = bshd(5)
        kw = {}
    else:
        q, w, k, cu = thd(6)
        kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, id_mode="global")
    got = dt.indexer_topk(q, w, k, 5, return_logits=True, return_lengths=True, **kw)
    want = numpy_front_end(q, w, k, 5, return_logits=True, return_lengths=True,
                           **{n: (v.numpy() if isinstance(v, torch.Tensor) else v) for n, v in kw.items()})
    for a, b in zip(got, want):
        assert a.dtype in (torch.int32, torch.float32)
        np.testing.assert_array_equal(a.numpy(), b)
    assert not torch.isnan(got[1]).any()
    assert torch.equal(dt.indexer_topk(q, w, k, 5, **kw), got[0])


def test_sequence_first_views_are_read_in_place(monkeypatch):
    S, B, H, D = 12, 2, 8, 64
    g = gen(7)
    q_sb = torch.randn(S, B, H, D, generator=g).to(torch.bfloat16)
    w_sb = torch.randn(S, B, H, generator=g)
    k_sb = torch.randn(S, B, D, generator=g).to(torch.bfloat16)
    q, w, k = q_sb.transpose(0, 1), w_sb.transpose(0, 1), k_sb.transpose(0, 1)
    assert not q.is_contiguous() and not k.is_contiguous()
    seen = {}
    real = dsaib_ops.run_library

    def spy(entry, dev, tensors, options):
        seen.update({n: (t.data_ptr(), t.stride()) for n, t in tensors.items() if n in ("index_q", "weights",
                                                                                         "index_k")})
        return real(entry, dev, tensors, options)

    monkeypatch.setattr(dsaib_ops, "run_library", spy)
    got = dt.indexer_topk(q, w, k, 6, return_logits=True)
    assert seen == {"index_q": (q_sb.data_ptr(), q.stride()), "weights": (w_sb.data_ptr(), w.stride()),
                    "index_k": (k_sb.data_ptr(), k.stride())}
    want = dt.indexer_topk(q.contiguous(), w.contiguous(), k.contiguous(), 6, return_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the rule the conversion applies: such views as they are, a transposed last dimension copied
    assert topk_operand(q, (torch.bfloat16,), cuda=True) is q
    assert topk_operand(k, (torch.bfloat16,), cuda=True) is k
    odd = q[:, :, :, 1:]  # a storage offset that is no multiple of 8 elements: the cuda backend's copy
    assert topk_operand(odd, (torch.bfloat16,), cuda=False) is odd
    assert topk_operand(odd, (torch.bfloat16,), cuda=True).is_contiguous()
    kt = k_sb.permute(1, 2, 0)  # (B, D, S): D is not contiguous
    assert topk_operand(kt, (torch.bfloat16,), cuda=False).is_contiguous()
    # float8: 16 bytes are 16 elements, so an offset of 8 elements is copied on CUDA
    f8 = torch.zeros(2, 48, dtype=torch.float8_e4m3fn)
    assert topk_operand(f8[:, 16:], (torch.float8_e4m3fn,), cuda=True).data_ptr() == f8[:, 16:].data_ptr()
    half_row = f8[:, 8:]
    assert topk_operand(half_row, (torch.float8_e4m3fn,), cuda=False) is half_row
    assert topk_operand(half_row, (torch.float8_e4m3fn,), cuda=True).is_contiguous()
    assert topk_operand(f8.view(4, 24)[:, :16], (torch.float8_e4m3fn,), cuda=True).is_contiguous()  # stride 24


def test_outputs_carry_no_gradient_and_float_inputs_are_rounded_to_bf16():
    q, w, k = bshd(8)
    qf, kf = q.float().requires_grad_(), k.float().requires_grad_()
    wf = w.clone().requires_grad_()
    ids, logits, lengths = dt.indexer_topk(qf, wf, kf, 4, return_logits=True, return_lengths=True)
    assert not logits.requires_grad and logits.grad_fn is None and ids.dtype == torch.int32
    want = dt.indexer_topk(q, w, k, 4, return_logits=True, return_lengths=True)
    assert all(torch.equal(a, b) for a, b in zip((ids, logits, lengths), want))


def test_int64_ranges_are_taken_and_clamped_to_int32():
    q, w, k = bshd(9)
    starts = torch.randint(-2, 5, (2, 6), generator=gen(10))
    ends = starts + torch.randint(0, 6, (2, 6), generator=gen(11))
    ends[0, 0] = 2**40  # beyond int32: clipped to the sequence like any range past its end
    got = dt.indexer_topk(q, w, k, 4, starts=starts, ends=ends, return_lengths=True)
    want = dt.indexer_topk(q, w, k, 4, starts=starts.to(torch.int32), ends=ends.clamp(max=2**31 - 1).to(torch.int32),
                           return_lengths=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[1][0, 0] == min(4, 9 - max(int(starts[0, 0]), 0))
    with pytest.raises(TypeError, match=r"^starts: expected an integer dtype, got torch.float32$"):
        dt.indexer_topk(q, w, k, 4, starts=starts.float(), ends=ends)
    with pytest.raises(TypeError, match=r"^weights: expected a torch.Tensor, got ndarray$"):
        dt.indexer_topk(q, w.numpy(), k, 4)


# ---- the chain: top-k ids, then the loss on them ---------------------------------------


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_topk_ids_feed_the_loss_and_its_gradients(layout):
    """The top-k's ids (-1 past a short causal row's count: slots the loss ignores) go to
    the loss with the same layout and id_mode; the loss equals the fp64 references."""
    sm = 0.125
    q, w, k = bshd(12, B=2, S_q=8, S_kv=8)
    id_mode = "global" if layout == "thd" else "local"
    kw = {}
    if layout == "thd":
        cu = torch.tensor([0, 8, 16], dtype=torch.int32)
        q, w, k = q.reshape(16, 8, 64), w.reshape(16, 8), k.reshape(16, 64)
        kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
    ids = dt.indexer_topk(q, w, k, 4, id_mode=id_mode, **kw)
    assert (ids == -1).any() and (ids >= 0).any()  # the first causal rows see fewer than 4 keys
    T = torch.rand(ids.shape, generator=gen(13)) * (ids >= 0)
    T = T / T.sum(-1, keepdim=True)
    leaves = [x.detach().float().requires_grad_() for x in (q, w, k)]
    loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=sm, id_mode=id_mode, **kw)
    loss.backward()
    one_call = dt.indexer_kl_loss_and_grad(q.float(), w, k.float(), ids, T, sm_scale=sm, id_mode=id_mode, **kw)
    assert torch.equal(one_call[0], loss.detach())
    for g, x in zip(one_call[1:], leaves):
        torch.testing.assert_close(g, x.grad, rtol=1e-5, atol=1e-7)
    # fp64 references: the library's host loss, and torch autograd in float64 (BSHD shapes)
    host = dsaib.reference_kl_loss(q, w, k, ids, T, torch.zeros_like(T), sm_scale=sm, id_mode=id_mode,
                                   **kw)
    assert abs(float(loss.detach()) - host) <= 1e-5 * abs(host) and np.isfinite(host)
    shape4 = lambda x, tail: x.reshape((2, 8) + tail)  # noqa: E731
    bq, bw, bk = shape4(q, (8, 64)), shape4(w, (8,)), shape4(k, (64,))
    r_leaves = [x.detach().double().requires_grad_() for x in (bq, bw, bk)]
    ref = reference_loss(*r_leaves, shape4(ids, (4,)), shape4(T, (4,)).double(), sm_scale=sm, id_mode=id_mode)
    ref.backward()
    assert abs(float(loss.detach()) - float(ref.detach())) <= 1e-5 * abs(float(ref.detach()))
    for x, r in zip(leaves, r_leaves):
        torch.testing.assert_close(x.grad.double().reshape(r.shape), r.grad, rtol=2e-3, atol=1e-5)


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and dsaib's cuda backend")
def test_cuda_selection_passes_the_librarys_check_against_fp64():
    q, w, k = bshd(14, B=2, S_q=64, S_kv=256, H=16, D=64, device="cuda")
    ids, logits, lengths = dt.indexer_topk(q, w, k, 32, return_logits=True, return_lengths=True)
    want = dt.indexer_topk(q.cpu(), w.cpu(), k.cpu(), 32, return_logits=True, return_lengths=True)
    assert torch.equal(lengths.cpu(), want[2])
    # near-ties may exchange ids; the sets agree elsewhere, and the logits are close
    same = (ids.cpu().sort(-1).values == want[0].sort(-1).values).float().mean()
    assert same > 0.99
    finite = torch.isfinite(want[1])
    torch.testing.assert_close(logits.cpu()[finite], want[1][finite], rtol=1e-2, atol=1e-2)


# ---- argument conversions: ranges, float64 weights, outputs too large -------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ranges_with_a_strided_last_dimension_are_copied(dtype):
    """starts/ends follow index_q's rule: a non-contiguous last dimension (a
    transpose, an expand) is copied contiguous, not refused."""
    q, w, k = bshd(30)
    starts = torch.randint(0, 4, (2, 6), generator=gen(31), dtype=dtype)
    ends = starts + torch.randint(0, 6, (2, 6), generator=gen(32), dtype=dtype)
    want = dt.indexer_topk(q, w, k, 4, starts=starts, ends=ends, return_lengths=True)
    got = dt.indexer_topk(q, w, k, 4, starts=starts.t().contiguous().t(), ends=ends.t().contiguous().t(),
                          return_lengths=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    column = starts[:, :1]  # (2, 1) expanded over the rows: last-dimension stride 0
    got = dt.indexer_topk(q, w, k, 4, starts=column.expand(2, 6), ends=ends, return_lengths=True)
    want = dt.indexer_topk(q, w, k, 4, starts=column.expand(2, 6).contiguous(), ends=ends, return_lengths=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_strict_ranges_name_the_int64_value_passed():
    q, w, k = bshd(33)
    starts = torch.zeros(2, 6, dtype=torch.int64)
    ends = torch.full((2, 6), 9, dtype=torch.int64)
    ends[1, 2] = 2**40 + 9
    with pytest.raises(ValueError, match=r"^ends: .*row \(1, 2\).*got 1099511627785$"):
        dt.indexer_topk(q, w, k, 4, starts=starts, ends=ends, strict_ranges=True)
    starts[0, 3] = -(2**33)
    with pytest.raises(ValueError, match=r"^starts: .*row \(0, 3\).*got -8589934592$"):
        dt.indexer_topk(q, w, k, 4, starts=starts, ends=ends, strict_ranges=True)
    # without strict_ranges the values are clamped, then clipped to the sequence
    assert dt.indexer_topk(q, w, k, 4, starts=starts, ends=ends, return_lengths=True)[1].eq(4).all()


def test_float64_weights_reach_the_cpu_backend_unrounded():
    """Two keys whose logits differ only below float32's precision: the float64
    weights select as dsaib.indexer_topk does on them, not as float32 weights."""
    H, D = 8, 64
    q = torch.zeros(1, 1, H, D, dtype=torch.bfloat16)
    q[0, 0, 0, 0], q[0, 0, 1, 1] = 1.0, 1.0
    k = torch.zeros(1, 2, D, dtype=torch.bfloat16)
    k[0, 0, 0], k[0, 1, 1] = 1.0, 1.0  # key 0 scores weights[0], key 1 weights[1]
    w = torch.zeros(1, 1, H, dtype=torch.float64)
    w[0, 0, 0], w[0, 0, 1] = 1.0, 1.0 + 2.0**-40  # equal in float32: key 0 first by id
    ids = dt.indexer_topk(q, w, k, 1, causal_offset=1)
    assert ids.tolist() == [[[1]]]
    assert dt.indexer_topk(q, w.float(), k, 1, causal_offset=1).tolist() == [[[0]]]
    generic = dsaib.indexer_topk(q.view(torch.int16).numpy().view(np.uint16), w.numpy(),
                                 k.view(torch.int16).numpy().view(np.uint16), 1, causal_offset=1, uint16_as_bf16=True)
    assert generic.tolist() == ids.tolist()


def test_outputs_too_large_are_a_memory_error_naming_topk(monkeypatch):
    # The allocator is made to refuse the 103 GB of ids: whether a real one does
    # depends on the host (under memory overcommit it grants them, and the run that
    # writes them is killed), and a test must not.
    allocate = torch.Tensor.new_empty

    def refusing(self, size, **kw):
        if math.prod(size) > 2**30:
            raise torch.OutOfMemoryError(f"refused {math.prod(size)} elements")
        return allocate(self, size, **kw)

    monkeypatch.setattr(torch.Tensor, "new_empty", refusing)
    q, w, k = bshd(34)
    with pytest.raises(MemoryError, match=r"^topk: .*got topk 2147483647: 12 query rows need 103079215056 bytes .*"
                                          r"\(refused 25769803764 elements\)$"):
        dt.indexer_topk(q, w, k, 2**31 - 1)


@pytest.mark.parametrize("id_mode, B, S_kv, message", [
    ("global", 2**21 + 1, 1024, r"^index_k: expected B\*S_kv at most 2\^31 with id_mode global \(int32 ids\), got "
                                r"B\*S_kv = 2147484672 \(shape \(2097153, 1024, 1\)\)$"),
    ("local", 1, 2**31 + 1, r"^index_k: expected S_kv at most 2\^31 \(int32 ids\), got S_kv = 2147483649 "
                            r"\(shape \(1, 2147483649, 1\)\)$"),
])
def test_ids_that_would_not_fit_int32_are_refused(id_mode, B, S_kv, message):
    # Stride-0 views: the key count is huge, the memory is not.
    q = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16).expand(B, 1, 1, 1)
    w = torch.ones(1, 1, 1).expand(B, 1, 1)
    k = torch.ones(1, 1, 1, dtype=torch.bfloat16).expand(B, S_kv, 1)
    starts = torch.zeros(B, 1, dtype=torch.int32)
    ends = torch.ones(B, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        dt.indexer_topk(q, w, k, 1, starts=starts, ends=ends, id_mode=id_mode)
