#include "memtune/data/chat_template.h"

#include <limits>

#include "memtune/core/enum_names.h"
#include "memtune/core/error.h"
#include "memtune/data/tokenizer.h"
#include "memtune/data/unicode_bytes.h"

namespace memtune {
namespace {

constexpr std::string_view kBeginOfText = "<|begin_of_text|>";
constexpr std::string_view kStartHeader = "<|start_header_id|>";
constexpr std::string_view kEndHeader = "<|end_header_id|>";
constexpr std::string_view kEndOfTurn = "<|eot_id|>";
constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kMistralBos = "<s>";
constexpr std::string_view kMistralEos = "</s>";
constexpr std::string_view kInst = "[INST]";
constexpr std::string_view kInstEnd = "[/INST]";
constexpr std::string_view kQwenDefaultSystem =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

constexpr size_t kUntrained = std::numeric_limits<size_t>::max();

// A rendered conversation as pieces: special tokens on their own (each one id), and the text
// between them, with the byte offset from which the text is trained (0: all of it; kUntrained:
// none). Text pieces end where special tokens begin, and the tokenizer never merges across an
// added token, so encoding the pieces one by one gives the ids of the whole text.
struct Piece {
  std::string text;
  bool special = false;
  size_t trained_from = kUntrained;
};

struct Rendering {
  std::vector<Piece> pieces;

  void special(std::string_view token, bool trained = false) {
    pieces.push_back({std::string(token), true, trained ? 0 : kUntrained});
  }
  void text(std::string text, size_t trained_from = kUntrained) {
    pieces.push_back({std::move(text), false, trained_from});
  }
  std::string joined() const {
    std::string out;
    for (const Piece& p : pieces) out += p.text;
    return out;
  }
};

void check_messages(const std::vector<ChatMessage>& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    unicode::check_utf8(messages[i].role, fmt::format("chat message {}: role", i));
    unicode::check_utf8(messages[i].content, fmt::format("chat message {}: content", i));
  }
}

// Python's str.strip(chars) family for one character.
std::string_view lstrip_char(std::string_view s, char c) {
  while (!s.empty() && s.front() == c) s.remove_prefix(1);
  return s;
}
std::string_view rstrip_char(std::string_view s, char c) {
  while (!s.empty() && s.back() == c) s.remove_suffix(1);
  return s;
}
std::string_view strip_char(std::string_view s, char c) { return rstrip_char(lstrip_char(s, c), c); }

// ----------------------------------------------------------------------------------------------
// Llama 3.

void render_llama3(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                   Rendering& r) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    std::string header;
    if (i == 0) header += kBeginOfText;
    header += kStartHeader;
    header += m.role;
    header += kEndHeader;
    header += "\n\n";
    const bool trained = m.role == "assistant";
    const size_t header_size = header.size();
    r.text(header + std::string(unicode::strip_python_space(m.content)),
           trained ? header_size : kUntrained);
    r.special(kEndOfTurn, trained);
  }
  if (add_generation_prompt) {
    r.text(std::string(kStartHeader) + "assistant" + std::string(kEndHeader) + "\n\n");
  }
}

// ----------------------------------------------------------------------------------------------
// ChatML: Qwen2.5 and Qwen3.

[[noreturn]] void refuse_role(std::string_view format, size_t index, std::string_view role) {
  mt_fail("chat message {}: role \"{}\": the {} chat format supports system, user and assistant "
          "messages (memtune does not render tool messages)",
          index, role, format);
}

void chatml_turn(Rendering& r, std::string_view role, std::string body, bool trained) {
  r.special(kImStart);
  std::string text = std::string(role) + "\n";
  const size_t header_size = text.size();
  text += body;
  r.text(std::move(text), trained ? header_size : kUntrained);
  r.special(kImEnd, trained);
  r.text("\n");
}

void render_qwen2_5(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                    Rendering& r) {
  MT_USER_CHECK(!messages.empty(), "the Qwen2.5 chat template needs at least one message");
  if (messages[0].role == "system") {
    chatml_turn(r, "system", messages[0].content, false);
  } else {
    chatml_turn(r, "system", std::string(kQwenDefaultSystem), false);
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "system" && i == 0) continue;
    if (m.role != "user" && m.role != "system" && m.role != "assistant") {
      refuse_role("Qwen2.5", i, m.role);
    }
    chatml_turn(r, m.role, m.content, m.role == "assistant");
  }
  if (add_generation_prompt) {
    r.special(kImStart);
    r.text("assistant\n");
  }
}

