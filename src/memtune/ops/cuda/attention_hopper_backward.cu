// The Hopper backward of flash attention (issue 23): backward v2's contract and algorithm
// (attention_flash_backward.cu: D = rowsum(dO * O) and the zeroed fp32 dQ accumulator come
// first, from attention_flash_backward's own passes; dK and dV of a kv head summed over its GQA
// group in registers; dQ added into the accumulator, rounded to dq afterwards) on Hopper's own
// machinery, compiled for sm_90a only (CMakeLists.txt). The tiling is FlashAttention-3's backward
// (Shah et al., arXiv 2407.08608, §3 and Appendix B; ideas only), without its warp specialisation
// yet:
//  - One block per (key block of 128 keys, kv head, batch row): two warpgroups, each owning 64 of
//    the keys (the M = 64 of its wgmmas), loop over the group's query heads and the query blocks
//    of 64 that see the keys (causal; on packed rows up to the last query whose segment id is one
//    of the keys', segment_reach in attention_flash_tiles.cuh).
//  - Per query block and warpgroup, all GEMMs are wgmma (PTX ISA, "wgmma.mma_async"):
//      S^T  = K Q^T     (shared x shared, both K-major)          64 keys x 64 queries
//      dP^T = V dO^T    (shared x shared, both K-major)          64 x 64, same commit group
//      P^T  = exp2(S^T scale log2 e - lse log2 e), masked; dS^T = P^T (dP^T - D) scale (registers)
//      dV  += P^T dO    (P^T from registers, dO N-major)         64 x head_dim
//      dK  += dS^T Q    (dS^T from registers, Q N-major)         64 x head_dim
//      dQ  += dS K      (dS^T written to shared memory and read transposed, K N-major): at
//                        head_dim 128 warpgroup w takes columns [64 w, 64 w + 64) over all 128
//                        keys, at 64 all columns over its own 64 keys; then
//                        red.global.add.v2.f32 into the fp32 accumulator.
//    The accumulator fragments of S^T and dS^T are, rounded to 16 bits, the register A fragments of
//    the dV and dK wgmmas (as P is for O += P V in the Hopper forward).
//  - Q and dO arrive by TMA (cp.async.bulk.tensor, 128-byte swizzle) into two stages that complete
//    on mbarriers: the next query block's is requested while this one computes. lse, D (and the
//    query segment ids on packed rows) come by 4-byte cp.async into the same stage (their rows are
//    not 16-byte aligned in general, which a tensor map needs). K and V come once by TMA.
//  - dS^T is double-buffered in shared memory, so one __syncthreads per query block suffices: it
//    publishes this block's dS^T (and the next stage's lse/D) and tells thread 0 that the other
//    stage is free.
//  - How dQ is added (kDq; FlashVersions::backward_hopper_dq, HopperDq in attention_flash.h):
//    2-float red.add from each thread's accumulator pairs, or (the default) the warpgroup's 64 x 64
//    f32 tile written to shared memory (128-byte swizzle, two 32-column boxes) and added by the
//    copy engine (cp.reduce.async.bulk.tensor), issued by one thread of the warpgroup, whose next
//    item waits only for the copy's reads.
//  - The order of blocks and items (kRows; HopperOrder in attention_flash.h): key blocks slowest
//    (keys_first), or rows slowest with a block's items query block by query block (rows_*; the
//    default is rows_falling).
// Not done yet (FA3's later steps): a producer warp with setmaxnreg, overlap of one query block's
// softmax with the next block's GEMMs (every wgmma group is waited for before its results are
// used), dQ's bulk reduce-adds issued from a separate warp, deterministic dQ, and 2 blocks an SM
// at head_dim 64.
//
// Shared memory (from a 1024-aligned base): K and V [chunks][128 keys][128 bytes] each; two stages
// of Q and dO [chunks][64 queries][128 bytes]; two dS^T buffers [128 keys][64 queries x 2 bytes]
// (one swizzled 128-byte row a key); the stages' lse, D and ids (f32/i32 [2][3][64]); the
// mbarriers; segment_reach's scratch: 163.1 KiB at head_dim 128, 99.1 KiB at 64 (with the 1 KiB
// of alignment slack). ptxas (CUDA 13.0): 240 registers at head_dim 128 (246 on packed rows), 196
// (197) at 64, no spills.
#include <algorithm>
#include <climits>
#include <type_traits>

#include "memtune/ops/cuda/attention_flash.h"
#include "memtune/ops/cuda/attention_flash_tiles.cuh"
#include "memtune/ops/cuda/attention_hopper.h"
#include "memtune/ops/cuda/attention_hopper_common.cuh"

