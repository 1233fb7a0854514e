#include "memtune/train/run_settings.h"

#include <fmt/format.h>

#include <ostream>

#include "memtune/core/error.h"

namespace memtune {
namespace {

// "key a vs b" for every key of `current` whose value differs in `saved` (keys only one side
// has count as differing: a value that was not recorded cannot be shown to agree).
std::string differences(const nlohmann::json& saved, const nlohmann::json& current) {
  std::string out;
  for (const auto& [key, value] : current.items()) {
    const nlohmann::json before = saved.is_object() && saved.contains(key) ? saved[key] : nlohmann::json();
    if (before == value) continue;
    out += fmt::format("{}{} {} vs {}", out.empty() ? "" : ", ", key, before.is_null() ? "(not recorded)" : before.dump(),
                       value.dump());
  }
  return out;
}

}  // namespace

nlohmann::json run_settings_json(const RunConfig& run, const LlamaConfig& model, const std::string& base_checkpoint) {
  const LoraConfig lora = run.lora_config();
  nlohmann::json math = {
      // The architecture (a config.json's shape fields): another model has other weights.
      {"model.hidden_size", model.hidden_size},
      {"model.intermediate_size", model.intermediate_size},
      {"model.num_hidden_layers", model.num_hidden_layers},
      {"model.num_attention_heads", model.num_attention_heads},
      {"model.num_key_value_heads", model.num_key_value_heads},
      {"model.head_dim", model.head_dim},
      {"model.vocab_size", model.vocab_size},
      {"model.rms_norm_eps", model.rms_norm_eps},
      {"model.rope_theta", model.rope_theta},
      {"model.rope_scaling", model.rope_scaling.type.empty() ? std::string("none")
                                                             : fmt::format("{} x{}", model.rope_scaling.type,
                                                                           model.rope_scaling.factor)},
      {"model.tie_word_embeddings", model.tie_word_embeddings},
      // A random base is a function of its seed; a checkpoint's path may move, its shape is above.
      {"base_weights", base_checkpoint.empty() ? fmt::format("random init, seed {}", run.seed) : "checkpoint"},
      {"precision", std::string(precision_name(run.precision))},
      {"load_in_4bit", run.load_in_4bit},
      {"lora_r", lora.r},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", lora.dropout},
      {"use_rslora", lora.use_rslora},
      {"lora_target_modules", lora.targets_string()}};
  if (run.load_in_4bit) {
    math["bnb_4bit_quant_type"] = std::string(quant_type_name(run.quant.type));
    math["bnb_4bit_use_double_quant"] = run.quant.double_quant;
    math["bnb_4bit_blocksize"] = run.quant.blocksize;
  }
  const nlohmann::json schedule = {
      {"learning_rate", run.learning_rate},
      {"lr_scheduler_type", lr_schedule_name(run.lr_scheduler_type)},
      {"warmup_steps", run.warmup_steps},
      {"max_steps", run.max_steps},
      {"weight_decay", run.weight_decay},
      {"adam_beta1", run.adam_beta1},
      {"adam_beta2", run.adam_beta2},
      {"adam_epsilon", run.adam_epsilon},
      {"max_grad_norm", run.max_grad_norm},
      {"per_device_train_batch_size", run.per_device_train_batch_size},
      {"gradient_accumulation_steps", run.gradient_accumulation_steps}};
  return {{"model", math}, {"schedule", schedule}};
}

void check_resume_settings(const nlohmann::json& saved, const nlohmann::json& current, const std::string& checkpoint,
                           std::ostream& err) {
  if (!saved.is_object()) {
    err << fmt::format("memtune: warning: --resume {}: the checkpoint records no run settings (an older checkpoint): "
                       "precision, quantization and LoRA settings cannot be checked against it\n",
                       checkpoint);
    return;
  }
  const std::string model = differences(saved.value("model", nlohmann::json()), current["model"]);
  MT_USER_CHECK(model.empty(),
                "--resume {}: this run differs from the checkpoint's in what the model computes ({}: checkpoint vs "
                "this run); resume with the checkpoint's settings, or start a new run from its adapter with "
                "--init-adapter {}",
                checkpoint, model, checkpoint);
  const std::string schedule = differences(saved.value("schedule", nlohmann::json()), current["schedule"]);
  if (!schedule.empty())
    err << fmt::format("memtune: warning: --resume {}: continuing with this run's schedule, which differs from the "
                       "checkpoint's ({}: checkpoint vs this run)\n",
                       checkpoint, schedule);
}

}  // namespace memtune
