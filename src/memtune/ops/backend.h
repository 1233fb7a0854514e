// The op interface: every computation of the training step goes through a Backend.
//
// Implementations: ops/cpu (the reference: fp32 math over f32/bf16/f16 storage), ops/cuda, and
// the meta backend (plan/meta_backend.h), which does no arithmetic so that the planner can run
// the step itself. All tensors are contiguous, row-major and live on the backend's device.
// Unless a comment says otherwise, math is fp32 and results are rounded once to the output's
// dtype; inputs and outputs may have different float dtypes.
//
// Layouts (N = batch * seq tokens, row-major):
//   activations      [N, features]
//   q                [N, n_heads * head_dim]      (= [batch, seq, heads, head_dim])
//   k, v             [N, n_kv_heads * head_dim]
//   eager probs      [batch, n_heads, seq, seq]
//   flash lse        [batch, n_heads, seq]        f32, natural log
//   linear weights   [out_features, in_features]  (HF nn.Linear layout)
//
// Room ops/ (docs/ARCHITECTURE.md): the op interface and its backends; may include core/ and quant/.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "memtune/core/tensor.h"
#include "memtune/quant/nf4.h"

namespace memtune {

struct AttentionDims {
  int64_t batch = 0, seq = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  float scale = 0.0f;  // softmax scale, head_dim^-0.5
  // Sliding window (Mistral): query i also loses the keys j with i - j >= window, as
  // transformers' sliding-window mask does; 0: none. Only the CPU backend applies one; the CUDA
  // kernels take only windows that mask nothing (seq <= window), which the step ensures.
  int64_t window = 0;
  int64_t tokens() const { return batch * seq; }
  int64_t group() const { return n_heads / n_kv_heads; }  // query heads per kv head (GQA)
};

// The softmax scale of scaled dot-product attention: head_dim^-0.5 (AttentionDims::scale).
inline float attention_softmax_scale(int64_t head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

// The f32 scratch the step plans for the cuDNN attention op (Backend::attention_cudnn_*). Measured
// on the H200 with cuDNN 9.14 (tests/gpu/test_cuda_attention_cudnn.cpp prints them): the backward
// wants 2 x 4 * batch * n_heads * seq * head_dim (its dq accumulator, twice the flash one) + 4 *
// batch * n_heads * seq (a row statistic) + 256 bytes; 539 MB at b8 s2048 32 heads d128, 135 MB
// at the ladder's b2. The bound takes seq padded to 128, row statistics and 1 MiB on top; it
// is at least the flash dq accumulator, so the packed-rows fallback fits in it too. The forward
// wants 256 bytes. A graph that wants more than planned fails with a clear error rather than
// allocating.
//
// Packed rows (RaggedAttention below). The backward's ragged graph is given the token count as
// its max_total_seq_len_q, and the op puts its copy of lse, in the layout cuDNN reads, in front of
// cuDNN's workspace (one more row statistic, which the dense bound's third one covers). Measured
// on an H100 with cuDNN 9.14 (the GPU test's WORKSPACE lines, bench/results/2026-12-06-h100-data-
// modes): the ragged backward wants 4 * n_heads * head_dim * (tokens + slots * max_len) bytes, +
// ~2 row statistics: its dq accumulator is sized by the tokens, a second buffer by the padded
// [slots, max_len] layout. So a run whose rows are packed (RunConfig::packed_rows: --packing,
// --padding_free) plans kRaggedSlotRoom * tokens * n_heads * head_dim more floats: room for
// slots * max_len up to about 4x the tokens (~60 chat samples of <= 256 tokens in 2 x 2,048; four
// 2,048-token samples in 8,192), at 3 x 64 MiB for an 8B model at 2 x 2,048. A batch whose graph
// wants more runs memtune's flash kernel (exact, slower), which the op counts and says once; an
// unpacked run pays nothing. The forward's bound has a second row statistic (one f32 per query
// row) and 1 MiB: cuDNN writes its ragged Stats token-major into the workspace, and the op
// transposes them into lse.
inline constexpr int64_t kRaggedSlotRoom = 3;

inline int64_t cudnn_attention_workspace_floats(const AttentionDims& d, bool backward,
                                                bool packed_rows = false) {
  if (!backward) return 2 * d.batch * d.n_heads * d.seq + (int64_t{1} << 18);
  const int64_t rows = d.batch * d.n_heads * ((d.seq + 127) / 128 * 128);
  const int64_t slot_room = packed_rows ? kRaggedSlotRoom * d.tokens() * d.n_heads * d.head_dim : 0;
  return rows * (2 * d.head_dim + 3) + slot_room + (int64_t{1} << 18);
}

// Packed rows (several samples in a row) for the cuDNN op: the device copy of the micro-batch's
// sequence table (ops/ragged_attention.h) and what the host knows of it. The step fills it for
// batches that are not one sample per row; empty means the op's dense path, where causal masking
// alone is exact.
struct RaggedAttention {
  Tensor table;            // i32 [kRaggedTableRows * (capacity + 1)]
  int64_t capacity = 0;    // the table's row stride is capacity + 1
  int64_t sequences = 0;   // real sequences
  int64_t slots = 0;       // sequence slots (>= sequences; the rest have length 0)
  int64_t max_len = 0;     // >= the longest sequence
  int64_t rows = 0, seq = 0;  // the batch shape the table describes (checked against the dims)
  bool empty() const { return slots == 0; }
};

// True when this build has cuDNN attention and the loaded libcudnn (9.x) and the GPU can run it.
bool cudnn_attention_available();
// What "auto" fused attention means for a run on `target`: "cudnn" (the faster one on the H200,
// bench/NOTES.md) on a CUDA device that has it, else "flash" (memtune's own kernel).
inline const char* fastest_fused_attention(Device target) {
  return target == Device::cuda && cudnn_attention_available() ? "cudnn" : "flash";
}

struct AdamWParams {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 1e-2f;
  int64_t step = 1;          // 1-based, after increment (torch semantics, SPECS.md §8)
  float grad_scale = 1.0f;   // applied to the stored grad first: fp16 unscale times clip coef
};

// A frozen linear weight in bitsandbytes' 4-bit form (SPECS.md §1), on a backend's device.
struct Quantized4bit {
  QuantConfig config;
  Shape shape;           // [out, in] of the dense weight
  Tensor packed;         // u8 [(n + 1) / 2]; element 2j in the high nibble
  Tensor absmax;         // f32 [blocks] without double quant; u8 codes [blocks] with it
  Tensor nested_absmax;  // f32 [nested blocks] (double quant)
  Tensor code_map;       // f32 [16]: the nf4 or fp4 values
  Tensor nested_map;     // f32 [256]: the signed dynamic map (double quant)
  float nested_offset = 0.0f;
  bool empty() const { return packed.empty(); }
};

// A handle to an event of the backend's copy stream (see Backend::create_event).
struct CopyEvent {
  int32_t id = -1;
};

class Memory;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;

  // ---- memory -------------------------------------------------------------------------
  virtual void* allocate_arena(uint64_t bytes) = 0;  // once per run
  virtual void free_arena(void* base) = 0;
  virtual void copy_from_host(const Tensor& dst, const void* host_src) = 0;  // same dtype/bytes
  virtual void copy_to_host(void* host_dst, const Tensor& src) = 0;
  virtual void synchronize() {}
  // Device scratch that the backend's ops need beside their tensor arguments (a GEMM library's
  // workspace, reduction partials). The engine plans one buffer of this many bytes
  // (MemCategory::workspace) and binds it before running anything, so that nothing outside the
  // plan is allocated; binding an empty tensor unbinds it. Standalone use without a binding
  // falls back to scratch that the backend allocates itself on first use.
  virtual uint64_t workspace_bytes() const { return 0; }
  virtual void bind_workspace(const Tensor& workspace) {}

  // ---- offload: pinned host memory, a copy stream and events ----
  // Activation offloading moves device buffers to host memory and back while the ops run. The
  // copies go on a copy stream beside the compute stream (which runs every op and every other
  // copy), so that they overlap with the arithmetic. Each asynchronous copy begins only after
  // all the work issued to the compute stream before it (so it reads a finished source, and it
  // does not overwrite a destination that an earlier op still reads), and it records `done` on
  // the copy stream; compute_wait(done) makes the compute work issued after it wait for the
  // copy. The defaults are synchronous (plain copies: done is complete at once), which is
  // exactly the ordering above, on a backend that has one stream.
  //
  // Host memory for these copies is allocated once per run, like the arena (pinned on CUDA, so
  // that the copies are asynchronous and run at full link speed); the step records its bytes in
  // Memory so that the plan shows them.
  virtual void* allocate_host(uint64_t bytes);
  virtual void free_host(void* base);
  // Events are created once per run, not per step.
  virtual CopyEvent create_event() { return CopyEvent{next_event_id_++}; }
  virtual void destroy_event(CopyEvent) {}
  virtual void copy_to_host_async(void* host_dst, const Tensor& src, CopyEvent /*done*/) {
    copy_to_host(host_dst, src);
  }
  virtual void copy_from_host_async(const Tensor& dst, const void* host_src, CopyEvent /*done*/) {
    copy_from_host(dst, host_src);
  }
  virtual void compute_wait(CopyEvent /*done*/) {}
  // ---- end offload ----

  // ---- elementwise ----------------------------------------------------------------------
  virtual void fill(const Tensor& dst, float value) = 0;
  // dst = src, converting dtype (same element count).
  virtual void convert(const Tensor& dst, const Tensor& src) = 0;
  // dst = a + b (dst may alias a or b).
  virtual void add(const Tensor& dst, const Tensor& a, const Tensor& b) = 0;
  // dst[i, :] = row for every row of dst [N, C], row [C] converted to dst's dtype. A projection's
  // bias goes in first and the GEMM adds x W^T onto it (beta 1), so that y = x W^T + b is rounded
  // once, as F.linear's addmm rounds it.
  virtual void broadcast_rows(const Tensor& dst, const Tensor& row) = 0;

  // ---- GEMM -------------------------------------------------------------------------------
  // c = alpha * op(a) @ op(b) + beta * c, on 2-D views: op(a) is [M, K], op(b) is [K, N], c is
  // [M, N]. With beta == 0, c is not read (it may hold garbage or NaN).
  virtual void matmul(const Tensor& c, const Tensor& a, bool transpose_a, const Tensor& b,
                      bool transpose_b, float alpha, float beta) = 0;

  // ---- model ops ----------------------------------------------------------------------------
  // out[i, :] = table[ids[i], :]. ids i32 [N]; an id outside [0, V) is an internal error
  // (ids are validated when the batch is built).
  virtual void embedding_forward(const Tensor& out, const Tensor& table, const Tensor& ids) = 0;

  // HF LlamaRMSNorm: y = weight * (x * rsqrt(mean(x^2) + eps)), with the normalised value
  // rounded to x's dtype before the weight multiply (SPECS.md §4). rstd f32 [N] is written.
  virtual void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                               const Tensor& weight, float eps) = 0;
  // dx (+)= d/dx of the above for a frozen weight. accumulate: dx += instead of dx =.
  virtual void rmsnorm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                const Tensor& weight, const Tensor& rstd, bool accumulate) = 0;

  // Rotary embedding in place on x [N, heads * head_dim], halves convention (rotate_half),
  // angle = positions[i] * inv_freq[j] (f32 [head_dim / 2], llama3 scaling already applied).
  virtual void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                            int64_t head_dim) = 0;
  // The transpose of the rotation: dx in place.
  virtual void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                             int64_t head_dim) = 0;

  // out = silu(gate) * up.
  virtual void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) = 0;
  // d_gate, d_up from d_out (d_gate/d_up may alias gate/up: they are read before written).
  virtual void swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out,
                               const Tensor& gate, const Tensor& up) = 0;
  // The gate and up projections' LoRA B terms, then SwiGLU (LlamaStep's stacked gate/up group):
  //   gate += scale * ut_gate^T b_gate^T,  up += scale * ut_up^T b_up^T   (as matmul with beta 1)
  //   out = silu(gate) * up
  // ut_*: the LoRA inputs u transposed, [r, rows]; b_*: [cols, r]. gate and up hold the sums
  // afterwards (the backward reads them). This default runs exactly those three ops; a backend
  // may do them in one pass over gate and up (the two rank-r products each read and write all of
  // their output only to add a rank-r term onto it).
  virtual void swiglu_lora_forward(const Tensor& out, const Tensor& gate, const Tensor& up,
                                   const Tensor& ut_gate, const Tensor& b_gate, const Tensor& ut_up,
                                   const Tensor& b_up, float scale);
  // A projection's LoRA B term, then the residual (LlamaStep's o and down projections):
  //   y += scale * u b^T   (as matmul with beta 1; u [rows, r], b [cols, r]),  then y += residual
  // rounded after each of the two, as the two ops round. This default runs exactly those two ops;
  // a backend may do them in one pass over y.
  virtual void lora_residual_forward(const Tensor& y, const Tensor& u, const Tensor& b, float scale,
                                     const Tensor& residual);

  // ---- attention ------------------------------------------------------------------------------
  // Causal GQA attention. segments (optional, i32 [N]): a token attends only to earlier tokens of
  // its own segment (packed sequences); empty means one segment per row of the batch.
  //
  // Eager, as HF's eager path: scores = q k^T * scale -> causal mask -> softmax in fp32 ->
  // probs (saved, in probs' dtype) -> out = probs v. scores_scratch [batch, n_heads, seq, seq]
  // is free for the implementation to use.
  virtual void attention_eager_forward(const Tensor& out, const Tensor& probs,
                                       const Tensor& scores_scratch, const Tensor& q,
                                       const Tensor& k, const Tensor& v, const Tensor& segments,
                                       const AttentionDims& dims) = 0;
  // dq, dk, dv (written, not accumulated). dprobs_scratch has the shape of probs.
  virtual void attention_eager_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                        const Tensor& dprobs_scratch, const Tensor& d_out,
                                        const Tensor& probs, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& segments,
                                        const AttentionDims& dims) = 0;
  // Flash (FlashAttention-2, SPECS.md §7): saves only out and lse (f32 [batch, n_heads, seq]).
  virtual void attention_flash_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                                       const Tensor& k, const Tensor& v, const Tensor& segments,
                                       const AttentionDims& dims) = 0;
  // delta_scratch f32 [batch, n_heads, seq] (rowsum(dO * O)); dq_accum_scratch f32 [N, n_heads *
  // head_dim] for implementations that accumulate dq across key blocks.
  virtual void attention_flash_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                        const Tensor& delta_scratch,
                                        const Tensor& dq_accum_scratch, const Tensor& d_out,
                                        const Tensor& out, const Tensor& lse, const Tensor& q,
                                        const Tensor& k, const Tensor& v, const Tensor& segments,
                                        const AttentionDims& dims) = 0;

  // cuDNN fused attention (--attn_implementation cudnn; ops/cuda/attention_cudnn.h): the flash
  // contract (same inputs, saved out and lse, causal, GQA). With `ragged` empty, for batches whose
  // rows each hold one sample (causal masking alone is then exact); with a table, for packed rows:
  // the table's sequences are those of `segments`, and the results are the flash op's with them.
  // workspace: f32 planned scratch of at least cudnn_attention_workspace_floats(dims, backward)
  // elements; an implementation that needs more fails (dense) or runs its flash op (ragged).
  // Backends without cuDNN run their flash op with the segments (the backward using delta_scratch
  // and the first N * n_heads * head_dim floats of the workspace as its dq accumulator).
  virtual void attention_cudnn_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                                       const Tensor& k, const Tensor& v, const Tensor& segments,
                                       const RaggedAttention& ragged, const Tensor& workspace,
                                       const AttentionDims& dims) {
    (void)ragged;
    (void)workspace;
    attention_flash_forward(out, lse, q, k, v, segments, dims);
  }
  virtual void attention_cudnn_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                        const Tensor& delta_scratch, const Tensor& workspace,
                                        const Tensor& d_out, const Tensor& out, const Tensor& lse,
                                        const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& segments, const RaggedAttention& ragged,
                                        const AttentionDims& dims) {
    (void)ragged;
    attention_flash_backward(dq, dk, dv, delta_scratch, cudnn_dq_accum_view(workspace, q), d_out,
                             out, lse, q, k, v, segments, dims);
  }
  // The flash backward's dq accumulator inside a cuDNN workspace (the packed-rows fallback).
  static Tensor cudnn_dq_accum_view(const Tensor& workspace, const Tensor& q) {
    Tensor t = workspace;
    t.dtype = DType::f32;
    t.shape = q.shape;
    MT_ASSERT(workspace.dtype == DType::f32 && workspace.numel() >= q.numel(),
              "cuDNN attention workspace {} smaller than q {}", workspace.shape.str(), q.shape.str());
    return t;
  }

  // ---- attention_decode (generation) ----
  // One new query per sequence against that sequence's KV cache. q, out [batch, n_heads *
  // head_dim]; k_cache, v_cache [batch, capacity, n_kv_heads * head_dim]. The query of sequence b
  // attends to all cache rows [0, dims.seq) of sequence b and to nothing else: the rows past the
  // newest token are not written yet, so no causal mask is needed (rows >= dims.seq may hold
  // garbage or NaN and are not read). GQA as above. Math in fp32 (scores, softmax, the weighted
  // sum of v); out is rounded once.
  virtual void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                                const Tensor& v_cache, const AttentionDims& dims) = 0;
  // ---- end attention_decode ----

  // ---- loss -------------------------------------------------------------------------------------
  // Cross-entropy over logits [rows, V] (any float dtype; math in fp32) against targets i32
  // [rows] (-100 = ignored). loss_sum f32 [1] += sum of -log softmax(logits)[target] over the
  // rows that are not ignored. d_logits (may alias logits) = (softmax - onehot) * grad_scale on
  // those rows and 0 on ignored rows.
  virtual void cross_entropy_forward_backward(const Tensor& loss_sum, const Tensor& d_logits,
                                              const Tensor& logits, const Tensor& targets,
                                              float grad_scale) = 0;
  // Forward only (eval): loss_sum += as above; nothing else is written.
  virtual void cross_entropy_forward(const Tensor& loss_sum, const Tensor& logits,
                                     const Tensor& targets) = 0;

  // ---- LoRA dropout -----------------------------------------------------------------------------
  // out = x * keep / (1 - p), keep drawn from a counter-based hash of (seed, element index) so
  // that the same call in the backward (or on another backend) gives the same mask. Element i of
  // x has index index_offset + i: a slice of rows of a larger tensor passes the slice's first
  // element, and so gets the mask that the whole tensor would have there.
  virtual void dropout(const Tensor& out, const Tensor& x, float p, uint64_t seed,
                       uint64_t index_offset) = 0;

  // ---- optimizer ----------------------------------------------------------------------------------
  // acc f32 [1] += sum(x^2) (fp32 accumulate of grads for the global norm and the finite check).
  virtual void sum_squares(const Tensor& acc, const Tensor& x) = 0;
  // AdamW on f32 param/grad/m/v (torch semantics, SPECS.md §8), grad multiplied by grad_scale.
  virtual void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                          const Tensor& exp_avg_sq, const AdamWParams& params) = 0;
  // dst *= value
  virtual void scale(const Tensor& dst, float value) = 0;

  // ---- QLoRA ----------------------------------------------------------------------------------
  // out (compute dtype, shape q.shape) = lut[code] * absmax per block, in fp32 then rounded once.
  // The default copies to the host and uses the reference (quant/nf4.h); device backends may
  // override it with a kernel.
  virtual void dequantize_4bit(const Tensor& out, const Quantized4bit& q);
  // ---- QLoRA: quantize on the device (quant4bit) ----
  // Quantizes `dense` (f32/f16/bf16, numel of q.shape, on this backend's device) into q's
  // tensors as allocated by ModelWeights (packed, absmax or absmax codes + nested_absmax,
  // code_map = bnb_quant_map, nested_map = the signed dynamic map) and sets q.nested_offset
  // (0 without double quant). Every output is bit-identical to quantize_4bit() of quant/nf4.h.
  // A NaN / Inf element throws memtune::Error naming `name` (the message of the reference);
  // q's tensors are then unspecified. The default copies `dense` to the host, runs the
  // reference and copies the results back; the meta backend does nothing.
  virtual void quantize_4bit(Quantized4bit& q, const Tensor& dense, std::string_view name);
  // ---- end QLoRA: quantize on the device ----

  // ---- initialisation -----------------------------------------------------------------------
  // Seeded random fill from a counter-based hash of (seed, element index), so that every
  // backend produces the same values: normal(a = mean, b = std) or uniform[a, b). The default
  // generates on the host in chunks and copies; device backends may override it.
  enum class Distribution { normal, uniform };
  virtual void fill_random(const Tensor& dst, Distribution distribution, float a, float b,
                           uint64_t seed);

  // Reads one f32 from device memory (synchronises).
  float read_scalar(const Tensor& scalar);

 private:
  int32_t next_event_id_ = 0;
};

