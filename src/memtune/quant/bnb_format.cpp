#include "memtune/quant/bnb_format.h"

#include <cmath>
#include <cstring>

#include "memtune/core/enum_names.h"
#include "memtune/core/error.h"
#include "memtune/quant/codebook.h"

namespace memtune {

namespace {


// Python's repr() of a float: the shortest digits that round-trip, fixed notation for decimal
// exponents -4..15 and always with a fractional part, scientific ("1e-05") otherwise. fmt's "{}"
// picks the same digits and the same notation, but writes integral values without ".0".
std::string python_float_repr(double value) {
  if (std::isnan(value)) return "NaN";  // json.dumps spelling
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  std::string text = fmt::format("{}", value);
  if (text.find_first_of(".e") == std::string::npos) text += ".0";
  return text;
}

std::string json_string(std::string_view text) { return nlohmann::json(std::string(text)).dump(); }

std::string shape_json(const Shape& shape) {
  std::string text = "[";
  for (int d = 0; d < shape.ndim; ++d) text += fmt::format("{}{}", d ? ", " : "", shape[d]);
  return text + "]";
}

template <typename T>
NamedArray make_array(std::string name, DType dtype, Shape shape, const std::vector<T>& values) {
  NamedArray array;
  array.name = std::move(name);
  array.dtype = dtype;
  array.shape = shape;
  array.bytes.resize(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(array.bytes.data(), values.data(), array.bytes.size());
  return array;
}

// Little-endian fp32 payload of an array whose dtype and element count were checked.
std::vector<float> floats_of(const NamedArray& array) {
  std::vector<float> values(array.bytes.size() / sizeof(float));
  if (!values.empty()) std::memcpy(values.data(), array.bytes.data(), array.bytes.size());
  return values;
}

const NamedArray& require(const std::function<const NamedArray*(std::string_view)>& lookup,
                          const std::string& name, std::string_view why) {
  const NamedArray* array = lookup(name);
  MT_USER_CHECK(array != nullptr, "bitsandbytes 4-bit weight: missing '{}' ({})", name, why);
  return *array;
}

void check_array(const NamedArray& array, DType dtype, int64_t numel) {
  MT_USER_CHECK(array.dtype == dtype, "bitsandbytes 4-bit weight: '{}' has dtype {}, expected {}",
                array.name, dtype_name(array.dtype), dtype_name(dtype));
  MT_USER_CHECK(array.shape.numel() == numel,
                "bitsandbytes 4-bit weight: '{}' has shape {} ({} elements), expected {} elements",
                array.name, array.shape.str(), array.shape.numel(), numel);
  MT_USER_CHECK(array.bytes.size() == static_cast<size_t>(numel) * dtype_size(dtype),
                "bitsandbytes 4-bit weight: '{}' holds {} bytes, expected {}", array.name,
                array.bytes.size(), static_cast<size_t>(numel) * dtype_size(dtype));
}

template <typename T>
T json_field(const nlohmann::json& object, const char* key, const std::string& where) {
  MT_USER_CHECK(object.contains(key), "{}: missing \"{}\"", where, key);
  const nlohmann::json& value = object.at(key);
  if constexpr (std::is_same_v<T, std::string>) {
    MT_USER_CHECK(value.is_string(), "{}: \"{}\" must be a string, got {}", where, key,
                  value.dump());
    return value.get<std::string>();
  } else if constexpr (std::is_same_v<T, bool>) {
    MT_USER_CHECK(value.is_boolean(), "{}: \"{}\" must be true or false, got {}", where, key,
                  value.dump());
    return value.get<bool>();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    MT_USER_CHECK(value.is_number_integer(), "{}: \"{}\" must be an integer, got {}", where, key,
                  value.dump());
    return value.get<int64_t>();
  } else {
    MT_USER_CHECK(value.is_number(), "{}: \"{}\" must be a number, got {}", where, key,
                  value.dump());
    return value.get<double>();
  }
}

}  // namespace

// torch's dtype names (str(torch.bfloat16) without "torch."), as bitsandbytes' quant_state writes them.
constexpr EnumName<DType> kTorchDTypeNames[] = {{DType::f32, "float32"}, {DType::f16, "float16"},
                                                {DType::bf16, "bfloat16"}, {DType::u8, "uint8"},
                                                {DType::i32, "int32"}};

std::string_view torch_dtype_name(DType dtype) { return name_of(kTorchDTypeNames, dtype); }

// torch's short aliases (torch.float is torch.float32, ...): read, never written.
constexpr EnumName<DType> kTorchDTypeAliases[] = {{DType::f32, "float"}, {DType::f16, "half"}, {DType::i32, "int"}};

bool dtype_from_torch_name(std::string_view name, DType* out) {
  if (name.starts_with("torch.")) name.remove_prefix(6);
  std::optional<DType> dtype = value_of(kTorchDTypeNames, name);
  if (!dtype) dtype = value_of(kTorchDTypeAliases, name);
  if (dtype) *out = *dtype;
  return dtype.has_value();
}

std::string bnb_quant_state_json(const QuantizedWeight& weight) {
  // QuantState.as_dict: the non-tensor items in insertion order.
  std::string text = fmt::format(
      "{{\"quant_type\": {}, \"blocksize\": {}, \"dtype\": {}, \"shape\": {}",
      json_string(quant_type_name(weight.config.type)), weight.config.blocksize,
      json_string(torch_dtype_name(weight.dtype)), shape_json(weight.shape));
  if (weight.config.double_quant) {
    text += fmt::format(", \"nested_blocksize\": {}, \"nested_dtype\": \"float32\", "
                        "\"nested_offset\": {}",
                        weight.config.nested_blocksize,
                        python_float_repr(static_cast<double>(weight.nested_offset)));
  }
  return text + "}";
}

std::vector<NamedArray> to_bnb_arrays(const QuantizedWeight& weight, std::string_view prefix) {
  MT_ASSERT(weight.packed.size() == static_cast<size_t>((weight.numel() + 1) / 2), "packed size");
  const std::string base = fmt::format("{}.weight", prefix);
  const int64_t blocks = weight.num_blocks();
  std::vector<NamedArray> arrays;
  arrays.push_back(make_array(base, DType::u8,
                              Shape{static_cast<int64_t>(weight.packed.size()), 1},
                              weight.packed));
  if (weight.config.double_quant) {
    MT_ASSERT(weight.absmax_codes.size() == static_cast<size_t>(blocks), "absmax codes");
    arrays.push_back(make_array(base + ".absmax", DType::u8, Shape{blocks}, weight.absmax_codes));
  } else {
    MT_ASSERT(weight.absmax.size() == static_cast<size_t>(blocks), "absmax");
    arrays.push_back(make_array(base + ".absmax", DType::f32, Shape{blocks}, weight.absmax));
  }
  std::vector<float> quant_map = weight.quant_map;
  if (quant_map.empty()) {
    const auto standard = bnb_quant_map(weight.config.type == QuantType::nf4);
    quant_map.assign(standard.begin(), standard.end());
  }
  arrays.push_back(make_array(base + ".quant_map", DType::f32,
                              Shape{static_cast<int64_t>(quant_map.size())}, quant_map));
  if (weight.config.double_quant) {
    arrays.push_back(make_array(base + ".nested_absmax", DType::f32,
                                Shape{static_cast<int64_t>(weight.nested_absmax.size())},
                                weight.nested_absmax));
    arrays.push_back(make_array(base + ".nested_quant_map", DType::f32,
                                Shape{static_cast<int64_t>(weight.nested_quant_map.size())},
                                weight.nested_quant_map));
  }
  const std::string json = bnb_quant_state_json(weight);
  std::vector<uint8_t> json_bytes(json.begin(), json.end());
  arrays.push_back(make_array(fmt::format("{}.quant_state.bitsandbytes__{}", base,
                                          quant_type_name(weight.config.type)),
                              DType::u8, Shape{static_cast<int64_t>(json_bytes.size())},
                              json_bytes));
  return arrays;
}

QuantizedWeight from_bnb_arrays(const std::function<const NamedArray*(std::string_view name)>& lookup,
                                std::string_view prefix, const std::optional<Shape>& expected_shape) {
  const std::string base = fmt::format("{}.weight", prefix);
  const std::string nf4_key = base + ".quant_state.bitsandbytes__nf4";
  const std::string fp4_key = base + ".quant_state.bitsandbytes__fp4";
  const NamedArray* nf4_state = lookup(nf4_key);
  const NamedArray* fp4_state = lookup(fp4_key);
  MT_USER_CHECK(nf4_state != nullptr || fp4_state != nullptr,
                "bitsandbytes 4-bit weight '{}': no quant state ('{}' or '{}')", base, nf4_key,
                fp4_key);
  MT_USER_CHECK(nf4_state == nullptr || fp4_state == nullptr,
                "bitsandbytes 4-bit weight '{}': both '{}' and '{}' are present", base, nf4_key,
                fp4_key);
  const NamedArray& state_array = nf4_state ? *nf4_state : *fp4_state;
  const QuantType key_type = nf4_state ? QuantType::nf4 : QuantType::fp4;
  MT_USER_CHECK(state_array.dtype == DType::u8, "bitsandbytes 4-bit weight: '{}' must be uint8",
                state_array.name);

  const std::string where = fmt::format("bitsandbytes quant state '{}'", state_array.name);
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(state_array.bytes.begin(), state_array.bytes.end());
  } catch (const nlohmann::json::exception& e) {
    mt_fail("{}: not valid JSON: {}", where, e.what());
  }
  MT_USER_CHECK(state.is_object(), "{}: not a JSON object", where);

