#include "memtune/data/jsonl_dataset.h"

#include "memtune/data/sft_dataset.h"
#include "memtune/ops/backend.h"

namespace memtune {

Dataset read_jsonl_dataset(const std::filesystem::path& path, const Tokenizer& tokenizer,
                           int64_t vocab_size, BadLinePolicy policy) {
  DatasetOptions options;
  options.on_bad_line = policy;
  return read_dataset(path, tokenizer, vocab_size, options);
}

Dataset synthetic_dataset(int64_t samples, int64_t seq, int64_t vocab_size, uint64_t seed) {
  Dataset dataset;
  for (int64_t s = 0; s < samples; ++s) {
    Sample sample;
    for (int64_t t = 0; t < seq; ++t)
      sample.input_ids.push_back(static_cast<int32_t>(
          dropout_hash(seed, static_cast<uint64_t>(s * seq + t)) % static_cast<uint64_t>(vocab_size)));
    sample.labels = sample.input_ids;
    dataset.stats.tokens += seq;
    dataset.stats.trained_targets += seq - 1;
    dataset.samples.push_back(std::move(sample));
  }
  return dataset;
}

}  // namespace memtune
