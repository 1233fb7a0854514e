#include "memtune/model/llama_config.h"

#include <cmath>
#include <fstream>

#include "memtune/core/enum_names.h"
#include "memtune/core/error.h"
#include "memtune/model/presets.h"

namespace memtune {
namespace {

using nlohmann::json;

const json& require(const json& object, const char* key, const std::string& source) {
  auto it = object.find(key);
  MT_USER_CHECK(it != object.end() && !it->is_null(), "{}: missing required field \"{}\"", source,
                key);
  return *it;
}

int64_t require_positive_int(const json& object, const char* key, const std::string& source) {
  const json& value = require(object, key, source);
  MT_USER_CHECK(value.is_number_integer() && value.get<int64_t>() > 0,
                "{}: \"{}\" must be a positive integer, got {}", source, key, value.dump());
  return value.get<int64_t>();
}

// The largest value of each size that memtune accepts: well above every released Llama-family
// model (Llama 3.1 405B: hidden 16384, intermediate 53248, 126 layers, 128 heads; vocabularies
// up to 256k; contexts up to 10M), and small enough that every byte count the planner derives
// from them (for example an eager attention's batch x heads x seq x seq scores) fits in 64 bits.
// A value beyond is a typo or a hostile file, refused with a clear message instead of planned.
struct SizeLimit {
  const char* key;
  int64_t max;
};
constexpr SizeLimit kSizeLimits[] = {
    {"hidden_size", int64_t{1} << 17},          {"intermediate_size", int64_t{1} << 20},
    {"num_hidden_layers", 1024},                 {"num_attention_heads", 1024},
    {"num_key_value_heads", 1024},               {"head_dim", 1024},
    {"vocab_size", int64_t{1} << 24},            {"max_position_embeddings", int64_t{1} << 24},
    {"original_max_position_embeddings", int64_t{1} << 24},
};

int64_t require_size(const json& object, const char* key, const std::string& source) {
  const int64_t value = require_positive_int(object, key, source);
  for (const SizeLimit& limit : kSizeLimits)
    if (std::string_view(limit.key) == key)
      MT_USER_CHECK(value <= limit.max, "{}: \"{}\" {} is outside the sizes real models use (1 to {})", source, key,
                    value, limit.max);
  return value;
}

double number_or(const json& object, const char* key, double fallback, const std::string& source) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  MT_USER_CHECK(it->is_number(), "{}: \"{}\" must be a number, got {}", source, key, it->dump());
  return it->get<double>();
}

// The model_type strings of config.json.
constexpr EnumName<ModelFamily> kModelTypes[] = {{ModelFamily::llama, "llama"}, {ModelFamily::qwen2, "qwen2"},
                                                 {ModelFamily::qwen3, "qwen3"}, {ModelFamily::mistral, "mistral"}};

bool family_from_name(const std::string& name, ModelFamily* out) {
  const std::optional<ModelFamily> family = value_of(kModelTypes, name);
  if (family) *out = *family;
  return family.has_value();
}

// The window that the attention must apply, or 0. Mistral's is on whenever sliding_window is a
// number (every layer; transformers' mask keeps key j for query i when i - j < window). Qwen2 / Qwen3 write a sliding_window that only counts with
// use_sliding_window true, and then for the layers from max_window_layers on (transformers 5
// spells that out as layer_types): a per-layer window that memtune does not implement, refused.
void read_sliding_window(const json& j, const std::string& source, LlamaConfig& c) {
  auto window = j.find("sliding_window");
  const bool has_window = window != j.end() && !window->is_null();
  if (has_window)
    MT_USER_CHECK(window->is_number_integer() && window->get<int64_t>() > 0,
                  "{}: \"sliding_window\" must be a positive integer or null, got {}", source,
                  window->dump());
  if (c.family == ModelFamily::qwen2 || c.family == ModelFamily::qwen3) {
    auto use = j.find("use_sliding_window");
    MT_USER_CHECK(use == j.end() || use->is_null() || (use->is_boolean() && !use->get<bool>()),
                  "{}: \"use_sliding_window\": true is not supported (a sliding window on some "
                  "layers only); memtune trains {} with full attention on every layer",
                  source, model_family_name(c.family));
  } else if (c.family == ModelFamily::mistral) {
    // MistralConfig's default is 4096 when the key is absent; an explicit null is no window.
    c.sliding_window = window == j.end() ? 4096 : has_window ? window->get<int64_t>() : 0;
  } else {
    MT_USER_CHECK(!has_window, "{}: \"sliding_window\" is not supported for model_type \"{}\"",
                  source, model_family_name(c.family));
  }
  if (auto types = j.find("layer_types"); types != j.end() && !types->is_null()) {
    MT_USER_CHECK(types->is_array(), "{}: \"layer_types\" must be a list", source);
    for (size_t i = 0; i < types->size(); ++i)
      MT_USER_CHECK((*types)[i] == "full_attention" ||
                        (c.sliding_window > 0 && (*types)[i] == "sliding_attention"),
                    "{}: \"layer_types\"[{}] is {}: memtune supports \"full_attention\" layers "
                    "(and Mistral's window on every layer)",
                    source, i, (*types)[i].dump());
  }
}

}  // namespace

