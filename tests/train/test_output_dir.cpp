// The output folder (checkpoint-<step> names, the newest one, rotation, the lock, a fresh run's
// refusal), the step health rule, an adapter's LoRA settings taken over by a run, and the run
// settings a checkpoint records.
#include "memtune/train/output_dir.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>

#include "memtune/core/error.h"
#include "memtune/train/run_settings.h"
#include "memtune/train/step_health.h"
#include "../support/expect_error.h"

using namespace memtune;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::path(MEMTUNE_BINARY_DIR) / "output_dir_tests" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void make_checkpoint(const fs::path& dir, int64_t step) {
  fs::create_directories(dir);
  std::ofstream(dir / "trainer_state.json") << "{\"step\": " << step << "}\n";
}

std::string error_of(const std::function<void()>& action) { return test::error_or_empty(action); }

TEST(OutputDir, CheckpointsAreFoundByStepNumberAndOnlyWhenComplete) {
  const fs::path out = fresh_dir("list");
  for (int64_t step : {9, 10, 2}) make_checkpoint(checkpoint_dir_for_step(out, step), step);
  fs::create_directories(out / "checkpoint-11.partial");             // a save that never finished
  fs::create_directories(out / "checkpoint-12");                     // no trainer_state.json
  make_checkpoint(out / "checkpoint-13.old", 13);                    // a swap interrupted between renames
  fs::create_directories(out / "checkpoint-x");
  const std::vector<CheckpointFolder> found = list_checkpoints(out);
  ASSERT_EQ(found.size(), 4u);
  EXPECT_EQ(found[0].step, 2);
  EXPECT_EQ(found[1].step, 9);
  EXPECT_EQ(found[2].step, 10);  // numeric, not alphabetical
  EXPECT_EQ(found[3].path, out / "checkpoint-13");
  EXPECT_EQ(complete_checkpoint_folder(out / "checkpoint-13"), out / "checkpoint-13.old");
  EXPECT_EQ(resolve_resume_folder(out), out / "checkpoint-13");
  EXPECT_EQ(resolve_resume_folder(out / "checkpoint-9"), out / "checkpoint-9");
  EXPECT_NE(error_of([&] { resolve_resume_folder(out / "checkpoint-12"); }).find("neither a complete memtune checkpoint"),
            std::string::npos);
}

TEST(OutputDir, TheOlderSingleCheckpointFolderStillCountsByItsStep) {
  const fs::path out = fresh_dir("legacy");
  make_checkpoint(out / "checkpoint", 7);
  EXPECT_EQ(resolve_resume_folder(out), out / "checkpoint");
  make_checkpoint(checkpoint_dir_for_step(out, 8), 8);
  EXPECT_EQ(resolve_resume_folder(out), out / "checkpoint-8");
}

TEST(OutputDir, SaveTotalLimitKeepsTheNewest) {
  const fs::path out = fresh_dir("rotate");
  for (int64_t step = 1; step <= 5; ++step) make_checkpoint(checkpoint_dir_for_step(out, step), step);
  EXPECT_TRUE(rotate_checkpoints(out, 0).empty());
  EXPECT_EQ(rotate_checkpoints(out, 2).size(), 3u);
  const std::vector<CheckpointFolder> left = list_checkpoints(out);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].step, 4);
  EXPECT_EQ(left[1].step, 5);
}

TEST(OutputDir, OneRunAtATimeHoldsTheLock) {
  const fs::path out = fresh_dir("lock");
  {
    OutputDirLock first(out);
    const std::string message = error_of([&] { OutputDirLock second(out); });
    EXPECT_NE(message.find("another memtune run (pid " + std::to_string(::getpid()) + ")"), std::string::npos) << message;
  }
  EXPECT_NO_THROW(OutputDirLock again(out));
}

// A run refused before it writes anything leaves no folder behind that it made; a folder that was
// there before, or one the run wrote into, stays.
TEST(OutputDir, AFolderTheLockMadeAndNothingWroteIntoGoesWithIt) {
  const fs::path parent = fresh_dir("lock_made");
  const fs::path made = parent / "made";
  { OutputDirLock lock(made); }
  EXPECT_FALSE(fs::exists(made));
  {
    OutputDirLock lock(made);
    std::ofstream(made / "adapter_model.safetensors") << "x";
  }
  EXPECT_TRUE(fs::exists(made / "adapter_model.safetensors"));
  const fs::path existing = parent / "existing";
  fs::create_directories(existing);
  { OutputDirLock lock(existing); }
  EXPECT_TRUE(fs::is_directory(existing));
}

TEST(OutputDir, AFreshRunNeedsAnEmptyFolderOrOverwrite) {
  const fs::path out = fresh_dir("fresh");
  OutputDirLock lock(out);
  EXPECT_TRUE(prepare_output_dir(out, false, false).empty());  // only the lock: empty
  make_checkpoint(checkpoint_dir_for_step(out, 3), 3);
  fs::create_directories(out / "adapter");
  std::ofstream(out / "notes.txt") << "mine\n";
  const std::string message = error_of([&] { prepare_output_dir(out, false, false); });
  EXPECT_NE(message.find("is not empty (adapter, checkpoint-3, notes.txt)"), std::string::npos) << message;
  EXPECT_NE(message.find("--resume " + out.string()), std::string::npos) << message;
  EXPECT_TRUE(prepare_output_dir(out, false, /*resuming=*/true).empty());
  EXPECT_EQ(prepare_output_dir(out, /*overwrite=*/true, false), (std::vector<std::string>{"adapter", "checkpoint-3"}));
  EXPECT_TRUE(fs::exists(out / "notes.txt")) << "only memtune's outputs are removed";
  EXPECT_TRUE(list_checkpoints(out).empty());
}

