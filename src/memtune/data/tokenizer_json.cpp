// Reading tokenizer.json into the BPE model (tokenizer_model.h): every field is looked at.
// Facts used, with where they were read:
//  - tokenizer.json layout and semantics: huggingface/tokenizers, tokenizers/src (models/bpe,
//    pre_tokenizers/{split,byte_level,sequence}.rs, processors/template.rs,
//    tokenizer/added_vocabulary.rs). Checked against `tokenizers` 0.23 by the fixtures of
//    tools/make_tokenizer_fixtures.py.
//  - The Llama 3 split regex and the special ids: SPECS.md section 6.
//  - GPT-2's split regex (ByteLevel with use_regex true): tokenizers
//    pre_tokenizers/byte_level.rs, the same as openai/gpt-2 encoder.py.
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
  auto bytes = unicode::byte_level_to_bytes(content);
  impl.token_bytes[size_t(id)] = bytes ? *bytes : std::string(content);
  impl.id_exists[size_t(id)] = 1;
  impl.id_special[size_t(id)] = special ? 1 : 0;
  impl.text_to_id[std::string(content)] = id;
  (normalized ? impl.normalized_added : impl.literal_added).add(content, id);
}

void parse_pre_tokenizer(Impl& impl, const std::string& origin, const json& spec) {
  if (spec.is_null()) {
    refuse(origin, "pre_tokenizer",
           "null; memtune needs the ByteLevel pre-tokenizer of a byte-level BPE");
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

void parse_normalizer(const std::string& origin, const json& spec) {
  if (spec.is_null()) return;
  // An empty Sequence changes nothing.
  if (spec.is_object() && spec.value("type", std::string()) == "Sequence" &&
      spec.value("normalizers", json::array()).empty()) {
    return;
  }
  refuse(origin, "normalizer", "memtune supports only null (Llama 3 has no normalizer)");
}

void parse_decoder(const std::string& origin, const json& spec) {
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
    refuse(origin, where, "memtune supports only the ByteLevel decoder");
  }
  // ByteLevel's decode ignores its flags (tokenizers pre_tokenizers/byte_level.rs).
  check_keys(origin, where, *decoder, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
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
  // a byte-level vocabulary (checked below) has every byte, so they never act.
  impl.ignore_merges = get_bool(origin, "model", model, "ignore_merges", false);

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
  for (unsigned b = 0; b < 256; ++b) {
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
               "true is not supported (no Llama 3 token uses it)");
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

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json) {
  std::error_code error;
  MT_USER_CHECK(std::filesystem::exists(tokenizer_json, error),
                "tokenizer file {} does not exist", tokenizer_json.string());
  return from_json_text(read_file(tokenizer_json), tokenizer_json.string());
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
  impl->kind = Impl::Kind::kBpe;
  parse_normalizer(origin, spec.value("normalizer", json()));
  parse_model(*impl, origin, spec["model"], spec.value("added_tokens", json::array()));
  parse_pre_tokenizer(*impl, origin, spec.value("pre_tokenizer", json()));
  bool seen_template = false;
  parse_post_processor(*impl, origin, "post_processor", spec.value("post_processor", json()),
                       seen_template);
  parse_decoder(origin, spec.value("decoder", json()));
  impl->resolve_special_ids(origin);
  return Tokenizer(std::move(impl));
}

}  // namespace memtune
