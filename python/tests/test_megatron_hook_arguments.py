"""The Megatron hook's own arguments (dsaib.megatron._hooks, no megatron-core
needed): checked in Megatron's names and sequence-first shapes before dsaib
sees its transposed views, ranges and index_topk by dsaib.torch.indexer_topk's
rules (int64 clamped to int32, floats refused), and a k without rows; the loss
hook's query, key, query_valid_rows and loss_coeff against the indexer's
tensors."""
import re

import pytest

torch = pytest.importorskip("torch")

import dsaib.torch as dt  # noqa: E402
from dsaib.megatron import _hooks  # noqa: E402

SQ, B, H, D, SKV = 4, 1, 8, 64, 6


def tensors(seed=0, skv=SKV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(SQ, B, H, D, generator=g).to(torch.bfloat16)
    k = torch.randn(skv, B, D, generator=g).to(torch.bfloat16)
    w = torch.randn(SQ, B, H, generator=g)
    starts = torch.zeros(SQ, dtype=torch.int32)
    ends = torch.arange(1, SQ + 1, dtype=torch.int32) + (skv - SQ)
    return q, k, w, starts, ends


def topk(q, k, w, index_topk, starts, ends):
    return _hooks.run_fused_qk_topk(q, k, w, index_topk, starts, ends, block_size=64)


def test_int64_ranges_are_clamped_as_dsaib_torch_does():
    q, k, w, starts, ends = tensors(1)
    want = topk(q, k, w, 4, starts, torch.full((SQ,), SKV, dtype=torch.int32))
    got = topk(q, k, w, 4, starts.long(), torch.full((SQ,), 2**32, dtype=torch.int64))  # .to(int32) would wrap to 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[1].eq(4).all()
    reference = dt.indexer_topk(q.transpose(0, 1), w.transpose(0, 1), k.transpose(0, 1), 4,
                                starts=starts.long().expand(B, SQ), ends=torch.full((B, SQ), 2**32),
                                return_lengths=True)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))


def test_float_ranges_and_index_topk_are_refused():
    q, k, w, starts, ends = tensors(2)
    with pytest.raises(TypeError, match=r"^starts: expected an integer dtype, got torch.float32$"):
        topk(q, k, w, 4, starts.float() + 0.7, ends)
    with pytest.raises(TypeError, match=r"^ends: expected an integer dtype, got torch.float64$"):
        topk(q, k, w, 4, starts, ends.double())
    with pytest.raises(TypeError, match=r"^index_topk: expected an int, got float 4.7$"):
        topk(q, k, w, 4.7, starts, ends)
    with pytest.raises(ValueError, match=re.escape("index_topk: expected an int in [1, 2^31-1], got 0")):
        topk(q, k, w, 0, starts, ends)


