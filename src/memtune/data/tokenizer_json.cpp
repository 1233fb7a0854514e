// Reading tokenizer.json into the BPE model (tokenizer_model.h): every field is looked at.
// Byte-level BPE (Llama 3, Qwen2.5/Qwen3: NFC normalizer, regex Split + ByteLevel) and BPE over
// characters with byte fallback (Mistral: Prepend + Replace normalizer or Metaspace, and a
// Replace/ByteFallback/Fuse/Strip decoder). tokenizers normalizers/{unicode,prepend,replace,
// utils}.rs, pre_tokenizers/metaspace.rs, decoders/{byte_fallback,fuse,strip}.rs were read for
// these, and tools/make_tokenizer_golden.py checks them against `tokenizers` 0.23.
// Facts used, with where they were read:
//  - tokenizer.json layout and semantics: huggingface/tokenizers, tokenizers/src (models/bpe,
//    pre_tokenizers/{split,byte_level,sequence}.rs, processors/template.rs,
//    tokenizer/added_vocabulary.rs). Checked against `tokenizers` 0.23 by the fixtures of
//    tools/make_tokenizer_fixtures.py.
//  - The Llama 3 split regex and the special ids: SPECS.md section 6.
//  - GPT-2's split regex (ByteLevel with use_regex true): tokenizers
//    pre_tokenizers/byte_level.rs, the same as openai/gpt-2 encoder.py.
#include <cctype>

#include <nlohmann/json.hpp>

#include "memtune/data/tokenizer_model.h"
#include "memtune/io/file_util.h"

namespace memtune {
namespace {

using nlohmann::json;
using namespace tokenizer_detail;

// ---------------------------------------------------------------------------------------------
// Reading tokenizer.json. Every field is looked at: an unknown one is refused, because HF may
// act on it and memtune would not.

[[noreturn]] void refuse(const std::string& origin, std::string_view where,
                         std::string_view problem) {
  mt_fail("{}: unsupported tokenizer.json: {}: {}", origin, where, problem);
}

void check_keys(const std::string& origin, std::string_view where, const json& object,
                std::initializer_list<std::string_view> known) {
  if (!object.is_object()) refuse(origin, where, "expected a JSON object");
  for (const auto& [key, value] : object.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      refuse(origin, fmt::format("{}.{}", where, key),
             "memtune does not know this field (it would be ignored, so it is refused)");
    }
  }
}

bool is_null_or(const json& object, std::string_view key, const json& allowed) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() || *it == allowed;
}

std::string type_of(const std::string& origin, std::string_view where, const json& object) {
  const auto it = object.find("type");
  if (!object.is_object() || it == object.end() || !it->is_string()) {
    refuse(origin, where, "expected an object with a string \"type\"");
  }
  return it->get<std::string>();
}

bool get_bool(const std::string& origin, std::string_view where, const json& object,
              std::string_view key, bool fallback) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) refuse(origin, fmt::format("{}.{}", where, key), "expected a boolean");
  return it->get<bool>();
}

