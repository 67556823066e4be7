"""torch CPU tests: skipped when torch is not installed."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsaib  # noqa: E402
from conftest import make_problem, numpy_reference  # noqa: E402


def to_torch(p):
    t = {}
    for k, v in p.items():
        if k in ("index_q", "index_k"):
            t[k] = torch.from_numpy(dsaib.bf16_to_f32(v)).to(torch.bfloat16)
        else:
            t[k] = torch.from_numpy(v)
    return t


def test_torch_bf16_matches_reference():
    p = make_problem(0)
    got = dsaib.indexer_backward(**to_torch(p), sm_scale=0.125)
    assert all(isinstance(g, torch.Tensor) and g.dtype == torch.float32 for g in got)
    for g, w in zip(got, numpy_reference(p, 0.125)):
        np.testing.assert_allclose(g.double().numpy(), w, rtol=1e-5, atol=1e-7)


def test_torch_bf16_outputs_and_bf16_weights():
    p = to_torch(make_problem(1))
    p["weights"] = p["weights"].to(torch.bfloat16)
    got = dsaib.indexer_backward(**p, sm_scale=0.125, out_dtype="bf16")
    assert all(g.dtype == torch.bfloat16 for g in got)


def test_torch_wrong_dtype_is_type_error():
    p = to_torch(make_problem(0))
    p["attn_score"] = p["attn_score"].double()
    with pytest.raises(TypeError, match="^attn_score: "):
        dsaib.indexer_backward(**p, sm_scale=0.125)
