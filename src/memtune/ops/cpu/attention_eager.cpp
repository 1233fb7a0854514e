// Eager causal GQA attention, as HF's eager path: the score and probability matrices are
// materialised ([batch, n_heads, seq, seq]) in their storage dtypes, and each later stage reads
// the stored (rounded) values, as HF's chain of bf16 tensors does.
//
// Forward: scores = q k^T * scale (masked: -inf) -> probs = softmax(scores) in fp32, rounded
// and stored (masked: 0) -> out = probs v.
// Backward: dV = P^T dO; dP = dO V^T (stored in dprobs_scratch); dS = P (dP - rowsum(dP P)) *
// scale; dQ = dS K; dK = dS^T Q. GQA: a kv head's dK and dV sum over the query heads that share
// it, so the work is split over (batch, kv head) and no two threads write the same rows.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "memtune/ops/cpu/cpu_backend.h"
#include "memtune/ops/op_checks.h"

namespace memtune {
namespace {

// Stores row[0, n) at offset of t and replaces it by what was stored (the rounded values).
void store_and_round(const Tensor& t, int64_t offset, int64_t n, float* row) {
  cpu::store_f32(t, offset, n, row);
  cpu::load_f32(t, offset, n, row);
}

}  // namespace

void CpuBackend::attention_eager_forward(const Tensor& out, const Tensor& probs,
                                         const Tensor& scores_scratch, const Tensor& q,
                                         const Tensor& k, const Tensor& v,
                                         const Tensor& segments, const AttentionDims& dims) {
  const cpu::AttentionView view = cpu::make_attention_view(dims, q, k, v, segments);
  check_float_like(out, q, "attention_eager_forward out", cpu::check_float_tensor);
  check_attention_matrix(probs, dims, "attention_eager_forward probs", cpu::check_float_tensor);
  check_attention_matrix(scores_scratch, dims, "attention_eager_forward scores_scratch", cpu::check_float_tensor);
  const int64_t seq = dims.seq, d = dims.head_dim, heads = dims.n_heads;
  const float negative_infinity = -std::numeric_limits<float>::infinity();

#pragma omp parallel
  {
    const size_t head_size = static_cast<size_t>(seq * d);
    std::vector<float> q_head(head_size), k_head(head_size), v_head(head_size);
    std::vector<float> out_head(head_size), row(static_cast<size_t>(seq));
#pragma omp for schedule(dynamic)
    for (int64_t bh = 0; bh < dims.batch * heads; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      cpu::gather_query_head_inputs(q, k, v, dims, b, h, q_head.data(), k_head.data(), v_head.data());
      for (int64_t i = 0; i < seq; ++i) {
        const int64_t row_offset = (bh * seq + i) * seq;
        const float* q_row = q_head.data() + i * d;
        for (int64_t j = 0; j < seq; ++j)
          row[j] = view.visible(b, i, j)
                       ? cpu::dot_f32(q_row, k_head.data() + j * d, d) * dims.scale
                       : negative_infinity;
        store_and_round(scores_scratch, row_offset, seq, row.data());

        // Keys past i are masked, so only [0, i] enters the softmax; the diagonal is always
        // visible, so the max is finite and masked entries become exp(-inf) = 0.
        float max_score = row[0];
        for (int64_t j = 1; j <= i; ++j) max_score = std::max(max_score, row[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - max_score);
          sum += row[j];
        }
        for (int64_t j = 0; j <= i; ++j) row[j] /= sum;
        for (int64_t j = i + 1; j < seq; ++j) row[j] = 0.0f;
        store_and_round(probs, row_offset, seq, row.data());

        float* out_row = out_head.data() + i * d;
        std::fill(out_row, out_row + d, 0.0f);
        for (int64_t j = 0; j <= i; ++j)
          if (row[j] != 0.0f) cpu::axpy_f32(row[j], v_head.data() + j * d, out_row, d);
      }
      cpu::scatter_head(out, dims, heads, b, h, out_head.data());
    }
  }
}

void CpuBackend::attention_eager_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                          const Tensor& dprobs_scratch, const Tensor& d_out,
                                          const Tensor& probs, const Tensor& q, const Tensor& k,
                                          const Tensor& v, const Tensor& segments,
                                          const AttentionDims& dims) {
  const cpu::AttentionView view = cpu::make_attention_view(dims, q, k, v, segments);
  check_attention_eager_backward(dq, dk, dv, dprobs_scratch, d_out, probs, q, k, dims, cpu::check_float_tensor);
  const int64_t seq = dims.seq, d = dims.head_dim, heads = dims.n_heads;
  const int64_t group = dims.group();

#pragma omp parallel
  {
    const size_t head_size = static_cast<size_t>(seq * d);
    std::vector<float> k_head(head_size), v_head(head_size), dk_head(head_size),
        dv_head(head_size);
    std::vector<float> q_head(head_size), d_out_head(head_size), dq_head(head_size);
    std::vector<float> p_row(static_cast<size_t>(seq)), dp_row(static_cast<size_t>(seq));
#pragma omp for schedule(dynamic)
    for (int64_t bg = 0; bg < dims.batch * dims.n_kv_heads; ++bg) {
      const int64_t b = bg / dims.n_kv_heads, kv_head = bg % dims.n_kv_heads;
      cpu::gather_head(k, dims, dims.n_kv_heads, b, kv_head, k_head.data());
      cpu::gather_head(v, dims, dims.n_kv_heads, b, kv_head, v_head.data());
      std::fill(dk_head.begin(), dk_head.end(), 0.0f);
      std::fill(dv_head.begin(), dv_head.end(), 0.0f);
      for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        cpu::gather_head(q, dims, heads, b, h, q_head.data());
        cpu::gather_head(d_out, dims, heads, b, h, d_out_head.data());
        for (int64_t i = 0; i < seq; ++i) {
          const int64_t row_offset = ((b * heads + h) * seq + i) * seq;
          cpu::load_f32(probs, row_offset, seq, p_row.data());
          const float* d_out_row = d_out_head.data() + i * d;
          for (int64_t j = 0; j < seq; ++j)
            dp_row[j] = view.visible(b, i, j)
                            ? cpu::dot_f32(d_out_row, v_head.data() + j * d, d)
                            : 0.0f;
          store_and_round(dprobs_scratch, row_offset, seq, dp_row.data());

          float p_dot_dp = 0.0f;
          for (int64_t j = 0; j <= i; ++j) p_dot_dp += p_row[j] * dp_row[j];
          float* dq_row = dq_head.data() + i * d;
          std::fill(dq_row, dq_row + d, 0.0f);
          const float* q_row = q_head.data() + i * d;
          for (int64_t j = 0; j <= i; ++j) {
            if (p_row[j] == 0.0f) continue;  // masked (or underflowed): no gradient
            cpu::axpy_f32(p_row[j], d_out_row, dv_head.data() + j * d, d);
            const float ds = p_row[j] * (dp_row[j] - p_dot_dp) * dims.scale;
            cpu::axpy_f32(ds, k_head.data() + j * d, dq_row, d);
            cpu::axpy_f32(ds, q_row, dk_head.data() + j * d, d);
          }
        }
        cpu::scatter_head(dq, dims, heads, b, h, dq_head.data());
      }
      cpu::scatter_head(dk, dims, dims.n_kv_heads, b, kv_head, dk_head.data());
      cpu::scatter_head(dv, dims, dims.n_kv_heads, b, kv_head, dv_head.data());
    }
  }
}

}  // namespace memtune
