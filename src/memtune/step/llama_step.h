// The Llama training step as calls on the op interface, with a hand-written backward.
//
// Per layer (pre-norm residual blocks, SPECS.md §4), N = batch * seq tokens:
//   h1 = rmsnorm(x, w_in); q, k, v = h1 W^T (+ LoRA); rope(q, k); a = attention(q, k, v)
//   mid = x + a W_o^T (+ LoRA)
//   h2 = rmsnorm(mid, w_post); g, u = h2 W^T (+ LoRA); s = silu(g) * u
//   out = mid + s W_down^T (+ LoRA)
// The other families are this layer with additions (model/llama_config.h):
//   Qwen2: q, k, v = h1 W^T + b (+ LoRA): the frozen bias is the base output's, as in PEFT; it
//          has no grad, so the backward is unchanged.
//   Qwen3: q = q_norm(q_unnormed), k = k_norm(k_unnormed), an RMSNorm over each head's head_dim
//          values, before RoPE; its backward is rmsnorm's below, per (token, head) row.
//   head_dim may differ from hidden / heads: q and the attention output are [N, heads * head_dim].
// LoRA on a projection with input x: y += scale * (drop(x) A^T) B^T, saving u = drop(x) A^T.
// Chain rule for y = x W^T + scale * u B^T, u = drop(x) A^T, given dy:
//   dB += scale * dy^T u;   du = scale * dy B;   dA += du^T drop(x);   dx = dy W + drop'(du A)
// rmsnorm: y = w * x r, r = rsqrt(mean(x^2) + eps): dx = r (w dy) - x r^3 mean(x w dy)
// swiglu:  s = g sigmoid(g) u: dg = ds u sigmoid(g) (1 + g (1 - sigmoid(g))), du = ds silu(g)
// The loss fuses the LM head with cross-entropy over chunks of tokens (full = one chunk).
//
// Memory: gate, up and swiglu_out ([N, intermediate] each) are a layer's largest activations.
// linear_backward reads its input x only before it writes dx, so the down projection's input grad
// overwrites swiglu_out in place, and swiglu's grads overwrite gate and up.
//
// Token chunks (mlp_chunk_tokens). Where a layer's activations are not kept for a backward
// (gradient checkpointing, and eval), everything in the layer but attention is row-wise: norm1
// and the q/k/v projections, and the o projection, the residual, norm2 and the MLP. Those run
// over chunks of mlp_chunk_tokens token rows, so that only q, k, v, the attention output (and
// lse) span the whole sequence; the forward is the same numbers. With checkpointing the
// recompute stops after attention, and the backward recomputes and back-propagates one chunk at
// a time: (mid = x + o(attn_out), norm2, MLP) -> d_mid, d_attn_out rows; attention backward over
// the whole sequence; then (norm1, q/k/v LoRA inputs) -> d_x rows. The LoRA grads accumulate
// over chunks as they do over micro-batches.
//
// Shapes that follow the data. The step is planned (and its buffers placed) for the capacity
// [micro_batch, seq] of StepOptions; set_shape(rows, seq) then runs a micro-batch at a smaller
// shape, rows * seq <= the capacity's tokens (fewer rows, shorter rows, or one padding-free row of
// several samples end to end). Every token-sized buffer is still reserved at its planned size
// (Memory::alloc with a reserve), and the token chunks keep their planned boundaries, so the
// allocator sees the planned sizes in the planned order (the chunks past the data are skipped
// whole): the offsets and the peak are those of the plan, whatever the shape. The ops see only
// the tokens of the shape, so no compute goes to the planned shape's padding.
//
// Activation offload (offload_activations, requires checkpointing). The saved layer inputs,
// [N, hidden] each and one per layer, are what grows with the depth. With offload each leaves
// for pinned host memory on the backend's copy stream as soon as its layer starts, and on the
// device the inputs live in a ring of kOffloadSlots buffers: layer l reads slot l % 2 and writes
// its output into slot (l + 1) % 2, after waiting for that slot's copy-out (issued a whole layer
// earlier). The backward runs layer l from slot l % 2 while layer l - 1's input comes back into
// the other slot (issued after layer l + 1's backward, the slot's last reader, and waited for
// before layer l - 1 reads it). The last layer's input never leaves the device.
//
// The frozen base is read through one place: layer_weights(l) (norms, projections, 4-bit codes;
// frozen_weight dequantizes from it), with every unit (embedding, layer, head) bracketed by
// acquire / release of the FrozenBaseUnits set on the step (frozen_base.h), so that a sharded
// base can gather each unit just in time. A layer's recompute and backward are one visit.
#pragma once

