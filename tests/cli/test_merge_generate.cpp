// memtune merge / generate / logits, run as a user runs them, on the golden fixture models
// (tests/fixtures/golden): the merged weights against W + scale * B @ A computed here in double,
// the sharded layout (index, shards, metadata) read back through the C++ safetensors reader, the
// merged model's logits against base + adapter, a bitsandbytes 4-bit base, atomic replacement of
// the output folder, greedy generation against transformers (tests/fixtures/generate), and the
// example run YAMLs and dataset.
#include <gtest/gtest.h>

#include "cli_test_util.h"
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "memtune/io/safetensors.h"
#include "memtune/model/llama_config.h"
#include "memtune/model/param_table.h"
#include "memtune/quant/bnb_format.h"
#include "memtune/quant/nf4.h"

namespace fs = std::filesystem;
using namespace memtune;

namespace {

using namespace memtune::clitest;




fs::path example(const std::string& name) { return memtune::test::source_path("examples/" + name); }


std::vector<float> floats(const SafetensorsTensor& t) {
  std::vector<float> out(static_cast<size_t>(t.shape.numel()));
  std::vector<uint8_t> bytes(t.data, t.data + t.nbytes);
  for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_f32(bytes.data(), t.dtype, static_cast<int64_t>(i));
  return out;
}

// W + scale * B @ A in double, for every parameter of the fixture (identity where no adapter).
std::map<std::string, std::vector<double>> expected_merge(const std::string& name) {
  const LlamaConfig config = LlamaConfig::from_file(golden(name) / "config.json");
  const SafetensorsFile base = SafetensorsFile::open(golden(name) / "model.safetensors");
  const SafetensorsFile adapter = SafetensorsFile::open(golden(name) / "adapter/adapter_model.safetensors");
  const nlohmann::json adapter_config = read_json_file(golden(name) / "adapter/adapter_config.json");
  const double scale = adapter_config["lora_alpha"].get<double>() / adapter_config["r"].get<double>();
  std::map<std::string, std::vector<double>> out;
  for (const ParamSpec& spec : base_parameter_table(config)) {
    const std::vector<float> w = floats(base.get(spec.hf_key));
    std::vector<double> merged(w.begin(), w.end());
    if (spec.kind == ParamKind::linear) {
      const std::string prefix = "base_model.model." + spec.hf_key.substr(0, spec.hf_key.size() - 7);
      const std::vector<float> a = floats(adapter.get(prefix + ".lora_A.weight"));
      const std::vector<float> b = floats(adapter.get(prefix + ".lora_B.weight"));
      const int64_t rows = spec.shape[0], cols = spec.shape[1], r = static_cast<int64_t>(a.size()) / cols;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          double delta = 0;
          for (int64_t k = 0; k < r; ++k) delta += double(b[i * r + k]) * a[k * cols + j];
          merged[i * cols + j] += scale * delta;
        }
    }
    out[spec.hf_key] = std::move(merged);
  }
  return out;
}

std::vector<float> logits_of(const fs::path& file) {
  const SafetensorsFile f = SafetensorsFile::open(file);
  return floats(f.get("logits"));
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::abs(double(a[i]) - b[i]));
  return worst;
}

const std::string kIds = "1,40,7,255,3,18,99,120,61,2,44,5,230,17";

