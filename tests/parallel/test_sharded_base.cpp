// The sharded frozen base: per-unit layout from the plan's records (NF4 codes, absmax, nested
// constants; or 16-bit weights), the double-buffered gather schedule, and per-rank memory.
#include "memtune/parallel/sharded_base.h"

#include <gtest/gtest.h>

#include <cstring>
#include <iostream>
#include <map>

#include "memtune/core/bytes.h"
#include "memtune/model/llama_config.h"
#include "memtune/train/engine.h"
#include "memtune/train/engine_arena.h"
#include "inprocess_communicator.h"

using namespace memtune;

namespace {

LlamaConfig four_layer_model() {
  LlamaConfig c = resolve_model("tiny").config;
  c.num_hidden_layers = 4;
  return c;
}

RunConfig qlora_run() {
  RunConfig run;
  run.precision = Precision::bf16;
  run.load_in_4bit = true;
  run.per_device_train_batch_size = 1;
  run.max_seq_length = 64;
  return run;
}

}  // namespace

TEST(ShardedBase, UnitsHoldEveryBaseBufferOnce) {
  const LlamaConfig model = four_layer_model();
  for (bool four_bit : {true, false}) {
    RunConfig run = qlora_run();
    run.load_in_4bit = four_bit;
    const Plan plan = plan_run(run, model, Device::cpu);
    for (int world : {1, 2, 3}) {
      const ShardedBaseLayout layout = sharded_base_layout(plan.records, world);
      ASSERT_EQ(layout.units.size(), 1u + model.num_hidden_layers + 1u);
      EXPECT_EQ(layout.units.front().name, "embed_tokens");
      EXPECT_EQ(layout.units[1].name, "layers.0");
      EXPECT_EQ(layout.units.back().name, "head");
      uint64_t piece_bytes = 0, frozen_records = 0;
      bool has_absmax = false, has_nested = false;
      for (const BaseUnit& u : layout.units) {
        EXPECT_EQ(u.bytes, u.shard_bytes * world);
        EXPECT_EQ(u.shard_bytes % 256, 0u);
        uint64_t end = 0;
        for (const BaseUnitPiece& p : u.pieces) {
          EXPECT_EQ(p.offset % 256, 0u);
          EXPECT_GE(p.offset, end);  // no overlap
          end = p.offset + p.bytes;
          piece_bytes += p.bytes;
          if (u.layer >= 0) EXPECT_NE(p.name.find(fmt::format("layers.{}.", u.layer)), std::string::npos) << p.name;
          has_absmax |= p.name.find(".absmax") != std::string::npos;
          has_nested |= p.name.find(".nested_absmax") != std::string::npos;
        }
        EXPECT_LE(end, u.bytes);
      }
      for (const AllocationRecord& r : plan.records)
        if ((r.category == MemCategory::frozen_weights || r.category == MemCategory::quant_constants) && r.freed_at < 0)
          frozen_records += r.bytes;
      EXPECT_EQ(piece_bytes, frozen_records);
      EXPECT_EQ(layout.unsharded_bytes, frozen_records);
      EXPECT_EQ(has_absmax, four_bit);
      EXPECT_EQ(has_nested, four_bit);
      // Every rank keeps 1 / world of the base, give or take the 256-byte alignment of each piece
      // and of each unit's shard.
      size_t pieces = 0;
      for (const BaseUnit& u : layout.units) pieces += u.pieces.size();
      EXPECT_GE(layout.shard_bytes_per_rank() * world, frozen_records);
      EXPECT_LE(layout.shard_bytes_per_rank() * world, frozen_records + pieces * 256 + layout.units.size() * 256 * world);
    }
  }
}

