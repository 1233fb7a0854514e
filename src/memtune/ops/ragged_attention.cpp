#include "memtune/ops/ragged_attention.h"

#include <algorithm>
#include <limits>

#include "memtune/core/error.h"

namespace memtune {

int64_t round_up_pow2(int64_t n) {
  MT_ASSERT(n >= 1, "round_up_pow2({})", n);
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

RaggedTableHost build_ragged_table(const int32_t* segments, const RaggedTableShape& s) {
  MT_ASSERT(s.rows > 0 && s.seq > 0 && s.capacity >= s.rows * s.seq && s.n_heads > 0 &&
                s.n_kv_heads > 0 && s.head_dim > 0,
            "ragged table: rows {} seq {} capacity {} heads {}/{} head_dim {}", s.rows, s.seq,
            s.capacity, s.n_heads, s.n_kv_heads, s.head_dim);
  const int64_t tokens = s.rows * s.seq;
  // The largest element offset is the end of q (tokens * n_heads * head_dim); the lse offsets are
  // smaller. cuDNN takes i32 offsets, so a batch past that runs the flash op.
  if (tokens * s.n_heads * std::max(s.head_dim, int64_t{1}) > std::numeric_limits<int32_t>::max())
    return {};

  // Sequence starts (tokens), cut at row starts and at every change of segment id.
  std::vector<int64_t> starts;
  starts.reserve(64);
  for (int64_t r = 0; r < s.rows; ++r) {
    const int32_t* row = segments + r * s.seq;
    starts.push_back(r * s.seq);
    for (int64_t t = 1; t < s.seq; ++t) {
      if (row[t] == row[t - 1]) continue;
      // An id that is not larger than the one before may be an earlier segment of this row
      // coming back, which a run-based table would split from its first part.
      if (row[t] < row[t - 1]) return {};
      starts.push_back(r * s.seq + t);
    }
  }
  RaggedTableHost table;
  table.sequences = static_cast<int64_t>(starts.size());
  for (size_t i = 0; i < starts.size(); ++i) {
    const int64_t end = i + 1 < starts.size() ? starts[i + 1] : tokens;
    table.longest = std::max(table.longest, end - starts[i]);
  }
  table.slots = s.round_up ? std::min(round_up_pow2(table.sequences), s.capacity) : table.sequences;
  table.max_len =
      s.round_up ? std::max(round_up_pow2(table.longest), kRaggedMinMaxLen) : table.longest;

  const int64_t stride = s.capacity + 1;
  table.values.assign(static_cast<size_t>(kRaggedTableRows * stride), 0);
  auto at = [&](int row, int64_t i) -> int32_t& {
    return table.values[static_cast<size_t>(row * stride + i)];
  };
  for (int64_t i = 0; i <= table.slots; ++i) {
    // Past the real sequences: length 0 at the end of the data.
    const int64_t start = i < table.sequences ? starts[static_cast<size_t>(i)] : tokens;
    const int64_t end = i + 1 < table.sequences ? starts[static_cast<size_t>(i + 1)] : tokens;
    if (i < table.slots) at(kRaggedLengths, i) = static_cast<int32_t>(i < table.sequences ? end - start : 0);
    at(kRaggedQOffsets, i) = static_cast<int32_t>(start * s.n_heads * s.head_dim);
    at(kRaggedKvOffsets, i) = static_cast<int32_t>(start * s.n_kv_heads * s.head_dim);
    at(kRaggedStatsTokens, i) = static_cast<int32_t>(start * s.n_heads);
    const int64_t row = start / s.seq, position = start % s.seq;
    at(kRaggedStatsRows, i) = static_cast<int32_t>(
        start == tokens ? tokens * s.n_heads : row * s.n_heads * s.seq + position);
    at(kRaggedStarts, i) = static_cast<int32_t>(start);
  }
  return table;
}

}  // namespace memtune
