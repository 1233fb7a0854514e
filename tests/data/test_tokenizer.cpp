#include "memtune/data/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <atomic>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/data/unicode_bytes.h"
#include "memtune/io/file_util.h"
#include "../support/expect_error.h"
#include "../support/tokenizer_data.h"

using namespace memtune;
using namespace memtune::test;  // tests/support: error_of, the tokenizer data
using nlohmann::json;
namespace fs = std::filesystem;

namespace {


// Compares every row's ids and prints each mismatch with its text, so a failure says which
// string broke and how.
// --------------------------------------------------------------------------------------------
// The real Llama 3 tokenizer against HF tokenizers.

TEST(Llama3Tokenizer, CorpusMatchesHfIdsExactly) {
  expect_ids_match_fixture(llama3_tokenizer(), tokenizer_fixture_dir() / "corpus.jsonl");
}

TEST(Llama3Tokenizer, CorpusIsLargeAndVaried) {
  const auto rows = read_jsonl(tokenizer_fixture_dir() / "corpus.jsonl");
  EXPECT_GE(rows.size(), 200u);
}

TEST(Llama3Tokenizer, DecodeRoundTripsAndMatchesHfDecode) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  for (const json& row : read_jsonl(tokenizer_fixture_dir() / "corpus.jsonl")) {
    const std::string text = row["text"];
    EXPECT_EQ(tokenizer.decode(tokenizer.encode_plain(text)), text) << json(text).dump();
    const auto ids = ids_of(row);
    EXPECT_EQ(tokenizer.decode(ids), "<|begin_of_text|>" + text);
    EXPECT_EQ(tokenizer.decode_lossy(ids), row["decoded"].get<std::string>());
  }
}

TEST(Llama3Tokenizer, BosFollowsThePostProcessor) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  EXPECT_TRUE(tokenizer.adds_bos_by_default());
  const std::string text = "Hello world";
  const auto plain = tokenizer.encode_plain(text);
  ASSERT_FALSE(plain.empty());
  EXPECT_NE(plain[0], 128000);
  auto with_bos = plain;
  with_bos.insert(with_bos.begin(), 128000);
  EXPECT_EQ(tokenizer.encode(text), with_bos);
  EXPECT_EQ(tokenizer.encode(text, true), with_bos);
  EXPECT_EQ(tokenizer.encode(text, false), plain);
  std::vector<int32_t> appended = {7};
  tokenizer.encode_plain_append(text, appended);
  EXPECT_EQ(appended.size(), plain.size() + 1);
  EXPECT_TRUE(std::equal(plain.begin(), plain.end(), appended.begin() + 1));
  EXPECT_EQ(tokenizer.encode(""), std::vector<int32_t>{128000});
  EXPECT_TRUE(tokenizer.encode_plain("").empty());
}

TEST(Llama3Tokenizer, SpecialTokenIds) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  // SPECS.md section 6.
  EXPECT_EQ(tokenizer.vocab_size(), 128256);
  EXPECT_EQ(tokenizer.bos_id(), 128000);
  EXPECT_EQ(tokenizer.eos_id(), 128001);
  EXPECT_EQ(tokenizer.eot_id(), 128009);
  EXPECT_EQ(tokenizer.pad_id(), 128004);
  EXPECT_EQ(tokenizer.token_to_id("<|start_header_id|>"), 128006);
  EXPECT_EQ(tokenizer.token_to_id("<|end_header_id|>"), 128007);
  // shared/data's file uses Llama 3.0's names for the slots that 3.1 (and SPECS.md) calls
  // <|finetune_right_pad_id|> (128004) and <|eom_id|> (128008).
  EXPECT_EQ(tokenizer.token_to_id("<|reserved_special_token_2|>"), 128004);
  EXPECT_EQ(tokenizer.token_to_id("<|reserved_special_token_4|>"), 128008);
  EXPECT_EQ(tokenizer.id_to_token(128009), "<|eot_id|>");
  EXPECT_EQ(tokenizer.id_to_token(128255), "<|reserved_special_token_250|>");
  EXPECT_TRUE(tokenizer.is_special(128009));
  EXPECT_FALSE(tokenizer.is_special(0));
  EXPECT_FALSE(tokenizer.is_byte_level());
}

