// LoRA adapters with PEFT's names, init and scaling (SPECS.md §2).
#pragma once

#include <string>
#include <vector>

#include "memtune/model/param_table.h"

namespace memtune {

struct LoraConfig {
  int64_t r = 8;
  double alpha = 8.0;
  double dropout = 0.0;
  bool use_rslora = false;
  std::vector<Projection> targets;  // which of the seven projections carry an adapter

  // PEFT: alpha / r, or alpha / sqrt(r) with rslora.
  float scaling() const;
  bool targets_projection(Projection p) const;
  // "all-linear" (every projection; the LM head is never a target, as in PEFT) or a comma
  // list of q_proj,k_proj,... (or q,k,...). Throws memtune::Error on unknown names.
  static std::vector<Projection> parse_targets(const std::string& text);
  std::string targets_string() const;  // "q_proj,k_proj,..."
};

// The settings in which two LoRA configs differ, in PEFT's adapter_config.json names, as
// "lora_alpha 32 vs 16, r 8 vs 16" (first's value, then second's); "" when they compute the same
// adapter (r, lora_alpha, lora_dropout, use_rslora and target_modules all equal).
std::string lora_config_differences(const LoraConfig& first, const LoraConfig& second);

struct LoraSpec {
  int layer;
  Projection projection;
  std::string a_key, b_key;  // PEFT: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
  Shape a_shape, b_shape;    // [r, in], [out, r]
};

std::vector<LoraSpec> lora_table(const LlamaConfig& model, const LoraConfig& lora);
int64_t count_lora_parameters(const std::vector<LoraSpec>& table);

}  // namespace memtune
