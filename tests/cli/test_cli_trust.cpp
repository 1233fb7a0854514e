// No silent wrong result: what memtune refuses, says or marks where it used to accept a mistake
// and give a wrong or lost result without a word. Each test drives the binary as a user does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>
#include <fstream>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "memtune/core/bytes.h"

namespace fs = std::filesystem;

namespace {

using namespace memtune::clitest;

std::string write_text(const fs::path& file, const std::string& text) {
  std::ofstream(file, std::ios::binary) << text;
  return file.string();
}

std::string text_data(const fs::path& dir) {
  return write_text(dir / "text.jsonl", R"({"text": "The quick brown fox jumps over the lazy dog again."}
{"text": "short one"}
{"text": "another line of text"}
{"text": "four"}
{"text": "five is here"}
{"text": "six"}
)");
}

std::vector<nlohmann::json> jsonl(const fs::path& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The last line of the output that parses as a JSON object with `key`.
nlohmann::json last_json_with(const std::string& output, const std::string& key) {
  nlohmann::json found;
  size_t start = 0;
  while (start < output.size()) {
    const size_t end = std::min(output.find('\n', start), output.size());
    const nlohmann::json line = nlohmann::json::parse(output.substr(start, end - start), nullptr, false);
    if (line.is_object() && line.contains(key)) found = line;
    start = end + 1;
  }
  return found;
}

void expect_refused(const Result& r, const std::string& expected, const std::string& what) {
  EXPECT_EQ(r.exit_code, 2) << what << "\n" << r.output;
  EXPECT_NE(r.output.find(expected), std::string::npos) << what << "\n" << r.output;
}

// ---- 1. an adapter's own adapter_config.json -------------------------------------------------

TEST(CliAdapterConfig, EvalAndInitAdapterTakeTheAdaptersSettingsAndRefuseContradictions) {
  const fs::path dir = scratch_dir("trust_adapter_config");
  const std::string data = text_data(dir);
  const std::string common = "--device cpu --seq 16 --data " + data;
  ASSERT_EQ(run_memtune("train " + common + " --lora_alpha 32 --max_steps 3 --quiet --out " + (dir / "a").string()).exit_code, 0);
  const std::string adapter = (dir / "a/adapter").string();

  // eval: the file's alpha 32, not the default 16, whether or not the options repeat it.
  const Result bare = run_memtune("eval " + common + " --adapter " + adapter);
  const Result repeated = run_memtune("eval " + common + " --adapter " + adapter + " --lora_alpha 32 --lora_r 16");
  ASSERT_EQ(bare.exit_code, 0) << bare.output;
  ASSERT_EQ(repeated.exit_code, 0) << repeated.output;
  EXPECT_EQ(last_json_with(bare.output, "loss"), last_json_with(repeated.output, "loss"));
  expect_refused(run_memtune("eval " + common + " --adapter " + adapter + " --lora_alpha 16"),
                 "lora_alpha 16 vs 32", "eval with a contradicting --lora_alpha");
  expect_refused(run_memtune("eval " + common + " --adapter " + adapter + " --use_rslora"), "use_rslora true vs false",
                 "eval with a contradicting --use_rslora");

  // train --init-adapter continues with the file's settings and writes them back.
  ASSERT_EQ(run_memtune("train " + common + " --init-adapter " + adapter + " --max_steps 1 --quiet --out " +
                        (dir / "b").string()).exit_code, 0);
  const nlohmann::json continued = memtune::read_json_file(dir / "b/adapter/adapter_config.json");
  EXPECT_EQ(continued["lora_alpha"], 32);
  EXPECT_EQ(continued["r"], 16);
  expect_refused(run_memtune("train " + common + " --init-adapter " + adapter + " --lora_r 8 --max_steps 1 --quiet"),
                 "r 8 vs 16", "train with a contradicting --lora_r");
  expect_refused(run_memtune("train " + common + " --init-adapter " + adapter +
                             " --lora_target_modules q_proj --max_steps 1 --quiet"),
                 "target_modules", "train with contradicting targets");

  // A config that is broken or does not describe the tensors is refused, not applied.
  const auto broken = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const fs::path copy = dir / name;
    fs::create_directories(copy);
    fs::copy_file(fs::path(adapter) / "adapter_model.safetensors", copy / "adapter_model.safetensors");
    nlohmann::json config = memtune::read_json_file(fs::path(adapter) / "adapter_config.json");
    edit(config);
    write_text(copy / "adapter_config.json", config.dump(2));
    return copy.string();
  };
  const std::string rank_8 = broken("rank_8", [](nlohmann::json& c) { c["r"] = 8; });
  const std::string fewer_targets = broken("fewer_targets", [](nlohmann::json& c) { c["target_modules"] = {"q_proj"}; });
  const std::string no_rank = broken("no_rank", [](nlohmann::json& c) { c.erase("r"); });
  const std::string not_json = broken("not_json", [](nlohmann::json&) {});
  write_text(fs::path(not_json) / "adapter_config.json", "{ \"r\": 16,");
  for (const std::string& command : {std::string("eval ") + common + " --adapter ",
                                     std::string("train ") + common + " --max_steps 1 --quiet --init-adapter "}) {
    expect_refused(run_memtune(command + rank_8), "shape", command + rank_8);
    expect_refused(run_memtune(command + fewer_targets), "is not a lora_A / lora_B weight", command + fewer_targets);
    expect_refused(run_memtune(command + no_rank), "\"r\"", command + no_rank);
    expect_refused(run_memtune(command + not_json), "adapter_config.json", command + not_json);
  }
}

// ---- 2. --resume refuses a change of the model, warns for a change of the schedule ------------

TEST(CliResume, SettingsThatChangeTheModelAreRefusedAndScheduleChangesWarned) {
  const fs::path dir = scratch_dir("trust_resume_settings");
  const std::string common = "train --device cpu --seq 16 --quiet --data " + text_data(dir);
  const fs::path out = dir / "out";
  ASSERT_EQ(run_memtune(common + " --max_steps 2 --save_steps 1 --output_dir " + out.string()).exit_code, 0);
  const std::string resume = " --max_steps 3 --resume_from_checkpoint " + out.string() + " --out " + out.string();
  const struct {
    std::string flags, named;
  } refused[] = {{"--lora_alpha 32", "lora_alpha 16.0 vs 32.0"}, {"--lora_r 8", "lora_r 16 vs 8"},
                 {"--lora_dropout 0.1", "lora_dropout"},          {"--use_rslora", "use_rslora false vs true"},
                 {"--lora_target_modules q_proj,v_proj", "lora_target_modules"},
                 {"--bf16", "precision \"fp32\" vs \"bf16\""},     {"--load_in_4bit", "load_in_4bit false vs true"},
                 {"--seed 7", "base_weights"}};
  for (const auto& c : refused) {
    const Result r = run_memtune(common + " " + c.flags + resume);
    expect_refused(r, "differs from the checkpoint's in what the model computes", c.flags);
    EXPECT_NE(r.output.find(c.named), std::string::npos) << c.flags << "\n" << r.output;
  }
  EXPECT_FALSE(fs::exists(out / "checkpoint-3")) << "a refused resume trained anyway";
  // The output folder's newest checkpoint is the one resumed; a new learning rate is taken, with a warning.
  const Result warned = run_memtune(common + " --learning_rate 1e-3" + resume);
  ASSERT_EQ(warned.exit_code, 0) << warned.output;
  EXPECT_NE(warned.output.find("resumed from " + (out / "checkpoint-2").string() + " at step 2"), std::string::npos)
      << warned.output;
  EXPECT_NE(warned.output.find("warning"), std::string::npos) << warned.output;
  EXPECT_NE(warned.output.find("learning_rate 0.0002 vs 0.001"), std::string::npos) << warned.output;
  EXPECT_TRUE(fs::exists(out / "checkpoint-3/trainer_state.json"));
}

// ---- 3. the output folder: fresh runs, the lock, checkpoint-<step> and save_total_limit --------

TEST(CliOut, AFreshRunRefusesAnotherRunsFolderUnlessToldToOverwriteIt) {
  const fs::path dir = scratch_dir("trust_out_fresh");
  const std::string common = "train --device cpu --seq 16 --quiet --data " + text_data(dir);
  const fs::path out = dir / "out";
  ASSERT_EQ(run_memtune(common + " --max_steps 3 --out " + out.string()).exit_code, 0);
  const std::string before = memtune::read_json_file(out / "checkpoint-3/trainer_state.json").dump();
  const Result again = run_memtune(common + " --max_steps 2 --out " + out.string());
  expect_refused(again, "is not empty", "a second fresh run into one --out");
  EXPECT_NE(again.output.find("--resume " + out.string()), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("--overwrite_output_dir"), std::string::npos) << again.output;
  EXPECT_EQ(memtune::read_json_file(out / "checkpoint-3/trainer_state.json").dump(), before);

  // Overwritten, and it diverges (every gradient vanishes at this learning rate): the previous
  // run's checkpoint is gone and is never called this run's last good one.
  const Result diverged = run_memtune(common + " --max_steps 20 --save_steps 5 --learning_rate 1e6 --overwrite_output_dir --out " +
                                      out.string());
  EXPECT_NE(diverged.output.find("removed the previous run's " + (out / "checkpoint-3").string()), std::string::npos)
      << diverged.output;
  if (diverged.exit_code == 0) GTEST_SKIP() << "this learning rate no longer makes the tiny model's gradients vanish";
  EXPECT_EQ(diverged.exit_code, 2) << diverged.output;
  EXPECT_EQ(diverged.output.find("checkpoint-3"), diverged.output.rfind("checkpoint-3")) << diverged.output;
  EXPECT_FALSE(fs::exists(out / "checkpoint-3"));
  EXPECT_FALSE(fs::exists(out / "adapter"));
}

TEST(CliOut, TwoRunsCannotWriteIntoOneFolderAtOnce) {
  const fs::path dir = scratch_dir("trust_out_lock");
  const std::string data = text_data(dir);
  const fs::path out = dir / "out", metrics = dir / "m.jsonl";
  const std::string train = memtune_binary() + " train --device cpu --seq 16 --quiet --data " + data;
  // The first run holds the lock while it trains; the second is refused while it does.
  const Result r = run_shell(train + " --max_steps 1000000 --out " + out.string() + " --metrics " + metrics.string() +
                             " & pid=$!; i=0; while [ ! -s " + metrics.string() +
                             " ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; " + train +
                             " --max_steps 1 --out " + out.string() + "; echo \"second=$?\"; kill -TERM $pid; wait $pid");
  EXPECT_NE(r.output.find("second=2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("another memtune run (pid "), std::string::npos) << r.output;
  // Once it has ended, the lock is free: the folder resumes.
  EXPECT_EQ(run_shell(train + " --max_steps 1 --resume " + out.string() + " --out " + out.string()).exit_code, 0);
}

TEST(CliOut, CheckpointsAreNamedByStepAndSaveTotalLimitKeepsTheNewest) {
  const fs::path dir = scratch_dir("trust_out_rotation");
  const std::string common = "train --device cpu --seq 16 --quiet --data " + text_data(dir);
  const fs::path out = dir / "out";
  ASSERT_EQ(run_memtune(common + " --max_steps 5 --save_steps 1 --save_total_limit 2 --out " + out.string()).exit_code, 0);
  std::vector<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(out)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".memtune.lock", "adapter", "checkpoint-4", "checkpoint-5"}));

  // A folder holding an older memtune's single checkpoint/ still resumes, by its own path and
  // as the newest of its output folder.
  const fs::path legacy = dir / "legacy";
  fs::create_directories(legacy);
  fs::copy(out / "checkpoint-5", legacy / "checkpoint");
  const Result resumed = run_memtune(common + " --max_steps 6 --resume " + legacy.string() + " --out " + legacy.string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + (legacy / "checkpoint").string() + " at step 5"), std::string::npos)
      << resumed.output;
  EXPECT_TRUE(fs::exists(legacy / "checkpoint-6/trainer_state.json"));
  expect_refused(run_memtune(common + " --resume " + (dir / "nowhere").string()), "no such folder", "--resume of nothing");
  expect_refused(run_memtune(common + " --resume " + out.string() + " --overwrite_output_dir --out " + out.string()),
                 "exclude each other", "--resume with --overwrite_output_dir");
}

