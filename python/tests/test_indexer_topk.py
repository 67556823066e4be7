"""indexer_topk from Python: the DLPack front end (dsaib.indexer_topk) and the
torch op (dsaib.torch.indexer_topk, torch.ops.dsaib.indexer_topk) against this
file's own fp64 numpy selection (logits, the rank order, the visible ranges),
their argument rules (the option table's), strided views read without a copy,
and the chain into the loss (ids from the top-k, then the loss on them)."""
import numpy as np
import pytest

import dsaib

SEED = np.random.SeedSequence().entropy  # fresh inputs each run; printed on failure
print(f"test_indexer_topk seed {SEED}")


def rng(salt):
    return np.random.default_rng([SEED, salt])


# ---- the test's own fp64 selection ----------------------------------------------------


def sequences(layout, q_shape, k_shape, cu_q=None, cu_k=None):
    """[(query rows, key rows (flat), first key row)] per sequence, rows as flat indices."""
    if layout == "bshd":
        B, S_q, S_kv = q_shape[0], q_shape[1], k_shape[1]
        return [(np.arange(b * S_q, (b + 1) * S_q), np.arange(b * S_kv, (b + 1) * S_kv), b * S_kv) for b in range(B)]
    return [(np.arange(cu_q[b], cu_q[b + 1]), np.arange(cu_k[b], cu_k[b + 1]), int(cu_k[b]))
            for b in range(len(cu_q) - 1)]


def reference_topk(q, w, k, topk, layout="bshd", id_mode="local", order="logit_descending", causal_offset=None,
                   starts=None, ends=None, cu_q=None, cu_k=None):
    """(ids, logits float64, lengths) as docs say: I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]) in fp64,
    ranked by I descending, ties by id ascending, NaN above everything."""
    H, D = q.shape[-2:]
    qf, wf = q.reshape(-1, H, D).astype(np.float64), w.reshape(-1, H).astype(np.float64)
    kf = k.reshape(-1, D).astype(np.float64)
    n_rows = qf.shape[0]
    ids = np.full((n_rows, topk), -1, np.int32)
    logits = np.full((n_rows, topk), -np.inf)
    lengths = np.zeros(n_rows, np.int32)
    st = None if starts is None else starts.reshape(-1)
    en = None if ends is None else ends.reshape(-1)
    for rows, keys, first in sequences(layout, q.shape, k.shape, cu_q, cu_k):
        n_k = len(keys)
        for t_local, r in enumerate(rows):
            if st is not None:
                lo, hi = int(st[r]), int(en[r])
                if layout == "thd":
                    lo, hi = lo - first, hi - first
                lo, hi = max(lo, 0), min(hi, n_k)
            else:
                off = n_k - len(rows) if causal_offset is None else causal_offset
                lo, hi = 0, min(t_local + off + 1, n_k)
            if hi <= lo:
                continue
            pos = np.arange(lo, hi)
            dots = np.einsum("hd,sd->sh", qf[r], kf[first + pos])
            I = (np.maximum(dots, 0.0) * wf[r]).sum(-1)
            I = np.where(I == 0, 0.0, I)  # -0.0 ranks as +0.0
            key = np.where(np.isnan(I), -np.inf, -I)  # NaN first
            nan_first = ~np.isnan(I)
            sel = np.lexsort((pos, key, nan_first))[:topk]
            chosen, vals = pos[sel], I[sel]
            if order == "id_ascending":
                o = np.argsort(chosen, kind="stable")
                chosen, vals = chosen[o], vals[o]
            n = len(chosen)
            ids[r, :n] = chosen + (first if id_mode == "global" else 0)
            logits[r, :n] = vals
            lengths[r] = n
    out_rows = q.shape[:-2]
    return ids.reshape(out_rows + (topk,)), logits.reshape(out_rows + (topk,)), lengths.reshape(out_rows)


def bshd_problem(salt, B=2, S_q=6, S_kv=9, H=4, D=16):
    g = rng(salt)
    q = dsaib.bf16_bits(g.standard_normal((B, S_q, H, D)).astype(np.float32))
    w = g.standard_normal((B, S_q, H)).astype(np.float32)
    k = dsaib.bf16_bits(g.standard_normal((B, S_kv, D)).astype(np.float32))
    return q, w, k


def thd_problem(salt, lengths_q=(3, 7, 5), lengths_k=(4, 9, 5), H=4, D=16):
    g = rng(salt)
    q = dsaib.bf16_bits(g.standard_normal((sum(lengths_q), H, D)).astype(np.float32))
    w = g.standard_normal((sum(lengths_q), H)).astype(np.float32)
    k = dsaib.bf16_bits(g.standard_normal((sum(lengths_k), D)).astype(np.float32))
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    return q, w, k, cu_q, cu_k


