// SwiGLU: out = silu(gate) * up with silu(g) = g * sigmoid(g).
// Backward: d_up = d_out * silu(g); d_gate = d_out * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
#include <algorithm>
#include <cmath>
#include <vector>

#include "memtune/ops/cpu/cpu_backend.h"
#include "memtune/ops/op_checks.h"

namespace memtune {
namespace {

constexpr int64_t kChunk = 2048;

inline float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

}  // namespace

void CpuBackend::swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  check_swiglu_forward_inputs(out, gate, up, cpu::check_float_tensor);
  const int64_t n = out.numel();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel if (n >= cpu::kParallelMinElements)
  {
    std::vector<float> g(kChunk), u(kChunk);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t offset = c * kChunk, count = std::min(kChunk, n - offset);
      cpu::load_f32(gate, offset, count, g.data());
      cpu::load_f32(up, offset, count, u.data());
      for (int64_t i = 0; i < count; ++i) g[i] = g[i] * sigmoid(g[i]) * u[i];
      cpu::store_f32(out, offset, count, g.data());
    }
  }
}

void CpuBackend::swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out,
                                 const Tensor& gate, const Tensor& up) {
  check_swiglu_backward_inputs(d_gate, d_up, d_out, gate, up, cpu::check_float_tensor);
  const int64_t n = d_out.numel();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel if (n >= cpu::kParallelMinElements)
  {
    std::vector<float> g(kChunk), u(kChunk), dy(kChunk);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t offset = c * kChunk, count = std::min(kChunk, n - offset);
      // All three inputs of the chunk are loaded before either output is stored: d_gate and
      // d_up may alias gate and up.
      cpu::load_f32(gate, offset, count, g.data());
      cpu::load_f32(up, offset, count, u.data());
      cpu::load_f32(d_out, offset, count, dy.data());
      for (int64_t i = 0; i < count; ++i) {
        const float s = sigmoid(g[i]);
        const float silu = g[i] * s;
        const float d_silu = s * (1.0f + g[i] * (1.0f - s));
        const float d_up_value = dy[i] * silu;
        g[i] = dy[i] * u[i] * d_silu;
        u[i] = d_up_value;
      }
      cpu::store_f32(d_gate, offset, count, g.data());
      cpu::store_f32(d_up, offset, count, u.data());
    }
  }
}

}  // namespace memtune
