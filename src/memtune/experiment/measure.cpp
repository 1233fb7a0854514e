#include "memtune/experiment/measure.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>

#include "memtune/core/bytes.h"
#include "memtune/data/jsonl_dataset.h"
#include "memtune/ops/device.h"
#include "memtune/ops/timed_backend.h"
#include "memtune/train/engine_arena.h"

#ifdef MEMTUNE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace memtune {
namespace {

// The SM count of the current CUDA device, for scaling the peak FLOPs of a MIG slice; 0 when
// unknown. (device.h gives the name and memory; this is the one more property MFU needs.)
int cuda_multiprocessor_count() {
#ifdef MEMTUNE_WITH_CUDA
  int index = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&index) == cudaSuccess && cudaGetDeviceProperties(&prop, index) == cudaSuccess)
    return prop.multiProcessorCount;
  cudaGetLastError();  // clear the error so that later calls do not report it
#endif
  return 0;
}

// FLOP/s of c = a b^T in bf16 at 8192^3 on this backend: the rate the step's big GEMMs can
// reach, as bench/bench_gemm.cpp's first row measures it.
double dense_gemm_flops(Backend& backend) {
  constexpr int64_t kSide = 8192;
  constexpr int kIterations = 20;
  const uint64_t matrix_bytes = static_cast<uint64_t>(kSide * kSide) * 2;
  void* arena = backend.allocate_arena(3 * matrix_bytes);
  const auto matrix = [&](int index) {
    return Tensor{static_cast<char*>(arena) + index * matrix_bytes, DType::bf16, Shape{kSide, kSide},
                  backend.device()};
  };
  const Tensor a = matrix(0), b = matrix(1), c = matrix(2);
  // Random inputs: a GEMM of zeros runs faster than one of real data.
  backend.fill_random(a, Backend::Distribution::normal, 0.0f, 1.0f, 11);
  backend.fill_random(b, Backend::Distribution::normal, 0.0f, 1.0f, 12);
  for (int i = 0; i < 3; ++i) backend.matmul(c, a, false, b, true, 1.0f, 0.0f);  // warm-up, heuristic
  backend.synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kIterations; ++i) backend.matmul(c, a, false, b, true, 1.0f, 0.0f);
  backend.synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  backend.free_arena(arena);
  return 2.0 * kSide * kSide * kSide * kIterations / seconds;
}

}  // namespace

DeviceInfo probe_device(const std::string& option, bool measure_gemm) {
  DeviceInfo info;
  info.option = option;
  std::unique_ptr<Backend> probe = make_backend(option);
  const bool on_cpu = probe->device() == Device::cpu;
  info.target = probe->device();
  info.name = on_cpu ? "cpu" : device_description(*probe);
  info.description = on_cpu ? "cpu (no GPU: embedded model on the CPU backend)" : info.name;
  // The CUDA context and library handles, measured before any arena exists.
  info.context_bytes = device_memory_in_use(*probe);
  // The CPU runs are bounded by host memory; keep them well inside the CI machine's. On a GPU
  // leave 2% of the card for the allocator's own rounding.
  info.capacity_bytes = on_cpu ? 8 * kGiB : device_memory_total(*probe) / 50 * 49;
  info.multiprocessors = on_cpu ? 0 : cuda_multiprocessor_count();
  if (measure_gemm && !on_cpu) info.measured_gemm_flops = dense_gemm_flops(*probe);
  return info;
}

nlohmann::json mfu_context_json(const DeviceInfo& device) {
  const std::optional<DevicePeakFlops> peak =
      device.target == Device::cpu ? std::nullopt
                                    : device_peak_flops(device.name, Precision::bf16, device.multiprocessors);
  return {{"device_peak_flops", peak ? nlohmann::json(peak->flops_per_second) : nlohmann::json(nullptr)},
          {"device_peak_flops_device", peak ? nlohmann::json(peak->device) : nlohmann::json(nullptr)},
          {"device_peak_flops_source", peak ? nlohmann::json(peak->source) : nlohmann::json(nullptr)},
          {"measured_gemm_flops", device.measured_gemm_flops > 0 ? nlohmann::json(device.measured_gemm_flops)
                                                                  : nlohmann::json(nullptr)},
          {"measured_gemm_definition",
           "dense bf16 GEMM 8192 x 8192 x 8192 (c = a b^T, fp32 accumulation) through the backend's matmul, "
           "mean of 20 after 3 warm-ups, measured in this process before the first rung"},
          {"mfu_definition",
           "mfu = model_flops_per_token x tokens/s / device_peak_flops (dense bf16/fp16 tensor-core peak); "
           "model FLOPs per token = 4 x frozen matmul parameters (forward + backward to the input, LM head "
           "included) + 6 x LoRA parameters + 6 x layers x seq x q_dim (attention, causal half, forward + "
           "backward); the recompute of gradient checkpointing is not counted. Null on the CPU, on an "
           "unknown device, and for fp32 runs."}};
}