TEST(Llama3Tokenizer, VocabularyLookups) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  // Token spellings are the byte-level ones of tokenizer.json: ' ' is 'Ġ'.
  const auto hello = tokenizer.token_to_id("\xC4\xA0hello");  // "Ġhello"
  ASSERT_TRUE(hello.has_value());
  EXPECT_EQ(tokenizer.id_to_token(*hello), "\xC4\xA0hello");
  EXPECT_EQ(tokenizer.encode_plain(" hello"), std::vector<int32_t>{*hello});
  EXPECT_EQ(tokenizer.token_to_id("!"), 0);
  EXPECT_FALSE(tokenizer.token_to_id("definitely not a token").has_value());
  EXPECT_CONTAINS(error_of([&] { (void)tokenizer.id_to_token(128256); }), "128256");
  EXPECT_CONTAINS(error_of([&] { (void)tokenizer.id_to_token(-1); }), "-1");
}

TEST(Llama3Tokenizer, SpecialTokensInTextAreWholeTokens) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  const auto ids = tokenizer.encode_plain("Hi<|eot_id|><|start_header_id|>user");
  const auto hi = tokenizer.encode_plain("Hi");
  const auto user = tokenizer.encode_plain("user");
  std::vector<int32_t> expected = hi;
  expected.push_back(128009);
  expected.push_back(128006);
  expected.insert(expected.end(), user.begin(), user.end());
  EXPECT_EQ(ids, expected);
  // Near misses are ordinary text.
  for (const char* text : {"<|eot_id|", "<|EOT_ID|>", "<eot_id>"}) {
    for (const int32_t id : tokenizer.encode_plain(text)) EXPECT_LT(id, 128000) << text;
  }
  // skip_special_tokens drops them on decode.
  EXPECT_EQ(tokenizer.decode(ids, true), "Hiuser");
  EXPECT_EQ(tokenizer.decode(ids, false), "Hi<|eot_id|><|start_header_id|>user");
}

TEST(Llama3Tokenizer, InvalidUtf8IsAnErrorWithTheOffset) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  struct Case {
    std::string text;
    size_t offset;
  };
  const std::vector<Case> cases = {
      {std::string("abc\xFF"), 3},                // never valid
      {std::string("abc\xC3"), 3},                // truncated 2-byte sequence
      {std::string("ab\xC3(xyz"), 2},             // bad continuation
      {std::string("\xC0\xAF"), 0},               // overlong '/'
      {std::string("x\xE0\x80\xAF"), 1},          // overlong 3-byte
      {std::string("hi \xED\xA0\x80"), 3},        // UTF-16 surrogate
      {std::string("\xF4\x90\x80\x80"), 0},       // above U+10FFFF
      {std::string("ok\xE2\x82"), 2},             // truncated 3-byte sequence at the end
      {std::string("<|eot_id|>\x80"), 10},        // after a special token
      {std::string(100, 'a') + "\xF8", 100},      // past the 8-byte ASCII fast path
  };
  for (const Case& c : cases) {
    const std::string message = error_of([&] { (void)tokenizer.encode(c.text); });
    EXPECT_CONTAINS(message, "offset " + std::to_string(c.offset));
    EXPECT_CONTAINS(message, "UTF-8");
  }
}

TEST(Llama3Tokenizer, DecodeKeepsBytesAndLossyMatchesHf) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  // The four single-byte tokens of an emoji, looked up by their byte-level spellings: decode
  // gives the bytes even when they stop mid-character.
  std::vector<int32_t> ids;
  for (const unsigned char b : std::string("\xF0\x9F\x98\x80")) {
    std::string spelling;
    unicode::append_utf8(spelling, unicode::byte_to_char(b));
    ids.push_back(*tokenizer.token_to_id(spelling));
  }
  EXPECT_EQ(tokenizer.decode(ids), "\xF0\x9F\x98\x80");
  const std::vector<int32_t> first_three(ids.begin(), ids.begin() + 3);
  EXPECT_EQ(tokenizer.decode(first_three), "\xF0\x9F\x98");
  EXPECT_EQ(tokenizer.decode_lossy(first_three), "\xEF\xBF\xBD");  // one U+FFFD
  const std::vector<int32_t> bad_id = {5, 999999};
  EXPECT_CONTAINS(error_of([&] { (void)tokenizer.decode(bad_id); }), "999999");
}

TEST(Llama3Tokenizer, LongRunsMatchRoundTrip) {
  // Long single-class runs exercise the PCRE2 JIT stack fallback and the heap BPE path.
  const Tokenizer& tokenizer = llama3_tokenizer();
  for (const std::string& text :
       {std::string(100000, ' '), std::string(50000, '\n'), std::string(20000, 'q'),
        std::string(30000, '!') + "x", std::string(4000, 'a') + std::string(4000, ' ') + "b"}) {
    EXPECT_EQ(tokenizer.decode(tokenizer.encode_plain(text)), text);
  }
}

