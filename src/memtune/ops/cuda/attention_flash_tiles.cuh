// Inside the flash attention kernels (attention_flash_forward.cu and attention_flash_backward.cu):
// what both directions use. Tensor-core tiles are brought into shared memory by cp.async
// (zero-filled past the sequence end), with rows padded by 16 bytes, which puts the eight 16-byte
// rows that one ldmatrix phase reads in eight different bank groups; fragments are loaded with
// ldmatrix (.trans where the operand must be transposed) and multiplied by mma.sync.m16n8k16 with
// fp32 accumulation (PTX ISA, "Warp-level matrix fragments for mma.m16n8k16").
//
// The device helpers have internal linkage on purpose: each kernel file compiles its own copy, as
// when the two directions were one file, and none of this is the backend's interface.
#pragma once

#include <climits>
#include <cstdint>
#include <cstring>

#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {

// The largest dynamic shared memory a block may opt into on the current device, cached per
// device (attention_flash_forward.cu).
int flash_max_shared_per_block();
// The current device's multiprocessor count, cached per device (attention_flash_forward.cu).
int flash_multiprocessors();

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ bool sees(const int32_t* segments_row, int64_t i, int64_t j) {
  return j <= i && (segments_row == nullptr || segments_row[i] == segments_row[j]);
}

// The generic kernels: one warp per query (or key) row, `kGenericWarps` rows per block.
constexpr int kGenericWarps = 4;
constexpr int kMaxPerLane = 8;  // head_dim <= 256

inline unsigned warp_rows_grid(int64_t rows) {
  return static_cast<unsigned>((rows + kGenericWarps - 1) / kGenericWarps);
}

// A generic kernel's query row: warps take the rows of [batch, n_heads, seq] in order (seq
// fastest). Its position i, head h, batch row b, kv head g, and the row's packed-sequence ids.
struct GenericQueryRow {
  int64_t i, h, b, g;
  const int32_t* segments_row;  // null: one sequence per batch row
};

// This warp's query row; false for the warps past the last one.
__device__ __forceinline__ bool generic_query_row(const AttentionParams& p, GenericQueryRow& r) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGenericWarps + (threadIdx.x >> 5);
  if (row >= p.batch * p.n_heads * p.seq) return false;
  r.i = row % p.seq;
  r.h = (row / p.seq) % p.n_heads;
  r.b = row / (p.seq * p.n_heads);
  r.g = r.h / (p.n_heads / p.n_kv_heads);
  r.segments_row = p.segments == nullptr ? nullptr : p.segments + r.b * p.seq;
  return true;
}

constexpr int kBlock = 64;     // rows of a load_tile tile (the forward's Q comes in two of them)
constexpr int kThreads = 128;  // 4 warps: the forward's block

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

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- Packed rows: the range of a row that a tile of tokens can see ----
// With segments (packed rows), token i sees key j only if j <= i and both have the same id. The
// tensor-core kernels walk, for a query tile, the key blocks up to the diagonal (forward), and for
// a key tile, the query blocks from the diagonal to the row's end (backward); on a packed row most
// of those blocks are wholly masked (a query tile in the fourth 2k sample of an 8k row sees no
// key before that sample's first token), and masked blocks cost as much as visible ones.
// segment_reach finds how far back (forward) or ahead (backward) any token of a tile sees, so that
// the kernels visit only the blocks inside that reach. Exact for any ids: in practice ids are
// non-decreasing, but nothing enforces it (the tests cycle them), and a token whose id comes back
// after other ids sees its id's earlier runs too. A block may be skipped only when none of its ids
// is one of the tile's, so every skipped id must be read: the search scans from the row's start
// (end) in chunks of all the block's threads x kSearchLoads independent loads, and stops at the
// first chunk that holds one of the tile's ids; it reads the skipped range rounded up to a chunk,
// no more. (A binary search over non-decreasing ids would first have to prove them
// non-decreasing, which reads the same prefix.) Membership: a range test on the tile's lowest and
// highest ids, then the tile's run ids (one per maximal run of equal ids: 1-3 on real packed rows).
constexpr int kSearchLoads = 16;  // ids per thread per chunk

