// The NCCL communicator with one rank (world_size 1, in-process ncclCommInitRank on a fresh
// unique id): every collective on small device tensors, the launch path through the TCP
// bootstrap, and the data-parallel adapter update (grad buckets, ZeRO-1 AdamW, all-gather) over
// real NCCL against the plain per-tensor AdamW. Skipped without a GPU or without NCCL.
#include <gtest/gtest.h>

#include <map>

#include "gpu_test_util.h"
#include "memtune/parallel/communicator.h"
#include "memtune/parallel/data_parallel.h"
#include "memtune/parallel/launch_env.h"
#include "memtune/parallel/sharded_base.h"
#include "memtune/train/engine_arena.h"
#include "memtune/model/llama_config.h"

using namespace memtune;
using gputest::DeviceTensor;
using optest::HostTensor;

namespace {

class NcclTest : public gputest::CudaTest {
 protected:
  void SetUp() override {
    gputest::CudaTest::SetUp();
    if (IsSkipped()) return;
    if (!nccl_available()) GTEST_SKIP() << "built without NCCL: NCCL tests skipped";
    comm_ = make_nccl_communicator_from_id(nccl_unique_id(), 0, 1);
  }
  Communicator& comm() { return *comm_; }
  HostTensor seeded(int64_t n, uint64_t seed) {
    HostTensor h(DType::f32, Shape{n});
    for (int64_t i = 0; i < n; ++i) h.f32()[i] = random_value(Backend::Distribution::normal, 0.0f, 1.0f, seed, i);
    return h;
  }
  std::unique_ptr<Communicator> comm_;
};

}  // namespace

TEST_F(NcclTest, EveryCollectiveOnOneRankIsTheIdentity) {
  EXPECT_EQ(comm().world_size(), 1);
  EXPECT_EQ(comm().name(), "nccl");
  const HostTensor host = seeded(1000, 1);
  const DeviceTensor send = upload(host);
  for (const char* op : {"all_reduce", "all_reduce_in_place", "reduce_scatter", "all_gather", "broadcast"}) {
    DeviceTensor recv = poisoned(DType::f32, Shape{1000});
    const std::string name = op;
    if (name == "all_reduce") comm().all_reduce_sum(send, recv, {});
    if (name == "all_reduce_in_place") {
      recv = upload(host);
      comm().all_reduce_sum(recv, recv, {});
    }
    if (name == "reduce_scatter") comm().reduce_scatter_sum(send, recv, {});
    if (name == "all_gather") comm().all_gather(send, recv, {});
    if (name == "broadcast") {
      recv = upload(host);
      comm().broadcast(recv, 0, {});
    }
    comm().wait({});
    EXPECT_EQ(recv.floats(), host.floats()) << op;
  }
  // Other dtypes: i32 counts and bf16.
  HostTensor counts(DType::i32, Shape{2});
  counts.storage.assign(8, 0);
  reinterpret_cast<int32_t*>(counts.storage.data())[0] = 123;
  reinterpret_cast<int32_t*>(counts.storage.data())[1] = 456;
  DeviceTensor device_counts = upload(counts);
  comm().all_reduce_sum(device_counts, device_counts, {});
  comm().wait({});
  EXPECT_EQ(device_counts.download().storage, counts.storage);
}

TEST_F(NcclTest, LaunchThroughTheBootstrapWithOneProcess) {
  LaunchEnv env;  // rank 0 of 1: the bootstrap hands the id over without a socket
  std::unique_ptr<Communicator> launched = make_nccl_communicator(env);
  const DeviceTensor t = upload(seeded(64, 2));
  launched->all_reduce_sum(t, t, {});
  launched->wait({});
  EXPECT_EQ(std::string(std::getenv("NCCL_NVLS_ENABLE")), "0");
}

TEST_F(NcclTest, DataParallelUpdateOverNcclEqualsThePlainAdamW) {
  LlamaConfig model = resolve_model("tiny").config;
  model.num_hidden_layers = 3;
  LoraConfig lora;
  lora.r = 4;
  lora.alpha = 8;
  lora.targets = {Projection::q, Projection::v, Projection::down};
  const uint64_t arena_bytes = 64ull << 20;
  void* arena_a = gpu().allocate_arena(arena_bytes);
  void* arena_b = gpu().allocate_arena(arena_bytes);
  {
    Memory memory_a(Device::cuda, arena_a, arena_bytes), memory_b(Device::cuda, arena_b, arena_bytes);
    LoraState plain = LoraState::allocate(memory_a, model, lora, DType::f32, true);
    LoraState flat = LoraState::allocate(memory_b, model, lora, DType::f32, false, lora_flat_multiple(1));
    DataParallelOptions options;
    options.bucket_bytes = 1;  // a bucket per layer: several all-reduces
    DataParallelAdapters dp(gpu(), memory_b, flat, comm(), options);
    EXPECT_EQ(dp.buckets().buckets.size(), 3u);
    plain.init_peft(gpu(), 5);
    plain.zero_optimizer(gpu());
    flat.init_peft(gpu(), 5);
    DeviceTensor loss = upload(seeded(1, 3));
    AdamWParams params;
    params.lr = 1e-2f;
    for (int step = 1; step <= 2; ++step) {
      for (size_t i = 0; i < plain.tensors().size(); ++i) {
        const LoraTensors &p = plain.tensors()[i], &f = flat.tensors()[i];
        gpu().fill_random(p.grad_a, Backend::Distribution::normal, 0.0f, 1.0f, 100 * step + i);
        gpu().fill_random(p.grad_b, Backend::Distribution::normal, 0.0f, 1.0f, 200 * step + i);
        gpu().fill_random(f.grad_a, Backend::Distribution::normal, 0.0f, 1.0f, 100 * step + i);
        gpu().fill_random(f.grad_b, Backend::Distribution::normal, 0.0f, 1.0f, 200 * step + i);
      }
      params.step = step;
      for (const LoraTensors& t : plain.tensors()) {
        gpu().adamw_step(t.a, t.grad_a, t.exp_avg_a, t.exp_avg_sq_a, params);
        gpu().adamw_step(t.b, t.grad_b, t.exp_avg_b, t.exp_avg_sq_b, params);
      }
      dp.reduce_gradients(loss);
      dp.adamw_step(params);
    }
    for (size_t i = 0; i < plain.tensors().size(); ++i)
      for (const auto& [p, f] : {std::pair{plain.tensors()[i].a, flat.tensors()[i].a},
                                 std::pair{plain.tensors()[i].b, flat.tensors()[i].b}}) {
        HostTensor hp(DType::f32, p.shape), hf(DType::f32, f.shape);
        gpu().copy_to_host(hp.storage.data(), p);
        gpu().copy_to_host(hf.storage.data(), f);
        EXPECT_EQ(hp.floats(), hf.floats()) << "tensor " << i;
      }
  }
  gpu().free_arena(arena_a);
  gpu().free_arena(arena_b);
}

