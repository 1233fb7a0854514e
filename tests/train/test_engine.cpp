// Engine-level properties: the plan is exact, buffers never overlap, the memory techniques do
// not change the math, and a seeded run is deterministic.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "memtune/core/error.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/train/engine_arena.h"
#include "../support/engine_setup.h"

using namespace memtune;

namespace {

using namespace enginetest;

using HostTensorF32 = std::vector<float>;

struct StepResult {
  double loss;
  std::vector<float> grads;
};

// Non-zero B so that every gradient is non-zero; the same values for every variant.
StepResult one_step(const RunConfig& run, const LlamaConfig& model) {
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  init_with_nonzero_b(engine.engine());
  const double loss_scale = run.precision == Precision::fp16 ? engine->scaler().scale : 1.0;
  const StepReport report = engine->train_step(random_batches(model, run, 2, 5));
  EXPECT_FALSE(report.skipped);
  std::vector<float> grads = adapter_grads(engine.engine());
  for (float& g : grads) g = static_cast<float>(g / loss_scale);  // fp16 grads are stored scaled
  return {report.loss, grads};
}

// One step of `run` with a switch that must not change the math off, then on: {off, on}.
std::pair<StepResult, StepResult> step_without_and_with(RunConfig run, bool RunConfig::*option, const LlamaConfig& model) {
  run.*option = false;
  StepResult without = one_step(run, model);
  run.*option = true;
  return {std::move(without), one_step(run, model)};
}

TEST(Engine, PlannedArenaEqualsAllocatedAndNoLiveBuffersOverlap) {
  const LlamaConfig model = small_model();
  for (bool ckpt : {false, true}) {
    for (const char* attn : {"eager", "flash"}) {
      for (int64_t mlp_chunk : {0, 7}) {  // 7: the chunked MLP (eval, and the checkpointed step)
       for (bool offload : {false, true}) {  // the offload ring of layer inputs, with checkpointing
        if (offload && !ckpt) continue;
        SCOPED_TRACE(fmt::format("ckpt {} {} chunk {} offload {}", ckpt, attn, mlp_chunk, offload));
        RunConfig run = small_run();
        run.offload_activations = offload;
        run.lora_dropout = mlp_chunk > 0 ? 0.1 : 0.0;  // and dropout's scratch, chunk-sized
        run.gradient_checkpointing = ckpt;
        run.attn_implementation = attn;
        run.loss_implementation = ckpt ? "chunked" : "full";
        run.loss_chunk_tokens = 7;
        run.mlp_chunk_tokens = mlp_chunk;
        auto cpu = make_cpu_backend();
        PlannedEngine engine(*cpu, run, model);
        expect_step_follows_plan(engine, model, run);
        // No two buffers alive at the same time share a byte.
        const auto& records = engine.plan().records;
        for (size_t i = 0; i < records.size(); ++i) {
          const int64_t end_i = records[i].freed_at < 0 ? INT64_MAX : records[i].freed_at;
          for (size_t j = i + 1; j < records.size(); ++j) {
            if (records[j].allocated_at >= end_i) break;  // i was freed before j was made
            const bool disjoint = records[i].offset + records[i].bytes <= records[j].offset ||
                                  records[j].offset + records[j].bytes <= records[i].offset;
            ASSERT_TRUE(disjoint) << records[i].name << " and " << records[j].name;
          }
        }
        EXPECT_EQ(engine->memory().host_bytes(), engine.plan().host_bytes);
       }
      }
    }
  }
}

TEST(Engine, FlashCheckpointingAndChunkedLossGiveTheSameStep) {
  const LlamaConfig model = small_model();
  const StepResult reference = one_step(small_run(), model);
  for (const char* attn : {"eager", "flash"}) {
    for (bool ckpt : {false, true}) {
      for (const char* loss : {"full", "chunked"}) {
        RunConfig run = small_run();
        run.attn_implementation = attn;
        run.gradient_checkpointing = ckpt;
        run.loss_implementation = loss;
        run.loss_chunk_tokens = 5;
        const StepResult got = one_step(run, model);
        EXPECT_NEAR(got.loss, reference.loss, 1e-5 * reference.loss) << attn << ckpt << loss;
        EXPECT_LT(rel_error(got.grads, reference.grads), 1e-5) << attn << ckpt << loss;
      }
    }
  }
}

// Stacked LoRA (one A GEMM for q/k/v and one for gate/up, LlamaStep::linear_group_forward) is
// the per-projection step: the same loss and grads, whole layers and chunked, with and without
// checkpointing, in fp32 and bf16, for every adapter layout it meets (all targets stacked, a
// partial group left per projection, dropout per projection).
TEST(Engine, StackedLoraGivesThePerProjectionStep) {
  const LlamaConfig model = small_model();
  struct Case {
    const char* targets;
    double dropout;
    bool stacks;
  };
  for (const Case& c : {Case{"all-linear", 0.0, true}, Case{"q_proj,v_proj,gate_proj,up_proj,down_proj", 0.0, true},
                        Case{"all-linear", 0.1, false}})
    for (Precision precision : {Precision::fp32, Precision::bf16})
      for (bool ckpt : {false, true})
        for (int64_t chunk : {0, 7}) {
          if (chunk > 0 && !ckpt) continue;
          SCOPED_TRACE(fmt::format("{} dropout {} {} ckpt {} chunk {}", c.targets, c.dropout,
                                   precision_name(precision), ckpt, chunk));
          RunConfig run = small_run();
          run.lora_target_modules = c.targets;
          run.lora_dropout = c.dropout;
          run.precision = precision;
          run.gradient_checkpointing = ckpt;
          run.mlp_chunk_tokens = chunk;
          const auto [reference, got] = step_without_and_with(run, &RunConfig::stacked_lora, model);
          const double tol = precision == Precision::fp32 ? 1e-5 : 2e-2;
          EXPECT_NEAR(got.loss, reference.loss, tol * reference.loss);
          EXPECT_LT(rel_error(got.grads, reference.grads), tol);
          // The stacked path ran where it can: its u^T buffers are in the plan.
          run.stacked_lora = true;
          const Plan plan = plan_run(run, model, Device::cpu);
          int stacked_buffers = 0;
          for (const AllocationRecord& r : plan.records)
            if (r.name.find("lora_uT") != std::string::npos) ++stacked_buffers;
          if (c.stacks) EXPECT_GT(stacked_buffers, 0);
          else EXPECT_EQ(stacked_buffers, 0);
        }
}

// LoraState lays the A of q/k/v and of gate/up end to end (masters, compute copies, grads)
// where every member has an adapter, and leaves a partial group (here q and v) apart.
TEST(Engine, LoraStateStacksTheAOfProjectionsThatShareAnInput) {
  const LlamaConfig model = small_model();
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    RunConfig run = small_run();
    run.precision = precision;
    run.lora_target_modules = "q_proj,v_proj,gate_proj,up_proj";
    auto cpu = make_cpu_backend();
    PlannedEngine engine(*cpu, run, model);
    const LoraState& lora = engine->lora();
    for (int layer = 0; layer < model.num_hidden_layers; ++layer) {
      const LoraTensors* gate = lora.find(layer, Projection::gate);
      const LoraTensors* up = lora.find(layer, Projection::up);
      for (Tensor LoraTensors::*field : {&LoraTensors::a, &LoraTensors::a_compute, &LoraTensors::grad_a}) {
        const Tensor* pair[] = {&(gate->*field), &(up->*field)};
        EXPECT_FALSE(stacked_rows(pair, 2).empty()) << layer;
      }
      const Tensor* qv[] = {&lora.find(layer, Projection::q)->a_compute, &lora.find(layer, Projection::v)->a_compute};
      EXPECT_TRUE(stacked_rows(qv, 2).empty()) << "q and v stacked without k";
      EXPECT_EQ(lora.find(layer, Projection::k), nullptr);
    }
  }
}

