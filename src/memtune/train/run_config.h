// One validated description of a run, in the Hugging Face / TRL / PEFT option names.
#pragma once

#include <cstdint>
#include <string>

#include "memtune/lora/lora_config.h"
#include "memtune/quant/nf4.h"
#include "memtune/step/llama_step.h"

namespace memtune {

enum class Precision : uint8_t { fp32, fp16, bf16 };
enum class LrSchedule : uint8_t { constant, linear, cosine };

std::string_view precision_name(Precision p);
std::string_view lr_schedule_name(LrSchedule schedule);  // "constant", "linear", "cosine"
// The schedule a name gives; `what` (the option or key) leads the error for any other name.
LrSchedule parse_lr_schedule(std::string_view name, std::string_view what);
DType precision_dtype(Precision p);

struct RunConfig {
  std::string model = "tiny";  // preset, folder with config.json, or config .json
  Precision precision = Precision::fp32;
  std::string attn_implementation = "eager";  // eager | flash (alias: flash_attention_2, sdpa) | cudnn
  std::string loss_implementation = "full";   // full | chunked
  // 256 rows x a 128k vocabulary: 63 MiB of bf16 logits per chunk, small enough that the loss
  // is not the peak of an 8B QLoRA step at 2 x 2048, large enough for full-speed GEMMs.
  int64_t loss_chunk_tokens = 256;
  bool gradient_checkpointing = false;
  // Token rows per chunk of a layer's row-wise parts (norms, projections, LoRA, MLP) where its
  // activations are not saved (with checkpointing the backward recomputes them chunk by chunk;
  // eval); 0 = no chunking, kAutoTokenChunks = chosen by resolved_token_chunk_rows() (and, under
  // a --vram budget, by fit_token_chunks). Same math (LoRA dropout too). The name is from when
  // only the MLP was chunked; it is kept for the configs that use it.
  static constexpr int64_t kAutoTokenChunks = -1;
  int64_t mlp_chunk_tokens = kAutoTokenChunks;
  // Offload the checkpointed layer inputs to pinned host memory between forward and backward,
  // on a copy stream overlapped with compute (needs gradient_checkpointing).
  bool offload_activations = false;
  // Keep the input embedding table in pinned host memory; the GPU gathers its rows over PCIe
  // (a few MiB per micro-batch). It is frozen, so nothing flows back. Saves vocab x hidden x
  // 2 bytes of device memory (1 GB on Llama 3.1 8B). Needs untied embeddings: a tied LM head
  // would read the table in every GEMM.
  bool offload_embeddings = false;
  // Keep AdamW's two moments of every adapter in pinned host memory; the device's AdamW kernel
  // reads and writes them in place over PCIe once a step (16 bytes a trainable parameter: ~0.7 GB
  // a step at r16 on Llama 3.1 8B). Saves 8 bytes a trainable parameter of device memory; the same
  // kernel, so the same update. Single device only (data parallel shards the moments: ZeRO-1).
  bool offload_optimizer = false;
  // The run's rows may hold several samples (train --packing or --padding_free; plan/fit take
  // the same flags): cuDNN attention then plans room for its ragged backward graphs
  // (ops/backend.h, cudnn_attention_workspace_floats). Set by the CLI from those flags.
  bool packed_rows = false;
  // Data parallel: the cap of one gradient all-reduce bucket in MiB (transformers'
  // ddp_bucket_cap_mb, PyTorch DDP's bucket_cap_mb; 25 there too). Smaller buckets start
  // communicating earlier in the backward, larger ones make fewer calls.
  double ddp_bucket_cap_mb = 25;
  // Several GPUs: the frozen base split across the ranks and gathered one unit (layer) at a
  // time, just in time (FSDP-QLoRA; parallel/sharded_base.h). Needs world_size > 1; one rank
  // ignores it (the CLI refuses it there).
  bool shard_base = false;
  // One device: this many of the frozen decoder layers kept in pinned host memory and copied to
  // the device just before each use (forward and backward), on the copy stream, into two
  // layer-sized buffers: the rest of the base stays resident (parallel/sharded_base.h,
  // streamed_base_layout; the layers chosen are spread evenly). The same numbers as the resident
  // base; the device holds (this many - 2) layers fewer. 0: every layer on the device.
  int64_t stream_layers = 0;
  int64_t per_device_train_batch_size = 1;
  int64_t gradient_accumulation_steps = 1;
  int64_t max_seq_length = 256;
  int64_t lora_r = 16;
  double lora_alpha = 16;
  double lora_dropout = 0.0;
  bool use_rslora = false;
  std::string lora_target_modules = "all-linear";
  // The LoRA A products of projections that share an input (q/k/v, gate/up) as one GEMM each
  // (StepOptions::stacked_lora). The same math (CPU test Engine.StackedLoraGivesThePerProjection-
  // Step, GPU test CudaStepTest.WholeStepsMatchTheCpuInEveryPrecisionAndTechnique). On by default:
  // measured 1.3% faster on 8B QLoRA and 16-bit LoRA at 2 x 2048, the same device peak
  // (bench/results/2026-12-06-h100-peers). false: one A GEMM per projection.
  bool stacked_lora = true;
  // With token chunks and a 4-bit base, each chunked pass of a layer dequantizes a projection once
  // instead of once per chunk (StepOptions::hold_chunk_weights); the same math, ~386 MB more at
  // the peak at 8B. fit_token_chunks turns it off where a budget needs that room.
  bool hold_chunk_weights = true;
  double learning_rate = 2e-4;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;  // <= 0: no clipping
  LrSchedule lr_scheduler_type = LrSchedule::constant;
  int64_t warmup_steps = 0;
  int64_t max_steps = 10;
  uint64_t seed = 42;
  // QLoRA, in bitsandbytes' names: load_in_4bit, bnb_4bit_quant_type (quant.type),
  // bnb_4bit_use_double_quant (quant.double_quant), bnb_4bit_blocksize (quant.blocksize),
  // bnb_4bit_compute_dtype (must be the run's 16-bit dtype).
  bool load_in_4bit = false;
  QuantConfig quant;
  std::string bnb_4bit_compute_dtype;  // "" = the run's precision

