// The 4-bit code tables of bitsandbytes and its nearest-code rules, written once for the host
// (quant/codebook.cpp, the CPU reference) and the device (ops/cuda/quant4bit.cu). Both sides
// compile these very functions and read these very floats, which is what keeps the CUDA kernels
// bit-identical to the reference. The facts and their sources are in codebook.h.
// (Plain C++17: nvcc compiles this header too.)
#pragma once

#include <cmath>
#include <cstdint>

// Inlined into the kernels as their own __forceinline__ helpers were.
#if defined(__CUDACC__)
#define MEMTUNE_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#else
#define MEMTUNE_HOST_DEVICE_INLINE inline
#endif
// `#pragma unroll` for nvcc's device pass only: the host compiler does not know the pragma.
#if defined(__CUDA_ARCH__)
#define MEMTUNE_UNROLL _Pragma("unroll")
#else
#define MEMTUNE_UNROLL
#endif

namespace memtune::codebook {

// bitsandbytes csrc/kernels.cu nf4_dequantization_lut (the same numbers as the Python list in
// functional.get_4bit_type("nf4")).
inline constexpr float kNf4Values[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// bitsandbytes csrc/kernels.cu fp4_dequantization_lut: the magnitude of codes 0b000..0b111.
inline constexpr float kFp4Magnitudes[8] = {
    0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f,
};

// The float literals of kernels.cu dQuantizeNF4, sorted. The kernel's tree is a balanced search
// over these 15 values with strict `x > t` at every node, so its result is the number of
// thresholds that x exceeds.
inline constexpr float kNf4Thresholds[15] = {
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f,  0.2035212516784668f,  0.2920137718319893f,  0.3893125355243683f,
    0.5016634166240692f,  0.6427869200706482f,  0.8614784181118011f,
};

// The float literals of kernels.cu dQuantizeFP4 (applied to |x|), sorted. Note 0.583333f, which is
// about 3e-7 below the true midpoint of 0.5 and 2/3.
inline constexpr float kFp4Thresholds[7] = {
    0.00260417f, 0.0859375f, 0.20833333f, 0.29166667f, 0.4166667f, 0.583333f, 0.8333333f,
};

// Magnitude code for "exceeds k thresholds": the codes sorted by their value
// (0, 0.0052, 1/6, 1/4, 1/3, 1/2, 2/3, 1).
inline constexpr uint8_t kFp4CodeByRank[8] = {0b000, 0b001, 0b110, 0b111,
                                              0b100, 0b101, 0b010, 0b011};

// kFp4CodeByRank packed 4 bits a rank (rank r in bits [4r, 4r + 4)): one scalar, which a kernel
// takes as an argument where it could not index a host array.
constexpr uint32_t pack_fp4_code_by_rank() {
  uint32_t packed = 0;
  for (int rank = 0; rank < 8; ++rank) packed |= uint32_t{kFp4CodeByRank[rank]} << (4 * rank);
  return packed;
}
inline constexpr uint32_t kFp4CodeByRankPacked = pack_fp4_code_by_rank();

// FP4 value of a code as the CUDA dequantizer produces it (kernels.cu dDequantizeFP4Tree):
// sign = 1 - 2 * bit3; value = lut[code & 7] * sign. Code 8 is -0.0. Host only: the kernels
// take the values as arguments (Quant4bitTables).
constexpr float fp4_value(int code) {
  const float sign = 1.0f - 2.0f * static_cast<float>((code & 0b1000) >> 3);
  return kFp4Magnitudes[code & 0b111] * sign;
}

MEMTUNE_HOST_DEVICE_INLINE float absolute(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return std::fabs(x);
#endif
}

// Nearest NF4 code of a value already scaled into [-1, 1] (kernels.cu dQuantizeNF4): the number
// of thresholds that x strictly exceeds, so a value exactly on a midpoint takes the lower code,
// and NaN falls through to code 0. `thresholds` is kNf4Thresholds (a kernel gets a copy of it in
// its arguments).
MEMTUNE_HOST_DEVICE_INLINE uint32_t nf4_code(const float (&thresholds)[15], float x) {
  uint32_t code = 0;
MEMTUNE_UNROLL
  for (int k = 0; k < 15; ++k) code += x > thresholds[k] ? 1u : 0u;
  return code;
}

// Nearest FP4 code of a scaled value (kernels.cu dQuantizeFP4): sign bit from `x < 0`, so -0.0
// gives code 0; the magnitude's rank among kFp4Thresholds (strict `>`) picks its code from
// kFp4CodeByRankPacked.
MEMTUNE_HOST_DEVICE_INLINE uint32_t fp4_code(const float (&magnitude_thresholds)[7],
                                             uint32_t code_by_rank_packed, float x) {
  const uint32_t sign = x < 0.0f ? 0b1000u : 0u;
  const float magnitude = absolute(x);
  uint32_t rank = 0;
MEMTUNE_UNROLL
  for (int k = 0; k < 7; ++k) rank += magnitude > magnitude_thresholds[k] ? 1u : 0u;
  return ((code_by_rank_packed >> (4 * rank)) & 0xfu) + sign;
}

// (a + b) * 0.5f rounded as fp32 at each step on both sides: nvcc may not fuse or reorder it.
MEMTUNE_HOST_DEVICE_INLINE float fp32_midpoint(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(__fadd_rn(a, b), 0.5f);
#else
  return (a + b) * 0.5f;
#endif
}

// Index of the nearest of 256 sorted codes (kernels.cu dQuantize<STOCHASTIC=0>): a binary search
// from pivot 127 with steps 64..1 that tracks the last codes visited below and above x (the bounds
// start as -1 and 1 and become the real end codes when the search never left them), then the fp32
// midpoint decides: strictly past it takes the outer code, exactly on it the final pivot.
MEMTUNE_HOST_DEVICE_INLINE uint8_t dynamic_code(const float* code, float x) {
  int pivot = 127;
  int above = 255;
  int below = 0;
  float above_value = 1.0f;
  float below_value = -1.0f;
  float pivot_value = code[pivot];
  for (int stride = 64; stride > 0; stride /= 2) {
    if (x > pivot_value) {
      below = pivot;
      below_value = pivot_value;
      pivot += stride;
    } else {
      above = pivot;
      above_value = pivot_value;
      pivot -= stride;
    }
    pivot_value = code[pivot];
  }
  if (above == 255) above_value = code[255];
  if (below == 0) below_value = code[0];
  if (x > pivot_value) {
    const float midpoint = fp32_midpoint(above_value, pivot_value);
    return static_cast<uint8_t>(x > midpoint ? above : pivot);
  }
  const float midpoint = fp32_midpoint(below_value, pivot_value);
  return static_cast<uint8_t>(x < midpoint ? below : pivot);
}

}  // namespace memtune::codebook
