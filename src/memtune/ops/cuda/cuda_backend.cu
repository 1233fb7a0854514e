// CUDA backend: the elementwise kernels (fill, convert, add, scale, fill_random, strided copy) and
// the deterministic reductions (sum_squares and the fixed-order sums that cross_entropy uses).
// The CudaBackend class itself, which checks Tensors and calls these, is in cuda_backend.cpp
// (cuda_ops.h says why).
//
// fill, convert, add and scale have typed kernels (cuda_vector.h) for the dtype mixes the step
// uses: one dtype throughout (the residual adds, scale of f32 grads, fill), and every pair of
// distinct float dtypes for convert (LoRA weights f32 -> compute dtype and back). The kernels
// with a run-time dtype switch below serve every other mix.
#include <atomic>
#include <cmath>

#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "memtune/ops/cuda/cuda_vector.h"

namespace memtune::cuda {
namespace {

constexpr int kThreads = 256;

std::atomic<bool> generic_only_flag{false};

template <typename T>
__global__ void fill_typed_kernel(T* dst, int64_t n, bool vector, float value) {
  for_each_chunk(n, vector, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = value;
    store_chunk<W>(dst + i, v);
  });
}

template <typename TDst, typename TSrc>
__global__ void convert_typed_kernel(TDst* dst, const TSrc* src, int64_t n, bool vector) {
  for_each_chunk(n, vector, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load_chunk<W>(src + i, v);
    store_chunk<W>(dst + i, v);
  });
}

// Each thread loads a and b at its chunk before it stores dst there: dst may alias a or b.
template <typename T>
__global__ void add_typed_kernel(T* dst, const T* a, const T* b, int64_t n, bool vector) {
  for_each_chunk(n, vector, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float va[W], vb[W];
    load_chunk<W>(a + i, va);
    load_chunk<W>(b + i, vb);
#pragma unroll
    for (int k = 0; k < W; ++k) va[k] += vb[k];
    store_chunk<W>(dst + i, va);
  });
}

template <typename T>
__global__ void scale_typed_kernel(T* dst, int64_t n, bool vector, float value) {
  for_each_chunk(n, vector, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load_chunk<W>(dst + i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] *= value;
    store_chunk<W>(dst + i, v);
  });
}

__global__ void fill_kernel(void* dst, DType dst_type, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_float(dst, dst_type, i, value);
}

__global__ void convert_kernel(void* dst, DType dst_type, const void* src, DType src_type,
                               int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_float(dst, dst_type, i, load_float(src, src_type, i));
}

__global__ void add_kernel(void* dst, DType dst_type, const void* a, DType a_type, const void* b,
                           DType b_type, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_float(dst, dst_type, i, load_float(a, a_type, i) + load_float(b, b_type, i));
}

__global__ void scale_kernel(void* dst, DType dst_type, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_float(dst, dst_type, i, load_float(dst, dst_type, i) * value);
}

// memtune::random_value (backend.cpp), operation for operation in the same precisions: double
// Box-Muller on two 24-bit uniforms. Device log/cos are within an ulp or two of glibc's in
// double, which the final rounding to float hides in all but the rarest cases.
__global__ void fill_random_kernel(void* dst, DType dst_type, int64_t n, int distribution,
                                   float a, float b, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t bits = device_dropout_hash(seed, static_cast<uint64_t>(i));
    const double u1 = (static_cast<double>(bits >> 40) + 1.0) * (1.0 / 16777216.0);
    const double u2 = static_cast<double>((bits >> 16) & 0xffffffu) * (1.0 / 16777216.0);
    float value;
    if (distribution == 1) {
      const float width = b - a;  // float, as in the host expression
      value = static_cast<float>(static_cast<double>(a) +
                                 static_cast<double>(width) * (u1 - 0x1p-24));
    } else {
      const double normal = sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
      value = static_cast<float>(static_cast<double>(a) + static_cast<double>(b) * normal);
    }
    store_float(dst, dst_type, i, value);
  }
}

__global__ void copy_2d_kernel(void* dst, DType dst_type, int64_t dst_ld, const void* src,
                               DType src_type, int64_t src_ld, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    store_float(dst, dst_type, r * dst_ld + c, load_float(src, src_type, r * src_ld + c));
  }
}

// One partial per block: each thread's grid-stride share in fp32, then the block's tree.
// The assignment of elements to threads and blocks is fixed by n alone, so the result is too.
__global__ void sum_squares_partial_kernel(const void* x, DType x_type, int64_t n,
                                           float* partials) {
  __shared__ float shared[32];
  float sum = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float value = load_float(x, x_type, i);
    sum = fmaf(value, value, sum);
  }
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// *acc += sum(values), one block, accumulated in double in a fixed order.
__global__ void add_sum_kernel(float* acc, const float* values, int64_t n) {
  __shared__ double shared[32];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += values[i];
  sum = warp_sum(sum);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += shared[w];
    *acc = static_cast<float>(static_cast<double>(*acc) + total);
  }
}

}  // namespace