std::vector<std::string> techniques_of(const RunConfig& r) {
  std::vector<std::string> techniques = {
      std::string(precision_name(r.precision)) + (r.load_in_4bit ? "+nf4-base" : ""), r.attn_implementation,
      r.gradient_checkpointing ? (r.offload_activations ? "checkpointing+offload" : "checkpointing") : "no-checkpointing",
      r.loss_implementation + "-loss",
      fmt::format("batch {} x accumulation {}", r.per_device_train_batch_size, r.gradient_accumulation_steps),
      fmt::format("seq {}", r.max_seq_length)};
  // Host memory that the device peak leaves out: say so where a reader compares the peaks.
  if (r.offload_embeddings) techniques.push_back("host-embeddings");
  if (r.offload_optimizer) techniques.push_back("host-optimizer");
  if (r.stream_layers > 0) techniques.push_back(fmt::format("host-layers {}", r.stream_layers));
  return techniques;
}

double tokens_per_step(const RunConfig& run) {
  return static_cast<double>(run.per_device_train_batch_size * run.gradient_accumulation_steps * run.max_seq_length);
}

uint64_t attention_buffer_peak_bytes(const Plan& plan) {
  // The step's names for them (step/llama_step.cpp): "layers.3.attn_probs" and so on.
  static const std::set<std::string> kAttentionBuffers = {"attn_scores", "attn_probs", "attn_dprobs",
                                                          "attn_lse",    "attn_delta", "attn_dq_accum"};
  std::vector<std::pair<int64_t, int64_t>> events;  // (event index, +bytes / -bytes)
  for (const AllocationRecord& record : plan.records) {
    const size_t dot = record.name.rfind('.');
    const std::string leaf = dot == std::string::npos ? record.name : record.name.substr(dot + 1);
    if (!kAttentionBuffers.contains(leaf)) continue;
    events.emplace_back(record.allocated_at, static_cast<int64_t>(record.bytes));
    if (record.freed_at >= 0) events.emplace_back(record.freed_at, -static_cast<int64_t>(record.bytes));
  }
  std::sort(events.begin(), events.end());
  int64_t live = 0, peak = 0;
  for (const auto& [at, delta] : events) {
    live += delta;
    peak = std::max(peak, live);
  }
  return static_cast<uint64_t>(peak);
}

nlohmann::json plan_rung(const RunConfig& run, const LlamaConfig& model, const DeviceInfo& device,
                         uint64_t budget_bytes, const std::string& name, const std::string& added) {
  const Plan plan = plan_run(run, model, device.target);
  nlohmann::json planned = nlohmann::json::object();
  for (int c = 0; c < kNumMemCategories; ++c) planned[std::string(category_name(category_at(c)))] = plan.at_peak[c];
  const uint64_t with_context = plan.arena_bytes + device.context_bytes;
  return {{"name", name}, {"added", added}, {"techniques", techniques_of(run)},
          {"planned", planned}, {"planned_peak_bytes", plan.arena_bytes},
          {"planned_with_context_bytes", with_context},
          {"attention_bytes", attention_buffer_peak_bytes(plan)},
          {"model_flops_per_token", lora_training_flops_per_token(model, run)},
          {"fits_budget", budget_bytes == 0 || with_context <= budget_bytes},
          {"fits_device", with_context <= device.capacity_bytes},
          {"micro_batch", run.per_device_train_batch_size},
          {"grad_accum", run.gradient_accumulation_steps}, {"seq", run.max_seq_length},
          {"measured", false}, {"engine_peak_bytes", nullptr}, {"device_peak_bytes", nullptr},
          {"step_seconds", nullptr}, {"tokens_per_second", nullptr}, {"loss", nullptr}, {"mfu", nullptr}};
}

namespace {

nlohmann::json finite_or_null(double value) { return std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr); }

}  // namespace

