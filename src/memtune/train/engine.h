// The engine of one run on one device: memory, frozen weights, adapters, optimizer state and
// the step, all placed by the same allocator. Constructed on the meta backend it is the
// planner: plan_run() builds it and runs one optimizer step there.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "memtune/core/memory.h"
#include "memtune/lora/lora_state.h"
#include "memtune/model/model_weights.h"
#include "memtune/step/llama_step.h"
#include "memtune/train/run_config.h"

namespace memtune {

class Communicator;          // parallel/communicator.h
class DataParallelAdapters;  // parallel/data_parallel.h
class ShardedBase;           // parallel/sharded_base.h
class ShardedBaseWeights;

// One micro-batch on the host, already shifted: targets[t] is the label of token t + 1. Its
// shape is [rows, seq] (rows * seq entries per array): the planned [batch, max_seq_length] or
// smaller (LlamaStep::set_shape); rows 0 means the planned shape.
struct HostMicroBatch {
  std::vector<int32_t> input_ids, targets, positions, segments;
  int64_t rows = 0, seq = 0;
  // Tokens that belong to a sample (the rest is padding); -1: not counted (every token).
  int64_t real_tokens = -1;
  int64_t valid_targets() const;
  int64_t tokens() const { return static_cast<int64_t>(input_ids.size()); }
  int64_t sample_tokens() const { return real_tokens < 0 ? tokens() : real_tokens; }
};

struct Plan {
  std::vector<AllocationRecord> records;
  uint64_t arena_bytes = 0;        // the arena that the engine allocates (peak offset)
  uint64_t peak_live_bytes = 0;    // live bytes at the peak (arena minus fragmentation)
  CategoryBytes at_peak{};         // live bytes per category at the peak (sums to peak_live)
  CategoryBytes max_by_category{}; // each category's own maximum
  int64_t trainable_parameters = 0, frozen_parameters = 0;
  double seconds = 0;              // how long planning took
  // The device planned for: its backend's workspace is part of the arena (32 MiB of GEMM and
  // reduction scratch on CUDA, none on the CPU), so planned == allocated holds on that device.
  Device target = Device::cuda;
  // ---- offload: host memory ----
  // Pinned host memory that the run allocates once beside the arena (offloaded activations).
  std::vector<HostAllocationRecord> host_records;
  uint64_t host_bytes = 0;
  // ---- end offload ----
};

struct LossScalerState {  // torch.cuda.amp.GradScaler semantics
  double scale = 65536.0;
  int64_t good_steps = 0, skipped_steps = 0;
  static constexpr double kGrowth = 2.0, kBackoff = 0.5;
  static constexpr int64_t kGrowthInterval = 2000;
};

struct StepReport {
  double loss = 0;          // sum of token losses / valid targets of the optimizer step
  double grad_norm = 0;     // global norm before clipping (unscaled)
  double learning_rate = 0;
  int64_t tokens = 0;       // token slots computed (the micro-batches' shapes, padding included)
  int64_t real_tokens = 0;  // of them, tokens of samples (not padding)
  int64_t targets = 0;      // trained targets (labels that are not -100)
  bool skipped = false;     // fp16 overflow: no update
};

class Engine {
 public:
  // Plans when backend is the meta backend (arena null); else runs on the given arena.
  // With a communicator of world_size > 1 the step is data parallel (parallel/data_parallel.h):
  // this rank's micro-batches, the loss normalised by the global valid targets, the grads
  // summed over ranks, ZeRO-1 AdamW. Without one (or world_size 1) nothing changes.
  Engine(Backend& backend, void* arena, uint64_t arena_bytes, const RunConfig& run,
         const LlamaConfig& model, Communicator* communicator = nullptr);
  ~Engine();  // unbinds the backend's workspace, which lives in this engine's arena
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Memory& memory() { return memory_; }
  // With the base sharded or streamed (base_sharded(), base_streamed()), the weights' tensors hold bytes only inside a step's
  // visit of their unit (parallel/sharded_base.h); outside they are null.
  const ModelWeights& weights() const { return weights_; }
  ModelWeights& weights() { return weights_; }
  LoraState& lora() { return lora_; }
  const LlamaConfig& model() const { return model_; }
  const RunConfig& run() const { return run_; }
  Backend& backend() { return backend_; }
  const LlamaStep& step() const { return step_; }
  // ---- data parallel (parallel/) ----
  int rank() const;
  int world_size() const;
  DataParallelAdapters* data_parallel() { return data_parallel_.get(); }
  // run.shard_base with world_size > 1: this rank keeps its shard of the frozen base.
  bool base_sharded() const;
  // run.stream_layers: some layers live in host memory and are copied in per visit.
  bool base_streamed() const;
  const ShardedBase* sharded_base() const { return sharded_base_.get(); }
  // ---- end data parallel ----

