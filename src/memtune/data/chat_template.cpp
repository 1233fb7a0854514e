#include "memtune/data/chat_template.h"

#include "memtune/core/error.h"
#include "memtune/data/tokenizer.h"
#include "memtune/data/unicode_bytes.h"

namespace memtune {
namespace {

constexpr std::string_view kBeginOfText = "<|begin_of_text|>";
constexpr std::string_view kStartHeader = "<|start_header_id|>";
constexpr std::string_view kEndHeader = "<|end_header_id|>";
constexpr std::string_view kEndOfTurn = "<|eot_id|>";

// Everything of a turn before its content: bos (first turn only) and the role header.
std::string turn_header(const ChatMessage& message, bool first) {
  std::string out;
  if (first) out += kBeginOfText;
  out += kStartHeader;
  out += message.role;
  out += kEndHeader;
  out += "\n\n";
  return out;
}

std::string_view trimmed_content(const ChatMessage& message, size_t index) {
  unicode::check_utf8(message.role, fmt::format("chat message {}: role", index));
  unicode::check_utf8(message.content, fmt::format("chat message {}: content", index));
  return unicode::strip_python_space(message.content);
}

}  // namespace

std::string apply_llama3_chat_template(const std::vector<ChatMessage>& messages,
                                       bool add_generation_prompt) {
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string_view content = trimmed_content(messages[i], i);
    out += turn_header(messages[i], i == 0);
    out += content;
    out += kEndOfTurn;
  }
  if (add_generation_prompt) {
    out += kStartHeader;
    out += "assistant";
    out += kEndHeader;
    out += "\n\n";
  }
  return out;
}

ChatEncoding encode_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages) {
  const auto eot = tokenizer.token_to_id(kEndOfTurn);
  MT_USER_CHECK(eot.has_value(), "encode_chat: the tokenizer has no {} token", kEndOfTurn);
  ChatEncoding result;
  // Each part is encoded on its own and the ids concatenated. That equals encoding the whole
  // rendered text because every boundary is one the tokenizer cannot merge across: added
  // tokens split the text, and the header's "\n\n" ends a pre-token whenever the (trimmed)
  // content after it starts with a non-space (the Llama 3 regex never joins a newline to a
  // following letter, digit or symbol). The fixtures test the equality.
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    const std::string_view content = trimmed_content(message, i);
    const bool trained = message.role == "assistant";
    tokenizer.encode_plain_append(turn_header(message, i == 0), result.ids);
    result.assistant_mask.resize(result.ids.size(), 0);
    tokenizer.encode_plain_append(content, result.ids);
    result.ids.push_back(*eot);
    result.assistant_mask.resize(result.ids.size(), trained ? 1 : 0);
  }
  return result;
}

}  // namespace memtune
