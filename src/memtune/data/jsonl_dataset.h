// Training data from JSON lines. A file holds one of four forms, detected from its first good
// line (sft_dataset.h describes the forms, their labels and their BOS/EOS handling):
//   {"input_ids": [...], "labels": [...]}   pre-tokenized (labels optional; -100 masks)
//   {"text": "..."}                          language modelling: every token trained
//   {"prompt": "...", "completion": "..."}   completion-only loss (TRL completion_only_loss)
//   {"messages": [{"role", "content"}, ...]} Llama 3 chat template, assistant turns trained
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "memtune/data/tokenizer.h"

namespace memtune {

struct Sample {
  std::vector<int32_t> input_ids, labels;  // labels[t] is the label OF token t (-100: none)
};

enum class BadLinePolicy { error, skip };

enum class DatasetFormat { token_ids, text, prompt_completion, messages };
std::string_view dataset_format_name(DatasetFormat format);

// What reading a file did, for the run's report: nothing is dropped silently.
struct DatasetStats {
  int64_t lines = 0;                 // non-blank lines
  int64_t skipped_bad_lines = 0;     // malformed lines skipped under BadLinePolicy::skip
  int64_t skipped_fully_masked = 0;  // samples with no trained target, skipped
  int64_t truncated_samples = 0;     // samples cut to max_seq_length
  int64_t truncated_tokens = 0;      // tokens those cuts dropped
  int64_t tokens = 0;                // tokens kept
  int64_t trained_targets = 0;       // kept tokens t >= 1 whose label is not -100
  std::string first_skipped_line;    // "file:line: reason" of the first skipped bad line
};

struct Dataset {
  std::vector<Sample> samples;
  DatasetFormat format = DatasetFormat::token_ids;
  DatasetStats stats;
};

// read_dataset (sft_dataset.h) with its defaults: no truncation, completion-only and
// assistant-only loss. Throws memtune::Error naming file:line for a malformed line (policy
// error), an empty dataset, or token ids outside [0, vocab_size).
Dataset read_jsonl_dataset(const std::filesystem::path& path, const Tokenizer& tokenizer,
                           int64_t vocab_size, BadLinePolicy policy = BadLinePolicy::error);

// Random token sequences (seeded) for runs without data: memory and speed do not depend on
// the token values.
Dataset synthetic_dataset(int64_t samples, int64_t seq, int64_t vocab_size, uint64_t seed);

}  // namespace memtune
