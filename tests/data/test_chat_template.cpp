#include "memtune/data/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/data/tokenizer.h"
#include "../support/expect_error.h"
#include "../support/tokenizer_data.h"

using namespace memtune;
using namespace memtune::test;  // tests/support: error_of, the tokenizer data
using nlohmann::json;

namespace {

// transformers' apply_chat_template on shared/data's tokenizer_config.json, as text and ids.
TEST(ChatTemplate, MatchesTransformersOnTheRealTemplate) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  const auto rows = read_jsonl(tokenizer_fixture_dir() / "chat.jsonl");
  ASSERT_GE(rows.size(), 5u);
  bool saw_system = false;
  for (const json& row : rows) {
    const auto messages = messages_of(row);
    for (const auto& m : messages) saw_system |= m.role == "system";
    const bool generation_prompt = row["add_generation_prompt"];
    const std::string text = apply_llama3_chat_template(messages, generation_prompt);
    EXPECT_EQ(text, row["text"].get<std::string>()) << row["messages"].dump();
    const auto expected_ids = row["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tokenizer.encode_plain(text), expected_ids) << row["messages"].dump();
    // encode_chat renders without the generation prompt; its ids are the prefix without it.
    const ChatEncoding encoded = encode_chat(tokenizer, messages);
    const auto without_prompt = tokenizer.encode_plain(apply_llama3_chat_template(messages, false));
    EXPECT_EQ(encoded.ids, without_prompt)
        << row["messages"].dump() << "\n  whole: " << ids_to_string(without_prompt)
        << "\n  parts: " << ids_to_string(encoded.ids);
    ASSERT_EQ(encoded.assistant_mask.size(), encoded.ids.size());
    if (!generation_prompt) EXPECT_EQ(encoded.ids, expected_ids);
  }
  EXPECT_TRUE(saw_system);
}

// The tokens the mask selects are exactly each assistant content (trimmed) and its <|eot_id|>.
TEST(ChatTemplate, MaskSelectsAssistantContentAndItsEndOfTurn) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  for (const json& row : read_jsonl(tokenizer_fixture_dir() / "chat.jsonl")) {
    const auto messages = messages_of(row);
    const ChatEncoding encoded = encode_chat(tokenizer, messages);
    std::vector<int32_t> trained;
    for (size_t i = 0; i < encoded.ids.size(); ++i) {
      if (encoded.assistant_mask[i]) trained.push_back(encoded.ids[i]);
    }
    std::string expected;
    for (const auto& m : messages) {
      if (m.role != "assistant") continue;
      // What the template put between the assistant header and its <|eot_id|>.
      expected += apply_llama3_chat_template({{"x", m.content}}, false)
                      .substr(std::string("<|begin_of_text|><|start_header_id|>x"
                                          "<|end_header_id|>\n\n")
                                  .size());
    }
    EXPECT_EQ(tokenizer.decode(trained), expected) << row["messages"].dump();
  }
}

TEST(ChatTemplate, ExactMaskOnAShortConversation) {
  const Tokenizer& tokenizer = llama3_tokenizer();
  const std::vector<ChatMessage> messages = {
      {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}};
  const ChatEncoding encoded = encode_chat(tokenizer, messages);
  // From chat.jsonl's style: "Hello!" is [9906, 0].
  const std::vector<int32_t> tail = {128006, 78191, 128007, 271, 9906, 0, 128009};
  ASSERT_GE(encoded.ids.size(), tail.size());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), encoded.ids.end() - 7));
  EXPECT_EQ(encoded.ids.front(), 128000);
  for (size_t i = 0; i < encoded.ids.size(); ++i) {
    const bool trained = i + 3 >= encoded.ids.size();  // "Hello", "!", <|eot_id|>
    EXPECT_EQ(encoded.assistant_mask[i], trained ? 1 : 0) << "token " << i;
  }
}

TEST(ChatTemplate, GenerationPromptAndEmptyConversation) {
  EXPECT_EQ(apply_llama3_chat_template({}, false), "");
  EXPECT_EQ(apply_llama3_chat_template({}, true),
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(apply_llama3_chat_template({{"user", "Hi"}}, true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  const ChatEncoding empty = encode_chat(llama3_tokenizer(), {});
  EXPECT_TRUE(empty.ids.empty());
  EXPECT_TRUE(empty.assistant_mask.empty());
}

TEST(ChatTemplate, TrimIsPythonStrip) {
  // Stripped: Python's whitespace, including U+001C..U+001F, U+0085, U+00A0, U+3000.
  EXPECT_EQ(apply_llama3_chat_template(
                {{"user", " \t\n\r\x0b\x0c\x1c\x1f\xC2\x85\xC2\xA0\xE3\x80\x80x y\xE2\x80\xA8 "}},
                false),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nx y<|eot_id|>");
  // Not stripped: U+180E (no longer whitespace), U+200B zero width space, U+FEFF.
  for (const std::string keep : {"\xE1\xA0\x8E", "\xE2\x80\x8B", "\xEF\xBB\xBF"}) {
    const std::string text = apply_llama3_chat_template({{"user", keep + "x" + keep}}, false);
    EXPECT_NE(text.find(keep + "x" + keep), std::string::npos);
  }
}

TEST(ChatTemplate, InvalidUtf8IsAnError) {
  EXPECT_NE(error_of([] { (void)apply_llama3_chat_template({{"user", "ok\xFF"}}, false); })
                .find("chat message 0: content"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              (void)encode_chat(Tokenizer::byte_level(), {{"user", "a"}, {"\xC3", "b"}});
            }).find("chat message 1: role"),
            std::string::npos);
}

TEST(ChatTemplate, ByteLevelTokenizer) {
  const Tokenizer tokenizer = Tokenizer::byte_level();
  const std::vector<ChatMessage> messages = {{"user", " Hi "}, {"assistant", "Yo"}};
  const ChatEncoding encoded = encode_chat(tokenizer, messages);
  EXPECT_EQ(encoded.ids, tokenizer.encode_plain(apply_llama3_chat_template(messages, false)));
  // ... <|end_header_id|> \n \n Y o <|eot_id|>
  const size_t n = encoded.ids.size();
  ASSERT_GE(n, 6u);
  EXPECT_EQ(encoded.ids[0], 256);
  EXPECT_EQ(encoded.ids[n - 1], 260);
  EXPECT_EQ(std::vector<uint8_t>(encoded.assistant_mask.end() - 6, encoded.assistant_mask.end()),
            (std::vector<uint8_t>{0, 0, 0, 1, 1, 1}));
}

}  // namespace
