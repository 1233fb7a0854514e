// --stream_layers (RunConfig::stream_layers): some frozen decoder layers kept in host memory and
// copied into one of two device buffers just before each visit (parallel/sharded_base.h,
// streamed_base_layout). The step must compute exactly what it computes with the whole base
// resident (bit for bit: the same bytes are read, only from another buffer), the plan must hold
// the resident units, the two buffers and nothing of the streamed layers on the device, and the
// streamed layers' bytes must be in the plan's host memory.
#include <gtest/gtest.h>

#include "memtune/core/error.h"
#include "memtune/parallel/sharded_base.h"
#include "memtune/plan/plan_report.h"
#include "../support/engine_setup.h"

using namespace memtune;
using namespace memtune::enginetest;

namespace {

LlamaConfig layers_model(int layers) {
  LlamaConfig c = small_model();
  c.num_hidden_layers = layers;
  return c;
}

struct Variant {
  const char* name;
  bool four_bit, checkpointing, offload;  // offload: the activations and the embedding table
  int64_t token_chunks;
  bool tied = false;
};

RunConfig run_of(const Variant& v) {
  RunConfig run = small_run();
  run.load_in_4bit = v.four_bit;
  run.gradient_checkpointing = v.checkpointing;
  run.offload_activations = v.offload;
  run.offload_embeddings = v.offload;
  run.mlp_chunk_tokens = v.token_chunks;
  run.lora_dropout = 0.1;  // the dropout masks must not move with the base's buffers either
  return run;
}

struct Outcome {
  std::vector<double> losses;
  std::vector<float> first_grads, adapters;
  double eval_loss = 0;
};

// Two steps of two micro-batches (accumulation) and an eval, on the CPU backend; the engine's
// high water must be its plan's arena.
Outcome train(const LlamaConfig& model, const RunConfig& run) {
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  EXPECT_EQ(engine->base_streamed(), run.stream_layers > 0);
  EXPECT_FALSE(engine->base_sharded());
  init_with_nonzero_b(engine.engine());
  Outcome out;
  for (int s = 0; s < 2; ++s) {
    out.losses.push_back(engine->train_step(random_batches(model, run, 2, 50 + s)).loss);
    if (s == 0) out.first_grads = adapter_grads(engine.engine());
  }
  out.adapters = adapter_values(engine.engine());
  out.eval_loss = engine->eval_loss_sum(random_batches(model, run, 1, 60)[0]).first;
  EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes);
  return out;
}

void expect_streamed_equals_resident(const Variant& v) {
  LlamaConfig model = layers_model(4);
  model.tie_word_embeddings = v.tied;
  RunConfig run = run_of(v);
  const Outcome resident = train(model, run);
  ASSERT_GT(resident.losses[0], 0.0);
  for (int64_t streamed : {1, 2, 3}) {
    SCOPED_TRACE(std::string(v.name) + ", " + std::to_string(streamed) + " of 4 layers streamed");
    run.stream_layers = streamed;
    const Outcome got = train(model, run);
    EXPECT_EQ(got.losses, resident.losses);
    EXPECT_EQ(got.first_grads, resident.first_grads);
    EXPECT_EQ(got.adapters, resident.adapters);
    EXPECT_EQ(got.eval_loss, resident.eval_loss);
  }
}

}  // namespace

TEST(StreamedLayers, TheChoiceSpreadsTheLayersEvenlyAndKeepsOneResident) {
  EXPECT_EQ(streamed_layer_choice(32, 5), (std::vector<int>{3, 9, 16, 22, 28}));
  EXPECT_EQ(streamed_layer_choice(32, 1), (std::vector<int>{16}));
  EXPECT_EQ(streamed_layer_choice(4, 3), (std::vector<int>{0, 2, 3}));
  EXPECT_TRUE(streamed_layer_choice(32, 0).empty());
  for (int layers : {2, 3, 32, 80})
    for (int count = 1; count < layers; ++count) {
      const std::vector<int> chosen = streamed_layer_choice(layers, count);
      ASSERT_EQ(static_cast<int>(chosen.size()), count);
      for (size_t i = 0; i < chosen.size(); ++i) {
        EXPECT_GE(chosen[i], 0);
        EXPECT_LT(chosen[i], layers);
        if (i > 0) EXPECT_GT(chosen[i], chosen[i - 1]) << layers << " layers, " << count << " streamed";
      }
    }
  EXPECT_THROW(streamed_layer_choice(4, 4), Error);
  EXPECT_THROW(streamed_layer_choice(4, -1), Error);
}

