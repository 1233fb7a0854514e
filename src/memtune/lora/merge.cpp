#include "memtune/lora/merge.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <set>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"
#include "memtune/ops/backend.h"
#include "memtune/quant/bnb_format.h"
#include "memtune/quant/nf4.h"

namespace memtune {
namespace fs = std::filesystem;

namespace {

std::vector<float> tensor_to_f32(const SafetensorsTensor& t) {
  // safetensors data need not be aligned for its dtype: copy before reading it as numbers.
  std::vector<uint8_t> aligned(t.nbytes);
  if (t.nbytes > 0) std::memcpy(aligned.data(), t.data, t.nbytes);
  const int64_t n = t.shape.numel();
  std::vector<float> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[i] = load_as_f32(aligned.data(), t.dtype, i);
  return values;
}

// A key whose value is absent, null, false, "", [] or {} leaves PEFT's behaviour at its default.
bool is_set(const nlohmann::json& config, const char* key) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return false;
  if (it->is_boolean()) return it->get<bool>();
  if (it->is_string()) return !it->get<std::string>().empty();
  if (it->is_array() || it->is_object()) return !it->empty();
  return true;
}

// PEFT targets a module whose path equals a target_modules entry or ends with "." + the entry;
// the entries that pick one projection in every layer are "q_proj" and "self_attn.q_proj". A path
// with a layer index would pick single layers, which lora_table cannot express.
bool projection_of_target(const std::string& name, Projection* out) {
  for (Projection p : kAllProjections)
    if (name == projection_name(p) || name == projection_module(p)) {
      *out = p;
      return true;
    }
  return false;
}

std::string projection_list() {
  std::string names;
  for (Projection p : kAllProjections) {
    if (!names.empty()) names += ", ";
    names += projection_name(p);
  }
  return names;
}

}  // namespace

DType parse_float_dtype(const std::string& name, const std::string& what) {
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::f16;
  if (name == "f32" || name == "fp32" || name == "float32") return DType::f32;
  mt_fail("{} {}: expected bf16, f16 or f32", what, name);
}

LoraConfig read_peft_adapter_config(const fs::path& adapter_dir) {
  const fs::path path = adapter_dir / "adapter_config.json";
  MT_USER_CHECK(fs::is_regular_file(path), "{}: no adapter_config.json (not a PEFT adapter folder)",
                adapter_dir.string());
  return parse_peft_adapter_config(read_json_file(path), path.string());
}

LoraConfig parse_peft_adapter_config(const nlohmann::json& j, const std::string& where) {
  json_require_object(j, where);
  const std::string peft_type = json_get_or<std::string>(j, "peft_type", "LORA", where);
  MT_USER_CHECK(peft_type == "LORA", "{}: peft_type {}: only LoRA adapters can be applied", where,
                peft_type);
  // Each of these changes what the adapter computes in a way memtune does not implement; applying
  // the adapter without it would give quietly wrong outputs.
  for (const char* key : {"use_dora", "modules_to_save", "rank_pattern", "alpha_pattern",
                          "layers_to_transform", "fan_in_fan_out", "lora_bias", "exclude_modules",
                          "trainable_token_indices", "target_parameters", "use_qalora"})
    MT_USER_CHECK(!is_set(j, key), "{}: \"{}\" is set ({}); memtune applies plain LoRA only", where,
                  key, j[key].dump());
  const std::string bias = json_get_or<std::string>(j, "bias", "none", where);
  MT_USER_CHECK(bias == "none", "{}: bias \"{}\": adapters with biases are not supported", where, bias);

  LoraConfig config;
  config.r = json_get<int64_t>(j, "r", where);
  MT_USER_CHECK(config.r > 0, "{}: r {} must be positive", where, config.r);
  config.alpha = json_get_or<double>(j, "lora_alpha", 8.0, where);  // PEFT's default
  config.dropout = json_get_or<double>(j, "lora_dropout", 0.0, where);
  config.use_rslora = json_get_or<bool>(j, "use_rslora", false, where);
  const nlohmann::json& targets = json_require(j, "target_modules", where);
  if (targets.is_string()) {
    // PEFT reads any other string as a regular expression over module paths.
    const std::string text = targets.get<std::string>();
    Projection p;
    if (text == "all-linear") config.targets = LoraConfig::parse_targets(text);
    else if (projection_of_target(text, &p)) config.targets = {p};
    else mt_fail("{}: target_modules \"{}\": a regular expression is not supported; list the modules "
                 "({})", where, text, projection_list());
  } else {
    for (const std::string& name : json_as<std::vector<std::string>>(targets, where + ": target_modules")) {
      Projection p;
      MT_USER_CHECK(projection_of_target(name, &p),
                    "{}: target_modules entry \"{}\": memtune applies LoRA to every layer's {} only",
                    where, name, projection_list());
      if (!config.targets_projection(p)) config.targets.push_back(p);
    }
    // The table's order is the model's module order, whatever order the file lists them in.
    std::sort(config.targets.begin(), config.targets.end());
  }
  MT_USER_CHECK(!config.targets.empty(), "{}: target_modules is empty", where);
  return config;
}

