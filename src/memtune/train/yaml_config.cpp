#include "memtune/train/yaml_config.h"

#include <yaml-cpp/yaml.h>

#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "memtune/core/error.h"

namespace memtune {

std::set<std::string> apply_run_yaml(const std::filesystem::path& path, RunConfig& run) {
  std::error_code ec;
  MT_USER_CHECK(!std::filesystem::is_directory(path, ec), "run config {} is a folder, not a YAML file", path.string());
  std::ifstream in(path, std::ios::binary);
  MT_USER_CHECK(in.good(), "cannot open run config {}", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  MT_USER_CHECK(!in.bad(), "cannot read run config {}", path.string());
  return apply_run_yaml_text(text.str(), path.string(), run);
}

std::set<std::string> apply_run_yaml_text(const std::string& text, const std::string& name, RunConfig& run) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    mt_fail("{}: not valid YAML: {}", name, e.what());
  }
  std::set<std::string> keys;
  if (root.IsNull()) return keys;
  MT_USER_CHECK(root.IsMap(), "{}: expected a mapping of option: value", name);
  using Setter = std::function<void(const YAML::Node&)>;
  auto set = [](auto& field) {
    return Setter([&field](const YAML::Node& n) { field = n.as<std::remove_reference_t<decltype(field)>>(); });
  };
  const std::map<std::string, Setter> setters = {
      {"model", set(run.model)},
      {"bf16", [&](const YAML::Node& n) { if (n.as<bool>()) run.precision = Precision::bf16; }},
      {"fp16", [&](const YAML::Node& n) { if (n.as<bool>()) run.precision = Precision::fp16; }},
      {"gradient_checkpointing", set(run.gradient_checkpointing)},
      {"attn_implementation", set(run.attn_implementation)},
      {"loss_implementation", set(run.loss_implementation)},
      {"loss_chunk_tokens", set(run.loss_chunk_tokens)},
      {"mlp_chunk_tokens", set(run.mlp_chunk_tokens)},
      {"hold_chunk_weights", set(run.hold_chunk_weights)},
      {"offload_activations", set(run.offload_activations)},
      {"offload_embeddings", set(run.offload_embeddings)},
      {"offload_optimizer", set(run.offload_optimizer)},
      {"ddp_bucket_cap_mb", set(run.ddp_bucket_cap_mb)},
      {"shard_base", set(run.shard_base)},
      {"stream_layers", set(run.stream_layers)},
      {"per_device_train_batch_size", set(run.per_device_train_batch_size)},
      {"gradient_accumulation_steps", set(run.gradient_accumulation_steps)},
      {"max_seq_length", set(run.max_seq_length)},
      {"lora_r", set(run.lora_r)},
      {"lora_alpha", set(run.lora_alpha)},
      {"lora_dropout", set(run.lora_dropout)},
      {"use_rslora", set(run.use_rslora)},
      {"lora_target_modules", [&](const YAML::Node& n) {
         if (n.IsSequence()) {
           std::string joined;
           for (const YAML::Node& item : n) {
             if (!joined.empty()) joined += ',';
             joined += item.as<std::string>();
           }
           run.lora_target_modules = joined;
         } else {
           run.lora_target_modules = n.as<std::string>();
         }
       }},
      {"learning_rate", set(run.learning_rate)},
      {"weight_decay", set(run.weight_decay)},
      {"adam_beta1", set(run.adam_beta1)},
      {"adam_beta2", set(run.adam_beta2)},
      {"adam_epsilon", set(run.adam_epsilon)},
      {"max_grad_norm", set(run.max_grad_norm)},
      {"lr_scheduler_type", [&](const YAML::Node& n) {
         run.lr_scheduler_type = parse_lr_schedule(n.as<std::string>(), "lr_scheduler_type");
       }},
      {"warmup_steps", set(run.warmup_steps)},
      {"max_steps", set(run.max_steps)},
      {"seed", set(run.seed)},
      {"load_in_4bit", set(run.load_in_4bit)},
      {"bnb_4bit_quant_type", [&](const YAML::Node& n) { run.quant.type = parse_quant_type(n.as<std::string>(), "bnb_4bit_quant_type"); }},
      {"bnb_4bit_use_double_quant", set(run.quant.double_quant)},
      {"bnb_4bit_blocksize", set(run.quant.blocksize)},
      {"bnb_4bit_compute_dtype", set(run.bnb_4bit_compute_dtype)},
  };
  bool bf16 = false, fp16 = false;
  for (const auto& item : root) {
    // A key that is a list or a mapping (`[a, b]: 1`) has no name to look up.
    MT_USER_CHECK(item.first.IsScalar(), "{}: an option's name must be a plain word, not a list or a mapping", name);
    const std::string key = item.first.Scalar();
    auto it = setters.find(key);
    MT_USER_CHECK(it != setters.end(), "{}: unknown option '{}'", name, key);
    MT_USER_CHECK(!keys.contains(key), "{}: option '{}' is given twice", name, key);
    try {
      it->second(item.second);
      if (key == "bf16") bf16 = item.second.as<bool>();
      if (key == "fp16") fp16 = item.second.as<bool>();
    } catch (const YAML::Exception&) {
      mt_fail("{}: option '{}' has a value of the wrong type", name, key);
    }
    keys.insert(key);
  }
  MT_USER_CHECK(!(bf16 && fp16), "{}: bf16 and fp16 exclude each other", name);
  run.validate();
  return keys;
}

}  // namespace memtune
