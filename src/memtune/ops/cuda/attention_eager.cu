// Eager causal GQA attention on the GPU, as HF's eager path (ops/cpu/attention_eager.cpp has the
// formulas): the [batch, n_heads, seq, seq] scores and probabilities are materialised in their
// storage dtypes, the four products are cuBLASLt GEMMs strided-batched over the batch (one call
// per head), and the softmax and its backward are row kernels in fp32.
//
// GQA without repeated K/V: query head h reads kv head h / group through pointer arithmetic on
// the [N, n_kv_heads * head_dim] layout (leading dimension n_kv_heads * head_dim).
//
// dK and dV of a kv head sum over the group's query heads. With f32 dk/dv the GEMMs accumulate
// into them (beta = 1). With 16-bit dk/dv and a group > 1 the sum is kept in fp32, one kv head at
// a time, in dq's memory (which holds N * n_heads * head_dim 16-bit values, at least the
// N * head_dim floats needed once n_heads >= 2) and rounded once into dk/dv; dq is computed last.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool visible(const int32_t* segments_row, int64_t i, int64_t j) {
  return j <= i && (segments_row == nullptr || segments_row[i] == segments_row[j]);
}

// One block per row (b, h, i) of the scores.
__global__ void __launch_bounds__(kThreads)
    softmax_forward_kernel(void* probs, DType probs_type, const void* scores, DType scores_type,
                           int64_t seq, int64_t n_heads, const int32_t* segments) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const int64_t i = row % seq, b = row / (seq * n_heads);
  const int32_t* segments_row = segments == nullptr ? nullptr : segments + b * seq;
  const int64_t offset = row * seq;
  float row_max = -INFINITY;
  for (int64_t j = threadIdx.x; j <= i; j += kThreads)
    if (visible(segments_row, i, j))
      row_max = fmaxf(row_max, load_float(scores, scores_type, offset + j));
  row_max = block_max(row_max, shared);  // finite: the diagonal is always visible
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j <= i; j += kThreads)
    if (visible(segments_row, i, j)) sum += expf(load_float(scores, scores_type, offset + j) - row_max);
  sum = block_sum(sum, shared);
  for (int64_t j = threadIdx.x; j < seq; j += kThreads) {
    const float p = visible(segments_row, i, j)
                        ? expf(load_float(scores, scores_type, offset + j) - row_max) / sum
                        : 0.0f;
    store_float(probs, probs_type, offset + j, p);
  }
}

// dS = P (dP - rowsum(P dP)) * scale, in place over dP; masked entries of dP count as 0.
__global__ void __launch_bounds__(kThreads)
    softmax_backward_kernel(void* dprobs, DType dprobs_type, const void* probs, DType probs_type,
                            int64_t seq, int64_t n_heads, const int32_t* segments, float scale) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const int64_t i = row % seq, b = row / (seq * n_heads);
  const int32_t* segments_row = segments == nullptr ? nullptr : segments + b * seq;
  const int64_t offset = row * seq;
  float p_dot_dp = 0.0f;
  for (int64_t j = threadIdx.x; j <= i; j += kThreads)
    if (visible(segments_row, i, j))
      p_dot_dp = fmaf(load_float(probs, probs_type, offset + j),
                      load_float(dprobs, dprobs_type, offset + j), p_dot_dp);
  p_dot_dp = block_sum(p_dot_dp, shared);
  for (int64_t j = threadIdx.x; j < seq; j += kThreads) {
    float ds = 0.0f;
    if (visible(segments_row, i, j)) {
      const float p = load_float(probs, probs_type, offset + j);
      ds = p * (load_float(dprobs, dprobs_type, offset + j) - p_dot_dp) * scale;
    }
    store_float(dprobs, dprobs_type, offset + j, ds);
  }
}

// Views of one head, batched over b (see cuda_ops.h: GemmArgs is row-major).
struct HeadView {
  const char* base;
  DType type;
  int64_t ld, stride;
};

HeadView head_of(const void* x, DType type, const AttentionParams& p, int64_t heads, int64_t h) {
  return HeadView{static_cast<const char*>(x) + h * p.head_dim * dtype_size(type), type,
                  heads * p.head_dim, p.seq * heads * p.head_dim};
}

HeadView matrix_of(const void* x, DType type, const AttentionParams& p, int64_t h) {
  return HeadView{static_cast<const char*>(x) + h * p.seq * p.seq * dtype_size(type), type, p.seq,
                  p.n_heads * p.seq * p.seq};
}

void batched_gemm(GemmContext* context, const AttentionParams& p, const HeadView& c,
                  const HeadView& a, bool transpose_a, const HeadView& b, bool transpose_b,
                  int64_t m, int64_t n, int64_t k, float alpha, float beta, cudaStream_t stream) {
  GemmArgs args;
  args.c = const_cast<char*>(c.base);
  args.c_type = c.type;
  args.ldc = c.ld;
  args.stride_c = c.stride;
  args.a = a.base;
  args.a_type = a.type;
  args.transpose_a = transpose_a;
  args.lda = a.ld;
  args.stride_a = a.stride;
  args.b = b.base;
  args.b_type = b.type;
  args.transpose_b = transpose_b;
  args.ldb = b.ld;
  args.stride_b = b.stride;
  args.m = m;
  args.n = n;
  args.k = k;
  args.batch = p.batch;
  args.alpha = alpha;
  args.beta = beta;
  gemm(context, args, stream);
}

