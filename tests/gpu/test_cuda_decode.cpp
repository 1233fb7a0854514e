// attention_decode on the CUDA backend against the CPU backend: cache lengths 1, 17 and 1000,
// GQA ratios 1 and 4, head_dims 64, 128 and an odd 40, f32 / bf16 / f16, with the cache rows past
// the attended length (and the output) poisoned with NaN, so that reading one fails the test.
// Then the whole generation path on the GPU: greedy tokens on the golden fixture models equal
// transformers' (tests/fixtures/generate/greedy.json), and cached logits equal the full forward's.
#include <nlohmann/json.hpp>

#include "gpu_test_util.h"
#include "../support/fixtures.h"
#include "memtune/step/llama_generate.h"
#include "../support/attention_setup.h"

namespace memtune::gputest {
namespace {

struct DecodeConfig {
  int64_t batch, kv_len, heads, kv_heads, head_dim;
};

class CudaDecodeTest : public CudaTest {};

TEST_F(CudaDecodeTest, AttentionDecodeMatchesCpu) {
  std::vector<DecodeConfig> configs;
  for (int64_t kv_len : {1, 17, 1000})
    for (int64_t group : {1, 4})
      for (int64_t head_dim : {64, 128, 40}) configs.push_back({2, kv_len, 8, 8 / group, head_dim});
  for (const DecodeConfig& c : configs)
    for (DType type : {DType::f32, DType::bf16, DType::f16}) {
      const std::string what = "b" + std::to_string(c.batch) + " kv" + std::to_string(c.kv_len) + " h" +
                               std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " d" +
                               std::to_string(c.head_dim) + " " + optest::dtype_label(type);
      const int64_t capacity = c.kv_len + 7, kv_width = c.kv_heads * c.head_dim;
      const AttentionDims dims = test::attention_dims(c.batch, c.kv_len, c.heads, c.kv_heads, c.head_dim);
      const HostTensor q = optest::random_tensor(type, Shape{c.batch, c.heads * c.head_dim}, rng_, -1.5f, 1.5f);
      HostTensor k = optest::random_tensor(type, Shape{c.batch, capacity, kv_width}, rng_, -1.5f, 1.5f);
      HostTensor v = optest::random_tensor(type, Shape{c.batch, capacity, kv_width}, rng_);
      for (int64_t b = 0; b < c.batch; ++b)  // rows not written yet
        for (int64_t j = c.kv_len; j < capacity; ++j)
          for (int64_t e = 0; e < kv_width; ++e) {
            store_from_f32(k.storage.data(), type, (b * capacity + j) * kv_width + e, std::nanf(""));
            store_from_f32(v.storage.data(), type, (b * capacity + j) * kv_width + e, std::nanf(""));
          }
      HostTensor reference(type, q.shape);
      cpu().attention_decode(reference, q, k, v, dims);
      DeviceTensor dq = upload(q), dk = upload(k), dv = upload(v), out = poisoned(type, q.shape);
      gpu().attention_decode(out, dq, dk, dv, dims);
      expect_close(what, out.floats(), reference.floats(), type == DType::f32 ? 1e-5 : storage_tolerance(type));
    }
}

TEST_F(CudaDecodeTest, GenerationOnTheGpuEqualsTransformersGreedy) {
  const nlohmann::json fixture = test::read_json_fixture("generate/greedy.json");
  const int64_t fixture_max_new = fixture["max_new_tokens"].get<int64_t>();
  for (const nlohmann::json& c : fixture["cases"]) {
    if (!c.value("checkable", true)) continue;  // a logit margin within fp32 noise
    const int64_t max_new = c.value("max_new_tokens", fixture_max_new);  // within a sliding window
    const std::string name = c["fixture"];
    const std::filesystem::path dir = test::golden_dir(name);
    const std::vector<int32_t> prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    const LlamaConfig config = LlamaConfig::from_file(dir / "config.json");
    InferenceSetup setup;
    setup.checkpoint_dir = dir;
    if (c["adapter"].get<bool>()) setup.adapter_dir = dir / "adapter";
    setup.generator.capacity = static_cast<int64_t>(prompt.size()) + max_new;
    setup.generator.max_chunk = static_cast<int64_t>(prompt.size());
    InferenceModel model(gpu(), config, setup);
    SamplingOptions options;
    options.max_new_tokens = max_new;
    options.stop_ids = stop_token_ids(config, dir);
    const GenerationResult result = generate_tokens(model.generator(), prompt, options);
    EXPECT_EQ(result.tokens, c["output_ids"].get<std::vector<int32_t>>())
        << name << (c["adapter"].get<bool>() ? " + adapter" : "") << ", prompt of " << prompt.size();
  }
}

TEST_F(CudaDecodeTest, CachedLogitsEqualTheFullForwardOnTheGpu) {
  const std::filesystem::path dir = test::golden_dir("gqa_rope");
  const LlamaConfig config = LlamaConfig::from_file(dir / "config.json");
  const std::vector<int32_t> ids = {1, 40, 7, 255, 3, 18, 99, 120, 61, 2, 44, 5, 230, 17, 8, 150, 77};
  const int64_t n = static_cast<int64_t>(ids.size());
  auto session = [&](int64_t max_chunk) {
    InferenceSetup setup;
    setup.checkpoint_dir = dir;
    setup.adapter_dir = dir / "adapter";
    setup.generator = {DType::f32, n, max_chunk, true};
    return std::make_unique<InferenceModel>(gpu(), config, setup);
  };
  const auto full = session(n);
  const std::vector<float> reference = full->generator().forward(ids, true);
  const auto cached = session(5);
  std::vector<float> got = cached->generator().forward(std::vector<int32_t>(ids.begin(), ids.begin() + 5), true);
  for (int64_t i = 5; i < n; ++i) {
    const std::vector<float> step = cached->generator().forward(std::vector<int32_t>{ids[i]}, true);
    got.insert(got.end(), step.begin(), step.end());
  }
  expect_close("cached vs full logits", got, reference, 1e-5);
}

}  // namespace
}  // namespace memtune::gputest
