// The trainable state on a device: LoRA master weights (fp32), their compute-dtype copies, the
// gradients and the AdamW moments.
//
// Room lora/ (docs/ARCHITECTURE.md): the adapters, merging them into the base, PEFT files; may include
// core/, io/, quant/, ops/ and model/.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "memtune/core/memory.h"
#include "memtune/lora/lora_config.h"

namespace memtune {

class Backend;
struct AdamWParams;

struct LoraTensors {
  Tensor a, b;                  // f32 masters, [r, in] and [out, r]
  Tensor a_compute, b_compute;  // what the GEMMs read: the masters in f32 mode, else copies
  Tensor grad_a, grad_b;        // f32
  Tensor exp_avg_a, exp_avg_sq_a, exp_avg_b, exp_avg_sq_b;  // f32; empty without optimizer
};

// Projections of a layer that read the same input: q, k, v (the attention's normed input) and
// gate, up (the MLP's). Where every member has an adapter, LoraState lays their A matrices (and
// the compute copies and gradients of A) end to end in one buffer, [members * r, in], so that the
// step can form every member's x A^T in one GEMM and back-propagate through all of them in one
// (LlamaStep's stacked LoRA; the data-parallel flat layout does not stack).
struct LoraInputGroup {
  std::array<Projection, 3> members;
  int size;
  const char* name;
};
inline constexpr LoraInputGroup kLoraInputGroups[] = {
    {{Projection::q, Projection::k, Projection::v}, 3, "qkv"},
    {{Projection::gate, Projection::up, Projection::up}, 2, "gate_up"},
};
inline constexpr int kNumLoraInputGroups = 2;

// Where a projection sits in kLoraInputGroups: its group and its place in the group's members;
// group -1 for a projection that reads an input of its own (o, down).
struct LoraGroupPlace {
  int group = -1, member = -1;
};
constexpr LoraGroupPlace lora_input_group_of(Projection p) {
  for (int g = 0; g < kNumLoraInputGroups; ++g)
    for (int m = 0; m < kLoraInputGroups[g].size; ++m)
      if (kLoraInputGroups[g].members[m] == p) return {g, m};
  return {};
}

// The rows of `first` through `first + count` tensors' worth, when `parts` (count tensors of one
// dtype and shape [r, in]) lie end to end in memory from parts[0]: one [count * r, in] view;
// an empty tensor otherwise.
Tensor stacked_rows(const Tensor* const* parts, int count);

class LoraState {
 public:
  // Every role (f32 masters, their compute-dtype copies, f32 grads, the two f32 AdamW moments)
  // is one flat buffer, and every tensor a view at the same element offset in each, in table
  // order (layer by layer), views 128-element aligned; the gaps hold zeros. So the optimizer's
  // elementwise ops (zeroing, the grad norm, AdamW, the compute copies) are one op each over the
  // whole buffers instead of one per tensor. flat_multiple 0 (a single-device run): the A of each
  // input group stack (kLoraInputGroups). flat_multiple > 0 (data parallel; parallel/): no
  // stacking, the buffers padded to a multiple of flat_multiple elements, so that they can be
  // reduced, sharded and gathered whole. moments_on_host (a backend; nullptr: in the arena) puts
  // the two moments in its host memory (pinned on CUDA, which its kernels read and write in
  // place), recorded in memory.record_host: RunConfig::offload_optimizer.
  static LoraState allocate(Memory& memory, const LlamaConfig& model, const LoraConfig& lora,
                            DType compute_dtype, bool with_optimizer, int64_t flat_multiple = 0,
                            Backend* moments_on_host = nullptr);

  const LoraConfig& config() const { return config_; }
  const std::vector<LoraSpec>& specs() const { return specs_; }
  std::vector<LoraTensors>& tensors() { return tensors_; }
  const std::vector<LoraTensors>& tensors() const { return tensors_; }
  // nullptr when (layer, projection) has no adapter.
  const LoraTensors* find(int layer, Projection projection) const;
  int64_t parameter_count() const { return count_lora_parameters(specs_); }
  // The flat buffers (f32 [padded elements]).
  const Tensor& flat_params() const { return flat_params_; }
  const Tensor& flat_grads() const { return flat_grads_; }
  // Element offset of a master / grad view in its flat buffer.
  int64_t flat_offset(const Tensor& view) const;

  // PEFT init: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0.
  void init_peft(Backend& backend, uint64_t seed) const;
  void zero_grads(Backend& backend) const;
  void zero_optimizer(Backend& backend) const;
  // Copies masters into the compute-dtype copies (after init, load and every update).
  void sync_compute_copies(Backend& backend) const;
  // acc (f32 [1]) += the sum of every grad's squares.
  void add_grad_squares(Backend& backend, const Tensor& acc) const;
  // One AdamW update of every adapter (allocated with_optimizer).
  void adamw_step(Backend& backend, const AdamWParams& params) const;

 private:
  LoraConfig config_;
  std::vector<LoraSpec> specs_;
  std::vector<LoraTensors> tensors_;
  std::vector<int> index_;  // layer * kNumProjections + projection -> tensors_ index or -1
  Tensor flat_params_, flat_compute_, flat_grads_, flat_exp_avg_, flat_exp_avg_sq_;
  std::shared_ptr<void> host_moments_;  // owns both moments' host memory (moments_on_host)
};

}  // namespace memtune
