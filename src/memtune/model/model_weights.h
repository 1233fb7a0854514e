// The frozen base model on a device: one tensor per row of the parameter table.
#pragma once

#include <array>
#include <vector>

#include "memtune/core/memory.h"
#include "memtune/model/param_table.h"

namespace memtune {

class Backend;

struct LayerWeights {
  Tensor input_norm, post_norm;
  std::array<Tensor, kNumProjections> projections;  // indexed by Projection, [out, in]
};

struct ModelWeights {
  std::vector<ParamSpec> table;
  std::vector<Tensor> tensors;  // tensors[i] holds table[i]
  Tensor embed_tokens, final_norm, lm_head;  // lm_head aliases embed_tokens when tied
  std::vector<LayerWeights> layers;

  // Allocates every parameter (category frozen_weights) in `storage` dtype.
  static ModelWeights allocate(Memory& memory, const LlamaConfig& config, DType storage);
  // Seeded random init as transformers does it: normal(0, initializer_range) for matrices,
  // ones for norms. Memory and speed do not depend on the values.
  void init_random(Backend& backend, const LlamaConfig& config, uint64_t seed) const;
  int64_t parameter_count() const { return count_parameters(table); }
};

}  // namespace memtune
