#include "memtune/lora/lora_state.h"

#include <cmath>

#include <fmt/format.h>

#include "memtune/ops/backend.h"

namespace memtune {

namespace {

// Every view starts at a multiple of this many elements: 512 bytes in f32, 256 in the 16-bit
// compute copies (what every arena buffer gets).
constexpr int64_t kFlatAlignElements = 128;

int64_t align_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

Tensor flat_view(const Tensor& flat, int64_t offset, Shape shape) {
  Tensor t = flat;
  t.shape = shape;
  if (flat.data != nullptr) t.data = static_cast<char*>(flat.data) + offset * static_cast<int64_t>(dtype_size(flat.dtype));
  return t;
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

// Where every spec's A and B start in the flat buffers, in elements. One layout serves every role
// (masters, compute copies, grads, both moments), so that an elementwise update of all the
// adapters is one op over the flat buffers. Table order, layer by layer (what the data-parallel
// grad buckets need); with `stack`, the A of an input group's members lie end to end without a
// gap, at the group's first member.
struct FlatLayout {
  std::vector<int64_t> a, b;
  int64_t total = 0;
};

FlatLayout flat_layout(const std::vector<LoraSpec>& specs, int num_layers, bool stack, int64_t multiple) {
  std::vector<std::vector<size_t>> stacked_from(specs.size());  // first member -> members
  std::vector<bool> stacked(specs.size(), false);
  if (stack)
    for (int layer = 0; layer < num_layers; ++layer)
      for (const LoraInputGroup& group : kLoraInputGroups) {
        std::vector<size_t> members = group_specs(specs, layer, group);
        if (members.empty()) continue;
        for (size_t i : members) stacked[i] = true;
        stacked_from[members[0]] = std::move(members);
      }
  FlatLayout layout;
  layout.a.assign(specs.size(), 0);
  layout.b.assign(specs.size(), 0);
  int64_t end = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!stacked_from[i].empty()) {
      for (size_t m = 0; m < stacked_from[i].size(); ++m)
        layout.a[stacked_from[i][m]] = end + static_cast<int64_t>(m) * specs[i].a_shape.numel();
      end = align_up(end + static_cast<int64_t>(stacked_from[i].size()) * specs[i].a_shape.numel(), kFlatAlignElements);
    } else if (!stacked[i]) {
      layout.a[i] = end;
      end = align_up(end + specs[i].a_shape.numel(), kFlatAlignElements);
    }
    layout.b[i] = end;
    end = align_up(end + specs[i].b_shape.numel(), kFlatAlignElements);
  }
  layout.total = align_up(std::max<int64_t>(end, 1), multiple);
  return layout;
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
  for (const Tensor* flat : {&flat_params_, &flat_grads_}) {
    const char* base = static_cast<const char*>(flat->data);
    const char* at = static_cast<const char*>(view.data);
    if (at >= base && at < base + flat->nbytes()) return (at - base) / static_cast<int64_t>(sizeof(float));
  }
  MT_ASSERT(false, "a tensor outside the flat adapter buffers");
  return 0;
}

LoraState LoraState::allocate(Memory& memory, const LlamaConfig& model, const LoraConfig& lora,
                              DType compute_dtype, bool with_optimizer, int64_t flat_multiple,
                              Backend* moments_on_host) {
  LoraState state;
  state.config_ = lora;
  state.specs_ = lora_table(model, lora);
  state.index_.assign(model.num_hidden_layers * kNumProjections, -1);
  const FlatLayout layout = flat_layout(state.specs_, model.num_hidden_layers, /*stack=*/flat_multiple == 0,
                                        std::max<int64_t>(flat_multiple, 1));
  const Shape flat{layout.total};
  // By role, so that the plan reads per category: the masters and their compute copies
  // (adapters), the grads, the moments.
  state.flat_params_ = memory.alloc("lora.flat_params", MemCategory::adapters, DType::f32, flat);
  state.flat_compute_ = compute_dtype == DType::f32
                            ? state.flat_params_
                            : memory.alloc("lora.flat_params.compute", MemCategory::adapters, compute_dtype, flat);
  state.flat_grads_ = memory.alloc("lora.flat_grads", MemCategory::adapter_grads, DType::f32, flat);
  if (with_optimizer && moments_on_host != nullptr) {
    // One host buffer for both moments, the second at the first's end (a multiple of 128 elements).
    const Tensor both = allocate_host_tensor(*moments_on_host, memory, "lora.flat_exp_avg + lora.flat_exp_avg_sq",
                                             DType::f32, Shape{2, layout.total}, state.host_moments_);
    state.flat_exp_avg_ = both.slice_rows(0, 1).view(flat);
    state.flat_exp_avg_sq_ = both.slice_rows(1, 2).view(flat);
  } else if (with_optimizer) {
    state.flat_exp_avg_ = memory.alloc("lora.flat_exp_avg", MemCategory::optimizer_state, DType::f32, flat);
    state.flat_exp_avg_sq_ = memory.alloc("lora.flat_exp_avg_sq", MemCategory::optimizer_state, DType::f32, flat);
  }
  state.tensors_.resize(state.specs_.size());
  for (size_t i = 0; i < state.specs_.size(); ++i) {
    const LoraSpec& spec = state.specs_[i];
    LoraTensors& t = state.tensors_[i];
    state.index_[spec.layer * kNumProjections + static_cast<int>(spec.projection)] = static_cast<int>(i);
    const auto views = [&](const Tensor& buffer, Tensor LoraTensors::*a, Tensor LoraTensors::*b) {
      t.*a = flat_view(buffer, layout.a[i], spec.a_shape);
      t.*b = flat_view(buffer, layout.b[i], spec.b_shape);
    };
    views(state.flat_params_, &LoraTensors::a, &LoraTensors::b);
    views(state.flat_compute_, &LoraTensors::a_compute, &LoraTensors::b_compute);
    views(state.flat_grads_, &LoraTensors::grad_a, &LoraTensors::grad_b);
    if (with_optimizer) {
      views(state.flat_exp_avg_, &LoraTensors::exp_avg_a, &LoraTensors::exp_avg_b);
      views(state.flat_exp_avg_sq_, &LoraTensors::exp_avg_sq_a, &LoraTensors::exp_avg_sq_b);
    }
  }
  return state;
}

const LoraTensors* LoraState::find(int layer, Projection projection) const {
  const int i = index_[layer * kNumProjections + static_cast<int>(projection)];
  return i < 0 ? nullptr : &tensors_[i];
}

void LoraState::init_peft(Backend& backend, uint64_t seed) const {
  backend.fill(flat_params_, 0.0f);  // every B, and the gaps between the views
  for (size_t i = 0; i < specs_.size(); ++i) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(specs_[i].a_shape[1]));
    backend.fill_random(tensors_[i].a, Backend::Distribution::uniform, -bound, bound,
                        seed * 7919 + i);
  }
  sync_compute_copies(backend);
}

// The gaps between the views hold zeros in every flat buffer (init_peft, zero_grads,
// zero_optimizer), which AdamW keeps at zero and which add nothing to the sum of squares: the
// ops below may run over the whole buffers.
void LoraState::zero_grads(Backend& backend) const { backend.fill(flat_grads_, 0.0f); }

void LoraState::zero_optimizer(Backend& backend) const {
  if (flat_exp_avg_.shape.ndim == 0) return;  // no optimizer
  backend.fill(flat_exp_avg_, 0.0f);
  backend.fill(flat_exp_avg_sq_, 0.0f);
}

void LoraState::sync_compute_copies(Backend& backend) const {
  if (flat_compute_.dtype != DType::f32) backend.convert(flat_compute_, flat_params_);
}

void LoraState::add_grad_squares(Backend& backend, const Tensor& acc) const { backend.sum_squares(acc, flat_grads_); }

void LoraState::adamw_step(Backend& backend, const AdamWParams& params) const {
  MT_ASSERT(flat_exp_avg_.shape.ndim != 0, "adamw_step on adapters allocated without optimizer state");
  backend.adamw_step(flat_params_, flat_grads_, flat_exp_avg_, flat_exp_avg_sq_, params);
}

}  // namespace memtune
