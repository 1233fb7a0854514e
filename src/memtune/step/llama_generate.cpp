#include "memtune/step/llama_generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "memtune/core/bytes.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/device.h"

namespace memtune {

DeviceAdapter DeviceAdapter::allocate(Memory& memory, const LlamaConfig& model, const LoraConfig& config) {
  DeviceAdapter adapter;
  adapter.config = config;
  adapter.specs = lora_table(model, config);
  adapter.index.assign(model.num_hidden_layers * kNumProjections, -1);
  for (size_t i = 0; i < adapter.specs.size(); ++i) {
    const LoraSpec& spec = adapter.specs[i];
    adapter.index[spec.layer * kNumProjections + static_cast<int>(spec.projection)] = static_cast<int>(i);
    adapter.a.push_back(memory.alloc(spec.a_key, MemCategory::adapters, DType::f32, spec.a_shape));
    adapter.b.push_back(memory.alloc(spec.b_key, MemCategory::adapters, DType::f32, spec.b_shape));
  }
  return adapter;
}

void DeviceAdapter::upload(Backend& backend, const PeftAdapter& adapter) const {
  MT_ASSERT(adapter.specs.size() == specs.size(), "adapter of {} tensors into {}", adapter.specs.size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    backend.copy_from_host(a[i], adapter.a[i].data());
    backend.copy_from_host(b[i], adapter.b[i].data());
  }
}

LlamaGenerator::LlamaGenerator(Backend& backend, Memory& memory, const LlamaConfig& config,
                               const ModelWeights& weights, const DeviceAdapter* adapter,
                               const GeneratorOptions& options)
    : backend_(backend), config_(config), weights_(weights), adapter_(adapter), options_(options) {
  MT_ASSERT(options.capacity > 0 && options.max_chunk > 0 && options.max_chunk <= options.capacity,
            "generator: capacity {} and max_chunk {}", options.capacity, options.max_chunk);
  if (adapter_ != nullptr) lora_scale_ = adapter_->config.scaling();
  const DType cd = options.compute_dtype;
  const int64_t n = options.max_chunk;
  const MemCategory transient = MemCategory::transient_activations;
  MT_USER_CHECK(config.sliding_window == 0 || options.capacity <= config.sliding_window,
                "generate: a KV cache of {} tokens outgrows the model's \"sliding_window\" {}, and "
                "the generator's attention (prefill and decode) has no sliding-window mask yet; "
                "generate at most {} tokens in all",
                options.capacity, config.sliding_window, config.sliding_window);
  inv_freq_ = memory.alloc("rope.inv_freq", MemCategory::workspace, DType::f32, Shape{config.head_dim / 2});
  if (memory.device() != Device::meta) {
    const std::vector<float> inv_freq = rope_inv_freq(config);
    backend_.copy_from_host(inv_freq_, inv_freq.data());
  }
  // The cache is the state that outlives a forward: saved, like the activations a backward needs.
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    k_cache_.push_back(memory.alloc(fmt::format("kv_cache.layers.{}.k", l), MemCategory::saved_activations, cd,
                                    Shape{options.capacity, config.kv_dim()}));
    v_cache_.push_back(memory.alloc(fmt::format("kv_cache.layers.{}.v", l), MemCategory::saved_activations, cd,
                                    Shape{options.capacity, config.kv_dim()}));
  }
  ids_ = memory.alloc("generate.input_ids", transient, DType::i32, Shape{n});
  positions_ = memory.alloc("generate.positions", transient, DType::i32, Shape{n});
  residual_ = memory.alloc("generate.residual", transient, cd, Shape{n, config.hidden_size});
  normed_ = memory.alloc("generate.normed", transient, cd, Shape{n, config.hidden_size});
  rstd_ = memory.alloc("generate.norm_rstd", transient, DType::f32, Shape{n});
  q_ = memory.alloc("generate.q", transient, cd, Shape{n, config.q_dim()});
  if (config.has_qk_norm) {
    // Qwen3: the projections write here, and the per-head norm writes q_ and the cache.
    q_unnormed_ = memory.alloc("generate.q_unnormed", transient, cd, Shape{n, config.q_dim()});
    k_unnormed_ = memory.alloc("generate.k_unnormed", transient, cd, Shape{n, config.kv_dim()});
    head_rstd_ = memory.alloc("generate.head_norm_rstd", transient, DType::f32,
                              Shape{n * config.num_attention_heads});
  }
  attn_out_ = memory.alloc("generate.attn_out", transient, cd, Shape{n, config.q_dim()});
  proj_out_ = memory.alloc("generate.proj_out", transient, cd, Shape{n, config.hidden_size});
  gate_ = memory.alloc("generate.gate", transient, cd, Shape{n, config.intermediate_size});
  up_ = memory.alloc("generate.up", transient, cd, Shape{n, config.intermediate_size});
  mlp_act_ = memory.alloc("generate.swiglu_out", transient, cd, Shape{n, config.intermediate_size});
  lse_ = memory.alloc("generate.attn_lse", MemCategory::attention_scratch, DType::f32,
                      Shape{n * config.num_attention_heads});
  if (adapter_ != nullptr)
    lora_u_ = memory.alloc("generate.lora_u", transient, DType::f32, Shape{n, adapter_->config.r});
  int64_t largest_quantized = 0;
  for (const LayerWeights& layer : weights.layers)
    for (const Quantized4bit& q : layer.quantized)
      if (!q.empty()) largest_quantized = std::max(largest_quantized, q.shape.numel());
  if (largest_quantized > 0)
    dequantized_ = memory.alloc("generate.dequantized_weight", MemCategory::workspace, cd, Shape{largest_quantized});
  logits_ = memory.alloc("generate.logits_f32", MemCategory::logits_loss, DType::f32,
                         Shape{options.all_logits ? n : 1, config.vocab_size});
}