// ---- 4. skipped and vanishing steps ------------------------------------------------------------

TEST(CliTrain, SkippedStepsAreSummarisedAndARunThatDidNotTrainFails) {
  const fs::path dir = scratch_dir("trust_skipped_steps");
  const std::string common = "train --device cpu --seq 16 --quiet --data " + text_data(dir);
  const Result healthy = run_memtune(common + " --max_steps 3");
  ASSERT_EQ(healthy.exit_code, 0) << healthy.output;
  EXPECT_NE(healthy.output.find("3 steps: 0 skipped (fp16 overflow: no update), 0 with a gradient norm of exactly 0"),
            std::string::npos) << healthy.output;

  // fp16 at a learning rate that overflows every step after the first: nothing is trained.
  const std::string overflow = common + " --fp16 --learning_rate 1e6 --max_steps 30 --out ";
  const fs::path out = dir / "out";
  const Result overflowing = run_memtune(overflow + out.string() + " --save_steps 4");
  EXPECT_EQ(overflowing.exit_code, 2) << overflowing.output;
  EXPECT_NE(overflowing.output.find("did not train the adapter"), std::string::npos) << overflowing.output;
  EXPECT_NE(overflowing.output.find("--max_skipped_steps_ratio 0.5"), std::string::npos) << overflowing.output;
  EXPECT_NE(overflowing.output.find("stopping without writing the adapter"), std::string::npos) << overflowing.output;
  EXPECT_FALSE(fs::exists(out / "adapter"));
  // Judged from step 8 on: the checkpoint of step 4 stays, with what it holds said.
  EXPECT_NE(overflowing.output.find("the last checkpoint (" + (out / "checkpoint-4").string() + ", step 4; "),
            std::string::npos) << overflowing.output;
  EXPECT_FALSE(fs::exists(out / "checkpoint-8"));

  // Allowed, it finishes and still says how many steps were skipped.
  const fs::path allowed_out = dir / "allowed";
  const Result allowed = run_memtune(overflow + allowed_out.string() + " --allow_skipped_steps");
  EXPECT_EQ(allowed.exit_code, 0) << allowed.output;
  EXPECT_NE(allowed.output.find("30 steps: "), std::string::npos) << allowed.output;
  EXPECT_EQ(allowed.output.find("30 steps: 0 skipped"), std::string::npos) << allowed.output;
  // Its adapter overflows fp16: eval says so and fails, it does not print a null loss.
  const Result eval = run_memtune("eval --device cpu --fp16 --seq 32 --adapter " + (allowed_out / "adapter").string() +
                                  " --data " + text_data(dir));
  EXPECT_EQ(eval.exit_code, 2) << eval.output;
  EXPECT_NE(eval.output.find("is not finite"), std::string::npos) << eval.output;
  EXPECT_EQ(eval.output.find("null"), std::string::npos) << eval.output;
  expect_refused(run_memtune(common + " --max_skipped_steps_ratio 1.5"), "--max_skipped_steps_ratio 1.5",
                 "a ratio above 1");
}