TEST(ShardedBase, GatherScheduleIsDoubleBufferedAndPrefetchesTheNextUnit) {
  const ShardedBaseLayout layout = sharded_base_layout(plan_run(qlora_run(), four_layer_model(), Device::cpu).records, 2);
  std::vector<int> visits;
  const std::vector<GatherEvent> events = unit_visits_of_step(layout, &visits);
  // Forward: embed, 4 layers, head; backward: layers 3..0.
  EXPECT_EQ(visits, (std::vector<int>{0, 1, 2, 3, 4, 5, 4, 3, 2, 1}));
  EXPECT_EQ(check_gather_schedule(events, visits), "");
  // The gather of visit k + 1 is issued before visit k computes.
  for (size_t i = 0; i + 1 < events.size(); ++i)
    if (events[i].action == GatherAction::compute && i > 0 && events[i].unit != visits.back())
      EXPECT_EQ(events[i - 1].action, GatherAction::gather);
  // A schedule that gathers into a held buffer is caught.
  std::vector<GatherEvent> bad = events;
  bad.insert(bad.begin() + 1, GatherEvent{GatherAction::gather, 3, 0});
  EXPECT_NE(check_gather_schedule(bad, visits), "");
}

// A visit of the unit just computed (the last gathered layer's forward then its backward, where
// the head between them is not gathered: a replicated head, or streamed layers) reads the same
// buffer again: no gather and no release between the two, and the buffers alternate around it.
TEST(ShardedBase, ARepeatedVisitReadsTheSameBufferWithoutAGather) {
  const std::vector<int> visits{1, 2, 3, 3, 2, 1};
  EXPECT_EQ(gather_buffers(visits), (std::vector<int>{0, 1, 0, 0, 1, 0}));
  const std::vector<GatherEvent> events = gather_schedule(visits);
  EXPECT_EQ(check_gather_schedule(events, visits), "");
  int gathers = 0, releases = 0;
  for (const GatherEvent& e : events) {
    gathers += e.action == GatherAction::gather;
    releases += e.action == GatherAction::release;
  }
  EXPECT_EQ(gathers, 5);
  EXPECT_EQ(releases, 5);
  // The streamed layout of layers 1 and 3 of 4: every other unit kept whole, the visits end and
  // begin the backward with layer 3.
  const ShardedBaseLayout streamed = streamed_base_layout(plan_run(qlora_run(), four_layer_model(), Device::cpu).records, {1, 3});
  EXPECT_TRUE(streamed.from_host);
  std::vector<int> streamed_visits;
  const std::vector<GatherEvent> streamed_events = unit_visits_of_step(streamed, &streamed_visits);
  ASSERT_EQ(streamed_visits.size(), 4u);
  EXPECT_EQ(streamed_visits[1], streamed_visits[2]);
  EXPECT_EQ(streamed.units[static_cast<size_t>(streamed_visits[1])].layer, 3);
  EXPECT_EQ(check_gather_schedule(streamed_events, streamed_visits), "");
  for (const BaseUnit& u : streamed.units) EXPECT_EQ(u.replicated, u.layer != 1 && u.layer != 3) << u.name;
}

TEST(ShardedBase, PerRankMemoryShrinksTheBaseAndTheOptimizerState) {
  const LlamaConfig model = four_layer_model();
  const RunConfig run = qlora_run();
  const Plan single = plan_run(run, model, Device::cpu);
  const Plan rank_plan = plan_run(run, model, Device::cpu, 2);
  const RankMemory replicated = rank_memory(rank_plan, 2, false);
  const RankMemory sharded = rank_memory(rank_plan, 2, true);
  const int fw = static_cast<int>(MemCategory::frozen_weights), qc = static_cast<int>(MemCategory::quant_constants),
            opt = static_cast<int>(MemCategory::optimizer_state);
  // ZeRO-1: half the moments (within a shard's alignment).
  EXPECT_LE(rank_plan.at_peak[opt], single.at_peak[opt] / 2 + 2 * 64 * 4 * 2);
  EXPECT_EQ(replicated.at_peak[fw], rank_plan.at_peak[fw]);
  const ShardedBaseLayout layout = sharded_base_layout(rank_plan.records, 2, true);
  EXPECT_EQ(sharded.base_shard_bytes, layout.shard_bytes_per_rank());
  EXPECT_EQ(sharded.base_gather_bytes, 2 * layout.gather_buffer_bytes());
  EXPECT_EQ(sharded.at_peak[fw] + sharded.at_peak[qc],
            rank_plan.at_peak[fw] + rank_plan.at_peak[qc] - layout.unsharded_arena_bytes + sharded.base_shard_bytes +
                sharded.base_gather_bytes);
  EXPECT_LT(sharded.arena_bytes, single.arena_bytes);
  const std::string table = format_rank_memory(single, sharded);
  EXPECT_NE(table.find("per-rank memory, 2 ranks"), std::string::npos);
  EXPECT_NE(table.find("frozen weights"), std::string::npos);
}

