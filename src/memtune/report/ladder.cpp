#include "memtune/report/ladder.h"

#include <chrono>
#include <cstdio>
#include <functional>

#include "memtune/core/bytes.h"
#include "memtune/core/error.h"
#include "memtune/data/jsonl_dataset.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/device.h"
#include "memtune/plan/plan_report.h"
#include "memtune/train/engine_arena.h"

namespace memtune {
namespace {

struct Trick {
  std::string name;   // as --order takes it
  std::string label;  // as the report shows it
  std::function<void(RunConfig&)> apply;
};

const std::vector<Trick>& tricks() {
  static const std::vector<Trick> all = {
      {"bf16", "+ bf16", [](RunConfig& r) { r.precision = Precision::bf16; }},
      {"gradient_checkpointing", "+ gradient checkpointing", [](RunConfig& r) { r.gradient_checkpointing = true; }},
      {"flash", "+ flash attention", [](RunConfig& r) { r.attn_implementation = "flash"; }},
      {"qlora", "+ QLoRA (nf4, double quant)", [](RunConfig& r) {
         r.load_in_4bit = true;
         r.quant = QuantConfig{};  // nf4, blocksize 64, double quant
         if (r.precision == Precision::fp32) r.precision = Precision::bf16;
       }},
      {"chunked_loss", "+ chunked loss", [](RunConfig& r) { r.loss_implementation = "chunked"; }},
      {"micro_batch", "micro-batch 1 x more accumulation", [](RunConfig& r) {
         r.gradient_accumulation_steps *= r.per_device_train_batch_size;
         r.per_device_train_batch_size = 1;
       }},
      {"seq_halved", "max_seq_length halved", [](RunConfig& r) { r.max_seq_length = std::max<int64_t>(2, r.max_seq_length / 2); }},
  };
  return all;
}

std::vector<std::string> techniques_of(const RunConfig& r) {
  return {std::string(precision_name(r.precision)) + (r.load_in_4bit ? "+nf4-base" : ""), r.attn_implementation,
          r.gradient_checkpointing ? "checkpointing" : "no-checkpointing",
          r.loss_implementation + "-loss",
          fmt::format("batch {} x accumulation {}", r.per_device_train_batch_size, r.gradient_accumulation_steps),
          fmt::format("seq {}", r.max_seq_length)};
}

nlohmann::json measure_rung(const LadderOptions& options, const RunConfig& run, const LlamaConfig& model,
                            const std::string& name, const std::string& added, uint64_t context_bytes,
                            uint64_t device_capacity) {
  const Plan plan = plan_run(run, model);
  nlohmann::json planned = nlohmann::json::object();
  for (int c = 0; c < kNumMemCategories; ++c) planned[std::string(category_name(category_at(c)))] = plan.at_peak[c];
  const uint64_t with_context = plan.arena_bytes + context_bytes;
  nlohmann::json rung = {{"name", name}, {"added", added}, {"techniques", techniques_of(run)},
                         {"planned", planned}, {"planned_peak_bytes", plan.arena_bytes},
                         {"planned_with_context_bytes", with_context},
                         {"fits_budget", options.budget_bytes == 0 || with_context <= options.budget_bytes},
                         {"fits_device", with_context <= device_capacity},
                         {"micro_batch", run.per_device_train_batch_size},
                         {"grad_accum", run.gradient_accumulation_steps}, {"seq", run.max_seq_length},
                         {"measured", false}, {"engine_peak_bytes", nullptr}, {"device_peak_bytes", nullptr},
                         {"step_seconds", nullptr}, {"tokens_per_second", nullptr}, {"loss", nullptr}};
  if (!rung["fits_device"].get<bool>()) return rung;

  std::unique_ptr<Backend> backend = make_backend(options.device);
  const uint64_t in_use_before = device_memory_in_use(*backend);
  PlannedEngine engine(*backend, run, model);
  engine->init_random_weights(run.seed);
  engine->init_adapters(run.seed + 1);
  const int64_t per_step = run.per_device_train_batch_size * run.gradient_accumulation_steps;
  const Dataset data = synthetic_dataset(per_step * options.steps, run.max_seq_length, model.vocab_size, run.seed);
  double timed_seconds = 0;
  int64_t timed_tokens = 0;
  double loss = 0;
  for (int64_t s = 0; s < options.steps; ++s) {
    std::vector<HostMicroBatch> batches;
    for (int64_t m = 0; m < run.gradient_accumulation_steps; ++m) {
      std::vector<std::vector<int32_t>> ids;
      for (int64_t b = 0; b < run.per_device_train_batch_size; ++b)
        ids.push_back(data.samples[(s * per_step + m * run.per_device_train_batch_size + b)].input_ids);
      batches.push_back(make_micro_batch(ids, ids, run.max_seq_length));
    }
    const auto start = std::chrono::steady_clock::now();
    const StepReport report = engine->train_step(batches);
    backend->synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // The first step carries one-time costs (page faults, library warm-up): time the rest.
    if (s > 0 || options.steps == 1) {
      timed_seconds += seconds;
      timed_tokens += report.tokens;
    }
    loss = report.loss;
    if (!options.quiet)
      std::fprintf(stderr, "\r  %-36s step %lld/%lld  loss %.4f  %.2f s/step", name.c_str(),
                   static_cast<long long>(s + 1), static_cast<long long>(options.steps), report.loss, seconds);
  }
  if (!options.quiet) std::fprintf(stderr, "\n");
  const int64_t timed_steps = options.steps > 1 ? options.steps - 1 : 1;
  rung["measured"] = true;
  rung["engine_peak_bytes"] = engine->memory().allocator().high_water();
  // Nothing is allocated inside the step, so memory in use now is the run's peak. Earlier
  // rungs' memory is freed; the context (and library handles) is counted, as nvidia-smi does.
  if (backend->device() != Device::cpu) {
    rung["device_peak_bytes"] = device_memory_in_use(*backend);
    rung["device_in_use_before_bytes"] = in_use_before;
  }
  rung["step_seconds"] = timed_seconds / timed_steps;
  rung["tokens_per_second"] = timed_tokens / timed_seconds;
  rung["loss"] = loss;
  if (run.precision == Precision::fp16)
    rung["loss_scaler"] = {{"skipped_steps", engine->scaler().skipped_steps}, {"final_scale", engine->scaler().scale}};
  return rung;
}

}  // namespace

const std::vector<std::string>& ladder_trick_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const Trick& t : tricks()) n.push_back(t.name);
    return n;
  }();
  return names;
}