TEST(Llama3Tokenizer, RandomUtf8RoundTrips) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  std::mt19937 rng(7);
  for (int round = 0; round < 300; ++round) {
    std::string text;
    const int n = int(rng() % 60);
    for (int i = 0; i < n; ++i) {
      char32_t c;
      do {
        c = char32_t(rng() % 0x110000);
      } while (c >= 0xD800 && c <= 0xDFFF);
      if (rng() % 2) c = char32_t(rng() % 128);
      unicode::append_utf8(text, c);
    }
    EXPECT_EQ(tokenizer.decode(tokenizer.encode_plain(text)), text);
  }
}

TEST(Llama3Tokenizer, IgnoreMergesOffMatchesHf) {
  // The same vocabulary with ignore_merges false: every word goes through the merges.
  json spec = json::parse(read_file(llama3_tokenizer_dir() / "tokenizer.json"));
  spec["model"]["ignore_merges"] = false;
  const Tokenizer tokenizer = Tokenizer::from_json_text(spec.dump(), "ignore_merges off");
  expect_ids_match_fixture(tokenizer, tokenizer_fixture_dir() / "ignore_merges_off.jsonl");
}

TEST(Llama3Tokenizer, CopiesShareAndWorkAcrossThreads) {
  const Tokenizer copy = llama3_tokenizer();
  const auto expected = copy.encode("The same text on every thread, 12345 \xF0\x9F\x98\x80.");
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        if (copy.encode("The same text on every thread, 12345 \xF0\x9F\x98\x80.") != expected) {
          ++failures;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

// --------------------------------------------------------------------------------------------
// The small synthetic tokenizer: ["a","b"] merges, ignore_merges false, GPT-2's ByteLevel
// regex, a non-special added token.

fs::path tiny_path() { return tokenizer_fixture_dir() / "tiny_tokenizer.json"; }

json tiny_spec() { return json::parse(read_file(tiny_path())); }

TEST(TinyTokenizer, MatchesHf) {
  expect_ids_match_fixture(Tokenizer::from_file(tiny_path()),
                         tokenizer_fixture_dir() / "tiny_corpus.jsonl");
}

TEST(TinyTokenizer, StringMergesEqualPairMerges) {
  json spec = tiny_spec();
  ASSERT_TRUE(spec["model"]["merges"][0].is_array());
  for (json& merge : spec["model"]["merges"]) {
    merge = merge[0].get<std::string>() + " " + merge[1].get<std::string>();
  }
  expect_ids_match_fixture(Tokenizer::from_json_text(spec.dump(), "tiny, string merges"),
                         tokenizer_fixture_dir() / "tiny_corpus.jsonl");
}

TEST(TinyTokenizer, NonSpecialAddedToken) {
  const Tokenizer tokenizer = Tokenizer::from_file(tiny_path());
  const int32_t word = *tokenizer.token_to_id("[word]");
  EXPECT_FALSE(tokenizer.is_special(word));
  const auto ids = tokenizer.encode_plain("a[word]<|eot_id|>");
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1], word);
  // skip_special_tokens keeps non-special added tokens, as HF does.
  EXPECT_EQ(tokenizer.decode(ids, true), "a[word]");
}

// --------------------------------------------------------------------------------------------
// Refusals.

std::string load_error(const json& spec) {
  return error_of([&] { (void)Tokenizer::from_json_text(spec.dump(), "test.json"); });
}