// ByteLevel as a pre-tokenizer: the only ids-relevant flags are add_prefix_space (unsupported
// when true) and use_regex (true: split with GPT-2's pattern first).
bool parse_byte_level_pre_tokenizer(const std::string& origin, const std::string& where,
                                    const json& spec) {
  check_keys(origin, where, spec, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
  if (get_bool(origin, where, spec, "add_prefix_space", true)) {
    refuse(origin, where + ".add_prefix_space", "true is not supported (Llama 3 uses false)");
  }
  return get_bool(origin, where, spec, "use_regex", true);
}

using Impl = Tokenizer::Impl;

// Added tokens go in after the vocabulary: an added token's content wins in token_to_id and
// id_to_token for its id (tokenizers: added vocabulary first, then the model).
void add_added_token(Impl& impl, std::string_view content, int32_t id, bool special,
                     bool normalized) {
  impl.token_text[size_t(id)] = std::string(content);
  // HF's ByteLevel decoder maps an added token's characters back to bytes like any other
  // token's, falling back to its UTF-8 when some character is outside the byte map.
  auto bytes = impl.kind == Impl::Kind::kBpe ? unicode::byte_level_to_bytes(content) : std::nullopt;
  impl.token_bytes[size_t(id)] = bytes ? *bytes : std::string(content);
  impl.id_exists[size_t(id)] = 1;
  impl.id_special[size_t(id)] = special ? 1 : 0;
  impl.text_to_id[std::string(content)] = id;
  (normalized ? impl.normalized_added : impl.literal_added).add(content, id);
}

// Whether the file is a byte-level BPE: its pre-tokenizer is, or ends in, ByteLevel. Anything
// else is read as a BPE over characters, which must then have byte fallback.
bool uses_byte_level(const json& spec) {
  if (!spec.is_object()) return false;
  if (spec.value("type", json()) == "ByteLevel") return true;
  if (spec.value("type", json()) != "Sequence") return false;
  const json& list = spec.value("pretokenizers", json::array());
  return list.is_array() && !list.empty() && list.back().is_object() &&
         list.back().value("type", json()) == "ByteLevel";
}

// A BPE over characters: no pre-tokenizer (the whole normalized text is one word, as the
// SentencePiece conversions of Llama 2 / Mistral have it) or Metaspace with split false.
void parse_char_pre_tokenizer(Impl& impl, const std::string& origin, const json& spec) {
  if (spec.is_null()) return;
  const std::string type = type_of(origin, "pre_tokenizer", spec);
  if (type != "Metaspace") {
    refuse(origin, "pre_tokenizer.type",
           fmt::format("\"{}\"; with a character (byte_fallback) BPE memtune supports null and "
                       "Metaspace; a byte-level BPE needs ByteLevel",
                       type));
  }
  check_keys(origin, "pre_tokenizer", spec, {"type", "replacement", "prepend_scheme", "split"});
  const auto replacement = spec.find("replacement");
  if (replacement == spec.end() || !replacement->is_string() ||
      replacement->get<std::string>().empty()) {
    refuse(origin, "pre_tokenizer.replacement", "expected a non-empty string");
  }
  impl.metaspace = true;
  impl.metaspace_replacement = replacement->get<std::string>();
  const std::string scheme = spec.value("prepend_scheme", std::string("always"));
  if (scheme == "always") {
    impl.metaspace_prepend = Impl::Prepend::kAlways;
  } else if (scheme == "first") {
    impl.metaspace_prepend = Impl::Prepend::kFirst;
  } else if (scheme == "never") {
    impl.metaspace_prepend = Impl::Prepend::kNever;
  } else {
    refuse(origin, "pre_tokenizer.prepend_scheme",
           fmt::format("\"{}\"; expected \"always\", \"first\" or \"never\"", scheme));
  }
  if (get_bool(origin, "pre_tokenizer", spec, "split", true)) {
    refuse(origin, "pre_tokenizer.split",
           "true is not supported (memtune reads Metaspace with split false, as the Llama/Mistral "
           "conversions write it)");
  }
}

void parse_pre_tokenizer(Impl& impl, const std::string& origin, const json& spec) {
  if (impl.kind == Impl::Kind::kCharBpe) {
    parse_char_pre_tokenizer(impl, origin, spec);
    return;
  }
  const std::string type = type_of(origin, "pre_tokenizer", spec);
  if (type == "ByteLevel") {
    if (parse_byte_level_pre_tokenizer(origin, "pre_tokenizer", spec)) {
      impl.split_regex = std::make_unique<SplitRegex>(kGpt2Pattern, origin + ": pre_tokenizer");
    }
    return;
  }
  if (type != "Sequence") {
    refuse(origin, "pre_tokenizer.type",
           fmt::format("\"{}\"; memtune supports ByteLevel, or a Sequence of a regex Split "
                       "and ByteLevel",
                       type));
  }
  check_keys(origin, "pre_tokenizer", spec, {"type", "pretokenizers"});
  const json& list = spec.value("pretokenizers", json::array());
  // The Llama 3 shape: [Split(regex, Isolated), ByteLevel(use_regex=false)]; also accepted:
  // [ByteLevel] alone.
  if (!list.is_array() || list.empty() || list.size() > 2) {
    refuse(origin, "pre_tokenizer.pretokenizers",
           "memtune supports [Split, ByteLevel] or [ByteLevel]");
  }
  const std::string last_where = fmt::format("pre_tokenizer.pretokenizers[{}]", list.size() - 1);
  if (type_of(origin, last_where, list.back()) != "ByteLevel") {
    refuse(origin, last_where + ".type", "memtune needs ByteLevel as the last pre-tokenizer");
  }
  const bool byte_level_regex = parse_byte_level_pre_tokenizer(origin, last_where, list.back());
  if (list.size() == 1) {
    if (byte_level_regex) {
      impl.split_regex = std::make_unique<SplitRegex>(kGpt2Pattern, origin + ": pre_tokenizer");
    }
    return;
  }
  if (byte_level_regex) {
    refuse(origin, last_where + ".use_regex",
           "true after a Split (two regex splits) is not supported; Llama 3 uses false");
  }
  const std::string where = "pre_tokenizer.pretokenizers[0]";
  const json& split = list[0];
  const std::string split_type = type_of(origin, where, split);
  if (split_type != "Split") {
    refuse(origin, where + ".type",
           fmt::format("\"{}\"; memtune supports Split before ByteLevel", split_type));
  }
  check_keys(origin, where, split, {"type", "pattern", "behavior", "invert"});
  if (split.value("behavior", std::string()) != "Isolated") {
    refuse(origin, where + ".behavior", "memtune supports only \"Isolated\"");
  }
  if (get_bool(origin, where, split, "invert", false)) {
    refuse(origin, where + ".invert", "true is not supported");
  }
  const auto pattern = split.find("pattern");
  if (pattern == split.end() || !pattern->is_object() || !pattern->contains("Regex") ||
      !(*pattern)["Regex"].is_string() || pattern->size() != 1) {
    refuse(origin, where + ".pattern", "memtune supports only {\"Regex\": \"...\"}");
  }
  impl.split_regex = std::make_unique<SplitRegex>((*pattern)["Regex"].get<std::string>(),
                                                  origin + ": " + where + ".pattern.Regex");
}

void parse_normalizer_step(Impl& impl, const std::string& origin, const std::string& where,
                           const json& spec) {
  const std::string type = type_of(origin, where, spec);
  using Op = Impl::NormalizerStep::Op;
  if (type == "NFC") {
    check_keys(origin, where, spec, {"type"});
    impl.normalizer.push_back({Op::kNfc, {}, {}});
  } else if (type == "Prepend") {
    check_keys(origin, where, spec, {"type", "prepend"});
    if (!spec.contains("prepend") || !spec["prepend"].is_string()) {
      refuse(origin, where + ".prepend", "expected a string");
    }
    impl.normalizer.push_back({Op::kPrepend, spec["prepend"].get<std::string>(), {}});
  } else if (type == "Replace") {
    check_keys(origin, where, spec, {"type", "pattern", "content"});
    const auto pattern = spec.find("pattern");
    if (pattern == spec.end() || !pattern->is_object() || pattern->size() != 1 ||
        !pattern->contains("String") || !(*pattern)["String"].is_string() ||
        (*pattern)["String"].get<std::string>().empty()) {
      refuse(origin, where + ".pattern",
             "memtune supports only {\"String\": \"...\"} (not empty, not a Regex)");
    }
    if (!spec.contains("content") || !spec["content"].is_string()) {
      refuse(origin, where + ".content", "expected a string");
    }
    impl.normalizer.push_back(
        {Op::kReplace, (*pattern)["String"].get<std::string>(), spec["content"].get<std::string>()});
  } else if (type == "Sequence") {
    check_keys(origin, where, spec, {"type", "normalizers"});
    const json& list = spec.value("normalizers", json::array());
    if (!list.is_array()) refuse(origin, where + ".normalizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_normalizer_step(impl, origin, fmt::format("{}.normalizers[{}]", where, i), list[i]);
    }
  } else {
    refuse(origin, where + ".type",
           fmt::format("\"{}\"; memtune supports NFC, Prepend, Replace (String) and a Sequence "
                       "of them",
                       type));
  }
}

void parse_normalizer(Impl& impl, const std::string& origin, const json& spec) {
  if (spec.is_null()) return;
  parse_normalizer_step(impl, origin, "normalizer", spec);
}

void parse_byte_level_decoder(const std::string& origin, const json& spec) {
  std::string where = "decoder";
  const json* decoder = &spec;
  if (spec.is_object() && spec.value("type", std::string()) == "Sequence") {
    const json& list = spec.value("decoders", json::array());
    if (!list.is_array() || list.size() != 1) {
      refuse(origin, "decoder.decoders", "memtune supports only a single ByteLevel decoder");
    }
    decoder = &list[0];
    where = "decoder.decoders[0]";
  }
  if (decoder->is_null() || type_of(origin, where, *decoder) != "ByteLevel") {
    refuse(origin, where, "memtune supports only the ByteLevel decoder for a byte-level BPE");
  }
  // ByteLevel's decode ignores its flags (tokenizers pre_tokenizers/byte_level.rs).
  check_keys(origin, where, *decoder, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
}

// The SentencePiece-style decoder: Sequence [Replace (String)..., ByteFallback, Fuse, Strip], in
// that order: the Replaces and ByteFallback act on each token, Fuse joins them, and Strip then
// trims the start of the whole text. Sets each token's decoded bytes.
void parse_char_decoder(Impl& impl, const std::string& origin, const json& spec) {
  if (!spec.is_object() || spec.value("type", json()) != "Sequence") {
    refuse(origin, "decoder",
           "memtune supports, for a character (byte_fallback) BPE, a Sequence of Replace, "
           "ByteFallback, Fuse and Strip");
  }
  check_keys(origin, "decoder", spec, {"type", "decoders"});
  const json& list = spec.value("decoders", json::array());
  if (!list.is_array()) refuse(origin, "decoder.decoders", "expected an array");
  std::vector<std::pair<std::string, std::string>> replaces;
  int stage = 0;  // 0: Replaces, 1: after ByteFallback, 2: after Fuse, 3: after Strip
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = fmt::format("decoder.decoders[{}]", i);
    const std::string type = type_of(origin, where, list[i]);
    const json& d = list[i];
    if (type == "Replace" && stage == 0) {
      check_keys(origin, where, d, {"type", "pattern", "content"});
      const auto pattern = d.find("pattern");
      if (pattern == d.end() || !pattern->is_object() || pattern->size() != 1 ||
          !pattern->contains("String") || !(*pattern)["String"].is_string() ||
          (*pattern)["String"].get<std::string>().empty() || !d.contains("content") ||
          !d["content"].is_string()) {
        refuse(origin, where, "memtune supports Replace of a non-empty String by a string");
      }
      replaces.emplace_back((*pattern)["String"].get<std::string>(), d["content"].get<std::string>());
    } else if (type == "ByteFallback" && stage == 0) {
      check_keys(origin, where, d, {"type"});
      impl.byte_fallback_decode = true;
      stage = 1;
    } else if (type == "Fuse" && stage <= 1) {
      check_keys(origin, where, d, {"type"});
      stage = 2;
    } else if (type == "Strip" && stage == 2) {
      check_keys(origin, where, d, {"type", "content", "start", "stop"});
      if (d.value("content", json()) != " " || !d.value("start", json()).is_number_unsigned() ||
          d.value("stop", json()) != 0) {
        refuse(origin, where, "memtune supports Strip of \" \" at the start only (stop 0)");
      }
      impl.strip_leading_spaces = d["start"].get<size_t>();
      stage = 3;
    } else {
      refuse(origin, where + ".type",
             fmt::format("\"{}\" here; memtune supports [Replace..., ByteFallback, Fuse, Strip] in "
                         "that order",
                         type));
    }
  }
  if (!impl.byte_fallback_decode) {
    refuse(origin, "decoder.decoders", "memtune needs ByteFallback for a byte_fallback BPE");
  }
  if (stage < 2) refuse(origin, "decoder.decoders", "memtune needs Fuse after ByteFallback");
  for (int32_t id = 0; id < impl.vocab_size; ++id) {
    if (!impl.id_exists[size_t(id)]) continue;
    std::string text = impl.token_text[size_t(id)];
    for (const auto& [pattern, content] : replaces) text = Impl::replace_all(text, pattern, content);
    // ByteFallback reads "<0xNN>" (two hex digits) as the byte NN.
    if (text.size() == 6 && text.starts_with("<0x") && text[5] == '>' &&
        std::isxdigit(static_cast<unsigned char>(text[3])) &&
        std::isxdigit(static_cast<unsigned char>(text[4]))) {
      impl.token_bytes[size_t(id)] = std::string(1, char(std::stoi(text.substr(3, 2), nullptr, 16)));
      impl.id_is_byte_token[size_t(id)] = 1;
    } else {
      impl.token_bytes[size_t(id)] = std::move(text);
    }
  }
}

void parse_decoder(Impl& impl, const std::string& origin, const json& spec) {
  if (impl.kind == Impl::Kind::kCharBpe) {
    parse_char_decoder(impl, origin, spec);
  } else {
    parse_byte_level_decoder(origin, spec);
  }
}

void parse_template(Impl& impl, const std::string& origin, const std::string& where,
                    const json& spec) {
  check_keys(origin, where, spec, {"type", "single", "pair", "special_tokens"});
  const json& specials = spec.value("special_tokens", json::object());
  const json& single = spec.value("single", json::array());
  if (!single.is_array()) refuse(origin, where + ".single", "expected an array");
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string item_where = fmt::format("{}.single[{}]", where, i);
    const json& item = single[i];
    if (item.is_object() && item.contains("Sequence")) {
      if (item["Sequence"].value("id", std::string()) != "A" || seen_sequence) {
        refuse(origin, item_where, "a single-sequence template must hold sequence A once");
      }
      seen_sequence = true;
      continue;
    }
    if (!item.is_object() || !item.contains("SpecialToken")) {
      refuse(origin, item_where, "expected {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    }
    const std::string name = item["SpecialToken"].value("id", std::string());
    const auto entry = specials.find(name);
    if (entry == specials.end() || !entry->contains("ids") || !(*entry)["ids"].is_array()) {
      refuse(origin, item_where,
             fmt::format("special token \"{}\" is not in {}.special_tokens", name, where));
    }
    for (const json& id : (*entry)["ids"]) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() >= impl.vocab_size || !impl.id_exists[id.get<size_t>()]) {
        refuse(origin, item_where, fmt::format("special token \"{}\" has an unknown id", name));
      }
      (seen_sequence ? impl.template_suffix : impl.template_prefix).push_back(id.get<int32_t>());
    }
  }
  if (!seen_sequence) refuse(origin, where + ".single", "the template never places sequence A");
}

