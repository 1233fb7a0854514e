#include "memtune/model/model_weights.h"

#include "memtune/ops/backend.h"

namespace memtune {

ModelWeights ModelWeights::allocate(Memory& memory, const LlamaConfig& config, DType storage) {
  ModelWeights weights;
  weights.table = base_parameter_table(config);
  weights.layers.resize(config.num_hidden_layers);
  for (const ParamSpec& spec : weights.table) {
    Tensor t = memory.alloc(spec.hf_key, MemCategory::frozen_weights, storage, spec.shape);
    weights.tensors.push_back(t);
    switch (spec.kind) {
      case ParamKind::embedding: weights.embed_tokens = t; break;
      case ParamKind::lm_head: weights.lm_head = t; break;
      case ParamKind::linear:
        weights.layers[spec.layer].projections[static_cast<int>(spec.projection)] = t;
        break;
      case ParamKind::norm:
        if (spec.layer < 0) weights.final_norm = t;
        else if (spec.hf_key.find("input_layernorm") != std::string::npos)
          weights.layers[spec.layer].input_norm = t;
        else weights.layers[spec.layer].post_norm = t;
        break;
    }
  }
  if (config.tie_word_embeddings) weights.lm_head = weights.embed_tokens;
  return weights;
}

void ModelWeights::init_random(Backend& backend, const LlamaConfig& config, uint64_t seed) const {
  for (size_t i = 0; i < table.size(); ++i) {
    if (table[i].kind == ParamKind::norm) {
      backend.fill(tensors[i], 1.0f);
    } else {
      backend.fill_random(tensors[i], Backend::Distribution::normal, 0.0f,
                          static_cast<float>(config.initializer_range), seed * 1000003 + i);
    }
  }
}

}  // namespace memtune
