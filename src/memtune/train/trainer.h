// The training loop of `memtune train`, as transformers' Trainer runs it: seeded epoch-wise
// shuffling, gradient accumulation with an update at the end of each epoch, periodic
// evaluation and checkpoints, a stop on a non-finite loss, and a clean stop on SIGINT/SIGTERM.
//
// Order of the data: the rows (one sample each, or packed: data/packing.h) of epoch e are
// seeded_permutation(rows, hash(data_seed, e)): every row once per epoch, a new order each
// epoch. A micro-batch takes per_device_train_batch_size rows; an optimizer step takes
// gradient_accumulation_steps micro-batches, or fewer at the end of an epoch (transformers
// updates there too, on the remainder), whose last micro-batch may then hold fewer rows.
//
// Shapes follow the data (Padding::longest, the default, as transformers' and TRL's collators
// pad): a micro-batch runs at [its rows, its longest row rounded up to pad_to_multiple_of]
// inside the planned [batch, max_seq_length] (LlamaStep::set_shape), so no compute goes to
// padding past the longest row. Padding::max_length keeps every micro-batch at the planned
// shape. padding_free (TRL's name) lays the micro-batch's samples end to end in one row of their
// summed length (rounded up likewise), each attending only to itself (segments, positions
// restarting per sample). group_by_length (transformers' name) orders each epoch so that a
// micro-batch holds rows of similar length (data/packing.h). None of these changes the loss or
// the gradients: padding has no target, and causal, segment-masked attention never lets a sample
// see another's tokens (the LoRA dropout masks, drawn per token slot, are other random masks).
//
// The data position (epoch, rows consumed in it, the shuffle seed, and the row count and
// fingerprint of the data it counts in) is written into the checkpoint's trainer_state.json;
// with the step (which seeds dropout) and the optimizer state it is everything the next step
// depends on, so a resumed run continues bit-identically on the CPU.
//
// Room train/ (docs/ARCHITECTURE.md, with parallel/): one run on one device and the loop around it;
// may include the rooms below it (core/ to step/) and parallel/.
#pragma once

#include <csignal>
#include <filesystem>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "memtune/data/jsonl_dataset.h"
#include "memtune/data/packing.h"
#include "memtune/train/engine.h"
#include "memtune/train/output_dir.h"
#include "memtune/train/step_health.h"