Tensor LlamaGenerator::frozen_weight(int layer, Projection p) const {
  const Quantized4bit& q = weights_.layers[layer].quantized[static_cast<int>(p)];
  if (q.empty()) return weights_.layers[layer].projections[static_cast<int>(p)];
  // QLoRA base: one projection at a time is dequantized into the compute-dtype scratch.
  const Tensor w{dequantized_.data, dequantized_.dtype, q.shape, dequantized_.device};
  backend_.dequantize_4bit(w, q);
  return w;
}

void LlamaGenerator::linear(int layer, Projection p, const Tensor& x, const Tensor& y) {
  // A frozen bias (Qwen2) first, and the GEMM adds onto it: one rounding, as the training step.
  const Tensor& bias = weights_.layers[layer].bias[static_cast<int>(p)];
  if (!bias.empty()) backend_.broadcast_rows(y, bias);
  backend_.matmul(y, x, false, frozen_weight(layer, p), true, 1.0f, bias.empty() ? 0.0f : 1.0f);
  const int lora = adapter_ == nullptr ? -1 : adapter_->find(layer, p);
  if (lora < 0) return;
  const Tensor u = lora_u_.slice_rows(0, x.rows());
  backend_.matmul(u, x, false, adapter_->a[lora], true, 1.0f, 0.0f);
  backend_.matmul(y, u, false, adapter_->b[lora], true, lora_scale_, 1.0f);
}

void LlamaGenerator::head_norm(const Tensor& out, const Tensor& x, const Tensor& weight, int64_t heads) {
  const int64_t rows = x.rows() * heads, d = config_.head_dim;
  backend_.rmsnorm_forward(out.view(Shape{rows, d}), head_rstd_.slice_rows(0, rows),
                           x.view(Shape{rows, d}), weight, static_cast<float>(config_.rms_norm_eps));
}

void LlamaGenerator::attention(int layer, const Tensor& q, const Tensor& out, int64_t first, int64_t n) {
  AttentionDims dims;
  dims.batch = 1;
  dims.n_heads = config_.num_attention_heads;
  dims.n_kv_heads = config_.num_key_value_heads;
  dims.head_dim = config_.head_dim;
  dims.scale = attention_softmax_scale(config_.head_dim);
  if (first == 0) {
    // A prefill: queries and keys share positions [0, n), the training step's causal case.
    dims.seq = n;
    backend_.attention_flash_forward(out, lse_.slice_rows(0, n * dims.n_heads), q,
                                     k_cache_[layer].slice_rows(0, n), v_cache_[layer].slice_rows(0, n),
                                     Tensor{}, dims);
    return;
  }
  // Appending to a cache: query i sees the rows up to its own position, first + i.
  const Shape cache_shape{1, options_.capacity, config_.kv_dim()};
  const Tensor k = k_cache_[layer].view(cache_shape), v = v_cache_[layer].view(cache_shape);
  for (int64_t i = 0; i < n; ++i) {
    dims.seq = first + i + 1;
    backend_.attention_decode(out.slice_rows(i, i + 1), q.slice_rows(i, i + 1), k, v, dims);
  }
}

