"""CPU tests of the dsaib Python package's arguments (numpy inputs; no torch
needed): every error type and message (the C++ ones mapped to Python
exception types), dtypes, outputs, options and DLPack capsules."""
import re

import numpy as np
import pytest

import dsaib
from conftest import make_problem, numpy_reference
from cpu_backward_cases import SM_SCALE, assert_close, run


def expect_backward_and_reference_refuse(problem, error, pattern):
    """The backward and the loss's reference both raise `error` matching `pattern`."""
    with pytest.raises(error, match=pattern):
        run(problem)
    with pytest.raises(error, match=pattern):
        dsaib.reference_kl_loss(**problem, sm_scale=SM_SCALE, uint16_as_bf16=True)


# --- errors: the C++ messages, mapped to Python exception types ---------------

def test_bad_shape_is_value_error_with_cpp_message():
    p = make_problem(0)
    p["weights"] = np.ascontiguousarray(p["weights"][:, :2])
    with pytest.raises(ValueError, match=r"^weights: expected shape \(2, 5, 8\) \(B, S_q, H\), got shape \(2, 2, 8\)$"):
        run(p)


def test_unsupported_heads_is_value_error():
    p = make_problem(0)
    with pytest.raises(ValueError, match=r"^index_q: "):
        run(dict(p, index_q=np.ascontiguousarray(p["index_q"][:, :, :4]), weights=np.ascontiguousarray(p["weights"][:, :, :4])))


def test_wrong_dtype_is_type_error_with_cpp_message():
    p = make_problem(0)
    p["index_score"] = p["index_score"].astype(np.int32)
    with pytest.raises(TypeError, match=r"^index_score: expected dtype f32 or f64, got dtype i32$"):
        run(p)


def test_uint16_without_flag_is_type_error():
    with pytest.raises(TypeError, match="uint16_as_bf16=True"):
        dsaib.indexer_backward(**make_problem(0), sm_scale=SM_SCALE)


def test_bf16_outputs_do_not_relax_uint16_inputs():
    with pytest.raises(TypeError, match=r"^index_q: .*uint16_as_bf16=True"):
        dsaib.indexer_backward(**make_problem(0), sm_scale=SM_SCALE, out_dtype="bf16")


def test_caller_uint16_outputs_are_bf16_with_the_flag():
    p = make_problem(0)
    out = tuple(np.empty(x.shape, np.uint16) for x in (p["index_q"], p["weights"], p["index_k"]))
    run(p, out=out)  # uint16_as_bf16=True: uint16 outputs hold bf16
    for o, w in zip(out, run(p, out_dtype="bf16")):
        np.testing.assert_array_equal(o, w)


def test_out_with_out_dtype_is_refused():
    # out= writes its arrays' own dtypes: an out_dtype beside it would be ignored
    p = make_problem(0)
    out = tuple(np.empty(x.shape, np.float32) for x in (p["index_q"], p["weights"], p["index_k"]))
    for o in out:
        o.fill(np.nan)
    with pytest.raises(ValueError, match=r"^out_dtype: expected None with out= .*got 'bf16'$"):
        run(p, out=out, out_dtype="bf16")
    assert all(np.isnan(o).all() for o in out)  # nothing written


def test_caller_uint16_outputs_without_the_flag_are_type_error():
    p = make_problem(0)
    for name in ("index_q", "index_k"):  # no uint16 input: only the outputs are uint16
        p[name] = dsaib.bf16_to_f32(p[name])
    out = tuple(np.empty(x.shape, np.uint16) for x in (p["index_q"], p["weights"], p["index_k"]))
    with pytest.raises(TypeError, match=r"^d_index_q: .*uint16_as_bf16=True"):
        dsaib.indexer_backward(**p, sm_scale=SM_SCALE, out=out)


def test_float64_inputs_are_read_as_they_are_on_cpu():
    # weights, attn_score, index_score in float64 holding the same values: the same
    # gradients; index_q stays bf16 (the library's message, naming f64).
    p = make_problem(0)
    want = run(p, out_dtype="f64")
    wide = dict(p, **{n: p[n].astype(np.float64) for n in ("weights", "attn_score", "index_score")})
    for g, w in zip(run(wide, out_dtype="f64"), want):
        np.testing.assert_array_equal(g, w)
    wide["index_q"] = dsaib.bf16_to_f32(p["index_q"]).astype(np.float64)
    with pytest.raises(TypeError, match=r"^index_q: expected dtype bf16, got dtype f64$"):
        run(wide)


