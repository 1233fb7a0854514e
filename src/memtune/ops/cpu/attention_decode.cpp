// Decode attention on the CPU: one query per sequence against its KV cache (backend.h), the
// reference for the CUDA kernel. Per (sequence, query head): s_j = (q . k_j) * scale over the
// cache rows j < kv_len, p = softmax(s) in fp32, out = sum_j p_j v_j, rounded once. The cache rows
// are read one at a time, so no [kv_len, head_dim] copy of the cache is made.
#include <algorithm>
#include <cmath>
#include <vector>

#include "memtune/ops/cpu/cpu_backend.h"
#include "memtune/ops/op_checks.h"

namespace memtune {

void CpuBackend::attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                                  const Tensor& v_cache, const AttentionDims& dims) {
  const int64_t capacity = check_attention_decode_inputs(out, q, k_cache, v_cache, dims, cpu::check_float_tensor);
  const int64_t d = dims.head_dim, heads = dims.n_heads, kv_dim = dims.n_kv_heads * d;
  const int64_t kv_len = dims.seq, group = dims.group();
  const bool parallel = dims.batch * heads * kv_len * d >= cpu::kParallelMinElements;

#pragma omp parallel if (parallel)
  {
    std::vector<float> q_row(d), key(d), out_row(d), probs(kv_len);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < dims.batch * heads; ++bh) {
      const int64_t b = bh / heads, h = bh % heads, kv_head = h / group;
      cpu::load_f32(q, bh * d, d, q_row.data());
      const auto cache_row = [&](int64_t j) { return (b * capacity + j) * kv_dim + kv_head * d; };
      float max_score = -INFINITY;
      for (int64_t j = 0; j < kv_len; ++j) {
        cpu::load_f32(k_cache, cache_row(j), d, key.data());
        probs[j] = cpu::dot_f32(q_row.data(), key.data(), d) * dims.scale;
        max_score = std::max(max_score, probs[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < kv_len; ++j) {
        probs[j] = std::exp(probs[j] - max_score);
        sum += probs[j];
      }
      std::fill(out_row.begin(), out_row.end(), 0.0f);
      for (int64_t j = 0; j < kv_len; ++j) {
        cpu::load_f32(v_cache, cache_row(j), d, key.data());
        cpu::axpy_f32(probs[j], key.data(), out_row.data(), d);
      }
      for (int64_t c = 0; c < d; ++c) out_row[c] /= sum;
      cpu::store_f32(out, bh * d, d, out_row.data());
    }
  }
}

}  // namespace memtune
