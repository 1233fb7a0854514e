// CUDA backend: 4-bit blockwise quantization (NF4 / FP4, optional double quantization) and its
// dequantization, bit-identical to the CPU reference of quant/nf4.h (whose header comment is the
// specification; SPECS.md §1 lists the bitsandbytes facts it follows). What keeps them equal:
//  - every constant (codes, thresholds) comes from the host tables of quant/codebook.h, and the
//    nearest-code rules are the reference's own functions (quant/codebook_shared.h);
//  - the arithmetic is the reference's, operation for operation, in explicitly rounded fp32
//    intrinsics (__fmul_rn, __fadd_rn, __fsub_rn, __frcp_rn = the correctly rounded 1.0f / x),
//    so that nvcc can neither contract a multiply and an add into an FMA nor use approximations;
//  - fp32 subnormals are flushed explicitly where the reference flushes them (the build does not
//    use -ftz, so nothing else is flushed, as on the host);
//  - comparisons are the same strict `>` / `<` in the same order, so NaN (an all-zero block's
//    0 * inf) falls through the same way.
// The double-quant mean offset is not computed here: the device returns the absmax sum (double,
// fixed order) and the smallest nonzero absmax, and the host decides whether that sum is exactly
// the reference's (cuda_backend.cpp, CudaBackend::quantize_4bit says when).
#include <cfloat>
#include <type_traits>

#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "memtune/quant/codebook_shared.h"

namespace memtune::cuda {
namespace {

constexpr int kThreads = 256;

// nf4.cpp flush_subnormal: a subnormal becomes a zero of the same sign; zeros, normals, Inf and
// NaN pass unchanged (NaN fails the comparison).
__device__ __forceinline__ float flush_subnormal(float x) {
  return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x;
}

// The reference's own rules (quant/codebook_shared.h) on the tables that the host handed over.
__device__ __forceinline__ uint32_t code_of_scaled(const Quant4bitTables& t, float scaled) {
  return t.is_nf4 ? codebook::nf4_code(t.nf4_thresholds, scaled)
                  : codebook::fp4_code(t.fp4_thresholds, t.fp4_code_by_rank, scaled);
}

// ---- stage 1: absmax and codes ----------------------------------------------------------------
//
// A group of `lanes` threads of one warp (16 for blocksize 32, else 32) owns one quantization
// block: pass 1 reads it with consecutive lanes on consecutive elements for the max |x| (and the
// finiteness scan), pass 2 re-reads it (from L1/L2) one byte = two elements per lane and writes
// the codes. Loop bounds are uniform per warp, so the shuffles always see the whole warp.
__global__ void quantize_blocks_kernel(const void* dense, DType dense_type, int64_t n,
                                       int log2_blocksize, int log2_lanes, int64_t blocks,
                                       Quant4bitTables tables, uint8_t* packed, float* absmax,
                                       unsigned long long* first_non_finite) {
  const int lanes = 1 << log2_lanes;
  const int groups_per_warp = 32 >> log2_lanes;
  const int lane = threadIdx.x & 31;
  const int lane_in_group = lane & (lanes - 1);
  const int64_t blocksize = int64_t{1} << log2_blocksize;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  unsigned long long my_first_bad = ~0ull;

  for (int64_t warp_first = warp * groups_per_warp; warp_first < blocks;
       warp_first += warps * groups_per_warp) {
    const int64_t block = warp_first + (lane >> log2_lanes);
    const bool active = block < blocks;
    const int64_t begin = block << log2_blocksize;
    const int64_t end = active ? min(n, begin + blocksize) : begin;

    float block_max = 0.0f;
    for (int64_t i = begin + lane_in_group; i < end; i += lanes) {
      const float x = load_float(dense, dense_type, i);
      if (!isfinite(x)) my_first_bad = min(my_first_bad, static_cast<unsigned long long>(i));
      block_max = fmaxf(block_max, fabsf(flush_subnormal(x)));
    }
    for (int offset = lanes / 2; offset > 0; offset >>= 1)
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, offset));
    if (active && lane_in_group == 0) absmax[block] = block_max;

