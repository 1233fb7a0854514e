// merge, generate, logits (output_commands.h).
#include "memtune/cli/output_commands.h"

#include <filesystem>
#include <iostream>

#include "memtune/core/bytes.h"
#include "memtune/data/chat_template.h"
#include "memtune/data/tokenizer.h"
#include "memtune/io/json_util.h"
#include "memtune/io/safetensors.h"
#include "memtune/lora/merge.h"
#include "memtune/ops/device.h"
#include "memtune/quant/bnb_format.h"
#include "memtune/step/llama_generate.h"

namespace memtune {
namespace {

// "1,2,3", "1 2 3" or "[1, 2, 3]".
std::vector<int32_t> parse_token_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::string digits;
  const auto flush = [&] {
    if (digits.empty()) return;
    const long long value = std::stoll(digits);
    MT_USER_CHECK(value >= 0 && value <= INT32_MAX, "--input-ids: {} is not a token id", digits);
    ids.push_back(static_cast<int32_t>(value));
    digits.clear();
  };
  for (char c : text) {
    if (c >= '0' && c <= '9') digits += c;
    else if (c == ',' || c == ' ' || c == '[' || c == ']' || c == '\n' || c == '\t') flush();
    else mt_fail("--input-ids: unexpected '{}' in \"{}\" (expected ids such as 1,2,3)", c, text);
  }
  flush();
  return ids;
}

// --tokenizer, else the model folder's tokenizer.json, else the built-in byte tokenizer.
Tokenizer output_tokenizer(const OutputCommandOptions& o, const ModelSource& source) {
  if (!o.tokenizer.empty()) return Tokenizer::from_file(o.tokenizer);
  if (!source.checkpoint_dir.empty() && std::filesystem::is_regular_file(source.checkpoint_dir / "tokenizer.json"))
    return Tokenizer::from_file(source.checkpoint_dir / "tokenizer.json");
  return Tokenizer::byte_level();
}

// --input-ids as given; else the prompt, as transformers' tokenizer(prompt) encodes it (with
// <|begin_of_text|>) or, with --chat, the tokenizer's chat format (Llama 3, Qwen's ChatML,
// Mistral's [INST]: data/chat_template.h) with the generation prompt.
std::vector<int32_t> output_prompt_ids(const OutputCommandOptions& o, const Tokenizer& tokenizer) {
  MT_USER_CHECK(o.prompt.empty() != o.input_ids.empty(), "give exactly one of --prompt and --input-ids");
  if (!o.input_ids.empty()) return parse_token_ids(o.input_ids);
  if (!o.chat) return tokenizer.encode(o.prompt);
  std::vector<ChatMessage> messages;
  if (!o.system.empty()) messages.push_back({"system", o.system});
  messages.push_back({"user", o.prompt});
  return tokenizer.encode_plain(apply_chat_template(chat_format_of(tokenizer), messages, /*add_generation_prompt=*/true));
}

// --dtype, else the config's torch_dtype / dtype (as transformers' dtype="auto"), else f32.
DType output_compute_dtype(const OutputCommandOptions& o, const LlamaConfig& config) {
  if (o.dtype != "auto") return parse_float_dtype(o.dtype, "--dtype");
  DType dtype = DType::f32;
  if (dtype_from_torch_name(config.torch_dtype, &dtype) && dtype_is_float(dtype)) return dtype;
  return DType::f32;
}

InferenceSetup output_inference_setup(const OutputCommandOptions& o, const ModelSource& source) {
  InferenceSetup setup;
  setup.checkpoint_dir = source.checkpoint_dir;
  setup.adapter_dir = o.adapter;
  setup.compute_dtype = output_compute_dtype(o, source.config);
  if (o.load_in_4bit) setup.load_in_4bit = QuantConfig{};  // nf4, blocksize 64, double quant
  // A bitsandbytes 4-bit folder stays in 4 bits with its own settings, as transformers loads it
  // (from_pretrained of such a folder gives the 4-bit model without a quantization argument).
  if (!source.checkpoint_dir.empty() && std::filesystem::is_regular_file(source.checkpoint_dir / "config.json")) {
    const nlohmann::json config_json = read_json_file(source.checkpoint_dir / "config.json");
    if (config_json.contains("quantization_config")) {
      QuantConfig quant = parse_quantization_config_json(config_json["quantization_config"]).quant;
      // quantization_config has no blocksize: each weight's quant_state holds it. The first
      // 4-bit weight gives it (upload_quantized checks every other weight against it).
      const BaseCheckpoint base(source.checkpoint_dir, source.config);
      for (size_t i = 0; i < base.table().size(); ++i) {
        if (!base.is_4bit(i)) continue;
        const QuantConfig stored = base.read_4bit(i).config;
        quant.blocksize = stored.blocksize;
        quant.nested_blocksize = stored.nested_blocksize;
        break;
      }
      setup.load_in_4bit = quant;
    }
  }
  setup.seed = o.seed;
  return setup;
}

// Decoded text, with ids that the tokenizer does not know (a model vocabulary larger than the
// tokenizer's, as the toy models have) shown as <id>.
std::string output_text(const Tokenizer& tokenizer, std::span<const int32_t> ids) {
  std::string text;
  std::vector<int32_t> known;
  const auto flush = [&] {
    text += tokenizer.decode(known, /*skip_special_tokens=*/true);
    known.clear();
  };
  for (int32_t id : ids) {
    if (id < tokenizer.vocab_size()) {
      known.push_back(id);
    } else {
      flush();
      text += fmt::format("<{}>", id);
    }
  }
  flush();
  return text;
}

// What generate and logits start from: the model, its tokenizer, the prompt's ids (refused with
// `empty_message` when there are none), a backend and the inference setup.
struct Prompted {
  ModelSource source;
  Tokenizer tokenizer;
  std::vector<int32_t> ids;
  std::unique_ptr<Backend> backend;
  InferenceSetup setup;
};

Prompted prompted(const OutputCommandOptions& o, const char* empty_message) {
  ModelSource source = resolve_model(o.model);
  Tokenizer tokenizer = output_tokenizer(o, source);
  std::vector<int32_t> ids = output_prompt_ids(o, tokenizer);
  MT_USER_CHECK(!ids.empty(), "{}", empty_message);
  std::unique_ptr<Backend> backend = make_backend(o.device);
  InferenceSetup setup = output_inference_setup(o, source);
  return {std::move(source), std::move(tokenizer), std::move(ids), std::move(backend), std::move(setup)};
}

}  // namespace

