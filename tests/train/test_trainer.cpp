// The training loop: packing preserves the math, epochs shuffle every row once, an interrupted
// and resumed run is bit-identical to a straight one, and a NaN loss or a full disk stops the
// run without losing the last good checkpoint.
#include "memtune/train/trainer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <set>
#include <sstream>

#include "memtune/core/error.h"
#include "memtune/data/sft_dataset.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"
#include "memtune/io/safetensors.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/train/engine_arena.h"
#include "../support/engine_setup.h"
#include "../support/expect_error.h"

using namespace memtune;
namespace fs = std::filesystem;

namespace {

using namespace enginetest;  // the shared engine set-up (tests/support/engine_setup.h)

fs::path tests_dir() { return fs::path(MEMTUNE_BINARY_DIR) / "trainer_tests"; }

fs::path temp_dir(const std::string& name) {
  const fs::path dir = tests_dir() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A quiet run that saves a checkpoint every `save_steps` steps into a fresh temp_dir(name).
TrainerOptions checkpointing_options(const std::string& name, int64_t save_steps) {
  TrainerOptions options;
  options.quiet = true;
  options.save_steps = save_steps;
  options.out_dir = temp_dir(name);
  return options;
}

// Samples of the given lengths with random ids; the first `masked` labels of every third
// sample are -100 (a prompt), and token 1 of sample i is 1 + i so that a row can be told apart.
Dataset random_dataset(const std::vector<int>& lengths, uint64_t seed, int masked = 2) {
  Dataset data;
  for (size_t i = 0; i < lengths.size(); ++i) {
    Sample s;
    for (int t = 0; t < lengths[i]; ++t)
      s.input_ids.push_back(static_cast<int32_t>(dropout_hash(seed, i * 1000 + t) % 300));
    s.input_ids[1] = static_cast<int32_t>(1 + i);
    s.labels = s.input_ids;
    if (i % 3 == 0)
      for (int t = 0; t < masked && t < lengths[i]; ++t) s.labels[t] = -100;
    data.samples.push_back(std::move(s));
  }
  return data;
}

HostMicroBatch rows_to_micro_batch(const Dataset& data, const std::vector<const RowLayout*>& rows, int64_t batch,
                                   int64_t seq) {
  static const RowLayout padding;
  HostMicroBatch b;
  b.input_ids.resize(batch * seq);
  b.targets.resize(batch * seq);
  b.positions.resize(batch * seq);
  b.segments.resize(batch * seq);
  for (int64_t r = 0; r < batch; ++r) {
    const RowLayout& row = static_cast<size_t>(r) < rows.size() ? *rows[r] : padding;
    const int64_t at = r * seq;
    write_row(data.samples, row, seq, 0, {&b.input_ids[at], &b.targets[at], &b.positions[at], &b.segments[at]});
  }
  return b;
}

TEST(TrainerPacking, PackedStepEqualsTheSameSamplesUnpacked) {
  const LlamaConfig model = small_model();
  const Dataset data = random_dataset({5, 9, 12, 7, 3, 16, 10, 4}, 17);
  // cudnn on the CPU: the flash op with the segments, after the step built the packed rows'
  // sequence table (the planner placed it: the arena is the plan's).
  for (const char* attention : {"eager", "flash", "cudnn"}) {
    RunConfig run = small_run();
    run.attn_implementation = attention;
    const int64_t batch = run.per_device_train_batch_size, seq = run.max_seq_length;
    // Packed: best-fit rows, two per micro-batch (the last filled up with padding).
    const std::vector<RowLayout> rows = pack_best_fit_decreasing(data.samples, seq);
    std::vector<HostMicroBatch> packed;
    for (size_t r = 0; r < rows.size(); r += batch) {
      std::vector<const RowLayout*> picked;
      for (size_t i = r; i < std::min(rows.size(), r + batch); ++i) picked.push_back(&rows[i]);
      packed.push_back(rows_to_micro_batch(data, picked, batch, seq));
    }
    // Unpacked: one padded row per sample, by the engine's own (independent) batch builder.
    std::vector<HostMicroBatch> unpacked;
    for (size_t s = 0; s < data.samples.size(); s += batch)
      unpacked.push_back(make_micro_batch({data.samples[s].input_ids, data.samples[s + 1].input_ids},
                                          {data.samples[s].labels, data.samples[s + 1].labels}, seq));
    ASSERT_LT(packed.size(), unpacked.size());
    ASSERT_EQ(packed[0].input_ids.size(), unpacked[0].input_ids.size());  // the planned shape
    int64_t packed_targets = 0, unpacked_targets = 0;
    for (const auto& b : packed) packed_targets += b.valid_targets();
    for (const auto& b : unpacked) unpacked_targets += b.valid_targets();
    EXPECT_EQ(packed_targets, unpacked_targets);

    auto cpu = make_cpu_backend();
    PlannedEngine a(*cpu, run, model), b(*cpu, run, model);
    init_with_nonzero_b(a.engine());
    init_with_nonzero_b(b.engine());
    const double packed_loss = a->train_step(packed).loss;
    const double unpacked_loss = b->train_step(unpacked).loss;
    EXPECT_NEAR(packed_loss, unpacked_loss, 1e-5 * unpacked_loss) << attention;
    if (std::string(attention) == "cudnn") {
      // The last micro-batch uploaded: a table exactly when its rows are not one sample each.
      EXPECT_NE(a->step().batch().one_sample_per_row, !a->step().batch().ragged.empty());
      EXPECT_TRUE(b->step().batch().ragged.empty());
      // Row 0 of the first micro-batch holds the two longest samples that fit (16 + 7 tokens).
      PlannedEngine c(*cpu, run, model);
      init_with_nonzero_b(c.engine());
      c->train_step({packed[0]});
      EXPECT_FALSE(c->step().batch().one_sample_per_row);
      ASSERT_FALSE(c->step().batch().ragged.empty());
      EXPECT_GE(c->step().batch().ragged.sequences, 4);
      EXPECT_EQ(a.engine().memory().allocator().high_water(), a.plan().arena_bytes);
    }
    EXPECT_LT(rel_error(adapter_grads(a.engine()), adapter_grads(b.engine())), 1e-5) << attention;
  }
}

TEST(Trainer, EpochsVisitEveryRowOnceInAFreshOrderAndUpdateOnTheRemainder) {
  const LlamaConfig model = small_model();
  RunConfig run = small_run();
  run.gradient_accumulation_steps = 2;
  const Dataset data = random_dataset({6, 6, 6, 6, 6}, 3);
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  std::ostringstream out, err;
  Trainer trainer(engine.engine(), data, nullptr, TrainerOptions{}, out, err);
  EXPECT_EQ(steps_per_epoch(5, 2, 2), 2);  // 3 micro-batches: 2, then the remainder 1
  EXPECT_EQ(steps_for_epochs(1.5, 5, 2, 2), 3);
  std::vector<std::vector<int32_t>> epoch_orders(3);
  for (int step = 0; step < 6; ++step) {
    const int64_t epoch = trainer.position().epoch;
    const std::vector<HostMicroBatch> batches = trainer.next_step_batches();
    EXPECT_EQ(batches.size(), step % 2 == 0 ? 2u : 1u);
    for (const HostMicroBatch& b : batches) {
      // Rows of 6 tokens, padded to the kernels' 64 but never past the planned 24; the epoch's
      // remainder micro-batch holds its one row only (shapes follow the data).
      ASSERT_EQ(b.seq, 24);
      ASSERT_EQ(b.input_ids.size(), static_cast<size_t>(b.rows * 24));
      for (int r = 0; r < b.rows; ++r)
        if (b.targets[r * 24] != -100 || b.targets[r * 24 + 1] != -100) epoch_orders[epoch].push_back(b.input_ids[r * 24 + 1]);
    }
    if (step % 2 == 0) EXPECT_EQ(trainer.position().next_row, 4);
    else EXPECT_EQ(trainer.position().next_row, 0);
  }
  for (const auto& order : epoch_orders) {
    ASSERT_EQ(order.size(), 5u);
    EXPECT_EQ(std::set<int32_t>(order.begin(), order.end()), (std::set<int32_t>{1, 2, 3, 4, 5}));
  }
  EXPECT_TRUE(epoch_orders[0] != epoch_orders[1] || epoch_orders[1] != epoch_orders[2]);
  EXPECT_EQ(trainer.position().epoch, 3);
}

struct RunResult {
  TrainOutcome outcome;
  std::string err;
};

RunResult train(const RunConfig& run, const Dataset& data, TrainerOptions options, const Dataset* eval = nullptr) {
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, small_model());
  init_with_nonzero_b(engine.engine());
  options.quiet = true;
  std::ostringstream out, err;
  Trainer trainer(engine.engine(), data, eval, options, out, err);
  RunResult result{trainer.run(), ""};
  result.err = err.str();
  return result;
}

TEST(Trainer, InterruptAfterThreeStepsThenResumeIsBitIdenticalToAStraightRun) {
  const Dataset data = random_dataset({10, 7, 12, 9, 5, 11, 8, 6, 12, 4}, 5);
  for (bool packing : {false, true}) {
    RunConfig run = small_run();
    run.max_steps = 6;
    run.lora_dropout = 0.1;
    run.weight_decay = 0.01;
    const std::string tag = packing ? "packed" : "unpacked";
    TrainerOptions options;
    options.packing = packing;
    options.out_dir = temp_dir("straight_" + tag);
    const RunResult straight = train(run, data, options);
    ASSERT_EQ(straight.outcome.exit_code, 0);
    ASSERT_EQ(straight.outcome.losses.size(), 6u);

    options.out_dir = temp_dir("interrupted_" + tag);
    options.after_step = [](int64_t step, const StepReport&) {
      if (step == 3) std::raise(SIGINT);  // the loop's handler records it; the step is done
    };
    const RunResult interrupted = train(run, data, options);
    EXPECT_EQ(interrupted.outcome.exit_code, 130) << tag;
    EXPECT_EQ(interrupted.outcome.steps_done, 3) << tag;
    EXPECT_NE(interrupted.err.find("SIGINT after step 3 of 6"), std::string::npos) << interrupted.err;
    EXPECT_FALSE(fs::exists(options.out_dir / "adapter")) << "an interrupted run writes its checkpoint only";
    const nlohmann::json state = read_json_file(options.out_dir / "checkpoint-3/trainer_state.json");
    EXPECT_EQ(state["step"], 3);
    const nlohmann::json& position = state["data_position"];
    EXPECT_EQ(position["shuffle_seed"], 42u);
    const int64_t rows = position["rows_per_epoch"].get<int64_t>();
    EXPECT_EQ(rows, packing ? static_cast<int64_t>(pack_best_fit_decreasing(data.samples, 24).size()) : 10);
    // 3 steps of 2 rows, where a step ends early at the end of an epoch.
    int64_t epoch = 0, index = 0;
    for (int step = 0; step < 3; ++step) {
      index = std::min(rows, index + 2);
      if (index == rows) ++epoch, index = 0;
    }
    EXPECT_EQ(position["epoch"].get<int64_t>(), epoch) << position.dump();
    EXPECT_EQ(position["index"].get<int64_t>(), index) << position.dump();

    options.after_step = nullptr;
    options.resume_from = options.out_dir;  // its newest checkpoint
    const RunResult resumed = train(run, data, options);
    EXPECT_EQ(resumed.outcome.exit_code, 0);
    EXPECT_EQ(resumed.outcome.first_step, 3);
    std::vector<double> losses = interrupted.outcome.losses;
    losses.insert(losses.end(), resumed.outcome.losses.begin(), resumed.outcome.losses.end());
    EXPECT_EQ(losses, straight.outcome.losses) << tag;
    for (const char* file : {"adapter/adapter_model.safetensors", "checkpoint-6/adapter_model.safetensors",
                             "checkpoint-6/optimizer.safetensors"})
      EXPECT_EQ(read_file(fs::path(options.out_dir) / file), read_file(tests_dir() / ("straight_" + tag) / file))
          << tag << " " << file;
  }
}

TEST(Trainer, ResumingWithOtherDataIsRefused) {
  RunConfig run = small_run();
  run.max_steps = 2;
  TrainerOptions options;
  options.out_dir = temp_dir("other_data");
  ASSERT_EQ(train(run, random_dataset({8, 8, 8}, 1), options).outcome.exit_code, 0);
  options.resume_from = options.out_dir / "checkpoint-2";
  run.max_steps = 3;
  EXPECT_CONTAINS(memtune::test::error_of([&] { train(run, random_dataset({8, 8, 9}, 1), options); }),
                  "resume with the same data");
}

void plant_nan_in_a_frozen_weight(Engine& engine) {
  const Tensor& w = engine.weights().layers[0].projections[0];
  if (w.dtype == DType::f32) {
    std::vector<float> host(w.numel());
    engine.backend().copy_to_host(host.data(), w);
    host[0] = std::nanf("");
    engine.backend().copy_from_host(w, host.data());
  } else {
    std::vector<uint16_t> host(w.numel());
    engine.backend().copy_to_host(host.data(), w);
    host[0] = 0x7fc0;  // NaN in bf16
    engine.backend().copy_from_host(w, host.data());
  }
}

TEST(Trainer, NonFiniteLossStopsNamingTheStepAndKeepsTheLastGoodCheckpoint) {
  const Dataset data = random_dataset({12, 12, 12, 12}, 9);
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    RunConfig run = small_run();
    run.precision = precision;
    run.max_steps = 6;
    auto cpu = make_cpu_backend();
    PlannedEngine engine(*cpu, run, small_model());
    init_with_nonzero_b(engine.engine());
    TrainerOptions options = checkpointing_options("nan_" + std::string(precision_name(precision)), 2);
    options.after_step = [&](int64_t step, const StepReport&) {
      if (step == 2) plant_nan_in_a_frozen_weight(engine.engine());
    };
    std::ostringstream out, err;
    Trainer trainer(engine.engine(), data, nullptr, options, out, err);
    const std::string message = memtune::test::error_of([&] { trainer.run(); });  // a NaN loss stops the run
    EXPECT_CONTAINS(message, "step 3: the loss is nan");
    EXPECT_CONTAINS(message, "the last good checkpoint");
    EXPECT_CONTAINS(message, "step 2");
    EXPECT_EQ(read_json_file(options.out_dir / "checkpoint-2/trainer_state.json")["step"], 2);
    EXPECT_FALSE(fs::exists(options.out_dir / "adapter"));
    const SafetensorsCheckpoint saved = SafetensorsCheckpoint::open(options.out_dir / "checkpoint-2", "adapter_model.safetensors");
    for (const std::string& name : saved.names()) {
      const SafetensorsTensor& t = saved.get(name);
      for (size_t i = 0; i < t.nbytes / 4; ++i) {
        float v;
        std::memcpy(&v, t.data + 4 * i, 4);
        ASSERT_TRUE(std::isfinite(v)) << name;
      }
    }
  }
}

