#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <random>

#include "memtune/core/error.h"
#include "memtune/quant/bnb_format.h"
#include "memtune/quant/nf4.h"
#include "../support/expect_error.h"

using namespace memtune;

namespace {

const std::string kPrefix = "model.layers.0.self_attn.q_proj";

QuantizedWeight sample_weight(QuantType type, bool double_quant, Shape shape = Shape{33, 70}) {
  std::mt19937 rng(29);
  std::normal_distribution<float> normal(0.0f, 0.04f);
  std::vector<uint16_t> values(static_cast<size_t>(shape.numel()));
  for (auto& v : values) v = f32_to_bf16_bits(normal(rng));
  QuantConfig config;
  config.type = type;
  config.double_quant = double_quant;
  return quantize_4bit(values.data(), DType::bf16, shape, config, "sample");
}

struct Store {
  std::map<std::string, NamedArray, std::less<>> arrays;
  explicit Store(const std::vector<NamedArray>& list) {
    for (const auto& a : list) arrays[a.name] = a;
  }
  std::function<const NamedArray*(std::string_view)> lookup() const {
    return [this](std::string_view name) -> const NamedArray* {
      auto it = arrays.find(name);
      return it == arrays.end() ? nullptr : &it->second;
    };
  }
  NamedArray& at(const std::string& suffix) { return arrays.at(kPrefix + ".weight" + suffix); }
  void set_json(const std::string& key_suffix, const std::string& json) {
    NamedArray& a = at(key_suffix);
    a.bytes.assign(json.begin(), json.end());
    a.shape = Shape{static_cast<int64_t>(a.bytes.size())};
  }
};

std::string error_of(const std::function<void()>& action) { return test::error_or_empty(action); }

void expect_same(const QuantizedWeight& a, const QuantizedWeight& b) {
  EXPECT_EQ(a.config, b.config);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.packed, b.packed);
  EXPECT_EQ(a.absmax, b.absmax);
  EXPECT_EQ(a.absmax_codes, b.absmax_codes);
  EXPECT_EQ(a.nested_absmax, b.nested_absmax);
  EXPECT_EQ(a.nested_offset, b.nested_offset);
  EXPECT_EQ(a.nested_quant_map, b.nested_quant_map);
  EXPECT_EQ(a.quant_map, b.quant_map);
}

}  // namespace

TEST(QuantBnbFormat, KeysShapesAndDtypes) {
  const QuantizedWeight w = sample_weight(QuantType::nf4, true);
  const auto arrays = to_bnb_arrays(w, kPrefix);
  ASSERT_EQ(arrays.size(), 6u);
  const std::string base = kPrefix + ".weight";
  EXPECT_EQ(arrays[0].name, base);
  EXPECT_EQ(arrays[0].dtype, DType::u8);
  EXPECT_EQ(arrays[0].shape, (Shape{1155, 1}));
  EXPECT_EQ(arrays[1].name, base + ".absmax");
  EXPECT_EQ(arrays[1].dtype, DType::u8);
  EXPECT_EQ(arrays[1].shape, (Shape{37}));
  EXPECT_EQ(arrays[2].name, base + ".quant_map");
  EXPECT_EQ(arrays[2].shape, (Shape{16}));
  EXPECT_EQ(arrays[3].name, base + ".nested_absmax");
  EXPECT_EQ(arrays[3].dtype, DType::f32);
  EXPECT_EQ(arrays[3].shape, (Shape{1}));
  EXPECT_EQ(arrays[4].name, base + ".nested_quant_map");
  EXPECT_EQ(arrays[4].shape, (Shape{256}));
  EXPECT_EQ(arrays[5].name, base + ".quant_state.bitsandbytes__nf4");
  EXPECT_EQ(arrays[5].dtype, DType::u8);

  const auto plain = to_bnb_arrays(sample_weight(QuantType::fp4, false), kPrefix);
  ASSERT_EQ(plain.size(), 4u);
  EXPECT_EQ(plain[1].dtype, DType::f32);
  EXPECT_EQ(plain[1].bytes.size(), 37u * 4);
  EXPECT_EQ(plain[3].name, base + ".quant_state.bitsandbytes__fp4");
}

