// cuDNN's fused scaled-dot-product attention (cuDNN 9 graph API through NVIDIA's header-only
// cudnn_frontend), the third attention backend (--attn_implementation cudnn).
//
// Same contract as the flash op (backend.h): causal, GQA without repeating K/V (the kv heads are
// given to cuDNN as they are), scale from AttentionDims. q/k/v/out/d_out/dq/dk/dv all bf16 or all
// f16, head_dim 64 or 128. The forward saves out and cuDNN's softmax "Stats" written straight into
// memtune's lse buffer: Stats is f32 [batch, n_heads, seq, 1] = max_j(s_ij) + ln(sum_j exp(s_ij -
// max)) with s = scale * q.k, i.e. the natural-log logsumexp of the scaled, masked scores, which
// is what memtune's flash lse is; the backward reads it back as Stats.
//
// Graphs (one forward and one backward per shape and dtype) are built at first use and cached,
// so a step builds them only in its first call. The workspace is the caller's (the step takes it
// from the plan); a graph needing more than it is given fails with the sizes, nothing is
// allocated here.
//
// Packed rows: cuDNN's causal mask does not know memtune's segments, so this op is only
// correct where each row is one sample (trailing padding that no loss reads is fine, since
// causal masking already hides it from the sample). The step decides: it runs the flash kernel
// for batches with several samples in a row (LlamaStep::attention_forward).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "memtune/core/dtype.h"
#include "memtune/ops/backend.h"

namespace memtune::cuda {

struct CudnnSdpaTensors {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;      // forward: written; backward: read
  float* lse = nullptr;     // forward: written (cuDNN Stats); backward: read
  const void* d_out = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  DType dtype = DType::bf16;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// The loaded libcudnn's version (e.g. 91400 for 9.14.0); 0 in a build without cuDNN.
size_t cudnn_runtime_version();

inline constexpr size_t kCudnnUnsupported = static_cast<size_t>(-1);

// One per CudaBackend: a cuDNN handle and the graph cache. Without MEMTUNE_HAVE_CUDNN every call
// fails with a message that says how to build with cuDNN.
class CudnnAttention {
 public:
  CudnnAttention();
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // False when cuDNN has no engine for the shape (its backward at seq 1, say; said once on
  // stderr): the caller runs memtune's flash kernel instead.
  bool forward(const AttentionDims& dims, const CudnnSdpaTensors& t, cudaStream_t stream);
  bool backward(const AttentionDims& dims, const CudnnSdpaTensors& t, cudaStream_t stream);
  // The workspace the graph for these dims needs (builds and caches it); kCudnnUnsupported
  // where cuDNN has no engine for the shape.
  size_t workspace_bytes(const AttentionDims& dims, DType dtype, bool backward);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memtune::cuda
