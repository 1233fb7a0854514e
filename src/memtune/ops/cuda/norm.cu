// HF LlamaRMSNorm on the GPU, forward and backward for a frozen weight (the formulas are in
// ops/cpu/norm.cpp). One block per row; the row's sums are block reductions in fp32. The forward
// rounds the normalised value to x's dtype before the weight multiply, as HF does.
//
// Aliasing: in the backward every element of dx is written by the thread that read x, dy (and
// dx) at that index, after the block's reduction over the whole row, so dx may alias dy or x.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_kernel(void* out, DType out_type, float* rstd, const void* x, DType x_type,
                           const void* weight, DType weight_type, int64_t hidden, float eps) {
  __shared__ float shared[32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * hidden;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) {
    const float value = load_float(x, x_type, offset + j);
    sum = fmaf(value, value, sum);
  }
  sum = block_sum(sum, shared);
  const float r = 1.0f / sqrtf(sum / static_cast<float>(hidden) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) {
    const float normalized = round_to(x_type, load_float(x, x_type, offset + j) * r);
    store_float(out, out_type, offset + j, load_float(weight, weight_type, j) * normalized);
  }
}

__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_kernel(void* dx, DType dx_type, const void* dy, DType dy_type, const void* x,
                            DType x_type, const void* weight, DType weight_type,
                            const float* rstd, int64_t hidden, bool accumulate) {
  __shared__ float shared[32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * hidden;
  float projection = 0.0f;
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) {
    const float dn = load_float(dy, dy_type, offset + j) * load_float(weight, weight_type, j);
    projection = fmaf(dn, load_float(x, x_type, offset + j), projection);
  }
  projection = block_sum(projection, shared) / static_cast<float>(hidden);
  const float r = rstd[blockIdx.x];
  const float x_coefficient = r * r * r * projection;
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) {
    const float dn = load_float(dy, dy_type, offset + j) * load_float(weight, weight_type, j);
    float value = r * dn - x_coefficient * load_float(x, x_type, offset + j);
    if (accumulate) value += load_float(dx, dx_type, offset + j);
    store_float(dx, dx_type, offset + j, value);
  }
}

}  // namespace

void launch_rmsnorm_forward(void* out, DType out_type, float* rstd, const void* x, DType x_type,
                            const void* weight, DType weight_type, int64_t rows, int64_t hidden,
                            float eps, cudaStream_t stream) {
  if (rows == 0) return;
  for (int64_t begin = 0; begin < rows; begin += INT32_MAX) {
    const int64_t count = rows - begin < INT32_MAX ? rows - begin : INT32_MAX;
    rmsnorm_forward_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
        static_cast<char*>(out) + begin * hidden * dtype_size(out_type), out_type, rstd + begin,
        static_cast<const char*>(x) + begin * hidden * dtype_size(x_type), x_type, weight,
        weight_type, hidden, eps);
    MT_CUDA_CHECK_LAUNCH();
  }
}

void launch_rmsnorm_backward(void* dx, DType dx_type, const void* dy, DType dy_type,
                             const void* x, DType x_type, const void* weight, DType weight_type,
                             const float* rstd, int64_t rows, int64_t hidden, bool accumulate,
                             cudaStream_t stream) {
  if (rows == 0) return;
  for (int64_t begin = 0; begin < rows; begin += INT32_MAX) {
    const int64_t count = rows - begin < INT32_MAX ? rows - begin : INT32_MAX;
    rmsnorm_backward_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
        static_cast<char*>(dx) + begin * hidden * dtype_size(dx_type), dx_type,
        static_cast<const char*>(dy) + begin * hidden * dtype_size(dy_type), dy_type,
        static_cast<const char*>(x) + begin * hidden * dtype_size(x_type), x_type, weight,
        weight_type, rstd + begin, hidden, accumulate);
    MT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace memtune::cuda
