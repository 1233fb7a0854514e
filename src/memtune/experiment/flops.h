// Model FLOPs utilisation (MFU) for the ladder and the sweep: the model FLOPs that one trained
// token needs, and the peak FLOP/s of the device that ran it.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "memtune/model/llama_config.h"
#include "memtune/train/run_config.h"

namespace memtune {

// Model FLOPs per trained token of one LoRA/QLoRA training step (forward + backward, no
// recompute): see flops.cpp for the derivation. Depends on the model, the LoRA targets and rank,
// and max_seq_length (attention); not on precision, batch shape, checkpointing or kernels.
double lora_training_flops_per_token(const LlamaConfig& model, const RunConfig& run);

// The dense tensor-core peak of a known device, for the run's precision.
struct DevicePeakFlops {
  double flops_per_second = 0;
  std::string device;  // the table's name for it: "NVIDIA H100 SXM"
  std::string source;  // where the figure comes from
};
// nullopt for an unknown device, for the CPU, and for fp32 runs (see flops.cpp for why).
// `device_name` is what the CUDA driver reports ("NVIDIA H200", "NVIDIA H200 MIG 3g.71gb").
// `multiprocessors` (0: unknown) is the SM count the device reports: a MIG slice reports its
// share, and the peak is scaled to it, so that MFU on 3/7 of a card is not read against all of it.
std::optional<DevicePeakFlops> device_peak_flops(std::string_view device_name, Precision precision,
                                                 int multiprocessors = 0);

// tokens/s x FLOPs per token / peak; nullopt when either is unknown or not positive.
std::optional<double> model_flops_utilization(double flops_per_token, std::optional<double> tokens_per_second,
                                              const std::optional<DevicePeakFlops>& peak);

}  // namespace memtune
