// The library's options structs read from a binding's keyword arguments, one
// table per struct (options.hpp). Each table names every field once, with its
// kind, words and default, so that reading **options and telling Python the
// options (option_table) cannot disagree.
#include "options.hpp"

#include <nanobind/stl/string.h>

#include <functional>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dsaib/error.hpp"
#include "type_error.hpp"

namespace dsaib_py {

namespace {

/// `"a", "b" or "c"`: how the library's messages list an option's words.
std::string word_list(const std::vector<std::string>& words) {
  std::string s;
  for (size_t i = 0; i < words.size(); ++i) {
    if (i) s += i + 1 == words.size() ? " or " : ", ";
    s += "\"" + words[i] + "\"";
  }
  return s;
}

/// The library's options struct `Options` read from keyword arguments: each
/// field once, with its name, kind, words (the library's *_name functions of
/// the enum's values) and default (a default-constructed Options). The
/// bindings read **options through it, and option_table() shows it to Python,
/// which takes its words and defaults from there.
template <class Options>
class OptionTable {
 public:
  template <class E>
  OptionTable& word(const char* name, E Options::*member, std::initializer_list<E> values, const char* (*word_of)(E)) {
    std::vector<std::string> words;
    for (E v : values) words.emplace_back(word_of(v));
    const std::vector<E> vals(values);
    const std::string option = name;
    add(name, "word", words,
        [member, vals, words, option](Options& o, nb::handle h) {
          const auto s = cast<std::string>(option, h);
          for (size_t i = 0; i < vals.size(); ++i) {
            if (s == words[i]) {
              o.*member = vals[i];
              return;
            }
          }
          throw dsaib::Error(dsaib::ErrorCode::invalid_argument, option,
                             option + ": expected " + word_list(words) + ", got \"" + s + "\"");
        },
        [member, word_of](const Options& o) -> nb::object { return nb::str(word_of(o.*member)); });
    return *this;
  }
  /// A number or a flag (float, bool, int64_t, int32_t), or a pointer read as an int (uintptr_t).
  template <class T>
  OptionTable& value(const char* name, T Options::*member) {
    const std::string option = name;
    add(name, kind<T>(), {}, [member, option](Options& o, nb::handle h) { o.*member = cast<T>(option, h); },
        [member](const Options& o) -> nb::object { return nb::cast(o.*member); });
    return *this;
  }
  OptionTable& pointer(const char* name, void* Options::*member) {
    const std::string option = name;
    add(name, "pointer", {},
        [member, option](Options& o, nb::handle h) { o.*member = reinterpret_cast<void*>(cast<uintptr_t>(option, h)); },
        [member](const Options& o) -> nb::object { return nb::cast(reinterpret_cast<uintptr_t>(o.*member)); });
    return *this;
  }

  /// Options from keyword arguments: a name not in the table is a TypeError; one
  /// left out keeps the struct's default.
  Options read(const nb::kwargs& kw) const {
    Options o;
    for (auto item : kw) {
      const auto name = nb::cast<std::string>(nb::str(item.first));
      const Field* f = find(name);
      if (!f) throw PyTypeError{"options: unexpected keyword argument '" + name + "'"};
      f->set(o, item.second);
    }
    return o;
  }

  /// {name: (kind, default, words)}, in the struct's order.
  nb::dict describe() const {
    const Options defaults{};
    nb::dict d;
    for (const Field& f : fields_) {
      nb::list words;
      for (const auto& w : f.words) words.append(nb::str(w.c_str()));
      d[f.name.c_str()] = nb::make_tuple(nb::str(f.kind.c_str()), f.get(defaults), nb::tuple(words));
    }
    return d;
  }

 private:
  struct Field {
    std::string name, kind;
    std::vector<std::string> words;
    std::function<void(Options&, nb::handle)> set;
    std::function<nb::object(const Options&)> get;
  };
  void add(const char* name, const char* k, std::vector<std::string> words,
           std::function<void(Options&, nb::handle)> set, std::function<nb::object(const Options&)> get) {
    fields_.push_back({name, k, std::move(words), std::move(set), std::move(get)});
  }
  const Field* find(const std::string& name) const {
    for (const Field& f : fields_) {
      if (f.name == name) return &f;
    }
    return nullptr;
  }
  template <class T>
  static const char* kind() {
    if constexpr (std::is_same_v<T, bool>) return "bool";
    else if constexpr (std::is_floating_point_v<T>) return "float";
    else if constexpr (sizeof(T) == 4) return "int32";
    else return "int64";
  }
  template <class T>
  static T cast(const std::string& name, nb::handle h) {
    T v{};
    if (!nb::try_cast<T>(h, v)) {
      const char* what = std::is_same_v<T, std::string> ? "a str"
                         : std::is_same_v<T, bool>      ? "a bool"
                         : std::is_floating_point_v<T>  ? "a float"
                                                        : "an int in the range of its C type";
      throw PyTypeError{name + ": expected " + what + ", got " +
                        nb::cast<std::string>(nb::str(h.type().attr("__name__")))};
    }
    return v;
  }

