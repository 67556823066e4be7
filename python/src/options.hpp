// The library's options as a binding's keyword arguments (**options), read
// through one table per options struct (options.cpp). The same tables are
// shown to Python (option_table), which takes each option's words and default
// from there instead of keeping its own copy.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "dsaib/attention_target.hpp"
#include "dsaib/indexer_backward.hpp"
#include "dsaib/indexer_topk.hpp"

namespace dsaib_py {

namespace nb = nanobind;

/// The options struct from keyword arguments: a name not in the table is a
/// TypeError, a value of the wrong type a TypeError naming the option, a word
/// not among the option's words a ValueError listing them; an option left out
/// keeps the struct's default.
dsaib::IndexerOptions read_indexer_options(const nb::kwargs& options);  // grad_loss_device: a tensor argument
dsaib::AttentionTargetOptions read_target_options(const nb::kwargs& options);
dsaib::IndexerTopkOptions read_topk_options(const nb::kwargs& options);

/// {name: (kind, default, words)} of the options of "indexer"
/// (dsaib::IndexerOptions), "attention_target" or "indexer_topk", in the
/// struct's order; kind one of "word", "float", "bool", "int32", "int64",
/// "pointer".
nb::dict option_table(const std::string& which);

}  // namespace dsaib_py
