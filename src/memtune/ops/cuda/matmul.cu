// GEMM through cuBLASLt (fp32 accumulation: CUBLAS_COMPUTE_32F, which never drops to TF32), with a
// plain tiled fp32 kernel for the dtype mixes cuBLASLt does not take.
//
// Row-major to cuBLASLt's column-major: a row-major [r, c] matrix with leading dimension ld is
// the column-major [c, r] matrix with the same ld, i.e. its transpose. So C = op(A) op(B) in row
// major is C^T = op(B)^T op(A)^T in column major: cuBLASLt's "A" is our B and its "B" our A, and a
// stored operand needs cuBLASLt's transpose exactly when ours is transposed (cuBLAS docs, "Data
// layout"; the usual row-major trick).
//
// Workspace: the backend allocates one 32 MiB workspace when it is created (cuda_backend.cpp) and
// passes it here; the planner is to take it over as its own buffer (MemCategory::workspace).
#include <array>
#include <cstdint>
#include <map>
#include <mutex>

#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

cudaDataType_t lt_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

bool lt_supports(const GemmArgs& args) {
  if (args.a_type != args.b_type) return false;
  if (args.a_type == DType::f32) return args.c_type == DType::f32;
  if (args.a_type == DType::bf16 || args.a_type == DType::f16)
    return args.c_type == args.a_type || args.c_type == DType::f32;
  return false;
}

uint32_t pointer_alignment(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && (address % alignment) != 0) alignment >>= 1;
  return alignment;
}

// Everything that determines the descriptors and the algorithm choice.
using PlanKey = std::array<int64_t, 20>;

PlanKey plan_key(const GemmArgs& args) {
  return PlanKey{static_cast<int64_t>(args.c_type), args.ldc, args.stride_c,
                 static_cast<int64_t>(args.a_type), args.transpose_a, args.lda, args.stride_a,
                 static_cast<int64_t>(args.b_type), args.transpose_b, args.ldb, args.stride_b,
                 args.m, args.n, args.k, args.batch,
                 pointer_alignment(args.a), pointer_alignment(args.b), pointer_alignment(args.c),
                 0, 0};
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A, B, C(=D)
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;  // false: no algorithm; use the fallback kernel
};

cublasLtMatrixLayout_t make_layout(DType dtype, int64_t rows, int64_t cols, int64_t ld,
                                   int64_t batch, int64_t stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, lt_type(dtype), static_cast<uint64_t>(rows),
                                             static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return layout;
}

// ---- fallback: 64 x 64 tiles, 16-deep K slices, 256 threads with 4 x 4 outputs each -------------
constexpr int kTile = 64, kSlice = 16, kFallbackThreads = 256;

__device__ __forceinline__ float operand_at(const void* base, DType dtype, bool transposed,
                                            int64_t ld, int64_t row, int64_t col) {
  return transposed ? load_float(base, dtype, col * ld + row) : load_float(base, dtype, row * ld + col);
}

__global__ void __launch_bounds__(kFallbackThreads)
    gemm_fallback_kernel(GemmArgs args) {
  __shared__ float a_tile[kSlice][kTile + 1];  // [k][m]
  __shared__ float b_tile[kSlice][kTile + 1];  // [k][n]
  const int64_t z = blockIdx.z;
  const char* a_base = static_cast<const char*>(args.a) + z * args.stride_a * element_bytes(args.a_type);
  const char* b_base = static_cast<const char*>(args.b) + z * args.stride_b * element_bytes(args.b_type);
  char* c_base = static_cast<char*>(args.c) + z * args.stride_c * element_bytes(args.c_type);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int64_t p0 = 0; p0 < args.k; p0 += kSlice) {
    for (int e = threadIdx.x; e < kSlice * kTile; e += kFallbackThreads) {
      const int kk = e / kTile, mm = e % kTile;
      const int64_t row = row0 + mm, p = p0 + kk;
      a_tile[kk][mm] = (row < args.m && p < args.k)
                           ? operand_at(a_base, args.a_type, args.transpose_a, args.lda, row, p)
                           : 0.0f;
      const int64_t col = col0 + mm;
      b_tile[kk][mm] = (col < args.n && p < args.k)
                           ? operand_at(b_base, args.b_type, args.transpose_b, args.ldb, p, col)
                           : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSlice; ++kk) {
      float a_values[4], b_values[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a_values[i] = a_tile[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b_values[j] = b_tile[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a_values[i], b_values[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = row0 + ty + 16 * i;
    if (row >= args.m) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = col0 + tx + 16 * j;
      if (col >= args.n) continue;
      const int64_t index = row * args.ldc + col;
      float value = args.alpha * acc[i][j];
      // beta == 0: c is not read (it may hold NaN).
      if (args.beta != 0.0f) value += args.beta * load_float(c_base, args.c_type, index);
      store_float(c_base, args.c_type, index, value);
    }
  }
}

}  // namespace

struct GemmContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  uint64_t workspace_bytes = 0;
  std::mutex mutex;  // guards plans
  std::map<PlanKey, Plan> plans;
};

GemmContext* gemm_context_create(void* workspace, uint64_t workspace_bytes) {
  auto* context = new GemmContext;
  MT_CUBLAS_CHECK(cublasLtCreate(&context->handle));
  context->workspace = workspace;
  context->workspace_bytes = workspace_bytes;
  return context;
}

void gemm_context_set_workspace(GemmContext* context, void* workspace, uint64_t workspace_bytes) {
  context->workspace = workspace;
  context->workspace_bytes = workspace_bytes;
}

void gemm_context_destroy(GemmContext* context) {
  if (context == nullptr) return;
  for (auto& [key, plan] : context->plans) {
    if (plan.a) MT_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(plan.a));
    if (plan.b) MT_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(plan.b));
    if (plan.c) MT_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(plan.c));
    if (plan.desc) MT_CUBLAS_CHECK(cublasLtMatmulDescDestroy(plan.desc));
  }
  MT_CUBLAS_CHECK(cublasLtDestroy(context->handle));
  delete context;
}

