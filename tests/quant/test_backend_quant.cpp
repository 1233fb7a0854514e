// Backend::quantize_4bit / dequantize_4bit on the CPU backend (the default implementations,
// which round-trip through the host reference of quant/nf4.h), and ModelWeights::init_random
// for a 4-bit base: the codes are those the host path always produced (seed * 1000003 + i).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../ops/op_test_util.h"
#include "quant_test_util.h"
#include "memtune/core/error.h"
#include "memtune/core/memory.h"
#include "memtune/model/model_weights.h"
#include "memtune/ops/backend.h"
#include "memtune/quant/codebook.h"
#include "memtune/quant/nf4.h"

namespace memtune {
namespace {

using optest::HostTensor;
using namespace quanttest;

// A Quantized4bit over host storage, laid out as ModelWeights::allocate lays it out.
class HostQuantized {
 public:
  HostQuantized(const QuantConfig& config, Shape shape) {
    q.config = config;
    q.shape = shape;
    const int64_t n = shape.numel();
    const int64_t blocks = (n + config.blocksize - 1) / config.blocksize;
    q.packed = optest::tensor_over(packed_, DType::u8, Shape{(n + 1) / 2});
    q.code_map = optest::tensor_over(code_map_, DType::f32, Shape{16});
    if (config.double_quant) {
      q.absmax = optest::tensor_over(absmax_, DType::u8, Shape{blocks});
      q.nested_absmax = optest::tensor_over(
          nested_absmax_, DType::f32,
          Shape{(blocks + config.nested_blocksize - 1) / config.nested_blocksize});
      q.nested_map = optest::tensor_over(nested_map_, DType::f32, Shape{256});
    } else {
      q.absmax = optest::tensor_over(absmax_, DType::f32, Shape{blocks});
    }
  }
  HostQuantized(const HostQuantized&) = delete;
  HostQuantized& operator=(const HostQuantized&) = delete;

  Quantized4bit q;