TEST(QuantBnbFormat, QuantStateJsonIsPythonsJsonDumps) {
  QuantizedWeight w = sample_weight(QuantType::nf4, true, Shape{64, 96});
  w.dtype = DType::f32;
  w.nested_offset = 0.13204973936080933f;  // a value bitsandbytes wrote (fixture w64x96_f32)
  EXPECT_EQ(bnb_quant_state_json(w),
            "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", \"shape\": [64, "
            "96], \"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": "
            "0.13204973936080933}");
  // Python's float repr for other magnitudes (values printed by Python for these fp32 numbers).
  const std::pair<float, const char*> reprs[] = {
      {1.0f, "1.0"},
      {1e-05f, "9.999999747378752e-06"},
      {9.090909657010282e+28f, "9.090909657010282e+28"},
      {123456789012345.0f, "123456788103168.0"},
      {1e16f, "1.0000000272564224e+16"},
      {3.0517578125e-05f, "3.0517578125e-05"},
  };
  for (const auto& [value, text] : reprs) {
    w.nested_offset = value;
    const std::string json = bnb_quant_state_json(w);
    EXPECT_NE(json.find(std::string("\"nested_offset\": ") + text + "}"), std::string::npos)
        << json;
  }
  const QuantizedWeight plain = sample_weight(QuantType::fp4, false, Shape{7});
  EXPECT_EQ(bnb_quant_state_json(plain),
            "{\"quant_type\": \"fp4\", \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": [7]}");
}

TEST(QuantBnbFormat, RoundTrip) {
  for (QuantType type : {QuantType::nf4, QuantType::fp4}) {
    for (bool dq : {false, true}) {
      const QuantizedWeight w = sample_weight(type, dq);
      Store store(to_bnb_arrays(w, kPrefix));
      const QuantizedWeight back = from_bnb_arrays(store.lookup(), kPrefix, Shape{33, 70});
      expect_same(w, back);
      std::vector<float> a(33 * 70), b(33 * 70);
      dequantize_4bit(w, a.data(), DType::f32);
      dequantize_4bit(back, b.data(), DType::f32);
      EXPECT_EQ(a, b);
    }
  }
}

namespace {

// The message from_bnb_arrays gives for a weight's arrays after `edit` ("" when it accepts them).
std::string error_after_edit(const QuantizedWeight& w, const std::function<void(Store&)>& edit,
                             const std::optional<Shape>& expected_shape = std::nullopt) {
  Store store(to_bnb_arrays(w, kPrefix));
  edit(store);
  return error_of([&] { from_bnb_arrays(store.lookup(), kPrefix, expected_shape); });
}

// Replaces `from` by `to` in the quant state's JSON.
void edit_quant_state(Store& store, const std::string& from, const std::string& to) {
  const std::vector<uint8_t>& bytes = store.at(".quant_state.bitsandbytes__nf4").bytes;
  std::string json(bytes.begin(), bytes.end());
  json.replace(json.find(from), from.size(), to);
  store.set_json(".quant_state.bitsandbytes__nf4", json);
}

}  // namespace