// Replicating a unit is chosen only for one larger than every layer and only when it leaves a
// rank fewer bytes than the all-sharded layout (the 70B test below sees the LM head replicated).
TEST(ShardedBase, AUnitMuchLargerThanALayerIsReplicatedOnlyWhenThatCostsLess) {
  const Plan plan = plan_run(qlora_run(), four_layer_model(), Device::cpu, 2);
  for (int world : {2, 4}) {
    const ShardedBaseLayout sharded = sharded_base_layout(plan.records, world);
    const ShardedBaseLayout chosen = sharded_base_layout(plan.records, world, true);
    auto per_rank = [](const ShardedBaseLayout& l) { return l.shard_bytes_per_rank() + 2 * l.gather_buffer_bytes(); };
    EXPECT_LE(per_rank(chosen), per_rank(sharded));
    uint64_t largest_layer = 0;
    for (const BaseUnit& u : sharded.units)
      if (u.layer >= 0) largest_layer = std::max(largest_layer, u.bytes);
    for (const BaseUnit& u : chosen.units) {
      if (u.layer >= 0) EXPECT_FALSE(u.replicated) << u.name;
      if (u.replicated) EXPECT_GT(u.bytes, largest_layer) << u.name;
    }
    // The visits skip what is not gathered.
    std::vector<int> visits;
    const std::vector<GatherEvent> events = unit_visits_of_step(chosen, &visits);
    for (int v : visits) EXPECT_FALSE(chosen.units[static_cast<size_t>(v)].replicated);
    EXPECT_EQ(check_gather_schedule(events, visits), "");
  }
  // One rank: nothing to choose.
  for (const BaseUnit& u : sharded_base_layout(plan.records, 1, true).units) EXPECT_FALSE(u.replicated);
}

// The done-when model: Llama 3.1 70B QLoRA at micro-batch 1 x 2048 on 2 ranks with both
// offloads, planned: one rank must fit 24 GiB (the device run is the lead's).
TEST(ShardedBase, Llama70bQloraOnTwoRanksPlansUnder24GiBPerRank) {
  const LlamaConfig model = resolve_model("llama-3.1-70b").config;
  RunConfig run;
  run.model = "llama-3.1-70b";
  run.precision = Precision::bf16;
  run.load_in_4bit = true;
  run.attn_implementation = "flash";
  run.gradient_checkpointing = true;
  run.loss_implementation = "chunked";
  run.offload_activations = true;
  run.offload_embeddings = true;
  run.per_device_train_batch_size = 1;
  run.max_seq_length = 2048;
  const Plan single = plan_run(run, model, Device::cuda);
  const Plan rank_plan = plan_run(run, model, Device::cuda, 2);
  const RankMemory sharded = rank_memory(rank_plan, 2, true);
  std::cout << format_rank_memory(single, sharded);
  EXPECT_LT(sharded.arena_bytes, 24ull << 30);
  const ShardedBaseLayout layout = sharded_base_layout(rank_plan.records, 2, true);
  EXPECT_EQ(layout.units.size(), 81u) << "80 layers and the head (the embedding is on the host)";
  // The LM head (bf16, 2.1 GB) stays whole: the gather buffers are one NF4 layer each.
  EXPECT_TRUE(layout.units.back().replicated);
  EXPECT_LT(layout.gather_buffer_bytes(), 600ull << 20);
  // The same run with every unit sharded, the LM head gathered into head-sized buffers.
  const ShardedBaseLayout all_sharded = sharded_base_layout(rank_plan.records, 2);
  const uint64_t all_sharded_arena = sharded.arena_bytes - layout.shard_bytes_per_rank() -
                                     2 * layout.gather_buffer_bytes() + all_sharded.shard_bytes_per_rank() +
                                     2 * all_sharded.gather_buffer_bytes();
  std::cout << "every unit sharded (the LM head gathered too): arena per rank " << format_bytes(all_sharded_arena)
            << "\n";
  EXPECT_LT(sharded.arena_bytes, all_sharded_arena);
}

