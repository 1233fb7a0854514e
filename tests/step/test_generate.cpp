// Inference (step/llama_generate.h) on the CPU backend: greedy generation equals transformers'
// greedy generate on the golden fixture models, alone and with their PEFT adapters
// (tests/fixtures/generate/greedy.json, from tools/make_generate_golden.py); the full forward
// equals transformers' logits (tests/fixtures/golden/*/forward.safetensors); the KV-cache path
// gives the logits of the full forward at every position; stopping and sampling.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "memtune/io/safetensors.h"
#include "memtune/ops/backend.h"
#include "memtune/step/llama_generate.h"
#include "../support/fixtures.h"

using namespace memtune;
using memtune::test::golden_dir;
namespace fs = std::filesystem;

namespace {

struct Session {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  LlamaConfig config;
  std::unique_ptr<InferenceModel> model;

  Session(const std::string& fixture, bool adapter, int64_t capacity, int64_t max_chunk, bool all_logits = false)
      : config(LlamaConfig::from_file(golden_dir(fixture) / "config.json")) {
    InferenceSetup setup;
    setup.checkpoint_dir = golden_dir(fixture);
    if (adapter) setup.adapter_dir = golden_dir(fixture) / "adapter";
    setup.generator.capacity = capacity;
    setup.generator.max_chunk = max_chunk;
    setup.generator.all_logits = all_logits;
    model = std::make_unique<InferenceModel>(*backend, config, setup);
  }
  LlamaGenerator& generator() { return model->generator(); }
};

nlohmann::json greedy_fixture() {
  return memtune::test::read_json_fixture("generate/greedy.json");
}

TEST(Generate, GreedyTokensEqualTransformersGenerate) {
  const nlohmann::json fixture = greedy_fixture();
  const int64_t fixture_max_new = fixture["max_new_tokens"].get<int64_t>();
  ASSERT_GE(fixture["cases"].size(), 30u);  // 5 fixtures (Llama x2, Qwen2, Qwen3, Mistral) x adapter or not x 3 prompts
  for (const nlohmann::json& c : fixture["cases"]) {
    if (!c.value("checkable", true)) continue;  // a logit margin within fp32 noise
    const int64_t max_new = c.value("max_new_tokens", fixture_max_new);  // within a sliding window
    const std::string name = c["fixture"];
    const std::vector<int32_t> prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> expected = c["output_ids"].get<std::vector<int32_t>>();
    const std::string what = name + (c["adapter"].get<bool>() ? " + adapter" : "") + ", prompt of " +
                             std::to_string(prompt.size());
    // The whole prompt in one prefill, and (for longer prompts) in chunks of 4, the later chunks
    // appended to a non-empty cache.
    for (int64_t chunk : {static_cast<int64_t>(prompt.size()), int64_t{4}}) {
      if (chunk > static_cast<int64_t>(prompt.size())) continue;
      Session session(name, c["adapter"].get<bool>(), static_cast<int64_t>(prompt.size()) + max_new, chunk);
      SamplingOptions options;
      options.max_new_tokens = max_new;
      options.stop_ids = stop_token_ids(session.config, golden_dir(name));
      const GenerationResult result = generate_tokens(session.generator(), prompt, options);
      EXPECT_EQ(result.tokens, expected) << what << ", chunk " << chunk;
      EXPECT_EQ(result.stop_reason, c["stop_reason"].get<std::string>()) << what;
    }
  }
}

TEST(Generate, FullForwardEqualsTransformersLogits) {
  // And the families beyond Llama: Qwen2's biases, Qwen3's per-head q/k norm, Mistral.
  for (const char* name : {"gqa_rope", "tied_odd", "qwen2_bias", "qwen3_qk_norm", "mistral_head_dim"}) {
    const SafetensorsFile batch = SafetensorsFile::open(golden_dir(name) / "batch.safetensors");
    const SafetensorsFile forward = SafetensorsFile::open(golden_dir(name) / "forward.safetensors");
    const SafetensorsTensor& ids = batch.get("input_ids");
    const SafetensorsTensor& logits = forward.get("logits");
    const int64_t rows = ids.shape[0], seq = ids.shape[1], vocab = logits.shape[2];
    Session session(name, /*adapter=*/true, seq, seq, /*all_logits=*/true);
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int32_t> row(seq);
      std::memcpy(row.data(), ids.data + r * seq * 4, seq * 4);
      session.generator().reset();
      const std::vector<float> got = session.generator().forward(row, /*all_positions=*/true);
      ASSERT_EQ(static_cast<int64_t>(got.size()), seq * vocab);
      for (int64_t i = 0; i < seq * vocab; ++i) {
        float want;
        std::memcpy(&want, logits.data + 4 * (r * seq * vocab + i), 4);
        worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want) / (1.0 + std::abs(want)));
      }
    }
    EXPECT_LT(worst, 2e-5) << name;
  }
}

