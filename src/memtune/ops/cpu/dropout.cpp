// LoRA dropout: out = x * keep / (1 - p), keep = dropout_keep(seed, index_offset + flat element
// index, p) (backend.h), so the backward's call with the same seed, on any backend, has the same
// mask, and a row slice with its offset has the mask of the whole tensor.
#include <algorithm>
#include <vector>

#include "memtune/ops/cpu/cpu_backend.h"

namespace memtune {

void CpuBackend::dropout(const Tensor& out, const Tensor& x, float p, uint64_t seed,
                         uint64_t index_offset) {
  cpu::check_float_tensor(out, "dropout out");
  cpu::check_float_tensor(x, "dropout x");
  MT_ASSERT(out.numel() == x.numel(), "dropout out {} for x {}", out.shape.str(), x.shape.str());
  MT_ASSERT(p >= 0.0f && p < 1.0f, "dropout p {} outside [0, 1)", p);
  if (p == 0.0f) {
    convert(out, x);
    return;
  }
  constexpr int64_t kChunk = 2048;
  const int64_t n = x.numel();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const float keep_divisor = 1.0f - p;
#pragma omp parallel if (n >= cpu::kParallelMinElements)
  {
    std::vector<float> values(kChunk);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t offset = c * kChunk, count = std::min(kChunk, n - offset);
      cpu::load_f32(x, offset, count, values.data());
      for (int64_t i = 0; i < count; ++i)
        values[i] = dropout_keep(seed, index_offset + static_cast<uint64_t>(offset + i), p)
                        ? values[i] / keep_divisor
                        : 0.0f;
      cpu::store_f32(out, offset, count, values.data());
    }
  }
}

}  // namespace memtune