TEST(Engine, Bf16StepIsCloseToFp32) {
  const LlamaConfig model = small_model();
  const StepResult reference = one_step(small_run(), model);
  for (Precision p : {Precision::bf16, Precision::fp16}) {
    RunConfig run = small_run();
    run.precision = p;
    const StepResult got = one_step(run, model);
    EXPECT_NEAR(got.loss, reference.loss, 2e-2 * reference.loss);
    EXPECT_LT(rel_error(got.grads, reference.grads), 5e-2) << precision_name(p);
    EXPECT_GT(rel_error(got.grads, reference.grads), 0.0) << "16-bit storage changed nothing";
  }
}

TEST(Engine, QloraStepEqualsBf16StepOnTheDequantizedWeights) {
  const LlamaConfig model = small_model();
  for (const bool double_quant : {true, false}) {
    RunConfig qlora_run = small_run();
    qlora_run.precision = Precision::bf16;
    qlora_run.load_in_4bit = true;
    qlora_run.quant.double_quant = double_quant;
    RunConfig dense_run = qlora_run;
    dense_run.load_in_4bit = false;
    auto cpu = make_cpu_backend();
    PlannedEngine qlora(*cpu, qlora_run, model);
    PlannedEngine dense(*cpu, dense_run, model);
    qlora->init_random_weights(7);
    dense->init_random_weights(7);
    // The dense engine gets exactly what the 4-bit base dequantizes to.
    const ModelWeights& qw = qlora->weights();
    for (size_t i = 0; i < qw.table.size(); ++i) {
      if (!qw.is_quantized(i)) continue;
      const ParamSpec& spec = qw.table[i];
      HostTensorF32 host(spec.shape.numel());
      Tensor view{host.data(), DType::f32, spec.shape, Device::cpu};
      cpu->dequantize_4bit(view, qw.layers[spec.layer].quantized[static_cast<int>(spec.projection)]);
      dense->weights().upload(*cpu, i, host.data(), DType::f32);
    }
    for (PlannedEngine* e : {&qlora, &dense}) {
      (*e)->init_adapters(11);
      for (const LoraTensors& t : (*e)->lora().tensors()) cpu->fill_random(t.b, Backend::Distribution::normal, 0.0f, 0.05f, 3);
      (*e)->lora().sync_compute_copies(*cpu);
    }
    const auto batches = random_batches(model, qlora_run, 2, 5);
    const StepReport a = qlora->train_step(batches);
    const StepReport b = dense->train_step(batches);
    EXPECT_NEAR(a.loss, b.loss, 1e-6 * b.loss);
    EXPECT_LT(rel_error(adapter_grads(qlora.engine()), adapter_grads(dense.engine())), 1e-6);
    // And the 4-bit base is a real approximation: its plan is smaller.
    EXPECT_LT(qlora.plan().at_peak[static_cast<int>(MemCategory::frozen_weights)],
              dense.plan().at_peak[static_cast<int>(MemCategory::frozen_weights)]);
  }
}

