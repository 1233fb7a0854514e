// Text <-> token ids, exactly as Hugging Face tokenizers does it for Llama 3, Qwen2.5/Qwen3 and
// Mistral.
//
// Two kinds:
//  - Tokenizer::from_file(tokenizer.json): BPE as HF tokenizers defines it (model "BPE" with
//    vocab, merges and ignore_merges; added tokens; TemplateProcessing post-processor), either
//    byte-level (a regex Split + ByteLevel pre-tokenizer, ByteLevel decoder: Llama 3; Qwen adds
//    an NFC normalizer) or over characters with byte fallback (<0xNN> tokens; a Prepend +
//    Replace normalizer or a Metaspace pre-tokenizer; a Replace/ByteFallback/Fuse/Strip decoder:
//    Mistral). The Llama 3 file is the first target (SPECS.md section 6); every part of a
//    tokenizer.json that this code does not implement is refused at load with the JSON path of
//    the part, never silently ignored, because a wrong tokenization trains a model quietly
//    wrong. from_file also keeps the chat template of tokenizer_config.json (or
//    chat_template.jinja) beside the file, for chat_template.h to choose the chat format by.
//  - Tokenizer::byte_level(): the built-in tokenizer of the embedded tiny model. Ids 0..255
//    are the raw bytes, then 256 <|begin_of_text|>, 257 <|end_of_text|>,
//    258 <|start_header_id|>, 259 <|end_header_id|>, 260 <|eot_id|>,
//    261 <|finetune_right_pad_id|>.
//
// Encoding (both kinds), as HF's default (encode_special_tokens off): added tokens written
// literally in the text are matched first, leftmost-longest, and emitted whole; the text
// between them is pre-tokenized and BPE'd on its own (so a regex lookahead never sees across
// an added token). Input must be valid UTF-8; anything else is a memtune::Error that gives the
// offset of the first bad byte (HF cannot even receive such text: Python str / Rust &str).
//
// A Tokenizer is immutable after construction: copies share the tables and every method may be
// called from many threads at once.
//
// Room data/ (docs/ARCHITECTURE.md): text to training rows; may include core/, io/ and ops/.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace memtune {

class Tokenizer {
 public:
  // memtune::Error when the file is missing or unreadable, is not JSON, or uses a structure
  // this code does not implement (the message names the part).
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  // The same from JSON text already in memory; `origin` names it in error messages.
  static Tokenizer from_json_text(std::string_view json_text, std::string_view origin);
  static Tokenizer byte_level();

  // What tokenizer.json's post-processor adds: for Llama 3, <|begin_of_text|> first; for
  // Mistral <s>; for Qwen nothing. byte_level() adds <|begin_of_text|>, like the Llama 3 it
  // stands in for.
  std::vector<int32_t> encode(std::string_view text) const;
  // bos_id() first when add_bos, then the text's tokens; nothing else is added. memtune::Error
  // for add_bos with a tokenizer that has no BOS (Qwen).
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const;
  // The text's tokens alone (HF: encode(text, add_special_tokens=False)).
  std::vector<int32_t> encode_plain(std::string_view text) const;
  // encode_plain appended to `out`: lets dataset code build one sequence without copies.
  void encode_plain_append(std::string_view text, std::vector<int32_t>& out) const;

  // The bytes the ids stand for, concatenated. Exact bytes, not HF's lossy UTF-8: a token may
  // hold part of a multi-byte character, and decoding a stream token by token must still
  // concatenate to the right text. Use decode_lossy for text that must be valid UTF-8 (logs,
  // JSON). skip_special_tokens drops added tokens whose "special" flag is set, as HF does.
  // memtune::Error for an id that names no token.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // A decoder that strips the start of the text (Mistral's Strip of one leading space, the space
  // its normalizer put before the first word) strips the start of what `ids` decode to, as HF
  // does: decoding a stream token by token then drops each token's leading space, so stream
  // with token_bytes instead.
  //
  // HF tokenizers' decode exactly: decode, then each ill-formed UTF-8 subsequence becomes
  // U+FFFD (Rust's String::from_utf8_lossy; with Mistral's ByteFallback decoder, one U+FFFD per
  // <0xNN> token of a run of them that is not valid UTF-8).
  std::string decode_lossy(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // max id + 1 over the model's vocabulary and the added tokens (Llama 3: 128256).
  int32_t vocab_size() const;
  // The id of a token written as tokenizer.json spells it ("Ġhello", "<|eot_id|>"); an added
  // token's content wins over a vocabulary entry with the same spelling, as in HF.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token's spelling in tokenizer.json. memtune::Error for an id that names no token.
  std::string_view id_to_token(int32_t id) const;
  // Whether `id` is an added token flagged "special" (what skip_special_tokens drops).
  bool is_special(int32_t id) const;
  // The bytes `id` puts into decode's output inside a sequence (Mistral: "▁" as a space, <0xNN>
  // as its byte), before any strip of the start. Concatenating them decodes a stream.
  // memtune::Error for an id that names no token.
  std::string_view token_bytes(int32_t id) const;

  // <|begin_of_text|> (or else the one token the post-processor puts first: Mistral's <s>);
  // -1 for a tokenizer without one (Qwen): see has_bos().
  int32_t bos_id() const;
  bool has_bos() const { return bos_id() >= 0; }
  // The end of a document in pretraining data: <|end_of_text|> (Llama 3), <|endoftext|> (Qwen),
  // </s> (Mistral).
  int32_t eos_id() const;
  // The end of a chat turn: <|eot_id|> (Llama 3 Instruct stops on it), <|im_end|> (Qwen's
  // ChatML); eos_id() if neither (Mistral ends a reply with </s>).
  int32_t eot_id() const;
  // <|finetune_right_pad_id|> (Llama 3.1's padding token, id 128004), else the same slot's
  // Llama 3.0 name <|reserved_special_token_2|>, else eos_id() (Qwen's pad_token is its eos).
  int32_t pad_id() const;

  // The chat template (Jinja text) found beside the file by from_file; empty when there was
  // none, and for from_json_text and byte_level().
  std::string_view chat_template() const;

  // Whether encode(text) adds bos_id() (the post-processor's template begins with it).
  bool adds_bos_by_default() const;
  // True for Tokenizer::byte_level().
  bool is_byte_level() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace memtune