PeftAdapter PeftAdapter::read(const fs::path& adapter_dir, const LlamaConfig& model) {
  PeftAdapter adapter;
  adapter.config = read_peft_adapter_config(adapter_dir);
  adapter.specs = lora_table(model, adapter.config);
  MT_USER_CHECK(fs::is_regular_file(adapter_dir / "adapter_model.safetensors"),
                "{}: no adapter_model.safetensors (save the adapter with safe_serialization=True, "
                "PEFT's default)", adapter_dir.string());
  const SafetensorsCheckpoint file = SafetensorsCheckpoint::open(adapter_dir, "adapter_model.safetensors");
  std::set<std::string> expected;
  for (const LoraSpec& spec : adapter.specs) {
    adapter.a.push_back(tensor_to_f32(expect_tensor(file, spec.a_key, {DType::f32, DType::f16, DType::bf16}, spec.a_shape)));
    adapter.b.push_back(tensor_to_f32(expect_tensor(file, spec.b_key, {DType::f32, DType::f16, DType::bf16}, spec.b_shape)));
    expected.insert(spec.a_key);
    expected.insert(spec.b_key);
  }
  for (const std::string& name : file.names())
    MT_USER_CHECK(expected.count(name) != 0,
                  "{}: tensor '{}' is not a lora_A / lora_B weight of the configured target modules "
                  "({}); memtune would ignore it", file.source_name(), name, adapter.config.targets_string());
  return adapter;
}

int PeftAdapter::find(int layer, Projection projection) const {
  for (size_t i = 0; i < specs.size(); ++i)
    if (specs[i].layer == layer && specs[i].projection == projection) return static_cast<int>(i);
  return -1;
}

BaseCheckpoint::BaseCheckpoint(const fs::path& model_dir, const LlamaConfig& config)
    : checkpoint_(SafetensorsCheckpoint::open(model_dir)), table_(base_parameter_table(config)) {
  quantized_.assign(table_.size(), false);
  dtypes_.assign(table_.size(), DType::f32);
  for (size_t i = 0; i < table_.size(); ++i) {
    const ParamSpec& spec = table_[i];
    if (spec.kind == ParamKind::linear) {
      const SafetensorsTensor* state = checkpoint_.find(spec.hf_key + ".quant_state.bitsandbytes__nf4");
      if (state == nullptr) state = checkpoint_.find(spec.hf_key + ".quant_state.bitsandbytes__fp4");
      if (state != nullptr) {
        // The dtype it was quantized from, from the quant state (read whole by read_f32).
        nlohmann::json json;
        try {
          json = nlohmann::json::parse(state->data, state->data + state->nbytes);
        } catch (const nlohmann::json::exception& e) {
          mt_fail("{}: quant state of {} is not valid JSON: {}", checkpoint_.source_name(), spec.hf_key, e.what());
        }
        DType dtype = DType::bf16;
        std::string name = "bfloat16";  // bitsandbytes' default when the state names none
        if (json.is_object() && json.contains("dtype") && json["dtype"].is_string()) name = json["dtype"];
        MT_USER_CHECK(dtype_from_torch_name(name, &dtype) && dtype_is_float(dtype),
                      "{}: quant state of {}: dtype '{}'", checkpoint_.source_name(), spec.hf_key, name);
        quantized_[i] = true;
        dtypes_[i] = dtype;
        has_4bit_ = true;
        continue;
      }
    }
    dtypes_[i] = expect_tensor(checkpoint_, spec.hf_key, {DType::f32, DType::f16, DType::bf16}, spec.shape).dtype;
  }
}

