// The model description, read from a Hugging Face config.json: Llama and the families whose
// layer is Llama's with a few additions (Qwen2 / Qwen2.5, Qwen3, Mistral). The struct keeps its
// name: the engine is the Llama engine, and every family is a Llama layer plus the switches below.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace memtune {

struct RopeScaling {
  std::string type;  // "" (none) or "llama3"
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// The config.json model_type values memtune trains. Each is Llama's decoder layer plus:
//   qwen2:   frozen biases on q_proj, k_proj and v_proj (has_qkv_bias)
//   qwen3:   per-head RMSNorm on q and k before RoPE (has_qk_norm); head_dim set explicitly
//   mistral: explicit head_dim; an optional sliding window (sliding_window)
enum class ModelFamily : uint8_t { llama, qwen2, qwen3, mistral };
std::string_view model_family_name(ModelFamily family);  // the model_type string

struct LlamaConfig {
  ModelFamily family = ModelFamily::llama;
  // Qwen2's q/k/v projections carry biases (o_proj and the MLP do not).
  bool has_qkv_bias = false;
  // Qwen3's q_norm / k_norm: RMSNorm over each head's head_dim values of q and k, before RoPE.
  bool has_qk_norm = false;
  // Keys further than this many positions back are masked (q - k >= window); 0: no window. Only
  // an active window is kept (Qwen's use_sliding_window false leaves 0 here).
  int64_t sliding_window = 0;
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
