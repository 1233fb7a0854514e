// Inside the tokenizer (tokenizer.h): the BPE model that tokenizer.cpp runs and tokenizer_json.cpp
// fills from tokenizer.json -- byte-level (Llama 3, Qwen) or over characters with byte fallback
// (Mistral, SentencePiece-converted) -- with its normalizer and pre-tokenizer. Its hot lookup tables, the added-token matcher, and
// Tokenizer::Impl. Not for use outside data/.
#pragma once

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/data/split_regex.h"
#include "memtune/data/tokenizer.h"
#include "memtune/data/unicode_bytes.h"
#include "memtune/data/unicode_nfc.h"

namespace memtune {
namespace tokenizer_detail {

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

inline uint64_t hash_bytes(const unsigned char* p, size_t n) {
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

inline size_t table_capacity_for(size_t count) {
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

}  // namespace tokenizer_detail

struct Tokenizer::Impl {
  using AddedTokenMatcher = tokenizer_detail::AddedTokenMatcher;
  using MergeTable = tokenizer_detail::MergeTable;
  using WordTable = tokenizer_detail::WordTable;
  using StringIdMap = tokenizer_detail::StringIdMap;

  // kBpe: byte-level BPE (each byte one symbol, spelt in GPT-2's byte map). kCharBpe: BPE over
  // characters, where a character missing from the vocabulary becomes its UTF-8 bytes' <0xNN>
  // tokens (tokenizers models/bpe/model.rs, merge_word with byte_fallback). kBytes: the built-in.
  enum class Kind { kBpe, kCharBpe, kBytes };
  Kind kind = Kind::kBpe;

  // The normalizer's steps, in order (tokenizers normalizers/{unicode,prepend,replace}.rs).
  struct NormalizerStep {
    enum class Op { kNfc, kPrepend, kReplace };
    Op op;
    std::string text;         // kPrepend: what is put first; kReplace: the pattern
    std::string replacement;  // kReplace
  };
  std::vector<NormalizerStep> normalizer;

  // The Metaspace pre-tokenizer (split false): spaces become `metaspace_replacement`, which is
  // also put first per the prepend scheme (tokenizers pre_tokenizers/metaspace.rs).
  enum class Prepend { kAlways, kFirst, kNever };
  bool metaspace = false;
  std::string metaspace_replacement;
  Prepend metaspace_prepend = Prepend::kAlways;

  // kCharBpe: single-character vocabulary tokens, and the <0xNN> token of each byte.
  std::unordered_map<char32_t, int32_t> char_ids;
  std::array<int32_t, 256> fallback_ids{};
  // The decoder's ByteFallback (runs of <0xNN> tokens that are not valid UTF-8 decode lossily
  // to one U+FFFD per token) and Strip (characters removed from the start of the whole text).
  std::vector<uint8_t> id_is_byte_token;
  bool byte_fallback_decode = false;
  size_t strip_leading_spaces = 0;

  // tokenizer_config.json's (or chat_template.jinja's) chat template, when from_file found one.
  std::string chat_template;

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
      split_normalized_added(text, /*at_start=*/true, out);
      return;
    }
    split_on(literal_added, text, out, [&](std::string_view gap, size_t offset) {
      split_normalized_added(gap, offset == 0, out);
    });
  }

  // A piece of text between literal added tokens: normalized on its own, then split on the
  // normalized added tokens (tokenizers AddedVocabulary::extract_and_normalize). `at_start`: the
  // piece begins the original text (Metaspace's "first" prepend scheme asks).
  void split_normalized_added(std::string_view text, bool at_start, std::vector<int32_t>& out) const {
    std::string normalized_text;
    // Qwen's normalizer is NFC alone, which leaves most text as it is: no copy then.
    const bool nfc_only_and_stable = normalizer.size() == 1 &&
                                     normalizer[0].op == NormalizerStep::Op::kNfc &&
                                     unicode::nfc_trivially_stable(text);
    if (!normalizer.empty() && !nfc_only_and_stable) {
      normalized_text = normalize(text);
      text = normalized_text;
    }
    if (normalized_added.empty()) {
      encode_segment(text, at_start, out);
      return;
    }
    split_on(normalized_added, text, out, [&](std::string_view gap, size_t offset) {
      encode_segment(gap, at_start && offset == 0, out);
    });
  }

