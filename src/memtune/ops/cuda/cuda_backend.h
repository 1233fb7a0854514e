// The CUDA backend: the ops of backend.h on one GPU, checked against the CPU reference backend by
// tests/gpu. Kernels live one family per .cu file behind cuda_ops.h; this class checks its
// Tensor arguments (an inconsistent call is an internal error: MT_ASSERT) and launches them.
//
// Streams: everything runs on the legacy default stream, in call order, so the host-side copies
// (cudaMemcpy) are ordered with the kernels without extra events.
//
// Memory owned by the backend itself, allocated once at creation (the planner is to take these
// over as planned buffers of MemCategory::workspace):
//  - a 32 MiB cuBLASLt workspace;
//  - a 256 KiB fp32 reduction scratch (kMaxPartials floats) for the deterministic sums of
//    sum_squares and cross_entropy.
#pragma once

#include <cstdint>
#include <string>

#include "memtune/ops/backend.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune {

class CudaBackend final : public Backend {
 public:
  static constexpr uint64_t kWorkspaceBytes = 32ull << 20;

  CudaBackend();
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return Device::cuda; }
  std::string name() const override { return "cuda"; }

  void* allocate_arena(uint64_t bytes) override;
  void free_arena(void* base) override;
  void copy_from_host(const Tensor& dst, const void* host_src) override;
  void copy_to_host(void* host_dst, const Tensor& src) override;
  void synchronize() override;

  void fill(const Tensor& dst, float value) override;
  void convert(const Tensor& dst, const Tensor& src) override;
  void add(const Tensor& dst, const Tensor& a, const Tensor& b) override;

  void matmul(const Tensor& c, const Tensor& a, bool transpose_a, const Tensor& b,
              bool transpose_b, float alpha, float beta) override;

  void embedding_forward(const Tensor& out, const Tensor& table, const Tensor& ids) override;
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, float eps) override;
  void rmsnorm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Tensor& rstd, bool accumulate) override;
  void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                    int64_t head_dim) override;
  void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                     int64_t head_dim) override;
  void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) override;
  void swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out,
                       const Tensor& gate, const Tensor& up) override;

  void attention_eager_forward(const Tensor& out, const Tensor& probs,
                               const Tensor& scores_scratch, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& segments,
                               const AttentionDims& dims) override;
  void attention_eager_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                const Tensor& dprobs_scratch, const Tensor& d_out,
                                const Tensor& probs, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& segments,
                                const AttentionDims& dims) override;
  void attention_flash_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                               const Tensor& k, const Tensor& v, const Tensor& segments,
                               const AttentionDims& dims) override;
  void attention_flash_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                const Tensor& delta_scratch, const Tensor& dq_accum_scratch,
                                const Tensor& d_out, const Tensor& out, const Tensor& lse,
                                const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& segments, const AttentionDims& dims) override;

  void cross_entropy_forward_backward(const Tensor& loss_sum, const Tensor& d_logits,
                                      const Tensor& logits, const Tensor& targets,
                                      float grad_scale) override;
  void cross_entropy_forward(const Tensor& loss_sum, const Tensor& logits,
                             const Tensor& targets) override;

  void dropout(const Tensor& out, const Tensor& x, float p, uint64_t seed) override;

  void sum_squares(const Tensor& acc, const Tensor& x) override;
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, const AdamWParams& params) override;
  void scale(const Tensor& dst, float value) override;

  void fill_random(const Tensor& dst, Distribution distribution, float a, float b,
                   uint64_t seed) override;

 private:
  cudaStream_t stream_ = nullptr;  // the legacy default stream
  void* workspace_ = nullptr;
  float* reduction_scratch_ = nullptr;
  cuda::GemmContext* gemm_ = nullptr;
};

// Whether a CUDA device is usable here (tests skip without one).
bool cuda_device_available();

}  // namespace memtune
