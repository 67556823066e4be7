"""Numbers and words that the options table (dsaib.OPTIONS) refuses, with the
error each entry point that takes them must raise: (name, value, error type,
message pattern). BAD_BACKWARD_OPTIONS: those of the entry points that take
grad_loss and out_dtype too."""

BAD_OPTIONS = [
    ("sm_scale", "0.125", TypeError, r"^sm_scale: expected a real number, got str '0.125'$"),
    ("sm_scale", True, TypeError, r"^sm_scale: expected a real number, got bool True$"),
    ("sm_scale", None, TypeError, r"^sm_scale: expected a real number, got NoneType$"),
    ("sm_scale", "abc", TypeError, r"^sm_scale: expected a real number, got str 'abc'$"),
    ("sm_scale", 10**400, ValueError, r"^sm_scale: expected a finite value, got inf"),
    ("loss_coeff", "3", TypeError, r"^loss_coeff: expected a real number, got str '3'$"),
    ("normalization_count", 2.5, TypeError, r"^normalization_count: expected an int, got float 2.5$"),
    ("normalization_count", True, TypeError, r"^normalization_count: expected an int, got bool True$"),
    ("normalization_count", "3", TypeError, r"^normalization_count: expected an int, got str '3'$"),
    ("normalization_count", 2**63, ValueError, r"^normalization_count: expected an int in \[0, 2\^63-1\]"),
    ("layout", None, TypeError, r'^layout: expected a str \("bshd" or "thd"\), got NoneType None$'),
]
BAD_BACKWARD_OPTIONS = [
    ("out_dtype", ("f32", "f32"), ValueError, r'^out_dtype: expected "f32", "bf16" or "f64", or a tuple of three'),
    ("grad_loss", "2", TypeError, r"^grad_loss: expected a real number or a one-element float32 tensor, got str"),
    ("grad_loss", True, TypeError, r"^grad_loss: expected a real number or a one-element float32 tensor, got bool"),
    ("grad_loss", 1e39, ValueError, r"^grad_loss: expected a finite value, got inf"),
]
