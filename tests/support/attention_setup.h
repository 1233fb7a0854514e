// The attention tests' shapes (CPU, CUDA flash and cuDNN): a test case names batch, seq, heads,
// kv_heads and head_dim; the op takes them as AttentionDims with the step's softmax scale.
#pragma once

#include <cmath>

#include "memtune/ops/backend.h"

namespace memtune::test {

// The AttentionDims of a test case (any struct with batch, seq, heads, kv_heads and head_dim), with
// the softmax scale that the step uses: head_dim^-0.5.
template <typename Case>
AttentionDims attention_dims_of(const Case& c) {
  AttentionDims dims;
  dims.batch = c.batch;
  dims.seq = c.seq;
  dims.n_heads = c.heads;
  dims.n_kv_heads = c.kv_heads;
  dims.head_dim = c.head_dim;
  dims.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  return dims;
}

}  // namespace memtune::test