nlohmann::json run_ladder(const LadderOptions& options) {
  const ModelSource source = resolve_model(options.base.model);
  std::unique_ptr<Backend> probe = make_backend(options.device);
  const bool on_cpu = probe->device() == Device::cpu;
  const std::string device = on_cpu ? "cpu (no GPU: embedded model on the CPU backend)" : device_description(*probe);
  // The CUDA context and library handles, measured before any arena exists.
  const uint64_t context_bytes = device_memory_in_use(*probe);
  // The CPU rungs are bounded by host memory; keep them well inside the CI machine's. On a GPU
  // leave 2% of the card for the allocator's own rounding.
  const uint64_t device_capacity = on_cpu ? 8 * kGiB : device_memory_total(*probe) / 50 * 49;
  probe.reset();

  std::vector<std::string> order = options.order.empty() ? ladder_trick_names() : options.order;
  for (const std::string& name : order) {
    bool known = false;
    for (const Trick& t : tricks()) known |= t.name == name;
    MT_USER_CHECK(known, "--order: unknown trick '{}'", name);
  }

  RunConfig run = options.base;
  run.precision = Precision::fp16;  // the seed's baseline: fp16, eager, no checkpointing, full loss
  run.attn_implementation = "eager";
  run.gradient_checkpointing = false;
  run.loss_implementation = "full";
  run.validate();

  nlohmann::json ladder = {
      {"config", run_config_json(run, source.config)},
      {"device", device}, {"device_context_bytes", context_bytes},
      {"commit", options.commit}, {"date", options.date}, {"budget_bytes", options.budget_bytes}};
  ladder["config"]["steps_per_rung"] = options.steps;
  ladder["config"]["order"] = order;
  nlohmann::json rungs = nlohmann::json::array();
  rungs.push_back(measure_rung(options, run, source.config, "fp16 baseline", "", context_bytes, device_capacity));
  for (const std::string& name : order) {
    for (const Trick& t : tricks()) {
      if (t.name != name) continue;
      t.apply(run);
      rungs.push_back(measure_rung(options, run, source.config, t.label, t.name, context_bytes, device_capacity));
    }
  }
  ladder["rungs"] = rungs;
  return ladder;
}

}  // namespace memtune
