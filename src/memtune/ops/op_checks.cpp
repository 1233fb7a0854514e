#include "memtune/ops/op_checks.h"

#include "memtune/core/error.h"

namespace memtune {

void check_float_tensor_on(Device device, const Tensor& t, const char* what) {
  MT_ASSERT(t.device == device, "{}: tensor on {}, not {}", what, device_name(t.device), device_name(device));
  MT_ASSERT(dtype_is_float(t.dtype), "{}: dtype {} is not a float dtype", what,
            dtype_name(t.dtype));
  MT_ASSERT(t.data != nullptr || t.numel() == 0, "{}: no data", what);
}

void check_tensor_on(Device device, const Tensor& t, DType dtype, const char* what) {
  MT_ASSERT(t.device == device, "{}: tensor on {}, not {}", what, device_name(t.device), device_name(device));
  MT_ASSERT(t.dtype == dtype, "{}: dtype {}, expected {}", what, dtype_name(t.dtype),
            dtype_name(dtype));
  MT_ASSERT(t.data != nullptr || t.numel() == 0, "{}: no data", what);
}

void check_attention_inputs(const AttentionDims& dims, const Tensor& q, const Tensor& k, const Tensor& v,
                            CheckFloatTensor check_float) {
  MT_ASSERT(dims.batch > 0 && dims.seq > 0 && dims.head_dim > 0, "attention: empty dims");
  MT_ASSERT(dims.n_heads > 0 && dims.n_kv_heads > 0 && dims.n_heads % dims.n_kv_heads == 0,
            "attention: {} query heads not a multiple of {} kv heads", dims.n_heads,
            dims.n_kv_heads);
  MT_ASSERT(dims.scale > 0.0f, "attention: scale {} not set", dims.scale);
  check_float(q, "attention q");
  check_float(k, "attention k");
  check_float(v, "attention v");
  const int64_t n = dims.tokens();
  MT_ASSERT(q.numel() == n * dims.n_heads * dims.head_dim, "attention q {} vs N {} x {} x {}",
            q.shape.str(), n, dims.n_heads, dims.head_dim);
  MT_ASSERT(k.numel() == n * dims.n_kv_heads * dims.head_dim, "attention k {} vs N {} x {} x {}",
            k.shape.str(), n, dims.n_kv_heads, dims.head_dim);
  MT_ASSERT(v.numel() == k.numel(), "attention v {} vs k {}", v.shape.str(), k.shape.str());
}

MatmulSizes check_matmul_inputs(const Tensor& c, const Tensor& a, bool transpose_a, const Tensor& b,
                                bool transpose_b, CheckFloatTensor check_float) {
  check_float(c, "matmul c");
  check_float(a, "matmul a");
  check_float(b, "matmul b");
  MT_ASSERT(a.shape.ndim == 2 && b.shape.ndim == 2 && c.shape.ndim == 2,
            "matmul wants 2-D views: c {} a {} b {}", c.shape.str(), a.shape.str(),
            b.shape.str());
  const int64_t m = transpose_a ? a.dim(1) : a.dim(0);
  const int64_t k = transpose_a ? a.dim(0) : a.dim(1);
  const int64_t kb = transpose_b ? b.dim(1) : b.dim(0);
  const int64_t n = transpose_b ? b.dim(0) : b.dim(1);
  MT_ASSERT(k == kb && c.dim(0) == m && c.dim(1) == n,
            "matmul shapes: c {} = op(a {}{}) @ op(b {}{})", c.shape.str(), a.shape.str(),
            transpose_a ? "^T" : "", b.shape.str(), transpose_b ? "^T" : "");
  return MatmulSizes{m, n, k};
}

void check_adamw_inputs(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                        const AdamWParams& params, CheckTensor check_tensor) {
  check_tensor(param, DType::f32, "adamw param");
  check_tensor(grad, DType::f32, "adamw grad");
  check_tensor(exp_avg, DType::f32, "adamw exp_avg");
  check_tensor(exp_avg_sq, DType::f32, "adamw exp_avg_sq");
  const int64_t n = param.numel();
  MT_ASSERT(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n,
            "adamw param {} grad {} exp_avg {} exp_avg_sq {}", param.shape.str(),
            grad.shape.str(), exp_avg.shape.str(), exp_avg_sq.shape.str());
  MT_ASSERT(params.step >= 1, "adamw step {} (1-based, after increment)", params.step);
}

}  // namespace memtune