TEST(CliMerge, ShardedMergedWeightsEqualBasePlusScaledDelta) {
  const fs::path dir = scratch_dir("merge_sharded");
  const fs::path out = dir / "merged";
  // 500 kB of fp32 weights in 200 kB shards: several shards and an index.
  const Result r = run_memtune("merge --model " + golden("gqa_rope").string() + " --adapter " +
                               (golden("gqa_rope") / "adapter").string() + " --out " + out.string() +
                               " --max_shard_size 200KB");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("14 merged projections"), std::string::npos) << r.output;

  // The index: every parameter once, shards that exist and hold exactly what the map says.
  const nlohmann::json index = read_json_file(out / "model.safetensors.index.json");
  const nlohmann::json& weight_map = index["weight_map"];
  const LlamaConfig config = LlamaConfig::from_file(golden("gqa_rope") / "config.json");
  const std::vector<ParamSpec> table = base_parameter_table(config);
  ASSERT_EQ(weight_map.size(), table.size());
  std::map<std::string, std::set<std::string>> by_shard;
  for (const auto& [key, shard] : weight_map.items()) by_shard[shard.get<std::string>()].insert(key);
  EXPECT_GE(by_shard.size(), 3u);
  uint64_t total = 0;
  for (const auto& [shard, keys] : by_shard) {
    EXPECT_NE(shard.find(fmt::format("-of-{:05d}.safetensors", by_shard.size())), std::string::npos) << shard;
    const SafetensorsFile file = SafetensorsFile::open(out / shard);
    EXPECT_EQ(file.metadata().at("format"), "pt");
    std::set<std::string> held;
    for (const SafetensorsTensor& t : file.tensors()) held.insert(t.name), total += t.nbytes;
    EXPECT_EQ(held, keys) << shard;
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_FALSE(fs::exists(out / "model.safetensors"));
  EXPECT_EQ(read_json_file(out / "config.json")["dtype"], "float32");
  EXPECT_TRUE(fs::exists(out / "generation_config.json"));

  // The values, through the reader transformers-style loading uses (the directory's index).
  const SafetensorsCheckpoint merged = SafetensorsCheckpoint::open(out);
  const auto expected = expected_merge("gqa_rope");
  for (const ParamSpec& spec : table) {
    const SafetensorsTensor& t = expect_tensor(merged, spec.hf_key, DType::f32, spec.shape);
    const std::vector<float> got = floats(t);
    const std::vector<double>& want = expected.at(spec.hf_key);
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / (1 + std::abs(want[i])));
    EXPECT_LT(worst, spec.kind == ParamKind::linear ? 1e-6 : 0.0 + 1e-12) << spec.hf_key;
  }
  // The merged model alone gives the logits of the base with the adapter applied unmerged.
  ASSERT_EQ(run_memtune("logits --device cpu --model " + golden("gqa_rope").string() + " --adapter " +
                        (golden("gqa_rope") / "adapter").string() + " --input-ids " + kIds + " --out " +
                        (dir / "adapter.safetensors").string()).exit_code, 0);
  ASSERT_EQ(run_memtune("logits --device cpu --model " + out.string() + " --input-ids " + kIds + " --out " +
                        (dir / "merged.safetensors").string()).exit_code, 0);
  EXPECT_LT(max_abs_diff(logits_of(dir / "merged.safetensors"), logits_of(dir / "adapter.safetensors")), 1e-4);
}

// Qwen2 (q/k/v biases, tied embeddings), Qwen3 (per-head q/k norms) and Mistral (explicit
// head_dim): the merged checkpoint is base + scale * B A on the projections and the base itself
// everywhere else (biases and head norms included), keeps its model_type, and alone gives the
// logits of the base with the adapter applied.
TEST(CliMerge, EveryFamilyMergesItsProjectionsAndKeepsItsOwnParts) {
  for (const char* name : {"qwen2_bias", "qwen3_qk_norm", "mistral_head_dim"}) {
    SCOPED_TRACE(name);
    const fs::path dir = scratch_dir(std::string("merge_family_") + name), out = dir / "merged";
    const Result r = run_memtune("merge --model " + golden(name).string() + " --adapter " +
                                 (golden(name) / "adapter").string() + " --out " + out.string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const LlamaConfig config = LlamaConfig::from_file(golden(name) / "config.json");
    const LlamaConfig merged_config = LlamaConfig::from_file(out / "config.json");
    EXPECT_EQ(merged_config.family, config.family);
    EXPECT_EQ(merged_config.to_json(), config.to_json());
    const SafetensorsCheckpoint merged = SafetensorsCheckpoint::open(out);
    const auto expected = expected_merge(name);
    for (const ParamSpec& spec : base_parameter_table(config)) {
      const std::vector<float> got = floats(expect_tensor(merged, spec.hf_key, DType::f32, spec.shape));
      const std::vector<double>& want = expected.at(spec.hf_key);
      double worst = 0;
      for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / (1 + std::abs(want[i])));
      EXPECT_LT(worst, spec.kind == ParamKind::linear ? 1e-6 : 1e-12) << spec.hf_key;
    }
    std::string ids;  // kIds' tokens within this fixture's vocabulary
    for (int id : {1, 40, 7, 255, 3, 18, 99, 120, 61, 2, 44, 5, 230, 17})
      ids += (ids.empty() ? "" : ",") + std::to_string(id % config.vocab_size);
    ASSERT_EQ(run_memtune("logits --device cpu --model " + golden(name).string() + " --adapter " +
                          (golden(name) / "adapter").string() + " --input-ids " + ids + " --out " +
                          (dir / "adapter.safetensors").string()).exit_code, 0);
    ASSERT_EQ(run_memtune("logits --device cpu --model " + out.string() + " --input-ids " + ids + " --out " +
                          (dir / "merged.safetensors").string()).exit_code, 0);
    EXPECT_LT(max_abs_diff(logits_of(dir / "merged.safetensors"), logits_of(dir / "adapter.safetensors")), 1e-4);
  }
}

