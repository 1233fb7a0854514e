#include "memtune/experiment/ladder.h"

#include <fmt/format.h>

#include <functional>
#include <map>
#include <optional>

#include "memtune/core/bytes.h"
#include "memtune/core/error.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/plan/plan_report.h"
#include "memtune/experiment/measure.h"
#include "memtune/core/progress.h"

namespace memtune {
namespace {

struct Trick {
  std::string name;   // as --order takes it, and the rung's "added"
  std::string label;  // the cumulative rung's name
  std::string plain;  // the trick on its own, for the isolate lists
  std::function<void(RunConfig&)> apply;
};

const std::vector<Trick>& tricks() {
  static const std::vector<Trick> all = {
      {"bf16", "+ bf16", "bf16", [](RunConfig& r) { r.precision = Precision::bf16; }},
      {"gradient_checkpointing", "+ gradient checkpointing", "gradient checkpointing",
       [](RunConfig& r) { r.gradient_checkpointing = true; }},
      {"flash", "+ flash attention", "flash attention", [](RunConfig& r) { r.attn_implementation = "flash"; }},
      {"qlora", "+ QLoRA (nf4, double quant)", "QLoRA (nf4, double quant)", [](RunConfig& r) {
         r.load_in_4bit = true;
         r.quant = QuantConfig{};  // nf4, blocksize 64, double quant
         if (r.precision == Precision::fp32) r.precision = Precision::bf16;
       }},
      {"chunked_loss", "+ chunked loss", "chunked loss", [](RunConfig& r) { r.loss_implementation = "chunked"; }},
      {"micro_batch", "micro-batch 1 x more accumulation", "micro-batch 1 x more accumulation", [](RunConfig& r) {
         r.gradient_accumulation_steps *= r.per_device_train_batch_size;
         r.per_device_train_batch_size = 1;
       }},
      {"seq_halved", "max_seq_length halved", "max_seq_length halved",
       [](RunConfig& r) { r.max_seq_length = std::max<int64_t>(2, r.max_seq_length / 2); }},
  };
  return all;
}

const Trick& trick_named(const std::string& name) {
  for (const Trick& t : tricks())
    if (t.name == name) return t;
  MT_USER_CHECK(name != "fp32", "--order: fp32 is the baseline's precision, not a trick: put it first in --order "
                "(or pass --fp32)");
  mt_fail("--order: unknown trick '{}' (known: {})", name, fmt::join(ladder_trick_names(), ", "));
}

// Two runs with this key train the same thing: the ladder measures them once.
std::string configuration_key(const RunConfig& run, const LlamaConfig& model) {
  nlohmann::json key = run_config_json(run, model);
  key["techniques"] = techniques_of(run);
  key["load_in_4bit"] = run.load_in_4bit;
  key["quant"] = {static_cast<int>(run.quant.type), run.quant.blocksize, run.quant.double_quant};
  return key.dump();
}

// One configuration the ladder runs: a cumulative rung or an isolate entry.
struct LadderEntry {
  RunConfig run;
  nlohmann::json rung;
  std::string section;              // "rungs", "alone" or "removed"
  std::optional<size_t> same_as;    // an earlier entry with the same configuration
};

void copy_measurement(const nlohmann::json& from, nlohmann::json& to) {
  for (const char* key : {"measured", "engine_peak_bytes", "device_peak_bytes", "device_in_use_before_bytes",
                          "step_seconds", "tokens_per_second", "loss", "loss_scaler", "mfu"})
    if (from.contains(key)) to[key] = from[key];
  to["same_as"] = from["name"];
}

std::string section_label(const LadderEntry& entry) {
  if (entry.section == "alone") return "alone: " + entry.rung["name"].get<std::string>();
  if (entry.section == "removed") return "without: " + entry.rung["name"].get<std::string>();
  return entry.rung["name"].get<std::string>();
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
  const LlamaConfig& model = source.config;
  const DeviceInfo device = probe_device(options.device, /*measure_gemm=*/true);

  std::vector<std::string> order = options.order.empty() ? ladder_trick_names() : options.order;
  // "fp32" first in --order names the baseline's precision.
  const bool fp32_baseline = options.fp32_baseline || (!order.empty() && order.front() == "fp32");
  if (!order.empty() && order.front() == "fp32") order.erase(order.begin());
  for (const std::string& name : order) trick_named(name);

  RunConfig base = options.base;
  // --offload_activations offloads the checkpointed layer inputs, so in a ladder it applies to
  // the rungs that checkpoint and to none before them.
  const bool offload_checkpoints = base.offload_activations;
  base.offload_activations = false;
  // The seed's baseline: fp16 (or fp32), eager, no checkpointing, full loss.
  base.precision = fp32_baseline ? Precision::fp32 : Precision::fp16;
  base.attn_implementation = "eager";
  base.gradient_checkpointing = false;
  base.loss_implementation = "full";
  base.validate();

  // Every configuration first, planned: the plans say which will run, and so how long it takes.
  std::vector<LadderEntry> entries;
  std::map<std::string, size_t> by_configuration;
  const auto add = [&](const RunConfig& run, const std::string& name, const std::string& added,
                       const std::string& section) {
    run.validate();
    LadderEntry entry{run, plan_rung(run, model, device, options.budget_bytes, name, added), section, std::nullopt};
    const auto [it, inserted] = by_configuration.emplace(configuration_key(run, model), entries.size());
    if (!inserted) entry.same_as = it->second;
    entries.push_back(std::move(entry));
    return &entries.back().rung;
  };
  add(base, fp32_baseline ? "fp32 baseline" : "fp16 baseline", "", "rungs");
  MT_USER_CHECK(options.flash_backend == "auto" || options.flash_backend == "flash" ||
                    options.flash_backend == "cudnn",
                "--flash-backend {}: expected auto, flash or cudnn", options.flash_backend);
  // The flash trick with the fused backend asked for (the rung keeps its name).
  const std::string flash_backend =
      options.flash_backend != "auto" ? options.flash_backend : fastest_fused_attention(device.target);
  const auto apply = [&](const Trick& t, RunConfig& r) {
    t.apply(r);
    if (r.attn_implementation == "flash") r.attn_implementation = flash_backend;
    if (offload_checkpoints && r.gradient_checkpointing) r.offload_activations = true;
  };
  RunConfig stacked = base;
  for (const std::string& name : order) {
    const Trick& t = trick_named(name);
    apply(t, stacked);
    add(stacked, t.label, t.name, "rungs");
  }
  const size_t cumulative_count = entries.size();
  if (options.isolate) {
    for (const std::string& name : order) {
      const Trick& t = trick_named(name);
      RunConfig alone = base;
      apply(t, alone);
      add(alone, t.plain, t.name, "alone");
    }
    for (const std::string& name : order) {
      const Trick& t = trick_named(name);
      RunConfig without = base;
      for (const std::string& other : order)
        if (other != name) apply(trick_named(other), without);
      // A removed entry adds nothing to the baseline's list: "removed" says what it lacks.
      nlohmann::json* rung = add(without, t.plain, "", "removed");
      rung->erase("added");
      (*rung)["removed"] = t.name;
    }
  }

  ProgressLine progress(stderr, !options.quiet);
  MetricsLog metrics(options.metrics);
  double total_work = 0;
  for (const LadderEntry& e : entries)
    if (!e.same_as && e.rung["fits_device"].get<bool>())
      total_work += tokens_per_step(e.run) * static_cast<double>(options.steps);
  progress.start(total_work);
  double work_done = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    LadderEntry& e = entries[i];
    const std::string label = fmt::format("[{}/{}] {}", i + 1, entries.size(), section_label(e));
    if (e.same_as) {
      copy_measurement(entries[*e.same_as].rung, e.rung);
      progress.note(fmt::format("{}: the same configuration as \"{}\", measured once", label,
                                entries[*e.same_as].rung["name"].get<std::string>()));
    } else if (e.rung["fits_device"].get<bool>()) {
      MeasureHooks hooks{&progress, &metrics, label,
                         {{"command", "ladder"}, {"section", e.section}, {"index", i},
                          {"rung", e.rung["name"]}},
                         work_done};
      hooks.profile = options.profile;
      hooks.profile_log = stdout;
      measure_rung(e.rung, e.run, model, device, options.steps, hooks);
      work_done += tokens_per_step(e.run) * static_cast<double>(options.steps);
      progress.set_work_done(work_done);
    } else {
      progress.note(fmt::format("{}: plan only ({} with context; the device takes {})", label,
                                format_bytes(e.rung["planned_with_context_bytes"].get<uint64_t>()),
                                format_bytes(device.capacity_bytes)));
    }
    nlohmann::json summary = {{"event", "rung"}, {"command", "ladder"}, {"section", e.section}, {"index", i}};
    for (const char* key : {"name", "added", "removed", "same_as", "measured", "fits_device", "fits_budget",
                            "planned_peak_bytes", "engine_peak_bytes", "device_peak_bytes", "step_seconds",
                            "tokens_per_second", "loss", "mfu", "micro_batch", "grad_accum", "seq"})
      if (e.rung.contains(key)) summary[key == std::string("name") ? "rung" : key] = e.rung[key];
    metrics.write(std::move(summary));
  }
  progress.note(fmt::format("ladder: {} configurations, {} measured", entries.size(),
                            std::count_if(entries.begin(), entries.end(),
                                          [](const LadderEntry& e) { return e.rung["measured"].get<bool>(); })));

