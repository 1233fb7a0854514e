// FlashAttention-2 on the CPU (Dao, arXiv 2307.08691; SPECS.md §7): the reference for the CUDA
// kernel, with the same tiling and the same fp32 bookkeeping, and no [seq, seq] matrix: the
// working set is one kBlockQ x kBlockK tile plus fp32 copies of the heads involved.
//
// Forward, per (batch, head) and query block, over the key blocks that the causal mask leaves:
//   S = Q K^T * scale (masked: -inf); m' = max(m, rowmax S); P = exp(S - m');
//   l = l exp(m - m') + rowsum P; O = O exp(m - m') + P V; then O /= l, lse = m + log(l).
// Backward, per (batch, kv head) so that a kv head's dK/dV sum over its query heads in one
// thread: D = rowsum(dO * O) (delta_scratch); per key block j, over the query heads of the group
// and the query blocks i that see block j: P = exp(S * scale - lse); dV_j += P^T dO_i;
// dP = dO_i V_j^T; dS = P (dP - D_i) * scale; dK_j += dS^T Q_i; dQ_i += dS K_j, with dQ summed
// in fp32 in dq_accum_scratch and rounded into dq at the end.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "memtune/ops/cpu/cpu_backend.h"
#include "memtune/ops/op_checks.h"

namespace memtune {
namespace {

// Deliberately unequal, so that tests with a few dozen positions cross both kinds of block edge.
constexpr int64_t kBlockQ = 32;
constexpr int64_t kBlockK = 16;

// S tile for queries [i0, i1) and keys [j0, j1): dot * scale where visible, else -inf.
// Returns whether any entry is visible.
bool score_tile(const cpu::AttentionView& view, int64_t b, const float* q_head,
                const float* k_head, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                float* tile) {
  const int64_t d = view.dims.head_dim;
  const float negative_infinity = -std::numeric_limits<float>::infinity();
  bool any_visible = false;
  for (int64_t i = i0; i < i1; ++i) {
    float* tile_row = tile + (i - i0) * kBlockK;
    for (int64_t j = j0; j < j1; ++j) {
      if (view.visible(b, i, j)) {
        tile_row[j - j0] = cpu::dot_f32(q_head + i * d, k_head + j * d, d) * view.dims.scale;
        any_visible = true;
      } else {
        tile_row[j - j0] = negative_infinity;
      }
    }
  }
  return any_visible;
}

}  // namespace

void CpuBackend::attention_flash_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                                         const Tensor& k, const Tensor& v,
                                         const Tensor& segments, const AttentionDims& dims) {
  const cpu::AttentionView view = cpu::make_attention_view(dims, q, k, v, segments);
  check_float_like(out, q, "attention_flash_forward out", cpu::check_float_tensor);
  check_attention_rows(lse, dims, "attention_flash_forward lse", cpu::check_tensor);
  const int64_t seq = dims.seq, d = dims.head_dim, heads = dims.n_heads;
  const float negative_infinity = -std::numeric_limits<float>::infinity();
  float* lse_values = lse.as<float>();

#pragma omp parallel
  {
    const size_t head_size = static_cast<size_t>(seq * d);
    std::vector<float> q_head(head_size), k_head(head_size), v_head(head_size),
        out_head(head_size);
    std::vector<float> tile(kBlockQ * kBlockK), row_max(kBlockQ), row_sum(kBlockQ);
#pragma omp for schedule(dynamic)
    for (int64_t bh = 0; bh < dims.batch * heads; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      cpu::gather_query_head_inputs(q, k, v, dims, b, h, q_head.data(), k_head.data(), v_head.data());
      for (int64_t i0 = 0; i0 < seq; i0 += kBlockQ) {
        const int64_t i1 = std::min(seq, i0 + kBlockQ);
        std::fill(row_max.begin(), row_max.end(), negative_infinity);
        std::fill(row_sum.begin(), row_sum.end(), 0.0f);
        std::fill(out_head.begin() + i0 * d, out_head.begin() + i1 * d, 0.0f);
        // Causal: key blocks that start after the block's last query are all masked.
        for (int64_t j0 = 0; j0 < i1; j0 += kBlockK) {
          const int64_t j1 = std::min(seq, j0 + kBlockK);
          if (!score_tile(view, b, q_head.data(), k_head.data(), i0, i1, j0, j1, tile.data()))
            continue;
          for (int64_t i = i0; i < i1; ++i) {
            float* tile_row = tile.data() + (i - i0) * kBlockK;
            float block_max = negative_infinity;
            for (int64_t j = 0; j < j1 - j0; ++j) block_max = std::max(block_max, tile_row[j]);
            if (block_max == negative_infinity) continue;  // row sees nothing in this block
            const int64_t r = i - i0;
            const float new_max = std::max(row_max[r], block_max);
            const float correction = std::exp(row_max[r] - new_max);  // 0 on the first block
            float block_sum = 0.0f;
            for (int64_t j = 0; j < j1 - j0; ++j) {
              tile_row[j] = std::exp(tile_row[j] - new_max);
              block_sum += tile_row[j];
            }
            row_sum[r] = row_sum[r] * correction + block_sum;
            row_max[r] = new_max;
            float* out_row = out_head.data() + i * d;
            for (int64_t c = 0; c < d; ++c) out_row[c] *= correction;
            for (int64_t j = 0; j < j1 - j0; ++j)
              if (tile_row[j] != 0.0f)
                cpu::axpy_f32(tile_row[j], v_head.data() + (j0 + j) * d, out_row, d);
          }
        }
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t r = i - i0;
          float* out_row = out_head.data() + i * d;
          for (int64_t c = 0; c < d; ++c) out_row[c] /= row_sum[r];
          lse_values[bh * seq + i] = row_max[r] + std::log(row_sum[r]);
        }
      }
      cpu::scatter_head(out, dims, heads, b, h, out_head.data());
    }
  }
}

