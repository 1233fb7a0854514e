// What `--attn_implementation auto` runs on a GPU: the faster of memtune's own flash kernel and
// cuDNN's fused attention at the run's attention shape. It is measured once per GPU model, libcudnn
// and memtune binary, then cached, so no fixed rule has to guess (issue 23). One forward + backward
// of each candidate is timed on random inputs of the run's exact shape (batch x seq, heads, head_dim,
// 16-bit type; packed rows as four samples a row) before the run's arena exists, and the memory it
// takes is freed before the arena is allocated. The result is kept in a small JSON file:
// $MEMTUNE_CACHE_DIR, else $XDG_CACHE_HOME/memtune, else ~/.cache/memtune, attention-picks.json.
// MEMTUNE_ATTENTION_PICK=rule skips the measurement and takes the fixed rule (cuDNN where
// available).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "memtune/core/dtype.h"

namespace memtune {

class Backend;
struct RunConfig;
struct LlamaConfig;

// The attention call that a run makes at each layer.
struct AttentionShape {
  int64_t batch = 0, seq = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  DType dtype = DType::bf16;
  bool packed = false;  // rows of several samples (probed as kProbeSamplesPerRow samples a row)
  // "b2 s2048 h32/8 d128 bf16", + " packed".
  std::string key() const;
};

inline constexpr int64_t kProbeSamplesPerRow = 4;

struct AttentionTiming {
  std::string implementation;  // "flash" or "cudnn"
  double milliseconds = 0.0;   // median of one forward + one backward
};

struct AttentionPick {
  std::string implementation;            // what the run uses
  std::vector<AttentionTiming> timings;  // those the pick rests on; empty when nothing was timed
  std::string source;                    // "measured now", "cached in <file>", or why nothing was timed
  // One line for the run's log: "attention auto: cudnn (1.820 ms a forward + backward) over flash
  // (3.190 ms), measured now at b8 s2048 h32/8 d128 bf16".
  std::string describe(const AttentionShape& shape) const;
};

// Device bytes that timing `implementations` at `shape` takes at once (tensors, scratch, tables).
uint64_t attention_probe_bytes(const AttentionShape& shape, const std::vector<std::string>& implementations);

// Median milliseconds of one forward + one backward of `implementation` ("flash" or "cudnn") at
// `shape` on `backend`, over `repeats` runs (fewer once 3 s are spent) after one untimed (cuDNN
// builds its graphs then).
// Allocates its inputs and scratch from one temporary arena and frees it before returning.
double time_attention(Backend& backend, const AttentionShape& shape, const std::string& implementation,
                      int repeats);

// ---- the cache ----
// The cache file, or empty where no folder is known (no MEMTUNE_CACHE_DIR, XDG_CACHE_HOME or HOME).
std::filesystem::path attention_cache_path();
// What the timings depend on besides the shape: the GPU's name, libcudnn's version and this binary
// (its size and modification time: a rebuilt memtune measures again).
std::string attention_device_key(const Backend& backend);
// The cached pick for (device, shape), if any. An unreadable or malformed file is reported on
// stderr once and treated as empty; it is never thrown.
std::optional<AttentionPick> read_cached_attention_pick(const std::filesystem::path& cache,
                                                        const std::string& device_key, const std::string& shape_key);
// Adds or replaces one entry (atomic write). A file that exists but cannot be parsed is left as it
// is (the entry is not stored, and stderr says so); failures to write are reported, not thrown.
void store_attention_pick(const std::filesystem::path& cache, const std::string& device_key,
                          const std::string& shape_key, const AttentionPick& pick);

// The pick among `candidates` (each "flash" or "cudnn", in the order of preference on a tie): with
// one candidate that one; else a cached pick whose implementation is a candidate and whose timings
// cover every candidate; else each candidate timed (`repeats` runs) and the fastest stored.
// `cache` empty: no cache.
AttentionPick pick_attention(Backend& backend, const AttentionShape& shape, const std::vector<std::string>& candidates,
                             const std::filesystem::path& cache, int repeats = 5);

// `--attn_implementation auto` (or sdpa) for a run on `backend`: where it is a GPU, sets
// run.attn_implementation to the pick (pick_attention, cache at attention_cache_path()) among the
// implementations that serve the run (cuDNN: this build, libcudnn and the GPU have it, head_dim 64
// or 128, bf16 or fp16) and whose plan fits budget_bytes (0: no budget) beside context_bytes, and
// returns the line to log. Returns "" and leaves the run as the fixed rule set it on the CPU, with
// MEMTUNE_ATTENTION_PICK=rule, where no candidate fits (the budget check that follows says why),
// and where timing both would not fit the budget itself (the line says so then).
std::string resolve_auto_attention(Backend& backend, RunConfig& run, const LlamaConfig& model, uint64_t budget_bytes,
                                   uint64_t context_bytes);

}  // namespace memtune
