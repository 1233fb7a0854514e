// bitsandbytes' serialized form of a 4-bit weight, and transformers' quantization_config.
//
// For a Linear4bit module with prefix P, bitsandbytes (nn/modules.py Linear4bit
// _save_to_state_dict, functional.py QuantState.as_dict(packed=True)) saves, in this order:
//   P.weight                      uint8 [(n + 1) / 2, 1]   packed codes (quant_storage uint8)
//   P.weight.absmax               fp32 [blocks]            or uint8 [blocks] under double quant
//   P.weight.quant_map            fp32 [16]
//   P.weight.nested_absmax        fp32 [nested blocks]     (double quant only)
//   P.weight.nested_quant_map     fp32 [256]               (double quant only)
//   P.weight.quant_state.bitsandbytes__nf4 (or __fp4)      uint8 bytes of a JSON dict
// The JSON (utils.py pack_dict_to_tensor: json.dumps, UTF-8) holds quant_type, blocksize, dtype
// (torch's name without "torch.", e.g. "bfloat16"), shape, and under double quant
// nested_blocksize, nested_dtype ("float32") and nested_offset (a Python float).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "memtune/core/dtype.h"
#include "memtune/core/tensor.h"
#include "memtune/quant/nf4.h"

namespace memtune {

// One named tensor as it would sit in a safetensors file: little-endian, row-major bytes.
struct NamedArray {
  std::string name;
  DType dtype = DType::u8;
  Shape shape;
  std::vector<uint8_t> bytes;
};

// torch's dtype name as bitsandbytes writes it ("float32", "float16", "bfloat16", "uint8").
std::string_view torch_dtype_name(DType dtype);
// The inverse, also taking "torch.bfloat16", "float", "half"; false for anything else.
bool dtype_from_torch_name(std::string_view name, DType* out);

// The exact bytes bitsandbytes writes for the quant_state JSON of `weight` (Python's json.dumps
// layout: ", " and ": " separators, floats as Python's repr).
std::string bnb_quant_state_json(const QuantizedWeight& weight);

// The arrays above, named with `prefix` (the module path, e.g.
// "model.layers.0.self_attn.q_proj").
std::vector<NamedArray> to_bnb_arrays(const QuantizedWeight& weight, std::string_view prefix);

// Rebuilds a weight from the arrays of module `prefix`; `lookup` returns nullptr for a missing
// name. Throws memtune::Error naming the key for a missing or inconsistent entry: no or two
// quant_state keys, an unknown quant_type, a quant_type that contradicts the key, wrong dtypes or
// sizes, a bad blocksize, nested entries present without double quant (or missing with it), or a
// shape other than `expected_shape` when that is given. P.weight may use another quant_storage
// dtype (bitsandbytes allows e.g. bf16 for FSDP) as long as it holds (n + 1) / 2 bytes.
QuantizedWeight from_bnb_arrays(const std::function<const NamedArray*(std::string_view name)>& lookup,
                                std::string_view prefix,
                                const std::optional<Shape>& expected_shape = std::nullopt);

// transformers' BitsAndBytesConfig(load_in_4bit=True, ...).to_dict(), as config.json's
// "quantization_config": quant_method "bitsandbytes", _load_in_4bit / load_in_4bit true,
// _load_in_8bit / load_in_8bit false, bnb_4bit_quant_type, bnb_4bit_use_double_quant,
// bnb_4bit_compute_dtype, bnb_4bit_quant_storage "uint8", and the llm_int8_* defaults.
// transformers has no blocksize field; a checkpoint carries its blocksize in each quant_state.
nlohmann::json quantization_config_json(const QuantConfig& config, DType compute_dtype);

struct BnbQuantizationConfig {
  QuantConfig quant;                   // blocksize 64 / nested 256: transformers' fixed values
  DType compute_dtype = DType::f32;    // transformers' default
  std::string quant_storage = "uint8";
};
// Reads a quantization_config object, with transformers' defaults for missing keys (quant type
// fp4, no double quant, compute float32, storage uint8). Throws memtune::Error for another
// quant_method, 8-bit loading, load_in_4bit not true, or a value of the wrong type or unknown name.
BnbQuantizationConfig parse_quantization_config_json(const nlohmann::json& config);

}  // namespace memtune
