#include "memtune/plan/fit.h"

#include <fmt/format.h>

#include <algorithm>
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
  // The checkpointed layer inputs and the input embedding table (where untied) in pinned host
  // memory: the copies overlap compute (an 8B QLoRA step on an H100: 11,128 against 11,422
  // tokens/s, bench/results/2026-12-06-h100-peers).
  bool offload;
  // The fewest frozen layers streamed from pinned host memory (--stream_layers) that fit: the
  // last resort, for a base too large for the device even in 4 bits.
  bool stream = false;
};

constexpr Candidate kCandidates[] = {
    {"bf16 + flash + chunked loss", "none", false, false, false},
    {"+ QLoRA", "~5-10% (dequantization)", true, false, false},
    {"+ gradient checkpointing", "~25-30% (recompute)", false, true, false},
    {"+ QLoRA + gradient checkpointing", "~30-40%", true, true, false},
    {"+ QLoRA + checkpointing + offload", "~30-40%, +~3% (host copies)", true, true, true},
    {"+ QLoRA + checkpointing + offload + streamed layers", "~30-40%, + the streamed layers' copies (not yet measured)",
     true, true, true, true},
};

// The fewest streamed layers with which `run` fits, token chunks fitted too
// (fewest_streamed_layers); false (run at the most layers) when none does.
bool fit_streamed_layers(RunConfig& run, const LlamaConfig& model, uint64_t budget, uint64_t context) {
  const int64_t chunks = run.mlp_chunk_tokens;
  const auto fits_with = [&](int64_t layers) {
    run.stream_layers = layers;
    run.mlp_chunk_tokens = chunks;
    return fit_token_chunks(run, model, budget, context);
  };
  // The search's last try may be another count: set the one found again.
  const int64_t layers = fewest_streamed_layers(model, fits_with);
  return layers > 0 && fits_with(layers);
}

}  // namespace

int64_t fewest_streamed_layers(const LlamaConfig& model, const std::function<bool(int64_t layers)>& fits) {
  int64_t low = 3, high = model.num_hidden_layers - 1;
  if (high < low || !fits(high)) return 0;
  while (low < high) {
    const int64_t mid = (low + high) / 2;
    if (fits(mid)) high = mid;
    else low = mid + 1;
  }
  return low;
}

bool fit_token_chunks(RunConfig& run, const LlamaConfig& model, uint64_t budget, uint64_t context,
                      int world_size) {
  const auto fits = [&](const RunConfig& r) {
    return plan_run(r, model, Device::cuda, world_size).arena_bytes + context <= budget;
  };
  // Holding a chunked pass's dequantized weights (hold_chunk_weights, asked for) is the speed; where
  // the budget needs its room, the same chunks without it come before smaller chunks, which cost more.
  const bool hold = run.hold_chunk_weights;
  const auto fits_holding_or_not = [&](RunConfig& r) {
    r.hold_chunk_weights = hold;
    if (fits(r)) return true;
    if (!hold || r.mlp_chunk_tokens <= 0 || !r.load_in_4bit) return false;
    r.hold_chunk_weights = false;
    if (fits(r)) return true;
    r.hold_chunk_weights = hold;
    return false;
  };
  if (run.mlp_chunk_tokens != RunConfig::kAutoTokenChunks) return fits_holding_or_not(run);
  const int64_t tokens = run.per_device_train_batch_size * run.max_seq_length;
  std::vector<int64_t> chunks{run.resolved_token_chunk_rows()};
  for (int64_t rows : {2048, 1024, 512, 256})
    if (rows < tokens && (chunks.back() == 0 || rows < chunks.back())) chunks.push_back(rows);
  for (int64_t rows : chunks) {
    run.mlp_chunk_tokens = rows;
    if (fits_holding_or_not(run)) return true;
  }
  return false;
}

std::string fit_flags(const RunConfig& r) {
  std::string flags = fmt::format("--{} --attn_implementation {} --loss_implementation {}", precision_name(r.precision),
                                  r.attn_implementation, r.loss_implementation);
  if (r.load_in_4bit) flags += " --load_in_4bit";
  if (r.gradient_checkpointing) flags += " --gradient_checkpointing";
  if (r.offload_activations) flags += " --offload_activations";
  if (r.offload_embeddings) flags += " --offload_embeddings";
  if (r.offload_optimizer) flags += " --offload_optimizer";
  if (r.stream_layers > 0) flags += fmt::format(" --stream_layers {}", r.stream_layers);
  flags += fmt::format(" --per_device_train_batch_size {} --gradient_accumulation_steps {}", r.per_device_train_batch_size,
                       r.gradient_accumulation_steps);
  if (r.mlp_chunk_tokens > 0) flags += fmt::format(" --mlp_chunk_tokens {}", r.mlp_chunk_tokens);
  if (r.mlp_chunk_tokens > 0 && r.load_in_4bit && !r.hold_chunk_weights) flags += " --hold_chunk_weights false";
  return flags;
}

