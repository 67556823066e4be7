"""The options of dsaib's operations: one table for both front ends.

``dsaib.indexer_backward`` and ``dsaib.torch.indexer_backward`` (and likewise
each operation both front ends have) take the same keyword arguments with
the same defaults and the same rules, from :data:`OPTIONS`. The library's
options (``dsaib::IndexerOptions``, ``dsaib::AttentionTargetOptions``,
``dsaib::IndexerTopkOptions``) come from the extension (``_dsaib.option_table``): their kinds and the words a
word option takes are the C++ library's own; Python adds what a front end
needs beyond them (a tensor ``grad_loss``, ``backend=None``, ``out_dtype``,
``topk``, ``causal_offset=None``, which outputs indexer_topk returns).

Each option is checked here before anything happens, with messages in the
library's style ("NAME: expected X, got Y"): a value of the wrong type is a
TypeError, a word the library does not take a ValueError with the library's
own message. Values whose rules only the library knows (finite scales,
non-negative counts) are passed on: its message is the only one.
"""

from __future__ import annotations

import textwrap
import types
from typing import Callable, NamedTuple, Tuple

from . import _dsaib
from ._args import _bool_value, _f32_value, _grad_loss, _int_value, _option_str, _stream_value

_INT32 = (-(2**31), 2**31 - 1, "[0, 2^31-1]")
_INT64 = (-(2**63), 2**63 - 1, "[0, 2^63-1]")
REQUIRED = object()  # sm_scale has no default


class Option(NamedTuple):
    """An argument of dsaib's operations: its name, default, the words it takes
    (word options), whether it is a field of the library's options struct, what
    it means, and its check (value -> the value passed on)."""

    name: str
    default: object
    words: Tuple[str, ...]
    library: bool
    doc: str
    check: Callable


def words_text(words, none=False) -> str:
    """'"a", "b" or "c"' as the library's messages list words (', or None' appended)."""
    quoted = [f'"{w}"' for w in words] + (["None"] if none else [])
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _word_check(name, words, none=False):
    def check(x):
        if none and x is None:
            return None
        _option_str(name, x, words_text(words, none))
        if x not in words:
            raise ValueError(f'{name}: expected {words_text(words)}, got "{x}"')
        return x
    return check


def _int_check(name, limits):
    return lambda x: _int_value(name, x, limits[0], limits[1], limits[2])


def _out_dtype(x):
    """One code for all three gradients, or a sequence of three; None as it is
    (each front end says what it means)."""
    if x is None:
        return None
    codes = ("f32", "bf16", "f64")
    each = (x,) * 3 if isinstance(x, str) else tuple(x) if isinstance(x, (tuple, list)) else None
    if each is None or len(each) != 3 or any(not isinstance(c, str) or c not in codes for c in each):
        raise ValueError(f'out_dtype: expected "f32", "bf16" or "f64", or a tuple of three such codes, got {x!r}')
    return each


_INDEXER = _dsaib.option_table("indexer")
_TARGET = _dsaib.option_table("attention_target")
_TOPK = _dsaib.option_table("indexer_topk")


def _library_entry(name):
    return next(table[name] for table in (_INDEXER, _TARGET, _TOPK) if name in table)


def _library_words(name):
    kind, _, words = _library_entry(name)
    assert kind == "word", name
    return tuple(words)


def _library_default(name):
    return _library_entry(name)[1]


def _topk_check(x):
    """topk: the width of indexer_topk's outputs (Python allocates them), an int in [1, 2^31-1]."""
    return _int_value("topk", x, 1, _INT32[1], "[1, 2^31-1]")


def _causal_offset_check(x):
    """None (each sequence's S_kv - S_q, the library's kCausalOffsetAuto) or an int64
    other than that sentinel."""
    if x is None:
        return None
    return _int_value("causal_offset", x, _INT64[0] + 1, _INT64[1], "[-2^63+1, 2^63-1] or None")


