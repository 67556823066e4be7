"""CPU tests of the dsaib Python package (numpy inputs; no torch needed): the
results against the float64 numpy reference. The arguments' rules and errors:
test_cpu_arguments.py."""
import numpy as np
import pytest

import dsaib
from conftest import make_problem, numpy_reference
from cpu_backward_cases import SM_SCALE, assert_close, run


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_float64_numpy_reference(seed):
    p = make_problem(seed)
    got = run(p, loss_coeff=0.7, grad_loss=1.5)
    assert all(g.dtype == np.float32 for g in got)
    assert_close(got, numpy_reference(p, SM_SCALE, loss_coeff=0.7, grad_loss=1.5))


def test_invalid_row_and_unselected_keys_are_zero():
    p = make_problem(0)
    dq, dw, dk = run(p)
    assert not dq[1, 2].any() and not dw[1, 2].any()
    selected = {(b, int(j)) for b in range(2) for j in p["topk_indices"][b].ravel() if 0 <= j < 7}
    for b in range(2):
        for j in range(7):
            if (b, j) not in selected:
                assert not dk[b, j].any()


def test_normalization_count_and_linearity():
    p = make_problem(2)
    base = run(p)
    doubled = run(p, normalization_count=5)  # N = 10 by default -> halving N doubles
    for a, b in zip(base, doubled):
        np.testing.assert_allclose(2 * a, b, rtol=1e-6, atol=1e-12)


def test_bf16_outputs_round_f32_outputs():
    p = make_problem(3)
    f32 = run(p)
    bf = run(p, out_dtype="bf16")
    for a, b in zip(f32, bf):
        assert b.dtype == np.uint16
        np.testing.assert_array_equal(dsaib.bf16_bits(a), b)


def test_caller_provided_outputs_are_written_and_returned():
    p = make_problem(4)
    want = run(p)
    out = tuple(np.full(x.shape, np.nan, dtype=np.float32) for x in want)
    got = run(p, out=out)
    assert all(g is o for g, o in zip(got, out))
    for g, w in zip(out, want):
        np.testing.assert_array_equal(g, w)


