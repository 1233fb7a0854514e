// FlashAttention-2 on the GPU (Dao, arXiv 2307.08691; SPECS.md §7): causal GQA attention that
// saves only O and the fp32 logsumexp, with segments (packed sequences).
//
// Tensor-core kernels (head_dim 64 and 128, q/k/v (and d_out) all bf16 or all f16, 16-byte
// aligned): blocks of 64 queries x 64 keys, 4 warps of 16 rows each, mma.sync.m16n8k16 with fp32
// accumulation (PTX ISA, "Warp-level matrix fragments for mma.m16n8k16"), fragments loaded from
// shared memory with ldmatrix (.trans where the operand must be transposed), tiles brought in by
// cp.async (zero-filled past the sequence end). Shared-memory rows are padded by 16 bytes, which
// puts the eight 16-byte rows that one ldmatrix phase reads in eight different bank groups.
//  - Forward: one block per (query block, head, batch row), heaviest (last) query blocks first.
//    Q fragments stay in registers; per key block S = Q K^T, the online softmax in the exp2
//    domain (scores times scale * log2 e), and O += P V with P taken straight from the S
//    accumulators (an m16n8 C fragment pair is an m16k16 A fragment). V's load overlaps S, the
//    next K's load overlaps the softmax and P V. This is forward v1, kept selectable
//    (MEMTUNE_FLASH_FWD=v1, attention_flash.h).
//  - Forward v2 (the default): 128 queries per block, 4 warps of 32 rows (two m16 tiles share
//    each K/V fragment), 64 keys per block (32 where shared memory is short), K/V
//    double-buffered one key block ahead, Q read from shared memory per key block, warps above
//    the diagonal skip the block, O rescaled only when a row's max moves by more than 2^8
//    (flash_forward_tc2).
//  - Backward: D = rowsum(dO * O) and a zeroed fp32 dQ accumulator first; then one block per
//    (key block, kv head, batch row), which loops over the group's query heads and the query
//    blocks that see its keys: S^T = K Q^T, P^T = exp2(S^T * scale log2 e - lse log2 e),
//    dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D) * scale, dK += dS^T Q, and dQ += dS K
//    added into the accumulator with fp32 atomics (as FA2 does); dQ is rounded into dq at the
//    end. dK and dV of a kv head are summed in registers over its whole group: K and V are never
//    repeated. This is backward v1, kept selectable (MEMTUNE_FLASH_BWD=v1, attention_flash.h).
//  - Backward v2 (the default; "backward v2" below): 128 keys x 8 warps per block, Q/dO/lse/D
//    double-buffered by cp.async, dS^T kept in registers for dK, skipped masked warps, vector
//    fp32 reductions for dQ on sm_90, 16-byte D/zeroing and dQ rounding passes.
// Generic kernels (any even head_dim up to 256, any float dtypes, any alignment): one warp per
// query row (forward, dQ) or key row (dK/dV), fp32 throughout. Simple, and the reference the
// tests hold the tensor-core path against as well as the CPU.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "memtune/ops/cuda/attention_flash.h"
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ bool sees(const int32_t* segments_row, int64_t i, int64_t j) {
  return j <= i && (segments_row == nullptr || segments_row[i] == segments_row[j]);
}

// ================================ generic kernels ===============================================

constexpr int kGenericWarps = 4;
constexpr int kMaxPerLane = 8;  // head_dim <= 256

__global__ void __launch_bounds__(kGenericWarps * 32)
    flash_forward_generic(AttentionParams p, FlashTensors t) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGenericWarps + (threadIdx.x >> 5);
  if (row >= p.batch * p.n_heads * p.seq) return;
  const int64_t i = row % p.seq, h = (row / p.seq) % p.n_heads, b = row / (p.seq * p.n_heads);
  const int64_t g = h / (p.n_heads / p.n_kv_heads), d = p.head_dim;
  const int32_t* segments_row = p.segments == nullptr ? nullptr : p.segments + b * p.seq;
  const float scale_log2 = p.scale * kLog2e;
  const int64_t q_offset = ((b * p.seq + i) * p.n_heads + h) * d;
  float q[kMaxPerLane], o[kMaxPerLane];
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int64_t c = lane + 32 * e;
    q[e] = c < d ? load_float(t.q, t.q_type, q_offset + c) * scale_log2 : 0.0f;
    o[e] = 0.0f;
  }
  float running_max = -INFINITY, running_sum = 0.0f;
  #pragma unroll 1  // a run-time loop: unrolling it only multiplies live registers
  for (int64_t j = 0; j <= i; ++j) {
    if (!sees(segments_row, i, j)) continue;
    const int64_t kv_offset = ((b * p.seq + j) * p.n_kv_heads + g) * d;
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int64_t c = lane + 32 * e;
      if (c < d) dot = fmaf(q[e], load_float(t.k, t.k_type, kv_offset + c), dot);
    }
    const float s = warp_sum(dot);
    const float new_max = fmaxf(running_max, s);
    const float correction = exp2f(running_max - new_max);
    const float weight = exp2f(s - new_max);
    running_sum = running_sum * correction + weight;
    running_max = new_max;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int64_t c = lane + 32 * e;
      if (c < d) o[e] = o[e] * correction + weight * load_float(t.v, t.v_type, kv_offset + c);
    }
  }
  const float inverse = 1.0f / running_sum;  // the diagonal is always visible: sum >= 1
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int64_t c = lane + 32 * e;
    if (c < d) store_float(t.out, t.out_type, q_offset + c, o[e] * inverse);
  }
  if (lane == 0)
    t.lse[(b * p.n_heads + h) * p.seq + i] = (running_max + log2f(running_sum)) * kLn2;
}

// D = rowsum(dO * O) per (b, h, i); with zero_accum, also zeroes the row's dQ accumulator.
__global__ void __launch_bounds__(kGenericWarps * 32)
    flash_delta_kernel(AttentionParams p, FlashTensors t, bool zero_accum) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGenericWarps + (threadIdx.x >> 5);
  if (row >= p.batch * p.n_heads * p.seq) return;
  const int64_t i = row % p.seq, h = (row / p.seq) % p.n_heads, b = row / (p.seq * p.n_heads);
  const int64_t offset = ((b * p.seq + i) * p.n_heads + h) * p.head_dim;
  float dot = 0.0f;
  for (int64_t c = lane; c < p.head_dim; c += 32) {
    dot = fmaf(load_float(t.d_out, t.d_out_type, offset + c), load_float(t.out, t.out_type, offset + c), dot);
    if (zero_accum) t.dq_accum[offset + c] = 0.0f;
  }
  dot = warp_sum(dot);
  if (lane == 0) t.delta[(b * p.n_heads + h) * p.seq + i] = dot;
}

// dQ_i = sum_j dS_ij K_j, one warp per query row.
__global__ void __launch_bounds__(kGenericWarps * 32)
    flash_dq_generic(AttentionParams p, FlashTensors t) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGenericWarps + (threadIdx.x >> 5);
  if (row >= p.batch * p.n_heads * p.seq) return;
  const int64_t i = row % p.seq, h = (row / p.seq) % p.n_heads, b = row / (p.seq * p.n_heads);
  const int64_t g = h / (p.n_heads / p.n_kv_heads), d = p.head_dim;
  const int32_t* segments_row = p.segments == nullptr ? nullptr : p.segments + b * p.seq;
  const int64_t q_offset = ((b * p.seq + i) * p.n_heads + h) * d;
  const float row_lse = t.lse[(b * p.n_heads + h) * p.seq + i];
  const float row_delta = t.delta[(b * p.n_heads + h) * p.seq + i];
  float q[kMaxPerLane], d_out[kMaxPerLane], dq[kMaxPerLane];
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int64_t c = lane + 32 * e;
    q[e] = c < d ? load_float(t.q, t.q_type, q_offset + c) : 0.0f;
    d_out[e] = c < d ? load_float(t.d_out, t.d_out_type, q_offset + c) : 0.0f;
    dq[e] = 0.0f;
  }
  #pragma unroll 1  // a run-time loop: unrolling it only multiplies live registers
  for (int64_t j = 0; j <= i; ++j) {
    if (!sees(segments_row, i, j)) continue;
    const int64_t kv_offset = ((b * p.seq + j) * p.n_kv_heads + g) * d;
    float qk = 0.0f, dov = 0.0f;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int64_t c = lane + 32 * e;
      if (c < d) {
        qk = fmaf(q[e], load_float(t.k, t.k_type, kv_offset + c), qk);
        dov = fmaf(d_out[e], load_float(t.v, t.v_type, kv_offset + c), dov);
      }
    }
    qk = warp_sum(qk);
    dov = warp_sum(dov);
    const float prob = expf(qk * p.scale - row_lse);
    const float ds = prob * (dov - row_delta) * p.scale;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int64_t c = lane + 32 * e;
      if (c < d) dq[e] = fmaf(ds, load_float(t.k, t.k_type, kv_offset + c), dq[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int64_t c = lane + 32 * e;
    if (c < d) store_float(t.dq, t.dq_type, q_offset + c, dq[e]);
  }
}

// dK_j, dV_j summed over the group's query heads and the queries that see key j; one warp per
// (b, kv head, j).
__global__ void __launch_bounds__(kGenericWarps * 32)
    flash_dkdv_generic(AttentionParams p, FlashTensors t) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGenericWarps + (threadIdx.x >> 5);
  if (row >= p.batch * p.n_kv_heads * p.seq) return;
  const int64_t j = row % p.seq, g = (row / p.seq) % p.n_kv_heads,
                b = row / (p.seq * p.n_kv_heads);
  const int64_t group = p.n_heads / p.n_kv_heads, d = p.head_dim;
  const int32_t* segments_row = p.segments == nullptr ? nullptr : p.segments + b * p.seq;
  const int64_t kv_offset = ((b * p.seq + j) * p.n_kv_heads + g) * d;
  float k[kMaxPerLane], v[kMaxPerLane], dk[kMaxPerLane], dv[kMaxPerLane];
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int64_t c = lane + 32 * e;
    k[e] = c < d ? load_float(t.k, t.k_type, kv_offset + c) : 0.0f;
    v[e] = c < d ? load_float(t.v, t.v_type, kv_offset + c) : 0.0f;
    dk[e] = dv[e] = 0.0f;
  }
  #pragma unroll 1  // a run-time loop: unrolling it only multiplies live registers
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    #pragma unroll 1  // a run-time loop: unrolling it only multiplies live registers
    for (int64_t i = j; i < p.seq; ++i) {
      if (!sees(segments_row, i, j)) continue;
      const int64_t q_offset = ((b * p.seq + i) * p.n_heads + h) * d;
      float qk = 0.0f, dov = 0.0f;
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) {
        const int64_t c = lane + 32 * e;
        if (c < d) {
          qk = fmaf(load_float(t.q, t.q_type, q_offset + c), k[e], qk);
          dov = fmaf(load_float(t.d_out, t.d_out_type, q_offset + c), v[e], dov);
        }
      }
      qk = warp_sum(qk);
      dov = warp_sum(dov);
      const int64_t stat = (b * p.n_heads + h) * p.seq + i;
      const float prob = expf(qk * p.scale - t.lse[stat]);
      const float ds = prob * (dov - t.delta[stat]) * p.scale;
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) {
        const int64_t c = lane + 32 * e;
        if (c < d) {
          dv[e] = fmaf(prob, load_float(t.d_out, t.d_out_type, q_offset + c), dv[e]);
          dk[e] = fmaf(ds, load_float(t.q, t.q_type, q_offset + c), dk[e]);
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int64_t c = lane + 32 * e;
    if (c < d) {
      store_float(t.dk, t.dk_type, kv_offset + c, dk[e]);
      store_float(t.dv, t.dv_type, kv_offset + c, dv[e]);
    }
  }
}

// ================================ tensor-core kernels ===========================================

constexpr int kBlock = 64;    // queries per block (forward) and keys per block (backward); both
                              // tile sides are 64, so block edges line up with the diagonal
