// The sharded base inside the training step (run.shard_base, ranks as threads over the
// in-process communicator): each rank keeps only its shards, the step gathers every unit just
// in time, and the numbers are those of the replicated base: bit for bit against the same ranks
// with the whole base, and within fp32 tolerance against one rank with all the micro-batches
// (the data-parallel sum over ranks adds in another order than one rank's accumulation).
#include "memtune/parallel/sharded_base.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "memtune/train/engine_arena.h"
#include "../support/engine_setup.h"
#include "inprocess_communicator.h"
#include "rank_engines.h"

using namespace memtune;

namespace {

using namespace enginetest;  // the shared engine set-up (tests/support/engine_setup.h)

LlamaConfig three_layer_model() {
  LlamaConfig c = enginetest::small_model();
  c.num_hidden_layers = 3;
  return c;
}

struct Variant {
  const char* name;
  bool four_bit, checkpointing, offload;  // offload: the activations and the embedding table
  int64_t token_chunks;
  bool tied = false;  // the LM head is the embedding table (kept whole on every rank)
};

RunConfig run_of(const Variant& v) {
  RunConfig run = enginetest::small_run();
  run.load_in_4bit = v.four_bit;
  run.gradient_checkpointing = v.checkpointing;
  run.offload_activations = v.offload;
  run.offload_embeddings = v.offload;  // the table on the host: not in the layout, read in place
  run.mlp_chunk_tokens = v.token_chunks;
  run.lora_dropout = 0.1;
  return run;
}

struct Outcome {
  std::vector<double> losses;      // per step
  std::vector<float> first_grads;  // after the first step's reduce
  std::vector<float> adapters;     // after the last step
  double eval_loss = 0;
};

constexpr int kSteps = 2;

// Global micro-batch m of step s; rank r of `world` takes m = r, r + world, ...
std::vector<HostMicroBatch> step_batches(const LlamaConfig& model, const RunConfig& run, int step, int count) {
  return enginetest::random_batches(model, run, count, 90 + step);
}

Outcome run_rank(Engine& engine, const LlamaConfig& model, const RunConfig& run, int rank, int world,
                 int micro_batches) {
  init_with_nonzero_b(engine);
  Outcome out;
  for (int s = 0; s < kSteps; ++s) {
    const std::vector<HostMicroBatch> all = step_batches(model, run, s, micro_batches);
    std::vector<HostMicroBatch> mine;
    for (int m = rank; m < micro_batches; m += world) mine.push_back(all[static_cast<size_t>(m)]);
    out.losses.push_back(engine.train_step(mine).loss);
    if (s == 0) out.first_grads = adapter_grads(engine);
  }
  out.adapters = adapter_values(engine);
  out.eval_loss = engine.eval_loss_sum(step_batches(model, run, 7, 1)[0]).first;
  return out;
}

// `world` ranks; each returns its outcome. Checks that each rank stays inside its plan.
std::vector<Outcome> run_world(const LlamaConfig& model, const RunConfig& run, int world, int micro_batches) {
  std::vector<Outcome> out(static_cast<size_t>(world));
  disttest::InProcessGroup group(world);
  disttest::run_ranks(world, [&](int rank) {
    disttest::InProcessCommunicator comm(group, rank);
    auto cpu = make_cpu_backend();
    PlannedEngine engine(*cpu, run, model, &comm);
    EXPECT_EQ(engine->base_sharded(), run.shard_base);
    out[static_cast<size_t>(rank)] = run_rank(engine.engine(), model, run, rank, world, micro_batches);
    // Two steps repeat the planned step's allocations (so the records differ in number, not in
    // peak).
    EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes) << "rank " << rank;
  });
  return out;
}


