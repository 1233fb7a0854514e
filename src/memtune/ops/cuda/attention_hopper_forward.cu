// The Hopper forward of flash attention (issue 23, first step): forward v2's algorithm
// (attention_flash_forward.cu: causal GQA, online softmax in the exp2 domain, O and the fp32
// logsumexp saved) on Hopper's own machinery, compiled for sm_90a only (CMakeLists.txt):
//  - both GEMMs are wgmma (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
//    S = Q K^T with Q and K read by the tensor cores straight from shared memory, and O += P V
//    with P from registers (the S accumulators, rounded to 16 bits, are already wgmma's A
//    fragment) and V from shared memory read transposed (imm-trans-b: V's rows are the K
//    dimension of that GEMM, stored N-major);
//  - Q, K and V arrive by TMA (cp.async.bulk.tensor) into the 128-byte swizzled layout that the
//    wgmma descriptors describe, completing on mbarriers; K/V are double-buffered, the next key
//    block requested while this one computes. O leaves by TMA too, through Q's shared memory.
// Packed rows (segment ids) as forward v2 takes them: the ids of each key block are staged in
// shared memory beside its K/V stage, keys of another id are masked, and the key loop starts at
// the first block that a query of the block sees (segment_reach).
// Block: 128 queries, two warpgroups of 64 rows (one m64 wgmma tile each), 128 keys per key
// block. No warp specialisation yet: thread 0 issues the copies between its own math, and one
// __syncthreads per key block tells it that both warpgroups are done with a buffer (a later step:
// FA3's producer warp + setmaxnreg). Two kernels of one template (kOverlap; the launcher picks by
// FlashVersions::forward_hopper_overlap, MEMTUNE_FLASH_FORWARD=hopper-overlap):
//  - the default waits for each wgmma group before its results are used, key blocks rising;
//  - the pipelined one (FA3's intra-warpgroup overlap) issues one block's S = Q K^T together with
//    the block before's O += P V and softmaxes the first while the tensor cores run the second,
//    key blocks falling (the diagonal block first, alone); its comment in the kernel says what
//    keeps ptxas from undoing the overlap. Not yet timed on a GPU.
//
// Shared memory (base aligned to 1024 bytes, the period of the 128-byte swizzle):
//   Q [2 column chunks at D = 128][128 rows][128 bytes], then two stages of K and V, each
//   [chunks][128 keys][128 bytes], then the mbarriers. A row of a 64-column chunk is 128 bytes,
//   whose 16-byte pieces are permuted by XOR with (row % 8): TMA's CU_TENSOR_MAP_SWIZZLE_128B
//   writes exactly the layout that a wgmma descriptor with swizzle mode 128B reads.
#include <climits>

#include "memtune/ops/cuda/attention_flash.h"
#include "memtune/ops/cuda/attention_flash_tiles.cuh"
#include "memtune/ops/cuda/attention_hopper.h"
#include "memtune/ops/cuda/attention_hopper_common.cuh"

