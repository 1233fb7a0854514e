// Whole training steps on the CUDA backend: against the CPU backend (the oracle) in every
// precision and memory technique, against the Hugging Face golden files, the fp16 loss scaler's
// overflow handling, and the plan's accuracy on the device.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>

#include "flash_versions_scope.h"
#include "gpu_test_util.h"
#include "../support/fixtures.h"
#include "memtune/io/json_util.h"
#include "memtune/io/safetensors.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/device.h"
#include "memtune/train/engine_arena.h"
#include "../support/engine_setup.h"

namespace memtune::gputest {
namespace {

namespace fs = std::filesystem;
using enginetest::small_model;

// The shared small run at seq 40 (a flash tile and a partial one), padding 7 tokens per row.
RunConfig small_run() {
  RunConfig run = enginetest::small_run();
  run.max_seq_length = 40;
  return run;
}

std::vector<HostMicroBatch> random_batches(const LlamaConfig& model, const RunConfig& run, int count, uint64_t seed) {
  return enginetest::random_batches(model, run, count, seed, /*padding_step=*/7);
}

using enginetest::host_floats;

struct StepOutcome {
  std::vector<double> losses, grad_norms;
  std::vector<float> grads;         // after the first step, unscaled
  std::vector<float> lora_weights;  // after the last step
};

// A step's micro-batches, given the step's index.
using BatchMaker = std::function<std::vector<HostMicroBatch>(int step)>;

// Two optimizer steps of two micro-batches each, from the same seeded weights on any backend
// (fill_random draws the same values everywhere), with non-zero B so every gradient is non-zero.
// The micro-batches: `batches`' where given, else random_batches'.
StepOutcome two_steps(Backend& backend, const RunConfig& run, const LlamaConfig& model,
                      const BatchMaker& batches = {}) {
  PlannedEngine engine(backend, run, model);
  enginetest::init_with_nonzero_b(engine.engine());
  StepOutcome out;
  for (int s = 0; s < 2; ++s) {
    const double loss_scale = run.precision == Precision::fp16 ? engine->scaler().scale : 1.0;
    const StepReport report = engine->train_step(batches ? batches(s) : random_batches(model, run, 2, 5 + s));
    EXPECT_FALSE(report.skipped);
    out.losses.push_back(report.loss);
    out.grad_norms.push_back(report.grad_norm);
    if (s == 0) {
      for (const LoraTensors& t : engine->lora().tensors())
        for (const Tensor* g : {&t.grad_a, &t.grad_b})
          for (float v : host_floats(backend, *g)) out.grads.push_back(static_cast<float>(v / loss_scale));
    }
  }
  out.lora_weights = enginetest::adapter_values(engine.engine());
  // The engine stayed inside its plan (the plan is one micro-batch; the allocations of every
  // further one repeat it, so the sequences differ in length but not in peak).
  EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes);
  return out;
}

struct Variant {
  Precision precision;
  const char* attention;
  bool checkpointing;
  const char* loss;
  bool qlora = false;
  bool offload = false;  // the layer inputs through pinned host memory (with checkpointing)
  bool stacked = false;  // one LoRA A GEMM for q/k/v and one for gate/up (--stacked_lora)
  std::string name() const {
    return std::string(precision_name(precision)) + "/" + attention + (checkpointing ? "/ckpt" : "") +
           "/" + loss + (qlora ? "/nf4" : "") + (offload ? "/offload" : "") + (stacked ? "/stacked" : "");
  }
};

class CudaStepTest : public CudaTest {};

TEST_F(CudaStepTest, WholeStepsMatchTheCpuInEveryPrecisionAndTechnique) {
  const LlamaConfig model = small_model();
  const std::vector<Variant> variants = {
      {Precision::fp32, "eager", false, "full"},     {Precision::fp32, "flash", true, "chunked"},
      {Precision::bf16, "eager", false, "full"},     {Precision::bf16, "flash", false, "full"},
      {Precision::bf16, "flash", true, "chunked"},   {Precision::fp16, "eager", false, "full"},
      {Precision::fp16, "flash", true, "chunked"},   {Precision::bf16, "flash", true, "chunked", true},
      {Precision::fp32, "flash", true, "chunked", false, true},
      {Precision::bf16, "flash", true, "chunked", true, true},
      {Precision::fp32, "eager", false, "full", false, false, true},
      {Precision::fp32, "flash", true, "chunked", false, false, true},
      {Precision::bf16, "flash", true, "chunked", true, false, true},
      {Precision::bf16, "flash", true, "chunked", true, true, true},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name());
    RunConfig run = small_run();
    run.precision = v.precision;
    run.attn_implementation = v.attention;
    run.gradient_checkpointing = v.checkpointing;
    run.loss_implementation = v.loss;
    run.loss_chunk_tokens = 24;
    run.load_in_4bit = v.qlora;
    run.offload_activations = v.offload;
    run.stacked_lora = v.stacked;
    run.mlp_chunk_tokens = 16;  // token chunks under checkpointing, with a short last chunk (80 rows)
    const StepOutcome want = two_steps(cpu(), run, model);
    const StepOutcome got = two_steps(gpu(), run, model);
    // The CPU computes in fp32 over the same storage; the GPU rounds its 16-bit intermediates at
    // other points (flash tiles, GEMM epilogues), so 16-bit modes get the storage tolerance.
    const double tolerance = v.precision == Precision::fp32 ? 1e-4 : 3e-2;
    for (size_t s = 0; s < want.losses.size(); ++s) {
      EXPECT_NEAR(got.losses[s], want.losses[s], tolerance * want.losses[s]) << "step " << s;
      EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], 5 * tolerance * want.grad_norms[s]) << "step " << s;
    }
    expect_close("lora grads after step 1", got.grads, want.grads, 5 * tolerance);
    expect_close("lora weights after step 2", got.lora_weights, want.lora_weights, tolerance);
  }
}