  QuantizedWeight weight;
  weight.config.type = parse_quant_type(json_field<std::string>(state, "quant_type", where), where);
  MT_USER_CHECK(weight.config.type == key_type,
                "{}: quant_type '{}' contradicts the key's suffix '{}'", where,
                quant_type_name(weight.config.type), quant_type_name(key_type));
  weight.config.blocksize = json_field<int64_t>(state, "blocksize", where);
  MT_USER_CHECK(quant_blocksize_valid(weight.config.blocksize),
                "{}: blocksize {} is not a power of two from 32 to 4096", where,
                weight.config.blocksize);
  const std::string dtype_text = json_field<std::string>(state, "dtype", where);
  MT_USER_CHECK(dtype_from_torch_name(dtype_text, &weight.dtype) && dtype_is_float(weight.dtype),
                "{}: dtype '{}' is not float32, float16 or bfloat16", where, dtype_text);
  MT_USER_CHECK(state.contains("shape") && state["shape"].is_array(),
                "{}: \"shape\" must be a list of sizes", where);
  const nlohmann::json& dims = state["shape"];
  MT_USER_CHECK(!dims.empty() && dims.size() <= static_cast<size_t>(Shape::kMaxDims),
                "{}: shape {} must have 1 to {} dimensions", where, dims.dump(), Shape::kMaxDims);
  for (const auto& dim : dims) {
    MT_USER_CHECK(dim.is_number_integer() && dim.get<int64_t>() > 0,
                  "{}: shape {} must hold positive integers", where, dims.dump());
    weight.shape.dims[weight.shape.ndim++] = dim.get<int64_t>();
  }
  if (expected_shape)
    MT_USER_CHECK(weight.shape == *expected_shape, "{}: shape {} but the model expects {}", where,
                  weight.shape.str(), expected_shape->str());

