"""The torch layer's parts (needs torch), below the public modules dsaib.torch
and dsaib.distributed, which import from here and never from each other's
internals: convert (argument rules, conversions to the library's dtypes), ops
(the custom ops and their fake kernels), reference (the forward in torch for
float64 leaves and index_scores), autograd (the loss's autograd function),
cp_agreement and cp_plan (context parallelism: the arguments every rank must
agree on, the split and its collectives)."""