// Packed micro-batches of `rows.size()` rows of `seq` tokens: row r holds samples of the lengths
// rows[r] end to end, each its own segment with positions from 0 and targets the next token of the
// same sample; the rest of the row is padding, a segment of its own without targets.
std::vector<HostMicroBatch> packed_batches(const LlamaConfig& model, int64_t seq,
                                           const std::vector<std::vector<int64_t>>& rows, int count, uint64_t seed) {
  std::vector<HostMicroBatch> out;
  for (int m = 0; m < count; ++m) {
    HostMicroBatch b;
    b.rows = static_cast<int64_t>(rows.size());
    b.seq = seq;
    b.real_tokens = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      int32_t id = 0;
      int64_t used = 0;
      for (const int64_t length : rows[r]) {
        for (int64_t t = 0; t < length; ++t) {
          const uint64_t index = static_cast<uint64_t>(m) * 100000 + r * 1000 + static_cast<uint64_t>(used + t);
          b.input_ids.push_back(static_cast<int32_t>(dropout_hash(seed, index) % model.vocab_size));
          b.targets.push_back(-100);
          if (t > 0) b.targets[b.targets.size() - 2] = b.input_ids.back();
          b.positions.push_back(static_cast<int32_t>(t));
          b.segments.push_back(id);
        }
        used += length;
        b.real_tokens += length;
        ++id;
      }
      for (int64_t t = used; t < seq; ++t) {
        b.input_ids.push_back(0);
        b.targets.push_back(-100);
        b.positions.push_back(static_cast<int32_t>(t - used));
        b.segments.push_back(id);
      }
    }
    out.push_back(std::move(b));
  }
  return out;
}