constexpr int kThreads = 128;  // 4 warps x 16 rows

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global -> shared, asynchronously; valid == false writes 16 zero bytes instead.
__device__ __forceinline__ void cp_async_16(uint32_t shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(global),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Shared-memory operands are 32-bit shared-window byte addresses: far fewer registers than
// generic 64-bit pointers, and ptxas folds the constant offsets into the instructions.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// Per-lane byte offsets of the three ldmatrix.x4 patterns, for a tile of row stride `stride`
// elements (PTX ISA, ldmatrix: lanes 8i..8i+7 give the row addresses of matrix i).
//  rows_a: a 16 x 16 A operand at (row 0, col 0): matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15)
//          in the order a0 a1 a2 a3.
//  rows_b: B operands of two n-tiles, from a tile stored [n][k]: r0 r1 = b0 b1 of rows 0-7,
//          r2 r3 = b0 b1 of rows 8-15.
//  trans:  B operands of two n-tiles, from a tile stored [k][n] (transposed on load): r0 r1 =
//          b0 b1 of columns 0-7, r2 r3 of columns 8-15.
//  trans_a: an A operand from a tile stored [k][m] (transposed on load).
__device__ __forceinline__ uint32_t rows_a_offset(int lane, int stride) {
  return static_cast<uint32_t>(((lane & 15) * stride + (lane >> 4) * 8) * 2);
}
__device__ __forceinline__ uint32_t rows_b_offset(int lane, int stride) {
  return static_cast<uint32_t>((((lane & 7) + (lane >> 4) * 8) * stride + ((lane >> 3) & 1) * 8) * 2);
}
__device__ __forceinline__ uint32_t trans_offset(int lane, int stride) {
  return static_cast<uint32_t>((((lane & 7) + ((lane >> 3) & 1) * 8) * stride + (lane >> 4) * 8) * 2);
}
__device__ __forceinline__ uint32_t trans_a_offset(int lane, int stride) {
  return static_cast<uint32_t>((((lane & 7) + (lane >> 4) * 8) * stride + ((lane >> 3) & 1) * 8) * 2);
}

// d += a b for one m16n8k16 tile, fp32 accumulators.
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (kBf16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as one register of two 16-bit values, the first in the low half.
template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float low, float high) {
  uint32_t bits;
  if constexpr (kBf16) {
    const __nv_bfloat162 value = __floats2bfloat162_rn(low, high);
    memcpy(&bits, &value, 4);
  } else {
    const __half2 value = __floats2half2_rn(low, high);
    memcpy(&bits, &value, 4);
  }
  return bits;
}

// A 64 x D tile of rows [row0, row0 + 64) of one head into shared memory (row stride D + 8);
// rows at or past `valid_rows` are zero-filled. `head` points at row 0 of the tile.
template <int D, int kRows = kBlock>
__device__ __forceinline__ void load_tile(uint32_t tile, const uint16_t* head, int64_t row_stride,
                                          int64_t valid_rows) {
  constexpr int kChunks = D / 8;  // 16-byte pieces per row
#pragma unroll
  for (int step = 0; step < kRows * kChunks / kThreads; ++step) {
    const int e = step * kThreads + threadIdx.x;
    const int r = e / kChunks, c = e % kChunks;
    const bool valid = r < valid_rows;
    cp_async_16(tile + static_cast<uint32_t>((r * (D + 8) + c * 8) * 2),
                valid ? head + r * row_stride + c * 8 : head, valid);
  }
}

template <int D>
constexpr int forward_shared_bytes() {
  return 3 * kBlock * (D + 8) * 2 + kBlock * 4;
}

template <int D, bool kBf16>
__global__ void __launch_bounds__(kThreads)
    flash_forward_tc(AttentionParams p, FlashTensors t) {
  constexpr int kStride = D + 8;
  constexpr uint32_t kTileBytes = kBlock * kStride * 2;
  extern __shared__ __align__(16) uint16_t shared[];
  int32_t* key_segments = reinterpret_cast<int32_t*>(shared + 3 * kBlock * kStride);
  const uint32_t q_tile = shared_address(shared);
  const uint32_t k_tile = q_tile + kTileBytes;
  const uint32_t v_tile = k_tile + kTileBytes;

  const int64_t seq = p.seq, heads = p.n_heads, kv_heads = p.n_kv_heads;
  const int64_t q_block = gridDim.x - 1 - blockIdx.x;  // the longest rows first
  const int64_t h = blockIdx.y, b = blockIdx.z, g = h / (heads / kv_heads);
  const int64_t q0 = q_block * kBlock;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group_id = lane >> 2, thread_in_group = lane & 3;
  const int32_t* segments_row = p.segments == nullptr ? nullptr : p.segments + b * seq;
  const float scale_log2 = p.scale * kLog2e;

  const uint16_t* k_head = static_cast<const uint16_t*>(t.k) + (b * seq * kv_heads + g) * D;
  const uint16_t* v_head = static_cast<const uint16_t*>(t.v) + (b * seq * kv_heads + g) * D;
  const int64_t kv_stride = kv_heads * D;

  load_tile<D>(q_tile, static_cast<const uint16_t*>(t.q) + ((b * seq + q0) * heads + h) * D,
               heads * D, seq - q0);
  load_tile<D>(k_tile, k_head, kv_stride, seq);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  uint32_t q_frag[D / 16][4];
  {
    const uint32_t base = q_tile + warp * 16 * kStride * 2 + rows_a_offset(lane, kStride);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(q_frag[kk], base + kk * 32);
  }
  const uint32_t k_lane = k_tile + rows_b_offset(lane, kStride);
  const uint32_t v_lane = v_tile + trans_offset(lane, kStride);

  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float max_a = -INFINITY, max_b = -INFINITY, sum_a = 0.0f, sum_b = 0.0f;
  const int row_a = static_cast<int>(warp * 16 + group_id), row_b = row_a + 8;  // in the block
  const int32_t segment_a =
      segments_row != nullptr && q0 + row_a < seq ? segments_row[q0 + row_a] : 0;
  const int32_t segment_b =
      segments_row != nullptr && q0 + row_b < seq ? segments_row[q0 + row_b] : 0;
  const int64_t last_key = (q0 + kBlock - 1 < seq - 1 ? q0 + kBlock - 1 : seq - 1);
  const int64_t key_blocks = last_key / kBlock + 1;

  #pragma unroll 1  // a run-time loop: unrolling it only multiplies live registers
  for (int64_t kb = 0; kb < key_blocks; ++kb) {
    const int64_t k0 = kb * kBlock;
    load_tile<D>(v_tile, v_head + k0 * kv_stride, kv_stride, seq - k0);
    cp_async_commit();
    if (segments_row != nullptr)
      for (int e = threadIdx.x; e < kBlock; e += kThreads)
        key_segments[e] = k0 + e < seq ? segments_row[k0 + e] : 0;
    cp_async_wait<1>();  // K of this block
    __syncthreads();

    float s[kBlock / 8][4];
#pragma unroll
    for (int nt = 0; nt < kBlock / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nt = 0; nt < kBlock / 8; nt += 2) {
        uint32_t r[4];
        ldmatrix_x4(r, k_lane + nt * 8 * kStride * 2 + kk * 32);
        mma_16816<kBf16>(s[nt], q_frag[kk], r[0], r[1]);
        mma_16816<kBf16>(s[nt + 1], q_frag[kk], r[2], r[3]);
      }
    }
    __syncthreads();  // every warp is done with k_tile
    if (kb + 1 < key_blocks)
      load_tile<D>(k_tile, k_head + (k0 + kBlock) * kv_stride, kv_stride, seq - k0 - kBlock);
    cp_async_commit();  // possibly empty: keeps the group count uniform

    // Online softmax over this block's scores (exp2 domain). Columns are relative to k0, rows
    // to q0; the diagonal offset decides causality.
    const int diagonal = static_cast<int>(q0 - k0);  // key c is visible to row r iff c <= r + diagonal
    const bool need_mask = segments_row != nullptr || kBlock - 1 > diagonal + warp * 16;
    float block_max_a = -INFINITY, block_max_b = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kBlock / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = nt * 8 + 2 * thread_in_group + e;
        float x_a = s[nt][e] * scale_log2, x_b = s[nt][2 + e] * scale_log2;
        if (need_mask) {
          const int32_t key_segment = segments_row != nullptr ? key_segments[col] : 0;
          if (col > row_a + diagonal || key_segment != segment_a) x_a = -INFINITY;
          if (col > row_b + diagonal || key_segment != segment_b) x_b = -INFINITY;
        }
        s[nt][e] = x_a;
        s[nt][2 + e] = x_b;
        block_max_a = fmaxf(block_max_a, x_a);
        block_max_b = fmaxf(block_max_b, x_b);
      }
    }
    // The four threads of a quad hold one row between them.
    block_max_a = fmaxf(block_max_a, __shfl_xor_sync(0xffffffffu, block_max_a, 1));
    block_max_a = fmaxf(block_max_a, __shfl_xor_sync(0xffffffffu, block_max_a, 2));
    block_max_b = fmaxf(block_max_b, __shfl_xor_sync(0xffffffffu, block_max_b, 1));
    block_max_b = fmaxf(block_max_b, __shfl_xor_sync(0xffffffffu, block_max_b, 2));
    const float new_max_a = fmaxf(max_a, block_max_a), new_max_b = fmaxf(max_b, block_max_b);
    // A row that has seen nothing yet keeps max -inf; subtracting 0 then keeps exp2 at 0
    // instead of exp2(-inf - -inf) = NaN.
    const float base_a = new_max_a == -INFINITY ? 0.0f : new_max_a;
    const float base_b = new_max_b == -INFINITY ? 0.0f : new_max_b;
    const float correction_a = exp2f(max_a - base_a), correction_b = exp2f(max_b - base_b);
    max_a = new_max_a;
    max_b = new_max_b;
    float local_a = 0.0f, local_b = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kBlock / 8; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - base_a);
      s[nt][1] = exp2f(s[nt][1] - base_a);
      s[nt][2] = exp2f(s[nt][2] - base_b);
      s[nt][3] = exp2f(s[nt][3] - base_b);
      local_a += s[nt][0] + s[nt][1];
      local_b += s[nt][2] + s[nt][3];
    }
    // Per-thread partial row sums; the quad's are added once at the end (they share the
    // corrections).
    sum_a = sum_a * correction_a + local_a;
    sum_b = sum_b * correction_b + local_b;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= correction_a;
      o[dt][1] *= correction_a;
      o[dt][2] *= correction_b;
      o[dt][3] *= correction_b;
    }

    cp_async_wait<1>();  // V of this block
    __syncthreads();
#pragma unroll
    for (int kc = 0; kc < kBlock / 16; ++kc) {
      const uint32_t a[4] = {pack2<kBf16>(s[2 * kc][0], s[2 * kc][1]),
                             pack2<kBf16>(s[2 * kc][2], s[2 * kc][3]),
                             pack2<kBf16>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                             pack2<kBf16>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, v_lane + kc * 16 * kStride * 2 + dt * 16);
        mma_16816<kBf16>(o[dt], a, r[0], r[1]);
        mma_16816<kBf16>(o[dt + 1], a, r[2], r[3]);
      }
    }
    __syncthreads();  // every warp is done with v_tile
  }

  sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 1);
  sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 2);
  sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 1);
  sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 2);
  const float inverse_a = sum_a > 0.0f ? 1.0f / sum_a : 0.0f;
  const float inverse_b = sum_b > 0.0f ? 1.0f / sum_b : 0.0f;
  const bool valid_a = q0 + row_a < seq, valid_b = q0 + row_b < seq;
  const int64_t offset_a = ((b * seq + q0 + row_a) * heads + h) * D + 2 * thread_in_group;
  const int64_t offset_b = offset_a + 8 * heads * D;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    if (valid_a) {
      store_float(t.out, t.out_type, offset_a + dt * 8, o[dt][0] * inverse_a);
      store_float(t.out, t.out_type, offset_a + dt * 8 + 1, o[dt][1] * inverse_a);
    }
    if (valid_b) {
      store_float(t.out, t.out_type, offset_b + dt * 8, o[dt][2] * inverse_b);
      store_float(t.out, t.out_type, offset_b + dt * 8 + 1, o[dt][3] * inverse_b);
    }
  }
  if (thread_in_group == 0) {
    float* head_lse = t.lse + (b * heads + h) * seq + q0;
    if (valid_a) head_lse[row_a] = (max_a + log2f(sum_a)) * kLn2;
    if (valid_b) head_lse[row_b] = (max_b + log2f(sum_b)) * kLn2;
  }
}


