// The Qwen3 (and so Qwen2.5) and Mistral 7B v0.3 tokenizers against HF tokenizers: the fixtures
// of tools/make_tokenizer_golden.py (tests/fixtures/tokenizer/{qwen3,mistral}, README there).
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memtune/data/tokenizer.h"
#include "memtune/data/unicode_nfc.h"
#include "memtune/io/file_util.h"
#include "../support/expect_error.h"
#include "../support/tokenizer_data.h"

using namespace memtune;
using namespace memtune::test;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {


void expect_decode_matches(const Tokenizer& tokenizer, const fs::path& fixture) {
  for (const json& row : read_jsonl(fixture)) {
    EXPECT_EQ(tokenizer.decode_lossy(ids_of(row)), row["decoded"].get<std::string>())
        << json(row["text"]).dump();
  }
}

bool has_any(const std::string& text, std::initializer_list<std::string_view> parts) {
  for (const auto part : parts) {
    if (text.find(part) != std::string::npos) return true;
  }
  return false;
}

fs::path qwen3_dir() { return tokenizer_fixture_dir() / "qwen3"; }
fs::path mistral_dir() { return tokenizer_fixture_dir() / "mistral"; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Qwen3 / Qwen2.5: byte-level BPE with an NFC normalizer and Qwen's split regex.

TEST(QwenTokenizer, CorpusMatchesHfIdsExactly) {
  expect_ids_match_fixture(family_tokenizer("qwen3"), qwen3_dir() / "corpus.jsonl", 250);
}

TEST(QwenTokenizer, CorpusHoldsTextThatNfcChanges) {
  size_t changed = 0;
  for (const json& row : read_jsonl(qwen3_dir() / "corpus.jsonl")) changed += row["text"] != row["nfc"];
  EXPECT_GE(changed, 30u);
}

TEST(QwenTokenizer, DecodeIsTheNormalizedTextAndMatchesHf) {
  const Tokenizer& tokenizer = family_tokenizer("qwen3");
  expect_decode_matches(tokenizer, qwen3_dir() / "corpus.jsonl");
  for (const json& row : read_jsonl(qwen3_dir() / "corpus.jsonl")) {
    // Byte-level decode gives back the text as the normalizer left it: NFC.
    EXPECT_EQ(tokenizer.decode(tokenizer.encode_plain(row["text"].get<std::string>())),
              row["nfc"].get<std::string>())
        << json(row["text"]).dump();
  }
}

TEST(QwenTokenizer, NfcMakesComposedAndDecomposedTextOneTokenization) {
  const Tokenizer& tokenizer = family_tokenizer("qwen3");
  EXPECT_EQ(tokenizer.encode_plain("cafe\xCC\x81"), tokenizer.encode_plain("caf\xC3\xA9"));
  EXPECT_EQ(tokenizer.encode_plain("\xE1\x84\x80\xE1\x85\xA1"), tokenizer.encode_plain("\xEA\xB0\x80"));
}

TEST(QwenTokenizer, SpecialTokenIds) {
  const Tokenizer& tokenizer = family_tokenizer("qwen3");
  EXPECT_EQ(tokenizer.vocab_size(), 151669);
  EXPECT_FALSE(tokenizer.has_bos());
  EXPECT_FALSE(tokenizer.adds_bos_by_default());
  EXPECT_EQ(tokenizer.eos_id(), 151643);  // <|endoftext|>
  EXPECT_EQ(tokenizer.eot_id(), 151645);  // <|im_end|>
  EXPECT_EQ(tokenizer.pad_id(), 151643);
  EXPECT_EQ(tokenizer.encode("Hi"), tokenizer.encode_plain("Hi"));
  EXPECT_CONTAINS(error_of([&] { (void)tokenizer.encode("Hi", /*add_bos=*/true); }), "no BOS");
  EXPECT_TRUE(tokenizer.is_special(151644));
  EXPECT_FALSE(tokenizer.is_special(*tokenizer.token_to_id("<think>")));
  EXPECT_NE(tokenizer.chat_template().find("<|im_start|>"), std::string_view::npos);
}

// ---------------------------------------------------------------------------------------------
// Mistral 7B v0.3: BPE over characters with byte fallback, Prepend + Replace normalizer.

TEST(MistralTokenizer, CorpusMatchesHfIdsExactly) {
  expect_ids_match_fixture(family_tokenizer("mistral"), mistral_dir() / "corpus.jsonl", 250);
}

TEST(MistralTokenizer, DecodeMatchesHfAndRoundTrips) {
  const Tokenizer& tokenizer = family_tokenizer("mistral");
  expect_decode_matches(tokenizer, mistral_dir() / "corpus.jsonl");
  size_t checked = 0;
  for (const json& row : read_jsonl(mistral_dir() / "corpus.jsonl")) {
    const std::string text = row["text"];
    // An added token in the text starts a new normalized piece, which gets its own "▁"; and a
    // "▁" in the text decodes as a space. Other text comes back byte for byte.
    if (has_any(text, {"<s>", "</s>", "<unk>", "[INST]", "[/INST]", "\xE2\x96\x81", "[TOOL",
                       "[AVAILABLE", "[IMG", "[PREFIX]", "[SUFFIX]", "[MIDDLE]", "[control_"})) {
      continue;
    }
    EXPECT_EQ(tokenizer.decode(tokenizer.encode_plain(text)), text) << json(text).dump();
    ++checked;
  }
  EXPECT_GE(checked, 250u);
}

TEST(MistralTokenizer, ByteFallbackForCharactersOutsideTheVocabulary) {
  const Tokenizer& tokenizer = family_tokenizer("mistral");
  // U+10348 GOTHIC LETTER HWAIR is not in the vocabulary: its four UTF-8 bytes' <0xNN> tokens.
  const auto ids = tokenizer.encode_plain("\xF0\x90\x8D\x88");
  ASSERT_GE(ids.size(), 4u);
  const std::vector<int32_t> tail(ids.end() - 4, ids.end());
  EXPECT_EQ(tokenizer.id_to_token(tail[0]), "<0xF0>");
  EXPECT_EQ(tokenizer.id_to_token(tail[3]), "<0x88>");
  EXPECT_EQ(tokenizer.token_bytes(tail[0]), "\xF0");
  // A run of byte tokens that is not valid UTF-8 decodes lossily to one U+FFFD per token.
  const std::vector<int32_t> broken = {tail[0], tail[1]};
  EXPECT_EQ(tokenizer.decode(broken), "\xF0\x90");
  EXPECT_EQ(tokenizer.decode_lossy(broken), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(MistralTokenizer, SpecialTokenIds) {
  const Tokenizer& tokenizer = family_tokenizer("mistral");
  EXPECT_EQ(tokenizer.vocab_size(), 32768);
  EXPECT_EQ(tokenizer.bos_id(), 1);
  EXPECT_TRUE(tokenizer.adds_bos_by_default());
  EXPECT_EQ(tokenizer.eos_id(), 2);
  EXPECT_EQ(tokenizer.eot_id(), 2);
  EXPECT_EQ(tokenizer.pad_id(), 2);
  EXPECT_EQ(*tokenizer.token_to_id("[INST]"), 3);
  EXPECT_EQ(*tokenizer.token_to_id("[/INST]"), 4);
  // The leading "▁" that the normalizer adds decodes to a space, which the Strip decoder drops.
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("Hello world")), "<s> Hello world");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("Hello world"), /*skip_special_tokens=*/true),
            "Hello world");
}

