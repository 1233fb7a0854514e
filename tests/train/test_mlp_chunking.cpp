// The token-chunked MLP (mlp_chunk_tokens): where the MLP's activations are not saved
// (checkpointing, eval) norm2 + MLP run over chunks of token rows. Every op there is row-wise, so
// the forward is the same bits and the LoRA grads differ only by the order of their sums over
// tokens; the LoRA dropout mask is indexed by the row within the whole layer (dropout's
// index_offset), so it is the same mask too. And the plan's peak shrinks.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "memtune/core/error.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/ops/timed_backend.h"
#include "memtune/train/engine_arena.h"
#include "../support/engine_setup.h"
#include "memtune/train/yaml_config.h"
#include "memtune/plan/fit.h"
#include "memtune/train/engine.h"

using namespace memtune;

namespace {

using namespace enginetest;  // the shared engine set-up (tests/support/engine_setup.h)

constexpr int64_t kBatch = 2, kSeq = 24, kTokens = kBatch * kSeq;

RunConfig small_run() {
  RunConfig run;
  run.per_device_train_batch_size = kBatch;
  run.max_seq_length = kSeq;
  run.lora_r = 4;
  run.lora_alpha = 8;
  run.gradient_checkpointing = true;
  return run;
}

// small_run() as 4-bit QLoRA in bf16 with the own flash attention and dropout on, so that the
// chunked and whole passes also slice the dropout masks.
RunConfig small_qlora_run() {
  RunConfig run = small_run();
  run.precision = Precision::bf16;
  run.load_in_4bit = true;
  run.attn_implementation = "flash";
  run.lora_dropout = 0.1;
  return run;
}

struct StepResult {
  double loss;       // of the training step (its forward)
  double eval_loss;  // eval_loss_sum before the step
  std::vector<float> grads;
};

// One step of two micro-batches (the grads accumulate across both, and across chunks), with a
// non-zero B so that every LoRA grad is non-zero (the same values for every variant). The grads
// stay in place after the step until the next one zeroes them.
StepResult one_step(const RunConfig& run, const LlamaConfig& model) {
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  enginetest::init_with_nonzero_b(engine.engine());
  // Eval first: after the step the adapters carry the grads' last-bit differences.
  const double eval_loss = engine->eval_loss_sum(random_batches(model, run, 1, 6)[0]).first;
  const StepReport report = engine->train_step(random_batches(model, run, 2, 5));
  EXPECT_FALSE(report.skipped);
  StepResult result{report.loss, eval_loss, enginetest::adapter_grads(engine.engine())};
  // The plan (one micro-batch and an eval) peaks where the step does (test_engine.cpp checks the
  // records one by one).
  EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes);
  return result;
}

