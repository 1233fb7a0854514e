#include "memtune/lora/lora_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "memtune/core/error.h"

namespace memtune {

float LoraConfig::scaling() const {
  return static_cast<float>(use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / r);
}

bool LoraConfig::targets_projection(Projection p) const {
  return std::find(targets.begin(), targets.end(), p) != targets.end();
}

std::vector<Projection> LoraConfig::parse_targets(const std::string& text) {
  if (text == "all-linear" || text == "all_linear")
    return {kAllProjections.begin(), kAllProjections.end()};
  std::vector<Projection> targets;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    std::string name = text.substr(start, end - start);
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (!name.empty()) {
      Projection p;
      MT_USER_CHECK(projection_from_name(name, &p),
                    "lora_target_modules: unknown module '{}' (use all-linear or q_proj, k_proj, "
                    "v_proj, o_proj, gate_proj, up_proj, down_proj)",
                    name);
      if (std::find(targets.begin(), targets.end(), p) == targets.end()) targets.push_back(p);
    }
    start = end + 1;
  }
  MT_USER_CHECK(!targets.empty(), "lora_target_modules is empty");
  std::sort(targets.begin(), targets.end());
  return targets;
}

std::string LoraConfig::targets_string() const {
  std::string out;
  for (Projection p : targets) {
    if (!out.empty()) out += ',';
    out += projection_name(p);
  }
  return out;
}

std::string lora_config_differences(const LoraConfig& first, const LoraConfig& second) {
  std::string out;
  const auto differ = [&](std::string_view key, const std::string& a, const std::string& b) {
    if (a == b) return;
    out += fmt::format("{}{} {} vs {}", out.empty() ? "" : ", ", key, a, b);
  };
  // Exact comparisons: both sides come from the same decimal text (flag or JSON) or from a
  // file memtune wrote, and an alpha that differs in any digit scales the adapter differently.
  differ("r", std::to_string(first.r), std::to_string(second.r));
  differ("lora_alpha", fmt::format("{}", first.alpha), fmt::format("{}", second.alpha));
  differ("lora_dropout", fmt::format("{}", first.dropout), fmt::format("{}", second.dropout));
  differ("use_rslora", first.use_rslora ? "true" : "false", second.use_rslora ? "true" : "false");
  differ("target_modules", first.targets_string(), second.targets_string());
  return out;
}

std::vector<LoraSpec> lora_table(const LlamaConfig& model, const LoraConfig& lora) {
  std::vector<LoraSpec> table;
  for (int layer = 0; layer < model.num_hidden_layers; ++layer) {
    for (Projection p : kAllProjections) {
      if (!lora.targets_projection(p)) continue;
      const std::string prefix = fmt::format("base_model.model.model.layers.{}.{}", layer,
                                             projection_module(p));
      table.push_back({layer, p, prefix + ".lora_A.weight", prefix + ".lora_B.weight",
                       Shape{lora.r, projection_in_features(model, p)},
                       Shape{projection_out_features(model, p), lora.r}});
    }
  }
  return table;
}

int64_t count_lora_parameters(const std::vector<LoraSpec>& table) {
  int64_t total = 0;
  for (const LoraSpec& spec : table) total += spec.a_shape.numel() + spec.b_shape.numel();
  return total;
}

}  // namespace memtune