namespace memtune::cuda {
namespace {

constexpr int kBackwardKeys = 128;     // keys per block: two warpgroups of 64
constexpr int kBackwardQueries = 64;   // queries per query block (the N of S^T and dP^T)
constexpr int kBackwardThreads = 256;  // two warpgroups

// How dQ is added (HopperDq): the kernel's template argument.
constexpr int kDqPairs = 0, kDqBulk = 1;

// kDqStaged: the bulk mode's two dQ tiles (one a warpgroup) between the dS^T buffers and the stats.
template <int D, bool kDqStaged = false>
struct BackwardLayout {
  static constexpr int kChunks = D / kChunkColumns;
  static constexpr uint32_t kKvChunkBytes = kBackwardKeys * kSwizzleRowBytes;     // 16 KB
  static constexpr uint32_t kQChunkBytes = kBackwardQueries * kSwizzleRowBytes;   // 8 KB
  static constexpr uint32_t kKvBytes = kChunks * kKvChunkBytes;  // one K or V tile
  static constexpr uint32_t kQBytes = kChunks * kQChunkBytes;    // one Q or dO tile
  static constexpr uint32_t kDsBytes = kBackwardKeys * kSwizzleRowBytes;  // dS^T: 64 queries a row
  // K at 0, V at kKvBytes.
  static constexpr uint32_t kStages = 2 * kKvBytes;  // stage s: Q at kStages + 2 s kQBytes, dO after it
  static constexpr uint32_t kDs = kStages + 4 * kQBytes;  // buffer i at kDs + i kDsBytes
  static constexpr uint32_t kDqTileBytes = kBackwardQueries * 64 * 4;  // 64 queries x 64 f32 columns
  static constexpr uint32_t kDqBoxBytes = kBackwardQueries * kSwizzleRowBytes;  // 32 of those columns
  static constexpr uint32_t kDqTiles = kDs + 2 * kDsBytes;  // warpgroup w's at kDqTiles + w kDqTileBytes
  static constexpr uint32_t kStats = kDqTiles + (kDqStaged ? 2 * kDqTileBytes : 0);  // [stage][lse | D | ids][64]
  static constexpr uint32_t kStatsStageBytes = 3 * kBackwardQueries * 4;
  static constexpr uint32_t kBarriers = kStats + 2 * kStatsStageBytes;  // kv, full[2]: 8 bytes each
  static constexpr uint32_t kReachScratch = kBarriers + 64;
  static constexpr int kSharedBytes =
      static_cast<int>(kReachScratch + segment_reach_scratch_words<kBackwardKeys>() * 4) + 1024;  // + alignment slack
  static_assert(kStages % 1024 == 0 && kDs % 1024 == 0 && kQChunkBytes % 1024 == 0 && kDqTiles % 1024 == 0 &&
                    kDqBoxBytes % 1024 == 0,
                "swizzle-period aligned tiles");
};

struct HopperBackwardArgs {
  int seq = 0, heads = 0, kv_heads = 0, kv_group = 1, batch = 0;
  float scale = 0.0f;       // softmax scale
  float scale_log2 = 0.0f;  // times log2 e
  const float* lse = nullptr;    // f32 [batch, heads, seq], natural log
  const float* delta = nullptr;  // f32 [batch, heads, seq]: rowsum(dO * O)
  float* dq_accum = nullptr;     // f32, q's layout, zeroed before; dQ is added into it
  void* dk = nullptr;            // 16-bit, k's layout
  void* dv = nullptr;
  const int32_t* segments = nullptr;  // i32 [batch, seq] (kSegments), else null
  int key_blocks = 0;                 // key blocks a row: ceil(seq / kBackwardKeys)
  int group_rows = 1;                 // the rows_* orders: rows a group (the last group may hold fewer)
  HopperOrder order = HopperOrder::keys_first;
};

#ifdef MEMTUNE_HOPPER_DEVICE_CODE

// address[0] += a, address[1] += b in global memory, no return value (8-byte aligned).
__device__ __forceinline__ void reduce_add_pair(float* address, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(a), "f"(b) : "memory");
}

__device__ __forceinline__ void cp_async_4_zero_fill(uint32_t shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared), "l"(global), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// acc (64 queries x 64 columns, fp32) = dS K over kSteps k-steps of 16 keys: dS^T [key][query] as
// the M-major A (imm-trans-a), K [key][head_dim] as the N-major B (imm-trans-b); each k-step
// starts 16 rows (2048 bytes) further in both.
template <bool kBf16, int kSteps>
__device__ __forceinline__ void dq_product(float (&acc)[kChunkColumns / 2], uint64_t ds_columns, uint64_t k_columns) {
  pin_registers(acc);
  wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < kSteps; ++kc)
    wgmma_m64_shared<kChunkColumns, kBf16, 1, 1>(acc, ds_columns + ((kc * 16 * kSwizzleRowBytes) >> 4),
                                                 k_columns + ((kc * 16 * kSwizzleRowBytes) >> 4), kc > 0);
  wgmma_commit();
  wgmma_wait_all();
  pin_registers(acc);
}

#endif  // MEMTUNE_HOPPER_DEVICE_CODE

