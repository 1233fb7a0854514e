// BPE matching HF tokenizers (v0.2x) bit for bit on the tokenizer.json files of Llama 3, Qwen3
// (and so Qwen2.5, the same model and normalizer) and Mistral 7B v0.3.
//
// Facts used, with where they were read:
//  - tokenizer.json layout and semantics: huggingface/tokenizers, tokenizers/src (models/bpe,
//    pre_tokenizers/{split,byte_level,sequence}.rs, processors/template.rs,
//    tokenizer/added_vocabulary.rs). Checked against `tokenizers` 0.23 by the fixtures of
//    tools/make_tokenizer_fixtures.py.
//  - The Llama 3 split regex and the special ids: SPECS.md section 6.
//  - GPT-2's split regex (ByteLevel with use_regex true): tokenizers
//    pre_tokenizers/byte_level.rs, the same as openai/gpt-2 encoder.py.
//
// The parts: tokenizer_model.h (the BPE model and its tables), split_regex.h (the pre-tokenizer's
// regex), tokenizer_json.cpp (reading tokenizer.json), and here the public interface.
#include "memtune/data/tokenizer.h"

#include "memtune/data/tokenizer_model.h"

namespace memtune {

Tokenizer Tokenizer::byte_level() {
  static const std::shared_ptr<const Impl> shared = [] {
    auto impl = std::make_shared<Impl>();
    impl->kind = Impl::Kind::kBytes;
    static constexpr std::array<std::string_view, 6> kSpecials = {
        "<|begin_of_text|>", "<|end_of_text|>",   "<|start_header_id|>",
        "<|end_header_id|>", "<|eot_id|>",        "<|finetune_right_pad_id|>"};
    impl->resize(256 + int32_t(kSpecials.size()));
    for (unsigned b = 0; b < 256; ++b) {
      std::string spelling;
      unicode::append_utf8(spelling, unicode::byte_to_char(uint8_t(b)));
      impl->token_text[b] = spelling;
      impl->token_bytes[b] = std::string(1, char(b));
      impl->id_exists[b] = 1;
      impl->text_to_id.emplace(std::move(spelling), int32_t(b));
    }
    for (size_t i = 0; i < kSpecials.size(); ++i) {
      const auto id = int32_t(256 + i);
      impl->token_text[size_t(id)] = std::string(kSpecials[i]);
      impl->token_bytes[size_t(id)] = std::string(kSpecials[i]);
      impl->id_exists[size_t(id)] = 1;
      impl->id_special[size_t(id)] = 1;
      impl->text_to_id[std::string(kSpecials[i])] = id;
      impl->literal_added.add(kSpecials[i], id);
    }
    impl->template_prefix = {256};
    impl->resolve_special_ids("byte-level tokenizer");
    return std::shared_ptr<const Impl>(std::move(impl));
  }();
  return Tokenizer(shared);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out = impl_->template_prefix;
  impl_->encode_plain_append(text, out);
  out.insert(out.end(), impl_->template_suffix.begin(), impl_->template_suffix.end());
  return out;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> out;
  if (add_bos) {
    MT_USER_CHECK(impl_->bos >= 0, "this tokenizer has no BOS token to add (Qwen has none)");
    out.push_back(impl_->bos);
  }
  impl_->encode_plain_append(text, out);
  return out;
}

std::vector<int32_t> Tokenizer::encode_plain(std::string_view text) const {
  std::vector<int32_t> out;
  impl_->encode_plain_append(text, out);
  return out;
}

void Tokenizer::encode_plain_append(std::string_view text, std::vector<int32_t>& out) const {
  impl_->encode_plain_append(text, out);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens);
}

std::string Tokenizer::decode_lossy(std::span<const int32_t> ids,
                                    bool skip_special_tokens) const {
  return impl_->decode_lossy(ids, skip_special_tokens);
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  impl_->check_id(id);
  return impl_->token_bytes[size_t(id)];
}

std::string_view Tokenizer::chat_template() const { return impl_->chat_template; }

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->text_to_id.find(token);
  if (it == impl_->text_to_id.end()) return std::nullopt;
  return it->second;
}

std::string_view Tokenizer::id_to_token(int32_t id) const {
  impl_->check_id(id);
  return impl_->token_text[size_t(id)];
}

bool Tokenizer::is_special(int32_t id) const {
  impl_->check_id(id);
  return impl_->id_special[size_t(id)] != 0;
}

int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::eot_id() const { return impl_->eot; }
int32_t Tokenizer::pad_id() const { return impl_->pad; }

bool Tokenizer::adds_bos_by_default() const {
  return impl_->bos >= 0 && !impl_->template_prefix.empty() && impl_->template_prefix[0] == impl_->bos;
}

bool Tokenizer::is_byte_level() const { return impl_->kind == Impl::Kind::kBytes; }

}  // namespace memtune
