// ZeRO-1 over the flat fp32 adapter space (lora_state.h's flat layout): the AdamW moments are
// split into world_size equal shards, and rank r keeps, and updates, only shard r.
//
// Shards are equal (NCCL's reduce-scatter and all-gather need one count per rank) and aligned
// to 64 elements (256 bytes, the arena's alignment), so the flat buffer is padded to
// world_size * shard elements; the padding, like the gaps between tensors, holds zeros and stays
// zero under AdamW (zero grad, zero moments). The last rank's shard is the one that holds the
// padding, so balance is within 64 * world_size elements.
//
// The update, on every rank:
//   1. grads summed over ranks: either reduce-scatter (each rank gets the sum of its shard only:
//      half the traffic of an all-reduce) or an all-reduce already done in buckets during the
//      backward (grad_buckets.h), which leaves the full sum everywhere;
//   2. AdamW on shard r: params[shard], grads[shard], the rank's moments;
//   3. all-gather of the params' shards into the flat params, in place.
// AdamW is elementwise and memtune decays every adapter element alike, so this gives exactly the
// parameters of an unsharded AdamW over the same summed grads.
#pragma once

#include <cstdint>
#include <vector>

#include "memtune/core/tensor.h"
#include "memtune/parallel/communicator.h"
#include "memtune/ops/backend.h"

namespace memtune {

constexpr int64_t kZeroShardAlignElements = 64;

struct ZeroShardLayout {
  int world_size = 1;
  int64_t total = 0;  // elements that hold something (tensors and the gaps between them)
  int64_t shard = 0;  // elements per rank, a multiple of the alignment
  int64_t padded_total() const { return shard * world_size; }
  int64_t begin(int rank) const { return shard * rank; }
  int64_t end(int rank) const { return shard * (rank + 1); }
  // Elements of the shard below `total` (the rest is padding).
  int64_t used(int rank) const;
  int owner_of(int64_t element) const;
};

// Throws memtune::Error for world_size < 1; total may be 0 (no adapters: empty shards).
ZeroShardLayout zero_shard_layout(int64_t total, int world_size, int64_t align_elements = kZeroShardAlignElements);

// A tensor's part in one rank's shard: elements [tensor_begin, tensor_begin + count) of the
// tensor, at shard element shard_offset.
struct ShardPiece {
  size_t tensor = 0;
  int64_t tensor_begin = 0, count = 0, shard_offset = 0;
};
// tensor_ranges: (flat offset, numel) per tensor. Pieces in flat order.
std::vector<ShardPiece> shard_pieces(const ZeroShardLayout& layout, int rank,
                                     const std::vector<std::pair<int64_t, int64_t>>& tensor_ranges);

// Elements [begin, begin + count) of a 1-D-viewed tensor.
Tensor flat_range(const Tensor& flat, int64_t begin, int64_t count);

// Step 1 as a reduce-scatter, in place: afterwards shard `rank` of flat_grads holds the sum.
void zero_reduce_scatter_grads(Communicator& comm, const ZeroShardLayout& layout, const Tensor& flat_grads,
                               CommStream stream);
// Step 2: AdamW on this rank's shard; exp_avg and exp_avg_sq are f32 [layout.shard].
void zero_adamw_shard(Backend& backend, const ZeroShardLayout& layout, int rank, const Tensor& flat_params,
                      const Tensor& flat_grads, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                      const AdamWParams& params);
// Step 3: every rank's flat_params = the concatenation of the updated shards, in place.
void zero_all_gather_params(Communicator& comm, const ZeroShardLayout& layout, const Tensor& flat_params,
                            CommStream stream);

}  // namespace memtune