// Logits of a cached run, position by position, against one full forward of the sequence.
void expect_cached_equals_full(const std::string& name, const std::vector<int32_t>& ids,
                               const std::vector<int64_t>& pieces) {
  const int64_t n = static_cast<int64_t>(ids.size());
  Session full(name, true, n, n, true);
  const std::vector<float> reference = full.generator().forward(ids, true);
  const int64_t vocab = full.config.vocab_size;
  int64_t longest = 0;
  for (int64_t p : pieces) longest = std::max(longest, p);
  Session cached(name, true, n, longest, true);
  int64_t begin = 0;
  double worst = 0;
  for (int64_t piece : pieces) {
    const std::vector<int32_t> chunk(ids.begin() + begin, ids.begin() + begin + piece);
    const std::vector<float> got = cached.generator().forward(chunk, true);
    for (int64_t i = 0; i < piece * vocab; ++i)
      worst = std::max(worst, std::abs(static_cast<double>(got[i]) - reference[begin * vocab + i]));
    begin += piece;
  }
  ASSERT_EQ(begin, n);
  EXPECT_EQ(cached.generator().cached(), n);
  EXPECT_LT(worst, 1e-5) << name << ": cached vs full logits";
}

TEST(Generate, KvCacheLogitsEqualTheFullForwardAtEveryPosition) {
  const std::vector<int32_t> ids = {1, 40, 7, 255, 3, 18, 99, 120, 61, 2, 44, 5, 230, 17, 8, 150, 77, 31, 9, 200};
  for (const char* name : {"gqa_rope", "tied_odd"}) {
    // One token at a time (a prefill of one, then decode steps), ...
    expect_cached_equals_full(name, ids, std::vector<int64_t>(ids.size(), 1));
    // ... a prefill, then single tokens and multi-token appends to the cache.
    expect_cached_equals_full(name, ids, {7, 1, 1, 4, 1, 6});
  }
  // The families' vocabularies are smaller (83 to 97): the same ids folded into them. Qwen3's
  // cache holds keys after its k norm and RoPE.
  std::vector<int32_t> small_ids = ids;
  for (int32_t& id : small_ids) id %= 83;
  for (const char* name : {"qwen2_bias", "qwen3_qk_norm", "mistral_head_dim"}) {
    expect_cached_equals_full(name, small_ids, std::vector<int64_t>(small_ids.size(), 1));
    expect_cached_equals_full(name, small_ids, {7, 1, 1, 4, 1, 6});
  }
}

TEST(Generate, StopsAfterAStopToken) {
  Session session("gqa_rope", true, 40, 9);
  const std::vector<int32_t> prompt = {1, 17, 104, 33, 250, 7, 61, 199, 42};
  SamplingOptions options;
  options.max_new_tokens = 24;
  const std::vector<int32_t> free_run = generate_tokens(session.generator(), prompt, options).tokens;
  ASSERT_EQ(free_run.size(), 24u);
  const int32_t stop = free_run[5];
  const size_t first = std::find(free_run.begin(), free_run.end(), stop) - free_run.begin();
  options.stop_ids = {stop};
  const GenerationResult stopped = generate_tokens(session.generator(), prompt, options);
  EXPECT_EQ(stopped.stop_reason, "eos");
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(free_run.begin(), free_run.begin() + first + 1));
}

TEST(Generate, CacheOverflowAndBadIdsAreUserErrors) {
  Session session("gqa_rope", false, 4, 4);
  EXPECT_THROW(session.generator().forward(std::vector<int32_t>{1, 2, 3, 4, 5}), Error);
  EXPECT_THROW(session.generator().forward(std::vector<int32_t>{1, 300}), Error);  // vocab 300
  session.generator().forward(std::vector<int32_t>{1, 2, 3});
  EXPECT_THROW(session.generator().forward(std::vector<int32_t>{4, 5}), Error);
  EXPECT_NO_THROW(session.generator().forward(std::vector<int32_t>{4}));
}

