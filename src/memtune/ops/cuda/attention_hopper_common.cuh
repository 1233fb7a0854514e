// What the Hopper (sm_90a) attention kernels share (attention_hopper_forward.cu, and
// attention_hopper_backward.cu; issue 23): the mbarrier and TMA (cp.async.bulk.tensor) wrappers,
// the wgmma wrappers and shared-memory matrix descriptors for the 128-byte swizzled layout, and on
// the host the tensor maps of [batch][seq][heads][head_dim] rows and the check that the sm_90a
// image is in the binary. Like attention_flash_tiles.cuh, everything has internal linkage: each
// kernel file compiles its own copy.
//
// The layout both directions use: a tile of 16-bit rows of head_dim elements lies in shared memory
// as head_dim / 64 column chunks, each [rows][128 bytes], whose 16-byte pieces are permuted by XOR
// with (row % 8). TMA's CU_TENSOR_MAP_SWIZZLE_128B writes exactly that layout, and a wgmma
// descriptor with swizzle mode 128B reads it (K-major or, transposed, M-/N-major). Tiles start at
// multiples of the 1024-byte swizzle period.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only: the driver is reached through the runtime)
#include <cudaTypedefs.h>

#include <atomic>
#include <cstdint>

#include "memtune/ops/cuda/attention_flash_tiles.cuh"

// wgmma, setmaxnreg and friends exist only in the arch-specific sm_90a target; other passes
// (sm_80..sm_89, plain sm_90) compile a kernel whose body is a trap, which the launcher never starts.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MEMTUNE_HOPPER_DEVICE_CODE 1
#endif

namespace memtune::cuda {
namespace {

constexpr int kWarpgroupRows = 64;    // the M of every wgmma
constexpr int kChunkColumns = 64;     // 16-bit elements in one 128-byte swizzled row
constexpr uint32_t kSwizzleRowBytes = 128;
[[maybe_unused]] constexpr uint32_t kSwizzlePeriodBytes = 8 * kSwizzleRowBytes;  // 8 rows: the XOR pattern repeats

#ifdef MEMTUNE_HOPPER_DEVICE_CODE

// ---- mbarrier and TMA (PTX ISA: "mbarrier", "cp.async.bulk.tensor") ----

__device__ __forceinline__ void mbarrier_init(uint32_t barrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals) : "memory");
}

// One arrival that also announces `bytes` of copies that will complete on the barrier.
__device__ __forceinline__ void mbarrier_expect_bytes(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_wait(uint32_t barrier, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred complete;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        "selp.u32 %0, 1, 0, complete;\n"
        "}\n"
        : "=r"(done)
        : "r"(barrier), "r"(parity)
        : "memory");
  } while (done == 0);
}

// A box of the 4-D tensor map [batch][seq][heads][head_dim] (innermost last) into shared memory:
// coordinates innermost first (column, head, row, batch row); rows past the tensor read as zeros.
__device__ __forceinline__ void tma_load(uint32_t destination, const CUtensorMap& map, int column,
                                         int head, int row, int batch_row, uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(column), "r"(head), "r"(row), "r"(batch_row),
      "r"(barrier)
      : "memory");
}

// The reverse: a shared-memory box to global memory; rows past the tensor are not written.
__device__ __forceinline__ void tma_store(const CUtensorMap& map, int column, int head, int row,
                                          int batch_row, uint32_t source) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<uint64_t>(&map)),
      "r"(column), "r"(head), "r"(row), "r"(batch_row), "r"(source)
      : "memory");
}

// The same box added element by element into global memory by the copy engine (f32 boxes: the
// Hopper backward's dQ), rows past the tensor skipped; completes in the issuing thread's bulk
// group, like tma_store.
__device__ __forceinline__ void tma_reduce_add(const CUtensorMap& map, int column, int head, int row,
                                               int batch_row, uint32_t source) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<uint64_t>(&map)),
      "r"(column), "r"(head), "r"(row), "r"(batch_row), "r"(source)
      : "memory");
}

// ---- wgmma (PTX ISA: "wgmma.mma_async", "Matrix Descriptor Format") ----

// A shared-memory matrix descriptor for a tile in the 128-byte swizzled layout: bits 0-13 the
// start address >> 4, 16-29 the leading byte offset >> 4, 32-45 the stride byte offset >> 4,
// 49-51 the base offset (0: every tile starts at a multiple of the 1024-byte swizzle period, and
// the k-steps inside a period are start-address offsets, as the swizzle is a function of the
// address bits), 62-63 the swizzle mode (1 = 128 bytes).
//  K-major operands (Q and K in S = Q K^T; rows of 64 elements contiguous): the stride byte
//  offset is the distance between 8-row groups (1024); the leading byte offset is unused for
//  swizzled K-major layouts ("assumed to be 1").
//  N-major operand (V in O += P V, read with imm-trans-b = 1; N = head_dim contiguous): the
//  leading byte offset is the distance between 64-column chunks of N, the stride byte offset
//  the distance between 8-key groups along K (1024).
__device__ __forceinline__ uint64_t swizzled_descriptor(uint32_t address, uint32_t leading_bytes,
                                                        uint32_t stride_bytes) {
  uint64_t descriptor = (address & 0x3FFFFu) >> 4;
  descriptor |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFFu) << 16;
  descriptor |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFFu) << 32;
  descriptor |= 1ull << 62;
  return descriptor;
}

