// The data-parallel step on the CPU: 2 ranks (threads, in-process communicator) give the same
// adapters as 1 rank with twice the accumulation, through the engine and through the trainer;
// the plan of a rank equals what it allocates; a rank that stops makes the others fail clearly.
#include "memtune/parallel/data_parallel.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "memtune/data/sft_dataset.h"
#include "memtune/parallel/launch_env.h"
#include "memtune/train/engine_arena.h"
#include "memtune/train/trainer.h"
#include "../support/engine_setup.h"
#include "inprocess_communicator.h"
#include "rank_engines.h"

using namespace memtune;

namespace {

using namespace enginetest;  // the shared engine set-up (tests/support/engine_setup.h)

}  // namespace

TEST(DataParallel, TwoRanksEqualOneRankWithTwiceTheAccumulation) {
  const LlamaConfig model = small_model();
  for (bool bf16 : {false, true}) {
    RunConfig run = small_run();
    run.lora_dropout = 0.1;  // dropout is seeded by the global micro-batch index
    run.weight_decay = 0.01;
    if (bf16) run.precision = Precision::bf16;
    const int steps = 3, per_rank = 2;
    std::vector<std::vector<HostMicroBatch>> step_batches;
    for (int s = 0; s < steps; ++s) step_batches.push_back(enginetest::random_batches(model, run, 2 * per_rank, 50 + s));

    auto cpu = make_cpu_backend();
    PlannedEngine single(*cpu, run, model);
    init_with_nonzero_b(single.engine());
    std::vector<double> single_losses;
    for (int s = 0; s < steps; ++s) single_losses.push_back(single->train_step(step_batches[static_cast<size_t>(s)]).loss);
    const std::vector<float> expected = adapter_values(single.engine());

    std::vector<std::vector<float>> got(2);
    std::vector<std::vector<double>> losses(2);
    disttest::InProcessGroup group(2);
    disttest::run_seeded_engines(group, 2, run, model,
                                 [&](int rank, PlannedEngine& engine, disttest::InProcessCommunicator& comm) {
      ASSERT_EQ(engine->world_size(), 2);
      for (int s = 0; s < steps; ++s) {
        std::vector<HostMicroBatch> mine;  // global micro-batches rank, rank + 2, ...
        for (int m = rank; m < 2 * per_rank; m += 2) mine.push_back(step_batches[static_cast<size_t>(s)][static_cast<size_t>(m)]);
        const StepReport report = engine->train_step(mine);
        losses[static_cast<size_t>(rank)].push_back(report.loss);
        EXPECT_EQ(report.tokens, 2 * per_rank * run.per_device_train_batch_size * run.max_seq_length);
      }
      got[static_cast<size_t>(rank)] = adapter_values(engine.engine());
    });
    EXPECT_EQ(got[0], got[1]) << "the ranks disagree";
    EXPECT_LT(rel_error(got[0], expected), bf16 ? 2e-3 : 1e-5) << (bf16 ? "bf16" : "fp32");
    for (int s = 0; s < steps; ++s) {
      EXPECT_NEAR(losses[0][static_cast<size_t>(s)], single_losses[static_cast<size_t>(s)], 1e-4 * single_losses[static_cast<size_t>(s)]);
      EXPECT_EQ(losses[0][static_cast<size_t>(s)], losses[1][static_cast<size_t>(s)]);
    }
  }
}

