#include "memtune/lora/lora_state.h"

#include <cmath>

#include "memtune/ops/backend.h"

namespace memtune {

LoraState LoraState::allocate(Memory& memory, const LlamaConfig& model, const LoraConfig& lora,
                              DType compute_dtype, bool with_optimizer) {
  LoraState state;
  state.config_ = lora;
  state.specs_ = lora_table(model, lora);
  state.index_.assign(model.num_hidden_layers * kNumProjections, -1);
  // Grouped by role so that the plan reads per category, as the buffers would be laid out.
  state.tensors_.resize(state.specs_.size());
  for (size_t i = 0; i < state.specs_.size(); ++i) {
    const LoraSpec& spec = state.specs_[i];
    LoraTensors& t = state.tensors_[i];
    state.index_[spec.layer * kNumProjections + static_cast<int>(spec.projection)] =
        static_cast<int>(i);
    t.a = memory.alloc(spec.a_key, MemCategory::adapters, DType::f32, spec.a_shape);
    t.b = memory.alloc(spec.b_key, MemCategory::adapters, DType::f32, spec.b_shape);
    if (compute_dtype == DType::f32) {
      t.a_compute = t.a;
      t.b_compute = t.b;
    } else {
      t.a_compute = memory.alloc(spec.a_key + ".compute", MemCategory::adapters, compute_dtype,
                                 spec.a_shape);
      t.b_compute = memory.alloc(spec.b_key + ".compute", MemCategory::adapters, compute_dtype,
                                 spec.b_shape);
    }
  }
  for (size_t i = 0; i < state.specs_.size(); ++i) {
    const LoraSpec& spec = state.specs_[i];
    LoraTensors& t = state.tensors_[i];
    t.grad_a = memory.alloc(spec.a_key + ".grad", MemCategory::adapter_grads, DType::f32,
                            spec.a_shape);
    t.grad_b = memory.alloc(spec.b_key + ".grad", MemCategory::adapter_grads, DType::f32,
                            spec.b_shape);
  }
  if (with_optimizer) {
    for (size_t i = 0; i < state.specs_.size(); ++i) {
      const LoraSpec& spec = state.specs_[i];
      LoraTensors& t = state.tensors_[i];
      const auto moment = [&](const std::string& key, const char* which, Shape shape) {
        return memory.alloc(key + which, MemCategory::optimizer_state, DType::f32, shape);
      };
      t.exp_avg_a = moment(spec.a_key, ".exp_avg", spec.a_shape);
      t.exp_avg_sq_a = moment(spec.a_key, ".exp_avg_sq", spec.a_shape);
      t.exp_avg_b = moment(spec.b_key, ".exp_avg", spec.b_shape);
      t.exp_avg_sq_b = moment(spec.b_key, ".exp_avg_sq", spec.b_shape);
    }
  }
  return state;
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
