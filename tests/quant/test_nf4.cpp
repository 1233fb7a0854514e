#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "memtune/core/error.h"
#include "memtune/quant/codebook.h"
#include "memtune/quant/nf4.h"
#include "quant_test_util.h"

using namespace memtune;

namespace {

using quanttest::error_of;

QuantConfig make_config(QuantType type, int64_t blocksize, bool double_quant) {
  QuantConfig config;
  config.type = type;
  config.blocksize = blocksize;
  config.double_quant = double_quant;
  return config;
}

std::vector<float> dequantize_f32(const QuantizedWeight& weight) {
  std::vector<float> out(static_cast<size_t>(weight.numel()));
  dequantize_4bit(weight, out.data(), DType::f32);
  return out;
}

QuantizedWeight quantize_f32(const std::vector<float>& values, Shape shape, const QuantConfig& c) {
  return quantize_4bit(values.data(), DType::f32, shape, c, "test.weight");
}

double largest_gap(const std::vector<float>& sorted) {
  double gap = 0;
  for (size_t i = 1; i < sorted.size(); ++i) gap = std::max(gap, double(sorted[i]) - sorted[i - 1]);
  return gap;
}

}  // namespace

TEST(QuantNf4, NibbleOrderElementTwoJIsHigh) {
  const QuantConfig config = make_config(QuantType::nf4, 64, false);
  std::vector<float> values = {-1.0f, 1.0f, 1.0f, -1.0f, 0.0f, 0.5f};
  const QuantizedWeight w = quantize_f32(values, Shape{6}, config);
  ASSERT_EQ(w.packed.size(), 3u);
  EXPECT_EQ(w.packed[0], 0x0F);  // element 0 (code 0) high, element 1 (code 15) low
  EXPECT_EQ(w.packed[1], 0xF0);
  EXPECT_EQ(w.packed[2], 0x7C);  // 0 -> 7; 0.5 < 0.5017 -> code 12 (0.4407)
  EXPECT_EQ(w.code_at(5), 12);
  const auto out = dequantize_f32(w);
  EXPECT_EQ(out[0], -1.0f);
  EXPECT_EQ(out[1], 1.0f);
  EXPECT_EQ(out[5], nf4_code_values()[12]);
}

TEST(QuantNf4, OddCountsAndPartialBlocks) {
  for (QuantType type : {QuantType::nf4, QuantType::fp4}) {
    const QuantConfig config = make_config(type, 32, false);
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 0.05f);
    std::vector<float> values(35);
    for (float& v : values) v = normal(rng);
    const QuantizedWeight w = quantize_f32(values, Shape{5, 7}, config);
    EXPECT_EQ(w.packed.size(), 18u);
    EXPECT_EQ(w.absmax.size(), 2u);
    float tail_max = 0;
    for (int i = 32; i < 35; ++i) tail_max = std::max(tail_max, std::fabs(values[i]));
    EXPECT_EQ(w.absmax[1], tail_max);
    // The pad nibble encodes a loaded 0.0: NF4 code 7, FP4 code 0.
    EXPECT_EQ(w.packed[17] & 0x0f, type == QuantType::nf4 ? 7 : 0);
    const auto out = dequantize_f32(w);
    ASSERT_EQ(out.size(), 35u);
    for (int i = 0; i < 35; ++i) EXPECT_LE(std::fabs(out[i] - values[i]), 0.2f * w.absmax[i / 32]);
  }
  const QuantizedWeight one =
      quantize_f32({0.3f}, Shape{1}, make_config(QuantType::nf4, 64, true));
  ASSERT_EQ(one.packed.size(), 1u);
  EXPECT_EQ(one.packed[0], 0xF7);
  EXPECT_EQ(dequantize_f32(one)[0], 0.3f);  // single block: offset = absmax, centered 0
}

