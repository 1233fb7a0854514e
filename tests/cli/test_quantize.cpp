// memtune quantize: a dense golden fixture written as a bitsandbytes 4-bit folder, loaded into
// the engine with --load_in_4bit without re-quantizing (the engine's 4-bit tensors are
// byte-identical to quantizing the dense checkpoint on load, and eval gives the same loss), a 4-bit
// checkpoint in a dense run (dequantized), and a checkpoint whose blocksize differs from the run's.
#include <gtest/gtest.h>

#include "cli_test_util.h"
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "memtune/io/safetensors.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/device.h"
#include "memtune/train/engine_arena.h"

namespace fs = std::filesystem;
using namespace memtune;

namespace {

using namespace memtune::clitest;

// The golden batch as a JSONL file for memtune eval.
fs::path write_batch_jsonl(const fs::path& dir) { return write_golden_batch_jsonl("gqa_rope", dir / "batch.jsonl"); }

std::vector<uint8_t> bytes_of(Backend& backend, const Tensor& t) {
  std::vector<uint8_t> out(t.nbytes());
  if (!out.empty()) backend.copy_to_host(out.data(), t);
  return out;
}

double eval_loss(const std::string& args) {
  const Result r = run_memtune("eval --device cpu --fp32 " + args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0) return -1;
  return nlohmann::json::parse(r.output)["loss"].get<double>();
}

}  // namespace

TEST(CliQuantize, WritesABitsandbytesFolderThatLoadsWithoutRequantizing) {
  const fs::path dir = scratch_dir("quantize");
  const fs::path out = dir / "gqa_rope_4bit";
  const Result r = run_memtune("quantize --model " + golden("gqa_rope").string() + " --out " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const auto& entry : fs::directory_iterator(dir))  // no staging folder left behind
    EXPECT_TRUE(entry.path() == out) << entry.path();

  const nlohmann::json config = read_json_file(out / "config.json");
  ASSERT_TRUE(config.contains("quantization_config")) << config.dump();
  const nlohmann::json& q = config["quantization_config"];
  EXPECT_EQ(q["quant_method"], "bitsandbytes");
  EXPECT_EQ(q["load_in_4bit"], true);
  EXPECT_EQ(q["load_in_8bit"], false);
  EXPECT_EQ(q["bnb_4bit_quant_type"], "nf4");
  EXPECT_EQ(q["bnb_4bit_use_double_quant"], true);
  EXPECT_EQ(q["bnb_4bit_quant_storage"], "uint8");
  EXPECT_TRUE(q.contains("bnb_4bit_compute_dtype"));

  const SafetensorsCheckpoint file = SafetensorsCheckpoint::open(out);
  const std::string p = "model.layers.0.self_attn.q_proj.weight";
  ASSERT_NE(file.find(p), nullptr);
  EXPECT_EQ(file.find(p)->dtype, DType::u8);
  for (const char* suffix : {".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map",
                             ".quant_state.bitsandbytes__nf4"})
    EXPECT_NE(file.find(p + suffix), nullptr) << suffix;
  const SafetensorsCheckpoint original = SafetensorsCheckpoint::open(golden("gqa_rope"));
  EXPECT_EQ(file.find("model.embed_tokens.weight")->dtype, original.find("model.embed_tokens.weight")->dtype);

  // The engine's 4-bit tensors: loaded pre-quantized == quantized on load from the dense weights.
  const LlamaConfig model = LlamaConfig::from_file(golden("gqa_rope") / "config.json");
  RunConfig run;
  run.precision = Precision::fp32;
  run.per_device_train_batch_size = 1;
  run.max_seq_length = 8;
  run.load_in_4bit = true;
  auto cpu = make_cpu_backend();
  PlannedEngine dense(*cpu, run, model), prequantized(*cpu, run, model);
  dense->load_base_checkpoint(golden("gqa_rope"));
  prequantized->load_base_checkpoint(out);
  const ModelWeights& a = dense->weights();
  const ModelWeights& b = prequantized->weights();
  int compared = 0;
  for (size_t i = 0; i < a.table.size(); ++i) {
    const ParamSpec& spec = a.table[i];
    if (!a.is_quantized(i)) {
      EXPECT_EQ(bytes_of(*cpu, a.tensors[i]), bytes_of(*cpu, b.tensors[i])) << spec.hf_key;
      continue;
    }
    ASSERT_TRUE(b.is_quantized(i)) << spec.hf_key;
    const Quantized4bit& qa = a.layers[spec.layer].quantized[static_cast<int>(spec.projection)];
    const Quantized4bit& qb = b.layers[spec.layer].quantized[static_cast<int>(spec.projection)];
    EXPECT_EQ(bytes_of(*cpu, qa.packed), bytes_of(*cpu, qb.packed)) << spec.hf_key;
    EXPECT_EQ(bytes_of(*cpu, qa.absmax), bytes_of(*cpu, qb.absmax)) << spec.hf_key;
    EXPECT_EQ(bytes_of(*cpu, qa.nested_absmax), bytes_of(*cpu, qb.nested_absmax)) << spec.hf_key;
    EXPECT_EQ(bytes_of(*cpu, qa.code_map), bytes_of(*cpu, qb.code_map)) << spec.hf_key;
    EXPECT_EQ(bytes_of(*cpu, qa.nested_map), bytes_of(*cpu, qb.nested_map)) << spec.hf_key;
    EXPECT_EQ(std::memcmp(&qa.nested_offset, &qb.nested_offset, sizeof(float)), 0) << spec.hf_key;
    ++compared;
  }
  EXPECT_EQ(compared, model.num_hidden_layers * 7);

  // memtune eval --load_in_4bit: the same loss from either checkpoint; a dense run dequantizes
  // the 4-bit checkpoint and gets the same loss up to the order of operations.
  const std::string data = " --data " + write_batch_jsonl(dir).string();
  const double from_dense = eval_loss("--load_in_4bit --model " + golden("gqa_rope").string() + data);
  const double from_4bit = eval_loss("--load_in_4bit --model " + out.string() + data);
  EXPECT_EQ(from_dense, from_4bit);
  const double dequantized = eval_loss("--model " + out.string() + data);
  EXPECT_NEAR(dequantized, from_4bit, 1e-5 * std::abs(from_4bit));
}