// The tensor-core attention kernels take head_dim 64 and 128 only (the small model's 32 runs the
// generic ones): whole steps with flash attention at those head_dims, rows of 160 tokens (a full
// 128-query tile of the Hopper forward and a partial one), in bf16 and f16 with and without
// checkpointing, against the CPU: one sample a row (7 tokens of padding a row), and packed rows
// (samples of 70, 1 and 60 tokens and 29 of padding; 13 and 140 tokens and 7 of padding). Each
// runs twice: with the backend's default flash forward (on a compute capability 9.0 device, the
// Hopper forward) and with forward v2 forced.
TEST_F(CudaStepTest, WholeStepsAtTensorCoreHeadDimsMatchTheCpu) {
  struct Heads {
    int64_t head_dim, heads, kv_heads;
  };
  for (const Heads shape : {Heads{64, 4, 2}, Heads{128, 4, 1}}) {
    LlamaConfig model = small_model();
    model.head_dim = shape.head_dim;
    model.num_attention_heads = shape.heads;
    model.num_key_value_heads = shape.kv_heads;
    model.hidden_size = 256;
    for (const Precision precision : {Precision::bf16, Precision::fp16})
      for (const bool checkpointing : {false, true})
        for (const bool packed : {false, true}) {
          RunConfig run = small_run();
          run.max_seq_length = 160;
          run.precision = precision;
          run.attn_implementation = "flash";
          run.gradient_checkpointing = checkpointing;
          run.loss_implementation = "chunked";
          run.loss_chunk_tokens = 24;
          BatchMaker batches;
          if (packed) {
            batches = [&](int step) {
              return packed_batches(model, run.max_seq_length, {{70, 1, 60}, {13, 140}}, 2, 5 + step);
            };
          }
          const StepOutcome want = two_steps(cpu(), run, model, batches);
          for (const bool hopper : {true, false}) {
            SCOPED_TRACE("head_dim " + std::to_string(shape.head_dim) + " " + std::string(precision_name(precision)) +
                         (checkpointing ? " ckpt" : "") + (packed ? " packed" : "") +
                         (hopper ? " default forward" : " forward v2"));
            const FlashVersionsScope choice(flash_versions_with_hopper(hopper));
            const StepOutcome got = two_steps(gpu(), run, model, batches);
            const double tolerance = 3e-2;  // as the 16-bit variants above
            for (size_t s = 0; s < want.losses.size(); ++s) {
              EXPECT_NEAR(got.losses[s], want.losses[s], tolerance * want.losses[s]) << "step " << s;
              EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], 5 * tolerance * want.grad_norms[s]) << "step " << s;
            }
            expect_close("lora grads after step 1", got.grads, want.grads, 5 * tolerance);
            expect_close("lora weights after step 2", got.lora_weights, want.lora_weights, tolerance);
          }
        }
  }
}

// ---- Hugging Face golden files on the GPU ---------------------------------------------------------

using test::golden_dir;

template <typename T>
std::vector<T> values_of(const SafetensorsTensor& t) {
  std::vector<T> out(t.nbytes / sizeof(T));
  std::memcpy(out.data(), t.data, t.nbytes);
  return out;
}

std::vector<std::vector<int32_t>> rows_of(const std::vector<int32_t>& flat, int64_t rows, int64_t seq) {
  std::vector<std::vector<int32_t>> out(rows);
  for (int64_t r = 0; r < rows; ++r) out[r].assign(flat.begin() + r * seq, flat.begin() + (r + 1) * seq);
  return out;
}

struct GoldenRun {
  double loss;
  std::vector<std::string> keys;          // PEFT keys of the LoRA tensors, in order
  std::vector<std::vector<float>> grads;  // their grads after one step
};