namespace memtune::cuda {
namespace {

constexpr int kHopperQueries = 128;   // queries per block: two warpgroups of 64 rows
constexpr int kHopperKeys = 128;      // keys per key block (the N of S = Q K^T)
constexpr int kHopperThreads = 256;   // two warpgroups

// Byte offsets inside the block's shared memory (from its 1024-aligned base).
template <int D>
struct HopperLayout {
  static constexpr int kChunks = D / kChunkColumns;
  static constexpr uint32_t kQChunkBytes = kHopperQueries * kSwizzleRowBytes;
  static constexpr uint32_t kKvChunkBytes = kHopperKeys * kSwizzleRowBytes;
  static constexpr uint32_t kQBytes = kChunks * kQChunkBytes;
  static constexpr uint32_t kKvBytes = kChunks * kKvChunkBytes;  // one K or one V tile
  static constexpr uint32_t kStages = kQBytes;  // Q at 0; stage s: K at kStages + s * 2 * kKvBytes, V after it
  static constexpr uint32_t kBarriers = kStages + 4 * kKvBytes;  // q, k[2], v[2]: 8 bytes each
  // A word that the pipelined kernel stores its row sums into each key block, never read (see
  // flash_forward_hopper's kOverlap), in the 64 bytes left for the barriers.
  static constexpr uint32_t kSink = kBarriers + 48;
  // Packed rows only: the segment ids of the keys of both stages (i32 [2][kHopperKeys]), then
  // segment_reach's scratch.
  static constexpr uint32_t kKeyIds = kBarriers + 64;
  static constexpr uint32_t kReachScratch = kKeyIds + 2 * kHopperKeys * 4;
  static constexpr int kSharedBytes =
      static_cast<int>(kReachScratch + segment_reach_scratch_words<kHopperQueries>() * 4) + 1024;  // + alignment slack
};

struct HopperForwardArgs {
  int seq = 0, heads = 0, kv_group = 1, batch = 0, query_blocks = 0;
  float scale_log2 = 0.0f;  // softmax scale times log2 e
  float* lse = nullptr;     // f32 [batch, heads, seq], natural log
  const int32_t* segments = nullptr;  // i32 [batch, seq] (kSegments), else null
};

#ifdef MEMTUNE_HOPPER_DEVICE_CODE

// Requests the K tile of key block `block` into `stage`'s K buffer; called by one thread.
template <int D>
__device__ __forceinline__ void request_keys(const CUtensorMap& k_map, uint32_t base, int stage, int block, int kv_head,
                                             int batch_row) {
  using L = HopperLayout<D>;
  const uint32_t k_tile = base + L::kStages + stage * 2 * L::kKvBytes;
  const uint32_t k_full = base + L::kBarriers + 8 * (1 + stage);
  mbarrier_expect_bytes(k_full, L::kKvBytes);  // the whole box counts, zero-filled rows too
#pragma unroll
  for (int c = 0; c < L::kChunks; ++c)
    tma_load(k_tile + c * L::kKvChunkBytes, k_map, c * kChunkColumns, kv_head, block * kHopperKeys, batch_row, k_full);
}

// The same for the V tile, into `stage`'s V buffer.
template <int D>
__device__ __forceinline__ void request_values(const CUtensorMap& v_map, uint32_t base, int stage, int block,
                                               int kv_head, int batch_row) {
  using L = HopperLayout<D>;
  const uint32_t v_tile = base + L::kStages + stage * 2 * L::kKvBytes + L::kKvBytes;
  const uint32_t v_full = base + L::kBarriers + 8 * (1 + stage) + 16;
  mbarrier_expect_bytes(v_full, L::kKvBytes);
#pragma unroll
  for (int c = 0; c < L::kChunks; ++c)
    tma_load(v_tile + c * L::kKvChunkBytes, v_map, c * kChunkColumns, kv_head, block * kHopperKeys, batch_row, v_full);
}

// Requests key block `block` (K, then V) into `stage`; called by one thread.
template <int D>
__device__ __forceinline__ void request_key_block(const CUtensorMap& k_map, const CUtensorMap& v_map,
                                                  uint32_t base, int stage, int block, int kv_head,
                                                  int batch_row) {
  request_keys<D>(k_map, base, stage, block, kv_head, batch_row);
  request_values<D>(v_map, base, stage, block, kv_head, batch_row);
}

// The steps of one key block, shared by both kernels (flash_forward_hopper's kOverlap): each is
// the statements the kernel had in line, so the kernel without the overlap is the same code.

// Issues S = Q K^T (64 x 128 per warpgroup, D / 16 k-steps) into `s`, uncommitted; the caller
// fences before and commits after. Q is K-major in this warpgroup's rows; k-step kk of 16 columns
// lies in chunk kk / 4 at byte 32 * (kk % 4) of each swizzled row, in Q's tile and K's alike.
template <int D, bool kBf16>
__device__ __forceinline__ void issue_scores(float (&s)[kHopperKeys / 2], uint64_t q_descriptor, uint32_t k_tile) {
  using L = HopperLayout<D>;
  const uint64_t k_descriptor = swizzled_descriptor(k_tile, 16, kSwizzlePeriodBytes);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t q_step = (kk / 4) * L::kQChunkBytes + (kk % 4) * 32;
    const uint32_t k_step = (kk / 4) * L::kKvChunkBytes + (kk % 4) * 32;
    wgmma_m64_shared<kHopperKeys, kBf16>(s, q_descriptor + (q_step >> 4), k_descriptor + (k_step >> 4), kk > 0);
  }
}

// Issues O += P V (uncommitted, the caller fences and commits): V is [keys][head_dim] with
// head_dim contiguous, the N-major form of B (16 keys x D); k-step kc starts 16 rows (2048 bytes,
// two swizzle periods) further.
template <int D, bool kBf16>
__device__ __forceinline__ void issue_values(float (&o)[D / 2], const uint32_t (&p)[kHopperKeys / 16][4],
                                             uint32_t v_tile) {
  using L = HopperLayout<D>;
  const uint64_t v_descriptor = swizzled_descriptor(v_tile, L::kKvChunkBytes, kSwizzlePeriodBytes);
#pragma unroll
  for (int kc = 0; kc < kHopperKeys / 16; ++kc)
    wgmma_m64_registers<D, kBf16>(o, p[kc], v_descriptor + ((kc * 16 * kSwizzleRowBytes) >> 4));
}

// Whether a key block needs the mask for a warp whose first row is `warp_q0`: where some key of
// the block lies past that row, and on packed rows everywhere (keys of other segments).
template <bool kSegments>
__device__ __forceinline__ bool block_needs_mask(int k0, int warp_q0) {
  return kSegments || k0 + kHopperKeys - 1 > warp_q0;
}

// The mask: -inf for the keys past each row (causal) and, on packed rows, for the keys whose id
// (`block_ids`) is not the row's. Keys past seq (zero-filled by TMA) lie past every valid query,
// so the causal mask hides them too.
template <bool kSegments>
__device__ __forceinline__ void mask_scores(float (&s)[kHopperKeys / 2], int k0, int query_a, int query_b,
                                            int thread_in_group, const int32_t* block_ids, int32_t id_a,
                                            int32_t id_b) {
#pragma unroll
  for (int nt = 0; nt < kHopperKeys / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int column = nt * 8 + 2 * thread_in_group + e;
      const int key = k0 + column;
      bool hide_a = key > query_a, hide_b = key > query_b;
      if constexpr (kSegments) {
        const int32_t key_id = block_ids[column];
        hide_a = hide_a || key_id != id_a;
        hide_b = hide_b || key_id != id_b;
      }
      if (hide_a) s[4 * nt + e] = -INFINITY;
      if (hide_b) s[4 * nt + 2 + e] = -INFINITY;
    }
}

// Online softmax on raw scores (forward v2's form): max first, then one FFMA and one ex2 per
// probability, in place in `s`. The four threads of a quad hold one row between them. The rows'
// max and sum move on; `correction` is what O (of the blocks before) is to be multiplied by.
__device__ __forceinline__ void online_softmax(float (&s)[kHopperKeys / 2], float (&row_max)[2],
                                               float (&row_sum)[2], float (&correction)[2], float scale_log2) {
  float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < kHopperKeys / 8; ++nt) {
    block_max[0] = fmaxf(block_max[0], fmaxf(s[4 * nt], s[4 * nt + 1]));
    block_max[1] = fmaxf(block_max[1], fmaxf(s[4 * nt + 2], s[4 * nt + 3]));
  }
  float base_max[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float m = block_max[half];
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const float new_max = fmaxf(row_max[half], m * scale_log2);
    // A row that has seen nothing yet keeps max -inf; subtracting 0 then keeps exp2 at 0
    // instead of exp2(-inf - -inf) = NaN.
    base_max[half] = new_max == -INFINITY ? 0.0f : new_max;
    correction[half] = exp2_approx(row_max[half] - base_max[half]);
    row_max[half] = new_max;
  }
  float local_sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < kHopperKeys / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int half = e / 2;
      s[4 * nt + e] = exp2_approx(fmaf(s[4 * nt + e], scale_log2, -base_max[half]));
      local_sum[half] += s[4 * nt + e];
    }
  row_sum[0] = row_sum[0] * correction[0] + local_sum[0];
  row_sum[1] = row_sum[1] * correction[1] + local_sum[1];
}