def f32(bits):
    return dsaib.bf16_to_f32(bits)


def check_against_reference(got, want, logits_too=True):
    ids, logits, lengths = got
    w_ids, w_logits, w_lengths = want
    np.testing.assert_array_equal(ids, w_ids)
    np.testing.assert_array_equal(lengths, w_lengths)
    if logits_too:
        assert not np.isnan(logits).any()
        assert logits.dtype == np.float32
        # fp64 sums rounded once to float32 (another summation order may move the last bit)
        np.testing.assert_array_equal(np.isinf(logits), np.isinf(w_logits))
        finite = np.isfinite(w_logits)
        np.testing.assert_allclose(logits[finite], w_logits[finite], rtol=2e-7, atol=1e-12)


# ---- the DLPack front end ----------------------------------------------------------------


@pytest.mark.parametrize("id_mode", ["local", "global"])
@pytest.mark.parametrize("order", ["logit_descending", "id_ascending"])
@pytest.mark.parametrize("topk", [1, 4, 12])
def test_bshd_causal_matches_the_fp64_selection(id_mode, order, topk):
    q, w, k = bshd_problem(topk + 10 * len(order) + len(id_mode))
    got = dsaib.indexer_topk(q, w, k, topk, id_mode=id_mode, order=order, return_logits=True,
                             return_lengths=True, uint16_as_bf16=True)
    assert [x.dtype for x in got] == [np.int32, np.float32, np.int32]
    assert got[0].shape == (2, 6, topk) and got[2].shape == (2, 6)
    check_against_reference(got, reference_topk(f32(q), w, f32(k), topk, id_mode=id_mode, order=order))
    assert (got[0] == -1).any() == (topk > 4)  # causal rows with fewer keys than topk are padded with -1


@pytest.mark.parametrize("causal_offset", [0, -2, 5])
def test_causal_offset_moves_each_rows_window(causal_offset):
    q, w, k = bshd_problem(30 + causal_offset)
    got = dsaib.indexer_topk(q, w, k, 5, causal_offset=causal_offset, return_logits=True, return_lengths=True,
                             uint16_as_bf16=True)
    check_against_reference(got, reference_topk(f32(q), w, f32(k), 5, causal_offset=causal_offset))


def test_starts_and_ends_give_each_row_its_range_clipped_to_its_sequence():
    q, w, k = bshd_problem(40)
    g = rng(41)
    starts = g.integers(-3, 9, (2, 6)).astype(np.int32)
    ends = (starts + g.integers(-2, 8, (2, 6))).astype(np.int32)
    ends[0, 0] = 100  # past the sequence: clipped
    before = [a.copy() for a in (q, w, k, starts, ends)]
    got = dsaib.indexer_topk(q, w, k, 4, starts=starts, ends=ends, return_logits=True, return_lengths=True,
                             uint16_as_bf16=True)
    check_against_reference(got, reference_topk(f32(q), w, f32(k), 4, starts=starts, ends=ends))
    for a, b in zip((q, w, k, starts, ends), before):  # inputs are never modified
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("id_mode", ["local", "global"])
def test_thd_matches_the_fp64_selection(id_mode):
    q, w, k, cu_q, cu_k = thd_problem(50 + len(id_mode))
    got = dsaib.indexer_topk(q, w, k, 3, layout="thd", id_mode=id_mode, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             return_logits=True, return_lengths=True, uint16_as_bf16=True)
    assert got[0].shape == (15, 3) and got[2].shape == (15,)
    check_against_reference(got, reference_topk(f32(q), w, f32(k), 3, layout="thd", id_mode=id_mode, cu_q=cu_q,
                                                cu_k=cu_k))


def test_thd_ranges_are_flat_rows_of_index_k():
    q, w, k, cu_q, cu_k = thd_problem(60)
    seq = np.repeat(np.arange(3), np.diff(cu_q))
    g = rng(61)
    starts = (cu_k[seq] + g.integers(0, 3, seq.shape)).astype(np.int32)
    ends = (starts + g.integers(0, 6, seq.shape)).astype(np.int32)
    got = dsaib.indexer_topk(q, w, k, 4, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, starts=starts,
                             ends=ends, return_logits=True, return_lengths=True, uint16_as_bf16=True)
    check_against_reference(got, reference_topk(f32(q), w, f32(k), 4, layout="thd", starts=starts, ends=ends,
                                                cu_q=cu_q, cu_k=cu_k))


