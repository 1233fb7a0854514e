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
// Packed rows (several samples in a row): given the micro-batch's sequence table
// (ops/ragged_attention.h, RaggedAttention in backend.h), the op runs cuDNN's ragged ("THD")
// SDPA: the sequences as a batch of `slots` sequences of at most `max_len` tokens, placed by
// ragged offsets (in elements, i32) into memtune's [tokens, heads * head_dim] tensors, with a
// padding mask (per-sequence lengths; unused slots have length 0) and the causal mask. One graph
// per (slots, max_len, tokens, shape, dtype, direction): the table rounds slots and max_len up to
// powers of two, so a run builds a handful, not one per micro-batch. The results are those of the
// flash op with the segments, lse included ([batch, n_heads, seq], natural log):
//  - RaggedStats::token_major (the default; TransformerEngine's THD recipe): cuDNN writes its
//    ragged Stats [tokens, n_heads] into the workspace and the op transposes them into lse; the
//    backward transposes lse into the workspace for cuDNN to read.
//  - RaggedStats::head_major (MEMTUNE_CUDNN_RAGGED_STATS=head_major): the forward writes lse in
//    place (per-sequence offsets row * n_heads * seq + position, head stride seq); the backward
//    reads [n_heads, tokens], which is lse itself at batch 1 and otherwise a strided copy of it
//    in the workspace.
// The backward's graph gets max_total_seq_len_q = tokens, so that cuDNN sizes its dq accumulator
// and its row sums by the tokens rather than by slots x max_len (and not max_total_seq_len_kv:
// with GQA that would make the per-query-head dK/dV real workspace tensors). A ragged graph that
// cuDNN refuses, or that needs more workspace than the caller gives, returns false: the caller
// runs memtune's flash kernel with the segments.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "memtune/core/dtype.h"
#include "memtune/ops/backend.h"

namespace memtune::cuda {

// Where the packed rows' sequence table lives (ops/ragged_attention.h): table == null means the
// dense path.
struct CudnnRagged {
  const int32_t* table = nullptr;  // device, kRaggedTableRows rows of `stride` entries
  int64_t stride = 0;
  int64_t slots = 0, max_len = 0;
};

enum class RaggedStats : uint8_t { token_major, head_major };

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
  CudnnRagged ragged;
};

// What the op has done so far: graph builds (those cuDNN refused included) and their wall time,
// ragged calls that ran cuDNN, and calls (dense or ragged) it handed back to the flash kernel.
struct CudnnStats {
  int64_t graphs = 0;
  double build_seconds = 0;
  int64_t ragged_runs = 0;
  int64_t refused = 0;
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
  // where cuDNN has no engine for the shape. With `ragged` (its slots and max_len; the table is
  // not read), the ragged graph's need plus the op's own scratch for the row statistics.
  size_t workspace_bytes(const AttentionDims& dims, DType dtype, bool backward,
                         const CudnnRagged* ragged = nullptr);
  // The ragged Stats layout (see the header comment); tests set both.
  void set_ragged_stats(RaggedStats layout);
  RaggedStats ragged_stats() const;
  CudnnStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memtune::cuda