TEST(QuantNf4, AllZeroBlocksFollowTheKernel) {
  // absmax 0 -> reciprocal +inf -> 0 * inf = NaN -> code 0 (NF4 -1.0), dequantized to -0.0.
  std::vector<float> values(128, 0.0f);
  for (int i = 64; i < 128; ++i) values[i] = 0.01f * static_cast<float>(i - 90);
  for (bool dq : {false, true}) {
    const QuantizedWeight w = quantize_f32(values, Shape{2, 64}, make_config(QuantType::nf4, 64, dq));
    for (int i = 0; i < 32; ++i) EXPECT_EQ(w.packed[i], 0x00) << i;
    const auto out = dequantize_f32(w);
    if (!dq) {
      for (int i = 0; i < 64; ++i) EXPECT_EQ(out[i], 0.0f) << i;  // -1 * 0 = -0.0
    } else {
      // Under double quant the zero block's absmax comes back as code8 * nested + offset, which
      // is not 0, so its elements come back as -absmax' (bitsandbytes does the same).
      EXPECT_GT(w.block_absmax(0), 0.0f);
      for (int i = 0; i < 64; ++i) EXPECT_EQ(out[i], -w.block_absmax(0)) << i;
    }
  }
  std::vector<float> zeros(64, 0.0f);
  const QuantizedWeight fp4 = quantize_f32(zeros, Shape{64}, make_config(QuantType::fp4, 64, false));
  for (uint8_t byte : fp4.packed) EXPECT_EQ(byte, 0x00);
  const QuantizedWeight nf4dq = quantize_f32(zeros, Shape{64}, make_config(QuantType::nf4, 64, true));
  EXPECT_EQ(nf4dq.nested_absmax[0], 0.0f);
  EXPECT_EQ(nf4dq.absmax_codes[0], 0);  // NaN through the 8-bit search as well
  EXPECT_EQ(nf4dq.block_absmax(0), 0.0f);
}

TEST(QuantNf4, ConstantBlocksAreExact) {
  for (QuantType type : {QuantType::nf4, QuantType::fp4}) {
    for (float c : {0.37f, -0.37f, 1e-3f, -250.0f}) {
      std::vector<float> values(64, c);
      const QuantizedWeight w = quantize_f32(values, Shape{64}, make_config(type, 64, false));
      const auto out = dequantize_f32(w);
      for (float v : out) EXPECT_EQ(v, c) << quant_type_name(type);
    }
  }
}

TEST(QuantNf4, HugeOutlierFlattensTheRest) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> values(64);
  for (float& v : values) v = normal(rng);
  values[9] = 1e30f;
  const QuantizedWeight w = quantize_f32(values, Shape{64}, make_config(QuantType::nf4, 64, false));
  EXPECT_EQ(w.absmax[0], 1e30f);
  const auto out = dequantize_f32(w);
  for (int i = 0; i < 64; ++i) {
    if (i == 9) {
      EXPECT_EQ(out[i], 1e30f);
    } else {
      EXPECT_EQ(w.code_at(i), 7);
      EXPECT_EQ(out[i], 0.0f);
    }
  }
}

TEST(QuantNf4, SubnormalsAreFlushedLikeFastMath) {
  // All fp32 subnormals: absmax 0 under --use_fast_math, so the block behaves as all-zero.
  std::vector<float> values(64);
  for (int i = 0; i < 64; ++i) values[i] = (i % 2 ? -1.0f : 1.0f) * 1e-40f * static_cast<float>(i + 1);
  ASSERT_EQ(std::fpclassify(values[10]), FP_SUBNORMAL);
  const QuantizedWeight w = quantize_f32(values, Shape{64}, make_config(QuantType::nf4, 64, false));
  EXPECT_EQ(w.absmax[0], 0.0f);
  for (uint8_t byte : w.packed) EXPECT_EQ(byte, 0x00);
  for (float v : dequantize_f32(w)) EXPECT_EQ(v, 0.0f);
  // With a tiny normal value in the block, the subnormals count as zero (NF4 code 7, FP4 code 0)
  // rather than as 1e-39 / 2e-38 = 0.05 of the absmax.
  values[0] = 2e-38f;
  const QuantizedWeight mixed =
      quantize_f32(values, Shape{64}, make_config(QuantType::nf4, 64, false));
  EXPECT_EQ(mixed.absmax[0], 2e-38f);
  EXPECT_EQ(mixed.code_at(0), 15);
  for (int i = 1; i < 64; ++i) EXPECT_EQ(mixed.code_at(i), 7) << i;
  const QuantizedWeight mixed_fp4 =
      quantize_f32(values, Shape{64}, make_config(QuantType::fp4, 64, false));
  for (int i = 1; i < 64; ++i) EXPECT_EQ(mixed_fp4.code_at(i), 0) << i;
  // bf16 subnormals reach the same path.
  std::vector<uint16_t> bf16(64, 0x0001);  // smallest positive bf16 subnormal
  const QuantizedWeight wb = quantize_4bit(bf16.data(), DType::bf16, Shape{64},
                                           make_config(QuantType::nf4, 64, false), "bf16");
  EXPECT_EQ(wb.absmax[0], 0.0f);
}