void gemm_fallback(const GemmArgs& args, cudaStream_t stream) {
  if (args.m == 0 || args.n == 0 || args.batch == 0) return;
  for (int64_t z0 = 0; z0 < args.batch; z0 += 65535) {
    GemmArgs part = args;
    const int64_t count = args.batch - z0 < 65535 ? args.batch - z0 : 65535;
    part.a = static_cast<const char*>(args.a) + z0 * args.stride_a * dtype_size(args.a_type);
    part.b = static_cast<const char*>(args.b) + z0 * args.stride_b * dtype_size(args.b_type);
    part.c = static_cast<char*>(args.c) + z0 * args.stride_c * dtype_size(args.c_type);
    part.batch = count;
    const dim3 grid(static_cast<unsigned>((args.n + kTile - 1) / kTile),
                    static_cast<unsigned>((args.m + kTile - 1) / kTile),
                    static_cast<unsigned>(count));
    gemm_fallback_kernel<<<grid, kFallbackThreads, 0, stream>>>(part);
    MT_CUDA_CHECK_LAUNCH();
  }
}

void gemm(GemmContext* context, const GemmArgs& args, cudaStream_t stream) {
  if (args.m == 0 || args.n == 0 || args.batch == 0) return;
  if (args.k == 0 || !lt_supports(args) || args.batch > INT32_MAX) {
    gemm_fallback(args, stream);
    return;
  }
  Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(context->mutex);
    const PlanKey key = plan_key(args);
    auto found = context->plans.find(key);
    if (found == context->plans.end()) {
      Plan fresh;
      MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&fresh.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      // cuBLASLt's A is our B, its B our A (see the top of the file).
      const cublasOperation_t trans_a = args.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
      const cublasOperation_t trans_b = args.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
      MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(fresh.desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                     &trans_a, sizeof(trans_a)));
      MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(fresh.desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                     &trans_b, sizeof(trans_b)));
      // Stored shapes in column-major terms: our B is [k, n] row-major = [n, k] column-major
      // (or [n, k] row-major = [k, n] when transposed); likewise our A; C is [n, m].
      fresh.a = args.transpose_b ? make_layout(args.b_type, args.k, args.n, args.ldb, args.batch, args.stride_b)
                                 : make_layout(args.b_type, args.n, args.k, args.ldb, args.batch, args.stride_b);
      fresh.b = args.transpose_a ? make_layout(args.a_type, args.m, args.k, args.lda, args.batch, args.stride_a)
                                 : make_layout(args.a_type, args.k, args.m, args.lda, args.batch, args.stride_a);
      fresh.c = make_layout(args.c_type, args.n, args.m, args.ldc, args.batch, args.stride_c);

      cublasLtMatmulPreference_t preference = nullptr;
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &context->workspace_bytes,
          sizeof(context->workspace_bytes)));
      // The heuristic assumes 256-byte aligned pointers unless told otherwise; views made by
      // slicing rows can be less aligned than that.
      const uint32_t align_a = pointer_alignment(args.b), align_b = pointer_alignment(args.a),
                     align_c = pointer_alignment(args.c);
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));
      cublasLtMatmulHeuristicResult_t result{};
      int returned = 0;
      const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
          context->handle, fresh.desc, fresh.a, fresh.b, fresh.c, fresh.c, preference, 1, &result,
          &returned);
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(preference));
      // NOT_SUPPORTED (or no result) is an answer, not an error: the fallback kernel runs.
      if (status == CUBLAS_STATUS_SUCCESS && returned > 0) {
        fresh.algo = result.algo;
        fresh.usable = true;
      } else if (status != CUBLAS_STATUS_NOT_SUPPORTED) {
        MT_CUBLAS_CHECK(status);
      }
      found = context->plans.emplace(key, fresh).first;
    }
    plan = &found->second;
  }
  if (!plan->usable) {
    gemm_fallback(args, stream);
    return;
  }
  MT_CUBLAS_CHECK(cublasLtMatmul(context->handle, plan->desc, &args.alpha, args.b, plan->a, args.a,
                                 plan->b, &args.beta, args.c, plan->c, args.c, plan->c,
                                 &plan->algo, context->workspace, context->workspace_bytes,
                                 stream));
}

}  // namespace memtune::cuda