unsigned rows_grid(const AttentionParams& p) {
  return static_cast<unsigned>(p.batch * p.n_heads * p.seq);
}

}  // namespace

void attention_eager_forward(GemmContext* gemm_context, const AttentionParams& p, void* out,
                             DType out_type, void* probs, DType probs_type, void* scores,
                             DType scores_type, const void* q, DType q_type, const void* k,
                             DType k_type, const void* v, DType v_type, cudaStream_t stream) {
  const int64_t group = p.n_heads / p.n_kv_heads, s = p.seq, d = p.head_dim;
  for (int64_t h = 0; h < p.n_heads; ++h)
    batched_gemm(gemm_context, p, matrix_of(scores, scores_type, p, h),
                 head_of(q, q_type, p, p.n_heads, h), false,
                 head_of(k, k_type, p, p.n_kv_heads, h / group), true, s, s, d, p.scale, 0.0f,
                 stream);
  softmax_forward_kernel<<<rows_grid(p), kThreads, 0, stream>>>(probs, probs_type, scores,
                                                                 scores_type, s, p.n_heads,
                                                                 p.segments);
  MT_CUDA_CHECK_LAUNCH();
  for (int64_t h = 0; h < p.n_heads; ++h)
    batched_gemm(gemm_context, p, head_of(out, out_type, p, p.n_heads, h),
                 matrix_of(probs, probs_type, p, h), false,
                 head_of(v, v_type, p, p.n_kv_heads, h / group), false, s, d, s, 1.0f, 0.0f,
                 stream);
}

void attention_eager_backward(GemmContext* gemm_context, const AttentionParams& p, void* dq,
                              DType dq_type, void* dk, DType dk_type, void* dv, DType dv_type,
                              void* dprobs, DType dprobs_type, const void* d_out,
                              DType d_out_type, const void* probs, DType probs_type,
                              const void* q, DType q_type, const void* k, DType k_type,
                              const void* v, DType v_type, cudaStream_t stream) {
  const int64_t group = p.n_heads / p.n_kv_heads, s = p.seq, d = p.head_dim;
  // dP = dO V^T, then dS in place.
  for (int64_t h = 0; h < p.n_heads; ++h)
    batched_gemm(gemm_context, p, matrix_of(dprobs, dprobs_type, p, h),
                 head_of(d_out, d_out_type, p, p.n_heads, h), false,
                 head_of(v, v_type, p, p.n_kv_heads, h / group), true, s, s, d, 1.0f, 0.0f,
                 stream);
  softmax_backward_kernel<<<rows_grid(p), kThreads, 0, stream>>>(
      dprobs, dprobs_type, probs, probs_type, s, p.n_heads, p.segments, p.scale);
  MT_CUDA_CHECK_LAUNCH();

  // dK = sum over the group of dS^T Q; dV = sum of P^T dO.
  for (int64_t g = 0; g < p.n_kv_heads; ++g) {
    for (int which = 0; which < 2; ++which) {  // 0: dK, 1: dV
      void* target = which == 0 ? dk : dv;
      const DType target_type = which == 0 ? dk_type : dv_type;
      const void* matrix = which == 0 ? static_cast<const void*>(dprobs) : probs;
      const DType matrix_type = which == 0 ? dprobs_type : probs_type;
      const void* rows = which == 0 ? q : d_out;
      const DType rows_type = which == 0 ? q_type : d_out_type;
      const bool direct = group == 1 || target_type == DType::f32;
      // The sum's destination: the kv head's columns of dk/dv, or fp32 [batch, seq, d] in dq.
      const HeadView destination =
          direct ? head_of(target, target_type, p, p.n_kv_heads, g)
                 : HeadView{static_cast<const char*>(dq), DType::f32, d, s * d};
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        batched_gemm(gemm_context, p, destination, matrix_of(matrix, matrix_type, p, h), true,
                     head_of(rows, rows_type, p, p.n_heads, h), false, s, d, s, 1.0f,
                     h == g * group ? 0.0f : 1.0f, stream);
      if (!direct)
        launch_copy_2d(static_cast<char*>(target) + g * d * dtype_size(target_type), target_type,
                       p.n_kv_heads * d, dq, DType::f32, d, p.batch * s, d, stream);
    }
  }
  // dQ = dS K (one query head per call, nothing to sum).
  for (int64_t h = 0; h < p.n_heads; ++h)
    batched_gemm(gemm_context, p, head_of(dq, dq_type, p, p.n_heads, h),
                 matrix_of(dprobs, dprobs_type, p, h), false,
                 head_of(k, k_type, p, p.n_kv_heads, h / group), false, s, d, s, 1.0f, 0.0f,
                 stream);
}

}  // namespace memtune::cuda