std::vector<float> LlamaGenerator::forward(std::span<const int32_t> ids, bool all_positions) {
  const int64_t n = static_cast<int64_t>(ids.size()), first = cached_;
  MT_USER_CHECK(n > 0, "generate: a forward needs at least one token");
  MT_USER_CHECK(n <= options_.max_chunk, "generate: {} tokens in one forward, at most {}", n, options_.max_chunk);
  MT_USER_CHECK(first + n <= options_.capacity,
                "generate: the KV cache holds {} tokens; {} cached + {} new do not fit", options_.capacity,
                first, n);
  MT_ASSERT(!all_positions || options_.all_logits, "generate: all_positions without all_logits");
  for (int32_t id : ids)
    MT_USER_CHECK(id >= 0 && id < config_.vocab_size, "token id {} is outside the model's vocabulary [0, {})", id,
                  config_.vocab_size);
  const bool meta = backend_.device() == Device::meta;
  const Tensor ids_n = ids_.slice_rows(0, n), positions = positions_.slice_rows(0, n);
  if (!meta) {
    std::vector<int32_t> host_positions(static_cast<size_t>(n));
    std::iota(host_positions.begin(), host_positions.end(), static_cast<int32_t>(first));
    backend_.copy_from_host(ids_n, ids.data());
    backend_.copy_from_host(positions, host_positions.data());
  }
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const Tensor x = residual_.slice_rows(0, n), h = normed_.slice_rows(0, n), rstd = rstd_.slice_rows(0, n);
  const Tensor q = q_.slice_rows(0, n), attn = attn_out_.slice_rows(0, n), y = proj_out_.slice_rows(0, n);
  const Tensor gate = gate_.slice_rows(0, n), up = up_.slice_rows(0, n), act = mlp_act_.slice_rows(0, n);
  backend_.embedding_forward(x, weights_.embed_tokens, ids_n);
  for (int layer = 0; layer < static_cast<int>(config_.num_hidden_layers); ++layer) {
    const LayerWeights& w = weights_.layers[layer];
    const Tensor k = k_cache_[layer].slice_rows(first, first + n);
    const Tensor v = v_cache_[layer].slice_rows(first, first + n);
    backend_.rmsnorm_forward(h, rstd, x, w.input_norm, eps);
    if (config_.has_qk_norm) {
      const Tensor q_unnormed = q_unnormed_.slice_rows(0, n), k_unnormed = k_unnormed_.slice_rows(0, n);
      linear(layer, Projection::q, h, q_unnormed);
      linear(layer, Projection::k, h, k_unnormed);
      head_norm(q, q_unnormed, w.q_norm, config_.num_attention_heads);
      head_norm(k, k_unnormed, w.k_norm, config_.num_key_value_heads);
    } else {
      linear(layer, Projection::q, h, q);
      linear(layer, Projection::k, h, k);
    }
    linear(layer, Projection::v, h, v);
    backend_.rope_forward(q, positions, inv_freq_, config_.head_dim);
    backend_.rope_forward(k, positions, inv_freq_, config_.head_dim);
    attention(layer, q, attn, first, n);
    linear(layer, Projection::o, attn, y);
    backend_.add(x, x, y);
    backend_.rmsnorm_forward(h, rstd, x, w.post_norm, eps);
    linear(layer, Projection::gate, h, gate);
    linear(layer, Projection::up, h, up);
    backend_.swiglu_forward(act, gate, up);
    linear(layer, Projection::down, act, y);
    backend_.add(x, x, y);
  }
  const int64_t rows = all_positions ? n : 1;
  const Tensor last = residual_.slice_rows(n - rows, n), last_normed = normed_.slice_rows(0, rows);
  backend_.rmsnorm_forward(last_normed, rstd_.slice_rows(0, rows), last, weights_.final_norm, eps);
  const Tensor logits = logits_.slice_rows(0, rows);
  backend_.matmul(logits, last_normed, false, weights_.lm_head, true, 1.0f, 0.0f);
  std::vector<float> host(static_cast<size_t>(rows * config_.vocab_size));
  if (!meta) backend_.copy_to_host(host.data(), logits);
  if (options_.compute_dtype != DType::f32)
    for (float& value : host) value = round_to_dtype(value, options_.compute_dtype);
  cached_ += n;
  return host;
}