def test_the_default_returns_the_ids_alone_and_each_flag_adds_its_output():
    q, w, k = bshd_problem(70)
    ids = dsaib.indexer_topk(q, w, k, 3, uint16_as_bf16=True)
    assert isinstance(ids, np.ndarray) and ids.shape == (2, 6, 3)
    ids2, logits = dsaib.indexer_topk(q, w, k, 3, return_logits=True, uint16_as_bf16=True)
    ids3, lengths = dsaib.indexer_topk(q, w, k, 3, return_lengths=True, uint16_as_bf16=True)
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_array_equal(ids, ids3)
    assert logits.dtype == np.float32 and lengths.dtype == np.int32 and lengths.shape == (2, 6)


def test_a_nan_input_reaches_the_selected_logits():
    q, w, k = bshd_problem(80)
    q[0, 5, 0, 0] = 0x7FC0  # bf16 NaN in the last row of batch 0: every key's logit there is NaN
    ids, logits = dsaib.indexer_topk(q, w, k, 3, return_logits=True, uint16_as_bf16=True)
    assert np.isnan(logits[0, 5]).all()            # NaN ranks first and is kept, not dropped
    np.testing.assert_array_equal(ids[0, 5], [0, 1, 2])  # NaNs among themselves by id
    assert not np.isnan(np.delete(logits.reshape(12, 3), 5, axis=0)).any()


def test_ties_are_ranked_by_id():
    q, w, k = bshd_problem(90)
    k[:] = k[:, :1]  # every key of a batch row equal: equal logits
    ids = dsaib.indexer_topk(q, w, k, 4, uint16_as_bf16=True)
    want = np.where(np.arange(4) <= np.arange(6)[:, None] + 3, np.arange(4), -1)
    np.testing.assert_array_equal(ids, np.broadcast_to(want, ids.shape))


@pytest.mark.parametrize("name, value, error, message", [
    ("topk", 0, ValueError, r"^topk: expected an int in \[1, 2\^31-1\], got 0$"),
    ("topk", 2.0, TypeError, r"^topk: expected an int, got float 2.0$"),
    ("topk", True, TypeError, r"^topk: expected an int, got bool True$"),
    ("order", "descending", ValueError, r'^order: expected "logit_descending" or "id_ascending", got "descending"$'),
    ("order", 1, TypeError, r'^order: expected a str \("logit_descending" or "id_ascending"\), got int 1$'),
    ("causal_offset", 1.5, TypeError, r"^causal_offset: expected an int, got float 1.5$"),
    ("causal_offset", -2**63, ValueError, r"^causal_offset: expected an int in \[-2\^63\+1, 2\^63-1\] or None"),
    ("strict_ranges", "yes", TypeError, r"^strict_ranges: expected a bool, got str 'yes'$"),
    ("return_logits", 1, TypeError, r"^return_logits: expected a bool, got int 1$"),
    ("return_lengths", None, TypeError, r"^return_lengths: expected a bool, got NoneType None$"),
    ("layout", "sbhd", ValueError, r'^layout: expected "bshd" or "thd", got "sbhd"$'),
    ("id_mode", "flat", ValueError, r'^id_mode: expected "local" or "global", got "flat"$'),
    ("num_threads", 2**40, ValueError, r"^num_threads: expected an int in \[0, 2\^31-1\], got 1099511627776$"),
])
def test_arguments_are_checked_by_the_option_table_in_both_front_ends(name, value, error, message):
    q, w, k = bshd_problem(100)
    kwargs = {name: value}
    topk = kwargs.pop("topk", 3)
    calls = 0 if not hasattr(dsaib._dsaib, "library_calls") else dsaib._dsaib.library_calls()
    with pytest.raises(error, match=message):
        dsaib.indexer_topk(q, w, k, topk, uint16_as_bf16=True, **kwargs)
    assert dsaib._dsaib.library_calls() == calls  # refused before the library is called
    torch = pytest.importorskip("torch")
    import dsaib.torch as dt

    tq, tk = (torch.from_numpy(f32(x)).to(torch.bfloat16) for x in (q, k))
    with pytest.raises(error, match=message):
        dt.indexer_topk(tq, torch.from_numpy(w), tk, topk, **kwargs)


def test_tensor_arguments_are_named():
    q, w, k = bshd_problem(110)
    with pytest.raises(TypeError, match=r"^starts: expected an array"):
        dsaib.indexer_topk(q, w, k, 3, starts=[0, 1], ends=np.zeros((2, 6), np.int32), uint16_as_bf16=True)
    with pytest.raises(TypeError, match=r"^index_k: expected an array"):
        dsaib.indexer_topk(q, w, None, 3, uint16_as_bf16=True)


