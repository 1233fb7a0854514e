// --attn_implementation auto's measured pick on the GPU (train/attention_pick.h): both
// implementations timed at a run's shape (dense and packed rows), the faster picked and cached, and
// a run's resolution under a budget that leaves out what does not fit. Prints the timings.
#include <gtest/gtest.h>

#include <cstdio>

#include "gpu_test_util.h"
#include "memtune/model/llama_config.h"
#include "memtune/train/attention_pick.h"
#include "memtune/train/engine.h"
#include "memtune/train/run_config.h"
#include "../support/temp_dir.h"

namespace memtune::gputest {
namespace {

class CudaAttentionPickTest : public CudaTest {};

TEST_F(CudaAttentionPickTest, PicksTheFasterOfTheOwnKernelAndCudnnAndCachesIt) {
  if (!cudnn_attention_available()) GTEST_SKIP() << "no cuDNN attention here: nothing to choose between";
  const std::filesystem::path dir = test::make_test_dir("memtune_gpu_attention_pick");
  const std::filesystem::path cache = dir / "attention-picks.json";
  for (const bool packed : {false, true}) {
    AttentionShape shape;
    shape.batch = 2;
    shape.seq = 1000;  // not a tile multiple
    shape.n_heads = 32;
    shape.n_kv_heads = 8;
    shape.head_dim = 128;
    shape.dtype = DType::bf16;
    shape.packed = packed;
    const AttentionPick pick = pick_attention(gpu(), shape, {"cudnn", "flash"}, cache, 5);
    ASSERT_EQ(pick.timings.size(), 2u) << shape.key();
    for (const AttentionTiming& t : pick.timings) EXPECT_GT(t.milliseconds, 0.0) << t.implementation;
    const AttentionTiming& faster =
        pick.timings[0].milliseconds <= pick.timings[1].milliseconds ? pick.timings[0] : pick.timings[1];
    EXPECT_EQ(pick.implementation, faster.implementation);
    std::printf("TIMING %s\n", pick.describe(shape).c_str());
    const AttentionPick cached = pick_attention(gpu(), shape, {"cudnn", "flash"}, cache, 5);
    EXPECT_EQ(cached.implementation, pick.implementation);
    EXPECT_EQ(cached.source, "cached in " + cache.string());
  }
  std::filesystem::remove_all(dir);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// A run resolved under a budget that holds the own kernel's plan and not cuDNN's (its backward's
// workspace is the larger at long context): the pick is the own kernel without timing.
TEST_F(CudaAttentionPickTest, ResolveLeavesOutWhatDoesNotFitTheBudget) {
  if (!cudnn_attention_available()) GTEST_SKIP() << "no cuDNN attention here: nothing to choose between";
  RunConfig run;
  run.precision = Precision::bf16;
  run.gradient_checkpointing = true;
  run.offload_activations = true;  // with the chunked loss: attention's scratch is the peak's margin
  run.loss_implementation = "chunked";
  run.per_device_train_batch_size = 1;
  run.max_seq_length = 32768;
  // Only planned (the budget leaves one candidate, so nothing is timed): a 1B model, head_dim 64.
  const LlamaConfig model = resolve_model("llama-3.2-1b").config;
  RunConfig flash = run, cudnn = run;
  flash.attn_implementation = "flash";
  cudnn.attn_implementation = "cudnn";
  const uint64_t flash_bytes = plan_run(flash, model).arena_bytes, cudnn_bytes = plan_run(cudnn, model).arena_bytes;
  if (cudnn_bytes <= flash_bytes) GTEST_SKIP() << "cuDNN's plan is not the larger at this shape";
  run.attn_implementation = "cudnn";
  const std::string line = resolve_auto_attention(gpu(), run, model, flash_bytes, 0);
  EXPECT_EQ(run.attn_implementation, "flash") << line;
  EXPECT_NE(line.find("cudnn does not fit the budget"), std::string::npos) << line;
}

}  // namespace
}  // namespace memtune::gputest