void parse_post_processor(Impl& impl, const std::string& origin, const std::string& where,
                          const json& spec, bool& seen_template) {
  if (spec.is_null()) return;
  const std::string type = type_of(origin, where, spec);
  if (type == "ByteLevel") {
    // As a post-processor ByteLevel only trims offsets; ids are untouched.
    check_keys(origin, where, spec, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
  } else if (type == "TemplateProcessing") {
    if (seen_template) refuse(origin, where, "more than one TemplateProcessing");
    seen_template = true;
    parse_template(impl, origin, where, spec);
  } else if (type == "Sequence") {
    check_keys(origin, where, spec, {"type", "processors"});
    const json& list = spec.value("processors", json::array());
    for (size_t i = 0; i < list.size(); ++i) {
      parse_post_processor(impl, origin, fmt::format("{}.processors[{}]", where, i), list[i],
                           seen_template);
    }
  } else {
    refuse(origin, where + ".type",
           fmt::format("\"{}\"; memtune supports TemplateProcessing, ByteLevel and Sequence",
                       type));
  }
}

std::pair<std::string, std::string> parse_merge(const std::string& origin, size_t index,
                                                const json& merge) {
  if (merge.is_string()) {
    // "a b": byte-level tokens never hold a plain space (it is spelt U+0120), so exactly one.
    const std::string text = merge.get<std::string>();
    const size_t space = text.find(' ');
    if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos ||
        space == 0 || space + 1 == text.size()) {
      refuse(origin, fmt::format("model.merges[{}]", index),
             fmt::format("\"{}\" is not two tokens separated by one space", text));
    }
    return {text.substr(0, space), text.substr(space + 1)};
  }
  if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
    return {merge[0].get<std::string>(), merge[1].get<std::string>()};
  }
  refuse(origin, fmt::format("model.merges[{}]", index),
         "expected \"a b\" or [\"a\", \"b\"]");
}