#include <array>
#include <string>
#include <functional>
#include <initializer_list>
#include <vector>

#include "memtune/core/memory.h"
#include "memtune/lora/lora_state.h"
#include "memtune/model/model_weights.h"
#include "memtune/ops/backend.h"
#include "memtune/step/activations.h"
#include "memtune/step/frozen_base.h"

namespace memtune {

// cudnn: cuDNN's fused SDPA (ops/cuda/attention_cudnn.h), the same memory as flash (plus the
// packed rows' sequence table); batches with several samples in a row run its ragged form from
// MicroBatchBuffers::ragged, or the flash op where there is no table.
enum class AttentionImpl : uint8_t { eager, flash, cudnn };
enum class LossImpl : uint8_t { full, chunked };

struct StepOptions {
  DType compute_dtype = DType::f32;  // activations and the frozen base
  AttentionImpl attention = AttentionImpl::eager;
  LossImpl loss = LossImpl::full;
  int64_t loss_chunk_tokens = 512;   // for LossImpl::chunked
  bool gradient_checkpointing = false;  // save layer inputs only; recompute in backward
  // Token rows per chunk of a layer's row-wise parts where its activations are not saved
  // (checkpointing, eval); 0 = the whole micro-batch at once. See the header comment.
  int64_t mlp_chunk_tokens = 0;
  // The saved layer inputs go to pinned host memory between forward and backward (needs
  // gradient_checkpointing); see the header comment.
  bool offload_activations = false;
  // Rows may hold several samples (packing, padding-free): AttentionImpl::cudnn plans room for
  // cuDNN's ragged backward (cudnn_attention_workspace_floats); no other effect.
  bool packed_rows = false;
  // LoRA of the projections that read one input (q/k/v, gate/up) stacked where the adapters
  // allow it (linear_group_forward); false: one projection at a time. The same math.
  bool stacked_lora = false;
  // With token chunks and a 4-bit base: a chunked pass of a layer dequantizes each projection
  // once and keeps the dense copies until the pass ends (HeldWeights), instead of once per chunk
  // (at 131,072 tokens in 1,024-row chunks, 128 times). Costs the pass's dense weights at once
  // (o, gate, up and down: ~386 MB at 8B); the same math. fit_token_chunks turns it off where
  // the budget needs that room.
  bool hold_chunk_weights = false;
  int64_t micro_batch = 1, seq = 0;
};

// The device buffers of one micro-batch; the host fills them before each call.
struct MicroBatchBuffers {
  Tensor input_ids;  // i32 [N]
  Tensor targets;    // i32 [N]: the label of the NEXT position (-100 = ignored)
  Tensor positions;  // i32 [N]: rope positions (reset at packed-sample boundaries)
  Tensor segments;   // i32 [N]: packed-sample id per token
  // Host-side: every row holds one sample, followed at most by tokens no target reads (padding).
  // Then causal masking alone is exact and AttentionImpl::cudnn runs cuDNN; else it runs cuDNN's
  // ragged form with `ragged`, or flash (whose mask knows the segments) where `ragged` is empty.
  // Engine::upload sets it; false is always safe.
  bool one_sample_per_row = false;
  // AttentionImpl::cudnn: the segments as a sequence table (ops/ragged_attention.h), planned for
  // the step's tokens; empty (no slots) unless set_packed_segments made one for this batch.
  RaggedAttention ragged;
};

// Whether rows of `seq` tokens reach the model's sliding window (Mistral), so that the window
// masks keys; and the refusal for a device whose attention has no window mask (CUDA).
bool sliding_window_reached(const LlamaConfig& config, int64_t seq);
std::string sliding_window_refusal(const LlamaConfig& config, int64_t seq);

class LlamaStep {
 public:
  LlamaStep(Backend& backend, Memory& memory, const LlamaConfig& config,
            const StepOptions& options, const ModelWeights& weights, const LoraState& lora);
  ~LlamaStep();  // gives back the offload host memory and events
  LlamaStep(const LlamaStep&) = delete;
  LlamaStep& operator=(const LlamaStep&) = delete;

