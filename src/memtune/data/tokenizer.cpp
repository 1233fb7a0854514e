// Byte-level BPE matching HF tokenizers (v0.2x) bit for bit on Llama 3's tokenizer.json.
//
// Facts used, with where they were read:
//  - tokenizer.json layout and semantics: huggingface/tokenizers, tokenizers/src (models/bpe,
//    pre_tokenizers/{split,byte_level,sequence}.rs, processors/template.rs,
//    tokenizer/added_vocabulary.rs). Checked against `tokenizers` 0.23 by the fixtures of
//    tools/make_tokenizer_fixtures.py.
//  - The Llama 3 split regex and the special ids: SPECS.md section 6.
//  - GPT-2's split regex (ByteLevel with use_regex true): tokenizers
//    pre_tokenizers/byte_level.rs, the same as openai/gpt-2 encoder.py.
#include "memtune/data/tokenizer.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <functional>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <pcre2.h>

#include "memtune/core/error.h"
#include "memtune/data/unicode_bytes.h"
#include "memtune/io/file_util.h"

namespace memtune {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Hashing and the two hot lookup tables.

inline uint64_t mix64(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h;
}

uint64_t hash_bytes(const unsigned char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t(n) * 0x87c37b91114253d5ull);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ (w * 0x87c37b91114253d5ull));
    h = ((h << 31) | (h >> 33)) * 0x4cf5ad432745937full;
    p += 8;
    n -= 8;
  }
  uint64_t tail = 0;
  if (n > 0) std::memcpy(&tail, p, n);
  return mix64(h ^ tail);
}

size_t table_capacity_for(size_t count) {
  size_t capacity = 16;
  while (capacity < count * 2) capacity *= 2;
  return capacity;
}

// (left id, right id) -> (rank, merged id): every BPE step looks here, so it is a flat
// open-addressing table rather than std::unordered_map's node per entry.
class MergeTable {
 public:
  struct Entry {
    uint64_t key;
    int32_t rank = -1;  // -1: empty slot
    int32_t merged;
  };

  void build(const std::vector<Entry>& entries) {
    slots_.assign(table_capacity_for(entries.size()), Entry{0, -1, 0});
    mask_ = slots_.size() - 1;
    for (const Entry& e : entries) {
      size_t i = mix64(e.key) & mask_;
      while (slots_[i].rank >= 0 && slots_[i].key != e.key) i = (i + 1) & mask_;
      // A pair listed twice keeps its later rank: HF collects the merges into a HashMap, where
      // a later insert replaces an earlier one.
      slots_[i] = e;
    }
  }

  const Entry* find(int32_t left, int32_t right) const {
    const uint64_t key = (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
    size_t i = mix64(key) & mask_;
    while (true) {
      const Entry& e = slots_[i];
      if (e.rank < 0) return nullptr;
      if (e.key == key) return &e;
      i = (i + 1) & mask_;
    }
  }

 private:
  std::vector<Entry> slots_{Entry{0, -1, 0}};
  size_t mask_ = 0;
};

// Raw bytes of a whole pre-token -> vocabulary id, for ignore_merges. Keyed by bytes, not by
// the byte-level spelling, so a pre-token is looked up without re-encoding it.
class WordTable {
 public:
  void add(std::string_view bytes, int32_t id) { pending_.push_back({std::string(bytes), id}); }

  void build() {
    slots_.assign(table_capacity_for(pending_.size()), Slot{});
    mask_ = slots_.size() - 1;
    for (auto& [bytes, id] : pending_) {
      const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
      const uint64_t h = hash_bytes(p, bytes.size());
      size_t i = h & mask_;
      while (slots_[i].id >= 0) i = (i + 1) & mask_;
      slots_[i] = Slot{uint32_t(h >> 32), uint32_t(arena_.size()), uint32_t(bytes.size()), id};
      arena_.append(bytes);
    }
    pending_.clear();
    pending_.shrink_to_fit();
  }

  int32_t find(const unsigned char* p, size_t n) const {
    const uint64_t h = hash_bytes(p, n);
    const uint32_t tag = uint32_t(h >> 32);
    size_t i = h & mask_;
    while (true) {
      const Slot& s = slots_[i];
      if (s.id < 0) return -1;
      if (s.tag == tag && s.length == n && std::memcmp(arena_.data() + s.offset, p, n) == 0) {
        return s.id;
      }
      i = (i + 1) & mask_;
    }
  }

 private:
  struct Slot {
    uint32_t tag = 0;
    uint32_t offset = 0;
    uint32_t length = 0;
    int32_t id = -1;
  };
  std::vector<std::pair<std::string, int32_t>> pending_;
  std::vector<Slot> slots_{Slot{}};
  size_t mask_ = 0;
  std::string arena_;
};

struct TransparentStringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringIdMap =
    std::unordered_map<std::string, int32_t, TransparentStringHash, std::equal_to<>>;

// ---------------------------------------------------------------------------------------------
// Added tokens: found in the text leftmost-longest, as HF's aho-corasick matcher
// (MatchKind::LeftmostLongest) finds them.

class AddedTokenMatcher {
 public:
  struct Match {
    size_t begin, end;
    int32_t id;
  };