void parse_model(Impl& impl, const std::string& origin, const json& model,
                 const json& added_tokens) {
  if (type_of(origin, "model", model) != "BPE") {
    refuse(origin, "model.type", "memtune supports only \"BPE\"");
  }
  check_keys(origin, "model", model,
             {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
              "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"});
  if (!is_null_or(model, "dropout", 0.0) && !is_null_or(model, "dropout", 0)) {
    refuse(origin, "model.dropout", "BPE dropout is random; memtune supports only null");
  }
  if (!is_null_or(model, "continuing_subword_prefix", "")) {
    refuse(origin, "model.continuing_subword_prefix", "memtune supports only null");
  }
  if (!is_null_or(model, "end_of_word_suffix", "")) {
    refuse(origin, "model.end_of_word_suffix", "memtune supports only null");
  }
  // unk_token, fuse_unk and byte_fallback only act on characters missing from the vocabulary;
  // a byte-level vocabulary (checked below) has every byte, so they never act; nor does unk in a
  // character BPE with byte fallback and every <0xNN> token (checked below).
  impl.ignore_merges = get_bool(origin, "model", model, "ignore_merges", false);
  const bool char_level = impl.kind == Impl::Kind::kCharBpe;
  if (char_level && !get_bool(origin, "model", model, "byte_fallback", false)) {
    refuse(origin, "model.byte_fallback",
           "false; without a ByteLevel pre_tokenizer memtune reads a BPE over characters, which "
           "needs byte_fallback true (characters outside the vocabulary would become unk)");
  }
  if (char_level && impl.ignore_merges) {
    refuse(origin, "model.ignore_merges", "true is supported only for a byte-level BPE");
  }

  const auto vocab_it = model.find("vocab");
  if (vocab_it == model.end() || !vocab_it->is_object()) {
    refuse(origin, "model.vocab", "expected an object of token -> id");
  }
  int64_t max_id = -1;
  for (const auto& [token, id] : vocab_it->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX / 2) {
      refuse(origin, fmt::format("model.vocab[\"{}\"]", token), "expected a non-negative id");
    }
    max_id = std::max(max_id, id.get<int64_t>());
  }
  if (!added_tokens.is_array()) refuse(origin, "added_tokens", "expected an array");
  for (const json& added : added_tokens) {
    if (!added.is_object() || !added.contains("id") || !added["id"].is_number_integer() ||
        added["id"].get<int64_t>() < 0 || added["id"].get<int64_t>() > INT32_MAX / 2) {
      refuse(origin, "added_tokens", "every added token needs a non-negative integer id");
    }
    max_id = std::max(max_id, added["id"].get<int64_t>());
  }
  impl.resize(int32_t(max_id + 1));

  for (const auto& [token, id_json] : vocab_it->items()) {
    const auto id = id_json.get<int32_t>();
    if (impl.id_exists[size_t(id)]) {
      refuse(origin, fmt::format("model.vocab[\"{}\"]", token),
             fmt::format("id {} is used twice", id));
    }
    impl.id_exists[size_t(id)] = 1;
    impl.token_text[size_t(id)] = token;
    impl.text_to_id.emplace(token, id);
    if (char_level) {
      // Decoded bytes come from the decoder (parse_char_decoder); here the one-character tokens.
      if (!token.empty()) {
        const unicode::Utf8Step step = unicode::decode_utf8_step(token);
        if (step.valid && step.length == token.size()) impl.char_ids.emplace(step.code_point, id);
      }
      continue;
    }
    // A token whose spelling is outside the byte map cannot come out of the byte-level
    // pipeline, but it still decodes: to its UTF-8, like HF's ByteLevel decoder.
    auto bytes = unicode::byte_level_to_bytes(token);
    if (bytes) {
      impl.words.add(*bytes, id);
      impl.token_bytes[size_t(id)] = std::move(*bytes);
    } else {
      impl.token_bytes[size_t(id)] = token;
    }
  }
  for (unsigned b = 0; char_level && b < 256; ++b) {
    const std::string name = fmt::format("<0x{:02X}>", b);
    const auto it = impl.text_to_id.find(name);
    if (it == impl.text_to_id.end()) {
      refuse(origin, "model.vocab",
             fmt::format("no byte-fallback token {}; memtune needs all 256", name));
    }
    impl.fallback_ids[b] = it->second;
  }
  for (unsigned b = 0; !char_level && b < 256; ++b) {
    std::string spelling;
    unicode::append_utf8(spelling, unicode::byte_to_char(uint8_t(b)));
    const auto it = impl.text_to_id.find(spelling);
    if (it == impl.text_to_id.end()) {
      refuse(origin, "model.vocab",
             fmt::format("no token for byte {:#04x} (\"{}\"); not a byte-level BPE vocabulary",
                         b, spelling));
    }
    impl.byte_ids[b] = it->second;
  }
  impl.words.build();

  const auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array()) {
    refuse(origin, "model.merges", "expected an array");
  }
  std::vector<MergeTable::Entry> entries;
  entries.reserve(merges_it->size());
  for (size_t i = 0; i < merges_it->size(); ++i) {
    const auto [left, right] = parse_merge(origin, i, (*merges_it)[i]);
    const auto left_id = impl.text_to_id.find(left);
    const auto right_id = impl.text_to_id.find(right);
    const auto merged_id = impl.text_to_id.find(left + right);
    if (left_id == impl.text_to_id.end() || right_id == impl.text_to_id.end() ||
        merged_id == impl.text_to_id.end()) {
      refuse(origin, fmt::format("model.merges[{}]", i),
             fmt::format("\"{}\" + \"{}\" names a token missing from the vocabulary", left,
                         right));
    }
    entries.push_back(MergeTable::Entry{
        (uint64_t(uint32_t(left_id->second)) << 32) | uint32_t(right_id->second), int32_t(i),
        merged_id->second});
  }
  impl.merges.build(entries);

  for (size_t i = 0; i < added_tokens.size(); ++i) {
    const std::string where = fmt::format("added_tokens[{}]", i);
    const json& added = added_tokens[i];
    check_keys(origin, where, added,
               {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
    if (!added.contains("content") || !added["content"].is_string() ||
        added["content"].get<std::string>().empty()) {
      refuse(origin, where + ".content", "expected a non-empty string");
    }
    for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
      if (get_bool(origin, where, added, flag, false)) {
        refuse(origin, fmt::format("{}.{}", where, flag),
               "true is not supported (no Llama 3, Qwen or Mistral token uses it)");
      }
    }
    const std::string content = added["content"].get<std::string>();
    unicode::check_utf8(content, fmt::format("{}: {}.content", origin, where));
    const bool special = get_bool(origin, where, added, "special", false);
    // tokenizers' AddedToken default: normalized = !special.
    const bool normalized = get_bool(origin, where, added, "normalized", !special);
    add_added_token(impl, content, added["id"].get<int32_t>(), special, normalized);
  }
}

}  // namespace

