#include "memtune/quant/nf4.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "memtune/core/enum_names.h"
#include "memtune/core/error.h"
#include "memtune/quant/codebook.h"

namespace memtune {

namespace {

// --use_fast_math (-ftz=true) makes the kernel's fp32 arithmetic treat subnormal operands and
// results as zero of the same sign.
inline float flush_subnormal(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
}

inline uint8_t quantize_scaled(QuantType type, float scaled) {
  return type == QuantType::nf4 ? nf4_quantize_scaled(scaled) : fp4_quantize_scaled(scaled);
}

const std::array<float, 16>& code_values(QuantType type) {
  return type == QuantType::nf4 ? nf4_code_values() : fp4_code_values();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string coordinates(const Shape& shape, int64_t flat) {
  std::string text = "[";
  std::array<int64_t, Shape::kMaxDims> index{};
  for (int d = shape.ndim - 1; d >= 0; --d) {
    index[d] = shape[d] == 0 ? 0 : flat % shape[d];
    flat = shape[d] == 0 ? 0 : flat / shape[d];
  }
  for (int d = 0; d < shape.ndim; ++d) text += fmt::format("{}{}", d ? ", " : "", index[d]);
  return text + "]";
}

void check_float_dtype(DType dtype, std::string_view what) {
  MT_USER_CHECK(dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16,
                "{}: dtype {} is not supported (f32, f16 or bf16)", what, dtype_name(dtype));
}

// x * (1.0f / absmax) as the kernel rounds it (see nf4.h): reciprocal first, then a multiply.
inline float reciprocal(float absmax) { return 1.0f / absmax; }

}  // namespace

constexpr EnumName<QuantType> kQuantTypeNames[] = {{QuantType::nf4, "nf4"}, {QuantType::fp4, "fp4"}};

std::string_view quant_type_name(QuantType type) { return name_of(kQuantTypeNames, type); }

QuantType parse_quant_type(std::string_view name, std::string_view what) {
  const std::optional<QuantType> type = value_of(kQuantTypeNames, name);
  MT_USER_CHECK(type.has_value(), "{}: unknown 4-bit quant type '{}' (expected {})", what, name,
                names_of(kQuantTypeNames));
  return *type;
}

bool quant_blocksize_valid(int64_t blocksize) {
  return blocksize >= 32 && blocksize <= 4096 && (blocksize & (blocksize - 1)) == 0;
}

void validate_quant_config(const QuantConfig& config) {
  MT_USER_CHECK(config.type == QuantType::nf4 || config.type == QuantType::fp4,
                "quantization: unknown quant type {}", static_cast<int>(config.type));
  MT_USER_CHECK(quant_blocksize_valid(config.blocksize),
                "quantization: blocksize {} is not supported: bitsandbytes takes a power of two "
                "from 32 to 4096 (32, 64, 128, 256, 512, 1024, 2048, 4096)",
                config.blocksize);
  if (config.double_quant)
    MT_USER_CHECK(quant_blocksize_valid(config.nested_blocksize),
                  "quantization: nested_blocksize {} is not supported: a power of two from 32 to "
                  "4096 (bitsandbytes uses 256)",
                  config.nested_blocksize);
}

int64_t QuantizedWeight::num_blocks() const { return ceil_div(numel(), config.blocksize); }

int64_t QuantizedWeight::num_nested_blocks() const {
  return config.double_quant ? ceil_div(num_blocks(), config.nested_blocksize) : 0;
}

float QuantizedWeight::block_absmax(int64_t block) const {
  if (!config.double_quant) return absmax[static_cast<size_t>(block)];
  const uint8_t code = absmax_codes[static_cast<size_t>(block)];
  // Two separate fp32 roundings (the dequantize kernel, then torch's `absmax += offset`); the
  // volatile keeps a compiler allowed to contract from fusing them into one FMA.
  volatile float scaled =
      nested_quant_map[code] * nested_absmax[static_cast<size_t>(block / config.nested_blocksize)];
  return scaled + nested_offset;
}

std::vector<float> QuantizedWeight::block_absmax_all() const {
  std::vector<float> all(static_cast<size_t>(num_blocks()));
  for (int64_t b = 0; b < num_blocks(); ++b) all[static_cast<size_t>(b)] = block_absmax(b);
  return all;
}

float absmax_mean(const std::vector<float>& absmax) {
  MT_ASSERT(!absmax.empty(), "mean of no absmax values");
  double sum = 0.0;
  for (float value : absmax) sum += value;
  return static_cast<float>(sum / static_cast<double>(absmax.size()));
}

void double_quantize_absmax(const std::vector<float>& absmax, float offset,
                            QuantizedWeight* weight) {
  MT_ASSERT(weight != nullptr && weight->config.double_quant, "double quant not configured");
  const int64_t blocks = static_cast<int64_t>(absmax.size());
  const int64_t nested_blocksize = weight->config.nested_blocksize;
  const int64_t nested_blocks = ceil_div(blocks, nested_blocksize);
  const std::vector<float>& map = signed_dynamic_map();

  std::vector<float> centered(absmax.size());
  for (size_t i = 0; i < absmax.size(); ++i) centered[i] = flush_subnormal(absmax[i] - offset);

  weight->absmax_codes.assign(absmax.size(), 0);
  weight->nested_absmax.assign(static_cast<size_t>(nested_blocks), 0.0f);
  for (int64_t nb = 0; nb < nested_blocks; ++nb) {
    const int64_t begin = nb * nested_blocksize;
    const int64_t end = std::min(blocks, begin + nested_blocksize);
    float block_max = 0.0f;
    for (int64_t i = begin; i < end; ++i) block_max = std::max(block_max, std::fabs(centered[i]));
    weight->nested_absmax[static_cast<size_t>(nb)] = block_max;
    const float inverse = reciprocal(block_max);
    for (int64_t i = begin; i < end; ++i)
      weight->absmax_codes[static_cast<size_t>(i)] =
          dynamic_quantize_scaled(map.data(), flush_subnormal(centered[i] * inverse));
  }
  weight->nested_offset = offset;
  weight->nested_quant_map = map;
  weight->absmax.clear();
}

QuantizedWeight quantize_4bit(const void* data, DType dtype, Shape shape, const QuantConfig& config,
                              std::string_view tensor_name) {
  validate_quant_config(config);
  check_float_dtype(dtype, fmt::format("quantize '{}'", tensor_name));
  MT_USER_CHECK(shape.ndim >= 1 && shape.numel() > 0, "quantize '{}': empty tensor {}",
                tensor_name, shape.str());
  MT_ASSERT(data != nullptr, "quantize '{}': no data", tensor_name);

  const int64_t n = shape.numel();
  int64_t first_bad = std::numeric_limits<int64_t>::max();
#pragma omp parallel for reduction(min : first_bad) schedule(static)
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(load_as_f32(data, dtype, i))) first_bad = std::min(first_bad, i);
  if (first_bad != std::numeric_limits<int64_t>::max()) {
    const float bad = load_as_f32(data, dtype, first_bad);
    mt_fail("quantize '{}': element {} (index {} of shape {}) is {}; NaN and Inf cannot be "
            "quantized to 4 bits",
            tensor_name, first_bad, coordinates(shape, first_bad), shape.str(),
            std::isnan(bad) ? "NaN" : (bad > 0 ? "+Inf" : "-Inf"));
  }