    // nf4.cpp: inverse = 1.0f / absmax (+inf for 0); each pair (x0, x1) -> one byte, the pad
    // element past the end of the tensor quantized as a loaded 0.0.
    const float inverse = __frcp_rn(block_max);
    for (int64_t i = begin + 2 * lane_in_group; i < end; i += 2 * lanes) {
      const float x0 = flush_subnormal(load_float(dense, dense_type, i));
      const float x1 = i + 1 < end ? flush_subnormal(load_float(dense, dense_type, i + 1)) : 0.0f;
      const uint32_t hi = code_of_scaled(tables, flush_subnormal(__fmul_rn(x0, inverse)));
      const uint32_t lo = code_of_scaled(tables, flush_subnormal(__fmul_rn(x1, inverse)));
      packed[i >> 1] = static_cast<uint8_t>((hi << 4) | lo);
    }
  }
  // One atomic per warp at most: the lowest bad index of the warp's elements.
  my_first_bad = warp_reduce(my_first_bad, [](unsigned long long a, unsigned long long b) { return min(a, b); });
  if (lane == 0 && my_first_bad != ~0ull) atomicMin(first_non_finite, my_first_bad);
}

// ---- absmax sum (double quant) ----------------------------------------------------------------
//
// Partial double sums and nonzero minima per thread block over a grid-stride share fixed by the
// count alone, then one block adds the partials in a fixed order: deterministic.
constexpr int kMaxSumPartials = 1024;

struct AbsmaxSumState {
  unsigned long long first_non_finite;
  double sum;
  float min_nonzero;
};

// Block-wide (sum, min) with every thread of the block calling; thread 0 gets the result.
__device__ __forceinline__ void block_sum_min(double& sum, float& minimum) {
  __shared__ double shared_sum[32];
  __shared__ float shared_min[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  sum = warp_sum(sum);
  minimum = warp_min(minimum);
  if (lane == 0) {
    shared_sum[warp] = sum;
    shared_min[warp] = minimum;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    sum = lane < warps ? shared_sum[lane] : 0.0;
    minimum = lane < warps ? shared_min[lane] : INFINITY;
    sum = warp_sum(sum);
    minimum = warp_min(minimum);
  }
}

__global__ void absmax_sum_partial_kernel(const float* absmax, int64_t blocks,
                                          double* partial_sums, float* partial_mins) {
  double sum = 0.0;
  float minimum = INFINITY;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < blocks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float value = absmax[i];
    sum += static_cast<double>(value);
    if (value > 0.0f) minimum = fminf(minimum, value);
  }
  block_sum_min(sum, minimum);
  if (threadIdx.x == 0) {
    partial_sums[blockIdx.x] = sum;
    partial_mins[blockIdx.x] = minimum;
  }
}

__global__ void absmax_sum_final_kernel(const double* partial_sums, const float* partial_mins,
                                        int count, AbsmaxSumState* state) {
  double sum = 0.0;
  float minimum = INFINITY;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    sum += partial_sums[i];
    minimum = fminf(minimum, partial_mins[i]);
  }
  block_sum_min(sum, minimum);
  if (threadIdx.x == 0) {
    state->sum = sum;
    state->min_nonzero = minimum;
  }
}

// ---- stage 2: double quantization of the absmax -------------------------------------------------

// One thread block per nested block (grid-stride over them): nf4.cpp double_quantize_absmax.
__global__ void double_quantize_kernel(const float* absmax, int64_t blocks,
                                       int64_t nested_blocksize, int64_t nested_blocks,
                                       float offset, const float* nested_map, uint8_t* codes,
                                       float* nested_absmax) {
  __shared__ float map[256];
  __shared__ float reduce[32];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) map[i] = nested_map[i];
  __syncthreads();
  for (int64_t nb = blockIdx.x; nb < nested_blocks; nb += gridDim.x) {
    const int64_t begin = nb * nested_blocksize;
    const int64_t end = min(blocks, begin + nested_blocksize);
    float local_max = 0.0f;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      local_max = fmaxf(local_max, fabsf(flush_subnormal(__fsub_rn(absmax[i], offset))));
    const float nested_max = block_max(local_max, reduce);
    if (threadIdx.x == 0) nested_absmax[nb] = nested_max;
    const float inverse = __frcp_rn(nested_max);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float centered = flush_subnormal(__fsub_rn(absmax[i], offset));
      codes[i] = codebook::dynamic_code(map, flush_subnormal(__fmul_rn(centered, inverse)));
    }
  }
}

