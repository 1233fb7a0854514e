#include "memtune/train/trainer.h"

#include <tuple>

#include <signal.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>

#include "memtune/core/bytes.h"
#include "memtune/core/error.h"
#include "memtune/core/progress.h"
#include "memtune/data/sft_dataset.h"
#include "memtune/io/json_util.h"
#include "memtune/ops/backend.h"
#include "memtune/ops/device.h"
#include "memtune/ops/timed_backend.h"
#include "memtune/train/run_settings.h"

namespace memtune {
namespace {

// Set by the handler, read between steps: a signal never interrupts a step or a save.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void record_stop_signal(int signal_number) { g_stop_signal = signal_number; }

// Installs the handler for the duration of a run. SA_RESETHAND restores the default action
// after the first signal, so a second Ctrl-C kills a run whose final save hangs (the save is
// atomic: killing it loses the new checkpoint, never the previous one).
class StopSignalGuard {
 public:
  explicit StopSignalGuard(bool enabled) : enabled_(enabled) {
    g_stop_signal = 0;
    if (!enabled_) return;
    struct sigaction action {};
    action.sa_handler = record_stop_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESETHAND | SA_RESTART;
    sigaction(SIGINT, &action, &previous_int_);
    sigaction(SIGTERM, &action, &previous_term_);
  }
  ~StopSignalGuard() {
    if (!enabled_) return;
    sigaction(SIGINT, &previous_int_, nullptr);
    sigaction(SIGTERM, &previous_term_, nullptr);
  }
  StopSignalGuard(const StopSignalGuard&) = delete;
  StopSignalGuard& operator=(const StopSignalGuard&) = delete;

 private:
  bool enabled_;
  struct sigaction previous_int_ {}, previous_term_ {};
};

std::string signal_name(int signal_number) {
  if (signal_number == SIGINT) return "SIGINT";
  if (signal_number == SIGTERM) return "SIGTERM";
  return fmt::format("signal {}", signal_number);
}

std::string hex64(uint64_t value) { return fmt::format("{:016x}", value); }

// Seeds are full 64-bit values, which json_as<int64_t> would refuse above 2^63.
uint64_t json_seed(const nlohmann::json& object, std::string_view key, std::string_view where) {
  const nlohmann::json& value = json_require(object, key, where);
  MT_USER_CHECK(value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0),
                "{}: expected a non-negative integer, got {}", json_key_description(where, key),
                json_value_description(value));
  return value.get<uint64_t>();
}

uint64_t epoch_seed(uint64_t data_seed, int64_t epoch) {
  return dropout_hash(data_seed, 0x9e3779b9ull + static_cast<uint64_t>(epoch));
}

nlohmann::json data_event(const std::string& split, const std::string& name, const Dataset& data,
                          const std::vector<RowLayout>& rows, int64_t seq, bool packing) {
  const DatasetStats& s = data.stats;
  return {{"event", "data"}, {"command", "train"}, {"split", split}, {"path", name},
          {"format", std::string(dataset_format_name(data.format))}, {"samples", data.samples.size()},
          {"rows", rows.size()}, {"packing", packing}, {"max_seq_length", seq}, {"tokens", s.tokens},
          {"trained_targets", s.trained_targets}, {"truncated_samples", s.truncated_samples},
          {"truncated_tokens", s.truncated_tokens}, {"skipped_bad_lines", s.skipped_bad_lines},
          {"skipped_fully_masked", s.skipped_fully_masked}};
}

// The last train step an earlier run logged to the metrics file (-1: none, or no file). A run
// killed after its last checkpoint logged steps that its resume runs again; those are marked.
int64_t last_logged_train_step(const std::string& metrics_path) {
  int64_t last = -1;
  if (metrics_path.empty()) return last;
  std::ifstream in(metrics_path);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_object() && record.value("event", "") == "step" && record.value("command", "") == "train" &&
        record.contains("step") && record["step"].is_number_integer())
      last = std::max(last, record["step"].get<int64_t>());
  }
  return last;
}

std::string rows_summary(const std::vector<RowLayout>& rows, int64_t seq, const TrainerOptions& options) {
  std::string text;
  if (options.packing) {
    int64_t tokens = 0;
    for (const RowLayout& row : rows) tokens += row.tokens;
    text = fmt::format("; packed into {} rows of {} tokens ({:.1f}% filled)", rows.size(), seq,
                       100.0 * static_cast<double>(tokens) / static_cast<double>(rows.size() * seq));
  }
  if (options.padding_free)
    text += fmt::format("; padding-free: each micro-batch's samples in one row (a multiple of {} tokens)",
                        options.pad_to_multiple_of);
  else if (options.padding == Padding::max_length)
    text += fmt::format("; every row padded to max_seq_length {}", seq);
  else
    text += fmt::format("; rows padded to the longest of their micro-batch (a multiple of {})", options.pad_to_multiple_of);
  if (options.group_by_length) text += ", grouped by length";
  return text;
}

