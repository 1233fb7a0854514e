#include "memtune/step/llama_step.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "memtune/model/llama_config.h"
#include "memtune/ops/ragged_attention.h"

namespace memtune {
namespace {

// Marks the span of a chunked layer pass (LlamaStep::alloc_chunk reserves the planned chunk's
// rows inside it); restores "not chunked" when the pass ends.
class ActiveChunk {
 public:
  ActiveChunk(int64_t& slot, int64_t rows) : slot_(slot) { slot_ = rows; }
  ~ActiveChunk() { slot_ = 0; }
  ActiveChunk(const ActiveChunk&) = delete;
  ActiveChunk& operator=(const ActiveChunk&) = delete;

 private:
  int64_t& slot_;
};

}  // namespace

bool sliding_window_reached(const LlamaConfig& config, int64_t seq) {
  return config.sliding_window > 0 && seq > config.sliding_window;
}

std::string sliding_window_refusal(const LlamaConfig& config, int64_t seq) {
  return fmt::format("{}: \"sliding_window\" {} is shorter than the run's rows of {} tokens, and the "
                     "CUDA attention kernels (eager, flash, cuDNN) have no sliding-window mask yet "
                     "(the CPU backend has one); use --max_seq_length {} or less",
                     config.name.empty() ? "model" : config.name, config.sliding_window, seq,
                     config.sliding_window);
}

LlamaStep::LlamaStep(Backend& backend, Memory& memory, const LlamaConfig& config,
                     const StepOptions& options, const ModelWeights& weights,
                     const LoraState& lora)
    : backend_(backend),
      memory_(memory),
      config_(config),
      options_(options),
      weights_(weights),
      lora_(lora),
      capacity_{options.micro_batch, options.seq, lora.config().r},
      capacity_tokens_(options.micro_batch * options.seq),
      dims_(capacity_),
      tokens_(capacity_tokens_),
      lora_scale_(lora.config().scaling()),
      lora_dropout_(static_cast<float>(lora.config().dropout)) {
  MT_ASSERT(options.micro_batch > 0 && options.seq > 0);
  MT_USER_CHECK(options.attention != AttentionImpl::cudnn || memory_.device() != Device::cuda ||
                    cudnn_attention_available(),
                "--attn_implementation cudnn: cuDNN attention is not available here (this build "
                "has no cuDNN frontend, libcudnn is not 9.x, or the GPU is older than sm80); use "
                "--attn_implementation flash");
  // A window that no row reaches masks nothing (keys are at most seq - 1 positions back); one
  // that rows reach is applied by the CPU attention only.
  MT_USER_CHECK(memory_.device() != Device::cuda || !sliding_window_reached(config, options.seq),
                "{}", sliding_window_refusal(config, options.seq));
  // LoraState lays its buffers out once, before the step exists: which groups stack is fixed.
  stacked_lora_a_.resize(static_cast<size_t>(config.num_hidden_layers));
  for (int layer = 0; layer < config.num_hidden_layers; ++layer)
    for (int g = 0; g < kNumLoraInputGroups; ++g)
      stacked_lora_a_[layer][g] = find_stacked_lora_a(layer, kLoraInputGroups[g]);
  inv_freq_ = memory_.alloc("rope.inv_freq", MemCategory::workspace, DType::f32,
                            Shape{config.head_dim / 2});
  if (memory_.device() != Device::meta) {
    const std::vector<float> inv_freq = rope_inv_freq(config);
    backend_.copy_from_host(inv_freq_, inv_freq.data());
  }
  loss_sum_ = memory_.alloc("loss.sum", MemCategory::logits_loss, DType::f32, Shape{1});
  const Shape per_token{capacity_tokens_};
  MicroBatchBuffers& b = planned_batch_;
  b.input_ids = memory_.alloc("batch.input_ids", MemCategory::saved_activations, DType::i32, per_token);
  b.targets = memory_.alloc("batch.targets", MemCategory::saved_activations, DType::i32, per_token);
  b.positions = memory_.alloc("batch.positions", MemCategory::saved_activations, DType::i32, per_token);
  b.segments = memory_.alloc("batch.segments", MemCategory::saved_activations, DType::i32, per_token);
  if (options.attention == AttentionImpl::cudnn) {
    b.ragged.capacity = capacity_tokens_;
    b.ragged.table = memory_.alloc("batch.ragged_table", MemCategory::saved_activations, DType::i32,
                                   Shape{kRaggedTableRows * (capacity_tokens_ + 1)});
  }
  batch_ = planned_batch_;
  if (options.offload_activations) {
    MT_USER_CHECK(options.gradient_checkpointing,
                  "offload_activations needs gradient_checkpointing: without it every activation of "
                  "every layer is saved on the device, and only the layer inputs are offloaded");
    const int layers = static_cast<int>(config.num_hidden_layers);
    offload_layer_bytes_ = static_cast<uint64_t>(capacity_tokens_) * static_cast<uint64_t>(config.hidden_size) *
                           dtype_size(options.compute_dtype);
    // Layers [0, layers - 1): the last layer's input stays in its ring slot for the backward.
    const uint64_t host_bytes = offload_layer_bytes_ * static_cast<uint64_t>(std::max(layers - 1, 0));
    if (host_bytes > 0) offload_host_ = backend_.allocate_host(host_bytes);
    memory_.record_host("offload.layer_inputs", host_bytes);
    for (int i = 0; i < kOffloadSlots; ++i) {
      slot_copied_out_[i] = backend_.create_event();
      slot_copied_in_[i] = backend_.create_event();
    }
  }
}

LlamaStep::~LlamaStep() {
  if (!options_.offload_activations) return;
  backend_.synchronize();  // no copy may still touch the host memory
  for (int i = 0; i < kOffloadSlots; ++i) {
    backend_.destroy_event(slot_copied_out_[i]);
    backend_.destroy_event(slot_copied_in_[i]);
  }
  if (offload_host_ != nullptr) backend_.free_host(offload_host_);
}

void* LlamaStep::offloaded_layer_input(int layer) const {
  MT_ASSERT(layer >= 0 && layer + 1 < config_.num_hidden_layers, "layer {} has no host copy", layer);
  // On the meta device there is no host memory, and nothing is copied.
  if (offload_host_ == nullptr) return nullptr;
  return static_cast<char*>(offload_host_) + static_cast<uint64_t>(layer) * offload_layer_bytes_;
}

void LlamaStep::set_shape(int64_t rows, int64_t seq) {
  MT_ASSERT(rows > 0 && seq > 0 && rows * seq <= capacity_tokens_,
            "micro-batch of {} x {} tokens for a step planned for {} x {}", rows, seq, capacity_.batch,
            capacity_.seq);
  // Eager attention's probabilities grow with seq^2: a longer row than planned would not fit.
  MT_USER_CHECK(options_.attention != AttentionImpl::eager || seq <= capacity_.seq,
                "a micro-batch row of {} tokens under eager attention planned for rows of {}: eager attention "
                "keeps [batch, heads, seq, seq] probabilities, so padding-free rows need flash attention "
                "(--attn_implementation flash or auto)",
                seq, capacity_.seq);
  dims_.batch = rows;
  dims_.seq = seq;
  tokens_ = rows * seq;
  batch_.input_ids = planned_batch_.input_ids.slice_rows(0, tokens_);
  batch_.targets = planned_batch_.targets.slice_rows(0, tokens_);
  batch_.positions = planned_batch_.positions.slice_rows(0, tokens_);
  batch_.segments = planned_batch_.segments.slice_rows(0, tokens_);
}

AttentionDims LlamaStep::planned_attention_dims() const {
  AttentionDims d = attention_dims();
  d.batch = capacity_.batch;
  d.seq = capacity_.seq;
  return d;
}

AttentionDims LlamaStep::attention_dims() const {
  AttentionDims d;
  d.batch = dims_.batch;
  d.seq = dims_.seq;
  d.n_heads = config_.num_attention_heads;
  d.n_kv_heads = config_.num_key_value_heads;
  d.head_dim = config_.head_dim;
  d.scale = attention_softmax_scale(config_.head_dim);
  d.window = config_.sliding_window;
  return d;
}

MemCategory LlamaStep::saved_category(bool recompute) const {
  // Under checkpointing, a layer's activations live only while that layer runs (forward, or
  // recompute + backward): they are transient, and only the layer inputs are saved.
  return (options_.gradient_checkpointing || recompute) ? MemCategory::transient_activations
                                                         : MemCategory::saved_activations;
}

Tensor LlamaStep::alloc_tokens(std::string name, MemCategory category, DType dtype, Shape shape) {
  MT_ASSERT(shape[0] == tokens_, "'{}' of {} rows is not a whole-micro-batch tensor of {}", name, shape[0], tokens_);
  Shape reserve = shape;
  reserve[0] = capacity_tokens_;
  return memory_.alloc(std::move(name), category, dtype, shape, reserve);
}

int64_t LlamaStep::reserved_rows(int64_t first_row) const {
  if (active_chunk_rows_ == 0) return capacity_tokens_;
  return std::min(capacity_tokens_, first_row + active_chunk_rows_) - first_row;
}

Tensor LlamaStep::alloc_chunk(std::string name, MemCategory category, DType dtype, Shape shape, int64_t first_row) {
  Shape reserve = shape;
  reserve[0] = reserved_rows(first_row);
  MT_ASSERT(shape[0] <= reserve[0], "'{}': {} rows at row {} for a reserve of {}", name, shape[0], first_row, reserve[0]);
  return memory_.alloc(std::move(name), category, dtype, shape, reserve);
}

Tensor LlamaStep::alloc_act(Act id, int layer, MemCategory category) {
  const ActSpec& spec = act_spec(id);
  return memory_.alloc(fmt::format("layers.{}.{}", layer, spec.name), category,
                       spec.fp32 ? DType::f32 : options_.compute_dtype,
                       act_shape(spec, config_, dims_), act_shape(spec, config_, capacity_));
}

Tensor LlamaStep::alloc_act_rows(Act id, int layer, MemCategory category, int64_t rows, int64_t first_row) {
  const ActSpec& spec = act_spec(id);
  return alloc_chunk(fmt::format("layers.{}.{}", layer, spec.name), category,
                     spec.fp32 ? DType::f32 : options_.compute_dtype,
                     act_rows_shape(spec, config_, dims_, rows), first_row);
}

int64_t LlamaStep::token_chunk_rows(bool training) const {
  // Without checkpointing the training forward keeps the whole layer for the backward anyway.
  const bool acts_saved = training && !options_.gradient_checkpointing;
  if (acts_saved || options_.mlp_chunk_tokens <= 0) return 0;
  // The planned chunks, whatever the current shape (see the header comment).
  return std::min(capacity_tokens_, options_.mlp_chunk_tokens);
}

Tensor LlamaStep::alloc_layer_output(int layer, bool training) {
  // The layer output is the next layer's input: saved whenever training, also under
  // checkpointing.
  const MemCategory category = training ? MemCategory::saved_activations : MemCategory::transient_activations;
  return alloc_tokens(fmt::format("layers.{}.layer_input", layer + 1), category,
                      options_.compute_dtype, Shape{tokens_, config_.hidden_size});
}

void LlamaStep::free_layer(LayerState& state, bool keep_input) {
  // Free in reverse order of allocation: the first-fit arena then reuses the space cleanly. A
  // stacked group's u's are views of one buffer, freed where its first member's would be.
  for (int p = kNumProjections - 1; p >= 0; --p) {
    const LoraGroupPlace place = lora_input_group_of(static_cast<Projection>(p));
    Tensor* stacked = place.group >= 0 ? &state.lora_u_stacked[place.group] : nullptr;
    if (stacked != nullptr && !stacked->empty()) {
      if (place.member == 0) memory_.free(*stacked), *stacked = Tensor{};
    } else if (!state.lora_u[p].empty()) {
      memory_.free(state.lora_u[p]);
    }
    state.lora_u[p] = Tensor{};
  }
  for (int i = kNumActs - 1; i >= 0; --i) {
    if (i == static_cast<int>(Act::layer_input) && keep_input) continue;
    if (!state.acts[i].empty()) memory_.free(state.acts[i]), state.acts[i] = Tensor{};
  }
}

void LlamaStep::begin_base_pass(bool with_backward) {
  if (base_units_ != nullptr) base_units_->begin_pass(with_backward);
}

void LlamaStep::acquire_unit(int unit) {
  MT_ASSERT(held_unit_ == kNoUnit, "acquiring base unit {} while {} is held", unit, held_unit_);
  held_unit_ = unit;
  if (base_units_ != nullptr) base_units_->acquire(unit);
}

void LlamaStep::release_unit(int unit) {
  MT_ASSERT(held_unit_ == unit, "releasing base unit {} while {} is held", unit, held_unit_);
  held_unit_ = kNoUnit;
  if (base_units_ != nullptr) base_units_->release(unit);
}

const LayerWeights& LlamaStep::layer_weights(int layer) const {
  MT_ASSERT(held_unit_ == layer, "layer {}'s frozen weights read while base unit {} is held", layer, held_unit_);
  return weights_.layers[layer];
}

Tensor LlamaStep::frozen_weight(int layer, Projection p) {
  const LayerWeights& lw = layer_weights(layer);
  const Quantized4bit& q = lw.quantized[static_cast<int>(p)];
  if (q.empty()) return lw.projections[static_cast<int>(p)];
  if (layer == held_layer_ && !held_weights_[static_cast<int>(p)].empty()) return held_weights_[static_cast<int>(p)];
  // QLoRA: one projection at a time is dequantized into compute-dtype scratch.
  Tensor w = memory_.alloc(fmt::format("layers.{}.{}.dequantized", layer, projection_name(p)),
                           MemCategory::workspace, options_.compute_dtype, q.shape);
  backend_.dequantize_4bit(w, q);
  return w;
}

void LlamaStep::release_frozen_weight(int layer, Projection p, const Tensor& w) {
  if (layer == held_layer_ && w.data == held_weights_[static_cast<int>(p)].data) return;
  if (!layer_weights(layer).quantized[static_cast<int>(p)].empty()) memory_.free(w);
}

LlamaStep::HeldWeights::HeldWeights(LlamaStep& step, int layer, std::initializer_list<Projection> projections)
    : step_(step) {
  if (!step.options_.hold_chunk_weights) return;
  MT_ASSERT(step.held_layer_ < 0, "weights of layer {} held while holding layer {}'s", layer, step.held_layer_);
  for (Projection p : projections) {
    if (step.layer_weights(layer).quantized[static_cast<int>(p)].empty()) continue;
    step.held_weights_[static_cast<int>(p)] = step.frozen_weight(layer, p);
    held_.push_back(p);
  }
  if (!held_.empty()) step.held_layer_ = layer;
}

LlamaStep::HeldWeights::~HeldWeights() {
  for (auto it = held_.rbegin(); it != held_.rend(); ++it) {
    Tensor& w = step_.held_weights_[static_cast<int>(*it)];
    step_.memory_.free(w);
    w = Tensor{};
  }
  if (!held_.empty()) step_.held_layer_ = -1;
}

Act LlamaStep::projection_output(Act id) const {
  if (!config_.has_qk_norm) return id;
  return id == Act::q ? Act::q_unnormed : id == Act::k ? Act::k_unnormed : id;
}

namespace {
// [tokens, heads * head_dim] seen as one row per (token, head): the rows that Qwen3's q_norm and
// k_norm normalise, each over its head_dim values.
Tensor per_head_rows(const Tensor& t, int64_t head_dim) {
  return t.view(Shape{t.numel() / head_dim, head_dim});
}
}  // namespace

void LlamaStep::head_norm_forward(int layer, LayerState& s, MemCategory keep) {
  auto act = [&](Act id) -> Tensor& { return s.acts[static_cast<int>(id)]; };
  const LayerWeights& w = layer_weights(layer);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const int64_t d = config_.head_dim;
  act(Act::q) = alloc_act(Act::q, layer, keep);
  act(Act::q_norm_rstd) = alloc_act(Act::q_norm_rstd, layer, keep);
  backend_.rmsnorm_forward(per_head_rows(act(Act::q), d), act(Act::q_norm_rstd),
                           per_head_rows(act(Act::q_unnormed), d), w.q_norm, eps);
  act(Act::k) = alloc_act(Act::k, layer, keep);
  act(Act::k_norm_rstd) = alloc_act(Act::k_norm_rstd, layer, keep);
  backend_.rmsnorm_forward(per_head_rows(act(Act::k), d), act(Act::k_norm_rstd),
                           per_head_rows(act(Act::k_unnormed), d), w.k_norm, eps);
}

void LlamaStep::head_norm_backward(int layer, LayerState& s, const Tensor& dq, const Tensor& dk) {
  auto act = [&](Act id) -> Tensor& { return s.acts[static_cast<int>(id)]; };
  const LayerWeights& w = layer_weights(layer);
  const int64_t d = config_.head_dim;
  // In place: the backward reads a whole row of dy before it writes that row of dx (both
  // backends), so dq and dk turn into the grads of the projections' outputs.
  backend_.rmsnorm_backward(per_head_rows(dq, d), per_head_rows(dq, d),
                            per_head_rows(act(Act::q_unnormed), d), w.q_norm,
                            act(Act::q_norm_rstd), false);
  backend_.rmsnorm_backward(per_head_rows(dk, d), per_head_rows(dk, d),
                            per_head_rows(act(Act::k_unnormed), d), w.k_norm,
                            act(Act::k_norm_rstd), false);
}

void LlamaStep::attention_forward(int layer, LayerState& s, MemCategory keep) {
  auto act = [&](Act id) -> Tensor& { return s.acts[static_cast<int>(id)]; };
  const AttentionDims dims = attention_dims();
  if (config_.has_qk_norm) head_norm_forward(layer, s, keep);
  backend_.rope_forward(act(Act::q), batch_.positions, inv_freq_, config_.head_dim);
  backend_.rope_forward(act(Act::k), batch_.positions, inv_freq_, config_.head_dim);

  act(Act::attn_out) = alloc_act(Act::attn_out, layer, keep);
  if (options_.attention == AttentionImpl::eager) {
    act(Act::attn_probs) = alloc_act(Act::attn_probs, layer, keep);
    Tensor scores = memory_.alloc(fmt::format("layers.{}.attn_scores", layer),
                                  MemCategory::attention_scratch, options_.compute_dtype,
                                  act(Act::attn_probs).shape,
                                  act_shape(act_spec(Act::attn_probs), config_, capacity_));
    backend_.attention_eager_forward(act(Act::attn_out), act(Act::attn_probs), scores, act(Act::q),
                                     act(Act::k), act(Act::v), batch_.segments, dims);
    memory_.free(scores);
  } else if (options_.attention == AttentionImpl::cudnn) {
    act(Act::attn_lse) = alloc_act(Act::attn_lse, layer, keep);
    // Planned whatever the batch, so the arena is the same for packed and unpacked batches.
    Tensor workspace = memory_.alloc(fmt::format("layers.{}.attn_cudnn_workspace", layer),
                                     MemCategory::attention_scratch, DType::f32,
                                     Shape{cudnn_attention_workspace_floats(planned_attention_dims(), false)});
    if (batch_.one_sample_per_row || !batch_.ragged.empty())
      backend_.attention_cudnn_forward(act(Act::attn_out), act(Act::attn_lse), act(Act::q),
                                       act(Act::k), act(Act::v), batch_.segments, batch_.ragged,
                                       workspace, dims);
    else
      backend_.attention_flash_forward(act(Act::attn_out), act(Act::attn_lse), act(Act::q),
                                       act(Act::k), act(Act::v), batch_.segments, dims);
    memory_.free(workspace);
  } else {
    act(Act::attn_lse) = alloc_act(Act::attn_lse, layer, keep);
    backend_.attention_flash_forward(act(Act::attn_out), act(Act::attn_lse), act(Act::q),
                                     act(Act::k), act(Act::v), batch_.segments, dims);
  }
}

Tensor LlamaStep::layer_forward(int layer, LayerState& s, bool recompute, uint64_t dropout_seed,
                                bool training, const Tensor* out_slot) {
  const int64_t chunk_rows = token_chunk_rows(training);
  if (chunk_rows > 0)
    return layer_forward_chunked(layer, s, recompute, dropout_seed, training, chunk_rows, out_slot);
  const MemCategory keep = training ? saved_category(recompute) : MemCategory::transient_activations;
  const LayerWeights& w = layer_weights(layer);
  LayerActs& a = s.acts;
  auto act = [&](Act id) -> Tensor& { return a[static_cast<int>(id)]; };
  auto lora_u = [&](Projection p) { return training ? &s.lora_u[static_cast<int>(p)] : nullptr; };
  const float eps = static_cast<float>(config_.rms_norm_eps);
  // The output first: under checkpointing it outlives everything else this layer allocates, so
  // placed below them it stacks on the previous layer's output instead of leaving a hole the
  // size of the layer's working set under it (0.9 GiB at 8B, 2 x 2048, eager attention).
  Tensor out;
  if (!recompute) out = out_slot != nullptr ? *out_slot : alloc_layer_output(layer, training);

  act(Act::norm1_out) = alloc_act(Act::norm1_out, layer, keep);
  act(Act::norm1_rstd) = alloc_act(Act::norm1_rstd, layer, keep);
  backend_.rmsnorm_forward(act(Act::norm1_out), act(Act::norm1_rstd), act(Act::layer_input),
                           w.input_norm, eps);
  const Act q_out = projection_output(Act::q), k_out = projection_output(Act::k);
  act(q_out) = alloc_act(q_out, layer, keep);
  act(k_out) = alloc_act(k_out, layer, keep);
  act(Act::v) = alloc_act(Act::v, layer, keep);
  const Tensor qkv_out[] = {act(q_out), act(k_out), act(Act::v)};
  linear_group_forward(layer, kLoraInputGroups[0], act(Act::norm1_out), 0, qkv_out, training ? &s : nullptr, keep,
                       dropout_seed, training);
  attention_forward(layer, s, keep);
  act(Act::mid) = alloc_act(Act::mid, layer, keep);
  linear_forward(layer, Projection::o, act(Act::attn_out), 0, act(Act::mid), lora_u(Projection::o), keep, dropout_seed, training,
                 &act(Act::layer_input));

  mlp_forward(layer, act(Act::mid), 0, s, keep, dropout_seed, training, training);
  if (recompute) {
    // The output already exists; the backward needs only the down projection's LoRA input.
    if (lora_.find(layer, Projection::down) != nullptr)
      s.lora_u[static_cast<int>(Projection::down)] = lora_input_projection(
          layer, Projection::down, act(Act::swiglu_out), 0, keep, dropout_seed, training);
    return Tensor{};
  }
  linear_forward(layer, Projection::down, act(Act::swiglu_out), 0, out, lora_u(Projection::down), keep, dropout_seed, training,
                 &act(Act::mid));
  return out;
}

Tensor LlamaStep::layer_forward_chunked(int layer, LayerState& s, bool recompute,
                                        uint64_t dropout_seed, bool training, int64_t chunk_rows,
                                        const Tensor* out_slot) {
  // Only what attention needs spans the sequence (kept while the layer runs, or through its
  // backward in a recompute); every row-wise part runs on chunk buffers and keeps nothing.
  const MemCategory keep = training ? saved_category(recompute) : MemCategory::transient_activations;
  const MemCategory transient = MemCategory::transient_activations;
  const LayerWeights& w = layer_weights(layer);
  auto act = [&](Act id) -> Tensor& { return s.acts[static_cast<int>(id)]; };
  const Tensor& x = act(Act::layer_input);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  // The output first, for the reason given in layer_forward.
  Tensor out;
  if (!recompute) out = out_slot != nullptr ? *out_slot : alloc_layer_output(layer, training);

  const Act q_out = projection_output(Act::q), k_out = projection_output(Act::k);
  act(q_out) = alloc_act(q_out, layer, keep);
  act(k_out) = alloc_act(k_out, layer, keep);
  act(Act::v) = alloc_act(Act::v, layer, keep);
  const ActiveChunk in_chunks(active_chunk_rows_, chunk_rows);
  {
    const HeldWeights qkv_weights(*this, layer, {Projection::q, Projection::k, Projection::v});
    for (int64_t begin = 0; begin < tokens_; begin += chunk_rows) {
      const int64_t end = std::min(tokens_, begin + chunk_rows);
      LayerState chunk;
      Tensor& normed = chunk.acts[static_cast<int>(Act::norm1_out)];
      Tensor& rstd = chunk.acts[static_cast<int>(Act::norm1_rstd)];
      normed = alloc_act_rows(Act::norm1_out, layer, transient, end - begin, begin);
      rstd = alloc_act_rows(Act::norm1_rstd, layer, transient, end - begin, begin);
      backend_.rmsnorm_forward(normed, rstd, x.slice_rows(begin, end), w.input_norm, eps);
      const Tensor qkv_rows[] = {act(q_out).slice_rows(begin, end), act(k_out).slice_rows(begin, end),
                                 act(Act::v).slice_rows(begin, end)};
      linear_group_forward(layer, kLoraInputGroups[0], normed, begin, qkv_rows, nullptr, transient, dropout_seed,
                           training);
      free_layer(chunk, /*keep_input=*/false);
    }
  }
  attention_forward(layer, s, keep);
  // The backward recomputes the o projection, norm2 and the MLP chunk by chunk.
  if (recompute) return Tensor{};

  const HeldWeights row_wise_weights(*this, layer, {Projection::o, Projection::gate, Projection::up, Projection::down});
  for (int64_t begin = 0; begin < tokens_; begin += chunk_rows) {
    const int64_t end = std::min(tokens_, begin + chunk_rows);
    LayerState chunk;
    Tensor& mid = chunk.acts[static_cast<int>(Act::mid)];
    mid = alloc_act_rows(Act::mid, layer, transient, end - begin, begin);
    const Tensor x_rows = x.slice_rows(begin, end);
    linear_forward(layer, Projection::o, act(Act::attn_out).slice_rows(begin, end), begin, mid,
                   nullptr, transient, dropout_seed, training, &x_rows);
    mlp_forward(layer, mid, begin, chunk, transient, dropout_seed, training, /*keep_lora_u=*/false);
    const Tensor out_rows = out.slice_rows(begin, end);
    linear_forward(layer, Projection::down, chunk.acts[static_cast<int>(Act::swiglu_out)], begin,
                   out_rows, nullptr, transient, dropout_seed, training, &mid);
    free_layer(chunk, /*keep_input=*/false);
  }
  return out;
}

void LlamaStep::mlp_forward(int layer, const Tensor& mid_rows, int64_t first_row, LayerState& mlp,
                            MemCategory category, uint64_t dropout_seed, bool training,
                            bool keep_lora_u) {
  const int64_t rows = mid_rows.rows();
  auto act = [&](Act id) -> Tensor& { return mlp.acts[static_cast<int>(id)]; };
  act(Act::norm2_out) = alloc_act_rows(Act::norm2_out, layer, category, rows, first_row);
  act(Act::norm2_rstd) = alloc_act_rows(Act::norm2_rstd, layer, category, rows, first_row);
  backend_.rmsnorm_forward(act(Act::norm2_out), act(Act::norm2_rstd), mid_rows,
                           layer_weights(layer).post_norm, static_cast<float>(config_.rms_norm_eps));
  act(Act::gate) = alloc_act_rows(Act::gate, layer, category, rows, first_row);
  act(Act::up) = alloc_act_rows(Act::up, layer, category, rows, first_row);
  const Tensor gate_up_out[] = {act(Act::gate), act(Act::up)};
  // A stacked gate/up group leaves its B terms to swiglu_lora_forward, which adds them with SwiGLU
  // (the same sums as linear_group_forward's, which a backend may make in one pass over gate and up).
  const LoraInputGroup& gate_up = kLoraInputGroups[1];
  const bool fused = !stacked_lora_a(layer, gate_up).empty();
  LayerState local;
  LayerState* held = keep_lora_u ? &mlp : fused ? &local : nullptr;
  linear_group_forward(layer, gate_up, act(Act::norm2_out), first_row, gate_up_out, held, category, dropout_seed,
                       training, /*add_lora_b=*/!fused);
  act(Act::swiglu_out) = alloc_act_rows(Act::swiglu_out, layer, category, rows, first_row);
  if (fused) {
    auto lora_b = [&](Projection p) -> const Tensor& { return lora_.find(layer, p)->b_compute; };
    backend_.swiglu_lora_forward(act(Act::swiglu_out), act(Act::gate), act(Act::up),
                                 held->lora_u[static_cast<int>(Projection::gate)], lora_b(Projection::gate),
                                 held->lora_u[static_cast<int>(Projection::up)], lora_b(Projection::up), lora_scale_);
  } else {
    backend_.swiglu_forward(act(Act::swiglu_out), act(Act::gate), act(Act::up));
  }
  free_layer(local, /*keep_input=*/false);  // the LoRA inputs a fused group did not keep
}

void LlamaStep::mlp_backward(int layer, LayerState& mlp, const Tensor& mid_rows,
                             const Tensor& d_resid_rows, int64_t first_row, uint64_t dropout_seed) {
  auto act = [&](Act id) -> Tensor& { return mlp.acts[static_cast<int>(id)]; };
  auto lora_u = [&](Projection p) { return mlp.lora_u[static_cast<int>(p)]; };
  // swiglu_out is dead once the down projection's backward has read it, so its grad overwrites
  // it in place (dx may alias x because accumulate is false); gate/up likewise take their grads.
  const Tensor& d_swiglu = act(Act::swiglu_out);
  linear_backward(layer, Projection::down, d_resid_rows, act(Act::swiglu_out), first_row,
                  lora_u(Projection::down), d_swiglu, false, dropout_seed);
  backend_.swiglu_backward(act(Act::gate), act(Act::up), d_swiglu, act(Act::gate), act(Act::up));
  memory_.free(act(Act::swiglu_out));  // d_swiglu is consumed: its space takes d_norm2
  act(Act::swiglu_out) = Tensor{};
  Tensor d_norm2 = alloc_chunk(fmt::format("layers.{}.d_norm2", layer), MemCategory::transient_activations,
                               options_.compute_dtype, act(Act::norm2_out).shape, first_row);
  const Tensor d_gate_up[] = {act(Act::gate), act(Act::up)};
  linear_group_backward(layer, kLoraInputGroups[1], d_gate_up, act(Act::norm2_out), first_row, mlp, d_norm2, false,
                        dropout_seed);
  backend_.rmsnorm_backward(d_resid_rows, d_norm2, mid_rows, layer_weights(layer).post_norm,
                            act(Act::norm2_rstd), true);
  memory_.free(d_norm2);
}

void LlamaStep::attention_backward(int layer, LayerState& s, const Tensor& d_attn, Tensor& dq,
                                   Tensor& dk, Tensor& dv) {
  auto act = [&](Act id) -> Tensor& { return s.acts[static_cast<int>(id)]; };
  const std::string prefix = fmt::format("layers.{}.", layer);
  const MemCategory transient = MemCategory::transient_activations;
  const DType cd = options_.compute_dtype;
  const AttentionDims dims = attention_dims();
  dq = alloc_tokens(prefix + "dq", transient, cd, act(Act::q).shape);
  dk = alloc_tokens(prefix + "dk", transient, cd, act(Act::k).shape);
  dv = alloc_tokens(prefix + "dv", transient, cd, act(Act::v).shape);
  if (options_.attention == AttentionImpl::eager) {
    Tensor dprobs = memory_.alloc(prefix + "attn_dprobs", MemCategory::attention_scratch, cd,
                                  act(Act::attn_probs).shape,
                                  act_shape(act_spec(Act::attn_probs), config_, capacity_));
    backend_.attention_eager_backward(dq, dk, dv, dprobs, d_attn, act(Act::attn_probs), act(Act::q),
                                      act(Act::k), act(Act::v), batch_.segments, dims);
    memory_.free(dprobs);
  } else if (options_.attention == AttentionImpl::cudnn) {
    Tensor delta = memory_.alloc(prefix + "attn_delta", MemCategory::attention_scratch, DType::f32,
                                 act(Act::attn_lse).shape, act_shape(act_spec(Act::attn_lse), config_, capacity_));
    // cuDNN's workspace; its first N * n_heads * head_dim floats are the flash dq accumulator
    // for packed batches.
    Tensor workspace = memory_.alloc(prefix + "attn_cudnn_workspace", MemCategory::attention_scratch,
                                     DType::f32, Shape{cudnn_attention_workspace_floats(planned_attention_dims(), true, options_.packed_rows)});
    if (batch_.one_sample_per_row || !batch_.ragged.empty())
      backend_.attention_cudnn_backward(dq, dk, dv, delta, workspace, d_attn, act(Act::attn_out),
                                        act(Act::attn_lse), act(Act::q), act(Act::k), act(Act::v),
                                        batch_.segments, batch_.ragged, dims);
    else
      backend_.attention_flash_backward(dq, dk, dv, delta,
                                        Backend::cudnn_dq_accum_view(workspace, act(Act::q)), d_attn,
                                        act(Act::attn_out), act(Act::attn_lse), act(Act::q),
                                        act(Act::k), act(Act::v), batch_.segments, dims);
    memory_.free(workspace);
    memory_.free(delta);
  } else {
    Tensor delta = memory_.alloc(prefix + "attn_delta", MemCategory::attention_scratch, DType::f32,
                                 act(Act::attn_lse).shape, act_shape(act_spec(Act::attn_lse), config_, capacity_));
    Tensor dq_accum = alloc_tokens(prefix + "attn_dq_accum", MemCategory::attention_scratch,
                                   DType::f32, act(Act::q).shape);
    backend_.attention_flash_backward(dq, dk, dv, delta, dq_accum, d_attn, act(Act::attn_out),
                                      act(Act::attn_lse), act(Act::q), act(Act::k), act(Act::v),
                                      batch_.segments, dims);
    memory_.free(dq_accum);
    memory_.free(delta);
  }
}

void LlamaStep::qkv_output_grads(int layer, LayerState& s, Tensor& d_attn, Tensor& dq, Tensor& dk, Tensor& dv) {
  attention_backward(layer, s, d_attn, dq, dk, dv);
  memory_.free(d_attn);
  backend_.rope_backward(dq, batch_.positions, inv_freq_, config_.head_dim);
  backend_.rope_backward(dk, batch_.positions, inv_freq_, config_.head_dim);
  if (config_.has_qk_norm) head_norm_backward(layer, s, dq, dk);
}

void LlamaStep::layer_backward(int layer, LayerState& s, const Tensor& d_resid, uint64_t seed) {
  const int64_t chunk_rows = token_chunk_rows(true);
  if (chunk_rows > 0) return layer_backward_chunked(layer, s, d_resid, seed, chunk_rows);
  const LayerWeights& w = layer_weights(layer);
  LayerActs& a = s.acts;
  auto act = [&](Act id) -> Tensor& { return a[static_cast<int>(id)]; };
  auto lora_u = [&](Projection p) { return s.lora_u[static_cast<int>(p)]; };
  const std::string prefix = fmt::format("layers.{}.", layer);
  const MemCategory transient = MemCategory::transient_activations;
  const DType cd = options_.compute_dtype;
  MT_ASSERT(!act(Act::gate).empty(), "a whole-layer backward after a chunked forward");

  // norm2 + MLP. d_resid is the grad of the layer output, and so of the down projection; it
  // becomes the grad of mid.
  mlp_backward(layer, s, act(Act::mid), d_resid, 0, seed);

  // Attention. d_resid is now the grad of mid, and so of the o projection's output.
  Tensor d_attn = alloc_tokens(prefix + "d_attn_out", transient, cd, act(Act::attn_out).shape);
  linear_backward(layer, Projection::o, d_resid, act(Act::attn_out), 0, lora_u(Projection::o), d_attn, false, seed);
  Tensor dq, dk, dv;
  qkv_output_grads(layer, s, d_attn, dq, dk, dv);
  Tensor d_norm1 = alloc_tokens(prefix + "d_norm1", transient, cd, act(Act::norm1_out).shape);
  const Tensor d_qkv[] = {dq, dk, dv};
  linear_group_backward(layer, kLoraInputGroups[0], d_qkv, act(Act::norm1_out), 0, s, d_norm1, false, seed);
  memory_.free(dv);
  memory_.free(dk);
  memory_.free(dq);
  backend_.rmsnorm_backward(d_resid, d_norm1, act(Act::layer_input), w.input_norm, act(Act::norm1_rstd), true);
  memory_.free(d_norm1);
}

void LlamaStep::layer_backward_chunked(int layer, LayerState& s, const Tensor& d_resid,
                                       uint64_t seed, int64_t chunk_rows) {
  const LayerWeights& w = layer_weights(layer);
  auto act = [&](Act id) -> Tensor& { return s.acts[static_cast<int>(id)]; };
  const Tensor& x = act(Act::layer_input);
  const std::string prefix = fmt::format("layers.{}.", layer);
  const MemCategory transient = MemCategory::transient_activations;
  const DType cd = options_.compute_dtype;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  MT_ASSERT(act(Act::mid).empty() && act(Act::norm1_out).empty(),
            "a chunked backward after a whole-layer forward");

  // The recompute stopped after attention. Per chunk of token rows: recompute mid (o projection
  // + residual), norm2, gate, up, swiglu and their LoRA inputs; back-propagate the MLP into the
  // chunk's rows of d_resid (the grad of the layer output becomes that of mid), and the o
  // projection from there into the chunk's rows of d_attn.
  Tensor d_attn = alloc_tokens(prefix + "d_attn_out", transient, cd, act(Act::attn_out).shape);
  const ActiveChunk in_chunks(active_chunk_rows_, chunk_rows);
  std::optional<HeldWeights> row_wise_weights(std::in_place, *this, layer,
                                              std::initializer_list<Projection>{Projection::o, Projection::gate,
                                                                                Projection::up, Projection::down});
  for (int64_t begin = 0; begin < tokens_; begin += chunk_rows) {
    const int64_t end = std::min(tokens_, begin + chunk_rows);
    const Tensor attn_rows = act(Act::attn_out).slice_rows(begin, end);
    const Tensor d_resid_rows = d_resid.slice_rows(begin, end);
    LayerState chunk;
    Tensor& mid = chunk.acts[static_cast<int>(Act::mid)];
    mid = alloc_act_rows(Act::mid, layer, transient, end - begin, begin);
    const Tensor x_rows = x.slice_rows(begin, end);
    linear_forward(layer, Projection::o, attn_rows, begin, mid, &chunk.lora_u[static_cast<int>(Projection::o)],
                   transient, seed, true, &x_rows);
    mlp_forward(layer, mid, begin, chunk, transient, seed, true, /*keep_lora_u=*/true);
    if (lora_.find(layer, Projection::down) != nullptr)
      chunk.lora_u[static_cast<int>(Projection::down)] = lora_input_projection(
          layer, Projection::down, chunk.acts[static_cast<int>(Act::swiglu_out)], begin,
          transient, seed, true);
    mlp_backward(layer, chunk, mid, d_resid_rows, begin, seed);
    linear_backward(layer, Projection::o, d_resid_rows, attn_rows, begin,
                    chunk.lora_u[static_cast<int>(Projection::o)], d_attn.slice_rows(begin, end),
                    false, seed);
    free_layer(chunk, /*keep_input=*/false);
  }

  row_wise_weights.reset();

  // Attention over the whole sequence.
  Tensor dq, dk, dv;
  qkv_output_grads(layer, s, d_attn, dq, dk, dv);
  const HeldWeights qkv_weights(*this, layer, {Projection::q, Projection::k, Projection::v});

  // Per chunk: recompute norm1 and the q/k/v LoRA inputs, back-propagate the projections into
  // d_norm1's rows and norm1 into d_resid's (which then holds the grad of the layer input).
  for (int64_t begin = 0; begin < tokens_; begin += chunk_rows) {
    const int64_t end = std::min(tokens_, begin + chunk_rows);
    const Tensor x_rows = x.slice_rows(begin, end);
    LayerState chunk;
    Tensor& normed = chunk.acts[static_cast<int>(Act::norm1_out)];
    Tensor& rstd = chunk.acts[static_cast<int>(Act::norm1_rstd)];
    normed = alloc_act_rows(Act::norm1_out, layer, transient, end - begin, begin);
    rstd = alloc_act_rows(Act::norm1_rstd, layer, transient, end - begin, begin);
    backend_.rmsnorm_forward(normed, rstd, x_rows, w.input_norm, eps);
    const LoraInputGroup& qkv = kLoraInputGroups[0];
    group_lora_inputs(layer, qkv, normed, begin, chunk, transient, seed, true);
    Tensor d_norm1 = alloc_chunk(prefix + "d_norm1", transient, cd, normed.shape, begin);
    const Tensor d_qkv_rows[] = {dq.slice_rows(begin, end), dk.slice_rows(begin, end), dv.slice_rows(begin, end)};
    linear_group_backward(layer, qkv, d_qkv_rows, normed, begin, chunk, d_norm1, false, seed);
    backend_.rmsnorm_backward(d_resid.slice_rows(begin, end), d_norm1, x_rows, w.input_norm, rstd, true);
    memory_.free(d_norm1);
    free_layer(chunk, /*keep_input=*/false);
  }
  memory_.free(dv);
  memory_.free(dk);
  memory_.free(dq);
}

void LlamaStep::loss_and_head(const Tensor& last_hidden, float loss_grad_scale, const Tensor* d_resid) {
  const DType cd = options_.compute_dtype;
  const int64_t vocab = config_.vocab_size;
  Tensor normed = alloc_tokens("final_norm.out", MemCategory::transient_activations, cd, last_hidden.shape);
  Tensor rstd = alloc_tokens("final_norm.rstd", MemCategory::transient_activations, DType::f32, Shape{tokens_});
  backend_.rmsnorm_forward(normed, rstd, last_hidden, weights_.final_norm, static_cast<float>(config_.rms_norm_eps));
  Tensor d_normed;
  if (d_resid != nullptr)
    d_normed = alloc_tokens("final_norm.d_out", MemCategory::transient_activations, cd, last_hidden.shape);
  // The planned chunks, whatever the current shape (see the header comment).
  const int64_t chunk = options_.loss == LossImpl::full ? capacity_tokens_
                                                        : std::min(capacity_tokens_, options_.loss_chunk_tokens);
  for (int64_t begin = 0; begin < tokens_; begin += chunk) {
    const int64_t end = std::min(tokens_, begin + chunk);
    const Tensor targets = batch_.targets.slice_rows(begin, end);
    // The logits of this chunk (the whole batch when loss == full) in the compute dtype, as HF's
    // lm_head writes them; the loss reads them in fp32 (HF's logits.float()) and writes d_logits
    // over them in place, in the dtype the head's backward GEMM takes. So a 16-bit step holds
    // one 16-bit copy of the logits and no fp32 one (1 GiB at 4096 tokens x 128,256 in bf16).
    Tensor logits = memory_.alloc("loss.logits", MemCategory::logits_loss, cd, Shape{end - begin, vocab},
                                  Shape{std::min(capacity_tokens_, begin + chunk) - begin, vocab});
    backend_.matmul(logits, normed.slice_rows(begin, end), false, weights_.lm_head, true, 1.0f, 0.0f);
    if (d_resid == nullptr) {
      backend_.cross_entropy_forward(loss_sum_, logits, targets);
      memory_.free(logits);
      continue;
    }
    backend_.cross_entropy_forward_backward(loss_sum_, logits, logits, targets, loss_grad_scale);
    backend_.matmul(d_normed.slice_rows(begin, end), logits, false, weights_.lm_head, false, 1.0f, 0.0f);
    memory_.free(logits);
  }
  memory_.free(normed);
  if (d_resid != nullptr) {
    backend_.rmsnorm_backward(*d_resid, d_normed, last_hidden, weights_.final_norm, rstd, false);
    memory_.free(d_normed);
  }
  memory_.free(rstd);
}

Tensor LlamaStep::embed_inputs(MemCategory category) {
  Tensor x = alloc_tokens("layers.0.layer_input", category, options_.compute_dtype,
                          Shape{tokens_, config_.hidden_size});
  acquire_unit(FrozenBaseUnits::kEmbedding);
  backend_.embedding_forward(x, weights_.embed_tokens, batch_.input_ids);
  release_unit(FrozenBaseUnits::kEmbedding);
  return x;
}

void LlamaStep::forward_backward(float loss_grad_scale, uint64_t dropout_seed) {
  if (options_.offload_activations) return forward_backward_offloaded(loss_grad_scale, dropout_seed);
  const int layers = static_cast<int>(config_.num_hidden_layers);
  std::vector<LayerState> states(layers);
  begin_base_pass(/*with_backward=*/true);
  Tensor x = embed_inputs(MemCategory::saved_activations);
  for (int l = 0; l < layers; ++l) {
    states[l].acts[static_cast<int>(Act::layer_input)] = x;
    acquire_unit(l);
    x = layer_forward(l, states[l], false, dropout_seed, true);
    release_unit(l);
    if (options_.gradient_checkpointing) free_layer(states[l], /*keep_input=*/true);
  }
  Tensor d_resid = alloc_tokens("d_residual", MemCategory::transient_activations,
                                options_.compute_dtype, x.shape);
  acquire_unit(FrozenBaseUnits::kHead);
  loss_and_head(x, loss_grad_scale, &d_resid);
  release_unit(FrozenBaseUnits::kHead);
  memory_.free(x);
  for (int l = layers - 1; l >= 0; --l) {
    // One visit: the recompute (checkpointing) and the backward read the same gathered weights.
    acquire_unit(l);
    if (options_.gradient_checkpointing) layer_forward(l, states[l], true, dropout_seed, true);
    layer_backward(l, states[l], d_resid, dropout_seed);
    release_unit(l);
    if (on_layer_grads_done_) on_layer_grads_done_(l);
    free_layer(states[l], /*keep_input=*/false);
  }
  memory_.free(d_resid);
}

void LlamaStep::forward_backward_offloaded(float loss_grad_scale, uint64_t dropout_seed) {
  MT_ASSERT(options_.gradient_checkpointing, "offload without checkpointing");
  const int layers = static_cast<int>(config_.num_hidden_layers);
  const Shape residual_shape{tokens_, config_.hidden_size};
  std::array<Tensor, kOffloadSlots> slots;
  for (int i = 0; i < kOffloadSlots; ++i)
    slots[i] = alloc_tokens(fmt::format("offload.layer_input_slot{}", i), MemCategory::saved_activations,
                            options_.compute_dtype, residual_shape);
  auto slot_of = [&](int layer) { return layer % kOffloadSlots; };
  begin_base_pass(/*with_backward=*/true);
  acquire_unit(FrozenBaseUnits::kEmbedding);
  backend_.embedding_forward(slots[0], weights_.embed_tokens, batch_.input_ids);
  release_unit(FrozenBaseUnits::kEmbedding);
  for (int l = 0; l < layers; ++l) {
    const int in = slot_of(l), out = slot_of(l + 1);
    // The input is complete (the ops before wrote it): copy it out while this layer runs.
    if (l + 1 < layers) backend_.copy_to_host_async(offloaded_layer_input(l), slots[in], slot_copied_out_[in]);
    // The output slot held layer l - 1's input: its copy-out, issued a layer ago, must be done.
    backend_.compute_wait(slot_copied_out_[out]);
    LayerState state;
    state.acts[static_cast<int>(Act::layer_input)] = slots[in];
    acquire_unit(l);
    layer_forward(l, state, false, dropout_seed, true, &slots[out]);
    release_unit(l);
    free_layer(state, /*keep_input=*/true);
  }
  Tensor d_resid = alloc_tokens("d_residual", MemCategory::transient_activations,
                                options_.compute_dtype, residual_shape);
  acquire_unit(FrozenBaseUnits::kHead);
  loss_and_head(slots[slot_of(layers)], loss_grad_scale, &d_resid);
  release_unit(FrozenBaseUnits::kHead);
  for (int l = layers - 1; l >= 0; --l) {
    // Layer l - 1's input comes back into the other slot while this layer runs; that slot's
    // last reader (layer l + 1's backward, or the loss) was issued before, so the copy waits
    // for it.
    if (l >= 1)
      backend_.copy_from_host_async(slots[slot_of(l - 1)], offloaded_layer_input(l - 1), slot_copied_in_[slot_of(l - 1)]);
    backend_.compute_wait(slot_copied_in_[slot_of(l)]);
    LayerState state;
    state.acts[static_cast<int>(Act::layer_input)] = slots[slot_of(l)];
    acquire_unit(l);
    layer_forward(l, state, true, dropout_seed, true);
    layer_backward(l, state, d_resid, dropout_seed);
    release_unit(l);
    if (on_layer_grads_done_) on_layer_grads_done_(l);
    free_layer(state, /*keep_input=*/true);
  }
  memory_.free(d_resid);
  // Every copy into or out of a slot is done before the slots' space is handed out again.
  for (int i = 0; i < kOffloadSlots; ++i) {
    backend_.compute_wait(slot_copied_out_[i]);
    backend_.compute_wait(slot_copied_in_[i]);
  }
  for (int i = kOffloadSlots - 1; i >= 0; --i) memory_.free(slots[i]);
}

void LlamaStep::forward_loss() {
  const int layers = static_cast<int>(config_.num_hidden_layers);
  begin_base_pass(/*with_backward=*/false);
  Tensor x = embed_inputs(MemCategory::transient_activations);
  for (int l = 0; l < layers; ++l) {
    LayerState state;
    state.acts[static_cast<int>(Act::layer_input)] = x;
    acquire_unit(l);
    Tensor out = layer_forward(l, state, false, 0, false);
    release_unit(l);
    free_layer(state, /*keep_input=*/false);
    x = out;
  }
  acquire_unit(FrozenBaseUnits::kHead);
  loss_and_head(x, 0.0f, nullptr);
  release_unit(FrozenBaseUnits::kHead);
  memory_.free(x);
}

// ---- packed rows on cuDNN: the sequence table ----
void LlamaStep::set_packed_segments(const int32_t* segments, int64_t rows, int64_t seq) {
  RaggedAttention& r = batch_.ragged;
  r.slots = r.sequences = r.max_len = 0;
  if (r.table.empty() || memory_.device() == Device::meta) return;
  RaggedTableShape shape;
  shape.rows = rows;
  shape.seq = seq;
  shape.capacity = r.capacity;
  shape.n_heads = config_.num_attention_heads;
  shape.n_kv_heads = config_.num_key_value_heads;
  shape.head_dim = config_.head_dim;
  upload_ragged_table(backend_, segments, shape, r);  // left empty: the flash op runs
}
// ---- end packed rows on cuDNN ----

}  // namespace memtune