// ---- dequantize -----------------------------------------------------------------------------------
//
// A thread decodes a group of 16 elements (8 packed bytes: one 8-byte load), which always lie in
// one quantization block (blocks are >= 32 elements and 32-aligned), so it decodes one absmax,
// and stores them with 16-byte stores. The last partial group and unaligned pointers take the
// element-wise path. value = lut[code] * absmax in fp32, then one rounding to Out.
// Measured on an H200 at [14336, 4096] nf4 bs64 dq -> bf16 (the DequantizeBandwidth test):
// 16 elements a thread ~3.45 TB/s; 8 a thread ~2.7 (3.2 with a persistent grid); 32 ~1.8;
// streaming stores (st.global.cs) or a persistent grid slower.
constexpr int kGroupElements = 16;

template <typename Out>
struct OutputStore;

template <>
struct OutputStore<float> {
  static __device__ __forceinline__ void one(float* out, int64_t i, float v) { out[i] = v; }
  static __device__ __forceinline__ void group(float* out, const float (&v)[kGroupElements]) {
    float4* dst = reinterpret_cast<float4*>(out);
#pragma unroll
    for (int k = 0; k < kGroupElements / 4; ++k)
      dst[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
  }
};

// 16-bit outputs: pairs rounded by the paired intrinsics (each element rounded to nearest even,
// exactly as the scalar conversion), 8 elements per 16-byte store.
template <typename Out>
struct OutputStore16 {
  static __device__ __forceinline__ uint32_t pair_bits(float a, float b) {
    if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);  // .x = a, the lower address
      return *reinterpret_cast<const uint32_t*>(&pair);
    } else {
      const __half2 pair = __floats2half2_rn(a, b);
      return *reinterpret_cast<const uint32_t*>(&pair);
    }
  }
  static __device__ __forceinline__ void one(Out* out, int64_t i, float v) {
    if constexpr (std::is_same_v<Out, __nv_bfloat16>) out[i] = __float2bfloat16_rn(v);
    else out[i] = __float2half_rn(v);
  }
  static __device__ __forceinline__ void group(Out* out, const float (&v)[kGroupElements]) {
    uint4* dst = reinterpret_cast<uint4*>(out);
#pragma unroll
    for (int k = 0; k < kGroupElements / 8; ++k)
      dst[k] = make_uint4(pair_bits(v[8 * k], v[8 * k + 1]), pair_bits(v[8 * k + 2], v[8 * k + 3]),
                          pair_bits(v[8 * k + 4], v[8 * k + 5]), pair_bits(v[8 * k + 6], v[8 * k + 7]));
  }
};
template <>
struct OutputStore<__nv_bfloat16> : OutputStore16<__nv_bfloat16> {};
template <>
struct OutputStore<__half> : OutputStore16<__half> {};

struct DequantizeParams {
  const uint8_t* packed;
  int64_t n;
  int log2_blocksize;
  const float* absmax;
  const uint8_t* absmax_codes;
  const float* nested_absmax;
  const float* nested_map;
  float nested_offset;
  int log2_nested_blocksize;
  bool vectorized;  // packed 8-byte and out 16-byte aligned
};