// __launch_bounds__(256, 1): one block an SM, so ptxas may give each thread up to 255 registers
// (at head_dim 128 the dK and dV accumulators alone take 128). kSegments: packed rows
// (args.segments): a query sees a key only where their ids are equal. kRows: one of the rows_*
// orders (args.order; HopperOrder), else keys_first; a template argument so that the keys_first
// kernels carry none of the other orders' arithmetic (registers).
template <int D, bool kBf16, bool kSegments, int kDq, bool kRows>
__global__ void __launch_bounds__(kBackwardThreads, 1)
    flash_backward_hopper(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
                          const __grid_constant__ CUtensorMap dq_map, HopperBackwardArgs args) {
#ifdef MEMTUNE_HOPPER_DEVICE_CODE
  using L = BackwardLayout<D, kDq == kDqBulk>;
  extern __shared__ uint8_t shared_raw[];
  const uint32_t raw_address = shared_address(shared_raw);
  const uint32_t base = (raw_address + kSwizzlePeriodBytes - 1) & ~(kSwizzlePeriodBytes - 1);
  uint8_t* const base_pointer = shared_raw + (base - raw_address);
  const uint32_t kv_full = base + L::kBarriers;  // full[stage] at kv_full + 8 (1 + stage)
  const uint32_t k_tile = base, v_tile = base + L::kKvBytes;

  // keys_first: the key block slowest over the grid, from 0: the blocks with the most query blocks
  // to visit (the first keys of a causal row) start first, the short ones fill the tail (as
  // backward v2). The rows_* orders: the same within groups of group_rows rows, the groups one
  // after another, so that a group's blocks run together and their dQ adds meet in L2 (HopperOrder).
  const int kv_heads_batch = args.kv_heads * args.batch;
  const int block_index = static_cast<int>(blockIdx.x);
  int key_block = block_index / kv_heads_batch, head_row = block_index % kv_heads_batch;
  if constexpr (kRows) {
    const int group_blocks = args.group_rows * args.key_blocks;
    const int first_row = block_index / group_blocks * args.group_rows;
    const int rows_here = min(args.group_rows, kv_heads_batch - first_row);
    const int local = block_index % group_blocks;
    key_block = local / rows_here;
    head_row = first_row + local % rows_here;
  }
  const int g = head_row % args.kv_heads, b = head_row / args.kv_heads;
  const int k0 = key_block * kBackwardKeys;
  const int seq = args.seq, group = args.kv_group;

  const int thread = static_cast<int>(threadIdx.x);
  const int warpgroup = thread / 128, warp = (thread / 32) % 4, lane = thread % 32;
  const int group_id = lane / 4, thread_in_group = lane % 4;
  // This thread's two key rows in the block (the accumulator rows of its warp in its warpgroup's
  // 64), and their positions.
  const int row_a = warpgroup * kWarpgroupRows + warp * 16 + group_id, row_b = row_a + 8;
  const int key_a = k0 + row_a, key_b = k0 + row_b;
  const int wg_k0 = k0 + warpgroup * kWarpgroupRows;
  const int32_t* const segments_row = kSegments ? args.segments + static_cast<int64_t>(b) * seq : nullptr;

  if (thread == 0) {
    for (int i = 0; i < 3; ++i) mbarrier_init(kv_full + 8 * i, 1);
    // The copy engine (the async proxy) must see the initialised barriers.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();

  // Work items: (query head of the group, query block from k0's up to last_query's). keys_first:
  // query blocks fastest, rising; the rows_* orders: the group's heads fastest, query blocks rising
  // or falling (HopperOrder). Item i uses stage i & 1, whose barrier completes for the (i >> 1)-th time.
  auto item_head = [&](int item, int q_blocks) { return g * group + (kRows ? item % group : item / q_blocks); };
  auto item_q0 = [&](int item, int q_blocks) {
    if constexpr (kRows) {
      const int rank = item / group;
      return k0 + (args.order == HopperOrder::rows_falling ? q_blocks - 1 - rank : rank) * kBackwardQueries;
    }
    return k0 + item % q_blocks * kBackwardQueries;
  };
  // Thread 0: the item's Q and dO into `stage` by TMA (rows past seq are zero-filled).
  auto request = [&](int h, int q0, int stage) {
    const uint32_t q_tile = base + L::kStages + stage * 2 * L::kQBytes, do_tile = q_tile + L::kQBytes;
    const uint32_t full = kv_full + 8 * (1 + stage);
    mbarrier_expect_bytes(full, 2 * L::kQBytes);  // the whole boxes count, zero-filled rows too
#pragma unroll
    for (int c = 0; c < L::kChunks; ++c) {
      tma_load(q_tile + c * L::kQChunkBytes, q_map, c * kChunkColumns, h, q0, b, full);
      tma_load(do_tile + c * L::kQChunkBytes, do_map, c * kChunkColumns, h, q0, b, full);
    }
  };
  // Threads 0-63 bring the item's lse, 64-127 its D, 128-191 its query ids (packed rows), zero
  // past seq; complete for this thread at its next cp_async_wait_all.
  auto stage_stats = [&](int h, int q0, int stage) {
    const int which = thread / kBackwardQueries, r = thread % kBackwardQueries;
    if (which > (kSegments ? 2 : 1)) return;
    const bool valid = q0 + r < seq;
    const int64_t row = (static_cast<int64_t>(b) * args.heads + h) * seq + q0 + (valid ? r : 0);
    const void* source = which == 0   ? static_cast<const void*>(args.lse + row)
                         : which == 1 ? static_cast<const void*>(args.delta + row)
                                      : static_cast<const void*>(segments_row + q0 + (valid ? r : 0));
    cp_async_4_zero_fill(base + L::kStats + stage * L::kStatsStageBytes + thread * 4, source, valid);
  };

  if (thread == 0) {
    mbarrier_expect_bytes(kv_full, 2 * L::kKvBytes);
#pragma unroll
    for (int c = 0; c < L::kChunks; ++c) {
      tma_load(k_tile + c * L::kKvChunkBytes, k_map, c * kChunkColumns, g, k0, b, kv_full);
      tma_load(v_tile + c * L::kKvChunkBytes, v_map, c * kChunkColumns, g, k0, b, kv_full);
    }
    // keys_first's item 0 (the group's first head, the query block at k0) is known now: request it
    // before segment_reach below.
    if constexpr (!kRows) request(g * group, k0, 0);
  }
  if constexpr (!kRows) stage_stats(g * group, k0, 0);

  // The last query that sees any key of the block: the row's last, or on packed rows the last
  // whose id is one of the keys' (segment_reach). The query blocks past its block are wholly
  // masked (P = dS = 0): skipping them leaves dK, dV and dQ as they were.
  int last_query = seq - 1;
  int32_t id_a = 0, id_b = 0;  // this thread's keys' ids (keys past seq: any id, never seen)
  if constexpr (kSegments) {
    if (seq - k0 > kBackwardQueries) {
      const int keys = min(seq - k0, kBackwardKeys);
      last_query = segment_reach<kBackwardThreads, kBackwardKeys, false>(
          segments_row, seq, k0, keys, reinterpret_cast<int32_t*>(base_pointer + L::kReachScratch));
    }
    id_a = key_a < seq ? segments_row[key_a] : 0;
    id_b = key_b < seq ? segments_row[key_b] : 0;
  }
  const int q_blocks = (last_query - k0) / kBackwardQueries + 1;
  const int items = group * q_blocks;
  if constexpr (kRows) {  // item 0's query block depends on q_blocks in the falling order
    if (thread == 0) request(item_head(0, q_blocks), item_q0(0, q_blocks), 0);
    stage_stats(item_head(0, q_blocks), item_q0(0, q_blocks), 0);
  }
  cp_async_wait_all();
  __syncthreads();  // stage 0's lse / D / ids are visible

  // Descriptors of this warpgroup's 64 rows of K and V: the K-major A of S^T and dP^T (k-step kk
  // of 16 columns lies in chunk kk / 4 at byte 32 (kk % 4) of each swizzled row).
  const uint64_t k_rows = swizzled_descriptor(k_tile + warpgroup * kWarpgroupRows * kSwizzleRowBytes, 16,
                                              kSwizzlePeriodBytes);
  const uint64_t v_rows = swizzled_descriptor(v_tile + warpgroup * kWarpgroupRows * kSwizzleRowBytes, 16,
                                              kSwizzlePeriodBytes);

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;

  mbarrier_wait(kv_full, 0);
#pragma unroll 1
  for (int item = 0; item < items; ++item) {
    const int stage = item & 1;
    const uint32_t parity = (item >> 1) & 1;
    // The other stage was last read by the previous item, which both warpgroups finished before
    // the barrier that ended it: refill it with the next item while this one computes.
    if (item + 1 < items) {
      const int next_h = item_head(item + 1, q_blocks), next_q0 = item_q0(item + 1, q_blocks);
      if (thread == 0) request(next_h, next_q0, stage ^ 1);
      stage_stats(next_h, next_q0, stage ^ 1);
    }
    const int h = item_head(item, q_blocks), q0 = item_q0(item, q_blocks);
    const uint32_t q_tile = base + L::kStages + stage * 2 * L::kQBytes, do_tile = q_tile + L::kQBytes;
    const uint32_t ds_tile = base + L::kDs + stage * L::kDsBytes;
    const float* const lse_tile = reinterpret_cast<const float*>(base_pointer + L::kStats + stage * L::kStatsStageBytes);
    const float* const delta_tile = lse_tile + kBackwardQueries;
    const int32_t* const query_ids = reinterpret_cast<const int32_t*>(delta_tile + kBackwardQueries);
    // Queries [q0, q0 + 64) see keys up to q0 + 63 (and none at or past seq): warpgroup 1's keys
    // only from the second query block of the key block on. Warpgroup 0's always: k0 <= q0 < seq.
    const int seen_end = min(q0 + kBackwardQueries, seq);
    const bool upper_seen = k0 + kWarpgroupRows < seen_end;
    const bool active = wg_k0 < seen_end;

    mbarrier_wait(kv_full + 8 * (1 + stage), parity);
    if (active) {
      // S^T = K Q^T and dP^T = V dO^T, 64 keys x 64 queries each, one commit group.
      float s[kBackwardQueries / 2], dp[kBackwardQueries / 2];
      const uint64_t q_rows = swizzled_descriptor(q_tile, 16, kSwizzlePeriodBytes);
      const uint64_t do_rows = swizzled_descriptor(do_tile, 16, kSwizzlePeriodBytes);
      pin_registers(s);
      pin_registers(dp);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t a_step = (kk / 4) * L::kKvChunkBytes + (kk % 4) * 32;
        const uint32_t b_step = (kk / 4) * L::kQChunkBytes + (kk % 4) * 32;
        wgmma_m64_shared<kBackwardQueries, kBf16>(s, k_rows + (a_step >> 4), q_rows + (b_step >> 4), kk > 0);
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t a_step = (kk / 4) * L::kKvChunkBytes + (kk % 4) * 32;
        const uint32_t b_step = (kk / 4) * L::kQChunkBytes + (kk % 4) * 32;
        wgmma_m64_shared<kBackwardQueries, kBf16>(dp, v_rows + (a_step >> 4), do_rows + (b_step >> 4), kk > 0);
      }
      wgmma_commit();
      wgmma_wait_all();
      pin_registers(s);
      pin_registers(dp);

      // P^T, masked: causality (query col sees key r iff key <= query), queries past seq (their
      // zero-filled lse would give P = 1), and on packed rows other segments. Masked scores become
      // -inf before the exponential (exp2(-inf) = 0). Only where some key of the warpgroup lies
      // past the block's first query, or the block runs past seq, or on packed rows.
      if (kSegments || wg_k0 + kWarpgroupRows - 1 > q0 || q0 + kBackwardQueries > seq) {
#pragma unroll
        for (int nt = 0; nt < kBackwardQueries / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int column = nt * 8 + 2 * thread_in_group + e;
            const int query = q0 + column;
            bool see_a = key_a <= query && query < seq, see_b = key_b <= query && query < seq;
            if constexpr (kSegments) {
              const int32_t query_id = query_ids[column];
              see_a = see_a && query_id == id_a;
              see_b = see_b && query_id == id_b;
            }
            if (!see_a) s[4 * nt + e] = -INFINITY;
            if (!see_b) s[4 * nt + 2 + e] = -INFINITY;
          }
      }
      // P^T = exp2(S^T scale log2 e - lse log2 e) (one FFMA and one ex2 each, as the forward);
      // dS^T = P^T (dP^T - D) scale, in place of dP^T.
#pragma unroll
      for (int nt = 0; nt < kBackwardQueries / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int column = nt * 8 + 2 * thread_in_group + e;
          const float lse_log2 = lse_tile[column] * kLog2e, delta = delta_tile[column];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int i = 4 * nt + 2 * half + e;
            s[i] = exp2_approx(fmaf(s[i], args.scale_log2, -lse_log2));
            dp[i] = s[i] * (dp[i] - delta) * args.scale;
          }
        }
      // Both in 16 bits as wgmma's A fragments: k-step kc (queries 16 kc .. 16 kc + 15) is the
      // C fragments of n8 tiles 2 kc and 2 kc + 1.
      uint32_t p[kBackwardQueries / 16][4], ds[kBackwardQueries / 16][4];
#pragma unroll
      for (int kc = 0; kc < kBackwardQueries / 16; ++kc)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          p[kc][j] = pack2<kBf16>(s[8 * kc + 2 * j], s[8 * kc + 2 * j + 1]);
          ds[kc][j] = pack2<kBf16>(dp[8 * kc + 2 * j], dp[8 * kc + 2 * j + 1]);
        }
      // dS^T into this item's buffer for dQ (the 128-byte swizzle, rows = keys; the 4-byte stores
      // of a warp hit 32 different banks, as the forward's epilogue), before the wgmmas below
      // take the registers (their A registers may not be read until they complete).
#pragma unroll
      for (int nt = 0; nt < kBackwardQueries / 8; ++nt) {
        const uint32_t packed_a = ds[nt / 2][(nt % 2) * 2], packed_b = ds[nt / 2][(nt % 2) * 2 + 1];
        uint8_t* const tile = base_pointer + (ds_tile - base);
        *reinterpret_cast<uint32_t*>(tile + row_a * kSwizzleRowBytes + ((nt ^ (row_a % 8)) * 16) + thread_in_group * 4) =
            packed_a;
        *reinterpret_cast<uint32_t*>(tile + row_b * kSwizzleRowBytes + ((nt ^ (row_b % 8)) * 16) + thread_in_group * 4) =
            packed_b;
      }
      // dV += P^T dO and dK += dS^T Q: dO and Q are [query][head_dim], the N-major form of B (16
      // queries x head_dim), k-step kc 16 rows (2048 bytes, two swizzle periods) further; the
      // leading byte offset is the distance between 64-column chunks.
      const uint64_t do_columns = swizzled_descriptor(do_tile, L::kQChunkBytes, kSwizzlePeriodBytes);
      const uint64_t q_columns = swizzled_descriptor(q_tile, L::kQChunkBytes, kSwizzlePeriodBytes);
      pin_registers(p);
      pin_registers(ds);
      pin_registers(dv);
      pin_registers(dk);
      wgmma_fence();
#pragma unroll
      for (int kc = 0; kc < kBackwardQueries / 16; ++kc)
        wgmma_m64_registers<D, kBf16>(dv, p[kc], do_columns + ((kc * 16 * kSwizzleRowBytes) >> 4));
#pragma unroll
      for (int kc = 0; kc < kBackwardQueries / 16; ++kc)
        wgmma_m64_registers<D, kBf16>(dk, ds[kc], q_columns + ((kc * 16 * kSwizzleRowBytes) >> 4));
      wgmma_commit();
      wgmma_wait_all();
      pin_registers(dv);
      pin_registers(dk);
    }
    // The next stage's lse / D / ids have landed (this thread's copies); dS^T's generic-proxy
    // stores must be visible to the wgmma (async proxy) reads below: fence, then the barrier that
    // also tells thread 0 that this stage is free after this item.
    cp_async_wait_all();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();

    // dQ += dS K over the keys the block's queries see: dS^T is [key][query] (the M-major A,
    // imm-trans-a), K [key][head_dim] (the N-major B). 64 output columns per wgmma (the width of
    // one swizzled chunk: narrower B tiles would start inside a swizzle atom, which no canonical
    // layout describes). At head_dim 128 warpgroup w takes columns [64 w, 64 w + 64) (chunk w of K)
    // over all keys, warpgroup 1's 64 keys only where they are seen (else its rows of the buffer
    // are stale); at head_dim 64 each warpgroup takes all 64 columns over its own 64 keys (where
    // they are seen), and both add theirs into the accumulator. Two straight-line versions of the
    // k-loop: a branch between the wgmmas of one group makes ptxas fence them.
    const bool dq_runs = D == 128 || active;
    if (dq_runs) {
      float acc[kChunkColumns / 2];
      const uint32_t ds_start = ds_tile + (D == 128 ? 0 : warpgroup * kWarpgroupRows * kSwizzleRowBytes);
      const uint32_t k_start =
          k_tile + (D == 128 ? warpgroup * L::kKvChunkBytes : warpgroup * kWarpgroupRows * kSwizzleRowBytes);
      const uint64_t ds_columns = swizzled_descriptor(ds_start, L::kDsBytes, kSwizzlePeriodBytes);
      const uint64_t k_columns = swizzled_descriptor(k_start, L::kKvChunkBytes, kSwizzlePeriodBytes);
      if (D == 128 && upper_seen) {
        dq_product<kBf16, kBackwardKeys / 16>(acc, ds_columns, k_columns);
      } else {
        dq_product<kBf16, kWarpgroupRows / 16>(acc, ds_columns, k_columns);
      }
      // Rows warp * 16 + group_id (+ 8) of the query block; columns n8 tile nt, 2 thread_in_group.
      const int query_a = q0 + warp * 16 + group_id, query_b = query_a + 8;
      const int64_t q_stride = static_cast<int64_t>(args.heads) * D;
      const int column0 = D == 128 ? warpgroup * kChunkColumns : 0;
      float* const dq_a = args.dq_accum + (static_cast<int64_t>(b) * seq + query_a) * q_stride +
                          static_cast<int64_t>(h) * D + column0 + 2 * thread_in_group;
      float* const dq_b = dq_a + 8 * q_stride;
      if constexpr (kDq == kDqBulk) {
        // The tile into this warpgroup's shared buffer, once the copy engine has read the last
        // item's out of it (issued an item ago: done by now in the steady state), then one reduce-add
        // a 32-column box. Box c holds columns [32 c, 32 c + 32) of the 64, rows = the block's 64
        // queries; thread (g, t) of warp w writes rows 16 w + g (+ 8), columns 8 nt + 2 t (+ 1), at
        // 16-byte piece (8 (nt % 4) + 2 t) / 4 of its 128-byte row, XOR the row's index mod 8.
        const uint32_t dq_tile = base + L::kDqTiles + warpgroup * L::kDqTileBytes;
        const bool issuer = thread % 128 == 0;
        if (issuer) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warpgroup) : "memory");
        uint8_t* const tile = base_pointer + (dq_tile - base);
        const int local_a = warp * 16 + group_id, local_b = local_a + 8;
