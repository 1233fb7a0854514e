// Training data from JSON lines: {"input_ids": [...], "labels": [...]} (labels optional, -100
// masks a position), or {"text": "..."} through a tokenizer.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "memtune/data/tokenizer.h"

namespace memtune {

struct Sample {
  std::vector<int32_t> input_ids, labels;
};

enum class BadLinePolicy { error, skip };

struct Dataset {
  std::vector<Sample> samples;
  int64_t skipped_lines = 0;
};

// Throws memtune::Error naming file:line for a malformed line (policy error), an empty
// dataset, or token ids outside [0, vocab_size).
Dataset read_jsonl_dataset(const std::filesystem::path& path, const Tokenizer& tokenizer,
                           int64_t vocab_size, BadLinePolicy policy = BadLinePolicy::error);

// Random token sequences (seeded) for runs without data: memory and speed do not depend on
// the token values.
Dataset synthetic_dataset(int64_t samples, int64_t seq, int64_t vocab_size, uint64_t seed);

}  // namespace memtune
