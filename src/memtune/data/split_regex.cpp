#include "memtune/data/split_regex.h"

namespace memtune {

namespace {

// White_Space (Unicode PropList.txt), which Oniguruma's \s matches in UTF-8 mode.
constexpr std::string_view kWhiteSpaceItems =
    "\\x{09}-\\x{0D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

}  // namespace

std::string translate_oniguruma_pattern(std::string_view pattern, const std::string& where) {
  std::string out;
  bool in_class = false;
  size_t class_open = 0;  // offset in `pattern` of the '[' that opened the class
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      MT_USER_CHECK(i + 1 < pattern.size(), "{}: the regex ends with a lone backslash", where);
      const char e = pattern[i + 1];
      ++i;
      if (e == 's') {
        if (in_class) {
          out += kWhiteSpaceItems;
        } else {
          out += '[';
          out += kWhiteSpaceItems;
          out += ']';
        }
        continue;
      }
      if (e == 'S') {
        MT_USER_CHECK(!in_class,
                      "{}: the regex uses \\S inside a character class; memtune cannot "
                      "translate it from Oniguruma to PCRE2 exactly",
                      where);
        out += "[^";
        out += kWhiteSpaceItems;
        out += ']';
        continue;
      }
      if (std::string_view("wWdDbBhHvVRXKyYO").find(e) != std::string_view::npos) {
        mt_fail("{}: the regex uses \\{}, whose meaning differs between Oniguruma (HF "
                "tokenizers) and PCRE2; memtune does not support it",
                where, e);
      }
      out += c;
      out += e;
      continue;
    }
    if (in_class) {
      MT_USER_CHECK(c != '[' && !(c == '&' && i + 1 < pattern.size() && pattern[i + 1] == '&'),
                    "{}: the regex nests character classes or uses && (Oniguruma class "
                    "operations); memtune does not support them",
                    where);
      // A ']' right after '[' or '[^' is a literal in both engines.
      const bool class_start = i == class_open + 1 || (i == class_open + 2 &&
                                                       pattern[class_open + 1] == '^');
      if (c == ']' && !class_start) in_class = false;
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      class_open = i;
    } else if (c == '^' || c == '$') {
      // Ruby syntax makes ^ and $ line anchors; PCRE2's are subject anchors.
      mt_fail("{}: the regex uses the anchor '{}', which means a line boundary in Oniguruma "
              "but the subject boundary in PCRE2; memtune does not support it",
              where, c);
    }
    out += c;
  }
  MT_USER_CHECK(!in_class, "{}: the regex has an unterminated character class", where);
  return out;
}

SplitRegex::SplitRegex(std::string_view oniguruma_pattern, const std::string& where) {
  const std::string pattern = translate_oniguruma_pattern(oniguruma_pattern, where);
  pcre2_compile_context* context = pcre2_compile_context_create(nullptr);
  MT_ASSERT(context != nullptr);
  // Oniguruma's newline is LF alone; PCRE2's default is a build option. '.' depends on it.
  pcre2_set_newline(context, PCRE2_NEWLINE_LF);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                        PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, context);
  pcre2_compile_context_free(context);
  if (code_ == nullptr) {
    mt_fail("{}: PCRE2 cannot compile the regex (as translated: \"{}\"): {} at offset {}",
            where, pattern, error_text(error_code), error_offset);
  }
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  // An empty-string match would make HF skip a character in a way this code mirrors only
  // loosely; none of the supported patterns can match empty, so refuse any that does.
  MatchData md;
  const int rc = match(reinterpret_cast<PCRE2_SPTR>(""), 0, 0, md.get());
  if (rc >= 0) {
    pcre2_code_free(code_);
    mt_fail("{}: the regex matches the empty string; memtune does not support that", where);
  }
}

int SplitRegex::match(PCRE2_SPTR subject, size_t length, size_t from, pcre2_match_data* md) const {
  // The text was checked for UTF-8 before; without NO_UTF_CHECK PCRE2 would re-check the
  // whole rest of the subject on every call, quadratic over a document.
  if (jit_) {
    const int rc = pcre2_jit_match(code_, subject, length, from, PCRE2_NO_UTF_CHECK, md,
                                   nullptr);
    // The JIT's default 32 KiB stack can run out on a very long run of one class; the
    // interpreter keeps its backtracking frames on the heap instead.
    if (rc != PCRE2_ERROR_JIT_STACKLIMIT) return rc;
  }
  return pcre2_match(code_, subject, length, from, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md,
                     nullptr);
}

std::string SplitRegex::error_text(int code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(code, buffer, sizeof(buffer));
  if (n < 0) return fmt::format("PCRE2 error {}", code);
  return std::string(reinterpret_cast<const char*>(buffer), size_t(n));
}

}  // namespace memtune