#pragma unroll
        for (int nt = 0; nt < kChunkColumns / 8; ++nt) {
          const int box = nt / 4, piece = (nt % 4) * 2 + thread_in_group / 2, within = (thread_in_group % 2) * 8;
          uint8_t* const box_rows = tile + box * L::kDqBoxBytes;
          *reinterpret_cast<float2*>(box_rows + local_a * kSwizzleRowBytes + ((piece ^ (local_a % 8)) * 16) + within) =
              make_float2(acc[4 * nt], acc[4 * nt + 1]);
          *reinterpret_cast<float2*>(box_rows + local_b * kSwizzleRowBytes + ((piece ^ (local_b % 8)) * 16) + within) =
              make_float2(acc[4 * nt + 2], acc[4 * nt + 3]);
        }
        // Generic-proxy writes that the copy engine reads next: fence, then the warpgroup's barrier.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warpgroup) : "memory");
        if (issuer) {
#pragma unroll
          for (int box = 0; box < 2; ++box)
            tma_reduce_add(dq_map, column0 + box * 32, h, q0, b, dq_tile + box * L::kDqBoxBytes);
          asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < kChunkColumns / 8; ++nt) {
          if (query_a < seq) reduce_add_pair(dq_a + nt * 8, acc[4 * nt], acc[4 * nt + 1]);
          if (query_b < seq) reduce_add_pair(dq_b + nt * 8, acc[4 * nt + 2], acc[4 * nt + 3]);
        }
      }
    } else if constexpr (kDq == kDqBulk) {
      // A warpgroup with no dQ this item (head_dim 64, its keys unseen) still passes its two named
      // barriers, so that both warpgroups meet the same barriers in the same order each item.
      // Nothing waits on it (bar.sync 1 + w counts only warpgroup w's threads), but
      // compute-sanitizer's racecheck reported hazards between the stats' cp.async writes and their
      // reads (head_dim 64, packed rows, H100, 2026-12-07) where only this warpgroup skipped them.
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warpgroup) : "memory");
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warpgroup) : "memory");
    }
  }

  // The last reduce-adds are complete before the block ends (their shared tile and their writes).
  if constexpr (kDq == kDqBulk) {
    if (thread % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }

  // dK and dV of this thread's two keys, in 16 bits (rows past seq are not written).
  const int64_t kv_stride = static_cast<int64_t>(args.kv_heads) * D;
  const int64_t offset_a = (static_cast<int64_t>(b) * seq + key_a) * kv_stride + static_cast<int64_t>(g) * D +
                           2 * thread_in_group;
  const int64_t offset_b = offset_a + 8 * kv_stride;
  uint32_t* const dk_out = static_cast<uint32_t*>(args.dk);
  uint32_t* const dv_out = static_cast<uint32_t*>(args.dv);
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    if (key_a < seq) {
      dk_out[(offset_a + nt * 8) / 2] = pack2<kBf16>(dk[4 * nt], dk[4 * nt + 1]);
      dv_out[(offset_a + nt * 8) / 2] = pack2<kBf16>(dv[4 * nt], dv[4 * nt + 1]);
    }
    if (key_b < seq) {
      dk_out[(offset_b + nt * 8) / 2] = pack2<kBf16>(dk[4 * nt + 2], dk[4 * nt + 3]);
      dv_out[(offset_b + nt * 8) / 2] = pack2<kBf16>(dv[4 * nt + 2], dv[4 * nt + 3]);
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // an image without the sm_90a code: never launched (hopper_kernel_runs_here), loud if it is
#endif  // MEMTUNE_HOPPER_DEVICE_CODE
}

// ================================ host side =====================================================

template <int D, bool kBf16, int kDq, bool kRows>
bool launch_backward(const AttentionParams& p, const FlashTensors& t, HopperOrder order, int row_group,
                     cudaStream_t stream) {
  constexpr int bytes = BackwardLayout<D, kDq == kDqBulk>::kSharedBytes;
  if (flash_max_shared_per_block() < bytes) return false;
  CUtensorMap q_map, k_map, v_map, do_map, dq_map{};
  if (!encode_head_rows(&q_map, t.q, kBf16, p.batch, p.seq, p.n_heads, D, kBackwardQueries) ||
      !encode_head_rows(&k_map, t.k, kBf16, p.batch, p.seq, p.n_kv_heads, D, kBackwardKeys) ||
      !encode_head_rows(&v_map, t.v, kBf16, p.batch, p.seq, p.n_kv_heads, D, kBackwardKeys) ||
      !encode_head_rows(&do_map, t.d_out, kBf16, p.batch, p.seq, p.n_heads, D, kBackwardQueries))
    return false;
  if (kDq == kDqBulk && !encode_head_rows_f32(&dq_map, t.dq_accum, p.batch, p.seq, p.n_heads, D, kBackwardQueries))
    return false;
  HopperBackwardArgs args;
  args.seq = static_cast<int>(p.seq);
  args.heads = static_cast<int>(p.n_heads);
  args.kv_heads = static_cast<int>(p.n_kv_heads);
  args.kv_group = static_cast<int>(p.n_heads / p.n_kv_heads);
  args.batch = static_cast<int>(p.batch);
  args.scale = p.scale;
  args.scale_log2 = p.scale * kLog2e;
  args.lse = t.lse;
  args.delta = t.delta;
  args.dq_accum = t.dq_accum;
  args.dk = t.dk;
  args.dv = t.dv;
  args.segments = p.segments;
  args.key_blocks = static_cast<int>((p.seq + kBackwardKeys - 1) / kBackwardKeys);
  args.order = order;
  if constexpr (kRows) {
    // Rows a group, unless set: as many groups as hold two waves of blocks (one block an SM) each,
    // the rows shared evenly among them (a small last group would leave its longest blocks to
    // start last; bench/backward_schedule.py counts the tails).
    const int rows = args.kv_heads * args.batch;
    const int wave_rows = (2 * flash_multiprocessors() + args.key_blocks - 1) / args.key_blocks;
    const int groups = std::max(1, rows / wave_rows);
    args.group_rows = std::clamp(row_group > 0 ? row_group : (rows + groups - 1) / groups, 1, rows);
  }
  const unsigned blocks = static_cast<unsigned>(args.key_blocks * p.n_kv_heads * p.batch);
  auto launch = [&](auto kernel) {
    allow_shared(kernel, bytes);
    kernel<<<blocks, kBackwardThreads, bytes, stream>>>(q_map, k_map, v_map, do_map, dq_map, args);
  };
  if (p.segments != nullptr) launch(flash_backward_hopper<D, kBf16, true, kDq, kRows>);
  else launch(flash_backward_hopper<D, kBf16, false, kDq, kRows>);
  MT_CUDA_CHECK_LAUNCH();
  return true;
}

}  // namespace