TEST(CliQuantize, ABlocksizeOtherThanTheRunsIsAClearError) {
  const fs::path dir = scratch_dir("quantize_blocksize");
  const fs::path out = dir / "gqa_rope_4bit_128";
  const Result q = run_memtune("quantize --model " + golden("gqa_rope").string() + " --out " + out.string() +
                               " --bnb_4bit_blocksize 128 --bnb_4bit_use_double_quant false --bnb_4bit_quant_type fp4");
  ASSERT_EQ(q.exit_code, 0) << q.output;
  const std::string data = " --data " + write_batch_jsonl(dir).string();
  const Result r = run_memtune("eval --device cpu --fp32 --load_in_4bit --bnb_4bit_quant_type fp4 "
                               "--bnb_4bit_use_double_quant false --model " + out.string() + data);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("model.layers.0.self_attn.q_proj.weight"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("blocksize 128"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--bnb_4bit_blocksize 64"), std::string::npos) << r.output;
  // The same settings as the checkpoint load it.
  const Result ok = run_memtune("eval --device cpu --fp32 --load_in_4bit --bnb_4bit_quant_type fp4 "
                                "--bnb_4bit_use_double_quant false --bnb_4bit_blocksize 128 --model " + out.string() + data);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  // Quantizing a 4-bit folder again is refused; --out must not be the input.
  EXPECT_NE(run_memtune("quantize --model " + out.string() + " --out " + (dir / "again").string()).exit_code, 0);
  EXPECT_NE(run_memtune("quantize --model " + golden("gqa_rope").string() + " --out " + golden("gqa_rope").string()).exit_code, 0);
}

// memtune logits on a bitsandbytes folder keeps the projections in 4 bits with the folder's own
// settings (as transformers loads such a folder), so its logits equal those of the dense folder
// quantized on load with the same settings, bit for bit; fp4 / blocksize 128 / no double quant
// needs no flags either.
TEST(CliQuantize, LogitsOfA4bitFolderUseItsCodesAsTheyAre) {
  const fs::path dir = scratch_dir("quantize_logits");
  const auto logits_of = [&](const std::string& args, const std::string& name) {
    const fs::path file = dir / (name + ".safetensors");
    const Result r = run_memtune("logits --device cpu --dtype f32 --input-ids 1,5,9,2,7,3 --out " +
                                 file.string() + " " + args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::vector<uint8_t> bytes;
    if (r.exit_code != 0) return bytes;
    const SafetensorsFile f = SafetensorsFile::open(file);
    const auto& t = f.get("logits");
    bytes.assign(t.data, t.data + t.nbytes);
    return bytes;
  };
  for (const std::string settings : {std::string(""), std::string(" --bnb_4bit_quant_type fp4 --bnb_4bit_use_double_quant false --bnb_4bit_blocksize 128")}) {
    const fs::path out = dir / (settings.empty() ? "nf4" : "fp4");
    const Result q = run_memtune("quantize --model " + golden("gqa_rope").string() + " --out " + out.string() + settings);
    ASSERT_EQ(q.exit_code, 0) << q.output;
    const std::vector<uint8_t> from_folder = logits_of("--model " + out.string(), out.filename().string() + "_folder");
    ASSERT_FALSE(from_folder.empty());
    if (settings.empty()) {
      const std::vector<uint8_t> on_load = logits_of("--load_in_4bit --model " + golden("gqa_rope").string(), "on_load");
      EXPECT_EQ(from_folder, on_load);
    }
    // And they differ from the dense model's: the 4-bit path really ran.
    const std::vector<uint8_t> dense = logits_of("--model " + golden("gqa_rope").string(), "dense");
    EXPECT_NE(from_folder, dense);
  }
}
