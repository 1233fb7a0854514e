// LoRA dropout on the GPU: out = x * keep / (1 - p) with keep = dropout_keep(seed, index_offset +
// flat index, p) of backend.h, through the same hash (cuda_common.h), so the masks equal the CPU
// backend's.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

__global__ void dropout_kernel(void* out, DType out_type, const void* x, DType x_type, int64_t n,
                               float p, float keep_divisor, uint64_t seed,
                               uint64_t index_offset) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t bits = device_dropout_hash(seed, index_offset + static_cast<uint64_t>(i));
    const bool keep = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f) >= p;
    store_float(out, out_type, i, keep ? load_float(x, x_type, i) / keep_divisor : 0.0f);
  }
}

}  // namespace

void launch_dropout(void* out, DType out_type, const void* x, DType x_type, int64_t n, float p,
                    uint64_t seed, uint64_t index_offset, cudaStream_t stream) {
  if (n == 0) return;
  dropout_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, out_type, x, x_type, n, p, 1.0f - p,
                                                        seed, index_offset);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
