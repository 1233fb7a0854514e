// Inference for the Llama family through the op interface: a prefill over the prompt, then one
// token at a time against a KV cache (`memtune generate`, `memtune logits`).
//
// Per layer, for n new tokens at positions [p, p + n) of one sequence:
//   h = rmsnorm(x, w_in); q = h W_q^T; k, v = h W_k^T, h W_v^T written straight into the cache
//   rows [p, p + n); rope(q), rope(those k rows); a = attention(q, cache rows [0, p + n))
//   x += a W_o^T;  h = rmsnorm(x, w_post);  x += (silu(h W_gate^T) * (h W_up^T)) W_down^T
// then logits = rmsnorm(x, w_final) W_head^T. The attention is the causal flash kernel when the
// cache starts empty (a prefill: q and k have the same positions) and attention_decode (one query
// against the whole cache) for each token appended to a non-empty cache.
//
// LoRA is applied unmerged, as PEFT's forward does: y = x W^T + scale * (x A^T) B^T, with A, B and
// the rank-r intermediate in fp32 (PEFT keeps adapters in fp32 over a 16-bit base) and the sum
// rounded once to the compute dtype. Dropout is off (inference).
//
// Memory: everything (weights, adapter, cache, the activations of the longest forward, logits,
// the backend's workspace) is allocated once, through the same Memory class as training, in one
// arena whose size comes from building the same objects on the meta backend first.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "memtune/core/memory.h"
#include "memtune/lora/merge.h"
#include "memtune/model/model_weights.h"

namespace memtune {

// A PEFT adapter on the device: lora_A [r, in] and lora_B [out, r] in fp32.
struct DeviceAdapter {
  LoraConfig config;
  std::vector<LoraSpec> specs;
  std::vector<Tensor> a, b;  // parallel to specs
  std::vector<int> index;    // layer * kNumProjections + projection -> specs index, or -1

  static DeviceAdapter allocate(Memory& memory, const LlamaConfig& model, const LoraConfig& config);
  void upload(Backend& backend, const PeftAdapter& adapter) const;
  int find(int layer, Projection projection) const {
    return index[layer * kNumProjections + static_cast<int>(projection)];
  }
};

struct GeneratorOptions {
  DType compute_dtype = DType::f32;  // activations, cache and the dense base
  int64_t capacity = 0;              // tokens the KV cache holds (prompt + generated)
  int64_t max_chunk = 0;             // most tokens one forward() takes; <= capacity
  bool all_logits = false;           // forward() may return every position's logits
};

class LlamaGenerator {
 public:
  // Allocates the cache and the buffers of a max_chunk forward from `memory`; forward() allocates
  // nothing more. `adapter` may be null.
  LlamaGenerator(Backend& backend, Memory& memory, const LlamaConfig& config,
                 const ModelWeights& weights, const DeviceAdapter* adapter,
                 const GeneratorOptions& options);

  // Runs `ids` at positions [cached(), cached() + n), appending their keys and values to the
  // cache. Returns fp32 logits: [n, vocab] row-major with all_positions (which needs
  // options.all_logits), else [vocab] of the last position. They are rounded to the compute
  // dtype first, as transformers' lm_head output is before `.float()`. memtune::Error when n is
  // 0, exceeds max_chunk, or the cache would overflow, or an id is outside the vocabulary.
  std::vector<float> forward(std::span<const int32_t> ids, bool all_positions = false);
  void reset() { cached_ = 0; }
  int64_t cached() const { return cached_; }
  const GeneratorOptions& options() const { return options_; }

 private:
  Tensor frozen_weight(int layer, Projection p) const;
  // y = x W^T (+ LoRA) for the n rows of x.
  void linear(int layer, Projection p, const Tensor& x, const Tensor& y);
  // out = RMSNorm of each head's head_dim values of x [rows, heads * head_dim] (Qwen3's q/k norm).
  void head_norm(const Tensor& out, const Tensor& x, const Tensor& weight, int64_t heads);
  void attention(int layer, const Tensor& q, const Tensor& out, int64_t first, int64_t n);

  Backend& backend_;
  const LlamaConfig& config_;
  const ModelWeights& weights_;
  const DeviceAdapter* adapter_;
  GeneratorOptions options_;
  float lora_scale_ = 0.0f;
  int64_t cached_ = 0;
  std::vector<Tensor> k_cache_, v_cache_;  // per layer [capacity, kv_dim]
  Tensor inv_freq_, ids_, positions_;
  Tensor residual_, normed_, rstd_, q_, attn_out_, proj_out_, gate_, up_, mlp_act_, lse_;
  Tensor lora_u_;       // f32 [max_chunk, r]
  // Qwen3 only: the q / k projections' outputs before the per-head norm, and its rstd.
  Tensor q_unnormed_, k_unnormed_, head_rstd_;
  Tensor dequantized_;  // compute dtype, the largest 4-bit projection (QLoRA base only)
  Tensor logits_;       // f32 [max_chunk or 1, vocab]
};

// What a generation session is built from.
struct InferenceSetup {
  std::filesystem::path checkpoint_dir;  // config.json + safetensors; empty: seeded random init
  std::filesystem::path adapter_dir;     // PEFT adapter folder; empty: the base alone
  DType compute_dtype = DType::f32;
  std::optional<QuantConfig> load_in_4bit;  // keep the projections in 4 bits (QLoRA base)
  uint64_t seed = 42;                       // random init (as `memtune train --seed`)
  GeneratorOptions generator;               // compute_dtype is taken from above
};

// The model, the adapter and a generator in one planned arena on a backend.
class InferenceModel {
 public:
  InferenceModel(Backend& backend, const LlamaConfig& config, const InferenceSetup& setup);
  ~InferenceModel();
  InferenceModel(const InferenceModel&) = delete;
  InferenceModel& operator=(const InferenceModel&) = delete;

  LlamaGenerator& generator();
  uint64_t arena_bytes() const { return arena_bytes_; }
  const std::optional<PeftAdapter>& adapter() const { return adapter_; }

 private:
  struct Parts;
  Backend& backend_;
  LlamaConfig config_;
  std::optional<PeftAdapter> adapter_;  // host copy (its config sizes the device adapter)
  uint64_t arena_bytes_ = 0;
  void* arena_ = nullptr;
  std::unique_ptr<Parts> parts_;
};

struct SamplingOptions {
  int64_t max_new_tokens = 128;
  double temperature = 0.0;  // 0: greedy (the first maximum, as torch.argmax)
  double top_p = 1.0;        // nucleus sampling after the temperature (transformers' TopP warper)
  uint64_t seed = 0;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // the new tokens, a stop token included
  std::string stop_reason;      // "eos" or "max_new_tokens"
};

// Prefill over `prompt` (on an empty cache), then one token at a time. on_token sees each new
// token as it is chosen.
GenerationResult generate_tokens(LlamaGenerator& generator, std::span<const int32_t> prompt,
                                 const SamplingOptions& options,
                                 const std::function<void(int32_t)>& on_token = {});

// Picks the next token from fp32 logits (modified in place): greedy at temperature 0, else
// softmax(logits / temperature) restricted to the top_p nucleus, drawn with `rng`.
int32_t sample_token(std::vector<float>& logits, const SamplingOptions& options, std::mt19937_64& rng);

// The ids that end generation: config.json's eos_token_id(s) and generation_config.json's
// eos_token_id (an int or a list) when the folder has one.
std::vector<int32_t> stop_token_ids(const LlamaConfig& config, const std::filesystem::path& model_dir);

}  // namespace memtune
