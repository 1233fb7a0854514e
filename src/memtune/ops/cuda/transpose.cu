// launch_transpose_f32 (cuda_ops.h): 32 x 32 tiles through shared memory, so that both the read of
// a source row and the write of a destination row are coalesced.
#include <algorithm>

#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

constexpr int kTile = 32, kRowsPerPass = 8;

// blockIdx.x: tile of columns, blockIdx.y: tile of rows, blockIdx.z: batch (the grid strides
// over the y and z dims where they exceed the launch limits).
__global__ void __launch_bounds__(kTile * kRowsPerPass)
    transpose_f32_kernel(float* dst, const float* src, int64_t batch, int64_t rows, int64_t cols) {
  __shared__ float tile[kTile][kTile + 1];  // +1: no bank conflicts on the transposed read
  const int64_t col_tiles = (cols + kTile - 1) / kTile, row_tiles = (rows + kTile - 1) / kTile;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const float* s = src + b * rows * cols;
    float* d = dst + b * rows * cols;
    for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
      for (int64_t ct = blockIdx.x; ct < col_tiles; ct += gridDim.x) {
        const int64_t r0 = rt * kTile, c0 = ct * kTile;
        for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
          const int64_t r = r0 + i, c = c0 + threadIdx.x;
          if (r < rows && c < cols) tile[i][threadIdx.x] = s[r * cols + c];
        }
        __syncthreads();
        // dst is [cols][rows]: its row c0 + i holds source column c0 + i.
        for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
          const int64_t c = c0 + i, r = r0 + threadIdx.x;
          if (r < rows && c < cols) d[c * rows + r] = tile[threadIdx.x][i];
        }
        __syncthreads();
      }
    }
  }
}

}  // namespace

void launch_transpose_f32(float* dst, const float* src, int64_t batch, int64_t rows, int64_t cols,
                          cudaStream_t stream) {
  if (batch * rows * cols == 0) return;
  const int64_t col_tiles = (cols + kTile - 1) / kTile, row_tiles = (rows + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(col_tiles, 65535)),
                  static_cast<unsigned>(std::min<int64_t>(row_tiles, 65535)),
                  static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
  transpose_f32_kernel<<<grid, dim3(kTile, kRowsPerPass), 0, stream>>>(dst, src, batch, rows, cols);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
