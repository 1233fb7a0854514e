// THE activation table: every per-layer tensor that the forward keeps for the backward, once,
// with its shape rule and dtype. The step allocates activations only through this table, so
// the planner, the printout and the code cannot disagree about what a layer holds.
#pragma once

#include <array>

#include "memtune/core/tensor.h"
#include "memtune/model/llama_config.h"

namespace memtune {

enum class Act : uint8_t {
  layer_input,  // residual stream entering the layer (kept under checkpointing too)
  norm1_out, norm1_rstd,
  q, k, v,      // after RoPE (and Qwen3's q/k norm)
  // Qwen3 only: the q and k projections' outputs before the per-head norm, which its backward
  // reads, and that norm's rstd per token and head.
  q_unnormed, k_unnormed, q_norm_rstd, k_norm_rstd,
  attn_probs,   // eager only: [batch, heads, seq, seq]
  attn_lse,     // flash only: [batch, heads, seq] f32
  attn_out,
  mid,          // residual stream after attention
  norm2_out, norm2_rstd,
  gate, up, swiglu_out,
  lora_u,       // x A^T, one per adapted projection: [tokens, r]
};
constexpr int kNumActs = 20;

enum class ActDim : uint8_t { hidden, q_dim, kv_dim, intermediate, rank, scalar_per_token,
                              scores, lse, scalar_per_q_head, scalar_per_kv_head };

struct ActSpec {
  Act id;
  const char* name;
  ActDim dim;
  bool fp32;  // else the compute dtype
};

constexpr std::array<ActSpec, kNumActs> kActivationTable = {{
    {Act::layer_input, "layer_input", ActDim::hidden, false},
    {Act::norm1_out, "norm1_out", ActDim::hidden, false},
    {Act::norm1_rstd, "norm1_rstd", ActDim::scalar_per_token, true},
    {Act::q, "q", ActDim::q_dim, false},
    {Act::k, "k", ActDim::kv_dim, false},
    {Act::v, "v", ActDim::kv_dim, false},
    {Act::q_unnormed, "q_unnormed", ActDim::q_dim, false},
    {Act::k_unnormed, "k_unnormed", ActDim::kv_dim, false},
    {Act::q_norm_rstd, "q_norm_rstd", ActDim::scalar_per_q_head, true},
    {Act::k_norm_rstd, "k_norm_rstd", ActDim::scalar_per_kv_head, true},
    {Act::attn_probs, "attn_probs", ActDim::scores, false},
    {Act::attn_lse, "attn_lse", ActDim::lse, true},
    {Act::attn_out, "attn_out", ActDim::q_dim, false},
    {Act::mid, "mid", ActDim::hidden, false},
    {Act::norm2_out, "norm2_out", ActDim::hidden, false},
    {Act::norm2_rstd, "norm2_rstd", ActDim::scalar_per_token, true},
    {Act::gate, "gate", ActDim::intermediate, false},
    {Act::up, "up", ActDim::intermediate, false},
    {Act::swiglu_out, "swiglu_out", ActDim::intermediate, false},
    {Act::lora_u, "lora_u", ActDim::rank, false},
}};

inline const ActSpec& act_spec(Act id) { return kActivationTable[static_cast<int>(id)]; }

struct ActDims {
  int64_t batch, seq, lora_rank;
};

inline Shape act_shape(const ActSpec& spec, const LlamaConfig& c, const ActDims& d) {
  const int64_t n = d.batch * d.seq;
  switch (spec.dim) {
    case ActDim::hidden: return Shape{n, c.hidden_size};
    case ActDim::q_dim: return Shape{n, c.q_dim()};
    case ActDim::kv_dim: return Shape{n, c.kv_dim()};
    case ActDim::intermediate: return Shape{n, c.intermediate_size};
    case ActDim::rank: return Shape{n, d.lora_rank};
    case ActDim::scalar_per_token: return Shape{n};
    case ActDim::scalar_per_q_head: return Shape{n * c.num_attention_heads};
    case ActDim::scalar_per_kv_head: return Shape{n * c.num_key_value_heads};
    case ActDim::scores: return Shape{d.batch, c.num_attention_heads, d.seq, d.seq};
    case ActDim::lse: return Shape{d.batch, c.num_attention_heads, d.seq};
  }
  return Shape{};
}

// The shape of `rows` token rows of a per-token activation: the buffers of one MLP chunk.
inline Shape act_rows_shape(const ActSpec& spec, const LlamaConfig& c, const ActDims& d,
                            int64_t rows) {
  MT_ASSERT(spec.dim != ActDim::scores && spec.dim != ActDim::lse &&
                spec.dim != ActDim::scalar_per_q_head && spec.dim != ActDim::scalar_per_kv_head,
            "{} is not a per-token activation", spec.name);
  Shape shape = act_shape(spec, c, d);
  shape[0] = rows;
  return shape;
}

}  // namespace memtune
