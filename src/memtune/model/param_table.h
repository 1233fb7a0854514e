// THE parameter table: every tensor of the base model, once. Names (HF keys), shapes, kinds
// and init all come from here; loading, saving, random init, planning and printing iterate it.
//
// Room model/ (docs/ARCHITECTURE.md): what the base model is; may include core/, io/, quant/ and ops/,
// never lora/ (merging an adapter into the base is lora/merge.h).
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "memtune/core/tensor.h"
#include "memtune/model/llama_config.h"

namespace memtune {

// The seven linear projections of a Llama layer, in HF module order.
enum class Projection : uint8_t { q, k, v, o, gate, up, down };
constexpr int kNumProjections = 7;
constexpr std::array<Projection, kNumProjections> kAllProjections = {
    Projection::q, Projection::k, Projection::v, Projection::o,
    Projection::gate, Projection::up, Projection::down};

std::string_view projection_name(Projection p);         // "q_proj"
std::string_view projection_module(Projection p);       // "self_attn.q_proj" / "mlp.gate_proj"
bool projection_from_name(std::string_view name, Projection* out);  // "q_proj" or "q"
int64_t projection_in_features(const LlamaConfig& c, Projection p);
int64_t projection_out_features(const LlamaConfig& c, Projection p);

// bias: a projection's frozen bias (Qwen2's q/k/v), [out]. head_norm: Qwen3's q_norm / k_norm,
// an RMSNorm weight over one head's values, [head_dim] (projection q or k says which).
enum class ParamKind : uint8_t { embedding, norm, linear, lm_head, bias, head_norm };

struct ParamSpec {
  std::string hf_key;  // "model.layers.3.self_attn.q_proj.weight"
  ParamKind kind;
  int layer = -1;      // -1: not inside a layer
  Projection projection = Projection::q;  // for kind == linear, bias and head_norm
  Shape shape;         // [out, in] for linear and lm_head; [H] for norms; [V, H] for embedding
};

// In checkpoint order: embed_tokens, then per layer input_layernorm, q (+ bias), k (+ bias),
// v (+ bias), o, (q_norm, k_norm), post_attention_layernorm, gate, up, down, then model.norm and
// (untied) lm_head. The rows in parentheses exist only for the families that have them, so a
// Llama table (and the seeds its rows draw by index) is what it always was.
std::vector<ParamSpec> base_parameter_table(const LlamaConfig& config);
int64_t count_parameters(const std::vector<ParamSpec>& table);

}  // namespace memtune