// Orders the warpgroup's register writes before the wgmma that reads them (accumulators, A).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Waits until at most `kPending` of the warpgroup's committed wgmma groups are still running (the
// groups complete in the order they were committed): with two groups in flight, 1 waits for the
// older alone.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Pins an accumulator array in place around the asynchronous wgmma: the compiler must neither
// read it between a wgmma and its wait (the values are not there yet) nor move writes to it past
// the fence before a wgmma (CUTLASS calls this a fence on the operand).
template <int N>
__device__ __forceinline__ void pin_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The same for A fragments held in registers (P of O += P V): written before the fence.
template <int M, int N>
__device__ __forceinline__ void pin_registers(uint32_t (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// The accumulator operand lists: "{%0, ..., %(n-1)}" and n "+f" constraints on d[0..n).
#define MT_ACC8(base)                                                                          \
  "+f"(d[base + 0]), "+f"(d[base + 1]), "+f"(d[base + 2]), "+f"(d[base + 3]), "+f"(d[base + 4]), \
      "+f"(d[base + 5]), "+f"(d[base + 6]), "+f"(d[base + 7])
#define MT_ACC32 MT_ACC8(0), MT_ACC8(8), MT_ACC8(16), MT_ACC8(24)
#define MT_ACC64 MT_ACC32, MT_ACC8(32), MT_ACC8(40), MT_ACC8(48), MT_ACC8(56)
#define MT_REGS32                                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MT_REGS64                                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x N, fp32) = A B (+ d where accumulate), N = 64 or 128: A 64 x 16 and B 16 x N both in
// shared memory. kTransA / kTransB = 0: the operand is K-major (rows of K elements contiguous: Q
// and K in S = Q K^T); 1: it is M- (N-) major, read transposed (imm-trans-a / imm-trans-b; 16-bit
// types only). As for the register-A form below, each (N, dtype) expands the one statement once.
#define MT_SS_AB32 ", %32, %33, accumulate, 1, 1, %35, %36;\n}\n"
#define MT_SS_AB64 ", %64, %65, accumulate, 1, 1, %67, %68;\n}\n"
#define MT_SS_PRED32 "%34"
#define MT_SS_PRED64 "%66"
template <int N, bool kBf16, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64_shared(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_m64_shared: N is 64 or 128");
#define MT_WGMMA_SS(SHAPE, TYPE, REGS, ACC, PRED, AB)                                              \
  asm volatile(                                                                                    \
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, " PRED ", 0;\n"                          \
      "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " REGS AB                      \
      : ACC                                                                                        \
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB))
  if constexpr (N == 128 && kBf16) {
    MT_WGMMA_SS("m64n128k16", "bf16", MT_REGS64, MT_ACC64, MT_SS_PRED64, MT_SS_AB64);
  } else if constexpr (N == 128) {
    MT_WGMMA_SS("m64n128k16", "f16", MT_REGS64, MT_ACC64, MT_SS_PRED64, MT_SS_AB64);
  } else if constexpr (kBf16) {
    MT_WGMMA_SS("m64n64k16", "bf16", MT_REGS32, MT_ACC32, MT_SS_PRED32, MT_SS_AB32);
  } else {
    MT_WGMMA_SS("m64n64k16", "f16", MT_REGS32, MT_ACC32, MT_SS_PRED32, MT_SS_AB32);
  }
#undef MT_WGMMA_SS
}
#undef MT_SS_AB32
#undef MT_SS_AB64
#undef MT_SS_PRED32
#undef MT_SS_PRED64

// d (64 x N, fp32) += A B, N = 64 or 128 (the head_dim): A 64 x 16 from registers (this thread's
// four 16-bit pairs, the m16n8k16 A-fragment layout per warp), B 16 x N N-major in shared memory
// (imm-trans-b = 1). The instruction's shape, its accumulator list and the numbers of the operands
// after it are literal asm text, so each (N, dtype) expands the one statement once.
#define MT_RS_AB32 "{%32, %33, %34, %35}, %36"
#define MT_RS_AB64 "{%64, %65, %66, %67}, %68"
template <int N, bool kBf16>
__device__ __forceinline__ void wgmma_m64_registers(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  static_assert(N == 64 || N == 128, "wgmma_m64_registers: N is 64 or 128");
#define MT_WGMMA_RS(SHAPE, TYPE, REGS, ACC, AB)                                                     \
  asm volatile("wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " REGS ", " AB         \
               ", 1, 1, 1, 1;\n"                                                                    \
               : ACC                                                                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
  if constexpr (N == 128 && kBf16) {
    MT_WGMMA_RS("m64n128k16", "bf16", MT_REGS64, MT_ACC64, MT_RS_AB64);
  } else if constexpr (N == 128) {
    MT_WGMMA_RS("m64n128k16", "f16", MT_REGS64, MT_ACC64, MT_RS_AB64);
  } else if constexpr (kBf16) {
    MT_WGMMA_RS("m64n64k16", "bf16", MT_REGS32, MT_ACC32, MT_RS_AB32);
  } else {
    MT_WGMMA_RS("m64n64k16", "f16", MT_REGS32, MT_ACC32, MT_RS_AB32);
  }
#undef MT_WGMMA_RS
}
#undef MT_RS_AB32
#undef MT_RS_AB64

#endif  // MEMTUNE_HOPPER_DEVICE_CODE

// ---- host side ----

using EncodeTiled = PFN_cuTensorMapEncodeTiled_v12000;

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda);
// null where the driver does not have it.
EncodeTiled encode_tiled_function() {
  static const EncodeTiled function = [] {
    void* address = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &address, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(address);
  }();
  return function;
}

// A [batch][seq][heads][head_dim] tensor of `element_bytes`-byte elements as a 4-D tensor map
// whose box is one 128-byte-wide chunk of columns (kSwizzleRowBytes / element_bytes of them) of
// `box_rows` rows of one head, in shared memory in the 128-byte swizzle; rows past seq read as
// zeros (and are not written by stores or reduce-adds).
bool encode_swizzled_head_rows(CUtensorMap* map, const void* data, CUtensorMapDataType type, uint32_t element_bytes,
                               int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, uint32_t box_rows) {
  const EncodeTiled encode = encode_tiled_function();
  if (encode == nullptr) return false;
  const int64_t row_bytes = head_dim * element_bytes;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(seq), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(heads * row_bytes),
                                 static_cast<cuuint64_t>(seq * heads * row_bytes)};  // bytes, dims 1..3
  const cuuint32_t box[4] = {kSwizzleRowBytes / element_bytes, 1, box_rows, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult result = encode(map, type, 4, const_cast<void*>(data), dims, strides, box, element_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS;
}

// 16-bit rows (q, k, v, out, d_out): boxes of one 64-column chunk.
bool encode_head_rows(CUtensorMap* map, const void* data, bool bf16, int64_t batch, int64_t seq,
                      int64_t heads, int64_t head_dim, uint32_t box_rows) {
  return encode_swizzled_head_rows(map, data, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                   2, batch, seq, heads, head_dim, box_rows);
}

// f32 rows (the backward's dQ accumulator): boxes of 32 columns.
bool encode_head_rows_f32(CUtensorMap* map, const float* data, int64_t batch, int64_t seq, int64_t heads,
                          int64_t head_dim, uint32_t box_rows) {
  return encode_swizzled_head_rows(map, data, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, batch, seq, heads, head_dim,
                                   box_rows);
}

// Whether the current device is compute capability 9.0 and the binary holds the sm_90a image of
// `kKernel` (one kernel of the calling file), cached per device and per kernel. Only the build that
// compiles the Hopper files for sm_90a alone (CMakeLists.txt, MEMTUNE_HOPPER_SM90A) has it:
// compiled with the other architectures, a file may carry PTX of an older target that the driver
// would JIT for a 9.0 device, into the kernel whose body is a trap.
template <auto kKernel>
bool hopper_kernel_runs_here() {
#ifndef MEMTUNE_HOPPER_SM90A
  return false;
#endif
  constexpr int kDevices = 64;
  static std::atomic<int> cached[kDevices] = {};  // 0 unknown, 1 yes, 2 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (device >= kDevices) device = kDevices - 1;
  int state = cached[device].load(std::memory_order_relaxed);
  if (state == 0) {
    int major = 0, minor = 0;
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    bool runs = major == 9 && minor == 0;
    if (runs) {
      cudaFuncAttributes attributes{};
      runs = cudaFuncGetAttributes(&attributes, kKernel) == cudaSuccess;
      cudaGetLastError();  // a missing image is an answer here, not an error for the next launch
    }
    state = runs ? 1 : 2;
    cached[device].store(state, std::memory_order_relaxed);
  }
  return state == 1;
}

}  // namespace
}  // namespace memtune::cuda
