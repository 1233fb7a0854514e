// A per-op time breakdown of a step: a Backend that forwards every call to another backend and,
// while enabled, times each op.
//
// Timing synchronises the device before and after every op, so each op's time is its own (launch
// plus execution, nothing queued behind it). That serialisation costs a few microseconds per op,
// so a profiled step is slower than a plain one: profile a step of its own, never the steps
// whose tokens/s are reported. Disabled, the wrapper adds one branch per call.
//
// GEMMs are also grouped by shape (M x N x K, transposes) with their achieved FLOP/s, the
// figure that says whether a step is GEMM-bound and how far the GEMMs are from the device peak.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "memtune/ops/backend.h"

namespace memtune {

struct OpTime {
  std::string op;  // "matmul", "attention_flash_backward", ...; GEMMs: "matmul 4096x14336x4096 NT"
  int64_t calls = 0;
  double seconds = 0;
  double flops = 0;  // GEMMs only: 2 M N K per call, summed
};

class TimedBackend final : public Backend {
 public:
  explicit TimedBackend(Backend& inner) : inner_(inner) {}

  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }
  void clear() { ops_.clear(); gemms_.clear(); }
  // Per op, most time first; and the GEMMs by shape, most time first.
  std::vector<OpTime> ops() const;
  std::vector<OpTime> gemm_shapes() const;
  // {"ops": [{op, calls, ms, share}], "gemm_shapes": [{shape, calls, ms, tflops}], "total_ms"}
  nlohmann::json to_json() const;
  // A fixed-width table of the above (top `max_gemm_shapes` GEMM shapes).
  std::string table(size_t max_gemm_shapes = 12) const;

  Device device() const override { return inner_.device(); }
  std::string name() const override { return inner_.name(); }

  void* allocate_arena(uint64_t bytes) override { return inner_.allocate_arena(bytes); }
  void free_arena(void* base) override { inner_.free_arena(base); }
  void copy_from_host(const Tensor& dst, const void* host_src) override;
  void copy_to_host(void* host_dst, const Tensor& src) override;
  void synchronize() override { inner_.synchronize(); }
  uint64_t workspace_bytes() const override { return inner_.workspace_bytes(); }
  void bind_workspace(const Tensor& workspace) override { inner_.bind_workspace(workspace); }

  void* allocate_host(uint64_t bytes) override { return inner_.allocate_host(bytes); }
  void free_host(void* base) override { inner_.free_host(base); }
  CopyEvent create_event() override { return inner_.create_event(); }
  void destroy_event(CopyEvent event) override { inner_.destroy_event(event); }
  // Asynchronous copies are not timed: synchronising around them would remove the overlap that
  // they exist for. Their cost shows in the ops that wait for them.
  void copy_to_host_async(void* host_dst, const Tensor& src, CopyEvent done) override {
    inner_.copy_to_host_async(host_dst, src, done);
  }
  void copy_from_host_async(const Tensor& dst, const void* host_src, CopyEvent done) override {
    inner_.copy_from_host_async(dst, host_src, done);
  }
  void compute_wait(CopyEvent done) override { inner_.compute_wait(done); }

  void fill(const Tensor& dst, float value) override;
  void convert(const Tensor& dst, const Tensor& src) override;
  void add(const Tensor& dst, const Tensor& a, const Tensor& b) override;
  void broadcast_rows(const Tensor& dst, const Tensor& row) override;
  void matmul(const Tensor& c, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
              float alpha, float beta) override;
  void embedding_forward(const Tensor& out, const Tensor& table, const Tensor& ids) override;
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                       float eps) override;
  void rmsnorm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Tensor& rstd, bool accumulate) override;
  void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, int64_t head_dim) override;
  void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq, int64_t head_dim) override;
  void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) override;
  void swiglu_lora_forward(const Tensor& out, const Tensor& gate, const Tensor& up, const Tensor& ut_gate,
                           const Tensor& b_gate, const Tensor& ut_up, const Tensor& b_up, float scale) override;
  void lora_residual_forward(const Tensor& y, const Tensor& u, const Tensor& b, float scale,
                             const Tensor& residual) override;
  void swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                       const Tensor& up) override;
  void attention_eager_forward(const Tensor& out, const Tensor& probs, const Tensor& scores_scratch,
                               const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segments,
                               const AttentionDims& dims) override;
  void attention_eager_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                const Tensor& dprobs_scratch, const Tensor& d_out, const Tensor& probs,
                                const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segments,
                                const AttentionDims& dims) override;
  void attention_flash_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& segments, const AttentionDims& dims) override;
  void attention_flash_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& delta_scratch,
                                const Tensor& dq_accum_scratch, const Tensor& d_out, const Tensor& out,
                                const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& segments, const AttentionDims& dims) override;
  void attention_cudnn_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& segments, const RaggedAttention& ragged,
                               const Tensor& workspace, const AttentionDims& dims) override;
  void attention_cudnn_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& delta_scratch,
                                const Tensor& workspace, const Tensor& d_out, const Tensor& out,
                                const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& segments, const RaggedAttention& ragged,
                                const AttentionDims& dims) override;
  void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                        const AttentionDims& dims) override;
  void cross_entropy_forward_backward(const Tensor& loss_sum, const Tensor& d_logits, const Tensor& logits,
                                      const Tensor& targets, float grad_scale) override;
  void cross_entropy_forward(const Tensor& loss_sum, const Tensor& logits, const Tensor& targets) override;
  void dropout(const Tensor& out, const Tensor& x, float p, uint64_t seed, uint64_t index_offset) override;
  void sum_squares(const Tensor& acc, const Tensor& x) override;
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const AdamWParams& params) override;
  void scale(const Tensor& dst, float value) override;
  void dequantize_4bit(const Tensor& out, const Quantized4bit& q) override;
  void quantize_4bit(Quantized4bit& q, const Tensor& dense, std::string_view name) override;
  void fill_random(const Tensor& dst, Distribution distribution, float a, float b, uint64_t seed) override;

 private:
  // Times `run` under `op` when enabled (synchronising before and after); else just runs it.
  template <typename Run>
  void timed(const char* op, Run&& run, double flops = 0, const std::string& gemm_shape = {});

  Backend& inner_;
  bool enabled_ = false;
  std::map<std::string, OpTime> ops_, gemms_;
};

}  // namespace memtune