  std::string normalize(std::string_view text) const {
    std::string s(text);
    for (const NormalizerStep& step : normalizer) {
      switch (step.op) {
        case NormalizerStep::Op::kNfc:
          if (!unicode::nfc_trivially_stable(s)) s = unicode::to_nfc(s);
          break;
        case NormalizerStep::Op::kPrepend:
          if (!s.empty()) s.insert(0, step.text);
          break;
        case NormalizerStep::Op::kReplace:
          s = replace_all(s, step.text, step.replacement);
          break;
      }
    }
    return s;
  }

  static std::string replace_all(std::string_view s, std::string_view pattern,
                                 std::string_view replacement) {
    std::string out;
    size_t pos = 0;
    while (true) {
      const size_t hit = s.find(pattern, pos);
      if (hit == std::string_view::npos) break;
      out.append(s.substr(pos, hit - pos));
      out.append(replacement);
      pos = hit + pattern.size();
    }
    out.append(s.substr(pos));
    return out;
  }

  template <typename Gap>
  static void split_on(const AddedTokenMatcher& matcher, std::string_view text,
                       std::vector<int32_t>& out, Gap&& gap) {
    size_t pos = 0;
    while (pos < text.size()) {
      const auto match = matcher.find(text, pos);
      const size_t gap_end = match ? match->begin : text.size();
      if (gap_end > pos) gap(text.substr(pos, gap_end - pos), pos);
      if (!match) break;
      out.push_back(match->id);
      pos = match->end;
    }
  }

