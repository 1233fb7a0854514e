// The CUDA 4-bit kernels (ops/cuda/quant4bit.cu) against the CPU reference of quant/nf4.h: every
// code, absmax, nested absmax, code map and offset bit-identical, on random weights of real and
// odd shapes, on adversarial blocks and on all three input dtypes; dequantize bit-identical for
// f32 / bf16 / f16 outputs; NaN / Inf raise the reference's error; ModelWeights::init_random and
// upload on the device. Prints (does not assert) the dequantize bandwidth at [14336, 4096].
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>

#include "../quant/quant_test_util.h"
#include "gpu_test_util.h"
#include "memtune/core/memory.h"
#include "memtune/model/model_weights.h"
#include "memtune/quant/codebook.h"
#include "memtune/quant/nf4.h"

namespace memtune::gputest {
namespace {

using namespace quanttest;

// A Quantized4bit in device buffers, poisoned (0xab bytes, NaN floats) so that anything a kernel
// fails to write fails the comparison.
class DeviceQuantized {
 public:
  DeviceQuantized(Backend& backend, const QuantConfig& config, Shape shape) {
    q.config = config;
    q.shape = shape;
    const int64_t n = shape.numel();
    const int64_t blocks = (n + config.blocksize - 1) / config.blocksize;
    packed_ = DeviceTensor(backend, DType::u8, Shape{(n + 1) / 2});
    code_map_ = DeviceTensor(backend, DType::f32, Shape{16});
    if (config.double_quant) {
      absmax_ = DeviceTensor(backend, DType::u8, Shape{blocks});
      nested_absmax_ = DeviceTensor(backend, DType::f32,
                                    Shape{(blocks + config.nested_blocksize - 1) / config.nested_blocksize});
      nested_map_ = DeviceTensor(backend, DType::f32, Shape{256});
    } else {
      absmax_ = DeviceTensor(backend, DType::f32, Shape{blocks});
    }
    for (DeviceTensor* t : {&packed_, &code_map_, &absmax_, &nested_absmax_, &nested_map_}) {
      const Tensor& view = t->tensor();
      if (view.empty()) continue;
      if (view.dtype == DType::u8) {
        const std::vector<uint8_t> poison(view.nbytes(), 0xab);
        backend.copy_from_host(view, poison.data());
      } else {
        backend.fill(view, std::nanf(""));
      }
    }
    q.packed = packed_;
    q.code_map = code_map_;
    q.absmax = absmax_;
    q.nested_absmax = nested_absmax_;
    q.nested_map = nested_map_;
    q.nested_offset = std::nanf("");
  }

  Quantized4bit q;

 private:
  DeviceTensor packed_, code_map_, absmax_, nested_absmax_, nested_map_;
};

class CudaQuantTest : public CudaTest {
 protected:
  // Quantizes `dense` on the device and on the host; expects identical results. Returns the
  // host reference for further checks.
  QuantizedWeight check_quantize(const HostTensor& dense, const QuantConfig& config,
                                 const std::string& what, DeviceQuantized* keep = nullptr) {
    const DeviceTensor dense_dev = upload(dense);
    std::unique_ptr<DeviceQuantized> local;
    if (keep == nullptr) {
      local = std::make_unique<DeviceQuantized>(gpu(), config, dense.shape);
      keep = local.get();
    }
    gpu().quantize_4bit(keep->q, dense_dev, "test.weight");
    QuantizedWeight ref =
        quantize_4bit(dense.storage.data(), dense.dtype, dense.shape, config, "test.weight");
    expect_equals_reference(gpu(), keep->q, ref, what);
    return ref;
  }