TEST(TokenizerJson, UnsupportedStructuresAreRefused) {
  struct Case {
    std::function<void(json&)> change;
    std::string expected;  // a part of the message
  };
  const std::vector<Case> cases = {
      {[](json& s) { s["normalizer"] = {{"type", "NFKC"}}; }, "normalizer.type"},
      {[](json& s) { s["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", "a+"}}},
                                        {"content", "b"}}; },
       "normalizer.pattern"},
      // Without ByteLevel the vocabulary is read as a character BPE, which needs byte fallback.
      {[](json& s) { s["pre_tokenizer"] = {{"type", "Metaspace"}}; }, "model.byte_fallback"},
      {[](json& s) { s["pre_tokenizer"] = nullptr; }, "pre_tokenizer"},
      {[](json& s) { s["pre_tokenizer"]["add_prefix_space"] = true; }, "add_prefix_space"},
      {[](json& s) {
         s["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers",
                                {{{"type", "Split"},
                                  {"pattern", {{"Regex", "\\w+|\\s+"}}},
                                  {"behavior", "Isolated"},
                                  {"invert", false}},
                                 {{"type", "ByteLevel"},
                                  {"add_prefix_space", false},
                                  {"use_regex", false}}}}};
       },
       "\\w"},
      {[](json& s) {
         s["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers",
                                {{{"type", "Split"},
                                  {"pattern", {{"Regex", "\\s+"}}},
                                  {"behavior", "Removed"},
                                  {"invert", false}},
                                 {{"type", "ByteLevel"},
                                  {"add_prefix_space", false},
                                  {"use_regex", false}}}}};
       },
       "behavior"},
      {[](json& s) {
         s["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers",
                                {{{"type", "Split"},
                                  {"pattern", {{"String", " "}}},
                                  {"behavior", "Isolated"},
                                  {"invert", false}},
                                 {{"type", "ByteLevel"},
                                  {"add_prefix_space", false},
                                  {"use_regex", false}}}}};
       },
       "pattern"},
      {[](json& s) { s["model"]["type"] = "WordPiece"; }, "model.type"},
      {[](json& s) { s["model"]["dropout"] = 0.1; }, "dropout"},
      {[](json& s) { s["model"]["continuing_subword_prefix"] = "##"; }, "continuing_subword"},
      {[](json& s) { s["model"]["new_option"] = 1; }, "model.new_option"},
      {[](json& s) { s["model"]["merges"][0] = "h e l"; }, "model.merges[0]"},
      {[](json& s) { s["model"]["merges"][1] = json::array({"l", "qq"}); }, "model.merges[1]"},
      {[](json& s) { s["model"]["vocab"].erase("\xC4\xA0"); }, "byte 0x20"},
      {[](json& s) { s["truncation"] = {{"max_length", 8}}; }, "truncation"},
      {[](json& s) { s["padding"] = {{"strategy", "BatchLongest"}}; }, "padding"},
      {[](json& s) { s["something_new"] = true; }, "something_new"},
      {[](json& s) { s["added_tokens"][0]["lstrip"] = true; }, "added_tokens[0].lstrip"},
      {[](json& s) { s["added_tokens"][1]["single_word"] = true; }, "single_word"},
      {[](json& s) { s["decoder"] = {{"type", "WordPiece"}}; }, "decoder"},
      {[](json& s) { s["decoder"] = nullptr; }, "decoder"},
      {[](json& s) { s["post_processor"] = {{"type", "BertProcessing"}}; }, "post_processor"},
      {[](json& s) {
         for (json& t : s["added_tokens"]) {
           if (t["content"] == "<|end_of_text|>") t["content"] = "<|eos|>";
         }
       },
       "<|end_of_text|>"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    json spec = tiny_spec();
    cases[i].change(spec);
    const std::string message = load_error(spec);
    SCOPED_TRACE("case " + std::to_string(i));
    EXPECT_CONTAINS(message, cases[i].expected);
    EXPECT_CONTAINS(message, "test.json");
  }
}

