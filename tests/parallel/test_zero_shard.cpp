// ZeRO-1: shard boundaries, and the sharded update (reduce-scatter or all-reduce, AdamW on the
// shard, all-gather) over the in-process communicator gives exactly the parameters of one
// unsharded AdamW over the summed grads.
#include "memtune/parallel/zero_shard.h"

#include <gtest/gtest.h>

#include "memtune/ops/backend.h"
#include "inprocess_communicator.h"

using namespace memtune;

TEST(ZeroShard, EqualAlignedShardsCoverThePaddedSpace) {
  const ZeroShardLayout l = zero_shard_layout(1000, 3);
  EXPECT_EQ(l.shard, 384);  // ceil(1000 / 3) = 334, aligned up to 64
  EXPECT_EQ(l.padded_total(), 1152);
  EXPECT_EQ(l.begin(1), 384);
  EXPECT_EQ(l.end(2), 1152);
  EXPECT_EQ(l.used(0), 384);
  EXPECT_EQ(l.used(2), 1000 - 768);
  EXPECT_EQ(l.owner_of(383), 0);
  EXPECT_EQ(l.owner_of(384), 1);
  EXPECT_EQ(l.owner_of(1151), 2);
  for (int world : {1, 2, 3, 8}) {
    for (int64_t total : {0, 1, 63, 64, 65, 4096, 123457}) {
      const ZeroShardLayout z = zero_shard_layout(total, world);
      EXPECT_EQ(z.shard % 64, 0);
      EXPECT_GE(z.padded_total(), total);
      EXPECT_LT(z.padded_total() - total, 64 * world + world);  // balanced within the alignment
      // The same multiple as LoraState's flat layout padded to 64 * world.
      EXPECT_EQ(z.padded_total(), (total + 64 * world - 1) / (64 * world) * (64 * world));
    }
  }
  EXPECT_THROW(zero_shard_layout(10, 0), Error);
}

TEST(ZeroShard, PiecesSayWhichPartOfWhichTensorARankOwns) {
  const ZeroShardLayout l = zero_shard_layout(256, 2);  // shards [0, 128) and [128, 256)
  const std::vector<std::pair<int64_t, int64_t>> tensors = {{0, 100}, {128, 64}, {192, 64}, {64, 100}};
  const std::vector<ShardPiece> rank1 = shard_pieces(l, 1, {{0, 100}, {100, 100}, {200, 56}});
  ASSERT_EQ(rank1.size(), 2u);
  EXPECT_EQ(rank1[0].tensor, 1u);
  EXPECT_EQ(rank1[0].tensor_begin, 28);
  EXPECT_EQ(rank1[0].count, 72);
  EXPECT_EQ(rank1[0].shard_offset, 0);
  EXPECT_EQ(rank1[1].tensor, 2u);
  EXPECT_EQ(rank1[1].count, 56);
  EXPECT_EQ(rank1[1].shard_offset, 72);
  EXPECT_EQ(shard_pieces(l, 0, tensors).size(), 2u);
}

namespace {

std::vector<float> seeded(size_t n, uint64_t seed, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = random_value(Backend::Distribution::normal, 0.0f, scale, seed, i);
  return v;
}

Tensor host_tensor(std::vector<float>& v) { return Tensor{v.data(), DType::f32, Shape{static_cast<int64_t>(v.size())}, Device::cpu}; }

}  // namespace

TEST(ZeroShard, ShardedUpdateEqualsUnshardedAdamW) {
  const int world = 3;
  const int64_t total = 1000;  // not a multiple of anything: the last shard holds padding
  const ZeroShardLayout layout = zero_shard_layout(total, world);
  const size_t padded = static_cast<size_t>(layout.padded_total());
  AdamWParams p;
  p.lr = 1e-2f;
  p.weight_decay = 0.1f;
  p.grad_scale = 0.5f;
  const int steps = 3;
  auto grads_of = [&](int rank, int step) {
    std::vector<float> g = seeded(padded, 100 * rank + step, 1.0f);
    std::fill(g.begin() + total, g.end(), 0.0f);  // the padding's grads are zero
    return g;
  };
  std::vector<float> initial = seeded(padded, 7, 0.2f);
  std::fill(initial.begin() + total, initial.end(), 0.0f);

  // The reference: one AdamW over the whole space with the grads summed in rank order.
  std::vector<float> ref = initial, m(padded, 0.0f), v(padded, 0.0f);
  auto cpu = make_cpu_backend();
  for (int s = 0; s < steps; ++s) {
    std::vector<float> sum(padded, 0.0f);
    for (int r = 0; r < world; ++r) {
      const std::vector<float> g = grads_of(r, s);
      for (size_t i = 0; i < padded; ++i) sum[i] += g[i];
    }
    p.step = s + 1;
    cpu->adamw_step(host_tensor(ref), host_tensor(sum), host_tensor(m), host_tensor(v), p);
  }

  for (bool reduce_scatter : {true, false}) {
    std::vector<std::vector<float>> params(world, initial);
    disttest::InProcessGroup group(world);
    disttest::run_ranks(world, [&](int rank) {
      disttest::InProcessCommunicator comm(group, rank);
      auto backend = make_cpu_backend();
      std::vector<float> m_shard(static_cast<size_t>(layout.shard), 0.0f), v_shard = m_shard;
      AdamWParams q = p;
      for (int s = 0; s < steps; ++s) {
        std::vector<float> g = grads_of(rank, s);
        const Tensor flat_grads = host_tensor(g);
        if (reduce_scatter) {
          zero_reduce_scatter_grads(comm, layout, flat_grads, {});
        } else {
          comm.all_reduce_sum(flat_grads, flat_grads, {});  // what the grad buckets leave
        }
        q.step = s + 1;
        zero_adamw_shard(*backend, layout, rank, host_tensor(params[static_cast<size_t>(rank)]), flat_grads,
                         host_tensor(m_shard), host_tensor(v_shard), q);
        zero_all_gather_params(comm, layout, host_tensor(params[static_cast<size_t>(rank)]), {});
      }
    });
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(params[static_cast<size_t>(r)].size(), ref.size());
      for (size_t i = 0; i < padded; ++i)
        ASSERT_EQ(params[static_cast<size_t>(r)][i], ref[i]) << "rank " << r << " element " << i
                                                             << (reduce_scatter ? " reduce-scatter" : " all-reduce");
    }
  }
}
