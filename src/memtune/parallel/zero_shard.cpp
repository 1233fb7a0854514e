#include "memtune/parallel/zero_shard.h"

#include <algorithm>

#include "memtune/core/error.h"

namespace memtune {

int64_t ZeroShardLayout::used(int rank) const {
  return std::clamp<int64_t>(total - begin(rank), 0, shard);
}

int ZeroShardLayout::owner_of(int64_t element) const {
  MT_ASSERT(element >= 0 && element < padded_total(), "element {} of {}", element, padded_total());
  return static_cast<int>(element / shard);
}

ZeroShardLayout zero_shard_layout(int64_t total, int world_size, int64_t align_elements) {
  MT_USER_CHECK(world_size >= 1, "ZeRO sharding over {} ranks: expected at least 1", world_size);
  MT_ASSERT(total >= 0 && align_elements >= 1, "total {} align {}", total, align_elements);
  ZeroShardLayout layout;
  layout.world_size = world_size;
  layout.total = total;
  const int64_t per_rank = (total + world_size - 1) / world_size;
  layout.shard = (per_rank + align_elements - 1) / align_elements * align_elements;
  return layout;
}

std::vector<ShardPiece> shard_pieces(const ZeroShardLayout& layout, int rank,
                                     const std::vector<std::pair<int64_t, int64_t>>& tensor_ranges) {
  std::vector<ShardPiece> pieces;
  const int64_t lo = layout.begin(rank), hi = layout.end(rank);
  for (size_t i = 0; i < tensor_ranges.size(); ++i) {
    const auto [offset, numel] = tensor_ranges[i];
    const int64_t begin = std::max(lo, offset), end = std::min(hi, offset + numel);
    if (begin < end) pieces.push_back({i, begin - offset, end - begin, begin - lo});
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const ShardPiece& a, const ShardPiece& b) { return a.shard_offset < b.shard_offset; });
  return pieces;
}

Tensor flat_range(const Tensor& flat, int64_t begin, int64_t count) {
  MT_ASSERT(begin >= 0 && count >= 0 && begin + count <= flat.numel(), "range [{}, {}) of {} elements", begin,
            begin + count, flat.numel());
  Tensor t = flat;
  t.shape = Shape{count};
  if (flat.data != nullptr) t.data = static_cast<char*>(flat.data) + begin * static_cast<int64_t>(dtype_size(flat.dtype));
  return t;
}

void zero_reduce_scatter_grads(Communicator& comm, const ZeroShardLayout& layout, const Tensor& flat_grads,
                               CommStream stream) {
  MT_ASSERT(flat_grads.numel() == layout.padded_total() && flat_grads.dtype == DType::f32,
            "flat grads {} {} for {} padded elements", dtype_name(flat_grads.dtype), flat_grads.numel(),
            layout.padded_total());
  comm.reduce_scatter_sum(flat_grads, flat_range(flat_grads, layout.begin(comm.rank()), layout.shard), stream);
}

void zero_adamw_shard(Backend& backend, const ZeroShardLayout& layout, int rank, const Tensor& flat_params,
                      const Tensor& flat_grads, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                      const AdamWParams& params) {
  MT_ASSERT(flat_params.numel() == layout.padded_total() && flat_grads.numel() == layout.padded_total() &&
                exp_avg.numel() == layout.shard && exp_avg_sq.numel() == layout.shard,
            "ZeRO AdamW: params {} grads {} moments {} {} for shards of {}", flat_params.numel(), flat_grads.numel(),
            exp_avg.numel(), exp_avg_sq.numel(), layout.shard);
  if (layout.shard == 0) return;
  backend.adamw_step(flat_range(flat_params, layout.begin(rank), layout.shard),
                     flat_range(flat_grads, layout.begin(rank), layout.shard), exp_avg, exp_avg_sq, params);
}

void zero_all_gather_params(Communicator& comm, const ZeroShardLayout& layout, const Tensor& flat_params,
                            CommStream stream) {
  MT_ASSERT(flat_params.numel() == layout.padded_total(), "flat params {} for {} padded elements",
            flat_params.numel(), layout.padded_total());
  comm.all_gather(flat_range(flat_params, layout.begin(comm.rank()), layout.shard), flat_params, stream);
}

}  // namespace memtune