def test_shapes_are_named_in_megatron_terms():
    q, k, w, starts, ends = tensors(3)
    cases = [
        (dict(weights=w.transpose(0, 1)), r"^weights: expected shape \(4, 1, 8\) \(\[sq, b, H\], of q's sizes\), "
                                          r"got shape \(1, 4, 8\)$"),
        (dict(q=q.flatten()), r"^q: expected a rank-4 tensor \[sq, b, H, D\], got shape \(2048,\)$"),
        (dict(k=k[..., :32]), r"^k: expected shape \(skv, 1, 64\) .*got shape \(6, 1, 32\)$"),
        (dict(starts=starts[:3]), r"^starts: expected shape \(4,\) \(\[sq\], of q's sizes\), got shape \(3,\)$"),
        (dict(ends=ends.expand(B, SQ)), r"^ends: expected a rank-1 tensor \[sq\], got shape \(1, 4\)$"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, w=w, starts=starts, ends=ends)
        args.update({("w" if n == "weights" else n): v for n, v in change.items()})
        with pytest.raises(ValueError, match=message):
            topk(args["q"], args["k"], args["w"], 4, args["starts"], args["ends"])


def test_arguments_of_other_types_are_named():
    q, k, w, starts, ends = tensors(4)
    with pytest.raises(TypeError, match=r"^starts: expected a torch.Tensor, got list$"):
        topk(q, k, w, 4, [0] * SQ, ends)
    with pytest.raises(TypeError, match=r"^k: expected a floating-point dtype, got torch.int32$"):
        topk(q, k.int(), w, 4, starts, ends)


def test_k_without_rows_gives_empty_rows():
    q, k, w, starts, ends = tensors(5, skv=0)
    ids, lengths = topk(q, k, w, 4, starts, torch.zeros(SQ, dtype=torch.int32))
    assert ids.shape == (B, SQ, 0) and ids.dtype == torch.int32
    assert lengths.shape == (B, SQ) and lengths.dtype == torch.int32 and lengths.eq(0).all()


NP, DQK = 16, 24


def loss_tensors(seed=6, skv=SKV):
    q, k, w, starts, ends = tensors(seed, skv)
    g = torch.Generator().manual_seed(seed + 100)
    query = torch.randn(SQ, B, NP, DQK, generator=g).to(torch.bfloat16)
    key = torch.randn(skv, B, 1, DQK, generator=g).to(torch.bfloat16)
    return q, k, w, starts, ends, query, key


def loss(q, k, w, starts, ends, query, key, loss_coeff=0.1, query_valid_rows=None, softmax_scale=0.2):
    return _hooks.run_fused_qk_topk_with_loss(q, k, w, 4, starts, ends, 64, query, key, softmax_scale=softmax_scale,
                                              loss_coeff=loss_coeff, pg_collection=None,
                                              query_valid_rows=query_valid_rows)


def test_loss_hook_checks_query_and_key_against_q_and_k():
    """key's rows are the keys the ids select: a key of another skv than k's
    would be read with k's ids (rows past its end as invalid slots), so it is
    refused, as is a query of another sq or b than q's, by name."""
    q, k, w, starts, ends, query, key = loss_tensors()
    kept = [t.clone() for t in (q, k, w, starts, ends, query, key)]
    cases = [
        (dict(key=key[:SKV - 2]), ValueError, r"^key: expected shape \(6, 1, 1, 24\) .*got shape \(4, 1, 1, 24\)$"),
        (dict(key=torch.cat([key, key])), ValueError, r"^key: expected shape \(6, 1, 1, 24\) .*got shape "
                                                      r"\(12, 1, 1, 24\)$"),
        (dict(key=key[..., :16]), ValueError, r"^key: expected shape \(6, 1, 1, 24\) .*got shape \(6, 1, 1, 16\)$"),
        (dict(key=key.squeeze(2)), ValueError, r"^key: expected shape \(6, 1, 1, 24\) .*got shape \(6, 1, 24\)$"),
        (dict(query=query[:SQ - 1]), ValueError, r"^query: expected shape \(4, 1, np, Dqk\) .*got shape "
                                                 r"\(3, 1, 16, 24\)$"),
        (dict(query=query.expand(SQ, 2, NP, DQK)), ValueError, r"^query: expected shape \(4, 1, np, Dqk\)"),
        (dict(query=query.tolist()), TypeError, r"^query: expected a torch.Tensor, got list$"),
        (dict(query_valid_rows=torch.ones(SQ + 1, dtype=torch.bool)), ValueError,
         r"^query_valid_rows: expected shape \(4,\) or \(1, 4\) \(\[sq\] or \[b, sq\] of q's sizes\), got "
         r"shape \(5,\)$"),
        (dict(loss_coeff="x"), TypeError, r"^loss_coeff: expected a real number, got str 'x'$"),
        (dict(loss_coeff=None), TypeError, r"^loss_coeff: expected a real number, got NoneType$"),
        (dict(loss_coeff=float("nan")), ValueError, r"^loss_coeff: expected a finite value, got nan$"),
        (dict(softmax_scale=None), TypeError, r"^softmax_scale: expected a real number, got NoneType$"),
        (dict(softmax_scale=float("inf")), ValueError, r"^softmax_scale: expected a finite value, got inf$"),
    ]
    for change, error, message in cases:
        args = dict(q=q, k=k, w=w, starts=starts, ends=ends, query=query, key=key)
        args.update(change)
        with pytest.raises(error, match=message):
            loss(**args)
    ids, lengths, value = loss(q, k, w, starts, ends, query, key)  # the unchanged arguments run
    assert torch.isfinite(value) and ids.shape == (B, SQ, 4)
    assert all(torch.equal(a, b) for a, b in zip(kept, (q, k, w, starts, ends, query, key)))


def test_loss_hook_with_k_without_rows_gives_zero_loss_and_gradients():
    q, k, w, starts, ends, query, key = loss_tensors(7, skv=0)
    q.requires_grad_(True)
    ids, lengths, value = loss(q, k, w, starts, torch.zeros(SQ, dtype=torch.int32), query, key)
    assert ids.shape == (B, SQ, 0) and lengths.eq(0).all()
    assert value.shape == () and value.dtype == torch.float32 and value.item() == 0.0
    value.backward()
    assert q.grad is not None and q.grad.eq(0).all() and q.grad.dtype == q.dtype


def test_loss_hook_refuses_a_graph_of_its_gradients():
    """The hook's gradients are formed in its forward and have no graph, so a
    backward with create_graph=True is refused when it starts instead of
    giving second derivatives of zero."""
    q, k, w, starts, ends, query, key = loss_tensors(8)
    q.requires_grad_(True)
    value = loss(q, k, w, starts, ends, query, key)[2]
    with pytest.raises(RuntimeError, match=r"^dsaib.megatron.run_fused_qk_topk_with_loss: expected a first-order "
                                           r"backward, got create_graph=True"):
        torch.autograd.grad(value, q, create_graph=True)
    (d_q,) = torch.autograd.grad(loss(q, k, w, starts, ends, query, key)[2], q)
    assert d_q.dtype == q.dtype and bool(torch.isfinite(d_q).all()) and bool(d_q.ne(0).any())


@pytest.mark.parametrize("sq,b", [(0, 1), (4, 0), (0, 0)])
def test_loss_hook_without_query_rows_gives_zero_loss_and_gradients(sq, b):
    """No query rows (sq or b 0) with keys: nothing to average over, so the
    loss and gradients are 0 in the inputs' shapes and dtypes, as with no keys."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(sq, b, H, D, generator=g).to(torch.bfloat16).requires_grad_()
    k = torch.randn(SKV, b, D, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(sq, b, H, generator=g).requires_grad_()
    query = torch.randn(sq, b, NP, DQK, generator=g).to(torch.bfloat16)
    key = torch.randn(SKV, b, 1, DQK, generator=g).to(torch.bfloat16)
    starts, ends = torch.zeros(sq, dtype=torch.int32), torch.full((sq,), SKV, dtype=torch.int32)
    ids, lengths, value = loss(q, k, w, starts, ends, query, key)
    assert ids.shape == (b, sq, 4) and lengths.shape == (b, sq)
    assert value.shape == () and value.dtype == torch.float32 and value.item() == 0.0
    value.backward()
    for x in (q, k, w):
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.dtype == x.dtype and x.grad.eq(0).all()