// P in 16 bits as wgmma's A fragments: k-step kc (keys 16 kc .. 16 kc + 15) is the C fragments of
// n8 tiles 2 kc and 2 kc + 1, as in forward v2's mma.sync.
template <bool kBf16>
__device__ __forceinline__ void pack_probabilities(const float (&s)[kHopperKeys / 2],
                                                   uint32_t (&p)[kHopperKeys / 16][4]) {
#pragma unroll
  for (int kc = 0; kc < kHopperKeys / 16; ++kc) {
    p[kc][0] = pack2<kBf16>(s[8 * kc + 0], s[8 * kc + 1]);
    p[kc][1] = pack2<kBf16>(s[8 * kc + 2], s[8 * kc + 3]);
    p[kc][2] = pack2<kBf16>(s[8 * kc + 4], s[8 * kc + 5]);
    p[kc][3] = pack2<kBf16>(s[8 * kc + 6], s[8 * kc + 7]);
  }
}

template <int D>
__device__ __forceinline__ void rescale_output(float (&o)[D / 2], const float (&correction)[2]) {
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] *= correction[(i / 2) % 2];
}

#endif  // MEMTUNE_HOPPER_DEVICE_CODE

// __launch_bounds__(256, 1): one block of 256 threads an SM (its shared memory allows no second
// at D = 128), so ptxas may give each thread up to 255 registers. kSegments: packed rows
// (args.segments, forward v2's representation): a query sees a key only where their ids are
// equal, and the key loop starts at the first block that a query of the block can see. kOverlap:
// FlashAttention-3's intra-warpgroup pipelining of the key loop (one block's softmax under the
// block before's O += P V; FlashVersions::forward_hopper_overlap), else each wgmma group is waited
// for at once.
template <int D, bool kBf16, bool kSegments, bool kOverlap>
__global__ void __launch_bounds__(kHopperThreads, 1)
    flash_forward_hopper(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                         const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap out_map,
                         HopperForwardArgs args) {
#ifdef MEMTUNE_HOPPER_DEVICE_CODE
  using L = HopperLayout<D>;
  extern __shared__ uint8_t shared_raw[];
  const uint32_t raw_address = shared_address(shared_raw);
  const uint32_t base = (raw_address + kSwizzlePeriodBytes - 1) & ~(kSwizzlePeriodBytes - 1);
  uint8_t* const base_pointer = shared_raw + (base - raw_address);
  const uint32_t q_full = base + L::kBarriers;

  // Heaviest (last) query blocks first over the whole grid, as forward v2: the short causal
  // blocks fill the tail.
  const int heads_batch = args.heads * args.batch;
  const int from_last = static_cast<int>(blockIdx.x) / heads_batch;
  const int head_row = static_cast<int>(blockIdx.x) % heads_batch;
  const int q_block = args.query_blocks - 1 - from_last;
  const int h = head_row % args.heads, b = head_row / args.heads, kv_head = h / args.kv_group;
  const int q0 = q_block * kHopperQueries;
  const int seq = args.seq;

  const int thread = static_cast<int>(threadIdx.x);
  const int warpgroup = thread / 128, warp = (thread / 32) % 4, lane = thread % 32;
  const int group_id = lane / 4, thread_in_group = lane % 4;
  // This thread's two rows (the m16n8 C-fragment rows of its warp), within the warpgroup's 64.
  const int row_a = warp * 16 + group_id, row_b = row_a + 8;
  const int warpgroup_q0 = q0 + warpgroup * kWarpgroupRows;
  const int query_a = warpgroup_q0 + row_a, query_b = warpgroup_q0 + row_b;
  const int last_query = min(q0 + kHopperQueries, seq) - 1;
  const int key_blocks = last_query / kHopperKeys + 1;
  const int32_t* const segments_row = kSegments ? args.segments + static_cast<int64_t>(b) * seq : nullptr;
  int32_t* const key_ids = reinterpret_cast<int32_t*>(base_pointer + L::kKeyIds);  // [2][kHopperKeys]
  // On packed rows: the ids of key block `block` into `ids`, by every thread (keys past seq: any
  // id; the causal mask hides them).
  auto stage_key_ids = [&](int32_t* ids, int block) {
    const int k_next = block * kHopperKeys;
    for (int e = thread; e < kHopperKeys; e += kHopperThreads) ids[e] = k_next + e < seq ? segments_row[k_next + e] : 0;
  };

  if (thread == 0) {
    for (int i = 0; i < 5; ++i) mbarrier_init(q_full + 8 * i, 1);
    // The copy engine (the async proxy) must see the initialised barriers.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
  if (thread == 0) {
    mbarrier_expect_bytes(q_full, L::kQBytes);
#pragma unroll
    for (int c = 0; c < L::kChunks; ++c)
      tma_load(base + c * L::kQChunkBytes, q_map, c * kChunkColumns, h, q0, b, q_full);
  }
  // The first key block that any query of the block sees: 0, or on packed rows the block of the
  // earliest key whose id is one of the queries' (segment_reach, attention_flash_tiles.cuh; searched
  // while Q is on its way). The blocks before it are wholly masked for every row: skipping them
  // leaves each row's max, sum and O as those blocks would (-inf, 0, 0).
  int first_block = 0;
  // This thread's two query rows' ids (rows past seq: any id; nothing of theirs is stored).
  int32_t id_a = 0, id_b = 0;
  if constexpr (kSegments) {
    if (q0 >= kHopperKeys) {
      int32_t* const scratch = reinterpret_cast<int32_t*>(base_pointer + L::kReachScratch);
      first_block = segment_reach<kHopperThreads, kHopperQueries, true>(segments_row, seq, q0, last_query - q0 + 1,
                                                                        scratch) /
                    kHopperKeys;
    }
    id_a = query_a < seq ? segments_row[query_a] : 0;
    id_b = query_b < seq ? segments_row[query_b] : 0;
    // The first block's key ids into stage 0, read in the loop after the __syncthreads below.
    stage_key_ids(key_ids, kOverlap ? key_blocks - 1 : first_block);
  }
  // Stages and mbarrier phases count iterations from the first block run (first_block; with
  // kOverlap the last, key_blocks - 1, as the key loop runs falling there): iteration i uses
  // stage i & 1, whose barriers complete for the (i >> 1)-th time.
  if (thread == 0) request_key_block<D>(k_map, v_map, base, 0, kOverlap ? key_blocks - 1 : first_block, kv_head, b);
  if constexpr (kSegments) __syncthreads();

  // Q (A of S = Q K^T) for this warpgroup's 64 rows, K-major (issue_scores).
  const uint64_t q_descriptor =
      swizzled_descriptor(base + warpgroup * kWarpgroupRows * kSwizzleRowBytes, 16, kSwizzlePeriodBytes);

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  // Row state for row_a and row_b; the max in the exp2 domain (scores times scale * log2 e).
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  mbarrier_wait(q_full, 0);
  if constexpr (!kOverlap) {
#pragma unroll 1
    for (int block = first_block; block < key_blocks; ++block) {
      const int iteration = block - first_block;
      const int stage = iteration & 1;
      const uint32_t parity = (iteration >> 1) & 1;
      // The other stage was last read by the previous block, which every warpgroup finished
      // before the barrier that ended it: refill it with the next block while this one computes
      // (on packed rows its key ids too: plain stores, read after this iteration's barrier).
      if (thread == 0 && block + 1 < key_blocks)
        request_key_block<D>(k_map, v_map, base, stage ^ 1, block + 1, kv_head, b);
      if constexpr (kSegments) {
        if (block + 1 < key_blocks) stage_key_ids(key_ids + (stage ^ 1) * kHopperKeys, block + 1);
      }
      const uint32_t k_tile = base + L::kStages + stage * 2 * L::kKvBytes, v_tile = k_tile + L::kKvBytes;
      const uint32_t k_full = base + L::kBarriers + 8 * (1 + stage), v_full = k_full + 16;

      float s[kHopperKeys / 2];
      mbarrier_wait(k_full, parity);
      pin_registers(s);
      wgmma_fence();
      issue_scores<D, kBf16>(s, q_descriptor, k_tile);
      wgmma_commit();
      wgmma_wait_all();
      pin_registers(s);

      if (block_needs_mask<kSegments>(block * kHopperKeys, warpgroup_q0 + warp * 16))
        mask_scores<kSegments>(s, block * kHopperKeys, query_a, query_b, thread_in_group,
                               key_ids + stage * kHopperKeys, id_a, id_b);
      float correction[2];
      online_softmax(s, row_max, row_sum, correction, args.scale_log2);
      uint32_t p[kHopperKeys / 16][4];
      pack_probabilities<kBf16>(s, p);
      rescale_output<D>(o, correction);

      mbarrier_wait(v_full, parity);
      pin_registers(p);
      pin_registers(o);
      wgmma_fence();
      issue_values<D, kBf16>(o, p, v_tile);
      wgmma_commit();
      wgmma_wait_all();
      pin_registers(o);
      // Both warpgroups are done with this stage: thread 0 may refill it next iteration but one.
      __syncthreads();
    }
  } else {
    // FlashAttention-3's intra-warpgroup overlap (Shah et al. 2024, arXiv 2407.08608, section 3.2
    // and Algorithm 2): the GEMMs of one key block, S = Q K^T, and of the block run before it,
    // O = O * c + P V (c: that block's correction, applied between the two issues), are issued
    // as two wgmma groups; waiting for the first alone (wait_group 1), the warpgroup masks and
    // softmaxes this block's S in place while the tensor cores run the other block's P V, then
    // waits for that (wait_group 0) and only then rounds S into P, over the registers that the
    // P V has just read. Registers: S (fp32) and the P before it (16-bit) live beside O, not
    // two sets of S. The operations on O are the other kernel's (O * c_j + P_j V_j per block).
    // What keeps ptxas from undoing the overlap (each checked in the SASS; ptxas -v warns of
    // the first):
    //  - no branch and no second copy of this loop between a wgmma issue and its wait: either
    //    makes ptxas serialize every wgmma of the kernel (C7513). So the key blocks run
    //    falling, the last first and alone (the diagonal, the only block that the causal mask
    //    touches: as many keys a block as queries), as FlashAttention-3 runs its masked blocks
    //    first, and the loop masks off packed rows never, on them always;
    //  - P rounded after the wait, not into a second array during the softmax: ptxas gave that
    //    array P's own registers, and waited for the P V before the softmax to write them;
    //  - a shared-memory store of the row sums before the wait (below).
    // The falling order adds the same terms in another order than the other kernel: O and the
    // sums agree with it within rounding, not bit for bit.
    // Buffers: iteration i (block j = key_blocks - 1 - i) reads K of block j in stage i & 1 and
    // V of block j + 1 (iteration i - 1's) in stage (i - 1) & 1, so K and V are refilled
    // separately, each one iteration ahead: at the top of iteration i, K of block j - 1 into the
    // other stage (its K was read by iteration i - 1, done before the barrier that ended it) and
    // V of block j into this stage (its V, iteration i - 2's, was read by iteration i - 1's
    // O += P V, likewise done). Barrier phases as above: the n-th fill of a buffer (from 0)
    // completes its barrier's phase n & 1.
    static_assert(kHopperKeys == kHopperQueries, "only the last key block meets the diagonal");
    const int last_block = key_blocks - 1;
    uint32_t p[kHopperKeys / 16][4];  // P of the block run before, O's next addend
    float correction[2];              // that block's correction, O's factor before it adds P V
    {
      // Iteration 0, the last block: S and its softmax; its O = O * c + P V (O is zero) comes
      // with the next iteration's S. Stage 0 holds its K and V (requested above); K of the
      // next block goes into stage 1, whose V the next iteration requests.
      if (thread == 0 && last_block > first_block) request_keys<D>(k_map, base, 1, last_block - 1, kv_head, b);
      if constexpr (kSegments) {
        if (last_block > first_block) stage_key_ids(key_ids + kHopperKeys, last_block - 1);
      }
      float s[kHopperKeys / 2];
      mbarrier_wait(base + L::kBarriers + 8, 0);
      pin_registers(s);
      wgmma_fence();
      issue_scores<D, kBf16>(s, q_descriptor, base + L::kStages);
      wgmma_commit();
      wgmma_wait_all();
      pin_registers(s);
      if (block_needs_mask<kSegments>(last_block * kHopperKeys, warpgroup_q0 + warp * 16))
        mask_scores<kSegments>(s, last_block * kHopperKeys, query_a, query_b, thread_in_group, key_ids, id_a, id_b);
      online_softmax(s, row_max, row_sum, correction, args.scale_log2);
      pack_probabilities<kBf16>(s, p);
      // Both warpgroups are done with stage 0's K (and its key ids).
      __syncthreads();
    }
#pragma unroll 1
    for (int block = last_block - 1; block >= first_block; --block) {
      const int iteration = last_block - block;
      const int stage = iteration & 1;
      const uint32_t parity = (iteration >> 1) & 1, prior_parity = ((iteration - 1) >> 1) & 1;
      if (thread == 0) {
        if (block > first_block) request_keys<D>(k_map, base, stage ^ 1, block - 1, kv_head, b);
        request_values<D>(v_map, base, stage, block, kv_head, b);
      }
      if constexpr (kSegments) {
        if (block > first_block) stage_key_ids(key_ids + (stage ^ 1) * kHopperKeys, block - 1);
      }
      const uint32_t k_tile = base + L::kStages + stage * 2 * L::kKvBytes;
      const uint32_t prior_v_tile = base + L::kStages + (stage ^ 1) * 2 * L::kKvBytes + L::kKvBytes;
      const uint32_t k_full = base + L::kBarriers + 8 * (1 + stage);
      const uint32_t prior_v_full = base + L::kBarriers + 8 * (1 + (stage ^ 1)) + 16;

      float s[kHopperKeys / 2];
      mbarrier_wait(k_full, parity);
      mbarrier_wait(prior_v_full, prior_parity);
      pin_registers(s);
      wgmma_fence();
      issue_scores<D, kBf16>(s, q_descriptor, k_tile);
      wgmma_commit();
      rescale_output<D>(o, correction);  // O is not in flight: the last P V was waited for
      pin_registers(p);
      pin_registers(o);
      wgmma_fence();
      issue_values<D, kBf16>(o, p, prior_v_tile);
      wgmma_commit();
      wgmma_wait<1>();  // S is done; O += P V of the block before may still run
      pin_registers(s);

      if constexpr (kSegments)
        mask_scores<kSegments>(s, block * kHopperKeys, query_a, query_b, thread_in_group,
                               key_ids + stage * kHopperKeys, id_a, id_b);
      online_softmax(s, row_max, row_sum, correction, args.scale_log2);
      // The softmax before the wait: ptxas moves ALU work freely across wgmma.wait_group (it
      // sank all but the max past the wait, and the overlap with it), but not a shared-memory
      // store; the sums depend on every probability, so storing them (to a word that nothing
      // reads) keeps the whole softmax above the wait.
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(base + L::kSink), "f"(row_sum[0] + row_sum[1]) : "memory");
      wgmma_wait<0>();
      pin_registers(o);
      pack_probabilities<kBf16>(s, p);
      // Both warpgroups are done with this stage's K and the other stage's V.
      __syncthreads();
    }
    // The first block's O += P V, from the stage of the last iteration.
    const int last_iteration = last_block - first_block;
    const int stage = last_iteration & 1;
    mbarrier_wait(base + L::kBarriers + 8 * (1 + stage) + 16, (last_iteration >> 1) & 1);
    rescale_output<D>(o, correction);
    pin_registers(p);
    pin_registers(o);
    wgmma_fence();
    issue_values<D, kBf16>(o, p, base + L::kStages + stage * 2 * L::kKvBytes + L::kKvBytes);
    wgmma_commit();
    wgmma_wait_all();
    pin_registers(o);
  }

  // Epilogue: O / sum in 16 bits into this warpgroup's own Q rows (only its wgmmas read them,
  // and they are complete), in the same swizzled layout, then out by TMA, which clips the rows
  // past seq. The 4-byte stores of a warp hit 32 different banks: 8 rows x 4 threads, each row's
  // piece permuted by the XOR with its row.
  float inverse[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    row_sum[half] = sum;
    inverse[half] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  uint8_t* const o_rows = base_pointer + warpgroup * kWarpgroupRows * kSwizzleRowBytes;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int chunk = nt / 8, piece = nt % 8;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = half == 0 ? row_a : row_b;
      const uint32_t packed = pack2<kBf16>(o[4 * nt + 2 * half] * inverse[half], o[4 * nt + 2 * half + 1] * inverse[half]);
      *reinterpret_cast<uint32_t*>(o_rows + chunk * L::kQChunkBytes + row * kSwizzleRowBytes +
                                   ((piece ^ (row % 8)) * 16) + thread_in_group * 4) = packed;
    }
  }
  if (thread_in_group == 0) {
    float* head_lse = args.lse + (static_cast<int64_t>(b) * args.heads + h) * seq;
    if (query_a < seq) head_lse[query_a] = (row_max[0] + log2f(row_sum[0])) * kLn2;
    if (query_b < seq) head_lse[query_b] = (row_max[1] + log2f(row_sum[1])) * kLn2;
  }
  // Generic-proxy writes that the copy engine reads next: fence, then the warpgroup's barrier.
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warpgroup) : "memory");
  if (thread % 128 == 0 && warpgroup_q0 < seq) {
#pragma unroll
    for (int c = 0; c < L::kChunks; ++c)
      tma_store(out_map, c * kChunkColumns, h, warpgroup_q0, b,
                base + c * L::kQChunkBytes + warpgroup * kWarpgroupRows * kSwizzleRowBytes);
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    // The block's shared memory must outlive the copy's reads of it.
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // an image without the sm_90a code: never launched (hopper_kernel_runs_here), loud if it is
#endif  // MEMTUNE_HOPPER_DEVICE_CODE
}

