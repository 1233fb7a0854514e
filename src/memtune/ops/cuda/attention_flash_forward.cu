// FlashAttention-2 on the GPU, forward (Dao, arXiv 2307.08691; SPECS.md §7): causal GQA attention
// that saves only O and the fp32 logsumexp, with segments (packed sequences). The backward is
// attention_flash_backward.cu; what both use (tiles, mma, constants) is attention_flash_tiles.cuh.
//
// Tensor-core kernel (head_dim 64 and 128, q/k/v all bf16 or all f16, 16-byte aligned; "forward
// v2", flash_forward_tc2): 128 queries per block, 4 warps of 32 rows (two m16 tiles share each
// K/V fragment), 64 keys per block (32 where shared memory is short), K/V double-buffered one key
// block ahead, Q read from shared memory per key block, warps above the diagonal skip the block;
// on packed rows the key loop starts at the first block that a query of the block can see.
// Per key block S = Q K^T, the online softmax in the exp2 domain (scores times scale * log2 e),
// and O += P V with P taken straight from the S accumulators (an m16n8 C fragment pair is an
// m16k16 A fragment); O is rescaled only when a row's max moves by more than 2^8. Blocks run
// heaviest (last) query blocks first.
// Generic kernel (any even head_dim up to 256, any float dtypes, any alignment, and shapes past
// the tensor-core kernel's 32-bit grid): one warp per query row, fp32 throughout. Simple, and the
// reference the tests hold the tensor-core path against as well as the CPU.
// On a compute capability 9.0 device, attention_flash_forward runs the Hopper forward instead
// (attention_hopper_forward.cu: wgmma + TMA) where that serves the call, unless
// MEMTUNE_FLASH_FORWARD=v2 or FlashVersions::forward_hopper says not to.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <iterator>

#include "memtune/ops/cuda/attention_flash.h"
#include "memtune/ops/cuda/attention_flash_tiles.cuh"
#include "memtune/ops/cuda/attention_hopper.h"