// Wraps a rank's communicator and notes, at each all-reduce, which part of the flat grads it
// covers and whether layer 0's grads had been computed yet (they are zero until layer 0's
// backward: one micro-batch per step).
class BackwardSpyCommunicator final : public Communicator {
 public:
  struct Call {
    int64_t grad_begin = -1;  // the flat grad element where the range starts; -1: not the grads
    int64_t numel = 0;
    bool layer0_grads_done = false;
  };
  explicit BackwardSpyCommunicator(Communicator& inner) : inner_(inner) {}
  void watch(const LoraState& lora) { lora_ = &lora; }
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::string name() const override { return "backward spy over " + inner_.name(); }
  void all_reduce_sum(const Tensor& send, const Tensor& recv, CommStream stream) override {
    Call call;
    call.numel = send.numel();
    const Tensor& grads = lora_->flat_grads();
    const auto* g = static_cast<const float*>(grads.data);
    const auto* p = static_cast<const float*>(send.data);
    if (send.dtype == DType::f32 && p >= g && p < g + grads.numel()) call.grad_begin = p - g;
    for (size_t i = 0; i < lora_->specs().size(); ++i)
      if (lora_->specs()[i].layer == 0)
        for (const Tensor* t : {&lora_->tensors()[i].grad_a, &lora_->tensors()[i].grad_b})
          for (int64_t k = 0; k < t->numel(); ++k) call.layer0_grads_done |= t->as<float>()[k] != 0.0f;
    calls.push_back(call);
    inner_.all_reduce_sum(send, recv, stream);
  }
  void reduce_scatter_sum(const Tensor& send, const Tensor& recv, CommStream stream) override {
    inner_.reduce_scatter_sum(send, recv, stream);
  }
  void all_gather(const Tensor& send, const Tensor& recv, CommStream stream) override { inner_.all_gather(send, recv, stream); }
  void broadcast(const Tensor& buffer, int root, CommStream stream) override { inner_.broadcast(buffer, root, stream); }
  void wait(CommStream stream) override { inner_.wait(stream); }
  std::vector<Call> calls;

 private:
  Communicator& inner_;
  const LoraState* lora_ = nullptr;
};

// The overlap hook: with one bucket per layer, the last layer's bucket is all-reduced before
// layer 0's backward has run (inside the backward, not after it), then layer 0's; the result
// still equals one rank with twice the accumulation. Both backward loops (kept and offloaded
// layer inputs) call the hook.
TEST(DataParallel, BucketsAreAllReducedInsideTheBackwardLastLayerFirst) {
  const LlamaConfig model = small_model();
  for (bool offload : {false, true}) {
    RunConfig run = small_run();
    run.ddp_bucket_cap_mb = 1e-9;  // one byte: every layer is a bucket of its own
    run.gradient_checkpointing = offload;
    run.offload_activations = offload;
    const std::vector<HostMicroBatch> batches = enginetest::random_batches(model, run, 2, 21);
    auto cpu = make_cpu_backend();
    PlannedEngine single(*cpu, run, model);
    init_with_nonzero_b(single.engine());
    const double single_loss = single->train_step(batches).loss;
    const std::vector<float> expected = adapter_values(single.engine());

    std::vector<std::vector<BackwardSpyCommunicator::Call>> calls(2);
    std::vector<std::vector<float>> got(2);
    std::vector<double> losses(2);
    disttest::InProcessGroup group(2);
    disttest::run_ranks(2, [&](int rank) {
      disttest::InProcessCommunicator inner(group, rank);
      BackwardSpyCommunicator spy(inner);
      auto backend = make_cpu_backend();
      PlannedEngine engine(*backend, run, model, &spy);
      spy.watch(engine->lora());
      ASSERT_EQ(engine->data_parallel()->buckets().buckets.size(), 2u);
      init_with_nonzero_b(engine.engine());
      losses[static_cast<size_t>(rank)] = engine->train_step({batches[static_cast<size_t>(rank)]}).loss;
      got[static_cast<size_t>(rank)] = adapter_values(engine.engine());
      calls[static_cast<size_t>(rank)] = spy.calls;
      // The buckets as planned: layer 1's first, then layer 0's.
      const GradBucketPlan& plan = engine->data_parallel()->buckets();
      EXPECT_EQ(plan.buckets[0].layers, std::vector<int>{1});
      EXPECT_EQ(plan.buckets[1].layers, std::vector<int>{0});
      const std::vector<BackwardSpyCommunicator::Call>& c = spy.calls;
      ASSERT_EQ(c.size(), 4u);  // global counts, bucket of layer 1, bucket of layer 0, loss
      EXPECT_EQ(c[0].grad_begin, -1);
      EXPECT_EQ(c[1].grad_begin, plan.buckets[0].begin);
      EXPECT_EQ(c[1].numel, plan.buckets[0].numel());
      EXPECT_FALSE(c[1].layer0_grads_done) << "layer 1's bucket waited for the end of the backward";
      EXPECT_EQ(c[2].grad_begin, plan.buckets[1].begin);
      EXPECT_TRUE(c[2].layer0_grads_done);
      EXPECT_EQ(c[3].grad_begin, -1);
    });
    EXPECT_EQ(got[0], got[1]);
    EXPECT_LT(rel_error(got[0], expected), 1e-5) << "offload " << offload;
    EXPECT_NEAR(losses[0], single_loss, 1e-5 * single_loss);
  }
}

