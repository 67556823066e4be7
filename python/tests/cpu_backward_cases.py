"""The numpy front end's indexer backward as the CPU tests call it: the scale
they use, the call with its defaults, and the comparison of its outputs."""
import numpy as np

import dsaib

SM_SCALE = 0.125


def run(p, **kw):
    kw.setdefault("sm_scale", SM_SCALE)
    kw.setdefault("uint16_as_bf16", True)
    return dsaib.indexer_backward(**p, **kw)


def assert_close(got, want, rtol=1e-5, atol=1e-7):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g, dtype=np.float64), w, rtol=rtol, atol=atol)