void set_generic_kernels_only(bool generic_only) {
  generic_only_flag.store(generic_only, std::memory_order_relaxed);
}
bool generic_kernels_only() { return generic_only_flag.load(std::memory_order_relaxed); }

void launch_fill(void* dst, DType dst_type, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  if (!generic_kernels_only()) {
    const bool vector = is_aligned_16(dst);
    const bool typed = with_float_type(dst_type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      fill_typed_kernel<T><<<grid_for_chunks(n, vector, kThreads), kThreads, 0, stream>>>(
          static_cast<T*>(dst), n, vector, value);
    });
    if (typed) {
      MT_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  fill_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(dst, dst_type, n, value);
  MT_CUDA_CHECK_LAUNCH();
}

void launch_convert(void* dst, DType dst_type, const void* src, DType src_type, int64_t n,
                    cudaStream_t stream) {
  if (n == 0) return;
  if (dst_type == src_type) {
    if (dst != src)
      MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * dtype_size(dst_type),
                                    cudaMemcpyDefault, stream));
    return;
  }
  if (!generic_kernels_only()) {
    const bool vector = is_aligned_16(dst) && is_aligned_16(src);
    bool typed = false;
    with_float_type(dst_type, [&](auto dst_tag) {
      typed = with_float_type(src_type, [&](auto src_tag) {
        using TDst = typename decltype(dst_tag)::type;
        using TSrc = typename decltype(src_tag)::type;
        convert_typed_kernel<TDst, TSrc>
            <<<grid_for_chunks(n, vector, kThreads), kThreads, 0, stream>>>(
                static_cast<TDst*>(dst), static_cast<const TSrc*>(src), n, vector);
      });
    });
    if (typed) {
      MT_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  convert_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(dst, dst_type, src, src_type,
                                                                  n);
  MT_CUDA_CHECK_LAUNCH();
}

void launch_add(void* dst, DType dst_type, const void* a, DType a_type, const void* b,
                DType b_type, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (!generic_kernels_only() && a_type == dst_type && b_type == dst_type) {
    const bool vector = is_aligned_16(dst) && is_aligned_16(a) && is_aligned_16(b);
    const bool typed = with_float_type(dst_type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      add_typed_kernel<T><<<grid_for_chunks(n, vector, kThreads), kThreads, 0, stream>>>(
          static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n, vector);
    });
    if (typed) {
      MT_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  add_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(dst, dst_type, a, a_type, b, b_type,
                                                              n);
  MT_CUDA_CHECK_LAUNCH();
}

void launch_scale(void* dst, DType dst_type, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  if (!generic_kernels_only()) {
    const bool vector = is_aligned_16(dst);
    const bool typed = with_float_type(dst_type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      scale_typed_kernel<T><<<grid_for_chunks(n, vector, kThreads), kThreads, 0, stream>>>(
          static_cast<T*>(dst), n, vector, value);
    });
    if (typed) {
      MT_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  scale_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(dst, dst_type, n, value);
  MT_CUDA_CHECK_LAUNCH();
}

void launch_fill_random(void* dst, DType dst_type, int64_t n, int distribution, float a, float b,
                        uint64_t seed, cudaStream_t stream) {
  if (n == 0) return;
  fill_random_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(dst, dst_type, n,
                                                                      distribution, a, b, seed);
  MT_CUDA_CHECK_LAUNCH();
}

void launch_copy_2d(void* dst, DType dst_type, int64_t dst_ld, const void* src, DType src_type,
                    int64_t src_ld, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows * cols == 0) return;
  copy_2d_kernel<<<grid_for(rows * cols, kThreads), kThreads, 0, stream>>>(
      dst, dst_type, dst_ld, src, src_type, src_ld, rows, cols);
  MT_CUDA_CHECK_LAUNCH();
}

void launch_sum_squares(float* acc, const void* x, DType x_type, int64_t n, float* partials,
                        cudaStream_t stream) {
  if (n == 0) return;
  // 1024 partials: enough blocks to fill any of the targeted GPUs several times over.
  const unsigned blocks = grid_for(n, kThreads * 4, 1024);
  sum_squares_partial_kernel<<<blocks, kThreads, 0, stream>>>(x, x_type, n, partials);
  MT_CUDA_CHECK_LAUNCH();
  launch_add_sum(acc, partials, blocks, stream);
}

void launch_add_sum(float* acc, const float* values, int64_t n, cudaStream_t stream) {
  add_sum_kernel<<<1, 1024, 0, stream>>>(acc, values, n);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