std::string_view model_family_name(ModelFamily family) { return name_of(kModelTypes, family); }

LlamaConfig LlamaConfig::from_json(const json& j, const std::string& source) {
  MT_USER_CHECK(j.is_object(), "{}: config must be a JSON object", source);
  const json& model_type = require(j, "model_type", source);
  LlamaConfig c;
  MT_USER_CHECK(model_type.is_string() && family_from_name(model_type.get<std::string>(), &c.family),
                "{}: unsupported model_type {} (memtune supports \"llama\", \"qwen2\", \"qwen3\" "
                "and \"mistral\")",
                source, model_type.dump());
  c.hidden_size = require_size(j, "hidden_size", source);
  c.intermediate_size = require_size(j, "intermediate_size", source);
  c.num_hidden_layers = require_size(j, "num_hidden_layers", source);
  c.num_attention_heads = require_size(j, "num_attention_heads", source);
  c.num_key_value_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                              ? require_size(j, "num_key_value_heads", source)
                              : c.num_attention_heads;
  c.vocab_size = require_size(j, "vocab_size", source);
  c.max_position_embeddings = require_size(j, "max_position_embeddings", source);
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    c.head_dim = require_size(j, "head_dim", source);
  } else if (c.family == ModelFamily::qwen3) {
    // Qwen3Config's own default, not hidden / heads (Qwen3-8B: hidden 4096, 32 heads, 128).
    c.head_dim = 128;
  } else {
    MT_USER_CHECK(c.hidden_size % c.num_attention_heads == 0,
                  "{}: hidden_size {} is not divisible by num_attention_heads {} and no head_dim "
                  "is given",
                  source, c.hidden_size, c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  MT_USER_CHECK(c.head_dim % 2 == 0, "{}: head_dim {} must be even for rotary embeddings", source,
                c.head_dim);
  MT_USER_CHECK(c.num_attention_heads % c.num_key_value_heads == 0,
                "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", source,
                c.num_attention_heads, c.num_key_value_heads);
  c.rms_norm_eps = number_or(j, "rms_norm_eps", 1e-6, source);
  c.rope_theta = number_or(j, "rope_theta", 10000.0, source);
  c.initializer_range = number_or(j, "initializer_range", 0.02, source);
  MT_USER_CHECK(c.rms_norm_eps > 0 && c.rope_theta > 0, "{}: rms_norm_eps and rope_theta must be "
                "positive", source);
  if (auto it = j.find("tie_word_embeddings"); it != j.end() && !it->is_null()) {
    MT_USER_CHECK(it->is_boolean(), "{}: tie_word_embeddings must be true or false", source);
    c.tie_word_embeddings = it->get<bool>();
  }
  // Qwen2's attention hard-codes biases on q, k and v (its config has no switch for them);
  // elsewhere attention_bias true would add an o_proj bias too, which memtune does not have.
  c.has_qkv_bias = c.family == ModelFamily::qwen2;
  c.has_qk_norm = c.family == ModelFamily::qwen3;
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (c.family == ModelFamily::qwen2 && std::string_view(key) == "attention_bias") continue;
    auto it = j.find(key);
    MT_USER_CHECK(it == j.end() || it->is_null() || (it->is_boolean() && !it->get<bool>()),
                  "{}: \"{}\": true is not supported (memtune's {} layer has no such biases)",
                  source, key, model_family_name(c.family));
  }
  read_sliding_window(j, source, c);
  if (auto it = j.find("hidden_act"); it != j.end() && !it->is_null())
    MT_USER_CHECK(*it == "silu", "{}: hidden_act {} is not supported (only \"silu\")", source,
                  it->dump());
  // transformers 4.x writes rope_theta + rope_scaling; transformers 5 writes both into one
  // rope_parameters object {"rope_type", "rope_theta", "factor", ...}.
  const json* rope_object = nullptr;
  if (auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
    MT_USER_CHECK(it->is_object(), "{}: rope_parameters must be an object", source);
    rope_object = &*it;
    c.rope_theta = number_or(*it, "rope_theta", c.rope_theta, source + " rope_parameters");
    MT_USER_CHECK(c.rope_theta > 0, "{}: rope_theta must be positive", source);
  } else if (auto it2 = j.find("rope_scaling"); it2 != j.end() && !it2->is_null()) {
    rope_object = &*it2;
  }
  if (rope_object != nullptr) {
    const json& rs = *rope_object;
    MT_USER_CHECK(rs.is_object(), "{}: rope_scaling must be an object or null", source);
    std::string type;
    for (const char* key : {"rope_type", "type"}) {
      auto it = rs.find(key);
      if (it == rs.end() || it->is_null()) continue;
      MT_USER_CHECK(it->is_string(), "{}: rope_scaling \"{}\" must be a string, got {}", source,
                    key, it->dump());
      type = it->get<std::string>();
      break;
    }
    const std::string ctx = source + " rope_scaling";
    if (type == "default" || type.empty()) {
      // no scaling
    } else if (type == "llama3") {
      c.rope_scaling.type = type;
      c.rope_scaling.factor = number_or(rs, "factor", 0, ctx);
      c.rope_scaling.low_freq_factor = number_or(rs, "low_freq_factor", 0, ctx);
      c.rope_scaling.high_freq_factor = number_or(rs, "high_freq_factor", 0, ctx);
      c.rope_scaling.original_max_position_embeddings =
          require_size(rs, "original_max_position_embeddings", ctx);
      MT_USER_CHECK(c.rope_scaling.factor > 0 && c.rope_scaling.low_freq_factor > 0 &&
                        c.rope_scaling.high_freq_factor > c.rope_scaling.low_freq_factor,
                    "{}: llama3 rope_scaling needs factor > 0 and high_freq_factor > "
                    "low_freq_factor > 0",
                    source);
    } else {
      mt_fail("{}: rope_scaling type \"{}\" is not supported (memtune supports \"llama3\")",
              source, type);
    }
  }
  if (auto it = j.find("bos_token_id"); it != j.end() && it->is_number_integer())
    c.bos_token_id = it->get<int64_t>();
  if (auto it = j.find("eos_token_id"); it != j.end()) {
    if (it->is_number_integer()) c.eos_token_ids = {it->get<int64_t>()};
    else if (it->is_array())
      for (const json& id : *it)
        if (id.is_number_integer()) c.eos_token_ids.push_back(id.get<int64_t>());
  }
  if (auto it = j.find("torch_dtype"); it != j.end() && it->is_string()) c.torch_dtype = *it;
  if (auto it = j.find("dtype"); it != j.end() && it->is_string()) c.torch_dtype = *it;
  return c;
}

