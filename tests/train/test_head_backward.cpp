// The lm head and the loss hold one copy of the logits, in the compute dtype (HF's lm_head
// output): the loss reads it in fp32 and writes d_logits over it in place, which the head's
// backward GEMM then reads. So a 16-bit step's logits/loss category is the logits themselves
// (half of what fp32 logits would take), and the full and chunked losses, which round the same
// logits the same way, are the same step.
#include <gtest/gtest.h>

#include <vector>

#include "../support/engine_setup.h"
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

HeadStep one_step(const RunConfig& run, const LlamaConfig& model) {
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

TEST(HeadBackward, LogitsAreHeldOnceInTheComputeDtype) {
  const LlamaConfig model = enginetest::small_model();
  for (const Precision precision : {Precision::bf16, Precision::fp16, Precision::fp32}) {
    RunConfig run = enginetest::small_run();
    run.precision = precision;
    run.loss_implementation = "full";
    const HeadStep step = one_step(run, model);
    double grad_norm = 0;
    for (float g : step.grads) grad_norm += double(g) * g;
    ASSERT_GT(grad_norm, 0.0);
    const uint64_t element_bytes = precision == Precision::fp32 ? 4 : 2;
    const uint64_t logits_bytes = uint64_t(run.per_device_train_batch_size * run.max_seq_length) *
                                  uint64_t(model.vocab_size) * element_bytes;
    // The logits plus the loss's few scalars (arena alignment included), and no second copy.
    EXPECT_GE(step.logits_bytes_max, logits_bytes) << precision_name(precision);
    EXPECT_LT(step.logits_bytes_max, logits_bytes + 4096) << precision_name(precision);
  }
}

TEST(HeadBackward, FullAndChunkedLossAreTheSameSixteenBitStep) {
  const LlamaConfig model = enginetest::small_model();
  RunConfig run = enginetest::small_run();
  run.precision = Precision::bf16;
  run.loss_implementation = "full";
  const HeadStep full = one_step(run, model);
  run.loss_implementation = "chunked";
  run.loss_chunk_tokens = 20;  // 48 tokens: chunks of 20, 20 and 8 rows
  const HeadStep chunked = one_step(run, model);
  EXPECT_NEAR(chunked.loss, full.loss, 1e-6 * full.loss);
  EXPECT_LT(enginetest::rel_error(chunked.grads, full.grads), 1e-5);
  EXPECT_LT(chunked.logits_bytes_max, full.logits_bytes_max);
}