TEST(QuantNf4, NegativeZeroIsZero) {
  std::vector<float> values(64);
  for (int i = 0; i < 64; ++i) values[i] = i % 2 ? -0.0f : 0.0f;
  values[63] = 1.0f;
  const QuantizedWeight nf4 = quantize_f32(values, Shape{64}, make_config(QuantType::nf4, 64, false));
  const QuantizedWeight fp4 = quantize_f32(values, Shape{64}, make_config(QuantType::fp4, 64, false));
  for (int i = 0; i < 63; ++i) {
    EXPECT_EQ(nf4.code_at(i), 7);
    EXPECT_EQ(fp4.code_at(i), 0);  // `x < 0` is false for -0.0
  }
  const auto out = dequantize_f32(nf4);
  for (int i = 0; i < 63; ++i) EXPECT_EQ(out[i], 0.0f);
  EXPECT_EQ(out[63], 1.0f);
}

// Bound on |x - dequantize(quantize(x))| for one element of a block with absmax A (u = 2^-24):
//  - scaled s = x * fl(1/A) = (x / A)(1 + d), |d| <= 2u (reciprocal and product roundings);
//  - the tree picks a code value v with |s - v| <= g/2 + tau, where g is the largest gap between
//    neighbouring code values and tau the largest distance of a threshold literal from the true
//    midpoint (0.583333f for FP4 is 3.3e-7 off);
//  - so |x - v*A| <= A * (g/2 + tau + 2u), and the product v*A rounds once more (u*A).
// With double quant the stored absmax A' differs from A: the centered value A - offset (rounded,
// u*|A - offset|) is scaled by fl(1/N) for the nested absmax N and snapped to the dynamic map,
// |(A - offset)/N - m| <= g8/2 + 2u, then A' = fl(fl(m*N) + offset) adds u*(N + |A'|). Since
// |v| <= 1, |v*A' - v*A| <= |A' - A| <= N*(g8/2 + 2u) + u*(|A - offset| + N + |A'|).
TEST(QuantNf4, ErrorBoundOnRandomBlocks) {
  const double u = std::ldexp(1.0, -24);
  std::vector<float> nf4_sorted(nf4_code_values().begin(), nf4_code_values().end());
  std::vector<float> fp4_sorted(fp4_code_values().begin(), fp4_code_values().end());
  std::sort(fp4_sorted.begin(), fp4_sorted.end());
  const double g8 = largest_gap(signed_dynamic_map());
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-3.0f, 3.0f);
  int64_t checked = 0;
  for (QuantType type : {QuantType::nf4, QuantType::fp4}) {
    const double g = largest_gap(type == QuantType::nf4 ? nf4_sorted : fp4_sorted);
    const double tau = type == QuantType::nf4 ? 1e-7 : 4e-7;
    for (int64_t blocksize : {32, 64, 256}) {
      for (bool dq : {false, true}) {
        for (int trial = 0; trial < 6; ++trial) {
          const int64_t rows = 7 + trial, cols = 61 + 13 * trial;  // partial last blocks
          std::vector<float> values(static_cast<size_t>(rows * cols));
          for (size_t i = 0; i < values.size(); ++i) {
            const float scale = std::pow(10.0f, log_scale(rng));
            const float base = trial % 3 == 0   ? normal(rng)
                               : trial % 3 == 1 ? uniform(rng)
                                                : std::pow(normal(rng), 3.0f);  // heavy tails
            values[i] = base * scale;
          }
          const QuantizedWeight w =
              quantize_f32(values, Shape{rows, cols}, make_config(type, blocksize, dq));
          const auto out = dequantize_f32(w);
          std::vector<float> plain_absmax(static_cast<size_t>(w.num_blocks()), 0.0f);
          for (size_t i = 0; i < values.size(); ++i)
            plain_absmax[i / blocksize] = std::max(plain_absmax[i / blocksize], std::fabs(values[i]));
          for (size_t i = 0; i < values.size(); ++i) {
            const int64_t b = static_cast<int64_t>(i) / blocksize;
            const double a = plain_absmax[b];
            double bound = a * (g / 2 + tau + 3 * u);
            if (dq) {
              const double n_abs = w.nested_absmax[b / w.config.nested_blocksize];
              const double stored = w.block_absmax(b);
              bound += n_abs * (g8 / 2 + 3 * u) +
                       u * (std::fabs(a - w.nested_offset) + n_abs + std::fabs(stored));
            }
            ASSERT_LE(std::fabs(double(values[i]) - double(out[i])), bound * (1 + 1e-6))
                << quant_type_name(type) << " bs " << blocksize << " dq " << dq << " element "
                << i << " x " << values[i] << " absmax " << a;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 60000);
}

TEST(QuantNf4, NanAndInfNameTheTensorAndElement) {
  std::vector<float> values(32, 0.5f);
  values[13] = std::nanf("");
  const std::string message = error_of([&] {
    quantize_4bit(values.data(), DType::f32, Shape{4, 8}, QuantConfig{},
                  "model.layers.3.mlp.up_proj.weight");
  });
  EXPECT_NE(message.find("model.layers.3.mlp.up_proj.weight"), std::string::npos) << message;
  EXPECT_NE(message.find("element 13"), std::string::npos) << message;
  EXPECT_NE(message.find("[1, 5]"), std::string::npos) << message;
  EXPECT_NE(message.find("NaN"), std::string::npos) << message;

  std::vector<uint16_t> bf16(64, f32_to_bf16_bits(0.25f));
  bf16[40] = 0xff80;  // -Inf
  bf16[50] = 0x7fc0;  // NaN after it: the first bad element is reported
  const std::string inf_message = error_of([&] {
    quantize_4bit(bf16.data(), DType::bf16, Shape{64}, QuantConfig{}, "lm.w");
  });
  EXPECT_NE(inf_message.find("'lm.w'"), std::string::npos) << inf_message;
  EXPECT_NE(inf_message.find("element 40"), std::string::npos) << inf_message;
  EXPECT_NE(inf_message.find("-Inf"), std::string::npos) << inf_message;
}

TEST(QuantNf4, ConfigValidation) {
  for (int64_t bad : {0, -64, 16, 48, 100, 8192}) {
    QuantConfig config;
    config.blocksize = bad;
    const std::string message = error_of([&] { validate_quant_config(config); });
    EXPECT_NE(message.find("blocksize " + std::to_string(bad)), std::string::npos) << message;
    EXPECT_NE(message.find("32 to 4096"), std::string::npos) << message;
  }
  for (int64_t good : {32, 64, 128, 256, 512, 1024, 2048, 4096}) {
    QuantConfig config;
    config.blocksize = good;
    EXPECT_NO_THROW(validate_quant_config(config));
  }
  QuantConfig nested;
  nested.nested_blocksize = 100;
  EXPECT_NE(error_of([&] { validate_quant_config(nested); }).find("nested_blocksize 100"),
            std::string::npos);
  nested.double_quant = false;  // unused without double quant
  EXPECT_NO_THROW(validate_quant_config(nested));

  std::vector<int32_t> ints(64, 1);
  EXPECT_THROW(quantize_4bit(ints.data(), DType::i32, Shape{64}, QuantConfig{}, "w"), Error);
  EXPECT_THROW(quantize_4bit(ints.data(), DType::f32, Shape{0}, QuantConfig{}, "w"), Error);
  EXPECT_EQ(parse_quant_type("nf4", "x"), QuantType::nf4);
  EXPECT_THROW(parse_quant_type("int4", "x"), Error);
}

TEST(QuantNf4, RowRangeMatchesFullDequantization) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 0.03f);
  std::vector<float> values(33 * 70);
  for (float& v : values) v = normal(rng);
  for (bool dq : {false, true}) {
    const QuantizedWeight w = quantize_f32(values, Shape{33, 70}, make_config(QuantType::nf4, 64, dq));
    const auto full = dequantize_f32(w);
    std::vector<uint16_t> full_bf16(values.size());
    dequantize_4bit(w, full_bf16.data(), DType::bf16);
    for (auto [r0, r1] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 2}, {5, 17}, {32, 33}, {0, 33}, {7, 7}}) {
      std::vector<float> part(static_cast<size_t>((r1 - r0) * 70));
      dequantize_4bit_rows(w, r0, r1, part.data(), DType::f32);
      for (size_t i = 0; i < part.size(); ++i) EXPECT_EQ(part[i], full[r0 * 70 + i]);
      std::vector<uint16_t> part_bf16(part.size());
      dequantize_4bit_rows(w, r0, r1, part_bf16.data(), DType::bf16);
      for (size_t i = 0; i < part.size(); ++i) {
        EXPECT_EQ(part_bf16[i], full_bf16[r0 * 70 + i]);
        EXPECT_EQ(part_bf16[i], f32_to_bf16_bits(full[r0 * 70 + i]));
      }
    }
  }
}

