// SwiGLU on the GPU: out = silu(gate) * up, and its backward (formulas in ops/cpu/swiglu.cpp).
// Elementwise; each thread reads gate, up and d_out at its index before it writes d_gate and
// d_up there, so the outputs may alias the inputs.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

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
  swiglu_forward_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, out_type, gate, gate_type, up,
                                                               up_type, n);
  MT_CUDA_CHECK_LAUNCH();
}

void launch_swiglu_backward(void* d_gate, DType d_gate_type, void* d_up, DType d_up_type,
                            const void* d_out, DType d_out_type, const void* gate,
                            DType gate_type, const void* up, DType up_type, int64_t n,
                            cudaStream_t stream) {
  if (n == 0) return;
  swiglu_backward_kernel<<<grid_for(n, 256), 256, 0, stream>>>(
      d_gate, d_gate_type, d_up, d_up_type, d_out, d_out_type, gate, gate_type, up, up_type, n);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