  void add(std::string_view content, int32_t id) {
    MT_ASSERT(!content.empty());
    if (nodes_.empty()) nodes_.emplace_back();
    first_byte_[static_cast<unsigned char>(content[0])] = true;
    int32_t node = 0;
    for (unsigned char c : content) {
      int32_t next = child(node, c);
      if (next < 0) {
        next = int32_t(nodes_.size());
        nodes_[node].children.push_back({c, next});
        nodes_.emplace_back();
      }
      node = next;
    }
    nodes_[node].id = id;
  }

  bool empty() const { return nodes_.empty(); }

  std::optional<Match> find(std::string_view text, size_t from) const {
    const auto* p = reinterpret_cast<const unsigned char*>(text.data());
    for (size_t begin = from; begin < text.size(); ++begin) {
      if (!first_byte_[p[begin]]) continue;
      int32_t node = 0;
      std::optional<Match> longest;
      for (size_t i = begin; i < text.size(); ++i) {
        node = child(node, p[i]);
        if (node < 0) break;
        if (nodes_[node].id >= 0) longest = Match{begin, i + 1, nodes_[node].id};
      }
      if (longest) return longest;
    }
    return std::nullopt;
  }

 private:
  struct Node {
    int32_t id = -1;
    std::vector<std::pair<unsigned char, int32_t>> children;
  };

  int32_t child(int32_t node, unsigned char c) const {
    for (const auto& [byte, next] : nodes_[node].children) {
      if (byte == c) return next;
    }
    return -1;
  }

  std::vector<Node> nodes_;
  std::array<bool, 256> first_byte_{};
};

// ---------------------------------------------------------------------------------------------
// The split regex. tokenizer.json patterns are Oniguruma (Ruby syntax); PCRE2 reads the same
// syntax for everything the Llama 3 and GPT-2 patterns use except `\s`: Oniguruma's `\s` is
// the Unicode White_Space property, while PCRE2 (10.42, UCP) adds U+180E through `\h`. So `\s`
// and `\S` are rewritten as explicit classes, and constructs whose meaning differs between the
// engines (or that this translation does not understand) are refused.

// White_Space (Unicode PropList.txt), which Oniguruma's \s matches in UTF-8 mode.
constexpr std::string_view kWhiteSpaceItems =
    "\\x{09}-\\x{0D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

// tokenizers pre_tokenizers/byte_level.rs: the pattern ByteLevel splits with when use_regex.
constexpr std::string_view kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

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

class SplitRegex {
 public:
  SplitRegex(std::string_view oniguruma_pattern, const std::string& where) {
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

  int match(PCRE2_SPTR subject, size_t length, size_t from, pcre2_match_data* md) const {
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

  static std::string error_text(int code) {
    PCRE2_UCHAR buffer[256];
    const int n = pcre2_get_error_message(code, buffer, sizeof(buffer));
    if (n < 0) return fmt::format("PCRE2 error {}", code);
    return std::string(reinterpret_cast<const char*>(buffer), size_t(n));
  }

  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// ---------------------------------------------------------------------------------------------
// Reading tokenizer.json. Every field is looked at: an unknown one is refused, because HF may
// act on it and memtune would not.

[[noreturn]] void refuse(const std::string& origin, std::string_view where,
                         std::string_view problem) {
  mt_fail("{}: unsupported tokenizer.json: {}: {}", origin, where, problem);
}

void check_keys(const std::string& origin, std::string_view where, const json& object,
                std::initializer_list<std::string_view> known) {
  if (!object.is_object()) refuse(origin, where, "expected a JSON object");
  for (const auto& [key, value] : object.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      refuse(origin, fmt::format("{}.{}", where, key),
             "memtune does not know this field (it would be ignored, so it is refused)");
    }
  }
}

bool is_null_or(const json& object, std::string_view key, const json& allowed) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() || *it == allowed;
}

std::string type_of(const std::string& origin, std::string_view where, const json& object) {
  const auto it = object.find("type");
  if (!object.is_object() || it == object.end() || !it->is_string()) {
    refuse(origin, where, "expected an object with a string \"type\"");
  }
  return it->get<std::string>();
}

bool get_bool(const std::string& origin, std::string_view where, const json& object,
              std::string_view key, bool fallback) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) refuse(origin, fmt::format("{}.{}", where, key), "expected a boolean");
  return it->get<bool>();
}