// Short samples without --packing: each row holds one sample, a micro-batch trains only a few
// of them, and the step is bound by reading the weights, not by the tokens (on ~40-token chat
// samples at 2,048, 0.15x the packed run's tokens/s: bench/results/2026-12-06-h100-data-modes).
// A user who does not know the flag is told once, at the start; nothing else changes.
std::string packing_hint(const Dataset& data, int64_t seq, const TrainerOptions& options) {
  if (options.packing || data.samples.empty()) return "";
  int64_t tokens = 0;
  for (const Sample& sample : data.samples) tokens += static_cast<int64_t>(sample.input_ids.size());
  const double mean = static_cast<double>(tokens) / static_cast<double>(data.samples.size());
  if (mean * kPackingHintRatio > static_cast<double>(seq)) return "";
  return fmt::format("memtune: note: the samples average {:.0f} tokens against --max_seq_length {}, one sample "
                     "a row: --packing would put about {:.0f} in each row (every sample attends only to "
                     "itself, so its loss is the same) and train that many times the tokens a step\n",
                     mean, seq, std::floor(static_cast<double>(seq) / mean));
}

}  // namespace

std::vector<RowLayout> training_rows(const Dataset& data, int64_t seq, bool packing) {
  if (packing) return pack_best_fit_decreasing(data.samples, seq);
  for (size_t i = 0; i < data.samples.size(); ++i)
    MT_USER_CHECK(static_cast<int64_t>(data.samples[i].input_ids.size()) <= seq,
                  "sample {} has {} tokens, more than max_seq_length {} (truncate it first)", i,
                  data.samples[i].input_ids.size(), seq);
  return rows_one_sample_each(data.samples);
}

int64_t planned_row_tokens(const std::vector<const Dataset*>& datasets, int64_t max_seq_length, bool packing,
                           Padding padding, int64_t pad_to_multiple_of) {
  if (packing || padding == Padding::max_length) return max_seq_length;
  int64_t longest = 0;
  for (const Dataset* data : datasets)
    if (data != nullptr)
      for (const Sample& sample : data->samples) longest = std::max<int64_t>(longest, sample.input_ids.size());
  // No data, or a sample over max_seq_length (training_rows refuses it, naming it): the run's rows.
  if (longest == 0 || longest > max_seq_length) return max_seq_length;
  // A row is a token and its next token at least (RunConfig::validate).
  return std::max<int64_t>(2, padded_length(longest, pad_to_multiple_of, max_seq_length));
}

int64_t steps_per_epoch(int64_t rows, int64_t batch, int64_t accumulation) {
  const int64_t micro_batches = (rows + batch - 1) / batch;
  return std::max<int64_t>(1, (micro_batches + accumulation - 1) / accumulation);
}

int64_t steps_for_epochs(double num_train_epochs, int64_t rows, int64_t batch, int64_t accumulation) {
  MT_USER_CHECK(num_train_epochs > 0 && std::isfinite(num_train_epochs), "--num_train_epochs {}: expected a positive number",
                num_train_epochs);
  return static_cast<int64_t>(std::ceil(num_train_epochs * static_cast<double>(steps_per_epoch(rows, batch, accumulation))));
}

Trainer::Trainer(Engine& engine, const Dataset& train, const Dataset* eval, TrainerOptions options,
                 std::ostream& out, std::ostream& err)
    : engine_(engine),
      train_(train),
      eval_(eval),
      options_(std::move(options)),
      out_(out),
      err_(err),
      batch_(engine.run().per_device_train_batch_size),
      accumulation_(engine.run().gradient_accumulation_steps),
      seq_(engine.run().max_seq_length),
      max_seq_length_(options_.max_seq_length > 0 ? options_.max_seq_length : seq_),
      rows_(training_rows(train, seq_, options_.packing)),
      fingerprint_(dataset_fingerprint(train)),
      health_(options_.step_health) {
  MT_USER_CHECK(!rows_.empty(), "the training data holds no samples");
  if (eval_ != nullptr) {
    eval_rows_ = training_rows(*eval_, seq_, options_.packing);
    MT_USER_CHECK(!eval_rows_.empty(), "the eval data holds no samples");
  }
}