// Forward v2 (the default; MEMTUNE_FLASH_FWD=v1 selects the kernel above): 128 queries per
// block, 4 warps of 32 rows, i.e. two m16 tiles per warp. Every K fragment (S = Q K^T) and
// every V fragment (O += P V) that a warp loads from shared memory with ldmatrix then feeds two
// mma.sync instead of one: with 16 rows per warp, shared-memory bandwidth, not the tensor cores,
// bounded the v1 kernel. The price is registers: O is 32 x D fp32 per warp (D regs/thread at
// D = 128) and S 32 x keys, so Q is not kept in registers but read from shared memory per key
// block. Warps whose 32 rows see none of a key block (above the diagonal) skip it. Measured, the
// fragment reuse alone gained nothing (v1 ~200 TFLOP/s at the timing shape, v2 single-buffered
// 197-199): the kernel waited on global memory. Double-buffering K and V a whole key block
// ahead gave 215-217.
// With two 4-warp blocks per SM (255 registers each), each scheduler has two warps: the
// instructions around the mma.sync (softmax, rescale, addressing) are issued by the same two
// warps and are not hidden, so they are kept few:
//  - the softmax works on raw scores: the row max is taken before scaling and each probability
//    is one FFMA (score * scale log2 e - max) and one ex2.approx.ftz (the plain exp2f adds a
//    range check and two multiplies for denormal results, which a probability rounded to bf16
//    does not need);
//  - O is rescaled only where a row's running max moved (a warp-wide vote), and the max moves
//    only when a key block's exceeds it by more than a slack of 8 (log2 units): a rescale costs
//    D/2 multiplies per thread, and after the first blocks a row's max rarely jumps that far;
//  - one __syncthreads per key block: the next block's K/V are requested right after it, into
//    the buffer that every warp has finished with by then;
//  - packed-sequence masking is compiled only into the kSegments kernel, causal masking runs only
//    on key blocks that cross a warp's diagonal;
//  - the K/V load addresses are recomputed from one per-thread pointer per block (kept opaque to
//    the compiler), not hoisted as one 64-bit register pair per 16-byte piece.
// Blocks are launched heaviest first over the whole grid (the last query blocks of every head,
// then the next-to-last, ...), so that the short causal blocks fill the tail; O leaves through
// shared memory in 16-byte stores.
// Measured on the H200 (2026-12-03, b8 s2048 h32/8 d128 bf16 causal, TimingPrintFlashForward-
// Variants): 214.5 TFLOP/s before these changes (32 keys); now 313.5 with 64 keys, 300.0 with
// 32; rescaling every block 303.8 (64 keys) / 279.1 (32), slack 0 304.4 / 282.8; the grid
// ordered per head 298.4 / 286.0. At D = 128, 64 keys take 255 registers without spills (the
// kSegments kernel spills 28 bytes: 5 local reloads per key block); before the address change,
// 64 keys spilled 88 bytes.
constexpr int kFwdRows = 128;
constexpr int kFwdTiles = 2;  // m16 tiles per warp

template <int D, int kKeys>
constexpr int forward2_shared_bytes() {
  return (kFwdRows + 4 * kKeys) * (D + 8) * 2 + (2 * kKeys + kFwdRows) * 4;
}

// Run-time choices of forward v2, for A/B timing (FlashVersions); the defaults are the measured
// best.
struct Forward2Options {
  int query_blocks = 0;               // per (head, batch row)
  bool heaviest_first_global = true;  // false: per head, as the grid was before (v2's first form)
  bool rescale_always = false;        // true: rescale O every key block
  float rescale_slack = 0.0f;         // the running max moves when exceeded by more than this
  bool vector_store = true;           // O in q's dtype, 16-byte aligned: 16-byte stores
};

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Hides a value's origin from the compiler, so that what is computed from it inside a loop
// stays inside the loop (instead of being hoisted into registers that live across it).
template <typename T>
__device__ __forceinline__ void opaque(T*& pointer) {
  asm volatile("" : "+l"(pointer));
}

// K and V rows [k_first, k_first + kKeys) into shared memory at k_shared / v_shared, rows at or
// past `valid` zero-filled. k_thread / v_thread: this thread's first 16-byte piece (row
// threadIdx.x / (D / 8) of the head, piece threadIdx.x % (D / 8)); shared_thread: its offset in
// a tile.
template <int D, int kKeys>
__device__ __forceinline__ void load_kv_block(uint32_t k_shared, uint32_t v_shared,
                                              uint32_t shared_thread, const uint16_t* k_thread,
                                              const uint16_t* v_thread, int64_t kv_stride,
                                              int k_first, int valid) {
  constexpr int kChunks = D / 8;
  constexpr int kRowsPerStep = kThreads / kChunks;
  constexpr uint32_t kStepBytes = kRowsPerStep * (D + 8) * 2;
  const int64_t step_stride = kRowsPerStep * kv_stride;
  const uint16_t* k_piece = k_thread + k_first * kv_stride;
  const uint16_t* v_piece = v_thread + k_first * kv_stride;
  opaque(k_piece);
  opaque(v_piece);
  if (valid >= kKeys) {
#pragma unroll
    for (int step = 0; step < kKeys / kRowsPerStep; ++step) {
      cp_async_16(k_shared + shared_thread + step * kStepBytes, k_piece + step * step_stride, true);
      cp_async_16(v_shared + shared_thread + step * kStepBytes, v_piece + step * step_stride, true);
    }
  } else {  // the last block of the sequence: invalid rows read from the first (valid) row
    const int row = static_cast<int>(threadIdx.x) / kChunks;
#pragma unroll
    for (int step = 0; step < kKeys / kRowsPerStep; ++step) {
      const bool ok = row + step * kRowsPerStep < valid;
      cp_async_16(k_shared + shared_thread + step * kStepBytes,
                  ok ? k_piece + step * step_stride : k_piece - row * kv_stride, ok);
      cp_async_16(v_shared + shared_thread + step * kStepBytes,
                  ok ? v_piece + step * step_stride : v_piece - row * kv_stride, ok);
    }
  }
}

