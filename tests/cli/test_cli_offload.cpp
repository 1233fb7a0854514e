// The command line of activation offload and of long contexts: --offload_activations (and its
// YAML key) in the plan, its refusal without checkpointing, in the ladder (the checkpointing
// rungs only), and fit --max-context.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <fstream>

#include "cli_test_util.h"

namespace {

using namespace memtune::clitest;
namespace fs = std::filesystem;

const char* kFullStack8b =
    "--model llama-3.1-8b --load_in_4bit --bf16 --gradient_checkpointing --attn_implementation flash "
    "--loss_implementation chunked --batch 1";

nlohmann::json plan_json_of(const std::string& args) {
  const Result r = run_memtune("plan --json " + args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // Past the model's positions a warning line comes first.
  return nlohmann::json::parse(r.output.substr(std::min(r.output.find('{'), r.output.size())));
}

TEST(CliOffload, NeedsGradientCheckpointing) {
  const Result r = run_memtune("plan --model tiny --offload_activations");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("offload_activations needs gradient_checkpointing"), std::string::npos) << r.output;
  const fs::path dir = scratch_dir("offload_yaml");
  std::ofstream(dir / "run.yaml") << "offload_activations: true\n";
  const Result from_yaml = run_memtune("plan --model tiny --config " + (dir / "run.yaml").string());
  EXPECT_NE(from_yaml.exit_code, 0);
  EXPECT_NE(from_yaml.output.find("needs gradient_checkpointing"), std::string::npos) << from_yaml.output;
  std::ofstream(dir / "run.yaml") << "offload_activations: true\ngradient_checkpointing: true\n";
  EXPECT_EQ(plan_json_of("--model tiny --config " + (dir / "run.yaml").string())["run"]["offload_activations"], true);
}

TEST(CliOffload, ThePlanShowsTheHostBytesAndTheDeviceSaving) {
  const nlohmann::json plain = plan_json_of(std::string(kFullStack8b) + " --seq 8192");
  const nlohmann::json offloaded = plan_json_of(std::string(kFullStack8b) + " --seq 8192 --offload_activations");
  EXPECT_EQ(plain["host_bytes"].get<uint64_t>(), 0u);
  // 31 of the 32 layer inputs, [8192, 4096] bf16 each, on the host.
  EXPECT_EQ(offloaded["host_bytes"].get<uint64_t>(), 31ull * 8192 * 4096 * 2);
  EXPECT_EQ(offloaded["host_categories"]["offloaded_activations"], offloaded["host_bytes"]);
  // On the device two slots replace 33 layer inputs (the saved activations at the peak).
  EXPECT_LT(offloaded["peak_bytes"].get<uint64_t>() + 25ull * 8192 * 4096 * 2, plain["peak_bytes"].get<uint64_t>());
  const Result text = run_memtune("plan " + std::string(kFullStack8b) + " --seq 8192 --offload_activations");
  EXPECT_NE(text.output.find("offloaded activations"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("checkpointing on + offload"), std::string::npos) << text.output;
}

TEST(CliOffload, Llama8bQloraAt128kFits24GiBOnlyWithOffload) {
  const std::string at_128k = std::string(kFullStack8b) + " --seq 131072";
  const uint64_t context = 512ull << 20, budget = 24ull << 30;
  const nlohmann::json plain = plan_json_of(at_128k);
  const nlohmann::json offloaded = plan_json_of(at_128k + " --offload_activations");
  EXPECT_GT(plain["peak_bytes"].get<uint64_t>() + context, budget);
  EXPECT_LT(offloaded["peak_bytes"].get<uint64_t>() + context, budget);
  EXPECT_EQ(run_memtune("plan " + at_128k + " --offload_activations --vram 24GiB").exit_code, 0);
}

TEST(CliFit, MaxContextWithAndWithoutOffload) {
  // A budget that is exactly the plan of the tiny model's full stack at seq 1024 without offload.
  const std::string stack = "--model tiny --load_in_4bit --bf16 --gradient_checkpointing --attn_implementation flash "
                            "--loss_implementation chunked --batch 1";
  const uint64_t budget = plan_json_of(stack + " --seq 1024")["peak_bytes"].get<uint64_t>();
  const Result r = run_memtune(fmt::format("fit --model tiny --vram {} --context 0 --max-context --json "
                                           "--host_memory none", budget));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json fit = nlohmann::json::parse(r.output);
  const int64_t without = fit["without_offload"]["seq"].get<int64_t>();
  const int64_t with = fit["with_offload"]["seq"].get<int64_t>();
  EXPECT_GE(without, 1024);
  EXPECT_LT(without, 2048);  // the model's limit does not fit
  EXPECT_GT(with, without);
  EXPECT_LE(fit["without_offload"]["planned_bytes"].get<uint64_t>(), budget);
  EXPECT_LE(fit["with_offload"]["planned_bytes"].get<uint64_t>(), budget);
  EXPECT_GT(fit["with_offload"]["host_bytes"].get<uint64_t>(), 0u);
  // One more step of tokens does not fit: the search found the longest.
  const nlohmann::json longer = plan_json_of(stack + fmt::format(" --seq {}", without + 256));
  EXPECT_GT(longer["peak_bytes"].get<uint64_t>(), budget);
  const Result text = run_memtune(fmt::format("fit --model tiny --vram {} --context 0 --max-context", budget));
  EXPECT_NE(text.output.find("without offload"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("with --offload_activations"), std::string::npos) << text.output;
  // Nothing fits: a clear error and a non-zero exit.
  const Result none = run_memtune("fit --model llama-3.1-8b --vram 2GiB --max-context");
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.output.find("nothing fits"), std::string::npos) << none.output;
  EXPECT_NE(none.output.find("no context of 256 tokens"), std::string::npos) << none.output;
}

// Offloaded activations live in pinned host memory: under --host_memory the longest context with
// offload is the longest whose pinned bytes fit it too, and the answer says that the host, not the
// device, stopped it. Without offload the host limit changes nothing here.
TEST(CliFit, MaxContextWithOffloadStaysInsideTheHostMemory) {
  const std::string fit = "fit --model tiny --vram 8GiB --context 0 --max-context --json";
  const Result unlimited = run_memtune(fit + " --host_memory none");
  ASSERT_EQ(unlimited.exit_code, 0) << unlimited.output;
  const nlohmann::json free_host = nlohmann::json::parse(unlimited.output);
  const uint64_t host_budget = free_host["with_offload"]["host_bytes"].get<uint64_t>() / 2;
  ASSERT_GT(host_budget, 0u);
  EXPECT_EQ(free_host["host_budget_bytes"], 0);
  EXPECT_EQ(free_host["with_offload"]["limited_by_host"], false);

  const Result limited = run_memtune(fit + fmt::format(" --host_memory {}", host_budget));
  ASSERT_EQ(limited.exit_code, 0) << limited.output;
  const nlohmann::json half = nlohmann::json::parse(limited.output);
  EXPECT_EQ(half["host_budget_bytes"], host_budget);
  EXPECT_LT(half["with_offload"]["seq"].get<int64_t>(), free_host["with_offload"]["seq"].get<int64_t>());
  EXPECT_GT(half["with_offload"]["seq"].get<int64_t>(), 0);
  EXPECT_LE(half["with_offload"]["host_bytes"].get<uint64_t>(), host_budget);
  EXPECT_EQ(half["with_offload"]["limited_by_host"], true);
  EXPECT_EQ(half["without_offload"]["seq"], free_host["without_offload"]["seq"]);
  // One more step of tokens with offload takes more pinned memory than the budget.
  const nlohmann::json longer = plan_json_of(
      "--model tiny --load_in_4bit --bf16 --gradient_checkpointing --attn_implementation flash --loss_implementation "
      "chunked --mlp_chunk_tokens 1024 --batch 1 --offload_activations" +
      fmt::format(" --seq {}", half["with_offload"]["seq"].get<int64_t>() + 256));
  EXPECT_GT(longer["host_bytes"].get<uint64_t>(), host_budget) << longer.dump();
  const Result text = run_memtune(fmt::format("fit --model tiny --vram 8GiB --context 0 --max-context --host_memory {}",
                                              host_budget));
  EXPECT_NE(text.output.find("host memory, not the device, limits it"), std::string::npos) << text.output;
  // A budget that is not a size is refused.
  const Result bad = run_memtune("fit --model tiny --vram 8GiB --max-context --host_memory lots");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("'lots' is not a byte count"), std::string::npos) << bad.output;
  const Result zero = run_memtune("fit --model tiny --vram 8GiB --host_memory 0");
  EXPECT_NE(zero.exit_code, 0);
  EXPECT_NE(zero.output.find("--host_memory 0: expected auto, none or a positive size"), std::string::npos) << zero.output;
}

// fit's offload candidate pins host memory: on a host that cannot hold it the candidate does not
// fit, and the answer says why and what would.
TEST(CliFit, TheOffloadCandidateMustFitTheHostsMemory) {
  // A budget that is the tiny model's full stack at seq 1024 without offload: at 2048 tokens only
  // the offload candidate fits it.
  const uint64_t budget = plan_json_of("--model tiny --load_in_4bit --bf16 --gradient_checkpointing --attn_implementation "
                                       "flash --loss_implementation chunked --batch 1 --seq 1024")["peak_bytes"].get<uint64_t>();
  const std::string fit = fmt::format("fit --model tiny --vram {} --context 0 --seq 2048 --batch 1 --accum 1 --json", budget);
  const Result roomy = run_memtune(fit + " --host_memory none");
  ASSERT_EQ(roomy.exit_code, 0) << roomy.output;
  const nlohmann::json fitted = nlohmann::json::parse(roomy.output);
  EXPECT_NE(fitted["options"].get<std::string>().find("--offload_activations"), std::string::npos) << roomy.output;
  const uint64_t pinned = fitted["plan"]["host_bytes"].get<uint64_t>();
  ASSERT_GT(pinned, 0u);

  const Result small_host = run_memtune(fit + fmt::format(" --host_memory {}", pinned - 1));
  EXPECT_EQ(small_host.exit_code, 3) << small_host.output;
  const nlohmann::json refused = nlohmann::json::parse(small_host.output);
  EXPECT_EQ(refused["fits"], false);
  EXPECT_EQ(refused["host_budget_bytes"], pinned - 1);
  const std::string why = refused["explanation"].get<std::string>();
  EXPECT_NE(why.find("does not fit the host's"), std::string::npos) << why;
  EXPECT_NE(why.find("more host memory"), std::string::npos) << why;
  // Exactly enough host memory: it fits again.
  EXPECT_EQ(run_memtune(fit + fmt::format(" --host_memory {}", pinned)).exit_code, 0);
}

// In a ladder, --offload_activations applies to the rungs that checkpoint, not to the baseline
// (which would refuse it), and the rungs' techniques say so.
TEST(CliOffload, TheLadderOffloadsTheCheckpointingRungsOnly) {
  const fs::path dir = scratch_dir("offload_ladder");
  const Result r = run_memtune("ladder --model tiny --seq 16 --batch 1 --accum 1 --steps-per-rung 1 --quiet --device cpu "
                               "--order bf16,gradient_checkpointing --offload_activations --out " + dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "ladder.json");
  const nlohmann::json ladder = nlohmann::json::parse(in);
  const nlohmann::json& rungs = ladder["rungs"];
  ASSERT_EQ(rungs.size(), 3u);
  const auto techniques = [&](size_t i) { return rungs[i]["techniques"].get<std::vector<std::string>>(); };
  for (size_t i : {0u, 1u}) {
    EXPECT_EQ(techniques(i)[2], "no-checkpointing") << i;
    EXPECT_EQ(rungs[i]["planned"]["saved_activations"], rungs[0]["planned"]["saved_activations"]);
  }
  EXPECT_EQ(techniques(2)[2], "checkpointing+offload");
  EXPECT_TRUE(rungs[2]["measured"].get<bool>());
  // The offloaded checkpoints leave the device: fewer saved bytes than checkpointing alone plans.
  const nlohmann::json alone = plan_json_of("--model tiny --seq 16 --batch 1 --bf16 --gradient_checkpointing");
  const nlohmann::json offloaded = plan_json_of("--model tiny --seq 16 --batch 1 --bf16 --gradient_checkpointing --offload_activations");
  const auto saved = [](const nlohmann::json& plan) { return plan["categories"]["saved_activations"].get<uint64_t>(); };
  EXPECT_LT(saved(offloaded), saved(alone));
  EXPECT_EQ(rungs[2]["planned"]["saved_activations"].get<uint64_t>(), saved(offloaded));
}

}  // namespace