// The gathers on ranks that are threads (the in-process test double stands in for NCCL): every
// rank keeps only its shards, and each unit gathered by the step's schedule is, piece by piece,
// bit for bit the buffer of the unsharded engine (NF4 codes, absmax, nested constants, norms).
TEST(ShardedBase, GatheredUnitsAreTheUnshardedBytesOnEveryRank) {
  const LlamaConfig model = four_layer_model();
  for (int world : {2, 3})
    for (bool replicate : {false, true}) {
      disttest::InProcessGroup group(world);
      disttest::run_ranks(world, [&](int rank) {
        disttest::InProcessCommunicator comm(group, rank);
        auto cpu = make_cpu_backend();
        PlannedEngine engine(*cpu, qlora_run(), model);
        engine->init_random_weights(7);
        const ShardedBaseLayout layout = sharded_base_layout(engine->memory().records(), world, replicate);
        std::vector<uint8_t> arena(layout.shard_bytes_per_rank() + 2 * layout.gather_buffer_bytes() +
                                   (layout.units.size() + 2) * 256);
        Memory memory(Device::cpu, arena.data(), arena.size());
        ShardedBase base(*cpu, memory, layout, engine->memory(), comm);
        uint64_t kept = 0;
        for (size_t u = 0; u < layout.units.size(); ++u) kept += base.shard(static_cast<int>(u)).nbytes();
        EXPECT_EQ(kept, layout.shard_bytes_per_rank());
        std::map<std::string, const AllocationRecord*> source;
        for (const AllocationRecord& r : engine->memory().records())
          if (r.freed_at < 0) source[r.name] = &r;
        std::vector<int> visits;
        int computed = 0;
        for (const GatherEvent& e : unit_visits_of_step(layout, &visits)) {
          if (e.action == GatherAction::gather) base.gather(e.unit, e.buffer);
          if (e.action == GatherAction::wait) base.wait();
          if (e.action != GatherAction::compute) continue;
          ++computed;
          const BaseUnit& unit = layout.units[static_cast<size_t>(e.unit)];
          for (size_t p = 0; p < unit.pieces.size(); ++p) {
            const Tensor got = base.piece(e.unit, e.buffer, p);
            const Tensor want = engine->memory().bytes_of(*source.at(unit.pieces[p].name));
            ASSERT_EQ(got.nbytes(), want.nbytes());
            ASSERT_EQ(std::memcmp(got.data, want.data, want.nbytes()), 0) << unit.pieces[p].name << " rank " << rank;
          }
        }
        EXPECT_EQ(computed, static_cast<int>(visits.size()));
        // Replicated units are read from the shard with no gather.
        for (size_t u = 0; u < layout.units.size(); ++u)
          if (layout.units[u].replicated)
            EXPECT_EQ(std::memcmp(base.piece(static_cast<int>(u), 0, 0).data,
                                  engine->memory().bytes_of(*source.at(layout.units[u].pieces[0].name)).data,
                                  layout.units[u].pieces[0].bytes), 0);
      });
    }
}

TEST(ShardedBase, ALayoutForAnotherWorldIsAClearError) {
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, qlora_run(), four_layer_model());
  const ShardedBaseLayout layout = sharded_base_layout(engine->memory().records(), 3);
  const std::unique_ptr<Communicator> one = make_single_rank_communicator();
  std::vector<uint8_t> arena(1 << 20);
  Memory memory(Device::cpu, arena.data(), arena.size());
  EXPECT_THROW(ShardedBase(*cpu, memory, layout, engine->memory(), *one), Error);
  EXPECT_THROW(sharded_base_layout(engine->memory().records(), 0), Error);
}
