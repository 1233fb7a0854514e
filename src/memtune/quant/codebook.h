// 4-bit and 8-bit code tables of bitsandbytes, and the scalar "nearest code" rules of its CUDA
// kernels. Everything here is a fact of bitsandbytes (0.50.x) and cites where it was read:
//   csrc/kernels.cu (and csrc/cuda/blockwise_quantization.cu): nf4_dequantization_lut,
//     fp4_dequantization_lut, dQuantizeNF4, dQuantizeFP4, dQuantize<0>
//   bitsandbytes/functional.py: get_4bit_type, create_dynamic_map
// The values are written here by hand from those facts; no code was copied.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace memtune {

// NF4 value of each 4-bit code (index = code). Exact float32 values: the literals of
// kernels.cu nf4_dequantization_lut, which equal functional.get_4bit_type("nf4") rounded to fp32.
const std::array<float, 16>& nf4_code_values();

// FP4 value of each 4-bit code as the CUDA dequantizer produces it: bit 3 is the sign,
// kernels.cu fp4_dequantization_lut[code & 7] * (1 - 2 * (code >> 3)). Code 8 is -0.0.
const std::array<float, 16>& fp4_code_values();

// The 16-float `quant_map` that bitsandbytes stores next to a 4-bit weight:
// functional.get_4bit_type(type), i.e. the nf4 list above, or for fp4
// [0, 0.0625, 8, 12, 4, 6, 2, 3, 0, -0.0625, -8, -12, -4, -6, -2, -3] / 12 in fp32. Note that its
// index 8 is +0.0 (Python's `-0` is the integer 0), where the CUDA dequantizer gives -0.0.
std::array<float, 16> bnb_quant_map(bool is_nf4);

// Nearest NF4 code of a value already scaled into [-1, 1]: the decision tree of kernels.cu
// dQuantizeNF4. Each comparison is a strict `x > threshold` against a float literal midpoint, so
// a value exactly on a midpoint takes the lower code, and NaN falls through to code 0.
uint8_t nf4_quantize_scaled(float x);

// Nearest FP4 code of a scaled value: kernels.cu dQuantizeFP4 (sign bit from `x < 0`, so -0.0
// gives code 0; magnitude through a tree of strict `>` against float literals).
uint8_t fp4_quantize_scaled(float x);

// The decision thresholds of the two trees, ascending (15 each), for tests and error bounds.
const std::array<float, 15>& nf4_thresholds();
const std::array<float, 7>& fp4_magnitude_thresholds();

// bitsandbytes functional.create_dynamic_map(signed, max_exponent_bits, total_bits): 256 sorted
// float32 values. Reproduces the torch float32 arithmetic of that function: torch.linspace(0.1, 1,
// k) in fp32 (each element one fused multiply-add, start + step*i in the first half and
// end - step*(k-1-i) in the second, as torch's vectorized CPU kernel computes it), the means of
// neighbours in fp32, times fp32(10^(i - max_exponent_bits + 1)). Throws memtune::Error for
// arguments that bitsandbytes itself rejects (its list must hold exactly 2^total_bits values).
std::vector<float> create_dynamic_map(bool is_signed = true, int max_exponent_bits = 7,
                                      int total_bits = 8);

// create_dynamic_map(true, 7, 8), built once. Index 127 is 0, index 255 is 1.0.
const std::vector<float>& signed_dynamic_map();

// Index of the nearest of 256 sorted codes: kernels.cu dQuantize<STOCHASTIC=0>. A binary search
// from pivot 127 with steps 64..1 that tracks the last codes below and above, then a midpoint
// comparison in fp32 ((a + b) * 0.5f): strictly past the midpoint takes the outer code, exactly on
// it takes the final pivot.
uint8_t dynamic_quantize_scaled(const float* code256, float x);

}  // namespace memtune