void measure_rung(nlohmann::json& rung, const RunConfig& run, const LlamaConfig& model, const DeviceInfo& device,
                  int64_t steps, const MeasureHooks& hooks) {
  std::unique_ptr<Backend> backend = make_backend(device.option);
  const uint64_t in_use_before = device_memory_in_use(*backend);
  // Every op goes through the timing wrapper; it times only the profile step (hooks.profile).
  TimedBackend timed(*backend);
  PlannedEngine engine(timed, run, model);
  engine->init_random_weights(run.seed);
  engine->init_adapters(run.seed + 1);
  const int64_t per_step = run.per_device_train_batch_size * run.gradient_accumulation_steps;
  const int64_t data_steps = steps + (hooks.profile ? 1 : 0);
  const Dataset data = synthetic_dataset(per_step * data_steps, run.max_seq_length, model.vocab_size, run.seed);
  const auto micro_batches = [&](int64_t s) {
    std::vector<HostMicroBatch> batches;
    for (int64_t m = 0; m < run.gradient_accumulation_steps; ++m) {
      std::vector<std::vector<int32_t>> ids;
      for (int64_t b = 0; b < run.per_device_train_batch_size; ++b)
        ids.push_back(data.samples[(s * per_step + m * run.per_device_train_batch_size + b)].input_ids);
      batches.push_back(make_micro_batch(ids, ids, run.max_seq_length));
    }
    return batches;
  };
  double timed_seconds = 0;
  int64_t timed_tokens = 0;
  double loss = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const std::vector<HostMicroBatch> batches = micro_batches(s);
    const auto start = std::chrono::steady_clock::now();
    const StepReport report = engine->train_step(batches);
    backend->synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // The first step carries one-time costs (page faults, library warm-up): time the rest.
    if (s > 0 || steps == 1) {
      timed_seconds += seconds;
      timed_tokens += report.tokens;
    }
    loss = report.loss;
    if (hooks.metrics != nullptr && hooks.metrics->enabled()) {
      nlohmann::json record = {{"event", "step"}};
      record.update(hooks.fields);
      record.update({{"step", s + 1}, {"steps", steps}, {"loss", finite_or_null(report.loss)},
                     {"step_seconds", seconds}, {"tokens", report.tokens},
                     {"tokens_per_second", seconds > 0 ? finite_or_null(report.tokens / seconds) : nlohmann::json(nullptr)},
                     {"lr", report.learning_rate}, {"grad_norm", finite_or_null(report.grad_norm)}});
      if (run.precision == Precision::fp16) record["skipped"] = report.skipped;
      hooks.metrics->write(std::move(record));
    }
    if (hooks.progress != nullptr) {
      hooks.progress->set_work_done(hooks.work_before + tokens_per_step(run) * static_cast<double>(s + 1));
      hooks.progress->update(fmt::format("{}  step {}/{}  loss {:.4f}  {:.2f} s/step", hooks.label, s + 1, steps,
                                         report.loss, seconds));
    }
  }
  if (hooks.profile) {
    timed.set_enabled(true);
    (void)engine->train_step(micro_batches(steps));
    timed.set_enabled(false);
    rung["op_profile"] = timed.to_json();
    if (hooks.profile_log != nullptr)
      std::fprintf(hooks.profile_log, "op profile of one step, %s:\n%s\n", hooks.label.c_str(), timed.table().c_str());
  }
  const int64_t timed_steps = steps > 1 ? steps - 1 : 1;
  rung["measured"] = true;
  rung["engine_peak_bytes"] = engine->memory().allocator().high_water();
  // Nothing is allocated inside the step, so memory in use now is the run's peak. Earlier
  // runs' memory is freed; the context (and library handles) is counted, as nvidia-smi does.
  if (backend->device() != Device::cpu) {
    rung["device_peak_bytes"] = device_memory_in_use(*backend);
    rung["device_in_use_before_bytes"] = in_use_before;
  }
  rung["step_seconds"] = timed_seconds / static_cast<double>(timed_steps);
  const double tokens_per_second = timed_seconds > 0 ? static_cast<double>(timed_tokens) / timed_seconds : 0.0;
  rung["tokens_per_second"] = tokens_per_second;
  rung["loss"] = loss;
  if (run.precision == Precision::fp16)
    rung["loss_scaler"] = {{"skipped_steps", engine->scaler().skipped_steps}, {"final_scale", engine->scaler().scale}};
  const std::optional<DevicePeakFlops> peak =
      backend->device() == Device::cpu ? std::nullopt
                                        : device_peak_flops(device.name, run.precision, device.multiprocessors);
  const std::optional<double> mfu =
      model_flops_utilization(lora_training_flops_per_token(model, run), tokens_per_second, peak);
  rung["mfu"] = mfu ? nlohmann::json(*mfu) : nlohmann::json(nullptr);
}

}  // namespace memtune
