#include "memtune/ops/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "memtune/core/memory.h"
#include "memtune/ops/ragged_attention.h"

namespace memtune {

void* Backend::allocate_host(uint64_t bytes) {
  // Page-aligned, as the CPU arena: every offset the step uses is a multiple of 256.
  constexpr uint64_t kAlignment = 4096;
  const uint64_t rounded = std::max<uint64_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  void* base = std::aligned_alloc(kAlignment, rounded);
  MT_USER_CHECK(base != nullptr, "{} bytes of host memory (offloaded activations or embeddings) could not be allocated", bytes);
  return base;
}

void Backend::free_host(void* base) { std::free(base); }

void Backend::swiglu_lora_forward(const Tensor& out, const Tensor& gate, const Tensor& up, const Tensor& ut_gate,
                                  const Tensor& b_gate, const Tensor& ut_up, const Tensor& b_up, float scale) {
  matmul(gate, ut_gate, true, b_gate, true, scale, 1.0f);
  matmul(up, ut_up, true, b_up, true, scale, 1.0f);
  swiglu_forward(out, gate, up);
}

void Backend::lora_residual_forward(const Tensor& y, const Tensor& u, const Tensor& b, float scale,
                                    const Tensor& residual) {
  matmul(y, u, false, b, true, scale, 1.0f);
  add(y, y, residual);
}

float Backend::read_scalar(const Tensor& scalar) {
  MT_ASSERT(scalar.dtype == DType::f32 && scalar.numel() == 1);
  float value = 0.0f;  // stays 0 on the meta device, which copies nothing
  copy_to_host(&value, scalar);
  return value;
}

float random_value(Backend::Distribution distribution, float a, float b, uint64_t seed,
                   uint64_t index) {
  const uint64_t bits = dropout_hash(seed, index);
  // Two 24-bit uniforms in (0, 1]; Box-Muller for the normal.
  const double u1 = (static_cast<double>(bits >> 40) + 1.0) * (1.0 / 16777216.0);
  const double u2 = static_cast<double>((bits >> 16) & 0xffffffu) * (1.0 / 16777216.0);
  if (distribution == Backend::Distribution::uniform) return static_cast<float>(a + (b - a) * (u1 - 0x1p-24));
  const double normal = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  return static_cast<float>(a + b * normal);
}

void Backend::dequantize_4bit(const Tensor& out, const Quantized4bit& q) {
  if (device() == Device::meta) return;
  MT_ASSERT(out.shape.numel() == q.shape.numel(), "dequantize {} into {}", q.shape.str(), out.shape.str());
  QuantizedWeight host;
  host.config = q.config;
  host.shape = q.shape;
  const auto fetch_bytes = [&](const Tensor& t, std::vector<uint8_t>& dst) {
    dst.resize(t.nbytes());
    copy_to_host(dst.data(), t);
  };
  const auto fetch_floats = [&](const Tensor& t, std::vector<float>& dst) {
    dst.resize(t.numel());
    copy_to_host(dst.data(), t);
  };
  fetch_bytes(q.packed, host.packed);
  fetch_floats(q.code_map, host.quant_map);
  if (q.config.double_quant) {
    fetch_bytes(q.absmax, host.absmax_codes);
    fetch_floats(q.nested_absmax, host.nested_absmax);
    fetch_floats(q.nested_map, host.nested_quant_map);
    host.nested_offset = q.nested_offset;
  } else {
    fetch_floats(q.absmax, host.absmax);
  }
  std::vector<uint8_t> dense(out.nbytes());
  memtune::dequantize_4bit(host, dense.data(), out.dtype);
  copy_from_host(out, dense.data());
}

// ---- QLoRA: quantize on the device (quant4bit) ----

void check_quantized4bit_layout(const Quantized4bit& q, std::string_view what) {
  validate_quant_config(q.config);
  const int64_t n = q.shape.numel();
  MT_ASSERT(n > 0, "{}: empty quantized shape {}", what, q.shape.str());
  const int64_t blocks = (n + q.config.blocksize - 1) / q.config.blocksize;
  const auto check = [&](const Tensor& t, DType dtype, int64_t count, const char* field) {
    MT_ASSERT(t.dtype == dtype && t.numel() == count && (t.data != nullptr || t.device == Device::meta),
              "{}: {} is {} {}, expected {} [{}]", what, field, dtype_name(t.dtype), t.shape.str(),
              dtype_name(dtype), count);
  };
  check(q.packed, DType::u8, (n + 1) / 2, "packed");
  check(q.code_map, DType::f32, 16, "code_map");
  if (q.config.double_quant) {
    check(q.absmax, DType::u8, blocks, "absmax codes");
    check(q.nested_absmax, DType::f32,
          (blocks + q.config.nested_blocksize - 1) / q.config.nested_blocksize, "nested_absmax");
    check(q.nested_map, DType::f32, 256, "nested_map");
  } else {
    check(q.absmax, DType::f32, blocks, "absmax");
  }
}

void Backend::quantize_4bit(Quantized4bit& q, const Tensor& dense, std::string_view name) {
  if (device() == Device::meta) return;
  check_quantized4bit_layout(q, name);
  MT_ASSERT(dense.numel() == q.shape.numel(), "quantize '{}': dense {} for shape {}", name,
            dense.shape.str(), q.shape.str());
  std::vector<uint8_t> host(dense.nbytes());
  copy_to_host(host.data(), dense);
  const QuantizedWeight quantized = memtune::quantize_4bit(host.data(), dense.dtype, q.shape, q.config, name);
  copy_from_host(q.packed, quantized.packed.data());
  copy_from_host(q.code_map, quantized.quant_map.data());
  if (q.config.double_quant) {
    copy_from_host(q.absmax, quantized.absmax_codes.data());
    copy_from_host(q.nested_absmax, quantized.nested_absmax.data());
    copy_from_host(q.nested_map, quantized.nested_quant_map.data());
  } else {
    copy_from_host(q.absmax, quantized.absmax.data());
  }
  q.nested_offset = quantized.nested_offset;  // 0 without double quant
}

// ---- end QLoRA: quantize on the device ----

Tensor allocate_host_tensor(Backend& backend, Memory& memory, std::string name, DType dtype, Shape shape,
                            std::shared_ptr<void>& owner) {
  Tensor t;
  t.dtype = dtype;
  t.shape = shape;
  t.device = memory.device();  // read and written by the device's kernels in place
  t.data = backend.allocate_host(t.nbytes());
  if (t.data != nullptr) owner.reset(t.data, [&backend](void* p) { backend.free_host(p); });
  memory.record_host(std::move(name), t.nbytes());
  return t;
}

void copy_from_host_converted(Backend& backend, const Tensor& dst, const void* host, DType host_dtype) {
  if (host_dtype == dst.dtype) {
    backend.copy_from_host(dst, host);  // bytewise: alignment does not matter
    return;
  }
  std::vector<uint8_t> aligned(static_cast<size_t>(dst.numel()) * dtype_size(host_dtype));
  std::memcpy(aligned.data(), host, aligned.size());
  std::vector<uint8_t> converted(dst.nbytes());
  for (int64_t i = 0; i < dst.numel(); ++i)
    store_from_f32(converted.data(), dst.dtype, i, load_as_f32(aligned.data(), host_dtype, i));
  backend.copy_from_host(dst, converted.data());
}

void upload_ragged_table(Backend& backend, const int32_t* segments, const RaggedTableShape& shape,
                         RaggedAttention& ragged) {
  ragged.slots = ragged.sequences = ragged.max_len = 0;
  const RaggedTableHost table = build_ragged_table(segments, shape);
  if (table.empty()) return;
  backend.copy_from_host(ragged.table, table.values.data());
  ragged.sequences = table.sequences;
  ragged.slots = table.slots;
  ragged.max_len = table.max_len;
  ragged.rows = shape.rows;
  ragged.seq = shape.seq;
}

void Backend::fill_random(const Tensor& dst, Distribution distribution, float a, float b,
                          uint64_t seed) {
  if (device() == Device::meta) return;
  constexpr int64_t kChunk = 1 << 20;
  const size_t element = dtype_size(dst.dtype);
  std::vector<uint8_t> host(static_cast<size_t>(std::min<int64_t>(kChunk, dst.numel())) * element);
  for (int64_t begin = 0; begin < dst.numel(); begin += kChunk) {
    const int64_t count = std::min<int64_t>(kChunk, dst.numel() - begin);
    for (int64_t i = 0; i < count; ++i)
      store_from_f32(host.data(), dst.dtype, i,
                     random_value(distribution, a, b, seed, static_cast<uint64_t>(begin + i)));
    Tensor part = dst.view(Shape{dst.numel()}).slice_rows(begin, begin + count);
    copy_from_host(part, host.data());
  }
}

}  // namespace memtune

#ifndef MEMTUNE_WITH_CUDA
namespace memtune {
// A build without the CUDA backend has no cuDNN attention (ops/cuda/attention_cudnn.cpp defines it
// otherwise).
bool cudnn_attention_available() { return false; }
}  // namespace memtune
#endif
