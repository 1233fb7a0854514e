#include "memtune/model/param_table.h"

#include <fmt/format.h>

namespace memtune {

std::string_view projection_name(Projection p) {
  static constexpr std::string_view names[] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                               "gate_proj", "up_proj", "down_proj"};
  return names[static_cast<int>(p)];
}

std::string_view projection_module(Projection p) {
  static constexpr std::string_view modules[] = {
      "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
      "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
  return modules[static_cast<int>(p)];
}

bool projection_from_name(std::string_view name, Projection* out) {
  for (Projection p : kAllProjections) {
    const std::string_view full = projection_name(p);
    if (name == full || name == full.substr(0, full.size() - 5)) {
      *out = p;
      return true;
    }
  }
  return false;
}

int64_t projection_in_features(const LlamaConfig& c, Projection p) {
  switch (p) {
    case Projection::o: return c.q_dim();
    case Projection::down: return c.intermediate_size;
    default: return c.hidden_size;
  }
}

int64_t projection_out_features(const LlamaConfig& c, Projection p) {
  switch (p) {
    case Projection::q: return c.q_dim();
    case Projection::k:
    case Projection::v: return c.kv_dim();
    case Projection::gate:
    case Projection::up: return c.intermediate_size;
    default: return c.hidden_size;
  }
}

std::vector<ParamSpec> base_parameter_table(const LlamaConfig& c) {
  std::vector<ParamSpec> table;
  table.push_back({"model.embed_tokens.weight", ParamKind::embedding, -1, Projection::q,
                   Shape{c.vocab_size, c.hidden_size}});
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string prefix = fmt::format("model.layers.{}.", layer);
    auto linear = [&](Projection p) {
      table.push_back({prefix + std::string(projection_module(p)) + ".weight", ParamKind::linear,
                       layer, p,
                       Shape{projection_out_features(c, p), projection_in_features(c, p)}});
    };
    table.push_back({prefix + "input_layernorm.weight", ParamKind::norm, layer, Projection::q,
                     Shape{c.hidden_size}});
    for (Projection p : {Projection::q, Projection::k, Projection::v, Projection::o}) {
      linear(p);
      if (c.has_qkv_bias && p != Projection::o)
        table.push_back({prefix + std::string(projection_module(p)) + ".bias", ParamKind::bias,
                         layer, p, Shape{projection_out_features(c, p)}});
    }
    if (c.has_qk_norm) {
      table.push_back({prefix + "self_attn.q_norm.weight", ParamKind::head_norm, layer,
                       Projection::q, Shape{c.head_dim}});
      table.push_back({prefix + "self_attn.k_norm.weight", ParamKind::head_norm, layer,
                       Projection::k, Shape{c.head_dim}});
    }
    table.push_back({prefix + "post_attention_layernorm.weight", ParamKind::norm, layer,
                     Projection::q, Shape{c.hidden_size}});
    for (Projection p : {Projection::gate, Projection::up, Projection::down}) linear(p);
  }
  table.push_back({"model.norm.weight", ParamKind::norm, -1, Projection::q, Shape{c.hidden_size}});
  if (!c.tie_word_embeddings)
    table.push_back({"lm_head.weight", ParamKind::lm_head, -1, Projection::q,
                     Shape{c.vocab_size, c.hidden_size}});
  return table;
}

int64_t count_parameters(const std::vector<ParamSpec>& table) {
  int64_t total = 0;
  for (const ParamSpec& spec : table) total += spec.shape.numel();
  return total;
}

}  // namespace memtune
