// The plan as people read it: a table by category, and one JSON object.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "memtune/train/engine.h"

namespace memtune {

std::string format_plan(const Plan& plan, const RunConfig& run, const LlamaConfig& model);
// {"categories": {name: bytes at the peak}, "max_by_category": {...}, "peak_bytes": arena,
//  "peak_live_bytes", "trainable_parameters", "frozen_parameters", "planning_seconds", "run"}
nlohmann::json plan_json(const Plan& plan, const RunConfig& run, const LlamaConfig& model);
// The buffers alive when the arena reaches its peak (the allocation whose end is the arena's
// high water), largest first: where to look when a run must shrink. At most max_rows rows.
std::string format_live_at_peak(const Plan& plan, size_t max_rows = 40);
nlohmann::json run_config_json(const RunConfig& run, const LlamaConfig& model);

// Advice for a run whose plan exceeds the budget: what each single change would give.
// world_size > 1: the plans are one rank's (plan_run with world_size), and sharding the base
// (--shard_base) is one of the changes. The plans are the device's (a CPU run has no GPU
// workspace), and `memtune fit`'s answer follows for a CUDA run.
std::string fit_advice(const RunConfig& run, const LlamaConfig& model, uint64_t budget_bytes,
                       uint64_t context_bytes, Device device, int world_size = 1);

}  // namespace memtune