// ByteLevel as a pre-tokenizer: the only ids-relevant flags are add_prefix_space (unsupported
// when true) and use_regex (true: split with GPT-2's pattern first).
bool parse_byte_level_pre_tokenizer(const std::string& origin, const std::string& where,
                                    const json& spec) {
  check_keys(origin, where, spec, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
  if (get_bool(origin, where, spec, "add_prefix_space", true)) {
    refuse(origin, where + ".add_prefix_space", "true is not supported (Llama 3 uses false)");
  }
  return get_bool(origin, where, spec, "use_regex", true);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  enum class Kind { kBpe, kBytes };
  Kind kind = Kind::kBpe;

  int32_t vocab_size = 0;
  std::vector<std::string> token_text;  // tokenizer.json's spelling, by id
  std::vector<std::string> token_bytes;  // what decode emits, by id
  std::vector<uint8_t> id_exists;
  std::vector<uint8_t> id_special;
  StringIdMap text_to_id;

  // Added tokens whose "normalized" flag is false are matched first, then those with true in
  // the gaps (tokenizers AddedVocabulary::extract_and_normalize). With no normalizer the two
  // passes see the same text, but the order still decides overlaps.
  AddedTokenMatcher literal_added;
  AddedTokenMatcher normalized_added;

  std::array<int32_t, 256> byte_ids{};
  MergeTable merges;
  WordTable words;
  bool ignore_merges = false;
  std::unique_ptr<SplitRegex> split_regex;

  std::vector<int32_t> template_prefix;
  std::vector<int32_t> template_suffix;
  int32_t bos = -1, eos = -1, eot = -1, pad = -1;

  void encode_plain_append(std::string_view text, std::vector<int32_t>& out) const {
    unicode::check_utf8(text, "text to tokenize");
    if (literal_added.empty()) {
      split_normalized_added(text, out);
      return;
    }
    split_on(literal_added, text, out,
             [&](std::string_view gap) { split_normalized_added(gap, out); });
  }

  void split_normalized_added(std::string_view text, std::vector<int32_t>& out) const {
    if (normalized_added.empty()) {
      encode_segment(text, out);
      return;
    }
    split_on(normalized_added, text, out,
             [&](std::string_view gap) { encode_segment(gap, out); });
  }

  template <typename Gap>
  static void split_on(const AddedTokenMatcher& matcher, std::string_view text,
                       std::vector<int32_t>& out, Gap&& gap) {
    size_t pos = 0;
    while (pos < text.size()) {
      const auto match = matcher.find(text, pos);
      const size_t gap_end = match ? match->begin : text.size();
      if (gap_end > pos) gap(text.substr(pos, gap_end - pos));
      if (!match) break;
      out.push_back(match->id);
      pos = match->end;
    }
  }

  // Text with no added token in it.
  void encode_segment(std::string_view text, std::vector<int32_t>& out) const {
    const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
    if (kind == Kind::kBytes) {
      for (size_t i = 0; i < text.size(); ++i) out.push_back(int32_t(bytes[i]));
      return;
    }
    if (!split_regex) {
      encode_word(bytes, text.size(), out);
      return;
    }
    split_regex->split(text, [&](size_t begin, size_t end) {
      encode_word(bytes + begin, end - begin, out);
    });
  }

  // One pre-token through the model (tokenizers models/bpe/model.rs, BPE::tokenize).
  void encode_word(const unsigned char* p, size_t n, std::vector<int32_t>& out) const {
    if (n == 0) return;
    if (n == 1) {
      out.push_back(byte_ids[p[0]]);
      return;
    }
    if (ignore_merges) {
      const int32_t id = words.find(p, n);
      if (id >= 0) {
        out.push_back(id);
        return;
      }
    }
    if (n <= kShortWord) {
      merge_short(p, n, out);
    } else {
      merge_long(p, n, out);
    }
  }

  // Both merge loops apply, at each step, the pair with the lowest merge rank, the leftmost
  // among equal ranks: the order of HF's heap of (rank, position) in models/bpe/word.rs
  // (Word::merge_all). Short words (most of them) use a plain array scan, which beats a heap
  // at these sizes; long words use the heap.
  static constexpr size_t kShortWord = 48;

  void merge_short(const unsigned char* p, size_t n, std::vector<int32_t>& out) const {
    int32_t symbols[kShortWord];
    int32_t rank[kShortWord];  // rank[j]: the pair (symbols[j], symbols[j + 1])
    int32_t merged[kShortWord];
    size_t count = n;
    for (size_t i = 0; i < n; ++i) symbols[i] = byte_ids[p[i]];
    auto look_up = [&](size_t j) {
      const MergeTable::Entry* e = merges.find(symbols[j], symbols[j + 1]);
      rank[j] = e ? e->rank : INT32_MAX;
      merged[j] = e ? e->merged : -1;
    };
    for (size_t j = 0; j + 1 < count; ++j) look_up(j);
    while (count > 1) {
      size_t best = 0;
      for (size_t j = 1; j + 1 < count; ++j) {
        if (rank[j] < rank[best]) best = j;
      }
      if (rank[best] == INT32_MAX) break;
      symbols[best] = merged[best];
      const size_t pairs = count - 1;
      for (size_t j = best + 1; j + 1 < count; ++j) symbols[j] = symbols[j + 1];
      for (size_t j = best + 1; j + 1 < pairs; ++j) {
        rank[j] = rank[j + 1];
        merged[j] = merged[j + 1];
      }
      --count;
      if (best + 1 < count) look_up(best);
      if (best > 0) look_up(best - 1);
    }
    out.insert(out.end(), symbols, symbols + count);
  }

  void merge_long(const unsigned char* p, size_t n, std::vector<int32_t>& out) const {
    struct Symbol {
      int32_t id;  // -1 once merged into its left neighbour
      int32_t prev, next;  // -1 at the ends
    };
    std::vector<Symbol> symbols(n);
    for (size_t i = 0; i < n; ++i) {
      symbols[i] = Symbol{byte_ids[p[i]], int32_t(i) - 1, i + 1 < n ? int32_t(i + 1) : -1};
    }
    // Min-heap of (rank << 32 | position): the lowest rank first, then the leftmost.
    std::vector<uint64_t> heap;
    heap.reserve(n);
    const auto later = std::greater<uint64_t>();
    auto push_pair = [&](int32_t left) {
      const int32_t right = symbols[size_t(left)].next;
      if (right < 0) return;
      if (const auto* e = merges.find(symbols[size_t(left)].id, symbols[size_t(right)].id)) {
        heap.push_back((uint64_t(uint32_t(e->rank)) << 32) | uint32_t(left));
        std::push_heap(heap.begin(), heap.end(), later);
      }
    };
    for (size_t i = 0; i + 1 < n; ++i) push_pair(int32_t(i));
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), later);
      const uint64_t top = heap.back();
      heap.pop_back();
      const auto rank = int32_t(top >> 32);
      const auto position = int32_t(top & 0xFFFFFFFFu);
      Symbol& left = symbols[size_t(position)];
      if (left.id < 0 || left.next < 0) continue;
      Symbol& right = symbols[size_t(left.next)];
      // Stale entry: the pair at this position changed since it was queued. HF compares the
      // merged id; comparing the rank is the same test, since a rank names one pair and a
      // position's pair can only change into one that spells a different merged token.
      const auto* e = merges.find(left.id, right.id);
      if (e == nullptr || e->rank != rank) continue;
      left.id = e->merged;
      right.id = -1;
      left.next = right.next;
      if (right.next >= 0) symbols[size_t(right.next)].prev = position;
      if (left.prev >= 0) push_pair(left.prev);
      push_pair(position);
    }
    for (int32_t i = 0; i >= 0; i = symbols[size_t(i)].next) out.push_back(symbols[size_t(i)].id);
  }

  void check_id(int32_t id) const {
    MT_USER_CHECK(id >= 0 && id < vocab_size && id_exists[size_t(id)],
                  "token id {} names no token (vocabulary size {})", id, vocab_size);
  }

  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
    std::string out;
    for (const int32_t id : ids) {
      check_id(id);
      if (skip_special_tokens && id_special[size_t(id)]) continue;
      out += token_bytes[size_t(id)];
    }
    return out;
  }

  // Sizes the per-id tables for ids [0, size).
  void resize(int32_t size) {
    vocab_size = size;
    token_text.resize(size_t(size));
    token_bytes.resize(size_t(size));
    id_exists.resize(size_t(size), 0);
    id_special.resize(size_t(size), 0);
  }

  // Resolves bos/eos/eot/pad from the tokens by name (Llama 3's names) and checks the template.
  void resolve_special_ids(const std::string& origin) {
    auto find = [&](std::string_view name) -> int32_t {
      const auto it = text_to_id.find(name);
      return it == text_to_id.end() ? -1 : it->second;
    };
    bos = find("<|begin_of_text|>");
    if (bos < 0 && template_prefix.size() == 1) bos = template_prefix[0];
    MT_USER_CHECK(bos >= 0,
                  "{}: the tokenizer has no <|begin_of_text|> token; memtune needs a Llama 3 "
                  "style tokenizer",
                  origin);
    eos = find("<|end_of_text|>");
    MT_USER_CHECK(eos >= 0,
                  "{}: the tokenizer has no <|end_of_text|> token; memtune needs a Llama 3 "
                  "style tokenizer",
                  origin);
    eot = find("<|eot_id|>");
    if (eot < 0) eot = eos;
    // Llama 3.1 named the reserved slot 128004 <|finetune_right_pad_id|>; Llama 3.0 files
    // (including shared/data's, despite its package name) still call it
    // <|reserved_special_token_2|>. Either way the same id pads, so the two agree.
    pad = find("<|finetune_right_pad_id|>");
    if (pad < 0) pad = find("<|reserved_special_token_2|>");
    if (pad < 0) pad = eos;
  }
};

