// The flash kernels' plain argument structs (cuda_ops.h: AttentionParams, FlashTensors) packed
// from Tensors and AttentionDims: one packing for the CUDA backend (cuda_backend.cpp) and for the
// GPU tests that call a kernel's launcher directly (the Hopper forward beside forward v2). Host
// C++ only: it includes Tensor, which the .cu files cannot (cuda_ops.h says why). Nothing is
// checked here; the backend checks its arguments before it packs them.
#pragma once

#include "memtune/ops/backend.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {

// The shape and softmax scale of `dims`; the packed rows' ids (i32 [batch * seq]) where
// `segments` is not empty.
inline AttentionParams attention_params_of(const AttentionDims& dims, const Tensor& segments = Tensor{}) {
  AttentionParams p;
  p.batch = dims.batch;
  p.seq = dims.seq;
  p.n_heads = dims.n_heads;
  p.n_kv_heads = dims.n_kv_heads;
  p.head_dim = dims.head_dim;
  p.scale = dims.scale;
  p.segments = segments.empty() ? nullptr : segments.as<const int32_t>();
  return p;
}

// The forward's tensors: q, k, v read; out and lse (f32 [batch, n_heads, seq]) written.
inline FlashTensors flash_forward_tensors(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                          const Tensor& v) {
  FlashTensors t;
  t.q = q.data;
  t.k = k.data;
  t.v = v.data;
  t.out = out.data;
  t.q_type = q.dtype;
  t.k_type = k.dtype;
  t.v_type = v.dtype;
  t.out_type = out.dtype;
  t.lse = lse.as<float>();
  return t;
}

// The backward's: the forward's (out and lse now read), d_out, the gradients written, and the f32
// scratch delta [batch, n_heads, seq] and dq_accum (q's element count).
inline FlashTensors flash_backward_tensors(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& delta,
                                           const Tensor& dq_accum, const Tensor& d_out, const Tensor& out,
                                           const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v) {
  FlashTensors t = flash_forward_tensors(out, lse, q, k, v);
  t.d_out = d_out.data;
  t.dq = dq.data;
  t.dk = dk.data;
  t.dv = dv.data;
  t.d_out_type = d_out.dtype;
  t.dq_type = dq.dtype;
  t.dk_type = dk.dtype;
  t.dv_type = dv.dtype;
  t.delta = delta.as<float>();
  t.dq_accum = dq_accum.as<float>();
  return t;
}

}  // namespace memtune::cuda
