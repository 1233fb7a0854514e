#include "memtune/ops/timed_backend.h"

#include <fmt/format.h>

#include <algorithm>

namespace memtune {

template <typename Run>
void TimedBackend::timed(const char* op, Run&& run, double flops, const std::string& gemm_shape) {
  if (!enabled_) {
    run();
    return;
  }
  inner_.synchronize();
  const auto start = std::chrono::steady_clock::now();
  run();
  inner_.synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  OpTime& entry = ops_[op];
  entry.op = op;
  entry.calls += 1;
  entry.seconds += seconds;
  entry.flops += flops;
  if (!gemm_shape.empty()) {
    OpTime& shape = gemms_[gemm_shape];
    shape.op = gemm_shape;
    shape.calls += 1;
    shape.seconds += seconds;
    shape.flops += flops;
  }
}

namespace {

std::vector<OpTime> by_time(const std::map<std::string, OpTime>& entries) {
  std::vector<OpTime> out;
  for (const auto& [name, entry] : entries) out.push_back(entry);
  std::sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  return out;
}

double total_seconds(const std::vector<OpTime>& ops) {
  double total = 0;
  for (const OpTime& op : ops) total += op.seconds;
  return total;
}

}  // namespace

std::vector<OpTime> TimedBackend::ops() const { return by_time(ops_); }
std::vector<OpTime> TimedBackend::gemm_shapes() const { return by_time(gemms_); }

nlohmann::json TimedBackend::to_json() const {
  const std::vector<OpTime> all = ops();
  const double total = total_seconds(all);
  nlohmann::json ops_json = nlohmann::json::array(), shapes_json = nlohmann::json::array();
  for (const OpTime& op : all) {
    nlohmann::json row = {{"op", op.op}, {"calls", op.calls}, {"ms", op.seconds * 1e3},
                          {"share", total > 0 ? op.seconds / total : 0.0}};
    if (op.flops > 0) row["tflops"] = op.flops / op.seconds / 1e12;
    ops_json.push_back(row);
  }
  for (const OpTime& shape : gemm_shapes())
    shapes_json.push_back({{"shape", shape.op}, {"calls", shape.calls}, {"ms", shape.seconds * 1e3},
                           {"tflops", shape.seconds > 0 ? shape.flops / shape.seconds / 1e12 : 0.0}});
  return {{"ops", ops_json}, {"gemm_shapes", shapes_json}, {"total_ms", total * 1e3},
          {"method", "device synchronised before and after every op; one step of its own"}};
}

std::string TimedBackend::table(size_t max_gemm_shapes) const {
  const std::vector<OpTime> all = ops();
  const double total = total_seconds(all);
  std::string text = fmt::format("{:<34} {:>7} {:>10} {:>7} {:>9}\n", "op", "calls", "ms", "share", "TFLOP/s");
  for (const OpTime& op : all)
    text += fmt::format("{:<34} {:>7} {:>10.2f} {:>6.1f}% {:>9}\n", op.op, op.calls, op.seconds * 1e3,
                        total > 0 ? 100.0 * op.seconds / total : 0.0,
                        op.flops > 0 ? fmt::format("{:.1f}", op.flops / op.seconds / 1e12) : "");
  text += fmt::format("{:<34} {:>7} {:>10.2f}\n", "total (synchronised)", "", total * 1e3);
  const std::vector<OpTime> shapes = gemm_shapes();
  if (!shapes.empty()) {
    text += fmt::format("\n{:<34} {:>7} {:>10} {:>9}\n", "GEMM shape (M x N x K, op(a) op(b))", "calls", "ms",
                        "TFLOP/s");
    for (size_t i = 0; i < std::min(max_gemm_shapes, shapes.size()); ++i)
      text += fmt::format("{:<34} {:>7} {:>10.2f} {:>9.1f}\n", shapes[i].op, shapes[i].calls,
                          shapes[i].seconds * 1e3, shapes[i].flops / shapes[i].seconds / 1e12);
  }
  return text;
}

void TimedBackend::copy_from_host(const Tensor& dst, const void* host_src) {
  timed("copy_from_host", [&] { inner_.copy_from_host(dst, host_src); });
}
void TimedBackend::copy_to_host(void* host_dst, const Tensor& src) {
  timed("copy_to_host", [&] { inner_.copy_to_host(host_dst, src); });
}
void TimedBackend::fill(const Tensor& dst, float value) {
  timed("fill", [&] { inner_.fill(dst, value); });
}
void TimedBackend::convert(const Tensor& dst, const Tensor& src) {
  timed("convert", [&] { inner_.convert(dst, src); });
}
void TimedBackend::add(const Tensor& dst, const Tensor& a, const Tensor& b) {
  timed("add", [&] { inner_.add(dst, a, b); });
}
void TimedBackend::matmul(const Tensor& c, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                          float alpha, float beta) {
  if (!enabled_) {
    inner_.matmul(c, a, transpose_a, b, transpose_b, alpha, beta);
    return;
  }
  // op(a) is [M, K] on the 2-D views (backend.h).
  const int64_t m = c.rows(), n = c.cols();
  const int64_t k = transpose_a ? a.rows() : a.cols();
  const std::string shape = fmt::format("{}x{}x{} {}{}", m, n, k, transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N');
  timed("matmul", [&] { inner_.matmul(c, a, transpose_a, b, transpose_b, alpha, beta); },
        2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k), shape);
}
void TimedBackend::embedding_forward(const Tensor& out, const Tensor& table, const Tensor& ids) {
  timed("embedding_forward", [&] { inner_.embedding_forward(out, table, ids); });
}
void TimedBackend::rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                                   float eps) {
  timed("rmsnorm_forward", [&] { inner_.rmsnorm_forward(out, rstd, x, weight, eps); });
}
void TimedBackend::rmsnorm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& weight,
                                    const Tensor& rstd, bool accumulate) {
  timed("rmsnorm_backward", [&] { inner_.rmsnorm_backward(dx, dy, x, weight, rstd, accumulate); });
}
void TimedBackend::rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, int64_t head_dim) {
  timed("rope_forward", [&] { inner_.rope_forward(x, positions, inv_freq, head_dim); });
}
void TimedBackend::rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq, int64_t head_dim) {
  timed("rope_backward", [&] { inner_.rope_backward(dx, positions, inv_freq, head_dim); });
}
void TimedBackend::swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  timed("swiglu_forward", [&] { inner_.swiglu_forward(out, gate, up); });
}
void TimedBackend::swiglu_lora_forward(const Tensor& out, const Tensor& gate, const Tensor& up,
                                       const Tensor& ut_gate, const Tensor& b_gate, const Tensor& ut_up,
                                       const Tensor& b_up, float scale) {
  timed("swiglu_lora_forward",
        [&] { inner_.swiglu_lora_forward(out, gate, up, ut_gate, b_gate, ut_up, b_up, scale); });
}
void TimedBackend::lora_residual_forward(const Tensor& y, const Tensor& u, const Tensor& b, float scale,
                                         const Tensor& residual) {
  timed("lora_residual_forward", [&] { inner_.lora_residual_forward(y, u, b, scale, residual); });
}
void TimedBackend::swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out,
                                   const Tensor& gate, const Tensor& up) {
  timed("swiglu_backward", [&] { inner_.swiglu_backward(d_gate, d_up, d_out, gate, up); });
}
void TimedBackend::attention_eager_forward(const Tensor& out, const Tensor& probs, const Tensor& scores_scratch,
                                           const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& segments, const AttentionDims& dims) {
  timed("attention_eager_forward",
        [&] { inner_.attention_eager_forward(out, probs, scores_scratch, q, k, v, segments, dims); });
}
void TimedBackend::attention_eager_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                            const Tensor& dprobs_scratch, const Tensor& d_out,
                                            const Tensor& probs, const Tensor& q, const Tensor& k,
                                            const Tensor& v, const Tensor& segments, const AttentionDims& dims) {
  timed("attention_eager_backward", [&] {
    inner_.attention_eager_backward(dq, dk, dv, dprobs_scratch, d_out, probs, q, k, v, segments, dims);
  });
}
void TimedBackend::attention_flash_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                           const Tensor& v, const Tensor& segments, const AttentionDims& dims) {
  timed("attention_flash_forward", [&] { inner_.attention_flash_forward(out, lse, q, k, v, segments, dims); });
}
void TimedBackend::attention_flash_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                            const Tensor& delta_scratch, const Tensor& dq_accum_scratch,
                                            const Tensor& d_out, const Tensor& out, const Tensor& lse,
                                            const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& segments, const AttentionDims& dims) {
  timed("attention_flash_backward", [&] {
    inner_.attention_flash_backward(dq, dk, dv, delta_scratch, dq_accum_scratch, d_out, out, lse, q, k, v,
                                    segments, dims);
  });
}