// The words of shared memory that segment_reach<..., kTile> needs as scratch.
template <int kTile>
constexpr int segment_reach_scratch_words() {
  return 4 + kTile;
}

// Called by all kThreadCount threads of the block (it holds barriers). `ids`: the row's segment
// ids, `seq` tokens; the tile: tokens [first, first + count), 1 <= count <= kTile. kLowest: the
// smallest j such that ids[j] is the id of a tile token i >= j (so j <= first); otherwise the
// largest i such that ids[i] is the id of a tile token j <= i (so i >= first + count - 1).
// `scratch`: segment_reach_scratch_words<kTile>() words of shared memory that nothing else touches
// during the call; free again when it returns (the last barrier comes after its last read).
template <int kThreadCount, int kTile, bool kLowest>
__device__ __forceinline__ int segment_reach(const int32_t* ids, int seq, int first, int count,
                                             int32_t* scratch) {
  int32_t* const run_ids = scratch + 4;
  const int thread = static_cast<int>(threadIdx.x);
  const int none = kLowest ? INT_MAX : -1;
  if (thread == 0) {
    scratch[0] = 0;  // runs
    scratch[1] = INT_MAX;  // the tile's lowest id
    scratch[2] = INT_MIN;  // and highest
    scratch[3] = none;     // the reach
  }
  __syncthreads();
  int32_t low = INT_MAX, high = INT_MIN;
  for (int r = thread; r < count; r += kThreadCount) {
    const int32_t id = ids[first + r];
    low = min(low, id);
    high = max(high, id);
    if (r == 0 || ids[first + r - 1] != id) run_ids[atomicAdd(&scratch[0], 1)] = id;
  }
  low = __reduce_min_sync(0xffffffffu, low);
  high = __reduce_max_sync(0xffffffffu, high);
  if ((thread & 31) == 0) {
    atomicMin(&scratch[1], low);
    atomicMax(&scratch[2], high);
  }
  __syncthreads();
  const int runs = scratch[0];
  low = scratch[1];
  high = scratch[2];
  // Up from 0 to `end`, or down from seq - 1 to `end`: the token at `end` (the tile's first or
  // last) holds a tile id, so the scan stops there at the latest.
  constexpr int kChunk = kThreadCount * kSearchLoads;
  const int end = kLowest ? first : first + count - 1;
#pragma unroll 1
  for (int base = kLowest ? 0 : seq - 1; kLowest ? base <= end : base >= end;
       base += kLowest ? kChunk : -kChunk) {
    int32_t chunk[kSearchLoads];  // all loads first: kSearchLoads in flight per thread
#pragma unroll
    for (int e = 0; e < kSearchLoads; ++e) {
      const int j = kLowest ? base + e * kThreadCount + thread : base - e * kThreadCount - thread;
      chunk[e] = (kLowest ? j <= end : j >= end) ? ids[j] : 0;
    }
    int found = none;
#pragma unroll
    for (int e = 0; e < kSearchLoads; ++e) {
      const int j = kLowest ? base + e * kThreadCount + thread : base - e * kThreadCount - thread;
      const int32_t id = chunk[e];
      if ((kLowest ? j <= end : j >= end) && id >= low && id <= high) {
        bool member = false;
#pragma unroll 1
        for (int r = 0; r < runs && !member; ++r) member = run_ids[r] == id;
        if (member) found = kLowest ? min(found, j) : max(found, j);
      }
    }
    if (found != none) {
      if constexpr (kLowest) {
        atomicMin(&scratch[3], found);
      } else {
        atomicMax(&scratch[3], found);
      }
    }
    if (__syncthreads_or(found != none)) break;  // a barrier: every atomic above has landed
  }
  int reach = scratch[3];
  if (reach == none) reach = kLowest ? 0 : seq - 1;  // unreachable (`end` matches): no skipping
  __syncthreads();  // everyone has read the scratch
  return reach;
}

inline bool aligned16(const void* pointer) { return (reinterpret_cast<uintptr_t>(pointer) & 15) == 0; }

template <typename Kernel>
void allow_shared(Kernel kernel, int bytes) {
  // Set on every launch: cheap, and correct for whichever device is current.
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

}  // namespace
}  // namespace memtune::cuda
