// A projection's LoRA B term made in the pass that adds the residual (backend.h:
// lora_residual_forward), instead of a rank-r GEMM that reads and writes the whole output only to
// add a rank-r term onto it:  y += s * u b^T;  y += residual  in 3 passes over y's [rows, cols]
// (read y, residual; write y) where the two ops make 5.
// The ranks are small, so each thread keeps its columns' rows of B in fp32 registers for the whole
// block and takes the rows' LoRA inputs, staged once per block in shared memory, as broadcast
// reads: the dot products are a few FMAs per element against a stream of memory.
//
// Measured (H100, 2026-12-07, bench/NOTES.md): at an 8B step's shapes the op takes 13.9 ms a step
// where the two ops took 14.5 at r16, and is slower than them at r32 (B's 128 registers a thread
// halve the occupancy), so ranks 4, 8 and 16 are served. The same scheme for the gate/up B terms
// with SwiGLU (two B matrices: 123 registers at r16) measured no faster than cuBLAS's rank-16
// GEMMs and the vectorised SwiGLU kernel in the step and is not used (bench/NOTES.md says what a
// faster one needs).
//
// Rounding: as the ops it replaces. The sum is alpha * dot + beta * y in fp32 (beta 1), rounded
// once to the storage type, as the GEMM's epilogue does; the residual add then reads the rounded
// value. Only the dot's fp32 summation order differs from the GEMM's.
//
// Served: one storage type for every operand, ranks 4, 8 and 16, contiguous rows. Anything else
// returns false and the backend runs the two ops of the default.
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "memtune/ops/cuda/cuda_vector.h"

namespace memtune::cuda {
namespace {

constexpr int kThreads = 256;
// Rows per block: B (cols x r) is read once per block from L2, so more rows read it less often;
// 64 keeps a step's [4096, 14336] at ~1,800 blocks, several waves over the SMs.
constexpr int kRowsPerBlock = 64;
constexpr int kUnroll = 4;

// Columns per thread: C consecutive elements moved in one access of C * sizeof(T) bytes.
template <typename T, int C>
struct alignas(sizeof(T) * C) Columns {
  T e[C];
};

template <typename T, int C>
__device__ __forceinline__ void load_columns(const T* p, float (&v)[C]) {
  const Columns<T, C> raw = *reinterpret_cast<const Columns<T, C>*>(p);
#pragma unroll
  for (int c = 0; c < C; ++c) v[c] = to_float(raw.e[c]);
}

template <typename T, int C>
__device__ __forceinline__ void store_columns(T* p, const float (&v)[C]) {
  Columns<T, C> raw;
#pragma unroll
  for (int c = 0; c < C; ++c) raw.e[c] = from_float<T>(v[c]);
  *reinterpret_cast<Columns<T, C>*>(p) = raw;
}

// This thread's C rows of a B [cols, R], in fp32 registers (zeros past the last column).
template <typename T, int R, int C>
__device__ __forceinline__ void load_b_rows(const T* b, int64_t col, int64_t cols, float (&rows)[C][R]) {
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int k = 0; k < R; ++k) rows[c][k] = col + c < cols ? to_float(b[(col + c) * R + k]) : 0.0f;
}

// dot[c] = sum_k u[k] * b[c][k], u a row of R fp32 values in shared memory (16-byte aligned: R is
// a multiple of 4), read as float4 broadcasts.
template <int R, int C>
__device__ __forceinline__ void row_dots(const float* u, const float (&b)[C][R], float (&dot)[C]) {
#pragma unroll
  for (int c = 0; c < C; ++c) dot[c] = 0.0f;
#pragma unroll
  for (int k = 0; k < R; k += 4) {
    const float4 u4 = *reinterpret_cast<const float4*>(u + k);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      dot[c] = fmaf(u4.x, b[c][k], dot[c]);
      dot[c] = fmaf(u4.y, b[c][k + 1], dot[c]);
      dot[c] = fmaf(u4.z, b[c][k + 2], dot[c]);
      dot[c] = fmaf(u4.w, b[c][k + 3], dot[c]);
    }
  }
}