// ---- 5. errors, not aborts, and runs that say what they do -------------------------------------

uint64_t mem_available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);)
    if (line.rfind("MemAvailable:", 0) == 0) return std::strtoull(line.c_str() + 13, nullptr, 10) * 1024;
  return 0;
}

TEST(CliErrors, ACpuRunLargerThanTheHostIsRefusedBeforeItAllocates) {
  // Llama 3.1 70B in fp32: 280 GB of frozen weights alone.
  if (mem_available_bytes() == 0 || mem_available_bytes() > (uint64_t{300} << 30))
    GTEST_SKIP() << "this machine holds a 70B model in fp32";
  const Result r = run_memtune("train --device cpu --model llama-3.1-70b --seq 16 --max_steps 1 --quiet");
  expect_refused(r, "of host memory", "70B fp32 on the CPU");
  EXPECT_NE(r.output.find("the machine has"), std::string::npos) << r.output;
}

TEST(CliErrors, ModelSizesBeyondRealModelsAreAClearError) {
  const fs::path dir = scratch_dir("trust_sizes");
  nlohmann::json config = memtune::read_json_file(memtune::test::source_path("configs/models/tiny.json"));
  config["hidden_size"] = int64_t{1} << 40;
  fs::create_directories(dir / "huge");
  write_text(dir / "huge/config.json", config.dump());
  expect_refused(run_memtune("plan --model " + (dir / "huge").string()),
                 "\"hidden_size\" 1099511627776 is outside the sizes real models use", "hidden_size 2^40");
  expect_refused(run_memtune("plan --model tiny --seq 4000000"), "max_seq_length 4000000 is over", "seq 4M");
  expect_refused(run_memtune("plan --model tiny --seq 1048576 --batch 64"), "tokens per micro-batch", "64 x 1M tokens");
}