TEST(MlpChunking, DropoutOfARowSliceWithItsOffsetIsThatSliceOfTheWholeMask) {
  auto cpu = make_cpu_backend();
  const int64_t rows = 9, cols = 37;
  std::vector<float> x(rows * cols), whole(rows * cols), slice_out(rows * cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 1.0f + static_cast<float>(i % 13);
  const Tensor x_view{x.data(), DType::f32, Shape{rows, cols}, Device::cpu};
  cpu->dropout(Tensor{whole.data(), DType::f32, Shape{rows, cols}, Device::cpu}, x_view, 0.3f, 99, 0);
  const Tensor out_view{slice_out.data(), DType::f32, Shape{rows, cols}, Device::cpu};
  for (int64_t begin = 0; begin < rows; begin += 4) {
    const int64_t end = std::min(rows, begin + 4);
    cpu->dropout(out_view.slice_rows(begin, end), x_view.slice_rows(begin, end), 0.3f, 99,
                 static_cast<uint64_t>(begin * cols));
  }
  EXPECT_EQ(slice_out, whole);
  int64_t dropped = 0;
  for (float v : whole) dropped += v == 0.0f;
  EXPECT_GT(dropped, 0);
}

TEST(MlpChunking, ChunkedStepEqualsTheWholeMlpStep) {
  const LlamaConfig model = small_model();
  for (const char* attn : {"eager", "flash"}) {
    for (const double dropout : {0.0, 0.1}) {
      RunConfig whole_run = small_run();
      whole_run.attn_implementation = attn;
      whole_run.lora_dropout = dropout;
      whole_run.mlp_chunk_tokens = 0;
      const StepResult whole = one_step(whole_run, model);
      // Without checkpointing the MLP is saved whole (and eval chunks): the same step.
      RunConfig saved_run = whole_run;
      saved_run.gradient_checkpointing = false;
      saved_run.mlp_chunk_tokens = 7;
      const StepResult saved = one_step(saved_run, model);
      EXPECT_EQ(saved.loss, whole.loss) << attn << " dropout " << dropout;
      EXPECT_EQ(saved.eval_loss, whole.eval_loss) << attn << " dropout " << dropout;
      EXPECT_LT(rel_error(saved.grads, whole.grads), 1e-5) << attn << " dropout " << dropout;
      // 7 leaves a short last chunk; kTokens is one chunk (as is anything larger).
      for (const int64_t chunk : {int64_t{7}, int64_t{16}, kTokens}) {
        RunConfig run = whole_run;
        run.mlp_chunk_tokens = chunk;
        const StepResult got = one_step(run, model);
        const std::string what = fmt::format("{} dropout {} chunk {}", attn, dropout, chunk);
        // Row-wise ops and a dropout mask indexed within the whole layer: the very same forward.
        EXPECT_EQ(got.loss, whole.loss) << what;
        EXPECT_EQ(got.eval_loss, whole.eval_loss) << what;
        EXPECT_LT(rel_error(got.grads, whole.grads), 1e-5) << what;
      }
    }
  }
}

TEST(MlpChunking, DropoutIsActiveSoTheMaskComparisonMeansSomething) {
  const LlamaConfig model = small_model();
  RunConfig run = small_run();
  run.mlp_chunk_tokens = 7;
  const StepResult without = one_step(run, model);
  run.lora_dropout = 0.1;
  const StepResult with = one_step(run, model);
  // A mask that shifted between forward and backward, or between chunks, would move the grads
  // by about as much as dropout itself does.
  EXPECT_GT(rel_error(with.grads, without.grads), 1e-2);
}

TEST(MlpChunking, QloraChunkedStepIsCloseToTheWholeMlpStep) {
  const LlamaConfig model = small_model();
  RunConfig run = small_qlora_run();
  run.mlp_chunk_tokens = 0;
  const StepResult whole = one_step(run, model);
  run.mlp_chunk_tokens = 16;
  const StepResult got = one_step(run, model);
  EXPECT_EQ(got.loss, whole.loss);
  // The LoRA grads accumulate in fp32; only the order of the sum over tokens changed.
  EXPECT_LT(rel_error(got.grads, whole.grads), 1e-5);
}

// hold_chunk_weights: a chunked pass of a layer dequantizes each 4-bit projection once and keeps
// the copy for all its chunks, instead of once per chunk. The same dense weights feed the same
// ops, so the step is the same to the bit; the plan grows by at most the held copies and still
// equals the engine's peak; and fit_token_chunks gives the room back where a budget needs it.
TEST(MlpChunking, HeldWeightsGiveTheSameStepWithOneDequantizationAPass) {
  const LlamaConfig model = small_model();
  RunConfig run = small_qlora_run();
  run.mlp_chunk_tokens = 7;  // 48 rows: 7 chunks a pass
  struct Counted {
    double loss;
    std::vector<float> grads;
    int64_t dequantizations;
    uint64_t planned;
  };
  const auto counted_step = [&](bool hold) {
    RunConfig r = run;
    r.hold_chunk_weights = hold;
    auto cpu = make_cpu_backend();
    TimedBackend timed(*cpu);
    PlannedEngine engine(timed, r, model);
    init_with_nonzero_b(engine.engine());
    timed.set_enabled(true);
    const StepReport report = engine->train_step(random_batches(model, r, 2, 5));
    timed.set_enabled(false);
    int64_t calls = 0;
    for (const OpTime& op : timed.ops())
      if (op.op == "dequantize_4bit") calls = op.calls;
    EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes) << "hold " << hold;
    return Counted{report.loss, adapter_grads(engine.engine()), calls, engine.plan().arena_bytes};
  };
  const Counted held = counted_step(true), per_chunk = counted_step(false);
  EXPECT_EQ(held.loss, per_chunk.loss);
  EXPECT_EQ(held.grads, per_chunk.grads);
  // Per layer and micro-batch: the forward's 7 projections, the recompute's q/k/v, the backward's
  // 7 (checkpointing), each once.
  EXPECT_EQ(held.dequantizations, 17 * model.num_hidden_layers * 2);
  EXPECT_GT(per_chunk.dequantizations, 6 * held.dequantizations);
  // The most held at once: o, gate, up and down in bf16.
  const uint64_t held_bytes =
      2 * static_cast<uint64_t>(model.hidden_size * model.hidden_size + 3 * model.hidden_size * model.intermediate_size);
  EXPECT_GT(held.planned, per_chunk.planned);
  EXPECT_LE(held.planned, per_chunk.planned + held_bytes + 4096) << held.planned << " vs " << per_chunk.planned;

  // fit_token_chunks: a budget with room for the held copies keeps them, one without turns them off.
  RunConfig holding = run, not_holding = run;
  not_holding.hold_chunk_weights = false;
  const uint64_t with_room = plan_run(holding, model, Device::cuda).arena_bytes;
  const uint64_t without_room = plan_run(not_holding, model, Device::cuda).arena_bytes;
  ASSERT_GT(with_room, without_room);
  RunConfig fitted = run;
  EXPECT_TRUE(fit_token_chunks(fitted, model, with_room, 0));
  EXPECT_TRUE(fitted.hold_chunk_weights);
  EXPECT_TRUE(fit_token_chunks(fitted, model, without_room, 0));
  EXPECT_FALSE(fitted.hold_chunk_weights);
  EXPECT_NE(fit_flags(fitted).find("--hold_chunk_weights false"), std::string::npos);
  fitted.hold_chunk_weights = true;
  EXPECT_FALSE(fit_token_chunks(fitted, model, without_room - 1, 0));
}