def test_f64_outputs_hold_the_unrounded_fp64_results():
    p = make_problem(1)
    f64 = run(p, loss_coeff=0.75, grad_loss=1.5, out_dtype="f64")  # scalars exact in float32
    f32 = run(p, loss_coeff=0.75, grad_loss=1.5)
    assert all(g.dtype == np.float64 for g in f64)
    for g64, g32 in zip(f64, f32):
        np.testing.assert_array_equal(g64.astype(np.float32), g32)  # one rounding of the same fp64 value
        assert (g64 != g64.astype(np.float32)).any()                # beyond float32: not rounded
    assert_close(f64, numpy_reference(p, SM_SCALE, loss_coeff=0.75, grad_loss=1.5), rtol=1e-10, atol=1e-15)
    loss, *grads = dsaib.indexer_kl_loss_and_grad(
        **{k: v for k, v in p.items() if k != "index_score"}, sm_scale=SM_SCALE, uint16_as_bf16=True,
        out_dtype="f64")
    assert loss.dtype == np.float64 and all(g.dtype == np.float64 for g in grads)
    bad = r'^out_dtype: expected "f32", "bf16" or "f64", or a tuple of three such codes, got %s$'
    with pytest.raises(ValueError, match=bad % r"'f16'"):
        run(p, out_dtype="f16")
    with pytest.raises(ValueError, match=bad % r"\('f32', 'f32'\)"):
        run(p, out_dtype=("f32", "f32"))
    # one code per gradient, as dsaib.torch takes them
    mixed = run(p, loss_coeff=0.75, grad_loss=1.5, out_dtype=("f64", "f32", "bf16"))
    assert [g.dtype for g in mixed] == [np.float64, np.float32, np.uint16]
    np.testing.assert_array_equal(mixed[0], f64[0])
    np.testing.assert_array_equal(mixed[1], f32[1])


@pytest.mark.parametrize("name,dtype,want", [
    ("topk_indices", np.int64, "i32"),
    ("attn_score", np.float16, "f32 (or f64 on the cpu backend)"),
    ("index_score", np.float16, "f32 (or f64 on the cpu backend)"),
    ("index_q", np.float16, "bf16"),
    ("weights", np.int64, "bf16 or f32 (or f64 on the cpu backend)"),
])
def test_binding_dtype_error_lists_what_the_argument_takes(name, dtype, want):
    p = make_problem(0)
    p[name] = p[name].astype(dtype)
    got = np.dtype(dtype).name
    with pytest.raises(TypeError, match=r"^%s: expected dtype %s, got %s$" % (name, re.escape(want), got)):
        run(p)


