// Rotary embedding on the GPU, halves convention, in place (formulas in ops/cpu/rope.cpp). The
// angle is float(position) * inv_freq[j] in fp32 and its cos/sin are the accurate (not
// --use_fast_math) sincosf, as HF computes them in fp32. The backward rotates by -angle.
//
// The typed kernel (x f32, bf16 or f16) takes a tile of tokens per block: the block first puts
// cos and sin of every (token, j < head_dim / 2) of the tile in shared memory, one sincosf each,
// then streams the tile's rows, each thread rotating a chunk of x[j..] against x[j + head_dim /
// 2..] of one head with them, so that all heads share the token's sincosf. A chunk is a 16-byte
// pack (head_dim / 2 a multiple of kPack, x 16-byte aligned) or one element. The generic kernel
// (one thread per (token, head, j), its own sincosf) remains for the generic-only switch and
// for head dims whose tables do not fit in shared memory.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "memtune/ops/cuda/cuda_vector.h"

namespace memtune::cuda {
namespace {

constexpr int kRopeThreads = 256;
constexpr int kMaxTileTokens = 16;
// Chunks a block aims at (two per thread), which sets the tile's token count.
constexpr int64_t kChunksPerBlock = 2 * kRopeThreads;
constexpr int64_t kMaxTableBytes = 48 * 1024;

__device__ __forceinline__ float load_position(const void* positions, DType positions_type,
                                               int64_t t) {
  return positions_type == DType::i32
             ? static_cast<float>(static_cast<const int32_t*>(positions)[t])
             : static_cast<const float*>(positions)[t];
}

// Tile sizes are small (at most kMaxTileTokens * width / 2 chunks), so the index arithmetic
// within a tile is 32-bit.
template <typename T, int kWidth>
__global__ void __launch_bounds__(kRopeThreads)
    rope_tile_kernel(T* x, int64_t tokens, int64_t width, const void* positions,
                     DType positions_type, const float* inv_freq, int head_dim, int tile_tokens,
                     float sin_sign) {
  extern __shared__ float table[];  // cos [tile_tokens][half], then sin [tile_tokens][half]
  const int half = head_dim / 2;
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * tile_tokens;
  const int tile = static_cast<int>(tokens - first_token < tile_tokens ? tokens - first_token
                                                                       : tile_tokens);
  float* cosines = table;
  float* sines = table + tile_tokens * half;
  for (int i = threadIdx.x; i < tile * half; i += blockDim.x) {
    const int t = i / half, j = i - t * half;
    float s, c;
    sincosf(load_position(positions, positions_type, first_token + t) * inv_freq[j], &s, &c);
    cosines[i] = c;
    sines[i] = s * sin_sign;
  }
  __syncthreads();
  const int chunks_per_head = half / kWidth;
  const int chunks_per_token = static_cast<int>(width / head_dim) * chunks_per_head;
  for (int e = threadIdx.x; e < tile * chunks_per_token; e += blockDim.x) {
    const int t = e / chunks_per_token, rest = e - t * chunks_per_token;
    const int h = rest / chunks_per_head, j = (rest - h * chunks_per_head) * kWidth;
    T* first = x + (first_token + t) * width + h * head_dim + j;
    T* second = first + half;
    float x1[kWidth], x2[kWidth];
    load_chunk<kWidth>(first, x1);
    load_chunk<kWidth>(second, x2);
    const float* c = cosines + t * half + j;
    const float* s = sines + t * half + j;
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      const float a = x1[k], b = x2[k];
      x1[k] = a * c[k] - b * s[k];
      x2[k] = b * c[k] + a * s[k];
    }
    store_chunk<kWidth>(first, x1);
    store_chunk<kWidth>(second, x2);
  }
}

__global__ void rope_kernel(void* x, DType x_type, int64_t tokens, int64_t width,
                            const void* positions, DType positions_type, const float* inv_freq,
                            int64_t head_dim, float sin_sign) {
  const int64_t half = head_dim / 2;
  const int64_t pairs_per_token = width / 2;
  const int64_t n = tokens * pairs_per_token;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / pairs_per_token, pair = e % pairs_per_token;
    const int64_t h = pair / half, j = pair % half;
    const float position = positions_type == DType::i32
                               ? static_cast<float>(static_cast<const int32_t*>(positions)[t])
                               : static_cast<const float*>(positions)[t];
    float s, c;
    sincosf(position * inv_freq[j], &s, &c);
    s *= sin_sign;
    const int64_t first = t * width + h * head_dim + j, second = first + half;
    const float x1 = load_float(x, x_type, first), x2 = load_float(x, x_type, second);
    store_float(x, x_type, first, x1 * c - x2 * s);
    store_float(x, x_type, second, x2 * c + x1 * s);
  }
}

}  // namespace

void launch_rope(void* x, DType x_type, int64_t tokens, int64_t width, const void* positions,
                 DType positions_type, const float* inv_freq, int64_t head_dim, bool inverse,
                 cudaStream_t stream) {
  const int64_t n = tokens * (width / 2);
  if (n == 0) return;
  const float sin_sign = inverse ? -1.0f : 1.0f;
  const int64_t half = head_dim / 2;
  const int64_t table_bytes_per_token = 2 * half * static_cast<int64_t>(sizeof(float));
  if (!generic_kernels_only() && table_bytes_per_token <= kMaxTableBytes) {
    const bool vector = half % kPack == 0 && is_aligned_16(x);
    const int64_t chunks_per_token = width / 2 / (vector ? kPack : 1);
    int64_t tile_tokens = (kChunksPerBlock + chunks_per_token - 1) / chunks_per_token;
    if (tile_tokens > kMaxTileTokens) tile_tokens = kMaxTileTokens;
    if (tile_tokens > kMaxTableBytes / table_bytes_per_token)
      tile_tokens = kMaxTableBytes / table_bytes_per_token;
    if (tile_tokens < 1) tile_tokens = 1;
    const int64_t blocks = (tokens + tile_tokens - 1) / tile_tokens;
    const size_t shared_bytes = static_cast<size_t>(tile_tokens * table_bytes_per_token);
    const bool typed = blocks <= INT32_MAX && with_float_type(x_type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      if (vector)
        rope_tile_kernel<T, kPack><<<static_cast<unsigned>(blocks), kRopeThreads, shared_bytes,
                                     stream>>>(static_cast<T*>(x), tokens, width, positions,
                                               positions_type, inv_freq,
                                               static_cast<int>(head_dim),
                                               static_cast<int>(tile_tokens), sin_sign);
      else
        rope_tile_kernel<T, 1><<<static_cast<unsigned>(blocks), kRopeThreads, shared_bytes,
                                 stream>>>(static_cast<T*>(x), tokens, width, positions,
                                           positions_type, inv_freq, static_cast<int>(head_dim),
                                           static_cast<int>(tile_tokens), sin_sign);
    });
    if (typed) {
      MT_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  rope_kernel<<<grid_for(n, 256), 256, 0, stream>>>(x, x_type, tokens, width, positions,
                                                     positions_type, inv_freq, head_dim,
                                                     sin_sign);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