TEST(Trainer, FullDiskWhileSavingKeepsThePreviousCheckpointAndSaysSo) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  RunConfig run = small_run();
  run.max_steps = 3;
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, small_model());
  init_with_nonzero_b(engine.engine());
  TrainerOptions options = checkpointing_options("disk_full", 1);
  const fs::path checkpoint = options.out_dir / "checkpoint-1";
  std::string previous_optimizer;
  // The second save's optimizer file goes to /dev/full: every write to it fails with ENOSPC,
  // which is what a full disk gives, through the real write path.
  engine->set_checkpoint_write_hook([&](const fs::path& file) {
    if (engine->steps_done() == 2 && file.filename() == "optimizer.safetensors") {
      previous_optimizer = read_file(checkpoint / "optimizer.safetensors");
      fs::create_symlink("/dev/full", atomic_temp_path(file));
    }
  });
  std::ostringstream out, err;
  const Dataset data = random_dataset({10, 10}, 2);
  Trainer trainer(engine.engine(), data, nullptr, options, out, err);
  const std::string message = memtune::test::error_of([&] { trainer.run(); });  // the failed save is reported
  EXPECT_CONTAINS(message, "saving the checkpoint");
  EXPECT_CONTAINS(message, "No space left on device");
  EXPECT_CONTAINS(message, "the last good checkpoint (" + checkpoint.string() + ", step 1) is kept");
  EXPECT_EQ(read_json_file(checkpoint / "trainer_state.json")["step"], 1);
  ASSERT_FALSE(previous_optimizer.empty());
  EXPECT_EQ(read_file(checkpoint / "optimizer.safetensors"), previous_optimizer);
  EXPECT_FALSE(fs::exists(options.out_dir / "checkpoint-2.partial"));
  EXPECT_FALSE(fs::exists(options.out_dir / "checkpoint-2"));
  // And it still resumes.
  auto fresh_cpu = make_cpu_backend();
  PlannedEngine fresh(*fresh_cpu, run, small_model());
  fresh->load_checkpoint(checkpoint);
  EXPECT_EQ(fresh->steps_done(), 1);
}

