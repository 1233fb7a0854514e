// Shared pieces of the engine-level tests (tests/train and tests/gpu): a small model, a small
// run, and seeded micro-batches with some padding, the same on every backend.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <vector>

#include "memtune/data/jsonl_dataset.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/train/engine.h"
#include "memtune/train/engine_arena.h"

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

// Samples of the given lengths with seeded ids below small_model()'s vocabulary; every third one
// has a 2-token prompt (labels -100).
inline Dataset seeded_dataset(const std::vector<int>& lengths, uint64_t seed) {
  Dataset data;
  for (size_t i = 0; i < lengths.size(); ++i) {
    Sample s;
    for (int t = 0; t < lengths[i]; ++t)
      s.input_ids.push_back(static_cast<int32_t>(dropout_hash(seed, i * 1000 + t) % 300));
    s.labels = s.input_ids;
    if (i % 3 == 0) s.labels[0] = s.labels[1] = -100;
    data.samples.push_back(std::move(s));
  }
  return data;
}

// Seeded base (7) and PEFT adapters (11), then a non-zero B (normal 0.05, seed 3) so that every
// adapter gradient is non-zero from the first step.
inline void init_with_nonzero_b(Engine& engine) {
  engine.init_random_weights(7);
  engine.init_adapters(11);
  for (const LoraTensors& t : engine.lora().tensors())
    engine.backend().fill_random(t.b, Backend::Distribution::normal, 0.0f, 0.05f, 3);
  engine.lora().sync_compute_copies(engine.backend());
}

// One seeded train step and one eval on a planned engine; then the real run's allocations are the
// plan's: the same sequence, at the same offsets, with the same peak.
inline void expect_step_follows_plan(PlannedEngine& engine, const LlamaConfig& model, const RunConfig& run) {
  engine->init_random_weights(1);
  engine->init_adapters(2);
  engine->train_step(random_batches(model, run, 1, 3));
  engine->eval_loss_sum(random_batches(model, run, 1, 4)[0]);
  EXPECT_EQ(engine->memory().verify_against(engine.plan().records), "");
  EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes);
}

// A tensor's values as f32 on the host, whatever its dtype.
inline std::vector<float> host_floats(Backend& backend, const Tensor& t) {
  std::vector<float> f32(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::f32) {
    backend.copy_to_host(f32.data(), t);
  } else {
    std::vector<uint8_t> raw(t.nbytes());
    backend.copy_to_host(raw.data(), t);
    for (int64_t i = 0; i < t.numel(); ++i) f32[static_cast<size_t>(i)] = load_as_f32(raw.data(), t.dtype, i);
  }
  return f32;
}

// The two tensors of every adapter (picked by `pick`), in LoraState order, end to end.
template <typename Pick>
std::vector<float> adapter_floats(Engine& engine, Pick pick) {
  std::vector<float> out;
  for (const LoraTensors& t : engine.lora().tensors())
    for (const Tensor* p : pick(t))
      for (float v : host_floats(engine.backend(), *p)) out.push_back(v);
  return out;
}

// Every adapter's A then B (the fp32 masters), in LoraState order, end to end.
inline std::vector<float> adapter_values(Engine& engine) {
  return adapter_floats(engine, [](const LoraTensors& t) { return std::array{&t.a, &t.b}; });
}

// Every adapter's grad of A then of B, in LoraState order, end to end.
inline std::vector<float> adapter_grads(Engine& engine) {
  return adapter_floats(engine, [](const LoraTensors& t) { return std::array{&t.grad_a, &t.grad_b}; });
}

// ||a - b|| / ||b||.
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    r += double(b[i]) * b[i];
  }
  return std::sqrt(d / r);
}

}  // namespace memtune::enginetest
