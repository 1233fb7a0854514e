// FlashAttention-2 on the GPU, backward (Dao, arXiv 2307.08691; SPECS.md §7) of the causal GQA
// attention of attention_flash_forward.cu, from O and the fp32 logsumexp that it saved; what both
// use is attention_flash_tiles.cuh.
//
// Tensor-core kernels (head_dim 64 and 128, q/k/v and d_out all bf16 or all f16, 16-byte
// aligned): D = rowsum(dO * O) and a zeroed fp32 dQ accumulator first; then one block per (key
// block, kv head, batch row), which loops over the group's query heads and the query blocks that
// see its keys: S^T = K Q^T, P^T = exp2(S^T * scale log2 e - lse log2 e), dV += P^T dO,
// dP^T = V dO^T, dS^T = P^T (dP^T - D) * scale, dK += dS^T Q, and dQ += dS K added into the
// accumulator with fp32 reductions (as FA2 does); dQ is rounded into dq at the end. dK and dV of a
// kv head are summed in registers over its whole group: K and V are never repeated. The tiling
// ("backward v2", below): 128 keys x 8 warps per block, Q/dO/lse/D double-buffered by cp.async,
// dS^T kept in registers for dK, skipped masked warps, vector fp32 reductions for dQ on sm_90,
// 16-byte D/zeroing and dQ rounding passes. On compute capability 9.0 the main pass may instead be
// the Hopper backward's (attention_hopper_backward.cu: wgmma + TMA, same contract), where
// FlashVersions::backward_hopper is set (attention_flash.h; the default) and it serves the call.
// Generic kernels (any even head_dim up to 256, any float dtypes, any alignment, and shapes the
// tensor-core tiling cannot take): one warp per query row (dQ) or key row (dK/dV), fp32
// throughout.
#include "memtune/ops/cuda/attention_flash.h"
#include "memtune/ops/cuda/attention_flash_tiles.cuh"
#include "memtune/ops/cuda/attention_hopper.h"

namespace memtune::cuda {
namespace {

// ================================ generic kernels ===============================================

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
  GenericQueryRow query;
  if (!generic_query_row(p, query)) return;
  const int64_t i = query.i, h = query.h, b = query.b, g = query.g, d = p.head_dim;
  const int32_t* segments_row = query.segments_row;
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

// ================================ backward v2 ===================================================
//
// The maths of the file comment, tiled for reuse and overlap (FA2 paper, arXiv 2307.08691,
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
//  - On packed rows the query loop stops after the block of the last query that sees any key of
//    the block (segment_reach, attention_flash_tiles.cuh).
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

  // The last query that sees any key of the block: the row's last, or on packed rows the last
  // whose id is one of the keys' (segment_reach, attention_flash_tiles.cuh). The query blocks
  // past its block are wholly masked (P = dS = 0): skipping them leaves dK, dV and dQ as they
  // were. Searched first, in dS^T's shared memory (first written inside the main loop): ptxas
  // keeps the main loop of every configuration free of new spills only with the search here
  // (placed after the first loads, the 64-key tiling spilled ~50 bytes, inside its main loop).
  static_assert(segment_reach_scratch_words<kKeys>() * 4 <= Config::kDsBytes, "scratch");
  int last_query = static_cast<int>(seq) - 1;
  if (segments_row != nullptr && seq - k0 > kQueryBlock) {
    const int keys = seq - k0 < kKeys ? static_cast<int>(seq - k0) : kKeys;
    last_query = segment_reach<kThreadCount, kKeys, false>(
        segments_row, static_cast<int>(seq), k0, keys,
        reinterpret_cast<int32_t*>(shared + (ds_tile - k_tile) / 2));
  }
  load_rows<D, kKeys, kThreadCount>(
      k_tile, static_cast<const uint16_t*>(t.k) + ((b * seq + k0) * kv_heads + g) * D, kv_stride,
      seq - k0);
  load_rows<D, kKeys, kThreadCount>(
      v_tile, static_cast<const uint16_t*>(t.v) + ((b * seq + k0) * kv_heads + g) * D, kv_stride,
      seq - k0);