// kKeys: keys per block, 64 or 32 (32 fits the 99 KiB of sm_86/89). kSegments: packed sequences
// (p.segments != null).
template <int D, bool kBf16, int kKeys, bool kSegments>
__global__ void __launch_bounds__(kThreads, 2)
    flash_forward_tc2(AttentionParams p, FlashTensors t, Forward2Options options) {
  constexpr int kStride = D + 8;
  constexpr uint32_t kRowBytes = kStride * 2;
  constexpr int kChunks = D / 8;  // 16-byte pieces per row
  extern __shared__ __align__(16) uint16_t shared[];
  // Key segments of two key blocks (double-buffered like K/V), then the block's query segments.
  int32_t* key_segments = reinterpret_cast<int32_t*>(shared + (kFwdRows + 4 * kKeys) * kStride);
  int32_t* query_segments = key_segments + 2 * kKeys;
  const uint32_t q_tile = shared_address(shared);
  // K and V double-buffered: buffer i holds K at k_tile + i * kBufferBytes, V right after it.
  // The next block's K and V are fetched while this block computes, a whole iteration ahead.
  constexpr uint32_t kBufferBytes = 2 * kKeys * kRowBytes;
  const uint32_t k_tile = q_tile + kFwdRows * kRowBytes;
  const uint32_t v_tile = k_tile + kKeys * kRowBytes;

  const int64_t seq = p.seq, heads = p.n_heads, kv_heads = p.n_kv_heads;
  // Block order: heaviest (last) query blocks first, over the whole grid or per head.
  const uint32_t linear = blockIdx.x, query_blocks = static_cast<uint32_t>(options.query_blocks);
  const uint32_t heads_batch = static_cast<uint32_t>(heads * p.batch);
  const uint32_t from_last = options.heaviest_first_global ? linear / heads_batch : linear % query_blocks;
  const uint32_t head_row = options.heaviest_first_global ? linear % heads_batch : linear / query_blocks;
  const int64_t q_block = query_blocks - 1 - from_last;
  const int64_t h = head_row % heads, b = head_row / heads, g = h / (heads / kv_heads);
  const int64_t q0 = q_block * kFwdRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group_id = lane >> 2, thread_in_group = lane & 3;
  const int32_t* segments_row = kSegments ? p.segments + b * seq : nullptr;
  const float scale_log2 = p.scale * kLog2e;

  const uint16_t* q_head = static_cast<const uint16_t*>(t.q) + ((b * seq + q0) * heads + h) * D;
  const int64_t kv_stride = kv_heads * D, q_stride = heads * D;
  const int load_row = static_cast<int>(threadIdx.x) / kChunks, load_piece = static_cast<int>(threadIdx.x) % kChunks;
  const int64_t kv_thread_offset = (b * seq * kv_heads + g) * D + load_row * kv_stride + load_piece * 8;
  const uint16_t* k_thread = static_cast<const uint16_t*>(t.k) + kv_thread_offset;
  const uint16_t* v_thread = static_cast<const uint16_t*>(t.v) + kv_thread_offset;
  const uint32_t shared_thread = static_cast<uint32_t>((load_row * kStride + load_piece * 8) * 2);

  // Q as two 64-row halves; a half wholly past the end is zero-filled from a valid address.
  load_tile<D>(q_tile, q_head, q_stride, seq - q0);
  load_tile<D>(q_tile + kBlock * kRowBytes, seq - q0 > kBlock ? q_head + kBlock * q_stride : q_head,
               q_stride, seq - q0 - kBlock);
  load_kv_block<D, kKeys>(k_tile, v_tile, shared_thread, k_thread, v_thread, kv_stride, 0,
                          static_cast<int>(seq));
  cp_async_commit();
  if constexpr (kSegments) {
    for (int e = threadIdx.x; e < kFwdRows; e += kThreads)
      query_segments[e] = q0 + e < seq ? segments_row[q0 + e] : 0;
    for (int e = threadIdx.x; e < kKeys; e += kThreads)
      key_segments[e] = e < seq ? segments_row[e] : 0;
  }

  const uint32_t q_lane = q_tile + warp * 32 * kRowBytes + rows_a_offset(lane, kStride);
  const uint32_t k_lane = k_tile + rows_b_offset(lane, kStride);
  const uint32_t v_lane = v_tile + trans_offset(lane, kStride);

  float o[kFwdTiles][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < kFwdTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
  // Row state per (m tile, half): rows warp*32 + mt*16 + group_id (+ 8 for the second half).
  // row_max is in the exp2 domain (scaled by scale * log2 e).
  float row_max[kFwdTiles][2], row_sum[kFwdTiles][2];
#pragma unroll
  for (int mt = 0; mt < kFwdTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_max[mt][half] = -INFINITY;
      row_sum[mt][half] = 0.0f;
    }
  const int warp_row0 = warp * 32;  // the warp's first row in the block
  const int64_t last_key = (q0 + kFwdRows - 1 < seq - 1 ? q0 + kFwdRows - 1 : seq - 1);
  // 32-bit key offsets (the dispatch keeps seq below 2^31): fewer live registers.
  const int key_blocks = static_cast<int>(last_key / kKeys + 1);

  #pragma unroll 1  // a run-time loop: unrolling it only multiplies live registers
  for (int kb = 0; kb < key_blocks; ++kb) {
    const int k0 = kb * kKeys;
    const uint32_t buffer = (kb & 1) * kBufferBytes;
    cp_async_wait<0>();  // K and V of this block (and Q, the first time)
    // Everyone's copies have landed, and every warp is done with the other buffer (the last
    // block's) and its key segments.
    __syncthreads();
    if (kb + 1 < key_blocks) {
      load_kv_block<D, kKeys>(k_tile + (kBufferBytes - buffer), v_tile + (kBufferBytes - buffer),
                              shared_thread, k_thread, v_thread, kv_stride, k0 + kKeys,
                              static_cast<int>(seq) - k0 - kKeys);
      cp_async_commit();
      if constexpr (kSegments) {  // plain stores, read after the next iteration's barrier
        int32_t* next_segments = key_segments + ((kb + 1) & 1) * kKeys;
        for (int e = threadIdx.x; e < kKeys; e += kThreads)
          next_segments[e] = k0 + kKeys + e < seq ? segments_row[k0 + kKeys + e] : 0;
      }
    }
    const int32_t* block_segments = key_segments + (kb & 1) * kKeys;

    const int diagonal = static_cast<int>(q0 - k0);  // key c is visible to row r iff c <= r + diagonal
    // Whether any of the warp's rows sees any key of the block: its last row sees key 0.
    if (warp_row0 + 31 + diagonal < 0) continue;

    float s[kFwdTiles][kKeys / 8][4];
#pragma unroll
    for (int mt = 0; mt < kFwdTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt)
        s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[kFwdTiles][4];
#pragma unroll
      for (int mt = 0; mt < kFwdTiles; ++mt) ldmatrix_x4(a[mt], q_lane + mt * 16 * kRowBytes + kk * 32);
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; nt += 2) {
        uint32_t r[4];
        ldmatrix_x4(r, k_lane + buffer + nt * 8 * kRowBytes + kk * 32);
#pragma unroll
        for (int mt = 0; mt < kFwdTiles; ++mt) {
          mma_16816<kBf16>(s[mt][nt], a[mt], r[0], r[1]);
          mma_16816<kBf16>(s[mt][nt + 1], a[mt], r[2], r[3]);
        }
      }
    }

    // Online softmax. Masks only where some key of the block lies past the diagonal for the
    // warp's first row, or where segments are packed.
    const bool need_mask = kSegments || kKeys - 1 > diagonal + warp_row0;
    float correction[kFwdTiles][2];
    bool grew = false;  // whether this thread's rows' max grew (then O needs rescaling)
#pragma unroll
    for (int mt = 0; mt < kFwdTiles; ++mt) {
      const int row_a = warp_row0 + mt * 16 + group_id, row_b = row_a + 8;
      if (need_mask) {
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = nt * 8 + 2 * thread_in_group + e;
            bool hide_a = col > row_a + diagonal, hide_b = col > row_b + diagonal;
            if constexpr (kSegments) {
              const int32_t key_segment = block_segments[col];
              hide_a = hide_a || key_segment != query_segments[row_a];
              hide_b = hide_b || key_segment != query_segments[row_b];
            }
            if (hide_a) s[mt][nt][e] = -INFINITY;
            if (hide_b) s[mt][nt][2 + e] = -INFINITY;
          }
      }
      float block_max_a = -INFINITY, block_max_b = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
        block_max_a = fmaxf(block_max_a, fmaxf(s[mt][nt][0], s[mt][nt][1]));
        block_max_b = fmaxf(block_max_b, fmaxf(s[mt][nt][2], s[mt][nt][3]));
      }
      // The four threads of a quad hold one row between them.
      block_max_a = fmaxf(block_max_a, __shfl_xor_sync(0xffffffffu, block_max_a, 1));
      block_max_a = fmaxf(block_max_a, __shfl_xor_sync(0xffffffffu, block_max_a, 2));
      block_max_b = fmaxf(block_max_b, __shfl_xor_sync(0xffffffffu, block_max_b, 1));
      block_max_b = fmaxf(block_max_b, __shfl_xor_sync(0xffffffffu, block_max_b, 2));
      // Scaling is monotonic, so the max of the scaled scores is the scaled max. The running
      // max moves only when the block's exceeds it by more than the slack (then it moves to the
      // block's): a stale max leaves probabilities up to 2^slack, which fp32 sums and bf16/f16
      // P hold without loss, and O needs no rescale (FA4 skips rescales the same way).
      block_max_a *= scale_log2;
      block_max_b *= scale_log2;
      const bool grew_a = block_max_a > row_max[mt][0] + options.rescale_slack;
      const bool grew_b = block_max_b > row_max[mt][1] + options.rescale_slack;
      const float new_max_a = grew_a ? block_max_a : row_max[mt][0];
      const float new_max_b = grew_b ? block_max_b : row_max[mt][1];
      grew = grew || grew_a || grew_b;
      // A row that has seen nothing yet keeps max -inf; subtracting 0 then keeps exp2 at 0
      // instead of exp2(-inf - -inf) = NaN.
      const float base_a = new_max_a == -INFINITY ? 0.0f : new_max_a;
      const float base_b = new_max_b == -INFINITY ? 0.0f : new_max_b;
      correction[mt][0] = exp2_approx(row_max[mt][0] - base_a);  // exactly 1 if the max held
      correction[mt][1] = exp2_approx(row_max[mt][1] - base_b);
      row_max[mt][0] = new_max_a;
      row_max[mt][1] = new_max_b;
      float local_a = 0.0f, local_b = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
        s[mt][nt][0] = exp2_approx(fmaf(s[mt][nt][0], scale_log2, -base_a));
        s[mt][nt][1] = exp2_approx(fmaf(s[mt][nt][1], scale_log2, -base_a));
        s[mt][nt][2] = exp2_approx(fmaf(s[mt][nt][2], scale_log2, -base_b));
        s[mt][nt][3] = exp2_approx(fmaf(s[mt][nt][3], scale_log2, -base_b));
        local_a += s[mt][nt][0] + s[mt][nt][1];
        local_b += s[mt][nt][2] + s[mt][nt][3];
      }
      // Per-thread partial row sums; the quad's are added once at the end.
      row_sum[mt][0] = row_sum[mt][0] * correction[mt][0] + local_a;
      row_sum[mt][1] = row_sum[mt][1] * correction[mt][1] + local_b;
    }
    if (options.rescale_always || __any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int mt = 0; mt < kFwdTiles; ++mt)
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          o[mt][dt][0] *= correction[mt][0];
          o[mt][dt][1] *= correction[mt][0];
          o[mt][dt][2] *= correction[mt][1];
          o[mt][dt][3] *= correction[mt][1];
        }
    }

#pragma unroll
    for (int kc = 0; kc < kKeys / 16; ++kc) {
      uint32_t a[kFwdTiles][4];
#pragma unroll
      for (int mt = 0; mt < kFwdTiles; ++mt) {
        a[mt][0] = pack2<kBf16>(s[mt][2 * kc][0], s[mt][2 * kc][1]);
        a[mt][1] = pack2<kBf16>(s[mt][2 * kc][2], s[mt][2 * kc][3]);
        a[mt][2] = pack2<kBf16>(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
        a[mt][3] = pack2<kBf16>(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
      }
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, v_lane + buffer + kc * 16 * kRowBytes + dt * 16);
#pragma unroll
        for (int mt = 0; mt < kFwdTiles; ++mt) {
          mma_16816<kBf16>(o[mt][dt], a[mt], r[0], r[1]);
          mma_16816<kBf16>(o[mt][dt + 1], a[mt], r[2], r[3]);
        }
      }
    }
  }

  // Epilogue. Only this warp ever read its 32 Q rows in shared memory, so it may overwrite them
  // with its O rows (no block barrier) and store them to global memory in 16-byte pieces.
#pragma unroll
  for (int mt = 0; mt < kFwdTiles; ++mt) {
    const int row_a = warp_row0 + mt * 16 + group_id, row_b = row_a + 8;
    float sum_a = row_sum[mt][0], sum_b = row_sum[mt][1];
    sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 1);
    sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 2);
    sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 1);
    sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 2);
    const float inverse_a = sum_a > 0.0f ? 1.0f / sum_a : 0.0f;
    const float inverse_b = sum_b > 0.0f ? 1.0f / sum_b : 0.0f;
    const bool valid_a = q0 + row_a < seq, valid_b = q0 + row_b < seq;
    if (options.vector_store) {
      uint16_t* row_a_shared = shared + row_a * kStride + 2 * thread_in_group;
      uint16_t* row_b_shared = row_a_shared + 8 * kStride;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const uint32_t packed_a = pack2<kBf16>(o[mt][dt][0] * inverse_a, o[mt][dt][1] * inverse_a);
        const uint32_t packed_b = pack2<kBf16>(o[mt][dt][2] * inverse_b, o[mt][dt][3] * inverse_b);
        *reinterpret_cast<uint32_t*>(row_a_shared + dt * 8) = packed_a;
        *reinterpret_cast<uint32_t*>(row_b_shared + dt * 8) = packed_b;
      }
    } else {
      const int64_t offset_a = ((b * seq + q0 + row_a) * heads + h) * D + 2 * thread_in_group;
      const int64_t offset_b = offset_a + 8 * heads * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        if (valid_a) {
          store_float(t.out, t.out_type, offset_a + dt * 8, o[mt][dt][0] * inverse_a);
          store_float(t.out, t.out_type, offset_a + dt * 8 + 1, o[mt][dt][1] * inverse_a);
        }
        if (valid_b) {
          store_float(t.out, t.out_type, offset_b + dt * 8, o[mt][dt][2] * inverse_b);
          store_float(t.out, t.out_type, offset_b + dt * 8 + 1, o[mt][dt][3] * inverse_b);
        }
      }
    }
    if (thread_in_group == 0) {
      float* head_lse = t.lse + (b * heads + h) * seq + q0;
      if (valid_a) head_lse[row_a] = (row_max[mt][0] + log2f(sum_a)) * kLn2;
      if (valid_b) head_lse[row_b] = (row_max[mt][1] + log2f(sum_b)) * kLn2;
    }
  }
  if (options.vector_store) {
    __syncwarp();
    uint16_t* out_rows = static_cast<uint16_t*>(t.out) + ((b * seq + q0 + warp_row0) * heads + h) * D;
#pragma unroll
    for (int e = lane; e < 32 * kChunks; e += 32) {
      const int r = e / kChunks, piece = e % kChunks;
      if (q0 + warp_row0 + r < seq) {
        *reinterpret_cast<uint4*>(out_rows + r * q_stride + piece * 8) =
            *reinterpret_cast<const uint4*>(shared + (warp_row0 + r) * kStride + piece * 8);
      }
    }
  }
}
template <int D>
constexpr int backward_shared_bytes() {
  // K, V, Q, dO tiles; dS^T [64 keys][64 + 8 queries]; lse * log2 e, D and segments of the
  // query block.
  return 4 * kBlock * (D + 8) * 2 + kBlock * (kBlock + 8) * 2 + 3 * kBlock * 4;
}

