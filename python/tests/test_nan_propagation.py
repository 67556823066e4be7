"""A NaN in one input reaches the loss and the gradients as it does through
torch's own float64 autograd (docs/math.md, "NaN and infinities"): relu(NaN) is
NaN, so the loss is NaN, and each gradient is NaN exactly where torch's is;
every other entry equals torch's. CPU backend; skipped without torch."""
import pytest

torch = pytest.importorskip("torch")

import dsaib.torch as dt  # noqa: E402
from torch_reference import make_torch_problem, reference_grads, reference_index_scores  # noqa: E402

SM = 0.125
NAMES = ("d_index_q", "d_weights", "d_index_k")

# (input, where the NaN goes): one element of one row (index_q, weights,
# attn_score) or of one key row (index_k), the rest finite.
PLACES = {
    "index_q": (0, 1, 3, 5),
    "weights": (1, 2, 4),
    "index_k": (0, 4, 7),
    "attn_score": (1, 3, 1),
}


def nan_problem(where):
    """q, w, k, ids, T (make_torch_problem without invalid slots: every slot is
    valid, so torch's gather of a stand-in key for invalid slots cannot add
    NaN that the library, which never reads such a slot, would not) with a NaN
    at PLACES[where]."""
    q, w, k, ids, T = make_torch_problem(B=2, S=5, S_kv=7, H=8, D=64, topk=4, seed=31, invalid=False)
    q, w, k, T = (x.clone() for x in (q, w, k, T))
    target = dict(index_q=q, weights=w, index_k=k, attn_score=T)[where]
    target[PLACES[where]] = float("nan")
    return q, w, k, ids, T


def assert_nan_where_torch_has_it(name, got, want, rtol):
    """NaN exactly where torch's float64 autograd has NaN, and elsewhere equal to
    it within rtol of the largest finite reference entry."""
    got = got.detach().double().reshape(want.shape)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (
        f"{name}: NaN at {torch.isnan(got).nonzero().tolist()}, torch's at {torch.isnan(want).nonzero().tolist()}")
    finite = ~torch.isnan(want)
    assert torch.isfinite(got[finite]).all(), f"{name}: non-finite where torch's is finite"
    scale = want[finite].abs().max().clamp_min(1e-30)
    err = ((got[finite] - want[finite]).abs().max() / scale).item()
    assert err <= rtol, f"{name}: max error {err:.3e} of the largest entry (tolerance {rtol:.1e})"


@pytest.mark.parametrize("where", list(PLACES))
def test_torch_reference_itself_gives_nan_loss_and_some_finite_gradients(where):
    q, w, k, ids, T = nan_problem(where)
    loss, *grads = reference_grads(q, w, k, ids, T, sm_scale=SM)
    assert torch.isnan(loss)
    for name, g in zip(NAMES, grads):
        # the case is informative: some entries NaN, some finite
        assert torch.isnan(g).any() and not torch.isnan(g).all(), (where, name)


@pytest.mark.parametrize("leaf_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("where", list(PLACES))
def test_loss_and_autograd_gradients_are_nan_where_torchs_are(where, leaf_dtype):
    q, w, k, ids, T = nan_problem(where)
    want_loss, *want = reference_grads(q, w, k, ids, T, sm_scale=SM, loss_coeff=0.9)
    leaves = [x.detach().to(leaf_dtype).requires_grad_() for x in (q, w, k)]
    loss = dt.indexer_kl_loss(*leaves, ids, T.to(leaf_dtype), sm_scale=SM, loss_coeff=0.9)
    assert torch.isnan(loss), f"{where}: loss {loss.item()}, torch's {want_loss.item()}"
    loss.backward()
    for name, x, r in zip(NAMES, leaves, want):
        assert_nan_where_torch_has_it(f"{where}: {name}", x.grad, r, 1e-5)


@pytest.mark.parametrize("leaf_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("where", list(PLACES))
def test_one_call_loss_and_gradients_are_nan_where_torchs_are(where, leaf_dtype):
    q, w, k, ids, T = nan_problem(where)
    want_loss, *want = reference_grads(q, w, k, ids, T, sm_scale=SM)
    loss, *got = dt.indexer_kl_loss_and_grad(*(x.to(leaf_dtype) for x in (q, w, k)), ids, T.to(leaf_dtype),
                                             sm_scale=SM)
    assert torch.isnan(loss), f"{where}: loss {loss.item()}, torch's {want_loss.item()}"
    for name, g, r in zip(NAMES, got, want):
        assert_nan_where_torch_has_it(f"{where}: {name}", g, r, 1e-5)


@pytest.mark.parametrize("form", ["index_score", "row_statistics"])
@pytest.mark.parametrize("where", list(PLACES))
def test_backward_op_gradients_are_nan_where_torchs_are(where, form):
    q, w, k, ids, T = nan_problem(where)
    _, *want = reference_grads(q, w, k, ids, T, sm_scale=SM)
    if form == "index_score":
        P = reference_index_scores(q, w, k, ids, sm_scale=SM).float()
        got = dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM)
    else:
        loss, row_lse, row_target_mass = dt.indexer_kl_forward(q, w, k, ids, T, sm_scale=SM)
        assert torch.isnan(loss)
        got = dt.indexer_backward(q, w, k, ids, T, None, sm_scale=SM, row_lse=row_lse,
                                  row_target_mass=row_target_mass)
    for name, g, r in zip(NAMES, got, want):
        # P rounded to float32 in the index_score form
        assert_nan_where_torch_has_it(f"{where}: {name}", g, r, 1e-5 if form == "row_statistics" else 1e-4)
