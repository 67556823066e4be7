// Text of the human-readable output: escaping of untrusted text, number and size formats.
#include <cstdio>
#include <string>

#include "cli.hpp"

namespace dsaib::cli {
namespace {

/// Length of the UTF-8 sequence at s[i] and its code point, or 0 when the bytes
/// there are not one (a stray continuation byte, an overlong form, a surrogate,
/// beyond U+10FFFF, or cut short).
size_t utf8_sequence(const std::string& s, size_t i, uint32_t* code_point) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char lead = byte(i);
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3;
    if (lead == 0xE0) lo = 0xA0;  // overlong
    if (lead == 0xED) hi = 0x9F;  // surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4;
    if (lead == 0xF0) lo = 0x90;  // overlong
    if (lead == 0xF4) hi = 0x8F;  // beyond U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size() || byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  uint32_t cp = lead & (0xFF >> (n + 1));
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  *code_point = cp;
  return n;
}

/// C1 controls (a terminal may take U+009B as CSI) and the bidirectional-text
/// controls (which reorder what follows them on the screen).
bool is_invisible_control(uint32_t cp) {
  return (cp >= 0x80 && cp <= 0x9F) || (cp >= 0x202A && cp <= 0x202E) || (cp >= 0x2066 && cp <= 0x2069);
}

void append_hex(std::string& out, const char* format, unsigned value) {
  char buf[16];
  std::snprintf(buf, sizeof buf, format, value);
  out += buf;
}

}  // namespace

std::string terminal_text(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      if (c == '\n') out += "\\n";
      else if (c == '\t') out += "\\t";
      else if (c == '\r') out += "\\r";
      else if (c < 0x20 || c == 0x7F) append_hex(out, "\\x%02x", c);
      else out += static_cast<char>(c);
      ++i;
      continue;
    }
    uint32_t cp = 0;
    const size_t n = utf8_sequence(text, i, &cp);
    if (n == 0) {
      append_hex(out, "\\x%02x", c);
      ++i;
    } else {
      if (is_invisible_control(cp)) append_hex(out, "\\u%04x", cp);
      else out.append(text, i, n);
      i += n;
    }
  }
  return out;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string sci(double v, int digits) {
  if (std::isnan(v)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*e", digits, v);
  return buf;
}

std::string human_bytes(double b) {
  if (b < 1024 * 1024) return fixed(b / 1024, 1) + " KiB";
  if (b < 1024.0 * 1024 * 1024) return fixed(b / (1024 * 1024), 1) + " MiB";
  return fixed(b / (1024.0 * 1024 * 1024), 2) + " GiB";
}

std::string tensor_dtypes(const Problem& p) {
  return std::string("index_q ") + dtype_name(p.tensors.at("index_q").dtype) + ", weights " +
         dtype_name(p.tensors.at("weights").dtype) + ", index_k " + dtype_name(p.tensors.at("index_k").dtype);
}

}  // namespace dsaib::cli
