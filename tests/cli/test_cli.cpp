// The memtune command line, run as a user runs it: figures of the plan, HF round trips through
// eval and train, and clear errors with a non-zero exit for bad input.
#include <gtest/gtest.h>

#include <map>

#include "cli_test_util.h"
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "memtune/io/safetensors.h"
#include "memtune/ops/backend.h"

namespace fs = std::filesystem;
using memtune::DType;

namespace {

using namespace memtune::clitest;



nlohmann::json plan_json(const std::string& args) {
  const Result r = run_memtune("plan --json " + args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return nlohmann::json::parse(r.output);
}



TEST(CliPlan, Llama31_8bBf16FrozenWeightsAndAdapterCountAreExact) {
  const nlohmann::json plan = plan_json("--model llama-3.1-8b --bf16 --lora_r 16 --lora_alpha 16 --lora_target_modules all-linear --batch 2 --seq 2048");
  EXPECT_EQ(plan["categories"]["frozen_weights"].get<uint64_t>(), 8030261248ull * 2);
  EXPECT_EQ(plan["frozen_parameters"].get<int64_t>(), 8030261248ll);
  EXPECT_EQ(plan["trainable_parameters"].get<int64_t>(), 41943040);
  // fp32 masters + bf16 copies, fp32 grads, two fp32 moments.
  EXPECT_EQ(plan["categories"]["adapters"].get<uint64_t>(), 41943040ull * 6);
  EXPECT_EQ(plan["categories"]["adapter_grads"].get<uint64_t>(), 41943040ull * 4);
  EXPECT_EQ(plan["categories"]["optimizer_state"].get<uint64_t>(), 41943040ull * 8);
}

TEST(CliPlan, ActivationsMoveWithCheckpointingAndAttention) {
  const std::string base = "--model llama-3.1-8b --bf16 --batch 2 --seq 2048 ";
  const nlohmann::json eager = plan_json(base);
  const nlohmann::json ckpt = plan_json(base + "--gradient_checkpointing");
  const nlohmann::json flash = plan_json(base + "--attn_implementation flash");
  const auto saved = [](const nlohmann::json& p) { return p["max_by_category"]["saved_activations"].get<uint64_t>(); };
  // Eager keeps bf16 probabilities of 32 heads x 2048 x 2048 x batch 2 in each of 32 layers;
  // flash keeps instead an fp32 logsumexp per row.
  const uint64_t probs = 2ull * 32 * 2048 * 2048 * 2 * 32;
  const uint64_t lse = 2ull * 32 * 2048 * 4 * 32;
  EXPECT_EQ(saved(eager) - saved(flash), probs - lse);
  EXPECT_LT(saved(ckpt) * 10, saved(eager));
  // Under checkpointing the saved activations are the 33 residual-stream tensors (+ the batch).
  EXPECT_EQ(saved(ckpt) / (2ull * 2048 * 4096 * 2), 33ull);
  EXPECT_LT(plan_json(base + "--gradient_checkpointing --attn_implementation flash --loss_implementation chunked")["peak_bytes"].get<uint64_t>(),
            plan_json(base + "--gradient_checkpointing --attn_implementation flash")["peak_bytes"].get<uint64_t>());
}

TEST(CliPlan, AutoAttentionIsCudnnWhereAvailableElseFlash) {
  // The test binary runs on the same machine as the memtune it starts: the same answer.
  const std::string expected = memtune::cudnn_attention_available() ? "cudnn" : "flash";
  for (const char* name : {"auto", "sdpa"})
    EXPECT_EQ(plan_json(std::string("--model tiny --attn_implementation ") + name)["run"]["attn_implementation"],
              expected) << name;
  EXPECT_EQ(plan_json("--model tiny --attn_implementation flash_attention_2")["run"]["attn_implementation"], "flash");
}

TEST(CliPlan, Llama31_70bPlansWellUnderASecond) {
  const nlohmann::json plan = plan_json("--model llama-3.1-70b --bf16 --batch 1 --seq 2048 --gradient_checkpointing");
  EXPECT_LT(plan["planning_seconds"].get<double>(), 0.5);
  EXPECT_GT(plan["frozen_parameters"].get<int64_t>(), 70000000000ll);
}

TEST(CliPlan, RunYamlSetsDefaultsThatFlagsOverride) {
  const std::string yaml = memtune::test::source_path("configs/runs/llama-3.1-8b_lora_bf16.yaml").string();
  const nlohmann::json from_yaml = plan_json("--config " + yaml);
  EXPECT_EQ(from_yaml["run"]["max_seq_length"], 2048);
  EXPECT_EQ(from_yaml["run"]["precision"], "bf16");
  EXPECT_EQ(from_yaml["run"]["attn_implementation"], "flash");
  EXPECT_EQ(plan_json("--config " + yaml + " --seq 1024")["run"]["max_seq_length"], 1024);
}

TEST(CliPlan, VramBudgetRefusesWithAdvice) {
  const Result r = run_memtune("plan --model llama-3.1-8b --bf16 --batch 2 --seq 2048 --vram 24GiB");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("does not fit --vram 24GiB"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--gradient_checkpointing"), std::string::npos) << r.output;
  EXPECT_EQ(run_memtune("plan --model tiny --vram 24GiB").exit_code, 0);
}

TEST(CliFit, FindsTheFastestFittingSetAndRefusesTheImpossible) {
  const std::string fits = "fit --model llama-3.1-8b --batch 2 --accum 8 --seq 2048 --vram 24GiB";
  const std::string impossible = "fit --model llama-3.1-70b --seq 2048 --vram 8GiB";
  const Result r = run_memtune(fits), none = run_memtune(impossible);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* expected : {"fits at micro-batch", "predicted peak with context", "the options: --bf16"})
    EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
  EXPECT_EQ(none.exit_code, 3) << none.output;
  EXPECT_NE(none.output.find("nothing fits"), std::string::npos) << none.output;
  // --json: one object, the fitted run's options and its plan, for scripts; fits false (exit 3)
  // where nothing fits.
  const Result json = run_memtune(fits + " --json"), none_json = run_memtune(impossible + " --json");
  ASSERT_EQ(json.exit_code, 0) << json.output;
  EXPECT_EQ(none_json.exit_code, 3) << none_json.output;
  EXPECT_FALSE(nlohmann::json::parse(none_json.output)["fits"].get<bool>());
  const nlohmann::json fit = nlohmann::json::parse(json.output);
  EXPECT_TRUE(fit["fits"].get<bool>());
  EXPECT_EQ(fit["units"], "bytes");
  EXPECT_NE(fit["options"].get<std::string>().find("--per_device_train_batch_size"), std::string::npos);
  EXPECT_LE(fit["with_context_bytes"].get<uint64_t>(), fit["budget_bytes"].get<uint64_t>());
  EXPECT_EQ(fit["plan"]["peak_bytes"], fit["planned_bytes"]);
}

TEST(CliEval, ReproducesTheLossOfTransformersAndPeft) {
  for (const char* name : {"gqa_rope", "tied_odd"}) {
    const fs::path dir = scratch_dir(std::string("eval_") + name);
    write_golden_batch_jsonl(name, dir / "batch.jsonl");
    const Result r = run_memtune("eval --model " + golden(name).string() + " --adapter " + (golden(name) / "adapter").string() +
                                 " --lora_r 4 --lora_alpha 8 --data " + (dir / "batch.jsonl").string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::ifstream in(golden(name) / "eval.json");
    const nlohmann::json expected = nlohmann::json::parse(in);
    const double want = expected.contains("loss_with_adapter") ? expected["loss_with_adapter"].get<double>() : expected["loss"].get<double>();
    EXPECT_NEAR(nlohmann::json::parse(r.output)["loss"].get<double>(), want, 1e-5 * want) << r.output;
  }
}

TEST(CliTrain, OneStepFromAPeftAdapterMatchesTransformers) {
  const std::string name = "gqa_rope";
  const fs::path dir = scratch_dir("train_init_adapter");
  const memtune::SafetensorsFile train = memtune::SafetensorsFile::open(golden(name) / "train.safetensors");
  const auto& ids = train.get("input_ids");  // [step, micro, batch, seq]
  const auto& labels = train.get("labels");
  const int64_t micro = ids.shape[1], rows = ids.shape[2], seq = ids.shape[3];
  std::ofstream out(dir / "step1.jsonl");
  for (int64_t r = 0; r < micro * rows; ++r) {  // step 0's sequences, micro-batch by micro-batch
    nlohmann::json row_ids = nlohmann::json::array(), row_labels = nlohmann::json::array();
    for (int64_t t = 0; t < seq; ++t) {
      int32_t v;
      std::memcpy(&v, ids.data + 4 * (r * seq + t), 4);
      row_ids.push_back(v);
      std::memcpy(&v, labels.data + 4 * (r * seq + t), 4);
      row_labels.push_back(v);
    }
    out << nlohmann::json{{"input_ids", row_ids}, {"labels", row_labels}}.dump() << "\n";
  }
  out.close();
  const Result r = run_memtune(fmt::format(
      "train --model {} --init-adapter {} --lora_r 4 --lora_alpha 8 --data {} --batch {} --accum {} --seq {} "
      "--max_steps 1 --learning_rate 1e-2 --weight_decay 0.01 --max_grad_norm 1.0 --device cpu --out {}",
      golden(name).string(), (golden(name) / "adapter").string(), (dir / "step1.jsonl").string(), rows, micro, seq,
      (dir / "out").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const memtune::SafetensorsCheckpoint adapter = memtune::SafetensorsCheckpoint::open(dir / "out/adapter", "adapter_model.safetensors");
  ASSERT_FALSE(adapter.names().empty());
  for (const std::string& key : adapter.names()) {
    const auto& got = adapter.get(key);
    const auto& want = train.get("after_step1." + key);
    const auto& grad = train.get("step1_grad." + key);
    ASSERT_EQ(got.nbytes, want.nbytes) << key;
    for (size_t e = 0; e < got.nbytes / 4; ++e) {
      float g, w, d;
      std::memcpy(&g, got.data + 4 * e, 4);
      std::memcpy(&w, want.data + 4 * e, 4);
      std::memcpy(&d, grad.data + 4 * e, 4);
      if (std::abs(d) > 1e-5f) ASSERT_NEAR(g, w, 1e-4f * (1 + std::abs(w))) << key << "[" << e << "]";
    }
  }
  std::ifstream config(dir / "out/adapter/adapter_config.json");
  const nlohmann::json c = nlohmann::json::parse(config);
  EXPECT_EQ(c["peft_type"], "LORA");
  EXPECT_EQ(c["r"], 4);
}

TEST(CliErrors, BadInputGetsAClearMessageAndNonZeroExit) {
  const fs::path dir = scratch_dir("errors");
  auto write = [&](const std::string& file, const std::string& text) {
    std::ofstream(dir / file) << text;
    return (dir / file).string();
  };
  struct Case {
    std::string args, expected;
  };
  fs::create_directories(dir / "bad_type");
  write("bad_type/config.json", R"({"model_type": "gpt2", "hidden_size": 8})");
  fs::create_directories(dir / "missing_field");
  write("missing_field/config.json", R"({"model_type": "llama", "hidden_size": 8})");
  fs::create_directories(dir / "not_json");
  write("not_json/config.json", "{ this is not json");
  const std::string bad_jsonl = write("bad.jsonl", "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [1, 2,\n");
  const std::string empty_jsonl = write("empty.jsonl", "\n");
  const std::string big_id = write("big_id.jsonl", "{\"input_ids\": [1, 999999]}\n");
  const std::string bad_yaml = write("bad.yaml", "foo: 1\n");
  const std::string wrong_type_yaml = write("wrong.yaml", "lora_r: sixteen\n");
  const std::string list_key_yaml = write("list_key.yaml", "[lora_r, lora_alpha]: 16\n");
  const std::string twice_yaml = write("twice.yaml", "lora_r: 8\nlora_r: 16\n");
  // Values that would train nothing, or NaN, without a word: refused by name.
  const std::string infinite_epsilon_yaml = write("epsilon.yaml", "adam_epsilon: .inf\n");
  const std::string infinite_alpha_yaml = write("alpha.yaml", "lora_alpha: .inf\n");
  const std::string nan_clip_yaml = write("clip.yaml", "max_grad_norm: .nan\n");
  const std::string huge_bucket_yaml = write("bucket.yaml", "ddp_bucket_cap_mb: 1e300\n");
  fs::create_directories(dir / "folder.yaml");
  const std::vector<Case> cases = {
      {"plan --config " + bad_yaml, "unknown option 'foo'"},
      {"plan --config " + wrong_type_yaml, "'lora_r' has a value of the wrong type"},
      {"plan --config " + (dir / "none.yaml").string(), "cannot open run config"},
      {"plan --config " + (dir / "folder.yaml").string(), "is a folder, not a YAML file"},
      {"plan --config " + list_key_yaml, "an option's name must be a plain word"},
      {"plan --config " + twice_yaml, "option 'lora_r' is given twice"},
      {"plan --config " + infinite_epsilon_yaml, "adam_epsilon must be positive and finite"},
      {"plan --config " + infinite_alpha_yaml, "lora_alpha must be positive and finite"},
      {"plan --config " + nan_clip_yaml, "max_grad_norm must be a number"},
      {"plan --config " + huge_bucket_yaml, "ddp_bucket_cap_mb 1e+300: expected a positive size"},
      {"plan --weight_decay -0.1", "weight_decay must be >= 0 and finite"},
      {"train --device cpu --max_steps 1 --num_train_epochs nan", "--num_train_epochs nan: expected a positive number"},
      {"train --device cpu --num_train_epochs -1", "--num_train_epochs -1: expected a positive number"},
      {"train --device cpu --max_steps 1 --eval_split nan --data " + bad_jsonl, "--eval_split nan: expected a fraction"},
      {"train --device cpu --max_steps 1 --save_steps -1", "--save_steps -1: expected 0"},
      {"train --device cpu --max_steps 1 --eval_steps -5", "--eval_steps -5: expected 0"},
      {"ladder --model tiny --device cpu --steps-per-rung 0 --out " + (dir / "ladder0").string(), "--steps-per-rung 0: expected 1 or more"},
      {"plan --model " + (dir / "bad_type").string(), "unsupported model_type"},
      {"plan --model " + (dir / "missing_field").string(), "missing required field \"intermediate_size\""},
      {"plan --model " + (dir / "not_json").string(), "not valid JSON"},
      {"plan --model no-such-model", "not a preset"},
      {"plan --bf16 --fp16", "exclude each other"},
      {"plan --attn_implementation magic", "attn_implementation 'magic'"},
      {"plan --lora_target_modules q_proj,foo", "unknown module 'foo'"},
      {"plan --seq 1", "max_seq_length must be >= 2"},
      {"plan --vram 24parsecs", "unknown byte unit"},
      {"train --device cpu --max_steps 1 --data " + bad_jsonl, "bad.jsonl:2"},
      {"train --device cpu --max_steps 1 --data " + empty_jsonl, "holds no samples"},
      {"train --device cpu --max_steps 1 --data " + big_id, "outside the model's vocabulary"},
      {"train --device cpu --max_steps 1 --data " + (dir / "missing.jsonl").string(), "cannot open dataset"},
      {"train --device cpu --max_steps 1 --init-adapter " + (dir / "nowhere").string(), "nowhere"},
      {"train --device cpu --max_steps 1 --merge_micro_batches true --lora_dropout 0.1",
       "--merge_micro_batches keeps the gradients only without LoRA dropout"},
  };
  for (const Case& c : cases) {
    const Result r = run_memtune(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
  }
  // --on-bad-line=skip trains on the good lines.
  EXPECT_EQ(run_memtune("train --device cpu --max_steps 1 --seq 8 --quiet --on-bad-line skip --data " + bad_jsonl).exit_code, 0);
}

}  // namespace

namespace {

TEST(CliLadder, CpuLadderWritesEveryRungWithEveryField) {
  const fs::path dir = scratch_dir("ladder");
  const Result r = run_memtune("ladder --model tiny --seq 64 --accum 2 --steps-per-rung 2 --vram 24GiB --quiet --device cpu --out " + dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "ladder.json");
  const nlohmann::json ladder = nlohmann::json::parse(in);
  for (const char* key : {"config", "device", "commit", "rungs"}) EXPECT_TRUE(ladder.contains(key)) << key;
  const std::vector<std::string> names = {"fp16 baseline", "+ bf16", "+ gradient checkpointing", "+ flash attention",
                                          "+ QLoRA (nf4, double quant)", "+ chunked loss",
                                          "micro-batch 1 x more accumulation", "max_seq_length halved"};
  ASSERT_EQ(ladder["rungs"].size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const nlohmann::json& rung = ladder["rungs"][i];
    EXPECT_EQ(rung["name"], names[i]);
    for (const char* key : {"name", "techniques", "planned", "planned_peak_bytes", "engine_peak_bytes", "device_peak_bytes",
                            "fits_budget", "measured", "step_seconds", "tokens_per_second", "loss"})
      EXPECT_TRUE(rung.contains(key)) << names[i] << " lacks " << key;
    EXPECT_TRUE(rung["measured"].get<bool>()) << names[i];
    EXPECT_EQ(rung["engine_peak_bytes"], rung["planned_peak_bytes"]) << names[i];
    EXPECT_GT(rung["tokens_per_second"].get<double>(), 0) << names[i];
    EXPECT_EQ(rung["planned"].size(), 10u);
  }
  EXPECT_TRUE(ladder["rungs"][0].contains("loss_scaler"));
  for (const char* file : {"report.md", "ladder.csv", "ladder.svg"}) EXPECT_TRUE(fs::exists(dir / file)) << file;
  // The SVG parses as XML.
  if (std::system("python3 -c 'import xml.dom.minidom' >/dev/null 2>&1") == 0) {
    const std::string command = "python3 -c 'import sys, xml.dom.minidom; xml.dom.minidom.parse(sys.argv[1])' " + (dir / "ladder.svg").string();
    EXPECT_EQ(std::system(command.c_str()), 0);
  }
}

}  // namespace

namespace {

TEST(CliLadder, IsolateProgressAndMetrics) {
  const fs::path dir = scratch_dir("ladder_isolate");
  // Not --quiet: the progress line goes to stderr, here a pipe, so plain lines with an ETA.
  const Result r = run_memtune("ladder --model tiny --seq 16 --batch 2 --accum 1 --steps-per-rung 2 --device cpu --isolate "
                               "--metrics " + (dir / "metrics.jsonl").string() + " --out " + dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ETA"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[1/22] fp16 baseline  step 1/2"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find('\r'), std::string::npos);

  std::ifstream in(dir / "ladder.json");
  const nlohmann::json ladder = nlohmann::json::parse(in);
  // The cumulative ladder is as it was without --isolate.
  ASSERT_EQ(ladder["rungs"].size(), 8u);
  EXPECT_EQ(ladder["rungs"][0]["name"], "fp16 baseline");
  EXPECT_EQ(ladder["rungs"][7]["name"], "max_seq_length halved");
  const std::vector<std::string> tricks = {"bf16", "gradient_checkpointing", "flash", "qlora", "chunked_loss",
                                           "micro_batch", "seq_halved"};
  ASSERT_TRUE(ladder.contains("isolate"));
  const nlohmann::json& alone = ladder["isolate"]["alone"];
  const nlohmann::json& removed = ladder["isolate"]["removed"];
  ASSERT_EQ(alone.size(), tricks.size());
  ASSERT_EQ(removed.size(), tricks.size());
  const uint64_t baseline = ladder["rungs"][0]["planned_peak_bytes"].get<uint64_t>();
  const uint64_t full = ladder["rungs"][7]["planned_peak_bytes"].get<uint64_t>();
  for (size_t i = 0; i < tricks.size(); ++i) {
    for (const nlohmann::json* entry : {&alone[i], &removed[i]})
      for (const char* key : {"name", "techniques", "planned", "planned_peak_bytes", "engine_peak_bytes",
                              "device_peak_bytes", "fits_budget", "measured", "step_seconds", "tokens_per_second",
                              "loss", "mfu", "saving_bytes"})
        EXPECT_TRUE(entry->contains(key)) << tricks[i] << " lacks " << key;
    EXPECT_EQ(alone[i]["added"], tricks[i]);
    EXPECT_EQ(removed[i]["removed"], tricks[i]);
    EXPECT_TRUE(alone[i]["measured"].get<bool>());
    EXPECT_EQ(alone[i]["saving_bytes"].get<int64_t>(),
              static_cast<int64_t>(baseline) - alone[i]["planned_peak_bytes"].get<int64_t>());
    EXPECT_EQ(removed[i]["saving_bytes"].get<int64_t>(),
              removed[i]["planned_peak_bytes"].get<int64_t>() - static_cast<int64_t>(full));
  }
  // bf16 alone is the ladder's "+ bf16" rung: the same configuration, measured once.
  EXPECT_EQ(alone[0]["same_as"], "+ bf16");
  EXPECT_EQ(alone[0]["planned_peak_bytes"], ladder["rungs"][1]["planned_peak_bytes"]);
  EXPECT_EQ(alone[2]["techniques"][1], "flash");
  EXPECT_EQ(alone[2]["techniques"][0], "fp16");  // alone: on the fp16 baseline

  std::ifstream md_in(dir / "report.md");
  const std::string md((std::istreambuf_iterator<char>(md_in)), std::istreambuf_iterator<char>());
  EXPECT_NE(md.find("## Isolating each trick"), std::string::npos);
  EXPECT_NE(md.find("Matters most alone: **"), std::string::npos);
  EXPECT_NE(md.find("Removal that hurts most: **"), std::string::npos);

  // One line per step and one per rung, each a whole JSON object.
  const std::vector<nlohmann::json> records = read_jsonl(dir / "metrics.jsonl");
  size_t steps = 0, rungs = 0;
  for (const nlohmann::json& record : records) {
    EXPECT_EQ(record["command"], "ladder");
    if (record["event"] == "step") {
      ++steps;
      for (const char* key : {"rung", "step", "loss", "step_seconds", "tokens", "tokens_per_second", "lr", "grad_norm"})
        EXPECT_TRUE(record.contains(key)) << key << " in " << record.dump();
      EXPECT_GT(record["tokens"].get<int64_t>(), 0);
      // "skipped" belongs to fp16 steps (the loss scaler's): the baseline has it, bf16 rungs do not.
      if (record["rung"] == "fp16 baseline") EXPECT_TRUE(record.contains("skipped"));
      if (record["rung"] == "+ bf16") EXPECT_FALSE(record.contains("skipped"));
    } else {
      EXPECT_EQ(record["event"], "rung");
      ++rungs;
      for (const char* key : {"rung", "section", "measured", "planned_peak_bytes", "tokens_per_second", "mfu"})
        EXPECT_TRUE(record.contains(key)) << key << " in " << record.dump();
    }
  }
  EXPECT_EQ(rungs, 8u + 14u);
  EXPECT_GE(steps, 2u * 8u);
  EXPECT_EQ(steps % 2, 0u);
}

TEST(CliSweep, PlanOnlyCurvesAndAMeasuredPoint) {
  const fs::path dir = scratch_dir("sweep");
  const Result r = run_memtune("sweep --model tiny --bf16 --vary seq --values 64,128,256 --plan-only --device cpu --out " +
                               (dir / "plan").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("eager attention bytes: 64->128: x4.00, 128->256: x4.00"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("flash attention bytes: 64->128: x2.00, 128->256: x2.00"), std::string::npos) << r.output;
  for (const char* file : {"sweep.json", "sweep.csv", "sweep_memory.svg", "sweep_tokens_per_second.svg"})
    EXPECT_TRUE(fs::exists(dir / "plan" / file)) << file;
  std::ifstream in(dir / "plan" / "sweep.json");
  const nlohmann::json sweep = nlohmann::json::parse(in);
  EXPECT_EQ(sweep["points"].size(), 6u);
  if (std::system("python3 -c 'import xml.dom.minidom' >/dev/null 2>&1") == 0) {
    for (const char* file : {"sweep_memory.svg", "sweep_tokens_per_second.svg"}) {
      const std::string command = "python3 -c 'import sys, xml.dom.minidom; xml.dom.minidom.parse(sys.argv[1])' " +
                                  (dir / "plan" / file).string();
      EXPECT_EQ(std::system(command.c_str()), 0) << file;
    }
  }

  const Result measured = run_memtune("sweep --model tiny --vary batch --values 1 --seq 16 --attn flash --steps-per-point 1 "
                                      "--quiet --device cpu --metrics " + (dir / "m.jsonl").string() + " --out " +
                                      (dir / "measured").string());
  ASSERT_EQ(measured.exit_code, 0) << measured.output;
  std::ifstream measured_in(dir / "measured" / "sweep.json");
  const nlohmann::json point = nlohmann::json::parse(measured_in)["points"].at(0);
  EXPECT_TRUE(point["measured"].get<bool>());
  EXPECT_EQ(point["attn_implementation"], "flash");
  EXPECT_GT(point["tokens_per_second"].get<double>(), 0);
  const std::vector<nlohmann::json> records = read_jsonl(dir / "m.jsonl");
  ASSERT_EQ(records.size(), 2u);  // the step, then the point
  EXPECT_EQ(records[0]["event"], "step");
  EXPECT_EQ(records[1]["event"], "point");
}

TEST(CliReport, RerendersASavedLadderWithAPeer) {
  const fs::path dir = scratch_dir("report");
  ASSERT_EQ(run_memtune("ladder --model tiny --seq 16 --batch 1 --accum 1 --steps-per-rung 1 --quiet --device cpu --order "
                        "bf16,flash --out " + (dir / "ladder").string()).exit_code, 0);
  nlohmann::json peer = {{"peer", "transformers 4.46.0, peft 0.13.2, torch 2.5.1, bitsandbytes none"},
                         {"device", "cpu"}, {"date", "2025-01-02"}, {"config", nlohmann::json::object()},
                         {"rungs", nlohmann::json::array()}};
  for (const char* added : {"", "bf16", "flash"})
    peer["rungs"].push_back({{"name", std::string("hf ") + added}, {"added", added}, {"techniques", nlohmann::json::object()},
                             {"measured", true}, {"tokens_per_second", 1.0}, {"step_seconds", 10.0}, {"loss", 6.3},
                             {"peak_allocated_bytes", nullptr}, {"peak_reserved_bytes", nullptr},
                             {"device_peak_bytes", nullptr}, {"context_bytes", nullptr}});
  std::ofstream(dir / "peer.json") << peer.dump(1);
  const Result r = run_memtune("report --ladder " + (dir / "ladder" / "ladder.json").string() + " --peer " +
                               (dir / "peer.json").string() + " --out " + (dir / "out").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("peer tokens/s"), std::string::npos) << r.output;
  std::ifstream in(dir / "out" / "ladder.json");
  const nlohmann::json ladder = nlohmann::json::parse(in);
  EXPECT_EQ(ladder["peer"]["peer"], peer["peer"]);
  EXPECT_EQ(ladder["rungs"][2]["peer"]["name"], "hf flash");
  EXPECT_EQ(ladder["rungs"][2]["peer"]["beats_tokens_per_second"], true);  // 1 token/s is easy to beat
  for (const char* file : {"report.md", "ladder.csv", "ladder.svg"}) EXPECT_TRUE(fs::exists(dir / "out" / file)) << file;

  // Without --out the outputs go beside the ladder.json.
  EXPECT_EQ(run_memtune("report --ladder " + (dir / "out" / "ladder.json").string()).exit_code, 0);

  // A bad peer file is refused with the field, and before a ladder runs.
  peer["rungs"][1]["tokens_per_second"] = "fast";
  std::ofstream(dir / "bad_peer.json") << peer.dump(1);
  const Result bad = run_memtune("report --ladder " + (dir / "ladder" / "ladder.json").string() + " --peer " +
                                 (dir / "bad_peer.json").string());
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("tokens_per_second"), std::string::npos) << bad.output;
  const Result early = run_memtune("ladder --model tiny --device cpu --quiet --peer " + (dir / "bad_peer.json").string() +
                                   " --out " + (dir / "never").string());
  EXPECT_NE(early.exit_code, 0);
  EXPECT_NE(early.output.find("expected a number"), std::string::npos) << early.output;
  EXPECT_FALSE(fs::exists(dir / "never" / "ladder.json"));
}

TEST(CliTrain, MetricsFileGetsOneLinePerStep) {
  const fs::path dir = scratch_dir("train_metrics");
  const Result r = run_memtune("train --device cpu --max_steps 3 --seq 8 --quiet --metrics " + (dir / "m.jsonl").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<nlohmann::json> records = read_jsonl(dir / "m.jsonl");
  ASSERT_EQ(records.size(), 4u);  // three steps and the run's summary
  EXPECT_EQ(records.back()["event"], "summary");
  records.pop_back();
  for (size_t i = 0; i < records.size(); ++i) {
    EXPECT_EQ(records[i]["event"], "step");
    EXPECT_EQ(records[i]["command"], "train");
    EXPECT_EQ(records[i]["step"], i + 1);
    for (const char* key : {"loss", "step_seconds", "tokens", "tokens_per_second", "lr", "grad_norm"})
      EXPECT_TRUE(records[i].contains(key)) << key;
  }
  // Progress on stderr without --quiet: plain lines into a pipe.
  const Result loud = run_memtune("train --device cpu --max_steps 2 --seq 8");
  ASSERT_EQ(loud.exit_code, 0) << loud.output;
  EXPECT_NE(loud.output.find("train step 2/2"), std::string::npos) << loud.output;
}

TEST(CliErrors, SweepAndReportOptions) {
  const struct {
    std::string args, expected;
  } cases[] = {
      {"sweep --model tiny --vary heads --values 64 --plan-only", "--vary heads: expected seq or batch"},
      {"sweep --model tiny --vary seq --values 64,x --plan-only", "--values 64,x"},
      {"sweep --model tiny --vary seq --values 64 --attn magic --plan-only", "--attn magic"},
      {"sweep --model tiny --vary seq --plan-only", "--values"},
      {"report --ladder /nonexistent/ladder.json", "/nonexistent/ladder.json"},
      {"ladder --model tiny --order bf16,magic --quiet --device cpu", "unknown trick 'magic'"},
  };
  for (const auto& c : cases) {
    const Result r = run_memtune(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
  }
}

}  // namespace

// Real fine-tuning data: the three TRL forms, packing, eval, epochs, signals and failed saves.
namespace {



std::string write_lines(const fs::path& file, const std::vector<std::string>& lines) {
  std::ofstream out(file, std::ios::binary);
  for (const std::string& line : lines) out << line << "\n";
  return file.string();
}

std::vector<nlohmann::json> events_of(const std::vector<nlohmann::json>& records, const std::string& event) {
  std::vector<nlohmann::json> out;
  for (const nlohmann::json& r : records)
    if (r["event"] == event) out.push_back(r);
  return out;
}

std::string sft_text_file(const fs::path& dir) {
  return write_lines(dir / "text.jsonl", {R"({"text": "The quick brown fox jumps over the lazy dog again."})",
                                          R"({"text": "short one"})", R"({"text": "another line of text"})",
                                          R"({"text": "four"})", R"({"text": "five is here"})", R"({"text": "six"})",
                                          R"({"text": "seven"})", R"({"text": "eight lines"})"});
}

// Short samples without --packing: the run says, once, what --packing would give; with it, or
// with samples near max_seq_length, it says nothing.
TEST(CliTrain, ShortSamplesWithoutPackingGetANoteAboutPacking) {
  const fs::path dir = scratch_dir("train_packing_hint");
  const std::string chat = write_lines(
      dir / "chat.jsonl",
      {R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})",
       R"({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})"});
  const std::string note = "--packing would put about";
  const Result unpacked = run_memtune("train --device cpu --seq 1024 --batch 2 --max_steps 1 --quiet --data " + chat);
  ASSERT_EQ(unpacked.exit_code, 0) << unpacked.output;
  EXPECT_NE(unpacked.output.find("memtune: note: the samples average"), std::string::npos) << unpacked.output;
  EXPECT_NE(unpacked.output.find(note), std::string::npos) << unpacked.output;
  const Result packed = run_memtune("train --device cpu --seq 1024 --batch 2 --max_steps 1 --quiet --packing --data " + chat);
  ASSERT_EQ(packed.exit_code, 0) << packed.output;
  EXPECT_EQ(packed.output.find(note), std::string::npos) << packed.output;
  const Result long_enough = run_memtune("train --device cpu --seq 32 --batch 2 --max_steps 1 --quiet --data " + chat);
  ASSERT_EQ(long_enough.exit_code, 0) << long_enough.output;
  EXPECT_EQ(long_enough.output.find(note), std::string::npos) << long_enough.output;
}

// One-sample rows padded to the longest of their micro-batch never outgrow the data's longest
// sample: the engine is planned for that row length (a smaller plan, the same loss), and says so;
// the data position and the messages keep --max_seq_length. Packing and --padding max_length
// fill rows of max_seq_length, so their plan stays.
TEST(CliTrain, UnpackedShortSamplesPlanTheEngineForTheLongestRowOnly) {
  const fs::path dir = scratch_dir("train_planned_rows");
  const std::string chat = write_lines(
      dir / "chat.jsonl",
      {R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})",
       R"({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})",
       R"({"messages": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}]})",
       R"({"messages": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]})"});
  const auto run = [&](const std::string& name, const std::string& flags) {
    const fs::path metrics = dir / (name + ".metrics.jsonl");
    const Result r = run_memtune("train --device cpu --seq 512 --batch 2 --max_steps 2 --quiet --seed 3 --metrics " +
                                 metrics.string() + " " + flags + " --data " + chat);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return std::pair{r, read_jsonl(metrics)};
  };
  const auto [unpacked, unpacked_records] = run("unpacked", "");
  const auto [full_rows, full_records] = run("max_length", "--padding max_length");
  const auto [packed, packed_records] = run("packed", "--packing");
  const std::string note = "the engine is planned for rows of 64, not --max_seq_length 512";
  EXPECT_NE(unpacked.output.find(note), std::string::npos) << unpacked.output;
  EXPECT_EQ(full_rows.output.find("the engine is planned for rows"), std::string::npos) << full_rows.output;
  EXPECT_EQ(packed.output.find("the engine is planned for rows"), std::string::npos) << packed.output;
  const auto first_step = [](const std::vector<nlohmann::json>& records) {
    const std::vector<nlohmann::json> steps = events_of(records, "step");
    return steps.empty() ? nlohmann::json::object() : steps.front();
  };
  const nlohmann::json short_rows = first_step(unpacked_records), long_rows = first_step(full_records);
  ASSERT_TRUE(short_rows.contains("planned_peak_bytes") && long_rows.contains("planned_peak_bytes"));
  EXPECT_LT(short_rows["planned_peak_bytes"].get<uint64_t>(), long_rows["planned_peak_bytes"].get<uint64_t>());
  EXPECT_EQ(first_step(packed_records)["planned_peak_bytes"], long_rows["planned_peak_bytes"]);
  // The same rows train: padding has no target, so the losses are those of the full-row run.
  EXPECT_NEAR(short_rows["loss"].get<double>(), long_rows["loss"].get<double>(), 1e-4);
  const std::vector<nlohmann::json> data = events_of(unpacked_records, "data");
  ASSERT_EQ(data.size(), 1u);
  EXPECT_EQ(data[0]["max_seq_length"], 512);
}

// --merge_micro_batches (on by default): a step's micro-batches of short rows run as fewer inside
// the planned micro-batch (the metrics count them), and the losses are those of the unmerged run.
// With LoRA dropout the default leaves them apart (its masks are drawn per micro-batch).
TEST(CliTrain, MergedMicroBatchesTrainTheSameStepsInFewerPasses) {
  const fs::path dir = scratch_dir("train_merged_micro_batches");
  std::vector<std::string> lines = {R"({"text": ")" + std::string(90, 'a') + R"("})"};
  for (const char* word : {"one", "two", "three", "four", "five", "six", "seven"})
    lines.push_back(R"({"text": ")" + std::string(word) + R"("})");
  const std::string text = write_lines(dir / "text.jsonl", lines);
  const auto run = [&](const std::string& name, const std::string& flags) {
    const fs::path metrics = dir / (name + ".metrics.jsonl");
    const Result r = run_memtune("train --device cpu --seq 512 --batch 2 --accum 4 --pad_to_multiple_of 8 --max_steps 2 "
                                 "--quiet --seed 5 --metrics " + metrics.string() + " " + flags + " --data " + text);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return events_of(read_jsonl(metrics), "step");
  };
  const std::vector<nlohmann::json> plain = run("plain", "--merge_micro_batches false"), merged = run("merged", "");
  const std::vector<nlohmann::json> dropout = run("dropout", "--lora_dropout 0.1");
  ASSERT_EQ(dropout.size(), 2u);
  for (const nlohmann::json& step : dropout) EXPECT_EQ(step["micro_batches"], 4);
  ASSERT_EQ(plain.size(), 2u);
  ASSERT_EQ(merged.size(), 2u);
  for (size_t s = 0; s < plain.size(); ++s) {
    EXPECT_EQ(plain[s]["micro_batches"], 4);
    EXPECT_LT(merged[s]["micro_batches"].get<int>(), 4) << "step " << s;
    EXPECT_NEAR(merged[s]["loss"].get<double>(), plain[s]["loss"].get<double>(), 1e-5 * plain[s]["loss"].get<double>());
    EXPECT_EQ(merged[s]["tokens"], plain[s]["tokens"]);
    EXPECT_EQ(merged[s]["targets"], plain[s]["targets"]);
  }
}

TEST(CliTrain, EachSftFormTrainsPackedWithAnEvalSplitAndReportsItsData) {
  const fs::path dir = scratch_dir("train_sft_forms");
  const std::string text = sft_text_file(dir);
  const std::string prompt_completion = write_lines(
      dir / "pc.jsonl", {R"({"prompt": "2+2=", "completion": " 4"})", R"({"prompt": "3+1=", "completion": " 4"})",
                         R"({"prompt": "1+1=", "completion": " 2"})", R"({"prompt": "5+1=", "completion": " 6"})"});
  const std::string chat = write_lines(
      dir / "chat.jsonl",
      {R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})",
       R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}]})",
       R"({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})",
       R"({"messages": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]})"});
  for (const auto& [file, format] : {std::pair{text, "text"}, std::pair{prompt_completion, "prompt-completion"},
                                     std::pair{chat, "messages"}}) {
    const fs::path metrics = dir / (std::string(format) + ".metrics.jsonl");
    const Result r = run_memtune("train --device cpu --seq 64 --batch 2 --max_steps 3 --quiet --packing --eval_split 0.25 "
                                 "--eval_steps 2 --metrics " + metrics.string() + " --data " + file);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("data: " + file + ": "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("packed into"), std::string::npos) << r.output;
    const std::vector<nlohmann::json> records = read_jsonl(metrics);
    const std::vector<nlohmann::json> data = events_of(records, "data");
    ASSERT_EQ(data.size(), 2u) << format;
    EXPECT_EQ(data[0]["split"], "train");
    EXPECT_EQ(data[0]["format"], format);
    EXPECT_EQ(data[0]["packing"], true);
    EXPECT_EQ(data[1]["split"], "eval");
    EXPECT_EQ(data[0]["samples"].get<int>() + data[1]["samples"].get<int>(), format == std::string("text") ? 8 : 4);
    const std::vector<nlohmann::json> evals = events_of(records, "eval");
    ASSERT_EQ(evals.size(), 2u) << format;  // at step 2 and at the end
    EXPECT_EQ(evals[0]["step"], 2);
    EXPECT_EQ(evals[1]["step"], 3);
    EXPECT_GT(evals[1]["eval_loss"].get<double>(), 0.0);
    EXPECT_EQ(events_of(records, "step").size(), 3u);
  }
  // The long first text line: BOS + 50 bytes + EOS = 52 tokens, cut to 32.
  const Result truncated = run_memtune("train --device cpu --seq 32 --batch 2 --max_steps 1 --quiet --data " + text);
  ASSERT_EQ(truncated.exit_code, 0) << truncated.output;
  EXPECT_NE(truncated.output.find("1 truncated to max_seq_length 32 (20 tokens dropped)"), std::string::npos)
      << truncated.output;
  // --num_train_epochs: 8 rows in micro-batches of 2 are 4 steps an epoch.
  const fs::path epochs = dir / "epochs.jsonl";
  const Result two_epochs = run_memtune("train --device cpu --seq 32 --batch 2 --num_train_epochs 2 --quiet --metrics " +
                                        epochs.string() + " --data " + text);
  ASSERT_EQ(two_epochs.exit_code, 0) << two_epochs.output;
  const std::vector<nlohmann::json> steps = events_of(read_jsonl(epochs), "step");
  ASSERT_EQ(steps.size(), 8u);
  EXPECT_EQ(steps[3]["epoch"], 1);
  EXPECT_EQ(steps[7]["epoch"], 2);
}

