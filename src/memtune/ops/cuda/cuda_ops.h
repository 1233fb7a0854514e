// The kernels of the CUDA backend behind plain launch functions: raw device pointers, dtypes and
// plain parameter structs (flash-attention's flash.h style), so that the .cu files need neither
// Tensor nor fmt. (fmt 9, header-only in C++20 mode, uses consteval format strings that nvcc 13
// cannot compile; core/tensor.h includes it through core/error.h. So the CudaBackend methods,
// which take Tensors and check them with MT_ASSERT, live in cuda_backend.cpp and call these.)
//
// Every launch goes to the given stream and returns without synchronising. Sizes are int64.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "memtune/core/dtype.h"

namespace memtune::cuda {

// ---- elementwise (cuda_backend.cu) ---------------------------------------------------------
// The bandwidth-bound kernels (fill, convert, add, scale, embedding, rmsnorm, rope, swiglu) run
// a kernel instantiated for their dtypes with 16-byte accesses (cuda_vector.h), and a generic
// kernel that switches on the dtypes at run time for the other dtype mixes. This process-wide
// switch sends every launch to the generic kernels: the tests check both paths with it and the
// bandwidth test times one against the other. Off by default.
void set_generic_kernels_only(bool generic_only);
bool generic_kernels_only();
void launch_fill(void* dst, DType dst_type, int64_t n, float value, cudaStream_t stream);
void launch_convert(void* dst, DType dst_type, const void* src, DType src_type, int64_t n,
                    cudaStream_t stream);
void launch_add(void* dst, DType dst_type, const void* a, DType a_type, const void* b,
                DType b_type, int64_t n, cudaStream_t stream);
void launch_scale(void* dst, DType dst_type, int64_t n, float value, cudaStream_t stream);
// distribution: 0 normal(a, b), 1 uniform[a, b) (Backend::Distribution order).
void launch_fill_random(void* dst, DType dst_type, int64_t n, int distribution, float a, float b,
                        uint64_t seed, cudaStream_t stream);
// Strided 2-D copy with conversion: dst[r * dst_ld + c] = src[r * src_ld + c].
void launch_copy_2d(void* dst, DType dst_type, int64_t dst_ld, const void* src, DType src_type,
                    int64_t src_ld, int64_t rows, int64_t cols, cudaStream_t stream);
// Batched f32 transpose (transpose.cu): dst[b][c][r] = src[b][r][c] for b < batch, r < rows,
// c < cols (the cuDNN op's ragged row statistics: [tokens, heads] <-> [batch, heads, seq]).
void launch_transpose_f32(float* dst, const float* src, int64_t batch, int64_t rows, int64_t cols,
                          cudaStream_t stream);

// Deterministic fp32 sums: partial sums per block go to `partials` (at most kMaxPartials
// floats, a buffer the backend owns), then one block adds them in a fixed order onto *acc.
constexpr int kMaxPartials = 1 << 16;
void launch_sum_squares(float* acc, const void* x, DType x_type, int64_t n, float* partials,
                        cudaStream_t stream);
// *acc += sum(values[0, n)) in a fixed order (n <= kMaxPartials), one block.
void launch_add_sum(float* acc, const float* values, int64_t n, cudaStream_t stream);

// ---- GEMM (matmul.cu) -------------------------------------------------------------------------
// Row-major, strided-batched: for each batch index z,
//   C_z[m, n] = alpha * op(A_z)[m, k] @ op(B_z)[k, n] + beta * C_z (C not read when beta == 0).
// op(A) = A stored [m, k] (ld lda) or, transposed, A stored [k, m] (ld lda); the same for B.
struct GemmArgs {
  void* c = nullptr;
  DType c_type = DType::f32;
  int64_t ldc = 0, stride_c = 0;
  const void* a = nullptr;
  DType a_type = DType::f32;
  bool transpose_a = false;
  int64_t lda = 0, stride_a = 0;
  const void* b = nullptr;
  DType b_type = DType::f32;
  bool transpose_b = false;
  int64_t ldb = 0, stride_b = 0;
  int64_t m = 0, n = 0, k = 0;
  int64_t batch = 1;
  float alpha = 1.0f, beta = 0.0f;
};

// The cuBLASLt handle, its workspace and a cache of the chosen algorithms.
struct GemmContext;
GemmContext* gemm_context_create(void* workspace, uint64_t workspace_bytes);
// Points later GEMMs at another workspace. The algorithms already chosen were chosen for the
// old size, so the size must not shrink (the backend always binds the same size).
void gemm_context_set_workspace(GemmContext* context, void* workspace, uint64_t workspace_bytes);
void gemm_context_destroy(GemmContext* context);
// cuBLASLt where it takes the dtypes (A and B of one dtype; f32 in -> f32 out, 16-bit in -> the
// same 16-bit or f32 out) and finds an algorithm; otherwise a plain fp32 tiled kernel.
void gemm(GemmContext* context, const GemmArgs& args, cudaStream_t stream);
// The fallback kernel alone (tests reach it through mixed dtypes).
void gemm_fallback(const GemmArgs& args, cudaStream_t stream);

// ---- model ops ----------------------------------------------------------------------------------
void launch_embedding(void* out, DType out_type, const void* table, DType table_type,
                      int64_t vocab, int64_t hidden, const int32_t* ids, int64_t n,
                      cudaStream_t stream);
void launch_rmsnorm_forward(void* out, DType out_type, float* rstd, const void* x, DType x_type,
                            const void* weight, DType weight_type, int64_t rows, int64_t hidden,
                            float eps, cudaStream_t stream);
void launch_rmsnorm_backward(void* dx, DType dx_type, const void* dy, DType dy_type,
                             const void* x, DType x_type, const void* weight, DType weight_type,
                             const float* rstd, int64_t rows, int64_t hidden, bool accumulate,
                             cudaStream_t stream);
// positions: i32 or f32 [tokens].
void launch_rope(void* x, DType x_type, int64_t tokens, int64_t width, const void* positions,
                 DType positions_type, const float* inv_freq, int64_t head_dim, bool inverse,
                 cudaStream_t stream);
void launch_swiglu_forward(void* out, DType out_type, const void* gate, DType gate_type,
                           const void* up, DType up_type, int64_t n, cudaStream_t stream);
void launch_swiglu_backward(void* d_gate, DType d_gate_type, void* d_up, DType d_up_type,
                            const void* d_out, DType d_out_type, const void* gate,
                            DType gate_type, const void* up, DType up_type, int64_t n,
                            cudaStream_t stream);

// A projection's LoRA B term with the residual add in one pass (lora_epilogue.cu): one storage
// dtype for every operand, contiguous rows; u [rows, rank], b [cols, rank]. Returns false,
// launching nothing, where the kernel does not serve the call (a rank other than 4, 8, 16, a
// dtype mix, or generic_kernels_only()): the caller then runs the separate ops.
bool launch_lora_residual_forward(void* y, const void* u, const void* b, const void* residual, DType dtype,
                                  float scale, int64_t rows, int64_t cols, int64_t rank, cudaStream_t stream);

// ---- attention ----------------------------------------------------------------------------------
struct AttentionParams {
  int64_t batch = 0, seq = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  float scale = 0.0f;
  const int32_t* segments = nullptr;  // i32 [batch * seq] or null
};

void attention_eager_forward(GemmContext* gemm_context, const AttentionParams& p, void* out,
                             DType out_type, void* probs, DType probs_type, void* scores,
                             DType scores_type, const void* q, DType q_type, const void* k,
                             DType k_type, const void* v, DType v_type, cudaStream_t stream);
void attention_eager_backward(GemmContext* gemm_context, const AttentionParams& p, void* dq,
                              DType dq_type, void* dk, DType dk_type, void* dv, DType dv_type,
                              void* dprobs, DType dprobs_type, const void* d_out,
                              DType d_out_type, const void* probs, DType probs_type,
                              const void* q, DType q_type, const void* k, DType k_type,
                              const void* v, DType v_type, cudaStream_t stream);

// Tensors of the flash kernels: q/k/v/out/d_out and dq/dk/dv with their dtypes.
struct FlashTensors {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;  // written by the forward, read by the backward
  const void* d_out = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  DType q_type = DType::bf16, k_type = DType::bf16, v_type = DType::bf16;
  DType out_type = DType::bf16, d_out_type = DType::bf16;
  DType dq_type = DType::bf16, dk_type = DType::bf16, dv_type = DType::bf16;
  float* lse = nullptr;       // f32 [batch, n_heads, seq]
  float* delta = nullptr;     // f32 [batch, n_heads, seq] (backward)
  float* dq_accum = nullptr;  // f32 [N, n_heads * head_dim] (backward)
};
void attention_flash_forward(const AttentionParams& p, const FlashTensors& t,
                             cudaStream_t stream);
void attention_flash_backward(const AttentionParams& p, const FlashTensors& t,
                              cudaStream_t stream);
// Whether the tensor-core kernels take these arguments (else the generic kernels run).
bool attention_flash_uses_tensor_cores(const AttentionParams& p, const FlashTensors& t,
                                       bool backward);

// ---- attention_decode (attention_decode.cu) ----
// One query per sequence against its cache: q, out [batch, n_heads * head_dim]; k_cache, v_cache
// [batch, capacity, n_kv_heads * head_dim], rows [0, kv_len) attended (1 <= kv_len <= capacity),
// head_dim <= 256. Any float dtype for each tensor; fp32 math.
struct AttentionDecodeArgs {
  int64_t batch = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, kv_len = 0, capacity = 0;
  float scale = 0.0f;
  const void* q = nullptr;
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  void* out = nullptr;
  DType q_type = DType::bf16, k_type = DType::bf16, v_type = DType::bf16, out_type = DType::bf16;
};
void attention_decode(const AttentionDecodeArgs& args, cudaStream_t stream);
// ---- end attention_decode ----

// ---- loss, dropout, optimizer ---------------------------------------------------------------------
// row_losses: f32 scratch of at least min(rows, kMaxPartials) floats.
void launch_cross_entropy(float* loss_sum, void* d_logits, DType d_logits_type,
                          const void* logits, DType logits_type, const int32_t* targets,
                          int64_t rows, int64_t vocab, float grad_scale, float* row_losses,
                          cudaStream_t stream);
// Element i of x is masked as element index_offset + i (a row slice of a larger tensor).
void launch_dropout(void* out, DType out_type, const void* x, DType x_type, int64_t n, float p,
                    uint64_t seed, uint64_t index_offset, cudaStream_t stream);
struct AdamWScalars {
  float decay_factor, avg_weight, beta2, sq_weight, bias_correction2_sqrt, neg_step_size, eps,
      grad_scale;
};
void launch_adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                  const AdamWScalars& s, cudaStream_t stream);

