#include "memtune/lora/lora_state.h"

#include <cmath>

#include <fmt/format.h>

#include "memtune/ops/backend.h"

namespace memtune {

namespace {

constexpr int64_t kFlatAlignElements = 64;  // 256 bytes: what every arena buffer gets

Tensor flat_view(const Tensor& flat, int64_t offset, Shape shape) {
  Tensor t = flat;
  t.shape = shape;
  if (flat.data != nullptr) t.data = flat.as<float>() + offset;
  return t;
}

// The 16-bit copy of an fp32 master that the step multiplies with (the master itself in fp32).
Tensor compute_copy(Memory& memory, const std::string& key, Shape shape, DType compute_dtype, const Tensor& master) {
  if (compute_dtype == DType::f32) return master;
  return memory.alloc(key + ".compute", MemCategory::adapters, compute_dtype, shape);
}

void allocate_compute_copies(Memory& memory, const LoraSpec& spec, LoraTensors& t, DType compute_dtype) {
  t.a_compute = compute_copy(memory, spec.a_key, spec.a_shape, compute_dtype, t.a);
  t.b_compute = compute_copy(memory, spec.b_key, spec.b_shape, compute_dtype, t.b);
}

// AdamW's two fp32 moments of every A and B, after all the adapters and grads.
void allocate_moments(Memory& memory, const std::vector<LoraSpec>& specs, std::vector<LoraTensors>& tensors) {
  for (size_t i = 0; i < specs.size(); ++i) {
    const LoraSpec& spec = specs[i];
    LoraTensors& t = tensors[i];
    const auto moment = [&](const std::string& key, const char* which, Shape shape) {
      return memory.alloc(key + which, MemCategory::optimizer_state, DType::f32, shape);
    };
    t.exp_avg_a = moment(spec.a_key, ".exp_avg", spec.a_shape);
    t.exp_avg_sq_a = moment(spec.a_key, ".exp_avg_sq", spec.a_shape);
    t.exp_avg_b = moment(spec.b_key, ".exp_avg", spec.b_shape);
    t.exp_avg_sq_b = moment(spec.b_key, ".exp_avg_sq", spec.b_shape);
  }
}

// The specs of `layer`'s group members in table order, when every member has an adapter with
// the same A shape; empty otherwise.
std::vector<size_t> group_specs(const std::vector<LoraSpec>& specs, int layer, const LoraInputGroup& group) {
  std::vector<size_t> found;
  for (int m = 0; m < group.size; ++m)
    for (size_t i = 0; i < specs.size(); ++i)
      if (specs[i].layer == layer && specs[i].projection == group.members[m]) found.push_back(i);
  if (static_cast<int>(found.size()) != group.size) return {};
  for (size_t i : found)
    if (specs[i].a_shape != specs[found[0]].a_shape) return {};
  return found;
}

// One buffer [members * r, in] of `dtype` for a group's A (or its copy, or its grad), handed out
// as row blocks into each member's tensor.
void allocate_stacked(Memory& memory, const std::vector<LoraSpec>& specs, const std::vector<size_t>& members,
                      const char* suffix, MemCategory category, DType dtype, std::vector<LoraTensors>& tensors,
                      Tensor LoraTensors::*field) {
  const LoraSpec& first = specs[members[0]];
  const int64_t rows = first.a_shape[0], in = first.a_shape[1];
  const Tensor whole = memory.alloc(fmt::format("{}{} (+{} stacked)", first.a_key, suffix, members.size() - 1), category,
                                    dtype, Shape{rows * static_cast<int64_t>(members.size()), in});
  for (size_t m = 0; m < members.size(); ++m) {
    Tensor part = whole.slice_rows(static_cast<int64_t>(m) * rows, static_cast<int64_t>(m + 1) * rows);
    tensors[members[m]].*field = part;
  }
}

}  // namespace

Tensor stacked_rows(const Tensor* const* parts, int count) {
  const Tensor& first = *parts[0];
  if (first.empty() || first.shape.ndim != 2) return Tensor{};
  for (int i = 1; i < count; ++i) {
    const Tensor& t = *parts[i];
    if (t.dtype != first.dtype || t.shape != first.shape ||
        t.data != static_cast<const char*>(first.data) + static_cast<size_t>(i) * first.nbytes())
      return Tensor{};
  }
  Tensor whole = first;
  whole.shape = Shape{first.shape[0] * count, first.shape[1]};
  return whole;
}

int64_t LoraState::flat_offset(const Tensor& view) const {
  MT_ASSERT(!flat_params_.empty(), "flat_offset without the flat layout");
  for (const Tensor* flat : {&flat_params_, &flat_grads_}) {
    const char* base = static_cast<const char*>(flat->data);
    const char* at = static_cast<const char*>(view.data);
    if (at >= base && at < base + flat->nbytes()) return (at - base) / static_cast<int64_t>(sizeof(float));
  }
  MT_ASSERT(false, "a tensor outside the flat adapter buffers");
  return 0;
}

LoraState LoraState::allocate(Memory& memory, const LlamaConfig& model, const LoraConfig& lora,
                              DType compute_dtype, bool with_optimizer, int64_t flat_multiple) {
  LoraState state;
  state.config_ = lora;
  state.specs_ = lora_table(model, lora);
  state.index_.assign(model.num_hidden_layers * kNumProjections, -1);
  if (flat_multiple > 0) return allocate_flat(state, memory, compute_dtype, with_optimizer, flat_multiple);
  // Grouped by role so that the plan reads per category, as the buffers would be laid out. The A
  // of each input group (kLoraInputGroups) is stacked: its f32 master, compute copy and grad are
  // each one buffer, allocated where the group's first member's would be.
  state.tensors_.resize(state.specs_.size());
  std::vector<std::vector<size_t>> stacked_from(state.specs_.size());  // first member -> members
  std::vector<bool> stacked(state.specs_.size(), false);
  for (int layer = 0; layer < model.num_hidden_layers; ++layer)
    for (const LoraInputGroup& group : kLoraInputGroups) {
      std::vector<size_t> members = group_specs(state.specs_, layer, group);
      if (members.empty()) continue;
      for (size_t i : members) stacked[i] = true;
      stacked_from[members[0]] = std::move(members);
    }
  const bool separate_copies = compute_dtype != DType::f32;
  for (size_t i = 0; i < state.specs_.size(); ++i) {
    const LoraSpec& spec = state.specs_[i];
    LoraTensors& t = state.tensors_[i];
    state.index_[spec.layer * kNumProjections + static_cast<int>(spec.projection)] =
        static_cast<int>(i);
    if (!stacked_from[i].empty()) {
      allocate_stacked(memory, state.specs_, stacked_from[i], "", MemCategory::adapters, DType::f32, state.tensors_, &LoraTensors::a);
      if (separate_copies)
        allocate_stacked(memory, state.specs_, stacked_from[i], ".compute", MemCategory::adapters, compute_dtype,
                         state.tensors_, &LoraTensors::a_compute);
    } else if (!stacked[i]) {
      t.a = memory.alloc(spec.a_key, MemCategory::adapters, DType::f32, spec.a_shape);
      t.a_compute = compute_copy(memory, spec.a_key, spec.a_shape, compute_dtype, t.a);
    }
    t.b = memory.alloc(spec.b_key, MemCategory::adapters, DType::f32, spec.b_shape);
    t.b_compute = compute_copy(memory, spec.b_key, spec.b_shape, compute_dtype, t.b);
  }
  if (!separate_copies)  // fp32: a stacked member's A is set with its group's first, after the loop
    for (LoraTensors& t : state.tensors_) t.a_compute = t.a;
  for (size_t i = 0; i < state.specs_.size(); ++i) {
    const LoraSpec& spec = state.specs_[i];
    LoraTensors& t = state.tensors_[i];
    if (!stacked_from[i].empty())
      allocate_stacked(memory, state.specs_, stacked_from[i], ".grad", MemCategory::adapter_grads, DType::f32,
                       state.tensors_, &LoraTensors::grad_a);
    else if (!stacked[i])
      t.grad_a = memory.alloc(spec.a_key + ".grad", MemCategory::adapter_grads, DType::f32, spec.a_shape);
    t.grad_b = memory.alloc(spec.b_key + ".grad", MemCategory::adapter_grads, DType::f32,
                            spec.b_shape);
  }
  if (with_optimizer) allocate_moments(memory, state.specs_, state.tensors_);
  return state;
}

LoraState LoraState::allocate_flat(LoraState& state, Memory& memory, DType compute_dtype,
                                   bool with_optimizer, int64_t flat_multiple) {
  // Offsets of A then B of each spec, in table order (layer by layer: what grad buckets need).
  std::vector<std::pair<int64_t, int64_t>> offsets;
  int64_t end = 0;
  for (const LoraSpec& spec : state.specs_) {
    const int64_t a = end;
    const int64_t b = a + (spec.a_shape.numel() + kFlatAlignElements - 1) / kFlatAlignElements * kFlatAlignElements;
    end = b + (spec.b_shape.numel() + kFlatAlignElements - 1) / kFlatAlignElements * kFlatAlignElements;
    offsets.push_back({a, b});
  }
  const int64_t padded = (end + flat_multiple - 1) / flat_multiple * flat_multiple;
  state.flat_params_ = memory.alloc("lora.flat_params", MemCategory::adapters, DType::f32, Shape{padded});
  state.tensors_.resize(state.specs_.size());
  for (size_t i = 0; i < state.specs_.size(); ++i) {
    const LoraSpec& spec = state.specs_[i];
    LoraTensors& t = state.tensors_[i];
    state.index_[spec.layer * kNumProjections + static_cast<int>(spec.projection)] = static_cast<int>(i);
    t.a = flat_view(state.flat_params_, offsets[i].first, spec.a_shape);
    t.b = flat_view(state.flat_params_, offsets[i].second, spec.b_shape);
  }
  for (size_t i = 0; i < state.specs_.size(); ++i) {
    const LoraSpec& spec = state.specs_[i];
    LoraTensors& t = state.tensors_[i];
    allocate_compute_copies(memory, spec, t, compute_dtype);
  }
  state.flat_grads_ = memory.alloc("lora.flat_grads", MemCategory::adapter_grads, DType::f32, Shape{padded});
  for (size_t i = 0; i < state.specs_.size(); ++i) {
    LoraTensors& t = state.tensors_[i];
    t.grad_a = flat_view(state.flat_grads_, offsets[i].first, state.specs_[i].a_shape);
    t.grad_b = flat_view(state.flat_grads_, offsets[i].second, state.specs_[i].b_shape);
  }
  if (with_optimizer) allocate_moments(memory, state.specs_, state.tensors_);
  return std::move(state);
}

const LoraTensors* LoraState::find(int layer, Projection projection) const {
  const int i = index_[layer * kNumProjections + static_cast<int>(projection)];
  return i < 0 ? nullptr : &tensors_[i];
}

void LoraState::init_peft(Backend& backend, uint64_t seed) const {
  for (size_t i = 0; i < specs_.size(); ++i) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(specs_[i].a_shape[1]));
    backend.fill_random(tensors_[i].a, Backend::Distribution::uniform, -bound, bound,
                        seed * 7919 + i);
    backend.fill(tensors_[i].b, 0.0f);
  }
  sync_compute_copies(backend);
}

void LoraState::zero_grads(Backend& backend) const {
  if (!flat_grads_.empty()) {
    backend.fill(flat_grads_, 0.0f);  // the gaps and the padding too
    return;
  }
  for (const LoraTensors& t : tensors_) {
    backend.fill(t.grad_a, 0.0f);
    backend.fill(t.grad_b, 0.0f);
  }
}

void LoraState::zero_optimizer(Backend& backend) const {
  for (const LoraTensors& t : tensors_)
    for (const Tensor* m : {&t.exp_avg_a, &t.exp_avg_sq_a, &t.exp_avg_b, &t.exp_avg_sq_b})
      if (!m->empty()) backend.fill(*m, 0.0f);
}

void LoraState::sync_compute_copies(Backend& backend) const {
  for (const LoraTensors& t : tensors_) {
    if (t.a_compute.data == t.a.data) continue;
    backend.convert(t.a_compute, t.a);
    backend.convert(t.b_compute, t.b);
  }
}

}  // namespace memtune