// 2 and 3 ranks, sharded against replicated and against one rank with every micro-batch.
void expect_sharded_equals_whole(const Variant& v) {
  LlamaConfig model = three_layer_model();
  model.tie_word_embeddings = v.tied;
  for (int world : {2, 3}) {
    SCOPED_TRACE(std::string(v.name) + " on " + std::to_string(world) + " ranks");
    RunConfig run = run_of(v);
    const int micro_batches = world;  // one per rank and step
    auto cpu = make_cpu_backend();
    PlannedEngine single(*cpu, run, model);
    const Outcome one = run_rank(single.engine(), model, run, 0, 1, micro_batches);

    const std::vector<Outcome> whole = run_world(model, run, world, micro_batches);
    run.shard_base = true;
    const std::vector<Outcome> sharded = run_world(model, run, world, micro_batches);
    for (int r = 0; r < world; ++r) {
      const Outcome& got = sharded[static_cast<size_t>(r)];
      // Bit for bit what the same ranks compute with the whole base on each.
      EXPECT_EQ(got.losses, whole[static_cast<size_t>(r)].losses) << "rank " << r;
      EXPECT_EQ(got.first_grads, whole[static_cast<size_t>(r)].first_grads) << "rank " << r;
      EXPECT_EQ(got.adapters, whole[static_cast<size_t>(r)].adapters) << "rank " << r;
      EXPECT_EQ(got.eval_loss, whole[static_cast<size_t>(r)].eval_loss) << "rank " << r;
      // Within fp32 tolerance of one rank with the whole base and every micro-batch.
      for (int s = 0; s < kSteps; ++s)
        EXPECT_NEAR(got.losses[static_cast<size_t>(s)], one.losses[static_cast<size_t>(s)],
                    1e-5 * one.losses[static_cast<size_t>(s)]);
      EXPECT_LT(rel_error(got.first_grads, one.first_grads), 1e-5);
      EXPECT_LT(rel_error(got.adapters, one.adapters), 1e-5);
      EXPECT_NEAR(got.eval_loss, one.eval_loss, 1e-5 * one.eval_loss);
    }
  }
}

}  // namespace

TEST(ShardedStep, Fp32RanksWithTheShardedBaseEqualOneRankWithTheWholeBase) {
  expect_sharded_equals_whole({"fp32", false, false, false, 0});
}

TEST(ShardedStep, Fp32CheckpointedAndChunkedRecomputeReadsTheSameGatheredWeights) {
  expect_sharded_equals_whole({"fp32/ckpt/token-chunks", false, true, false, 8});
}

TEST(ShardedStep, TiedEmbeddingsKeepTheTableWholeForTheHead) {
  expect_sharded_equals_whole({"fp32/tied", false, false, false, 0, /*tied=*/true});
}

TEST(ShardedStep, QloraRanksWithTheShardedBaseEqualOneRankWithTheWholeBase) {
  expect_sharded_equals_whole({"nf4", true, false, false, 0});
}

TEST(ShardedStep, QloraWithCheckpointingActivationOffloadAndHostEmbeddings) {
  expect_sharded_equals_whole({"nf4/ckpt/offload", true, true, true, 0});
}

