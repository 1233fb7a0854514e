#include "memtune/data/jsonl_dataset.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "memtune/core/error.h"
#include "memtune/ops/backend.h"

namespace memtune {
namespace {

std::vector<int32_t> id_list(const nlohmann::json& value, const char* key, int64_t vocab,
                             bool allow_ignore, const std::string& where) {
  MT_USER_CHECK(value.is_array(), "{}: \"{}\" must be an array of integers", where, key);
  std::vector<int32_t> ids;
  ids.reserve(value.size());
  for (const nlohmann::json& v : value) {
    MT_USER_CHECK(v.is_number_integer(), "{}: \"{}\" holds a non-integer {}", where, key, v.dump());
    const int64_t id = v.get<int64_t>();
    MT_USER_CHECK((id >= 0 && id < vocab) || (allow_ignore && id == -100),
                  "{}: \"{}\" holds id {} outside the model's vocabulary [0, {})", where, key, id, vocab);
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

}  // namespace

Dataset read_jsonl_dataset(const std::filesystem::path& path, const Tokenizer& tokenizer,
                           int64_t vocab_size, BadLinePolicy policy) {
  std::ifstream in(path);
  MT_USER_CHECK(in.good(), "cannot open dataset {}", path.string());
  MT_USER_CHECK(tokenizer.vocab_size() <= vocab_size,
                "the tokenizer has {} ids but the model's vocabulary has only {}",
                tokenizer.vocab_size(), vocab_size);
  Dataset dataset;
  std::string line;
  int64_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", path.string(), line_number);
    try {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      MT_USER_CHECK(!j.is_discarded() && j.is_object(), "{}: not a JSON object", where);
      Sample sample;
      if (j.contains("input_ids")) {
        sample.input_ids = id_list(j["input_ids"], "input_ids", vocab_size, false, where);
        sample.labels = j.contains("labels") ? id_list(j["labels"], "labels", vocab_size, true, where)
                                             : sample.input_ids;
        MT_USER_CHECK(sample.labels.size() == sample.input_ids.size(),
                      "{}: \"labels\" has {} entries, \"input_ids\" {}", where,
                      sample.labels.size(), sample.input_ids.size());
      } else if (j.contains("text")) {
        MT_USER_CHECK(j["text"].is_string(), "{}: \"text\" must be a string", where);
        sample.input_ids = tokenizer.encode(j["text"].get<std::string>());
        sample.labels = sample.input_ids;
      } else {
        mt_fail("{}: expected {{\"input_ids\": [...]}} or {{\"text\": \"...\"}}", where);
      }
      MT_USER_CHECK(sample.input_ids.size() >= 2, "{}: a sample needs at least 2 tokens", where);
      dataset.samples.push_back(std::move(sample));
    } catch (const Error& e) {
      if (policy == BadLinePolicy::error) throw;
      ++dataset.skipped_lines;
    }
  }
  MT_USER_CHECK(!dataset.samples.empty(), "dataset {} holds no samples", path.string());
  return dataset;
}

Dataset synthetic_dataset(int64_t samples, int64_t seq, int64_t vocab_size, uint64_t seed) {
  Dataset dataset;
  for (int64_t s = 0; s < samples; ++s) {
    Sample sample;
    for (int64_t t = 0; t < seq; ++t)
      sample.input_ids.push_back(static_cast<int32_t>(
          dropout_hash(seed, static_cast<uint64_t>(s * seq + t)) % static_cast<uint64_t>(vocab_size)));
    sample.labels = sample.input_ids;
    dataset.samples.push_back(std::move(sample));
  }
  return dataset;
}

}  // namespace memtune
