// The model description, read from a Hugging Face config.json (LlamaConfig fields).
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace memtune {

struct RopeScaling {
  std::string type;  // "" (none) or "llama3"
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct LlamaConfig {
  int64_t hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
  int64_t vocab_size = 0, max_position_embeddings = 0;
  double rms_norm_eps = 1e-5, rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;
  std::string torch_dtype;  // as written in the file; informative only
  std::string name;         // preset name or folder, for reports

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }

  // Parses and validates. `source` names the file in error messages.
  static LlamaConfig from_json(const nlohmann::json& json, const std::string& source);
  static LlamaConfig from_file(const std::filesystem::path& config_json);
  nlohmann::json to_json() const;  // a config.json that transformers reads
};

// inv_freq[j] = 1 / theta^(2j / head_dim), with llama3 scaling applied (SPECS.md §3), in fp32
// as transformers computes it.
std::vector<float> rope_inv_freq(const LlamaConfig& config);

// Where presets live: <repo>/configs/models/<name>.json. Resolves a --model argument that is a
// preset name, a folder holding config.json, or a config.json path. Returns the config and the
// folder that holds the weights ("" when there is no checkpoint).
struct ModelSource {
  LlamaConfig config;
  std::filesystem::path checkpoint_dir;  // empty: random init
};
ModelSource resolve_model(const std::string& model_argument);
std::vector<std::string> preset_names();

}  // namespace memtune