const SafetensorsTensor* BaseCheckpoint::dense(size_t index) const {
  return quantized_[index] ? nullptr : checkpoint_.find(table_[index].hf_key);
}

std::vector<float> BaseCheckpoint::read_f32(size_t index) const {
  const ParamSpec& spec = table_[index];
  if (!quantized_[index]) return tensor_to_f32(*checkpoint_.find(spec.hf_key));
  const QuantizedWeight weight = read_4bit(index);
  std::vector<float> values(static_cast<size_t>(spec.shape.numel()));
  dequantize_4bit(weight, values.data(), DType::f32);
  return values;
}

QuantizedWeight BaseCheckpoint::read_4bit(size_t index) const {
  const ParamSpec& spec = table_[index];
  MT_ASSERT(quantized_[index], "BaseCheckpoint::read_4bit: {} is not 4-bit", spec.hf_key);
  std::map<std::string, NamedArray, std::less<>> arrays;
  const auto lookup = [&](std::string_view name) -> const NamedArray* {
    if (auto it = arrays.find(name); it != arrays.end()) return &it->second;
    const SafetensorsTensor* t = checkpoint_.find(name);
    if (t == nullptr) return nullptr;
    NamedArray array{std::string(name), t->dtype, t->shape, std::vector<uint8_t>(t->data, t->data + t->nbytes)};
    return &arrays.emplace(std::string(name), std::move(array)).first->second;
  };
  const std::string prefix = spec.hf_key.substr(0, spec.hf_key.size() - std::string(".weight").size());
  return from_bnb_arrays(lookup, prefix, spec.shape);
}

void BaseCheckpoint::release(size_t index) const {
  const std::string& key = table_[index].hf_key;
  if (const SafetensorsTensor* t = checkpoint_.find(key)) checkpoint_.file_of(key).release_pages(*t);
}

