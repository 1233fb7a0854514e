#include "memtune/core/dtype.h"

#include <cmath>

#include "memtune/core/enum_names.h"
#include "memtune/core/error.h"

namespace memtune {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::u8: return 1;
    case DType::i32: return 4;
  }
  MT_ASSERT(false, "unknown dtype");
}

namespace {

constexpr EnumName<DType> kDTypeNames[] = {
    {DType::f32, "f32"}, {DType::f16, "f16"}, {DType::bf16, "bf16"}, {DType::u8, "u8"}, {DType::i32, "i32"}};
// The dtype strings of the safetensors header.
constexpr EnumName<DType> kSafetensorsNames[] = {
    {DType::f32, "F32"}, {DType::f16, "F16"}, {DType::bf16, "BF16"}, {DType::u8, "U8"}, {DType::i32, "I32"}};

}  // namespace

std::string_view dtype_name(DType dtype) { return name_of(kDTypeNames, dtype); }

std::string_view dtype_safetensors_name(DType dtype) { return name_of(kSafetensorsNames, dtype); }

bool dtype_from_safetensors_name(std::string_view name, DType* out) {
  const std::optional<DType> dtype = value_of(kSafetensorsNames, name);
  if (dtype) *out = *dtype;
  return dtype.has_value();
}

bool dtype_is_float(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

uint16_t f32_to_f16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs_bits >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs_bits < 0x38800000u) {
    // Result is subnormal (or zero) in f16: value = m * 2^-24, round to nearest even.
    float magnitude;
    std::memcpy(&magnitude, &abs_bits, 4);
    const float scaled = magnitude * 16777216.0f;  // 2^24, exact
    const float rounded = std::nearbyint(scaled);  // default rounding mode: nearest even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rounded));
  }
  // Normal: rebias exponent 127 -> 15 and round the 13 dropped mantissa bits to nearest even.
  uint32_t result = abs_bits - 0x38000000u;
  result += 0x0fffu + ((result >> 13) & 1u);
  return static_cast<uint16_t>(sign | (result >> 13));
}

float f16_bits_to_f32(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &magnitude, 4);
    bits |= sign;
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

float round_to_dtype(float value, DType dtype) {
  switch (dtype) {
    case DType::bf16: return bf16_bits_to_f32(f32_to_bf16_bits(value));
    case DType::f16: return f16_bits_to_f32(f32_to_f16_bits(value));
    default: return value;
  }
}

}  // namespace memtune