TEST(CliTrain, ARunOnSyntheticTokensOrWithoutOutSaysSoFirst) {
  const Result r = run_memtune("train --device cpu --seq 16 --max_steps 1 --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.substr(0, r.output.find('\n')),
            "memtune: note: no --data: training on synthetic random tokens; no --out: the trained adapter is not saved");
}

// ---- 6. advice, names, the ladder ----------------------------------------------------------------

// The README's example (an 8B in bf16 does not fit 12 GiB; QLoRA does) and an 8B at 6 GiB, which
// fits only with the checkpointed inputs and the embedding table in host memory: the advice and
// fit hold the same CUDA context reserve (ops/device.h) beside the plan and find the same run.
TEST(CliPlan, VramAdviceOffersQloraAndAgreesWithFit) {
  struct Case {
    const char* options;
    const char* budget;
    const char* fit_finds;
  };
  for (const Case& c : {Case{"--bf16", "12GiB", "--load_in_4bit"},
                        Case{"", "6GiB", "--load_in_4bit --gradient_checkpointing --offload_activations --offload_embeddings"}}) {
    SCOPED_TRACE(c.budget);
    const Result plan = run_memtune(fmt::format("plan --model llama-3.1-8b {} --vram {}", c.options, c.budget));
    expect_refused(plan, fmt::format("does not fit --vram {}", c.budget), "an 8B over its budget");
    EXPECT_NE(plan.output.find("--load_in_4bit (QLoRA"), std::string::npos) << plan.output;
    EXPECT_NE(plan.output.find("memtune fit (the same plans with 640.0 MiB reserved for the CUDA context) finds a "
                               "run that fits"), std::string::npos) << plan.output;
    EXPECT_EQ(plan.output.find("still does not fit"), std::string::npos) << plan.output;
    const Result fit = run_memtune(fmt::format("fit --model llama-3.1-8b {} --vram {}", c.options, c.budget));
    EXPECT_EQ(fit.exit_code, 0) << fit.output;
    EXPECT_NE(fit.output.find(c.fit_finds), std::string::npos) << fit.output;
  }
}