namespace memtune {

class TimedBackend;  // ops/timed_backend.h

enum class Padding : uint8_t { longest, max_length };  // the tokenizer / collator's padding names

class MetricsLog;
class ProgressLine;

struct TrainerOptions {
  bool packing = false;         // TRL SFTConfig.packing
  Padding padding = Padding::longest;
  int64_t pad_to_multiple_of = 64;  // transformers' collator name; the kernels' tile size
  // The run's --max_seq_length, where the engine plans shorter rows than it (planned_row_tokens):
  // what the messages, the metrics and the checkpoint's data position name. 0: the engine's.
  int64_t max_seq_length = 0;
  bool padding_free = false;    // TRL SFTConfig.padding_free
  bool group_by_length = false; // transformers TrainingArguments.group_by_length
  // The micro-batches of one optimizer step run as fewer, larger ones where their rows fit the
  // planned micro-batch's tokens together (short unpacked samples: 4 rows of 64 in a plan of
  // 2 x 128). The step's loss is normalised by all its targets, so the gradients are the same,
  // summed in another order; only without LoRA dropout (its masks are drawn per micro-batch)
  // and on one process. Fewer, larger micro-batches read the frozen weights fewer times.
  bool merge_micro_batches = false;
  uint64_t data_seed = 42;      // transformers' data_seed (defaults to seed)
  int64_t save_steps = 0;       // checkpoint every N steps (0: at the end only)
  int64_t eval_steps = 0;       // evaluate every N steps (0: at the end only)
  std::filesystem::path out_dir;      // adapter/ and checkpoint-<step>/ (output_dir.h); empty: nothing is written
  // A checkpoint folder, or an output folder (its newest checkpoint); empty: start at step 0.
  std::filesystem::path resume_from;
  bool overwrite_output_dir = false;  // transformers: a fresh run may replace out_dir's previous outputs
  int64_t save_total_limit = 0;       // transformers: keep the newest N checkpoint folders; 0: all
  int64_t logging_steps = 1;          // a step line on stdout every N steps (the metrics file gets every step)
  StepHealthOptions step_health;      // when skipped or vanished steps fail the run (step_health.h)
  // The base model folder, "" for a seeded random init: checkpoints record it (run_settings.h).
  std::string base_checkpoint;
  // Set by a caller that has already locked and prepared out_dir (prepare_output_dir), so that
  // a bad --out is refused before a model is loaded; else run() does both.
  std::shared_ptr<OutputDirLock> output_lock;
  std::string base_model_name;        // adapter_config.json's base_model_name_or_path
  std::string train_data_name, eval_data_name;  // for the report; empty: synthetic / none
  std::string metrics_path;           // JSONL of data, step, eval and checkpoint events
  uint64_t planned_peak_bytes = 0;    // reported per step beside the engine's own peak
  // --vram (0: none). On a GPU each step also records the device memory in use (nvidia-smi's
  // figure); the summary holds its maximum against the budget, and says so when it is over.
  uint64_t budget_bytes = 0;
  bool quiet = false;           // no per-step stdout lines and no progress line
  int32_t pad_id = 0;           // the padding's value cannot change the loss (causal, -100)
  bool handle_signals = true;   // SIGINT / SIGTERM stop after the current step
  // train --profile: the engine runs on this wrapper of its backend, which times every op of the
  // run's last step (marked "profiled" in the metrics and left out of the token totals, since the
  // timing serialises the device); the per-op table goes to stderr and an "op_profile" record.
  TimedBackend* profiler = nullptr;
  // Called after each step's line is written (tests: simulate an interrupt with raise()).
  std::function<void(int64_t step, const StepReport& report)> after_step;
};

struct DataPosition {
  int64_t epoch = 0;
  int64_t next_row = 0;  // rows of this epoch's order already trained on
};

// What this run's steps computed, for the closing summary: token slots (the micro-batches'
// shapes), tokens of samples and trained targets.
struct TokenTotals {
  int64_t computed = 0, real = 0, targets = 0;
  double seconds = 0;
  // The share of the computed token slots that were padding.
  double padding_fraction() const {
    return computed == 0 ? 0.0 : 1.0 - static_cast<double>(real) / static_cast<double>(computed);
  }
};

struct TrainOutcome {
  int exit_code = 0;      // 0, or 128 + the signal that stopped the run (130 SIGINT, 143 SIGTERM)
  int stop_signal = 0;
  int64_t first_step = 0, steps_done = 0;
  TokenTotals tokens;
  uint64_t device_in_use_max_bytes = 0;                    // 0 on the CPU
  std::vector<double> losses;                               // this run's steps
  std::vector<std::pair<int64_t, double>> eval_losses;      // (step, mean eval loss)
};

// The rows a dataset makes (one per sample, or packed by best-fit decreasing).
std::vector<RowLayout> training_rows(const Dataset& data, int64_t seq, bool packing);
// The longest row that one-sample rows padded to the longest of their micro-batch reach: the
// longest sample of `datasets` (null entries skipped) rounded up to pad_to_multiple_of, at most
// max_seq_length. The engine is planned at that row length, so that a run on short samples does
// not hold activations, workspaces and a --vram verdict for max_seq_length tokens no row reaches
// (transformers' collators allocate per batch; this is the same bound, known before the run).
// max_seq_length where rows are that long whatever the data: packing, Padding::max_length.
int64_t planned_row_tokens(const std::vector<const Dataset*>& datasets, int64_t max_seq_length, bool packing,
                           Padding padding, int64_t pad_to_multiple_of);
// A run without --packing whose samples average at most max_seq_length / kPackingHintRatio
// tokens is told, once, what --packing would give it.
inline constexpr double kPackingHintRatio = 4;
// Optimizer steps in one epoch of `rows` rows.
int64_t steps_per_epoch(int64_t rows, int64_t batch, int64_t accumulation);
// transformers' max_steps for num_train_epochs: ceil(epochs * steps per epoch).
int64_t steps_for_epochs(double num_train_epochs, int64_t rows, int64_t batch, int64_t accumulation);

class Trainer {
 public:
  // `engine` is ready to train (weights and adapters initialised); its RunConfig gives the
  // batch shape, max_steps and precision. `eval` may be null.
  Trainer(Engine& engine, const Dataset& train, const Dataset* eval, TrainerOptions options,
          std::ostream& out, std::ostream& err);
  // The trainer keeps a reference to the data: a temporary would dangle.
  Trainer(Engine& engine, Dataset&& train, const Dataset* eval, TrainerOptions options, std::ostream& out,
          std::ostream& err) = delete;

