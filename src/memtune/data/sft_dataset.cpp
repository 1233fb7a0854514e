#include "memtune/data/sft_dataset.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "memtune/core/enum_names.h"
#include "memtune/core/error.h"
#include "memtune/data/unicode_bytes.h"
#include "memtune/io/json_util.h"

namespace memtune {
namespace {

constexpr int32_t kIgnore = -100;

// A line of another form than the file's: never skipped as a bad line.
struct MixedFormsError : Error {
  using Error::Error;
};

std::string_view form_spelling(DatasetFormat format) {
  switch (format) {
    case DatasetFormat::token_ids: return R"({"input_ids", "labels"})";
    case DatasetFormat::text: return R"({"text"})";
    case DatasetFormat::prompt_completion: return R"({"prompt", "completion"})";
    case DatasetFormat::messages: return R"({"messages"})";
  }
  return "?";
}

// TRL's precedence: pre-tokenized data is used as given; then conversational; then a
// "prompt" makes it prompt-completion; else language modelling.
std::optional<DatasetFormat> detect_format(const nlohmann::json& line) {
  if (line.contains("input_ids")) return DatasetFormat::token_ids;
  if (line.contains("messages")) return DatasetFormat::messages;
  if (line.contains("prompt") || line.contains("completion")) return DatasetFormat::prompt_completion;
  if (line.contains("text")) return DatasetFormat::text;
  return std::nullopt;
}

std::vector<int32_t> id_list(const nlohmann::json& value, const char* key, int64_t vocab,
                             bool allow_ignore, const std::string& where) {
  MT_USER_CHECK(value.is_array(), "{}: \"{}\" must be an array of integers", where, key);
  std::vector<int32_t> ids;
  ids.reserve(value.size());
  for (const nlohmann::json& v : value) {
    MT_USER_CHECK(v.is_number_integer(), "{}: \"{}\" holds a non-integer {}", where, key, v.dump());
    const int64_t id = v.get<int64_t>();
    MT_USER_CHECK((id >= 0 && id < vocab) || (allow_ignore && id == kIgnore),
                  "{}: \"{}\" holds id {} outside the model's vocabulary [0, {})", where, key, id, vocab);
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

const std::string& string_field(const nlohmann::json& line, const char* key, const std::string& where) {
  MT_USER_CHECK(line.contains(key), "{}: missing \"{}\"", where, key);
  MT_USER_CHECK(line[key].is_string(), "{}: \"{}\" must be a string, not {}", where, key, line[key].type_name());
  return line[key].get_ref<const std::string&>();
}

std::vector<ChatMessage> messages_field(const nlohmann::json& line, const std::string& where) {
  const nlohmann::json& list = line["messages"];
  MT_USER_CHECK(list.is_array() && !list.empty(), "{}: \"messages\" must be a non-empty array", where);
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string at = fmt::format("{}: messages[{}]", where, i);
    MT_USER_CHECK(list[i].is_object(), "{} must be an object with \"role\" and \"content\"", at);
    messages.push_back({string_field(list[i], "role", at), string_field(list[i], "content", at)});
  }
  return messages;
}

Sample sample_from_line(const nlohmann::json& line, DatasetFormat format, const Tokenizer& tokenizer,
                        int64_t vocab_size, const DatasetOptions& options, int32_t eos_id,
                        const std::string& where) {
  switch (format) {
    case DatasetFormat::token_ids: {
      Sample sample;
      sample.input_ids = id_list(line["input_ids"], "input_ids", vocab_size, false, where);
      sample.labels = line.contains("labels") ? id_list(line["labels"], "labels", vocab_size, true, where)
                                              : sample.input_ids;
      MT_USER_CHECK(sample.labels.size() == sample.input_ids.size(),
                    "{}: \"labels\" has {} entries, \"input_ids\" {}", where, sample.labels.size(),
                    sample.input_ids.size());
      return sample;
    }
    case DatasetFormat::text:
      return encode_text_sample(tokenizer, string_field(line, "text", where), eos_id);
    case DatasetFormat::prompt_completion:
      return encode_prompt_completion_sample(tokenizer, string_field(line, "prompt", where),
                                             string_field(line, "completion", where), eos_id,
                                             options.completion_only_loss);
    case DatasetFormat::messages:
      return encode_messages_sample(tokenizer, messages_field(line, where), options.assistant_only_loss);
  }
  mt_fail("{}: unknown dataset form", where);
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

constexpr EnumName<DatasetFormat> kDatasetFormatNames[] = {
    {DatasetFormat::token_ids, "input_ids"}, {DatasetFormat::text, "text"},
    {DatasetFormat::prompt_completion, "prompt-completion"}, {DatasetFormat::messages, "messages"}};

std::string_view dataset_format_name(DatasetFormat format) { return name_of(kDatasetFormatNames, format); }

Sample encode_text_sample(const Tokenizer& tokenizer, std::string_view text, int32_t eos_id) {
  Sample sample;
  sample.input_ids = tokenizer.encode(text);
  // TRL appends the eos_token text unless the text ends with it; as an added token it always
  // becomes exactly this one id, so appending the id is the same.
  if (sample.input_ids.empty() || sample.input_ids.back() != eos_id) sample.input_ids.push_back(eos_id);
  sample.labels = sample.input_ids;
  return sample;
}

Sample encode_prompt_completion_sample(const Tokenizer& tokenizer, std::string_view prompt,
                                       std::string_view completion, int32_t eos_id,
                                       bool completion_only_loss) {
  const size_t prompt_tokens = tokenizer.encode(prompt).size();
  std::string whole(prompt);
  whole += completion;
  Sample sample = encode_text_sample(tokenizer, whole, eos_id);
  if (completion_only_loss)
    std::fill_n(sample.labels.begin(), std::min(prompt_tokens, sample.labels.size()), kIgnore);
  return sample;
}

Sample encode_messages_sample(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages,
                              bool assistant_only_loss) {
  ChatEncoding chat = encode_chat(tokenizer, messages);
  Sample sample;
  sample.labels = chat.ids;
  if (assistant_only_loss)
    for (size_t t = 0; t < chat.ids.size(); ++t)
      if (chat.assistant_mask[t] == 0) sample.labels[t] = kIgnore;
  sample.input_ids = std::move(chat.ids);
  return sample;
}

int64_t trained_targets(const Sample& sample) {
  int64_t count = 0;
  for (size_t t = 1; t < sample.labels.size(); ++t) count += sample.labels[t] != kIgnore;
  return count;
}

void check_tokenizer_fits_model(const Tokenizer& tokenizer, int64_t vocab_size) {
  MT_USER_CHECK(tokenizer.vocab_size() <= vocab_size,
                "the tokenizer has {} ids (max id + 1) but the model's vocab_size is {}: ids {}..{} "
                "would index past the embedding table; use the model's own tokenizer",
                tokenizer.vocab_size(), vocab_size, vocab_size, tokenizer.vocab_size() - 1);
}

std::optional<int32_t> eos_id_from_tokenizer_config(const std::filesystem::path& tokenizer_json,
                                                    const Tokenizer& tokenizer) {
  const std::filesystem::path config_path = tokenizer_json.parent_path() / "tokenizer_config.json";
  std::ifstream in(config_path);
  if (!in.good()) return std::nullopt;
  const nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  MT_USER_CHECK(!config.is_discarded() && config.is_object(), "{} is not a JSON object", config_path.string());
  if (!config.contains("eos_token") || config["eos_token"].is_null()) return std::nullopt;
  const nlohmann::json& eos = config["eos_token"];
  std::string content;
  if (eos.is_string()) content = eos.get<std::string>();
  else if (eos.is_object() && eos.contains("content") && eos["content"].is_string()) content = eos["content"].get<std::string>();
  else mt_fail("{}: \"eos_token\" must be a string or {{\"content\": ...}}", config_path.string());
  const std::optional<int32_t> id = tokenizer.token_to_id(content);
  MT_USER_CHECK(id.has_value(), "{}: eos_token \"{}\" is not a token of {}", config_path.string(), content,
                tokenizer_json.string());
  return id;
}

Dataset read_dataset(const std::filesystem::path& path, const Tokenizer& tokenizer, int64_t vocab_size,
                     const DatasetOptions& options) {
  MT_USER_CHECK(!std::filesystem::is_directory(path), "cannot open dataset {}: it is a directory", path.string());
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) {
    const int open_errno = errno;
    mt_fail("cannot open dataset {}: {}", path.string(), std::strerror(open_errno));
  }
  return read_dataset(in, path.string(), tokenizer, vocab_size, options);
}

Dataset read_dataset(std::istream& in, const std::string& name, const Tokenizer& tokenizer, int64_t vocab_size,
                     const DatasetOptions& options) {
  check_tokenizer_fits_model(tokenizer, vocab_size);
  const int32_t eos_id = options.eos_id.value_or(tokenizer.eos_id());
  Dataset dataset;
  DatasetStats& stats = dataset.stats;
  std::optional<DatasetFormat> format;
  int64_t format_line = 0;
  std::string line;
  int64_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++stats.lines;
    const std::string where = fmt::format("{}:{}", name, line_number);
    try {
      if (const auto bad = unicode::find_invalid_utf8(line))
        mt_fail("{}: invalid UTF-8 (byte 0x{:02X} at offset {} of the line); JSON text must be UTF-8, "
                "and HF datasets rejects such a file too",
                where, static_cast<uint8_t>(line[*bad]), *bad);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        // parse_error, and out_of_range for a number too large for a double ("3e513": found by
        // fuzz/fuzz_dataset.cpp).
        mt_fail("{}: not valid JSON ({})", where, json_exception_reason(e));
      }
      MT_USER_CHECK(j.is_object(), "{}: not a JSON object", where);
      const std::optional<DatasetFormat> line_format = detect_format(j);
      MT_USER_CHECK(line_format.has_value(),
                    "{}: expected one of {{\"text\"}}, {{\"prompt\", \"completion\"}}, {{\"messages\"}} "
                    "or {{\"input_ids\"}}",
                    where);
      if (format.has_value() && *line_format != *format) {
        // Not a bad line to skip: the file itself mixes forms.
        throw MixedFormsError(fmt::format(
            "{}: a {} line, but line {} made this a {} dataset; one file holds one form", where,
            form_spelling(*line_format), format_line, form_spelling(*format)));
      }
      Sample sample = sample_from_line(j, *line_format, tokenizer, vocab_size, options, eos_id, where);
      MT_USER_CHECK(sample.input_ids.size() >= 2, "{}: a sample needs at least 2 tokens, this one has {}", where,
                    sample.input_ids.size());
      if (!format.has_value()) {
        format = line_format;
        format_line = line_number;
      }
      const int64_t length = static_cast<int64_t>(sample.input_ids.size());
      if (options.max_seq_length > 0 && length > options.max_seq_length) {
        ++stats.truncated_samples;
        stats.truncated_tokens += length - options.max_seq_length;
        sample.input_ids.resize(options.max_seq_length);
        sample.labels.resize(options.max_seq_length);
      }
      const int64_t targets = trained_targets(sample);
      if (targets == 0) {
        ++stats.skipped_fully_masked;
        continue;
      }
      stats.tokens += static_cast<int64_t>(sample.input_ids.size());
      stats.trained_targets += targets;
      dataset.samples.push_back(std::move(sample));
    } catch (const MixedFormsError&) {
      throw;
    } catch (const Error& e) {
      if (options.on_bad_line == BadLinePolicy::error) throw;
      if (stats.skipped_bad_lines++ == 0) stats.first_skipped_line = e.what();
    }
  }
  if (in.bad()) {
    const int read_errno = errno;
    mt_fail("reading dataset {} failed: {}", name, std::strerror(read_errno));
  }
  dataset.format = format.value_or(DatasetFormat::token_ids);
  if (dataset.samples.empty()) {
    MT_USER_CHECK(stats.skipped_fully_masked == 0,
                  "every sample of {} ({}) has all its labels masked (-100){}: nothing to train on",
                  name, stats.skipped_fully_masked,
                  options.max_seq_length > 0 ? fmt::format(" after truncation to max_seq_length {}", options.max_seq_length)
                                             : std::string());
    mt_fail("dataset {} holds no samples ({} lines, {} skipped as malformed{}{})", name, stats.lines,
            stats.skipped_bad_lines, stats.skipped_bad_lines > 0 ? "; first: " : "", stats.first_skipped_line);
  }
  return dataset;
}

std::vector<uint32_t> seeded_permutation(size_t n, uint64_t seed) {
  std::vector<uint32_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<uint32_t>(i);
  uint64_t state = seed;
  for (size_t i = n; i > 1; --i) {  // Fisher-Yates, with a multiply-shift bounded draw
    const uint64_t j = static_cast<uint64_t>((static_cast<unsigned __int128>(splitmix64(state)) * i) >> 64);
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

DatasetSplit split_dataset(const Dataset& data, double eval_fraction, uint64_t seed) {
  MT_USER_CHECK(eval_fraction > 0 && eval_fraction < 1, "--eval_split {}: expected a fraction in (0, 1)", eval_fraction);
  const size_t n = data.samples.size();
  const size_t eval_count = static_cast<size_t>(std::ceil(eval_fraction * static_cast<double>(n)));
  MT_USER_CHECK(eval_count < n, "--eval_split {} of {} samples leaves none to train on", eval_fraction, n);
  std::vector<bool> to_eval(n, false);
  const std::vector<uint32_t> order = seeded_permutation(n, seed ^ 0x5eed5eed5eed5eedull);
  for (size_t i = 0; i < eval_count; ++i) to_eval[order[i]] = true;
  DatasetSplit split;
  for (Dataset* part : {&split.train, &split.eval}) part->format = data.format;
  split.train.stats = data.stats;  // what reading the file did belongs to the file
  for (size_t i = 0; i < n; ++i) {
    Dataset& part = to_eval[i] ? split.eval : split.train;
    part.samples.push_back(data.samples[i]);
  }
  for (Dataset* part : {&split.train, &split.eval}) {
    part->stats.tokens = part->stats.trained_targets = 0;
    for (const Sample& s : part->samples) {
      part->stats.tokens += static_cast<int64_t>(s.input_ids.size());
      part->stats.trained_targets += trained_targets(s);
    }
  }
  return split;
}

uint64_t dataset_fingerprint(const Dataset& data) {
  uint64_t hash = 0xcbf29ce484222325ull;
  auto mix = [&hash](uint64_t value) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (value >> (8 * byte)) & 0xff;
      hash *= 0x100000001b3ull;
    }
  };
  mix(data.samples.size());
  for (const Sample& s : data.samples) {
    mix(s.input_ids.size());
    for (int32_t id : s.input_ids) mix(static_cast<uint32_t>(id));
    for (int32_t label : s.labels) mix(static_cast<uint32_t>(label));
  }
  return hash;
}

std::string dataset_summary(std::string_view name, const Dataset& data, int64_t max_seq_length) {
  const DatasetStats& s = data.stats;
  std::string out = fmt::format("data: {}: {} samples ({}), {} tokens, {} trained targets", name,
                                data.samples.size(), dataset_format_name(data.format), s.tokens, s.trained_targets);
  out += fmt::format("; {} truncated to max_seq_length {} ({} tokens dropped)", s.truncated_samples,
                     max_seq_length, s.truncated_tokens);
  if (s.skipped_fully_masked > 0)
    out += fmt::format("; {} skipped with every label masked", s.skipped_fully_masked);
  if (s.skipped_bad_lines > 0)
    out += fmt::format("; {} bad line{} skipped (first: {})", s.skipped_bad_lines, s.skipped_bad_lines == 1 ? "" : "s",
                       s.first_skipped_line);
  return out;
}

}  // namespace memtune