void TimedBackend::attention_cudnn_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                                           const Tensor& k, const Tensor& v, const Tensor& segments,
                                           const RaggedAttention& ragged, const Tensor& workspace,
                                           const AttentionDims& dims) {
  timed("attention_cudnn_forward",
        [&] { inner_.attention_cudnn_forward(out, lse, q, k, v, segments, ragged, workspace, dims); });
}

void TimedBackend::attention_cudnn_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                            const Tensor& delta_scratch, const Tensor& workspace,
                                            const Tensor& d_out, const Tensor& out, const Tensor& lse,
                                            const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& segments, const RaggedAttention& ragged,
                                            const AttentionDims& dims) {
  timed("attention_cudnn_backward", [&] {
    inner_.attention_cudnn_backward(dq, dk, dv, delta_scratch, workspace, d_out, out, lse, q, k, v,
                                    segments, ragged, dims);
  });
}
void TimedBackend::attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                                    const Tensor& v_cache, const AttentionDims& dims) {
  timed("attention_decode", [&] { inner_.attention_decode(out, q, k_cache, v_cache, dims); });
}
void TimedBackend::cross_entropy_forward_backward(const Tensor& loss_sum, const Tensor& d_logits,
                                                  const Tensor& logits, const Tensor& targets, float grad_scale) {
  timed("cross_entropy_forward_backward",
        [&] { inner_.cross_entropy_forward_backward(loss_sum, d_logits, logits, targets, grad_scale); });
}
void TimedBackend::cross_entropy_forward(const Tensor& loss_sum, const Tensor& logits, const Tensor& targets) {
  timed("cross_entropy_forward", [&] { inner_.cross_entropy_forward(loss_sum, logits, targets); });
}
void TimedBackend::dropout(const Tensor& out, const Tensor& x, float p, uint64_t seed, uint64_t index_offset) {
  timed("dropout", [&] { inner_.dropout(out, x, p, seed, index_offset); });
}
void TimedBackend::sum_squares(const Tensor& acc, const Tensor& x) {
  timed("sum_squares", [&] { inner_.sum_squares(acc, x); });
}
void TimedBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                              const Tensor& exp_avg_sq, const AdamWParams& params) {
  timed("adamw_step", [&] { inner_.adamw_step(param, grad, exp_avg, exp_avg_sq, params); });
}
void TimedBackend::broadcast_rows(const Tensor& dst, const Tensor& row) {
  timed("broadcast_rows", [&] { inner_.broadcast_rows(dst, row); });
}

void TimedBackend::scale(const Tensor& dst, float value) {
  timed("scale", [&] { inner_.scale(dst, value); });
}
void TimedBackend::dequantize_4bit(const Tensor& out, const Quantized4bit& q) {
  timed("dequantize_4bit", [&] { inner_.dequantize_4bit(out, q); });
}
void TimedBackend::quantize_4bit(Quantized4bit& q, const Tensor& dense, std::string_view name) {
  timed("quantize_4bit", [&] { inner_.quantize_4bit(q, dense, name); });
}
void TimedBackend::fill_random(const Tensor& dst, Distribution distribution, float a, float b, uint64_t seed) {
  timed("fill_random", [&] { inner_.fill_random(dst, distribution, a, b, seed); });
}

}  // namespace memtune