template <int D, bool kBf16>
__global__ void __launch_bounds__(kThreads)
    flash_backward_tc(AttentionParams p, FlashTensors t) {
  constexpr int kStride = D + 8;
  constexpr int kDsStride = kBlock + 8;
  constexpr uint32_t kTileBytes = kBlock * kStride * 2;
  extern __shared__ __align__(16) uint16_t shared[];
  uint16_t* ds_pointer = shared + 4 * kBlock * kStride;  // dS^T: [key][query]
  float* lse_tile = reinterpret_cast<float*>(ds_pointer + kBlock * kDsStride);
  float* delta_tile = lse_tile + kBlock;
  int32_t* query_segments = reinterpret_cast<int32_t*>(delta_tile + kBlock);
  const uint32_t k_tile = shared_address(shared);
  const uint32_t v_tile = k_tile + kTileBytes;
  const uint32_t q_tile = v_tile + kTileBytes;
  const uint32_t do_tile = q_tile + kTileBytes;
  const uint32_t ds_tile = do_tile + kTileBytes;

  const int64_t seq = p.seq, heads = p.n_heads, kv_heads = p.n_kv_heads;
  const int64_t group = heads / kv_heads;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kBlock;  // the longest columns first
  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group_id = lane >> 2, thread_in_group = lane & 3;
  const int32_t* segments_row = p.segments == nullptr ? nullptr : p.segments + b * seq;
  const float scale_log2 = p.scale * kLog2e;
  const int64_t kv_stride = kv_heads * D, q_stride = heads * D;

  load_tile<D>(k_tile, static_cast<const uint16_t*>(t.k) + ((b * seq + k0) * kv_heads + g) * D,
               kv_stride, seq - k0);
  load_tile<D>(v_tile, static_cast<const uint16_t*>(t.v) + ((b * seq + k0) * kv_heads + g) * D,
               kv_stride, seq - k0);
  cp_async_commit();

  // This thread's two key rows (accumulator rows g and g + 8 of its warp's 16), in the block.
  const int key_a = warp * 16 + group_id, key_b = key_a + 8;
  const int32_t segment_a =
      segments_row != nullptr && k0 + key_a < seq ? segments_row[k0 + key_a] : 0;
  const int32_t segment_b =
      segments_row != nullptr && k0 + key_b < seq ? segments_row[k0 + key_b] : 0;
  // Per-lane ldmatrix addresses.
  const uint32_t k_rows = k_tile + warp * 16 * kStride * 2 + rows_a_offset(lane, kStride);
  const uint32_t v_rows = v_tile + warp * 16 * kStride * 2 + rows_a_offset(lane, kStride);
  const uint32_t q_cols = q_tile + rows_b_offset(lane, kStride);
  const uint32_t do_cols = do_tile + rows_b_offset(lane, kStride);
  const uint32_t q_trans = q_tile + trans_offset(lane, kStride);
  const uint32_t do_trans = do_tile + trans_offset(lane, kStride);
  const uint32_t k_trans = k_tile + trans_offset(lane, kStride);
  const uint32_t ds_rows = ds_tile + warp * 16 * kDsStride * 2 + rows_a_offset(lane, kDsStride);
  const uint32_t ds_trans = ds_tile + warp * 16 * 2 + trans_a_offset(lane, kDsStride);

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;

  #pragma unroll 1  // a run-time loop: unrolling it only multiplies live registers
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    const uint16_t* q_head = static_cast<const uint16_t*>(t.q) + (b * seq * heads + h) * D;
    const uint16_t* do_head = static_cast<const uint16_t*>(t.d_out) + (b * seq * heads + h) * D;
    const int64_t stats = (b * heads + h) * seq;
    // Causal: the first query block that sees key k0 is the one holding position k0.
    #pragma unroll 1  // a run-time loop: unrolling it only multiplies live registers
    for (int64_t q0 = k0; q0 < seq; q0 += kBlock) {
      load_tile<D>(q_tile, q_head + q0 * q_stride, q_stride, seq - q0);
      load_tile<D>(do_tile, do_head + q0 * q_stride, q_stride, seq - q0);
      cp_async_commit();
      for (int e = threadIdx.x; e < kBlock; e += kThreads) {
        const bool valid = q0 + e < seq;
        // Past the end: lse = +inf makes every P of that query 0.
        lse_tile[e] = valid ? t.lse[stats + q0 + e] * kLog2e : INFINITY;
        delta_tile[e] = valid ? t.delta[stats + q0 + e] : 0.0f;
        if (segments_row != nullptr) query_segments[e] = valid ? segments_row[q0 + e] : 0;
      }
      cp_async_wait<0>();
      __syncthreads();

      // S^T = K Q^T for the warp's 16 keys x 64 queries.
      float s[kBlock / 8][4];
#pragma unroll
      for (int nt = 0; nt < kBlock / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, k_rows + kk * 32);
#pragma unroll
        for (int nt = 0; nt < kBlock / 8; nt += 2) {
          uint32_t r[4];
          ldmatrix_x4(r, q_cols + nt * 8 * kStride * 2 + kk * 32);
          mma_16816<kBf16>(s[nt], a, r[0], r[1]);
          mma_16816<kBf16>(s[nt + 1], a, r[2], r[3]);
        }
      }
      // P^T, masked. Query column c (relative to q0) sees key row r (relative to k0) iff
      // r <= c + diagonal.
      const int diagonal = static_cast<int>(q0 - k0);
      const bool need_mask = segments_row != nullptr || diagonal < kBlock;
#pragma unroll
      for (int nt = 0; nt < kBlock / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = nt * 8 + 2 * thread_in_group + e;
          float p_a = exp2f(s[nt][e] * scale_log2 - lse_tile[col]);
          float p_b = exp2f(s[nt][2 + e] * scale_log2 - lse_tile[col]);
          if (need_mask) {
            const int32_t query_segment = segments_row != nullptr ? query_segments[col] : 0;
            if (key_a > col + diagonal || query_segment != segment_a) p_a = 0.0f;
            if (key_b > col + diagonal || query_segment != segment_b) p_b = 0.0f;
          }
          s[nt][e] = p_a;
          s[nt][2 + e] = p_b;
        }
      }
      // dV += P^T dO.
#pragma unroll
      for (int kc = 0; kc < kBlock / 16; ++kc) {
        const uint32_t a[4] = {pack2<kBf16>(s[2 * kc][0], s[2 * kc][1]),
                               pack2<kBf16>(s[2 * kc][2], s[2 * kc][3]),
                               pack2<kBf16>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                               pack2<kBf16>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
        for (int dt = 0; dt < D / 8; dt += 2) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, do_trans + kc * 16 * kStride * 2 + dt * 16);
          mma_16816<kBf16>(dv[dt], a, r[0], r[1]);
          mma_16816<kBf16>(dv[dt + 1], a, r[2], r[3]);
        }
      }
      // dP^T = V dO^T, then dS^T = P^T (dP^T - D) * scale into shared memory (in the A/C
      // fragment layout's element positions: [key][query]).
      {
        float dp[kBlock / 8][4];
#pragma unroll
        for (int nt = 0; nt < kBlock / 8; ++nt) dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t a[4];
          ldmatrix_x4(a, v_rows + kk * 32);
#pragma unroll
          for (int nt = 0; nt < kBlock / 8; nt += 2) {
            uint32_t r[4];
            ldmatrix_x4(r, do_cols + nt * 8 * kStride * 2 + kk * 32);
            mma_16816<kBf16>(dp[nt], a, r[0], r[1]);
            mma_16816<kBf16>(dp[nt + 1], a, r[2], r[3]);
          }
        }
#pragma unroll
        for (int nt = 0; nt < kBlock / 8; ++nt) {
          const int col = nt * 8 + 2 * thread_in_group;
          const float delta0 = delta_tile[col], delta1 = delta_tile[col + 1];
          const uint32_t top = pack2<kBf16>(s[nt][0] * (dp[nt][0] - delta0) * p.scale,
                                            s[nt][1] * (dp[nt][1] - delta1) * p.scale);
          const uint32_t bottom = pack2<kBf16>(s[nt][2] * (dp[nt][2] - delta0) * p.scale,
                                               s[nt][3] * (dp[nt][3] - delta1) * p.scale);
          *reinterpret_cast<uint32_t*>(ds_pointer + key_a * kDsStride + col) = top;
          *reinterpret_cast<uint32_t*>(ds_pointer + key_b * kDsStride + col) = bottom;
        }
      }
      __syncthreads();  // dS^T of all four warps is in shared memory

      // dK += dS^T Q (the warp's own key rows of dS^T).
#pragma unroll
      for (int kc = 0; kc < kBlock / 16; ++kc) {
        uint32_t a[4];
        ldmatrix_x4(a, ds_rows + kc * 32);
#pragma unroll
        for (int dt = 0; dt < D / 8; dt += 2) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, q_trans + kc * 16 * kStride * 2 + dt * 16);
          mma_16816<kBf16>(dk[dt], a, r[0], r[1]);
          mma_16816<kBf16>(dk[dt + 1], a, r[2], r[3]);
        }
      }

      // dQ += dS K for the warp's 16 queries, 32 columns of d at a time.
      const int query_a = warp * 16 + group_id, query_b = query_a + 8;
      float* dq_a = t.dq_accum + ((b * seq + q0 + query_a) * heads + h) * D + 2 * thread_in_group;
      float* dq_b = dq_a + 8 * q_stride;
      const bool valid_a = q0 + query_a < seq, valid_b = q0 + query_b < seq;
#pragma unroll
      for (int d0 = 0; d0 < D; d0 += 32) {
        float acc[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < kBlock / 16; ++kc) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, ds_trans + kc * 16 * kDsStride * 2);
#pragma unroll
          for (int nt = 0; nt < 4; nt += 2) {
            uint32_t r[4];
            ldmatrix_x4_trans(r, k_trans + kc * 16 * kStride * 2 + (d0 + nt * 8) * 2);
            mma_16816<kBf16>(acc[nt], a, r[0], r[1]);
            mma_16816<kBf16>(acc[nt + 1], a, r[2], r[3]);
          }
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if (valid_a) {
            atomicAdd(dq_a + d0 + nt * 8, acc[nt][0]);
            atomicAdd(dq_a + d0 + nt * 8 + 1, acc[nt][1]);
          }
          if (valid_b) {
            atomicAdd(dq_b + d0 + nt * 8, acc[nt][2]);
            atomicAdd(dq_b + d0 + nt * 8 + 1, acc[nt][3]);
          }
        }
      }
      __syncthreads();  // q/dO/dS tiles are free for the next query block
    }
  }

  const bool valid_a = k0 + key_a < seq, valid_b = k0 + key_b < seq;
  const int64_t offset_a = ((b * seq + k0 + key_a) * kv_heads + g) * D + 2 * thread_in_group;
  const int64_t offset_b = offset_a + 8 * kv_stride;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    if (valid_a) {
      store_float(t.dk, t.dk_type, offset_a + dt * 8, dk[dt][0]);
      store_float(t.dk, t.dk_type, offset_a + dt * 8 + 1, dk[dt][1]);
      store_float(t.dv, t.dv_type, offset_a + dt * 8, dv[dt][0]);
      store_float(t.dv, t.dv_type, offset_a + dt * 8 + 1, dv[dt][1]);
    }
    if (valid_b) {
      store_float(t.dk, t.dk_type, offset_b + dt * 8, dk[dt][2]);
      store_float(t.dk, t.dk_type, offset_b + dt * 8 + 1, dk[dt][3]);
      store_float(t.dv, t.dv_type, offset_b + dt * 8, dv[dt][2]);
      store_float(t.dv, t.dv_type, offset_b + dt * 8 + 1, dv[dt][3]);
    }
  }
}

// ================================ backward v2 ===================================================
//
// The maths of flash_backward_tc, re-tiled for reuse and overlap (FA2 paper, arXiv 2307.08691,
// §3.1-3.2; ideas only):
//  - kKeys = 128 keys per block with 8 warps of 16 key rows: each Q and dO tile that comes in
//    serves twice as many keys, which halves the Q/dO traffic and the dQ atomics per FLOP.
//  - kStages = 2: the next (head, query block)'s Q, dO, lse, D and segments come in by cp.async
//    into the other stage while this one is computed.
//  - dS^T stays in registers as the A operand of dK += dS^T Q (the C fragments of a warp's 16
//    key rows are its A fragments, as P's are for dV), so shared memory holds dS^T only for dQ,
//    whose contraction runs over all the block's keys. Two barriers per query block.
//  - Warps whose 16 keys all come after the query block's last query skip their work, and dQ's
//    contraction stops at the last key the block can see.
//  - dQ goes into the fp32 accumulator by red.global.add.v2.f32 (two adjacent columns at once)
//    on sm_90, by scalar reductions elsewhere.
//  - The grid is one-dimensional with the key block slowest: every longest block (key block 0
//    of each (batch, kv head)) starts first, and the short ones fill the tail.
// Devices with 99 KB of shared memory per block (sm_86/89) run kKeys = 64 with one stage at
// head_dim 128 (the two-stage 128-key tiles take 155 KB there); head_dim 64 fits in 92 KB.

constexpr int kQueryBlock = 64;  // queries per iteration of the backward v2 loop