struct InferenceModel::Parts {
  Memory memory;
  ModelWeights weights;
  std::optional<DeviceAdapter> adapter;
  Tensor workspace;
  std::unique_ptr<LlamaGenerator> generator;  // refers to weights and adapter: Parts never moves

  Parts(Backend& backend, void* arena, uint64_t arena_bytes, const LlamaConfig& config,
        const InferenceSetup& setup, const PeftAdapter* host_adapter)
      : memory(backend.device(), arena, arena_bytes),
        weights(ModelWeights::allocate(memory, config, setup.compute_dtype,
                                       setup.load_in_4bit ? &*setup.load_in_4bit : nullptr)) {
    if (host_adapter != nullptr) adapter = DeviceAdapter::allocate(memory, config, host_adapter->config);
    if (backend.workspace_bytes() > 0)
      workspace = memory.alloc("backend.workspace", MemCategory::workspace, DType::u8,
                               Shape{static_cast<int64_t>(backend.workspace_bytes())});
    GeneratorOptions options = setup.generator;
    options.compute_dtype = setup.compute_dtype;
    generator = std::make_unique<LlamaGenerator>(backend, memory, config, weights,
                                                 adapter ? &*adapter : nullptr, options);
  }
};

InferenceModel::InferenceModel(Backend& backend, const LlamaConfig& config, const InferenceSetup& setup)
    : backend_(backend), config_(config) {
  if (!setup.adapter_dir.empty()) adapter_ = PeftAdapter::read(setup.adapter_dir, config_);
  const PeftAdapter* host_adapter = adapter_ ? &*adapter_ : nullptr;
  {
    // Plan by building: the same objects on the meta backend give the arena's size.
    const std::unique_ptr<Backend> meta = make_meta_backend(backend.workspace_bytes());
    const Parts plan(*meta, nullptr, 0, config_, setup, host_adapter);
    arena_bytes_ = plan.memory.allocator().high_water();
  }
  // Refused by name before allocating: the KV cache of a long --max_new_tokens, or a model larger
  // than the memory left, would otherwise end inside the allocator (an internal error on the CPU,
  // cudaMalloc's abort on the GPU). 0: the amount is unknown, and the allocator decides.
  const bool on_cpu = backend_.device() == Device::cpu;
  const uint64_t available =
      on_cpu ? host_memory_available() : device_memory_total(backend_) - device_memory_in_use(backend_);
  MT_USER_CHECK(available == 0 || arena_bytes_ <= available,
                "generation needs {} of {} memory (the weights, a KV cache for {} tokens, scratch) and {} is free; "
                "ask for fewer --max_new_tokens, or use a shorter prompt, --dtype bf16 or --load_in_4bit",
                format_bytes(arena_bytes_), on_cpu ? "host" : "GPU", setup.generator.capacity, format_bytes(available));
  arena_ = backend_.allocate_arena(arena_bytes_);
  try {
    parts_ = std::make_unique<Parts>(backend_, arena_, arena_bytes_, config_, setup, host_adapter);
    backend_.bind_workspace(parts_->workspace);
    ModelWeights& weights = parts_->weights;
    if (!setup.checkpoint_dir.empty()) {
      const BaseCheckpoint base(setup.checkpoint_dir, config_);
      for (size_t i = 0; i < base.table().size(); ++i) {
        if (const SafetensorsTensor* t = base.dense(i)) {
          weights.upload(backend_, i, t->data, t->dtype, parts_->memory.free_tail());
        } else if (weights.is_quantized(i)) {
          // bitsandbytes' codes as they are: re-quantizing dequantized values would not give
          // back the same nested constants, so the logits would drift from bitsandbytes'.
          weights.upload_quantized(backend_, i, base.read_4bit(i));
        } else {  // a 4-bit weight into a 16-bit run: dequantized on the host
          const std::vector<float> values = base.read_f32(i);
          weights.upload(backend_, i, values.data(), DType::f32, parts_->memory.free_tail());
        }
        base.release(i);
      }
    } else {
      weights.init_random(backend_, config_, setup.seed, parts_->memory.free_tail());
    }
    if (host_adapter != nullptr) parts_->adapter->upload(backend_, *host_adapter);
    backend_.synchronize();
  } catch (...) {
    parts_.reset();
    backend_.bind_workspace(Tensor{});
    backend_.free_arena(arena_);
    throw;
  }
}

