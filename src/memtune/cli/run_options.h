// The run options in Hugging Face / TRL / PEFT names, shared by every subcommand.
#pragma once

#include <CLI/CLI.hpp>

#include "memtune/train/run_config.h"
#include "memtune/ops/backend.h"

namespace memtune {

struct RunFlags {
  bool bf16 = false, fp16 = false, fp32 = false;
  std::string lr_scheduler_type = "constant";
  std::string quant_type = "nf4";
};

inline void add_run_options(CLI::App& app, RunConfig& run, RunFlags& flags) {
  app.add_option("--model", run.model, "preset (tiny, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, llama-3.1-70b), a folder with config.json, or a config .json")->capture_default_str();
  app.add_flag("--bf16", flags.bf16, "bf16 base and activations (fp32 LoRA masters, grads, AdamW)");
  app.add_flag("--fp16", flags.fp16, "fp16 base and activations with dynamic loss scaling");
  app.add_flag("--fp32", flags.fp32, "fp32 everything (default)");
  app.add_flag("--gradient_checkpointing,--gradient-checkpointing", run.gradient_checkpointing, "save layer inputs only; recompute in backward");
  app.add_option("--attn_implementation,--attn-implementation", run.attn_implementation, "eager | flash (memtune's kernel) | cudnn (cuDNN fused attention, CUDA builds with cuDNN) | auto (alias sdpa: train on a GPU runs the faster of flash and cudnn at its shape, timed once and cached; elsewhere cudnn where available, else flash)")->capture_default_str();
  app.add_option("--loss_implementation,--loss-implementation", run.loss_implementation, "full | chunked")->capture_default_str();
  app.add_option("--loss_chunk_tokens", run.loss_chunk_tokens, "tokens per chunk of the chunked loss")->capture_default_str();
  app.add_option("--mlp_chunk_tokens", run.mlp_chunk_tokens, "tokens per chunk of a layer's row-wise parts (norms, projections, LoRA, MLP) where its activations are not saved (checkpointing, eval); 0 = no chunking")->capture_default_str();
  app.add_flag("--offload_activations,--offload-activations", run.offload_activations, "offload the checkpointed layer inputs to pinned host memory, overlapped with compute (needs --gradient_checkpointing)");
  app.add_flag("--offload_optimizer,--offload-optimizer", run.offload_optimizer, "keep AdamW's moments in pinned host memory; the GPU updates them there over PCIe once a step (8 bytes a trainable parameter less on the device)");
  app.add_option("--stream_layers,--stream-layers", run.stream_layers, "keep this many frozen decoder layers in pinned host memory and copy each to the GPU just before its use (one device; the same numbers; ~2 layers' worth of buffers stay on the device)");
  app.add_flag("--offload_embeddings,--offload-embeddings", run.offload_embeddings, "keep the input embedding table in pinned host memory; the GPU reads its rows over PCIe (untied embeddings only)");
  app.add_option("--ddp_bucket_cap_mb", run.ddp_bucket_cap_mb, "several GPUs: the cap of one gradient all-reduce bucket in MiB")->capture_default_str();
  app.add_option("--per_device_train_batch_size,--batch", run.per_device_train_batch_size, "micro-batch size")->capture_default_str();
  app.add_option("--gradient_accumulation_steps,--accum", run.gradient_accumulation_steps, "micro-batches per optimizer step")->capture_default_str();
  app.add_option("--max_seq_length,--seq", run.max_seq_length, "tokens per sequence")->capture_default_str();
  app.add_option("--lora_r", run.lora_r, "LoRA rank")->capture_default_str();
  app.add_option("--lora_alpha", run.lora_alpha, "LoRA alpha")->capture_default_str();
  app.add_option("--lora_dropout", run.lora_dropout, "LoRA dropout")->capture_default_str();
  app.add_flag("--use_rslora", run.use_rslora, "scale by alpha/sqrt(r)");
  app.add_option("--lora_target_modules", run.lora_target_modules, "all-linear or q_proj,k_proj,...")->capture_default_str();
  app.add_option("--stacked_lora", run.stacked_lora, "one LoRA A GEMM for q/k/v and one for gate/up (same math, measured faster); false: one per projection")->capture_default_str();
  app.add_option("--hold_chunk_weights", run.hold_chunk_weights, "with token chunks and a 4-bit base: dequantize each projection once per chunked pass, not once per chunk (same math, more memory); false: once per chunk")->capture_default_str();
  app.add_option("--learning_rate,--lr", run.learning_rate)->capture_default_str();
  app.add_option("--weight_decay", run.weight_decay)->capture_default_str();
  app.add_option("--adam_beta1", run.adam_beta1)->capture_default_str();
  app.add_option("--adam_beta2", run.adam_beta2)->capture_default_str();
  app.add_option("--adam_epsilon", run.adam_epsilon)->capture_default_str();
  app.add_option("--max_grad_norm", run.max_grad_norm, "clip by global norm; <= 0 disables")->capture_default_str();
  app.add_option("--lr_scheduler_type", flags.lr_scheduler_type, "constant | linear | cosine")->capture_default_str();
  app.add_option("--warmup_steps", run.warmup_steps)->capture_default_str();
  app.add_option("--max_steps,--steps", run.max_steps, "optimizer steps")->capture_default_str();
  app.add_option("--seed", run.seed)->capture_default_str();
  app.add_flag("--load_in_4bit", run.load_in_4bit, "QLoRA: a frozen 4-bit base (bitsandbytes format)");
  app.add_option("--bnb_4bit_quant_type", flags.quant_type, "nf4 | fp4")->capture_default_str();
  app.add_option("--bnb_4bit_use_double_quant", run.quant.double_quant, "true | false")->capture_default_str();
  app.add_option("--bnb_4bit_blocksize", run.quant.blocksize)->capture_default_str();
  app.add_option("--bnb_4bit_compute_dtype", run.bnb_4bit_compute_dtype, "bfloat16 | float16 | float32 (must match the precision)");
}

// Applies the flags that need resolving; throws memtune::Error on contradictions. A command
// that builds its own configurations from the flags (the ladder) validates those instead.
inline void resolve_run_flags(RunConfig& run, const RunFlags& flags, bool validate = true) {
  MT_USER_CHECK(int(flags.bf16) + int(flags.fp16) + int(flags.fp32) <= 1,
                "--bf16, --fp16 and --fp32 exclude each other");
  if (flags.bf16) run.precision = Precision::bf16;
  if (flags.fp16) run.precision = Precision::fp16;
  if (flags.fp32) run.precision = Precision::fp32;
  run.lr_scheduler_type = parse_lr_schedule(flags.lr_scheduler_type, "--lr_scheduler_type");
  run.quant.type = parse_quant_type(flags.quant_type, "--bnb_4bit_quant_type");
  if (run.attn_implementation == "flash_attention_2") run.attn_implementation = "flash";
  // auto (and sdpa, which in torch picks the fastest fused kernel there is). The device is not
  // chosen yet here: taken as CUDA, which gives flash wherever no GPU can run cuDNN.
  if (run.attn_implementation == "auto" || run.attn_implementation == "sdpa")
    run.attn_implementation = fastest_fused_attention(Device::cuda);
  if (validate) run.validate();
}

}  // namespace memtune