namespace {

using Impl = Tokenizer::Impl;

// Added tokens go in after the vocabulary: an added token's content wins in token_to_id and
// id_to_token for its id (tokenizers: added vocabulary first, then the model).
void add_added_token(Impl& impl, std::string_view content, int32_t id, bool special,
                     bool normalized) {
  impl.token_text[size_t(id)] = std::string(content);
  // HF's ByteLevel decoder maps an added token's characters back to bytes like any other
  // token's, falling back to its UTF-8 when some character is outside the byte map.
  auto bytes = unicode::byte_level_to_bytes(content);
  impl.token_bytes[size_t(id)] = bytes ? *bytes : std::string(content);
  impl.id_exists[size_t(id)] = 1;
  impl.id_special[size_t(id)] = special ? 1 : 0;
  impl.text_to_id[std::string(content)] = id;
  (normalized ? impl.normalized_added : impl.literal_added).add(content, id);
}

void parse_pre_tokenizer(Impl& impl, const std::string& origin, const json& spec) {
  if (spec.is_null()) {
    refuse(origin, "pre_tokenizer",
           "null; memtune needs the ByteLevel pre-tokenizer of a byte-level BPE");
  }
  const std::string type = type_of(origin, "pre_tokenizer", spec);
  if (type == "ByteLevel") {
    if (parse_byte_level_pre_tokenizer(origin, "pre_tokenizer", spec)) {
      impl.split_regex = std::make_unique<SplitRegex>(kGpt2Pattern, origin + ": pre_tokenizer");
    }
    return;
  }
  if (type != "Sequence") {
    refuse(origin, "pre_tokenizer.type",
           fmt::format("\"{}\"; memtune supports ByteLevel, or a Sequence of a regex Split "
                       "and ByteLevel",
                       type));
  }
  check_keys(origin, "pre_tokenizer", spec, {"type", "pretokenizers"});
  const json& list = spec.value("pretokenizers", json::array());
  // The Llama 3 shape: [Split(regex, Isolated), ByteLevel(use_regex=false)]; also accepted:
  // [ByteLevel] alone.
  if (!list.is_array() || list.empty() || list.size() > 2) {
    refuse(origin, "pre_tokenizer.pretokenizers",
           "memtune supports [Split, ByteLevel] or [ByteLevel]");
  }
  const std::string last_where = fmt::format("pre_tokenizer.pretokenizers[{}]", list.size() - 1);
  if (type_of(origin, last_where, list.back()) != "ByteLevel") {
    refuse(origin, last_where + ".type", "memtune needs ByteLevel as the last pre-tokenizer");
  }
  const bool byte_level_regex = parse_byte_level_pre_tokenizer(origin, last_where, list.back());
  if (list.size() == 1) {
    if (byte_level_regex) {
      impl.split_regex = std::make_unique<SplitRegex>(kGpt2Pattern, origin + ": pre_tokenizer");
    }
    return;
  }
  if (byte_level_regex) {
    refuse(origin, last_where + ".use_regex",
           "true after a Split (two regex splits) is not supported; Llama 3 uses false");
  }
  const std::string where = "pre_tokenizer.pretokenizers[0]";
  const json& split = list[0];
  const std::string split_type = type_of(origin, where, split);
  if (split_type != "Split") {
    refuse(origin, where + ".type",
           fmt::format("\"{}\"; memtune supports Split before ByteLevel", split_type));
  }
  check_keys(origin, where, split, {"type", "pattern", "behavior", "invert"});
  if (split.value("behavior", std::string()) != "Isolated") {
    refuse(origin, where + ".behavior", "memtune supports only \"Isolated\"");
  }
  if (get_bool(origin, where, split, "invert", false)) {
    refuse(origin, where + ".invert", "true is not supported");
  }
  const auto pattern = split.find("pattern");
  if (pattern == split.end() || !pattern->is_object() || !pattern->contains("Regex") ||
      !(*pattern)["Regex"].is_string() || pattern->size() != 1) {
    refuse(origin, where + ".pattern", "memtune supports only {\"Regex\": \"...\"}");
  }
  impl.split_regex = std::make_unique<SplitRegex>((*pattern)["Regex"].get<std::string>(),
                                                  origin + ": " + where + ".pattern.Regex");
}

void parse_normalizer(const std::string& origin, const json& spec) {
  if (spec.is_null()) return;
  // An empty Sequence changes nothing.
  if (spec.is_object() && spec.value("type", std::string()) == "Sequence" &&
      spec.value("normalizers", json::array()).empty()) {
    return;
  }
  refuse(origin, "normalizer", "memtune supports only null (Llama 3 has no normalizer)");
}

void parse_decoder(const std::string& origin, const json& spec) {
  std::string where = "decoder";
  const json* decoder = &spec;
  if (spec.is_object() && spec.value("type", std::string()) == "Sequence") {
    const json& list = spec.value("decoders", json::array());
    if (!list.is_array() || list.size() != 1) {
      refuse(origin, "decoder.decoders", "memtune supports only a single ByteLevel decoder");
    }
    decoder = &list[0];
    where = "decoder.decoders[0]";
  }
  if (decoder->is_null() || type_of(origin, where, *decoder) != "ByteLevel") {
    refuse(origin, where, "memtune supports only the ByteLevel decoder");
  }
  // ByteLevel's decode ignores its flags (tokenizers pre_tokenizers/byte_level.rs).
  check_keys(origin, where, *decoder, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
}

void parse_template(Impl& impl, const std::string& origin, const std::string& where,
                    const json& spec) {
  check_keys(origin, where, spec, {"type", "single", "pair", "special_tokens"});
  const json& specials = spec.value("special_tokens", json::object());
  const json& single = spec.value("single", json::array());
  if (!single.is_array()) refuse(origin, where + ".single", "expected an array");
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string item_where = fmt::format("{}.single[{}]", where, i);
    const json& item = single[i];
    if (item.is_object() && item.contains("Sequence")) {
      if (item["Sequence"].value("id", std::string()) != "A" || seen_sequence) {
        refuse(origin, item_where, "a single-sequence template must hold sequence A once");
      }
      seen_sequence = true;
      continue;
    }
    if (!item.is_object() || !item.contains("SpecialToken")) {
      refuse(origin, item_where, "expected {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    }
    const std::string name = item["SpecialToken"].value("id", std::string());
    const auto entry = specials.find(name);
    if (entry == specials.end() || !entry->contains("ids") || !(*entry)["ids"].is_array()) {
      refuse(origin, item_where,
             fmt::format("special token \"{}\" is not in {}.special_tokens", name, where));
    }
    for (const json& id : (*entry)["ids"]) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() >= impl.vocab_size || !impl.id_exists[id.get<size_t>()]) {
        refuse(origin, item_where, fmt::format("special token \"{}\" has an unknown id", name));
      }
      (seen_sequence ? impl.template_suffix : impl.template_prefix).push_back(id.get<int32_t>());
    }
  }
  if (!seen_sequence) refuse(origin, where + ".single", "the template never places sequence A");
}

void parse_post_processor(Impl& impl, const std::string& origin, const std::string& where,
                          const json& spec, bool& seen_template) {
  if (spec.is_null()) return;
  const std::string type = type_of(origin, where, spec);
  if (type == "ByteLevel") {
    // As a post-processor ByteLevel only trims offsets; ids are untouched.
    check_keys(origin, where, spec, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
  } else if (type == "TemplateProcessing") {
    if (seen_template) refuse(origin, where, "more than one TemplateProcessing");
    seen_template = true;
    parse_template(impl, origin, where, spec);
  } else if (type == "Sequence") {
    check_keys(origin, where, spec, {"type", "processors"});
    const json& list = spec.value("processors", json::array());
    for (size_t i = 0; i < list.size(); ++i) {
      parse_post_processor(impl, origin, fmt::format("{}.processors[{}]", where, i), list[i],
                           seen_template);
    }
  } else {
    refuse(origin, where + ".type",
           fmt::format("\"{}\"; memtune supports TemplateProcessing, ByteLevel and Sequence",
                       type));
  }
}

std::pair<std::string, std::string> parse_merge(const std::string& origin, size_t index,
                                                const json& merge) {
  if (merge.is_string()) {
    // "a b": byte-level tokens never hold a plain space (it is spelt U+0120), so exactly one.
    const std::string text = merge.get<std::string>();
    const size_t space = text.find(' ');
    if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos ||
        space == 0 || space + 1 == text.size()) {
      refuse(origin, fmt::format("model.merges[{}]", index),
             fmt::format("\"{}\" is not two tokens separated by one space", text));
    }
    return {text.substr(0, space), text.substr(space + 1)};
  }
  if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
    return {merge[0].get<std::string>(), merge[1].get<std::string>()};
  }
  refuse(origin, fmt::format("model.merges[{}]", index),
         "expected \"a b\" or [\"a\", \"b\"]");
}