void CpuBackend::attention_flash_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                          const Tensor& delta_scratch,
                                          const Tensor& dq_accum_scratch, const Tensor& d_out,
                                          const Tensor& out, const Tensor& lse, const Tensor& q,
                                          const Tensor& k, const Tensor& v,
                                          const Tensor& segments, const AttentionDims& dims) {
  const cpu::AttentionView view = cpu::make_attention_view(dims, q, k, v, segments);
  check_fused_attention_backward("attention_flash_backward", dq, dk, dv, d_out, out, lse, q, k, dims,
                                 cpu::check_float_tensor, cpu::check_tensor);
  check_attention_rows(delta_scratch, dims, "attention_flash_backward delta_scratch", cpu::check_tensor);
  cpu::check_tensor(dq_accum_scratch, DType::f32, "attention_flash_backward dq_accum_scratch");
  MT_ASSERT(dq_accum_scratch.numel() == q.numel(),
            "attention_flash_backward dq_accum_scratch {} vs q {}",
            dq_accum_scratch.shape.str(), q.shape.str());
  const int64_t seq = dims.seq, d = dims.head_dim, heads = dims.n_heads;
  const int64_t group = dims.group();
  const float* lse_values = lse.as<const float>();
  float* delta_values = delta_scratch.as<float>();
  // dq_accum_scratch as [N, heads, d]: the fp32 dQ of query head h lives in its columns.
  float* dq_accum = dq_accum_scratch.as<float>();
  auto dq_accum_row = [&](int64_t b, int64_t h, int64_t i) {
    return dq_accum + ((b * seq + i) * heads + h) * d;
  };

#pragma omp parallel
  {
    const size_t head_size = static_cast<size_t>(seq * d);
    const size_t group_size = head_size * static_cast<size_t>(group);
    std::vector<float> k_head(head_size), v_head(head_size);
    std::vector<float> q_group(group_size), d_out_group(group_size);
    std::vector<float> out_row(static_cast<size_t>(d));
    std::vector<float> dk_block(kBlockK * d), dv_block(kBlockK * d);
    std::vector<float> tile(kBlockQ * kBlockK);
#pragma omp for schedule(dynamic)
    for (int64_t bg = 0; bg < dims.batch * dims.n_kv_heads; ++bg) {
      const int64_t b = bg / dims.n_kv_heads, kv_head = bg % dims.n_kv_heads;
      const int64_t first_head = kv_head * group;
      cpu::gather_head(k, dims, dims.n_kv_heads, b, kv_head, k_head.data());
      cpu::gather_head(v, dims, dims.n_kv_heads, b, kv_head, v_head.data());
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = first_head + g;
        float* q_head = q_group.data() + g * head_size;
        float* d_out_head = d_out_group.data() + g * head_size;
        cpu::gather_head(q, dims, heads, b, h, q_head);
        cpu::gather_head(d_out, dims, heads, b, h, d_out_head);
        for (int64_t i = 0; i < seq; ++i) {
          cpu::load_f32(out, ((b * seq + i) * heads + h) * d, d, out_row.data());
          delta_values[(b * heads + h) * seq + i] =
              cpu::dot_f32(d_out_head + i * d, out_row.data(), d);
          std::fill(dq_accum_row(b, h, i), dq_accum_row(b, h, i) + d, 0.0f);
        }
      }

      for (int64_t j0 = 0; j0 < seq; j0 += kBlockK) {
        const int64_t j1 = std::min(seq, j0 + kBlockK);
        std::fill(dk_block.begin(), dk_block.end(), 0.0f);
        std::fill(dv_block.begin(), dv_block.end(), 0.0f);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = first_head + g;
          const float* q_head = q_group.data() + g * head_size;
          const float* d_out_head = d_out_group.data() + g * head_size;
          const float* head_lse = lse_values + (b * heads + h) * seq;
          const float* head_delta = delta_values + (b * heads + h) * seq;
          // Causal: the first query block that can see key j0 is the one holding position j0.
          for (int64_t i0 = j0 / kBlockQ * kBlockQ; i0 < seq; i0 += kBlockQ) {
            const int64_t i1 = std::min(seq, i0 + kBlockQ);
            if (!score_tile(view, b, q_head, k_head.data(), i0, i1, j0, j1, tile.data()))
              continue;
            for (int64_t i = i0; i < i1; ++i) {
              const float* tile_row = tile.data() + (i - i0) * kBlockK;
              const float* q_row = q_head + i * d;
              const float* d_out_row = d_out_head + i * d;
              float* dq_row = dq_accum_row(b, h, i);
              for (int64_t j = j0; j < j1; ++j) {
                // exp(-inf - lse) = 0: masked entries drop out.
                const float p = std::exp(tile_row[j - j0] - head_lse[i]);
                if (p == 0.0f) continue;
                const float* k_row = k_head.data() + j * d;
                cpu::axpy_f32(p, d_out_row, dv_block.data() + (j - j0) * d, d);
                const float dp = cpu::dot_f32(d_out_row, v_head.data() + j * d, d);
                const float ds = p * (dp - head_delta[i]) * dims.scale;
                cpu::axpy_f32(ds, q_row, dk_block.data() + (j - j0) * d, d);
                cpu::axpy_f32(ds, k_row, dq_row, d);
              }
            }
          }
        }
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t offset = ((b * seq + j) * dims.n_kv_heads + kv_head) * d;
          cpu::store_f32(dk, offset, d, dk_block.data() + (j - j0) * d);
          cpu::store_f32(dv, offset, d, dv_block.data() + (j - j0) * d);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = first_head + g;
        for (int64_t i = 0; i < seq; ++i)
          cpu::store_f32(dq, ((b * seq + i) * heads + h) * d, d, dq_accum_row(b, h, i));
      }
    }
  }
}

}  // namespace memtune
