// CPU GEMM: c = alpha * op(a) @ op(b) + beta * c with fp32 accumulation over any mix of
// f32/bf16/f16 storage.
//
// The structure is the classic Goto/BLIS one, kept small: c is cut into kMC x kNC tiles that the
// threads share out; each tile keeps an fp32 accumulator for the whole K range (so the output is
// rounded once, whatever its dtype), and for each kKC slice of K the tile's rows of op(a) and
// columns of op(b) are converted to fp32 and packed into panels that a kMR x kNR register-tiled
// micro-kernel streams through. Packing absorbs the transposes and the dtypes, so the kernel is a
// single fixed loop the compiler vectorizes. A tile's sum over K is in a fixed order, so the
// result does not depend on the number of threads.
#include <algorithm>
#include <cstring>
#include <memory>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "memtune/ops/cpu/cpu_backend.h"
#include "memtune/ops/op_checks.h"

namespace memtune {
namespace {

constexpr int64_t kMR = 6;    // micro-tile rows: 6 x 8 fp32 accumulators, 12 SSE / 6 AVX registers
constexpr int64_t kNR = 8;    // micro-tile columns
constexpr int64_t kMC = 96;   // tile rows (a multiple of kMR): the packed a block stays in L2
constexpr int64_t kNC = 256;  // tile columns (a multiple of kNR)
constexpr int64_t kKC = 256;  // K slice: one packed b panel (kKC x kNR) stays in L1

// Below this many multiply-adds (~0.1 ms on one core) a parallel region costs more than it
// saves (see cpu::kParallelMinElements).
constexpr int64_t kParallelMacs = 1 << 23;

// op(x) as a logical [rows, cols] matrix over row-major storage.
struct Operand {
  const void* data;
  DType dtype;
  bool transposed;  // storage is [cols, rows]
  int64_t rows, cols;
  int64_t ld;  // elements per stored row
};

template <DType D>
inline float load_element(const void* base, int64_t index) {
  if constexpr (D == DType::f32) return static_cast<const float*>(base)[index];
  if constexpr (D == DType::bf16) return bf16_bits_to_f32(static_cast<const uint16_t*>(base)[index]);
  if constexpr (D == DType::f16) return f16_bits_to_f32(static_cast<const uint16_t*>(base)[index]);
  return 0.0f;
}

// Rows [i0, i0 + rows_valid) by K slice [p0, p0 + kc) of op(a), as out[p * kMR + row], with the
// rows past rows_valid zero so that edge micro-tiles need no special case.
template <DType D>
void pack_a_panel(const Operand& a, int64_t i0, int64_t rows_valid, int64_t p0, int64_t kc,
                  float* out) {
  if (!a.transposed) {
    for (int64_t r = 0; r < rows_valid; ++r) {
      const int64_t row_start = (i0 + r) * a.ld + p0;
      for (int64_t p = 0; p < kc; ++p) out[p * kMR + r] = load_element<D>(a.data, row_start + p);
    }
  } else {
    for (int64_t p = 0; p < kc; ++p) {
      const int64_t row_start = (p0 + p) * a.ld + i0;
      for (int64_t r = 0; r < rows_valid; ++r)
        out[p * kMR + r] = load_element<D>(a.data, row_start + r);
    }
  }
  for (int64_t r = rows_valid; r < kMR; ++r)
    for (int64_t p = 0; p < kc; ++p) out[p * kMR + r] = 0.0f;
}

// K slice [p0, p0 + kc) by columns [j0, j0 + cols_valid) of op(b), as out[p * kNR + col].
template <DType D>
void pack_b_panel(const Operand& b, int64_t j0, int64_t cols_valid, int64_t p0, int64_t kc,
                  float* out) {
  if (!b.transposed) {
    for (int64_t p = 0; p < kc; ++p) {
      const int64_t row_start = (p0 + p) * b.ld + j0;
      for (int64_t c = 0; c < cols_valid; ++c)
        out[p * kNR + c] = load_element<D>(b.data, row_start + c);
    }
  } else {
    for (int64_t c = 0; c < cols_valid; ++c) {
      const int64_t row_start = (j0 + c) * b.ld + p0;
      for (int64_t p = 0; p < kc; ++p) out[p * kNR + c] = load_element<D>(b.data, row_start + p);
    }
  }
  for (int64_t c = cols_valid; c < kNR; ++c)
    for (int64_t p = 0; p < kc; ++p) out[p * kNR + c] = 0.0f;
}

void pack_a(const Operand& a, int64_t i0, int64_t rows_valid, int64_t p0, int64_t kc,
            float* out) {
  switch (a.dtype) {
    case DType::f32: return pack_a_panel<DType::f32>(a, i0, rows_valid, p0, kc, out);
    case DType::bf16: return pack_a_panel<DType::bf16>(a, i0, rows_valid, p0, kc, out);
    case DType::f16: return pack_a_panel<DType::f16>(a, i0, rows_valid, p0, kc, out);
    default: MT_ASSERT(false, "matmul: a dtype {}", dtype_name(a.dtype));
  }
}

void pack_b(const Operand& b, int64_t j0, int64_t cols_valid, int64_t p0, int64_t kc,
            float* out) {
  switch (b.dtype) {
    case DType::f32: return pack_b_panel<DType::f32>(b, j0, cols_valid, p0, kc, out);
    case DType::bf16: return pack_b_panel<DType::bf16>(b, j0, cols_valid, p0, kc, out);
    case DType::f16: return pack_b_panel<DType::f16>(b, j0, cols_valid, p0, kc, out);
    default: MT_ASSERT(false, "matmul: b dtype {}", dtype_name(b.dtype));
  }
}

// c_tile[kMR x kNR] (row stride ldc) += a_panel^T b_panel over kc.
//
// Written with GCC/Clang vector types and one named variable per accumulator, so that the
// compiler keeps the 6 x 8 accumulators in registers (plain loops over an array get vectorized
// across the wrong dimension, or spilled to the stack on every step). Two versions with the same
// operations in the same order: four-wide for the baseline x86-64 (SSE2) build and eight-wide
// for CPUs with AVX2, picked at run time. AVX2 without FMA rounds every multiply and add as SSE
// does, so both give bit-identical results; the build must not enable FMA contraction here
// (-ffp-contract applies only when the target has FMA, which neither version enables).
typedef float Float4 __attribute__((vector_size(16)));
static_assert(kMR == 6 && kNR == 8, "the micro-kernels are written out for 6 x 8");

using MicroKernel = void (*)(int64_t kc, const float* __restrict a_panel,
                             const float* __restrict b_panel, float* __restrict c_tile,
                             int64_t ldc);

inline Float4 load4(const float* p) {
  Float4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store4(float* p, Float4 v) { std::memcpy(p, &v, sizeof(v)); }

void micro_kernel_4wide(int64_t kc, const float* __restrict a_panel,
                        const float* __restrict b_panel, float* __restrict c_tile, int64_t ldc) {
  Float4 c00{}, c01{}, c10{}, c11{}, c20{}, c21{}, c30{}, c31{}, c40{}, c41{}, c50{}, c51{};
  for (int64_t p = 0; p < kc; ++p) {
    const Float4 b0 = load4(b_panel + p * kNR), b1 = load4(b_panel + p * kNR + 4);
    const float* a = a_panel + p * kMR;
    c00 += a[0] * b0;
    c01 += a[0] * b1;
    c10 += a[1] * b0;
    c11 += a[1] * b1;
    c20 += a[2] * b0;
    c21 += a[2] * b1;
    c30 += a[3] * b0;
    c31 += a[3] * b1;
    c40 += a[4] * b0;
    c41 += a[4] * b1;
    c50 += a[5] * b0;
    c51 += a[5] * b1;
  }
  const Float4 sums[kMR][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                               {c30, c31}, {c40, c41}, {c50, c51}};
  for (int64_t i = 0; i < kMR; ++i) {
    float* row = c_tile + i * ldc;
    store4(row, load4(row) + sums[i][0]);
    store4(row + 4, load4(row + 4) + sums[i][1]);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEMTUNE_HAVE_AVX2_KERNEL 1
typedef float Float8 __attribute__((vector_size(32)));

__attribute__((target("avx2"))) void micro_kernel_8wide(int64_t kc,
                                                         const float* __restrict a_panel,
                                                         const float* __restrict b_panel,
                                                         float* __restrict c_tile, int64_t ldc) {
  Float8 c0{}, c1{}, c2{}, c3{}, c4{}, c5{};
  for (int64_t p = 0; p < kc; ++p) {
    Float8 b;
    std::memcpy(&b, b_panel + p * kNR, sizeof(b));
    const float* a = a_panel + p * kMR;
    c0 += a[0] * b;
    c1 += a[1] * b;
    c2 += a[2] * b;
    c3 += a[3] * b;
    c4 += a[4] * b;
    c5 += a[5] * b;
  }
  const Float8 sums[kMR] = {c0, c1, c2, c3, c4, c5};
  for (int64_t i = 0; i < kMR; ++i) {
    Float8 row;
    std::memcpy(&row, c_tile + i * ldc, sizeof(row));
    row += sums[i];
    std::memcpy(c_tile + i * ldc, &row, sizeof(row));
  }
}
#endif

MicroKernel select_micro_kernel() {
#ifdef MEMTUNE_HAVE_AVX2_KERNEL
  if (__builtin_cpu_supports("avx2")) return micro_kernel_8wide;
#endif
  return micro_kernel_4wide;
}

const MicroKernel micro_kernel = select_micro_kernel();

int64_t max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Per-thread buffers, allocated once per call at the sizes the call's tiles need, and left
// uninitialised (everything is written before it is read): small GEMMs such as the LoRA ones
// would otherwise spend a good part of their time zeroing buffers.
struct TileBuffers {
  std::unique_ptr<float[]> a_block, b_block, c_tile, c_row;
  TileBuffers(int64_t tile_m, int64_t tile_n, int64_t slice_k)
      : a_block(std::make_unique_for_overwrite<float[]>(round_up(tile_m, kMR) * slice_k)),
        b_block(std::make_unique_for_overwrite<float[]>(round_up(tile_n, kNR) * slice_k)),
        c_tile(std::make_unique_for_overwrite<float[]>(round_up(tile_m, kMR) *
                                                       round_up(tile_n, kNR))),
        c_row(std::make_unique_for_overwrite<float[]>(tile_n)) {}
};

// Tile [i0, i0 + tile_m) x [j0, j0 + tile_n) of c, tile_m <= kMC and tile_n <= kNC.
void compute_tile(const Tensor& c, const Operand& a, const Operand& b, int64_t i0, int64_t j0,
                  int64_t tile_m, int64_t tile_n, float alpha, float beta,
                  TileBuffers& buffers) {
  const int64_t m = a.rows, n = b.cols, k = a.cols;
  const int64_t mc = std::min(tile_m, m - i0);
  const int64_t nc = std::min(tile_n, n - j0);
  const int64_t a_panels = (mc + kMR - 1) / kMR;
  const int64_t b_panels = (nc + kNR - 1) / kNR;
  const int64_t ldt = round_up(nc, kNR);
  float* c_tile = buffers.c_tile.get();
  std::fill(c_tile, c_tile + round_up(mc, kMR) * ldt, 0.0f);

  for (int64_t p0 = 0; p0 < k; p0 += kKC) {
    const int64_t kc = std::min(kKC, k - p0);
    for (int64_t ir = 0; ir < a_panels; ++ir)
      pack_a(a, i0 + ir * kMR, std::min(kMR, mc - ir * kMR), p0, kc,
             buffers.a_block.get() + ir * kMR * kc);
    for (int64_t jr = 0; jr < b_panels; ++jr)
      pack_b(b, j0 + jr * kNR, std::min(kNR, nc - jr * kNR), p0, kc,
             buffers.b_block.get() + jr * kNR * kc);
    for (int64_t jr = 0; jr < b_panels; ++jr) {
      const float* b_panel = buffers.b_block.get() + jr * kNR * kc;
      for (int64_t ir = 0; ir < a_panels; ++ir)
        micro_kernel(kc, buffers.a_block.get() + ir * kMR * kc, b_panel,
                     c_tile + ir * kMR * ldt + jr * kNR, ldt);
    }
  }

  float* row = buffers.c_row.get();
  for (int64_t i = 0; i < mc; ++i) {
    const float* sums = c_tile + i * ldt;
    const int64_t offset = (i0 + i) * n + j0;
    if (beta != 0.0f) {
      cpu::load_f32(c, offset, nc, row);
      for (int64_t j = 0; j < nc; ++j) row[j] = alpha * sums[j] + beta * row[j];
    } else {
      // beta == 0: c is not read, so NaN or garbage in it cannot leak into the result.
      for (int64_t j = 0; j < nc; ++j) row[j] = alpha * sums[j];
    }
    cpu::store_f32(c, offset, nc, row);
  }
}

}  // namespace

void CpuBackend::matmul(const Tensor& c, const Tensor& a, bool transpose_a, const Tensor& b,
                        bool transpose_b, float alpha, float beta) {
  const MatmulSizes sizes = check_matmul_inputs(c, a, transpose_a, b, transpose_b, cpu::check_float_tensor);
  const int64_t m = sizes.m, n = sizes.n, k = sizes.k;
  if (m == 0 || n == 0) return;
  MT_ASSERT(c.data != a.data && c.data != b.data, "matmul: c aliases an input");

  const Operand op_a{a.data, a.dtype, transpose_a, m, k, a.dim(1)};
  const Operand op_b{b.data, b.dtype, transpose_b, k, n, b.dim(1)};
  // Tiles are shrunk (down to a few micro-tiles) until every thread has some, so that skinny
  // shapes such as the LoRA gradients ([r, in] = dy^T x) use all cores. Tile sizes do not change
  // any result: each entry's sum over K is in the same order whatever the tiling.
  const int64_t macs = m * n * k;
  const int64_t threads = macs >= kParallelMacs ? max_threads() : 1;
  int64_t tile_m = kMC, tile_n = kNC;
  auto tile_count = [&] { return ((m + tile_m - 1) / tile_m) * ((n + tile_n - 1) / tile_n); };
  while (tile_count() < 2 * threads && tile_n > 4 * kNR && n > tile_n / 2) tile_n /= 2;
  while (tile_count() < 2 * threads && tile_m > 2 * kMR && m > tile_m / 2) tile_m /= 2;
  const int64_t tiles_m = (m + tile_m - 1) / tile_m;
  const int64_t tiles_n = (n + tile_n - 1) / tile_n;
  const bool parallel = threads > 1 && tiles_m * tiles_n > 1;

#pragma omp parallel if (parallel)
  {
    TileBuffers buffers(tile_m, tile_n, std::min(kKC, k));
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t tm = 0; tm < tiles_m; ++tm)
      for (int64_t tn = 0; tn < tiles_n; ++tn)
        compute_tile(c, op_a, op_b, tm * tile_m, tn * tile_n, tile_m, tile_n, alpha, beta,
                     buffers);
  }
}

}  // namespace memtune