TEST(CliMerge, Bf16OutputOfATiedModelInOneFile) {
  const fs::path out = scratch_dir("merge_bf16") / "merged";
  const Result r = run_memtune("merge --model " + golden("tied_odd").string() + " --adapter " +
                               (golden("tied_odd") / "adapter").string() + " --out " + out.string() + " --dtype bf16");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_EQ(read_json_file(out / "config.json")["dtype"], "bfloat16");
  const SafetensorsFile merged = SafetensorsFile::open(out / "model.safetensors");
  EXPECT_EQ(merged.find("lm_head.weight"), nullptr);  // tied: the head is the embedding
  const auto expected = expected_merge("tied_odd");
  int64_t elements = 0, exact = 0;
  for (const auto& [key, want] : expected) {
    const SafetensorsTensor& t = merged.get(key);
    ASSERT_EQ(t.dtype, DType::bf16) << key;
    const std::vector<float> got = floats(t);
    for (size_t i = 0; i < got.size(); ++i) {
      // Rounded once from the fp32 sum: the double-precision value rounded to bf16, or (when the
      // fp32 sum sits next to a rounding boundary) one bf16 step away.
      const float rounded = round_to_dtype(static_cast<float>(want[i]), DType::bf16);
      ASSERT_LE(std::abs(got[i] - rounded), std::abs(rounded) * 0x1p-7 + 1e-30) << key << "[" << i << "]";
      exact += got[i] == rounded;
      ++elements;
    }
  }
  EXPECT_GT(exact, elements * 99 / 100);
}

TEST(CliMerge, FailureLeavesAnExistingOutputIntactAndSuccessReplacesIt) {
  const fs::path dir = scratch_dir("merge_atomic");
  const fs::path out = dir / "merged";
  fs::create_directories(out);
  std::ofstream(out / "config.json") << "{\"old\": true}\n";
  std::ofstream(out / "sentinel.txt") << "from the previous merge\n";
  // An adapter whose config does not match its tensors (r 5 instead of 4).
  fs::create_directories(dir / "bad_adapter");
  nlohmann::json config = read_json_file(golden("gqa_rope") / "adapter/adapter_config.json");
  config["r"] = 5;
  std::ofstream(dir / "bad_adapter/adapter_config.json") << config.dump(2);
  fs::copy_file(golden("gqa_rope") / "adapter/adapter_model.safetensors", dir / "bad_adapter/adapter_model.safetensors");
  const Result bad = run_memtune("merge --model " + golden("gqa_rope").string() + " --adapter " +
                                 (dir / "bad_adapter").string() + " --out " + out.string());
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("shape"), std::string::npos) << bad.output;
  EXPECT_TRUE(fs::exists(out / "sentinel.txt"));
  EXPECT_EQ(read_json_file(out / "config.json")["old"], true);
  for (const auto& entry : fs::directory_iterator(dir))  // no staging folder left behind
    EXPECT_EQ(entry.path().filename().string().find(".merge-"), std::string::npos) << entry.path();

  const Result good = run_memtune("merge --model " + golden("gqa_rope").string() + " --adapter " +
                                  (golden("gqa_rope") / "adapter").string() + " --out " + out.string());
  ASSERT_EQ(good.exit_code, 0) << good.output;
  EXPECT_FALSE(fs::exists(out / "sentinel.txt"));
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));

  // A folder that is not a model is not replaced; an adapter memtune cannot apply is refused.
  fs::create_directories(dir / "papers");
  std::ofstream(dir / "papers/thesis.tex") << "\\documentclass{article}\n";
  const Result refused = run_memtune("merge --model " + golden("gqa_rope").string() + " --adapter " +
                                     (golden("gqa_rope") / "adapter").string() + " --out " + (dir / "papers").string());
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("refusing to replace it"), std::string::npos) << refused.output;
  config["r"] = 4;
  config["use_dora"] = true;
  std::ofstream(dir / "bad_adapter/adapter_config.json") << config.dump(2);
  const Result dora = run_memtune("merge --model " + golden("gqa_rope").string() + " --adapter " +
                                  (dir / "bad_adapter").string() + " --out " + (dir / "dora").string());
  EXPECT_NE(dora.exit_code, 0);
  EXPECT_NE(dora.output.find("use_dora"), std::string::npos) << dora.output;
}