template <typename Out, bool kDoubleQuant>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(Out* __restrict__ out, DequantizeParams p, Quant4bitTables tables) {
  __shared__ float lut[16];
  __shared__ float nested_map[kDoubleQuant ? 256 : 1];
  if (threadIdx.x < 16) lut[threadIdx.x] = tables.code_values[threadIdx.x];
  if (kDoubleQuant)
    for (int i = threadIdx.x; i < 256; i += blockDim.x) nested_map[i] = p.nested_map[i];
  __syncthreads();

  const int64_t groups = (p.n + kGroupElements - 1) / kGroupElements;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t first = g * kGroupElements;
    const int64_t block = first >> p.log2_blocksize;
    float scale;
    if (kDoubleQuant) {
      // nf4.cpp block_absmax: two fp32 roundings (the nested dequantize, then + offset).
      const float nested = p.nested_absmax[block >> p.log2_nested_blocksize];
      scale = __fadd_rn(__fmul_rn(nested_map[p.absmax_codes[block]], nested), p.nested_offset);
    } else {
      scale = p.absmax[block];
    }
    if (p.vectorized && first + kGroupElements <= p.n) {
      const uint2 bytes = *reinterpret_cast<const uint2*>(p.packed + first / 2);
      float values[kGroupElements];
#pragma unroll
      for (int k = 0; k < kGroupElements / 2; ++k) {
        // Little-endian: byte k of the group is bits [8 (k % 4), + 8) of word k / 4.
        const uint32_t byte = ((k < 4 ? bytes.x : bytes.y) >> (8 * (k % 4))) & 0xffu;
        values[2 * k] = __fmul_rn(lut[byte >> 4], scale);
        values[2 * k + 1] = __fmul_rn(lut[byte & 0xfu], scale);
      }
      OutputStore<Out>::group(out + first, values);
    } else {
      const int64_t last = min(p.n, first + kGroupElements);
      for (int64_t i = first; i < last; ++i) {
        const uint32_t byte = p.packed[i >> 1];
        const uint32_t code = (i & 1) ? (byte & 0xfu) : (byte >> 4);
        OutputStore<Out>::one(out, i, __fmul_rn(lut[code], scale));
      }
    }
  }
}

int log2_exact(int64_t value) {
  int log = 0;
  while ((int64_t{1} << log) < value) ++log;
  return log;
}

template <typename Out>
void launch_dequantize_typed(Out* out, const DequantizeParams& p, bool double_quant,
                             const Quant4bitTables& tables, cudaStream_t stream) {
  const int64_t groups = (p.n + kGroupElements - 1) / kGroupElements;
  const unsigned grid = grid_for(groups, kThreads, int64_t{1} << 20);
  if (double_quant)
    dequantize_kernel<Out, true><<<grid, kThreads, 0, stream>>>(out, p, tables);
  else
    dequantize_kernel<Out, false><<<grid, kThreads, 0, stream>>>(out, p, tables);
  MT_CUDA_CHECK_LAUNCH();
}

bool aligned(const void* pointer, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(pointer) % alignment == 0;
}

}  // namespace