// The sharded base's gathers over real NCCL (u8 all-gathers into the two gather buffers, one
// rank): every piece of every unit of a 4-bit base, gathered in the step's schedule, is the
// engine's buffer bit for bit.
TEST_F(NcclTest, ShardedBaseGathersOverNcclAreTheUnshardedBytes) {
  LlamaConfig model = resolve_model("tiny").config;
  model.num_hidden_layers = 3;
  RunConfig run;
  run.precision = Precision::bf16;
  run.load_in_4bit = true;
  run.per_device_train_batch_size = 1;
  run.max_seq_length = 64;
  PlannedEngine engine(gpu(), run, model);
  engine->init_random_weights(7);
  const ShardedBaseLayout layout = sharded_base_layout(engine->memory().records(), 1);
  const uint64_t arena_bytes = layout.shard_bytes_per_rank() + 2 * layout.gather_buffer_bytes() + (layout.units.size() + 2) * 256;
  void* arena = gpu().allocate_arena(arena_bytes);
  {
    Memory memory(Device::cuda, arena, arena_bytes);
    ShardedBase base(gpu(), memory, layout, engine->memory(), comm());
    std::map<std::string, const AllocationRecord*> source;
    for (const AllocationRecord& r : engine->memory().records())
      if (r.freed_at < 0) source[r.name] = &r;
    std::vector<int> visits;
    for (const GatherEvent& e : unit_visits_of_step(layout, &visits)) {
      if (e.action == GatherAction::gather) base.gather(e.unit, e.buffer);
      if (e.action == GatherAction::wait) base.wait();
      if (e.action != GatherAction::compute) continue;
      const BaseUnit& unit = layout.units[static_cast<size_t>(e.unit)];
      for (size_t p = 0; p < unit.pieces.size(); ++p) {
        const Tensor got = base.piece(e.unit, e.buffer, p);
        const Tensor want = engine->memory().bytes_of(*source.at(unit.pieces[p].name));
        std::vector<uint8_t> hg(got.nbytes()), hw(want.nbytes());
        gpu().copy_to_host(hg.data(), got);
        gpu().copy_to_host(hw.data(), want);
        ASSERT_EQ(hg, hw) << unit.pieces[p].name;
      }
    }
  }
  gpu().free_arena(arena);
}

// The side stream (Communicator::side_stream) is a stream of its own, and the events order it
// against the compute stream both ways: a collective after after_compute reads what the kernels
// before it wrote, and a kernel after compute_waits reads what the collective wrote. The buffer
// is large (64 MiB) so that a missing order would show as poison or stale values.
TEST_F(NcclTest, SideStreamCollectivesAreOrderedAgainstComputeByEvents) {
  const CommStream side = comm().side_stream();
  EXPECT_NE(side.cuda_stream, nullptr);
  EXPECT_EQ(comm().side_stream().cuda_stream, side.cuda_stream) << "one side stream per communicator";
  const CommEvent reduced = comm().create_event();
  const int64_t n = int64_t{1} << 24;
  DeviceTensor send = poisoned(DType::f32, Shape{n});
  DeviceTensor recv = poisoned(DType::f32, Shape{n});
  DeviceTensor doubled = poisoned(DType::f32, Shape{n});
  for (int round = 1; round <= 3; ++round) {
    gpu().fill(send, static_cast<float>(round));  // compute stream
    comm().after_compute(side);
    comm().all_reduce_sum(send, recv, side);
    comm().record(reduced, side);
    comm().compute_waits(reduced);
    gpu().add(doubled, recv, recv);  // compute stream, after the all-reduce
    comm().wait(side);
    const std::vector<float> got = doubled.download().floats();
    size_t wrong = 0;
    for (float v : got) wrong += v != 2.0f * static_cast<float>(round);
    EXPECT_EQ(wrong, 0u) << "round " << round;
  }
}
