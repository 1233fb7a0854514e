// The memory ladder: the seed exercise as one command. Rungs apply memory techniques one at a
// time, cumulatively, from an fp16 baseline; each is planned, and run where it fits the device.
// With `isolate`, each technique is also run alone from the baseline, and the full stack is run
// once without each technique, so that a trick's effect is seen apart from the order it came in.
//
// Room experiment/ (docs/ARCHITECTURE.md): the runners that build runs, drive the engine and time
// it (ladder with isolate, sweep, measure, MFU); report/ renders what they write. May include
// any room below cli/.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memtune/train/run_config.h"

namespace memtune {

struct LadderOptions {
  RunConfig base;                  // the baseline's shape: model, batch, seq, LoRA
  std::string device = "auto";
  uint64_t budget_bytes = 0;       // --vram
  int64_t steps = 3;               // optimizer steps measured per rung
  std::vector<std::string> order;  // trick names; empty: the seed's order
  // The baseline in fp32 instead of the seed's fp16 (--fp32, or "fp32" first in --order), so that
  // the bf16 rung measures what 16-bit precision saves.
  bool fp32_baseline = false;
  bool isolate = false;            // --isolate: also each trick alone, and each removed
  bool profile = false;            // --profile: one more step per rung with every op timed
  std::string flash_backend = "auto";  // --flash-backend: the flash trick's attn_implementation (auto | flash | cudnn)
  bool quiet = false;              // no progress line
  std::filesystem::path metrics;   // --metrics: JSONL of steps and rungs; empty: none
  std::string commit, date;
};

// The tricks, by name, in the seed's order.
const std::vector<std::string>& ladder_trick_names();
// Runs the ladder and returns ladder.json (see report/ladder_report.h for the schema).
nlohmann::json run_ladder(const LadderOptions& options);

}  // namespace memtune