TEST(MistralTokenizer, MetaspacePreTokenizerMatchesHf) {
  // The same model as transformers' non-legacy conversion writes it: no normalizer and a
  // Metaspace pre-tokenizer, with each prepend scheme.
  json spec = json::parse(read_file(family_tokenizer_dir("mistral", "mistral") / "tokenizer.json"));
  for (const std::string scheme : {"first", "always", "never"}) {
    SCOPED_TRACE(scheme);
    spec["normalizer"] = nullptr;
    spec["pre_tokenizer"] = {{"type", "Metaspace"},
                             {"replacement", "\xE2\x96\x81"},
                             {"prepend_scheme", scheme},
                             {"split", false}};
    const Tokenizer tokenizer = Tokenizer::from_json_text(spec.dump(), "mistral, metaspace");
    const fs::path fixture = mistral_dir() / ("corpus_metaspace_" + scheme + ".jsonl");
    expect_ids_match_fixture(tokenizer, fixture, 250);
    expect_decode_matches(tokenizer, fixture);
  }
}

TEST(MistralTokenizer, UnsupportedPartsAreRefusedWithTheirPath) {
  const json base = json::parse(read_file(family_tokenizer_dir("mistral", "mistral") / "tokenizer.json"));
  struct Case {
    std::function<void(json&)> change;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](json& s) { s["model"]["byte_fallback"] = false; }, "model.byte_fallback"},
      {[](json& s) { s["model"]["vocab"].erase("<0x41>"); }, "<0x41>"},
      {[](json& s) { s["normalizer"]["normalizers"][1]["pattern"] = {{"Regex", " +"}}; },
       "normalizer.normalizers[1].pattern"},
      {[](json& s) { s["normalizer"]["normalizers"][0]["type"] = "Lowercase"; },
       "normalizer.normalizers[0].type"},
      {[](json& s) { s["pre_tokenizer"] = {{"type", "Whitespace"}}; }, "pre_tokenizer.type"},
      {[](json& s) {
         s["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}, {"split", true}};
       },
       "pre_tokenizer.split"},
      {[](json& s) { s["decoder"]["decoders"][3]["stop"] = 1; }, "decoder.decoders[3]"},
      {[](json& s) { s["decoder"]["decoders"].erase(1); }, "decoder.decoders"},
      {[](json& s) { s["decoder"] = {{"type", "ByteLevel"}}; }, "decoder"},
      {[](json& s) { s["model"]["ignore_merges"] = true; }, "model.ignore_merges"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    json spec = base;
    cases[i].change(spec);
    const std::string message =
        error_of([&] { (void)Tokenizer::from_json_text(spec.dump(), "mistral.json"); });
    EXPECT_CONTAINS(message, cases[i].expected);
    EXPECT_CONTAINS(message, "mistral.json");
  }
}