  void init_random_weights(uint64_t seed);
  void load_base_checkpoint(const std::filesystem::path& checkpoint);
  void init_adapters(uint64_t seed);  // PEFT init
  // Loads a PEFT adapter folder into the fp32 masters. memtune::Error when its
  // adapter_config.json differs from the run's LoRA settings (adopt_adapter_lora_config makes
  // them agree) or its tensors do not match that config (a missing, extra or misshapen tensor).
  void load_adapter(const std::filesystem::path& adapter_dir);
  void save_adapter(const std::filesystem::path& adapter_dir, const std::string& base_model) const;
  // A resumable training state: the adapter (PEFT files) plus optimizer.safetensors (AdamW
  // moments) and trainer_state.json (step, loss scaler, and `trainer_fields`: the trainer's
  // data position). The folder is written beside the target (DIR.partial) and renamed into
  // place, so a failed save (disk full, a crash) never leaves a half checkpoint: on failure the
  // partial folder is removed, the previous DIR is left as it was, and memtune::Error says what
  // failed. load_checkpoint returns trainer_state.json; it also finds DIR.old, which is the
  // previous checkpoint when a crash fell between the save's two renames.
  void save_checkpoint(const std::filesystem::path& dir, const std::string& base_model,
                       const nlohmann::json& trainer_fields = nlohmann::json::object()) const;
  nlohmann::json load_checkpoint(const std::filesystem::path& dir);
  // Called with each file's path just before save_adapter or save_checkpoint writes it: lets a
  // test make that write fail as a full disk does (link the file's temporary name to /dev/full).
  void set_checkpoint_write_hook(std::function<void(const std::filesystem::path&)> hook) {
    checkpoint_write_hook_ = std::move(hook);
  }

  // One optimizer step over the given micro-batches (the accumulation), loss normalised by the
  // valid targets of all of them (transformers >= 4.46). Data parallel: this rank's share of the
  // step (possibly none), normalised by the valid targets of every rank's micro-batches; the
  // report's loss and tokens are the global ones.
  StepReport train_step(const std::vector<HostMicroBatch>& micro_batches);
  // Sum of token losses and count of valid targets. With the base sharded, every rank must make
  // the same calls (each pass gathers the base: collectives).
  std::pair<double, int64_t> eval_loss_sum(const HostMicroBatch& batch);
  const LossScalerState& scaler() const { return scaler_; }
  int64_t steps_done() const { return steps_done_; }

 private:
  void upload(const HostMicroBatch& batch);
  // Runs fill(table rows) over the base one unit at a time: with the base sharded, each unit's
  // weights are pointed at gather buffer 0 (or its whole shard), filled, and this rank's shard
  // kept; else once over every row.
  void fill_base_by_unit(const std::function<void(const std::vector<size_t>& rows)>& fill);

  Backend& backend_;
  RunConfig run_;
  LlamaConfig model_;
  Memory memory_;
  // With the base sharded: the whole base described on the meta device (never allocated); its
  // records are the sharded layout's source.
  Memory base_description_;
  ModelWeights weights_;
  // run.shard_base and world_size > 1, or run.stream_layers (one device; a streamed layout)
  std::unique_ptr<ShardedBase> sharded_base_;
  LoraState lora_;
  Tensor grad_norm_sq_;  // f32 [1]
  Tensor backend_workspace_;  // Backend::workspace_bytes() of planned scratch, bound to the backend
  LlamaStep step_;
  std::unique_ptr<DataParallelAdapters> data_parallel_;  // world_size > 1 only
  std::unique_ptr<ShardedBaseWeights> sharded_views_;    // beside sharded_base_
  LossScalerState scaler_;
  int64_t steps_done_ = 0;
  std::function<void(const std::filesystem::path&)> checkpoint_write_hook_;
  void before_checkpoint_write(const std::filesystem::path& file) const {
    if (checkpoint_write_hook_) checkpoint_write_hook_(file);
  }
};

// The plan of a run: the engine on the meta backend through one full optimizer step, for a
// target device (whose backend's workspace is planned with the rest). world_size > 1 plans one
// rank of a data-parallel run (flat adapter buffers, ZeRO-1 moment shards).
Plan plan_run(const RunConfig& run, const LlamaConfig& model, Device target = Device::cuda,
              int world_size = 1);

// Builds micro-batches of one optimizer step from token sequences (each its own sample):
// truncated to max_seq_length, right-padded, labels shifted, -100 on padding.
HostMicroBatch make_micro_batch(const std::vector<std::vector<int32_t>>& input_ids,
                                const std::vector<std::vector<int32_t>>& labels, int64_t seq,
                                int32_t pad_id = 0);

}  // namespace memtune