TEST(QuantBnbFormat, MissingAndInconsistentEntries) {
  const QuantizedWeight w = sample_weight(QuantType::nf4, true);
  const std::string base = kPrefix + ".weight";
  const auto erase = [&](const std::string& suffix) {
    return [&, suffix](Store& store) { store.arrays.erase(base + suffix); };
  };
  EXPECT_CONTAINS(error_after_edit(w, erase(".quant_state.bitsandbytes__nf4")), "no quant state");
  EXPECT_CONTAINS(error_after_edit(w, erase(".absmax")), "missing '" + base + ".absmax'");
  EXPECT_CONTAINS(error_after_edit(w, erase(".nested_quant_map")), "nested_quant_map");
  EXPECT_CONTAINS(error_after_edit(w, erase(".nested_absmax")), "must come together");  // JSON still has nested_offset
  EXPECT_CONTAINS(error_after_edit(w,
                                   [](Store& store) {
                                     store.at(".absmax").bytes.pop_back();
                                     store.at(".absmax").shape = Shape{36};
                                   }),
                  "expected 37 elements");
  EXPECT_CONTAINS(error_after_edit(w,
                                   [](Store& store) {
                                     store.at("").bytes.resize(100);
                                     store.at("").shape = Shape{100, 1};
                                   }),
                  "needs 1155 bytes");
  EXPECT_CONTAINS(error_after_edit(w, [](Store&) {}, Shape{70, 33}), "shape [33, 70] but the model expects [70, 33]");
  EXPECT_CONTAINS(error_after_edit(w, [](Store& store) { edit_quant_state(store, "\"nf4\"", "\"int4\""); }),
                  "unknown 4-bit quant type 'int4'");
  EXPECT_CONTAINS(error_after_edit(w, [](Store& store) { edit_quant_state(store, "\"nf4\"", "\"fp4\""); }),
                  "contradicts");
  EXPECT_CONTAINS(error_after_edit(w, [](Store& store) {
                    edit_quant_state(store, "\"blocksize\": 64", "\"blocksize\": 48");
                  }),
                  "blocksize 48");
  EXPECT_CONTAINS(error_after_edit(w, [](Store& store) { store.set_json(".quant_state.bitsandbytes__nf4", "{not json"); }),
                  "not valid JSON");
  EXPECT_CONTAINS(error_after_edit(w,
                                   [](Store& store) {
                                     reinterpret_cast<float*>(store.at(".quant_map").bytes.data())[3] = 0.25f;
                                   }),
                  "quant_map'[3]");
  EXPECT_CONTAINS(error_after_edit(w,
                                   [&](Store& store) {
                                     NamedArray twin = store.at(".quant_state.bitsandbytes__nf4");
                                     twin.name = base + ".quant_state.bitsandbytes__fp4";
                                     store.arrays[twin.name] = twin;
                                   }),
                  "both");
  EXPECT_CONTAINS(error_after_edit(w, [](Store& store) { store.at(".nested_absmax").dtype = DType::bf16; }),
                  "has dtype bf16");
}

TEST(QuantBnbFormat, OtherQuantStorageIsAccepted) {
  // bitsandbytes' quant_storage=torch.bfloat16 (QLoRA + FSDP) stores the same bytes as bf16.
  const QuantizedWeight w = sample_weight(QuantType::nf4, false, Shape{64, 64});
  Store store(to_bnb_arrays(w, kPrefix));
  store.at("").dtype = DType::bf16;
  store.at("").shape = Shape{1024, 1};
  EXPECT_EQ(from_bnb_arrays(store.lookup(), kPrefix).packed, w.packed);
}

TEST(QuantBnbFormat, QuantizationConfigJson) {
  const QuantConfig seed;  // nf4, double quant
  const nlohmann::json json = quantization_config_json(seed, DType::bf16);
  const nlohmann::json expected = nlohmann::json::parse(R"({
    "_load_in_4bit": true, "_load_in_8bit": false, "bnb_4bit_compute_dtype": "bfloat16",
    "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": true, "llm_int8_enable_fp32_cpu_offload": false,
    "llm_int8_has_fp16_weight": false, "llm_int8_skip_modules": null, "llm_int8_threshold": 6.0,
    "load_in_4bit": true, "load_in_8bit": false, "quant_method": "bitsandbytes"})");
  EXPECT_EQ(json, expected);
  const BnbQuantizationConfig parsed = parse_quantization_config_json(json);
  EXPECT_EQ(parsed.quant, seed);
  EXPECT_EQ(parsed.compute_dtype, DType::bf16);
  EXPECT_EQ(parsed.quant_storage, "uint8");

  QuantConfig fp4;
  fp4.type = QuantType::fp4;
  fp4.double_quant = false;
  const BnbQuantizationConfig back =
      parse_quantization_config_json(quantization_config_json(fp4, DType::f16));
  EXPECT_EQ(back.quant, fp4);
  EXPECT_EQ(back.compute_dtype, DType::f16);
}