def test_the_library_checks_what_only_it_knows():
    q, w, k = bshd_problem(120)
    with pytest.raises(ValueError, match=r"^ends: expected a tensor \(starts and ends come together"):
        dsaib.indexer_topk(q, w, k, 3, starts=np.zeros((2, 6), np.int32), uint16_as_bf16=True)
    with pytest.raises(ValueError, match=r"^index_q: expected rank 4, got rank 3"):
        dsaib.indexer_topk(q[0], w, k, 3, uint16_as_bf16=True)
    with pytest.raises(TypeError, match=r"^index_k: expected dtype bf16"):
        dsaib.indexer_topk(q, w, k.astype(np.int32), 3, uint16_as_bf16=True)


def test_strict_ranges_names_a_range_outside_its_sequence():
    q, w, k = bshd_problem(130)
    starts = np.zeros((2, 6), np.int32)
    ends = np.full((2, 6), 9, np.int32)
    dsaib.indexer_topk(q, w, k, 3, starts=starts, ends=ends, strict_ranges=True, uint16_as_bf16=True)
    ends[1, 2] = 10
    with pytest.raises(ValueError, match=r"^ends: strict mode found a range outside its sequence's keys at "
                                         r"\(b=1, t=2\)"):
        dsaib.indexer_topk(q, w, k, 3, starts=starts, ends=ends, strict_ranges=True, uint16_as_bf16=True)
    ids = dsaib.indexer_topk(q, w, k, 3, starts=starts, ends=ends, uint16_as_bf16=True)  # clipped
    np.testing.assert_array_equal(ids, reference_topk(f32(q), w, f32(k), 3, starts=starts, ends=ends)[0])


def test_the_workspace_query_is_zero_on_the_cpu_backend():
    q, w, k = bshd_problem(140)
    out = np.empty((2, 6, 3), np.int32)
    n = dsaib._dsaib.indexer_topk_workspace_size(q, w, k, None, None, None, None, out, uint16_as_bf16=True,
                                                 backend="cpu")
    assert n == 0
    with pytest.raises(ValueError, match=r'^order: expected "logit_descending" or "id_ascending", got "x"$'):
        dsaib._dsaib.indexer_topk_workspace_size(q, w, k, None, None, None, None, out, uint16_as_bf16=True,
                                                 order="x")


def test_the_binding_is_one_library_call_and_takes_a_workspace_allocator_or_none():
    q, w, k = bshd_problem(150)
    ext = dsaib._dsaib
    ids = np.full((2, 6, 3), 7, np.int32)
    asked = []
    before = ext.library_calls()
    ext.indexer_topk(q, w, k, None, None, None, None, ids, workspace=lambda n: asked.append(n),
                     uint16_as_bf16=True, backend="cpu")
    assert ext.library_calls() == before + 1 and asked == []  # the cpu backend asks for no workspace
    np.testing.assert_array_equal(ids, reference_topk(f32(q), w, f32(k), 3)[0])
    with pytest.raises(TypeError, match=r"^workspace: expected None or a callable nbytes -> array"):
        ext.indexer_topk(q, w, k, None, None, None, None, ids, workspace=np.empty(8, np.uint8),
                         uint16_as_bf16=True)
    with pytest.raises(TypeError, match=r"^options: unexpected keyword argument 'sm_scale'$"):
        ext.indexer_topk(q, w, k, None, None, None, None, ids, uint16_as_bf16=True, sm_scale=1.0)
    table = ext.option_table("indexer_topk")
    assert list(table) == ["layout", "id_mode", "backend", "order", "causal_offset", "strict_ranges", "stream",
                           "num_threads"]
    assert table["order"] == ("word", "logit_descending", ("logit_descending", "id_ascending"))
    assert table["strict_ranges"] == ("bool", False, ()) and table["causal_offset"] == ("int64", -2**63, ())


def test_an_output_the_library_refuses_is_left_unwritten():
    q, w, k = bshd_problem(160)
    ids = np.full((2, 6, 3), 7, np.int32)
    lengths = np.full((2, 5), 9, np.int32)  # the wrong shape: refused before anything is written
    with pytest.raises(ValueError, match=r"^topk_lengths: "):
        dsaib._dsaib.indexer_topk(q, w, k, None, None, None, None, ids, topk_lengths=lengths, uint16_as_bf16=True)
    assert (ids == 7).all() and (lengths == 9).all()
