// A PEFT LoRA adapter merged into its base model and written as a Hugging Face model folder
// (`memtune merge`), and the two readers that merging and inference (step/llama_generate.h)
// share: base checkpoints, dense or bitsandbytes 4-bit, and PEFT adapters.
//
// Merge, per targeted projection (PEFT's merge_and_unload): W' = W + scale * (B @ A), with W, B
// and A in fp32 and the sum rounded once to the output dtype (torch's in-place `W += delta` on a
// 16-bit W rounds the fp32 sum the same way). A 4-bit base is dequantized first (code value *
// absmax in fp32, SPECS.md §1), so W' is the dense weight that the QLoRA forward used plus the
// adapter; the output then holds no quantization_config.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "memtune/io/safetensors.h"
#include "memtune/lora/lora_config.h"
#include "memtune/model/llama_config.h"
#include "memtune/model/param_table.h"
#include "memtune/quant/nf4.h"

namespace memtune {

// adapter_config.json of a PEFT LoRA adapter. memtune::Error for a config that memtune cannot
// apply exactly (another peft_type, DoRA, biases, modules_to_save, per-layer rank or alpha
// patterns, layers_to_transform, fan_in_fan_out, targets other than the seven projections, a
// regex target_modules), naming the key.
LoraConfig read_peft_adapter_config(const std::filesystem::path& adapter_dir);
// The same from the file's parsed JSON; `where` names it in errors.
LoraConfig parse_peft_adapter_config(const nlohmann::json& config, const std::string& where);

// A PEFT adapter in host memory: its config and every lora_A / lora_B in fp32.
struct PeftAdapter {
  LoraConfig config;
  std::vector<LoraSpec> specs;           // lora_table(model, config)
  std::vector<std::vector<float>> a, b;  // parallel to specs: [r, in] and [out, r]

  // adapter_config.json + adapter_model.safetensors. memtune::Error for a missing tensor, a
  // wrong shape or dtype, or a tensor in the file that is not one of the specs (which would
  // otherwise be silently dropped).
  static PeftAdapter read(const std::filesystem::path& adapter_dir, const LlamaConfig& model);
  // Index into specs of (layer, projection), or -1.
  int find(int layer, Projection projection) const;
};

// The parameters of a base checkpoint folder (config.json + safetensors), each readable as fp32.
// A linear weight saved by bitsandbytes in 4 bits (P.weight.quant_state.bitsandbytes__nf4 /
// __fp4 beside it, SPECS.md §1) is dequantized; everything else must be f32, f16 or bf16.
class BaseCheckpoint {
 public:
  BaseCheckpoint(const std::filesystem::path& model_dir, const LlamaConfig& config);

  const std::vector<ParamSpec>& table() const { return table_; }
  // Whether any parameter is stored in 4 bits.
  bool has_4bit() const { return has_4bit_; }
  bool is_4bit(size_t index) const { return quantized_[index]; }
  // The dtype the parameter has (for a 4-bit weight: the dtype it was quantized from).
  DType dtype(size_t index) const { return dtypes_[index]; }
  // The stored tensor of a dense parameter (valid while this object lives); null for 4-bit.
  const SafetensorsTensor* dense(size_t index) const;
  // table()[index] as fp32 values (numel of its shape).
  std::vector<float> read_f32(size_t index) const;
  // A 4-bit parameter (is_4bit(index)) as bitsandbytes saved it, checked by from_bnb_arrays
  // against the table's shape.
  QuantizedWeight read_4bit(size_t index) const;
  // Lets the kernel drop the file pages behind a parameter once it has been read.
  void release(size_t index) const;

 private:
  SafetensorsCheckpoint checkpoint_;
  std::vector<ParamSpec> table_;
  std::vector<bool> quantized_;
  std::vector<DType> dtypes_;
  bool has_4bit_ = false;
};

struct MergeOptions {
  std::optional<DType> dtype;                   // default: the base's (embed_tokens') dtype
  uint64_t max_shard_bytes = 5'000'000'000ull;  // transformers' default max_shard_size "5GB"
};

struct MergeReport {
  DType dtype = DType::f32;
  int64_t merged_projections = 0;  // weights that received an adapter
  bool dequantized_4bit = false;
  std::vector<std::filesystem::path> weight_files;  // as written into out_dir (index last)
};

// Writes out_dir: config.json (torch_dtype / dtype set to the output dtype, no
// quantization_config), the weights (model.safetensors, or model-0000i-of-0000N.safetensors +
// model.safetensors.index.json past max_shard_bytes), and the tokenizer and generation files of
// model_dir that exist. Atomic: everything is written into a sibling staging folder that is then
// renamed into place, so a failure leaves an existing out_dir as it was. Host memory holds one
// parameter in fp32 at a time.
MergeReport merge_adapter(const std::filesystem::path& model_dir,
                          const std::filesystem::path& adapter_dir,
                          const std::filesystem::path& out_dir, const MergeOptions& options);

struct QuantizeOptions {
  std::optional<DType> compute_dtype;           // bnb_4bit_compute_dtype; default: the base's dtype
  uint64_t max_shard_bytes = 5'000'000'000ull;
};

struct QuantizeReport {
  int64_t quantized_projections = 0;
  std::vector<std::filesystem::path> weight_files;  // as written into out_dir (index last)
};

// Writes out_dir as a bitsandbytes 4-bit Hugging Face folder: every projection of the dense
// checkpoint in model_dir quantized by quantize_4bit (from its stored dtype) and saved under
// bitsandbytes' key names (to_bnb_arrays), embeddings and norms as stored, config.json with
// quantization_config (quantization_config_json), and the tokenizer and generation files.
// Atomic as merge_adapter. A checkpoint that already holds 4-bit weights is refused.
QuantizeReport quantize_checkpoint(const std::filesystem::path& model_dir,
                                   const std::filesystem::path& out_dir, const QuantConfig& quant,
                                   const QuantizeOptions& options = {});

// "bf16" / "bfloat16", "f16" / "fp16" / "float16", "f32" / "fp32" / "float32"; memtune::Error
// naming `what` otherwise.
DType parse_float_dtype(const std::string& name, const std::string& what);

}  // namespace memtune