void render_qwen3(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                  Rendering& r) {
  MT_USER_CHECK(!messages.empty(), "the Qwen3 chat template needs at least one message");
  if (messages[0].role == "system") chatml_turn(r, "system", messages[0].content, false);
  // The last user message that is not a wrapped tool response: reasoning is kept after it.
  size_t last_query = messages.size() - 1;
  for (size_t k = messages.size(); k-- > 0;) {
    const std::string_view c = messages[k].content;
    if (messages[k].role == "user" &&
        !(c.starts_with("<tool_response>") && c.ends_with("</tool_response>"))) {
      last_query = k;
      break;
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      chatml_turn(r, m.role, m.content, false);
      continue;
    }
    if (m.role == "system") continue;
    if (m.role != "assistant") refuse_role("Qwen3", i, m.role);
    std::string_view content = m.content;
    std::string_view reasoning;
    constexpr std::string_view kThinkEnd = "</think>";
    if (const size_t first_end = content.find(kThinkEnd); first_end != std::string_view::npos) {
      const size_t last_end = content.rfind(kThinkEnd);
      std::string_view before = rstrip_char(content.substr(0, first_end), '\n');
      if (const size_t open = before.rfind("<think>"); open != std::string_view::npos) {
        before = before.substr(open + std::string_view("<think>").size());
      }
      reasoning = lstrip_char(before, '\n');
      content = lstrip_char(content.substr(last_end + kThinkEnd.size()), '\n');
    }
    std::string body;
    if (i > last_query && (i + 1 == messages.size() || !reasoning.empty())) {
      body = "<think>\n" + std::string(strip_char(reasoning, '\n')) + "\n</think>\n\n" +
             std::string(lstrip_char(content, '\n'));
    } else {
      body = std::string(content);
    }
    chatml_turn(r, "assistant", std::move(body), true);
  }
  if (add_generation_prompt) {
    r.special(kImStart);
    r.text("assistant\n");
  }
}

// ----------------------------------------------------------------------------------------------
// Mistral v0.3.

void render_mistral_v3(const std::vector<ChatMessage>& messages, Rendering& r) {
  size_t first = 0;
  const std::string* system = nullptr;
  if (!messages.empty() && messages[0].role == "system") {
    system = &messages[0].content;
    first = 1;
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const bool expect_user = (i - first) % 2 == 0;
    MT_USER_CHECK((messages[i].role == "user") == expect_user &&
                      (messages[i].role == "user" || messages[i].role == "assistant"),
                  "chat message {}: role \"{}\": the Mistral v0.3 chat template needs the roles "
                  "after an optional first system message to alternate user/assistant/user/... "
                  "(memtune does not render tool messages)",
                  i, messages[i].role);
  }
  r.special(kMistralBos);
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user") {
      r.special(kInst);
      if (i + 1 == messages.size() && system != nullptr) {
        r.text(" " + *system + "\n\n" + m.content);
      } else {
        r.text(" " + m.content);
      }
      r.special(kInstEnd);
    } else {
      // append, not " " + std::string(...): g++ 12 warns (-Wrestrict) on that operator+ when inlined.
      r.text(std::string(" ").append(unicode::strip_python_space(m.content)), 0);
      r.special(kMistralEos, true);
    }
  }
}

Rendering render(ChatFormat format, const std::vector<ChatMessage>& messages,
                 bool add_generation_prompt) {
  check_messages(messages);
  Rendering r;
  switch (format) {
    case ChatFormat::llama3:
      render_llama3(messages, add_generation_prompt, r);
      break;
    case ChatFormat::qwen2_5:
      render_qwen2_5(messages, add_generation_prompt, r);
      break;
    case ChatFormat::qwen3:
      render_qwen3(messages, add_generation_prompt, r);
      break;
    case ChatFormat::mistral_v3:
      // The template ignores add_generation_prompt: "[/INST]" already asks for the reply.
      render_mistral_v3(messages, r);
      break;
  }
  return r;
}

bool contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

}  // namespace