InferenceModel::~InferenceModel() {
  parts_.reset();
  backend_.bind_workspace(Tensor{});
  backend_.free_arena(arena_);
}

LlamaGenerator& InferenceModel::generator() { return *parts_->generator; }

int32_t sample_token(std::vector<float>& logits, const SamplingOptions& options, std::mt19937_64& rng) {
  MT_ASSERT(!logits.empty(), "sample_token: no logits");
  if (options.temperature <= 0.0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const float inverse_temperature = static_cast<float>(1.0 / options.temperature);
  float max_logit = -INFINITY;
  for (float& value : logits) max_logit = std::max(max_logit, value *= inverse_temperature);
  double total = 0.0;
  for (float& value : logits) total += (value = std::exp(value - max_logit));
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  size_t kept = order.size();
  if (options.top_p < 1.0) {
    // Keep a token while the tokens more probable than it hold less than top_p of the mass
    // (transformers removes those whose ascending cumulative probability is <= 1 - top_p).
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    double above = 0.0;
    kept = 0;
    while (kept < order.size() && (kept == 0 || above < options.top_p * total)) above += logits[order[kept++]];
  }
  double kept_mass = 0.0;
  for (size_t i = 0; i < kept; ++i) kept_mass += logits[order[i]];
  double draw = std::uniform_real_distribution<double>(0.0, kept_mass)(rng);
  for (size_t i = 0; i < kept; ++i) {
    draw -= logits[order[i]];
    if (draw < 0.0) return order[i];
  }
  return order[kept - 1];
}

GenerationResult generate_tokens(LlamaGenerator& generator, std::span<const int32_t> prompt,
                                 const SamplingOptions& options, const std::function<void(int32_t)>& on_token) {
  MT_USER_CHECK(!prompt.empty(), "generate: the prompt has no tokens");
  MT_USER_CHECK(options.max_new_tokens > 0, "generate: --max_new_tokens must be positive");
  MT_USER_CHECK(options.temperature >= 0.0, "generate: --temperature must be >= 0");
  MT_USER_CHECK(options.top_p > 0.0 && options.top_p <= 1.0, "generate: --top_p must be in (0, 1]");
  generator.reset();
  std::vector<float> logits;
  const size_t chunk = static_cast<size_t>(generator.options().max_chunk);
  for (size_t begin = 0; begin < prompt.size(); begin += chunk)
    logits = generator.forward(prompt.subspan(begin, std::min(chunk, prompt.size() - begin)));
  std::mt19937_64 rng(options.seed);
  const std::set<int32_t> stops(options.stop_ids.begin(), options.stop_ids.end());
  GenerationResult result;
  result.stop_reason = "max_new_tokens";
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    const int32_t token = sample_token(logits, options, rng);
    result.tokens.push_back(token);
    if (on_token) on_token(token);
    if (stops.count(token) != 0) {
      result.stop_reason = "eos";
      break;
    }
    if (step + 1 < options.max_new_tokens) logits = generator.forward(std::span<const int32_t>(&token, 1));
  }
  return result;
}

std::vector<int32_t> stop_token_ids(const LlamaConfig& config, const std::filesystem::path& model_dir) {
  std::vector<int32_t> ids;
  const auto add = [&](int64_t id) {
    if (id >= 0 && std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(static_cast<int32_t>(id));
  };
  for (int64_t id : config.eos_token_ids) add(id);
  const std::filesystem::path file = model_dir / "generation_config.json";
  if (!model_dir.empty() && std::filesystem::is_regular_file(file)) {
    const nlohmann::json json = read_json_file(file);
    json_require_object(json, file.string());
    if (const nlohmann::json* eos = json_find(json, "eos_token_id", file.string()); eos != nullptr && !eos->is_null()) {
      if (eos->is_array()) {
        for (int64_t id : json_as<std::vector<int64_t>>(*eos, file.string() + ": eos_token_id")) add(id);
      } else {
        add(json_as<int64_t>(*eos, file.string() + ": eos_token_id"));
      }
    }
  }
  return ids;
}

}  // namespace memtune