  // Text with no added token in it.
  void encode_segment(std::string_view text, bool at_start, std::vector<int32_t>& out) const {
    const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
    if (kind == Kind::kBytes) {
      for (size_t i = 0; i < text.size(); ++i) out.push_back(int32_t(bytes[i]));
      return;
    }
    if (kind == Kind::kCharBpe) {
      if (!metaspace) {
        encode_chars(text, out);
        return;
      }
      std::string replaced = replace_all(text, " ", metaspace_replacement);
      const bool prepend =
          metaspace_prepend == Prepend::kAlways || (metaspace_prepend == Prepend::kFirst && at_start);
      if (prepend && !std::string_view(replaced).starts_with(metaspace_replacement)) {
        replaced.insert(0, metaspace_replacement);
      }
      encode_chars(replaced, out);
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

  // kCharBpe: one pre-token, each character a symbol (or its bytes' <0xNN> tokens), then merged.
  void encode_chars(std::string_view text, std::vector<int32_t>& out) const {
    if (text.empty()) return;
    thread_local std::vector<int32_t> symbols;
    symbols.clear();
    for (size_t i = 0; i < text.size();) {
      const unicode::Utf8Step step = unicode::decode_utf8_step(text.substr(i));
      MT_ASSERT(step.valid);
      const auto it = char_ids.find(step.code_point);
      if (it != char_ids.end()) {
        symbols.push_back(it->second);
      } else {
        for (size_t b = 0; b < step.length; ++b) {
          symbols.push_back(fallback_ids[static_cast<unsigned char>(text[i + b])]);
        }
      }
      i += step.length;
    }
    merge_symbols(symbols.data(), symbols.size(), out);
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
    int32_t short_symbols[kShortWord];
    if (n <= kShortWord) {
      for (size_t i = 0; i < n; ++i) short_symbols[i] = byte_ids[p[i]];
      merge_short(short_symbols, n, out);
      return;
    }
    std::vector<int32_t> symbols(n);
    for (size_t i = 0; i < n; ++i) symbols[i] = byte_ids[p[i]];
    merge_long(symbols.data(), n, out);
  }

  void merge_symbols(const int32_t* initial, size_t n, std::vector<int32_t>& out) const {
    if (n == 0) return;
    if (n == 1) {
      out.push_back(initial[0]);
      return;
    }
    if (n <= kShortWord) {
      merge_short(initial, n, out);
    } else {
      merge_long(initial, n, out);
    }
  }

  // Both merge loops apply, at each step, the pair with the lowest merge rank, the leftmost
  // among equal ranks: the order of HF's heap of (rank, position) in models/bpe/word.rs
  // (Word::merge_all). Short words (most of them) use a plain array scan, which beats a heap
  // at these sizes; long words use the heap.
  static constexpr size_t kShortWord = 48;

  void merge_short(const int32_t* initial, size_t n, std::vector<int32_t>& out) const {
    int32_t symbols[kShortWord];
    int32_t rank[kShortWord];  // rank[j]: the pair (symbols[j], symbols[j + 1])
    int32_t merged[kShortWord];
    size_t count = n;
    for (size_t i = 0; i < n; ++i) symbols[i] = initial[i];
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

  void merge_long(const int32_t* initial, size_t n, std::vector<int32_t>& out) const {
    struct Symbol {
      int32_t id;  // -1 once merged into its left neighbour
      int32_t prev, next;  // -1 at the ends
    };
    std::vector<Symbol> symbols(n);
    for (size_t i = 0; i < n; ++i) {
      symbols[i] = Symbol{initial[i], int32_t(i) - 1, i + 1 < n ? int32_t(i + 1) : -1};
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
    strip_start(out);
    return out;
  }

  // HF's decode: the ByteLevel decoder's String::from_utf8_lossy, or for ByteFallback one U+FFFD
  // per <0xNN> token of a run that is not valid UTF-8 (tokenizers decoders/byte_fallback.rs).
  std::string decode_lossy(std::span<const int32_t> ids, bool skip_special_tokens) const {
    if (!byte_fallback_decode) return unicode::to_utf8_lossy(decode(ids, skip_special_tokens));
    std::string out, run;
    size_t run_tokens = 0;
    auto flush = [&] {
      if (run_tokens == 0) return;
      if (unicode::find_invalid_utf8(run)) {
        for (size_t i = 0; i < run_tokens; ++i) out += "\xEF\xBF\xBD";
      } else {
        out += run;
      }
      run.clear();
      run_tokens = 0;
    };
    for (const int32_t id : ids) {
      check_id(id);
      if (skip_special_tokens && id_special[size_t(id)]) continue;
      if (id_is_byte_token[size_t(id)]) {
        run += token_bytes[size_t(id)];
        ++run_tokens;
        continue;
      }
      flush();
      out += unicode::to_utf8_lossy(token_bytes[size_t(id)]);
    }
    flush();
    strip_start(out);
    return out;
  }

  void strip_start(std::string& text) const {
    size_t n = 0;
    while (n < strip_leading_spaces && n < text.size() && text[n] == ' ') ++n;
    text.erase(0, n);
  }

  // Sizes the per-id tables for ids [0, size).
  void resize(int32_t size) {
    vocab_size = size;
    token_text.resize(size_t(size));
    token_bytes.resize(size_t(size));
    id_exists.resize(size_t(size), 0);
    id_special.resize(size_t(size), 0);
    id_is_byte_token.resize(size_t(size), 0);
  }

  // Resolves bos/eos/eot/pad from the tokens by name: Llama 3's names, else Qwen's, else
  // Mistral's (SentencePiece) names.
  void resolve_special_ids(const std::string& origin) {
    auto find = [&](std::string_view name) -> int32_t {
      const auto it = text_to_id.find(name);
      return it == text_to_id.end() ? -1 : it->second;
    };
    auto first_of = [&](std::initializer_list<std::string_view> names) -> int32_t {
      for (const std::string_view name : names) {
        if (const int32_t id = find(name); id >= 0) return id;
      }
      return -1;
    };
    // BOS: what the post-processor puts first; Qwen has none (-1).
    bos = find("<|begin_of_text|>");
    if (bos < 0 && template_prefix.size() == 1) bos = template_prefix[0];
    eos = first_of({"<|end_of_text|>", "<|endoftext|>", "</s>"});
    MT_USER_CHECK(eos >= 0,
                  "{}: the tokenizer has none of <|end_of_text|> (Llama 3), <|endoftext|> (Qwen) and "
                  "</s> (Mistral); memtune needs one of them as the end of a document",
                  origin);
    eot = first_of({"<|eot_id|>", "<|im_end|>"});
    if (eot < 0) eot = eos;
    // Llama 3.1 named the reserved slot 128004 <|finetune_right_pad_id|>; Llama 3.0 files
    // (including shared/data's, despite its package name) still call it
    // <|reserved_special_token_2|>. Either way the same id pads, so the two agree.
    pad = first_of({"<|finetune_right_pad_id|>", "<|reserved_special_token_2|>"});
    if (pad < 0) pad = eos;
  }
};

}  // namespace memtune
