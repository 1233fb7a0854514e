// The frozen base model on a device: one tensor per row of the parameter table.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "memtune/core/memory.h"
#include "memtune/model/param_table.h"
#include "memtune/ops/backend.h"
#include "memtune/quant/nf4.h"

namespace memtune {

struct LayerWeights {
  Tensor input_norm, post_norm;
  // Indexed by Projection, [out, in]. With a 4-bit base the dense tensor is empty and the
  // quantized form holds the weight.
  std::array<Tensor, kNumProjections> projections;
  std::array<Quantized4bit, kNumProjections> quantized;
  // Indexed by Projection: the frozen bias [out] where the family has one (Qwen2: q, k, v), else
  // empty. Biases stay in the storage dtype under 4-bit quantization, as bitsandbytes keeps them.
  std::array<Tensor, kNumProjections> bias;
  // Qwen3's per-head RMSNorm weights [head_dim] on q and k; empty for other families.
  Tensor q_norm, k_norm;
  // The field that holds a bias or head_norm row of the parameter table.
  Tensor* field_for(const ParamSpec& spec);
};

struct ModelWeights {
  std::vector<ParamSpec> table;
  std::vector<Tensor> tensors;  // tensors[i] holds table[i]
  Tensor embed_tokens, final_norm, lm_head;  // lm_head aliases embed_tokens when tied
  std::vector<LayerWeights> layers;
  // Host memory that some tensors live in (offload_embeddings); freed with the last copy.
  std::shared_ptr<void> host_storage;

  // Allocates every parameter (category frozen_weights) in `storage` dtype; with `quant`, the
  // seven projections are stored in 4 bits (codes: frozen_weights; absmax and maps:
  // quant_constants) and embeddings, norms and the LM head stay in `storage`.
  // embeddings_on_host: the input embedding table lives in host memory from
  // backend.allocate_host (pinned on CUDA, where kernels read it through unified addressing),
  // recorded in memory.record_host instead of the arena. Untied embeddings only.
  static ModelWeights allocate(Memory& memory, const LlamaConfig& config, DType storage,
                               const QuantConfig* quant = nullptr,
                               Backend* embeddings_on_host = nullptr);
  // Seeded random init as transformers does it: normal(0, initializer_range) for matrices,
  // ones for norms. Memory and speed do not depend on the values. Tensor i draws
  // fill_random(seed * 1000003 + i); a 4-bit projection draws those f32 values into a temporary
  // device scratch (the largest projection's size in f32, outside the arena, freed on return)
  // and is quantized there by backend.quantize_4bit. lent_scratch (u8, device): space to use
  // for that scratch instead when it is large enough (the engine lends Memory::free_tail, so that
  // nothing is allocated outside the plan).
  void init_random(Backend& backend, const LlamaConfig& config, uint64_t seed,
                   const Tensor& lent_scratch = Tensor{});
  // The same for table rows `indices` only (each draws exactly what init_random gives it): the
  // sharded base initialises one unit at a time.
  void init_random_rows(Backend& backend, const LlamaConfig& config, uint64_t seed,
                        const std::vector<size_t>& indices, const Tensor& lent_scratch = Tensor{});
  // Every tensor field that holds a buffer allocate() recorded, with that record's name (a
  // buffer held by several fields, as tensors[i] and its typed alias, appears once per field).
  // The sharded base points them at the gathered bytes of their unit.
  std::vector<std::pair<std::string, Tensor*>> named_buffers();
  // Stores table[index] from host data (f32/f16/bf16), converting or quantizing it. A 4-bit
  // projection is copied to a temporary device scratch in host_dtype and quantized there by
  // backend.quantize_4bit (the host reference on the CPU backend); NaN / Inf throws
  // memtune::Error naming the tensor. lent_scratch as for init_random.
  void upload(Backend& backend, size_t index, const void* host, DType host_dtype,
              const Tensor& lent_scratch = Tensor{});
  // Stores a 4-bit projection (is_quantized(index)) from a pre-quantized checkpoint weight: the
  // codes, absmax (or absmax codes + nested absmax), maps and nested offset are copied as they
  // are. A weight whose quant type, blocksize, double quant or nested blocksize differs from the
  // run's quant config, or whose shape differs from the table's, throws memtune::Error naming
  // the tensor and both values.
  void upload_quantized(Backend& backend, size_t index, const QuantizedWeight& weight);
  bool is_quantized(size_t index) const;
  int64_t parameter_count() const { return count_parameters(table); }
};

}  // namespace memtune
