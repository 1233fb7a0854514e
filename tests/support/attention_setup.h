// The attention tests' shapes (CPU, CUDA flash and cuDNN): a test case names batch, seq, heads,
// kv_heads and head_dim; the op takes them as AttentionDims with the step's softmax scale.
#pragma once

#include <cmath>
#include <cstdint>

#include "memtune/ops/backend.h"

namespace memtune::test {

// Attention over `seq` keys per row, with the softmax scale that the step uses: head_dim^-0.5.
inline AttentionDims attention_dims(int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return AttentionDims{batch, seq, heads, kv_heads, head_dim, attention_softmax_scale(head_dim)};
}

// The AttentionDims of a test case: any struct with batch, seq, heads, kv_heads and head_dim.
template <typename Case>
AttentionDims attention_dims_of(const Case& c) {
  return attention_dims(c.batch, c.seq, c.heads, c.kv_heads, c.head_dim);
}

}  // namespace memtune::test