// On the CPU the advice's figures are CPU plans (no GPU workspace), as the refused plan is.
TEST(CliPlan, CpuVramAdviceCountsTheCpuPlan) {
  const Result plan = run_memtune("plan --device cpu --model tiny --vram 1MiB");
  EXPECT_EQ(plan.exit_code, 2) << plan.output;
  const Result json = run_memtune("plan --device cpu --model tiny --json");
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const uint64_t peak = nlohmann::json::parse(json.output.substr(json.output.find('{')))["peak_bytes"].get<uint64_t>();
  EXPECT_NE(plan.output.find("the plan needs " + memtune::format_bytes(peak) + " + "), std::string::npos) << plan.output;
  EXPECT_EQ(plan.output.find("memtune fit"), std::string::npos) << plan.output;  // fit searches GPU runs
}

TEST(CliNames, HuggingFaceAliasesVersionAndUnknownOptions) {
  const Result version = run_memtune("--version");
  EXPECT_EQ(version.exit_code, 0) << version.output;
  EXPECT_EQ(version.output.rfind("memtune ", 0), 0u) << version.output;
  const Result typo = run_memtune("train --lora_rank 8");
  EXPECT_EQ(typo.exit_code, 2) << typo.output;
  EXPECT_NE(typo.output.find("unknown option --lora_rank; did you mean --lora_r?"), std::string::npos) << typo.output;
  const Result far = run_memtune("plan --zzzzzzzz");
  EXPECT_EQ(far.exit_code, 2) << far.output;
  EXPECT_NE(far.output.find("unknown option --zzzzzzzz (memtune plan --help"), std::string::npos) << far.output;
  const Result command = run_memtune("trian --max_steps 1");
  EXPECT_EQ(command.exit_code, 2) << command.output;
  EXPECT_NE(command.output.find("unknown command trian; did you mean train?"), std::string::npos) << command.output;
  EXPECT_EQ(run_memtune("plan --seq").exit_code, 2);  // a missing value: CLI11's message, memtune's exit code

  // --logging_steps: a step line every N steps, and the last, whose loss is the mean of the steps
  // since the line before (transformers' logging); the progress lines (off a terminal) follow it.
  const fs::path metrics = scratch_dir("trust_logging_steps") / "metrics.jsonl";
  fs::remove(metrics);
  const Result logged =
      run_memtune("train --device cpu --seq 16 --max_steps 5 --logging_steps 2 --metrics " + metrics.string());
  ASSERT_EQ(logged.exit_code, 0) << logged.output;
  std::vector<nlohmann::json> lines;
  std::istringstream output(logged.output);
  int progress_lines = 0;
  for (std::string text; std::getline(output, text);) {
    if (text.rfind("{\"engine_peak_bytes\"", 0) == 0) lines.push_back(nlohmann::json::parse(text));
    if (text.rfind("train step ", 0) == 0) ++progress_lines;
  }
  ASSERT_EQ(lines.size(), 3u) << logged.output;  // steps 2, 4 and 5
  EXPECT_EQ(progress_lines, 3) << logged.output;
  std::vector<double> step_losses;
  for (const nlohmann::json& record : read_jsonl(metrics))
    if (record["event"] == "step") step_losses.push_back(record["loss"].get<double>());
  ASSERT_EQ(step_losses.size(), 5u);
  EXPECT_EQ(lines[0]["step"], 2);
  EXPECT_EQ(lines[0]["loss_steps"], 2);
  EXPECT_NEAR(lines[0]["loss"].get<double>(), (step_losses[0] + step_losses[1]) / 2, 1e-12);
  EXPECT_NEAR(lines[1]["loss"].get<double>(), (step_losses[2] + step_losses[3]) / 2, 1e-12);
  EXPECT_FALSE(lines[2].contains("loss_steps"));
  EXPECT_NEAR(lines[2]["loss"].get<double>(), step_losses[4], 1e-12);
}

