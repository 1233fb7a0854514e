// The Llama 3 chat format, and its tokens with a mask for completions-only training.
//
// The format is the `chat_template` of shared/data/llama3-tokenizer/tokenizer_config.json,
// which is the Llama 3 (not 3.1) template: per message
//   <|start_header_id|>{role}<|end_header_id|>\n\n{content | trim}<|eot_id|>
// with <|begin_of_text|> before the first message, and with add_generation_prompt the opening
// of an assistant turn, <|start_header_id|>assistant<|end_header_id|>\n\n (SPECS.md section 6).
// Unlike the template Meta ships with Llama 3.1 (which, when no system message is given,
// inserts one holding "Cutting Knowledge Date: December 2023" and "Today Date: ..."), this one
// adds no default system message; memtune matches the file it is given, which is what
// transformers' apply_chat_template(..., tokenize=False) renders (checked by
// tests/data/test_chat_template.cpp against tests/fixtures/tokenizer/chat.jsonl).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memtune {

class Tokenizer;

struct ChatMessage {
  std::string role;
  std::string content;
};

// The rendered conversation. Contents are trimmed of leading and trailing whitespace as
// Jinja's `trim` (Python's str.strip()) trims. memtune::Error when a role or content is not
// valid UTF-8.
std::string apply_llama3_chat_template(const std::vector<ChatMessage>& messages,
                                       bool add_generation_prompt);

struct ChatEncoding {
  std::vector<int32_t> ids;
  // 1 where the token is trained on: the content of an "assistant" message and the
  // <|eot_id|> that closes it (so the model learns to stop); 0 for everything else (bos,
  // headers, the other roles' turns).
  std::vector<uint8_t> assistant_mask;
};

// The tokens of apply_llama3_chat_template(messages, false) -- the same ids as
// tokenizer.encode_plain of that text, as transformers' apply_chat_template(tokenize=True)
// gives them -- with the assistant mask. Works with the Llama 3 tokenizer and with
// Tokenizer::byte_level(), which both have the chat special tokens.
ChatEncoding encode_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages);

}  // namespace memtune
