// The families beyond Llama (issue 25): Qwen2 / Qwen2.5 (q/k/v biases), Qwen3 (per-head q/k
// RMSNorm, head_dim != hidden / heads) and Mistral (explicit head_dim, sliding window). Their
// config.json, their rows of the parameter table, an exact plan, and gradients that agree with
// finite differences of the loss through the new pieces, at odd sizes (tests/fixtures/families).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "memtune/model/llama_config.h"
#include "memtune/model/param_table.h"
#include "memtune/ops/backend.h"
#include "memtune/train/engine_arena.h"
#include "../support/engine_setup.h"
#include "../support/expect_error.h"
#include "../support/fixtures.h"

using namespace memtune;
using namespace memtune::enginetest;
namespace fs = std::filesystem;

namespace {

fs::path family_config_path(const std::string& name) {
  return memtune::test::fixture_path("families/" + name + ".json");
}

LlamaConfig family_model(const std::string& name) {
  return resolve_model(family_config_path(name).string()).config;
}

// A config.json of `family` with the keys of `extra` set over a small valid base.
LlamaConfig parse_with(const std::string& model_type, const nlohmann::json& extra) {
  nlohmann::json j = {{"model_type", model_type}, {"hidden_size", 32},      {"intermediate_size", 48},
                      {"num_hidden_layers", 1},   {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"vocab_size", 64},         {"max_position_embeddings", 128}};
  if (extra.is_object()) j.update(extra);
  return LlamaConfig::from_json(j, "test config");
}

const ParamSpec* find_param(const std::vector<ParamSpec>& table, const std::string& key) {
  for (const ParamSpec& spec : table)
    if (spec.hf_key == key) return &spec;
  return nullptr;
}

}  // namespace