  // Dequantizes q on the device into each output dtype (aligned, and at an odd element offset
  // for the unvectorized path); expects the reference's bytes.
  void check_dequantize(const Quantized4bit& q, const QuantizedWeight& ref, const std::string& what) {
    const int64_t n = q.shape.numel();
    for (DType out_type : {DType::f32, DType::bf16, DType::f16}) {
      std::vector<uint8_t> expected(static_cast<size_t>(n) * dtype_size(out_type));
      dequantize_4bit(ref, expected.data(), out_type);
      for (int64_t offset : {int64_t{0}, int64_t{1}}) {
        DeviceTensor buffer = poisoned(out_type, Shape{n + 8});
        Tensor out = buffer.tensor();
        out.data = static_cast<char*>(out.data) + offset * dtype_size(out_type);
        out.shape = q.shape;
        gpu().dequantize_4bit(out, q);
        std::vector<uint8_t> got(expected.size());
        gpu().copy_to_host(got.data(), out);
        expect_same(got, expected,
                    what + " dequantize -> " + std::string(dtype_name(out_type)) +
                        (offset ? " (unaligned)" : ""));
      }
    }
  }
};

const QuantConfig kAllConfigs[] = {
    make_config(QuantType::nf4, 64, true),    make_config(QuantType::nf4, 64, false),
    make_config(QuantType::nf4, 128, true),   make_config(QuantType::nf4, 128, false),
    make_config(QuantType::nf4, 4096, true),  make_config(QuantType::nf4, 4096, false),
    make_config(QuantType::fp4, 64, true),    make_config(QuantType::fp4, 64, false),
    make_config(QuantType::fp4, 128, true),   make_config(QuantType::fp4, 128, false),
    make_config(QuantType::fp4, 4096, true),  make_config(QuantType::fp4, 4096, false),
    make_config(QuantType::nf4, 32, true),    make_config(QuantType::fp4, 32, false),
};

TEST_F(CudaQuantTest, RandomWeightsMatchReference) {
  const Shape shapes[] = {Shape{1, 1}, Shape{17, 33}, Shape{333, 777}, Shape{4096, 4096}};
  for (const Shape& shape : shapes) {
    const std::vector<float> values = normal_values(shape.numel(), rng_, 0.02f);
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      // The largest shape in f32 only (bf16 / f16 inputs are covered at the real scale below).
      if (shape.numel() > 1000000 && dtype != DType::f32) continue;
      const HostTensor dense = optest::tensor_from(dtype, shape, values);
      for (const QuantConfig& config : kAllConfigs) {
        const std::string what = config_label(config) + " " + std::string(dtype_name(dtype)) + " " + shape.str();
        DeviceQuantized q(gpu(), config, shape);
        const QuantizedWeight ref = check_quantize(dense, config, what, &q);
        if (shape.numel() <= 1000000 || config.blocksize == 64) check_dequantize(q.q, ref, what);
      }
    }
  }
}

TEST_F(CudaQuantTest, LlamaMlpShapeInBf16AndF16) {
  // An 8B model's gate/up projection: 58.7M elements, 917504 blocks of 64.
  const Shape shape{14336, 4096};
  const std::vector<float> values = normal_values(shape.numel(), rng_, 0.02f);
  const std::pair<DType, QuantConfig> cases[] = {{DType::bf16, make_config(QuantType::nf4, 64, true)},
                                                 {DType::f16, make_config(QuantType::fp4, 128, false)}};
  for (const auto& [dtype, config] : cases) {
    const HostTensor dense = optest::tensor_from(dtype, shape, values);
    const std::string what = config_label(config) + " " + std::string(dtype_name(dtype)) + " " + shape.str();
    DeviceQuantized q(gpu(), config, shape);
    const QuantizedWeight ref = check_quantize(dense, config, what, &q);
    check_dequantize(q.q, ref, what);
  }
}

// Blocks built to hit every edge of the reference: zeros (absmax 0: NaN codes), constants, a huge
// outlier, fp32 subnormals (flushed), -0.0, values exactly on the decision thresholds and just
// past them (absmax 1 and 2, so the scaled value is exact), the largest floats, a block of tiny
// normals (which defeats the device's exact-sum shortcut for the double-quant mean and sends it
// to the host), and alternating signs.
std::vector<float> adversarial_values(int64_t blocksize, std::mt19937_64& rng) {
  std::vector<std::function<float(int64_t)>> blocks;
  const float subnormal = std::numeric_limits<float>::denorm_min();
  blocks.push_back([](int64_t) { return 0.0f; });
  blocks.push_back([](int64_t) { return 0.37f; });
  blocks.push_back([](int64_t) { return -1.5f; });
  blocks.push_back([](int64_t i) { return i == 5 ? 1e30f : 0.01f * ((i % 7) - 3); });
  blocks.push_back([](int64_t i) { return i == 0 ? -3e38f : 1.0f; });
  blocks.push_back([=](int64_t i) { return subnormal * static_cast<float>(i + 1); });
  blocks.push_back([=](int64_t i) { return (i & 1) ? -subnormal * 1000 : 0.25f; });
  blocks.push_back([](int64_t i) { return (i & 1) ? -0.0f : 0.0f; });
  blocks.push_back([](int64_t i) { return std::numeric_limits<float>::min() * (3.0f + i % 5); });
  for (float scale : {1.0f, 2.0f}) {
    // Element 0 sets absmax = scale; the others are thresholds (and neighbours) times scale.
    std::vector<float> points;
    for (float t : nf4_thresholds()) points.insert(points.end(), {t, std::nextafter(t, 2.0f), std::nextafter(t, -2.0f)});
    for (float t : fp4_magnitude_thresholds())
      points.insert(points.end(), {t, -t, std::nextafter(t, 2.0f), std::nextafter(t, -2.0f)});
    blocks.push_back([=](int64_t i) { return i == 0 ? scale : scale * points[(i - 1) % points.size()]; });
    blocks.push_back([=](int64_t i) { return i == 0 ? -scale : scale * points[(i + 7) % points.size()]; });
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  blocks.push_back([&](int64_t i) { return (i & 1 ? -1.0f : 1.0f) * std::fabs(normal(rng)); });
  blocks.push_back([&](int64_t) { return normal(rng) * 1e-20f; });
  std::vector<float> values;
  for (const auto& block : blocks)
    for (int64_t i = 0; i < blocksize; ++i) values.push_back(block(i));
  return values;
}

TEST_F(CudaQuantTest, AdversarialBlocksMatchReference) {
  for (const QuantConfig& config : kAllConfigs) {
    std::vector<float> values = adversarial_values(config.blocksize, rng_);
    values.resize(values.size() - 3);  // odd count, partial last block
    const int64_t n = static_cast<int64_t>(values.size());
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      const HostTensor dense = optest::tensor_from(dtype, Shape{n}, values);
      // f16 turns the huge values into Inf; those inputs belong to the NaN / Inf test.
      bool finite = true;
      for (float v : dense.floats()) finite = finite && std::isfinite(v);
      if (!finite) continue;
      const std::string what = config_label(config) + " adversarial " + std::string(dtype_name(dtype));
      DeviceQuantized q(gpu(), config, Shape{n});
      const QuantizedWeight ref = check_quantize(dense, config, what, &q);
      check_dequantize(q.q, ref, what);
    }
  }
  // The adversarial f16 case without the out-of-range values.
  for (const QuantConfig& config : {make_config(QuantType::nf4, 64, true), make_config(QuantType::fp4, 64, false)}) {
    std::vector<float> values = adversarial_values(config.blocksize, rng_);
    for (float& v : values)
      if (std::fabs(v) > 60000.0f) v = std::copysign(60000.0f, v);
    const HostTensor dense = optest::tensor_from(DType::f16, Shape{static_cast<int64_t>(values.size())}, values);
    check_quantize(dense, config, config_label(config) + " adversarial f16 (clamped)");
  }
}

TEST_F(CudaQuantTest, WholeTensorEdgeCases) {
  // Whole tensors of one value: double quant then centres every absmax to 0 (nested absmax 0).
  struct Case {
    const char* name;
    std::function<float(int64_t)> value;
  };
  const Case cases[] = {
      {"all zero", [](int64_t) { return 0.0f; }},
      {"constant", [](int64_t) { return 0.125f; }},
      {"constant negative", [](int64_t) { return -7.0f; }},
      {"all subnormal", [](int64_t i) { return std::numeric_limits<float>::denorm_min() * (i % 100); }},
      {"one outlier", [](int64_t i) { return i == 12345 ? 65000.0f : 1e-3f * ((i % 11) - 5); }},
      {"mixed magnitudes", [](int64_t i) { return std::ldexp(1.0f + (i % 13) / 16.0f, static_cast<int>((i / 64) % 160) - 120); }},
  };
  const Shape shape{129, 257};
  for (const Case& c : cases) {
    std::vector<float> values(static_cast<size_t>(shape.numel()));
    for (int64_t i = 0; i < shape.numel(); ++i) values[i] = c.value(i);
    for (DType dtype : {DType::f32, DType::bf16})
      for (const QuantConfig& config : kAllConfigs) {
        const HostTensor dense = optest::tensor_from(dtype, shape, values);
        const std::string what = config_label(config) + " " + c.name + " " + std::string(dtype_name(dtype));
        DeviceQuantized q(gpu(), config, shape);
        const QuantizedWeight ref = check_quantize(dense, config, what, &q);
        check_dequantize(q.q, ref, what);
      }
  }
}

TEST_F(CudaQuantTest, NonFiniteWeightRaisesTheReferenceError) {
  const Shape shape{300, 129};
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  struct Bad {
    int64_t index;
    float value;
  };
  const std::vector<std::vector<Bad>> cases = {
      {{0, nan}}, {{shape.numel() - 1, inf}}, {{20000, -inf}}, {{31000, nan}, {777, inf}, {30000, -inf}}};
  for (DType dtype : {DType::f32, DType::bf16, DType::f16})
    for (bool double_quant : {true, false})
      for (const auto& bad : cases) {
        std::vector<float> values = normal_values(shape.numel(), rng_, 0.02f);
        for (const Bad& b : bad) values[b.index] = b.value;
        const HostTensor dense = optest::tensor_from(dtype, shape, values);
        const DeviceTensor dense_dev = upload(dense);
        const QuantConfig config = make_config(QuantType::nf4, 64, double_quant);
        DeviceQuantized q(gpu(), config, shape);
        const std::string name = "model.layers.3.self_attn.o_proj.weight";
        const std::string got = error_of([&] { gpu().quantize_4bit(q.q, dense_dev, name); });
        const std::string want = error_of(
            [&] { quantize_4bit(dense.storage.data(), dtype, shape, config, name); });
        EXPECT_FALSE(want.empty());
        EXPECT_EQ(got, want) << dtype_name(dtype);
        EXPECT_NE(got.find(name), std::string::npos) << got;
      }
  // The backend is still usable afterwards.
  const HostTensor dense = optest::tensor_from(DType::f32, shape, normal_values(shape.numel(), rng_, 0.02f));
  check_quantize(dense, make_config(QuantType::nf4, 64, true), "after errors");
}

// The engine's two routes to a 4-bit base on the device: init_random (fill_random into an f32
// scratch, then quantize_4bit) and upload (host data copied to a scratch, then quantize_4bit).
TEST_F(CudaQuantTest, ModelWeightsInitRandomAndUploadOnDevice) {
  const LlamaConfig model = odd_tiny_model();
  const uint64_t seed = 7;
  for (const QuantConfig& config : {make_config(QuantType::nf4, 64, true), make_config(QuantType::fp4, 128, false)}) {
    Memory plan(Device::meta, nullptr, 0);
    (void)ModelWeights::allocate(plan, model, DType::bf16, &config);
    const uint64_t bytes = plan.allocator().high_water();
    void* arena = gpu().allocate_arena(bytes);
    {
      Memory memory(Device::cuda, arena, bytes);
      ModelWeights weights = ModelWeights::allocate(memory, model, DType::bf16, &config);
      weights.init_random(gpu(), model, seed);
      for (size_t i = 0; i < weights.table.size(); ++i) {
        if (!weights.is_quantized(i)) continue;
        const ParamSpec& spec = weights.table[i];
        const Quantized4bit& q = weights.layers[spec.layer].quantized[static_cast<int>(spec.projection)];
        // The device's own f32 draws, quantized by the reference.
        DeviceTensor drawn(gpu(), DType::f32, spec.shape);
        gpu().fill_random(drawn, Backend::Distribution::normal, 0.0f,
                          static_cast<float>(model.initializer_range), seed * 1000003 + i);
        const HostTensor host = drawn.download();
        expect_equals_reference(gpu(), q,
                                quantize_4bit(host.storage.data(), DType::f32, spec.shape, config, spec.hf_key),
                                config_label(config) + " init_random " + spec.hf_key);
        // upload from bf16 host data.
        const HostTensor bf16 = optest::converted(host, DType::bf16);
        weights.upload(gpu(), i, bf16.storage.data(), DType::bf16);
        expect_equals_reference(gpu(), q,
                                quantize_4bit(bf16.storage.data(), DType::bf16, spec.shape, config, spec.hf_key),
                                config_label(config) + " upload " + spec.hf_key);
      }
    }
    gpu().free_arena(arena);
  }
}

TEST_F(CudaQuantTest, DequantizeBandwidth) {
  const Shape shape{14336, 4096};
  const int64_t n = shape.numel();
  const QuantConfig config = make_config(QuantType::nf4, 64, true);
  DeviceTensor dense(gpu(), DType::f32, shape);
  gpu().fill_random(dense, Backend::Distribution::normal, 0.0f, 0.02f, 5);
  DeviceQuantized q(gpu(), config, shape);
  auto start = std::chrono::steady_clock::now();
  gpu().quantize_4bit(q.q, dense, "bench.weight");
  gpu().synchronize();
  const double quantize_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  DeviceTensor out(gpu(), DType::bf16, shape);
  for (int warmup = 0; warmup < 3; ++warmup) gpu().dequantize_4bit(out, q.q);
  gpu().synchronize();
  constexpr int kIterations = 50;
  start = std::chrono::steady_clock::now();
  for (int it = 0; it < kIterations; ++it) gpu().dequantize_4bit(out, q.q);
  gpu().synchronize();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kIterations;
  // For scale: a device-to-device copy of the bf16 output (read + write, 4 bytes per element).
  DeviceTensor copy(gpu(), DType::bf16, shape);
  gpu().convert(copy, out);
  gpu().synchronize();
  start = std::chrono::steady_clock::now();
  for (int it = 0; it < kIterations; ++it) gpu().convert(copy, out);
  gpu().synchronize();
  const double copy_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kIterations;
  const int64_t blocks = (n + 63) / 64;
  const double bytes = static_cast<double>((n + 1) / 2 + blocks + (blocks + 255) / 256 * 4 + n * 2);
  std::printf("[ timing ] dequantize_4bit nf4 bs64 dq [14336, 4096] -> bf16: %.1f us, %.0f GB/s "
              "(packed + codes + bf16 out); bf16 device copy of the same output: %.0f GB/s; "
              "quantize from f32: %.2f ms (incl. staging and sync)\n",
              seconds * 1e6, bytes / seconds / 1e9, 4.0 * n / copy_seconds / 1e9, quantize_s * 1e3);
  EXPECT_GT(seconds, 0.0);  // reported, not asserted: the number depends on the GPU
}

}  // namespace
}  // namespace memtune::gputest