// --stream_layers: the streamed layers are host memory in the plan (their own JSON key and text
// line), the device saving is (streamed - 2) layers, and fit streams the fewest layers that fit as
// its last resort: Llama 3.1 70B in 4 bits does not fit 24 GiB whole, and does with some layers
// in host memory; one layer fewer does not.
TEST(CliStreamLayers, ThePlanAndFitStreamLayersFromHostMemory) {
  const std::string lora16 = "--model llama-3.1-8b --bf16 --gradient_checkpointing --attn_implementation flash "
                             "--loss_implementation chunked --batch 2 --seq 2048";
  const nlohmann::json resident = plan_json_of(lora16);
  const nlohmann::json streamed = plan_json_of(lora16 + " --stream_layers 6");
  // A Llama 3.1 8B layer in bf16: q, o 4096 x 4096; k, v 1024 x 4096; gate, up, down 14336 x 4096;
  // two norms of 4096.
  const uint64_t layer = (2ull * 4096 * 4096 + 2ull * 1024 * 4096 + 3ull * 14336 * 4096 + 2 * 4096) * 2;
  EXPECT_EQ(streamed["host_categories"]["streamed_layers"].get<uint64_t>(), 6 * layer);
  EXPECT_EQ(streamed["run"]["stream_layers"], 6);
  EXPECT_EQ(resident["peak_bytes"].get<uint64_t>() - streamed["peak_bytes"].get<uint64_t>(), 4 * layer);
  const Result text = run_memtune("plan " + lora16 + " --stream_layers 5");
  EXPECT_NE(text.output.find("copied in before each use: layers 3, 9, 16, 22, 28 of 0-31"), std::string::npos)
      << text.output;
  const Result too_many = run_memtune("plan " + lora16 + " --stream_layers 32");
  EXPECT_NE(too_many.exit_code, 0);
  EXPECT_NE(too_many.output.find("--stream_layers 32 of 32 decoder layers"), std::string::npos) << too_many.output;

  const Result fit = run_memtune("fit --model llama-3.1-70b --seq 2048 --vram 24GiB --json");
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  const nlohmann::json fitted = nlohmann::json::parse(fit.output);
  const int64_t layers = fitted["plan"]["run"]["stream_layers"].get<int64_t>();
  ASSERT_GT(layers, 2) << fit.output;
  EXPECT_LT(layers, 80);
  EXPECT_LE(fitted["with_context_bytes"].get<uint64_t>(), fitted["budget_bytes"].get<uint64_t>());
  const std::string options = fitted["options"].get<std::string>();
  EXPECT_NE(options.find(fmt::format("--stream_layers {}", layers)), std::string::npos) << options;
  // One layer fewer: over the budget (the plan of the same options, checked by plan --vram).
  std::string fewer = options;
  fewer.replace(fewer.find(fmt::format("--stream_layers {}", layers)), fmt::format("--stream_layers {}", layers).size(),
                fmt::format("--stream_layers {}", layers - 1));
  EXPECT_NE(run_memtune("plan --model llama-3.1-70b --seq 2048 --vram 24GiB " + fewer).exit_code, 0);
  EXPECT_EQ(run_memtune("plan --model llama-3.1-70b --seq 2048 --vram 24GiB " + options).exit_code, 0);
}
