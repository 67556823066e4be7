// The words of the option enums (l2_hints_name, parse_l2_hints, ...): one parse
// for every enum, over the words its name function gives.
#pragma once

#include <initializer_list>
#include <string>

namespace dsaib::detail {

/// Sets *out to the value among `values` whose name(value) is `word` and
/// returns true; false, *out unchanged, for any other word.
template <class E, class Name>
bool parse_option_word(const std::string& word, std::initializer_list<E> values, Name&& name, E* out) {
  for (E v : values) {
    if (word == name(v)) {
      *out = v;
      return true;
    }
  }
  return false;
}

}  // namespace dsaib::detail
