// Planning and measuring one run configuration: what a ladder rung and a sweep point share.
// Both produce the same JSON object ("a rung"), so that the report, the CSV and tools read
// one shape (see report/ladder_report.h for the fields).
#pragma once

#include <cstdio>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "memtune/core/tensor.h"
#include "memtune/model/llama_config.h"
#include "memtune/experiment/flops.h"
#include "memtune/core/progress.h"
#include "memtune/train/engine.h"

namespace memtune {

// The device the runs go to, probed once before any of them.
struct DeviceInfo {
  std::string option = "auto";   // --device: cpu | cuda | auto
  Device target = Device::cpu;
  std::string description;       // for reports: "NVIDIA H200", "cpu (no GPU: ...)"
  std::string name;              // the driver's name (the peak-FLOPs table key); "cpu"
  uint64_t context_bytes = 0;    // CUDA context + library handles, measured before any arena
  uint64_t capacity_bytes = 0;   // what one run may take: a rung that plans more is plan only
  int multiprocessors = 0;       // SMs the device reports (a MIG slice reports its share); 0 on the CPU
  double measured_gemm_flops = 0;  // dense bf16 GEMM rate measured by probe_device; 0: not measured
};
// measure_gemm: on a GPU, also time the backend's dense bf16 GEMM (8192^3, fp32 accumulation)
// after the context is measured, so that MFU can be stated against what the GEMMs reach in
// the same process (about a second; the buffers are freed before anything else runs).
DeviceInfo probe_device(const std::string& option, bool measure_gemm = false);

// Top-level fields that say how "mfu" was computed: device_peak_flops (bf16/fp16 dense, null
// when unknown or on the CPU), device_peak_flops_device, device_peak_flops_source, mfu_definition,
// and measured_gemm_flops (null when not measured).
nlohmann::json mfu_context_json(const DeviceInfo& device);

// "bf16+nf4-base", "flash", "checkpointing", "full-loss", "batch 2 x accumulation 8", "seq 2048".
std::vector<std::string> techniques_of(const RunConfig& run);

// Tokens in one optimizer step: the unit of the progress line's ETA.
double tokens_per_step(const RunConfig& run);

// Peak over the step of the live bytes in buffers whose size depends on the attention
// implementation (eager: scores, probabilities and their gradient, [batch, heads, seq, seq];
// flash: the log-sum-exp rows and the backward's delta and dQ accumulator).
uint64_t attention_buffer_peak_bytes(const Plan& plan);

// The rung as planned, unmeasured: name, added, techniques, planned (by category),
// planned_peak_bytes, planned_with_context_bytes, attention_bytes, model_flops_per_token,
// fits_budget, fits_device, micro_batch, grad_accum, seq, and the measured fields as null
// (measured false).
nlohmann::json plan_rung(const RunConfig& run, const LlamaConfig& model, const DeviceInfo& device,
                         uint64_t budget_bytes, const std::string& name, const std::string& added);

struct MeasureHooks {
  ProgressLine* progress = nullptr;
  MetricsLog* metrics = nullptr;
  std::string label;                                  // progress line prefix: "[3/8] + flash attention"
  nlohmann::json fields = nlohmann::json::object();   // merged into every metrics record
  double work_before = 0;                             // tokens done before this run (for the ETA)
  // After the measured steps, one more step with every op timed (ops/timed_backend.h): its
  // breakdown goes to rung["op_profile"] and, as a table, to profile_log when set. The measured
  // steps are not affected (the wrapper is disabled for them).
  bool profile = false;
  std::FILE* profile_log = nullptr;
};

// Trains `steps` optimizer steps on synthetic tokens and fills the measured fields of `rung`:
// measured, engine_peak_bytes, device_peak_bytes (GPU), step_seconds, tokens_per_second, loss,
// loss_scaler (fp16), mfu. Writes one "step" metrics record per step. With hooks.profile, also
// op_profile (see MeasureHooks).
void measure_rung(nlohmann::json& rung, const RunConfig& run, const LlamaConfig& model, const DeviceInfo& device,
                  int64_t steps, const MeasureHooks& hooks);

}  // namespace memtune