namespace {

// The chat template that transformers would use for the tokenizer in `folder`: chat_template.jinja
// (transformers >= 4.43 saves it there) over tokenizer_config.json's "chat_template", which is a
// string or a list of {"name", "template"} (the one named "default"). Empty when there is none.
std::string read_chat_template(const std::filesystem::path& folder) {
  std::error_code error;
  const auto jinja = folder / "chat_template.jinja";
  if (std::filesystem::is_regular_file(jinja, error)) return read_file(jinja);
  const auto config_path = folder / "tokenizer_config.json";
  if (!std::filesystem::is_regular_file(config_path, error)) return {};
  json config;
  try {
    config = json::parse(read_file(config_path));
  } catch (const json::exception& e) {
    mt_fail("{}: not valid JSON: {}", config_path.string(), e.what());
  }
  const json& chat = config.is_object() ? config.value("chat_template", json()) : json();
  if (chat.is_string()) return chat.get<std::string>();
  if (chat.is_array()) {
    for (const json& entry : chat) {
      if (entry.is_object() && entry.value("name", json()) == "default" &&
          entry.value("template", json()).is_string()) {
        return entry["template"].get<std::string>();
      }
    }
  }
  MT_USER_CHECK(chat.is_null(),
                "{}: \"chat_template\" is neither a string nor a list holding one named \"default\"",
                config_path.string());
  return {};
}

}  // namespace

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json) {
  std::error_code error;
  MT_USER_CHECK(std::filesystem::exists(tokenizer_json, error),
                "tokenizer file {} does not exist", tokenizer_json.string());
  Tokenizer tokenizer = from_json_text(read_file(tokenizer_json), tokenizer_json.string());
  std::string chat_template = read_chat_template(tokenizer_json.parent_path());
  if (!chat_template.empty()) {
    // The tables are shared by copies; this one is not yet shared, so it is changed in place.
    auto impl = std::const_pointer_cast<Impl>(tokenizer.impl_);
    impl->chat_template = std::move(chat_template);
  }
  return tokenizer;
}

