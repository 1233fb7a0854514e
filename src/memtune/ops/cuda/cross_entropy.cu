// Cross-entropy on the GPU (formulas in ops/cpu/cross_entropy.cpp): one block per row. Pass one
// keeps a running max and a running sum of exp(x - max) per thread (the online softmax of
// Milakov & Gimelshein, arXiv 1805.02867) and merges them over the block; pass two writes
// d_logits. Each d_logits element is written by the thread that read that logit, after the
// whole row has been read, so d_logits may alias logits. Row losses go to a scratch buffer and
// are added to loss_sum in row order by one block: the total does not depend on scheduling.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int32_t kIgnoreIndex = -100;

__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(void* d_logits, DType d_logits_type, const void* logits,
                         DType logits_type, const int32_t* targets, int64_t vocab,
                         float grad_scale, float* row_losses) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const int64_t offset = row * vocab;
  const int32_t target = targets[row];
  if (target == kIgnoreIndex) {
    if (d_logits != nullptr)
      for (int64_t j = threadIdx.x; j < vocab; j += kThreads)
        store_float(d_logits, d_logits_type, offset + j, 0.0f);
    if (threadIdx.x == 0) row_losses[row] = 0.0f;
    return;
  }
  if (target < 0 || target >= vocab) {  // validated upstream: an internal error, made visible
    if (threadIdx.x == 0) row_losses[row] = __int_as_float(0x7fc00000);
    return;
  }
  float running_max = -INFINITY, running_sum = 0.0f;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    const float x = load_float(logits, logits_type, offset + j);
    if (x > running_max) {
      running_sum = running_sum * expf(running_max - x) + 1.0f;
      running_max = x;
    } else {
      running_sum += expf(x - running_max);
    }
  }
  const float row_max = block_max(running_max, shared);
  const float scaled = running_sum == 0.0f ? 0.0f : running_sum * expf(running_max - row_max);
  const float sum = block_sum(scaled, shared);
  const float target_logit = load_float(logits, logits_type, offset + target);
  __syncthreads();  // every thread has read logits[target] before anyone overwrites it
  if (threadIdx.x == 0) row_losses[row] = (row_max - target_logit) + logf(sum);
  if (d_logits == nullptr) return;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    const float p = expf(load_float(logits, logits_type, offset + j) - row_max) / sum;
    store_float(d_logits, d_logits_type, offset + j,
                (j == target ? p - 1.0f : p) * grad_scale);
  }
}

}  // namespace

void launch_cross_entropy(float* loss_sum, void* d_logits, DType d_logits_type,
                          const void* logits, DType logits_type, const int32_t* targets,
                          int64_t rows, int64_t vocab, float grad_scale, float* row_losses,
                          cudaStream_t stream) {
  for (int64_t begin = 0; begin < rows; begin += kMaxPartials) {
    const int64_t count = rows - begin < kMaxPartials ? rows - begin : kMaxPartials;
    void* d_part = d_logits == nullptr
                       ? nullptr
                       : static_cast<char*>(d_logits) + begin * vocab * dtype_size(d_logits_type);
    cross_entropy_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
        d_part, d_logits_type,
        static_cast<const char*>(logits) + begin * vocab * dtype_size(logits_type), logits_type,
        targets + begin, vocab, grad_scale, row_losses);
    MT_CUDA_CHECK_LAUNCH();
    launch_add_sum(loss_sum, row_losses, count, stream);
  }
}

}  // namespace memtune::cuda