TEST_F(CudaStepTest, GoldenLossAndGradsInFp32AndBf16) {
  // With the families beyond Llama (issue 25): Qwen2's q/k/v biases, Qwen3's per-head q/k norm,
  // Mistral's explicit head_dim.
  for (const char* fixture : {"gqa_rope", "gqa_rope_rslora", "tied_odd", "qwen2_bias", "qwen3_qk_norm",
                              "mistral_head_dim"}) {
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      for (const char* attention : {"eager", "flash"}) {
        SCOPED_TRACE(std::string(fixture) + " " + std::string(precision_name(precision)) + " " + attention);
        const fs::path dir = golden_dir(fixture);
        const LlamaConfig model = LlamaConfig::from_file(dir / "config.json");
        const SafetensorsFile batch_file = SafetensorsFile::open(dir / "batch.safetensors");
        const SafetensorsFile forward = SafetensorsFile::open(dir / "forward.safetensors");
        const SafetensorsTensor& ids = batch_file.get("input_ids");
        const int64_t rows = ids.shape[0], seq = ids.shape[1];
        const nlohmann::json adapter = read_json_file(dir / "adapter/adapter_config.json");
        RunConfig run;
        run.precision = precision;
        run.attn_implementation = attention;
        run.per_device_train_batch_size = rows;
        run.max_seq_length = seq;
        run.lora_r = adapter["r"];
        run.lora_alpha = adapter["lora_alpha"];
        run.use_rslora = adapter.value("use_rslora", false);
        const HostMicroBatch batch = make_micro_batch(rows_of(values_of<int32_t>(ids), rows, seq),
                                                      rows_of(values_of<int32_t>(batch_file.get("labels")), rows, seq), seq);
        const float hf_loss = values_of<float>(forward.get("loss"))[0];
        // The same run on both backends: loss and every LoRA grad after one step.
        auto run_on = [&](Backend& backend) {
          PlannedEngine engine(backend, run, model);
          engine->load_base_checkpoint(dir / "model.safetensors");
          engine->load_adapter(dir / "adapter");
          const auto [loss_sum, count] = engine->eval_loss_sum(batch);
          engine->train_step({batch});
          GoldenRun out{loss_sum / count, {}, {}};
          const LoraState& lora = engine->lora();
          for (size_t i = 0; i < lora.specs().size(); ++i) {
            out.keys.push_back(lora.specs()[i].a_key);
            out.grads.push_back(host_floats(backend, lora.tensors()[i].grad_a));
            out.keys.push_back(lora.specs()[i].b_key);
            out.grads.push_back(host_floats(backend, lora.tensors()[i].grad_b));
          }
          return out;
        };
        const GoldenRun on_gpu = run_on(gpu());
        ASSERT_FALSE(on_gpu.keys.empty());
        if (precision == Precision::fp32) {
          // The GPU sums in another order than torch's CPU: fp32 rounding only.
          EXPECT_NEAR(on_gpu.loss, hf_loss, 1e-5 * hf_loss);
          for (size_t i = 0; i < on_gpu.keys.size(); ++i)
            expect_close(on_gpu.keys[i], on_gpu.grads[i], values_of<float>(forward.get(on_gpu.keys[i])), 1e-3);
          continue;
        }
        // bf16: weights and activations carry 8 mantissa bits, so the distance from HF's fp32
        // is set by the precision, not by the backend. The GPU must be as close to HF as the CPU
        // reference backend with the same bf16 storage is (within 1.5x, or 1e-2 absolute).
        const GoldenRun on_cpu = run_on(cpu());
        EXPECT_LE(std::abs(on_gpu.loss - hf_loss), std::max(1e-3 * hf_loss, 1.5 * std::abs(on_cpu.loss - hf_loss)));
        for (size_t i = 0; i < on_gpu.keys.size(); ++i) {
          const std::vector<float> hf = values_of<float>(forward.get(on_gpu.keys[i]));
          const double cpu_error = optest::norm_rel_error(on_cpu.grads[i], optest::to_double(hf));
          expect_close(on_gpu.keys[i], on_gpu.grads[i], hf, std::max(1e-2, 1.5 * cpu_error));
        }
      }
    }
  }
}

// ---- fp16 loss scaling --------------------------------------------------------------------------