def test_inputs_unchanged_and_thread_count_irrelevant():
    p = make_problem(5)
    before = {k: v.copy() for k, v in p.items()}
    a = run(p, num_threads=1)
    b = run(p, num_threads=2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    for k in p:
        np.testing.assert_array_equal(p[k], before[k])


def test_thd_layout_matches_bshd():
    p = make_problem(6, invalid=False)
    B, S_q, H, D = p["index_q"].shape
    S_kv = p["index_k"].shape[1]
    thd = {k: np.ascontiguousarray(v.reshape((-1,) + v.shape[2:])) for k, v in p.items()}
    cu_q = np.arange(0, (B + 1) * S_q, S_q, dtype=np.int32)
    cu_k = np.arange(0, (B + 1) * S_kv, S_kv, dtype=np.int32)
    want = run(p)
    got = run(thd, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w.reshape(g.shape))


def test_global_ids_match_local():
    p = make_problem(7, invalid=False)
    S_kv = p["index_k"].shape[1]
    g = dict(p)
    g["topk_indices"] = (p["topk_indices"] + S_kv * np.arange(2, dtype=np.int32)[:, None, None]).astype(np.int32)
    for a, b in zip(run(p), run(g, id_mode="global")):
        np.testing.assert_array_equal(a, b)


def test_loss_finite_difference_in_weights():
    # dLoss/dw from indexer_backward vs a central difference of reference_kl_loss
    # (P recomputed from the logits, so it must be consistent with them).
    p = make_problem(8, invalid=False)
    q = dsaib.bf16_to_f32(p["index_q"]).astype(np.float64)
    k = dsaib.bf16_to_f32(p["index_k"]).astype(np.float64)
    x = np.einsum("bthd,bsd->bths", q, k)
    ids = p["topk_indices"]
    xs = np.take_along_axis(x, ids[:, :, None, :].repeat(x.shape[2], 2), axis=3)  # (B,S,H,topk)
    z = SM_SCALE * np.einsum("bth,bthi->bti", p["weights"].astype(np.float64), np.maximum(xs, 0))
    z -= z.max(-1, keepdims=True)
    P = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    p["index_score"] = P.astype(np.float32)
    _, dw, _ = run(p)
    loss = lambda pp: dsaib.reference_kl_loss(**pp, sm_scale=SM_SCALE, uint16_as_bf16=True)
    h = 1e-2
    for idx in [(0, 0, 0), (1, 4, 7), (0, 2, 3)]:
        hi, lo = dict(p), dict(p)
        hi["weights"] = p["weights"].copy(); hi["weights"][idx] += h
        lo["weights"] = p["weights"].copy(); lo["weights"][idx] -= h
        fd = (loss(hi) - loss(lo)) / (2 * h)
        assert abs(fd - dw[idx]) <= 1e-3 * max(1e-3, abs(fd)) + 1e-6, (idx, fd, dw[idx])


def _forward_inputs(p):
    return {n: p[n] for n in ("index_q", "weights", "index_k", "topk_indices", "attn_score")}


def test_loss_forward_matches_the_float64_loss_and_softmax():
    p = make_problem(3)
    loss, row_lse, row_target_mass, P = dsaib.indexer_kl_forward(
        **_forward_inputs(p), sm_scale=SM_SCALE, loss_coeff=0.7, uint16_as_bf16=True, return_index_score=True)
    assert [a.dtype for a in (loss, row_lse, row_target_mass, P)] == [np.float32] * 4
    assert loss.shape == () and row_lse.shape == row_target_mass.shape == (2, 5) and P.shape == (2, 5, 4)
    want = dsaib.reference_kl_loss(**_forward_inputs(p), index_score=p["index_score"], sm_scale=SM_SCALE,
                                   loss_coeff=0.7, uint16_as_bf16=True)
    assert abs(float(loss) - want) <= 1e-6 * abs(want)
    # P = exp(z - LSE): 0 at invalid slots, rows summing to 1 (the row without a valid slot: 0, LSE -inf)
    assert P[0, 0, 0] == 0 and P[0, 1, 1] == 0 and np.all(P[1, 2] == 0) and row_lse[1, 2] == -np.inf
    sums = P.sum(-1)
    np.testing.assert_allclose(np.delete(sums.reshape(-1), 7), 1.0, rtol=1e-6)
    assert row_target_mass[1, 2] == 0
    valid = P > 0
    np.testing.assert_allclose(row_target_mass, np.where(valid, p["attn_score"], 0).sum(-1), rtol=1e-6)


def test_p_free_backward_and_one_call_match_the_backward_given_p():
    p = make_problem(4)
    fwd = _forward_inputs(p)
    _, row_lse, row_target_mass, P = dsaib.indexer_kl_forward(**fwd, sm_scale=SM_SCALE, uint16_as_bf16=True,
                                                               return_index_score=True)
    with_p = run(dict(fwd, index_score=P), grad_loss=1.5)
    p_free = run(dict(fwd, index_score=None), grad_loss=1.5, row_lse=row_lse, row_target_mass=row_target_mass)
    assert_close(p_free, [np.asarray(g, dtype=np.float64) for g in with_p], rtol=1e-5, atol=5e-8)  # P rounded to float32 on one side
    loss, *grads = dsaib.indexer_kl_loss_and_grad(**fwd, sm_scale=SM_SCALE, grad_loss=1.5, uint16_as_bf16=True)
    assert loss.dtype == np.float32 and loss.shape == ()
    assert_close(grads, [np.asarray(g, dtype=np.float64) for g in with_p], rtol=1e-5, atol=5e-8)  # P rounded to float32 on one side
    assert float(loss) == float(dsaib.indexer_kl_forward(**fwd, sm_scale=SM_SCALE, uint16_as_bf16=True)[0])
    # errors are the library's: P given twice, or not at all
    with pytest.raises(ValueError, match=r"^row_lse: expected absent when index_score is given"):
        run(dict(fwd, index_score=P), row_lse=row_lse, row_target_mass=row_target_mass)
    with pytest.raises(TypeError, match=r"^index_score: expected an array"):
        run(dict(fwd, index_score=None))
    with pytest.raises(ValueError, match=r"^row_target_mass: expected shape"):
        run(dict(fwd, index_score=None), row_lse=row_lse, row_target_mass=row_target_mass[:1])
    with pytest.raises(ValueError, match=r"^weights: expected shape"):
        dsaib.indexer_kl_loss_and_grad(**dict(fwd, weights=p["weights"][:, :2]), sm_scale=SM_SCALE,
                                       uint16_as_bf16=True)