def _make_options():
    def word(name, doc):
        words = _library_words(name)
        return Option(name, _library_default(name), words, True, doc, _word_check(name, words))

    def flag(name, doc, library=True, default=None):
        return Option(name, _library_default(name) if default is None else default, (), library, doc,
                      lambda x: _bool_value(name, x))

    backend_words = _library_words("backend")
    table = [
        Option("sm_scale", REQUIRED, (), True, "multiplies every logit (float32, finite)",
               lambda x: _f32_value("sm_scale", x)),
        Option("loss_coeff", _library_default("loss_coeff"), (), True, "the loss weight (float32, finite)",
               lambda x: _f32_value("loss_coeff", x)),
        Option("grad_loss", _library_default("grad_loss"), (), True,
               "the upstream gradient of the loss: a number, or a one-element float32 tensor on the backend's "
               "device read when the work runs (a replayed CUDA graph reads the value it holds then)", _grad_loss),
        Option("normalization_count", _library_default("normalization_count"), (), True,
               "N in grad_loss * loss_coeff / N; 0: the number of query rows",
               _int_check("normalization_count", _INT64)),
        word("layout", '"bshd" (batched) or "thd" (packed sequences, with cu_seqlens_q and cu_seqlens_k)'),
        word("id_mode", '"local" (ids are rows of the query\'s own sequence) or "global" (flat rows of index_k)'),
        Option("backend", None, backend_words, True,
               '"cpu" (fp64 reference on host tensors), "cuda" (the sm_90a kernels) or None: "cuda" for CUDA '
               'tensors, else "cpu"', _word_check("backend", backend_words, none=True)),
        flag("strict_indices", "raise ValueError naming the first invalid id instead of ignoring its slot (reads "
                               "the ids to the host: on a GPU a synchronisation, refused during a capture)"),
        flag("deterministic", "bitwise run-to-run reproducible d_index_k on cuda (64-bit fixed point; d_index_q, "
                              "d_weights and the cpu backend always are); dsaib.torch also runs it under "
                              "torch.use_deterministic_algorithms(True)"),
        Option("num_threads", _library_default("num_threads"), (), True, "cpu backend worker threads (0: all cores)",
               _int_check("num_threads", _INT32)),
        Option("stream", None, (), True,
               "cuda: the stream to run on (an int cudaStream_t, an object with __int__, or a torch stream); None: "
               "the current stream of the inputs' framework (torch, cupy; else the legacy default stream 0); the "
               "cpu backend takes only None or 0", lambda x: None if x is None else _stream_value(x)),
        word("a_operand_precision", 'cuda: the dK/dQ GEMMs\' a operand in one bf16 term ("bf16", faster, ~1.5e-3 '
                                    'relative RMS error) or two ("bf16x2"); "auto": two when d_index_q or '
                                    'd_index_k is float32'),
        word("l2_hints", 'cuda launch choice: L2 evict_last hints on the dK reductions ("auto", "on", "off"); '
                         'results do not depend on it'),
        word("start_stagger", 'cuda launch choice: delayed start of the CTAs with a task fewer ("auto", "off"); '
                              'results do not depend on it'),
        word("forward_fusion", 'cuda, indexer_kl_loss_and_grad: the loss forward inside the backward kernel '
                               '("auto", where it applies) or as a kernel of its own ("off"); results do not '
                               'depend on it'),
        Option("lse_base", _library_default("lse_base"), _library_words("lse_base"), True,
               '"natural" or "base2" (FlashMLA\'s): the base of lse (not used when lse is None)',
               _word_check("lse_base", _library_words("lse_base"))),
        flag("normalize", "True: T = U / sum U per row; False: U itself (for a tensor-parallel all-reduce)"),
        Option("out_dtype", None, ("f32", "bf16", "f64"), False,
               'the gradients\' dtypes: "f32", "bf16" or "f64" (cpu backend, unrounded), or a tuple of three such '
               'codes (d_index_q, d_weights, d_index_k); None: "f32", except for dsaib.torch.indexer_kl_loss_and_grad, '
               'whose gradients then have the dtypes of index_q, weights and index_k (as their .grad would)',
               _out_dtype),
        Option("gradients", "forward", ("forward", "backward"), False,
               'the autograd loss (dsaib.torch.indexer_kl_loss): where the gradients are formed. "forward": by '
               'the forward\'s one library call (indexer_kl_loss_and_grad at grad_loss 1), held until the backward, '
               'which scales them by the upstream gradient (the same library work as the loss and gradients in one '
               'call; holds gradient-sized tensors between the two); "backward": by a P-free backward fed the '
               'forward\'s row statistics (the forward is the loss alone). "forward" only where a gradient is wanted '
               '(grad mode on, index_q, weights or index_k requiring grad, not float64 leaves); deterministic '
               'and torch.use_deterministic_algorithms are read where the gradients are formed; '
               'dsaib.indexer_kl_loss checks it only',
               _word_check("gradients", ("forward", "backward"))),
        flag("return_index_score", "also return P (float32, shaped like topk_indices)", library=False, default=False),
        Option("topk", REQUIRED, (), False, "the number of keys each query row selects (an int >= 1): the last "
                                            "dimension of topk_indices", _topk_check),
        word("order", '"logit_descending" (each row\'s keys by logit, equal logits by id) or "id_ascending" '
                      '(by id, as FlashMLA\'s sparse kernels read them)'),
        Option("causal_offset", None, (), True,
               "without starts/ends, row t (0-based in its sequence) sees its sequence's keys [0, t + causal_offset "
               "+ 1); None: S_kv - S_q of each sequence (its query rows are its last S_q positions); ignored with "
               "starts/ends", _causal_offset_check),
        flag("strict_ranges", "with starts/ends: raise ValueError naming the first row whose [start, end) is not "
                              "0 <= start <= end <= its sequence's key count, instead of clipping it (on a GPU one "
                              "synchronisation, refused during a capture)"),
        flag("return_logits", "also return each selected key's logit (float32, shaped like topk_indices, -inf "
                              "past the row's count)", library=False, default=False),
        flag("return_lengths", "also return each query row's count (int32, min(topk, keys it sees))",
             library=False, default=False),
    ]
    return types.MappingProxyType({o.name: o for o in table})