// grid: (column blocks of kThreads * C columns, row blocks of kRowsPerBlock rows).
template <typename T, int R, int C>
__global__ void __launch_bounds__(kThreads)
    lora_residual_kernel(T* y, const T* u, const T* b, float scale, const T* residual, int64_t rows, int64_t cols) {
  __shared__ __align__(16) float u_rows[kRowsPerBlock][R];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock;
  const int block_rows = static_cast<int>((rows - row0 < kRowsPerBlock ? rows - row0 : kRowsPerBlock));
  // u is [rows, R]: the block's rows are one contiguous run.
  for (int e = threadIdx.x; e < R * kRowsPerBlock; e += kThreads) {
    const int t = e / R, k = e % R;
    u_rows[t][k] = t < block_rows ? to_float(u[(row0 + t) * R + k]) : 0.0f;
  }
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * C;
  float bk[C][R];
  load_b_rows<T, R, C>(b, col, cols, bk);
  __syncthreads();
  if (col >= cols) return;
  for (int t0 = 0; t0 < block_rows; t0 += kUnroll) {
    float v[kUnroll][C], r[kUnroll][C];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i)
      if (t0 + i < block_rows) {
        const int64_t at = (row0 + t0 + i) * cols + col;
        load_columns<T, C>(y + at, v[i]);
        load_columns<T, C>(residual + at, r[i]);
      }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (t0 + i >= block_rows) break;
      float dot[C];
      row_dots<R, C>(u_rows[t0 + i], bk, dot);
#pragma unroll
      for (int c = 0; c < C; ++c) v[i][c] = round_through<T>(fmaf(scale, dot[c], v[i][c])) + r[i][c];
      store_columns<T, C>(y + (row0 + t0 + i) * cols + col, v[i]);
    }
  }
}

// Calls f(std::integral_constant<int, R>) for a served rank and returns true; false otherwise.
template <typename F>
bool with_rank(int64_t r, F&& f) {
  switch (r) {
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    case 16: f(std::integral_constant<int, 16>{}); return true;
    default: return false;
  }
}

bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Two columns a thread (one 2-element access) where cols is even and the row-major tensors are
// aligned for it, else one.
template <typename T>
bool two_columns(int64_t cols, std::initializer_list<const void*> row_major) {
  if (cols % 2 != 0) return false;
  for (const void* p : row_major)
    if (!aligned_to(p, 2 * sizeof(T))) return false;
  return true;
}

dim3 grid_of(int64_t rows, int64_t cols, int columns_per_thread) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * columns_per_thread;
  return dim3(static_cast<unsigned>((cols + per_block - 1) / per_block),
              static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
}

}  // namespace

bool launch_lora_residual_forward(void* y, const void* u, const void* b, const void* residual, DType dtype,
                                  float scale, int64_t rows, int64_t cols, int64_t rank, cudaStream_t stream) {
  if (generic_kernels_only()) return false;
  if (rows == 0 || cols == 0) return true;
  bool launched = false;
  with_float_type(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    launched = with_rank(rank, [&](auto rank_tag) {
      constexpr int R = decltype(rank_tag)::value;
      auto launch = [&](auto columns_tag) {
        constexpr int C = decltype(columns_tag)::value;
        lora_residual_kernel<T, R, C><<<grid_of(rows, cols, C), kThreads, 0, stream>>>(
            static_cast<T*>(y), static_cast<const T*>(u), static_cast<const T*>(b), scale,
            static_cast<const T*>(residual), rows, cols);
      };
      if (two_columns<T>(cols, {y, residual})) launch(std::integral_constant<int, 2>{});
      else launch(std::integral_constant<int, 1>{});
    });
  });
  if (launched) MT_CUDA_CHECK_LAUNCH();
  return launched;
}

}  // namespace memtune::cuda
