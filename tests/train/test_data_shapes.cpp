// Shapes that follow the data (train/trainer.h, LlamaStep::set_shape): a micro-batch padded to
// its longest row, a padding-free row of several samples, and length-grouped batches give the
// loss and gradients of the same samples padded to max_seq_length, and every buffer they
// allocate is one the plan placed, at the planned offset and size.
#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <sstream>

#include "memtune/core/error.h"
#include "memtune/data/packing.h"
#include "memtune/data/sft_dataset.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/train/engine_arena.h"
#include "memtune/train/trainer.h"
#include "../support/engine_setup.h"

using namespace memtune;

namespace {

using namespace enginetest;  // the shared engine set-up (tests/support/engine_setup.h)

// The micro-batches of the trainer's first step, for a run and trainer options.
std::vector<HostMicroBatch> first_step(Engine& engine, const Dataset& data, const TrainerOptions& options) {
  std::ostringstream out, err;
  Trainer trainer(engine, data, nullptr, options, out, err);
  return trainer.next_step_batches();
}

// The trainer's first step under `options`, trained once on a fresh engine whose LoRA B is not
// zero (so that every adapter has a gradient): its micro-batches, report and adapter gradients.
struct TrainedStep {
  std::vector<HostMicroBatch> batches;
  StepReport report;
  std::vector<float> grads;
};
TrainedStep train_first_step(Backend& backend, const RunConfig& run, const LlamaConfig& model, const Dataset& data,
                             const TrainerOptions& options) {
  PlannedEngine engine(backend, run, model);
  init_with_nonzero_b(engine.engine());
  TrainedStep step;
  step.batches = first_step(engine.engine(), data, options);
  step.report = engine->train_step(step.batches);
  step.grads = adapter_grads(engine.engine());
  return step;
}

// Every allocation the engine made is the planned allocation of the same name at the same
// offset with the same size, in the planned order; a shorter micro-batch may skip whole token
// chunks of the plan, and nothing else. Returns "" or the first mismatch.
std::string is_planned_subsequence(const std::vector<AllocationRecord>& made,
                                   const std::vector<AllocationRecord>& planned) {
  size_t p = 0;
  for (const AllocationRecord& r : made) {
    while (p < planned.size() &&
           !(planned[p].name == r.name && planned[p].offset == r.offset && planned[p].bytes == r.bytes))
      ++p;
    if (p == planned.size()) return fmt::format("'{}' ({} bytes at {}) is not planned there", r.name, r.bytes, r.offset);
    ++p;
  }
  return "";
}

struct ShapeCase {
  const char* attention;
  bool checkpointing;
  int64_t token_chunks;  // mlp_chunk_tokens
  const char* loss;
};

std::string case_name(const ShapeCase& c) {
  return fmt::format("{} ckpt {} chunks {} loss {}", c.attention, c.checkpointing, c.token_chunks, c.loss);
}

RunConfig run_for(const ShapeCase& c) {
  RunConfig run = small_run();
  run.per_device_train_batch_size = 3;
  run.max_seq_length = 40;
  run.gradient_accumulation_steps = 2;
  run.attn_implementation = c.attention;
  run.gradient_checkpointing = c.checkpointing;
  run.mlp_chunk_tokens = c.token_chunks;
  run.loss_implementation = c.loss;
  run.loss_chunk_tokens = 11;
  return run;
}

const std::vector<ShapeCase> kCases = {
    {"eager", false, 0, "full"},  {"flash", false, 0, "full"},    {"eager", true, 0, "chunked"},
    {"flash", true, 16, "chunked"}, {"flash", true, 50, "full"},  {"cudnn", true, 16, "chunked"},
};

// Lengths whose micro-batches (3 rows) are far shorter than the planned 40 tokens, and odd.
const std::vector<int> kLengths = {5, 9, 13, 3, 17, 11, 7, 21};

TEST(DataShapes, PaddedLengthRoundsUpToTheMultipleWithinTheCap) {
  EXPECT_EQ(padded_length(1, 64, 2048), 64);
  EXPECT_EQ(padded_length(64, 64, 2048), 64);
  EXPECT_EQ(padded_length(65, 64, 2048), 128);
  EXPECT_EQ(padded_length(2000, 64, 2048), 2048);
  EXPECT_EQ(padded_length(2047, 64, 2047), 2047);  // never past the planned row
  EXPECT_EQ(padded_length(13, 1, 40), 13);
}

TEST(DataShapes, MicroBatchesRunAtTheirLongestRowRoundedUp) {
  const LlamaConfig model = small_model();
  const RunConfig run = run_for(kCases[1]);
  const Dataset data = seeded_dataset(kLengths, 5);
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  TrainerOptions longest;
  longest.pad_to_multiple_of = 8;
  TrainerOptions fixed = longest;
  fixed.padding = Padding::max_length;
  TrainerOptions free = longest;
  free.padding_free = true;
  std::ostringstream out, err;
  Trainer trainer(engine.engine(), data, nullptr, longest, out, err);
  const std::vector<HostMicroBatch> batches = trainer.next_step_batches();
  ASSERT_EQ(batches.size(), 2u);
  for (const HostMicroBatch& b : batches) {
    EXPECT_EQ(b.rows, 3);
    EXPECT_EQ(b.seq % 8, 0);
    EXPECT_LT(b.seq, 40);
    int64_t longest_row = 0, row_tokens = 0;
    for (int64_t r = 0; r < b.rows; ++r) {
      int64_t last = -1;  // the last position holding a sample token (segment 0)
      for (int64_t t = 0; t < b.seq; ++t)
        if (b.segments[r * b.seq + t] == 0) last = t;
      longest_row = std::max(longest_row, last + 1);
      row_tokens += last + 1;
    }
    EXPECT_EQ(b.seq, padded_length(longest_row, 8, 40));
    EXPECT_EQ(b.real_tokens, row_tokens);
  }
  for (const HostMicroBatch& b : first_step(engine.engine(), data, fixed)) {
    EXPECT_EQ(b.rows, 3);
    EXPECT_EQ(b.seq, 40);
  }
  int64_t samples_tokens = 0, padded_samples_tokens = 0;
  for (const HostMicroBatch& b : batches) padded_samples_tokens += b.real_tokens;
  for (const HostMicroBatch& b : first_step(engine.engine(), data, free)) {
    EXPECT_EQ(b.rows, 1);
    EXPECT_EQ(b.seq, padded_length(b.real_tokens, 8, 120));
    samples_tokens += b.real_tokens;
    // Positions restart at every sample; each sample is its own segment.
    std::set<int32_t> segments(b.segments.begin(), b.segments.end());
    EXPECT_GE(segments.size(), 3u);
  }
  EXPECT_EQ(samples_tokens, padded_samples_tokens);  // the same six rows of the shuffled order
}

TEST(DataShapes, ShapedAndPaddingFreeStepsEqualThePaddedStep) {
  const LlamaConfig model = small_model();
  const Dataset data = seeded_dataset(kLengths, 5);
  for (const ShapeCase& c : kCases) {
    SCOPED_TRACE(case_name(c));
    const RunConfig run = run_for(c);
    auto cpu = make_cpu_backend();
    TrainerOptions padded;
    padded.padding = Padding::max_length;
    PlannedEngine reference(*cpu, run, model);
    init_with_nonzero_b(reference.engine());
    const StepReport want = reference->train_step(first_step(reference.engine(), data, padded));
    const std::vector<float> want_grads = adapter_grads(reference.engine());
    for (const bool padding_free : {false, true}) {
      if (padding_free && std::string(c.attention) == "eager") continue;  // refused: see the CLI test
      SCOPED_TRACE(padding_free ? "padding-free" : "padded to the longest row");
      TrainerOptions shaped;
      shaped.pad_to_multiple_of = padding_free ? 8 : 4;
      shaped.padding_free = padding_free;
      RunConfig shaped_run = run;
      shaped_run.packed_rows = padding_free;  // as train --padding_free sets it
      PlannedEngine engine(*cpu, shaped_run, model);
      init_with_nonzero_b(engine.engine());
      const std::vector<HostMicroBatch> batches = first_step(engine.engine(), data, shaped);
      const StepReport got = engine->train_step(batches);
      EXPECT_NEAR(got.loss, want.loss, 1e-5 * want.loss);
      EXPECT_LT(rel_error(adapter_grads(engine.engine()), want_grads), 1e-5);
      EXPECT_EQ(got.real_tokens, want.real_tokens);
      EXPECT_EQ(got.targets, want.targets);
      EXPECT_LT(got.tokens, want.tokens);  // less compute went to padding
      EXPECT_EQ(want.tokens, 2 * 3 * 40);
      // What the plan ran, at these shapes (one micro-batch's step, then an eval pass): every
      // buffer is a planned one, and the peak is at most the plan's.
      PlannedEngine fresh(*cpu, shaped_run, model);
      init_with_nonzero_b(fresh.engine());
      fresh->train_step({batches[0]});
      fresh->eval_loss_sum(batches[1]);
      EXPECT_EQ(is_planned_subsequence(fresh->memory().records(), fresh.plan().records), "");
      EXPECT_LE(fresh->memory().allocator().high_water(), fresh.plan().arena_bytes);
    }
  }
}

// --merge_micro_batches: a step's micro-batches of short rows run as fewer, larger ones inside
// the planned micro-batch's tokens, with the loss and gradients of the padded step (the loss is
// normalised by the step's targets, so only the summation order changes), in every attention and
// chunking case, and every buffer of a merged micro-batch is a planned one.
TEST(DataShapes, MergedMicroBatchesGiveThePaddedStepInFewerPasses) {
  const LlamaConfig model = small_model();
  // 12 samples of at most 9 tokens: micro-batches of 3 rows of <= 12 (a multiple of 4) against a
  // plan of 3 x 40, so that up to 3 of them fit one.
  const Dataset data = seeded_dataset({5, 9, 3, 7, 6, 4, 8, 2, 9, 5, 7, 3}, 11);
  for (const ShapeCase& c : kCases) {
    SCOPED_TRACE(case_name(c));
    RunConfig run = run_for(c);
    run.gradient_accumulation_steps = 4;
    auto cpu = make_cpu_backend();
    TrainerOptions padded;
    padded.padding = Padding::max_length;
    const TrainedStep want = train_first_step(*cpu, run, model, data, padded);
    ASSERT_EQ(want.batches.size(), 4u);
    TrainerOptions merge;
    merge.pad_to_multiple_of = 4;
    merge.merge_micro_batches = true;
    const TrainedStep got = train_first_step(*cpu, run, model, data, merge);
    const std::vector<HostMicroBatch>& batches = got.batches;
    EXPECT_LT(batches.size(), 4u);
    int64_t rows = 0;
    for (const HostMicroBatch& b : batches) {
      rows += b.rows;
      EXPECT_LE(b.rows * b.seq, 3 * 40) << "a merged micro-batch outgrew the plan";
    }
    EXPECT_EQ(rows, 12);
    EXPECT_GT(batches.front().rows, 3);  // at least one micro-batch holds more rows than planned
    EXPECT_NEAR(got.report.loss, want.report.loss, 1e-5 * want.report.loss);
    EXPECT_LT(rel_error(got.grads, want.grads), 1e-5);
    EXPECT_EQ(got.report.real_tokens, want.report.real_tokens);
    EXPECT_EQ(got.report.targets, want.report.targets);
    PlannedEngine fresh(*cpu, run, model);
    init_with_nonzero_b(fresh.engine());
    fresh->train_step({batches.front()});
    EXPECT_EQ(is_planned_subsequence(fresh->memory().records(), fresh.plan().records), "");
    EXPECT_LE(fresh->memory().allocator().high_water(), fresh.plan().arena_bytes);
  }
}

// Padding-free, a merged micro-batch is one row of its samples end to end: micro-batches join only
// while that row fits the planned batch x seq tokens, and the step keeps the unmerged gradients.
TEST(DataShapes, PaddingFreeMergesOnlyWhileTheJoinedRowFitsThePlan) {
  const LlamaConfig model = small_model();
  // 12 samples, four long (30-35 tokens) among short ones: micro-batches of 3 samples against a
  // plan of 3 x 40 = 120 tokens, so that some neighbours fit together and some do not.
  const Dataset data = seeded_dataset({30, 3, 4, 35, 5, 2, 33, 6, 3, 31, 4, 5}, 13);
  RunConfig run = run_for(kCases[1]);
  run.gradient_accumulation_steps = 4;
  auto cpu = make_cpu_backend();
  TrainerOptions apart;
  apart.padding_free = true;
  apart.pad_to_multiple_of = 4;
  TrainerOptions merge = apart;
  merge.merge_micro_batches = true;
  const TrainedStep want = train_first_step(*cpu, run, model, data, apart);
  ASSERT_EQ(want.batches.size(), 4u);
  const TrainedStep got = train_first_step(*cpu, run, model, data, merge);
  EXPECT_LT(got.batches.size(), 4u);
  EXPECT_GT(got.batches.size(), 1u);
  int64_t tokens = 0;
  for (const HostMicroBatch& b : got.batches) {
    EXPECT_EQ(b.rows, 1);
    EXPECT_LE(b.seq, 3 * 40) << "a merged padding-free row outgrew the plan";
    tokens += b.real_tokens;
  }
  EXPECT_EQ(tokens, want.report.real_tokens);
  EXPECT_NEAR(got.report.loss, want.report.loss, 1e-5 * want.report.loss);
  EXPECT_LT(rel_error(got.grads, want.grads), 1e-5);
}

// Rows of several samples (--packing, --padding_free) give cuDNN's ragged backward its room in
// the plan: kRaggedSlotRoom x tokens x heads x head_dim floats more in each layer's backward
// workspace, and nothing else changes; an unpacked run, or one on the flash kernel, pays nothing.
TEST(DataShapes, PackedRowsPlanRoomForCudnnsRaggedBackwardOnly) {
  const LlamaConfig model = small_model();
  auto workspace_bytes = [&](const char* attention, bool packed_rows) {
    RunConfig run = run_for(kCases[5]);
    run.attn_implementation = attention;
    run.packed_rows = packed_rows;
    const Plan plan = plan_run(run, model, Device::cuda);
    uint64_t bytes = 0;
    for (const AllocationRecord& r : plan.records)
      if (r.name == "layers.1.attn_cudnn_workspace") bytes = std::max(bytes, r.bytes);  // the backward's
    return std::make_pair(bytes, plan.records.size());
  };
  const auto [unpacked, unpacked_records] = workspace_bytes("cudnn", false);
  const auto [packed, packed_records] = workspace_bytes("cudnn", true);
  const RunConfig run = run_for(kCases[5]);
  const int64_t tokens = run.per_device_train_batch_size * run.max_seq_length;
  ASSERT_GT(unpacked, 0u) << "no backward cuDNN workspace found in the plan";
  EXPECT_EQ(packed - unpacked, uint64_t{4} * kRaggedSlotRoom * tokens * model.num_attention_heads * model.head_dim);
  EXPECT_EQ(packed_records, unpacked_records);
  // The flash kernel has no cuDNN workspace: packing changes nothing in its plan.
  RunConfig flash = run_for(kCases[3]);
  const uint64_t flash_arena = plan_run(flash, model, Device::cuda).arena_bytes;
  flash.packed_rows = true;
  EXPECT_EQ(plan_run(flash, model, Device::cuda).arena_bytes, flash_arena);
}

TEST(DataShapes, OffloadedLayerInputsAtAShorterShapeGiveThePaddedStep) {
  const LlamaConfig model = small_model();
  const Dataset data = seeded_dataset(kLengths, 9);
  RunConfig run = run_for({"flash", true, 16, "chunked"});
  run.offload_activations = true;
  auto cpu = make_cpu_backend();
  TrainerOptions padded;
  padded.padding = Padding::max_length;
  PlannedEngine reference(*cpu, run, model), engine(*cpu, run, model);
  init_with_nonzero_b(reference.engine());
  init_with_nonzero_b(engine.engine());
  const double want = reference->train_step(first_step(reference.engine(), data, padded)).loss;
  TrainerOptions shaped;
  shaped.padding_free = true;
  const double got = engine->train_step(first_step(engine.engine(), data, shaped)).loss;
  EXPECT_NEAR(got, want, 1e-5 * want);
  EXPECT_LT(rel_error(adapter_grads(engine.engine()), adapter_grads(reference.engine())), 1e-5);
}

TEST(DataShapes, GroupByLengthVisitsEveryRowOnceAndPadsLess) {
  const LlamaConfig model = small_model();
  std::vector<int> lengths;
  for (int i = 0; i < 60; ++i) lengths.push_back(3 + static_cast<int>(dropout_hash(3, i) % 37));
  const Dataset data = seeded_dataset(lengths, 2);
  RunConfig run = run_for(kCases[1]);
  run.gradient_accumulation_steps = 1;
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  auto epoch_padding = [&](bool grouped, std::multiset<int64_t>* seen) {
    TrainerOptions options;
    options.pad_to_multiple_of = 1;
    options.group_by_length = grouped;
    std::ostringstream out, err;
    Trainer trainer(engine.engine(), data, nullptr, options, out, err);
    int64_t computed = 0, real = 0;
    for (int step = 0; step < 20; ++step)
      for (const HostMicroBatch& b : trainer.next_step_batches()) {
        computed += b.tokens();
        real += b.real_tokens;
        for (int64_t r = 0; r < b.rows; ++r) seen->insert(b.input_ids[r * b.seq] * 1000 + b.input_ids[r * b.seq + 1]);
      }
    EXPECT_EQ(trainer.position().epoch, 1);  // 60 rows / 3 per step: one whole epoch
    EXPECT_EQ(real, std::accumulate(lengths.begin(), lengths.end(), int64_t{0}));
    return computed - real;
  };
  std::multiset<int64_t> plain_rows, grouped_rows;
  const int64_t plain = epoch_padding(false, &plain_rows);
  const int64_t grouped = epoch_padding(true, &grouped_rows);
  EXPECT_EQ(plain_rows, grouped_rows);  // the same rows, each once
  EXPECT_LT(grouped * 2, plain);        // far less padding
}

TEST(DataShapes, GroupByLengthKeepsTheShuffleAtTheMegaBatchScale) {
  std::vector<RowLayout> rows(400);
  for (size_t i = 0; i < rows.size(); ++i) rows[i].tokens = static_cast<int64_t>(1 + dropout_hash(8, i) % 500);
  const std::vector<uint32_t> shuffled = seeded_permutation(rows.size(), 4);
  const std::vector<uint32_t> order = group_by_length(shuffled, rows, 2);
  // Mega-batches of min(400 / 8, 50) * 2 = 100 rows: the same rows as the shuffle's, each sorted.
  for (size_t begin = 0; begin < order.size(); begin += 100) {
    std::multiset<uint32_t> a(order.begin() + begin, order.begin() + begin + 100);
    std::multiset<uint32_t> b(shuffled.begin() + begin, shuffled.begin() + begin + 100);
    EXPECT_EQ(a, b);
    for (size_t i = begin + 1; i < begin + 100; ++i) EXPECT_GE(rows[order[i - 1]].tokens, rows[order[i]].tokens);
  }
}

}  // namespace