constexpr EnumName<ChatFormat> kChatFormatNames[] = {{ChatFormat::llama3, "Llama 3"}, {ChatFormat::qwen2_5, "Qwen2.5"},
                                                     {ChatFormat::qwen3, "Qwen3"}, {ChatFormat::mistral_v3, "Mistral v0.3"}};

std::string_view chat_format_name(ChatFormat format) { return name_of(kChatFormatNames, format); }

ChatFormat chat_format_of(const Tokenizer& tokenizer) {
  const std::string_view t = tokenizer.chat_template();
  if (!t.empty()) {
    // Text that only that template has (as the Jinja source spells it, "\\n" included).
    if (contains(t, kStartHeader) && contains(t, kEndHeader)) return ChatFormat::llama3;
    if (contains(t, kImStart) && contains(t, "reasoning_content.strip('\\n')") &&
        contains(t, "ns.last_query_index")) {
      return ChatFormat::qwen3;
    }
    if (contains(t, kImStart) &&
        contains(t, "'<|im_start|>system\\n" + std::string(kQwenDefaultSystem) + "<|im_end|>\\n'") &&
        contains(t, "'<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n'")) {
      return ChatFormat::qwen2_5;
    }
    if (contains(t, "\"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\"") &&
        contains(t, "\" \" + message[\"content\"]|trim + eos_token")) {
      return ChatFormat::mistral_v3;
    }
    mt_fail("the tokenizer's chat template is not one memtune renders (it renders the templates "
            "of Llama 3, Qwen2.5-Instruct, Qwen3 and Mistral-7B-Instruct-v0.3); its first line: "
            "\"{}\"",
            t.substr(0, std::min(t.find('\n'), size_t(120))));
  }
  if (tokenizer.token_to_id(kStartHeader) && tokenizer.token_to_id(kEndOfTurn)) {
    return ChatFormat::llama3;
  }
  if (tokenizer.token_to_id(kImStart) && tokenizer.token_to_id(kImEnd)) {
    return tokenizer.token_to_id("<think>") ? ChatFormat::qwen3 : ChatFormat::qwen2_5;
  }
  if (tokenizer.token_to_id(kInst) && tokenizer.token_to_id(kInstEnd)) return ChatFormat::mistral_v3;
  mt_fail("the tokenizer has no chat template and none of the chat tokens memtune knows "
          "(<|start_header_id|>, <|im_start|>, [INST]); give a tokenizer_config.json with its "
          "chat_template beside tokenizer.json");
}

std::string apply_chat_template(ChatFormat format, const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt) {
  return render(format, messages, add_generation_prompt).joined();
}

std::string apply_llama3_chat_template(const std::vector<ChatMessage>& messages,
                                       bool add_generation_prompt) {
  return apply_chat_template(ChatFormat::llama3, messages, add_generation_prompt);
}

ChatEncoding encode_chat(const Tokenizer& tokenizer, ChatFormat format,
                         const std::vector<ChatMessage>& messages) {
  const Rendering r = render(format, messages, /*add_generation_prompt=*/false);
  ChatEncoding result;
  for (const Piece& piece : r.pieces) {
    if (piece.special) {
      const auto id = tokenizer.token_to_id(piece.text);
      MT_USER_CHECK(id.has_value(), "encode_chat: the tokenizer has no {} token, which the {} chat "
                    "format needs", piece.text, chat_format_name(format));
      result.ids.push_back(*id);
      result.assistant_mask.push_back(piece.trained_from == 0 ? 1 : 0);
      continue;
    }
    const size_t begin = result.ids.size();
    tokenizer.encode_plain_append(piece.text, result.ids);
    result.assistant_mask.resize(result.ids.size(), 0);
    if (piece.trained_from == kUntrained) continue;
    // Train each token that ends past the header. A piece's tokens spell its text byte for byte
    // here: the headers are ASCII, which no normalizer of these formats changes, and Mistral's
    // pieces (whose normalizer adds a leading space) are trained whole.
    size_t end_byte = 0;
    for (size_t k = begin; k < result.ids.size(); ++k) {
      end_byte += tokenizer.token_bytes(result.ids[k]).size();
      if (end_byte > piece.trained_from || piece.trained_from == 0) result.assistant_mask[k] = 1;
    }
  }
  return result;
}

ChatEncoding encode_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages) {
  return encode_chat(tokenizer, chat_format_of(tokenizer), messages);
}

}  // namespace memtune
