// The meta backend: the training step runs on it to make the plan. Memory calls hand out
// nothing (the Memory class places the buffers) and ops do no arithmetic, so planning a 70B
// model costs only the bookkeeping of its allocations.
#include "memtune/ops/backend.h"

namespace memtune {
namespace {

class MetaBackend final : public Backend {
 public:
  explicit MetaBackend(uint64_t target_workspace_bytes) : target_workspace_bytes_(target_workspace_bytes) {}
  uint64_t workspace_bytes() const override { return target_workspace_bytes_; }
  Device device() const override { return Device::meta; }
  std::string name() const override { return "meta"; }
  void* allocate_arena(uint64_t) override { return nullptr; }
  void free_arena(void*) override {}
  void copy_from_host(const Tensor&, const void*) override {}
  void copy_to_host(void*, const Tensor&) override {}
  // The planner needs only the bytes of the offload host memory (Memory records them).
  void* allocate_host(uint64_t) override { return nullptr; }
  void free_host(void*) override {}
  void fill(const Tensor&, float) override {}
  void convert(const Tensor&, const Tensor&) override {}
  void add(const Tensor&, const Tensor&, const Tensor&) override {}
  void broadcast_rows(const Tensor&, const Tensor&) override {}
  void matmul(const Tensor&, const Tensor&, bool, const Tensor&, bool, float, float) override {}
  void embedding_forward(const Tensor&, const Tensor&, const Tensor&) override {}
  void rmsnorm_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, float) override {}
  void rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        bool) override {}
  void rope_forward(const Tensor&, const Tensor&, const Tensor&, int64_t) override {}
  void rope_backward(const Tensor&, const Tensor&, const Tensor&, int64_t) override {}
  void swiglu_forward(const Tensor&, const Tensor&, const Tensor&) override {}
  void swiglu_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&) override {}
  void attention_eager_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, const Tensor&, const Tensor&,
                               const AttentionDims&) override {}
  void attention_eager_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const AttentionDims&) override {}
  void attention_flash_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, const Tensor&, const AttentionDims&) override {}
  void attention_flash_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const AttentionDims&) override {}
  void attention_decode(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const AttentionDims&) override {}
  void cross_entropy_forward_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      float) override {}
  void cross_entropy_forward(const Tensor&, const Tensor&, const Tensor&) override {}
  void dropout(const Tensor&, const Tensor&, float, uint64_t, uint64_t) override {}
  void sum_squares(const Tensor&, const Tensor&) override {}
  void adamw_step(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                  const AdamWParams&) override {}
  void scale(const Tensor&, float) override {}
  // QLoRA: the planner never needs the codes, only the tensors' sizes.
  void quantize_4bit(Quantized4bit&, const Tensor&, std::string_view) override {}

 private:
  uint64_t target_workspace_bytes_;
};

}  // namespace

std::unique_ptr<Backend> make_meta_backend(uint64_t target_workspace_bytes) {
  return std::make_unique<MetaBackend>(target_workspace_bytes);
}

}  // namespace memtune
