// HF LlamaRMSNorm on the GPU, forward and backward for a frozen weight (the formulas are in
// ops/cpu/norm.cpp). One block per row; the row's sums are block reductions in fp32. The forward
// rounds the normalised value to x's dtype before the weight multiply, as HF does.
//
// One dtype for x, weight and out (dx and dy: the step's case) runs a kernel instantiated for it
// that holds its share of the row in registers, as loaded (16-bit values stay packed, which
// doubles the rows an SM keeps in flight): the row is read from memory once, reduced, and
// written once. A thread holds kChunksPerThread chunks, each a 16-byte pack of kPack elements
// (when hidden is a multiple of kPack and every pointer is 16-byte aligned, so that every row
// is) or, else, one element; the block has as many threads as that takes, up to kMaxRowThreads
// (vector rows up to 32768 elements of a 16-bit type or 16384 of f32, others up to 8192).
// Wider rows and other dtype mixes run the generic kernels, which read the row twice with a
// run-time dtype switch.
//
// Aliasing: in the backward every element of dx is written after the block's reduction over the
// whole row, which follows every read of x and dy, and dx's old value (accumulate) is read by the
// thread that writes it; so dx may alias dy or x.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "memtune/ops/cuda/cuda_vector.h"

namespace memtune::cuda {
namespace {

constexpr int kThreads = 256;

constexpr int kMaxRowThreads = 512;
// Vector rows: packs per thread, 64 values of a 16-bit type (32 registers per row tensor held),
// 32 of f32 (the same registers).
template <typename T>
constexpr int kChunksPerThread = sizeof(T) == 4 ? 4 : 8;
constexpr int kScalarChunksPerThread = 16;  // other rows: 16 single elements per thread

// Element index of chunk k of this thread: chunks are interleaved across the block, so that each
// warp's accesses are contiguous.
template <int kWidth>
__device__ __forceinline__ int64_t chunk_begin(int k) {
  return (static_cast<int64_t>(k) * blockDim.x + threadIdx.x) * kWidth;
}

// A chunk of a row held across the reduction as loaded (RawPack: 16-bit types take half the
// registers of fp32 values, which doubles the rows an SM keeps in flight), widened when used.
template <typename T, int kWidth>
struct HeldChunk;
template <typename T>
struct HeldChunk<T, kPack> {
  RawPack<T> raw;
  __device__ __forceinline__ void load(const T* p) { raw = load_raw_pack(p); }
  __device__ __forceinline__ void values(float (&v)[kPack]) const { unpack(raw, v); }
};
template <typename T>
struct HeldChunk<T, 1> {
  T raw;
  __device__ __forceinline__ void load(const T* p) { raw = *p; }
  __device__ __forceinline__ void values(float (&v)[1]) const { v[0] = to_float(raw); }
};

template <typename T, int kWidth, int kChunks>
__global__ void __launch_bounds__(kMaxRowThreads)
    rmsnorm_forward_rows_kernel(T* out, float* rstd, const T* x, const T* weight, int64_t hidden,
                                float eps) {
  __shared__ float shared[32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * hidden;
  HeldChunk<T, kWidth> held[kChunks];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t begin = chunk_begin<kWidth>(k);
    if (begin < hidden) held[k].load(x + offset + begin);
  }
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t begin = chunk_begin<kWidth>(k);
    if (begin < hidden) {
      float v[kWidth];
      held[k].values(v);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) sum = fmaf(v[e], v[e], sum);
    }
  }
  sum = block_sum(sum, shared);
  const float r = 1.0f / sqrtf(sum / static_cast<float>(hidden) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t begin = chunk_begin<kWidth>(k);
    if (begin < hidden) {
      float v[kWidth], w[kWidth];
      held[k].values(v);
      load_chunk<kWidth>(weight + begin, w);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) v[e] = w[e] * round_through<T>(v[e] * r);
      store_chunk<kWidth>(out + offset + begin, v);
    }
  }
}

// dn = dy * weight is formed in both passes from the held dy and the weight (a re-read that hits
// in L1 / L2), the same product each time.
template <typename T, int kWidth, int kChunks>
__global__ void __launch_bounds__(kMaxRowThreads)
    rmsnorm_backward_rows_kernel(T* dx, const T* dy, const T* x, const T* weight,
                                 const float* rstd, int64_t hidden, bool accumulate) {
  __shared__ float shared[32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * hidden;
  HeldChunk<T, kWidth> held_x[kChunks], held_dy[kChunks];
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t begin = chunk_begin<kWidth>(k);
    if (begin < hidden) {
      held_x[k].load(x + offset + begin);
      held_dy[k].load(dy + offset + begin);
    }
  }
  float projection = 0.0f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t begin = chunk_begin<kWidth>(k);
    if (begin < hidden) {
      float xs[kWidth], dn[kWidth], w[kWidth];
      held_x[k].values(xs);
      held_dy[k].values(dn);
      load_chunk<kWidth>(weight + begin, w);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) projection = fmaf(dn[e] * w[e], xs[e], projection);
    }
  }
  projection = block_sum(projection, shared) / static_cast<float>(hidden);
  const float r = rstd[blockIdx.x];
  const float x_coefficient = r * r * r * projection;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t begin = chunk_begin<kWidth>(k);
    if (begin < hidden) {
      float xs[kWidth], dn[kWidth], w[kWidth], previous[kWidth];
      held_x[k].values(xs);
      held_dy[k].values(dn);
      load_chunk<kWidth>(weight + begin, w);
      if (accumulate) load_chunk<kWidth>(dx + offset + begin, previous);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) {
        dn[e] = r * (dn[e] * w[e]) - x_coefficient * xs[e];
        if (accumulate) dn[e] += previous[e];
      }
      store_chunk<kWidth>(dx + offset + begin, dn);
    }
  }
}

