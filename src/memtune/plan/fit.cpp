#include "memtune/plan/fit.h"

#include <fmt/format.h>

#include "memtune/core/bytes.h"
#include "memtune/train/engine.h"

namespace memtune {
namespace {

struct Candidate {
  const char* name;
  // Expected cost against bf16 + flash, the fastest setting: a lead for ordering, not a
  // measurement (the ladder measures it): checkpointing recomputes the forward (~+30% FLOPs),
  // the 4-bit base dequantizes every projection twice per step.
  const char* expected_slowdown;
  bool qlora, checkpointing;
};

constexpr Candidate kCandidates[] = {
    {"bf16 + flash + chunked loss", "none", false, false},
    {"+ QLoRA", "~5-10% (dequantization)", true, false},
    {"+ gradient checkpointing", "~25-30% (recompute)", false, true},
    {"+ QLoRA + gradient checkpointing", "~30-40%", true, true},
};

}  // namespace

FitResult fit_run(const RunConfig& base, const LlamaConfig& model, uint64_t budget, uint64_t context) {
  FitResult result;
  const int64_t effective = base.per_device_train_batch_size * base.gradient_accumulation_steps;
  result.explanation = fmt::format("budget {} ({} of it CUDA context), effective batch {} x seq {}:\n",
                                   format_bytes(budget), format_bytes(context), effective, base.max_seq_length);
  for (const Candidate& candidate : kCandidates) {
    RunConfig run = base;
    if (run.precision == Precision::fp32) run.precision = Precision::bf16;
    run.attn_implementation = "flash";
    run.loss_implementation = "chunked";
    run.load_in_4bit = candidate.qlora;
    run.gradient_checkpointing = candidate.checkpointing;
    // The largest micro-batch that divides the effective batch and fits.
    for (int64_t micro = effective; micro >= 1; --micro) {
      if (effective % micro != 0) continue;
      run.per_device_train_batch_size = micro;
      run.gradient_accumulation_steps = effective / micro;
      const uint64_t planned = plan_run(run, model).arena_bytes;
      if (planned + context > budget) continue;
      result.explanation += fmt::format("  {:<36} fits at micro-batch {} x accumulation {}: {} (expected slowdown {})\n",
                                        candidate.name, micro, effective / micro,
                                        format_bytes(planned + context), candidate.expected_slowdown);
      if (!result.fits) {
        result.fits = true;
        result.run = run;
        result.planned_bytes = planned;
        result.with_context_bytes = planned + context;
      }
      break;
    }
    if (!result.fits)
      result.explanation += fmt::format("  {:<36} does not fit even at micro-batch 1\n", candidate.name);
    if (result.fits) break;  // candidates are in order of expected slowdown: the first wins
  }
  if (result.fits)
    result.explanation += "chosen: the first that fits, in order of expected slowdown; a larger micro-batch keeps the GEMMs larger.\n";
  else
    result.explanation += "nothing fits: shorten --max_seq_length or use a smaller model.\n";
  return result;
}

}  // namespace memtune