  // Resolved from the above; throws memtune::Error on contradictions.
  // mlp_chunk_tokens with auto resolved. Chunks cost speed, not memory: each chunk re-runs the
  // LoRA GEMMs at fewer rows and dequantizes a 4-bit base once more (measured: 1024-row chunks
  // cost 16% of tokens/s at 2 x 2048, bench/NOTES.md). So auto chunks only a micro-batch of more
  // than kAutoChunkRows tokens, in chunks of kAutoChunkRows, where the GEMMs are full-sized; a
  // budget that needs smaller chunks gets them from fit_token_chunks.
  static constexpr int64_t kAutoChunkRows = 4096;
  static constexpr int64_t kMaxSeqLength = int64_t{1} << 20;
  static constexpr int64_t kMaxMicroBatchTokens = int64_t{1} << 24;
  static constexpr int64_t kMaxLoraRank = int64_t{1} << 16;
  static constexpr double kMaxBucketCapMb = 1 << 20;  // 1 TiB: bucket bytes fit 64 bits with room
  int64_t resolved_token_chunk_rows() const;
  StepOptions step_options() const;
  LoraConfig lora_config() const;
  void validate() const;
};

// Which LoRA options the user set (on the command line or in the run YAML), as opposed to
// left at their defaults.
struct LoraOptionsGiven {
  bool r = false, alpha = false, dropout = false, use_rslora = false, target_modules = false;
};

// A run that starts from an existing adapter (train --init-adapter, eval --adapter) takes r,
// lora_alpha, lora_dropout, use_rslora and target_modules from the adapter's
// adapter_config.json (`adapter`, read by read_peft_adapter_config), as merge and generate do:
// the defaults would silently scale or shape the adapter differently from how it was trained.
// An option the user gave that contradicts the file is refused (memtune::Error naming both
// values and `source`).
void adopt_adapter_lora_config(RunConfig& run, const LoraConfig& adapter, const LoraOptionsGiven& given,
                               const std::string& source);

// The learning rate at optimizer step `step` (0-based), as transformers' schedulers give it.
double learning_rate_at(const RunConfig& run, int64_t step);

}  // namespace memtune