TEST(MlpChunking, ChunkingShrinksThePlanWhereTheMlpDominates) {
  LlamaConfig model = small_model();
  model.intermediate_size = 16 * model.hidden_size;
  RunConfig run = small_run();
  run.max_seq_length = 128;
  run.loss_implementation = "chunked";
  run.loss_chunk_tokens = 32;
  for (const char* attn : {"eager", "flash"}) {
    run.attn_implementation = attn;
    run.mlp_chunk_tokens = 0;
    const uint64_t whole = plan_run(run, model, Device::cpu).arena_bytes;
    run.mlp_chunk_tokens = 32;
    const uint64_t chunked = plan_run(run, model, Device::cpu).arena_bytes;
    // gate, up and swiglu_out of [256, 2048] fp32 are 2 MiB each: at 32 rows they are 8x smaller.
    EXPECT_LT(chunked + 4 * (uint64_t{1} << 20), whole) << attn << ": " << chunked << " vs " << whole;
    // Without checkpointing the backward needs the whole MLP anyway: chunking changes nothing
    // (eval chunks too, but its peak is below the training step's).
    RunConfig saved = run;
    saved.gradient_checkpointing = false;
    saved.mlp_chunk_tokens = 0;
    const uint64_t saved_whole = plan_run(saved, model, Device::cpu).arena_bytes;
    saved.mlp_chunk_tokens = 32;
    EXPECT_EQ(plan_run(saved, model, Device::cpu).arena_bytes, saved_whole) << attn;
  }
}

