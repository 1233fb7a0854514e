#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "memtune/core/error.h"
#include "memtune/quant/codebook.h"

using namespace memtune;

namespace {

uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

float next_up(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }

}  // namespace

TEST(QuantCodebook, Nf4ValuesAreExact) {
  // SPECS.md section 1 / bitsandbytes kernels.cu nf4_dequantization_lut, as float32 bit patterns:
  // an independent spelling of codebook_shared.h's literals, so that a changed literal cannot hide.
  const uint32_t expected_bits[16] = {0xbf800000, 0xbf3239b1, 0xbf066b30, 0xbeca32a0,
                                      0xbe91a24d, 0xbe3d353f, 0xbdba7871, 0x00000000,
                                      0x3da2faff, 0x3e24cae3, 0x3e7c04dd, 0x3ead033a,
                                      0x3ee1a4b8, 0x3f1007ab, 0x3f3913b3, 0x3f800000};
  const auto& values = nf4_code_values();
  for (int i = 0; i < 16; ++i) EXPECT_EQ(bits_of(values[i]), expected_bits[i]) << i;
  for (int i = 1; i < 16; ++i) EXPECT_LT(values[i - 1], values[i]);
  const auto map = bnb_quant_map(true);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(bits_of(map[i]), bits_of(values[i]));
}

TEST(QuantCodebook, Fp4Values) {
  const auto& values = fp4_code_values();
  const float magnitudes[8] = {0.0f, 0.005208333333f, 0.66666667f, 1.0f,
                               0.33333333f, 0.5f, 0.16666667f, 0.25f};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(values[i], magnitudes[i]);
    EXPECT_EQ(values[i + 8], -magnitudes[i]);
  }
  EXPECT_TRUE(std::signbit(values[8]));  // the CUDA dequantizer's -0.0
  // bitsandbytes' stored quant_map: k / 12 in fp32, the same values, but +0.0 at index 8.
  const auto map = bnb_quant_map(false);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(map[i], values[i]) << i;
  EXPECT_FALSE(std::signbit(map[8]));
  EXPECT_EQ(bits_of(map[1]), bits_of(0.0625f / 12.0f));
  EXPECT_EQ(bits_of(map[2]), bits_of(8.0f / 12.0f));
}

TEST(QuantCodebook, Nf4TreeIsNearestWithLowerCodeOnMidpoints) {
  const auto& t = nf4_thresholds();
  const auto& v = nf4_code_values();
  for (int i = 0; i < 15; ++i) {
    // Each threshold is the midpoint of codes i and i+1 (to float precision).
    EXPECT_NEAR(t[i], 0.5 * (double(v[i]) + double(v[i + 1])), 1e-7) << i;
    EXPECT_EQ(nf4_quantize_scaled(t[i]), i) << "exactly on a midpoint: the lower code";
    EXPECT_EQ(nf4_quantize_scaled(next_up(t[i])), i + 1);
  }
  for (int code = 0; code < 16; ++code) EXPECT_EQ(nf4_quantize_scaled(v[code]), code);
  EXPECT_EQ(nf4_quantize_scaled(-0.0f), 7);
  EXPECT_EQ(nf4_quantize_scaled(1.5f), 15);
  EXPECT_EQ(nf4_quantize_scaled(-1.5f), 0);
  EXPECT_EQ(nf4_quantize_scaled(std::nanf("")), 0);  // every `>` is false
  // Brute force: the tree picks a nearest code everywhere on a fine grid.
  for (int k = -100000; k <= 100000; ++k) {
    const float x = static_cast<float>(k) / 100000.0f;
    const uint8_t code = nf4_quantize_scaled(x);
    for (int other = 0; other < 16; ++other)
      ASSERT_LE(std::fabs(x - v[code]), std::fabs(x - v[other]) + 1e-7f) << x;
  }
}

TEST(QuantCodebook, Fp4TreeSignAndTies) {
  const auto& t = fp4_magnitude_thresholds();
  const auto& v = fp4_code_values();
  for (float threshold : t) {
    const uint8_t at = fp4_quantize_scaled(threshold);
    const uint8_t above = fp4_quantize_scaled(next_up(threshold));
    EXPECT_LT(v[at], v[above]) << threshold;
    EXPECT_EQ(fp4_quantize_scaled(-threshold), at | 8);
  }
  EXPECT_EQ(fp4_quantize_scaled(0.0f), 0);
  EXPECT_EQ(fp4_quantize_scaled(-0.0f), 0);       // x < 0 is false for -0.0
  EXPECT_EQ(fp4_quantize_scaled(-1e-6f), 8);      // tiny negatives are -0 (code 8)
  EXPECT_EQ(fp4_quantize_scaled(1.0f), 0b0011);
  EXPECT_EQ(fp4_quantize_scaled(-1.0f), 0b1011);
  EXPECT_EQ(fp4_quantize_scaled(0.5f), 0b0101);
  EXPECT_EQ(fp4_quantize_scaled(std::nanf("")), 0);
  // The kernel's literal 0.583333f sits a little below the true midpoint of 1/2 and 2/3.
  EXPECT_EQ(fp4_quantize_scaled(0.5833332f), 0b0010);
  for (int k = 0; k <= 100000; ++k) {
    const float x = static_cast<float>(k) / 100000.0f;
    const uint8_t code = fp4_quantize_scaled(x);
    for (int other = 0; other < 8; ++other)
      ASSERT_LE(std::fabs(x - v[code]), std::fabs(x - v[other]) + 5e-7f) << x;
  }
}