const std::vector<uint32_t>& Trainer::epoch_order() {
  if (order_epoch_ != position_.epoch) {
    order_ = seeded_permutation(rows_.size(), epoch_seed(options_.data_seed, position_.epoch));
    if (options_.group_by_length) order_ = group_by_length(order_, rows_, batch_);
    order_epoch_ = position_.epoch;
  }
  return order_;
}

std::pair<int64_t, int64_t> Trainer::micro_batch_shape(const std::vector<const RowLayout*>& rows) const {
  MT_ASSERT(!rows.empty(), "a micro-batch without rows");
  int64_t longest = 1, joined = 0;
  for (const RowLayout* row : rows) longest = std::max(longest, row->tokens), joined += row->tokens;
  const auto count = static_cast<int64_t>(rows.size());
  // Padding-free: the micro-batch's samples end to end in one row.
  if (options_.padding_free)
    return {1, padded_length(std::max<int64_t>(joined, 1), options_.pad_to_multiple_of, batch_ * seq_)};
  if (options_.padding == Padding::max_length) return {batch_, seq_};
  return {count, padded_length(longest, options_.pad_to_multiple_of, seq_)};
}

HostMicroBatch Trainer::micro_batch(const std::vector<const RowLayout*>& picked, const Dataset& data) const {
  static const RowLayout kPaddingRow;
  std::vector<const RowLayout*> rows = picked;
  HostMicroBatch batch;
  std::tie(batch.rows, batch.seq) = micro_batch_shape(rows);
  // Padding-free: the micro-batch's samples end to end in one row.
  RowLayout joined;
  if (options_.padding_free) {
    for (const RowLayout* row : rows) {
      joined.samples.insert(joined.samples.end(), row->samples.begin(), row->samples.end());
      joined.tokens += row->tokens;
    }
    rows = {&joined};
  }
  batch.real_tokens = 0;
  for (const RowLayout* row : rows) batch.real_tokens += row->tokens;
  const size_t n = static_cast<size_t>(batch.rows * batch.seq);
  batch.input_ids.resize(n);
  batch.targets.resize(n);
  batch.positions.resize(n);
  batch.segments.resize(n);
  for (int64_t r = 0; r < batch.rows; ++r) {
    const RowLayout& row = static_cast<size_t>(r) < rows.size() ? *rows[r] : kPaddingRow;
    const size_t at = static_cast<size_t>(r * batch.seq);
    write_row(data.samples, row, batch.seq, options_.pad_id,
              {&batch.input_ids[at], &batch.targets[at], &batch.positions[at], &batch.segments[at]});
  }
  return batch;
}

std::vector<HostMicroBatch> Trainer::next_step_batches() {
  const int64_t rows = rows_per_epoch();
  if (position_.next_row >= rows) position_ = {position_.epoch + 1, 0};
  const std::vector<uint32_t>& order = epoch_order();
  std::vector<HostMicroBatch> batches;
  // Data parallel: a step is accumulation x world_size micro-batches of the one global order
  // (every rank computes it alike); rank r takes the micro-batches r, r + world, ..., so a rank
  // may get fewer (or none) at the end of an epoch. world_size 1: all of them.
  const int64_t world = engine_.world_size(), rank = engine_.rank();
  std::vector<std::vector<const RowLayout*>> picks;
  for (int64_t m = 0; m < accumulation_ * world && position_.next_row < rows; ++m) {
    std::vector<const RowLayout*> picked;
    for (int64_t b = 0; b < batch_; ++b) {
      const int64_t index = position_.next_row + b;
      if (index < rows) picked.push_back(&rows_[order[static_cast<size_t>(index)]]);
    }
    position_.next_row = std::min(rows, position_.next_row + batch_);
    if (m % world == rank) picks.push_back(std::move(picked));
  }
  if (options_.merge_micro_batches && world == 1 && engine_.run().lora_dropout == 0) picks = merged(std::move(picks));
  for (const std::vector<const RowLayout*>& picked : picks) batches.push_back(micro_batch(picked, train_));
  // The epoch ends with this step (transformers updates on the remainder micro-batches).
  if (position_.next_row >= rows) position_ = {position_.epoch + 1, 0};
  return batches;
}