TEST(QuantNf4, InputDtypesAgree) {
  // The same bf16-representable values given as f32, f16-free bf16 and f32 give the same codes.
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> values(256);
  std::vector<uint16_t> bf16(256), f16(256);
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = round_to_dtype(normal(rng), DType::bf16);
    bf16[i] = f32_to_bf16_bits(values[i]);
  }
  const QuantConfig config = make_config(QuantType::fp4, 64, true);
  const QuantizedWeight a = quantize_4bit(values.data(), DType::f32, Shape{256}, config, "a");
  const QuantizedWeight b = quantize_4bit(bf16.data(), DType::bf16, Shape{256}, config, "b");
  EXPECT_EQ(a.packed, b.packed);
  EXPECT_EQ(a.absmax_codes, b.absmax_codes);
  EXPECT_EQ(b.dtype, DType::bf16);
  for (size_t i = 0; i < values.size(); ++i) f16[i] = f32_to_f16_bits(values[i]);
  const QuantizedWeight c = quantize_4bit(f16.data(), DType::f16, Shape{256}, config, "c");
  EXPECT_EQ(c.dtype, DType::f16);
  EXPECT_EQ(c.packed.size(), a.packed.size());
}

TEST(QuantNf4, BitsPerParameterAndDeviceBytes) {
  QuantConfig plain;
  plain.double_quant = false;
  EXPECT_DOUBLE_EQ(quantized_bits_per_param(plain), 4.5);
  const QuantConfig dq;  // nf4, 64, double quant, 256
  EXPECT_DOUBLE_EQ(quantized_bits_per_param(dq), 4.0 + 8.0 / 64 + 32.0 / (64 * 256));
  EXPECT_NEAR(quantized_bits_per_param(dq), 4.127, 1e-3);

  const int64_t n = 4096 * 14336;  // a Llama 3.1 8B MLP weight
  const int64_t blocks = n / 64;
  EXPECT_EQ(quantized_weight_bytes(n, plain), size_t(n / 2 + 4 * blocks + 64));
  EXPECT_EQ(quantized_weight_bytes(n, dq),
            size_t(n / 2 + blocks + 4 * ((blocks + 255) / 256) + 4 + 1024 + 64));
  EXPECT_NEAR(8.0 * quantized_weight_bytes(n, dq) / n, quantized_bits_per_param(dq), 1e-3);
  EXPECT_NEAR(8.0 * quantized_weight_bytes(n, plain) / n, 4.5, 1e-4);
  // Odd and partial sizes round up.
  EXPECT_EQ(quantized_weight_bytes(35, make_config(QuantType::nf4, 32, false)),
            size_t(18 + 2 * 4 + 64));
  // The bytes match what quantize_4bit holds.
  std::vector<float> values(3000, 0.1f);
  const QuantizedWeight w = quantize_f32(values, Shape{3000}, dq);
  EXPECT_EQ(quantized_weight_bytes(3000, dq),
            w.packed.size() + w.absmax_codes.size() + 4 * w.nested_absmax.size() + 4 +
                4 * w.nested_quant_map.size() + 4 * w.quant_map.size());
  EXPECT_THROW(quantized_weight_bytes(100, make_config(QuantType::nf4, 48, false)), Error);
}