  std::vector<Field> fields_;
};

using dsaib::AOperandPrecision;
using dsaib::Backend;
using dsaib::ForwardFusion;
using dsaib::IdMode;
using dsaib::L2Hints;
using dsaib::Layout;
using dsaib::LseBase;
using dsaib::StartStagger;

/// dsaib::IndexerOptions (grad_loss_device comes as a tensor argument).
const OptionTable<dsaib::IndexerOptions>& indexer_options() {
  using O = dsaib::IndexerOptions;
  static const OptionTable<O> table = [] {
    OptionTable<O> t;
    t.word("layout", &O::layout, {Layout::bshd, Layout::thd}, dsaib::layout_name)
        .word("id_mode", &O::id_mode, {IdMode::local, IdMode::global}, dsaib::id_mode_name)
        .word("backend", &O::backend, {Backend::cpu, Backend::cuda}, dsaib::backend_name)
        .value("sm_scale", &O::sm_scale)
        .value("loss_coeff", &O::loss_coeff)
        .value("grad_loss", &O::grad_loss)
        .value("normalization_count", &O::normalization_count)
        .value("strict_indices", &O::strict_indices)
        .value("deterministic", &O::deterministic)
        .pointer("stream", &O::stream)
        .value("num_threads", &O::num_threads)
        .word("a_operand_precision", &O::a_operand_precision,
              {AOperandPrecision::automatic, AOperandPrecision::bf16x2, AOperandPrecision::bf16},
              dsaib::a_operand_precision_name)
        .word("l2_hints", &O::l2_hints, {L2Hints::automatic, L2Hints::on, L2Hints::off}, dsaib::l2_hints_name)
        .word("start_stagger", &O::start_stagger, {StartStagger::automatic, StartStagger::off},
              dsaib::start_stagger_name)
        .word("forward_fusion", &O::forward_fusion, {ForwardFusion::automatic, ForwardFusion::off},
              dsaib::forward_fusion_name);
    return t;
  }();
  return table;
}

/// dsaib::AttentionTargetOptions.
const OptionTable<dsaib::AttentionTargetOptions>& target_options() {
  using O = dsaib::AttentionTargetOptions;
  static const OptionTable<O> table = [] {
    OptionTable<O> t;
    t.word("layout", &O::layout, {Layout::bshd, Layout::thd}, dsaib::layout_name)
        .word("id_mode", &O::id_mode, {IdMode::local, IdMode::global}, dsaib::id_mode_name)
        .word("backend", &O::backend, {Backend::cpu, Backend::cuda}, dsaib::backend_name)
        .value("sm_scale", &O::sm_scale)
        .word("lse_base", &O::lse_base, {LseBase::natural, LseBase::base2}, dsaib::lse_base_name)
        .value("normalize", &O::normalize)
        .value("strict_indices", &O::strict_indices)
        .pointer("stream", &O::stream)
        .value("num_threads", &O::num_threads);
    return t;
  }();
  return table;
}

/// dsaib::IndexerTopkOptions (causal_offset's default, kCausalOffsetAuto, is
/// Python's None: the keyword is then left out).
const OptionTable<dsaib::IndexerTopkOptions>& topk_options() {
  using O = dsaib::IndexerTopkOptions;
  static const OptionTable<O> table = [] {
    OptionTable<O> t;
    t.word("layout", &O::layout, {Layout::bshd, Layout::thd}, dsaib::layout_name)
        .word("id_mode", &O::id_mode, {IdMode::local, IdMode::global}, dsaib::id_mode_name)
        .word("backend", &O::backend, {Backend::cpu, Backend::cuda}, dsaib::backend_name)
        .word("order", &O::order, {dsaib::TopkOrder::logit_descending, dsaib::TopkOrder::id_ascending},
              dsaib::topk_order_name)
        .value("causal_offset", &O::causal_offset)
        .value("strict_ranges", &O::strict_ranges)
        .pointer("stream", &O::stream)
        .value("num_threads", &O::num_threads);
    return t;
  }();
  return table;
}

}  // namespace

dsaib::IndexerOptions read_indexer_options(const nb::kwargs& options) { return indexer_options().read(options); }

dsaib::AttentionTargetOptions read_target_options(const nb::kwargs& options) {
  return target_options().read(options);
}

dsaib::IndexerTopkOptions read_topk_options(const nb::kwargs& options) { return topk_options().read(options); }

nb::dict option_table(const std::string& which) {
  if (which == "indexer") return indexer_options().describe();
  if (which == "attention_target") return target_options().describe();
  if (which == "indexer_topk") return topk_options().describe();
  throw dsaib::Error(dsaib::ErrorCode::invalid_argument, "which",
                     "which: expected \"indexer\", \"attention_target\" or \"indexer_topk\", got \"" + which +
                         "\"");
}

}  // namespace dsaib_py
