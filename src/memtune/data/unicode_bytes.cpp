#include "memtune/data/unicode_bytes.h"

#include <array>
#include <cstring>

#include "memtune/core/error.h"

namespace memtune::unicode {
namespace {

bool is_printable_byte(unsigned b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

struct ByteTables {
  std::array<char32_t, 256> to_char{};
  // Every mapped character is below U+0144 (256 + 68), so a flat table covers them.
  static constexpr char32_t kLimit = 0x144;
  std::array<int16_t, kLimit> from_char{};

  ByteTables() {
    from_char.fill(-1);
    char32_t next_extra = 256;
    for (unsigned b = 0; b < 256; ++b) {
      to_char[b] = is_printable_byte(b) ? char32_t(b) : next_extra++;
      from_char[to_char[b]] = int16_t(b);
    }
    MT_ASSERT(next_extra == kLimit, "GPT-2 byte map must use 68 extra characters");
  }
};

const ByteTables& tables() {
  static const ByteTables instance;
  return instance;
}

bool is_continuation(unsigned char b) { return (b & 0xC0) == 0x80; }

}  // namespace

char32_t byte_to_char(uint8_t byte) { return tables().to_char[byte]; }

std::optional<uint8_t> char_to_byte(char32_t c) {
  if (c >= ByteTables::kLimit) return std::nullopt;
  const int16_t b = tables().from_char[c];
  if (b < 0) return std::nullopt;
  return uint8_t(b);
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(char(c));
  } else if (c < 0x800) {
    out.push_back(char(0xC0 | (c >> 6)));
    out.push_back(char(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(char(0xE0 | (c >> 12)));
    out.push_back(char(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(char(0x80 | (c & 0x3F)));
  } else {
    MT_ASSERT(c <= 0x10FFFF, "not a code point: {:#x}", uint32_t(c));
    out.push_back(char(0xF0 | (c >> 18)));
    out.push_back(char(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(char(0x80 | (c & 0x3F)));
  }
}

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) append_utf8(out, byte_to_char(b));
  return out;
}

std::optional<std::string> byte_level_to_bytes(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  while (!text.empty()) {
    const Utf8Step step = decode_utf8_step(text);
    if (!step.valid) return std::nullopt;
    const auto byte = char_to_byte(step.code_point);
    if (!byte) return std::nullopt;
    out.push_back(char(*byte));
    text.remove_prefix(step.length);
  }
  return out;
}

Utf8Step decode_utf8_step(std::string_view bytes) {
  MT_ASSERT(!bytes.empty());
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  const unsigned b0 = p[0];
  if (b0 < 0x80) return {true, 1, char32_t(b0)};
  size_t length;
  // The allowed range of the second byte depends on the first (Table 3-7); this is where
  // overlong forms (E0 80..9F, F0 80..8F), surrogates (ED A0..BF) and values past U+10FFFF
  // (F4 90..) are excluded.
  unsigned lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    length = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    length = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    length = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {false, 1, 0};
  }
  if (n < 2 || p[1] < lo || p[1] > hi) return {false, 1, 0};
  for (size_t i = 2; i < length; ++i) {
    if (i >= n || !is_continuation(p[i])) return {false, i, 0};
  }
  char32_t c = b0 & (0x7F >> length);
  for (size_t i = 1; i < length; ++i) c = (c << 6) | (p[i] & 0x3F);
  return {true, length, c};
}

std::optional<size_t> find_invalid_utf8(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    // Most training text is ASCII: skip it eight bytes at a time.
    if (i + 8 <= n) {
      uint64_t word;
      std::memcpy(&word, p + i, 8);
      if ((word & 0x8080808080808080ull) == 0) {
        i += 8;
        continue;
      }
    }
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step step = decode_utf8_step(text.substr(i));
    if (!step.valid) return i;
    i += step.length;
  }
  return std::nullopt;
}

void check_utf8(std::string_view text, std::string_view what) {
  const auto bad = find_invalid_utf8(text);
  if (!bad) return;
  mt_fail("{} is not valid UTF-8: byte {:#04x} at offset {} does not start a well-formed UTF-8 "
          "sequence (text length {} bytes)",
          what, unsigned(static_cast<unsigned char>(text[*bad])), *bad, text.size());
}

std::string to_utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  while (!bytes.empty()) {
    const Utf8Step step = decode_utf8_step(bytes);
    if (step.valid) {
      out.append(bytes.data(), step.length);
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD
    }
    bytes.remove_prefix(step.length);
  }
  return out;
}

bool is_python_space(char32_t c) {
  if (c <= 0x20) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
  switch (c) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

std::string_view strip_python_space(std::string_view text) {
  // Leading: decode forwards.
  while (!text.empty()) {
    const Utf8Step step = decode_utf8_step(text);
    MT_ASSERT(step.valid, "strip_python_space needs valid UTF-8");
    if (!is_python_space(step.code_point)) break;
    text.remove_prefix(step.length);
  }
  // Trailing: find the start of the last code point by skipping continuation bytes.
  while (!text.empty()) {
    size_t start = text.size() - 1;
    while (start > 0 && is_continuation(static_cast<unsigned char>(text[start]))) --start;
    const Utf8Step step = decode_utf8_step(text.substr(start));
    MT_ASSERT(step.valid && start + step.length == text.size(),
              "strip_python_space needs valid UTF-8");
    if (!is_python_space(step.code_point)) break;
    text.remove_suffix(step.length);
  }
  return text;
}

}  // namespace memtune::unicode