TEST(CliLadder, StartsFromFp32WhenAskedAndNeedsStepsToJudgeStability) {
  const fs::path dir = scratch_dir("trust_ladder_fp32");
  const std::string ladder = "ladder --model tiny --device cpu --seq 32 --steps-per-rung 1 --quiet ";
  const Result r = run_memtune(ladder + "--order fp32,bf16 --out " + (dir / "order").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json json = memtune::read_json_file(dir / "order/ladder.json");
  EXPECT_EQ(json["rungs"][0]["name"], "fp32 baseline");
  EXPECT_EQ(json["rungs"][1]["added"], "bf16");
  const std::string report = [&] {
    std::ifstream in(dir / "order/report.md");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  EXPECT_EQ(report.find("No fp32 rung on this run"), std::string::npos) << report;
  const Result flag = run_memtune(ladder + "--fp32 --order bf16 --out " + (dir / "flag").string());
  ASSERT_EQ(flag.exit_code, 0) << flag.output;
  EXPECT_EQ(memtune::read_json_file(dir / "flag/ladder.json")["rungs"][0]["name"], "fp32 baseline");
  expect_refused(run_memtune(ladder + "--order bf16,fp32"), "put it first in --order", "fp32 after a trick");
}

// ---- 7. planned == allocated on the CPU, plan --json, replayed steps ---------------------------

TEST(CliPlan, TheCpuPlanIsWhatTheCpuEngineAllocatesAndJsonNamesUnitsAndFit) {
  const Result trained = run_memtune("train --device cpu --seq 16 --max_steps 1");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const nlohmann::json step = last_json_with(trained.output, "engine_peak_bytes");
  ASSERT_TRUE(step.is_object()) << trained.output;
  EXPECT_EQ(step["planned_peak_bytes"], step["engine_peak_bytes"]);
  const Result planned = run_memtune("plan --json --device cpu --seq 16 --vram 24GiB");
  ASSERT_EQ(planned.exit_code, 0) << planned.output;
  const nlohmann::json plan = nlohmann::json::parse(planned.output);
  EXPECT_EQ(plan["peak_bytes"], step["planned_peak_bytes"]);
  EXPECT_EQ(plan["units"], "bytes");
  EXPECT_EQ(plan["device"], "cpu");
  EXPECT_EQ(plan["fits"], true);
  EXPECT_EQ(plan["budget_bytes"], uint64_t{24} << 30);
  // The CUDA plan counts the library workspace the CPU never allocates.
  const nlohmann::json cuda = nlohmann::json::parse(run_memtune("plan --json --seq 16").output);
  EXPECT_EQ(cuda["device"], "cuda");
  EXPECT_GT(cuda["peak_bytes"].get<uint64_t>(), plan["peak_bytes"].get<uint64_t>());
  const Result over = run_memtune("plan --json --seq 16 --vram 1MiB");
  EXPECT_EQ(over.exit_code, 2);
  // The JSON (stdout) comes whole, then the refusal (stderr).
  const size_t error_at = over.output.find("memtune: error");
  ASSERT_NE(error_at, std::string::npos) << over.output;
  const nlohmann::json refused = nlohmann::json::parse(over.output.substr(0, error_at), nullptr, false);
  ASSERT_TRUE(refused.is_object()) << over.output;
  EXPECT_EQ(refused["fits"], false) << over.output;
}

// A --vram budget holds the plan plus the device memory outside the arena (CUDA context,
// library handles, lazily loaded kernels): a plan that fits only without that reserve is refused.
TEST(CliPlan, TheVramVerdictCountsTheCudaContext) {
  const nlohmann::json plan = nlohmann::json::parse(run_memtune("plan --json --seq 16").output);
  const uint64_t arena = plan["peak_bytes"].get<uint64_t>(), reserve = uint64_t{640} << 20;
  const auto verdict = [](const Result& r) {
    const size_t error_at = r.output.find("memtune: error");
    return nlohmann::json::parse(r.output.substr(0, error_at), nullptr, false);
  };
  const Result inside = run_memtune(fmt::format("plan --json --seq 16 --vram {}", arena + reserve));
  EXPECT_EQ(inside.exit_code, 0) << inside.output;
  EXPECT_EQ(verdict(inside)["fits"], true) << inside.output;
  EXPECT_EQ(verdict(inside)["context_reserve_bytes"], reserve) << inside.output;
  const Result arena_only = run_memtune(fmt::format("plan --json --seq 16 --vram {}", arena + reserve - 1));
  EXPECT_EQ(arena_only.exit_code, 2) << arena_only.output;
  EXPECT_EQ(verdict(arena_only)["fits"], false) << arena_only.output;
  EXPECT_NE(arena_only.output.find("640.0 MiB context"), std::string::npos) << arena_only.output;
  // On the CPU nothing lives outside the arena.
  const Result cpu = run_memtune(fmt::format("plan --json --device cpu --seq 16 --vram {}", arena));
  EXPECT_EQ(verdict(cpu)["context_reserve_bytes"], 0) << cpu.output;
}

// Past the model's max_position_embeddings a run goes on, with a warning, as transformers does;
// fit --max-context searches past it and says when its answer is there.
TEST(CliPlan, PastTheModelsPositionsWarnsAndGoesOn) {
  const Result plan = run_memtune("plan --model tiny --seq 4096");  // tiny: 2048 positions
  EXPECT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find("warning: --max_seq_length 4096 is past the model's max_position_embeddings 2048"),
            std::string::npos) << plan.output;
  EXPECT_EQ(run_memtune("plan --model tiny --seq 2048").output.find("max_position_embeddings"), std::string::npos);
  const Result fit = run_memtune("fit --model tiny --vram 8GiB --max-context --json --host_memory none");
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  const nlohmann::json longest = nlohmann::json::parse(fit.output.substr(fit.output.find('{')));
  EXPECT_GT(longest["with_offload"]["seq"].get<int64_t>(), 2048) << fit.output;
  EXPECT_EQ(longest["with_offload"]["past_model_limit"], true) << fit.output;
  EXPECT_EQ(longest["model_max_position_embeddings"], 2048) << fit.output;
}

TEST(CliTrain, StepsReplayedAfterAKillAreMarkedInTheMetrics) {
  const fs::path dir = scratch_dir("trust_replayed");
  const std::string data = text_data(dir);
  const fs::path out = dir / "out", metrics = dir / "m.jsonl";
  const std::string train = memtune_binary() + " train --device cpu --seq 16 --quiet --save_steps 2 --data " + data +
                            " --out " + out.string() + " --metrics " + metrics.string();
  // Killed (SIGKILL: no handler runs) once step 3 is logged, past the checkpoint of step 2.
  const Result killed = run_shell(train + " --max_steps 1000000 & pid=$!; i=0; while ! grep -q '\"step\":3' " +
                                  metrics.string() + " 2>/dev/null && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; "
                                  "kill -KILL $pid; wait $pid; echo \"exit=$?\"");
  ASSERT_NE(killed.output.find("exit=137"), std::string::npos) << killed.output;
  int64_t logged = 0;
  for (const nlohmann::json& r : jsonl(metrics))
    if (r["event"] == "step") logged = std::max<int64_t>(logged, r["step"].get<int64_t>());
  const Result resumed = run_shell(train + " --max_steps " + std::to_string(logged + 2) + " --resume " + out.string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  // Every step appears once unmarked; the re-run ones are marked "replayed".
  std::map<int64_t, int> unmarked, replayed;
  for (const nlohmann::json& r : jsonl(metrics)) {
    if (r["event"] != "step") continue;
    (r.value("replayed", false) ? replayed : unmarked)[r["step"].get<int64_t>()] += 1;
  }
  for (int64_t step = 1; step <= logged + 2; ++step) EXPECT_EQ(unmarked[step], 1) << "step " << step;
  // The resumed run starts after its checkpoint's step: the steps up to what the killed run
  // logged are the replayed ones, each marked once.
  const size_t at = resumed.output.find(" at step ");
  ASSERT_NE(at, std::string::npos) << resumed.output;
  const int64_t resumed_at = std::stoll(resumed.output.substr(at + 9));
  EXPECT_GE(logged, 3);
  for (int64_t step = 1; step <= logged + 2; ++step)
    EXPECT_EQ(replayed[step], step > resumed_at && step <= logged ? 1 : 0) << "step " << step;
}

// train --profile times every op of the last step: the table on stderr, an op_profile record,
// and that step marked and left out of the closing token totals (its timing serialises ops).
TEST(CliTrain, ProfileTimesTheLastStepAndKeepsItOutOfTheTotals) {
  const fs::path dir = scratch_dir("trust_profile");
  const fs::path metrics = dir / "m.jsonl";
  const Result r = run_memtune("train --device cpu --seq 16 --max_steps 3 --quiet --profile --metrics " + metrics.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("op profile of the last step"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("matmul"), std::string::npos) << r.output;
  int64_t profiled_step = 0, unprofiled_tokens = 0, profiles = 0, summary_tokens = -1;
  for (const nlohmann::json& record : jsonl(metrics)) {
    if (record["event"] == "step") {
      if (record.value("profiled", false)) profiled_step = record["step"].get<int64_t>();
      else unprofiled_tokens += record["tokens"].get<int64_t>();
    }
    if (record["event"] == "op_profile") {
      ++profiles;
      EXPECT_FALSE(record["op_profile"]["ops"].empty());
    }
    if (record["event"] == "summary") summary_tokens = record["tokens"].get<int64_t>();
  }
  EXPECT_EQ(profiled_step, 3);
  EXPECT_EQ(profiles, 1);
  EXPECT_EQ(summary_tokens, unprofiled_tokens);
}

}  // namespace
