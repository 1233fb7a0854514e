#include "memtune/train/run_config.h"

#include <cmath>

#include "memtune/core/enum_names.h"
#include "memtune/core/error.h"

namespace memtune {

namespace {

constexpr EnumName<Precision> kPrecisionNames[] = {
    {Precision::fp32, "fp32"}, {Precision::fp16, "fp16"}, {Precision::bf16, "bf16"}};
// transformers' lr_scheduler_type names.
constexpr EnumName<LrSchedule> kLrScheduleNames[] = {
    {LrSchedule::constant, "constant"}, {LrSchedule::linear, "linear"}, {LrSchedule::cosine, "cosine"}};

}  // namespace

std::string_view precision_name(Precision p) { return name_of(kPrecisionNames, p); }

std::string_view lr_schedule_name(LrSchedule schedule) { return name_of(kLrScheduleNames, schedule); }

LrSchedule parse_lr_schedule(std::string_view name, std::string_view what) {
  const std::optional<LrSchedule> schedule = value_of(kLrScheduleNames, name);
  MT_USER_CHECK(schedule.has_value(), "{} {}: expected {}", what, name, names_of(kLrScheduleNames));
  return *schedule;
}

DType precision_dtype(Precision p) {
  switch (p) {
    case Precision::fp16: return DType::f16;
    case Precision::bf16: return DType::bf16;
    default: return DType::f32;
  }
}

void RunConfig::validate() const {
  MT_USER_CHECK(attn_implementation == "eager" || attn_implementation == "flash" ||
                    attn_implementation == "flash_attention_2" || attn_implementation == "sdpa" ||
                    attn_implementation == "cudnn",
                "attn_implementation '{}' is not one of eager, flash (flash_attention_2), cudnn",
                attn_implementation);
  MT_USER_CHECK(loss_implementation == "full" || loss_implementation == "chunked",
                "loss_implementation '{}' is not one of full, chunked", loss_implementation);
  MT_USER_CHECK(per_device_train_batch_size > 0, "per_device_train_batch_size must be >= 1");
  MT_USER_CHECK(gradient_accumulation_steps > 0, "gradient_accumulation_steps must be >= 1");
  MT_USER_CHECK(max_seq_length > 1, "max_seq_length must be >= 2 (a token and its next token)");
  // Bounds that keep every planned byte count within 64 bits (with the model sizes that
  // LlamaConfig accepts), far above what a device holds: 1M tokens per sequence, 16M per micro-batch.
  MT_USER_CHECK(max_seq_length <= kMaxSeqLength, "max_seq_length {} is over the {} tokens memtune plans for",
                max_seq_length, kMaxSeqLength);
  MT_USER_CHECK(per_device_train_batch_size <= kMaxMicroBatchTokens / max_seq_length,
                "per_device_train_batch_size {} x max_seq_length {} is over the {} tokens per micro-batch memtune "
                "plans for", per_device_train_batch_size, max_seq_length, kMaxMicroBatchTokens);
  MT_USER_CHECK(lora_r <= kMaxLoraRank, "lora_r {} is over {}", lora_r, kMaxLoraRank);
  MT_USER_CHECK(loss_chunk_tokens > 0, "loss_chunk_tokens must be >= 1");
  MT_USER_CHECK(mlp_chunk_tokens >= 0 || mlp_chunk_tokens == kAutoTokenChunks,
                "mlp_chunk_tokens must be >= 0 (0: no chunking) or -1 (auto)");
  MT_USER_CHECK(!offload_activations || gradient_checkpointing,
                "offload_activations needs gradient_checkpointing: it offloads the layer inputs that "
                "checkpointing saves (add --gradient_checkpointing)");
  MT_USER_CHECK(stream_layers >= 0, "stream_layers {}: expected 0 or more layers", stream_layers);
  MT_USER_CHECK(stream_layers == 0 || !shard_base, "stream_layers with shard_base: the sharded base already keeps "
                "only a shard of each layer on a rank; use one or the other");
  MT_USER_CHECK(lora_r > 0, "lora_r must be >= 1");
  MT_USER_CHECK(lora_alpha > 0 && std::isfinite(lora_alpha), "lora_alpha must be positive and finite");
  MT_USER_CHECK(lora_dropout >= 0 && lora_dropout < 1, "lora_dropout must be in [0, 1)");
  MT_USER_CHECK(learning_rate >= 0 && std::isfinite(learning_rate), "learning_rate must be >= 0");
  MT_USER_CHECK(adam_beta1 >= 0 && adam_beta1 < 1 && adam_beta2 >= 0 && adam_beta2 < 1,
                "adam betas must be in [0, 1)");
  // An infinite epsilon would make every update zero: a run that trains nothing, silently.
  MT_USER_CHECK(adam_epsilon > 0 && std::isfinite(adam_epsilon), "adam_epsilon must be positive and finite");
  MT_USER_CHECK(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay must be >= 0 and finite");
  // <= 0 turns clipping off; NaN would too, silently (every comparison with it is false).
  MT_USER_CHECK(!std::isnan(max_grad_norm), "max_grad_norm must be a number (<= 0 turns clipping off)");
  // The bucket's bytes are an integer: a size past 1 TiB (or infinite) would not convert.
  MT_USER_CHECK(ddp_bucket_cap_mb > 0 && ddp_bucket_cap_mb <= kMaxBucketCapMb,
                "ddp_bucket_cap_mb {}: expected a positive size up to {} MiB", ddp_bucket_cap_mb, kMaxBucketCapMb);
  MT_USER_CHECK(max_steps >= 0, "max_steps must be >= 0");
  MT_USER_CHECK(warmup_steps >= 0, "warmup_steps must be >= 0");
  LoraConfig::parse_targets(lora_target_modules);
  if (load_in_4bit) {
    validate_quant_config(quant);
    if (!bnb_4bit_compute_dtype.empty()) {
      const std::string& c = bnb_4bit_compute_dtype;
      const Precision wanted = (c == "bfloat16" || c == "bf16") ? Precision::bf16
                               : (c == "float16" || c == "fp16") ? Precision::fp16
                               : (c == "float32" || c == "fp32") ? Precision::fp32
                               : (mt_fail("bnb_4bit_compute_dtype {}: expected bfloat16, float16 or float32", c), Precision::fp32);
      MT_USER_CHECK(wanted == precision,
                    "bnb_4bit_compute_dtype {} contradicts the run's precision {}: the 4-bit base is "
                    "dequantized into the run's compute dtype (use --{} or drop the option)",
                    c, precision_name(precision), precision_name(wanted));
    }
  } else {
    MT_USER_CHECK(bnb_4bit_compute_dtype.empty(), "bnb_4bit_compute_dtype needs --load_in_4bit");
  }
}

StepOptions RunConfig::step_options() const {
  validate();
  StepOptions o;
  o.compute_dtype = precision_dtype(precision);
  o.attention = attn_implementation == "eager"   ? AttentionImpl::eager
                : attn_implementation == "cudnn" ? AttentionImpl::cudnn
                                                 : AttentionImpl::flash;
  o.loss = loss_implementation == "chunked" ? LossImpl::chunked : LossImpl::full;
  o.loss_chunk_tokens = loss_chunk_tokens;
  o.gradient_checkpointing = gradient_checkpointing;
  o.mlp_chunk_tokens = resolved_token_chunk_rows();
  o.offload_activations = offload_activations;
  o.packed_rows = packed_rows;
  o.stacked_lora = stacked_lora;
  o.hold_chunk_weights = hold_chunk_weights;
  o.micro_batch = per_device_train_batch_size;
  o.seq = max_seq_length;
  return o;
}

int64_t RunConfig::resolved_token_chunk_rows() const {
  if (mlp_chunk_tokens != kAutoTokenChunks) return mlp_chunk_tokens;
  return per_device_train_batch_size * max_seq_length > kAutoChunkRows ? kAutoChunkRows : 0;
}

LoraConfig RunConfig::lora_config() const {
  LoraConfig l;
  l.r = lora_r;
  l.alpha = lora_alpha;
  l.dropout = lora_dropout;
  l.use_rslora = use_rslora;
  l.targets = LoraConfig::parse_targets(lora_target_modules);
  return l;
}

void adopt_adapter_lora_config(RunConfig& run, const LoraConfig& adapter, const LoraOptionsGiven& given,
                               const std::string& source) {
  // Only the options the user gave are compared: the others take the adapter's values.
  LoraConfig asked = adapter;
  if (given.r) asked.r = run.lora_r;
  if (given.alpha) asked.alpha = run.lora_alpha;
  if (given.dropout) asked.dropout = run.lora_dropout;
  if (given.use_rslora) asked.use_rslora = run.use_rslora;
  if (given.target_modules) asked.targets = LoraConfig::parse_targets(run.lora_target_modules);
  const std::string differences = lora_config_differences(asked, adapter);
  MT_USER_CHECK(differences.empty(),
                "the options contradict the adapter's {}/adapter_config.json ({}: option vs file); drop the "
                "options to use the adapter's values",
                source, differences);
  run.lora_r = adapter.r;
  run.lora_alpha = adapter.alpha;
  run.lora_dropout = adapter.dropout;
  run.use_rslora = adapter.use_rslora;
  run.lora_target_modules = adapter.targets_string();
}

double learning_rate_at(const RunConfig& run, int64_t step) {
  const double base = run.learning_rate;
  if (step < run.warmup_steps) return base * static_cast<double>(step) / std::max<int64_t>(1, run.warmup_steps);
  if (run.lr_scheduler_type == LrSchedule::constant) return base;
  const double progress = static_cast<double>(step - run.warmup_steps) /
                          std::max<int64_t>(1, run.max_steps - run.warmup_steps);
  if (run.lr_scheduler_type == LrSchedule::linear) return base * std::max(0.0, 1.0 - progress);
  return base * std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
}

}  // namespace memtune
