// UTF-8 checking and the GPT-2 byte <-> character mapping used by byte-level BPE.
//
// Byte-level BPE vocabularies (GPT-2, Llama 3) store each token as a string of printable
// characters, one character per byte: the mapping of openai/gpt-2 `encoder.py`
// (`bytes_to_unicode`), which HF tokenizers' ByteLevel pre-tokenizer and decoder also use. The
// printable bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for themselves; the other 68
// bytes, in increasing order, get U+0100, U+0101, ... (so ' ' is U+0120 'Ġ', '\n' U+010A 'Ċ').
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace memtune::unicode {

// The character that stands for `byte` in a byte-level vocabulary.
char32_t byte_to_char(uint8_t byte);
// The byte a byte-level character stands for; nullopt for any other character.
std::optional<uint8_t> char_to_byte(char32_t c);

// Appends the UTF-8 encoding of `c` (which must be a Unicode scalar value).
void append_utf8(std::string& out, char32_t c);

// The byte-level spelling of raw bytes: each byte becomes its character, UTF-8 encoded.
std::string bytes_to_byte_level(std::string_view bytes);
// The raw bytes a byte-level string spells; nullopt when `text` is not valid UTF-8 or holds a
// character outside the mapping (a token such as "<|eot_id|>" is all printable ASCII and so
// spells itself; one with a plain space does not map).
std::optional<std::string> byte_level_to_bytes(std::string_view text);

// One step of UTF-8 decoding at the start of `bytes` (which must not be empty). Follows
// Unicode's Table 3-7 of well-formed byte sequences: overlong forms, surrogates and values
// above U+10FFFF are ill-formed.
struct Utf8Step {
  bool valid;
  // valid: the sequence's length (1-4). Ill-formed: the length of the "maximal subpart"
  // (Unicode 15, section 3.9, U+FFFD substitution): the bytes that one U+FFFD replaces.
  size_t length;
  char32_t code_point;  // meaningful when valid
};
Utf8Step decode_utf8_step(std::string_view bytes);

// The offset of the first byte that is not part of a well-formed UTF-8 sequence, or nullopt.
std::optional<size_t> find_invalid_utf8(std::string_view text);

// Throws memtune::Error naming `what` and the offset (and value) of the first bad byte.
void check_utf8(std::string_view text, std::string_view what);

// `bytes` with each ill-formed subsequence replaced by U+FFFD, exactly as Rust's
// String::from_utf8_lossy (which HF tokenizers' ByteLevel decoder ends with) does.
std::string to_utf8_lossy(std::string_view bytes);

// Python's str.isspace() (which Jinja's `trim` filter uses through str.strip()): U+0009-000D,
// U+001C-001F, U+0020, U+0085, U+00A0, U+1680, U+2000-200A, U+2028, U+2029, U+202F, U+205F,
// U+3000. Checked against CPython 3.11 by listing every code point with isspace() true.
bool is_python_space(char32_t c);

// `text` (valid UTF-8) without leading and trailing is_python_space characters.
std::string_view strip_python_space(std::string_view text);

}  // namespace memtune::unicode
