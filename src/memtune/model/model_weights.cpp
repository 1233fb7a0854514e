#include "memtune/model/model_weights.h"

#include <algorithm>

#include "memtune/core/error.h"
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

// The device buffer for the dense weight that quantize_4bit reads, while weights are initialised
// or loaded (before training starts). It is the lent tensor (Memory::free_tail: planned arena
// space that no buffer uses yet) when that is large enough; otherwise a temporary allocation
// outside the arena, freed on every path out (quantize_4bit throws for NaN / Inf weights).
class ScratchArena {
 public:
  ScratchArena(Backend& backend, uint64_t bytes, const Tensor& lent)
      : backend_(backend),
        owned_(bytes > 0 && lent.nbytes() < bytes),
        base_(owned_ ? backend.allocate_arena(bytes) : lent.data),
        bytes_(owned_ ? bytes : lent.nbytes()) {}
  ~ScratchArena() {
    if (owned_) backend_.free_arena(base_);
  }
  ScratchArena(const ScratchArena&) = delete;
  ScratchArena& operator=(const ScratchArena&) = delete;

  Tensor tensor(DType dtype, Shape shape) const {
    Tensor t{base_, dtype, shape, backend_.device()};
    MT_ASSERT(t.nbytes() <= bytes_, "scratch of {} bytes for {} {}", bytes_, dtype_name(dtype), shape.str());
    return t;
  }

 private:
  Backend& backend_;
  bool owned_;
  void* base_;
  uint64_t bytes_;
};

}  // namespace

ModelWeights ModelWeights::allocate(Memory& memory, const LlamaConfig& config, DType storage,
                                    const QuantConfig* quant, Backend* embeddings_on_host) {
  MT_USER_CHECK(embeddings_on_host == nullptr || !config.tie_word_embeddings,
                "offload_embeddings needs untied embeddings: this model's LM head is its embedding "
                "table, which every LM-head GEMM would then read over PCIe");
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
    Tensor t;
    if (spec.kind == ParamKind::embedding && embeddings_on_host != nullptr) {
      t = allocate_host_tensor(*embeddings_on_host, memory, spec.hf_key, storage, spec.shape, weights.host_storage);
    } else {
      t = memory.alloc(spec.hf_key, MemCategory::frozen_weights, storage, spec.shape);
    }
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
      case ParamKind::bias:
      case ParamKind::head_norm: *weights.layers[spec.layer].field_for(spec) = t; break;
    }
  }
  if (config.tie_word_embeddings) weights.lm_head = weights.embed_tokens;
  return weights;
}

Tensor* LayerWeights::field_for(const ParamSpec& spec) {
  const int p = static_cast<int>(spec.projection);
  switch (spec.kind) {
    case ParamKind::bias: return &bias[p];
    case ParamKind::head_norm: return spec.projection == Projection::q ? &q_norm : &k_norm;
    default: MT_ASSERT(false, "{} is not a bias or a head norm", spec.hf_key);
  }
  return nullptr;
}

bool ModelWeights::is_quantized(size_t index) const {
  const ParamSpec& spec = table[index];
  return spec.kind == ParamKind::linear &&
         !layers[spec.layer].quantized[static_cast<int>(spec.projection)].empty();
}

void ModelWeights::upload(Backend& backend, size_t index, const void* host, DType host_dtype,
                          const Tensor& lent_scratch) {
  const ParamSpec& spec = table[index];
  if (is_quantized(index)) {
    // Quantized on the backend's device: the dense weight goes to a scratch there first (its
    // own dtype: the codes do not depend on where it is quantized, and a bf16 checkpoint needs
    // half the bytes of f32). On the CPU backend this is the host reference itself.
    Quantized4bit& q = layers[spec.layer].quantized[static_cast<int>(spec.projection)];
    ScratchArena scratch(backend, static_cast<uint64_t>(spec.shape.numel()) * dtype_size(host_dtype), lent_scratch);
    const Tensor dense = scratch.tensor(host_dtype, spec.shape);
    backend.copy_from_host(dense, host);
    backend.quantize_4bit(q, dense, spec.hf_key);
    return;
  }
  copy_from_host_converted(backend, tensors[index], host, host_dtype);
}