// gqa_rope with its projections saved as bitsandbytes writes them (nf4, double quant).
fs::path write_4bit_fixture(const fs::path& dir, std::map<std::string, std::vector<float>>& dequantized) {
  const LlamaConfig config = LlamaConfig::from_file(golden("gqa_rope") / "config.json");
  const SafetensorsFile base = SafetensorsFile::open(golden("gqa_rope") / "model.safetensors");
  QuantConfig quant;  // nf4, blocksize 64, double quant
  std::vector<NamedArray> arrays;
  for (const ParamSpec& spec : base_parameter_table(config)) {
    const std::vector<float> w = floats(base.get(spec.hf_key));
    if (spec.kind != ParamKind::linear) {
      NamedArray dense{spec.hf_key, DType::f32, spec.shape, std::vector<uint8_t>(w.size() * 4)};
      std::memcpy(dense.bytes.data(), w.data(), dense.bytes.size());
      arrays.push_back(std::move(dense));
      continue;
    }
    const QuantizedWeight q = quantize_4bit(w.data(), DType::f32, spec.shape, quant, spec.hf_key);
    std::vector<float>& values = dequantized[spec.hf_key];
    values.resize(w.size());
    dequantize_4bit(q, values.data(), DType::f32);
    for (NamedArray& a : to_bnb_arrays(q, spec.hf_key.substr(0, spec.hf_key.size() - 7))) arrays.push_back(std::move(a));
  }
  std::vector<SafetensorsWriteEntry> entries;
  for (const NamedArray& a : arrays) entries.push_back({a.name, a.dtype, a.shape, a.bytes.data()});
  const fs::path folder = dir / "gqa_rope_4bit";
  fs::create_directories(folder);
  write_safetensors(folder / "model.safetensors", entries, {{"format", "pt"}});
  nlohmann::json config_json = read_json_file(golden("gqa_rope") / "config.json");
  config_json["quantization_config"] = quantization_config_json(quant, DType::f32);
  std::ofstream(folder / "config.json") << config_json.dump(2);
  return folder;
}

TEST(CliMerge, DequantizesABitsandbytes4bitBase) {
  const fs::path dir = scratch_dir("merge_4bit");
  std::map<std::string, std::vector<float>> dequantized;
  const fs::path base = write_4bit_fixture(dir, dequantized);
  const fs::path out = dir / "merged";
  const Result r = run_memtune("merge --model " + base.string() + " --adapter " + (golden("gqa_rope") / "adapter").string() +
                               " --out " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("dequantized"), std::string::npos) << r.output;
  const nlohmann::json config = read_json_file(out / "config.json");
  EXPECT_FALSE(config.contains("quantization_config"));
  EXPECT_EQ(config["dtype"], "float32");
  // Merged = dequantized W + (the fp32 merge's delta, which is merged - W for the dense base).
  const auto dense_merge = expected_merge("gqa_rope");
  const SafetensorsFile base_file = SafetensorsFile::open(golden("gqa_rope") / "model.safetensors");
  const SafetensorsFile merged = SafetensorsFile::open(out / "model.safetensors");
  for (const auto& [key, values] : dequantized) {
    const std::vector<float> got = floats(merged.get(key));
    const std::vector<float> w = floats(base_file.get(key));
    const std::vector<double>& dense = dense_merge.at(key);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], values[i] + (dense[i] - w[i]), 1e-6 * (1 + std::abs(values[i]))) << key << "[" << i << "]";
  }
  // Inference reads the 4-bit checkpoint (dequantized on load) and equals the fp32 checkpoint
  // quantized on load the same way (--load_in_4bit).
  ASSERT_EQ(run_memtune("logits --device cpu --model " + base.string() + " --input-ids " + kIds + " --out " +
                        (dir / "from_4bit_checkpoint.safetensors").string()).exit_code, 0);
  const Result quantized = run_memtune("logits --device cpu --load_in_4bit --model " + golden("gqa_rope").string() +
                                       " --input-ids " + kIds + " --out " + (dir / "quantized_on_load.safetensors").string());
  ASSERT_EQ(quantized.exit_code, 0) << quantized.output;
  EXPECT_LT(max_abs_diff(logits_of(dir / "from_4bit_checkpoint.safetensors"),
                         logits_of(dir / "quantized_on_load.safetensors")), 1e-5);
}