#: Every option of dsaib's operations, by name (read-only).
OPTIONS = _make_options()

_TARGET_NAMES = ("sm_scale", "lse_base", "normalize", "layout", "id_mode", "backend", "strict_indices",
                 "num_threads", "stream")
_COMMON = ("sm_scale", "loss_coeff", "normalization_count", "layout", "id_mode", "backend", "strict_indices",
           "num_threads", "stream")
_BACKWARD = ("deterministic", "a_operand_precision", "l2_hints", "start_stagger")

#: The options each operation takes, in both front ends (its tensors, and
#: uint16_as_bf16 / out of the DLPack front end, are arguments of their own).
OPERATIONS = types.MappingProxyType({
    "indexer_backward": _COMMON + ("grad_loss", "out_dtype") + _BACKWARD,
    "indexer_kl_forward": _COMMON + ("return_index_score",),
    "indexer_kl_loss": _COMMON + _BACKWARD + ("gradients",),
    "indexer_kl_loss_and_grad": _COMMON + ("grad_loss", "out_dtype") + _BACKWARD + ("forward_fusion",),
    "attention_target": _TARGET_NAMES,
    "indexer_topk": ("topk", "layout", "id_mode", "order", "causal_offset", "strict_ranges", "return_logits",
                     "return_lengths", "backend", "num_threads", "stream"),
})


def check(operation: str, given: dict) -> dict:
    """The operation's options checked, in its order (the first bad one raises)."""
    names = OPERATIONS[operation]
    assert set(given) == set(names), (operation, sorted(set(given) ^ set(names)))
    return {name: OPTIONS[name].check(given[name]) for name in names}


def check_each(**given) -> dict:
    """Options checked by their own rules in OPTIONS, in the order given: for a
    function that takes some of an operation's options (the context-parallel
    ones), so that its rules are the table's too."""
    return {name: OPTIONS[name].check(value) for name, value in given.items()}


def library_kwargs(options: dict, *, drop=()) -> dict:
    """The checked options that are fields of the library's options struct (what
    the extension takes as **options); grad_loss as its number (a tensor goes
    as grad_loss_device), backend and stream as resolved by the caller;
    causal_offset None left out (the struct's default is the per-sequence one)."""
    out = {}
    for name, value in options.items():
        if name in drop or not OPTIONS[name].library or (name == "causal_offset" and value is None):
            continue
        if name == "grad_loss":
            value = value[0]
        out[name] = value
    return out


def documented(operation: str):
    """Appends the operation's options (from OPTIONS) to a function's docstring."""
    def decorate(fn):
        lines = ["", "    Options (the same in dsaib and dsaib.torch; dsaib.OPTIONS):"]
        for name in OPERATIONS[operation]:
            o = OPTIONS[name]
            default = "required" if o.default is REQUIRED else f"default {o.default!r}"
            lines += textwrap.wrap(f"{name} ({default}): {o.doc}.", 100, initial_indent="      ",
                                   subsequent_indent="        ")
        fn.__doc__ = (fn.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
        return fn
    return decorate