void ModelWeights::upload_quantized(Backend& backend, size_t index, const QuantizedWeight& weight) {
  const ParamSpec& spec = table[index];
  MT_ASSERT(is_quantized(index), "upload_quantized: {} is not stored in 4 bits", spec.hf_key);
  Quantized4bit& q = layers[spec.layer].quantized[static_cast<int>(spec.projection)];
  const QuantConfig& want = q.config;
  const QuantConfig& got = weight.config;
  MT_USER_CHECK(got.type == want.type, "{}: the checkpoint's quant type {} differs from the run's "
                "--bnb_4bit_quant_type {}", spec.hf_key, quant_type_name(got.type), quant_type_name(want.type));
  MT_USER_CHECK(got.blocksize == want.blocksize, "{}: the checkpoint's blocksize {} differs from the "
                "run's --bnb_4bit_blocksize {}", spec.hf_key, got.blocksize, want.blocksize);
  MT_USER_CHECK(got.double_quant == want.double_quant, "{}: the checkpoint's double quant {} differs "
                "from the run's --bnb_4bit_use_double_quant {}", spec.hf_key, got.double_quant, want.double_quant);
  MT_USER_CHECK(!want.double_quant || got.nested_blocksize == want.nested_blocksize,
                "{}: the checkpoint's nested blocksize {} differs from the run's {}", spec.hf_key,
                got.nested_blocksize, want.nested_blocksize);
  MT_USER_CHECK(weight.shape == spec.shape, "{}: the checkpoint's shape {} differs from the model's {}",
                spec.hf_key, weight.shape.str(), spec.shape.str());
  const auto copy = [&](const Tensor& dst, const void* src, size_t bytes, const char* what) {
    MT_USER_CHECK(dst.nbytes() == bytes, "{}: {} holds {} bytes, the run's layout {}", spec.hf_key, what,
                  bytes, dst.nbytes());
    backend.copy_from_host(dst, src);
  };
  copy(q.packed, weight.packed.data(), weight.packed.size(), "weight");
  copy(q.code_map, weight.quant_map.data(), weight.quant_map.size() * sizeof(float), "weight.quant_map");
  if (want.double_quant) {
    copy(q.absmax, weight.absmax_codes.data(), weight.absmax_codes.size(), "weight.absmax");
    copy(q.nested_absmax, weight.nested_absmax.data(), weight.nested_absmax.size() * sizeof(float),
         "weight.nested_absmax");
    copy(q.nested_map, weight.nested_quant_map.data(), weight.nested_quant_map.size() * sizeof(float),
         "weight.nested_quant_map");
    q.nested_offset = weight.nested_offset;
  } else {
    copy(q.absmax, weight.absmax.data(), weight.absmax.size() * sizeof(float), "weight.absmax");
    q.nested_offset = 0.0f;
  }
}

void ModelWeights::init_random(Backend& backend, const LlamaConfig& config, uint64_t seed,
                               const Tensor& lent_scratch) {
  std::vector<size_t> all(table.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  init_random_rows(backend, config, seed, all, lent_scratch);
}

std::vector<std::pair<std::string, Tensor*>> ModelWeights::named_buffers() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (size_t i = 0; i < table.size(); ++i) {
    const ParamSpec& spec = table[i];
    if (is_quantized(i)) {
      Quantized4bit& q = layers[spec.layer].quantized[static_cast<int>(spec.projection)];
      out.emplace_back(spec.hf_key, &q.packed);
      out.emplace_back(spec.hf_key + ".quant_map", &q.code_map);
      out.emplace_back(spec.hf_key + ".absmax", &q.absmax);
      if (q.config.double_quant) {
        out.emplace_back(spec.hf_key + ".nested_absmax", &q.nested_absmax);
        out.emplace_back(spec.hf_key + ".nested_quant_map", &q.nested_map);
      }
      continue;
    }
    out.emplace_back(spec.hf_key, &tensors[i]);
    switch (spec.kind) {
      case ParamKind::embedding:
        out.emplace_back(spec.hf_key, &embed_tokens);
        // Tied: the table has no LM head row, and lm_head is the embedding's buffer.
        if (std::none_of(table.begin(), table.end(), [](const ParamSpec& s) { return s.kind == ParamKind::lm_head; }))
          out.emplace_back(spec.hf_key, &lm_head);
        break;
      case ParamKind::lm_head: out.emplace_back(spec.hf_key, &lm_head); break;
      case ParamKind::linear:
        out.emplace_back(spec.hf_key, &layers[spec.layer].projections[static_cast<int>(spec.projection)]);
        break;
      case ParamKind::norm:
        if (spec.layer < 0) out.emplace_back(spec.hf_key, &final_norm);
        else if (spec.hf_key.find("input_layernorm") != std::string::npos)
          out.emplace_back(spec.hf_key, &layers[spec.layer].input_norm);
        else out.emplace_back(spec.hf_key, &layers[spec.layer].post_norm);
        break;
      case ParamKind::bias:
      case ParamKind::head_norm: out.emplace_back(spec.hf_key, layers[spec.layer].field_for(spec)); break;
    }
  }
  return out;
}

void ModelWeights::init_random_rows(Backend& backend, const LlamaConfig& config, uint64_t seed,
                                    const std::vector<size_t>& indices, const Tensor& lent_scratch) {
  const float std_dev = static_cast<float>(config.initializer_range);
  // 4-bit projections are drawn on the device into one f32 scratch (the largest projection's
  // size, freed on return) and quantized there: the same f32 values a dense run draws
  // (fill_random's counter-based values), so the codes do not depend on the backend beyond
  // fill_random's own (last-bit) agreement.
  int64_t largest_quantized = 0;
  for (size_t i : indices)
    if (is_quantized(i)) largest_quantized = std::max(largest_quantized, table[i].shape.numel());
  ScratchArena scratch(backend, static_cast<uint64_t>(largest_quantized) * sizeof(float), lent_scratch);
  for (size_t i : indices) {
    const uint64_t tensor_seed = seed * 1000003 + i;
    if (is_quantized(i)) {
      const ParamSpec& spec = table[i];
      const Tensor dense = scratch.tensor(DType::f32, spec.shape);
      backend.fill_random(dense, Backend::Distribution::normal, 0.0f, std_dev, tensor_seed);
      backend.quantize_4bit(layers[spec.layer].quantized[static_cast<int>(spec.projection)], dense,
                            spec.hf_key);
    } else if (table[i].kind == ParamKind::norm || table[i].kind == ParamKind::head_norm) {
      backend.fill(tensors[i], 1.0f);
    } else if (table[i].kind == ParamKind::bias) {
      // transformers' _init_weights zeroes every nn.Linear bias.
      backend.fill(tensors[i], 0.0f);
    } else {
      backend.fill_random(tensors[i], Backend::Distribution::normal, 0.0f, std_dev, tensor_seed);
    }
  }
}

}  // namespace memtune
