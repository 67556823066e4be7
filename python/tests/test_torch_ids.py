"""The torch layer's conversion of topk_indices to int32 (ids_int32): an id
outside int32 is an invalid slot, never wrapped onto a valid id, for every
integer dtype, in the loss, the one call and index_scores; strict mode names
the first; the conversion runs on the device, in one compiled graph. Skipped
when torch is not installed."""
import pytest

torch = pytest.importorskip("torch")

import dsaib.torch as dt  # noqa: E402
from dsaib._torch.convert import ids_int32  # noqa: E402
from torch_reference import make_torch_problem  # noqa: E402

SM = 0.125


def _ids_beyond_int32(ids):
    """(int64 ids with some slots set to ids outside int32, the same ids with those slots -1)."""
    far = ids.long().clone()
    far[0, 0, :4] = torch.tensor([2**32, 2**32 + 1, -(2**32) + 3, 2**31])
    far[1, 2, 1] = -(2**31) - 1
    invalid = far.clone()
    invalid[0, 0, :4] = -1
    invalid[1, 2, 1] = -1
    return far, invalid


def test_ids_outside_int32_are_invalid_slots_not_wrapped():
    q, w, k, ids, T = make_torch_problem(seed=22, invalid=False)
    far, invalid = _ids_beyond_int32(ids)
    # wrapped, 2**32 and 2**32 + 1 would read as the valid ids 0 and 1
    assert not torch.equal(far.to(torch.int32), invalid.to(torch.int32))
    leaves = lambda: [x.detach().float().requires_grad_() for x in (q, w, k)]  # noqa: E731
    a, b = leaves(), leaves()
    la = dt.indexer_kl_loss(*a, far, T, sm_scale=SM)
    lb = dt.indexer_kl_loss(*b, invalid, T, sm_scale=SM)
    assert torch.equal(la, lb)
    la.backward()
    lb.backward()
    for x, y in zip(a, b):
        assert torch.equal(x.grad, y.grad)
    # the float64 forward (torch) and the fp64 library agree on them too
    for f in (dt.indexer_kl_loss, dt.indexer_kl_loss_and_grad):
        got = f(q.double(), w.double(), k.double(), far, T.double(), sm_scale=SM)
        want = f(q.double(), w.double(), k.double(), invalid, T.double(), sm_scale=SM)
        for x, y in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(x, y)
    for x, y in zip(dt.indexer_kl_loss_and_grad(q, w, k, far, T, sm_scale=SM),
                    dt.indexer_kl_loss_and_grad(q, w, k, invalid, T, sm_scale=SM)):
        assert torch.equal(x, y)
    assert torch.equal(dt.index_scores(q, w, k, far, sm_scale=SM), dt.index_scores(q, w, k, invalid, sm_scale=SM))


def test_ids_conversion_of_every_integer_dtype():
    got = ids_int32(torch.tensor([2**32, 2**32 + 1, -(2**31) - 1, -(2**31), 2**31 - 1, 2**31, 5, -1]))
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert got.tolist() == [-1, -1, -1, -(2**31), 2**31 - 1, -1, 5, -1]
    assert ids_int32(torch.tensor([2**32 - 1, 7], dtype=torch.uint32)).tolist() == [-1, 7]
    assert ids_int32(torch.tensor([2**63 + 5, 2**64 - 1, 7, 2**32], dtype=torch.uint64)).tolist() == [-1, -1, 7, -1]
    for dtype in (torch.int8, torch.int16, torch.uint8):
        assert ids_int32(torch.tensor([-1, 3, 100], dtype=torch.int16).to(dtype)).tolist() == (
            torch.tensor([-1, 3, 100], dtype=torch.int16).to(dtype).tolist())
    ids32 = torch.tensor([[1, -1], [3, 4]], dtype=torch.int32)
    assert ids_int32(ids32) is ids32
    strided = torch.arange(12, dtype=torch.int64).view(3, 4).t()
    assert torch.equal(ids_int32(strided), strided.to(torch.int32)) and ids_int32(strided).is_contiguous()


def test_ids_conversion_strict_names_the_first_id_outside_int32():
    ids = torch.tensor([[1, -1], [2**40, -(2**33)]])
    with pytest.raises(ValueError, match=r"^topk_indices: strict mode found an out-of-range id at \(t=1, slot=0\): "
                                         r"expected -1 or an id that fits int32, the library's id type "
                                         r"\(\[-2\^31, 2\^31-1\]\), got id 1099511627776$"):
        ids_int32(ids, strict=True)
    with pytest.raises(ValueError, match=r"at \(b=0, t=1, slot=0\): "):
        ids_int32(ids.unsqueeze(0), strict=True)
    with pytest.raises(ValueError, match=r"got id 9223372036854775813$"):
        ids_int32(torch.tensor([2**63 + 5], dtype=torch.uint64), strict=True)
    assert ids_int32(torch.tensor([[1, -1], [-(2**31), 2**31 - 1]]), strict=True).tolist() == [
        [1, -1], [-(2**31), 2**31 - 1]]


def test_ids_outside_int32_compile_in_one_graph():
    # the conversion runs on the device (torch.where): no graph break, no host read
    q, w, k, ids, T = make_torch_problem(seed=23, invalid=False)
    far, invalid = _ids_beyond_int32(ids)

    def loss_fn(q, w, k, ids, T):
        return dt.indexer_kl_loss(q, w, k, ids, T, sm_scale=SM)

    got = torch.compile(loss_fn, fullgraph=True, backend="eager")(q.float(), w, k.float(), far, T)
    assert torch.equal(got, loss_fn(q.float(), w, k.float(), invalid, T))