TEST(Trainer, EvaluatesEveryEvalStepsAndAtTheEndAndPackingDoesNotChangeTheEvalLoss) {
  RunConfig run = small_run();
  run.max_steps = 5;
  const Dataset data = random_dataset({10, 12, 8, 6}, 4);
  const Dataset eval = random_dataset({9, 5, 13, 7, 11}, 8);
  TrainerOptions options;
  options.eval_steps = 2;
  options.metrics_path = temp_dir("eval") / "metrics.jsonl";
  const RunResult result = train(run, data, options, &eval);
  ASSERT_EQ(result.outcome.eval_losses.size(), 3u);
  EXPECT_EQ(result.outcome.eval_losses[0].first, 2);
  EXPECT_EQ(result.outcome.eval_losses[1].first, 4);
  EXPECT_EQ(result.outcome.eval_losses[2].first, 5);
  int eval_events = 0;
  std::istringstream metrics(read_file(options.metrics_path));
  for (std::string line; std::getline(metrics, line);)
    eval_events += nlohmann::json::parse(line)["event"] == "eval";
  EXPECT_EQ(eval_events, 3);

  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, small_model());
  init_with_nonzero_b(engine.engine());
  std::ostringstream out, err;
  TrainerOptions packed_options;
  packed_options.packing = true;
  Trainer unpacked(engine.engine(), data, &eval, TrainerOptions{}, out, err);
  Trainer packed(engine.engine(), data, &eval, packed_options, out, err);
  const auto [unpacked_loss, unpacked_count] = unpacked.evaluate();
  const auto [packed_loss, packed_count] = packed.evaluate();
  EXPECT_EQ(packed_count, unpacked_count);
  EXPECT_NEAR(packed_loss, unpacked_loss, 1e-5 * unpacked_loss);
}

}  // namespace
