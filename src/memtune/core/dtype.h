// Storage dtypes and the scalar conversions used by the CPU reference backend.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace memtune {

enum class DType : uint8_t { f32, f16, bf16, u8, i32 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "f32", "f16", "bf16", "u8", "i32"
// safetensors spelling: "F32", "F16", "BF16", "U8", "I32".
std::string_view dtype_safetensors_name(DType dtype);
// Returns false when the name is not one memtune stores.
bool dtype_from_safetensors_name(std::string_view name, DType* out);
bool dtype_is_float(DType dtype);

// bf16: the top 16 bits of an f32, rounded to nearest even (NaN kept quiet).
inline uint16_t f32_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
inline float bf16_bits_to_f32(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}
uint16_t f32_to_f16_bits(float value);  // IEEE binary16, round to nearest even
float f16_bits_to_f32(uint16_t bits);

// Round-trips a value through a storage dtype: what storing and reloading it gives.
float round_to_dtype(float value, DType dtype);

// Element access for f32/f16/bf16 buffers (the CPU backend's load/store).
inline float load_as_f32(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(data)[index];
    case DType::bf16: return bf16_bits_to_f32(static_cast<const uint16_t*>(data)[index]);
    case DType::f16: return f16_bits_to_f32(static_cast<const uint16_t*>(data)[index]);
    case DType::u8: return static_cast<float>(static_cast<const uint8_t*>(data)[index]);
    case DType::i32: return static_cast<float>(static_cast<const int32_t*>(data)[index]);
  }
  return 0.0f;
}
inline void store_from_f32(void* data, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(data)[index] = value; return;
    case DType::bf16: static_cast<uint16_t*>(data)[index] = f32_to_bf16_bits(value); return;
    case DType::f16: static_cast<uint16_t*>(data)[index] = f32_to_f16_bits(value); return;
    case DType::u8: static_cast<uint8_t*>(data)[index] = static_cast<uint8_t>(value); return;
    case DType::i32: static_cast<int32_t*>(data)[index] = static_cast<int32_t>(value); return;
  }
}

}  // namespace memtune