  QuantizedWeight weight;
  weight.config = config;
  weight.shape = shape;
  weight.dtype = dtype;
  const auto map = bnb_quant_map(config.type == QuantType::nf4);
  weight.quant_map.assign(map.begin(), map.end());
  const int64_t blocksize = config.blocksize;
  const int64_t blocks = ceil_div(n, blocksize);
  weight.packed.assign(static_cast<size_t>((n + 1) / 2), 0);
  std::vector<float> absmax(static_cast<size_t>(blocks));

#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * blocksize;
    const int64_t end = std::min(n, begin + blocksize);
    float block_max = 0.0f;
    for (int64_t i = begin; i < end; ++i)
      block_max = std::max(block_max, std::fabs(flush_subnormal(load_as_f32(data, dtype, i))));
    absmax[static_cast<size_t>(b)] = block_max;
    const float inverse = reciprocal(block_max);
    // A block starts on an even element (blocksize >= 32), so it owns whole bytes; past the end
    // of the tensor the kernel quantizes a loaded 0.0 into the pad nibble.
    for (int64_t i = begin; i < end; i += 2) {
      const float x0 = flush_subnormal(load_as_f32(data, dtype, i));
      const float x1 = i + 1 < end ? flush_subnormal(load_as_f32(data, dtype, i + 1)) : 0.0f;
      const uint8_t hi = quantize_scaled(config.type, flush_subnormal(x0 * inverse));
      const uint8_t lo = quantize_scaled(config.type, flush_subnormal(x1 * inverse));
      weight.packed[static_cast<size_t>(i / 2)] = static_cast<uint8_t>((hi << 4) | lo);
    }
  }

