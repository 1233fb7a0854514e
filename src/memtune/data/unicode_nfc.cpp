// NFC: full canonical decomposition, canonical ordering, then canonical composition (UAX #15,
// sections 1.3 and 9). The tables are sorted by the generator, so lookups are binary searches.
#include "memtune/data/unicode_nfc.h"

#include <algorithm>
#include <vector>

#include "memtune/data/unicode_bytes.h"

namespace memtune::unicode {
namespace {

using namespace nfc_data;

// Hangul syllable arithmetic (The Unicode Standard, section 3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr char32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

uint8_t combining_class(char32_t c) {
  if (c < kFirstTouched) return 0;
  const auto* end = kCombiningRanges + kCombiningRangeCount;
  const auto* it = std::upper_bound(kCombiningRanges, end, c,
                                    [](char32_t v, const CombiningRange& r) { return v < r.first; });
  if (it == kCombiningRanges) return 0;
  --it;
  return c <= it->last ? it->combining_class : 0;
}

void decompose(char32_t c, std::vector<char32_t>& out) {
  if (c >= kSBase && c < kSBase + kSCount) {
    const char32_t s = c - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (c >= kFirstTouched) {
    const auto* end = kDecompositions + kDecompositionCount;
    const auto* it = std::lower_bound(
        kDecompositions, end, c, [](const Decomposition& d, char32_t v) { return d.code_point < v; });
    if (it != end && it->code_point == c) {
      out.insert(out.end(), kDecompositionChars + it->offset,
                 kDecompositionChars + it->offset + it->length);
      return;
    }
  }
  out.push_back(c);
}

// The primary composite of (first, second), or 0.
char32_t compose(char32_t first, char32_t second) {
  if (first >= kLBase && first < kLBase + kLCount && second >= kVBase && second < kVBase + kVCount) {
    return kSBase + ((first - kLBase) * kVCount + (second - kVBase)) * kTCount;
  }
  if (first >= kSBase && first < kSBase + kSCount && (first - kSBase) % kTCount == 0 &&
      second > kTBase && second < kTBase + kTCount) {
    return first + (second - kTBase);
  }
  const auto* end = kCompositions + kCompositionCount;
  const auto* it = std::lower_bound(kCompositions, end, std::pair{first, second},
                                    [](const Composition& e, const std::pair<char32_t, char32_t>& v) {
                                      return e.first != v.first ? e.first < v.first
                                                                : e.second < v.second;
                                    });
  if (it != end && it->first == first && it->second == second) return it->composite;
  return 0;
}

}  // namespace

bool nfc_trivially_stable(std::string_view text) {
  // Every character below U+00C0 is one byte below 0x80 or two bytes led by 0xC2.
  static_assert(sizeof(char) == 1);
  for (const char ch : text) {
    if (static_cast<unsigned char>(ch) >= 0xC3) return false;
  }
  return true;
}

std::string_view nfc_unicode_version() { return kUnicodeVersion; }

std::string to_nfc(std::string_view text) {
  if (nfc_trivially_stable(text)) return std::string(text);
  std::vector<char32_t> chars;
  chars.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const Utf8Step step = decode_utf8_step(text.substr(i));
    // The caller checked the text; a bad byte here is a broken invariant.
    if (!step.valid) std::abort();
    decompose(step.code_point, chars);
    i += step.length;
  }
  // Canonical ordering: a stable sort of each run of non-starters by combining class.
  std::vector<uint8_t> classes(chars.size());
  for (size_t i = 0; i < chars.size(); ++i) classes[i] = combining_class(chars[i]);
  for (size_t i = 0; i < chars.size();) {
    if (classes[i] == 0) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < chars.size() && classes[end] != 0) ++end;
    // Runs are short; insertion sort is stable.
    for (size_t j = i + 1; j < end; ++j) {
      for (size_t k = j; k > i && classes[k - 1] > classes[k]; --k) {
        std::swap(classes[k - 1], classes[k]);
        std::swap(chars[k - 1], chars[k]);
      }
    }
    i = end;
  }
  // Canonical composition: each character composes with the last starter unless blocked (a
  // character between them has class 0 or a class >= its own).
  if (!chars.empty()) {
    size_t starter = 0;
    int last_class = classes[0] == 0 ? 0 : 256;  // a leading non-starter has no starter
    size_t kept = 1;
    for (size_t i = 1; i < chars.size(); ++i) {
      const char32_t c = chars[i];
      const int c_class = classes[i];
      const char32_t composite =
          (last_class < c_class || last_class == 0) && last_class != 256 ? compose(chars[starter], c) : 0;
      if (composite != 0) {
        chars[starter] = composite;
        continue;
      }
      if (c_class == 0) starter = kept;
      last_class = c_class;
      chars[kept] = c;
      classes[kept] = uint8_t(c_class);
      ++kept;
    }
    chars.resize(kept);
  }
  std::string out;
  out.reserve(text.size());
  for (const char32_t c : chars) append_utf8(out, c);
  return out;
}

}  // namespace memtune::unicode
