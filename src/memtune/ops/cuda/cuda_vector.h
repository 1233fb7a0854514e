// Statically typed storage access for the bandwidth-bound kernels (elementwise, norm, rope,
// swiglu, embedding; included by .cu files only). The host picks the element types once per
// launch (with_float_type) and instantiates a kernel for them; the kernel moves data in packs of
// kPack elements, 16-byte accesses, where every pointer it walks is 16-byte aligned, and element
// by element (a scalar tail, or the whole range) otherwise. Math stays fp32, every store rounds
// to nearest even, exactly as load_float / store_float of cuda_common.h do; those run-time dtype
// switches remain the generic path for the dtype mixes that are not instantiated.
#pragma once

#include <cstdint>

#include "memtune/ops/cuda/cuda_common.h"

namespace memtune::cuda {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with T the storage type of a float dtype and returns true; returns
// false (f not called) for the others.
template <typename F>
bool with_float_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(TypeTag<float>{}); return true;
    case DType::bf16: f(TypeTag<__nv_bfloat16>{}); return true;
    case DType::f16: f(TypeTag<__half>{}); return true;
    default: return false;
  }
}

inline bool is_aligned_16(const void* pointer) {
  return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0;
}

__device__ __forceinline__ float to_float(float value) { return value; }
__device__ __forceinline__ float to_float(__nv_bfloat16 value) { return __bfloat162float(value); }
__device__ __forceinline__ float to_float(__half value) { return __half2float(value); }

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float value) {
  return __float2half_rn(value);
}

// round_to (cuda_common.h) for a static type.
template <typename T>
__device__ __forceinline__ float round_through(float value) {
  return to_float(from_float<T>(value));
}

// Elements per pack: one 16-byte access of a 16-bit type, two of f32. A pointer p of type T that
// is 16-byte aligned stays so at p + i * kPack for every i.
constexpr int kPack = 8;

// A pack as loaded, its bits not yet widened to fp32: half the registers of the floats for the
// 16-bit types, for kernels that hold data across a reduction (rmsnorm).
template <typename T>
struct RawPack {
  uint4 bits[sizeof(T) * kPack / 16];
};

template <typename T>
__device__ __forceinline__ RawPack<T> load_raw_pack(const T* p) {
  RawPack<T> raw;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(raw.bits) / sizeof(uint4)); ++i)
    raw.bits[i] = reinterpret_cast<const uint4*>(p)[i];
  return raw;
}

__device__ __forceinline__ void unpack(const RawPack<float>& raw, float (&v)[kPack]) {
  const float* f = reinterpret_cast<const float*>(raw.bits);
#pragma unroll
  for (int i = 0; i < kPack; ++i) v[i] = f[i];
}
// bf16 is the top half of an f32: widening is a shift or a mask of each 32-bit word (element 2i
// in the low half, as in memory), exact, and without the conversion instructions' temporaries.
__device__ __forceinline__ void unpack(const RawPack<__nv_bfloat16>& raw, float (&v)[kPack]) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(raw.bits);
#pragma unroll
  for (int i = 0; i < kPack / 2; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack(const RawPack<__half>& raw, float (&v)[kPack]) {
  const __half2* pairs = reinterpret_cast<const __half2*>(raw.bits);
#pragma unroll
  for (int i = 0; i < kPack / 2; ++i) {
    const float2 f = __half22float2(pairs[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load_pack(const float* p, float (&v)[kPack]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load_pack(const __nv_bfloat16* p, float (&v)[kPack]) {
  const uint4 bits = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&bits);
#pragma unroll
  for (int i = 0; i < kPack / 2; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load_pack(const __half* p, float (&v)[kPack]) {
  const uint4 bits = *reinterpret_cast<const uint4*>(p);
  const __half2* pairs = reinterpret_cast<const __half2*>(&bits);
#pragma unroll
  for (int i = 0; i < kPack / 2; ++i) {
    const float2 f = __half22float2(pairs[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void store_pack(float* p, const float (&v)[kPack]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store_pack(__nv_bfloat16* p, const float (&v)[kPack]) {
  uint4 bits;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&bits);
#pragma unroll
  for (int i = 0; i < kPack / 2; ++i) pairs[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = bits;
}
__device__ __forceinline__ void store_pack(__half* p, const float (&v)[kPack]) {
  uint4 bits;
  __half2* pairs = reinterpret_cast<__half2*>(&bits);
#pragma unroll
  for (int i = 0; i < kPack / 2; ++i) pairs[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = bits;
}

// A chunk of kWidth consecutive elements: a pack (kWidth == kPack, p 16-byte aligned) or one
// element (kWidth == 1), so that a kernel body serves both its vector and its scalar path.
template <int kWidth, typename T>
__device__ __forceinline__ void load_chunk(const T* p, float (&v)[kWidth]) {
  if constexpr (kWidth == kPack) load_pack(p, v);
  else {
    static_assert(kWidth == 1, "a chunk is a pack or one element");
    v[0] = to_float(*p);
  }
}
template <int kWidth, typename T>
__device__ __forceinline__ void store_chunk(T* p, const float (&v)[kWidth]) {
  if constexpr (kWidth == kPack) store_pack(p, v);
  else {
    static_assert(kWidth == 1, "a chunk is a pack or one element");
    *p = from_float<T>(v[0]);
  }
}

// Grid-stride loop over [0, n): chunk(i, pack) for i = 0, kPack, ... over the whole packs when
// `vector`, then chunk(i, one) for each remaining element (all of them when not `vector`). pack
// and one are std::integral_constant-like tags carrying the width, so that a single generic
// lambda is the body of both loops.
template <int kWidth>
struct Width {
  static constexpr int value = kWidth;
};

template <typename Body>
__device__ __forceinline__ void for_each_chunk(int64_t n, bool vector, Body body) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if (vector) {
    const int64_t packs = n / kPack;
    for (int64_t p = first; p < packs; p += stride) body(p * kPack, Width<kPack>{});
    scalar_begin = packs * kPack;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride) body(i, Width<1>{});
}

// Blocks for for_each_chunk over n elements.
inline unsigned grid_for_chunks(int64_t n, bool vector, int threads) {
  return grid_for(vector ? n / kPack + n % kPack : n, threads);
}

}  // namespace memtune::cuda
