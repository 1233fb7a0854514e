// Decode attention: one query per sequence against its KV cache (backend.h attention_decode),
// checked against ops/cpu/attention_decode.cpp by tests/gpu/test_cuda_decode.cpp.
//
// One block per (sequence, query head), kWarps warps. Warp w walks the cache rows w, w + kWarps,
// ... with an online softmax of its own (running max m, sum l, and an fp32 accumulator of the
// weighted v rows): a lane holds head elements lane + 32 i, so every cache row is read coalesced
// and a score is one warp reduction. At the end the warps' partial states are merged through
// shared memory: M = max m_w, out = sum_w acc_w exp(m_w - M) / sum_w l_w exp(m_w - M).
// No [kv_len] score buffer is kept, so the cache length is not limited by shared memory.
//
// Known limit: one block per head leaves most SMs idle for a single sequence with a long cache
// (32 heads on 132 SMs); splitting the cache over blocks (flash-decoding) would fix it, and
// decode is dominated by reading the weights anyway.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

constexpr int kWarps = 8;

// kPerLane: head elements per lane, head_dim <= 32 * kPerLane.
template <int kPerLane>
__global__ void __launch_bounds__(kWarps * 32)
    attention_decode_kernel(AttentionDecodeArgs a) {
  __shared__ float warp_max_scores[kWarps];
  __shared__ float warp_sums[kWarps];
  __shared__ float warp_acc[kWarps][32 * kPerLane];

  const int64_t bh = blockIdx.x;
  const int64_t b = bh / a.n_heads, h = bh % a.n_heads;
  const int64_t kv_head = h / (a.n_heads / a.n_kv_heads);
  const int64_t d = a.head_dim, kv_width = a.n_kv_heads * d;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  float q[kPerLane], acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t c = lane + 32 * i;
    q[i] = c < d ? load_float(a.q, a.q_type, bh * d + c) : 0.0f;
    acc[i] = 0.0f;
  }
  float running_max = -INFINITY, running_sum = 0.0f;
  for (int64_t j = warp; j < a.kv_len; j += kWarps) {
    const int64_t row = (b * a.capacity + j) * kv_width + kv_head * d;
    float partial = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t c = lane + 32 * i;
      if (c < d) partial += q[i] * load_float(a.k_cache, a.k_type, row + c);
    }
    const float score = warp_sum(partial) * a.scale;
    const float new_max = fmaxf(running_max, score);
    const float correction = expf(running_max - new_max);  // 0 on the first row
    const float p = expf(score - new_max);
    running_sum = running_sum * correction + p;
    running_max = new_max;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t c = lane + 32 * i;
      const float v = c < d ? load_float(a.v_cache, a.v_type, row + c) : 0.0f;
      acc[i] = acc[i] * correction + p * v;
    }
  }
  if (lane == 0) {
    warp_max_scores[warp] = running_max;
    warp_sums[warp] = running_sum;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) warp_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();

  float block_max_score = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) block_max_score = fmaxf(block_max_score, warp_max_scores[w]);
  float total = 0.0f;
  float weight[kWarps];
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    // A warp that saw no rows (kv_len < kWarps) has m = -inf and weighs exp(-inf) = 0.
    weight[w] = expf(warp_max_scores[w] - block_max_score);
    total += warp_sums[w] * weight[w];
  }
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float value = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) value += warp_acc[w][c] * weight[w];
    store_float(a.out, a.out_type, bh * d + c, value / total);
  }
}

}  // namespace

void attention_decode(const AttentionDecodeArgs& args, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(args.batch * args.n_heads);
  const int threads = kWarps * 32;
  if (args.head_dim <= 32) attention_decode_kernel<1><<<blocks, threads, 0, stream>>>(args);
  else if (args.head_dim <= 64) attention_decode_kernel<2><<<blocks, threads, 0, stream>>>(args);
  else if (args.head_dim <= 128) attention_decode_kernel<4><<<blocks, threads, 0, stream>>>(args);
  else attention_decode_kernel<8><<<blocks, threads, 0, stream>>>(args);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