  nlohmann::json ladder = {
      {"config", run_config_json(base, model)},
      {"device", device.description}, {"device_context_bytes", device.context_bytes},
      {"commit", options.commit}, {"date", options.date}, {"budget_bytes", options.budget_bytes}};
  ladder["config"]["steps_per_rung"] = options.steps;
  ladder["config"]["order"] = order;
  ladder["config"]["baseline_precision"] = std::string(precision_name(base.precision));
  ladder["config"]["flash_backend"] = flash_backend;
  ladder.update(mfu_context_json(device));
  nlohmann::json rungs = nlohmann::json::array();
  for (size_t i = 0; i < cumulative_count; ++i) rungs.push_back(entries[i].rung);
  ladder["rungs"] = rungs;
  if (options.isolate) {
    // saving_bytes: larger means the trick matters more (see report/ladder_report.h).
    const int64_t baseline_peak = entries.front().rung["planned_peak_bytes"].get<int64_t>();
    const int64_t full_peak = entries[cumulative_count - 1].rung["planned_peak_bytes"].get<int64_t>();
    nlohmann::json alone = nlohmann::json::array(), removed = nlohmann::json::array();
    for (size_t i = cumulative_count; i < entries.size(); ++i) {
      nlohmann::json entry = entries[i].rung;
      const int64_t peak = entry["planned_peak_bytes"].get<int64_t>();
      if (entries[i].section == "alone") {
        entry["saving_bytes"] = baseline_peak - peak;
        alone.push_back(std::move(entry));
      } else {
        entry["saving_bytes"] = peak - full_peak;
        removed.push_back(std::move(entry));
      }
    }
    ladder["isolate"] = {{"alone", alone}, {"removed", removed}};
  }
  return ladder;
}

}  // namespace memtune