  const bool nested = lookup(base + ".nested_absmax") != nullptr;
  weight.config.double_quant = nested;
  MT_USER_CHECK(nested == state.contains("nested_offset"),
                "{}: '{}.nested_absmax' and \"nested_offset\" must come together", where, base);
  if (nested) {
    weight.config.nested_blocksize = json_field<int64_t>(state, "nested_blocksize", where);
    MT_USER_CHECK(quant_blocksize_valid(weight.config.nested_blocksize),
                  "{}: nested_blocksize {} is not a power of two from 32 to 4096", where,
                  weight.config.nested_blocksize);
    const std::string nested_dtype = json_field<std::string>(state, "nested_dtype", where);
    MT_USER_CHECK(nested_dtype == "float32", "{}: nested_dtype '{}' is not float32", where,
                  nested_dtype);
    weight.nested_offset = static_cast<float>(json_field<double>(state, "nested_offset", where));
    MT_USER_CHECK(std::isfinite(weight.nested_offset), "{}: nested_offset is not finite", where);
  }

  const int64_t n = weight.shape.numel();
  const int64_t blocks = weight.num_blocks();

  const NamedArray& packed = require(lookup, base, "the packed 4-bit codes");
  MT_USER_CHECK(packed.bytes.size() == static_cast<size_t>((n + 1) / 2) &&
                    packed.shape.numel() * static_cast<int64_t>(dtype_size(packed.dtype)) ==
                        static_cast<int64_t>(packed.bytes.size()),
                "bitsandbytes 4-bit weight: '{}' holds {} bytes (shape {}, {}), but shape {} "
                "needs {} bytes of packed codes",
                base, packed.bytes.size(), packed.shape.str(), dtype_name(packed.dtype),
                weight.shape.str(), (n + 1) / 2);
  weight.packed = packed.bytes;

  const NamedArray& absmax = require(lookup, base + ".absmax", "the per-block absmax");
  if (nested) {
    check_array(absmax, DType::u8, blocks);
    weight.absmax_codes = absmax.bytes;
    const NamedArray& nested_absmax =
        require(lookup, base + ".nested_absmax", "the nested absmax");
    check_array(nested_absmax, DType::f32, weight.num_nested_blocks());
    weight.nested_absmax = floats_of(nested_absmax);
    const NamedArray& nested_map =
        require(lookup, base + ".nested_quant_map", "the 8-bit map of the nested absmax");
    check_array(nested_map, DType::f32, 256);
    weight.nested_quant_map = floats_of(nested_map);
  } else {
    check_array(absmax, DType::f32, blocks);
    weight.absmax = floats_of(absmax);
    MT_USER_CHECK(lookup(base + ".nested_quant_map") == nullptr,
                  "bitsandbytes 4-bit weight: '{}.nested_quant_map' without nested_absmax", base);
  }

