// CPU backend: memory, the elementwise ops, sum_squares, the shared row helpers and the factory.
#include "memtune/ops/cpu/cpu_backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "memtune/ops/op_checks.h"

namespace memtune {
namespace cpu {

void check_float_tensor(const Tensor& t, const char* what) { check_float_tensor_on(Device::cpu, t, what); }

void check_tensor(const Tensor& t, DType dtype, const char* what) { check_tensor_on(Device::cpu, t, dtype, what); }

void load_f32(const Tensor& src, int64_t offset, int64_t count, float* dst) {
  switch (src.dtype) {
    case DType::f32:
      std::memcpy(dst, src.as<const float>() + offset, static_cast<size_t>(count) * 4);
      return;
    case DType::bf16: {
      const uint16_t* bits = src.as<const uint16_t>() + offset;
      for (int64_t i = 0; i < count; ++i) dst[i] = bf16_bits_to_f32(bits[i]);
      return;
    }
    case DType::f16: {
      const uint16_t* bits = src.as<const uint16_t>() + offset;
      for (int64_t i = 0; i < count; ++i) dst[i] = f16_bits_to_f32(bits[i]);
      return;
    }
    default:
      for (int64_t i = 0; i < count; ++i) dst[i] = load_as_f32(src.data, src.dtype, offset + i);
      return;
  }
}

void store_f32(const Tensor& dst, int64_t offset, int64_t count, const float* src) {
  switch (dst.dtype) {
    case DType::f32:
      // memmove: callers may store a row over the buffer it was loaded from.
      std::memmove(dst.as<float>() + offset, src, static_cast<size_t>(count) * 4);
      return;
    case DType::bf16: {
      uint16_t* bits = dst.as<uint16_t>() + offset;
      for (int64_t i = 0; i < count; ++i) bits[i] = f32_to_bf16_bits(src[i]);
      return;
    }
    case DType::f16: {
      uint16_t* bits = dst.as<uint16_t>() + offset;
      for (int64_t i = 0; i < count; ++i) bits[i] = f32_to_f16_bits(src[i]);
      return;
    }
    default:
      for (int64_t i = 0; i < count; ++i) store_from_f32(dst.data, dst.dtype, offset + i, src[i]);
      return;
  }
}

AttentionView make_attention_view(const AttentionDims& dims, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& segments) {
  check_attention_inputs(dims, q, k, v, check_float_tensor);
  const int64_t n = dims.tokens();
  const int32_t* segment_ids = nullptr;
  if (!segments.empty()) {
    check_tensor(segments, DType::i32, "attention segments");
    MT_ASSERT(segments.numel() == n, "attention segments {} vs N {}", segments.shape.str(), n);
    segment_ids = segments.as<const int32_t>();
  }
  return AttentionView{dims, segment_ids};
}

void gather_head(const Tensor& x, const AttentionDims& dims, int64_t heads, int64_t b, int64_t h,
                 float* dst) {
  const int64_t d = dims.head_dim;
  for (int64_t s = 0; s < dims.seq; ++s)
    load_f32(x, ((b * dims.seq + s) * heads + h) * d, d, dst + s * d);
}

void gather_query_head_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionDims& dims,
                              int64_t b, int64_t h, float* q_head, float* k_head, float* v_head) {
  const int64_t kv_head = h / dims.group();
  gather_head(q, dims, dims.n_heads, b, h, q_head);
  gather_head(k, dims, dims.n_kv_heads, b, kv_head, k_head);
  gather_head(v, dims, dims.n_kv_heads, b, kv_head, v_head);
}

void scatter_head(const Tensor& x, const AttentionDims& dims, int64_t heads, int64_t b,
                  int64_t h, const float* src) {
  const int64_t d = dims.head_dim;
  for (int64_t s = 0; s < dims.seq; ++s)
    store_f32(x, ((b * dims.seq + s) * heads + h) * d, d, src + s * d);
}

}  // namespace cpu

namespace {

// Elementwise ops walk their tensors in chunks of this many elements, through fp32 buffers.
constexpr int64_t kChunk = 2048;

// Calls body(offset, count, buffer) for consecutive chunks, in parallel when worthwhile; buffer
// holds kChunk floats private to the calling thread.
template <typename Body>
void for_each_chunk(int64_t n, int buffers, Body body) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel if (n >= cpu::kParallelMinElements)
  {
    std::vector<float> scratch(static_cast<size_t>(kChunk) * buffers);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t offset = c * kChunk;
      body(offset, std::min(kChunk, n - offset), scratch.data());
    }
  }
}

}  // namespace

void* CpuBackend::allocate_arena(uint64_t bytes) {
  // Page alignment keeps every planned offset (multiples of 256) aligned for any vector load.
  constexpr uint64_t kArenaAlignment = 4096;
  const uint64_t rounded = std::max<uint64_t>(kArenaAlignment, (bytes + kArenaAlignment - 1) /
                                                                   kArenaAlignment *
                                                                   kArenaAlignment);
  void* base = std::aligned_alloc(kArenaAlignment, rounded);
  // The callers check the host's free memory first where it is known; this is the last word.
  MT_USER_CHECK(base != nullptr, "cannot allocate {} bytes of host memory for the CPU arena: the machine has too "
                "little free (memtune plan --device cpu shows what a run needs)", bytes);
  return base;
}