TEST(QuantBnbFormat, QuantizationConfigDefaultsAndErrors) {
  // transformers' defaults: fp4, no double quant, float32 compute.
  const BnbQuantizationConfig minimal = parse_quantization_config_json(
      nlohmann::json::parse(R"({"quant_method": "bitsandbytes", "load_in_4bit": true})"));
  EXPECT_EQ(minimal.quant.type, QuantType::fp4);
  EXPECT_FALSE(minimal.quant.double_quant);
  EXPECT_EQ(minimal.compute_dtype, DType::f32);
  const BnbQuantizationConfig private_flag = parse_quantization_config_json(nlohmann::json::parse(
      R"({"quant_method": "bitsandbytes", "_load_in_4bit": true,
          "bnb_4bit_compute_dtype": "torch.float16"})"));
  EXPECT_EQ(private_flag.compute_dtype, DType::f16);

  auto error_for = [](const char* text) {
    return error_of([&] { parse_quantization_config_json(nlohmann::json::parse(text)); });
  };
  EXPECT_NE(error_for(R"({"quant_method": "gptq", "load_in_4bit": true})").find("gptq"),
            std::string::npos);
  EXPECT_NE(error_for(R"({"load_in_4bit": true})").find("quant_method"), std::string::npos);
  EXPECT_NE(error_for(R"({"quant_method": "bitsandbytes", "load_in_8bit": true})").find("8bit"),
            std::string::npos);
  EXPECT_NE(error_for(R"({"quant_method": "bitsandbytes"})").find("load_in_4bit must be true"),
            std::string::npos);
  EXPECT_NE(error_for(R"({"quant_method": "bitsandbytes", "load_in_4bit": true,
                          "bnb_4bit_quant_type": "int4"})").find("int4"),
            std::string::npos);
  EXPECT_NE(error_for(R"({"quant_method": "bitsandbytes", "load_in_4bit": "yes"})")
                .find("must be true or false"),
            std::string::npos);
  EXPECT_NE(error_for(R"({"quant_method": "bitsandbytes", "load_in_4bit": true,
                          "bnb_4bit_compute_dtype": "float64"})").find("float64"),
            std::string::npos);
  EXPECT_NE(error_for(R"({"quant_method": "bitsandbytes", "load_in_4bit": true,
                          "bnb_4bit_quant_storage": "int4"})").find("quant_storage"),
            std::string::npos);
  EXPECT_THROW(quantization_config_json(QuantConfig{}, DType::u8), Error);
}

// torch dtype names as bitsandbytes' quant_state and config.json's torch_dtype hold them: the
// names torch_dtype_name writes, with or without "torch.", and torch's short aliases.
TEST(BnbFormat, TorchDtypeNamesReadBackWithTheirAliases) {
  for (DType dtype : {DType::f32, DType::f16, DType::bf16, DType::u8, DType::i32}) {
    DType read = DType::u8;
    ASSERT_TRUE(dtype_from_torch_name(torch_dtype_name(dtype), &read)) << torch_dtype_name(dtype);
    EXPECT_EQ(read, dtype);
    ASSERT_TRUE(dtype_from_torch_name("torch." + std::string(torch_dtype_name(dtype)), &read));
    EXPECT_EQ(read, dtype);
  }
  const std::pair<const char*, DType> aliases[] = {{"float", DType::f32}, {"torch.half", DType::f16}, {"int", DType::i32}};
  for (const auto& [name, dtype] : aliases) {
    DType read = DType::u8;
    ASSERT_TRUE(dtype_from_torch_name(name, &read)) << name;
    EXPECT_EQ(read, dtype) << name;
  }
  DType untouched = DType::bf16;
  EXPECT_FALSE(dtype_from_torch_name("float64", &untouched));
  EXPECT_EQ(untouched, DType::bf16);
}