  // Resumes (options.resume_from), trains to max_steps, evaluates and saves. Returns normally
  // when it finished or a signal stopped it (checkpoint written); memtune::Error for a
  // non-finite loss in fp32/bf16 (nothing saved from that step), too many skipped or vanished
  // steps (step_health.h; nothing saved from then on), a failed save, an output folder that is
  // in use or holds another run, or a resume from a checkpoint made with other data or settings
  // that change the model (run_settings.h).
  TrainOutcome run();

  // The micro-batches of the next optimizer step, advancing the data position.
  std::vector<HostMicroBatch> next_step_batches();
  const DataPosition& position() const { return position_; }
  int64_t rows_per_epoch() const { return static_cast<int64_t>(rows_.size()); }
  // Mean loss (token-weighted: sum over tokens / count) on the eval rows.
  std::pair<double, int64_t> evaluate();

 private:
  nlohmann::json checkpoint_fields() const;
  nlohmann::json run_settings() const;
  void restore(const nlohmann::json& state);
  void save_checkpoint();
  // Which checkpoint a failed run leaves to resume from, for its error message.
  std::string kept_checkpoint() const;
  // Too many skipped or vanished steps: logs the failure and throws memtune::Error, saving nothing.
  [[noreturn]] void fail_for_step_health(MetricsLog& metrics, ProgressLine& progress) const;
  const std::vector<uint32_t>& epoch_order();
  HostMicroBatch micro_batch(const std::vector<const RowLayout*>& rows, const Dataset& data) const;
  // [rows, seq] of the micro-batch that micro_batch() builds from these rows (none null).
  std::pair<int64_t, int64_t> micro_batch_shape(const std::vector<const RowLayout*>& rows) const;
  // TrainerOptions::merge_micro_batches: consecutive micro-batches of one step joined while the
  // joined rows' micro-batch fits the planned batch x seq tokens.
  std::vector<std::vector<const RowLayout*>> merged(std::vector<std::vector<const RowLayout*>> micro_batches) const;
  // The data-position fields that must agree for a resume (how rows are made and ordered).
  nlohmann::json layout_fields() const;

  Engine& engine_;
  const Dataset& train_;
  const Dataset* eval_;
  TrainerOptions options_;
  std::ostream& out_;
  std::ostream& err_;
  // seq_: the engine's planned row length, the longest a row may be; max_seq_length_: the run's
  // --max_seq_length (TrainerOptions::max_seq_length), which the data position and messages name.
  int64_t batch_, accumulation_, seq_, max_seq_length_;
  std::vector<RowLayout> rows_, eval_rows_;
  uint64_t fingerprint_;
  DataPosition position_;
  std::vector<uint32_t> order_;
  int64_t order_epoch_ = -1;
  int64_t last_checkpoint_step_ = -1;  // this run's last save
  std::filesystem::path last_checkpoint_path_;
  int64_t last_checkpoint_untrained_ = 0, last_checkpoint_steps_ = 0;  // step health at that save
  int64_t resumed_step_ = -1;
  StepHealth health_;
};

}  // namespace memtune