  // Device buffers that hold layer inputs while offloading: two suffice (see the header comment).
  static constexpr int kOffloadSlots = 2;

  // The current micro-batch's buffers, at its shape (views of the planned buffers).
  const MicroBatchBuffers& batch() const { return batch_; }
  // Runs the next micro-batches at [rows, seq] (see the header comment); the planned shape is
  // the default. An eager step keeps [batch, heads, seq, seq] probabilities, so its rows may not
  // be longer than planned; flash and cuDNN only need rows * seq within the planned tokens.
  void set_shape(int64_t rows, int64_t seq);
  int64_t rows() const { return dims_.batch; }
  int64_t seq() const { return dims_.seq; }
  int64_t tokens() const { return tokens_; }
  // Every new batch: its layout. A batch that is not one sample per row then gets its sequence
  // table from set_packed_segments (AttentionImpl::cudnn only; a no-op otherwise).
  void set_one_sample_per_row(bool value) {
    batch_.one_sample_per_row = value;
    batch_.ragged.slots = batch_.ragged.sequences = batch_.ragged.max_len = 0;
  }
  // Builds the sequence table of `segments` (rows x seq ids, the batch just uploaded) and uploads
  // it; without a usable table (ids that come back within a row) the batch runs the flash op.
  void set_packed_segments(const int32_t* segments, int64_t rows, int64_t seq);
  // Forward, loss and backward of one micro-batch. Adds the loss sum (sum of token losses) to
  // loss_sum() and adds d(loss_grad_scale * loss_sum)/d(adapter) to the adapter grads.
  void forward_backward(float loss_grad_scale, uint64_t dropout_seed);
  // Forward and loss only (eval): loss_sum() += sum of token losses.
  void forward_loss();
  const Tensor& loss_sum() const { return loss_sum_; }
  // Called by forward_backward right after the backward of layer l (last layer first), when
  // layer l's adapter grads hold this micro-batch's contribution and nothing later in the
  // backward writes them. Data parallel sets it for a step's last micro-batch so that the
  // all-reduce of the grad buckets a layer completes is issued while the layers below still
  // run their backward. Empty (the default): nothing is called.
  void set_on_layer_grads_done(std::function<void(int layer)> hook) { on_layer_grads_done_ = std::move(hook); }
  const StepOptions& options() const { return options_; }
  // The sharded base (parallel/sharded_base.h): every read of a unit's frozen weights is then
  // bracketed by its acquire / release (frozen_base.h). Null (the default): the whole base is
  // resident and nothing is called.
  void set_frozen_base_units(FrozenBaseUnits* units) { base_units_ = units; }

 private:
  FrozenBaseUnits* base_units_ = nullptr;
  int held_unit_ = kNoUnit;  // the unit between acquire and release (checked by the readers)
  static constexpr int kNoUnit = -100;
  void begin_base_pass(bool with_backward);
  void acquire_unit(int unit);
  void release_unit(int unit);
  // The one place the step reads a layer's frozen weights (norms, projections, 4-bit codes).
  const LayerWeights& layer_weights(int layer) const;
  std::function<void(int)> on_layer_grads_done_;
  using LayerActs = std::array<Tensor, kNumActs>;
  using LoraActs = std::array<Tensor, kNumProjections>;
  struct LayerState {
    LayerActs acts;
    // Each projection's LoRA input u = x A^T [rows, r]; for a stacked input group (below), a
    // view u^T [r, rows] into the group's one buffer in lora_u_stacked.
    LoraActs lora_u;
    std::array<Tensor, kNumLoraInputGroups> lora_u_stacked;  // [members * r, rows] or empty
  };