StepReport step(bool skipped, double grad_norm) {
  StepReport r;
  r.skipped = skipped;
  r.grad_norm = grad_norm;
  return r;
}

TEST(StepHealth, FailsPastTheRatioOnceJudgedAndNeverWhenAllowed) {
  StepHealth health;
  health.record(step(true, NAN));
  EXPECT_FALSE(health.failing(false)) << "one overflow while the scaler finds its scale";
  EXPECT_TRUE(health.failing(true)) << "a run of one skipped step trained nothing";
  for (int i = 0; i < 3; ++i) health.record(step(false, 1.0));
  health.record(step(false, 0.0));
  EXPECT_EQ(health.skipped(), 1);
  EXPECT_EQ(health.vanished(), 1);
  EXPECT_FALSE(health.failing(true));  // 2 of 5
  for (int i = 0; i < 3; ++i) health.record(step(false, 0.0));
  EXPECT_TRUE(health.failing(false));  // 5 of 8, judged from the 8th step on
  EXPECT_NE(health.failure_reason().find("5 of 8 steps did not train"), std::string::npos) << health.failure_reason();
  StepHealthOptions allow;
  allow.allow_skipped_steps = true;
  StepHealth allowed(allow);
  for (int i = 0; i < 10; ++i) allowed.record(step(true, NAN));
  EXPECT_FALSE(allowed.failing(true));
  EXPECT_EQ(allowed.summary(), "10 steps: 10 skipped (fp16 overflow: no update), 0 with a gradient norm of exactly 0");
}

TEST(AdapterLoraConfig, TheAdaptersSettingsWinAndAGivenContradictionIsRefused) {
  LoraConfig adapter;
  adapter.r = 8;
  adapter.alpha = 32;
  adapter.dropout = 0.05;
  adapter.use_rslora = true;
  adapter.targets = LoraConfig::parse_targets("q_proj,v_proj");
  RunConfig run;  // defaults: r 16, alpha 16, all-linear
  adopt_adapter_lora_config(run, adapter, {}, "dir");
  EXPECT_EQ(run.lora_r, 8);
  EXPECT_EQ(run.lora_alpha, 32);
  EXPECT_EQ(run.lora_dropout, 0.05);
  EXPECT_TRUE(run.use_rslora);
  EXPECT_EQ(lora_config_differences(run.lora_config(), adapter), "");
  RunConfig agreeing;
  agreeing.lora_alpha = 32;
  LoraOptionsGiven alpha_given;
  alpha_given.alpha = true;
  EXPECT_NO_THROW(adopt_adapter_lora_config(agreeing, adapter, alpha_given, "dir"));
  RunConfig contradicting;  // alpha 16 given
  const std::string message = error_of([&] { adopt_adapter_lora_config(contradicting, adapter, alpha_given, "dir"); });
  EXPECT_NE(message.find("lora_alpha 16 vs 32"), std::string::npos) << message;
  EXPECT_NE(message.find("dir/adapter_config.json"), std::string::npos) << message;
}

TEST(RunSettings, ModelChangesAreRefusedScheduleChangesWarned) {
  LlamaConfig model;
  model.hidden_size = 64;
  RunConfig run;
  const nlohmann::json saved = run_settings_json(run, model, "");
  std::ostringstream err;
  check_resume_settings(saved, saved, "ckpt", err);
  EXPECT_EQ(err.str(), "");
  RunConfig faster = run;
  faster.learning_rate = 1e-3;
  faster.max_steps = 99;
  check_resume_settings(saved, run_settings_json(faster, model, ""), "ckpt", err);
  EXPECT_NE(err.str().find("learning_rate 0.0002 vs 0.001, max_steps 10 vs 99"), std::string::npos) << err.str();
  RunConfig other = run;
  other.precision = Precision::bf16;
  other.lora_alpha = 32;
  const std::string message = error_of([&] { check_resume_settings(saved, run_settings_json(other, model, ""), "ckpt", err); });
  EXPECT_NE(message.find("precision \"fp32\" vs \"bf16\""), std::string::npos) << message;
  EXPECT_NE(message.find("lora_alpha 16.0 vs 32.0"), std::string::npos) << message;
  LlamaConfig wider = model;
  wider.hidden_size = 128;
  EXPECT_NE(error_of([&] { check_resume_settings(saved, run_settings_json(run, wider, ""), "ckpt", err); })
                .find("model.hidden_size 64 vs 128"),
            std::string::npos);
  // A random base is its seed; a checkpoint base is not.
  RunConfig reseeded = run;
  reseeded.seed = 7;
  EXPECT_NE(error_of([&] { check_resume_settings(saved, run_settings_json(reseeded, model, ""), "ckpt", err); }), "");
  EXPECT_EQ(error_of([&] {
              check_resume_settings(run_settings_json(run, model, "/m"), run_settings_json(reseeded, model, "/m"), "ckpt", err);
            }),
            "");
  std::ostringstream older;
  check_resume_settings(nlohmann::json(), saved, "ckpt", older);
  EXPECT_NE(older.str().find("records no run settings"), std::string::npos);
}

}  // namespace
