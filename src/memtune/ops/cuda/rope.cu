// Rotary embedding on the GPU, halves convention, in place (formulas in ops/cpu/rope.cpp): one
// thread per (token, head, j < head_dim / 2) pair, which owns x[j] and x[j + head_dim / 2]. The
// angle is float(position) * inv_freq[j] in fp32 and its cos/sin are the accurate (not
// --use_fast_math) sincosf, as HF computes them in fp32. The backward rotates by -angle.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

__global__ void rope_kernel(void* x, DType x_type, int64_t tokens, int64_t width,
                            const void* positions, DType positions_type, const float* inv_freq,
                            int64_t head_dim, float sin_sign) {
  const int64_t half = head_dim / 2;
  const int64_t pairs_per_token = width / 2;
  const int64_t n = tokens * pairs_per_token;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / pairs_per_token, pair = e % pairs_per_token;
    const int64_t h = pair / half, j = pair % half;
    const float position = positions_type == DType::i32
                               ? static_cast<float>(static_cast<const int32_t*>(positions)[t])
                               : static_cast<const float*>(positions)[t];
    float s, c;
    sincosf(position * inv_freq[j], &s, &c);
    s *= sin_sign;
    const int64_t first = t * width + h * head_dim + j, second = first + half;
    const float x1 = load_float(x, x_type, first), x2 = load_float(x, x_type, second);
    store_float(x, x_type, first, x1 * c - x2 * s);
    store_float(x, x_type, second, x2 * c + x1 * s);
  }
}

}  // namespace

void launch_rope(void* x, DType x_type, int64_t tokens, int64_t width, const void* positions,
                 DType positions_type, const float* inv_freq, int64_t head_dim, bool inverse,
                 cudaStream_t stream) {
  const int64_t n = tokens * (width / 2);
  if (n == 0) return;
  rope_kernel<<<grid_for(n, 256), 256, 0, stream>>>(x, x_type, tokens, width, positions,
                                                     positions_type, inv_freq, head_dim,
                                                     inverse ? -1.0f : 1.0f);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
