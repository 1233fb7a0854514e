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
