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

#include <cstdint>
#include <cstring>

#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {

// The largest dynamic shared memory a block may opt into on the current device, cached per
// device (attention_flash_forward.cu).
int flash_max_shared_per_block();

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

inline bool aligned16(const void* pointer) { return (reinterpret_cast<uintptr_t>(pointer) & 15) == 0; }

template <typename Kernel>
void allow_shared(Kernel kernel, int bytes) {
  // Set on every launch: cheap, and correct for whichever device is current.
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

}  // namespace
}  // namespace memtune::cuda