  // Every buffer of the step is allocated through these, at the current shape inside the
  // planned reserve. alloc_tokens: a tensor whose leading dimension is every token of the
  // micro-batch. alloc_chunk: the rows [first_row, first_row + shape[0]) of a row-wise part
  // (a token chunk, or the whole micro-batch where the layer is not chunked).
  Tensor alloc_tokens(std::string name, MemCategory category, DType dtype, Shape shape);
  Tensor alloc_chunk(std::string name, MemCategory category, DType dtype, Shape shape, int64_t first_row);
  // Planned rows of the row-wise part that starts at first_row: the chunk's at capacity.
  int64_t reserved_rows(int64_t first_row) const;
  Tensor alloc_act(Act id, int layer, MemCategory category);
  // A per-token activation for `rows` token rows only, starting at first_row (a chunk).
  Tensor alloc_act_rows(Act id, int layer, MemCategory category, int64_t rows, int64_t first_row);
  void free_layer(LayerState& state, bool keep_input);
  MemCategory saved_category(bool recompute) const;
  // Token rows per chunk of a layer's row-wise parts in a pass that trains (or not); 0: the
  // layer runs whole.
  int64_t token_chunk_rows(bool training) const;
  // Runs layer `layer` on state.acts[layer_input]; returns the layer output: written into
  // *out_slot when given (an offload ring slot), else allocated (saved when training). A
  // recompute (checkpointing) returns an empty tensor; chunked, it stops after attention.
  Tensor layer_forward(int layer, LayerState& state, bool recompute, uint64_t dropout_seed,
                       bool training, const Tensor* out_slot = nullptr);
  Tensor layer_forward_chunked(int layer, LayerState& state, bool recompute,
                               uint64_t dropout_seed, bool training, int64_t chunk_rows,
                               const Tensor* out_slot);
  // RoPE on state's q and k, then the attention op into attn_out (and its probs or lse), kept
  // in `keep`: the part of a layer that spans the sequence, chunked or not.
  void attention_forward(int layer, LayerState& state, MemCategory keep);
  // Where the q / k projections write: Act::q / Act::k, or with Qwen3's per-head norm the
  // unnormed buffers that the norm then reads into Act::q / Act::k.
  Act projection_output(Act id) const;
  // Qwen3: q = q_norm(q_unnormed), k = k_norm(k_unnormed) per head, with their rstd, kept in
  // `keep`; and the backward of that, in place on dq and dk (grads of the normed q and k before
  // RoPE, on return those of the projections' outputs).
  void head_norm_forward(int layer, LayerState& state, MemCategory keep);
  void head_norm_backward(int layer, LayerState& state, const Tensor& dq, const Tensor& dk);
  void layer_backward(int layer, LayerState& state, const Tensor& d_resid, uint64_t dropout_seed);
  void layer_backward_chunked(int layer, LayerState& state, const Tensor& d_resid,
                              uint64_t dropout_seed, int64_t chunk_rows);
  // The attention op's backward from d_attn into dq, dk, dv (allocated here).
  void attention_backward(int layer, LayerState& state, const Tensor& d_attn, Tensor& dq,
                          Tensor& dk, Tensor& dv);
  // From the grad of the attention output (d_attn, freed here) to those of the q/k/v projections'
  // outputs (allocated here): attention_backward, then rope's and (Qwen3) the per-head norm's.
  void qkv_output_grads(int layer, LayerState& state, Tensor& d_attn, Tensor& dq, Tensor& dk, Tensor& dv);
  // The micro-batch's token embeddings: layer 0's input, allocated in `category`.
  Tensor embed_inputs(MemCategory category);
  // The layer output buffer of `layer` (the next layer's input).
  Tensor alloc_layer_output(int layer, bool training);
  // forward_backward with the layer inputs offloaded to host memory.
  void forward_backward_offloaded(float loss_grad_scale, uint64_t dropout_seed);
  void* offloaded_layer_input(int layer) const;
  // norm2 and the MLP up to swiglu_out (gate and up with their LoRA u, kept in mlp.lora_u when
  // keep_lora_u) for the token rows mid_rows, which start at row first_row of the layer, into
  // mlp.acts: the layer's own state for the whole MLP, or a chunk's.
  void mlp_forward(int layer, const Tensor& mid_rows, int64_t first_row, LayerState& mlp,
                   MemCategory category, uint64_t dropout_seed, bool training, bool keep_lora_u);
  // Back through down, swiglu, gate, up and norm2 for those rows: d_resid_rows (the grad of the
  // layer output's rows) += the grad through the MLP, making it the grad of mid's rows. The
  // grads overwrite mlp's activations in place (swiglu_out takes d_swiglu, gate/up theirs).
  void mlp_backward(int layer, LayerState& mlp, const Tensor& mid_rows, const Tensor& d_resid_rows,
                    int64_t first_row, uint64_t dropout_seed);
  // The dense [out, in] weight of a projection: the stored one, or (4-bit base) a dequantized
  // copy in planned scratch, given back with release_frozen_weight.
  // A projection that HeldWeights holds is served from its copy and not given back.
  Tensor frozen_weight(int layer, Projection p);
  void release_frozen_weight(int layer, Projection p, const Tensor& w);
  // While alive: the given 4-bit projections of `layer` dequantized once, for every frozen_weight
  // call of a chunked pass (StepOptions::hold_chunk_weights; nothing where it is off). Freed in
  // reverse order when it goes out of scope.
  class HeldWeights {
   public:
    HeldWeights(LlamaStep& step, int layer, std::initializer_list<Projection> projections);
    ~HeldWeights();
    HeldWeights(const HeldWeights&) = delete;
    HeldWeights& operator=(const HeldWeights&) = delete;