TEST(CliErrors, BadTrainingDataGetsAClearMessageAndNonZeroExit) {
  const fs::path dir = scratch_dir("train_data_errors");
  const std::string text = sft_text_file(dir);
  const std::string mixed = write_lines(dir / "mixed.jsonl", {R"({"text": "a"})", R"({"prompt": "a", "completion": "b"})"});
  const std::string utf8 = write_lines(dir / "utf8.jsonl", {"{\"text\": \"caf\xC3\"}"});
  const std::string masked = write_lines(dir / "masked.jsonl", {R"({"messages": [{"role": "user", "content": "hi"}]})"});
  const std::string some_bad = write_lines(dir / "some_bad.jsonl", {R"({"text": "good"})", "{oops", R"({"text": "fine"})"});
  nlohmann::json config = memtune::read_json_file(memtune::test::source_path("configs/models/tiny.json"));
  config["vocab_size"] = 200;
  config["bos_token_id"] = 1;
  config["eos_token_id"] = 2;
  fs::create_directories(dir / "small_vocab");
  std::ofstream(dir / "small_vocab/config.json") << config.dump(2);
  const struct {
    std::string args, expected;
  } cases[] = {
      {"--data " + mixed, "mixed.jsonl:2: a {\"prompt\", \"completion\"} line, but line 1 made this a {\"text\"} dataset"},
      {"--on-bad-line skip --data " + mixed, "one file holds one form"},
      {"--data " + utf8, "utf8.jsonl:1: invalid UTF-8"},
      {"--data " + masked, "has all its labels masked"},
      {"--data " + some_bad, "some_bad.jsonl:2: not valid JSON"},
      {"--model " + (dir / "small_vocab").string() + " --data " + text, "but the model's vocab_size is 200"},
      {"--data " + text + " --eval_data " + text + " --eval_split 0.1", "--eval_data and --eval_split exclude each other"},
      {"--eval_split 0.1", "--eval_split splits --data"},
      {"--data " + text + " --eval_split 1.5", "--eval_split 1.5"},
      {"--data " + (dir / "absent.jsonl").string(), "absent.jsonl: No such file or directory"},
      {"--data " + text + " --padding_free", "--padding_free needs flash or cuDNN attention"},
      {"--data " + text + " --padding shortest", "--padding shortest: expected longest or max_length"},
      {"--data " + text + " --pad_to_multiple_of 0", "--pad_to_multiple_of 0"},
      {"--data " + text + " --attn_implementation flash --padding_free --padding max_length", "drop --padding max_length"},
  };
  for (const auto& c : cases) {
    const Result r = run_memtune("train --device cpu --max_steps 1 --seq 16 --quiet " + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
  }
  const Result skipped = run_memtune("train --device cpu --max_steps 1 --seq 16 --quiet --on-bad-line skip --data " + some_bad);
  EXPECT_EQ(skipped.exit_code, 0) << skipped.output;
  EXPECT_NE(skipped.output.find("1 bad line skipped (first: " + some_bad + ":2"), std::string::npos) << skipped.output;
}

TEST(CliTrain, TokenFiguresCountTheSamplesTokensBesideTheComputedSlots) {
  const fs::path dir = scratch_dir("train_token_figures");
  std::vector<std::string> lines;
  for (int i = 0; i < 12; ++i) lines.push_back(fmt::format(R"({{"text": "sample {} {}"}})", i, std::string(i * 3, 'x')));
  const std::string text = write_lines(dir / "text.jsonl", lines);
  // Two steps of 2 x 3 rows are the whole epoch of 12 samples: every mode trains the same
  // samples (--group_by_length in another order); only the shapes differ.
  std::map<std::string, nlohmann::json> summaries;
  for (const std::string mode : {"--padding max_length", "", "--group_by_length", "--attn_implementation flash --padding_free"}) {
    const fs::path metrics = dir / "metrics.jsonl";
    fs::remove(metrics);
    const Result r = run_memtune("train --device cpu --seq 64 --batch 3 --accum 2 --max_steps 2 --pad_to_multiple_of 8 --metrics " +
                                 metrics.string() + " --data " + text + " " + mode);
    ASSERT_EQ(r.exit_code, 0) << mode << "\n" << r.output;
    EXPECT_NE(r.output.find("tokens of samples"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("% of them padding"), std::string::npos) << r.output;
    const std::vector<nlohmann::json> records = read_jsonl(metrics);
    const std::vector<nlohmann::json> steps = events_of(records, "step");
    ASSERT_EQ(steps.size(), 2u);
    for (const nlohmann::json& step : steps) {
      EXPECT_LE(step["tokens"].get<int64_t>(), step["computed_tokens"].get<int64_t>()) << mode;
      EXPECT_LT(step["targets"].get<int64_t>(), step["tokens"].get<int64_t>()) << mode;
      EXPECT_GT(step["targets_per_second"].get<double>(), 0) << mode;
      EXPECT_NEAR(step["tokens_per_second"].get<double>(),
                  step["tokens"].get<double>() / step["step_seconds"].get<double>(), 1e-6 * step["tokens_per_second"].get<double>());
    }
    const std::vector<nlohmann::json> summary = events_of(records, "summary");
    ASSERT_EQ(summary.size(), 1u) << mode;
    summaries[mode] = summary[0];
  }
  const nlohmann::json& padded = summaries["--padding max_length"];
  EXPECT_EQ(padded["computed_tokens"], 2 * 2 * 3 * 64);  // every micro-batch at the planned shape
  for (const std::string mode : {"", "--group_by_length", "--attn_implementation flash --padding_free"}) {
    EXPECT_EQ(summaries[mode]["tokens"], padded["tokens"]) << mode;  // the same samples
    EXPECT_EQ(summaries[mode]["targets"], padded["targets"]) << mode;
    EXPECT_LT(summaries[mode]["computed_tokens"].get<int64_t>(), padded["computed_tokens"].get<int64_t>()) << mode;
  }
  EXPECT_GT(padded["padding_fraction"].get<double>(), summaries[""]["padding_fraction"].get<double>());
}

TEST(CliTrain, SigtermStopsAfterTheStepWithACheckpointAndResumeMatchesAStraightRun) {
  const fs::path dir = scratch_dir("train_sigterm");
  const std::string data = sft_text_file(dir);
  const std::string common = memtune_binary() + " train --device cpu --seq 16 --batch 2 --lora_dropout 0.1 --quiet --data " + data;
  const fs::path out = dir / "out", metrics = dir / "m.jsonl";
  // Far more steps than it gets to run: it is stopped as soon as its first step is logged.
  const Result stopped = run_shell(common + " --max_steps 1000000 --out " + out.string() + " --metrics " + metrics.string() +
                               " & pid=$!; i=0; while [ ! -s " + metrics.string() +
                               " ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; kill -TERM $pid; wait $pid; "
                               "echo \"exit=$?\"");
  ASSERT_NE(stopped.output.find("exit=143"), std::string::npos) << stopped.output;
  EXPECT_NE(stopped.output.find("SIGTERM after step"), std::string::npos) << stopped.output;
  // The one checkpoint the stopped run wrote, named by its step as transformers names it.
  std::vector<fs::path> checkpoints;
  for (const fs::directory_entry& entry : fs::directory_iterator(out))
    if (entry.path().filename().string().rfind("checkpoint-", 0) == 0) checkpoints.push_back(entry.path());
  ASSERT_EQ(checkpoints.size(), 1u) << stopped.output;
  const nlohmann::json state = nlohmann::json::parse(std::ifstream(checkpoints[0] / "trainer_state.json"));
  const int64_t k = state["step"].get<int64_t>();
  EXPECT_EQ(checkpoints[0].filename(), "checkpoint-" + std::to_string(k));
  EXPECT_NE(stopped.output.find("checkpoint written to " + checkpoints[0].string()), std::string::npos) << stopped.output;
  const std::vector<nlohmann::json> steps = events_of(read_jsonl(metrics), "step");
  ASSERT_GE(k, 1);
  EXPECT_EQ(static_cast<int64_t>(steps.size()), k) << "the checkpoint holds the last finished step";
  for (const char* key : {"epoch", "index", "shuffle_seed", "rows_per_epoch", "data_fingerprint"})
    EXPECT_TRUE(state["data_position"].contains(key)) << key;
  EXPECT_FALSE(fs::exists(checkpoints[0].string() + ".partial"));

  // --resume of the output folder takes its newest checkpoint.
  const fs::path resumed_metrics = dir / "resumed.jsonl";
  const Result resumed = run_shell(fmt::format("{} --max_steps {} --resume {} --out {} --metrics {}", common, k + 2,
                                           out.string(), out.string(), resumed_metrics.string()));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const std::vector<nlohmann::json> resumed_steps = events_of(read_jsonl(resumed_metrics), "step");
  ASSERT_EQ(resumed_steps.size(), 2u);
  EXPECT_EQ(resumed_steps[0]["step"], k + 1);
  const Result straight = run_shell(fmt::format("{} --max_steps {} --out {}", common, k + 2, (dir / "straight").string()));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  auto bytes_of = [](const fs::path& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string adapter = bytes_of(out / "adapter/adapter_model.safetensors");
  ASSERT_FALSE(adapter.empty());
  EXPECT_EQ(adapter, bytes_of(dir / "straight/adapter/adapter_model.safetensors")) << "resume is not bit-identical";
}

TEST(CliTrain, AFailedCheckpointWriteExitsNonZeroAndKeepsThePreviousCheckpoint) {
  const fs::path dir = scratch_dir("train_write_fails");
  const std::string data = sft_text_file(dir);
  const std::string common = memtune_binary() + " train --device cpu --seq 16 --batch 2 --quiet --data " + data;
  const fs::path out = dir / "out";
  ASSERT_EQ(run_shell(common + " --max_steps 2 --out " + out.string()).exit_code, 0);
  // A file-size limit (with SIGXFSZ ignored, so the write returns EFBIG) fails the next save
  // partway through the adapter file, as a full disk would.
  const Result r = run_shell("trap '' XFSZ; ulimit -f 64; " + common + " --max_steps 4 --save_steps 1 --resume " +
                         (out / "checkpoint-2").string() + " --out " + out.string());
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("saving the checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("File too large"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the checkpoint this run resumed from (" + (out / "checkpoint-2").string() + ", step 2) is kept"),
            std::string::npos) << r.output;
  const nlohmann::json state = nlohmann::json::parse(std::ifstream(out / "checkpoint-2/trainer_state.json"));
  EXPECT_EQ(state["step"], 2);
  EXPECT_FALSE(fs::exists(out / "checkpoint-3.partial"));
  EXPECT_FALSE(fs::exists(out / "checkpoint-3"));
  EXPECT_EQ(run_shell(common + " --max_steps 3 --resume " + out.string()).exit_code, 0);
}

}  // namespace

// One rank of several GPUs: the per-rank table, the budget check per rank, and the bad
// combinations refused with a message.
TEST(Cli, PlanOfOneRankWithAShardedBase) {
  const std::string run70b = "plan --model llama-3.1-70b --bf16 --load_in_4bit --attn_implementation flash "
                             "--gradient_checkpointing --loss_implementation chunked --offload_activations "
                             "--offload_embeddings --batch 1 --seq 2048 ";
  const Result ok = run_memtune(run70b + "--world_size 2 --shard_base --vram 24GiB");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("per-rank memory, 2 ranks (frozen base sharded"), std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("head is kept whole on every rank"), std::string::npos) << ok.output;
  const Result replicated = run_memtune(run70b + "--world_size 2 --vram 24GiB");
  EXPECT_NE(replicated.exit_code, 0) << "the whole 70B base on each rank fits 24 GiB?";
  EXPECT_NE(replicated.output.find("does not fit --vram 24GiB"), std::string::npos) << replicated.output;
  const Result no_world = run_memtune("plan --model tiny --shard_base");
  EXPECT_NE(no_world.exit_code, 0);
  EXPECT_NE(no_world.output.find("--shard_base needs --world_size"), std::string::npos) << no_world.output;
  EXPECT_NE(run_memtune("plan --model tiny --world_size 0").exit_code, 0);
}