int run_merge(const OutputCommandOptions& o) {
  MergeOptions options;
  if (o.dtype != "auto") options.dtype = parse_float_dtype(o.dtype, "--dtype");
  options.max_shard_bytes = parse_bytes(o.max_shard_size);
  MT_USER_CHECK(options.max_shard_bytes > 0, "--max_shard_size must be positive");
  const MergeReport report = merge_adapter(o.model, o.adapter, o.out, options);
  std::cout << fmt::format("wrote {}: {} merged projections, {}, {} weight file(s){}\n", o.out,
                           report.merged_projections, torch_dtype_name(report.dtype), report.weight_files.size(),
                           report.dequantized_4bit ? "; the 4-bit base was dequantized" : "");
  return 0;
}

int run_generate(const OutputCommandOptions& o) {
  MT_USER_CHECK(o.max_new_tokens > 0, "--max_new_tokens must be positive");
  Prompted p = prompted(o, "the prompt encodes to no tokens");
  const ModelSource& source = p.source;
  const Tokenizer& tokenizer = p.tokenizer;
  const std::vector<int32_t>& prompt = p.ids;
  InferenceSetup& setup = p.setup;
  Backend& backend = *p.backend;
  // A bound that keeps the KV cache's byte count within 64 bits for any model memtune reads; the
  // memory check (InferenceModel) refuses far less than this on a real machine.
  constexpr int64_t kMaxGenerationTokens = int64_t{1} << 24;
  MT_USER_CHECK(o.max_new_tokens <= kMaxGenerationTokens - static_cast<int64_t>(prompt.size()),
                "--max_new_tokens {}: the prompt ({} tokens) and the new tokens may hold at most {} tokens",
                o.max_new_tokens, prompt.size(), kMaxGenerationTokens);
  setup.generator.capacity = static_cast<int64_t>(prompt.size()) + o.max_new_tokens;
  // Longer prompts are prefilled in chunks (the later ones through the decode path).
  setup.generator.max_chunk = std::min<int64_t>(static_cast<int64_t>(prompt.size()), 4096);
  InferenceModel model(backend, source.config, setup);
  SamplingOptions sampling;
  sampling.max_new_tokens = o.max_new_tokens;
  sampling.temperature = o.temperature;
  sampling.top_p = o.top_p;
  sampling.seed = o.seed;
  sampling.stop_ids = stop_token_ids(source.config, source.checkpoint_dir);
  // A chat turn ends with <|eot_id|> (Llama 3 Instruct's generation_config lists it too).
  if (o.chat && tokenizer.eot_id() < source.config.vocab_size) sampling.stop_ids.push_back(tokenizer.eot_id());
  const GenerationResult result = generate_tokens(model.generator(), prompt, sampling, [&](int32_t token) {
    if (o.json) return;
    std::cout << output_text(tokenizer, std::span<const int32_t>(&token, 1)) << std::flush;
  });
  if (o.json) {
    const nlohmann::json line = {{"prompt_ids", prompt}, {"output_ids", result.tokens},
                                 {"text", output_text(tokenizer, result.tokens)}, {"stop_reason", result.stop_reason}};
    // A token may end inside a UTF-8 character: such bytes are written as U+FFFD.
    std::cout << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::cout << "\n";
  }
  return 0;
}

int run_logits(const OutputCommandOptions& o) {
  Prompted p = prompted(o, "no input tokens");
  const ModelSource& source = p.source;
  const std::vector<int32_t>& ids = p.ids;
  p.setup.generator.capacity = p.setup.generator.max_chunk = static_cast<int64_t>(ids.size());
  p.setup.generator.all_logits = true;
  InferenceModel model(*p.backend, source.config, p.setup);
  const std::vector<float> logits = model.generator().forward(ids, /*all_positions=*/true);
  const int64_t tokens = static_cast<int64_t>(ids.size());
  const std::vector<SafetensorsWriteEntry> entries = {
      {"logits", DType::f32, Shape{tokens, source.config.vocab_size}, logits.data()},
      {"input_ids", DType::i32, Shape{tokens}, ids.data()}};
  write_safetensors(o.out, entries, {{"format", "pt"}});
  std::cout << nlohmann::json{{"out", o.out}, {"tokens", tokens}, {"vocab", source.config.vocab_size}}.dump() << "\n";
  return 0;
}

}  // namespace memtune