template <int D, int kKeys, int kStages>
struct BackwardV2 {
  static constexpr int kWarps = kKeys / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = D + 8;
  static constexpr int kDsStride = kQueryBlock + 8;
  static constexpr uint32_t kKeyTileBytes = kKeys * kStride * 2;
  static constexpr uint32_t kQueryTileBytes = kQueryBlock * kStride * 2;
  // One stage: Q, dO, then the lse, D and segment id of its 64 queries (4 bytes each).
  static constexpr uint32_t kStageBytes = 2 * kQueryTileBytes + 3 * kQueryBlock * 4;
  static constexpr uint32_t kDsBytes = kKeys * kDsStride * 2;  // dS^T: [key][query]
  static constexpr int kSharedBytes =
      static_cast<int>(2 * kKeyTileBytes + kStages * kStageBytes + kDsBytes);
  // dQ = dS K: 4 warps of 16 queries down the query block, kWarps / 4 across head_dim, in chunks
  // of at most 64 columns (32 accumulators) next to the dK/dV accumulators.
  static constexpr int kDqCols = D / (kWarps / 4);
  static constexpr int kDqChunk = kDqCols < 64 ? kDqCols : 64;
  // dP^T = V dO^T is made in kDpParts column slices: with 4 at head_dim 128 x 128 keys, ptxas
  // fits the kernel in 255 registers without spilling (1 and 2 spill 12 bytes there), for 24
  // more ldmatrix of V per warp and query block (+13%). Elsewhere one slice spills nothing.
  static constexpr int kDpParts = D == 128 && kKeys == 128 ? 4 : 1;
  static_assert(kWarps % 4 == 0 && kDqCols % 16 == 0, "tile shape");
};

// `kRows` rows of D elements into shared memory (row stride D + 8) by `kThreadCount` threads;
// rows at or past `valid_rows` are zero-filled. `head` points at row 0.
template <int D, int kRows, int kThreadCount>
__device__ __forceinline__ void load_rows(uint32_t tile, const uint16_t* head, int64_t row_stride,
                                          int64_t valid_rows) {
  constexpr int kChunks = D / 8;  // 16-byte pieces per row
  static_assert(kRows * kChunks % kThreadCount == 0, "whole steps");
#pragma unroll
  for (int step = 0; step < kRows * kChunks / kThreadCount; ++step) {
    const int e = step * kThreadCount + static_cast<int>(threadIdx.x);
    const int r = e / kChunks, c = e % kChunks;
    const bool valid = r < valid_rows;
    cp_async_16(tile + static_cast<uint32_t>((r * (D + 8) + c * 8) * 2),
                valid ? head + r * row_stride + c * 8 : head, valid);
  }
}

// 4 bytes global -> shared, asynchronously (cp.async takes 4 only with .ca); valid == false
// writes zero.
__device__ __forceinline__ void cp_async_4(uint32_t shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared), "l"(global),
               "r"(valid ? 4 : 0));
}

// A 32-bit store through the shared window: one register per address instead of a 64-bit
// generic pointer. The memory clobber keeps it ordered with the barriers and the ldmatrix reads.
__device__ __forceinline__ void store_shared_b32(uint32_t address, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(value) : "memory");
}

// address[0] += a, address[1] += b in global memory, without a return value. `paired` needs
// 8-byte alignment; the vector form exists from sm_90 (PTX ISA 8.1, red: .v2.f32).
__device__ __forceinline__ void reduce_add2(float* address, float a, float b, bool paired) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (paired) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(a), "f"(b)
                 : "memory");
    return;
  }
#endif
  (void)paired;
  atomicAdd(address, a);
  atomicAdd(address + 1, b);
}

template <int D, bool kBf16, int kKeys, int kStages>
__global__ void __launch_bounds__(BackwardV2<D, kKeys, kStages>::kThreads)
    flash_backward_tc2(AttentionParams p, FlashTensors t, bool paired_red) {
  using Config = BackwardV2<D, kKeys, kStages>;
  constexpr int kStride = Config::kStride;
  constexpr int kDsStride = Config::kDsStride;
  constexpr int kThreadCount = Config::kThreads;
  constexpr uint32_t kQueryTileBytes = Config::kQueryTileBytes;
  constexpr uint32_t kStageBytes = Config::kStageBytes;
  extern __shared__ __align__(16) uint16_t shared[];
  const uint32_t k_tile = shared_address(shared);
  const uint32_t v_tile = k_tile + Config::kKeyTileBytes;
  const uint32_t stage_tiles = v_tile + Config::kKeyTileBytes;
  const uint32_t ds_tile = stage_tiles + kStages * kStageBytes;
  const unsigned char* stage_bytes =
      reinterpret_cast<const unsigned char*>(shared) + 2 * Config::kKeyTileBytes;

  const int64_t seq = p.seq, heads = p.n_heads, kv_heads = p.n_kv_heads;
  const int64_t group = heads / kv_heads;
  // 32-bit block coordinates (the launch checks that they fit): fewer live registers than
  // 64-bit ones across the main loop, where every register counts.
  const int linear = static_cast<int>(blockIdx.x);
  const int kv_heads32 = static_cast<int>(kv_heads), batch32 = static_cast<int>(p.batch);
  const int g = linear % kv_heads32, b = linear / kv_heads32 % batch32;
  const int k0 = linear / (kv_heads32 * batch32) * kKeys;  // key block slowest: longest first
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int group_id = lane >> 2, thread_in_group = lane & 3;
  const int32_t* segments_row = p.segments == nullptr ? nullptr : p.segments + b * seq;
  const float scale_log2 = p.scale * kLog2e;
  const int64_t kv_stride = kv_heads * D, q_stride = heads * D;

  load_rows<D, kKeys, kThreadCount>(
      k_tile, static_cast<const uint16_t*>(t.k) + ((b * seq + k0) * kv_heads + g) * D, kv_stride,
      seq - k0);
  load_rows<D, kKeys, kThreadCount>(
      v_tile, static_cast<const uint16_t*>(t.v) + ((b * seq + k0) * kv_heads + g) * D, kv_stride,
      seq - k0);

  // Work items: (query head of the group, query block from the one holding k0 on), query
  // blocks fastest.
  const int q_blocks = static_cast<int>((seq - k0 + kQueryBlock - 1) / kQueryBlock);
  const int items = static_cast<int>(group) * q_blocks;
  auto issue = [&](int item, int stage) {
    const int64_t h = g * group + item / q_blocks;
    const int64_t q0 = k0 + item % q_blocks * kQueryBlock;
    const uint32_t q_tile = stage_tiles + stage * kStageBytes;
    const int64_t q_offset = ((b * seq + q0) * heads + h) * D;
    load_rows<D, kQueryBlock, kThreadCount>(
        q_tile, static_cast<const uint16_t*>(t.q) + q_offset, q_stride, seq - q0);
    load_rows<D, kQueryBlock, kThreadCount>(
        q_tile + kQueryTileBytes, static_cast<const uint16_t*>(t.d_out) + q_offset, q_stride,
        seq - q0);
    const uint32_t stats = q_tile + 2 * kQueryTileBytes;
    const int64_t row = (b * heads + h) * seq + q0;
    // Threads 0-63 bring lse, 64-127 D, 128-191 the segment ids (warp-uniform choices).
    for (int e = static_cast<int>(threadIdx.x); e < 3 * kQueryBlock; e += kThreadCount) {
      const int which = e / kQueryBlock, r = e % kQueryBlock;
      if (which == 2 && segments_row == nullptr) continue;
      const bool valid = q0 + r < seq;
      const int64_t index = valid ? r : 0;
      const void* source = which == 0   ? static_cast<const void*>(t.lse + row + index)
                           : which == 1 ? static_cast<const void*>(t.delta + row + index)
                                        : static_cast<const void*>(segments_row + q0 + index);
      cp_async_4(stats + static_cast<uint32_t>(e) * 4, source, valid);
    }
  };
  if constexpr (kStages == 2) issue(0, 0);
  cp_async_commit();  // K and V (and the first stage)

  // This thread's two key rows (accumulator rows g and g + 8 of its warp's 16), in the block.
  const int key_a = warp * 16 + group_id, key_b = key_a + 8;
  const int32_t segment_a =
      segments_row != nullptr && k0 + key_a < seq ? segments_row[k0 + key_a] : 0;
  const int32_t segment_b =
      segments_row != nullptr && k0 + key_b < seq ? segments_row[k0 + key_b] : 0;
  const uint32_t k_rows = k_tile + warp * 16 * kStride * 2 + rows_a_offset(lane, kStride);
  const uint32_t v_rows = v_tile + warp * 16 * kStride * 2 + rows_a_offset(lane, kStride);
  const uint32_t k_trans = k_tile + trans_offset(lane, kStride);
  const uint32_t lane_cols = rows_b_offset(lane, kStride), lane_trans = trans_offset(lane, kStride);
  // dQ's warp tile: queries [16 dq_q, +16), columns [kDqCols dq_d, +kDqCols).
  const int dq_q = warp & 3, dq_d = warp >> 2;
  const uint32_t ds_trans = ds_tile + dq_q * 16 * 2 + trans_a_offset(lane, kDsStride);
  const uint32_t k_trans_dq = k_trans + dq_d * Config::kDqCols * 2;

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;

  #pragma unroll 1  // a run-time loop: unrolling it only multiplies live registers
  for (int item = 0; item < items; ++item) {
    int stage = 0;
    if constexpr (kStages == 2) {
      // The other stage was last read before the previous item's middle barrier, which every
      // warp has passed: it can be refilled now.
      stage = static_cast<int>(item & 1);
      if (item + 1 < items) issue(item + 1, stage ^ 1);
      cp_async_commit();  // possibly empty: keeps the group count uniform
      cp_async_wait<1>();  // this item's stage (and K, V)
    } else {
      issue(item, 0);
      cp_async_commit();
      cp_async_wait<0>();
    }
    // Makes the stage visible to all warps, and frees dS^T: every warp is done with the
    // previous item's dQ.
    __syncthreads();

    const int64_t h = g * group + item / q_blocks;
    const int64_t q0 = k0 + item % q_blocks * kQueryBlock;
    const int diagonal = static_cast<int>(q0 - k0);  // key r sees query c iff r <= c + diagonal
    const uint32_t q_tile = stage_tiles + stage * kStageBytes;
    const uint32_t do_tile = q_tile + kQueryTileBytes;
    // lse, D and segments, 64 words each (plain loads: the compiler schedules them freely).
    const float* lse_tile =
        reinterpret_cast<const float*>(stage_bytes + stage * kStageBytes + 2 * kQueryTileBytes);
    const float* delta_tile = lse_tile + kQueryBlock;
    const int32_t* query_segments = reinterpret_cast<const int32_t*>(delta_tile + kQueryBlock);

    if (warp * 16 < diagonal + kQueryBlock) {  // the block's last query sees the warp's first key
      // S^T = K Q^T for the warp's 16 keys x 64 queries.
      float s[kQueryBlock / 8][4];
#pragma unroll
      for (int nt = 0; nt < kQueryBlock / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, k_rows + kk * 32);
#pragma unroll
        for (int nt = 0; nt < kQueryBlock / 8; nt += 2) {
          uint32_t r[4];
          ldmatrix_x4(r, q_tile + lane_cols + nt * 8 * kStride * 2 + kk * 32);
          mma_16816<kBf16>(s[nt], a, r[0], r[1]);
          mma_16816<kBf16>(s[nt + 1], a, r[2], r[3]);
        }
      }
      // P^T, masked: causality, segments, and queries past the end (their zero-filled lse would
      // give P = 1). Masked scores become -inf before the exponential, so that only the light
      // compare-and-select pass exists in two versions, not the exponentials (the masked copy
      // of those cost spills).
      const int valid_queries = seq - q0 < kQueryBlock ? static_cast<int>(seq - q0) : kQueryBlock;
      if (segments_row != nullptr || warp * 16 + 15 > diagonal || valid_queries < kQueryBlock) {
        // Query col sees key_a iff key_a - diagonal <= col < valid_queries (and same segment).
        const int first_a = key_a - diagonal, first_b = key_b - diagonal;
#pragma unroll
        for (int nt = 0; nt < kQueryBlock / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = nt * 8 + 2 * thread_in_group + e;
            bool see_a = col >= first_a && col < valid_queries;
            bool see_b = col >= first_b && col < valid_queries;
            if (segments_row != nullptr) {
              const int32_t query_segment = query_segments[col];
              see_a = see_a && query_segment == segment_a;
              see_b = see_b && query_segment == segment_b;
            }
            if (!see_a) s[nt][e] = -INFINITY;
            if (!see_b) s[nt][2 + e] = -INFINITY;
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < kQueryBlock / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = nt * 8 + 2 * thread_in_group + e;
          const float lse_log2 = lse_tile[col] * kLog2e;
          // One FFMA and one ex2.approx.ftz (as in the forward); exp2(-inf) = 0.
          s[nt][e] = exp2_approx(s[nt][e] * scale_log2 - lse_log2);
          s[nt][2 + e] = exp2_approx(s[nt][2 + e] * scale_log2 - lse_log2);
        }
      }
      // dV += P^T dO.
#pragma unroll
      for (int kc = 0; kc < kQueryBlock / 16; ++kc) {
        const uint32_t a[4] = {pack2<kBf16>(s[2 * kc][0], s[2 * kc][1]),
                               pack2<kBf16>(s[2 * kc][2], s[2 * kc][3]),
                               pack2<kBf16>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                               pack2<kBf16>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
        for (int dt = 0; dt < D / 8; dt += 2) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, do_tile + lane_trans + kc * 16 * kStride * 2 + dt * 16);
          mma_16816<kBf16>(dv[dt], a, r[0], r[1]);
          mma_16816<kBf16>(dv[dt + 1], a, r[2], r[3]);
        }
      }
      // dP^T = V dO^T (in Config::kDpParts slices of queries), then dS^T = P^T (dP^T - D) *
      // scale: packed (rows key_a | key_b) for dK, and into shared memory for dQ. The stores
      // are conflict-free: row stride 36 words puts the 8 rows x 4 threads of a warp on 32
      // different banks.
      uint32_t ds_top[kQueryBlock / 8], ds_bottom[kQueryBlock / 8];
#pragma unroll
      for (int half = 0; half < Config::kDpParts; ++half) {
        constexpr int kHalf = kQueryBlock / 8 / Config::kDpParts;  // n-tiles per slice
        float dp[kHalf][4];
#pragma unroll
        for (int nt = 0; nt < kHalf; ++nt) dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t a[4];
          ldmatrix_x4(a, v_rows + kk * 32);
#pragma unroll
          for (int nt = 0; nt < kHalf; nt += 2) {
            uint32_t r[4];
            ldmatrix_x4(r, do_tile + lane_cols + (half * kHalf + nt) * 8 * kStride * 2 + kk * 32);
            mma_16816<kBf16>(dp[nt], a, r[0], r[1]);
            mma_16816<kBf16>(dp[nt + 1], a, r[2], r[3]);
          }
        }
#pragma unroll
        for (int n = 0; n < kHalf; ++n) {
          const int nt = half * kHalf + n;
          const int col = nt * 8 + 2 * thread_in_group;
          const float delta0 = delta_tile[col], delta1 = delta_tile[col + 1];
          ds_top[nt] = pack2<kBf16>(s[nt][0] * (dp[n][0] - delta0) * p.scale,
                                    s[nt][1] * (dp[n][1] - delta1) * p.scale);
          ds_bottom[nt] = pack2<kBf16>(s[nt][2] * (dp[n][2] - delta0) * p.scale,
                                       s[nt][3] * (dp[n][3] - delta1) * p.scale);
          store_shared_b32(ds_tile + (key_a * kDsStride + col) * 2, ds_top[nt]);
          store_shared_b32(ds_tile + (key_b * kDsStride + col) * 2, ds_bottom[nt]);
        }
      }
      // dK += dS^T Q, the A operand straight from the registers.
