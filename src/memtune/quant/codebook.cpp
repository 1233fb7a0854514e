#include "memtune/quant/codebook.h"

#include <algorithm>
#include <cmath>

#include "memtune/core/error.h"
#include "memtune/quant/codebook_shared.h"

namespace memtune {

namespace {

// The tables and the nearest-code rules are in codebook_shared.h, which the CUDA kernels compile
// too; here they take the std::array shapes of codebook.h.
template <size_t N>
constexpr std::array<float, N> to_array(const float (&values)[N]) {
  std::array<float, N> out{};
  for (size_t i = 0; i < N; ++i) out[i] = values[i];
  return out;
}

constexpr std::array<float, 16> kNf4Values = to_array(codebook::kNf4Values);
constexpr std::array<float, 15> kNf4Thresholds = to_array(codebook::kNf4Thresholds);
constexpr std::array<float, 7> kFp4Thresholds = to_array(codebook::kFp4Thresholds);

std::array<float, 16> make_fp4_values() {
  std::array<float, 16> values{};
  for (int code = 0; code < 16; ++code) values[code] = codebook::fp4_value(code);
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
  return static_cast<uint8_t>(codebook::nf4_code(codebook::kNf4Thresholds, x));
}

uint8_t fp4_quantize_scaled(float x) {
  return static_cast<uint8_t>(
      codebook::fp4_code(codebook::kFp4Thresholds, codebook::kFp4CodeByRankPacked, x));
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

uint8_t dynamic_quantize_scaled(const float* code, float x) { return codebook::dynamic_code(code, x); }

}  // namespace memtune