LlamaConfig LlamaConfig::from_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  MT_USER_CHECK(in.good(), "cannot open model config {}", path.string());
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  MT_USER_CHECK(!j.is_discarded(), "{}: not valid JSON", path.string());
  LlamaConfig c = from_json(j, path.string());
  c.name = path.parent_path().filename().string();
  return c;
}

json LlamaConfig::to_json() const {
  static constexpr const char* kArchitectures[] = {"LlamaForCausalLM", "Qwen2ForCausalLM",
                                                   "Qwen3ForCausalLM", "MistralForCausalLM"};
  json j = {{"architectures", {kArchitectures[static_cast<int>(family)]}},
            {"model_type", std::string(model_family_name(family))},
            {"hidden_size", hidden_size},
            {"intermediate_size", intermediate_size},
            {"num_hidden_layers", num_hidden_layers},
            {"num_attention_heads", num_attention_heads},
            {"num_key_value_heads", num_key_value_heads},
            {"head_dim", head_dim},
            {"vocab_size", vocab_size},
            {"max_position_embeddings", max_position_embeddings},
            {"rms_norm_eps", rms_norm_eps},
            {"rope_theta", rope_theta},
            {"tie_word_embeddings", tie_word_embeddings},
            {"initializer_range", initializer_range},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"mlp_bias", false}};
  if (rope_scaling.type.empty()) {
    j["rope_scaling"] = nullptr;
  } else {
    j["rope_scaling"] = {{"rope_type", rope_scaling.type},
                         {"factor", rope_scaling.factor},
                         {"low_freq_factor", rope_scaling.low_freq_factor},
                         {"high_freq_factor", rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings",
                          rope_scaling.original_max_position_embeddings}};
  }
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_ids.size() == 1) j["eos_token_id"] = eos_token_ids[0];
  else if (!eos_token_ids.empty()) j["eos_token_id"] = eos_token_ids;
  if (!torch_dtype.empty()) j["torch_dtype"] = torch_dtype;
  // Qwen2 has no bias switch (its q/k/v biases are implied by the model type).
  if (family == ModelFamily::qwen2) j.erase("attention_bias");
  if (family == ModelFamily::qwen2 || family == ModelFamily::qwen3) j["use_sliding_window"] = false;
  if (family == ModelFamily::mistral)
    j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
  return j;
}