// A rank's arena holds its shards and two gather buffers, not the whole base; the plan traced
// with the sharded base is what the arithmetic on the replicated plan predicts (rank_memory),
// and lower than the replicated plan by the base bytes that sharding saves.
TEST(ShardedStep, ThePerRankPlanHoldsTheShardsAndIsLowerByTheShardedBytes) {
  LlamaConfig model = enginetest::small_model();
  model.num_hidden_layers = 8;  // enough layers that the shards outweigh the two gather buffers
  for (bool four_bit : {false, true})
    for (int world : {2, 3}) {
      SCOPED_TRACE(std::string(four_bit ? "nf4" : "fp32") + " on " + std::to_string(world) + " ranks");
      RunConfig run = enginetest::small_run();
      run.load_in_4bit = four_bit;
      run.gradient_checkpointing = true;
      const Plan replicated = plan_run(run, model, Device::cpu, world);
      run.shard_base = true;
      const Plan sharded = plan_run(run, model, Device::cpu, world);
      ASSERT_TRUE(plan_has_sharded_base(sharded));
      ASSERT_FALSE(plan_has_sharded_base(replicated));
      for (const AllocationRecord& r : sharded.records)
        EXPECT_NE(r.name.rfind("model.", 0), 0u) << r.name << " is a whole base buffer in a sharded rank's arena";

      const ShardedBaseLayout layout = sharded_base_layout(replicated.records, world, true);
      const uint64_t kept = layout.shard_bytes_per_rank() + 2 * layout.gather_buffer_bytes();
      ASSERT_GT(layout.unsharded_arena_bytes, kept);
      const uint64_t saved = layout.unsharded_arena_bytes - kept;  // live bytes count aligned
      EXPECT_EQ(sharded.peak_live_bytes + saved, replicated.peak_live_bytes);
      EXPECT_EQ(replicated.arena_bytes - sharded.arena_bytes, saved);

      const RankMemory traced = rank_memory(sharded, world, true);
      const RankMemory predicted = rank_memory(replicated, world, true);
      EXPECT_EQ(traced.arena_bytes, sharded.arena_bytes);
      EXPECT_EQ(traced.arena_bytes, predicted.arena_bytes);
      EXPECT_EQ(traced.peak_live_bytes(), predicted.peak_live_bytes());
      EXPECT_EQ(traced.base_shard_bytes, predicted.base_shard_bytes);
      EXPECT_EQ(traced.base_gather_bytes, predicted.base_gather_bytes);
      EXPECT_EQ(traced.replicated_units, predicted.replicated_units);
      // Read without --shard_base, a sharded plan is a contradiction.
      EXPECT_THROW(rank_memory(sharded, world, false), Error);
    }
}

// One all-gather per visit of a gathered unit: a training step gathers the embedding, every
// layer and the head on the way forward and every layer again on the way back (the recompute
// of checkpointing inside the same visit: no extra gather); eval gathers the forward's only.
TEST(ShardedStep, EachVisitGathersItsUnitOnce) {
  const LlamaConfig model = three_layer_model();
  for (bool checkpointing : {false, true}) {
    RunConfig run = run_of({"fp32", false, checkpointing, false, 0});
    int calls[2][2] = {};  // [sharded][after train, after eval]
    for (bool shard : {false, true}) {
      run.shard_base = shard;
      disttest::InProcessGroup group(2);
      disttest::run_seeded_engines(group, 2, run, model,
                                   [&](int rank, PlannedEngine& engine, disttest::InProcessCommunicator& comm) {
        const int before = comm.calls();
        engine->train_step({step_batches(model, run, 0, 2)[static_cast<size_t>(rank)]});
        const int after_train = comm.calls();
        engine->eval_loss_sum(step_batches(model, run, 1, 1)[0]);
        if (rank == 0) {
          calls[shard][0] = after_train - before;
          calls[shard][1] = comm.calls() - after_train;
        }
      });
    }
    std::vector<AllocationRecord> records = plan_run(run, model, Device::cpu, 2).records;
    run.shard_base = false;
    const ShardedBaseLayout layout = sharded_base_layout(plan_run(run, model, Device::cpu, 2).records, 2, true);
    const int forward = static_cast<int>(gathered_unit_visits(layout, false).size());
    const int training = static_cast<int>(gathered_unit_visits(layout, true).size());
    EXPECT_EQ(training, forward + static_cast<int>(model.num_hidden_layers));
    // The head is gathered between the last layer's two visits here, so no visit repeats the one
    // before it (a repeat would read the same buffer again, without a gather: gather_schedule).
    const std::vector<GatherEvent> schedule = gather_schedule(gathered_unit_visits(layout, true));
    EXPECT_EQ(std::count_if(schedule.begin(), schedule.end(),
                            [](const GatherEvent& e) { return e.action == GatherAction::gather; }),
              training);
    EXPECT_EQ(calls[1][0] - calls[0][0], training) << "checkpointing " << checkpointing;
    EXPECT_EQ(calls[1][1] - calls[0][1], forward) << "checkpointing " << checkpointing;
  }
}
