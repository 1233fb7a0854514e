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

void check_float_like(const Tensor& t, const Tensor& like, const char* what, CheckFloatTensor check_float) {
  check_float(t, what);
  MT_ASSERT(t.numel() == like.numel(), "{}: {} vs {}", what, t.shape.str(), like.shape.str());
}

void check_attention_matrix(const Tensor& t, const AttentionDims& dims, const char* what,
                            CheckFloatTensor check_float) {
  check_float(t, what);
  MT_ASSERT(t.numel() == dims.batch * dims.n_heads * dims.seq * dims.seq,
            "{} {} is not [batch {}, heads {}, seq {}, seq]", what, t.shape.str(), dims.batch,
            dims.n_heads, dims.seq);
}

void check_attention_rows(const Tensor& t, const AttentionDims& dims, const char* what, CheckTensor check_tensor) {
  check_tensor(t, DType::f32, what);
  MT_ASSERT(t.numel() == dims.batch * dims.n_heads * dims.seq,
            "{} {} is not [batch {}, heads {}, seq {}]", what, t.shape.str(), dims.batch,
            dims.n_heads, dims.seq);
}

void check_attention_eager_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                    const Tensor& dprobs_scratch, const Tensor& d_out, const Tensor& probs,
                                    const Tensor& q, const Tensor& k, const AttentionDims& dims,
                                    CheckFloatTensor check_float) {
  check_float_like(dq, q, "attention_eager_backward dq", check_float);
  check_float_like(d_out, q, "attention_eager_backward d_out", check_float);
  check_float_like(dk, k, "attention_eager_backward dk", check_float);
  check_float_like(dv, k, "attention_eager_backward dv", check_float);
  check_attention_matrix(probs, dims, "attention_eager_backward probs", check_float);
  check_attention_matrix(dprobs_scratch, dims, "attention_eager_backward dprobs_scratch", check_float);
}

void check_fused_attention_backward(const char* op, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                    const Tensor& d_out, const Tensor& out, const Tensor& lse, const Tensor& q,
                                    const Tensor& k, const AttentionDims& dims, CheckFloatTensor check_float,
                                    CheckTensor check_tensor) {
  const auto name = [op](const char* tensor) { return fmt::format("{} {}", op, tensor); };
  check_float_like(dq, q, name("dq").c_str(), check_float);
  check_float_like(d_out, q, name("d_out").c_str(), check_float);
  check_float_like(out, q, name("out").c_str(), check_float);
  check_float_like(dk, k, name("dk").c_str(), check_float);
  check_float_like(dv, k, name("dv").c_str(), check_float);
  check_attention_rows(lse, dims, name("lse").c_str(), check_tensor);
}

void check_rmsnorm_inputs(const char* op, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                          CheckFloatTensor check_float, CheckTensor check_tensor) {
  check_float(x, op);
  check_float(weight, op);
  check_tensor(rstd, DType::f32, op);
  MT_ASSERT(x.shape.ndim >= 1 && weight.numel() == x.cols(), "{}: weight {} for x {}", op,
            weight.shape.str(), x.shape.str());
  MT_ASSERT(rstd.numel() == x.rows(), "{}: rstd {} for {} rows", op, rstd.shape.str(), x.rows());
}

int64_t check_attention_decode_inputs(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                                      const Tensor& v_cache, const AttentionDims& dims,
                                      CheckFloatTensor check_float) {
  check_float(out, "attention_decode out");
  check_float(q, "attention_decode q");
  check_float(k_cache, "attention_decode k_cache");
  check_float(v_cache, "attention_decode v_cache");
  MT_ASSERT(dims.batch > 0 && dims.seq > 0 && dims.head_dim > 0 && dims.scale > 0.0f,
            "attention_decode: dims not set");
  MT_ASSERT(dims.n_heads > 0 && dims.n_kv_heads > 0 && dims.n_heads % dims.n_kv_heads == 0,
            "attention_decode: {} query heads not a multiple of {} kv heads", dims.n_heads,
            dims.n_kv_heads);
  const int64_t kv_width = dims.n_kv_heads * dims.head_dim;
  MT_ASSERT(q.numel() == dims.batch * dims.n_heads * dims.head_dim && out.numel() == q.numel(),
            "attention_decode q {} / out {} vs batch {} x {} heads x {}", q.shape.str(),
            out.shape.str(), dims.batch, dims.n_heads, dims.head_dim);
  MT_ASSERT(k_cache.numel() == v_cache.numel() && k_cache.numel() % (dims.batch * kv_width) == 0,
            "attention_decode k_cache {} / v_cache {} vs batch {} x kv width {}",
            k_cache.shape.str(), v_cache.shape.str(), dims.batch, kv_width);
  const int64_t capacity = k_cache.numel() / (dims.batch * kv_width);
  MT_ASSERT(dims.seq <= capacity, "attention_decode: {} cached rows in a cache of {}", dims.seq, capacity);
  return capacity;
}

void check_swiglu_forward_inputs(const Tensor& out, const Tensor& gate, const Tensor& up,
                                 CheckFloatTensor check_float) {
  check_float(out, "swiglu_forward out");
  check_float_like(gate, out, "swiglu_forward gate", check_float);
  check_float_like(up, out, "swiglu_forward up", check_float);
}

void check_swiglu_backward_inputs(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out,
                                  const Tensor& gate, const Tensor& up, CheckFloatTensor check_float) {
  check_float(d_out, "swiglu_backward d_out");
  check_float_like(gate, d_out, "swiglu_backward gate", check_float);
  check_float_like(up, d_out, "swiglu_backward up", check_float);
  check_float_like(d_gate, d_out, "swiglu_backward d_gate", check_float);
  check_float_like(d_up, d_out, "swiglu_backward d_up", check_float);
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
