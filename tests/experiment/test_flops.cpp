// MFU: the model-FLOPs formula on a model whose parameter counts are known exactly, and the
// table of device peaks.
#include <gtest/gtest.h>

#include "memtune/model/llama_config.h"
#include "memtune/experiment/flops.h"

using namespace memtune;

TEST(Flops, Llama31_8bLoraTokenCostIsTheDocumentedSum) {
  const LlamaConfig model = resolve_model("llama-3.1-8b").config;
  RunConfig run;
  run.lora_r = 16;
  run.lora_target_modules = "all-linear";
  run.max_seq_length = 2048;
  // 8,030,261,248 parameters less the embedding (128256 x 4096) and the 65 RMSNorm vectors: the
  // seven projections of 32 layers plus the LM head.
  const double frozen_matmul = 8030261248.0 - 128256.0 * 4096 - 65.0 * 4096;
  const double lora = 41943040;  // r 16 on all seven projections (the plan's trainable count)
  const double attention = 6.0 * 32 * 2048 * 4096;  // causal half, forward + backward
  EXPECT_DOUBLE_EQ(lora_training_flops_per_token(model, run), 4 * frozen_matmul + 6 * lora + attention);

  // Attention is the only term that grows with the sequence; precision and batch shape do not enter.
  RunConfig longer = run;
  longer.max_seq_length = 4096;
  longer.precision = Precision::bf16;
  longer.per_device_train_batch_size = 4;
  EXPECT_DOUBLE_EQ(lora_training_flops_per_token(model, longer) - lora_training_flops_per_token(model, run), attention);
  // A frozen model is mostly forward + backward-to-input: about 4 FLOPs per parameter, not the 6 of full training.
  EXPECT_NEAR(lora_training_flops_per_token(model, run) / 8.03e9, 4.0, 0.4);
}

TEST(Flops, DevicePeaksByDriverName) {
  const auto tflops = [](std::string_view name, Precision p = Precision::bf16, int sms = 0) {
    const std::optional<DevicePeakFlops> peak = device_peak_flops(name, p, sms);
    return peak ? peak->flops_per_second / 1e12 : -1.0;
  };
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H200"), 989.4);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H100 80GB HBM3"), 989.4);  // SXM
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H100 PCIe"), 756.0);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA A100-SXM4-80GB"), 312.0);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA A100 80GB PCIe"), 312.0);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA GeForce RTX 4090"), 165.2);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA GeForce RTX 3090"), 71.0);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA L4"), 121.0);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA A10"), 125.0);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA A10", Precision::fp16), 125.0);
  // Whole tokens: an A10G or an L40S is not in the table, and is not mistaken for an A10 or an L4.
  EXPECT_EQ(tflops("NVIDIA A10G"), -1.0);
  EXPECT_EQ(tflops("NVIDIA L40S"), -1.0);
  EXPECT_EQ(tflops("cpu"), -1.0);
  // fp32 rungs get no MFU.
  EXPECT_EQ(tflops("NVIDIA H200", Precision::fp32), -1.0);
  // A MIG slice reports its share of the SMs, and gets that share of the peak.
  EXPECT_NEAR(tflops("NVIDIA H200 MIG 3g.71gb", Precision::bf16, 60), 989.4 * 60 / 132, 1e-9);
  EXPECT_DOUBLE_EQ(tflops("NVIDIA H200", Precision::bf16, 132), 989.4);
  const std::optional<DevicePeakFlops> slice = device_peak_flops("NVIDIA H200 MIG 3g.71gb", Precision::bf16, 60);
  ASSERT_TRUE(slice.has_value());
  EXPECT_NE(slice->source.find("MIG"), std::string::npos);
  EXPECT_NE(slice->source.find("datasheet"), std::string::npos);
}

TEST(Flops, Utilization) {
  const DevicePeakFlops h200{989.4e12, "NVIDIA H200", "datasheet"};
  EXPECT_NEAR(*model_flops_utilization(3.2e10, 10000.0, h200), 3.2e14 / 989.4e12, 1e-12);
  EXPECT_FALSE(model_flops_utilization(3.2e10, std::nullopt, h200).has_value());
  EXPECT_FALSE(model_flops_utilization(3.2e10, 10000.0, std::nullopt).has_value());
  EXPECT_FALSE(model_flops_utilization(3.2e10, 0.0, h200).has_value());
}
