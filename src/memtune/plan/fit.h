// memtune fit: from the plan alone, the set of memory techniques with the least expected
// slowdown, and the largest micro-batch, that fit a VRAM budget.
#pragma once

#include <functional>
#include <string>

#include "memtune/train/run_config.h"

namespace memtune {

struct FitResult {
  bool fits = false;
  RunConfig run;              // the chosen configuration
  uint64_t planned_bytes = 0; // arena
  uint64_t with_context_bytes = 0;
  std::string explanation;    // every candidate tried, and why the chosen one won
};

// The options that give `fitted` (a FitResult's run) from the command line: "--bf16
// --attn_implementation flash --loss_implementation chunked --load_in_4bit ...".
std::string fit_flags(const RunConfig& fitted);

// Keeps the effective batch (micro-batch x accumulation) of `base`. host_budget_bytes (0: no
// limit) bounds the pinned host memory of the offload candidate.
FitResult fit_run(const RunConfig& base, const LlamaConfig& model, uint64_t budget_bytes,
                  uint64_t context_bytes, uint64_t host_budget_bytes = 0);

// --stream_layers: the fewest of the model's layers that, streamed, make `fits(layers)` true, searched
// from 3 (one or two streamed layers only add the two layer-sized buffers) to all but one (the plan
// falls as the count rises); 0 when even all but one do not.
int64_t fewest_streamed_layers(const LlamaConfig& model, const std::function<bool(int64_t layers)>& fits);

// Under a budget, an auto mlp_chunk_tokens (RunConfig::kAutoTokenChunks) becomes the largest
// token chunk whose plan plus the context fits: the auto default first, then 2048, 1024, 512 and
// 256 rows (smaller chunks cost speed, bench/NOTES.md), each with hold_chunk_weights as asked and
// then, for a 4-bit base, without it (its room, before smaller chunks). An explicit value is kept. Returns
// whether the run, as it now is, fits; `run` is left at the smallest chunk tried when none does.
bool fit_token_chunks(RunConfig& run, const LlamaConfig& model, uint64_t budget_bytes,
                      uint64_t context_bytes, int world_size = 1);

// ---- fit --max-context ----
// The longest max_seq_length at micro-batch 1 whose plan plus the context fits the budget, with
// the full memory stack: bf16 (fp16 when asked), flash attention, chunked loss, gradient
// checkpointing, the 4-bit base, token chunks; the rest (LoRA, chunk sizes, quantization) from
// `base`. Searched in steps of kContextStep tokens up to RunConfig::kMaxSeqLength: past the
// model's max_position_embeddings a run goes on with a warning, as transformers does, and the
// result says so (past_model_limit). host_budget_bytes (0: no limit) bounds the pinned host memory
// that offload takes: a length whose offloaded activations do not fit this host does not fit.
constexpr int64_t kContextStep = 256;
RunConfig max_context_stack(const RunConfig& base, bool offload_activations);
struct MaxContextResult {
  bool offload_activations = false;
  int64_t seq = 0;               // 0: not even kContextStep tokens fit
  uint64_t planned_bytes = 0;    // the arena at that seq
  uint64_t host_bytes = 0;       // pinned host memory at that seq (offload)
  bool at_search_limit = false;  // RunConfig::kMaxSeqLength fits: it, not memory, limits
  bool past_model_limit = false; // seq is past the model's max_position_embeddings
  bool limited_by_host = false;  // the next length fits the device but not host_budget_bytes
};
MaxContextResult max_context(const RunConfig& base, const LlamaConfig& model, uint64_t budget_bytes,
                             uint64_t context_bytes, bool offload_activations, uint64_t host_budget_bytes = 0);
// Both searches (without and with offload) as a table; fits is false when neither fits at all.
struct MaxContextReport {
  MaxContextResult without_offload, with_offload;
  std::string text;
  bool fits() const { return without_offload.seq > 0 || with_offload.seq > 0; }
};
MaxContextReport max_context_report(const RunConfig& base, const LlamaConfig& model,
                                    uint64_t budget_bytes, uint64_t context_bytes, uint64_t host_budget_bytes = 0);
// ---- end fit --max-context ----

}  // namespace memtune
