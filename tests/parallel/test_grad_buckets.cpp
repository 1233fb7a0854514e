// Grad buckets: whole layers, last layer first, closed at the size cap, one contiguous range
// each; the readiness bookkeeping says when a bucket can be all-reduced.
#include "memtune/parallel/grad_buckets.h"

#include <gtest/gtest.h>

#include "memtune/lora/lora_state.h"
#include "memtune/model/llama_config.h"

using namespace memtune;

namespace {

// `layers` layers, each with two grads of `numel` elements, laid out layer by layer.
std::vector<GradParam> layered(int layers, int64_t numel) {
  std::vector<GradParam> params;
  int64_t offset = 0;
  for (int l = 0; l < layers; ++l)
    for (int i = 0; i < 2; ++i) {
      params.push_back({l, offset, numel});
      offset += numel;
    }
  return params;
}

}  // namespace

TEST(GradBuckets, WholeLayersLastFirstClosedAtTheCap) {
  // 2 x 1024 floats = 8 KiB per layer; a 20 KiB cap closes a bucket after 3 layers (24 KiB).
  const GradBucketPlan plan = plan_grad_buckets(layered(7, 1024), 7, 20 << 10);
  ASSERT_EQ(plan.buckets.size(), 3u);
  EXPECT_EQ(plan.buckets[0].layers, (std::vector<int>{6, 5, 4}));
  EXPECT_EQ(plan.buckets[1].layers, (std::vector<int>{3, 2, 1}));
  EXPECT_EQ(plan.buckets[2].layers, (std::vector<int>{0}));
  EXPECT_EQ(plan.buckets[0].begin, 4 * 2048);
  EXPECT_EQ(plan.buckets[0].end, 7 * 2048);
  EXPECT_EQ(plan.buckets[2].begin, 0);
  EXPECT_EQ(plan.buckets[2].numel(), 2048);
  EXPECT_EQ(plan.bucket_of_layer, (std::vector<int>{2, 1, 1, 1, 0, 0, 0}));
}

TEST(GradBuckets, ALayerLargerThanTheCapIsABucketOfItsOwn) {
  const GradBucketPlan plan = plan_grad_buckets(layered(3, 1 << 20), 3, 1 << 20);
  ASSERT_EQ(plan.buckets.size(), 3u);
  for (int b = 0; b < 3; ++b) EXPECT_EQ(plan.buckets[static_cast<size_t>(b)].layers, (std::vector<int>{2 - b}));
}

TEST(GradBuckets, TheRealAdapterTableInTheFlatLayout) {
  LlamaConfig model = resolve_model("tiny").config;
  model.num_hidden_layers = 4;
  LoraConfig lora;
  lora.r = 8;
  lora.alpha = 16;
  lora.targets = {Projection::q, Projection::k, Projection::v, Projection::o, Projection::gate, Projection::up,
                  Projection::down};
  Memory memory(Device::meta, nullptr, 0);
  const LoraState state = LoraState::allocate(memory, model, lora, DType::bf16, false, 128);
  std::vector<GradParam> params;
  int64_t total = 0;
  for (size_t i = 0; i < state.specs().size(); ++i)
    for (const Tensor* g : {&state.tensors()[i].grad_a, &state.tensors()[i].grad_b}) {
      params.push_back({state.specs()[i].layer, state.flat_offset(*g), g->numel()});
      total += g->numel();
    }
  const GradBucketPlan plan = plan_grad_buckets(params, 4, 1);  // every layer closes a bucket
  ASSERT_EQ(plan.buckets.size(), 4u);
  int64_t covered = 0;
  for (const GradBucket& b : plan.buckets) covered += b.numel();
  EXPECT_GE(covered, total);  // the 64-element gaps are inside the ranges
  EXPECT_LT(covered, total + static_cast<int64_t>(params.size()) * 64);
  EXPECT_EQ(state.flat_grads().numel() % 128, 0);
}

TEST(GradBuckets, ReadinessCompletesABucketWithItsLastLayer) {
  const GradBucketPlan plan = plan_grad_buckets(layered(5, 1024), 5, 16 << 10);  // {4,3} {2,1} {0}
  ASSERT_EQ(plan.buckets.size(), 3u);
  BucketReadiness ready(plan);
  EXPECT_TRUE(ready.layer_done(4).empty());
  EXPECT_EQ(ready.layer_done(3), (std::vector<int>{0}));
  EXPECT_TRUE(ready.layer_done(2).empty());
  EXPECT_EQ(ready.incomplete(), (std::vector<int>{1, 2}));
  EXPECT_EQ(ready.layer_done(1), (std::vector<int>{1}));
  EXPECT_FALSE(ready.all_complete());
  EXPECT_EQ(ready.layer_done(0), (std::vector<int>{2}));
  EXPECT_TRUE(ready.all_complete());
  ready.reset();
  EXPECT_EQ(ready.incomplete().size(), 3u);
  EXPECT_DEATH(
      {
        ready.layer_done(1);
        ready.layer_done(1);
      },
      "finished twice");
}