  if (config.double_quant) {
    double_quantize_absmax(absmax, absmax_mean(absmax), &weight);
  } else {
    weight.absmax = std::move(absmax);
  }
  return weight;
}

void dequantize_4bit_rows(const QuantizedWeight& weight, int64_t row_begin, int64_t row_end,
                          void* out, DType out_dtype) {
  check_float_dtype(out_dtype, "dequantize_4bit");
  const int64_t n = weight.numel();
  MT_ASSERT(weight.shape.ndim >= 1 && weight.shape[0] > 0, "dequantize: bad shape {}",
            weight.shape.str());
  const int64_t rows = weight.shape[0];
  const int64_t cols = n / rows;
  MT_ASSERT(0 <= row_begin && row_begin <= row_end && row_end <= rows,
            "dequantize rows [{}, {}) of {}", row_begin, row_end, rows);
  MT_ASSERT(weight.packed.size() == static_cast<size_t>((n + 1) / 2), "packed size");
  if (row_begin == row_end) return;

  const int64_t blocksize = weight.config.blocksize;
  const int64_t first = row_begin * cols;
  const int64_t last = row_end * cols;  // exclusive
  const int64_t block_lo = first / blocksize;
  const int64_t block_hi = (last - 1) / blocksize;
  std::vector<float> absmax(static_cast<size_t>(block_hi - block_lo + 1));
  for (int64_t b = block_lo; b <= block_hi; ++b)
    absmax[static_cast<size_t>(b - block_lo)] = weight.block_absmax(b);
  const std::array<float, 16>& values = code_values(weight.config.type);

#pragma omp parallel for schedule(static)
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      const float scale = absmax[static_cast<size_t>(i / blocksize - block_lo)];
      store_from_f32(out, out_dtype, i - first, values[weight.code_at(i)] * scale);
    }
  }
}

void dequantize_4bit(const QuantizedWeight& weight, void* out, DType out_dtype) {
  dequantize_4bit_rows(weight, 0, weight.shape[0], out, out_dtype);
}

size_t quantized_weight_bytes(int64_t numel, const QuantConfig& config) {
  validate_quant_config(config);
  MT_ASSERT(numel >= 0, "negative element count");
  const int64_t blocks = ceil_div(numel, config.blocksize);
  size_t bytes = static_cast<size_t>((numel + 1) / 2) + 16 * sizeof(float);
  if (config.double_quant) {
    const int64_t nested_blocks = ceil_div(blocks, config.nested_blocksize);
    bytes += static_cast<size_t>(blocks) + static_cast<size_t>(nested_blocks) * sizeof(float) +
             sizeof(float) + 256 * sizeof(float);
  } else {
    bytes += static_cast<size_t>(blocks) * sizeof(float);
  }
  return bytes;
}

double quantized_bits_per_param(const QuantConfig& config) {
  validate_quant_config(config);
  const double blocksize = static_cast<double>(config.blocksize);
  if (!config.double_quant) return 4.0 + 32.0 / blocksize;
  return 4.0 + 8.0 / blocksize +
         32.0 / (blocksize * static_cast<double>(config.nested_blocksize));
}

}  // namespace memtune
