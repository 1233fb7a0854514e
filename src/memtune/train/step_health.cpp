#include "memtune/train/step_health.h"

#include <fmt/format.h>

#include <cmath>

namespace memtune {

void StepHealth::record(const StepReport& report) {
  ++steps_;
  if (report.skipped) ++skipped_;
  else if (report.grad_norm == 0.0) ++vanished_;
}

std::string StepHealth::summary() const {
  return fmt::format("{} step{}: {} skipped (fp16 overflow: no update), {} with a gradient norm of exactly 0", steps_,
                     steps_ == 1 ? "" : "s", skipped_, vanished_);
}

bool StepHealth::failing(bool at_end) const {
  if (options_.allow_skipped_steps || steps_ == 0) return false;
  if (!at_end && steps_ < kMinStepsToJudge) return false;
  return static_cast<double>(skipped_ + vanished_) > options_.max_skipped_steps_ratio * static_cast<double>(steps_);
}

std::string StepHealth::failure_reason() const {
  return fmt::format("{} of {} steps did not train the adapter ({} skipped on fp16 overflow, {} with a gradient norm "
                     "of exactly 0), more than --max_skipped_steps_ratio {} of them: the run diverged or its "
                     "gradients vanished (a learning rate far too high, or broken data or weights); "
                     "--allow_skipped_steps lets such a run finish",
                     skipped_ + vanished_, steps_, skipped_, vanished_, options_.max_skipped_steps_ratio);
}

}  // namespace memtune