#pragma unroll
      for (int kc = 0; kc < kQueryBlock / 16; ++kc) {
        const uint32_t a[4] = {ds_top[2 * kc], ds_bottom[2 * kc], ds_top[2 * kc + 1],
                               ds_bottom[2 * kc + 1]};
#pragma unroll
        for (int dt = 0; dt < D / 8; dt += 2) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, q_tile + lane_trans + kc * 16 * kStride * 2 + dt * 16);
          mma_16816<kBf16>(dk[dt], a, r[0], r[1]);
          mma_16816<kBf16>(dk[dt + 1], a, r[2], r[3]);
        }
      }
    }
    // dS^T of every warp is in shared memory; after this barrier nothing reads this stage.
    __syncthreads();

    // dQ += dS K for the warp's 16 queries x kDqCols columns, over the keys the block can see
    // (rows of dS^T from skipped warps are never read).
    const int key_chunks = (diagonal + kQueryBlock < kKeys ? diagonal + kQueryBlock : kKeys) / 16;
    const int query_a = dq_q * 16 + group_id, query_b = query_a + 8;
    const bool valid_a = q0 + query_a < seq, valid_b = q0 + query_b < seq;
    float* dq_a = t.dq_accum + ((b * seq + q0 + query_a) * heads + h) * D + dq_d * Config::kDqCols +
                  2 * thread_in_group;
    float* dq_b = dq_a + 8 * q_stride;
    // Chunks one after the other (not unrolled): unrolled, ptxas interleaves them and spills
    // on sm_8x at 64 keys x head_dim 128.
#pragma unroll 1
    for (int d0 = 0; d0 < Config::kDqCols; d0 += Config::kDqChunk) {
      float acc[Config::kDqChunk / 8][4];
#pragma unroll
      for (int nt = 0; nt < Config::kDqChunk / 8; ++nt)
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
      for (int kc = 0; kc < kKeys / 16; ++kc) {
        if (kc < key_chunks) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, ds_trans + kc * 16 * kDsStride * 2);
#pragma unroll
          for (int nt = 0; nt < Config::kDqChunk / 8; nt += 2) {
            uint32_t r[4];
            ldmatrix_x4_trans(r, k_trans_dq + kc * 16 * kStride * 2 + (d0 + nt * 8) * 2);
            mma_16816<kBf16>(acc[nt], a, r[0], r[1]);
            mma_16816<kBf16>(acc[nt + 1], a, r[2], r[3]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < Config::kDqChunk / 8; ++nt) {
        if (valid_a) reduce_add2(dq_a + d0 + nt * 8, acc[nt][0], acc[nt][1], paired_red);
        if (valid_b) reduce_add2(dq_b + d0 + nt * 8, acc[nt][2], acc[nt][3], paired_red);
      }
    }
  }

  const bool valid_a = k0 + key_a < seq, valid_b = k0 + key_b < seq;
  const int64_t offset_a = ((b * seq + k0 + key_a) * kv_heads + g) * D + 2 * thread_in_group;
  const int64_t offset_b = offset_a + 8 * kv_stride;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    if (valid_a) {
      store_float(t.dk, t.dk_type, offset_a + dt * 8, dk[dt][0]);
      store_float(t.dk, t.dk_type, offset_a + dt * 8 + 1, dk[dt][1]);
      store_float(t.dv, t.dv_type, offset_a + dt * 8, dv[dt][0]);
      store_float(t.dv, t.dv_type, offset_a + dt * 8 + 1, dv[dt][1]);
    }
    if (valid_b) {
      store_float(t.dk, t.dk_type, offset_b + dt * 8, dk[dt][2]);
      store_float(t.dk, t.dk_type, offset_b + dt * 8 + 1, dk[dt][3]);
      store_float(t.dv, t.dv_type, offset_b + dt * 8, dv[dt][2]);
      store_float(t.dv, t.dv_type, offset_b + dt * 8 + 1, dv[dt][3]);
    }
  }
}

// D = rowsum(dO * O) and the zeroed dQ accumulator for the tensor-core path: 16 bytes of dO and
// of O per thread, D / 8 threads per row (rows in memory order: (b * seq + i) * heads + h).
template <int D, bool kBf16>
__global__ void __launch_bounds__(256) flash_delta_vec(AttentionParams p, FlashTensors t) {
  constexpr int kParts = D / 8;
  const int64_t rows = p.batch * p.seq * p.n_heads;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = thread / kParts;
  const int part = static_cast<int>(thread % kParts);
  const bool valid = row < rows;  // no early return: the whole warp takes part in the shuffles
  float sum = 0.0f;
  if (valid) {
    const int64_t offset = row * D + part * 8;
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(t.out) + offset);
    const uint4 g = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(t.d_out) + offset);
    const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, gw[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float2 of, gf;
      if constexpr (kBf16) {
        __nv_bfloat162 ov, gv;
        memcpy(&ov, &ow[w], 4);
        memcpy(&gv, &gw[w], 4);
        of = __bfloat1622float2(ov);
        gf = __bfloat1622float2(gv);
      } else {
        __half2 ov, gv;
        memcpy(&ov, &ow[w], 4);
        memcpy(&gv, &gw[w], 4);
        of = __half22float2(ov);
        gf = __half22float2(gv);
      }
      sum = fmaf(of.x, gf.x, sum);
      sum = fmaf(of.y, gf.y, sum);
    }
    float4* accum = reinterpret_cast<float4*>(t.dq_accum + offset);
    accum[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    accum[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int offset = kParts / 2; offset > 0; offset /= 2)
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (valid && part == 0) {
    const int64_t h = row % p.n_heads, token = row / p.n_heads;
    const int64_t i = token % p.seq, b = token / p.seq;
    t.delta[(b * p.n_heads + h) * p.seq + i] = sum;
  }
}

// dq = dq_accum rounded to 16 bits, 8 elements per thread (n is a multiple of 8).
template <bool kBf16>
__global__ void __launch_bounds__(256) flash_dq_round_vec(void* dq, const float* accum, int64_t n) {
  const int64_t e = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (e >= n) return;
  const float4 x = *reinterpret_cast<const float4*>(accum + e);
  const float4 y = *reinterpret_cast<const float4*>(accum + e + 4);
  uint4 out;
  out.x = pack2<kBf16>(x.x, x.y);
  out.y = pack2<kBf16>(x.z, x.w);
  out.z = pack2<kBf16>(y.x, y.y);
  out.w = pack2<kBf16>(y.z, y.w);
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(dq) + e) = out;
}

// ================================ dispatch =====================================================

bool aligned16(const void* pointer) { return (reinterpret_cast<uintptr_t>(pointer) & 15) == 0; }

int max_shared_per_block();

