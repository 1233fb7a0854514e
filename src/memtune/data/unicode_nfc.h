// Unicode Normalization Form C (UAX #15), as HF tokenizers' "NFC" normalizer applies it.
//
// The data (combining classes, canonical decompositions, primary composites) is generated from
// Python's unicodedata by tools/make_unicode_nfc.py into generated/unicode_nfc_table.cpp; Hangul syllables
// are decomposed and composed by the arithmetic of The Unicode Standard, section 3.12. HF
// tokenizers takes its tables from the unicode-normalization-alignments crate, which may carry an
// older Unicode version than Python's: the two agree on every character both versions assign (the
// Unicode stability policy freezes the decompositions and classes of assigned characters); they
// can differ only on characters assigned between the two versions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace memtune::unicode {

// The NFC form of `text`, which must be valid UTF-8 (checked by the caller).
std::string to_nfc(std::string_view text);

// Whether to_nfc(text) == text is certain without work: every character is below the first one
// that NFC can change or compose with (U+00C0, as generated).
bool nfc_trivially_stable(std::string_view text);

// For the tests: the Unicode version the tables came from.
std::string_view nfc_unicode_version();

namespace nfc_data {
struct CombiningRange {
  char32_t first, last;
  uint8_t combining_class;
};
struct Decomposition {
  char32_t code_point;
  uint32_t offset, length;  // into kDecompositionChars
};
struct Composition {
  char32_t first, second, composite;
};
extern const char* const kUnicodeVersion;
extern const char32_t kFirstTouched;
extern const CombiningRange kCombiningRanges[];
extern const size_t kCombiningRangeCount;
extern const char32_t kDecompositionChars[];
extern const Decomposition kDecompositions[];
extern const size_t kDecompositionCount;
extern const Composition kCompositions[];
extern const size_t kCompositionCount;
}  // namespace nfc_data

}  // namespace memtune::unicode
