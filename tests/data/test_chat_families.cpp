// The Qwen2.5, Qwen3 and Mistral v0.3 chat formats against transformers' apply_chat_template on
// the templates of tests/fixtures/tokenizer/{qwen2.5,qwen3,mistral}/tokenizer_config.json
// (chat.jsonl beside each, from tools/make_tokenizer_golden.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memtune/data/chat_template.h"
#include "memtune/data/tokenizer.h"
#include "memtune/io/file_util.h"
#include "../support/temp_dir.h"
#include "../support/expect_error.h"
#include "../support/tokenizer_data.h"

using namespace memtune;
using namespace memtune::test;
using nlohmann::json;

namespace {

std::string trained_text(const Tokenizer& tokenizer, const ChatEncoding& encoded) {
  std::string out;
  for (size_t i = 0; i < encoded.ids.size(); ++i) {
    if (encoded.assistant_mask[i]) out += tokenizer.token_bytes(encoded.ids[i]);
  }
  return out;
}

void expect_matches_transformers(const std::string& family, ChatFormat format) {
  const Tokenizer& tokenizer = family_tokenizer(family);
  EXPECT_EQ(chat_format_of(tokenizer), format);
  const auto rows = read_jsonl(tokenizer_fixture_dir() / family / "chat.jsonl");
  ASSERT_GE(rows.size(), 8u);
  for (const json& row : rows) {
    SCOPED_TRACE(row["messages"].dump());
    const auto messages = messages_of(row);
    const bool generation_prompt = row["add_generation_prompt"];
    const std::string text = apply_chat_template(format, messages, generation_prompt);
    EXPECT_EQ(text, row["text"].get<std::string>());
    const auto expected_ids = row["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tokenizer.encode_plain(text), expected_ids);
    const ChatEncoding encoded = encode_chat(tokenizer, messages);
    ASSERT_EQ(encoded.assistant_mask.size(), encoded.ids.size());
    EXPECT_EQ(encoded.ids, tokenizer.encode_plain(apply_chat_template(format, messages, false)))
        << "\n  parts: " << ids_to_string(encoded.ids);
    if (!generation_prompt) EXPECT_EQ(encoded.ids, expected_ids);
  }
}

}  // namespace

TEST(ChatTemplateFamilies, Qwen25MatchesTransformers) {
  expect_matches_transformers("qwen2.5", ChatFormat::qwen2_5);
}

TEST(ChatTemplateFamilies, Qwen3MatchesTransformers) {
  expect_matches_transformers("qwen3", ChatFormat::qwen3);
}

TEST(ChatTemplateFamilies, MistralMatchesTransformers) {
  expect_matches_transformers("mistral", ChatFormat::mistral_v3);
}

TEST(ChatTemplateFamilies, Qwen25MaskTrainsAssistantTurnsAndImEnd) {
  const Tokenizer& tokenizer = family_tokenizer("qwen2.5");
  const std::vector<ChatMessage> messages = {
      {"user", "Hi"}, {"assistant", "Hello there"}, {"user", "More"}, {"assistant", "\n\nSure."}};
  const ChatEncoding encoded = encode_chat(tokenizer, messages);
  // The second reply's leading newlines merge with the header's "\n" into one token, which is
  // trained (it straddles the header's end).
  EXPECT_EQ(trained_text(tokenizer, encoded), "Hello there<|im_end|>\n\n\nSure.<|im_end|>");
  // The "\n" after each <|im_end|> is not trained.
  EXPECT_EQ(encoded.assistant_mask.back(), 0);
}

TEST(ChatTemplateFamilies, Qwen3MaskTrainsTheThinkBlock) {
  const Tokenizer& tokenizer = family_tokenizer("qwen3");
  const std::vector<ChatMessage> messages = {{"user", "q"}, {"assistant", "a"}};
  EXPECT_EQ(trained_text(tokenizer, encode_chat(tokenizer, messages)),
            "<think>\n\n</think>\n\na<|im_end|>");
}

TEST(ChatTemplateFamilies, MistralMaskTrainsRepliesAndEos) {
  const Tokenizer& tokenizer = family_tokenizer("mistral");
  const std::vector<ChatMessage> messages = {
      {"system", "S"}, {"user", "a"}, {"assistant", " b "}, {"user", "c"}, {"assistant", "d"}};
  const ChatEncoding encoded = encode_chat(tokenizer, messages);
  // Each reply's piece is " {content | trim}", whose leading space the normalizer turns into "▁"
  // (and prepends another): the trained bytes spell both spaces.
  EXPECT_EQ(trained_text(tokenizer, encoded), "  b</s>  d</s>");
  EXPECT_EQ(encoded.ids.front(), tokenizer.bos_id());
}

TEST(ChatTemplateFamilies, RefusalsAreClear) {
  EXPECT_CONTAINS(error_of([] {
                    (void)apply_chat_template(ChatFormat::mistral_v3,
                                              {{"user", "a"}, {"user", "b"}}, false);
                  }),
                  "alternate");
  EXPECT_CONTAINS(error_of([] {
                    (void)apply_chat_template(ChatFormat::qwen2_5, {{"tool", "{}"}}, false);
                  }),
                  "role \"tool\"");
  EXPECT_CONTAINS(error_of([] { (void)apply_chat_template(ChatFormat::qwen3, {}, false); }),
                  "at least one message");
}

TEST(ChatTemplateFamilies, FormatFromTokensWithoutATemplate) {
  EXPECT_EQ(chat_format_of(Tokenizer::byte_level()), ChatFormat::llama3);
  EXPECT_EQ(chat_format_of(llama3_tokenizer()), ChatFormat::llama3);
  const std::string qwen_json = read_file(family_tokenizer_dir("qwen3", "qwen3") / "tokenizer.json");
  EXPECT_EQ(chat_format_of(Tokenizer::from_json_text(qwen_json, "qwen3")), ChatFormat::qwen3);
  const std::string mistral_json =
      read_file(family_tokenizer_dir("mistral", "mistral") / "tokenizer.json");
  EXPECT_EQ(chat_format_of(Tokenizer::from_json_text(mistral_json, "mistral")), ChatFormat::mistral_v3);
}

TEST(ChatTemplateFamilies, UnknownTemplateIsRefused) {
  namespace fs = std::filesystem;
  const fs::path dir = make_test_dir("chat_unknown");
  fs::copy_file(family_tokenizer_dir("mistral", "mistral") / "tokenizer.json", dir / "tokenizer.json");
  {
    std::ofstream config(dir / "tokenizer_config.json");
    config << R"({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})";
  }
  const Tokenizer tokenizer = Tokenizer::from_file(dir / "tokenizer.json");
  EXPECT_CONTAINS(error_of([&] { (void)encode_chat(tokenizer, {{"user", "a"}}); }),
                  "not one memtune renders");
  fs::remove_all(dir);
}

// transformers >= 4.43 saves the template as chat_template.jinja, which wins over
// tokenizer_config.json; older configs may hold a list of named templates ("default" is used).
TEST(ChatTemplateFamilies, TemplateFromJinjaFileOrNamedList) {
  namespace fs = std::filesystem;
  const fs::path dir = make_test_dir("chat_sources");
  fs::copy_file(family_tokenizer_dir("mistral", "mistral") / "tokenizer.json", dir / "tokenizer.json");
  const json mistral_config =
      json::parse(read_file(tokenizer_fixture_dir() / "mistral" / "tokenizer_config.json"));
  const json qwen_config =
      json::parse(read_file(tokenizer_fixture_dir() / "qwen2.5" / "tokenizer_config.json"));
  {
    json config = {{"chat_template",
                    {{{"name", "tool_use"}, {"template", qwen_config["chat_template"]}},
                     {{"name", "default"}, {"template", mistral_config["chat_template"]}}}}};
    std::ofstream(dir / "tokenizer_config.json") << config.dump();
  }
  EXPECT_EQ(chat_format_of(Tokenizer::from_file(dir / "tokenizer.json")), ChatFormat::mistral_v3);
  std::ofstream(dir / "chat_template.jinja") << qwen_config["chat_template"].get<std::string>();
  EXPECT_EQ(chat_format_of(Tokenizer::from_file(dir / "tokenizer.json")), ChatFormat::qwen2_5);
  std::ofstream(dir / "tokenizer_config.json") << R"({"chat_template": 3})";
  fs::remove(dir / "chat_template.jinja");
  EXPECT_CONTAINS(error_of([&] { (void)Tokenizer::from_file(dir / "tokenizer.json"); }),
                  "chat_template");
  fs::remove_all(dir);
}
