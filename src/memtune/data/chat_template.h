// The chat formats memtune renders -- Llama 3, Qwen2.5 and Qwen3 (ChatML), Mistral v0.3 ([INST])
// -- and their tokens with a mask for completions-only training. The format is chosen from the
// tokenizer's chat template (tokenizer_config.json beside tokenizer.json) when it has one, else
// from its special tokens (chat_format_of). memtune does not run Jinja: it renders what each
// known template renders for plain {role, content} messages, and refuses a template it does not
// recognise rather than render it wrongly.
//
// Llama 3:
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
//
// Qwen2.5 (Qwen2.5-Instruct's template): "<|im_start|>{role}\n{content}<|im_end|>\n" per
// message, contents untrimmed; when the first message is not a system message, the system turn
// "You are Qwen, created by Alibaba Cloud. You are a helpful assistant." goes first; the
// generation prompt is "<|im_start|>assistant\n".
//
// Qwen3 (Qwen3's template): the same turns with no default system message; an assistant turn's
// "<think>...</think>" is split off its content, dropped from turns before the last user query,
// and written as "<think>\n{reasoning}\n</think>\n\n{content}" on later turns (the last turn
// always gets it, empty when the content had none).
//
// Mistral v0.3 (Mistral-7B-Instruct-v0.3's template): "<s>", then "[INST] {content}[/INST]" per
// user turn and " {content | trim}</s>" per assistant turn; a first system message goes into
// the LAST user turn as "{system}\n\n{content}" (and nowhere when the conversation ends with an
// assistant turn, as in the template); the roles after it must alternate user/assistant, and no
// generation prompt is added. Tool messages are not supported by any format here: other roles
// than system/user/assistant are a memtune::Error.
//
// Checked against transformers' apply_chat_template by tests/data/test_chat_template.cpp on
// tests/fixtures/tokenizer/{chat.jsonl,qwen2.5,qwen3,mistral}.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace memtune {

class Tokenizer;

struct ChatMessage {
  std::string role;
  std::string content;
};

enum class ChatFormat { llama3, qwen2_5, qwen3, mistral_v3 };

std::string_view chat_format_name(ChatFormat format);

// The format of `tokenizer`'s chat template, recognised by text that only that template has;
// without a template (no tokenizer_config.json, Tokenizer::byte_level()), by its special tokens:
// <|start_header_id|> Llama 3, <|im_start|> Qwen3 when the vocabulary has <think> and Qwen2.5
// otherwise, [INST] Mistral v0.3. memtune::Error naming what was found when neither decides.
ChatFormat chat_format_of(const Tokenizer& tokenizer);

// The rendered conversation, as transformers' apply_chat_template(tokenize=False) renders it.
// memtune::Error for invalid UTF-8, a role the format does not support, or (Mistral) roles that
// do not alternate.
std::string apply_chat_template(ChatFormat format, const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt);

// Llama 3: the rendered conversation. Contents are trimmed of leading and trailing whitespace as
// Jinja's `trim` (Python's str.strip()) trims. memtune::Error when a role or content is not
// valid UTF-8.
std::string apply_llama3_chat_template(const std::vector<ChatMessage>& messages,
                                       bool add_generation_prompt);

struct ChatEncoding {
  std::vector<int32_t> ids;
  // 1 where the token is trained on: what an "assistant" message put in the text and the token
  // that closes its turn (so the model learns to stop): Llama 3 the content and <|eot_id|>;
  // ChatML everything after "<|im_start|>assistant\n" (Qwen3's think block included) and
  // <|im_end|>, not the "\n" after it; Mistral " {content}" and </s>. 0 for everything else
  // (bos, headers, the other roles' turns). A token that straddles the end of an assistant
  // header (the header's "\n" merged with a content that starts with newlines) is trained.
  std::vector<uint8_t> assistant_mask;
};

// The tokens of apply_chat_template(format, messages, false) -- the same ids as
// tokenizer.encode_plain of that text, as transformers' apply_chat_template(tokenize=True)
// gives them -- with the assistant mask. The tokenizer must have the format's special tokens.
ChatEncoding encode_chat(const Tokenizer& tokenizer, ChatFormat format,
                         const std::vector<ChatMessage>& messages);
// The same in chat_format_of(tokenizer).
ChatEncoding encode_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages);

}  // namespace memtune