TEST(TokenizerJson, SupportedVariantsLoad) {
  // Llama 3's shape: Split(regex) then ByteLevel(use_regex false), with a template.
  json spec = tiny_spec();
  spec["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern",
          {{"Regex",
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
            "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
         {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  spec["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
        {{"SpecialToken", {{"id", "<|end_of_text|>"}, {"type_id", 0}}}}}},
      {"pair", json::array()},
      {"special_tokens",
       {{"<|begin_of_text|>", {{"id", "<|begin_of_text|>"}, {"ids", {278}}, {"tokens", {"x"}}}},
        {"<|end_of_text|>", {{"id", "<|end_of_text|>"}, {"ids", {279}}, {"tokens", {"y"}}}}}}};
  spec["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array()}};
  const Tokenizer tokenizer = Tokenizer::from_json_text(spec.dump(), "variant");
  const auto ids = tokenizer.encode("hello");
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 278);
  EXPECT_EQ(ids[1], 259);  // "hello" via merges
  EXPECT_EQ(ids.back(), 279);
  EXPECT_TRUE(tokenizer.adds_bos_by_default());
  // No post-processor: nothing added by default.
  spec["post_processor"] = nullptr;
  const Tokenizer bare = Tokenizer::from_json_text(spec.dump(), "variant");
  EXPECT_FALSE(bare.adds_bos_by_default());
  EXPECT_EQ(bare.encode("hello"), std::vector<int32_t>{259});
  EXPECT_EQ(bare.encode("hello", true), (std::vector<int32_t>{278, 259}));
}

TEST(TokenizerJson, MissingFileAndBadJson) {
  const fs::path missing = fs::temp_directory_path() / "memtune_no_such_dir" / "tokenizer.json";
  const std::string message = error_of([&] { (void)Tokenizer::from_file(missing); });
  EXPECT_CONTAINS(message, missing.string());
  EXPECT_CONTAINS(message, "does not exist");
  EXPECT_CONTAINS(error_of([] { (void)Tokenizer::from_json_text("{\"model\": ", "broken.json"); }),
                  "broken.json: not valid JSON");
  EXPECT_CONTAINS(error_of([] { (void)Tokenizer::from_json_text("[1, 2]", "array.json"); }),
                  "array.json");
}

// --------------------------------------------------------------------------------------------
// The built-in byte-level tokenizer.

TEST(ByteLevelTokenizer, IdsAndSpecials) {
  const Tokenizer tokenizer = Tokenizer::byte_level();
  EXPECT_TRUE(tokenizer.is_byte_level());
  EXPECT_EQ(tokenizer.vocab_size(), 262);
  EXPECT_EQ(tokenizer.bos_id(), 256);
  EXPECT_EQ(tokenizer.eos_id(), 257);
  EXPECT_EQ(tokenizer.token_to_id("<|start_header_id|>"), 258);
  EXPECT_EQ(tokenizer.token_to_id("<|end_header_id|>"), 259);
  EXPECT_EQ(tokenizer.eot_id(), 260);
  EXPECT_EQ(tokenizer.pad_id(), 261);
  EXPECT_TRUE(tokenizer.adds_bos_by_default());
  EXPECT_TRUE(tokenizer.is_special(260));
  EXPECT_FALSE(tokenizer.is_special(65));
  EXPECT_EQ(tokenizer.id_to_token(65), "A");
  EXPECT_EQ(tokenizer.id_to_token(32), "\xC4\xA0");  // byte-level spelling of ' '
  EXPECT_EQ(tokenizer.encode("hi"), (std::vector<int32_t>{256, 'h', 'i'}));
  EXPECT_EQ(tokenizer.encode("hi", false), (std::vector<int32_t>{'h', 'i'}));
  EXPECT_EQ(tokenizer.encode_plain("a<|eot_id|>\xC3\xA9<|eot_id"),
            (std::vector<int32_t>{'a', 260, 0xC3, 0xA9, '<', '|', 'e', 'o', 't', '_', 'i', 'd'}));
  EXPECT_EQ(tokenizer.encode_plain("<|begin_of_text|><|finetune_right_pad_id|>"),
            (std::vector<int32_t>{256, 261}));
}

TEST(ByteLevelTokenizer, DecodeRoundTripsAnyBytes) {
  const Tokenizer tokenizer = Tokenizer::byte_level();
  std::vector<int32_t> all_bytes;
  std::string expected;
  for (int b = 255; b >= 0; --b) {
    all_bytes.push_back(b);
    expected.push_back(char(b));
  }
  EXPECT_EQ(tokenizer.decode(all_bytes), expected);
  const std::string text = "h\xC3\xA9llo <|eot_id|> \xF0\x9F\x98\x80\n";
  EXPECT_EQ(tokenizer.decode(tokenizer.encode_plain(text)), text);
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(text), true), "h\xC3\xA9llo  \xF0\x9F\x98\x80\n");
  EXPECT_CONTAINS(error_of([&] { (void)tokenizer.decode(std::vector<int32_t>{262}); }), "262");
  EXPECT_CONTAINS(error_of([&] { (void)tokenizer.encode("\xFF"); }), "offset 0");
}

// --------------------------------------------------------------------------------------------
// UTF-8 helpers.

TEST(UnicodeBytes, ByteMapIsGpt2s) {
  EXPECT_EQ(unicode::byte_to_char(' '), U'\u0120');
  EXPECT_EQ(unicode::byte_to_char('\n'), U'\u010A');
  EXPECT_EQ(unicode::byte_to_char('A'), U'A');
  EXPECT_EQ(unicode::byte_to_char(0xAD), U'\u0143');
  EXPECT_EQ(unicode::byte_to_char(0x00), U'\u0100');
  for (int b = 0; b < 256; ++b) EXPECT_EQ(unicode::char_to_byte(unicode::byte_to_char(b)), b);
  EXPECT_FALSE(unicode::char_to_byte(U' ').has_value());
  EXPECT_FALSE(unicode::char_to_byte(U'\u0144').has_value());
  EXPECT_EQ(unicode::byte_level_to_bytes("\xC4\xA0hi"), " hi");
  EXPECT_FALSE(unicode::byte_level_to_bytes("a b").has_value());
}

TEST(UnicodeBytes, LossyReplacesMaximalSubparts) {
  // Unicode 15 section 3.9, Table 3-8's example: 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64
  // becomes a FFFD FFFD FFFD b FFFD c FFFD FFFD d.
  const std::string in = "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64";
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(unicode::to_utf8_lossy(in), "a" + r + r + r + "b" + r + "c" + r + r + "d");
}

}  // namespace