Tokenizer Tokenizer::from_json_text(std::string_view json_text, std::string_view origin_view) {
  const std::string origin(origin_view);
  json spec;
  try {
    spec = json::parse(json_text);
  } catch (const json::exception& e) {
    mt_fail("{}: not valid JSON: {}", origin, e.what());
  }
  if (!spec.is_object()) refuse(origin, "(top level)", "expected a JSON object");
  check_keys(origin, "(top level)", spec,
             {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
              "post_processor", "decoder", "model"});
  // Truncation and padding change what HF's encode returns; memtune does both itself.
  if (!spec.value("truncation", json()).is_null()) {
    refuse(origin, "truncation", "memtune supports only null");
  }
  if (!spec.value("padding", json()).is_null()) {
    refuse(origin, "padding", "memtune supports only null");
  }
  if (!spec.contains("model")) refuse(origin, "model", "missing");

  auto impl = std::make_shared<Impl>();
  impl->kind = uses_byte_level(spec.value("pre_tokenizer", json())) ? Impl::Kind::kBpe
                                                                     : Impl::Kind::kCharBpe;
  parse_normalizer(*impl, origin, spec.value("normalizer", json()));
  parse_model(*impl, origin, spec["model"], spec.value("added_tokens", json::array()));
  parse_pre_tokenizer(*impl, origin, spec.value("pre_tokenizer", json()));
  bool seen_template = false;
  parse_post_processor(*impl, origin, "post_processor", spec.value("post_processor", json()),
                       seen_template);
  parse_decoder(*impl, origin, spec.value("decoder", json()));
  impl->resolve_special_ids(origin);
  return Tokenizer(std::move(impl));
}

}  // namespace memtune
