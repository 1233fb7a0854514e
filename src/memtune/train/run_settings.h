// What a resumable checkpoint records of the run that wrote it, so that --resume refuses a run
// that would silently compute something else from it.
//
// Two groups, in trainer_state.json's "run_settings":
//  - "model": what changes the function the adapter is trained in: the model's architecture,
//    its base weights (a checkpoint, or a random init and its seed), the precision, the 4-bit
//    quantization and the LoRA settings. Changing one on resume is refused: the adapter and the
//    optimizer state would be applied to another function (the data position, max_seq_length and
//    packing, is checked with the data).
//  - "schedule": what changes only how the optimizer goes on (learning rate, scheduler, warmup,
//    max_steps, AdamW's settings, clipping, the effective batch). A change is taken, with a
//    warning, as transformers takes a changed TrainingArguments on resume.
// What changes memory only (checkpointing, attention kernel, chunking, offload) may change.
#pragma once

#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>

#include "memtune/model/llama_config.h"
#include "memtune/train/run_config.h"

namespace memtune {

// {"model": {...}, "schedule": {...}}. `base_checkpoint`: the base model folder; empty for a
// seeded random init (whose seed is then part of the model).
nlohmann::json run_settings_json(const RunConfig& run, const LlamaConfig& model, const std::string& base_checkpoint);

// Compares a checkpoint's "run_settings" (`saved`; null for a checkpoint written before they
// were recorded: a warning) with this run's. memtune::Error listing every "model" setting that
// differs (checkpoint's value, then this run's); a warning on `err` for "schedule" differences.
void check_resume_settings(const nlohmann::json& saved, const nlohmann::json& current, const std::string& checkpoint,
                           std::ostream& err);

}  // namespace memtune