   private:
    LlamaStep& step_;
    std::vector<Projection> held_;  // in allocation order
  };
  // The projections take x as rows of the layer's [N, in] input starting at row first_row (0 for
  // the whole input, the chunk's first row in a chunked MLP): the LoRA dropout masks element
  // (first_row + i, j) of the whole input, so chunking does not change the mask.
  // u = drop(x) A^T [x rows, r] for the adapter on (layer, p).
  Tensor lora_input_projection(int layer, Projection p, const Tensor& x, int64_t first_row,
                               MemCategory u_category, uint64_t dropout_seed, bool training);
  // y = x W^T (+ the LoRA term) (+ *residual, where given: the o and down projections' residual
  // adds, made with the LoRA term by one backend op, lora_residual_forward).
  void linear_forward(int layer, Projection p, const Tensor& x, int64_t first_row, const Tensor& y,
                      Tensor* lora_u, MemCategory u_category, uint64_t dropout_seed, bool training,
                      const Tensor* residual = nullptr);
  // dx (+)= d/dx, and the adapter's grads += theirs. Everything that reads x happens before dx
  // is written, so dx may alias x when accumulate is false (x is dead afterwards).
  void linear_backward(int layer, Projection p, const Tensor& dy, const Tensor& x,
                       int64_t first_row, const Tensor& lora_u, const Tensor& dx, bool accumulate,
                       uint64_t dropout_seed);
  // y = x W^T (+ bias): the frozen part of linear_forward.
  void base_linear_forward(int layer, Projection p, const Tensor& x, const Tensor& y);
  // Stacked LoRA: the members of an input group (lora/lora_state.h) read one x. Where their A
  // lie end to end (LoraState stacks them) and LoRA dropout is off, one GEMM forms every
  // member's u^T = A x^T, [members * r, rows], and the backward forms every member's A grad and
  // the LoRA part of dx in one GEMM each; the B products stay per member, the math (PEFT's order,
  // u rounded to the compute dtype) unchanged. Else each member runs linear_forward / _backward.
  // The A of the group as one [members * r, in] view, or empty when it cannot stack (found once,
  // by find_stacked_lora_a, when the step is built).
  const Tensor& stacked_lora_a(int layer, const LoraInputGroup& group) const;
  Tensor find_stacked_lora_a(int layer, const LoraInputGroup& group) const;
  // ys[m]: member m's output. keep (nullable): where the u's are kept for the backward.
  // add_lora_b false (a stacked group only): the B terms are left to the caller, who reads the
  // LoRA inputs from *keep (then required) and adds them (mlp_forward: swiglu_lora_forward).
  void linear_group_forward(int layer, const LoraInputGroup& group, const Tensor& x, int64_t first_row,
                            const Tensor* ys, LayerState* keep, MemCategory u_category, uint64_t dropout_seed,
                            bool training, bool add_lora_b = true);
  // Every member's LoRA input into keep.lora_u (members without an adapter are skipped): stacked,
  // one GEMM into keep.lora_u_stacked[group], u^T [members * r, rows], and each member's u a view
  // of its r rows; else one x A^T per member. free_layer frees either.
  void group_lora_inputs(int layer, const LoraInputGroup& group, const Tensor& x, int64_t first_row, LayerState& keep,
                         MemCategory u_category, uint64_t dropout_seed, bool training);
  // The group's backward: dys[m] the grad of member m's output; dx (+)= the sum over members
  // (accumulate as linear_backward, for the first member; the rest add). saved: the state that
  // holds the forward's u's.
  void linear_group_backward(int layer, const LoraInputGroup& group, const Tensor* dys, const Tensor& x,
                             int64_t first_row, const LayerState& saved, const Tensor& dx, bool accumulate,
                             uint64_t dropout_seed);
  // Final norm + LM head + cross-entropy; with d_resid given, also its backward into it.
  void loss_and_head(const Tensor& last_hidden, float loss_grad_scale, const Tensor* d_resid);
  AttentionDims attention_dims() const;           // the current shape's
  AttentionDims planned_attention_dims() const;   // the capacity's (scratch reserves)

