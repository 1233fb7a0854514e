// The CUDA backend: the ops of backend.h on one GPU, checked against the CPU reference backend by
// tests/gpu. Kernels live one family per .cu file behind cuda_ops.h; this class checks its
// Tensor arguments (an inconsistent call is an internal error: MT_ASSERT) and launches them.
//
// Streams: everything runs on the legacy default stream, in call order, so the host-side copies
// (cudaMemcpy) are ordered with the kernels without extra events. The one exception is the
// offload copies (copy_to_host_async, copy_from_host_async): they run on a non-blocking copy
// stream, created on first use, between pinned host memory (cudaHostAlloc) and the arena, and
// are ordered against the default stream with events (backend.h states the contract).
//
// Scratch (Backend::workspace_bytes, planned by the engine and bound with bind_workspace):
//  - a 32 MiB cuBLASLt workspace;
//  - a 256 KiB fp32 reduction scratch (kMaxPartials floats) for the deterministic sums of
//    sum_squares and cross_entropy.
// Without a binding (the op tests) the backend allocates the same scratch itself on first use.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "memtune/ops/backend.h"
#include "memtune/ops/cuda/attention_cudnn.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune {

class CudaBackend final : public Backend {
 public:

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
  // ---- offload ----
  void* allocate_host(uint64_t bytes) override;
  void free_host(void* base) override;
  CopyEvent create_event() override;
  void destroy_event(CopyEvent event) override;
  void copy_to_host_async(void* host_dst, const Tensor& src, CopyEvent done) override;
  void copy_from_host_async(const Tensor& dst, const void* host_src, CopyEvent done) override;
  void compute_wait(CopyEvent done) override;
  // ---- end offload ----
  uint64_t workspace_bytes() const override;
  void bind_workspace(const Tensor& workspace) override;

  void fill(const Tensor& dst, float value) override;
  void convert(const Tensor& dst, const Tensor& src) override;
  void add(const Tensor& dst, const Tensor& a, const Tensor& b) override;
  void broadcast_rows(const Tensor& dst, const Tensor& row) override;

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
  // One pass (lora_epilogue.cu) where the kernel serves the call, else backend.h's two ops.
  void lora_residual_forward(const Tensor& y, const Tensor& u, const Tensor& b, float scale,
                             const Tensor& residual) override;

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
  // cuDNN fused attention (attention_cudnn.h); a clear error in a build without cuDNN. Packed
  // rows (a non-empty `ragged`) run cuDNN's ragged SDPA, or the flash kernel with the segments
  // where cuDNN refuses them.
  void attention_cudnn_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                               const Tensor& k, const Tensor& v, const Tensor& segments,
                               const RaggedAttention& ragged, const Tensor& workspace,
                               const AttentionDims& dims) override;
  void attention_cudnn_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                const Tensor& delta_scratch, const Tensor& workspace,
                                const Tensor& d_out, const Tensor& out, const Tensor& lse,
                                const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& segments, const RaggedAttention& ragged,
                                const AttentionDims& dims) override;
  // The bytes cuDNN's graph for these dims wants (builds and caches the graph); for tests. With
  // `ragged`, the ragged graph's (its slots and max_len) plus the op's scratch.
  size_t cudnn_attention_workspace_bytes(const AttentionDims& dims, DType dtype, bool backward,
                                         const RaggedAttention* ragged = nullptr);
  // The cuDNN op itself (graph cache, ragged Stats layout, build times); for tests.
  cuda::CudnnAttention& cudnn_attention() { return cudnn(); }

  // ---- attention_decode (attention_decode.cu) ----
  void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                        const Tensor& v_cache, const AttentionDims& dims) override;
  // ---- end attention_decode ----

  void cross_entropy_forward_backward(const Tensor& loss_sum, const Tensor& d_logits,
                                      const Tensor& logits, const Tensor& targets,
                                      float grad_scale) override;
  void cross_entropy_forward(const Tensor& loss_sum, const Tensor& logits,
                             const Tensor& targets) override;

  void dropout(const Tensor& out, const Tensor& x, float p, uint64_t seed,
               uint64_t index_offset) override;

  void sum_squares(const Tensor& acc, const Tensor& x) override;
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, const AdamWParams& params) override;
  void scale(const Tensor& dst, float value) override;

  void fill_random(const Tensor& dst, Distribution distribution, float a, float b,
                   uint64_t seed) override;

  // ---- QLoRA 4-bit (quant4bit.cu; bit-identical to quant/nf4.h) ----
  void dequantize_4bit(const Tensor& out, const Quantized4bit& q) override;
  // Synchronises (the double-quant offset is a host float). Double quant stages the fp32 absmax
  // in a temporary device buffer of 4 bytes per block (n / 16 bytes at blocksize 64).
  void quantize_4bit(Quantized4bit& q, const Tensor& dense, std::string_view name) override;
  // ---- end QLoRA 4-bit ----

 private:
  // Points gemm_ and reduction_scratch_ at the bound scratch, or at owned scratch allocated
  // here on first use when none is bound. Called by every op that uses them.
  void ensure_workspace();

  cudaStream_t stream_ = nullptr;  // the legacy default stream
  // ---- offload ----
  // Makes the copy stream wait for everything issued to the compute stream so far.
  void copy_stream_follows_compute();
  cudaEvent_t event_of(CopyEvent event) const;
  cudaStream_t copy_stream_ = nullptr;     // non-blocking: it never waits on the default stream by itself
  cudaEvent_t compute_issued_ = nullptr;   // recorded on the compute stream before each copy
  std::vector<cudaEvent_t> copy_events_;   // indexed by CopyEvent::id
  // ---- end offload ----
  void* bound_workspace_ = nullptr;  // planned by the engine; null when unbound
  void* owned_workspace_ = nullptr;  // the fallback, allocated on first unbound use
  float* reduction_scratch_ = nullptr;
  cuda::GemmContext* gemm_ = nullptr;
  // Created at the first cuDNN attention call, so runs that never choose it hold no cuDNN handle.
  cuda::CudnnAttention& cudnn();
  std::unique_ptr<cuda::CudnnAttention> cudnn_;
};

// Whether a CUDA device is usable here (tests skip without one).
bool cuda_device_available();

}  // namespace memtune