// ================================ host side =====================================================

template <int D, bool kBf16, bool kSegments, bool kOverlap>
void launch_hopper_kernel(const CUtensorMap& q_map, const CUtensorMap& k_map, const CUtensorMap& v_map,
                          const CUtensorMap& out_map, const HopperForwardArgs& args, unsigned blocks,
                          cudaStream_t stream) {
  constexpr int bytes = HopperLayout<D>::kSharedBytes;
  allow_shared(flash_forward_hopper<D, kBf16, kSegments, kOverlap>, bytes);
  flash_forward_hopper<D, kBf16, kSegments, kOverlap>
      <<<blocks, kHopperThreads, bytes, stream>>>(q_map, k_map, v_map, out_map, args);
}

template <int D, bool kBf16>
bool launch_hopper(const AttentionParams& p, const FlashTensors& t, bool overlap, cudaStream_t stream) {
  constexpr int bytes = HopperLayout<D>::kSharedBytes;
  if (flash_max_shared_per_block() < bytes) return false;
  CUtensorMap q_map, k_map, v_map, out_map;
  if (!encode_head_rows(&q_map, t.q, kBf16, p.batch, p.seq, p.n_heads, D, kHopperQueries) ||
      !encode_head_rows(&k_map, t.k, kBf16, p.batch, p.seq, p.n_kv_heads, D, kHopperKeys) ||
      !encode_head_rows(&v_map, t.v, kBf16, p.batch, p.seq, p.n_kv_heads, D, kHopperKeys) ||
      !encode_head_rows(&out_map, t.out, kBf16, p.batch, p.seq, p.n_heads, D, kWarpgroupRows))
    return false;
  HopperForwardArgs args;
  args.seq = static_cast<int>(p.seq);
  args.heads = static_cast<int>(p.n_heads);
  args.kv_group = static_cast<int>(p.n_heads / p.n_kv_heads);
  args.batch = static_cast<int>(p.batch);
  args.query_blocks = static_cast<int>((p.seq + kHopperQueries - 1) / kHopperQueries);
  args.scale_log2 = p.scale * kLog2e;
  args.lse = t.lse;
  args.segments = p.segments;
  const unsigned blocks = static_cast<unsigned>(static_cast<int64_t>(args.query_blocks) * p.n_heads * p.batch);
  const bool packed = p.segments != nullptr;
  if (packed && overlap)
    launch_hopper_kernel<D, kBf16, true, true>(q_map, k_map, v_map, out_map, args, blocks, stream);
  else if (packed)
    launch_hopper_kernel<D, kBf16, true, false>(q_map, k_map, v_map, out_map, args, blocks, stream);
  else if (overlap)
    launch_hopper_kernel<D, kBf16, false, true>(q_map, k_map, v_map, out_map, args, blocks, stream);
  else
    launch_hopper_kernel<D, kBf16, false, false>(q_map, k_map, v_map, out_map, args, blocks, stream);
  MT_CUDA_CHECK_LAUNCH();
  return true;
}

}  // namespace