void parse_model(Impl& impl, const std::string& origin, const json& model,
                 const json& added_tokens) {
  if (type_of(origin, "model", model) != "BPE") {
    refuse(origin, "model.type", "memtune supports only \"BPE\"");
  }
  check_keys(origin, "model", model,
             {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
              "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"});
  if (!is_null_or(model, "dropout", 0.0) && !is_null_or(model, "dropout", 0)) {
    refuse(origin, "model.dropout", "BPE dropout is random; memtune supports only null");
  }
  if (!is_null_or(model, "continuing_subword_prefix", "")) {
    refuse(origin, "model.continuing_subword_prefix", "memtune supports only null");
  }
  if (!is_null_or(model, "end_of_word_suffix", "")) {
    refuse(origin, "model.end_of_word_suffix", "memtune supports only null");
  }
  // unk_token, fuse_unk and byte_fallback only act on characters missing from the vocabulary;
  // a byte-level vocabulary (checked below) has every byte, so they never act.
  impl.ignore_merges = get_bool(origin, "model", model, "ignore_merges", false);

  const auto vocab_it = model.find("vocab");
  if (vocab_it == model.end() || !vocab_it->is_object()) {
    refuse(origin, "model.vocab", "expected an object of token -> id");
  }
  int64_t max_id = -1;
  for (const auto& [token, id] : vocab_it->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX / 2) {
      refuse(origin, fmt::format("model.vocab[\"{}\"]", token), "expected a non-negative id");
    }
    max_id = std::max(max_id, id.get<int64_t>());
  }
  if (!added_tokens.is_array()) refuse(origin, "added_tokens", "expected an array");
  for (const json& added : added_tokens) {
    if (!added.is_object() || !added.contains("id") || !added["id"].is_number_integer() ||
        added["id"].get<int64_t>() < 0 || added["id"].get<int64_t>() > INT32_MAX / 2) {
      refuse(origin, "added_tokens", "every added token needs a non-negative integer id");
    }
    max_id = std::max(max_id, added["id"].get<int64_t>());
  }
  impl.resize(int32_t(max_id + 1));

  for (const auto& [token, id_json] : vocab_it->items()) {
    const auto id = id_json.get<int32_t>();
    if (impl.id_exists[size_t(id)]) {
      refuse(origin, fmt::format("model.vocab[\"{}\"]", token),
             fmt::format("id {} is used twice", id));
    }
    impl.id_exists[size_t(id)] = 1;
    impl.token_text[size_t(id)] = token;
    impl.text_to_id.emplace(token, id);
    // A token whose spelling is outside the byte map cannot come out of the byte-level
    // pipeline, but it still decodes: to its UTF-8, like HF's ByteLevel decoder.
    auto bytes = unicode::byte_level_to_bytes(token);
    if (bytes) {
      impl.words.add(*bytes, id);
      impl.token_bytes[size_t(id)] = std::move(*bytes);
    } else {
      impl.token_bytes[size_t(id)] = token;
    }
  }
  for (unsigned b = 0; b < 256; ++b) {
    std::string spelling;
    unicode::append_utf8(spelling, unicode::byte_to_char(uint8_t(b)));
    const auto it = impl.text_to_id.find(spelling);
    if (it == impl.text_to_id.end()) {
      refuse(origin, "model.vocab",
             fmt::format("no token for byte {:#04x} (\"{}\"); not a byte-level BPE vocabulary",
                         b, spelling));
    }
    impl.byte_ids[b] = it->second;
  }
  impl.words.build();

  const auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array()) {
    refuse(origin, "model.merges", "expected an array");
  }
  std::vector<MergeTable::Entry> entries;
  entries.reserve(merges_it->size());
  for (size_t i = 0; i < merges_it->size(); ++i) {
    const auto [left, right] = parse_merge(origin, i, (*merges_it)[i]);
    const auto left_id = impl.text_to_id.find(left);
    const auto right_id = impl.text_to_id.find(right);
    const auto merged_id = impl.text_to_id.find(left + right);
    if (left_id == impl.text_to_id.end() || right_id == impl.text_to_id.end() ||
        merged_id == impl.text_to_id.end()) {
      refuse(origin, fmt::format("model.merges[{}]", i),
             fmt::format("\"{}\" + \"{}\" names a token missing from the vocabulary", left,
                         right));
    }
    entries.push_back(MergeTable::Entry{
        (uint64_t(uint32_t(left_id->second)) << 32) | uint32_t(right_id->second), int32_t(i),
        merged_id->second});
  }
  impl.merges.build(entries);

  for (size_t i = 0; i < added_tokens.size(); ++i) {
    const std::string where = fmt::format("added_tokens[{}]", i);
    const json& added = added_tokens[i];
    check_keys(origin, where, added,
               {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
    if (!added.contains("content") || !added["content"].is_string() ||
        added["content"].get<std::string>().empty()) {
      refuse(origin, where + ".content", "expected a non-empty string");
    }
    for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
      if (get_bool(origin, where, added, flag, false)) {
        refuse(origin, fmt::format("{}.{}", where, flag),
               "true is not supported (no Llama 3 token uses it)");
      }
    }
    const std::string content = added["content"].get<std::string>();
    unicode::check_utf8(content, fmt::format("{}: {}.content", origin, where));
    const bool special = get_bool(origin, where, added, "special", false);
    // tokenizers' AddedToken default: normalized = !special.
    const bool normalized = get_bool(origin, where, added, "normalized", !special);
    add_added_token(impl, content, added["id"].get<int32_t>(), special, normalized);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json) {
  std::error_code error;
  MT_USER_CHECK(std::filesystem::exists(tokenizer_json, error),
                "tokenizer file {} does not exist", tokenizer_json.string());
  return from_json_text(read_file(tokenizer_json), tokenizer_json.string());
}

Tokenizer Tokenizer::from_json_text(std::string_view json_text, std::string_view origin_view) {
  const std::string origin(origin_view);
  json spec;
  try {
    spec = json::parse(json_text);
  } catch (const json::exception& e) {
    mt_fail("{}: not valid JSON: {}", origin, e.what());
  }
  if (!spec.is_object()) refuse(origin, "(top level)", "expected a JSON object");
  check_keys(origin, "(top level)", spec,
             {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
              "post_processor", "decoder", "model"});
  // Truncation and padding change what HF's encode returns; memtune does both itself.
  if (!spec.value("truncation", json()).is_null()) {
    refuse(origin, "truncation", "memtune supports only null");
  }
  if (!spec.value("padding", json()).is_null()) {
    refuse(origin, "padding", "memtune supports only null");
  }
  if (!spec.contains("model")) refuse(origin, "model", "missing");

  auto impl = std::make_shared<Impl>();
  impl->kind = Impl::Kind::kBpe;
  parse_normalizer(origin, spec.value("normalizer", json()));
  parse_model(*impl, origin, spec["model"], spec.value("added_tokens", json::array()));
  parse_pre_tokenizer(*impl, origin, spec.value("pre_tokenizer", json()));
  bool seen_template = false;
  parse_post_processor(*impl, origin, "post_processor", spec.value("post_processor", json()),
                       seen_template);
  parse_decoder(origin, spec.value("decoder", json()));
  impl->resolve_special_ids(origin);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::byte_level() {
  static const std::shared_ptr<const Impl> shared = [] {
    auto impl = std::make_shared<Impl>();
    impl->kind = Impl::Kind::kBytes;
    static constexpr std::array<std::string_view, 6> kSpecials = {
        "<|begin_of_text|>", "<|end_of_text|>",   "<|start_header_id|>",
        "<|end_header_id|>", "<|eot_id|>",        "<|finetune_right_pad_id|>"};
    impl->resize(256 + int32_t(kSpecials.size()));
    for (unsigned b = 0; b < 256; ++b) {
      std::string spelling;
      unicode::append_utf8(spelling, unicode::byte_to_char(uint8_t(b)));
      impl->token_text[b] = spelling;
      impl->token_bytes[b] = std::string(1, char(b));
      impl->id_exists[b] = 1;
      impl->text_to_id.emplace(std::move(spelling), int32_t(b));
    }
    for (size_t i = 0; i < kSpecials.size(); ++i) {
      const auto id = int32_t(256 + i);
      impl->token_text[size_t(id)] = std::string(kSpecials[i]);
      impl->token_bytes[size_t(id)] = std::string(kSpecials[i]);
      impl->id_exists[size_t(id)] = 1;
      impl->id_special[size_t(id)] = 1;
      impl->text_to_id[std::string(kSpecials[i])] = id;
      impl->literal_added.add(kSpecials[i], id);
    }
    impl->template_prefix = {256};
    impl->resolve_special_ids("byte-level tokenizer");
    return std::shared_ptr<const Impl>(std::move(impl));
  }();
  return Tokenizer(shared);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out = impl_->template_prefix;
  impl_->encode_plain_append(text, out);
  out.insert(out.end(), impl_->template_suffix.begin(), impl_->template_suffix.end());
  return out;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> out;
  if (add_bos) out.push_back(impl_->bos);
  impl_->encode_plain_append(text, out);
  return out;
}

std::vector<int32_t> Tokenizer::encode_plain(std::string_view text) const {
  std::vector<int32_t> out;
  impl_->encode_plain_append(text, out);
  return out;
}

void Tokenizer::encode_plain_append(std::string_view text, std::vector<int32_t>& out) const {
  impl_->encode_plain_append(text, out);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens);
}

std::string Tokenizer::decode_lossy(std::span<const int32_t> ids,
                                    bool skip_special_tokens) const {
  return unicode::to_utf8_lossy(impl_->decode(ids, skip_special_tokens));
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->text_to_id.find(token);
  if (it == impl_->text_to_id.end()) return std::nullopt;
  return it->second;
}

std::string_view Tokenizer::id_to_token(int32_t id) const {
  impl_->check_id(id);
  return impl_->token_text[size_t(id)];
}

bool Tokenizer::is_special(int32_t id) const {
  impl_->check_id(id);
  return impl_->id_special[size_t(id)] != 0;
}

int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::eot_id() const { return impl_->eot; }
int32_t Tokenizer::pad_id() const { return impl_->pad; }

bool Tokenizer::adds_bos_by_default() const {
  return !impl_->template_prefix.empty() && impl_->template_prefix[0] == impl_->bos;
}

bool Tokenizer::is_byte_level() const { return impl_->kind == Impl::Kind::kBytes; }

}  // namespace memtune
