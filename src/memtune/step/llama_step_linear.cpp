// LlamaStep's projections: the frozen GEMM and its LoRA term, one projection at a time
// (linear_forward / linear_backward) or for an input group whose A stack (linear_group_*: q/k/v
// and gate/up read one x). The layer passes that call them are in llama_step.cpp.
#include <fmt/format.h>

#include "memtune/step/llama_step.h"

namespace memtune {

Tensor LlamaStep::lora_input_projection(int layer, Projection p, const Tensor& x,
                                        int64_t first_row, MemCategory u_category,
                                        uint64_t dropout_seed, bool training) {
  const LoraTensors* adapter = lora_.find(layer, p);
  const std::string u_name = fmt::format("layers.{}.{}.lora_u", layer, projection_name(p));
  Tensor u = alloc_chunk(u_name, u_category, options_.compute_dtype, Shape{x.rows(), lora_.config().r}, first_row);
  if (training && lora_dropout_ > 0.0f) {
    Tensor dropped = alloc_chunk(u_name + ".dropped_x", MemCategory::transient_activations,
                                 x.dtype, x.shape, first_row);
    backend_.dropout(dropped, x, lora_dropout_, dropout_hash(dropout_seed, layer * 8 + static_cast<int>(p)),
                     static_cast<uint64_t>(first_row * x.cols()));
    backend_.matmul(u, dropped, false, adapter->a_compute, true, 1.0f, 0.0f);
    memory_.free(dropped);
  } else {
    backend_.matmul(u, x, false, adapter->a_compute, true, 1.0f, 0.0f);
  }
  return u;
}

void LlamaStep::base_linear_forward(int layer, Projection p, const Tensor& x, const Tensor& y) {
  const Tensor w = frozen_weight(layer, p);
  // A frozen bias (Qwen2's q/k/v) is part of the base output, before the low-rank term, as in
  // PEFT where the base layer's F.linear adds it. It goes into y first and the GEMM adds onto it.
  const Tensor& bias = layer_weights(layer).bias[static_cast<int>(p)];
  if (!bias.empty()) backend_.broadcast_rows(y, bias);
  backend_.matmul(y, x, false, w, true, 1.0f, bias.empty() ? 0.0f : 1.0f);
  release_frozen_weight(layer, p, w);
}

void LlamaStep::linear_forward(int layer, Projection p, const Tensor& x, int64_t first_row,
                               const Tensor& y, Tensor* lora_u, MemCategory u_category,
                               uint64_t dropout_seed, bool training, const Tensor* residual) {
  base_linear_forward(layer, p, x, y);
  const LoraTensors* adapter = lora_.find(layer, p);
  if (adapter == nullptr) {
    if (residual != nullptr) backend_.add(y, y, *residual);
    return;
  }
  // PEFT's order: the base output first, then the low-rank term added onto it. (Writing the
  // low-rank term first and letting the base GEMM add onto it with beta 1 saves a pass over y,
  // but it measured further from Hugging Face's bf16 goldens on the GPU than the CPU oracle
  // is: bench/NOTES.md, 2026-12-03.)
  Tensor u = lora_input_projection(layer, p, x, first_row, u_category, dropout_seed, training);
  if (residual != nullptr) backend_.lora_residual_forward(y, u, adapter->b_compute, lora_scale_, *residual);
  else backend_.matmul(y, u, false, adapter->b_compute, true, lora_scale_, 1.0f);
  if (lora_u != nullptr) *lora_u = u;
  else memory_.free(u);
}

void LlamaStep::linear_backward(int layer, Projection p, const Tensor& dy, const Tensor& x,
                                int64_t first_row, const Tensor& lora_u, const Tensor& dx,
                                bool accumulate, uint64_t dropout_seed) {
  // Everything that reads x comes before dx is written, so that a caller may pass dx == x (an
  // input that nothing needs after this backward) and save a buffer; accumulating into x is
  // never meaningful, so that case stays an error.
  MT_ASSERT(!accumulate || dx.data != x.data, "linear_backward accumulates into its own input");
  const LoraTensors* adapter = lora_.find(layer, p);
  const std::string name = fmt::format("layers.{}.{}", layer, projection_name(p));
  const uint64_t mask_seed = dropout_hash(dropout_seed, layer * 8 + static_cast<int>(p));
  const uint64_t mask_offset = static_cast<uint64_t>(first_row * x.cols());
  Tensor du;
  if (adapter != nullptr) {
    backend_.matmul(adapter->grad_b, dy, true, lora_u, false, lora_scale_, 1.0f);
    du = alloc_chunk(name + ".d_lora_u", MemCategory::transient_activations,
                     options_.compute_dtype, lora_u.shape, first_row);
    backend_.matmul(du, dy, false, adapter->b_compute, false, lora_scale_, 0.0f);
    if (lora_dropout_ > 0.0f) {
      Tensor dropped_x = alloc_chunk(name + ".dropped_x", MemCategory::transient_activations,
                                     x.dtype, x.shape, first_row);
      backend_.dropout(dropped_x, x, lora_dropout_, mask_seed, mask_offset);
      backend_.matmul(adapter->grad_a, du, true, dropped_x, false, 1.0f, 1.0f);
      memory_.free(dropped_x);
    } else {
      backend_.matmul(adapter->grad_a, du, true, x, false, 1.0f, 1.0f);
    }
  }
  // x is not read from here on.
  const Tensor w = frozen_weight(layer, p);
  backend_.matmul(dx, dy, false, w, false, 1.0f, accumulate ? 1.0f : 0.0f);
  release_frozen_weight(layer, p, w);
  if (adapter == nullptr) return;
  if (lora_dropout_ > 0.0f) {
    // du A, masked and rescaled like the forward's input.
    Tensor d_dropped_x = alloc_chunk(name + ".d_dropped_x", MemCategory::transient_activations,
                                     x.dtype, x.shape, first_row);
    backend_.matmul(d_dropped_x, du, false, adapter->a_compute, false, 1.0f, 0.0f);
    backend_.dropout(d_dropped_x, d_dropped_x, lora_dropout_, mask_seed, mask_offset);
    backend_.add(dx, dx, d_dropped_x);
    memory_.free(d_dropped_x);
  } else {
    backend_.matmul(dx, du, false, adapter->a_compute, false, 1.0f, 1.0f);
  }
  memory_.free(du);
}

Tensor LlamaStep::find_stacked_lora_a(int layer, const LoraInputGroup& group) const {
  // Dropout draws its own mask of x for every member, so the members' inputs differ.
  if (!options_.stacked_lora || lora_dropout_ > 0.0f) return Tensor{};
  std::array<const Tensor*, 3> a{}, grads{};
  for (int m = 0; m < group.size; ++m) {
    const LoraTensors* adapter = lora_.find(layer, group.members[m]);
    if (adapter == nullptr) return Tensor{};
    a[m] = &adapter->a_compute;
    grads[m] = &adapter->grad_a;
  }
  if (stacked_rows(grads.data(), group.size).empty()) return Tensor{};
  return stacked_rows(a.data(), group.size);
}

const Tensor& LlamaStep::stacked_lora_a(int layer, const LoraInputGroup& group) const {
  return stacked_lora_a_[layer][&group - kLoraInputGroups];
}

void LlamaStep::group_lora_inputs(int layer, const LoraInputGroup& group, const Tensor& x, int64_t first_row,
                                  LayerState& keep, MemCategory u_category, uint64_t dropout_seed, bool training) {
  const Tensor& a = stacked_lora_a(layer, group);
  if (a.empty()) {
    for (int m = 0; m < group.size; ++m) {
      const Projection p = group.members[m];
      if (lora_.find(layer, p) != nullptr)
        keep.lora_u[static_cast<int>(p)] =
            lora_input_projection(layer, p, x, first_row, u_category, dropout_seed, training);
    }
    return;
  }
  Tensor& ut = keep.lora_u_stacked[&group - kLoraInputGroups];
  ut = memory_.alloc(fmt::format("layers.{}.{}.lora_uT", layer, group.name), u_category, options_.compute_dtype,
                     Shape{a.rows(), x.rows()}, Shape{a.rows(), reserved_rows(first_row)});
  backend_.matmul(ut, a, false, x, true, 1.0f, 0.0f);
  const int64_t r = lora_.config().r;
  for (int m = 0; m < group.size; ++m) keep.lora_u[static_cast<int>(group.members[m])] = ut.slice_rows(m * r, (m + 1) * r);
}

void LlamaStep::linear_group_forward(int layer, const LoraInputGroup& group, const Tensor& x, int64_t first_row,
                                     const Tensor* ys, LayerState* keep, MemCategory u_category,
                                     uint64_t dropout_seed, bool training, bool add_lora_b) {
  if (stacked_lora_a(layer, group).empty()) {
    MT_ASSERT(add_lora_b, "an unstacked group adds its own LoRA terms");
    for (int m = 0; m < group.size; ++m) {
      const int p = static_cast<int>(group.members[m]);
      linear_forward(layer, group.members[m], x, first_row, ys[m], keep != nullptr ? &keep->lora_u[p] : nullptr,
                     u_category, dropout_seed, training);
    }
    return;
  }
  for (int m = 0; m < group.size; ++m) base_linear_forward(layer, group.members[m], x, ys[m]);
  // PEFT's order, as linear_forward: the base outputs first, then each low-rank term onto them.
  LayerState local;
  LayerState& held = keep != nullptr ? *keep : local;
  group_lora_inputs(layer, group, x, first_row, held, u_category, dropout_seed, training);
  if (!add_lora_b) {
    MT_ASSERT(keep != nullptr, "a caller that adds the LoRA terms itself must keep the LoRA inputs");
    return;
  }
  for (int m = 0; m < group.size; ++m) {
    const Projection p = group.members[m];
    backend_.matmul(ys[m], held.lora_u[static_cast<int>(p)], true, lora_.find(layer, p)->b_compute, true, lora_scale_,
                    1.0f);
  }
  if (keep == nullptr) free_layer(local, /*keep_input=*/false);
}

void LlamaStep::linear_group_backward(int layer, const LoraInputGroup& group, const Tensor* dys, const Tensor& x,
                                      int64_t first_row, const LayerState& saved, const Tensor& dx,
                                      bool accumulate, uint64_t dropout_seed) {
  const Tensor& ut = saved.lora_u_stacked[&group - kLoraInputGroups];
  if (ut.empty()) {
    for (int m = 0; m < group.size; ++m)
      linear_backward(layer, group.members[m], dys[m], x, first_row, saved.lora_u[static_cast<int>(group.members[m])],
                      dx, accumulate || m > 0, dropout_seed);
    return;
  }
  const int64_t r = lora_.config().r;
  const Tensor& a = stacked_lora_a(layer, group);
  MT_ASSERT(!a.empty() && ut.rows() == a.rows(), "stacked LoRA inputs without stacked adapters");
  Tensor dut = memory_.alloc(fmt::format("layers.{}.{}.d_lora_uT", layer, group.name), MemCategory::transient_activations,
                             options_.compute_dtype, ut.shape, Shape{ut.rows(), reserved_rows(first_row)});
  const LoraTensors* first = lora_.find(layer, group.members[0]);
  for (int m = 0; m < group.size; ++m) {
    const LoraTensors* adapter = lora_.find(layer, group.members[m]);
    const Tensor ut_m = ut.slice_rows(m * r, (m + 1) * r);
    // grad B += s dy^T u, and du^T = s B^T dy^T: linear_backward's, with u kept transposed.
    backend_.matmul(adapter->grad_b, dys[m], true, ut_m, true, lora_scale_, 1.0f);
    backend_.matmul(dut.slice_rows(m * r, (m + 1) * r), adapter->b_compute, true, dys[m], true, lora_scale_, 0.0f);
  }
  // grad A (every member's, stacked as A is) += du^T x: the last read of x before dx is written.
  Tensor grad_a = first->grad_a;
  grad_a.shape = a.shape;
  backend_.matmul(grad_a, dut, false, x, false, 1.0f, 1.0f);
  for (int m = 0; m < group.size; ++m) {
    const Projection p = group.members[m];
    const Tensor w = frozen_weight(layer, p);
    backend_.matmul(dx, dys[m], false, w, false, 1.0f, (accumulate || m > 0) ? 1.0f : 0.0f);
    release_frozen_weight(layer, p, w);
  }
  backend_.matmul(dx, dut, true, a, false, 1.0f, 1.0f);
  memory_.free(dut);
}

}  // namespace memtune
