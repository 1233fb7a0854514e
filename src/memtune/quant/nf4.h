// 4-bit blockwise quantization (NF4 / FP4, optional double quantization): the CPU reference of
// bitsandbytes' quantize_4bit / dequantize_4bit as its CUDA kernels compute them.
//
// Quantize (bitsandbytes csrc/kernels.cu kQuantizeBlockwise<T, blocksize, *, 0, NF4|FP4>):
//  - the row-major flattened weight is cut into blocks of `blocksize` elements (the last block may
//    be partial); absmax = max |x| of the block, in fp32;
//  - scaled = x * (1.0f / absmax): a reciprocal, then a multiply (not a division);
//  - code = nf4_quantize_scaled / fp4_quantize_scaled (codebook.h): strict `>` against the
//    kernel's midpoint literals, so a value exactly on a midpoint takes the lower code;
//  - element 2j goes to the HIGH nibble of byte j, element 2j+1 to the low nibble; an odd count
//    leaves a pad nibble that encodes 0.0 (NF4 code 7, FP4 code 0).
//  bitsandbytes builds its CUDA code with --use_fast_math, which flushes fp32 subnormals to zero.
//  This reference does the same, on the inputs and on the scaled value: a block whose values are
//  all zero or fp32-subnormal gets absmax 0, its reciprocal is +inf, 0 * inf is NaN, and NaN falls
//  through the decision tree to code 0 (NF4 -1.0, FP4 +0), which dequantizes to -0.0 / +0.0.
//  Known gap: with --use_fast_math the kernel's 1.0f/absmax compiles to rcp.approx.ftz.f32. On an
//  H200 that is one ulp off the correctly rounded reciprocal for 13.2% of all mantissas (never
//  more than one ulp); this reference uses the correctly rounded one, as a CUDA kernel built
//  without fast math (or with __frcp_rn) does. A code can differ only where that ulp carries
//  x * (1/absmax) across a threshold: in practice bf16 values whose ratio to the absmax is exactly
//  an FP4 midpoint such as 5/24 (4 of ~148k codes in tests/fixtures/nf4/cuda, none for NF4).
//
// Double quantization (bitsandbytes functional.quantize_4bit with compress_statistics=True):
//  offset = mean(absmax) in fp32; the centered values absmax - offset are quantized with
//  quantize_blockwise(blocksize=256): per block of 256 an fp32 absmax ("nested_absmax"), the
//  scaled value centered * (1.0f / nested_absmax), and dynamic_quantize_scaled() against the
//  signed dynamic map. Dequantized absmax = nested_quant_map[q] * nested_absmax[b / 256] + offset
//  (two fp32 roundings, as the kernel and the following torch add do).
//  The mean is computed here as a double sum in index order divided by the count, rounded to
//  fp32; torch's CUDA reduction sums fp32 in another order, so its offset can differ in the last
//  bit (2 of 13 fixture tensors), which shifts each dequantized absmax by about an ulp.
//
// Dequantize (kDequantizeBlockwise<T, *, *, *, NF4|FP4>): value = code_value[c] * absmax in fp32,
// then rounded to the output dtype (round to nearest even).
//
// Room quant/ (docs/ARCHITECTURE.md): bitsandbytes-exact 4-bit quantization, the host side of
// what ops/cuda/quant4bit.cu computes; may include core/ only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "memtune/core/dtype.h"
#include "memtune/core/tensor.h"

namespace memtune {

enum class QuantType : uint8_t { nf4, fp4 };
std::string_view quant_type_name(QuantType type);  // "nf4", "fp4"
// Parses "nf4" / "fp4"; throws memtune::Error naming `what` for anything else.
QuantType parse_quant_type(std::string_view name, std::string_view what);

struct QuantConfig {
  QuantType type = QuantType::nf4;
  int64_t blocksize = 64;
  bool double_quant = true;
  int64_t nested_blocksize = 256;