bool flash_backward_hopper_serves(const AttentionParams& p, const FlashTensors& t) {
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  const DType type = t.q_type;
  if (type != DType::bf16 && type != DType::f16) return false;
  if (t.k_type != type || t.v_type != type || t.d_out_type != type || t.dk_type != type || t.dv_type != type)
    return false;
  if (!aligned16(t.q) || !aligned16(t.k) || !aligned16(t.v) || !aligned16(t.d_out) || !aligned16(t.dk) ||
      !aligned16(t.dv) || !aligned16(t.dq_accum))
    return false;
  if (t.lse == nullptr || t.delta == nullptr) return false;
  if (p.batch < 1 || p.seq < 1 || p.n_kv_heads < 1 || p.n_heads % p.n_kv_heads != 0) return false;
  // 32-bit coordinates and block arithmetic; one grid dimension.
  const int64_t blocks = (p.seq + kBackwardKeys - 1) / kBackwardKeys * p.n_kv_heads * p.batch;
  if (p.seq > INT_MAX - kBackwardKeys || p.n_heads > INT_MAX || blocks > INT_MAX) return false;
  return hopper_kernel_runs_here<flash_backward_hopper<128, true, false, kDqPairs, false>>();
}

bool launch_flash_backward_hopper(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream) {
  if (!flash_backward_hopper_serves(p, t)) return false;
  const FlashVersions versions = flash_versions();
  const HopperDq dq = versions.backward_hopper_dq;
  const HopperOrder order = versions.backward_hopper_order;
  const int row_group = versions.backward_hopper_row_group;
  auto launch = [&](auto dq_mode, auto rows) {
    constexpr int kDq = decltype(dq_mode)::value;
    constexpr bool kRows = decltype(rows)::value;
    const bool bf16 = t.q_type == DType::bf16;
    if (p.head_dim == 64)
      return bf16 ? launch_backward<64, true, kDq, kRows>(p, t, order, row_group, stream)
                  : launch_backward<64, false, kDq, kRows>(p, t, order, row_group, stream);
    return bf16 ? launch_backward<128, true, kDq, kRows>(p, t, order, row_group, stream)
                : launch_backward<128, false, kDq, kRows>(p, t, order, row_group, stream);
  };
  // The 2-float reductions are built in the keys_first order only, the rows_* orders with the bulk
  // way only (HopperOrder).
  if (dq == HopperDq::pairs) return launch(std::integral_constant<int, kDqPairs>{}, std::false_type{});
  if (order == HopperOrder::keys_first) return launch(std::integral_constant<int, kDqBulk>{}, std::false_type{});
  return launch(std::integral_constant<int, kDqBulk>{}, std::true_type{});
}

}  // namespace memtune::cuda