// QLoRA checkpoints of the other families: `memtune quantize` writes the bitsandbytes folder (the
// projections in nf4; Qwen2's biases and Qwen3's head norms as they were), inference from it
// equals the dense fixture quantized on load, and training starts from it.
TEST(CliQuantize, EveryFamilyRoundTripsThroughABitsandbytesFolder) {
  for (const char* name : {"qwen2_bias", "qwen3_qk_norm", "mistral_head_dim"}) {
    SCOPED_TRACE(name);
    const fs::path dir = scratch_dir(std::string("quantize_family_") + name), out = dir / "4bit";
    const Result q = run_memtune("quantize --model " + golden(name).string() + " --out " + out.string());
    ASSERT_EQ(q.exit_code, 0) << q.output;
    EXPECT_NE(q.output.find("14 projections in nf4"), std::string::npos) << q.output;
    EXPECT_EQ(LlamaConfig::from_file(out / "config.json").family, LlamaConfig::from_file(golden(name) / "config.json").family);
    const std::string ids = "1,40,7,55,3,18,9,12,61,2";
    ASSERT_EQ(run_memtune("logits --device cpu --model " + out.string() + " --input-ids " + ids + " --out " +
                          (dir / "from_checkpoint.safetensors").string()).exit_code, 0);
    ASSERT_EQ(run_memtune("logits --device cpu --load_in_4bit --model " + golden(name).string() + " --input-ids " + ids +
                          " --out " + (dir / "on_load.safetensors").string()).exit_code, 0);
    EXPECT_EQ(max_abs_diff(logits_of(dir / "from_checkpoint.safetensors"), logits_of(dir / "on_load.safetensors")), 0.0);
    const Result train = run_memtune("train --device cpu --load_in_4bit --bf16 --model " + out.string() +
                                     " --max_steps 2 --seq 24 --batch 2 --quiet");
    EXPECT_EQ(train.exit_code, 0) << train.output;
  }
}

TEST(CliGenerate, GreedyJsonEqualsTransformersAndSamplingIsSeeded) {
  const nlohmann::json fixture = memtune::test::read_json_fixture("generate/greedy.json");
  int checked = 0;
  for (const nlohmann::json& c : fixture["cases"]) {
    if (!c["adapter"].get<bool>() || c["prompt_ids"].size() < 3) continue;
    if (!c.value("checkable", true)) continue;  // a logit margin within fp32 noise
    const std::string name = c["fixture"];
    std::string ids;
    for (const auto& id : c["prompt_ids"]) ids += (ids.empty() ? "" : ",") + std::to_string(id.get<int>());
    const Result r = run_memtune("generate --device cpu --json --model " + golden(name).string() + " --adapter " +
                                 (golden(name) / "adapter").string() + " --input-ids " + ids +
                                 " --max_new_tokens " + std::to_string(c.value("max_new_tokens", fixture["max_new_tokens"].get<int>())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const nlohmann::json out = nlohmann::json::parse(r.output);
    EXPECT_EQ(out["output_ids"], c["output_ids"]) << name;
    EXPECT_EQ(out["stop_reason"], c["stop_reason"]) << name;
    ++checked;
  }
  // Two prompts of several tokens on each fixture: Llama (gqa_rope, tied_odd), Qwen2 (q/k/v
  // biases, tied), Qwen3 (per-head q/k norm), Mistral (explicit head_dim).
  EXPECT_EQ(checked, 10);

  // Chat prompt on the embedded tiny model (built-in byte tokenizer); sampling repeats per seed.
  const std::string chat = "generate --device cpu --json --model tiny --chat --system \"Be brief.\" --prompt \"Hello there\" "
                           "--max_new_tokens 12 --temperature 0.8 --top_p 0.9 --seed 5";
  const Result first = run_memtune(chat), second = run_memtune(chat);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const nlohmann::json a = nlohmann::json::parse(first.output), b = nlohmann::json::parse(second.output);
  EXPECT_EQ(a["output_ids"], b["output_ids"]);
  // bos, then the system turn's header.
  EXPECT_EQ(a["prompt_ids"][0], 256);
  EXPECT_EQ(a["prompt_ids"][1], 258);
  const std::vector<int> tail = {258, 97, 115, 115, 105, 115, 116, 97, 110, 116, 259, 10, 10};  // assistant header
  const std::vector<int> prompt = a["prompt_ids"].get<std::vector<int>>();
  EXPECT_TRUE(std::equal(tail.rbegin(), tail.rend(), prompt.rbegin()));
  const Result plain = run_memtune("generate --device cpu --model tiny --prompt \"Hi\" --max_new_tokens 3");
  EXPECT_EQ(plain.exit_code, 0) << plain.output;

  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"generate --model tiny --prompt hi --input-ids 1,2", "exactly one of --prompt and --input-ids"},
           {"generate --model tiny --input-ids 1,99999", "outside the model's vocabulary"},
           {"generate --model tiny --input-ids 1,x", "--input-ids"},
           {"generate --model tiny --prompt hi --dtype f8", "--dtype f8"},
           {"logits --model tiny --prompt hi", "--out is required"},
           {"merge --model " + golden("gqa_rope").string() + " --adapter /nonexistent --out " +
                (scratch_dir("merge_errors") / "x").string(), "adapter_config.json"}}) {
    const Result r = run_memtune(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
  }
}

