// Rotary position embedding, halves convention (HF rotate_half), in place.
//
// For j < d/2 with x1 = x[j], x2 = x[j + d/2] and angle = float(position) * inv_freq[j] (fp32, as
// HF's LlamaRotaryEmbedding computes it, cos/sin of the fp32 angle):
//   forward:  out[j] = x1 cos - x2 sin,  out[j + d/2] = x2 cos + x1 sin
//   backward: the inverse (transposed) rotation, dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin.
#include <cmath>
#include <vector>

#include "memtune/ops/cpu/cpu_backend.h"

namespace memtune {
namespace {

void rope_apply(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                int64_t head_dim, bool inverse) {
  const char* op = inverse ? "rope_backward" : "rope_forward";
  cpu::check_float_tensor(x, op);
  MT_ASSERT(positions.dtype == DType::i32 || positions.dtype == DType::f32,
            "{}: positions dtype {}", op, dtype_name(positions.dtype));
  MT_ASSERT(positions.device == Device::cpu && positions.numel() == x.rows(),
            "{}: positions {} for x {}", op, positions.shape.str(), x.shape.str());
  cpu::check_tensor(inv_freq, DType::f32, op);
  MT_ASSERT(head_dim > 0 && head_dim % 2 == 0 && x.cols() % head_dim == 0,
            "{}: head_dim {} for x {}", op, head_dim, x.shape.str());
  const int64_t half = head_dim / 2;
  MT_ASSERT(inv_freq.numel() == half, "{}: inv_freq {} for head_dim {}", op,
            inv_freq.shape.str(), head_dim);

  const int64_t tokens = x.rows(), width = x.cols(), heads = width / head_dim;
  const float* frequencies = inv_freq.as<const float>();
  // Backward rotates by -angle: the same formulas with sin negated.
  const float sin_sign = inverse ? -1.0f : 1.0f;

#pragma omp parallel if (tokens * width >= cpu::kParallelMinElements)
  {
    std::vector<float> row(static_cast<size_t>(width)), cosines(static_cast<size_t>(half)),
        sines(static_cast<size_t>(half));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const float position = load_as_f32(positions.data, positions.dtype, t);
      for (int64_t j = 0; j < half; ++j) {
        const float angle = position * frequencies[j];
        cosines[j] = std::cos(angle);
        sines[j] = sin_sign * std::sin(angle);
      }
      cpu::load_f32(x, t * width, width, row.data());
      for (int64_t h = 0; h < heads; ++h) {
        float* first = row.data() + h * head_dim;
        float* second = first + half;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = first[j], x2 = second[j];
          first[j] = x1 * cosines[j] - x2 * sines[j];
          second[j] = x2 * cosines[j] + x1 * sines[j];
        }
      }
      cpu::store_f32(x, t * width, width, row.data());
    }
  }
}

}  // namespace

void CpuBackend::rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                              int64_t head_dim) {
  rope_apply(x, positions, inv_freq, head_dim, /*inverse=*/false);
}

void CpuBackend::rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                               int64_t head_dim) {
  rope_apply(dx, positions, inv_freq, head_dim, /*inverse=*/true);
}

}  // namespace memtune
