// Packed rows as variable-length ("ragged", THD) sequences for a fused attention kernel that takes
// them (cuDNN's SDPA with ragged offsets and a padding mask: Backend::attention_cudnn_*).
//
// A micro-batch of `rows` rows of `seq` tokens, with a segment id per token (data/packing.h), is
// cut into sequences: the maximal runs of one segment id inside a row, in token order. Every token
// belongs to exactly one sequence (a row's trailing padding is a sequence of its own), so the
// kernel writes every output row. Causal attention within each sequence is then exactly the
// segment mask of the flash op, provided a segment id never comes back after another one in the
// same row (write_row numbers a row's samples 0, 1, ...): where it does, there is no table and the
// step runs the flash op, whose mask knows the ids.
//
// The table is i32, kRaggedTableRows rows of stride = capacity + 1 entries (capacity = the tokens
// of the largest micro-batch the step planned for; the sequence count never exceeds the tokens):
//   row 0 (kRaggedLengths):        length of sequence i, i < slots
//   row 1 (kRaggedQOffsets):       element offset of sequence i in q / out / d_out / dq
//                                  (start token * n_heads * head_dim), i <= slots
//   row 2 (kRaggedKvOffsets):      the same in k / v / dk / dv (start * n_kv_heads * head_dim)
//   row 3 (kRaggedStatsTokens):    start * n_heads: a [tokens, n_heads] row statistic
//   row 4 (kRaggedStatsRows):      row * n_heads * seq + position: memtune's lse layout
//                                  [batch, n_heads, seq] (backend.h)
//   row 5 (kRaggedStarts):         start token: a [n_heads, tokens] row statistic
// Graph caching: the kernel's graph depends on the number of sequences and the longest length, so
// the table rounds both up: `slots` = the sequence count rounded up to a power of two (at most
// capacity), the entries past the real sequences having length 0 and the end offsets; `max_len` =
// the longest sequence rounded up to a power of two, at least kRaggedMinMaxLen.
#pragma once

#include <cstdint>
#include <vector>

namespace memtune {

inline constexpr int kRaggedTableRows = 6;
inline constexpr int kRaggedLengths = 0, kRaggedQOffsets = 1, kRaggedKvOffsets = 2,
                     kRaggedStatsTokens = 3, kRaggedStatsRows = 4, kRaggedStarts = 5;
inline constexpr int64_t kRaggedMinMaxLen = 64;

// The host side of a table: what the step uploads and what the op is told about it.
struct RaggedTableHost {
  std::vector<int32_t> values;  // kRaggedTableRows * (capacity + 1); empty: no table (use flash)
  int64_t sequences = 0;        // real sequences
  int64_t slots = 0;            // sequences rounded up (see above); 0 when there is no table
  int64_t max_len = 0;          // the longest sequence, rounded up
  int64_t longest = 0;          // the longest sequence
  bool empty() const { return slots == 0; }
};

struct RaggedTableShape {
  int64_t rows = 0, seq = 0;    // the micro-batch: rows x seq tokens
  int64_t capacity = 0;         // the table's capacity in tokens (>= rows * seq)
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0;
  bool round_up = true;         // false: slots = sequences, max_len = longest (tests)
};

// The table for `segments` (rows * seq ids). Empty when a segment id comes back within a row,
// or when an element offset would not fit in an i32.
RaggedTableHost build_ragged_table(const int32_t* segments, const RaggedTableShape& shape);

// The smallest power of two >= n (n >= 1).
int64_t round_up_pow2(int64_t n);

}  // namespace memtune