TEST(QuantCodebook, DynamicMapSpotValues) {
  const std::vector<float>& map = signed_dynamic_map();
  ASSERT_EQ(map.size(), 256u);
  EXPECT_EQ(map[127], 0.0f);
  EXPECT_EQ(map[255], 1.0f);
  // Values printed by bitsandbytes 0.50.2 / torch (float32, shown as Python floats).
  EXPECT_EQ(map[0], -0.992968738079071f);
  EXPECT_EQ(map[1], -0.9789062738418579f);
  EXPECT_EQ(map[126], -5.500000384017767e-07f);
  EXPECT_EQ(map[128], 5.500000384017767e-07f);
  EXPECT_EQ(map[129], 3.250000190746505e-06f);
  EXPECT_EQ(map[254], 0.992968738079071f);
  for (int i = 1; i < 256; ++i) EXPECT_LT(map[i - 1], map[i]) << i;
  for (int i = 0; i < 255; ++i)
    if (i != 127) EXPECT_EQ(map[i], -map[254 - i]) << "symmetric except 0 and 1.0";
}

TEST(QuantCodebook, DynamicMapOtherArguments) {
  const std::vector<float> unsigned_map = create_dynamic_map(false, 7, 8);
  ASSERT_EQ(unsigned_map.size(), 256u);
  EXPECT_EQ(unsigned_map[0], 0.0f);
  EXPECT_EQ(unsigned_map[255], 1.0f);
  for (int i = 1; i < 256; ++i) EXPECT_LT(unsigned_map[i - 1], unsigned_map[i]);
  const std::vector<float> five_bits = create_dynamic_map(true, 3, 5);  // padded with zeros
  ASSERT_EQ(five_bits.size(), 256u);
  EXPECT_TRUE(std::is_sorted(five_bits.begin(), five_bits.end()));
  EXPECT_THROW(create_dynamic_map(false, 4, 8), Error);  // bitsandbytes' assert fails too
  EXPECT_THROW(create_dynamic_map(true, 0, 8), Error);
  EXPECT_THROW(create_dynamic_map(true, 7, 9), Error);
}

TEST(QuantCodebook, DynamicQuantizeNearestAndTies) {
  const std::vector<float>& map = signed_dynamic_map();
  for (int i = 0; i < 256; ++i) EXPECT_EQ(dynamic_quantize_scaled(map.data(), map[i]), i) << i;
  EXPECT_EQ(dynamic_quantize_scaled(map.data(), -1.0f), 0);
  EXPECT_EQ(dynamic_quantize_scaled(map.data(), 1.5f), 255);
  EXPECT_EQ(dynamic_quantize_scaled(map.data(), std::nanf("")), 0);
  // The result is a nearest code, up to the rounding of the fp32 midpoint (about 1e-7 here).
  for (int k = -20000; k <= 20000; ++k) {
    const float x = static_cast<float>(k) / 20000.0f;
    const uint8_t code = dynamic_quantize_scaled(map.data(), x);
    const float best = std::fabs(x - map[code]);
    for (int other = 0; other < 256; ++other)
      ASSERT_LE(best, std::fabs(x - map[other]) + 1.2e-7f) << x;
  }
  // Exactly on an fp32 midpoint (a + b) * 0.5f the kernel keeps its final pivot; one ulp past
  // it takes the neighbour. Checked against the real kernel in test_bnb_fixtures.cpp.
  int ties = 0;
  for (int i = 0; i + 1 < 256; ++i) {
    const float mid = (map[i] + map[i + 1]) * 0.5f;
    if (mid == map[i] || mid == map[i + 1]) continue;
    const uint8_t at = dynamic_quantize_scaled(map.data(), mid);
    EXPECT_TRUE(at == i || at == i + 1) << i;
    EXPECT_EQ(dynamic_quantize_scaled(map.data(), std::nextafter(mid, -2.0f)), i) << i;
    EXPECT_EQ(dynamic_quantize_scaled(map.data(), std::nextafter(mid, 2.0f)), i + 1) << i;
    ++ties;
  }
  EXPECT_GT(ties, 250);
}
