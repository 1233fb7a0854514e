// memtune fit: from the plan alone, the set of memory techniques with the least expected
// slowdown, and the largest micro-batch, that fit a VRAM budget.
#pragma once

#include <string>

#include "memtune/train/run_config.h"

namespace memtune {

struct FitResult {
  bool fits = false;
  RunConfig run;              // the chosen configuration
  uint64_t planned_bytes = 0; // arena
  uint64_t with_context_bytes = 0;
  std::string explanation;    // every candidate tried, and why the chosen one won
};

// Keeps the effective batch (micro-batch x accumulation) of `base`.
FitResult fit_run(const RunConfig& base, const LlamaConfig& model, uint64_t budget_bytes,
                  uint64_t context_bytes);

}  // namespace memtune
