// The data-parallel part of an optimizer step (the engine builds one when world_size > 1):
//  - the global counts: valid targets (the loss normaliser: transformers divides by the tokens of
//    the whole global batch) and tokens, summed over ranks;
//  - the gradient all-reduce over grad buckets (grad_buckets.h), in the order the backward
//    finishes the layers;
//  - ZeRO-1 AdamW (zero_shard.h): this rank's shard of the moments, the shard update, the
//    all-gather of the params.
//
// Overlap with the backward: layer_backward_done(l) launches the all-reduce of every bucket that
// layer l completes. The engine calls it from LlamaStep's on_layer_grads_done hook during a
// step's last micro-batch; reduce_gradients() then launches only what is left (nothing, when
// every layer reported). Every collective runs on the communicator's side stream after the
// kernels issued before it (Communicator::after_compute): on NCCL the buckets overlap the rest of
// the backward; the CPU communicators are synchronous.
//
// Every collective sequence ends in Communicator::wait before the host reads anything, so a dead
// peer becomes a memtune::Error on every surviving rank.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "memtune/core/memory.h"
#include "memtune/parallel/communicator.h"
#include "memtune/parallel/grad_buckets.h"
#include "memtune/parallel/zero_shard.h"
#include "memtune/lora/lora_state.h"
#include "memtune/ops/backend.h"

namespace memtune {

struct DataParallelOptions {
  uint64_t bucket_bytes = kDefaultGradBucketBytes;
};

// The multiple that LoraState's flat buffers are padded to for `world_size` ranks.
inline int64_t lora_flat_multiple(int world_size) { return kZeroShardAlignElements * world_size; }

class DataParallelAdapters {
 public:
  // `lora` has the flat layout for comm.world_size() and no per-tensor moments. Allocates this
  // rank's moment shards (optimizer_state) and a small count buffer (workspace) in `memory`.
  DataParallelAdapters(Backend& backend, Memory& memory, LoraState& lora, Communicator& comm,
                       const DataParallelOptions& options = {});

  Communicator& comm() { return comm_; }
  const ZeroShardLayout& layout() const { return layout_; }
  const GradBucketPlan& buckets() const { return buckets_; }

  // Per-step counts summed over ranks: valid targets, token slots computed, tokens of samples.
  struct StepCounts {
    int64_t valid_targets = 0, tokens = 0, real_tokens = 0;
  };
  StepCounts global_counts(const StepCounts& local);
  // At the start of a step's last micro-batch (the one whose backward finishes the grads).
  void begin_final_backward();
  // The hook: layer `layer`'s adapter grads are final for this step.
  void layer_backward_done(int layer);
  // After the backward of the last micro-batch: launches the buckets not launched yet, sums
  // loss_sum (f32 [1]) over ranks, and waits. The grads are then the global sums on every rank.
  void reduce_gradients(const Tensor& loss_sum);
  // ZeRO-1: AdamW on this rank's shard, then the all-gather of the params (and a wait).
  void adamw_step(const AdamWParams& params);
  void zero_optimizer();
  // This rank's moment shards (for checkpoints and tests).
  const Tensor& exp_avg_shard() const { return exp_avg_; }
  const Tensor& exp_avg_sq_shard() const { return exp_avg_sq_; }

 private:
  void launch_bucket(int bucket);

  Backend& backend_;
  LoraState& lora_;
  Communicator& comm_;
  ZeroShardLayout layout_;
  GradBucketPlan buckets_;
  BucketReadiness readiness_;
  Tensor counts_;  // i32 [2]
  Tensor exp_avg_, exp_avg_sq_;
  CommStream stream_;  // the communicator's side stream
};

}  // namespace memtune