bool flash_forward_hopper_serves(const AttentionParams& p, const FlashTensors& t) {
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  const DType type = t.q_type;
  if (type != DType::bf16 && type != DType::f16) return false;
  if (t.k_type != type || t.v_type != type || t.out_type != type) return false;
  if (!aligned16(t.q) || !aligned16(t.k) || !aligned16(t.v) || !aligned16(t.out) || t.lse == nullptr) return false;
  if (p.batch < 1 || p.seq < 1 || p.n_kv_heads < 1 || p.n_heads % p.n_kv_heads != 0) return false;
  // 32-bit coordinates and block arithmetic; one grid dimension.
  const int64_t blocks = (p.seq + kHopperQueries - 1) / kHopperQueries * p.n_heads * p.batch;
  if (p.seq > INT_MAX - kHopperQueries || p.n_heads > INT_MAX || blocks > INT_MAX) return false;
  return hopper_kernel_runs_here<flash_forward_hopper<128, true, false, false>>();
}

bool launch_flash_forward_hopper(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream) {
  if (!flash_forward_hopper_serves(p, t)) return false;
  const bool bf16 = t.q_type == DType::bf16;
  // The kernel with FlashAttention-3's intra-warpgroup pipelining where FlashVersions says so.
  const bool overlap = flash_versions().forward_hopper_overlap;
  if (p.head_dim == 64)
    return bf16 ? launch_hopper<64, true>(p, t, overlap, stream) : launch_hopper<64, false>(p, t, overlap, stream);
  return bf16 ? launch_hopper<128, true>(p, t, overlap, stream) : launch_hopper<128, false>(p, t, overlap, stream);
}

}  // namespace memtune::cuda
