#include "memtune/plan/fit.h"

#include <fmt/format.h>

#include <vector>

#include "memtune/core/bytes.h"
#include "memtune/train/engine.h"

namespace memtune {
namespace {

struct Candidate {
  const char* name;
  // Expected cost against bf16 + flash, the fastest setting: a lead for ordering, not a
  // measurement (the ladder measures it): checkpointing recomputes the forward (~+30% FLOPs),
  // the 4-bit base dequantizes every projection twice per step.
  const char* expected_slowdown;
  bool qlora, checkpointing;
};

constexpr Candidate kCandidates[] = {
    {"bf16 + flash + chunked loss", "none", false, false},
    {"+ QLoRA", "~5-10% (dequantization)", true, false},
    {"+ gradient checkpointing", "~25-30% (recompute)", false, true},
    {"+ QLoRA + gradient checkpointing", "~30-40%", true, true},
};

}  // namespace

bool fit_token_chunks(RunConfig& run, const LlamaConfig& model, uint64_t budget, uint64_t context,
                      int world_size) {
  const auto fits = [&](const RunConfig& r) {
    return plan_run(r, model, Device::cuda, world_size).arena_bytes + context <= budget;
  };
  if (run.mlp_chunk_tokens != RunConfig::kAutoTokenChunks) return fits(run);
  const int64_t tokens = run.per_device_train_batch_size * run.max_seq_length;
  std::vector<int64_t> chunks{run.resolved_token_chunk_rows()};
  for (int64_t rows : {2048, 1024, 512, 256})
    if (rows < tokens && (chunks.back() == 0 || rows < chunks.back())) chunks.push_back(rows);
  for (int64_t rows : chunks) {
    run.mlp_chunk_tokens = rows;
    if (fits(run)) return true;
  }
  return false;
}

std::string fit_flags(const RunConfig& r) {
  std::string flags = fmt::format("--{} --attn_implementation {} --loss_implementation {}", precision_name(r.precision),
                                  r.attn_implementation, r.loss_implementation);
  if (r.load_in_4bit) flags += " --load_in_4bit";
  if (r.gradient_checkpointing) flags += " --gradient_checkpointing";
  if (r.offload_activations) flags += " --offload_activations";
  flags += fmt::format(" --per_device_train_batch_size {} --gradient_accumulation_steps {}", r.per_device_train_batch_size,
                       r.gradient_accumulation_steps);
  if (r.mlp_chunk_tokens > 0) flags += fmt::format(" --mlp_chunk_tokens {}", r.mlp_chunk_tokens);
  return flags;
}

FitResult fit_run(const RunConfig& base, const LlamaConfig& model, uint64_t budget, uint64_t context) {
  FitResult result;
  const int64_t effective = base.per_device_train_batch_size * base.gradient_accumulation_steps;
  result.explanation = fmt::format("budget {} ({} of it CUDA context), effective batch {} x seq {}:\n",
                                   format_bytes(budget), format_bytes(context), effective, base.max_seq_length);
  for (const Candidate& candidate : kCandidates) {
    RunConfig run = base;
    if (run.precision == Precision::fp32) run.precision = Precision::bf16;
    run.attn_implementation = "flash";
    run.loss_implementation = "chunked";
    run.load_in_4bit = candidate.qlora;
    run.gradient_checkpointing = candidate.checkpointing;
    // The largest micro-batch that divides the effective batch and fits.
    for (int64_t micro = effective; micro >= 1; --micro) {
      if (effective % micro != 0) continue;
      run.per_device_train_batch_size = micro;
      run.gradient_accumulation_steps = effective / micro;
      run.mlp_chunk_tokens = base.mlp_chunk_tokens;  // auto again for every micro-batch
      if (!fit_token_chunks(run, model, budget, context)) continue;
      const uint64_t planned = plan_run(run, model).arena_bytes;
      result.explanation += fmt::format("  {:<36} fits at micro-batch {} x accumulation {}{}: {} (expected slowdown {})\n",
                                        candidate.name, micro, effective / micro,
                                        run.resolved_token_chunk_rows() > 0
                                            ? fmt::format(", token chunks of {}", run.resolved_token_chunk_rows())
                                            : std::string(),
                                        format_bytes(planned + context), candidate.expected_slowdown);
      if (!result.fits) {
        result.fits = true;
        result.run = run;
        result.planned_bytes = planned;
        result.with_context_bytes = planned + context;
      }
      break;
    }
    if (!result.fits)
      result.explanation += fmt::format("  {:<36} does not fit even at micro-batch 1\n", candidate.name);
    if (result.fits) break;  // candidates are in order of expected slowdown: the first wins
  }
  if (result.fits)
    result.explanation += "chosen: the first that fits, in order of expected slowdown; a larger micro-batch keeps the GEMMs larger.\n";
  else
    result.explanation += "nothing fits: shorten --max_seq_length or use a smaller model.\n";
  return result;
}

// ---- fit --max-context ----

RunConfig max_context_stack(const RunConfig& base, bool offload_activations) {
  RunConfig run = base;
  if (run.precision == Precision::fp32) run.precision = Precision::bf16;
  run.attn_implementation = "flash";
  run.loss_implementation = "chunked";
  run.gradient_checkpointing = true;
  run.load_in_4bit = true;
  run.bnb_4bit_compute_dtype.clear();  // the stack's precision
  // The leanest chunks that still run the GEMMs well: the 1024 rows measured at 131,072 tokens.
  if (run.mlp_chunk_tokens <= 0) run.mlp_chunk_tokens = 1024;
  run.offload_activations = offload_activations;
  run.per_device_train_batch_size = 1;
  run.gradient_accumulation_steps = 1;
  return run;
}

MaxContextResult max_context(const RunConfig& base, const LlamaConfig& model, uint64_t budget,
                             uint64_t context, bool offload_activations) {
  RunConfig run = max_context_stack(base, offload_activations);
  MaxContextResult result;
  result.offload_activations = offload_activations;
  const int64_t model_limit = std::min(model.max_position_embeddings > 0 ? model.max_position_embeddings : RunConfig::kMaxSeqLength,
                                       RunConfig::kMaxSeqLength);
  // The plan grows with seq: the longest fitting multiple of kContextStep (or the model's limit).
  auto plan_at = [&](int64_t seq) {
    run.max_seq_length = seq;
    return plan_run(run, model);
  };
  auto record = [&](int64_t seq, const Plan& plan) {
    result.seq = seq;
    result.planned_bytes = plan.arena_bytes;
    result.host_bytes = plan.host_bytes;
  };
  const Plan at_limit = plan_at(model_limit);
  if (at_limit.arena_bytes + context <= budget) {
    record(model_limit, at_limit);
    result.at_model_limit = true;
    return result;
  }
  int64_t low = 0, high = (model_limit - 1) / kContextStep;  // steps: low fits (0: none), high + 1 does not
  while (low < high) {
    const int64_t mid = low + (high - low + 1) / 2;
    const Plan plan = plan_at(mid * kContextStep);
    if (plan.arena_bytes + context <= budget) low = mid, record(mid * kContextStep, plan);
    else high = mid - 1;
  }
  return result;
}

MaxContextReport max_context_report(const RunConfig& base, const LlamaConfig& model, uint64_t budget,
                                    uint64_t context) {
  MaxContextReport report;
  report.without_offload = max_context(base, model, budget, context, false);
  report.with_offload = max_context(base, model, budget, context, true);
  const RunConfig stack = max_context_stack(base, false);
  report.text = fmt::format(
      "longest context at micro-batch 1 in {} ({} of it CUDA context), from the plan: {} + flash + "
      "chunked loss + gradient checkpointing + QLoRA ({}), token chunks of {}, LoRA r{}; searched in "
      "steps of {} tokens up to the model's {}:\n",
      format_bytes(budget), format_bytes(context), precision_name(stack.precision),
      quant_type_name(stack.quant.type), stack.mlp_chunk_tokens, stack.lora_r, kContextStep,
      model.max_position_embeddings);
  for (const MaxContextResult* r : {&report.without_offload, &report.with_offload}) {
    const char* name = r->offload_activations ? "with --offload_activations" : "without offload";
    if (r->seq == 0) {
      report.text += fmt::format("  {:<28} nothing fits (not even {} tokens)\n", name, kContextStep);
      continue;
    }
    report.text += fmt::format("  {:<28} {:>8} tokens: device {} (arena {} + context){}{}\n", name, r->seq,
                               format_bytes(r->planned_bytes + context), format_bytes(r->planned_bytes),
                               r->offload_activations ? fmt::format(", pinned host {}", format_bytes(r->host_bytes)) : "",
                               r->at_model_limit ? "; the model's limit, not memory" : "");
  }
  return report;
}

// ---- end fit --max-context ----

}  // namespace memtune
