#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "memtune/core/bytes.h"
#include "memtune/core/dtype.h"
#include "memtune/core/error.h"

using namespace memtune;

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16_bits(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to even (1.0).
  EXPECT_EQ(f32_to_bf16_bits(1.00390625f), 0x3f80);
  EXPECT_EQ(f32_to_bf16_bits(1.01171875f), 0x3f82);  // 1 + 3*2^-8 -> rounds up to even
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(std::nanf("")))));
}

TEST(DType, F16MatchesIeeeOnEdges) {
  EXPECT_EQ(f32_to_f16_bits(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16_bits(65520.0f), 0x7c00);  // rounds to inf
  EXPECT_EQ(f32_to_f16_bits(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16_bits(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16_bits(2.9802322387695312e-08f), 0x0000);  // half of it: tie to even 0
  EXPECT_EQ(f16_bits_to_f32(0x0001), 5.960464477539063e-08f);
  EXPECT_EQ(f16_bits_to_f32(0x7c00), std::numeric_limits<float>::infinity());
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float value = f16_bits_to_f32(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    ASSERT_EQ(f32_to_f16_bits(value), bits) << bits;
  }
}

TEST(Bytes, ParseAndFormat) {
  EXPECT_EQ(parse_bytes("24GiB"), 24ull * kGiB);
  EXPECT_EQ(parse_bytes("24 gib"), 24ull * kGiB);
  EXPECT_EQ(parse_bytes("8GB"), 8000000000ull);
  EXPECT_EQ(parse_bytes("1.5MiB"), 1572864ull);
  EXPECT_EQ(parse_bytes("1234"), 1234ull);
  EXPECT_THROW(parse_bytes("lots"), memtune::Error);
  EXPECT_THROW(parse_bytes("24 parsecs"), memtune::Error);
  EXPECT_EQ(format_bytes(1536ull * kMiB), "1.50 GiB");
}
