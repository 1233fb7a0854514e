#include "memtune/ops/backend.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace memtune {

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