 private:
  std::vector<uint8_t> packed_, absmax_, nested_absmax_, code_map_, nested_map_;
};

TEST(BackendQuant, DefaultQuantizeEqualsReference) {
  auto cpu = make_cpu_backend();
  std::mt19937_64 rng(41);
  const Shape shapes[] = {Shape{1, 1}, Shape{17, 33}, Shape{64, 96}, Shape{3, 4097}};
  for (QuantType type : {QuantType::nf4, QuantType::fp4})
    for (int64_t blocksize : {32, 64, 128, 4096})
      for (bool double_quant : {true, false})
        for (DType dtype : {DType::f32, DType::bf16, DType::f16})
          for (const Shape& shape : shapes) {
            const QuantConfig config = make_config(type, blocksize, double_quant);
            const std::string what = config_label(config) + " " +
                                     std::string(dtype_name(dtype)) + " " + shape.str();
            const HostTensor dense =
                optest::tensor_from(dtype, shape, normal_values(shape.numel(), rng, 0.02f));
            HostQuantized device(config, shape);
            cpu->quantize_4bit(device.q, dense, "layers.0.q_proj.weight");
            const QuantizedWeight ref =
                quantize_4bit(dense.storage.data(), dtype, shape, config, "layers.0.q_proj.weight");
            expect_equals_reference(*cpu, device.q, ref, what);
          }
}

TEST(BackendQuant, DefaultDequantizeEqualsReference) {
  auto cpu = make_cpu_backend();
  std::mt19937_64 rng(43);
  const Shape shape{33, 65};
  for (QuantType type : {QuantType::nf4, QuantType::fp4})
    for (bool double_quant : {true, false}) {
      const QuantConfig config = make_config(type, 64, double_quant);
      const std::vector<float> values = normal_values(shape.numel(), rng, 1.0f);
      HostQuantized device(config, shape);
      const HostTensor dense = optest::tensor_from(DType::f32, shape, values);
      cpu->quantize_4bit(device.q, dense, "w");
      const QuantizedWeight ref = quantize_4bit(values.data(), DType::f32, shape, config, "w");
      for (DType out_type : {DType::f32, DType::bf16, DType::f16}) {
        HostTensor out(out_type, shape);
        cpu->dequantize_4bit(out, device.q);
        std::vector<uint8_t> expected(out.storage.size());
        dequantize_4bit(ref, expected.data(), out_type);
        EXPECT_EQ(out.storage, expected) << config_label(config) << " -> " << dtype_name(out_type);
      }
    }
}

TEST(BackendQuant, NonFiniteWeightNamesTheTensor) {
  auto cpu = make_cpu_backend();
  const Shape shape{4, 40};
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> values(static_cast<size_t>(shape.numel()), 0.5f);
    values[97] = bad;
    const HostTensor dense = optest::tensor_from(DType::f32, shape, values);
    HostQuantized device(make_config(QuantType::nf4, 64, true), shape);
    const std::string message = error_of(
        [&] { cpu->quantize_4bit(device.q, dense, "model.layers.1.mlp.up_proj.weight"); });
    EXPECT_NE(message.find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << message;
    EXPECT_NE(message.find("element 97"), std::string::npos) << message;
    EXPECT_EQ(message, error_of([&] {
                quantize_4bit(values.data(), DType::f32, shape, device.q.config,
                              "model.layers.1.mlp.up_proj.weight");
              }));
  }
}

TEST(BackendQuant, MetaBackendIgnoresQuantize) {
  auto meta = make_meta_backend();
  Memory memory(Device::meta, nullptr, 0);
  Quantized4bit q;
  q.config = make_config(QuantType::nf4, 64, true);
  q.shape = Shape{128, 64};
  const Tensor dense = memory.alloc("dense", MemCategory::workspace, DType::f32, q.shape);
  meta->quantize_4bit(q, dense, "w");  // nothing to check but that it does nothing
  EXPECT_EQ(q.nested_offset, 0.0f);
}

uint64_t fnv1a(uint64_t hash, const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001b3ull;
  return hash;
}

// What ModelWeights::init_random stored for 4-bit projections before quantize_4bit moved to the
// backend: f32 values random_value(normal, 0, initializer_range, seed * 1000003 + i, e) on the
// host, quantized by the reference.
QuantizedWeight host_path_projection(const ParamSpec& spec, size_t index, uint64_t seed,
                                     const LlamaConfig& model, const QuantConfig& quant) {
  std::vector<float> host(static_cast<size_t>(spec.shape.numel()));
  for (size_t e = 0; e < host.size(); ++e)
    host[e] = random_value(Backend::Distribution::normal, 0.0f,
                           static_cast<float>(model.initializer_range), seed * 1000003 + index, e);
  return quantize_4bit(host.data(), DType::f32, spec.shape, quant, spec.hf_key);
}

TEST(BackendQuant, InitRandomQuantizedGivesTheHostPathCodes) {
  const LlamaConfig model = odd_tiny_model();
  const uint64_t seed = 7;
  struct Case {
    QuantConfig quant;
    uint64_t fingerprint;  // FNV-1a of every stored field: pins the codes across changes
  };
  // Fingerprints recorded from the host path (host_path_projection) when the init moved to the
  // backend; a change means the seed scheme, random_value or the quantizer changed.
  const Case cases[] = {{make_config(QuantType::nf4, 64, true), 0xb0dc9c6d0df99710ull},
                        {make_config(QuantType::nf4, 64, false), 0x5bab7caeae1e81c7ull},
                        {make_config(QuantType::fp4, 128, true), 0xf965adc8353dacbbull}};
  for (const Case& c : cases) {
    auto cpu = make_cpu_backend();
    Memory plan(Device::meta, nullptr, 0);
    (void)ModelWeights::allocate(plan, model, DType::bf16, &c.quant);
    const uint64_t bytes = plan.allocator().high_water();
    void* arena = cpu->allocate_arena(bytes);
    {
      Memory memory(Device::cpu, arena, bytes);
      ModelWeights weights = ModelWeights::allocate(memory, model, DType::bf16, &c.quant);
      weights.init_random(*cpu, model, seed);
      uint64_t fingerprint = 0xcbf29ce484222325ull;
      int quantized = 0;
      for (size_t i = 0; i < weights.table.size(); ++i) {
        if (!weights.is_quantized(i)) continue;
        ++quantized;
        const ParamSpec& spec = weights.table[i];
        const Quantized4bit& q = weights.layers[spec.layer].quantized[static_cast<int>(spec.projection)];
        expect_equals_reference(*cpu, q, host_path_projection(spec, i, seed, model, c.quant),
                                config_label(c.quant) + " " + spec.hf_key);
        for (const Tensor* t : {&q.packed, &q.absmax, &q.nested_absmax})
          if (!t->empty()) fingerprint = fnv1a(fingerprint, t->data, t->nbytes());
        fingerprint = fnv1a(fingerprint, &q.nested_offset, sizeof(float));
      }
      EXPECT_EQ(quantized, 2 * kNumProjections);
      EXPECT_EQ(fingerprint, c.fingerprint)
          << config_label(c.quant) << ": got 0x" << std::hex << fingerprint;
    }
    cpu->free_arena(arena);
  }
}

// The dense scratch of a 4-bit init comes from the lent tensor when it is large enough
// (Memory::free_tail: arena space above the live buffers), so that nothing is allocated outside
// the plan; the codes are the same either way.
TEST(BackendQuant, InitRandomUsesTheLentScratchAndGivesTheSameCodes) {
  const LlamaConfig model = odd_tiny_model();
  const QuantConfig quant = make_config(QuantType::nf4, 64, true);
  auto cpu = make_cpu_backend();
  Memory plan(Device::meta, nullptr, 0);
  const ModelWeights planned = ModelWeights::allocate(plan, model, DType::bf16, &quant);
  EXPECT_TRUE(plan.free_tail().empty());  // nothing to lend on the meta device
  int64_t largest = 0;
  for (size_t i = 0; i < planned.table.size(); ++i)
    if (planned.is_quantized(i)) largest = std::max(largest, planned.table[i].shape.numel());
  const uint64_t weight_bytes = plan.allocator().high_water();
  const uint64_t tail_bytes = static_cast<uint64_t>(largest) * sizeof(float);
  const auto stored = [&](uint64_t extra_bytes, bool lend, bool* tail_written) {
    void* arena = cpu->allocate_arena(weight_bytes + extra_bytes);
    std::memset(arena, 0xA5, weight_bytes + extra_bytes);
    std::vector<uint8_t> bytes;
    {
      Memory memory(Device::cpu, arena, weight_bytes + extra_bytes);
      ModelWeights weights = ModelWeights::allocate(memory, model, DType::bf16, &quant);
      const Tensor tail = memory.free_tail();
      EXPECT_EQ(tail.nbytes(), extra_bytes);
      weights.init_random(*cpu, model, 7, lend ? tail : Tensor{});
      for (size_t i = 0; i < weights.table.size(); ++i) {
        if (!weights.is_quantized(i)) continue;
        const ParamSpec& spec = weights.table[i];
        const Quantized4bit& q = weights.layers[spec.layer].quantized[static_cast<int>(spec.projection)];
        for (const Tensor* t : {&q.packed, &q.absmax, &q.nested_absmax})
          bytes.insert(bytes.end(), t->as<uint8_t>(), t->as<uint8_t>() + t->nbytes());
      }
      const uint8_t* tail_begin = static_cast<const uint8_t*>(arena) + weight_bytes;
      *tail_written = std::any_of(tail_begin, tail_begin + extra_bytes, [](uint8_t b) { return b != 0xA5; });
    }
    cpu->free_arena(arena);
    return bytes;
  };
  bool written_without = true, written_with = false, written_small = true;
  const std::vector<uint8_t> without = stored(tail_bytes, false, &written_without);
  const std::vector<uint8_t> with_tail = stored(tail_bytes, true, &written_with);
  // One alignment unit short: the loader allocates its own scratch and leaves the tail alone.
  const std::vector<uint8_t> too_small = stored(tail_bytes - LifetimeAllocator::kAlignment, true, &written_small);
  EXPECT_FALSE(written_without);
  EXPECT_TRUE(written_with);
  EXPECT_FALSE(written_small);
  EXPECT_EQ(with_tail, without);
  EXPECT_EQ(too_small, without);
}

}  // namespace
}  // namespace memtune