// Several ranks, bad input: each refused with a message that names the rule, and a non-zero
// exit. The rules: --world_size is 1 or more; --shard_base needs 2 ranks or more (plan:
// --world_size; train: the launcher's WORLD_SIZE); train's --world_size, when given, equals the
// launcher's. And train under a launcher of 2 holds --vram against one rank's plan, the plan
// that `memtune plan --world_size 2` prints, before it allocates anything (on the CPU it would
// otherwise stop later, at "several processes need the CUDA backend").
TEST(Cli, SeveralRanksBadInputAndThePerRankBudget) {
  struct Case {
    std::string args, expected;
  };
  const std::string torchrun2 = "WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 ";
  const std::string train = "train --device cpu --model tiny --max_steps 1 --seq 16 --quiet ";
  const std::vector<Case> cases = {
      {"plan --model tiny --world_size 0", "--world_size 0: expected 1 or more ranks"},
      {"plan --model tiny --world_size -3", "--world_size -3: expected 1 or more ranks"},
      {"plan --model tiny --world_size 1 --shard_base", "--shard_base needs --world_size 2 or more"},
      {train + "--shard_base", "--shard_base needs 2 ranks or more, and the launcher started 1"},
      {train + "--world_size 2", "--world_size 2 disagrees with the launcher"},
      {train + "--world_size 0", "--world_size 0: expected 1 or more ranks"},
      {torchrun2 + memtune_binary() + " " + train + "--world_size 3", "--world_size 3 disagrees with the launcher"},
      {torchrun2 + memtune_binary() + " " + train + "--shard_base --vram 1MiB", "one rank of 2 does not fit --vram 1MiB"},
  };
  for (const Case& c : cases) {
    const bool shell = c.args.rfind("WORLD_SIZE=", 0) == 0;
    const Result r = shell ? run_shell(c.args) : run_memtune(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
  }

  // The figure train refuses with is the per-rank arena that plan prints.
  const Result planned = run_memtune("plan --model tiny --seq 16 --world_size 2 --shard_base");
  ASSERT_EQ(planned.exit_code, 0) << planned.output;
  const size_t row = planned.output.find("  arena");
  ASSERT_NE(row, std::string::npos) << planned.output;
  const std::string line = planned.output.substr(row, planned.output.find('\n', row) - row);
  const std::string per_rank = line.substr(line.rfind(' ', line.rfind(' ') - 1) + 1);  // "1.23 MiB"
  const Result refused = run_shell(torchrun2 + memtune_binary() + " " + train + "--shard_base --vram 1MiB");
  EXPECT_NE(refused.output.find("it plans " + per_rank + " per rank with the base sharded"), std::string::npos)
      << "plan says " << per_rank << "\n" << refused.output;
  EXPECT_EQ(refused.output.find("several processes need the CUDA backend"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("the plan of one rank of 2 needs"), std::string::npos) << refused.output;
  // Within the budget, train goes on to the communicator, which refuses CPU ranks.
  const Result fits = run_shell(torchrun2 + memtune_binary() + " " + train + "--shard_base --vram 24GiB");
  EXPECT_NE(fits.exit_code, 0);
  EXPECT_NE(fits.output.find("several processes need the CUDA backend"), std::string::npos) << fits.output;
}