TEST_F(CudaStepTest, Fp16PlantedInfIsSkippedAndTheScaleBacksOff) {
  const LlamaConfig model = small_model();
  RunConfig run = small_run();
  run.precision = Precision::fp16;
  PlannedEngine engine(gpu(), run, model);
  engine->init_random_weights(1);
  engine->init_adapters(2);
  const std::vector<float> before = host_floats(gpu(), engine->lora().tensors()[0].a);
  const Tensor& w = engine->weights().layers[0].projections[0];
  std::vector<uint16_t> host(w.numel());
  gpu().copy_to_host(host.data(), w);
  host[0] = 0x7c00;  // +inf in f16: the loss, and so every gradient, overflows
  gpu().copy_from_host(w, host.data());
  const double scale_before = engine->scaler().scale;
  const StepReport report = engine->train_step(random_batches(model, run, 1, 1));
  EXPECT_TRUE(report.skipped);
  EXPECT_EQ(engine->scaler().skipped_steps, 1);
  EXPECT_EQ(engine->scaler().scale, scale_before * 0.5);
  EXPECT_EQ(host_floats(gpu(), engine->lora().tensors()[0].a), before) << "a skipped step must not update";
  // Repaired, the next step goes through at the lower scale.
  host[0] = 0;
  gpu().copy_from_host(w, host.data());
  EXPECT_FALSE(engine->train_step(random_batches(model, run, 1, 2)).skipped);
  EXPECT_EQ(engine->scaler().scale, scale_before * 0.5);
}

// ---- the plan on the device ---------------------------------------------------------------------

TEST_F(CudaStepTest, DevicePeakIsThePlanPlusTheContext) {
  // A model large enough that the arena dominates the driver's rounding.
  LlamaConfig model = resolve_model("tiny").config;
  model.hidden_size = 1024;
  model.intermediate_size = 2816;
  model.num_attention_heads = 8;
  model.num_key_value_heads = 2;
  model.head_dim = 128;
  model.vocab_size = 32000;
  RunConfig run = small_run();
  run.precision = Precision::bf16;
  run.max_seq_length = 512;
  struct PeakVariant {
    const char* name;
    const char* attention;
    bool offload;
  };
  for (const PeakVariant& v : {PeakVariant{"eager", "eager", false}, PeakVariant{"flash", "flash", false},
                               PeakVariant{"flash+ckpt+offload", "flash", true}}) {
    const char* attention = v.name;
    SCOPED_TRACE(attention);
    run.attn_implementation = v.attention;
    run.gradient_checkpointing = v.offload;
    run.offload_activations = v.offload;
    const uint64_t before = device_memory_in_use(gpu());
    {
      PlannedEngine engine(gpu(), run, model);
      engine->init_random_weights(1);
      engine->init_adapters(2);
      engine->train_step(random_batches(model, run, 2, 1));
      gpu().synchronize();
      const uint64_t planned = engine.plan().arena_bytes;
      EXPECT_EQ(engine->memory().allocator().high_water(), planned);
      const uint64_t grew = device_memory_in_use(gpu()) - before;
      const double slack = std::max(0.03 * planned, 256.0 * (1 << 20));
      EXPECT_LE(std::abs(static_cast<double>(grew) - static_cast<double>(planned)), slack)
          << "device grew by " << grew << " for a plan of " << planned;
      if (v.offload) EXPECT_EQ(engine->memory().host_bytes(), engine.plan().host_bytes);
      std::printf("  PLAN %s: planned %llu, device grew %llu\n", attention,
                  static_cast<unsigned long long>(planned), static_cast<unsigned long long>(grew));
    }
  }
}

