// SwiGLU on the GPU: out = silu(gate) * up, and its backward (formulas in ops/cpu/swiglu.cpp).
// Elementwise; each thread reads gate, up and d_out at its index (its pack of indices) before it
// writes d_gate and d_up there, so the outputs may alias the inputs.
//
// One dtype for all tensors (the step's case) runs a kernel instantiated for it, with 16-byte
// accesses when every pointer is 16-byte aligned (cuda_vector.h); other mixes run the kernels
// with a run-time dtype switch.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "memtune/ops/cuda/cuda_vector.h"

namespace memtune::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_typed_kernel(T* out, const T* gate, const T* up, int64_t n, bool vector) {
  for_each_chunk(n, vector, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float g[W], u[W];
    load_chunk<W>(gate + i, g);
    load_chunk<W>(up + i, u);
#pragma unroll
    for (int k = 0; k < W; ++k) g[k] = g[k] * sigmoid(g[k]) * u[k];
    store_chunk<W>(out + i, g);
  });
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_typed_kernel(T* d_gate, T* d_up, const T* d_out, const T* gate, const T* up,
                                 int64_t n, bool vector) {
  for_each_chunk(n, vector, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float g[W], u[W], dy[W];
    load_chunk<W>(gate + i, g);
    load_chunk<W>(up + i, u);
    load_chunk<W>(d_out + i, dy);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float s = sigmoid(g[k]);
      const float silu = g[k] * s;
      const float d_silu = s * (1.0f + g[k] * (1.0f - s));
      g[k] = dy[k] * u[k] * d_silu;
      u[k] = dy[k] * silu;
    }
    store_chunk<W>(d_gate + i, g);
    store_chunk<W>(d_up + i, u);
  });
}

__global__ void swiglu_forward_kernel(void* out, DType out_type, const void* gate,
                                      DType gate_type, const void* up, DType up_type, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = load_float(gate, gate_type, i);
    store_float(out, out_type, i, g * sigmoid(g) * load_float(up, up_type, i));
  }
}

__global__ void swiglu_backward_kernel(void* d_gate, DType d_gate_type, void* d_up,
                                       DType d_up_type, const void* d_out, DType d_out_type,
                                       const void* gate, DType gate_type, const void* up,
                                       DType up_type, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = load_float(gate, gate_type, i);
    const float u = load_float(up, up_type, i);
    const float dy = load_float(d_out, d_out_type, i);
    const float s = sigmoid(g);
    const float silu = g * s;
    const float d_silu = s * (1.0f + g * (1.0f - s));
    store_float(d_gate, d_gate_type, i, dy * u * d_silu);
    store_float(d_up, d_up_type, i, dy * silu);
  }
}

}  // namespace

void launch_swiglu_forward(void* out, DType out_type, const void* gate, DType gate_type,
                           const void* up, DType up_type, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (!generic_kernels_only() && gate_type == out_type && up_type == out_type) {
    const bool vector = is_aligned_16(out) && is_aligned_16(gate) && is_aligned_16(up);
    const bool typed = with_float_type(out_type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      swiglu_forward_typed_kernel<T><<<grid_for_chunks(n, vector, kThreads), kThreads, 0, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(gate), static_cast<const T*>(up), n, vector);
    });
    if (typed) {
      MT_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  swiglu_forward_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, out_type, gate, gate_type, up,
                                                               up_type, n);
  MT_CUDA_CHECK_LAUNCH();
}

void launch_swiglu_backward(void* d_gate, DType d_gate_type, void* d_up, DType d_up_type,
                            const void* d_out, DType d_out_type, const void* gate,
                            DType gate_type, const void* up, DType up_type, int64_t n,
                            cudaStream_t stream) {
  if (n == 0) return;
  if (!generic_kernels_only() && d_up_type == d_gate_type && d_out_type == d_gate_type &&
      gate_type == d_gate_type && up_type == d_gate_type) {
    const bool vector = is_aligned_16(d_gate) && is_aligned_16(d_up) && is_aligned_16(d_out) &&
                        is_aligned_16(gate) && is_aligned_16(up);
    const bool typed = with_float_type(d_gate_type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      swiglu_backward_typed_kernel<T>
          <<<grid_for_chunks(n, vector, kThreads), kThreads, 0, stream>>>(
              static_cast<T*>(d_gate), static_cast<T*>(d_up), static_cast<const T*>(d_out),
              static_cast<const T*>(gate), static_cast<const T*>(up), n, vector);
    });
    if (typed) {
      MT_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  swiglu_backward_kernel<<<grid_for(n, 256), 256, 0, stream>>>(
      d_gate, d_gate_type, d_up, d_up_type, d_out, d_out_type, gate, gate_type, up, up_type, n);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
