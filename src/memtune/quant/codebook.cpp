#include "memtune/quant/codebook.h"

#include <algorithm>
#include <cmath>

#include "memtune/core/error.h"

namespace memtune {

namespace {

// bitsandbytes csrc/kernels.cu nf4_dequantization_lut (the same numbers as the Python list in
// functional.get_4bit_type("nf4")).
constexpr std::array<float, 16> kNf4Values = {
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
constexpr std::array<float, 8> kFp4Magnitudes = {
    0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f,
};

// The float literals of kernels.cu dQuantizeNF4, sorted. The kernel's tree is a balanced search
// over these 15 values with strict `x > t` at every node, so its result is the number of
// thresholds that x exceeds.
constexpr std::array<float, 15> kNf4Thresholds = {
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f,  0.2035212516784668f,  0.2920137718319893f,  0.3893125355243683f,
    0.5016634166240692f,  0.6427869200706482f,  0.8614784181118011f,
};

// The float literals of kernels.cu dQuantizeFP4 (applied to |x|), sorted. Note 0.583333f, which is
// about 3e-7 below the true midpoint of 0.5 and 2/3.
constexpr std::array<float, 7> kFp4Thresholds = {
    0.00260417f, 0.0859375f, 0.20833333f, 0.29166667f, 0.4166667f, 0.583333f, 0.8333333f,
};
// Magnitude code for "exceeds k thresholds": the codes sorted by their value
// (0, 0.0052, 1/6, 1/4, 1/3, 1/2, 2/3, 1).
constexpr std::array<uint8_t, 8> kFp4CodeByRank = {0b000, 0b001, 0b110, 0b111,
                                                   0b100, 0b101, 0b010, 0b011};

std::array<float, 16> make_fp4_values() {
  std::array<float, 16> values{};
  for (int code = 0; code < 16; ++code) {
    // kernels.cu dDequantizeFP4Tree: sign = 1 - 2 * bit3; value = lut[code & 7] * sign.
    const float sign = 1.0f - 2.0f * static_cast<float>((code & 0b1000) >> 3);
    values[code] = kFp4Magnitudes[code & 0b111] * sign;
  }
  return values;
}

// One element of torch.linspace(start, end, steps) in float32 on the CPU. torch's kernel
// (aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp) computes step = (end - start) / (steps - 1)
// in float, then start + step * i for the first half and end - step * (steps - 1 - i) for the
// second; the vectorized build contracts each into one fused multiply-add, which is what the
// values bitsandbytes gets from create_dynamic_map show (checked against torch 2.15 on AVX-512).
float torch_linspace_element(float start, float end, int64_t steps, int64_t index) {
  if (steps == 1) return start;
  const float step = (end - start) / static_cast<float>(steps - 1);
  if (index < steps / 2) return std::fma(step, static_cast<float>(index), start);
  return std::fma(-step, static_cast<float>(steps - 1 - index), end);
}

// Appends 10^exponent * means(linspace(0.1, 1, points)) (and its negation when signed), as
// create_dynamic_map does with fp32 torch tensors and a Python scalar converted to fp32.
void append_fraction_means(std::vector<float>& data, int64_t points, int exponent,
                           bool is_signed) {
  const float scale = static_cast<float>(std::pow(10.0, exponent));
  std::vector<float> boundaries(static_cast<size_t>(points));
  for (int64_t k = 0; k < points; ++k)
    boundaries[k] = torch_linspace_element(0.1f, 1.0f, points, k);
  std::vector<float> means;
  for (int64_t k = 0; k + 1 < points; ++k) {
    const float sum = boundaries[k] + boundaries[k + 1];
    means.push_back(sum / 2.0f);
  }
  for (float mean : means) data.push_back(scale * mean);
  if (is_signed)
    for (float mean : means) data.push_back(-scale * mean);
}

}  // namespace

const std::array<float, 16>& nf4_code_values() { return kNf4Values; }

const std::array<float, 16>& fp4_code_values() {
  static const std::array<float, 16> values = make_fp4_values();
  return values;
}

std::array<float, 16> bnb_quant_map(bool is_nf4) {
  if (is_nf4) return kNf4Values;
  // functional.get_4bit_type("fp4"): the list below as a float32 tensor, then data.div_(max|data|)
  // with max|data| = 12, i.e. an fp32 division.
  constexpr std::array<float, 16> unscaled = {0.0f,  0.0625f,  8.0f,  12.0f,  4.0f,  6.0f,
                                              2.0f,  3.0f,     0.0f,  -0.0625f, -8.0f, -12.0f,
                                              -4.0f, -6.0f,    -2.0f, -3.0f};
  std::array<float, 16> values{};
  for (int i = 0; i < 16; ++i) values[i] = unscaled[i] / 12.0f;
  return values;
}

uint8_t nf4_quantize_scaled(float x) {
  uint8_t code = 0;
  for (float threshold : kNf4Thresholds) code += (x > threshold) ? 1 : 0;
  return code;
}

uint8_t fp4_quantize_scaled(float x) {
  const uint8_t sign = x < 0.0f ? 0b1000 : 0;
  const float magnitude = std::fabs(x);
  int rank = 0;
  for (float threshold : kFp4Thresholds) rank += (magnitude > threshold) ? 1 : 0;
  return static_cast<uint8_t>(kFp4CodeByRank[rank] + sign);
}

const std::array<float, 15>& nf4_thresholds() { return kNf4Thresholds; }
const std::array<float, 7>& fp4_magnitude_thresholds() { return kFp4Thresholds; }

std::vector<float> create_dynamic_map(bool is_signed, int max_exponent_bits, int total_bits) {
  MT_USER_CHECK(total_bits >= 2 && total_bits <= 8,
                "create_dynamic_map: total_bits must be in 2..8, got {}", total_bits);
  const int non_sign_bits = total_bits - 1;  // functional.py: total_bits - (1 if signed else 1)
  MT_USER_CHECK(max_exponent_bits >= 1 && max_exponent_bits <= non_sign_bits,
                "create_dynamic_map: max_exponent_bits must be in 1..{}, got {}", non_sign_bits,
                max_exponent_bits);
  const int64_t additional_items = (int64_t{1} << (non_sign_bits - max_exponent_bits)) - 1;
  std::vector<float> data;
  for (int i = 0; i < max_exponent_bits; ++i) {
    const int64_t fraction_items =
        is_signed ? (int64_t{1} << (i + non_sign_bits - max_exponent_bits)) + 1
                  : (int64_t{1} << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    append_fraction_means(data, fraction_items, -(max_exponent_bits - 1) + i, is_signed);
  }
  if (additional_items > 0) {
    // functional.py reuses the loop variable, whose last value is max_exponent_bits - 1.
    append_fraction_means(data, additional_items + 1, 0, is_signed);
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  MT_USER_CHECK(data.size() == (size_t{1} << total_bits),
                "create_dynamic_map(signed={}, max_exponent_bits={}, total_bits={}) makes {} "
                "values, not {} (bitsandbytes rejects these arguments too)",
                is_signed, max_exponent_bits, total_bits, data.size(), size_t{1} << total_bits);
  data.resize(256, 0.0f);
  std::sort(data.begin(), data.end());
  return data;
}

const std::vector<float>& signed_dynamic_map() {
  static const std::vector<float> map = create_dynamic_map(true, 7, 8);
  return map;
}

uint8_t dynamic_quantize_scaled(const float* code, float x) {
  // Bracketing search: `below`/`above` are the last visited codes under and over x, and their
  // values; the bounds start as -1 and 1 and are replaced by the real end codes when the search
  // never left them.
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
    const float midpoint = (above_value + pivot_value) * 0.5f;
    return static_cast<uint8_t>(x > midpoint ? above : pivot);
  }
  const float midpoint = (below_value + pivot_value) * 0.5f;
  return static_cast<uint8_t>(x < midpoint ? below : pivot);
}

}  // namespace memtune