TEST(FamilyConfig, PresetsParseAndCountTheirPublishedParameters) {
  // The counts the model cards publish (7.61B, 8.19B, 7.25B), from the table alone.
  struct Expected {
    const char* preset;
    ModelFamily family;
    int64_t parameters;
    int64_t head_dim;
  };
  for (const Expected& e : {Expected{"qwen2.5-7b", ModelFamily::qwen2, 7'615'616'512, 128},
                            Expected{"qwen3-8b", ModelFamily::qwen3, 8'190'735'360, 128},
                            Expected{"mistral-7b-v0.3", ModelFamily::mistral, 7'248'023'552, 128}}) {
    SCOPED_TRACE(e.preset);
    const LlamaConfig c = resolve_model(e.preset).config;
    EXPECT_EQ(c.family, e.family);
    EXPECT_EQ(c.head_dim, e.head_dim);
    EXPECT_EQ(c.rope_theta, 1e6);
    EXPECT_EQ(c.sliding_window, 0) << "no active window in any of the three";
    EXPECT_EQ(count_parameters(base_parameter_table(c)), e.parameters);
  }
  EXPECT_TRUE(resolve_model("qwen2.5-7b").config.has_qkv_bias);
  EXPECT_TRUE(resolve_model("qwen3-8b").config.has_qk_norm);
  EXPECT_FALSE(resolve_model("mistral-7b-v0.3").config.has_qkv_bias);
  EXPECT_FALSE(resolve_model("llama-3.1-8b").config.has_qkv_bias);
  EXPECT_FALSE(resolve_model("llama-3.1-8b").config.has_qk_norm);
}

TEST(FamilyConfig, OddSizesRopeParametersAndARoundTripThroughToJson) {
  const LlamaConfig qwen3 = family_model("tiny-qwen3");
  EXPECT_EQ(qwen3.head_dim, 14);  // not 36 / 4
  EXPECT_EQ(qwen3.q_dim(), 56);
  EXPECT_EQ(qwen3.rope_theta, 1e6);  // from transformers 5's rope_parameters
  EXPECT_EQ(parse_with("qwen3", {}).head_dim, 128) << "Qwen3Config's default head_dim";
  EXPECT_EQ(parse_with("mistral", {}).head_dim, 8) << "hidden / heads without head_dim";
  EXPECT_EQ(parse_with("mistral", {}).sliding_window, 4096) << "MistralConfig's default";
  EXPECT_EQ(parse_with("mistral", {{"sliding_window", nullptr}}).sliding_window, 0);
  EXPECT_EQ(family_model("tiny-mistral").sliding_window, 32);
  EXPECT_EQ(family_model("tiny-qwen2").sliding_window, 0) << "use_sliding_window false";
  for (const char* name : {"tiny-qwen2", "tiny-qwen3", "tiny-mistral"}) {
    SCOPED_TRACE(name);
    const LlamaConfig c = family_model(name);
    const LlamaConfig back = LlamaConfig::from_json(c.to_json(), "round trip");
    EXPECT_EQ(back.family, c.family);
    EXPECT_EQ(back.has_qkv_bias, c.has_qkv_bias);
    EXPECT_EQ(back.has_qk_norm, c.has_qk_norm);
    EXPECT_EQ(back.sliding_window, c.sliding_window);
    EXPECT_EQ(back.head_dim, c.head_dim);
    EXPECT_EQ(back.tie_word_embeddings, c.tie_word_embeddings);
    EXPECT_EQ(back.rope_theta, c.rope_theta);
  }
  EXPECT_EQ(family_model("tiny-qwen2").to_json()["architectures"][0], "Qwen2ForCausalLM");
}

TEST(FamilyConfig, RefusesWhatItDoesNotImplementNamingTheKey) {
  using test::error_of;
  EXPECT_CONTAINS(error_of([] { parse_with("gemma", {}); }), "unsupported model_type \"gemma\"");
  EXPECT_CONTAINS(error_of([] { parse_with("qwen2", {{"use_sliding_window", true}}); }),
                  "\"use_sliding_window\"");
  EXPECT_CONTAINS(error_of([] { parse_with("qwen3", {{"attention_bias", true}}); }), "\"attention_bias\"");
  EXPECT_CONTAINS(error_of([] { parse_with("mistral", {{"attention_bias", true}}); }), "\"attention_bias\"");
  EXPECT_CONTAINS(error_of([] {
                    parse_with("qwen3", {{"layer_types", {"full_attention", "sliding_attention"}}});
                  }),
                  "\"layer_types\"[1]");
  EXPECT_CONTAINS(error_of([] { parse_with("llama", {{"sliding_window", 16}}); }), "\"sliding_window\"");
  // A rope type that is not a string (found by fuzz_model_config) is a refusal, not an abort.
  EXPECT_CONTAINS(error_of([] { parse_with("llama", {{"rope_scaling", {{"rope_type", 5}}}}); }),
                  "rope_scaling \"rope_type\" must be a string");
  EXPECT_CONTAINS(error_of([] { parse_with("qwen3", {{"rope_parameters", {{"type", {1}}}}}); }),
                  "rope_scaling \"type\" must be a string");
  // Qwen2's config has no bias switch: attention_bias is not read, its q/k/v biases always are.
  EXPECT_TRUE(parse_with("qwen2", {{"attention_bias", false}}).has_qkv_bias);
  // A window shorter than the run's rows: the CPU attention masks it, the CUDA kernels have no
  // window mask yet, so a CUDA run's plan refuses it.
  RunConfig run = small_run();
  run.max_seq_length = 48;
  EXPECT_CONTAINS(error_of([&] { plan_run(run, family_model("tiny-mistral"), Device::cuda); }),
                  "\"sliding_window\" 32");
  EXPECT_NO_THROW(plan_run(run, family_model("tiny-mistral"), Device::cpu));
  run.max_seq_length = 32;
  EXPECT_NO_THROW(plan_run(run, family_model("tiny-mistral"), Device::cuda));
}

TEST(FamilyParamTable, BiasesAndHeadNormsHaveTheirHuggingFaceKeysAndShapes) {
  const LlamaConfig qwen2 = family_model("tiny-qwen2");
  const std::vector<ParamSpec> t2 = base_parameter_table(qwen2);
  for (const char* p : {"q", "k", "v"}) {
    const ParamSpec* bias = find_param(t2, fmt::format("model.layers.1.self_attn.{}_proj.bias", p));
    ASSERT_NE(bias, nullptr) << p;
    EXPECT_EQ(bias->kind, ParamKind::bias);
    EXPECT_EQ(bias->shape, Shape{std::string(p) == "q" ? qwen2.q_dim() : qwen2.kv_dim()});
  }
  EXPECT_EQ(find_param(t2, "model.layers.0.self_attn.o_proj.bias"), nullptr);
  EXPECT_EQ(find_param(t2, "lm_head.weight"), nullptr) << "tied";

  const LlamaConfig qwen3 = family_model("tiny-qwen3");
  const std::vector<ParamSpec> t3 = base_parameter_table(qwen3);
  for (const char* n : {"q_norm", "k_norm"}) {
    const ParamSpec* norm = find_param(t3, fmt::format("model.layers.0.self_attn.{}.weight", n));
    ASSERT_NE(norm, nullptr) << n;
    EXPECT_EQ(norm->kind, ParamKind::head_norm);
    EXPECT_EQ(norm->shape, Shape{qwen3.head_dim});
  }
  EXPECT_EQ(find_param(t3, "model.layers.0.self_attn.q_proj.bias"), nullptr);
  const ParamSpec* o_proj = find_param(t3, "model.layers.0.self_attn.o_proj.weight");
  ASSERT_NE(o_proj, nullptr);
  EXPECT_EQ(o_proj->shape, (Shape{qwen3.hidden_size, qwen3.q_dim()})) << "o_proj reads heads * head_dim";

  // Llama's table has neither, so its rows (and the seeds they draw by index) are unchanged.
  for (const ParamSpec& spec : base_parameter_table(resolve_model("tiny").config))
    EXPECT_TRUE(spec.kind != ParamKind::bias && spec.kind != ParamKind::head_norm) << spec.hf_key;
}

class Family : public ::testing::TestWithParam<std::string> {};

TEST_P(Family, PlannedArenaEqualsAllocated) {
  const LlamaConfig model = family_model(GetParam());
  for (bool ckpt : {false, true}) {
    for (const char* attn : {"eager", "flash"}) {
      for (int64_t mlp_chunk : {0, 7}) {
        SCOPED_TRACE(fmt::format("ckpt {} {} chunk {}", ckpt, attn, mlp_chunk));
        RunConfig run = small_run();
        run.gradient_checkpointing = ckpt;
        run.attn_implementation = attn;
        run.mlp_chunk_tokens = mlp_chunk;
        run.lora_dropout = mlp_chunk > 0 ? 0.1 : 0.0;
        auto cpu = make_cpu_backend();
        PlannedEngine engine(*cpu, run, model);
        expect_step_follows_plan(engine, model, run);
      }
    }
  }
}

namespace {

// Random weights, then biases and head-norm weights that are not their init (zeros, ones), so
// that both change the numbers; and a non-zero B, so every adapter has a gradient.
void init_family_engine(Engine& engine) {
  init_with_nonzero_b(engine);
  uint64_t seed = 100;
  for (LayerWeights& layer : engine.weights().layers) {
    for (const Tensor& bias : layer.bias)
      if (!bias.empty()) engine.backend().fill_random(bias, Backend::Distribution::normal, 0.0f, 0.5f, ++seed);
    for (const Tensor* norm : {&layer.q_norm, &layer.k_norm})
      if (!norm->empty()) engine.backend().fill_random(*norm, Backend::Distribution::uniform, 0.5f, 1.5f, ++seed);
  }
}

double mean_loss(Engine& engine, const HostMicroBatch& batch) {
  const auto [sum, count] = engine.eval_loss_sum(batch);
  return sum / static_cast<double>(count);
}

// Adds step * direction to every adapter A and B (direction laid out as adapter_values()).
void move_adapters(Engine& engine, const std::vector<float>& direction, float step) {
  size_t at = 0;
  for (const LoraTensors& t : engine.lora().tensors()) {
    for (const Tensor* p : {&t.a, &t.b}) {
      std::vector<float> values = host_floats(engine.backend(), *p);
      for (float& v : values) v += step * direction[at++];
      engine.backend().copy_from_host(*p, values.data());
    }
  }
  engine.lora().sync_compute_copies(engine.backend());
}

}  // namespace

TEST_P(Family, LoraGradsMatchFiniteDifferencesThroughBiasAndHeadNorm) {
  const LlamaConfig model = family_model(GetParam());
  RunConfig run = small_run();
  run.lora_target_modules = "all-linear";
  run.learning_rate = 0.0;  // the step leaves the adapters where the differences are taken
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  init_family_engine(engine.engine());
  const HostMicroBatch batch = random_batches(model, run, 1, 9)[0];
  engine->train_step({batch});
  const std::vector<float> grads = adapter_grads(engine.engine());
  // The directional derivative along the grads of one projection's adapters, for the ones that
  // the new pieces sit in front of (q, k: bias and head norm) and one they do not (v, o).
  const LoraState& lora = engine->lora();
  for (Projection projection : {Projection::q, Projection::k, Projection::v, Projection::o}) {
    SCOPED_TRACE(std::string(projection_name(projection)));
    std::vector<float> direction(grads.size(), 0.0f);
    size_t at = 0;
    for (size_t i = 0; i < lora.specs().size(); ++i) {
      const size_t n = static_cast<size_t>(lora.tensors()[i].a.numel() + lora.tensors()[i].b.numel());
      if (lora.specs()[i].projection == projection)
        std::copy(grads.begin() + at, grads.begin() + at + n, direction.begin() + at);
      at += n;
    }
    double norm = 0;
    for (float d : direction) norm += double(d) * d;
    norm = std::sqrt(norm);
    ASSERT_GT(norm, 0.0);
    for (float& d : direction) d = static_cast<float>(d / norm);
    // Central differences over a step of 2e-2 in the adapters' norm (theirs is about 1): small
    // enough for the cubic term, large enough that fp32's rounding of the loss is far below it.
    const float h = 2e-2f;
    move_adapters(engine.engine(), direction, h);
    const double plus = mean_loss(engine.engine(), batch);
    move_adapters(engine.engine(), direction, -2 * h);
    const double minus = mean_loss(engine.engine(), batch);
    move_adapters(engine.engine(), direction, h);
    const double numeric = (plus - minus) / (2.0 * h);
    EXPECT_NEAR(numeric, norm, 1e-2 * norm) << "analytic |g| " << norm << " numeric " << numeric;
  }
}

TEST_P(Family, FlashCheckpointingAndChunksGiveTheSameStep) {
  const LlamaConfig model = family_model(GetParam());
  auto step = [&](RunConfig run) {
    run.lora_target_modules = "all-linear";
    auto cpu = make_cpu_backend();
    PlannedEngine engine(*cpu, run, model);
    init_family_engine(engine.engine());
    const StepReport report = engine->train_step(random_batches(model, run, 2, 5));
    return std::pair{report.loss, adapter_grads(engine.engine())};
  };
  const auto [loss, grads] = step(small_run());
  for (const char* attn : {"eager", "flash"}) {
    for (bool ckpt : {false, true}) {
      RunConfig run = small_run();
      run.attn_implementation = attn;
      run.gradient_checkpointing = ckpt;
      run.mlp_chunk_tokens = ckpt ? 7 : 0;
      const auto [got_loss, got_grads] = step(run);
      EXPECT_NEAR(got_loss, loss, 1e-5 * loss) << attn << ckpt;
      EXPECT_LT(rel_error(got_grads, grads), 1e-5) << attn << ckpt;
    }
  }
}

TEST_P(Family, Bf16StepIsCloseToFp32) {
  // Llama's tolerances (tests/train/test_engine.cpp), with the bias and head-norm weights in
  // bf16 storage too.
  const LlamaConfig model = family_model(GetParam());
  auto step = [&](Precision precision) {
    RunConfig run = small_run();
    run.precision = precision;
    auto cpu = make_cpu_backend();
    PlannedEngine engine(*cpu, run, model);
    init_family_engine(engine.engine());
    const StepReport report = engine->train_step(random_batches(model, run, 2, 5));
    return std::pair{report.loss, adapter_grads(engine.engine())};
  };
  const auto [loss, grads] = step(Precision::fp32);
  const auto [bf16_loss, bf16_grads] = step(Precision::bf16);
  EXPECT_NEAR(bf16_loss, loss, 2e-2 * loss);
  EXPECT_LT(rel_error(bf16_grads, grads), 5e-2);
  EXPECT_GT(rel_error(bf16_grads, grads), 0.0) << "16-bit storage changed nothing";
}

TEST_P(Family, QloraStepEqualsBf16StepOnTheDequantizedWeights) {
  // The 4-bit base holds the projections only: the biases and head norms stay 16-bit beside
  // them, and the step must add them the same way around the dequantized weights.
  const LlamaConfig model = family_model(GetParam());
  RunConfig qlora_run = small_run();
  qlora_run.precision = Precision::bf16;
  qlora_run.load_in_4bit = true;
  RunConfig dense_run = qlora_run;
  dense_run.load_in_4bit = false;
  auto cpu = make_cpu_backend();
  PlannedEngine qlora(*cpu, qlora_run, model);
  PlannedEngine dense(*cpu, dense_run, model);
  init_family_engine(qlora.engine());
  init_family_engine(dense.engine());
  const ModelWeights& qw = qlora->weights();
  for (size_t i = 0; i < qw.table.size(); ++i) {
    if (!qw.is_quantized(i)) continue;
    const ParamSpec& spec = qw.table[i];
    std::vector<float> host(static_cast<size_t>(spec.shape.numel()));
    const Tensor view{host.data(), DType::f32, spec.shape, Device::cpu};
    cpu->dequantize_4bit(view, qw.layers[spec.layer].quantized[static_cast<int>(spec.projection)]);
    dense->weights().upload(*cpu, i, host.data(), DType::f32);
  }
  const auto batches = random_batches(model, qlora_run, 2, 5);
  const StepReport a = qlora->train_step(batches);
  const StepReport b = dense->train_step(batches);
  EXPECT_NEAR(a.loss, b.loss, 1e-6 * b.loss);
  EXPECT_LT(rel_error(adapter_grads(qlora.engine()), adapter_grads(dense.engine())), 1e-6);
}

TEST(FamilySlidingWindow, EagerFlashAndCheckpointingAgreeAndTheWindowMasks) {
  // Mistral's window shorter than the rows (5 of 24 tokens): the CPU attention masks keys 5 or
  // more positions back, the same in the eager and flash paths, checkpointed or not.
  LlamaConfig model = family_model("tiny-mistral");
  model.sliding_window = 5;
  auto step = [&](const LlamaConfig& config, const char* attn, bool ckpt) {
    RunConfig run = small_run();
    run.attn_implementation = attn;
    run.gradient_checkpointing = ckpt;
    run.mlp_chunk_tokens = ckpt ? 7 : 0;
    auto cpu = make_cpu_backend();
    PlannedEngine engine(*cpu, run, config);
    init_family_engine(engine.engine());
    const StepReport report = engine->train_step(random_batches(config, run, 2, 5));
    return std::pair{report.loss, adapter_grads(engine.engine())};
  };
  const auto [loss, grads] = step(model, "eager", false);
  for (const char* attn : {"eager", "flash"})
    for (bool ckpt : {false, true}) {
      const auto [got_loss, got_grads] = step(model, attn, ckpt);
      EXPECT_NEAR(got_loss, loss, 1e-5 * loss) << attn << ckpt;
      EXPECT_LT(rel_error(got_grads, grads), 1e-5) << attn << ckpt;
    }
  LlamaConfig unwindowed = model;
  unwindowed.sliding_window = 0;
  EXPECT_GT(std::abs(step(unwindowed, "flash", false).first - loss), 1e-4) << "the window masked nothing";
}

TEST_P(Family, TheNewPiecesChangeTheLoss) {
  // Guards the tests above against a bias or a head norm that never reaches the math.
  const LlamaConfig model = family_model(GetParam());
  if (!model.has_qkv_bias && !model.has_qk_norm) GTEST_SKIP() << "neither piece in this family";
  const RunConfig run = small_run();
  auto cpu = make_cpu_backend();
  PlannedEngine engine(*cpu, run, model);
  init_with_nonzero_b(engine.engine());
  const HostMicroBatch batch = random_batches(model, run, 1, 9)[0];
  const double plain = mean_loss(engine.engine(), batch);
  init_family_engine(engine.engine());
  EXPECT_GT(std::abs(mean_loss(engine.engine(), batch) - plain), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Families, Family, ::testing::Values("tiny-qwen2", "tiny-qwen3", "tiny-mistral"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });
