// Shared pieces of the engine-level tests (tests/train and tests/gpu): a small model, a small
// run, and seeded micro-batches with some padding, the same on every backend.
#pragma once

#include <vector>

#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/train/engine.h"

namespace memtune::enginetest {

// The tiny preset cut to 2 layers and a 300-token vocabulary: a whole step takes milliseconds.
inline LlamaConfig small_model() {
  LlamaConfig c = resolve_model("tiny").config;
  c.num_hidden_layers = 2;
  c.vocab_size = 300;
  return c;
}

// Micro-batch 2 x seq 24, LoRA r 4 alpha 8, fp32, a learning rate that moves the adapters.
inline RunConfig small_run() {
  RunConfig run;
  run.per_device_train_batch_size = 2;
  run.max_seq_length = 24;
  run.lora_r = 4;
  run.lora_alpha = 8;
  run.learning_rate = 1e-2;
  return run;
}

// `count` micro-batches of seeded ids; row r is `r * padding_step` tokens shorter than the
// sequence, so that padding and ignored targets are exercised.
inline std::vector<HostMicroBatch> random_batches(const LlamaConfig& model, const RunConfig& run, int count,
                                                  uint64_t seed, int64_t padding_step = 5) {
  std::vector<HostMicroBatch> out;
  for (int m = 0; m < count; ++m) {
    std::vector<std::vector<int32_t>> ids(run.per_device_train_batch_size);
    for (size_t r = 0; r < ids.size(); ++r) {
      const int64_t len = run.max_seq_length - static_cast<int64_t>(r) * padding_step;
      for (int64_t t = 0; t < len; ++t)
        ids[r].push_back(static_cast<int32_t>(dropout_hash(seed, m * 10000 + r * 100 + t) % model.vocab_size));
    }
    out.push_back(make_micro_batch(ids, ids, run.max_seq_length));
  }
  return out;
}

}  // namespace memtune::enginetest
