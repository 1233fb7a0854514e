// The lm head's backward in a 16-bit run converts d_logits to the compute dtype a slice of rows
// at a time (StepOptions::head_backward_slice_rows), instead of holding a compute-dtype copy of
// all the logits. Every row of d_normed is one row of d_logits times the head, so slicing must
// not change the step; and the plan holds only one slice beside the fp32 logits.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engine_test_util.h"
#include "memtune/ops/backend.h"
#include "memtune/train/engine.h"
#include "memtune/train/engine_arena.h"

using namespace memtune;

namespace {

struct HeadStep {
  double loss;
  std::vector<float> grads;
  uint64_t logits_bytes_max;  // the plan's own maximum of the logits/loss category
};

HeadStep one_bf16_step(const RunConfig& run, const LlamaConfig& model) {
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  engine->init_random_weights(7);
  engine->init_adapters(11);
  // A non-zero B: every LoRA grad, the A's included, depends on d_normed.
  for (const LoraTensors& t : engine->lora().tensors())
    cpu->fill_random(t.b, Backend::Distribution::normal, 0.0f, 0.05f, 3);
  engine->lora().sync_compute_copies(*cpu);
  const StepReport report = engine->train_step(enginetest::random_batches(model, run, 2, 5));
  EXPECT_FALSE(report.skipped);
  HeadStep result{report.loss, {}, 0};
  for (const LoraTensors& t : engine->lora().tensors())
    for (const Tensor* g : {&t.grad_a, &t.grad_b}) {
      std::vector<float> host(g->numel());
      cpu->copy_to_host(host.data(), *g);
      result.grads.insert(result.grads.end(), host.begin(), host.end());
    }
  result.logits_bytes_max =
      engine->memory().allocator().max_by_category()[static_cast<int>(MemCategory::logits_loss)];
  return result;
}

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), r += double(b[i]) * b[i];
  return std::sqrt(d / r);
}

}  // namespace

TEST(HeadBackward, SlicedDLogitsConversionIsTheSameStep) {
  const LlamaConfig model = enginetest::small_model();
  for (const char* loss : {"full", "chunked"}) {
    RunConfig run = enginetest::small_run();
    run.precision = Precision::bf16;
    run.loss_implementation = loss;
    run.loss_chunk_tokens = 20;  // 48 tokens: chunks of 20, 20 and 8 rows
    const HeadStep whole = one_bf16_step(run, model);  // 0: one slice per loss chunk here
    double grad_norm = 0;
    for (float g : whole.grads) grad_norm += double(g) * g;
    ASSERT_GT(grad_norm, 0.0) << loss;
    // 7 rows leaves a short last slice in every chunk; 1 row is the extreme.
    for (const int64_t rows : {int64_t{7}, int64_t{1}}) {
      RunConfig sliced_run = run;
      sliced_run.head_backward_slice_rows = rows;
      const HeadStep sliced = one_bf16_step(sliced_run, model);
      const std::string what = fmt::format("{} loss, {} rows per slice", loss, rows);
      EXPECT_EQ(sliced.loss, whole.loss) << what;  // the forward is untouched
      EXPECT_LT(relative_difference(sliced.grads, whole.grads), 1e-6) << what;
      // The bf16 slice beside the fp32 logits shrinks with the slice.
      EXPECT_LT(sliced.logits_bytes_max, whole.logits_bytes_max) << what;
    }
  }
}