TEST(Generate, ACacheLongerThanMistralsSlidingWindowIsRefused) {
  // mistral_head_dim's window is 32 tokens, and the attention has no window mask yet: a cache
  // that fits in the window is exact (HF masks only keys 32 or more positions back).
  EXPECT_NO_THROW(Session("mistral_head_dim", true, 32, 8));
  try {
    Session session("mistral_head_dim", true, 33, 8);
    ADD_FAILURE() << "a 33-token cache under a 32-token window was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"sliding_window\" 32"), std::string::npos) << e.what();
  }
}

// The decode op against the last query row of the causal flash kernel over the same keys, with
// the cache rows past the attended length holding NaN (they must not be read).
TEST(AttentionDecode, EqualsTheLastRowOfCausalAttention) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> uniform(-1.5f, 1.5f);
  for (int64_t kv_len : {1, 17, 100})
    for (int64_t kv_heads : {4, 1}) {  // GQA ratios 1 and 4
      const int64_t heads = 4, d = 24, capacity = kv_len + 3, kv_width = kv_heads * d;
      std::vector<float> q(kv_len * heads * d), k(capacity * kv_width, NAN), v(capacity * kv_width, NAN);
      for (float& x : q) x = uniform(rng);
      for (int64_t i = 0; i < kv_len * kv_width; ++i) k[i] = uniform(rng), v[i] = uniform(rng);
      AttentionDims dims{1, kv_len, heads, kv_heads, d, 1.0f / std::sqrt(float(d))};
      std::vector<float> full(q.size()), lse(heads * kv_len), decoded(heads * d);
      const auto tensor = [](std::vector<float>& x, Shape shape) { return Tensor{x.data(), DType::f32, shape, Device::cpu}; };
      cpu->attention_flash_forward(tensor(full, Shape{kv_len, heads * d}), tensor(lse, Shape{heads * kv_len}),
                                   tensor(q, Shape{kv_len, heads * d}), tensor(k, Shape{capacity, kv_width}).slice_rows(0, kv_len),
                                   tensor(v, Shape{capacity, kv_width}).slice_rows(0, kv_len), Tensor{}, dims);
      std::vector<float> last_q(q.end() - heads * d, q.end());
      cpu->attention_decode(tensor(decoded, Shape{1, heads * d}), tensor(last_q, Shape{1, heads * d}),
                            tensor(k, Shape{1, capacity, kv_width}), tensor(v, Shape{1, capacity, kv_width}), dims);
      for (int64_t i = 0; i < heads * d; ++i)
        ASSERT_NEAR(decoded[i], full[(kv_len - 1) * heads * d + i], 1e-6) << "kv " << kv_len << " kv_heads " << kv_heads;
    }
}

TEST(Sampling, GreedyTemperatureAndTopP) {
  std::mt19937_64 rng(7);
  SamplingOptions greedy;
  std::vector<float> tie = {0.5f, 2.0f, 2.0f, -1.0f};
  EXPECT_EQ(sample_token(tie, greedy, rng), 1);  // the first maximum, as torch.argmax

  // probabilities 0.4, 0.3, 0.2, 0.1
  const std::vector<float> logits = {std::log(0.4f), std::log(0.3f), std::log(0.2f), std::log(0.1f)};
  SamplingOptions sampled;
  sampled.temperature = 1.0;
  std::map<int32_t, int> counts;
  constexpr int kDraws = 40000;
  for (int i = 0; i < kDraws; ++i) {
    std::vector<float> l = logits;
    ++counts[sample_token(l, sampled, rng)];
  }
  for (int t = 0; t < 4; ++t) EXPECT_NEAR(counts[t] / double(kDraws), std::exp(logits[t]), 0.01) << t;

  // transformers' TopP with 0.5 keeps {0.4, 0.3}: the ascending cumulative sums of 0.1 and 0.2
  // (0.1, 0.3) are <= 1 - 0.5.
  sampled.top_p = 0.5;
  counts.clear();
  for (int i = 0; i < kDraws; ++i) {
    std::vector<float> l = logits;
    ++counts[sample_token(l, sampled, rng)];
  }
  EXPECT_EQ(counts[2] + counts[3], 0);
  EXPECT_NEAR(counts[0] / double(kDraws), 0.4 / 0.7, 0.01);
  // A nucleus smaller than the top token keeps the top token.
  sampled.top_p = 1e-6;
  std::vector<float> l = logits;
  EXPECT_EQ(sample_token(l, sampled, rng), 0);
}

}  // namespace