TEST(StreamedLayers, Fp32StepEqualsTheResidentBaseBitForBit) {
  expect_streamed_equals_resident({"fp32", false, false, false, 0});
}

TEST(StreamedLayers, CheckpointedChunkedRecomputeReadsTheSameStreamedWeights) {
  expect_streamed_equals_resident({"fp32/ckpt/token-chunks", false, true, false, 8});
}

TEST(StreamedLayers, TiedEmbeddingsStayResident) {
  expect_streamed_equals_resident({"fp32/tied", false, false, false, 0, /*tied=*/true});
}

TEST(StreamedLayers, QloraStepEqualsTheResidentBaseBitForBit) {
  expect_streamed_equals_resident({"nf4", true, false, false, 0});
}

TEST(StreamedLayers, QloraWithCheckpointingActivationOffloadAndHostEmbeddings) {
  expect_streamed_equals_resident({"nf4/ckpt/offload", true, true, true, 0});
}

// The device holds the resident units and two layer-sized buffers: L streamed layers save L - 2
// layers of the arena (every layer the same size), and the host holds the L layers.
TEST(StreamedLayers, ThePlanHoldsTwoBuffersOnTheDeviceAndTheStreamedLayersOnTheHost) {
  const LlamaConfig model = layers_model(8);
  for (bool four_bit : {false, true}) {
    SCOPED_TRACE(four_bit ? "nf4" : "16-bit");
    RunConfig run = small_run();
    run.precision = Precision::bf16;
    run.load_in_4bit = four_bit;
    run.gradient_checkpointing = true;
    const Plan resident = plan_run(run, model, Device::cuda);
    const ShardedBaseLayout whole = sharded_base_layout(resident.records, 1);
    uint64_t layer_bytes = 0;
    for (const BaseUnit& unit : whole.units)
      if (unit.layer == 0) layer_bytes = unit.bytes;
    ASSERT_GT(layer_bytes, 0u);
    for (int64_t streamed : {1, 2, 5, 7}) {
      SCOPED_TRACE(std::to_string(streamed) + " of 8 layers streamed");
      run.stream_layers = streamed;
      const Plan plan = plan_run(run, model, Device::cuda);
      EXPECT_EQ(plan.host_bytes - resident.host_bytes, static_cast<uint64_t>(streamed) * layer_bytes);
      EXPECT_EQ(static_cast<int64_t>(resident.arena_bytes) - static_cast<int64_t>(plan.arena_bytes),
                (streamed - 2) * static_cast<int64_t>(layer_bytes));
      for (const AllocationRecord& r : plan.records)
        EXPECT_NE(r.name.rfind("model.", 0), 0u) << r.name << " is a base buffer outside the streamed layout";
      // The plan's text shows the streamed layers as host memory, on one line.
      const std::string text = format_plan(plan, run, model);
      EXPECT_NE(text.find("streamed layers"), std::string::npos) << text;
      EXPECT_EQ(text.find("streamed layers"), text.rfind("streamed layers")) << text;
    }
  }
}

TEST(StreamedLayers, ImpossibleCountsAndCombinationsAreRefused) {
  const LlamaConfig model = layers_model(4);
  RunConfig run = small_run();
  run.stream_layers = 4;  // every layer: at least one stays on the device
  EXPECT_THROW(plan_run(run, model, Device::cpu), Error);
  run.stream_layers = -1;
  EXPECT_THROW(run.validate(), Error);
  run.stream_layers = 2;
  run.shard_base = true;
  EXPECT_THROW(run.validate(), Error);
}
