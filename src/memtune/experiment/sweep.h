// memtune sweep: one run option varied over a list of values (max_seq_length or the
// micro-batch), for eager and flash attention, each point planned and, where it fits, measured.
// It is where "flash attention takes attention memory from O(n^2) to O(n)" shows: one ladder
// sees one sequence length, a sweep sees the curve.
//
// sweep.json:
//   vary ("seq" | "batch"), values, attn_implementations, plan_only, steps_per_point,
//   config (the base run), model, device, device_context_bytes, budget_bytes, commit, date,
//   device_peak_flops (+ _device, _source), mfu_definition,
//   points: one per (value, attention implementation), in that order: the ladder's rung fields
//     (experiment/measure.h: planned, planned_peak_bytes, attention_bytes, measured, engine_peak_bytes,
//     device_peak_bytes, tokens_per_second, mfu, ...) plus value and attn_implementation,
//   growth: per implementation and consecutive pair of values: from, to, value_ratio,
//     attention_bytes_ratio, planned_peak_ratio (4x attention bytes for 2x seq is quadratic).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memtune/train/run_config.h"

namespace memtune {

struct SweepOptions {
  RunConfig base;
  std::string vary = "seq";                               // seq | batch
  std::vector<int64_t> values;
  std::vector<std::string> attention = {"eager", "flash"};
  bool plan_only = false;
  int64_t steps = 2;                                      // optimizer steps measured per point
  std::string device = "auto";
  uint64_t budget_bytes = 0;
  bool quiet = false;
  std::filesystem::path metrics;                          // JSONL; empty: none
  std::string commit, date;
};

// "256,512,1024" -> {256, 512, 1024}; memtune::Error naming `flag` for anything else.
std::vector<int64_t> parse_sweep_values(const std::string& text, const std::string& flag);

nlohmann::json run_sweep(const SweepOptions& options);

std::string sweep_terminal_table(const nlohmann::json& sweep);
std::string sweep_csv(const nlohmann::json& sweep);  // one row per point
// Line charts against the varied value, one line per attention implementation.
std::string sweep_memory_svg(const nlohmann::json& sweep);  // planned peak
std::string sweep_speed_svg(const nlohmann::json& sweep);   // measured tokens/s
// sweep.json, sweep.csv, sweep_memory.svg, sweep_tokens_per_second.svg, each atomically, all
// rendered before the first is written.
void write_sweep_outputs(const nlohmann::json& sweep, const std::filesystem::path& out_dir);

}  // namespace memtune