  // Work items: (query head of the group, query block from the one holding k0 up to the one
  // holding last_query), query blocks fastest.
  const int q_blocks = (last_query - k0) / kQueryBlock + 1;
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

// The largest tiling (keys per block) that fits the device's shared memory; 0 where none does,
// or where the grid outgrows the kernel's one dimension and 32-bit block coordinates and key
// offsets (then the generic kernels run).
template <int D>
int backward_keys_per_block(const AttentionParams& p) {
  if ((p.seq + 63) / 64 * p.batch * p.n_kv_heads > 0x7fffffff || p.seq > 0x7fffffff) return 0;
  const int available = flash_max_shared_per_block();
  if (BackwardV2<D, 128, 2>::kSharedBytes <= available) return 128;
  if (BackwardV2<D, 64, 1>::kSharedBytes <= available) return 64;
  return 0;
}

template <int D, bool kBf16>
void launch_backward_v2(const AttentionParams& p, const FlashTensors& t, int keys_per_block,
                        cudaStream_t stream) {
  if (keys_per_block == 128) {
    launch_backward_tc2<D, kBf16, 128, 2>(p, t, stream);
  } else {
    launch_backward_tc2<D, kBf16, 64, 1>(p, t, stream);
  }
}

}  // namespace

void attention_flash_backward(const AttentionParams& p, const FlashTensors& t,
                              cudaStream_t stream) {
  const int64_t query_rows = p.batch * p.n_heads * p.seq;
  const bool bf16 = t.q_type == DType::bf16;
  int keys_per_block = 0;
  if (attention_flash_uses_tensor_cores(p, t, true)) {
    keys_per_block = p.head_dim == 64 ? backward_keys_per_block<64>(p) : backward_keys_per_block<128>(p);
  }
  // The Hopper backward's main pass in place of backward v2's where it is on (the default)
  // (FlashVersions::backward_hopper) and serves the call (attention_hopper.h); the passes before
  // and after it are the same.
  const bool hopper = flash_versions().backward_hopper && flash_backward_hopper_serves(p, t);
  if (hopper || keys_per_block > 0) {
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
    if (hopper && launch_flash_backward_hopper(p, t, stream)) {
      // dQ is in the accumulator, dk and dv written.
    } else if (keys_per_block == 0) {
      // The Hopper launch refused after all (no tensor-map encoder, too little shared memory) on a
      // shape that backward v2 does not take: the generic kernels, with D already computed.
      flash_dq_generic<<<warp_rows_grid(query_rows), kGenericWarps * 32, 0, stream>>>(p, t);
      MT_CUDA_CHECK_LAUNCH();
      flash_dkdv_generic<<<warp_rows_grid(p.batch * p.n_kv_heads * p.seq), kGenericWarps * 32, 0, stream>>>(p, t);
      MT_CUDA_CHECK_LAUNCH();
      return;
    } else if (p.head_dim == 64) {
      bf16 ? launch_backward_v2<64, true>(p, t, keys_per_block, stream)
           : launch_backward_v2<64, false>(p, t, keys_per_block, stream);
    } else {
      bf16 ? launch_backward_v2<128, true>(p, t, keys_per_block, stream)
           : launch_backward_v2<128, false>(p, t, keys_per_block, stream);
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
  flash_delta_kernel<<<warp_rows_grid(query_rows), kGenericWarps * 32, 0, stream>>>(p, t, false);
  MT_CUDA_CHECK_LAUNCH();
  flash_dq_generic<<<warp_rows_grid(query_rows), kGenericWarps * 32, 0, stream>>>(p, t);
  MT_CUDA_CHECK_LAUNCH();
  flash_dkdv_generic<<<warp_rows_grid(p.batch * p.n_kv_heads * p.seq), kGenericWarps * 32, 0,
                       stream>>>(p, t);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