TEST(MlpChunking, OptionIsValidatedAndReadFromYaml) {
  RunConfig run;
  EXPECT_EQ(run.mlp_chunk_tokens, RunConfig::kAutoTokenChunks);
  run.validate();
  run.mlp_chunk_tokens = -2;
  EXPECT_THROW(run.validate(), memtune::Error);
  const std::filesystem::path yaml = std::filesystem::path(MEMTUNE_BINARY_DIR) / "test_mlp_chunk_tokens.yaml";
  std::ofstream(yaml) << "gradient_checkpointing: true\nmlp_chunk_tokens: 0\n";
  RunConfig from_yaml;
  apply_run_yaml(yaml, from_yaml);
  EXPECT_EQ(from_yaml.mlp_chunk_tokens, 0);
  EXPECT_EQ(from_yaml.step_options().mlp_chunk_tokens, 0);
}

// Auto chunks only a micro-batch of more than kAutoChunkRows tokens, in chunks of that size;
// an explicit value (0 too) is kept as given.
TEST(MlpChunking, AutoChunksOnlyLargeMicroBatches) {
  RunConfig run;
  run.per_device_train_batch_size = 2;
  run.max_seq_length = 2048;
  EXPECT_EQ(run.step_options().mlp_chunk_tokens, 0);
  run.max_seq_length = 2049;
  EXPECT_EQ(run.step_options().mlp_chunk_tokens, RunConfig::kAutoChunkRows);
  run.per_device_train_batch_size = 1;
  run.max_seq_length = 131072;
  EXPECT_EQ(run.step_options().mlp_chunk_tokens, RunConfig::kAutoChunkRows);
  run.mlp_chunk_tokens = 0;
  EXPECT_EQ(run.step_options().mlp_chunk_tokens, 0);
  run.mlp_chunk_tokens = 512;
  EXPECT_EQ(run.step_options().mlp_chunk_tokens, 512);
}

// Under a budget, auto shrinks the chunks until the plan fits, and only as far as needed.
TEST(MlpChunking, FitTokenChunksShrinksChunksToTheBudget) {
  RunConfig run;
  run.model = "tiny";
  run.gradient_checkpointing = true;
  run.attn_implementation = "flash";     // no S x S scratch and no full logits: the layer's
  run.loss_implementation = "chunked";   // row-wise working set is then the peak
  run.per_device_train_batch_size = 4;
  run.max_seq_length = 512;
  const LlamaConfig model = resolve_model(run.model).config;
  RunConfig whole = run, chunked = run;
  whole.mlp_chunk_tokens = 0;
  chunked.mlp_chunk_tokens = 256;
  const uint64_t whole_bytes = plan_run(whole, model).arena_bytes;
  const uint64_t chunked_bytes = plan_run(chunked, model).arena_bytes;
  ASSERT_LT(chunked_bytes, whole_bytes);

  RunConfig roomy = run;
  EXPECT_TRUE(fit_token_chunks(roomy, model, whole_bytes, 0));
  EXPECT_EQ(roomy.mlp_chunk_tokens, 0);  // room for no chunks: none

  RunConfig tight = run;
  EXPECT_TRUE(fit_token_chunks(tight, model, chunked_bytes, 0));
  EXPECT_GT(tight.mlp_chunk_tokens, 0);  // no chunks do not fit: some chunk size was chosen
  EXPECT_LE(plan_run(tight, model).arena_bytes, chunked_bytes);

  RunConfig hopeless = run;
  EXPECT_FALSE(fit_token_chunks(hopeless, model, chunked_bytes / 4, 0));

  RunConfig explicit_whole = run;
  explicit_whole.mlp_chunk_tokens = 0;
  EXPECT_FALSE(fit_token_chunks(explicit_whole, model, chunked_bytes, 0));
  EXPECT_EQ(explicit_whole.mlp_chunk_tokens, 0);  // an explicit value is never changed
}

}  // namespace