std::vector<std::vector<const RowLayout*>> Trainer::merged(std::vector<std::vector<const RowLayout*>> micro_batches) const {
  // Rows padded to max_length fill the planned micro-batch already.
  if (options_.padding == Padding::max_length && !options_.padding_free) return micro_batches;
  std::vector<std::vector<const RowLayout*>> out;
  for (std::vector<const RowLayout*>& next : micro_batches) {
    if (!out.empty()) {
      std::vector<const RowLayout*> joined = out.back();
      joined.insert(joined.end(), next.begin(), next.end());
      int64_t joined_tokens = 0;
      for (const RowLayout* row : joined) joined_tokens += row->tokens;
      // Padding-free, the joined samples are one row, which must fit the planned tokens before
      // micro_batch_shape pads it (a padded row is never longer than the plan).
      if (!options_.padding_free || joined_tokens <= batch_ * seq_) {
        const auto [rows, seq] = micro_batch_shape(joined);
        if (rows * seq <= batch_ * seq_) {
          out.back() = std::move(joined);
          continue;
        }
      }
    }
    out.push_back(std::move(next));
  }
  return out;
}

std::pair<double, int64_t> Trainer::evaluate() {
  MT_ASSERT(eval_ != nullptr);
  double sum = 0;
  int64_t count = 0;
  for (size_t first = 0; first < eval_rows_.size(); first += static_cast<size_t>(batch_)) {
    std::vector<const RowLayout*> picked;
    for (size_t r = first; r < std::min(eval_rows_.size(), first + static_cast<size_t>(batch_)); ++r)
      picked.push_back(&eval_rows_[r]);
    const auto [loss_sum, targets] = engine_.eval_loss_sum(micro_batch(picked, *eval_));
    sum += loss_sum;
    count += targets;
  }
  MT_USER_CHECK(count > 0, "every label of the eval data is masked (-100): no eval loss");
  return {sum / static_cast<double>(count), count};
}

nlohmann::json Trainer::layout_fields() const {
  // Padding and padding-free change shapes, not which rows a step trains; group_by_length
  // changes the order, so a resume must keep it.
  return {{"group_by_length", options_.group_by_length}};
}

nlohmann::json Trainer::checkpoint_fields() const {
  nlohmann::json position = {{"epoch", position_.epoch}, {"index", position_.next_row}, {"shuffle_seed", options_.data_seed},
                             {"rows_per_epoch", rows_per_epoch()}, {"data_fingerprint", hex64(fingerprint_)},
                             {"packing", options_.packing}, {"max_seq_length", max_seq_length_}};
  position.update(layout_fields());
  return {{"data_position", position},
          // Dropout masks are a hash of (seed, step, micro-batch): the step is the RNG state.
          {"seed", engine_.run().seed},
          {"max_steps", engine_.run().max_steps},
          {"run_settings", run_settings()}};
}

nlohmann::json Trainer::run_settings() const {
  return run_settings_json(engine_.run(), engine_.model(), options_.base_checkpoint);
}

std::string Trainer::kept_checkpoint() const {
  // A checkpoint saved before the step health could be judged may already hold untrained steps.
  if (last_checkpoint_step_ >= 0 && last_checkpoint_untrained_ > 0)
    return fmt::format("the last checkpoint ({}, step {}; {} of the {} steps this run made before it did not train) "
                       "is kept", last_checkpoint_path_.string(), last_checkpoint_step_, last_checkpoint_untrained_,
                       last_checkpoint_steps_);
  if (last_checkpoint_step_ >= 0)
    return fmt::format("the last good checkpoint ({}, step {}) is kept", last_checkpoint_path_.string(),
                       last_checkpoint_step_);
  if (!options_.resume_from.empty())
    return fmt::format("the checkpoint this run resumed from ({}, step {}) is kept", options_.resume_from.string(),
                       resumed_step_);
  return "no checkpoint had been written yet";
}

