// Whether a run's optimizer steps trained the adapter. Two kinds of step do not:
//  - skipped: fp16's loss scaler found non-finite gradients and made no update (GradScaler);
//  - vanished: the gradient norm is exactly 0, so nothing is learned from the step.
// A few skipped steps are normal while the loss scaler finds its scale; a run where most steps
// are skipped or vanish (a learning rate far too high, broken data or weights) ends in an
// adapter that looks trained and is not. The trainer prints the counts at the end and fails a
// run past --max_skipped_steps_ratio unless --allow_skipped_steps.
#pragma once

#include <cstdint>
#include <string>

#include "memtune/train/engine.h"

namespace memtune {

struct StepHealthOptions {
  double max_skipped_steps_ratio = 0.5;  // of this run's steps; skipped + vanished
  bool allow_skipped_steps = false;      // count and report, never fail
};

class StepHealth {
 public:
  // The ratio is judged once this many steps ran (earlier, a loss scaler that is still finding
  // its scale could fail a sound run), or at the run's end whatever its length.
  static constexpr int64_t kMinStepsToJudge = 8;

  explicit StepHealth(StepHealthOptions options = {}) : options_(options) {}
  void record(const StepReport& report);
  int64_t steps() const { return steps_; }
  int64_t skipped() const { return skipped_; }
  int64_t vanished() const { return vanished_; }
  // "30 steps: 29 skipped (fp16 overflow), 0 with a gradient norm of exactly 0"
  std::string summary() const;
  // True when the run must stop: too many steps did not train, the run is far enough along (or
  // at its end) to judge, and failing is not disallowed.
  bool failing(bool at_end) const;
  // The reason, for the error message.
  std::string failure_reason() const;

 private:
  StepHealthOptions options_;
  int64_t steps_ = 0, skipped_ = 0, vanished_ = 0;
};

}  // namespace memtune
