// The lm head's backward in a 16-bit run converts d_logits to the compute dtype a slice of rows
// at a time (StepOptions::head_backward_slice_rows), instead of holding a compute-dtype copy of
// all the logits. Every row of d_normed is one row of d_logits times the head, so slicing must
// not change the step; and the plan holds only one slice beside the fp32 logits.
#include <gtest/gtest.h>

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
  // A non-zero B: every LoRA grad, the A's included, depends on d_normed.
  enginetest::init_with_nonzero_b(engine.engine());
  const StepReport report = engine->train_step(enginetest::random_batches(model, run, 2, 5));
  EXPECT_FALSE(report.skipped);
  return {report.loss, enginetest::adapter_grads(engine.engine()),
          engine->memory().allocator().max_by_category()[static_cast<int>(MemCategory::logits_loss)]};
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
      EXPECT_LT(enginetest::rel_error(sliced.grads, whole.grads), 1e-6) << what;
      // The bf16 slice beside the fp32 logits shrinks with the slice.
      EXPECT_LT(sliced.logits_bytes_max, whole.logits_bytes_max) << what;
    }
  }
}
