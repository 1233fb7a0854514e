// Device-side helpers shared by the .cu files of the CUDA backend (included by .cu files only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "memtune/core/dtype.h"
#include "memtune/ops/cuda/cuda_check.h"

namespace memtune::cuda {

// Storage access by run-time dtype. The switch is uniform across a warp (one dtype per tensor),
// so it costs a few scalar instructions, not divergence; memory-bound kernels do not notice it,
// and one kernel serves every dtype mix instead of one instantiation per combination.
__device__ __forceinline__ float load_float(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(data)[index];
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[index]);
    case DType::f16: return __half2float(static_cast<const __half*>(data)[index]);
    default: return 0.0f;
  }
}

__device__ __forceinline__ void store_float(void* data, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(data)[index] = value; return;
    case DType::bf16:
      static_cast<__nv_bfloat16*>(data)[index] = __float2bfloat16_rn(value);
      return;
    case DType::f16: static_cast<__half*>(data)[index] = __float2half_rn(value); return;
    default: return;
  }
}

__host__ __device__ __forceinline__ int64_t element_bytes(DType dtype) {
  return dtype == DType::f32 || dtype == DType::i32 ? 4 : dtype == DType::u8 ? 1 : 2;
}

// What storing value into dtype and loading it back gives (round to nearest even).
__device__ __forceinline__ float round_to(DType dtype, float value) {
  switch (dtype) {
    case DType::bf16: return __bfloat162float(__float2bfloat16_rn(value));
    case DType::f16: return __half2float(__float2half_rn(value));
    default: return value;
  }
}

// The dropout / fill_random hash of backend.h (SplitMix64's finaliser), for the device. It must
// stay identical to memtune::dropout_hash: the tests compare masks with the CPU backend.
__device__ __forceinline__ uint64_t device_dropout_hash(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A butterfly over the 32 lanes of a warp: every lane gets combine() of all 32 values.
template <typename T, typename Combine>
__device__ __forceinline__ T warp_reduce(T value, Combine combine) {
  for (int offset = 16; offset > 0; offset >>= 1)
    value = combine(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
  return warp_reduce(value, [](T a, T b) { return a + b; });
}

__device__ __forceinline__ float warp_max(float value) {
  return warp_reduce(value, [](float a, float b) { return fmaxf(a, b); });
}

__device__ __forceinline__ float warp_min(float value) {
  return warp_reduce(value, [](float a, float b) { return fminf(a, b); });
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// `shared` holds 32 floats. Contains __syncthreads: call it from every thread of the block.
__device__ __forceinline__ float block_sum(float value, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  value = warp_sum(value);
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  value = lane < warps ? shared[lane] : 0.0f;
  return warp_sum(value);
}

__device__ __forceinline__ float block_max(float value, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  value = warp_max(value);
  __syncthreads();
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  value = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(value);
}

// Blocks for a grid-stride loop over n elements.
inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65536) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned>(blocks);
}

}  // namespace memtune::cuda
