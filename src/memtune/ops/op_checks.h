// The argument checks that the CPU and CUDA backends both run before an op computes anything.
// Where a check depends on the backend (which device and dtypes it reads), the backend passes its
// own test in. A failure is a broken invariant of the caller: it aborts (MT_ASSERT).
#pragma once

#include <cstdint>

#include "memtune/core/dtype.h"
#include "memtune/core/tensor.h"
#include "memtune/ops/backend.h"

namespace memtune {

// A tensor that the backend on `device` can read: on that device, with data (or empty), and of a
// float dtype / of exactly `dtype`. Each backend's check_float_tensor and check_tensor.
void check_float_tensor_on(Device device, const Tensor& t, const char* what);
void check_tensor_on(Device device, const Tensor& t, DType dtype, const char* what);

// The backend's own tests of one tensor, handed to the checks below.
using CheckFloatTensor = void (*)(const Tensor& t, const char* what);
using CheckTensor = void (*)(const Tensor& t, DType dtype, const char* what);

// Attention: dims that make sense (positive sizes, query heads a multiple of kv heads, a scale),
// q, k and v readable by the backend, and element counts that match the dims.
void check_attention_inputs(const AttentionDims& dims, const Tensor& q, const Tensor& k, const Tensor& v,
                            CheckFloatTensor check_float);

// An op's output or gradient beside the tensor it mirrors: readable, with as many elements.
void check_float_like(const Tensor& t, const Tensor& like, const char* what, CheckFloatTensor check_float);

// Attention's probabilities and their scratch: [batch, heads, seq, seq], readable.
void check_attention_matrix(const Tensor& t, const AttentionDims& dims, const char* what,
                            CheckFloatTensor check_float);

// Attention's per-row statistics (lse, delta): f32, [batch, heads, seq].
void check_attention_rows(const Tensor& t, const AttentionDims& dims, const char* what, CheckTensor check_tensor);

// Eager attention's backward: the grads and d_out like q or k, probs and dprobs_scratch matrices.
void check_attention_eager_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                    const Tensor& dprobs_scratch, const Tensor& d_out, const Tensor& probs,
                                    const Tensor& q, const Tensor& k, const AttentionDims& dims,
                                    CheckFloatTensor check_float);

// A fused attention's backward (flash, cuDNN): dq, d_out and out like q, dk and dv like k, and lse
// one f32 row per (batch, head, position). `op` prefixes the messages.
void check_fused_attention_backward(const char* op, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                    const Tensor& d_out, const Tensor& out, const Tensor& lse, const Tensor& q,
                                    const Tensor& k, const AttentionDims& dims, CheckFloatTensor check_float,
                                    CheckTensor check_tensor);

// RMSNorm: x and weight readable, rstd f32; one weight per column of x and one rstd per row.
// `op` names the op in the messages.
void check_rmsnorm_inputs(const char* op, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                          CheckFloatTensor check_float, CheckTensor check_tensor);

// Decode attention: out and q hold one query row of every head per sequence, k_cache and v_cache
// the same number of rows of kv width per sequence, and dims.seq (the cached rows attended to)
// fits in them. Returns the cache's capacity in rows.
int64_t check_attention_decode_inputs(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                                      const Tensor& v_cache, const AttentionDims& dims,
                                      CheckFloatTensor check_float);

// SwiGLU: every tensor readable and of out's (forward) or d_out's (backward) element count.
void check_swiglu_forward_inputs(const Tensor& out, const Tensor& gate, const Tensor& up,
                                 CheckFloatTensor check_float);
void check_swiglu_backward_inputs(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out,
                                  const Tensor& gate, const Tensor& up, CheckFloatTensor check_float);

// c = op(a) @ op(b) on 2-D views: readable operands whose shapes agree. Returns the GEMM's sizes.
struct MatmulSizes {
  int64_t m = 0, n = 0, k = 0;
};
MatmulSizes check_matmul_inputs(const Tensor& c, const Tensor& a, bool transpose_a, const Tensor& b,
                                bool transpose_b, CheckFloatTensor check_float);

// AdamW: four f32 tensors of one size, and a 1-based step.
void check_adamw_inputs(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                        const AdamWParams& params, CheckTensor check_tensor);

}  // namespace memtune