void Trainer::restore(const nlohmann::json& state) {
  const std::string where = (options_.resume_from / "trainer_state.json").string();
  if (!state.contains("data_position")) {
    err_ << "memtune: warning: " << where
         << " has no data position (an older checkpoint): the data starts again at epoch 0\n";
    return;
  }
  const nlohmann::json& p = state["data_position"];
  const int64_t rows = json_get<int64_t>(p, "rows_per_epoch", where);
  const std::string fingerprint = json_get<std::string>(p, "data_fingerprint", where);
  const bool packing = json_get<bool>(p, "packing", where);
  const int64_t seq = json_get<int64_t>(p, "max_seq_length", where);
  MT_USER_CHECK(rows == rows_per_epoch() && fingerprint == hex64(fingerprint_) && packing == options_.packing &&
                    seq == max_seq_length_,
                "--resume {}: its data position counts in {} rows (data {}, packing {}, max_seq_length {}), but "
                "this run has {} rows (data {}, packing {}, max_seq_length {}); resume with the same data, "
                "--packing and --max_seq_length, or start a new run from its adapter with --init-adapter {}",
                options_.resume_from.string(), rows, fingerprint, packing, seq, rows_per_epoch(),
                hex64(fingerprint_), options_.packing, max_seq_length_, options_.resume_from.string());
  const bool grouped = p.contains("group_by_length") && json_get<bool>(p, "group_by_length", where);
  MT_USER_CHECK(grouped == options_.group_by_length,
                "--resume {}: the checkpoint was trained with group_by_length {}, this run has {}: the data order "
                "would differ; resume with the same --group_by_length",
                options_.resume_from.string(), grouped, options_.group_by_length);
  position_.epoch = json_get<int64_t>(p, "epoch", where);
  position_.next_row = json_get<int64_t>(p, "index", where);
  MT_USER_CHECK(position_.epoch >= 0 && position_.next_row >= 0 && position_.next_row <= rows,
                "{}: data position (epoch {}, index {}) is out of range", where, position_.epoch, position_.next_row);
  const uint64_t shuffle_seed = json_seed(p, "shuffle_seed", where);
  if (shuffle_seed != options_.data_seed)
    err_ << fmt::format("memtune: note: continuing with the checkpoint's shuffle seed {} (not {})\n", shuffle_seed,
                        options_.data_seed);
  options_.data_seed = shuffle_seed;
  order_epoch_ = -1;
  if (state.contains("seed") && json_seed(state, "seed", where) != engine_.run().seed)
    err_ << fmt::format("memtune: warning: the checkpoint was trained with --seed {}, this run has {}: dropout "
                        "masks will differ from an uninterrupted run\n",
                        json_seed(state, "seed", where), engine_.run().seed);
}

void Trainer::fail_for_step_health(MetricsLog& metrics, ProgressLine& progress) const {
  progress.clear();
  metrics.write({{"event", "failed"}, {"command", "train"}, {"step", engine_.steps_done()},
                 {"steps", health_.steps()}, {"skipped", health_.skipped()}, {"vanished", health_.vanished()}});
  mt_fail("after step {}: {}; stopping without writing the adapter; {}", engine_.steps_done(), health_.failure_reason(),
          kept_checkpoint());
}

void Trainer::save_checkpoint() {
  const std::filesystem::path dir = checkpoint_dir_for_step(options_.out_dir, engine_.steps_done());
  try {
    engine_.save_checkpoint(dir, options_.base_model_name, checkpoint_fields());
  } catch (const Error& e) {
    mt_fail("{}; {}", e.what(), kept_checkpoint());
  }
  last_checkpoint_step_ = engine_.steps_done();
  last_checkpoint_path_ = dir;
  last_checkpoint_untrained_ = health_.skipped() + health_.vanished();
  last_checkpoint_steps_ = health_.steps();
  rotate_checkpoints(options_.out_dir, options_.save_total_limit);
}

