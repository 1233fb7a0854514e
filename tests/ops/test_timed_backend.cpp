// TimedBackend (ops/timed_backend.h): it forwards every op unchanged, records nothing while
// disabled, and while enabled counts calls, times, and the FLOPs of each GEMM shape; the ladder's
// profile step puts that breakdown into the rung.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "op_test_util.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/ops/timed_backend.h"
#include "memtune/experiment/measure.h"
#include "memtune/train/run_config.h"

namespace memtune {
namespace {

using optest::HostTensor;

TEST(TimedBackend, ForwardsOpsAndTimesOnlyWhenEnabled) {
  auto cpu = make_cpu_backend();
  TimedBackend timed(*cpu);
  std::mt19937_64 rng(5);
  const HostTensor a = optest::random_tensor(DType::f32, Shape{7, 5}, rng);
  const HostTensor b = optest::random_tensor(DType::f32, Shape{3, 5}, rng);
  HostTensor direct(DType::f32, Shape{7, 3}), through(DType::f32, Shape{7, 3});
  cpu->matmul(direct, a, false, b, true, 1.0f, 0.0f);
  timed.matmul(through, a, false, b, true, 1.0f, 0.0f);
  EXPECT_EQ(direct.storage, through.storage);
  EXPECT_TRUE(timed.ops().empty());  // disabled: nothing recorded

  timed.set_enabled(true);
  timed.matmul(through, a, false, b, true, 1.0f, 0.0f);
  timed.matmul(through, a, false, b, true, 1.0f, 0.0f);
  timed.scale(through, 2.0f);
  EXPECT_EQ(through.floats()[0], 2.0f * direct.floats()[0]);
  const std::vector<OpTime> ops = timed.ops();
  ASSERT_EQ(ops.size(), 2u);
  const auto matmul = std::find_if(ops.begin(), ops.end(), [](const OpTime& o) { return o.op == "matmul"; });
  ASSERT_NE(matmul, ops.end());
  EXPECT_EQ(matmul->calls, 2);
  EXPECT_EQ(matmul->flops, 2 * 2.0 * 7 * 3 * 5);
  const std::vector<OpTime> shapes = timed.gemm_shapes();
  ASSERT_EQ(shapes.size(), 1u);
  EXPECT_EQ(shapes[0].op, "7x3x5 NT");
  const nlohmann::json json = timed.to_json();
  EXPECT_EQ(json["ops"].size(), 2u);
  EXPECT_EQ(json["gemm_shapes"][0]["calls"], 2);
  EXPECT_NE(timed.table().find("7x3x5 NT"), std::string::npos);
  timed.clear();
  EXPECT_TRUE(timed.ops().empty());
}

TEST(TimedBackend, TheProfileStepOfARungListsTheStepsOps) {
  const ModelSource source = resolve_model("tiny");
  RunConfig run;
  run.model = "tiny";
  run.precision = Precision::fp32;
  run.per_device_train_batch_size = 1;
  run.gradient_accumulation_steps = 1;
  run.max_seq_length = 32;
  run.attn_implementation = "flash";
  run.gradient_checkpointing = true;
  const DeviceInfo device = probe_device("cpu");
  nlohmann::json rung = plan_rung(run, source.config, device, 0, "flash", "flash");
  MeasureHooks hooks;
  hooks.profile = true;
  measure_rung(rung, run, source.config, device, 2, hooks);
  ASSERT_TRUE(rung.contains("op_profile")) << rung.dump();
  std::set<std::string> names;
  for (const auto& op : rung["op_profile"]["ops"]) names.insert(op["op"].get<std::string>());
  for (const char* expected : {"matmul", "attention_flash_forward", "attention_flash_backward", "rmsnorm_forward",
                               "adamw_step", "cross_entropy_forward_backward"})
    EXPECT_TRUE(names.contains(expected)) << expected << " missing from " << rung["op_profile"].dump();
  // A checkpointed step runs the attention forward twice per layer (forward, then recompute).
  for (const auto& op : rung["op_profile"]["ops"])
    if (op["op"] == "attention_flash_forward")
      EXPECT_EQ(op["calls"].get<int64_t>(), 2 * source.config.num_hidden_layers);
  EXPECT_GT(rung["op_profile"]["total_ms"].get<double>(), 0.0);
  EXPECT_TRUE(rung["measured"].get<bool>());
}

}  // namespace
}  // namespace memtune