namespace {

// fp32 values written as `dtype`, converted a slice at a time (no second full-size copy).
void write_converted(FileSink& sink, const std::vector<float>& values, DType dtype) {
  if (dtype == DType::f32) {
    sink.write(values.data(), values.size() * sizeof(float));
    return;
  }
  constexpr size_t kSlice = 1 << 16;
  std::vector<uint16_t> bits(kSlice);
  for (size_t begin = 0; begin < values.size(); begin += kSlice) {
    const size_t count = std::min(kSlice, values.size() - begin);
    for (size_t i = 0; i < count; ++i)
      bits[i] = dtype == DType::bf16 ? f32_to_bf16_bits(values[begin + i]) : f32_to_f16_bits(values[begin + i]);
    sink.write(bits.data(), count * sizeof(uint16_t));
  }
}

bool same_path(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  return fs::weakly_canonical(a, ec) == fs::weakly_canonical(b, ec);
}

// The files beside the weights that a Hugging Face model folder carries, copied when present.
constexpr const char* kCompanionFiles[] = {
    "generation_config.json", "tokenizer.json",     "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model",        "added_tokens.json",  "chat_template.jinja",   "chat_template.json"};

// Refuses an out_dir that is an input folder, or a non-empty folder that is not a model folder.
void check_out_dir(const fs::path& out_dir, std::initializer_list<fs::path> inputs) {
  for (const fs::path& input : inputs)
    MT_USER_CHECK(!same_path(out_dir, input), "--out {} would replace an input folder; write the model elsewhere",
                  out_dir.string());
  if (fs::exists(out_dir)) {
    MT_USER_CHECK(fs::is_directory(out_dir), "--out {} exists and is not a folder", out_dir.string());
    MT_USER_CHECK(fs::is_empty(out_dir) || fs::exists(out_dir / "config.json"),
                  "--out {} is a non-empty folder without config.json; refusing to replace it",
                  out_dir.string());
  }
}

// `fill` writes the folder's files into a sibling staging folder, which then replaces out_dir
// (an existing one is set aside until the new one is in place); a failure removes the staging
// folder and leaves out_dir as it was.
void write_folder_atomically(const fs::path& out_dir, const std::string& tag,
                             const std::function<void(const fs::path& staging)>& fill) {
  const fs::path parent = out_dir.has_parent_path() ? out_dir.parent_path() : fs::path(".");
  fs::create_directories(parent);
  const std::string pid = std::to_string(::getpid());
  const fs::path staging = parent / (out_dir.filename().string() + "." + tag + "-partial-" + pid);
  fs::remove_all(staging);
  fs::create_directories(staging);
  try {
    fill(staging);
    const fs::path old = parent / (out_dir.filename().string() + "." + tag + "-old-" + pid);
    fs::remove_all(old);
    const bool replacing = fs::exists(out_dir);
    if (replacing) fs::rename(out_dir, old);
    try {
      fs::rename(staging, out_dir);
    } catch (...) {
      if (replacing) fs::rename(old, out_dir);
      throw;
    }
    if (replacing) fs::remove_all(old);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
}

void copy_companion_files(const fs::path& model_dir, const fs::path& staging) {
  for (const char* name : kCompanionFiles)
    if (fs::is_regular_file(model_dir / name)) fs::copy_file(model_dir / name, staging / name);
}

}  // namespace

MergeReport merge_adapter(const fs::path& model_dir, const fs::path& adapter_dir, const fs::path& out_dir,
                          const MergeOptions& options) {
  MT_USER_CHECK(fs::is_regular_file(model_dir / "config.json"), "{}: not a model folder (no config.json)",
                model_dir.string());
  check_out_dir(out_dir, {model_dir, adapter_dir});
  nlohmann::json config_json = read_json_file(model_dir / "config.json");
  const LlamaConfig config = LlamaConfig::from_json(config_json, (model_dir / "config.json").string());
  const PeftAdapter adapter = PeftAdapter::read(adapter_dir, config);
  const BaseCheckpoint base(model_dir, config);

  MergeReport report;
  report.dtype = options.dtype.value_or(base.dtype(0));  // table[0] is embed_tokens
  report.dequantized_4bit = base.has_4bit();
  const float scale = adapter.config.scaling();
  std::unique_ptr<Backend> cpu = make_cpu_backend();  // its GEMM is blocked and multi-threaded

  std::vector<SafetensorsWriteEntry> entries;
  for (size_t i = 0; i < base.table().size(); ++i) {
    const ParamSpec& spec = base.table()[i];
    const int lora = spec.kind == ParamKind::linear ? adapter.find(spec.layer, spec.projection) : -1;
    report.merged_projections += lora >= 0;
    entries.push_back({spec.hf_key, report.dtype, spec.shape, nullptr, [&, i, lora](FileSink& sink) {
      std::vector<float> weight = base.read_f32(i);
      base.release(i);
      if (lora >= 0) {
        const LoraSpec& l = adapter.specs[lora];
        const Tensor w{weight.data(), DType::f32, base.table()[i].shape, Device::cpu};
        const Tensor b{const_cast<float*>(adapter.b[lora].data()), DType::f32, l.b_shape, Device::cpu};
        const Tensor a{const_cast<float*>(adapter.a[lora].data()), DType::f32, l.a_shape, Device::cpu};
        cpu->matmul(w, b, false, a, false, scale, 1.0f);  // W += scale * (B @ A), in fp32
      }
      write_converted(sink, weight, report.dtype);
    }});
  }

  write_folder_atomically(out_dir, "merge", [&](const fs::path& staging) {
    report.weight_files = write_sharded_safetensors(staging, entries, options.max_shard_bytes, {{"format", "pt"}});
    for (fs::path& file : report.weight_files) file = out_dir / file.filename();
    // The merged weights are dense in the output dtype: the base's quantization no longer applies.
    config_json.erase("quantization_config");
    const std::string torch_name(torch_dtype_name(report.dtype));
    bool has_dtype_key = false;
    for (const char* key : {"torch_dtype", "dtype"})
      if (config_json.contains(key)) config_json[key] = torch_name, has_dtype_key = true;
    if (!has_dtype_key) config_json["torch_dtype"] = torch_name;  // read by transformers 4 and 5
    write_file_atomic(staging / "config.json", config_json.dump(2) + "\n");
    copy_companion_files(model_dir, staging);
  });
  return report;
}

QuantizeReport quantize_checkpoint(const fs::path& model_dir, const fs::path& out_dir,
                                   const QuantConfig& quant, const QuantizeOptions& options) {
  validate_quant_config(quant);
  MT_USER_CHECK(fs::is_regular_file(model_dir / "config.json"), "{}: not a model folder (no config.json)",
                model_dir.string());
  check_out_dir(out_dir, {model_dir});
  nlohmann::json config_json = read_json_file(model_dir / "config.json");
  const LlamaConfig config = LlamaConfig::from_json(config_json, (model_dir / "config.json").string());
  const BaseCheckpoint base(model_dir, config);
  MT_USER_CHECK(!base.has_4bit(), "{}: already holds bitsandbytes 4-bit weights; quantize a dense checkpoint",
                model_dir.string());

  QuantizeReport report;
  // Each projection is quantized from its stored dtype, as bitsandbytes quantizes the loaded weight.
  std::vector<std::vector<NamedArray>> quantized(base.table().size());
  std::vector<SafetensorsWriteEntry> entries;
  for (size_t i = 0; i < base.table().size(); ++i) {
    const ParamSpec& spec = base.table()[i];
    const SafetensorsTensor& t = *base.dense(i);
    if (spec.kind != ParamKind::linear) {
      entries.push_back({spec.hf_key, t.dtype, t.shape, t.data});
      continue;
    }
    const std::vector<uint8_t> aligned(t.data, t.data + t.nbytes);
    const QuantizedWeight weight = quantize_4bit(aligned.data(), t.dtype, spec.shape, quant, spec.hf_key);
    quantized[i] = to_bnb_arrays(weight, spec.hf_key.substr(0, spec.hf_key.size() - std::string(".weight").size()));
    for (const NamedArray& a : quantized[i]) entries.push_back({a.name, a.dtype, a.shape, a.bytes.data()});
    ++report.quantized_projections;
  }
  config_json["quantization_config"] = quantization_config_json(quant, options.compute_dtype.value_or(base.dtype(0)));
  write_folder_atomically(out_dir, "quantize", [&](const fs::path& staging) {
    report.weight_files = write_sharded_safetensors(staging, entries, options.max_shard_bytes, {{"format", "pt"}});
    for (fs::path& file : report.weight_files) file = out_dir / file.filename();
    write_file_atomic(staging / "config.json", config_json.dump(2) + "\n");
    copy_companion_files(model_dir, staging);
  });
  return report;
}

}  // namespace memtune