def test_binding_dtype_error_for_cu_seqlens_and_outputs():
    p = make_problem(6, invalid=False)
    thd = {k: np.ascontiguousarray(v.reshape((-1,) + v.shape[2:])) for k, v in p.items()}
    cu_q = np.array([0, 5, 10], np.int64)
    cu_k = np.array([0, 7, 14], np.int32)
    with pytest.raises(TypeError, match=r"^cu_seqlens_q: expected dtype i32, got int64$"):
        run(thd, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out = [np.empty(p["index_q"].shape, np.float32), np.empty(p["weights"].shape, np.float16),
           np.empty(p["index_k"].shape, np.float32)]
    with pytest.raises(TypeError, match=r"^d_weights: expected dtype bf16 or f32 \(or f64 on the cpu backend\), "
                                        r"got float16$"):
        run(p, out=out)
    # uint16 where bf16 is not taken: no uint16_as_bf16 hint
    for name in ("index_q", "index_k"):
        p[name] = dsaib.bf16_to_f32(p[name])
    p["topk_indices"] = p["topk_indices"].astype(np.uint16)
    with pytest.raises(TypeError, match=r"^topk_indices: expected dtype i32, got uint16$"):
        dsaib.indexer_backward(**p, sm_scale=SM_SCALE)


def test_read_only_output_is_value_error_naming_it():
    p = make_problem(0)
    out = [np.empty(x.shape, np.float32) for x in (p["index_q"], p["weights"], p["index_k"])]
    out[1].flags.writeable = False
    with pytest.raises(ValueError, match=r"^out: expected writable arrays, got a read-only d_weights$"):
        run(p, out=out)


def test_out_must_hold_three_arrays():
    p = make_problem(0)
    with pytest.raises(TypeError, match=r"^out: expected 3 arrays .*got None for d_index_q$"):
        run(p, out=(None, None, None))
    with pytest.raises(ValueError, match=r"^out: expected \(d_index_q, d_weights, d_index_k\), got 2 items$"):
        run(p, out=(np.empty(1, np.float32),) * 2)
    with pytest.raises(TypeError, match=r"^out: expected a tuple"):
        run(p, out=3)
    outs = [np.empty(p[k].shape, np.float32) for k in ("index_q", "weights", "index_k")]
    with pytest.raises(TypeError, match=r"^out: expected a tuple .*got generator$"):
        run(p, out=(o for o in outs))  # an iterator is refused, not consumed
    run(p, out=outs)  # a list is a sequence
    with pytest.raises(TypeError, match=r"^out: expected 3 arrays \(d_index_q, d_weights, d_index_k\), got int for d_index_q$"):
        run(p, out=(1, 2, 3))


@pytest.mark.parametrize("bad", [True, np.bool_(False), "1.0", [1.0]])
def test_grad_loss_must_be_a_number_or_a_tensor(bad):
    with pytest.raises(TypeError, match=r"^grad_loss: expected a real number or a one-element float32 tensor, got "):
        run(make_problem(0), grad_loss=bad)


def test_grad_loss_tensor_and_number_agree():
    p = make_problem(0)
    for a, b in zip(run(p, grad_loss=np.ones(1, np.float32) * 1.5), run(p, grad_loss=1.5)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match=r"^grad_loss: expected dtype float32"):
        run(p, grad_loss=np.ones(1, np.float64))


@pytest.mark.parametrize("bad,exc,msg", [
    (2**40, ValueError, r"^num_threads: expected an int in \[0, 2\^31-1\], got 1099511627776$"),
    (-1, ValueError, r"^num_threads: expected >= 0 \(0 = all hardware threads\), got -1$"),
    (2.0, TypeError, r"^num_threads: expected an int, got float 2.0$"),
    (True, TypeError, r"^num_threads: expected an int, got bool True$"),
])
def test_num_threads_is_an_int32(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        run(make_problem(0), num_threads=bad)


def test_normalization_count_must_be_an_integer():
    p = make_problem(2)
    with pytest.raises(TypeError, match=r"^normalization_count: expected an int, got float 2.5$"):
        run(p, normalization_count=2.5)
    with pytest.raises(TypeError, match=r"^normalization_count: "):
        dsaib.reference_kl_loss(**p, sm_scale=SM_SCALE, uint16_as_bf16=True, normalization_count=2.5)
    with pytest.raises(ValueError, match=r"^normalization_count: expected an int in \[0, 2\^63-1\], got 9223372036854775808$"):
        run(p, normalization_count=2**63)
    for a, b in zip(run(p, normalization_count=np.int64(5)), run(p, normalization_count=5)):
        np.testing.assert_array_equal(a, b)


def test_scale_overflowing_float32_gives_the_library_message():
    # The C++ library takes float32 and sees inf: "expected a finite value, got inf".
    p = make_problem(0)
    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite value, got inf$"):
        run(p, sm_scale=1e300)
    with pytest.raises(ValueError, match=r"^loss_coeff: expected a finite value, got -inf$"):
        run(p, loss_coeff=-1e39)
    with pytest.raises(ValueError, match=r"^grad_loss: expected a finite value, got inf$"):
        run(p, grad_loss=3.5e38)
    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite value, got inf$"):
        dsaib.reference_kl_loss(**p, sm_scale=1e300, uint16_as_bf16=True)
    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite value, got inf$"):
        run(p, sm_scale=10**400)  # an int beyond float64
    # FLT_MAX and the largest value that rounds to it are finite; the next one is not
    run(p, sm_scale=3.4028235e38)
    run(p, sm_scale=float.fromhex("0x1.ffffffp127") - float.fromhex("0x1p75"))
    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite value, got inf$"):
        run(p, sm_scale=float.fromhex("0x1.ffffffp127"))
    with pytest.raises(TypeError, match=r"^sm_scale: expected a real number, got bool True$"):
        run(p, sm_scale=True)


def test_non_finite_values_give_the_library_message():
    p = make_problem(0)
    for bad, text in ((float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf")):
        with pytest.raises(ValueError, match=rf"^sm_scale: expected a finite value, got {text}$"):
            run(p, sm_scale=bad)
        with pytest.raises(ValueError, match=rf"^loss_coeff: expected a finite value, got {text}$"):
            run(p, loss_coeff=bad)


def test_negative_counts_give_the_library_message():
    p = make_problem(0)
    with pytest.raises(ValueError, match=r"^normalization_count: expected >= 0 \(0 = number of query tokens\), got -1$"):
        run(p, normalization_count=-1)
    with pytest.raises(ValueError, match=r"^num_threads: expected >= 0 \(0 = all hardware threads\), got -1$"):
        run(p, num_threads=-1)


def test_non_finite_scale_is_value_error():
    with pytest.raises(ValueError, match="sm_scale"):
        run(make_problem(0), sm_scale=float("nan"))


def test_non_finite_grad_loss_array_is_value_error_before_writing():
    # A float grad_loss and a one-element float32 array are checked alike on the cpu backend.
    p = make_problem(0)
    for bad, text in ((np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")):
        out = tuple(np.full(s, 7.0, dtype=np.float32) for s in (p["index_q"].shape, p["weights"].shape,
                                                                 p["index_k"].shape))
        with pytest.raises(ValueError, match=rf"^grad_loss: expected a finite value, got {text}$"):
            run(p, grad_loss=np.array([bad], dtype=np.float32), out=out)
        assert all((o == 7.0).all() for o in out)


def test_non_array_inputs_are_type_errors_naming_the_argument():
    p = make_problem(0)
    cases = [
        ("index_q", None, r"^index_q: expected an array \(numpy, torch, cupy, jax or a DLPack tensor\), got NoneType$"),
        ("weights", p["weights"].tolist(), r"^weights: expected an array .*, got list$"),
        ("attn_score", 1.0, r"^attn_score: expected an array .*, got float$"),
        ("weights", p["weights"].astype(">f4"), r"^weights: expected native byte order, got dtype >f4$"),
        ("attn_score", p["attn_score"].astype(object), r"^attn_score: expected an array of numbers, got dtype object$"),
        ("attn_score", p["attn_score"].astype(str), r"^attn_score: expected an array of numbers, got dtype <U"),
    ]
    for name, value, pattern in cases:
        q = dict(p)
        q[name] = value
        expect_backward_and_reference_refuse(q, TypeError, pattern)


def test_numpy_views_with_strides_between_elements_are_value_errors():
    # A byte stride that is not a whole number of elements has no DLPack form.
    from numpy.lib.stride_tricks import as_strided

    p = make_problem(0)
    shape = p["attn_score"].shape
    base = np.zeros(int(np.prod(shape)) * 2 + 8, dtype=np.float32)
    odd = as_strided(base, shape=shape, strides=(shape[1] * shape[2] * 4, shape[2] * 4, 2))
    q = dict(p)
    q["attn_score"] = odd
    pattern = (r"^attn_score: expected strides that are multiples of the element size \(4 bytes\), "
               r"got byte strides \(\d+, \d+, 2\)$")
    expect_backward_and_reference_refuse(q, ValueError, pattern)


def test_buffer_protocol_inputs_and_byte_order_of_outputs():
    p = make_problem(0)
    want = run(p)
    q = dict(p)
    q["weights"] = memoryview(p["weights"])  # buffer protocol, no DLPack: taken as before
    for got, w in zip(run(q), want):
        np.testing.assert_array_equal(got, w)
    out = tuple(np.empty(p[n].shape, dtype=">f4") for n in ("index_q", "weights", "index_k"))
    with pytest.raises(TypeError, match=r"^d_index_q: expected native byte order, got dtype >f4$"):
        run(p, out=out)
    with pytest.raises(TypeError, match=r"^grad_loss: expected native byte order, got dtype >f4$"):
        run(p, grad_loss=np.array([1.0], dtype=">f4"))


def test_stream_on_the_cpu_backend_is_value_error():
    with pytest.raises(ValueError, match=r"^stream: expected None or 0 on the cpu backend .*got 1234$"):
        run(make_problem(0), stream=1234)
    run(make_problem(0), stream=0)  # 0 is the "no stream" value and stays accepted


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_stream_must_be_an_int_before_anything_else_about_it(backend):
    # Checked before the backend is looked at (a cpu-only build raises RuntimeError for "cuda"
    # later): a str, a bool, a float or a negative stream names the argument.
    p = make_problem(0)
    for bad, err, text in (("x", TypeError, r"^stream: expected an int \(a cudaStream_t\), got str 'x'$"),
                           (False, TypeError, r"^stream: expected an int \(a cudaStream_t\), got bool False$"),
                           (0.0, TypeError, r"^stream: expected an int \(a cudaStream_t\), got float 0\.0$"),
                           (np.float64(0), TypeError, r"^stream: expected an int \(a cudaStream_t\), got "),
                           (object(), TypeError, r"^stream: expected an int \(a cudaStream_t\), got object"),
                           (-1, ValueError, r"^stream: expected an int in \[0, 2\^64-1\] \(a cudaStream_t\), got -1$"),
                           (2**64, ValueError, r"^stream: expected an int in \[0, 2\^64-1\] \(a cudaStream_t\), got 18446744073709551616$")):
        with pytest.raises(err, match=text):
            run(p, stream=bad, backend=backend)
    run(p, stream=np.int64(0))  # numpy integers are ints

    class IntOnlyStream:  # numba's cuda.Stream converts with __int__ and has no __index__
        def __int__(self):
            return 0

    run(p, stream=IntOnlyStream())


def test_bad_option_strings_are_value_errors():
    p = make_problem(0)
    with pytest.raises(ValueError, match=r'^layout: expected "bshd" or "thd", got "sbhd"$'):
        run(p, layout="sbhd")
    with pytest.raises(ValueError, match="out_dtype"):
        run(p, out_dtype="f16")


@pytest.mark.parametrize("name, bad", [("layout", None), ("layout", 0), ("id_mode", None), ("backend", 0)])
def test_option_words_that_are_not_str_are_type_errors_naming_them(name, bad):
    with pytest.raises(TypeError, match=r"^%s: expected a str \(.*\), got %s " % (name, type(bad).__name__)):
        run(make_problem(0), **{name: bad})
    if name != "backend":  # reference_kl_loss has no backend (host only)
        with pytest.raises(TypeError, match=r"^%s: expected a str" % name):
            dsaib.reference_kl_loss(**make_problem(0), sm_scale=SM_SCALE, uint16_as_bf16=True, **{name: bad})


def test_kl_loss_recompute_p_is_a_bool():
    with pytest.raises(TypeError, match=r"^recompute_p: expected a bool, got str 'false'$"):
        dsaib.reference_kl_loss(**make_problem(0), sm_scale=SM_SCALE, uint16_as_bf16=True, recompute_p="false")


@pytest.mark.parametrize("name", ["strict_indices", "deterministic", "uint16_as_bf16"])
def test_flags_are_bools(name):
    p = make_problem(0)
    # "false" is a truthy str: refused rather than taken as True
    for bad in ("false", 1, None):
        with pytest.raises(TypeError, match=r"^%s: expected a bool, got " % name):
            run(p, **{name: bad})
    if name != "strict_indices":  # make_problem(0) holds an out-of-range id, which strict mode reports
        run(p, **{name: np.bool_(name == "uint16_as_bf16")})


def test_a_operand_precision_values_give_identical_cpu_results():
    # The option picks the cuda kernel's GEMM operand precision; the cpu backend
    # (float64 throughout) accepts all three words and ignores them.
    p = make_problem(9)
    base = run(p)
    for word in ("auto", "bf16x2", "bf16"):
        for out_dtype in ("f32", "bf16"):
            got = run(p, a_operand_precision=word, out_dtype=out_dtype)
            want = base if out_dtype == "f32" else tuple(dsaib.bf16_bits(b) for b in base)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)


def test_bad_a_operand_precision_is_value_error_and_writes_nothing():
    p = make_problem(0)
    out = tuple(np.full(x.shape, 7.0, dtype=np.float32) for x in (p["index_q"], p["weights"], p["index_k"]))
    for bad in ("bf32", "BF16", "automatic", ""):
        with pytest.raises(ValueError, match=r'^a_operand_precision: expected "auto", "bf16x2" or "bf16", got "%s"$' % bad):
            run(p, out=out, a_operand_precision=bad)
    assert all((o == 7.0).all() for o in out)
    with pytest.raises(TypeError, match=r"^a_operand_precision: expected a str"):
        run(p, a_operand_precision=2)


def test_launch_options_give_identical_cpu_results_and_reject_bad_words():
    # l2_hints and start_stagger tune the cuda launch only; the cpu backend
    # accepts every word and ignores it. A bad word is the library's ValueError,
    # raised before anything is written.
    p = make_problem(9)
    base = run(p)
    for name, words in (("l2_hints", ("auto", "on", "off")), ("start_stagger", ("auto", "off"))):
        for word in words:
            for g, w in zip(run(p, **{name: word}), base):
                np.testing.assert_array_equal(g, w)
    out = tuple(np.full(x.shape, 7.0, dtype=np.float32) for x in (p["index_q"], p["weights"], p["index_k"]))
    with pytest.raises(ValueError, match=r'^l2_hints: expected "auto", "on" or "off", got "yes"$'):
        run(p, out=out, l2_hints="yes")
    with pytest.raises(ValueError, match=r'^start_stagger: expected "auto" or "off", got "on"$'):
        run(p, out=out, start_stagger="on")
    assert all((o == 7.0).all() for o in out)
    with pytest.raises(TypeError, match=r"^l2_hints: expected a str"):
        run(p, l2_hints=1)


def test_strict_indices_is_value_error_and_writes_nothing():
    p = make_problem(0)
    out = tuple(np.full(x.shape, 7.0, dtype=np.float32) for x in (p["index_q"], p["weights"], p["index_k"]))
    with pytest.raises(ValueError, match=r"^topk_indices: strict mode found an out-of-range id at \(b=0, t=1, slot=1\)"):
        run(p, out=out, strict_indices=True)
    assert all((o == 7.0).all() for o in out)


def test_wrong_output_shape_is_value_error():
    p = make_problem(0)
    out = [np.empty(p["index_q"].shape, np.float32), np.empty((2, 5, 9), np.float32), np.empty(p["index_k"].shape, np.float32)]
    with pytest.raises(ValueError, match=r"^d_weights: "):
        run(p, out=out)


def test_non_contiguous_output_is_value_error():
    p = make_problem(0)
    dq = np.empty(p["index_q"].shape[:-1] + (128,), np.float32)[..., ::2]
    out = [dq, np.empty(p["weights"].shape, np.float32), np.empty(p["index_k"].shape, np.float32)]
    with pytest.raises(ValueError, match=r"^d_index_q: "):
        run(p, out=out)


def test_cuda_backend_unavailable_is_runtime_error():
    if dsaib.cuda_backend_available():
        pytest.skip("cuda backend available here")
    with pytest.raises(RuntimeError, match=r"^backend: "):
        run(make_problem(0), backend="cuda")


def test_kl_loss_takes_grad_loss_as_the_backward_does():
    p = make_problem(0)
    loss = lambda **kw: dsaib.reference_kl_loss(**p, sm_scale=SM_SCALE, uint16_as_bf16=True, **kw)
    assert loss(grad_loss=np.ones(1, np.float32) * 1.5) == loss(grad_loss=1.5)
    assert loss(grad_loss=np.full((), 1.5, np.float32)) == loss(grad_loss=1.5)
    with pytest.raises(TypeError, match=r"^grad_loss: expected dtype float32"):
        loss(grad_loss=np.ones(1, np.float64))
    with pytest.raises(TypeError, match=r"^grad_loss: expected dtype float32"):
        loss(grad_loss=np.full((), 1.5))  # 0-d float64: a tensor, refused by the backward too
    with pytest.raises(TypeError, match=r"^grad_loss: expected dtype float32"):
        run(p, grad_loss=np.full((), 1.5))
    with pytest.raises(ValueError, match=r"^grad_loss: expected a one-element tensor, got 2 elements$"):
        loss(grad_loss=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"^grad_loss: expected a finite value, got nan$"):
        loss(grad_loss=np.array([np.nan], np.float32))
    with pytest.raises(TypeError, match=r"^grad_loss: expected a real number or a one-element float32 tensor, got bool"):
        loss(grad_loss=True)


def test_16_bit_integers_are_bf16_only_where_bf16_is_taken():
    p = make_problem(0)
    q = dict(p)
    q["topk_indices"] = p["topk_indices"].astype(np.int16)  # with the flag: still named int16, not "bf16"
    with pytest.raises(TypeError, match=r"^topk_indices: expected dtype i32, got int16$"):
        run(q)
    q = dict(p)
    q["index_q"] = p["index_q"].astype(np.int16)  # without the flag: the hint, for int16 as for uint16
    with pytest.raises(TypeError, match=r"^index_q: expected dtype bf16, got int16 \(pass uint16_as_bf16=True to read "
                                        r"16-bit integers as bf16 bit patterns\)$"):
        dsaib.indexer_backward(**q, sm_scale=SM_SCALE)
    for a, b in zip(run(q), run(p)):  # int16 and uint16 bit patterns read alike
        np.testing.assert_array_equal(a, b)


def test_bf16_helpers_keep_shapes_and_refuse_wide_values():
    assert dsaib.bf16_bits(np.float32(1.5)).shape == ()
    assert dsaib.bf16_bits(np.ones((2, 3), np.float32)).shape == (2, 3)
    assert dsaib.bf16_to_f32(np.uint16(0x3FC0)).shape == ()
    assert dsaib.bf16_to_f32(np.uint16(0x3FC0)) == 1.5
    np.testing.assert_array_equal(dsaib.bf16_to_f32(np.array([-16512], np.int16)), [-1.0])  # int16 bits
    t = np.arange(6, dtype=np.float32).reshape(2, 3).T
    np.testing.assert_array_equal(dsaib.bf16_to_f32(dsaib.bf16_bits(t)), t)
    with pytest.raises(ValueError, match=r"^bits: expected 16-bit patterns, got values in \[70000, 70000\]$"):
        dsaib.bf16_to_f32(np.array([70000]))
    with pytest.raises(TypeError, match=r"^bits: expected an integer array"):
        dsaib.bf16_to_f32(np.array([1.5]))


def test_bf16_helpers_round_trip():
    x = np.array([0.0, 1.0, -2.5, 3.140625, 2.0**-100, np.inf, -np.inf], dtype=np.float32)
    np.testing.assert_array_equal(dsaib.bf16_to_f32(dsaib.bf16_bits(x)), x)
    # round to nearest even: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> 1
    assert dsaib.bf16_bits(np.float32(1 + 2**-8)) == dsaib.bf16_bits(np.float32(1.0))
    assert np.isnan(dsaib.bf16_to_f32(dsaib.bf16_bits(np.float32(np.nan))))


def test_a_consumed_or_shared_dlpack_capsule_is_named():
    # A DLPack capsule is read once; a second use got nanobind's generic TypeError.
    p = make_problem(0)
    cap = p["attn_score"].__dlpack__()
    with pytest.raises(ValueError, match=r"^index_score: expected its own DLPack capsule, got the one given "
                                         r"for attn_score"):
        run({**p, "attn_score": cap, "index_score": cap})
    cap = p["attn_score"].__dlpack__()
    want = run(p)
    got = run({**p, "attn_score": cap})  # a fresh capsule is taken ...
    assert_close(got, want)
    with pytest.raises(ValueError, match=r"^attn_score: expected an unused DLPack capsule, got one already "
                                         r"consumed"):
        run({**p, "attn_score": cap})  # ... once


def test_a_versioned_or_foreign_capsule_is_named():
    # nanobind takes unversioned DLPack capsules only; a versioned one got its generic TypeError.
    p = make_problem(0)
    try:
        versioned = p["attn_score"].__dlpack__(max_version=(1, 0))
    except TypeError:
        pytest.skip("this numpy makes no versioned DLPack capsules (numpy < 2.1)")
    with pytest.raises(TypeError, match=r"^attn_score: expected a DLPack capsule named 'dltensor' "
                                        r"\(unversioned.*got a capsule named 'dltensor_versioned'$"):
        run({**p, "attn_score": versioned})


def test_the_capsule_check_leaves_ctypes_pythonapi_alone():
    import ctypes

    fn = ctypes.pythonapi.PyCapsule_GetName
    fn.restype = ctypes.c_void_p  # what another library may have set
    p = make_problem(0)
    run({**p, "attn_score": p["attn_score"].__dlpack__()})
    assert ctypes.pythonapi.PyCapsule_GetName.restype is ctypes.c_void_p