TEST(DataParallel, TrainerOnTwoRanksEqualsOneRankWithTwiceTheAccumulation) {
  const LlamaConfig model = small_model();
  // 11 rows, 2 per micro-batch: 6 micro-batches an epoch, so a 4-micro-batch step leaves a
  // remainder step of 2 (one each) and a rank can get fewer micro-batches than another.
  const Dataset data = seeded_dataset({10, 7, 12, 9, 5, 11, 8, 6, 12, 4, 9}, 5);
  RunConfig run = small_run();
  run.max_steps = 4;
  run.lora_dropout = 0.1;
  run.gradient_accumulation_steps = 4;
  TrainerOptions options;
  options.quiet = true;
  options.handle_signals = false;

  auto cpu = make_cpu_backend();
  PlannedEngine single(*cpu, run, model);
  init_with_nonzero_b(single.engine());
  std::ostringstream out, err;
  const TrainOutcome expected = Trainer(single.engine(), data, nullptr, options, out, err).run();
  const std::vector<float> expected_adapters = adapter_values(single.engine());

  run.gradient_accumulation_steps = 2;
  std::vector<TrainOutcome> outcomes(2);
  std::vector<std::vector<float>> got(2);
  disttest::InProcessGroup group(2);
  disttest::run_seeded_engines(group, 2, run, model,
                               [&](int rank, PlannedEngine& engine, disttest::InProcessCommunicator& comm) {
    std::ostringstream rank_out, rank_err;
    outcomes[static_cast<size_t>(rank)] = Trainer(engine.engine(), data, nullptr, options, rank_out, rank_err).run();
    got[static_cast<size_t>(rank)] = adapter_values(engine.engine());
  });
  ASSERT_EQ(outcomes[0].losses.size(), expected.losses.size());
  for (size_t s = 0; s < expected.losses.size(); ++s)
    EXPECT_NEAR(outcomes[0].losses[s], expected.losses[s], 1e-4 * expected.losses[s]) << "step " << s;
  EXPECT_EQ(got[0], got[1]);
  EXPECT_LT(rel_error(got[0], expected_adapters), 1e-5);
}

TEST(DataParallel, ThePlanOfARankIsWhatItAllocates) {
  const LlamaConfig model = small_model();
  RunConfig run = small_run();
  run.precision = Precision::bf16;
  run.gradient_checkpointing = true;
  disttest::InProcessGroup group(2);
  disttest::run_seeded_engines(group, 2, run, model,
                               [&](int rank, PlannedEngine& engine, disttest::InProcessCommunicator& comm) {
    engine->train_step(enginetest::random_batches(model, run, 1, 3 + rank));
    engine->eval_loss_sum(enginetest::random_batches(model, run, 1, 4)[0]);
    EXPECT_EQ(engine->memory().verify_against(engine.plan().records), "");
    EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes);
    const DataParallelAdapters& dp = *engine->data_parallel();
    EXPECT_EQ(dp.exp_avg_shard().numel() * 2, engine->lora().flat_params().numel());
    EXPECT_EQ(dp.layout().padded_total(), engine->lora().flat_grads().numel());
  });
  // ZeRO-1 halves the moments of the plan.
  const Plan one = plan_run(run, model, Device::cpu), two = plan_run(run, model, Device::cpu, 2);
  const int opt = static_cast<int>(MemCategory::optimizer_state);
  EXPECT_LT(two.max_by_category[opt], one.max_by_category[opt] * 6 / 10);
}

