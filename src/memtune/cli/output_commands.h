// merge, generate, logits: what a trained adapter is for. The options of the three commands and
// their handlers, apart from the training commands in main.cpp.
#pragma once

#include <cstdint>
#include <string>

namespace memtune {

struct OutputCommandOptions {
  std::string model = "tiny", adapter, out, dtype = "auto", max_shard_size = "5GB";
  std::string prompt, input_ids, system, tokenizer, device = "auto";
  bool chat = false, json = false, load_in_4bit = false;
  int64_t max_new_tokens = 128;
  double temperature = 0.0, top_p = 1.0;
  uint64_t seed = 42;
};

int run_merge(const OutputCommandOptions& o);
int run_generate(const OutputCommandOptions& o);
int run_logits(const OutputCommandOptions& o);

}  // namespace memtune