// ---------------------------------------------------------------------------------------------
// NFC itself, against Python's unicodedata.

TEST(TokenizerUnicodeNfc, MatchesPythonOnTheCorpus) {
  for (const json& row : read_jsonl(qwen3_dir() / "corpus.jsonl")) {
    EXPECT_EQ(unicode::to_nfc(row["text"].get<std::string>()), row["nfc"].get<std::string>())
        << json(row["text"]).dump();
  }
}

// Every character with a canonical decomposition, alone and decomposed, and 3000 seeded random
// runs of starters, marks and jamo (tools/make_unicode_nfc.py).
TEST(TokenizerUnicodeNfc, MatchesPythonOnEveryDecomposableCharacterAndRandomMarks) {
  const auto rows = read_jsonl(tokenizer_fixture_dir() / "nfc_cases.jsonl");
  ASSERT_GE(rows.size(), 6000u);
  size_t mismatches = 0;
  for (const json& row : rows) {
    const std::string text = row["text"];
    if (unicode::to_nfc(text) != row["nfc"].get<std::string>() && ++mismatches <= 20) {
      ADD_FAILURE() << json(text).dump() << ": memtune " << json(unicode::to_nfc(text)).dump()
                    << ", Python " << row["nfc"].dump();
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(TokenizerUnicodeNfc, KnownForms) {
  EXPECT_EQ(unicode::to_nfc("e\xCC\x81"), "\xC3\xA9");                      // e + acute
  EXPECT_EQ(unicode::to_nfc("\xE2\x84\xAB"), "\xC3\x85");                   // ANGSTROM SIGN
  EXPECT_EQ(unicode::to_nfc("\xE0\xA5\x98"), "\xE0\xA4\x95\xE0\xA4\xBC");   // excluded QA
  EXPECT_EQ(unicode::to_nfc("a\xCC\xA3\xCC\x82"), "\xE1\xBA\xAD");           // reordered marks
  EXPECT_EQ(unicode::to_nfc("a\xCC\x82\xCC\xA3"), "\xE1\xBA\xAD");
  EXPECT_EQ(unicode::to_nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // Hangul LVT
  EXPECT_EQ(unicode::to_nfc("\xCC\x81x"), "\xCC\x81x");  // a leading mark stays
  EXPECT_EQ(unicode::to_nfc(""), "");
  EXPECT_TRUE(unicode::nfc_trivially_stable("plain ASCII \xC2\xA0"));
  EXPECT_FALSE(unicode::nfc_trivially_stable("\xC3\xA9"));
  EXPECT_FALSE(unicode::nfc_unicode_version().empty());
}