// ---- QLoRA: quantize on the device (quant4bit) ----
// Checks that q's tensors have the dtypes and sizes that q.config and q.shape ask for (an
// inconsistent Quantized4bit is an internal error: MT_ASSERT naming `what`).
void check_quantized4bit_layout(const Quantized4bit& q, std::string_view what);
// ---- end QLoRA: quantize on the device ----

struct RaggedTableShape;  // ops/ragged_attention.h

// The sequence table of `segments` (shape.rows * shape.seq ids; build_ragged_table) uploaded into
// ragged.table, whose capacity the caller has set (shape.capacity), and ragged's counts filled in.
// Where no table can be made (an id that comes back within a row, offsets past i32) ragged is left
// empty: the flash op, whose mask knows the ids, runs instead.
void upload_ragged_table(Backend& backend, const int32_t* segments, const RaggedTableShape& shape,
                         RaggedAttention& ragged);

// copy_from_host with a dtype conversion on the host (f32/f16/bf16 -> dst.dtype). `host` need
// not be aligned for its dtype (safetensors data is not).
void copy_from_host_converted(Backend& backend, const Tensor& dst, const void* host, DType host_dtype);

// A tensor in the backend's host memory (Backend::allocate_host: pinned on CUDA, where the
// device's kernels read and write it in place through unified addressing), recorded in
// memory.record_host under `name` so that the plan shows it; `owner` frees it. Its data is null on
// the meta device, which stores nothing. Host embeddings and the offloaded optimizer use it.
Tensor allocate_host_tensor(Backend& backend, Memory& memory, std::string name, DType dtype, Shape shape,
                            std::shared_ptr<void>& owner);

std::unique_ptr<Backend> make_cpu_backend();
// The meta backend plans for a target device: it reports that device's workspace_bytes().
std::unique_ptr<Backend> make_meta_backend(uint64_t target_workspace_bytes = 0);
#ifdef MEMTUNE_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend();
#endif

// Counter-based hash for dropout masks: identical on every backend (a SplitMix64 finaliser).
inline uint64_t dropout_hash(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// The value fill_random puts at `index`.
float random_value(Backend::Distribution distribution, float a, float b, uint64_t seed,
                   uint64_t index);

// keep iff the top 24 bits, as a fraction of 2^24, are >= p.
inline bool dropout_keep(uint64_t seed, uint64_t index, float p) {
  return static_cast<float>(dropout_hash(seed, index) >> 40) * (1.0f / 16777216.0f) >= p;
}

}  // namespace memtune