void CpuBackend::free_arena(void* base) { std::free(base); }

void CpuBackend::copy_from_host(const Tensor& dst, const void* host_src) {
  MT_ASSERT(dst.device == Device::cpu, "copy_from_host into a {} tensor", device_name(dst.device));
  if (dst.nbytes() > 0) std::memcpy(dst.data, host_src, dst.nbytes());
}

void CpuBackend::copy_to_host(void* host_dst, const Tensor& src) {
  MT_ASSERT(src.device == Device::cpu, "copy_to_host from a {} tensor", device_name(src.device));
  if (src.nbytes() > 0) std::memcpy(host_dst, src.data, src.nbytes());
}

void CpuBackend::fill(const Tensor& dst, float value) {
  cpu::check_float_tensor(dst, "fill dst");
  for_each_chunk(dst.numel(), 1, [&](int64_t offset, int64_t count, float* buffer) {
    std::fill(buffer, buffer + count, value);
    cpu::store_f32(dst, offset, count, buffer);
  });
}

void CpuBackend::convert(const Tensor& dst, const Tensor& src) {
  cpu::check_float_tensor(dst, "convert dst");
  cpu::check_float_tensor(src, "convert src");
  MT_ASSERT(dst.numel() == src.numel(), "convert {} from {}", dst.shape.str(), src.shape.str());
  if (dst.dtype == src.dtype) {
    if (dst.data != src.data && dst.nbytes() > 0) std::memmove(dst.data, src.data, dst.nbytes());
    return;
  }
  for_each_chunk(dst.numel(), 1, [&](int64_t offset, int64_t count, float* buffer) {
    cpu::load_f32(src, offset, count, buffer);
    cpu::store_f32(dst, offset, count, buffer);
  });
}

void CpuBackend::add(const Tensor& dst, const Tensor& a, const Tensor& b) {
  cpu::check_float_tensor(dst, "add dst");
  cpu::check_float_tensor(a, "add a");
  cpu::check_float_tensor(b, "add b");
  MT_ASSERT(dst.numel() == a.numel() && dst.numel() == b.numel(), "add {} = {} + {}",
            dst.shape.str(), a.shape.str(), b.shape.str());
  for_each_chunk(dst.numel(), 2, [&](int64_t offset, int64_t count, float* buffer) {
    float* a_values = buffer;
    float* b_values = buffer + kChunk;
    cpu::load_f32(a, offset, count, a_values);
    cpu::load_f32(b, offset, count, b_values);
    for (int64_t i = 0; i < count; ++i) a_values[i] += b_values[i];
    cpu::store_f32(dst, offset, count, a_values);
  });
}

void CpuBackend::broadcast_rows(const Tensor& dst, const Tensor& row) {
  cpu::check_float_tensor(dst, "broadcast_rows dst");
  cpu::check_float_tensor(row, "broadcast_rows row");
  MT_ASSERT(row.numel() == dst.cols(), "broadcast_rows {} from {}",
            dst.shape.str(), row.shape.str());
  const int64_t cols = dst.cols();
  std::vector<float> values(static_cast<size_t>(cols));
  cpu::load_f32(row, 0, cols, values.data());
  for (int64_t r = 0; r < dst.rows(); ++r) cpu::store_f32(dst, r * cols, cols, values.data());
}

void CpuBackend::scale(const Tensor& dst, float value) {
  cpu::check_float_tensor(dst, "scale dst");
  for_each_chunk(dst.numel(), 1, [&](int64_t offset, int64_t count, float* buffer) {
    cpu::load_f32(dst, offset, count, buffer);
    for (int64_t i = 0; i < count; ++i) buffer[i] *= value;
    cpu::store_f32(dst, offset, count, buffer);
  });
}

void CpuBackend::sum_squares(const Tensor& acc, const Tensor& x) {
  cpu::check_tensor(acc, DType::f32, "sum_squares acc");
  MT_ASSERT(acc.numel() == 1, "sum_squares acc {} is not one value", acc.shape.str());
  cpu::check_float_tensor(x, "sum_squares x");
  // Per-chunk partial sums in double, added in chunk order: the total does not depend on the
  // thread count.
  const int64_t n = x.numel();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partials(static_cast<size_t>(chunks), 0.0);
  for_each_chunk(n, 1, [&](int64_t offset, int64_t count, float* buffer) {
    cpu::load_f32(x, offset, count, buffer);
    double lanes[4] = {0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 4 <= count; i += 4)
      for (int l = 0; l < 4; ++l) lanes[l] += static_cast<double>(buffer[i + l]) * buffer[i + l];
    for (; i < count; ++i) lanes[0] += static_cast<double>(buffer[i]) * buffer[i];
    partials[static_cast<size_t>(offset / kChunk)] = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  });
  double total = 0.0;
  for (double partial : partials) total += partial;
  float* value = acc.as<float>();
  *value = static_cast<float>(static_cast<double>(*value) + total);
}

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace memtune