// ---- QLoRA 4-bit quantize / dequantize (quant4bit.cu) ----------------------------------------
// The kernels reproduce the CPU reference of quant/nf4.h bit for bit; every constant they use is
// handed over from the host (from quant/codebook.h), never retyped, so that both sides compare
// against the very same floats.
struct Quant4bitTables {
  bool is_nf4 = true;
  float code_values[16] = {};     // nf4_code_values() / fp4_code_values() (the dequantize LUT)
  float nf4_thresholds[15] = {};  // nf4_thresholds(), ascending
  float fp4_thresholds[7] = {};   // fp4_magnitude_thresholds(), ascending
  // The FP4 magnitude code for "exceeds r thresholds" in bits [4r, 4r + 4)
  // (codebook::kFp4CodeByRankPacked).
  uint32_t fp4_code_by_rank = 0;
};

// Stage 1 of quantize_4bit: per block of `blocksize` elements, absmax (fp32, into `absmax`) and
// the packed codes; and a scan for NaN / Inf. With `sum_absmax` (double quant) it also reduces
// the absmax values in a fixed order. Synchronises (the results are needed on the host).
struct Quantize4bitBlocksArgs {
  const void* dense = nullptr;
  DType dense_type = DType::f32;
  int64_t n = 0;
  int64_t blocksize = 64;
  uint8_t* packed = nullptr;  // (n + 1) / 2 bytes
  float* absmax = nullptr;    // ceil(n / blocksize) floats
  bool sum_absmax = false;
  void* scratch = nullptr;    // the backend's reduction scratch (at least 64 KiB)
  uint64_t scratch_bytes = 0;
};
struct Quantize4bitBlocksResult {
  int64_t first_non_finite = -1;  // lowest flat index of a NaN / Inf element, -1 if none
  double absmax_sum = 0.0;        // sum of absmax in double (sum_absmax only)
  float min_nonzero_absmax = 0.0f;  // smallest absmax > 0; +inf when all are 0 (sum_absmax only)
};
Quantize4bitBlocksResult quantize_4bit_blocks(const Quantize4bitBlocksArgs& args,
                                              const Quant4bitTables& tables, cudaStream_t stream);

// Stage 2 (double quant): codes[i] and nested_absmax from centered = absmax[i] - offset per
// nested block, against nested_map (256 sorted floats on the device).
void launch_double_quantize_absmax(const float* absmax, int64_t blocks, int64_t nested_blocksize,
                                   float offset, const float* nested_map, uint8_t* codes,
                                   float* nested_absmax, cudaStream_t stream);

struct Dequantize4bitArgs {
  void* out = nullptr;
  DType out_type = DType::bf16;  // f32, f16 or bf16
  const uint8_t* packed = nullptr;
  int64_t n = 0;
  int64_t blocksize = 64;
  const float* absmax = nullptr;  // f32 per block (no double quant)
  bool double_quant = false;
  const uint8_t* absmax_codes = nullptr;  // double quant: u8 per block,
  const float* nested_absmax = nullptr;   // f32 per nested block,
  const float* nested_map = nullptr;      // 256 floats,
  float nested_offset = 0.0f;             // and the mean offset
  int64_t nested_blocksize = 256;
};
void launch_dequantize_4bit(const Dequantize4bitArgs& args, const Quant4bitTables& tables,
                            cudaStream_t stream);

}  // namespace memtune::cuda