TrainOutcome Trainer::run() {
  const RunConfig& run = engine_.run();
  // ---- data parallel: rank 0 alone reports and writes; checkpoints are single-process only ----
  if (engine_.world_size() > 1) {
    MT_USER_CHECK(options_.resume_from.empty() && options_.save_steps == 0,
                  "--resume and --save_steps are not supported with {} processes yet (ZeRO-1 moment shards are not "
                  "checkpointed); rank 0 writes the adapter at the end",
                  engine_.world_size());
    if (engine_.rank() != 0) {
      options_.quiet = true;
      options_.metrics_path.clear();
      options_.out_dir.clear();
      options_.train_data_name.clear();
      options_.eval_data_name.clear();
    }
  }
  // ---- end data parallel ----
  MetricsLog metrics(options_.metrics_path);
  if (!options_.train_data_name.empty()) {
    err_ << dataset_summary(options_.train_data_name, train_, max_seq_length_) << rows_summary(rows_, seq_, options_)
         << "\n" << packing_hint(train_, max_seq_length_, options_);
    metrics.write(data_event("train", options_.train_data_name, train_, rows_, max_seq_length_, options_.packing));
  }
  if (eval_ != nullptr) {
    err_ << dataset_summary(options_.eval_data_name, *eval_, max_seq_length_) << rows_summary(eval_rows_, seq_, options_)
         << "\n";
    metrics.write(data_event("eval", options_.eval_data_name, *eval_, eval_rows_, max_seq_length_, options_.packing));
  }
  std::shared_ptr<OutputDirLock> output_lock = options_.output_lock;
  if (!options_.out_dir.empty() && !output_lock) {
    output_lock = std::make_shared<OutputDirLock>(options_.out_dir);
    for (const std::string& name :
         prepare_output_dir(options_.out_dir, options_.overwrite_output_dir, !options_.resume_from.empty()))
      err_ << "memtune: --overwrite_output_dir: removed the previous run's " << (options_.out_dir / name).string() << "\n";
  }
  const int64_t replayed_until = options_.resume_from.empty() ? -1 : last_logged_train_step(options_.metrics_path);
  if (!options_.resume_from.empty()) {
    options_.resume_from = resolve_resume_folder(options_.resume_from);
    // Checked before anything is loaded, so that every difference is named at once.
    const nlohmann::json saved =
        read_json_file(complete_checkpoint_folder(options_.resume_from) / "trainer_state.json");
    check_resume_settings(saved.contains("run_settings") ? saved["run_settings"] : nlohmann::json(), run_settings(),
                          options_.resume_from.string(), err_);
    restore(engine_.load_checkpoint(options_.resume_from));
    resumed_step_ = engine_.steps_done();
    err_ << fmt::format("resumed from {} at step {} (epoch {}, row {} of {})\n", options_.resume_from.string(),
                        engine_.steps_done(), position_.epoch, position_.next_row, rows_per_epoch());
  }

  TrainOutcome outcome;
  outcome.first_step = engine_.steps_done();
  const bool fp16 = run.precision == Precision::fp16;
  int64_t last_eval_step = -1;
  double logged_loss_sum = 0;  // the steps since the last --logging_steps line
  int64_t logged_loss_steps = 0;
  auto run_eval = [&](int64_t step) {
    const auto [loss, targets] = evaluate();
    if (!std::isfinite(loss))
      err_ << fmt::format("memtune: warning: the eval loss after step {} is not finite ({}): the adapter's "
                          "outputs overflow{}\n",
                          step, loss, fp16 ? " fp16 (--bf16 or --fp32 keep them finite)" : "");
    outcome.eval_losses.push_back({step, loss});
    last_eval_step = step;
    metrics.write({{"event", "eval"}, {"command", "train"}, {"step", step}, {"eval_loss", loss},
                   {"eval_targets", targets}});
    return loss;
  };

  StopSignalGuard signals(options_.handle_signals);
  ProgressLine progress(stderr, !options_.quiet);
  progress.start(static_cast<double>(run.max_steps - outcome.first_step));
  for (int64_t step = outcome.first_step; step < run.max_steps; ++step) {
    const std::vector<HostMicroBatch> batches = next_step_batches();
    const bool profiled = options_.profiler != nullptr && step + 1 == run.max_steps;
    if (profiled) options_.profiler->set_enabled(true);
    const auto start = std::chrono::steady_clock::now();
    const StepReport report = engine_.train_step(batches);
    engine_.backend().synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (profiled) options_.profiler->set_enabled(false);
    const int64_t done = step + 1;
    // transformers' "epoch": epochs completed, fractional.
    const double epochs_done = static_cast<double>(position_.epoch) +
                               static_cast<double>(position_.next_row) / static_cast<double>(rows_per_epoch());
    // Token figures count the tokens of samples ("tokens", "tokens_per_second"), beside the
    // trained targets and the token slots computed (padding included).
    const double padding = report.tokens == 0 ? 0.0 : 1.0 - static_cast<double>(report.real_tokens) / report.tokens;
    nlohmann::json record = {{"event", "step"}, {"command", "train"}, {"step", done}, {"steps", run.max_steps},
                             {"loss", report.loss}, {"step_seconds", seconds}, {"tokens", report.real_tokens},
                             {"targets", report.targets}, {"computed_tokens", report.tokens},
                             {"micro_batches", batches.size()},
                             {"padding_fraction", padding},
                             {"tokens_per_second", report.real_tokens / seconds},
                             {"targets_per_second", report.targets / seconds},
                             {"computed_tokens_per_second", report.tokens / seconds},
                             {"lr", report.learning_rate}, {"epoch", epochs_done},
                             {"grad_norm", std::isfinite(report.grad_norm) ? nlohmann::json(report.grad_norm) : nlohmann::json()},
                             {"planned_peak_bytes", options_.planned_peak_bytes},
                             {"engine_peak_bytes", engine_.memory().allocator().high_water()},
                             {"skipped", report.skipped}};  // every precision: one record shape
    if (profiled) record["profiled"] = true;
    if (done <= replayed_until) record["replayed"] = true;  // logged before by the run this one resumes
    // fp16 overflows are the loss scaler's business (the step was skipped and the scale backed
    // off); in fp32 or bf16 a non-finite loss means the run has diverged or the data or weights
    // are broken, and every later step would be as bad.
    if (!fp16 && !(std::isfinite(report.loss) && std::isfinite(report.grad_norm))) {
      metrics.write(record);
      progress.clear();
      mt_fail("step {}: the loss is {} (grad norm {}) in {} training; stopping without saving this step "
              "(the adapter was not updated by it); {}",
              done, report.loss, report.grad_norm, precision_name(run.precision), kept_checkpoint());
    }
    outcome.losses.push_back(report.loss);
    health_.record(report);
    outcome.steps_done = done;
    if (!profiled) {
      outcome.tokens.computed += report.tokens;
      outcome.tokens.real += report.real_tokens;
      outcome.tokens.targets += report.targets;
      outcome.tokens.seconds += seconds;
    }
    nlohmann::json line = {{"step", done}, {"loss", report.loss}, {"grad_norm", report.grad_norm},
                           {"lr", report.learning_rate}, {"tokens_per_second", report.real_tokens / seconds},
                           {"targets_per_second", report.targets / seconds}, {"padding_fraction", padding},
                           {"planned_peak_bytes", options_.planned_peak_bytes},
                           {"engine_peak_bytes", engine_.memory().allocator().high_water()},
                           {"skipped", report.skipped}};
    if (const uint64_t in_use = device_memory_in_use(engine_.backend()); in_use > 0) {
      line["device_in_use_bytes"] = in_use;
      record["device_in_use_bytes"] = in_use;
      outcome.device_in_use_max_bytes = std::max(outcome.device_in_use_max_bytes, in_use);
    }
    if (eval_ != nullptr && options_.eval_steps > 0 && done % options_.eval_steps == 0) {
      const double eval_loss = run_eval(done);
      line["eval_loss"] = eval_loss;
      record["eval_loss"] = eval_loss;
    }
    metrics.write(std::move(record));
    // --logging_steps N: a line every N steps (and the last), whose loss is the mean of the
    // steps since the previous line, as transformers logs it; --metrics keeps every step.
    logged_loss_sum += report.loss;
    ++logged_loss_steps;
    const bool log_line = done % std::max<int64_t>(1, options_.logging_steps) == 0 || done == run.max_steps;
    progress.clear();  // the step's line goes to stdout; the progress line is redrawn below it
    if (log_line) {
      line["loss"] = logged_loss_sum / static_cast<double>(logged_loss_steps);
      if (logged_loss_steps > 1) line["loss_steps"] = logged_loss_steps;
      logged_loss_sum = 0;
      logged_loss_steps = 0;
      if (!options_.quiet) out_ << line.dump() << std::endl;
    }
    progress.set_work_done(static_cast<double>(done - outcome.first_step));
    // Off a terminal every progress update is a line of its own: those follow the logging steps.
    if (progress.terminal() || log_line)
      progress.update(fmt::format("train step {}/{}  loss {:.4f}  {:.2f} s/step  {:.0f} tokens/s", done, run.max_steps,
                                  report.loss, seconds, report.real_tokens / seconds));
    if (options_.after_step) options_.after_step(done, report);
    if (!options_.out_dir.empty() && options_.save_steps > 0 && done % options_.save_steps == 0) {
      // A run that has stopped training keeps its last good checkpoint instead of a new one.
      if (health_.failing(/*at_end=*/false)) fail_for_step_health(metrics, progress);
      save_checkpoint();
      metrics.write({{"event", "checkpoint"}, {"command", "train"}, {"step", done},
                     {"path", last_checkpoint_path_.string()}});
    }
    if (g_stop_signal != 0 && done < run.max_steps) {
      const int signal_number = g_stop_signal;
      progress.clear();
      outcome.stop_signal = signal_number;
      outcome.exit_code = 128 + signal_number;
      if (options_.out_dir.empty()) {
        err_ << fmt::format("memtune: {} after step {} of {}: stopped; no --out was given, so nothing was saved\n",
                            signal_name(signal_number), done, run.max_steps);
      } else if (engine_.world_size() > 1) {
        // Data parallel: the adapter only (a signal reaches the ranks between different steps, and
        // a rank that stops first makes the others' next collective fail with a clear error).
        engine_.save_adapter(options_.out_dir / "adapter", options_.base_model_name);
        err_ << fmt::format("memtune: {} after step {} of {}: stopped; adapter written to {}\n",
                            signal_name(signal_number), done, run.max_steps,
                            (options_.out_dir / "adapter").string());
      } else {
        if (last_checkpoint_step_ != done) save_checkpoint();
        err_ << fmt::format("memtune: {} after step {} of {}: stopped; checkpoint written to {} "
                            "(continue with --resume {})\n",
                            signal_name(signal_number), done, run.max_steps, last_checkpoint_path_.string(),
                            options_.out_dir.string());
      }
      metrics.write({{"event", "interrupted"}, {"command", "train"}, {"step", done},
                     {"signal", signal_name(signal_number)}});
      return outcome;
    }
  }
  progress.clear();
  outcome.steps_done = engine_.steps_done();
  if (outcome.tokens.seconds > 0) {
    const TokenTotals& t = outcome.tokens;
    err_ << fmt::format("trained {} steps: {} tokens of samples ({:.0f} tokens/s), {} trained targets ({:.0f}/s); "
                        "{} token slots computed, {:.1f}% of them padding\n",
                        outcome.steps_done - outcome.first_step, t.real, t.real / t.seconds, t.targets,
                        t.targets / t.seconds, t.computed, 100.0 * t.padding_fraction());
    metrics.write({{"event", "summary"}, {"command", "train"}, {"steps", outcome.steps_done - outcome.first_step},
                   {"tokens", t.real}, {"targets", t.targets}, {"computed_tokens", t.computed},
                   {"padding_fraction", t.padding_fraction()}, {"seconds", t.seconds},
                   {"tokens_per_second", t.real / t.seconds}, {"targets_per_second", t.targets / t.seconds}});
  }
  if (options_.profiler != nullptr && !options_.profiler->ops().empty()) {
    err_ << "op profile of the last step (every op timed alone):\n" << options_.profiler->table() << "\n";
    metrics.write({{"event", "op_profile"}, {"command", "train"}, {"step", outcome.steps_done},
                   {"op_profile", options_.profiler->to_json()}});
  }
  if (outcome.device_in_use_max_bytes > 0) {
    // The arena is allocated once, so what grows past plan + context is outside the plan: the
    // kernels loaded on first use and the libraries' own allocations (ops/device.h).
    const uint64_t budget = options_.budget_bytes;
    err_ << fmt::format("device memory in use at most {} (arena {}){}\n", format_bytes(outcome.device_in_use_max_bytes),
                        format_bytes(options_.planned_peak_bytes),
                        budget == 0 ? ""
                        : outcome.device_in_use_max_bytes <= budget
                            ? fmt::format(", inside --vram {}", format_bytes(budget))
                            : fmt::format("; WARNING: over --vram {} by {}, which the plan's verdict did not foresee",
                                          format_bytes(budget), format_bytes(outcome.device_in_use_max_bytes - budget)));
    metrics.write({{"event", "device_memory"}, {"device_in_use_max_bytes", outcome.device_in_use_max_bytes},
                   {"planned_peak_bytes", options_.planned_peak_bytes}, {"budget_bytes", budget}});
  }
  err_ << "memtune: " << health_.summary() << "\n";
  if (health_.failing(/*at_end=*/true)) fail_for_step_health(metrics, progress);
  if (eval_ != nullptr && last_eval_step != outcome.steps_done) {
    const double eval_loss = run_eval(outcome.steps_done);
    if (!options_.quiet) out_ << nlohmann::json{{"step", outcome.steps_done}, {"eval_loss", eval_loss}}.dump() << std::endl;
  }
  if (!outcome.eval_losses.empty())
    err_ << fmt::format("eval loss {:.6f} at step {}\n", outcome.eval_losses.back().second, outcome.eval_losses.back().first);
  if (!options_.out_dir.empty() && engine_.world_size() > 1) {
    const std::filesystem::path adapter = options_.out_dir / "adapter";
    engine_.save_adapter(adapter, options_.base_model_name);
    err_ << "wrote " << adapter.string() << " (PEFT format; no resumable checkpoint: data-parallel run)\n";
  } else if (!options_.out_dir.empty()) {
    const std::filesystem::path adapter = options_.out_dir / "adapter";
    engine_.save_adapter(adapter, options_.base_model_name);
    if (last_checkpoint_step_ != outcome.steps_done) save_checkpoint();
    err_ << "wrote " << adapter.string() << " (PEFT format) and " << last_checkpoint_path_.string() << "\n";
  }
  return outcome;
}

}  // namespace memtune