FitResult fit_run(const RunConfig& base, const LlamaConfig& model, uint64_t budget, uint64_t context,
                  uint64_t host_budget) {
  FitResult result;
  const int64_t effective = base.per_device_train_batch_size * base.gradient_accumulation_steps;
  result.explanation = fmt::format("budget {} ({} of it CUDA context), effective batch {} x seq {}:\n",
                                   format_bytes(budget), format_bytes(context), effective, base.max_seq_length);
  bool host_refused = false;  // some candidate fitted the device but not the host's pinned memory
  for (const Candidate& candidate : kCandidates) {
    RunConfig run = base;
    if (run.precision == Precision::fp32) run.precision = Precision::bf16;
    run.attn_implementation = "flash";
    run.loss_implementation = "chunked";
    run.load_in_4bit = candidate.qlora;
    run.gradient_checkpointing = candidate.checkpointing;
    if (candidate.offload) {
      run.offload_activations = true;
      run.offload_embeddings = run.offload_embeddings || !model.tie_word_embeddings;
    }
    // The largest micro-batch that divides the effective batch and fits (the device, and the
    // host's pinned memory where it offloads).
    uint64_t host_short = 0;  // pinned bytes of the smallest micro-batch that the host refused
    for (int64_t micro = effective; micro >= 1; --micro) {
      if (effective % micro != 0) continue;
      run.per_device_train_batch_size = micro;
      run.gradient_accumulation_steps = effective / micro;
      run.mlp_chunk_tokens = base.mlp_chunk_tokens;  // auto again for every micro-batch
      if (candidate.stream ? !fit_streamed_layers(run, model, budget, context)
                           : !fit_token_chunks(run, model, budget, context))
        continue;
      const Plan plan = plan_run(run, model);
      if (host_budget > 0 && plan.host_bytes > host_budget) {
        host_short = plan.host_bytes;
        continue;
      }
      const uint64_t planned = plan.arena_bytes;
      result.explanation += fmt::format("  {:<36} fits at micro-batch {} x accumulation {}{}{}: {} (expected slowdown {})\n",
                                        candidate.name, micro, effective / micro,
                                        run.resolved_token_chunk_rows() > 0
                                            ? fmt::format(", token chunks of {}", run.resolved_token_chunk_rows())
                                            : std::string(),
                                        run.stream_layers > 0
                                            ? fmt::format(", {} of {} layers streamed", run.stream_layers,
                                                          model.num_hidden_layers)
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
    host_refused = host_refused || (!result.fits && host_short > 0);
    if (!result.fits && host_short > 0)
      result.explanation += fmt::format("  {:<36} fits the device, but its pinned host memory ({}) does not fit "
                                        "the host's {}\n", candidate.name, format_bytes(host_short),
                                        format_bytes(host_budget));
    else if (!result.fits)
      result.explanation += fmt::format("  {:<36} does not fit even at micro-batch 1\n", candidate.name);
    if (result.fits) break;  // candidates are in order of expected slowdown: the first wins
  }
  if (result.fits)
    result.explanation += "chosen: the first that fits, in order of expected slowdown; a larger micro-batch keeps the GEMMs larger.\n";
  else
    result.explanation += host_refused ? "nothing fits: shorten --max_seq_length, use a smaller model, or train on a "
                                         "machine with more host memory (--host_memory plans for one).\n"
                                       : "nothing fits: shorten --max_seq_length or use a smaller model.\n";
  return result;
}

// ---- fit --max-context ----

RunConfig max_context_stack(const RunConfig& base, bool offload_activations) {
  RunConfig run = base;
  if (run.precision == Precision::fp32) run.precision = Precision::bf16;
  // A fused kernel the run asked for (flash, or cuDNN: its backward workspace is larger) is kept.
  if (run.attn_implementation == "eager") run.attn_implementation = "flash";
  run.loss_implementation = "chunked";
  run.gradient_checkpointing = true;
  run.load_in_4bit = true;
  run.bnb_4bit_compute_dtype.clear();  // the stack's precision
  // The leanest chunks that still run the GEMMs well: the 1024 rows measured at 131,072 tokens.
  if (run.mlp_chunk_tokens <= 0) run.mlp_chunk_tokens = 1024;
  // The longest context: the room that held dequantized weights would take goes to tokens.
  run.hold_chunk_weights = false;
  run.offload_activations = offload_activations;
  run.per_device_train_batch_size = 1;
  run.gradient_accumulation_steps = 1;
  return run;
}

MaxContextResult max_context(const RunConfig& base, const LlamaConfig& model, uint64_t budget,
                             uint64_t context, bool offload_activations, uint64_t host_budget) {
  RunConfig run = max_context_stack(base, offload_activations);
  MaxContextResult result;
  result.offload_activations = offload_activations;
  // The plan grows with seq, so the longest fitting length is found in steps of kContextStep:
  // first from the model's max_position_embeddings upward by doubling (past it only when it
  // fits; plans of long runs take seconds each), then by bisection between the last length that
  // fitted and the first that did not. RunConfig::kMaxSeqLength bounds the search.
  const int64_t limit_steps = RunConfig::kMaxSeqLength / kContextStep;
  // Every refusal lowers `high`, so the last one is the first length past the result: its reason
  // is what limits the answer.
  const auto fits_at = [&](int64_t steps) {
    run.max_seq_length = steps * kContextStep;
    const Plan plan = plan_run(run, model);
    const bool device_refuses = plan.arena_bytes + context > budget;
    const bool host_refuses = host_budget > 0 && plan.host_bytes > host_budget;
    if (device_refuses || host_refuses) {
      result.limited_by_host = !device_refuses;
      return false;
    }
    if (run.max_seq_length > result.seq) {
      result.seq = run.max_seq_length;
      result.past_model_limit = model.max_position_embeddings > 0 && result.seq > model.max_position_embeddings;
      result.planned_bytes = plan.arena_bytes;
      result.host_bytes = plan.host_bytes;
    }
    return true;
  };
  int64_t low = 0;  // in steps: fits (0: nothing does)
  int64_t high = std::clamp<int64_t>(model.max_position_embeddings / kContextStep, 1, limit_steps);  // first probe
  while (fits_at(high)) {
    low = high;
    if (high == limit_steps) {
      result.at_search_limit = true;
      return result;
    }
    high = std::min(high * 2, limit_steps);
  }
  // low fits (or is 0), high does not.
  while (high - low > 1) {
    const int64_t mid = low + (high - low) / 2;
    if (fits_at(mid)) low = mid;
    else high = mid;
  }
  return result;
}

MaxContextReport max_context_report(const RunConfig& base, const LlamaConfig& model, uint64_t budget,
                                    uint64_t context, uint64_t host_budget) {
  MaxContextReport report;
  report.without_offload = max_context(base, model, budget, context, false, host_budget);
  report.with_offload = max_context(base, model, budget, context, true, host_budget);
  const RunConfig stack = max_context_stack(base, false);
  report.text = fmt::format(
      "longest context at micro-batch 1 in {} ({} of it CUDA context), from the plan: {} + {} attention + "
      "chunked loss + gradient checkpointing + QLoRA ({}), token chunks of {}, LoRA r{}; searched in "
      "steps of {} tokens up to {} (the model's max_position_embeddings: {}){}:\n",
      format_bytes(budget), format_bytes(context), precision_name(stack.precision), stack.attn_implementation,
      quant_type_name(stack.quant.type), stack.mlp_chunk_tokens, stack.lora_r, kContextStep,
      RunConfig::kMaxSeqLength, model.max_position_embeddings,
      host_budget > 0 ? fmt::format(", pinned host memory up to {}", format_bytes(host_budget)) : "");
  for (const MaxContextResult* r : {&report.without_offload, &report.with_offload}) {
    const char* name = r->offload_activations ? "with --offload_activations" : "without offload";
    if (r->seq == 0) {
      report.text += fmt::format("  {:<28} nothing fits (not even {} tokens)\n", name, kContextStep);
      continue;
    }
    report.text += fmt::format("  {:<28} {:>8} tokens: device {} (arena {} + context){}{}{}{}\n", name, r->seq,
                               format_bytes(r->planned_bytes + context), format_bytes(r->planned_bytes),
                               r->offload_activations ? fmt::format(", pinned host {}", format_bytes(r->host_bytes)) : "",
                               r->at_search_limit ? "; the search's limit, not memory" : "",
                               r->limited_by_host ? "; host memory, not the device, limits it" : "",
                               r->past_model_limit ? "; past max_position_embeddings (warning: positions the "
                                                     "model was not trained at)" : "");
  }
  return report;
}

// ---- end fit --max-context ----

}  // namespace memtune