// The launch shape of the register kernels for a row of `hidden` elements: vector or not and the
// threads per block, or threads == 0 where the row is too wide for them.
struct RowLaunch {
  bool vector = false;
  int threads = 0;
};

RowLaunch row_launch(int64_t hidden, bool pointers_aligned, int64_t packs_per_thread) {
  RowLaunch launch;
  launch.vector = pointers_aligned && hidden % kPack == 0;
  const int64_t chunks = launch.vector ? hidden / kPack : hidden;
  const int64_t per_thread = launch.vector ? packs_per_thread : kScalarChunksPerThread;
  int64_t threads = (chunks + per_thread - 1) / per_thread;
  threads = (threads + 31) / 32 * 32;
  if (threads < 32) threads = 32;
  launch.threads = threads <= kMaxRowThreads ? static_cast<int>(threads) : 0;
  return launch;
}

int64_t packs_per_thread(DType dtype) { return dtype == DType::f32 ? 4 : 8; }

// The generic kernels: any dtype mix, any width; two passes over the row.
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
  const RowLaunch launch =
      row_launch(hidden, is_aligned_16(out) && is_aligned_16(x) && is_aligned_16(weight),
                 packs_per_thread(x_type));
  const bool try_typed = !generic_kernels_only() && launch.threads > 0 && out_type == x_type &&
                         weight_type == x_type;
  for (int64_t begin = 0; begin < rows; begin += INT32_MAX) {
    const int64_t count = rows - begin < INT32_MAX ? rows - begin : INT32_MAX;
    void* out_rows = static_cast<char*>(out) + begin * hidden * dtype_size(out_type);
    const void* x_rows = static_cast<const char*>(x) + begin * hidden * dtype_size(x_type);
    const bool typed = try_typed && with_float_type(x_type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const unsigned blocks = static_cast<unsigned>(count);
      if (launch.vector)
        rmsnorm_forward_rows_kernel<T, kPack, kChunksPerThread<T>>
            <<<blocks, launch.threads, 0, stream>>>(
                static_cast<T*>(out_rows), rstd + begin, static_cast<const T*>(x_rows),
                static_cast<const T*>(weight), hidden, eps);
      else
        rmsnorm_forward_rows_kernel<T, 1, kScalarChunksPerThread>
            <<<blocks, launch.threads, 0, stream>>>(
                static_cast<T*>(out_rows), rstd + begin, static_cast<const T*>(x_rows),
                static_cast<const T*>(weight), hidden, eps);
    });
    if (!typed)
      rmsnorm_forward_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
          out_rows, out_type, rstd + begin, x_rows, x_type, weight, weight_type, hidden, eps);
    MT_CUDA_CHECK_LAUNCH();
  }
}

void launch_rmsnorm_backward(void* dx, DType dx_type, const void* dy, DType dy_type,
                             const void* x, DType x_type, const void* weight, DType weight_type,
                             const float* rstd, int64_t rows, int64_t hidden, bool accumulate,
                             cudaStream_t stream) {
  if (rows == 0) return;
  const RowLaunch launch =
      row_launch(hidden,
                 is_aligned_16(dx) && is_aligned_16(dy) && is_aligned_16(x) &&
                     is_aligned_16(weight),
                 packs_per_thread(x_type));
  const bool try_typed = !generic_kernels_only() && launch.threads > 0 && dx_type == x_type &&
                         dy_type == x_type && weight_type == x_type;
  for (int64_t begin = 0; begin < rows; begin += INT32_MAX) {
    const int64_t count = rows - begin < INT32_MAX ? rows - begin : INT32_MAX;
    void* dx_rows = static_cast<char*>(dx) + begin * hidden * dtype_size(dx_type);
    const void* dy_rows = static_cast<const char*>(dy) + begin * hidden * dtype_size(dy_type);
    const void* x_rows = static_cast<const char*>(x) + begin * hidden * dtype_size(x_type);
    const bool typed = try_typed && with_float_type(x_type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const unsigned blocks = static_cast<unsigned>(count);
      if (launch.vector)
        rmsnorm_backward_rows_kernel<T, kPack, kChunksPerThread<T>>
            <<<blocks, launch.threads, 0, stream>>>(
                static_cast<T*>(dx_rows), static_cast<const T*>(dy_rows),
                static_cast<const T*>(x_rows), static_cast<const T*>(weight), rstd + begin,
                hidden, accumulate);
      else
        rmsnorm_backward_rows_kernel<T, 1, kScalarChunksPerThread>
            <<<blocks, launch.threads, 0, stream>>>(
                static_cast<T*>(dx_rows), static_cast<const T*>(dy_rows),
                static_cast<const T*>(x_rows), static_cast<const T*>(weight), rstd + begin,
                hidden, accumulate);
    });
    if (!typed)
      rmsnorm_backward_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
          dx_rows, dx_type, dy_rows, dy_type, x_rows, x_type, weight, weight_type, rstd + begin,
          hidden, accumulate);
    MT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace memtune::cuda