Quantize4bitBlocksResult quantize_4bit_blocks(const Quantize4bitBlocksArgs& args,
                                              const Quant4bitTables& tables,
                                              cudaStream_t stream) {
  Quantize4bitBlocksResult result;
  if (args.n == 0) return result;
  const int64_t blocks = (args.n + args.blocksize - 1) / args.blocksize;
  // Scratch layout: the state, then the partial sums and minima.
  static_assert(sizeof(AbsmaxSumState) <= 256, "state fits its slot");
  constexpr uint64_t kPartialSumsOffset = 256;
  constexpr uint64_t kPartialMinsOffset = kPartialSumsOffset + kMaxSumPartials * sizeof(double);
  if (args.scratch_bytes < kPartialMinsOffset + kMaxSumPartials * sizeof(float))
    cuda_check_failed("quantize_4bit_blocks", "memtune", "reduction scratch too small", __FILE__,
                      __LINE__);
  char* scratch = static_cast<char*>(args.scratch);
  auto* state = reinterpret_cast<AbsmaxSumState*>(scratch);
  auto* partial_sums = reinterpret_cast<double*>(scratch + kPartialSumsOffset);
  auto* partial_mins = reinterpret_cast<float*>(scratch + kPartialMinsOffset);

  MT_CUDA_CHECK(cudaMemsetAsync(&state->first_non_finite, 0xff, sizeof(unsigned long long), stream));
  const int log2_blocksize = log2_exact(args.blocksize);
  const int log2_lanes = args.blocksize >= 64 ? 5 : log2_blocksize - 1;  // blocksize/2 lanes, <= 32
  const int64_t warps_needed = (blocks + (32 >> log2_lanes) - 1) / (32 >> log2_lanes);
  const unsigned grid = grid_for(warps_needed * 32, kThreads, 1 << 16);
  quantize_blocks_kernel<<<grid, kThreads, 0, stream>>>(
      args.dense, args.dense_type, args.n, log2_blocksize, log2_lanes, blocks, tables,
      args.packed, args.absmax, &state->first_non_finite);
  MT_CUDA_CHECK_LAUNCH();

  if (args.sum_absmax) {
    const unsigned partials = grid_for(blocks, kThreads * 4, kMaxSumPartials);
    absmax_sum_partial_kernel<<<partials, kThreads, 0, stream>>>(args.absmax, blocks,
                                                                  partial_sums, partial_mins);
    MT_CUDA_CHECK_LAUNCH();
    absmax_sum_final_kernel<<<1, kThreads, 0, stream>>>(partial_sums, partial_mins,
                                                       static_cast<int>(partials), state);
    MT_CUDA_CHECK_LAUNCH();
  }
  AbsmaxSumState host_state{};
  MT_CUDA_CHECK(cudaMemcpyAsync(&host_state, state, sizeof(host_state), cudaMemcpyDeviceToHost,
                                stream));
  MT_CUDA_CHECK(cudaStreamSynchronize(stream));
  result.first_non_finite = host_state.first_non_finite == ~0ull
                                ? -1
                                : static_cast<int64_t>(host_state.first_non_finite);
  if (args.sum_absmax) {
    result.absmax_sum = host_state.sum;
    result.min_nonzero_absmax = host_state.min_nonzero;
  }
  return result;
}

void launch_double_quantize_absmax(const float* absmax, int64_t blocks, int64_t nested_blocksize,
                                   float offset, const float* nested_map, uint8_t* codes,
                                   float* nested_absmax, cudaStream_t stream) {
  if (blocks == 0) return;
  const int64_t nested_blocks = (blocks + nested_blocksize - 1) / nested_blocksize;
  const unsigned grid = grid_for(nested_blocks, 1, 1 << 16);
  double_quantize_kernel<<<grid, kThreads, 0, stream>>>(absmax, blocks, nested_blocksize,
                                                        nested_blocks, offset, nested_map, codes,
                                                        nested_absmax);
  MT_CUDA_CHECK_LAUNCH();
}

void launch_dequantize_4bit(const Dequantize4bitArgs& args, const Quant4bitTables& tables,
                            cudaStream_t stream) {
  if (args.n == 0) return;
  DequantizeParams p;
  p.packed = args.packed;
  p.n = args.n;
  p.log2_blocksize = log2_exact(args.blocksize);
  p.absmax = args.absmax;
  p.absmax_codes = args.absmax_codes;
  p.nested_absmax = args.nested_absmax;
  p.nested_map = args.nested_map;
  p.nested_offset = args.nested_offset;
  p.log2_nested_blocksize = args.double_quant ? log2_exact(args.nested_blocksize) : 0;
  p.vectorized = aligned(args.packed, 8) && aligned(args.out, 16);
  switch (args.out_type) {
    case DType::f32:
      launch_dequantize_typed(static_cast<float*>(args.out), p, args.double_quant, tables, stream);
      return;
    case DType::bf16:
      launch_dequantize_typed(static_cast<__nv_bfloat16*>(args.out), p, args.double_quant, tables,
                              stream);
      return;
    case DType::f16:
      launch_dequantize_typed(static_cast<__half*>(args.out), p, args.double_quant, tables, stream);
      return;
    default:
      cuda_check_failed("launch_dequantize_4bit", "memtune", "output dtype is not f32/f16/bf16",
                        __FILE__, __LINE__);
  }
}

}  // namespace memtune::cuda