  const NamedArray& quant_map = require(lookup, base + ".quant_map", "the 4-bit code values");
  check_array(quant_map, DType::f32, 16);
  weight.quant_map = floats_of(quant_map);
  // The dequantizer uses its own table (so does bitsandbytes' CUDA kernel); a map that is not the
  // standard one would be silently ignored, so it is refused instead.
  const auto standard = bnb_quant_map(weight.config.type == QuantType::nf4);
  for (int i = 0; i < 16; ++i)
    MT_USER_CHECK(std::fabs(weight.quant_map[i] - standard[i]) <= 1e-6f,
                  "bitsandbytes 4-bit weight: '{}.quant_map'[{}] is {}, but {} code {} is {}",
                  base, i, weight.quant_map[i], quant_type_name(weight.config.type), i,
                  standard[i]);
  return weight;
}

nlohmann::json quantization_config_json(const QuantConfig& config, DType compute_dtype) {
  validate_quant_config(config);
  MT_USER_CHECK(dtype_is_float(compute_dtype),
                "quantization_config: compute dtype {} is not float32, float16 or bfloat16",
                dtype_name(compute_dtype));
  nlohmann::json json;
  json["quant_method"] = "bitsandbytes";
  json["_load_in_8bit"] = false;
  json["_load_in_4bit"] = true;
  json["llm_int8_threshold"] = 6.0;
  json["llm_int8_skip_modules"] = nullptr;
  json["llm_int8_enable_fp32_cpu_offload"] = false;
  json["llm_int8_has_fp16_weight"] = false;
  json["bnb_4bit_quant_type"] = std::string(quant_type_name(config.type));
  json["bnb_4bit_use_double_quant"] = config.double_quant;
  json["bnb_4bit_compute_dtype"] = std::string(torch_dtype_name(compute_dtype));
  json["bnb_4bit_quant_storage"] = "uint8";
  json["load_in_4bit"] = true;
  json["load_in_8bit"] = false;
  return json;
}

BnbQuantizationConfig parse_quantization_config_json(const nlohmann::json& config) {
  const std::string where = "quantization_config";
  MT_USER_CHECK(config.is_object(), "{}: must be a JSON object, got {}", where, config.dump());
  const std::string method = json_field<std::string>(config, "quant_method", where);
  MT_USER_CHECK(method == "bitsandbytes",
                "{}: quant_method '{}' is not supported (only 'bitsandbytes')", where, method);
  auto flag = [&](const char* key, const char* private_key) {
    if (config.contains(key)) return json_field<bool>(config, key, where);
    if (config.contains(private_key)) return json_field<bool>(config, private_key, where);
    return false;
  };
  MT_USER_CHECK(!flag("load_in_8bit", "_load_in_8bit"),
                "{}: load_in_8bit (LLM.int8) is not supported; use load_in_4bit", where);
  MT_USER_CHECK(flag("load_in_4bit", "_load_in_4bit"), "{}: load_in_4bit must be true", where);

  BnbQuantizationConfig result;
  result.quant.type = QuantType::fp4;  // BitsAndBytesConfig's default
  result.quant.double_quant = false;
  if (config.contains("bnb_4bit_quant_type"))
    result.quant.type = parse_quant_type(
        json_field<std::string>(config, "bnb_4bit_quant_type", where), where + ".bnb_4bit_quant_type");
  if (config.contains("bnb_4bit_use_double_quant"))
    result.quant.double_quant = json_field<bool>(config, "bnb_4bit_use_double_quant", where);
  if (config.contains("bnb_4bit_compute_dtype") && !config["bnb_4bit_compute_dtype"].is_null()) {
    const std::string name = json_field<std::string>(config, "bnb_4bit_compute_dtype", where);
    MT_USER_CHECK(dtype_from_torch_name(name, &result.compute_dtype) &&
                      dtype_is_float(result.compute_dtype),
                  "{}: bnb_4bit_compute_dtype '{}' is not float32, float16 or bfloat16", where,
                  name);
  }
  if (config.contains("bnb_4bit_quant_storage") && !config["bnb_4bit_quant_storage"].is_null()) {
    result.quant_storage = json_field<std::string>(config, "bnb_4bit_quant_storage", where);
    static constexpr std::string_view kStorage[] = {"float16", "float32", "int8",
                                                     "uint8",   "float64", "bfloat16"};
    bool known = false;
    for (std::string_view name : kStorage) known = known || name == result.quant_storage;
    MT_USER_CHECK(known, "{}: bnb_4bit_quant_storage '{}' is not one transformers accepts", where,
                  result.quant_storage);
  }
  return result;
}

}  // namespace memtune