TEST(Engine, SeededRunIsDeterministicAndLossFalls) {
  const LlamaConfig model = small_model();
  RunConfig run = small_run();
  run.lora_dropout = 0.1;
  std::vector<std::vector<double>> runs;
  for (int repeat = 0; repeat < 2; ++repeat) {
    auto cpu = make_cpu_backend();
    PlannedEngine engine(*cpu, run, model);
    engine->init_random_weights(1);
    engine->init_adapters(2);
    const auto batches = random_batches(model, run, 1, 9);
    std::vector<double> losses;
    for (int s = 0; s < 12; ++s) losses.push_back(engine->train_step(batches).loss);
    runs.push_back(losses);
  }
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_LT(runs[0].back(), runs[0].front() - 0.1) << "training on one batch must overfit it";
}

TEST(Engine, Fp16OverflowSkipsTheStepAndBacksOff) {
  const LlamaConfig model = small_model();
  RunConfig run = small_run();
  run.precision = Precision::fp16;
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  engine->init_random_weights(1);
  engine->init_adapters(2);
  // Plant an inf in a frozen weight: the loss, and so the grads, overflow.
  const Tensor& w = engine->weights().layers[0].projections[0];
  std::vector<uint16_t> host(w.numel());
  cpu->copy_to_host(host.data(), w);
  host[0] = 0x7c00;  // +inf in f16
  cpu->copy_from_host(w, host.data());
  const double scale_before = engine->scaler().scale;
  const StepReport report = engine->train_step(random_batches(model, run, 1, 1));
  EXPECT_TRUE(report.skipped);
  EXPECT_EQ(engine->scaler().skipped_steps, 1);
  EXPECT_EQ(engine->scaler().scale, scale_before * 0.5);
}

TEST(Engine, CheckpointAfterStep3ResumesBitIdentically) {
  const LlamaConfig model = small_model();
  RunConfig run = small_run();
  run.weight_decay = 0.01;
  run.lora_dropout = 0.1;
  const auto batches = random_batches(model, run, 2, 21);
  const std::filesystem::path dir = std::filesystem::path(MEMTUNE_BINARY_DIR) / "test_checkpoint_resume";
  std::vector<double> straight;
  {
    auto cpu = make_cpu_backend();
    PlannedEngine engine(*cpu, run, model);
    engine->init_random_weights(1);
    engine->init_adapters(2);
    for (int s = 0; s < 5; ++s) {
      straight.push_back(engine->train_step(batches).loss);
      if (s == 2) engine->save_checkpoint(dir, "tiny");
    }
  }
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  engine->init_random_weights(1);
  engine->load_checkpoint(dir);
  EXPECT_EQ(engine->steps_done(), 3);
  EXPECT_EQ(engine->train_step(batches).loss, straight[3]);
  EXPECT_EQ(engine->train_step(batches).loss, straight[4]);
  EXPECT_THROW(engine->load_checkpoint(dir / "missing"), memtune::Error);
}

}  // namespace