namespace memtune::cuda {
namespace {

// ================================ generic kernel ================================================

__global__ void __launch_bounds__(kGenericWarps * 32)
    flash_forward_generic(AttentionParams p, FlashTensors t) {
  const int lane = threadIdx.x & 31;
  GenericQueryRow query;
  if (!generic_query_row(p, query)) return;
  const int64_t i = query.i, h = query.h, b = query.b, g = query.g, d = p.head_dim;
  const int32_t* segments_row = query.segments_row;
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

// ================================ tensor-core kernel ============================================

// The tensor-core forward ("forward v2"; its 64-query predecessor, v1, is gone): 128 queries per
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

// The first key that a query tile of forward v2 can see on a packed row (segment_reach with the
// block's threads), out of line: inlined into the kSegments kernels, ptxas spilled 32 bytes at
// D = 128 x 64 keys on sm_90 (5 reloads per key block, as many as before the search existed);
// called, 4 bytes (1 reload).
template <int kTile>
__device__ __noinline__ int first_visible_key(const int32_t* ids, int seq, int first, int count,
                                              int32_t* scratch) {
  return segment_reach<kThreads, kTile, true>(ids, seq, first, count, scratch);
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
  // The first key block that any query of the block sees: 0, or on packed rows the block of the
  // earliest key whose id is one of the queries' (segment_reach, attention_flash_tiles.cuh). The
  // blocks before it are wholly masked: skipping them leaves every row's max, sum and O exactly
  // as those blocks left them (-inf, 0, 0). Searched while Q is on its way, in K's first buffer
  // (its first load comes after the search's last barrier).
  int kb_first = 0;
  if constexpr (kSegments) {
    for (int e = threadIdx.x; e < kFwdRows; e += kThreads)
      query_segments[e] = q0 + e < seq ? segments_row[q0 + e] : 0;
    static_assert(segment_reach_scratch_words<kFwdRows>() * 4 <= kKeys * kRowBytes, "scratch");
    if (q0 >= kKeys) {  // else the first block is block 0 anyway
      const int rows = static_cast<int>(seq - q0 < kFwdRows ? seq - q0 : kFwdRows);
      int32_t* scratch = reinterpret_cast<int32_t*>(shared + kFwdRows * kStride);  // K, buffer 0
      kb_first = first_visible_key<kFwdRows>(segments_row, static_cast<int>(seq),
                                             static_cast<int>(q0), rows, scratch) /
                 kKeys;
    }
  }
  // Key blocks are double-buffered by parity (block kb in buffer kb & 1), so the first one goes
  // to its parity's buffer.
  {
    const uint32_t first_buffer = (kb_first & 1) * kBufferBytes;
    const int k_first = kb_first * kKeys;
    load_kv_block<D, kKeys>(k_tile + first_buffer, v_tile + first_buffer, shared_thread, k_thread,
                            v_thread, kv_stride, k_first, static_cast<int>(seq) - k_first);
    cp_async_commit();
    if constexpr (kSegments) {
      int32_t* first_segments = key_segments + (kb_first & 1) * kKeys;
      for (int e = threadIdx.x; e < kKeys; e += kThreads)
        first_segments[e] = k_first + e < seq ? segments_row[k_first + e] : 0;
    }
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
  for (int kb = kb_first; kb < key_blocks; ++kb) {
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
  // with its O rows (no block barrier) and store them to global memory in 16-byte pieces. A lane
  // writes rows that other lanes' addresses fed to ldmatrix: the warp barrier orders those reads
  // before these writes (compute-sanitizer racecheck reported the pair without it).
  __syncwarp();
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

// ================================ dispatch =====================================================

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

// The tensor-core forward at the largest key block that the device's shared memory holds; false
// where it cannot run (then the generic kernel does). It takes 32-bit key offsets and one grid
// dimension; with 32 keys its shared memory (70 KiB at D = 128) fits every sm_80+ opt-in limit,
// with 64 (103 KiB) only sm_80's and sm_90's.
template <int D, bool kBf16>
bool launch_forward(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream,
                    const FlashVersions& versions) {
  const int available = flash_max_shared_per_block();
  const int64_t blocks = (p.seq + kFwdRows - 1) / kFwdRows * p.n_heads * p.batch;
  if (p.seq > 0x7fffffff || blocks > 0x7fffffff || forward2_shared_bytes<D, 32>() > available)
    return false;
  if (versions.forward_keys == 32 || forward2_shared_bytes<D, 64>() > available) {
    launch_forward_tc2<D, kBf16, 32>(p, t, stream, versions);
  } else {
    launch_forward_tc2<D, kBf16, 64>(p, t, stream, versions);
  }
  return true;
}

}  // namespace

namespace {

// The current device's value of an attribute that does not change while the process runs, cached
// per device in `cached` (one array per attribute).
constexpr int kCachedDevices = 64;
int cached_device_attribute(cudaDeviceAttr attribute, std::atomic<int> (&cached)[kCachedDevices]) {
  int device = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kCachedDevices) device = kCachedDevices - 1;  // beyond 64 GPUs: any one's value is a guess
  int value = cached[device].load(std::memory_order_relaxed);
  if (value == 0) {
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
    cached[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

}  // namespace

// attention_flash_tiles.cuh.
int flash_max_shared_per_block() {
  static std::atomic<int> cached[kCachedDevices] = {};
  return cached_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, cached);
}

int flash_multiprocessors() {
  static std::atomic<int> cached[kCachedDevices] = {};
  return cached_device_attribute(cudaDevAttrMultiProcessorCount, cached);
}

namespace {

// The value that environment variable `name` names among `choices` (unset: `unset`). Any other
// value aborts, naming the values it takes: a mistyped switch would silently time or bisect the
// wrong kernel.
template <typename T>
struct EnvironmentValue {
  const char* name;
  T value;
};
template <typename T, size_t N>
T environment_choice(const char* name, T unset, const EnvironmentValue<T> (&choices)[N]) {
  const char* value = std::getenv(name);
  if (value == nullptr) return unset;
  std::string names;
  for (size_t i = 0; i < N; ++i) {
    if (std::strcmp(value, choices[i].name) == 0) return choices[i].value;
    names += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::string(choices[i].name);
  }
  const std::string what = std::string(name) + " takes " + names;
  cuda_check_failed(("getenv(\"" + std::string(name) + "\")").c_str(), "environment", what.c_str(), __FILE__,
                    __LINE__);
}

// MEMTUNE_FLASH_FORWARD, read once: unset or "hopper" (the Hopper forward where it serves the
// call), "hopper-overlap" (its kernel with the intra-warpgroup pipelining) or "v2" (forward v2).
struct ForwardChoice {
  bool hopper = FlashVersions{}.forward_hopper;
  bool overlap = FlashVersions{}.forward_hopper_overlap;
};
const ForwardChoice& forward_environment() {
  static const ForwardChoice choice = environment_choice<ForwardChoice>(
      "MEMTUNE_FLASH_FORWARD", ForwardChoice{},
      {{"v2", {false, false}}, {"hopper", {true, false}}, {"hopper-overlap", {true, true}}});
  return choice;
}

// Whether the Hopper forward may run, and which of its kernels: their start values from the environment.
std::atomic<bool>& forward_hopper_flag() {
  static std::atomic<bool> flag{forward_environment().hopper};
  return flag;
}

std::atomic<bool>& forward_hopper_overlap_flag() {
  static std::atomic<bool> flag{forward_environment().overlap};
  return flag;
}

// MEMTUNE_FLASH_BACKWARD, read once: unset or "hopper" (the Hopper backward, dQ by bulk
// reduce-adds of shared-memory tiles), "hopper-pairs" (dQ by 2-float reductions, in the keys_first
// order) or "v2" (backward v2).
struct BackwardChoice {
  bool hopper = true;
  HopperDq dq = FlashVersions{}.backward_hopper_dq;
};
const BackwardChoice& backward_environment() {
  static const BackwardChoice choice = environment_choice<BackwardChoice>(
      "MEMTUNE_FLASH_BACKWARD", BackwardChoice{},
      {{"v2", {false, FlashVersions{}.backward_hopper_dq}}, {"hopper", {}}, {"hopper-pairs", {true, HopperDq::pairs}}});
  return choice;
}

// Whether the Hopper backward may run, and how it adds dQ: their start values from the environment.
std::atomic<bool>& backward_hopper_flag() {
  static std::atomic<bool> flag{backward_environment().hopper};
  return flag;
}

std::atomic<HopperDq>& backward_dq_value() {
  static std::atomic<HopperDq> mode{backward_environment().dq};
  return mode;
}

// The Hopper backward's order (MEMTUNE_FLASH_BACKWARD_ORDER: "keys", "rising", "falling"; unset,
// FlashVersions' default), read once.
std::atomic<HopperOrder>& backward_order_value() {
  static std::atomic<HopperOrder> order{[] {
    EnvironmentValue<HopperOrder> choices[std::size(kHopperOrderNames)];
    for (size_t i = 0; i < std::size(kHopperOrderNames); ++i)
      choices[i] = {kHopperOrderNames[i].name, kHopperOrderNames[i].order};
    return environment_choice("MEMTUNE_FLASH_BACKWARD_ORDER", FlashVersions{}.backward_hopper_order, choices);
  }()};
  return order;
}

std::atomic<int>& backward_row_group_value() {
  static std::atomic<int> rows{FlashVersions{}.backward_hopper_row_group};
  return rows;
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
  versions.forward_hopper = forward_hopper_flag().load(std::memory_order_relaxed);
  versions.forward_hopper_overlap = forward_hopper_overlap_flag().load(std::memory_order_relaxed);
  versions.backward_hopper = backward_hopper_flag().load(std::memory_order_relaxed);
  versions.backward_hopper_dq = backward_dq_value().load(std::memory_order_relaxed);
  versions.backward_hopper_order = backward_order_value().load(std::memory_order_relaxed);
  versions.backward_hopper_row_group = backward_row_group_value().load(std::memory_order_relaxed);
  versions.forward_keys = forward_keys_value().load(std::memory_order_relaxed);
  versions.forward_grid_per_head = forward_grid_per_head_flag().load(std::memory_order_relaxed);
  versions.forward_rescale_always = forward_rescale_always_flag().load(std::memory_order_relaxed);
  versions.forward_rescale_slack = forward_rescale_slack_value().load(std::memory_order_relaxed);
  return versions;
}

void set_flash_versions(const FlashVersions& versions) {
  forward_hopper_flag().store(versions.forward_hopper, std::memory_order_relaxed);
  forward_hopper_overlap_flag().store(versions.forward_hopper_overlap, std::memory_order_relaxed);
  backward_hopper_flag().store(versions.backward_hopper, std::memory_order_relaxed);
  backward_dq_value().store(versions.backward_hopper_dq, std::memory_order_relaxed);
  backward_order_value().store(versions.backward_hopper_order, std::memory_order_relaxed);
  backward_row_group_value().store(versions.backward_hopper_row_group, std::memory_order_relaxed);
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
  const FlashVersions versions = flash_versions();
  // The Hopper forward where it serves the call: a compute capability 9.0 device (asked once per
  // device), this build's sm_90a object, head_dim 64/128 in bf16/f16 (attention_hopper.h).
  if (versions.forward_hopper && launch_flash_forward_hopper(p, t, stream)) return;
  if (attention_flash_uses_tensor_cores(p, t, false)) {
    const bool bf16 = t.q_type == DType::bf16;
    bool launched;
    if (p.head_dim == 64) {
      launched = bf16 ? launch_forward<64, true>(p, t, stream, versions)
                      : launch_forward<64, false>(p, t, stream, versions);
    } else {
      launched = bf16 ? launch_forward<128, true>(p, t, stream, versions)
                      : launch_forward<128, false>(p, t, stream, versions);
    }
    if (launched) return;
  }
  flash_forward_generic<<<warp_rows_grid(p.batch * p.n_heads * p.seq), kGenericWarps * 32, 0,
                          stream>>>(p, t);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace memtune::cuda
