// AdamW on the GPU with torch semantics (ops/cpu/adamw.cpp has the sequence of tensor ops). The
// scalar coefficients come from the host, computed as the CPU backend computes them; each
// element then takes the same fp32 operations in the same order, written with the _rn
// intrinsics so that nvcc cannot contract them into FMAs. The result is the CPU backend's, bit
// for bit (sqrt and division are correctly rounded on both).
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

__global__ void adamw_kernel(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                             int64_t n, AdamWScalars s) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = __fmul_rn(grad[i], s.grad_scale);
    float p = __fmul_rn(param[i], s.decay_factor);
    float m = exp_avg[i];
    // torch's lerp: start + weight * (end - start) for weight < 0.5, else the mirrored form.
    m = s.avg_weight < 0.5f ? __fadd_rn(m, __fmul_rn(s.avg_weight, __fsub_rn(g, m)))
                            : __fsub_rn(g, __fmul_rn(__fsub_rn(g, m), __fsub_rn(1.0f, s.avg_weight)));
    const float v = __fadd_rn(__fmul_rn(exp_avg_sq[i], s.beta2), __fmul_rn(__fmul_rn(s.sq_weight, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), s.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

}  // namespace

void launch_adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                  const AdamWScalars& s, cudaStream_t stream) {
  if (n == 0) return;
  adamw_kernel<<<grid_for(n, 256), 256, 0, stream>>>(param, grad, exp_avg, exp_avg_sq, n, s);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