TEST(DataParallel, ARankThatStopsMakesTheOthersFailWithAClearError) {
  const LlamaConfig model = small_model();
  const RunConfig run = small_run();
  const std::vector<HostMicroBatch> batches = enginetest::random_batches(model, run, 2, 9);
  disttest::InProcessGroup group(2, std::chrono::milliseconds(500));
  std::string message;
  disttest::run_seeded_engines(group, 2, run, model,
                               [&](int rank, PlannedEngine& engine, disttest::InProcessCommunicator& comm) {
    if (rank == 1) return;  // "dies" before its first step
    try {
      engine->train_step({batches[0]});
    } catch (const Error& e) {
      message = e.what();
    }
  });
  EXPECT_NE(message.find("rank 0 waited"), std::string::npos) << message;
}

TEST(DataParallel, CheckpointsOfADataParallelRunAreRefusedClearly) {
  const LlamaConfig model = small_model();
  const RunConfig run = small_run();
  disttest::InProcessGroup group(2);
  disttest::run_ranks(2, [&](int rank) {
    disttest::InProcessCommunicator comm(group, rank);
    auto backend = make_cpu_backend();
    PlannedEngine engine(*backend, run, model, &comm);
    EXPECT_THROW(engine->save_checkpoint(std::filesystem::path(MEMTUNE_BINARY_DIR) / "dp_ckpt", "base"), Error);
  });
}

TEST(DataParallel, OneRankCommunicatorChangesNothing) {
  const LlamaConfig model = small_model();
  const RunConfig run = small_run();
  const std::vector<HostMicroBatch> batches = enginetest::random_batches(model, run, 2, 4);
  auto cpu = make_cpu_backend();
  const std::unique_ptr<Communicator> one = make_single_rank_communicator();
  PlannedEngine plain(*cpu, run, model), with_one(*cpu, run, model, one.get());
  EXPECT_EQ(plain.plan().arena_bytes, with_one.plan().arena_bytes);
  init_with_nonzero_b(plain.engine());
  init_with_nonzero_b(with_one.engine());
  EXPECT_EQ(plain->train_step(batches).loss, with_one->train_step(batches).loss);
  EXPECT_EQ(adapter_values(plain.engine()), adapter_values(with_one.engine()));
  EXPECT_EQ(with_one->world_size(), 1);
}

TEST(DataParallel, TheSingleRankCommunicatorIsTheIdentity) {
  const std::unique_ptr<Communicator> one = make_single_rank_communicator();
  std::vector<float> a = {1, 2, 3, 4}, b(4, 0.0f);
  const Tensor ta{a.data(), DType::f32, Shape{4}, Device::cpu}, tb{b.data(), DType::f32, Shape{4}, Device::cpu};
  one->all_reduce_sum(ta, tb, {});
  EXPECT_EQ(b, a);
  std::fill(b.begin(), b.end(), 0.0f);
  one->reduce_scatter_sum(ta, tb, {});
  EXPECT_EQ(b, a);
  std::fill(b.begin(), b.end(), 0.0f);
  one->all_gather(ta, tb, {});
  EXPECT_EQ(b, a);
  one->broadcast(ta, 0, {});
  one->wait({});
  EXPECT_EQ(a, (std::vector<float>{1, 2, 3, 4}));
}

TEST(DataParallel, SeveralCpuProcessesAreRefused) {
  LaunchEnv env;
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = 29500;
  try {
    make_communicator(env, Device::cpu);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA backend"), std::string::npos) << e.what();
  }
}
