// A Hopper-native flash attention forward (attention_hopper_forward.cu; issue 23, first step):
// wgmma for both GEMMs, the bulk tensor copy engine (TMA) for Q/K/V in and O out. Same contract
// as attention_flash_forward (cuda_ops.h): causal, GQA, q/k/v/out rows [batch, seq, heads,
// head_dim], out and the fp32 natural-log logsumexp lse [batch, n_heads, seq], so the existing
// flash backward consumes what it writes. attention_flash_forward (the backend's own flash forward)
// calls it first where FlashVersions::forward_hopper holds (attention_flash.h; the default, off
// with MEMTUNE_FLASH_FORWARD=v2) and runs forward v2 where it refuses the call. It has two kernels
// of the same contract: the default, and one with FlashAttention-3's intra-warpgroup pipelining
// (a key block's softmax under the block before's O += P V), which it launches where
// FlashVersions::forward_hopper_overlap holds (off by default; MEMTUNE_FLASH_FORWARD=hopper-overlap).
#pragma once

#include <cuda_runtime_api.h>

#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {

// Whether launch_flash_forward_hopper takes these arguments on the current device: compute
// capability 9.0 with the sm_90a kernel in the binary, head_dim 64 or 128, q/k/v/out all bf16 or
// all f16 and 16-byte aligned, seq and the grid within 32 bits. Packed rows (p.segments) are
// served as forward v2 serves them: keys of another id are masked, and the key loop starts at the
// first block that a query of the block can see.
bool flash_forward_hopper_serves(const AttentionParams& p, const FlashTensors& t);

// Launches the forward on `stream` and returns true; returns false, launching nothing, where
// flash_forward_hopper_serves is false (or the driver cannot encode the tensor maps).
bool launch_flash_forward_hopper(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream);

// The Hopper backward (attention_hopper_backward.cu; wgmma + TMA, FlashAttention-3's tiling
// without warp specialisation yet): the main pass of attention_flash_backward (cuda_ops.h), which
// runs it in place of backward v2's main kernel where FlashVersions::backward_hopper holds
// (attention_flash.h; on by default, MEMTUNE_FLASH_BACKWARD=v2 turns it off) and it serves the
// call. It reads q, k, v, d_out, lse and t.delta (= rowsum(dO * O), f32 [batch, n_heads, seq]),
// adds dQ into t.dq_accum (f32, q's layout, zeroed before), and writes dk and dv (16-bit, k's
// layout); the D pass before it and dQ's rounding after it are attention_flash_backward's.
// Serves: compute capability 9.0 with the sm_90a kernel in the binary, head_dim 64 or 128, q, k,
// v, d_out, dk and dv all bf16 or all f16, those and dq_accum 16-byte aligned, seq and the grid
// within 32 bits; packed rows (p.segments) as backward v2 takes them.
bool flash_backward_hopper_serves(const AttentionParams& p, const FlashTensors& t);

// Launches that main pass on `stream` and returns true; returns false, launching nothing, where
// flash_backward_hopper_serves is false (or the driver cannot encode the tensor maps).
bool launch_flash_backward_hopper(const AttentionParams& p, const FlashTensors& t, cudaStream_t stream);

}  // namespace memtune::cuda