// The offloaded step on the device against the plain checkpointed one on the device: the same
// kernels on the same numbers, the layer inputs only travel through pinned host memory on the
// copy stream; a missed event would show as a different loss or grad.
TEST_F(CudaStepTest, OffloadedStepsMatchPlainCheckpointedStepsOnTheDevice) {
  LlamaConfig model = small_model();
  model.num_hidden_layers = 4;  // more layers than the ring has slots
  model.tie_word_embeddings = false;
  for (const int64_t chunk : {int64_t{0}, int64_t{16}}) {
    SCOPED_TRACE(chunk);
    RunConfig run = small_run();
    run.precision = Precision::bf16;
    run.attn_implementation = "flash";
    run.gradient_checkpointing = true;
    run.loss_implementation = "chunked";
    run.loss_chunk_tokens = 24;
    run.load_in_4bit = true;
    run.mlp_chunk_tokens = chunk;
    const StepOutcome plain = two_steps(gpu(), run, model);
    run.offload_activations = true;
    const StepOutcome offloaded = two_steps(gpu(), run, model);
    // Bit-identical unless a kernel sums in a run-dependent order (atomics): bf16-tight.
    for (size_t s = 0; s < plain.losses.size(); ++s)
      EXPECT_NEAR(offloaded.losses[s], plain.losses[s], 1e-3 * plain.losses[s]) << "step " << s;
    expect_close("lora grads after step 1", offloaded.grads, plain.grads, 1e-2);
    expect_close("lora weights after step 2", offloaded.lora_weights, plain.lora_weights, 1e-3);
    // And the embedding table in pinned host memory, gathered by the kernel over PCIe.
    run.offload_embeddings = true;
    const StepOutcome host_table = two_steps(gpu(), run, model);
    for (size_t s = 0; s < plain.losses.size(); ++s)
      EXPECT_NEAR(host_table.losses[s], plain.losses[s], 1e-3 * plain.losses[s]) << "step " << s;
    expect_close("lora grads after step 1 (host embeddings)", host_table.grads, plain.grads, 1e-2);
  }
}

// AdamW's moments in pinned host memory, updated in place by the device's kernel over PCIe: the
// same kernel on the same values, so the same bits (eager attention: no atomics anywhere, so the
// step itself is the same bits run to run).
TEST_F(CudaStepTest, OffloadedOptimizerStepsAreTheDeviceOptimizerSteps) {
  LlamaConfig model = small_model();
  model.tie_word_embeddings = false;
  for (const bool qlora : {false, true}) {
    SCOPED_TRACE(qlora ? "QLoRA" : "16-bit LoRA");
    RunConfig run = small_run();
    run.precision = Precision::bf16;
    run.attn_implementation = "eager";
    run.gradient_checkpointing = true;
    run.load_in_4bit = qlora;
    const StepOutcome plain = two_steps(gpu(), run, model);
    run.offload_optimizer = true;
    const StepOutcome offloaded = two_steps(gpu(), run, model);
    EXPECT_EQ(offloaded.losses, plain.losses);
    EXPECT_EQ(offloaded.grads, plain.grads);
    EXPECT_EQ(offloaded.lora_weights, plain.lora_weights);
  }
}

// Frozen layers streamed from pinned host memory (--stream_layers): each visit's layer copied on
// the copy stream into one of two device buffers, beside the activation offload's copies on the
// same stream. The same kernels read the same bytes, so the same bits (eager attention: no
// atomics); a copy that a kernel did not wait for, or one that overwrote a buffer still read,
// shows as another loss or gradient.
TEST_F(CudaStepTest, StreamedLayersStepsAreTheResidentSteps) {
  LlamaConfig model = small_model();
  model.num_hidden_layers = 6;
  model.tie_word_embeddings = false;
  for (const bool qlora : {false, true})
    for (const bool offload : {false, true}) {
      SCOPED_TRACE(std::string(qlora ? "QLoRA" : "16-bit LoRA") + (offload ? ", activations offloaded" : ""));
      RunConfig run = small_run();
      run.precision = Precision::bf16;
      run.attn_implementation = "eager";
      run.gradient_checkpointing = true;
      run.offload_activations = offload;
      run.load_in_4bit = qlora;
      const StepOutcome resident = two_steps(gpu(), run, model);
      for (const int64_t streamed : {int64_t{2}, int64_t{5}}) {
        SCOPED_TRACE(std::to_string(streamed) + " of 6 layers streamed");
        run.stream_layers = streamed;
        const StepOutcome got = two_steps(gpu(), run, model);
        EXPECT_EQ(got.losses, resident.losses);
        EXPECT_EQ(got.grads, resident.grads);
        EXPECT_EQ(got.lora_weights, resident.lora_weights);
      }
      run.stream_layers = 0;
    }
}

}  // namespace
}  // namespace memtune::gputest