  bool operator==(const QuantConfig&) const = default;
};

// The block sizes bitsandbytes' CUDA kernels take (backends/cuda/ops.py quantize_4bit:
// 4096, 2048, 1024, 512, 256, 128, 64, 32). The same set is accepted for nested_blocksize,
// although bitsandbytes' quantize_4bit always uses 256 there (and its 4-bit GEMM needs 256).
bool quant_blocksize_valid(int64_t blocksize);
// Throws memtune::Error with the offending field and the allowed values.
void validate_quant_config(const QuantConfig& config);

// A weight quantized on the host: everything bitsandbytes saves for one Params4bit.
struct QuantizedWeight {
  QuantConfig config;
  Shape shape;                      // shape of the original weight (bnb quant_state "shape")
  DType dtype = DType::bf16;        // dtype of the original weight (bnb quant_state "dtype")
  std::vector<uint8_t> packed;      // (numel + 1) / 2 bytes; element 2j in the high nibble
  std::vector<float> absmax;        // fp32 per block; empty when config.double_quant
  std::vector<uint8_t> absmax_codes;     // per block, 8-bit dynamic codes (double_quant)
  std::vector<float> nested_absmax;      // per nested block of absmax_codes (double_quant)
  float nested_offset = 0.0f;            // mean of the fp32 absmax (double_quant)
  std::vector<float> quant_map;          // 16 values, bnb_quant_map(); informative only
  std::vector<float> nested_quant_map;   // 256 values used to dequantize absmax_codes

  int64_t numel() const { return shape.numel(); }
  int64_t num_blocks() const;         // ceil(numel / blocksize)
  int64_t num_nested_blocks() const;  // ceil(num_blocks / nested_blocksize), 0 without dq
  // The fp32 absmax of one block (dequantized through the nested state under double quant).
  float block_absmax(int64_t block) const;
  // All of them.
  std::vector<float> block_absmax_all() const;
  // The 4-bit code of element i of the flattened weight.
  uint8_t code_at(int64_t index) const {
    const uint8_t byte = packed[static_cast<size_t>(index >> 1)];
    return (index & 1) ? (byte & 0x0f) : (byte >> 4);
  }
};

// Quantizes a contiguous row-major f32 / f16 / bf16 tensor. Throws memtune::Error for a bad
// config, an unsupported dtype, an empty tensor, or any NaN / Inf element (the message names
// `tensor_name`, the flat element index and its coordinates).
QuantizedWeight quantize_4bit(const void* data, DType dtype, Shape shape, const QuantConfig& config,
                              std::string_view tensor_name);

// The second stage of quantize_4bit under double quantization, exposed so that tests can give the
// offset bitsandbytes computed: fills absmax_codes, nested_absmax, nested_offset and
// nested_quant_map of `weight` from the per-block fp32 `absmax`, and clears weight->absmax.
void double_quantize_absmax(const std::vector<float>& absmax, float offset,
                            QuantizedWeight* weight);
// offset = mean(absmax) as described above.
float absmax_mean(const std::vector<float>& absmax);

// Dequantizes the whole weight into `out` (numel elements of out_dtype: f32, f16 or bf16).
void dequantize_4bit(const QuantizedWeight& weight, void* out, DType out_dtype);

// Dequantizes rows [row_begin, row_end) of the weight seen as 2-D [shape[0], numel / shape[0]]
// (a Linear's [out, in]) into `out`, which holds (row_end - row_begin) * cols elements. Blocks may
// straddle rows; the result equals the same rows of dequantize_4bit.
void dequantize_4bit_rows(const QuantizedWeight& weight, int64_t row_begin, int64_t row_end,
                          void* out, DType out_dtype);

// Bytes one quantized weight of `numel` elements takes on the device: the packed codes
// ceil(numel / 2), the 16-float quant_map, and either fp32 absmax per block or, with double
// quant, one u8 code per block + fp32 nested_absmax per nested block + the fp32 offset + the
// 256-float nested_quant_map. Throws for an invalid config.
size_t quantized_weight_bytes(int64_t numel, const QuantConfig& config);
// The asymptotic storage cost per parameter, ignoring partial blocks and the code maps:
// 4 + 32 / blocksize without double quant (4.5 at 64); with it
// 4 + 8 / blocksize + 32 / (blocksize * nested_blocksize) (4.127 at 64 / 256).
double quantized_bits_per_param(const QuantConfig& config);

}  // namespace memtune