TEST(CliExamples, RunYamlsAreReadableAndTheDatasetIsChatMessages) {
  const Result seed = run_memtune("plan --json --config " + example("seed-qlora-8b.yaml").string());
  ASSERT_EQ(seed.exit_code, 0) << seed.output;
  const nlohmann::json plan = nlohmann::json::parse(seed.output);
  const nlohmann::json& run = plan["run"];
  EXPECT_EQ(run["max_seq_length"], 2048);
  EXPECT_EQ(run["precision"], "bf16");
  EXPECT_EQ(run["per_device_train_batch_size"], 2);
  EXPECT_EQ(run["gradient_accumulation_steps"], 8);
  EXPECT_EQ(run["gradient_checkpointing"], true);
  EXPECT_EQ(run["lora_r"], 16);
  EXPECT_EQ(run["lora_alpha"], 16);
  EXPECT_EQ(run["lora_target_modules"], "all-linear");
  EXPECT_EQ(plan["frozen_parameters"], 8030261248ll);
  EXPECT_GT(plan["categories"]["quant_constants"].get<uint64_t>(), 0u);  // the 4-bit base
  // 4 bits + double-quant constants per projection weight: far below bf16's 16 GB.
  EXPECT_LT(plan["categories"]["frozen_weights"].get<uint64_t>(), 6ull << 30);
  EXPECT_EQ(run_memtune("plan --config " + example("tiny-sft.yaml").string()).exit_code, 0);

  std::ifstream in(example("sft-tasks.jsonl"));
  int lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    const nlohmann::json sample = nlohmann::json::parse(line);
    const nlohmann::json& messages = sample.at("messages");
    ASSERT_GE(messages.size(), 2u) << line;
    EXPECT_EQ(messages.back()["role"], "assistant") << line;
    EXPECT_EQ(messages[messages.size() - 2]["role"], "user") << line;
  }
  EXPECT_GE(lines, 300);
}

// A KV cache larger than the machine is refused by name before anything is allocated (it ended
// inside the CPU allocator with an internal error), and a length past the byte counts' bound too.
TEST(CliGenerate, AKvCacheLargerThanTheMachineIsAClearError) {
  // Llama 3.1 8B's KV cache for 16M tokens: ~2 TB, more than a host holds (refused before the
  // weights are made, so the test allocates nothing).
  const Result huge =
      run_memtune("generate --model llama-3.1-8b --device cpu --prompt hi --max_new_tokens 16000000");
  EXPECT_NE(huge.exit_code, 0) << huge.output;
  EXPECT_NE(huge.output.find("generation needs"), std::string::npos) << huge.output;
  EXPECT_EQ(huge.output.find("internal error"), std::string::npos) << huge.output;
  const Result past = run_memtune("generate --model tiny --device cpu --prompt hi --max_new_tokens 9000000000000000000");
  EXPECT_NE(past.exit_code, 0) << past.output;
  EXPECT_NE(past.output.find("may hold at most 16777216 tokens"), std::string::npos) << past.output;
}

}  // namespace