  Backend& backend_;
  Memory& memory_;
  const LlamaConfig& config_;
  StepOptions options_;
  const ModelWeights& weights_;
  const LoraState& lora_;
  std::vector<std::array<Tensor, kNumLoraInputGroups>> stacked_lora_a_;  // [layer][group]
  ActDims capacity_;         // the planned shape
  int64_t capacity_tokens_;
  ActDims dims_;             // the current micro-batch's shape (set_shape)
  int64_t tokens_;
  // Token rows per chunk while a chunked layer runs (alloc_chunk's reserve); 0 outside one.
  int64_t active_chunk_rows_ = 0;
  // The dense copies that a HeldWeights serves (of layer held_layer_), by projection; empty: not held.
  int held_layer_ = -1;
  std::array<Tensor, kNumProjections> held_weights_;
  float lora_scale_;
  float lora_dropout_;
  Tensor inv_freq_;  // f32 [head_dim / 2]
  Tensor loss_sum_;  // f32 [1]
  MicroBatchBuffers planned_batch_;  // the buffers at the planned shape
  MicroBatchBuffers batch_;          // their first tokens_ entries
  // Offload: host copies of layers [0, layers - 1)'s inputs (pinned, allocated once), and per
  // ring slot the events of its last copy out and in.
  void* offload_host_ = nullptr;
  uint64_t offload_layer_bytes_ = 0;
  std::array<CopyEvent, kOffloadSlots> slot_copied_out_{}, slot_copied_in_{};
};

}  // namespace memtune
