#include "memtune/model/model_weights.h"

#include "memtune/ops/backend.h"
#include "memtune/quant/nf4.h"

namespace memtune {

namespace {

Quantized4bit allocate_quantized(Memory& memory, const std::string& key, Shape shape,
                                 const QuantConfig& config) {
  Quantized4bit q;
  q.config = config;
  q.shape = shape;
  const int64_t n = shape.numel();
  const int64_t blocks = (n + config.blocksize - 1) / config.blocksize;
  q.packed = memory.alloc(key, MemCategory::frozen_weights, DType::u8, Shape{(n + 1) / 2});
  q.code_map = memory.alloc(key + ".quant_map", MemCategory::quant_constants, DType::f32, Shape{16});
  if (config.double_quant) {
    q.absmax = memory.alloc(key + ".absmax", MemCategory::quant_constants, DType::u8, Shape{blocks});
    q.nested_absmax = memory.alloc(key + ".nested_absmax", MemCategory::quant_constants, DType::f32,
                                   Shape{(blocks + config.nested_blocksize - 1) / config.nested_blocksize});
    q.nested_map = memory.alloc(key + ".nested_quant_map", MemCategory::quant_constants, DType::f32, Shape{256});
  } else {
    q.absmax = memory.alloc(key + ".absmax", MemCategory::quant_constants, DType::f32, Shape{blocks});
  }
  return q;
}

}  // namespace

ModelWeights ModelWeights::allocate(Memory& memory, const LlamaConfig& config, DType storage,
                                    const QuantConfig* quant) {
  ModelWeights weights;
  weights.table = base_parameter_table(config);
  weights.layers.resize(config.num_hidden_layers);
  for (const ParamSpec& spec : weights.table) {
    if (quant != nullptr && spec.kind == ParamKind::linear) {
      weights.layers[spec.layer].quantized[static_cast<int>(spec.projection)] =
          allocate_quantized(memory, spec.hf_key, spec.shape, *quant);
      weights.tensors.emplace_back();
      continue;
    }
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

bool ModelWeights::is_quantized(size_t index) const {
  const ParamSpec& spec = table[index];
  return spec.kind == ParamKind::linear &&
         !layers[spec.layer].quantized[static_cast<int>(spec.projection)].empty();
}

void ModelWeights::upload(Backend& backend, size_t index, const void* host, DType host_dtype) {
  const ParamSpec& spec = table[index];
  if (is_quantized(index)) {
    Quantized4bit& q = layers[spec.layer].quantized[static_cast<int>(spec.projection)];
    const QuantizedWeight quantized = quantize_4bit(host, host_dtype, spec.shape, q.config, spec.hf_key);
    backend.copy_from_host(q.packed, quantized.packed.data());
    backend.copy_from_host(q.code_map, quantized.quant_map.data());
    if (q.config.double_quant) {
      backend.copy_from_host(q.absmax, quantized.absmax_codes.data());
      backend.copy_from_host(q.nested_absmax, quantized.nested_absmax.data());
      backend.copy_from_host(q.nested_map, quantized.nested_quant_map.data());
      q.nested_offset = quantized.nested_offset;  // a scalar: kept on the host
    } else {
      backend.copy_from_host(q.absmax, quantized.absmax.data());
    }
    return;
  }
  copy_from_host_converted(backend, tensors[index], host, host_dtype);
}

void ModelWeights::init_random(Backend& backend, const LlamaConfig& config, uint64_t seed) {
  for (size_t i = 0; i < table.size(); ++i) {
    if (is_quantized(i)) {
      // Quantized on the host from the same values a dense run draws.
      std::vector<float> host(table[i].shape.numel());
      for (size_t e = 0; e < host.size(); ++e)
        host[e] = random_value(Backend::Distribution::normal, 0.0f,
                               static_cast<float>(config.initializer_range), seed * 1000003 + i, e);
      upload(backend, i, host.data(), DType::f32);
    } else if (table[i].kind == ParamKind::norm) {
      backend.fill(tensors[i], 1.0f);
    } else {
      backend.fill_random(tensors[i], Backend::Distribution::normal, 0.0f,
                          static_cast<float>(config.initializer_range), seed * 1000003 + i);
    }
  }
}

}  // namespace memtune
