#include "memtune/plan/plan_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>

#include "memtune/core/bytes.h"
#include "memtune/parallel/sharded_base.h"
#include "memtune/plan/fit.h"

namespace memtune {

nlohmann::json run_config_json(const RunConfig& run, const LlamaConfig& model) {
  return {{"model", model.name.empty() ? run.model : model.name},
          {"precision", std::string(precision_name(run.precision))},
          {"attn_implementation", run.attn_implementation},
          {"loss_implementation", run.loss_implementation},
          {"loss_chunk_tokens", run.loss_chunk_tokens},
          {"mlp_chunk_tokens", run.resolved_token_chunk_rows()},
          {"hold_chunk_weights", run.hold_chunk_weights},
          {"offload_activations", run.offload_activations},
          {"offload_embeddings", run.offload_embeddings},
          {"offload_optimizer", run.offload_optimizer},
          {"stream_layers", run.stream_layers},
          {"packed_rows", run.packed_rows},
          {"gradient_checkpointing", run.gradient_checkpointing},
          {"per_device_train_batch_size", run.per_device_train_batch_size},
          {"gradient_accumulation_steps", run.gradient_accumulation_steps},
          {"max_seq_length", run.max_seq_length},
          {"lora_r", run.lora_r},
          {"lora_alpha", run.lora_alpha},
          {"lora_dropout", run.lora_dropout},
          {"use_rslora", run.use_rslora},
          {"lora_target_modules", run.lora_target_modules},
          {"stacked_lora", run.stacked_lora},
          {"learning_rate", run.learning_rate},
          {"max_steps", run.max_steps},
          {"seed", run.seed}};
}

namespace {
// What a host allocation is (the names are ModelWeights', LlamaStep's, LoraState's and
// ShardedBase's): its key in the plan's JSON and its line in the plan's text.
struct HostKind {
  const char* key;
  const char* label;
};
HostKind host_kind(const std::string& name) {
  if (name == "model.embed_tokens.weight") return {"embeddings", "offloaded embeddings"};
  if (name.rfind("lora.", 0) == 0) return {"optimizer", "offloaded optimizer"};
  if (name.rfind("base_host.", 0) == 0) return {"streamed_layers", "streamed layers"};
  return {"offloaded_activations", "offloaded activations"};
}
}  // namespace

nlohmann::json plan_json(const Plan& plan, const RunConfig& run, const LlamaConfig& model) {
  nlohmann::json categories = nlohmann::json::object(), max = nlohmann::json::object();
  for (int c = 0; c < kNumMemCategories; ++c) {
    categories[std::string(category_name(category_at(c)))] = plan.at_peak[c];
    max[std::string(category_name(category_at(c)))] = plan.max_by_category[c];
  }
  // Host memory is not part of the device peak: its own object.
  nlohmann::json host = nlohmann::json::object();
  host["offloaded_activations"] = 0;
  for (const HostAllocationRecord& r : plan.host_records) {
    const char* key = host_kind(r.name).key;
    host[key] = host.value(key, uint64_t{0}) + r.bytes;
  }
  // Every figure is in bytes; "device" is the backend planned for (its workspace included).
  return {{"units", "bytes"},
          {"device", std::string(device_name(plan.target))},
          {"categories", categories},
          {"max_by_category", max},
          {"host_categories", host},
          {"host_bytes", plan.host_bytes},
          {"peak_bytes", plan.arena_bytes},
          {"peak_live_bytes", plan.peak_live_bytes},
          {"trainable_parameters", plan.trainable_parameters},
          {"frozen_parameters", plan.frozen_parameters},
          {"allocations", plan.records.size()},
          {"planning_seconds", plan.seconds},
          {"run", run_config_json(run, model)}};
}

std::string format_plan(const Plan& plan, const RunConfig& run, const LlamaConfig& model) {
  std::string out = fmt::format(
      "memtune plan for {}: {} | {} | attention {} | checkpointing {}{} | loss {} | batch {} x seq {} "
      "(accumulation {}) | LoRA r{} alpha {} on {}\n",
      device_name(plan.target), model.name.empty() ? run.model : model.name, precision_name(run.precision),
      run.attn_implementation, run.gradient_checkpointing ? "on" : "off",
      run.offload_activations ? " + offload" : "", run.loss_implementation,
      run.per_device_train_batch_size, run.max_seq_length, run.gradient_accumulation_steps,
      run.lora_r, run.lora_alpha, run.lora_target_modules);
  // The figure columns: 14 wide, or wider where a figure needs it (a model at the size limits),
  // so that two figures never run together.
  size_t width = 14;
  const auto widen = [&](uint64_t bytes) { width = std::max(width, format_bytes(bytes).size() + 2); };
  for (int c = 0; c < kNumMemCategories; ++c) widen(plan.at_peak[c]), widen(plan.max_by_category[c]);
  widen(plan.arena_bytes);
  // One line a label: the streamed layers are one record each.
  std::vector<std::pair<std::string, uint64_t>> host_lines;
  for (const HostAllocationRecord& r : plan.host_records) {
    const std::string label = host_kind(r.name).label;
    const auto same = std::find_if(host_lines.begin(), host_lines.end(), [&](const auto& line) { return line.first == label; });
    if (same != host_lines.end()) same->second += r.bytes;
    else host_lines.emplace_back(label, r.bytes);
  }
  for (const auto& line : host_lines) widen(line.second);
  out += fmt::format("  {:<24}{:>{}}{:>{}}\n", "category", "at peak", width, "own max", width);
  for (int c = 0; c < kNumMemCategories; ++c)
    out += fmt::format("  {:<24}{:>{}}{:>{}}\n", category_label(category_at(c)), format_bytes(plan.at_peak[c]), width,
                       format_bytes(plan.max_by_category[c]), width);
  out += fmt::format("  {:<24}{:>{}}\n", "peak (arena)", format_bytes(plan.arena_bytes), width);
  // Host memory, beside the device arena (pinned, allocated once; not in the device peak).
  if (plan.host_records.empty())
    out += fmt::format("  {:<24}{:>{}}   host (pinned), not in the device peak\n", "host memory", format_bytes(0), width);
  for (const auto& [label, bytes] : host_lines) {
    out += fmt::format("  {:<24}{:>{}}   host (pinned), not in the device peak\n", label, format_bytes(bytes), width);
  }
  out += fmt::format("  parameters: {} frozen, {} trainable; {} allocations planned in {:.3f} s\n",
                     plan.frozen_parameters, plan.trainable_parameters, plan.records.size(),
                     plan.seconds);
  if (run.stream_layers > 0)
    out += fmt::format("  streamed from host memory, copied in before each use: layers {} of 0-{}\n",
                       fmt::join(streamed_layer_choice(static_cast<int>(model.num_hidden_layers),
                                                       static_cast<int>(run.stream_layers)),
                                 ", "),
                       model.num_hidden_layers - 1);
  return out;
}

std::string fit_advice(const RunConfig& run, const LlamaConfig& model, uint64_t budget,
                       uint64_t context, Device device, int world_size) {
  struct Change {
    std::string what;
    std::function<bool(RunConfig&)> apply;  // false: not applicable
  };
  const auto planned = [&](const RunConfig& r) { return plan_run(r, model, device, world_size).arena_bytes; };
  // --stream_layers: the fewest layers that fit with nothing else changed, else all but one.
  const int64_t layers = model.num_hidden_layers;
  int64_t stream = 0;
  if (world_size == 1 && run.stream_layers == 0 && !run.shard_base && layers >= 4) {
    stream = fewest_streamed_layers(model, [&](int64_t count) {
      RunConfig r = run;
      r.stream_layers = count;
      return planned(r) + context <= budget;
    });
    if (stream == 0) stream = layers - 1;
  }
  const std::vector<Change> changes = {
      {"--shard_base (the frozen base split across the ranks)", [world_size](RunConfig& r) { if (world_size < 2 || r.shard_base) return false; r.shard_base = true; return true; }},
      {"--bf16", [](RunConfig& r) { if (r.precision != Precision::fp32) return false; r.precision = Precision::bf16; return true; }},
      {"--load_in_4bit (QLoRA: the frozen base in 4 bits)", [](RunConfig& r) { if (r.load_in_4bit) return false; r.load_in_4bit = true; r.bnb_4bit_compute_dtype.clear(); return true; }},
      {"--gradient_checkpointing", [](RunConfig& r) { if (r.gradient_checkpointing) return false; r.gradient_checkpointing = true; return true; }},
      {"--attn_implementation flash", [](RunConfig& r) { if (r.attn_implementation != "eager") return false; r.attn_implementation = "flash"; return true; }},
      {"--loss_implementation chunked", [](RunConfig& r) { if (r.loss_implementation == "chunked") return false; r.loss_implementation = "chunked"; return true; }},
      {"--mlp_chunk_tokens 1024 (with checkpointing)", [](RunConfig& r) { const int64_t rows = r.resolved_token_chunk_rows(); if (!r.gradient_checkpointing || (rows > 0 && rows <= 1024) || r.per_device_train_batch_size * r.max_seq_length <= 1024) return false; r.mlp_chunk_tokens = 1024; return true; }},
      {"--offload_activations (with checkpointing)", [](RunConfig& r) { if (r.offload_activations) return false; r.offload_activations = r.gradient_checkpointing = true; return true; }},
      {"--offload_embeddings", [&model](RunConfig& r) { if (r.offload_embeddings || model.tie_word_embeddings) return false; r.offload_embeddings = true; return true; }},
      {"--offload_optimizer (AdamW's moments in host memory)", [world_size](RunConfig& r) { if (r.offload_optimizer || world_size > 1) return false; r.offload_optimizer = true; return true; }},
      {fmt::format("--stream_layers {} (of {} layers, from host memory)", stream, layers),
       [stream](RunConfig& r) { if (stream == 0 || r.stream_layers > 0) return false; r.stream_layers = stream; return true; }},
      {"halve --per_device_train_batch_size (double accumulation)", [](RunConfig& r) { if (r.per_device_train_batch_size < 2) return false; r.per_device_train_batch_size /= 2; r.gradient_accumulation_steps *= 2; return true; }},
      {"halve --max_seq_length", [](RunConfig& r) { if (r.max_seq_length < 4) return false; r.max_seq_length /= 2; return true; }},
  };
  std::string out = fmt::format("the plan{} needs {} + {} context, over the budget of {}. Single changes:\n",
                                world_size > 1 ? fmt::format(" of one rank of {}", world_size) : "",
                                format_bytes(planned(run)), format_bytes(context), format_bytes(budget));
  RunConfig all = run;
  for (const Change& change : changes) {
    RunConfig changed = run;
    if (!change.apply(changed)) continue;
    change.apply(all);
    const uint64_t peak = planned(changed) + context;
    out += fmt::format("  {:<58} -> {:>12}{}\n", change.what, format_bytes(peak), peak <= budget ? "  fits" : "");
  }
  const uint64_t all_peak = planned(all) + context;
  out += fmt::format("  {:<58} -> {:>12}{}\n", "all of the above", format_bytes(all_peak), all_peak <= budget ? "  fits" : "  still does not fit");
  // The search `memtune fit` makes (same plans, same effective batch and seq), so that the
  // advice and fit give one answer. fit searches GPU runs: a CPU run's advice ends above.
  if (world_size == 1 && device == Device::cuda) {
    const FitResult fit = fit_run(run, model, budget, context);
    const std::string reserve = context > 0 ? fmt::format(" with {} reserved for the CUDA context", format_bytes(context)) : "";
    if (fit.fits)
      out += fmt::format("memtune fit (the same plans{}) finds a run that fits, at {}: {}\n", reserve,
                         format_bytes(fit.with_context_bytes), fit_flags(fit.run));
    else
      out += fmt::format("memtune fit (the same plans{}) finds nothing that fits at this model, seq and effective "
                         "batch: shorten --max_seq_length or use a smaller model\n", reserve);
  }
  return out;
}

std::string format_live_at_peak(const Plan& plan, size_t max_rows) {
  // The first allocation that reaches the high water fixes the moment of the peak.
  const AllocationRecord* peak = nullptr;
  for (const AllocationRecord& r : plan.records)
    if (r.offset + r.bytes == plan.arena_bytes) {
      peak = &r;
      break;
    }
  if (peak == nullptr) return "no allocation reaches the arena's peak\n";
  const int64_t moment = peak->allocated_at;
  std::vector<const AllocationRecord*> live;
  uint64_t live_bytes = 0;
  for (const AllocationRecord& r : plan.records)
    if (r.allocated_at <= moment && (r.freed_at < 0 || r.freed_at > moment)) {
      live.push_back(&r);
      live_bytes += r.bytes;
    }
  std::stable_sort(live.begin(), live.end(),
                   [](const AllocationRecord* a, const AllocationRecord* b) { return a->bytes > b->bytes; });
  std::string out = fmt::format("live at the peak (when '{}' is allocated, event {}): {} buffers, {}\n",
                                peak->name, moment, live.size(), format_bytes(live_bytes));
  for (size_t i = 0; i < live.size() && i < max_rows; ++i)
    out += fmt::format("  {:>12}  {:<22} {}\n", format_bytes(live[i]->bytes), category_name(live[i]->category),
                       live[i]->name);
  if (live.size() > max_rows) out += fmt::format("  ... {} more\n", live.size() - max_rows);
  return out;
}

}  // namespace memtune