template <typename Kernel>
void allow_shared(Kernel kernel, int bytes) {
  // Set on every launch: cheap, and correct for whichever device is current.
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <int D, bool kBf16>
void launch_forward_tc(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream) {
  constexpr int bytes = forward_shared_bytes<D>();
  allow_shared(flash_forward_tc<D, kBf16>, bytes);
  const dim3 grid(static_cast<unsigned>((p.seq + kBlock - 1) / kBlock),
                  static_cast<unsigned>(p.n_heads), static_cast<unsigned>(p.batch));
  flash_forward_tc<D, kBf16><<<grid, kThreads, bytes, stream>>>(p, t);
  MT_CUDA_CHECK_LAUNCH();
}

template <int D, bool kBf16, int kKeys>
void launch_forward_tc2(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream,
                        const FlashVersions& versions) {
  constexpr int bytes = forward2_shared_bytes<D, kKeys>();
  Forward2Options options;
  options.query_blocks = static_cast<int>((p.seq + kFwdRows - 1) / kFwdRows);
  options.heaviest_first_global = !versions.forward_grid_per_head;
  options.rescale_always = versions.forward_rescale_always;
  options.rescale_slack = static_cast<float>(versions.forward_rescale_slack);
  options.vector_store = t.out_type == t.q_type && aligned16(t.out);
  const unsigned blocks = static_cast<unsigned>(options.query_blocks * p.n_heads * p.batch);
  if (p.segments != nullptr) {
    allow_shared(flash_forward_tc2<D, kBf16, kKeys, true>, bytes);
    flash_forward_tc2<D, kBf16, kKeys, true><<<blocks, kThreads, bytes, stream>>>(p, t, options);
  } else {
    allow_shared(flash_forward_tc2<D, kBf16, kKeys, false>, bytes);
    flash_forward_tc2<D, kBf16, kKeys, false><<<blocks, kThreads, bytes, stream>>>(p, t, options);
  }
  MT_CUDA_CHECK_LAUNCH();
}

template <int D, bool kBf16>
void launch_forward(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream,
                    const FlashVersions& versions) {
  // v2 takes 32-bit key offsets and one grid dimension; with 32 keys its shared memory (70 KiB
  // at D = 128) fits every sm_80+ opt-in limit, with 64 (103 KiB) only sm_80's and sm_90's.
  const int available = max_shared_per_block();
  const int64_t blocks = (p.seq + kFwdRows - 1) / kFwdRows * p.n_heads * p.batch;
  if (versions.forward_v1 || p.seq > 0x7fffffff || blocks > 0x7fffffff ||
      forward2_shared_bytes<D, 32>() > available) {
    launch_forward_tc<D, kBf16>(p, t, stream);
  } else if (versions.forward_keys == 32 || forward2_shared_bytes<D, 64>() > available) {
    launch_forward_tc2<D, kBf16, 32>(p, t, stream, versions);
  } else {
    launch_forward_tc2<D, kBf16, 64>(p, t, stream, versions);
  }
}

template <int D, bool kBf16>
void launch_backward_tc(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream) {
  constexpr int bytes = backward_shared_bytes<D>();
  allow_shared(flash_backward_tc<D, kBf16>, bytes);
  const dim3 grid(static_cast<unsigned>((p.seq + kBlock - 1) / kBlock),
                  static_cast<unsigned>(p.n_kv_heads), static_cast<unsigned>(p.batch));
  flash_backward_tc<D, kBf16><<<grid, kThreads, bytes, stream>>>(p, t);
  MT_CUDA_CHECK_LAUNCH();
}

// The largest dynamic shared memory a block may opt into on the current device, cached per
// device (the attribute does not change while the process runs).
int max_shared_per_block() {
  constexpr int kDevices = 64;
  static std::atomic<int> cached[kDevices] = {};
  int device = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kDevices) device = kDevices - 1;  // beyond 64 GPUs: any one's value is a guess
  int bytes = cached[device].load(std::memory_order_relaxed);
  if (bytes == 0) {
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cached[device].store(bytes, std::memory_order_relaxed);
  }
  return bytes;
}

template <int D, bool kBf16, int kKeys, int kStages>
void launch_backward_tc2(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream) {
  using Config = BackwardV2<D, kKeys, kStages>;
  constexpr int bytes = Config::kSharedBytes;
  allow_shared(flash_backward_tc2<D, kBf16, kKeys, kStages>, bytes);
  const int64_t blocks = (p.seq + kKeys - 1) / kKeys * p.batch * p.n_kv_heads;  // < 2^31: checked
  const bool paired_red = (reinterpret_cast<uintptr_t>(t.dq_accum) & 7) == 0;
  flash_backward_tc2<D, kBf16, kKeys, kStages>
      <<<static_cast<unsigned>(blocks), Config::kThreads, bytes, stream>>>(p, t, paired_red);
  MT_CUDA_CHECK_LAUNCH();
}

// The largest v2 tiling that fits the device's shared memory; false where none does.
template <int D, bool kBf16>
bool launch_backward_v2(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream) {
  // One grid dimension, and 32-bit block coordinates and key offsets inside the kernel.
  if ((p.seq + 63) / 64 * p.batch * p.n_kv_heads > 0x7fffffff || p.seq > 0x7fffffff) return false;
  const int available = max_shared_per_block();
  if (BackwardV2<D, 128, 2>::kSharedBytes <= available) {
    launch_backward_tc2<D, kBf16, 128, 2>(p, t, stream);
    return true;
  }
  if (BackwardV2<D, 64, 1>::kSharedBytes <= available) {
    launch_backward_tc2<D, kBf16, 64, 1>(p, t, stream);
    return true;
  }
  return false;
}

unsigned warp_rows_grid(int64_t rows) {
  return static_cast<unsigned>((rows + kGenericWarps - 1) / kGenericWarps);
}

}  // namespace

namespace {

bool env_selects_v1(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::strcmp(value, "v1") == 0;
}

// Whether the backward v1 runs; the environment is read once, at the first use.
std::atomic<bool>& backward_v1_flag() {
  static std::atomic<bool> flag{env_selects_v1("MEMTUNE_FLASH_BWD")};
  return flag;
}

// Whether the forward v1 runs (MEMTUNE_FLASH_FWD=v1); read once, at the first use.
std::atomic<bool>& forward_v1_flag() {
  static std::atomic<bool> flag{env_selects_v1("MEMTUNE_FLASH_FWD")};
  return flag;
}

// Forward v2's keys per block (MEMTUNE_FLASH_FWD_KEYS=32 or 64; else 0, the default); read once.
std::atomic<int>& forward_keys_value() {
  static std::atomic<int> keys{[] {
    const char* value = std::getenv("MEMTUNE_FLASH_FWD_KEYS");
    if (value == nullptr) return 0;
    return std::strcmp(value, "32") == 0 ? 32 : std::strcmp(value, "64") == 0 ? 64 : 0;
  }()};
  return keys;
}

std::atomic<bool>& forward_grid_per_head_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

std::atomic<bool>& forward_rescale_always_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

std::atomic<int>& forward_rescale_slack_value() {
  static std::atomic<int> slack{FlashVersions{}.forward_rescale_slack};
  return slack;
}

}  // namespace

FlashVersions flash_versions() {
  FlashVersions versions;
  versions.backward_v1 = backward_v1_flag().load(std::memory_order_relaxed);
  versions.forward_v1 = forward_v1_flag().load(std::memory_order_relaxed);
  versions.forward_keys = forward_keys_value().load(std::memory_order_relaxed);
  versions.forward_grid_per_head = forward_grid_per_head_flag().load(std::memory_order_relaxed);
  versions.forward_rescale_always = forward_rescale_always_flag().load(std::memory_order_relaxed);
  versions.forward_rescale_slack = forward_rescale_slack_value().load(std::memory_order_relaxed);
  return versions;
}

void set_flash_versions(const FlashVersions& versions) {
  backward_v1_flag().store(versions.backward_v1, std::memory_order_relaxed);
  forward_v1_flag().store(versions.forward_v1, std::memory_order_relaxed);
  forward_keys_value().store(versions.forward_keys, std::memory_order_relaxed);
  forward_grid_per_head_flag().store(versions.forward_grid_per_head, std::memory_order_relaxed);
  forward_rescale_always_flag().store(versions.forward_rescale_always, std::memory_order_relaxed);
  forward_rescale_slack_value().store(versions.forward_rescale_slack, std::memory_order_relaxed);
}

bool attention_flash_uses_tensor_cores(const AttentionParams& p, const FlashTensors& t,
                                       bool backward) {
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  const DType type = t.q_type;
  if (type != DType::bf16 && type != DType::f16) return false;
  if (t.k_type != type || t.v_type != type) return false;
  if (!aligned16(t.q) || !aligned16(t.k) || !aligned16(t.v)) return false;
  if (backward && (t.d_out_type != type || !aligned16(t.d_out))) return false;
  if (p.batch > 65535 || p.n_heads > 65535) return false;
  return true;
}

void attention_flash_forward(const AttentionParams& p, const FlashTensors& t,
                             cudaStream_t stream) {
  if (attention_flash_uses_tensor_cores(p, t, false)) {
    const bool bf16 = t.q_type == DType::bf16;
    const FlashVersions versions = flash_versions();
    if (p.head_dim == 64) {
      bf16 ? launch_forward<64, true>(p, t, stream, versions)
           : launch_forward<64, false>(p, t, stream, versions);
    } else {
      bf16 ? launch_forward<128, true>(p, t, stream, versions)
           : launch_forward<128, false>(p, t, stream, versions);
    }
    return;
  }
  flash_forward_generic<<<warp_rows_grid(p.batch * p.n_heads * p.seq), kGenericWarps * 32, 0,
                          stream>>>(p, t);
  MT_CUDA_CHECK_LAUNCH();
}

void attention_flash_backward(const AttentionParams& p, const FlashTensors& t,
                              cudaStream_t stream) {
  const bool tensor_cores = attention_flash_uses_tensor_cores(p, t, true);
  const int64_t query_rows = p.batch * p.n_heads * p.seq;
  const bool bf16 = t.q_type == DType::bf16;
  if (tensor_cores && !flash_versions().backward_v1) {
    // The 16-byte passes before and after take O and dq in q's dtype and 16-byte alignment
    // (else the generic ones run); the main kernel does not care.
    const bool vector_io = t.out_type == t.q_type && t.d_out_type == t.q_type &&
                           t.dq_type == t.q_type && aligned16(t.out) && aligned16(t.d_out) &&
                           aligned16(t.dq) && aligned16(t.dq_accum);
    const int64_t parts = query_rows * (p.head_dim / 8);
    if (vector_io) {
      const unsigned grid = static_cast<unsigned>((parts + 255) / 256);
      if (p.head_dim == 64) {
        bf16 ? flash_delta_vec<64, true><<<grid, 256, 0, stream>>>(p, t)
             : flash_delta_vec<64, false><<<grid, 256, 0, stream>>>(p, t);
      } else {
        bf16 ? flash_delta_vec<128, true><<<grid, 256, 0, stream>>>(p, t)
             : flash_delta_vec<128, false><<<grid, 256, 0, stream>>>(p, t);
      }
    } else {
      flash_delta_kernel<<<warp_rows_grid(query_rows), kGenericWarps * 32, 0, stream>>>(p, t,
                                                                                        true);
    }
    MT_CUDA_CHECK_LAUNCH();
    bool launched;
    if (p.head_dim == 64) {
      launched = bf16 ? launch_backward_v2<64, true>(p, t, stream)
                      : launch_backward_v2<64, false>(p, t, stream);
    } else {
      launched = bf16 ? launch_backward_v2<128, true>(p, t, stream)
                      : launch_backward_v2<128, false>(p, t, stream);
    }
    if (!launched) {  // too little shared memory even for 64 keys: v1 needs the same bytes
      if (p.head_dim == 64) {
        bf16 ? launch_backward_tc<64, true>(p, t, stream) : launch_backward_tc<64, false>(p, t, stream);
      } else {
        bf16 ? launch_backward_tc<128, true>(p, t, stream) : launch_backward_tc<128, false>(p, t, stream);
      }
    }
    const int64_t n = query_rows * p.head_dim;
    if (vector_io) {
      const unsigned grid = static_cast<unsigned>((n / 8 + 255) / 256);
      bf16 ? flash_dq_round_vec<true><<<grid, 256, 0, stream>>>(t.dq, t.dq_accum, n)
           : flash_dq_round_vec<false><<<grid, 256, 0, stream>>>(t.dq, t.dq_accum, n);
      MT_CUDA_CHECK_LAUNCH();
    } else {
      launch_convert(t.dq, t.dq_type, t.dq_accum, DType::f32, n, stream);
    }
    return;
  }
  flash_delta_kernel<<<warp_rows_grid(query_rows), kGenericWarps * 32, 0, stream>>>(p, t,
                                                                                    tensor_cores);
  MT_CUDA_CHECK_LAUNCH();
  if (tensor_cores) {
    if (p.head_dim == 64) {
      bf16 ? launch_backward_tc<64, true>(p, t, stream) : launch_backward_tc<64, false>(p, t, stream);
    } else {
      bf16 ? launch_backward_tc<128, true>(p, t, stream) : launch_backward_tc<128, false>(p, t, stream);
    }
    launch_convert(t.dq, t.dq_type, t.dq_accum, DType::f32, query_rows * p.head_dim, stream);
    return;
  }
  flash_dq_generic<<<warp_rows_grid(query_rows), kGenericWarps * 32, 0, stream>>>(p, t);
  MT_CUDA_CHECK_LAUNCH();
  flash_dkdv_generic<<<warp_rows_grid(p.batch * p.n_kv_heads * p.seq), kGenericWarps * 32, 0,
                       stream>>>(p, t);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
