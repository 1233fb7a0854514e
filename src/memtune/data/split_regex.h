// The pre-tokenizer's split regex (tokenizer.json's Split and ByteLevel pre-tokenizers), on PCRE2.
// The split regex. tokenizer.json patterns are Oniguruma (Ruby syntax); PCRE2 reads the same
// syntax for everything the Llama 3 and GPT-2 patterns use except `\s`: Oniguruma's `\s` is
// the Unicode White_Space property, while PCRE2 (10.42, UCP) adds U+180E through `\h`. So `\s`
// and `\S` are rewritten as explicit classes, and constructs whose meaning differs between the
// engines (or that this translation does not understand) are refused.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <pcre2.h>

#include "memtune/core/error.h"
#include "memtune/data/unicode_bytes.h"

namespace memtune {

// tokenizers pre_tokenizers/byte_level.rs: the pattern ByteLevel splits with when use_regex.
constexpr std::string_view kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// The Oniguruma pattern as PCRE2 reads it; memtune::Error (naming `where`) for what it refuses.
std::string translate_oniguruma_pattern(std::string_view pattern, const std::string& where);

class SplitRegex {
 public:
  // Compiles the tokenizer.json (Oniguruma) pattern; memtune::Error names `where` when it cannot
  // be translated or compiled, or when it matches the empty string.
  SplitRegex(std::string_view oniguruma_pattern, const std::string& where);
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;
  ~SplitRegex() { pcre2_code_free(code_); }

  // Calls piece(begin, end) for every piece HF's Split(behavior Isolated) makes of `text`:
  // each match, and each gap between matches (tokenizers' Pattern::find_matches for a Regex).
  template <typename Piece>
  void split(std::string_view text, Piece&& piece) const {
    thread_local MatchData md;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    const size_t n = text.size();
    size_t previous_end = 0;
    size_t from = 0;
    while (from < n) {
      const int rc = match(subject, n, from, md.get());
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        mt_fail("pre-tokenizer regex failed on a text of {} bytes at offset {}: {}", n, from,
                error_text(rc));
      }
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(md.get());
      const size_t begin = ovector[0], end = ovector[1];
      if (begin != previous_end) piece(previous_end, begin);
      if (end > begin) {
        piece(begin, end);
        from = end;
      } else {
        // Not reached with the supported patterns (the constructor refuses any that matches
        // empty); kept so that a search can never stall.
        from = end + unicode::decode_utf8_step(text.substr(end)).length;
      }
      previous_end = end;
    }
    if (previous_end != n) piece(previous_end, n);
  }

 private:
  class MatchData {
   public:
    // One ovector pair is enough for any pattern: only the whole match is read, and PCRE2
    // still matches (returning 0) when the ovector is too small for the groups.
    MatchData() : md_(pcre2_match_data_create(1, nullptr)) { MT_ASSERT(md_ != nullptr); }
    ~MatchData() { pcre2_match_data_free(md_); }
    MatchData(const MatchData&) = delete;
    MatchData& operator=(const MatchData&) = delete;
    pcre2_match_data* get() const { return md_; }

   private:
    pcre2_match_data* md_;
  };

  int match(PCRE2_SPTR subject, size_t length, size_t from, pcre2_match_data* md) const;

  static std::string error_text(int code);

  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

}  // namespace memtune