std::vector<float> rope_inv_freq(const LlamaConfig& c) {
  // transformers: inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64)
  // .to(device=device, dtype=torch.float) / dim)): the exponent and the power are fp32.
  const int64_t half = c.head_dim / 2;
  std::vector<float> inv_freq(half);
  for (int64_t j = 0; j < half; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(c.head_dim);
    inv_freq[j] = 1.0f / std::pow(static_cast<float>(c.rope_theta), exponent);
  }
  if (c.rope_scaling.type == "llama3") {
    // transformers modeling_rope_utils._compute_llama3_parameters (SPECS.md §3), fp32 tensors.
    const RopeScaling& s = c.rope_scaling;
    const float factor = static_cast<float>(s.factor);
    const float low = static_cast<float>(s.low_freq_factor);
    const float high = static_cast<float>(s.high_freq_factor);
    const float original = static_cast<float>(s.original_max_position_embeddings);
    const float low_freq_wavelen = original / low;
    const float high_freq_wavelen = original / high;
    for (float& f : inv_freq) {
      const float wavelen = 2.0f * static_cast<float>(M_PI) / f;
      if (wavelen > low_freq_wavelen) {
        f = f / factor;
      } else if (wavelen >= high_freq_wavelen) {
        const float smooth = (original / wavelen - low) / (high - low);
        f = (1.0f - smooth) * f / factor + smooth * f;
      }
    }
  }
  return inv_freq;
}

}  // namespace memtune

namespace memtune {

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const EmbeddedPreset& preset : embedded_presets()) names.emplace_back(preset.name);
  return names;
}

ModelSource resolve_model(const std::string& argument) {
  namespace fs = std::filesystem;
  for (const EmbeddedPreset& preset : embedded_presets()) {
    if (argument != preset.name) continue;
    ModelSource source;
    source.config = LlamaConfig::from_json(nlohmann::json::parse(preset.config_json),
                                           std::string("preset ") + preset.name);
    source.config.name = preset.name;
    return source;
  }
  const fs::path path(argument);
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    MT_USER_CHECK(fs::exists(path / "config.json"), "model folder {} has no config.json",
                  path.string());
    ModelSource source;
    source.config = LlamaConfig::from_file(path / "config.json");
    source.config.name = fs::absolute(path).lexically_normal().filename().string();
    bool has_weights = false;
    for (const auto& entry : fs::directory_iterator(path))
      if (entry.path().extension() == ".safetensors") has_weights = true;
    if (has_weights) source.checkpoint_dir = path;
    return source;
  }
  if (fs::is_regular_file(path, ec) && path.extension() == ".json") {
    ModelSource source;
    source.config = LlamaConfig::from_file(path);
    source.config.name = path.stem().string();
    return source;
  }
  std::string known;
  for (const std::string& name : preset_names()) known += (known.empty() ? "" : ", ") + name;
  mt_fail("--model {}: not a preset ({}), a folder with config.json, or a config .json file",
          argument, known);
}

}  // namespace memtune
