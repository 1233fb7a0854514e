// The packed rows' sequence table (ops/ragged_attention.h) that cuDNN's ragged attention reads:
// the sequences are exactly the segments of each row (so causal attention within a sequence is
// the flash op's segment mask), every token is in one sequence, the slots and the longest length
// are rounded up for graph caching with empty slots at the end, and every offset row says where
// each sequence lives in its tensor.
#include "memtune/ops/ragged_attention.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

using namespace memtune;

namespace {

RaggedTableShape shape_of(int64_t rows, int64_t seq, int64_t capacity = 0) {
  RaggedTableShape s;
  s.rows = rows;
  s.seq = seq;
  s.capacity = capacity > 0 ? capacity : rows * seq;
  s.n_heads = 4;
  s.n_kv_heads = 2;
  s.head_dim = 8;
  return s;
}

int32_t at(const RaggedTableHost& t, const RaggedTableShape& s, int row, int64_t i) {
  return t.values[static_cast<size_t>(row * (s.capacity + 1) + i)];
}

TEST(RaggedTable, RunsOfOneSegmentIdPerRowAreTheSequences) {
  // Row 0: samples of 3, 2 and 1 tokens; row 1: one sample of 4 and 2 tokens of padding (its own
  // segment id, as write_row numbers it).
  const std::vector<int32_t> segments = {0, 0, 0, 1, 1, 2,  //
                                         0, 0, 0, 0, 1, 1};
  const RaggedTableShape s = shape_of(2, 6);
  const RaggedTableHost t = build_ragged_table(segments.data(), s);
  ASSERT_FALSE(t.empty());
  EXPECT_EQ(t.sequences, 5);
  EXPECT_EQ(t.slots, 8);      // rounded up to a power of two
  EXPECT_EQ(t.longest, 4);
  EXPECT_EQ(t.max_len, kRaggedMinMaxLen);
  ASSERT_EQ(t.values.size(), static_cast<size_t>(kRaggedTableRows * (s.capacity + 1)));
  const std::vector<int64_t> starts = {0, 3, 5, 6, 10}, lengths = {3, 2, 1, 4, 2};
  for (int64_t i = 0; i < t.slots; ++i) {
    const bool real = i < t.sequences;
    const int64_t start = real ? starts[i] : 12;  // empty slots sit at the end of the data
    EXPECT_EQ(at(t, s, kRaggedLengths, i), real ? lengths[i] : 0) << i;
    EXPECT_EQ(at(t, s, kRaggedQOffsets, i), start * 4 * 8) << i;
    EXPECT_EQ(at(t, s, kRaggedKvOffsets, i), start * 2 * 8) << i;
    EXPECT_EQ(at(t, s, kRaggedStatsTokens, i), start * 4) << i;
    EXPECT_EQ(at(t, s, kRaggedStarts, i), start) << i;
    // lse [batch, heads, seq]: row * heads * seq + position.
    const int64_t rows_offset = real ? (start / 6) * 4 * 6 + start % 6 : 12 * 4;
    EXPECT_EQ(at(t, s, kRaggedStatsRows, i), rows_offset) << i;
  }
  // The offset rows have one entry more (the end).
  EXPECT_EQ(at(t, s, kRaggedQOffsets, t.slots), 12 * 4 * 8);
  EXPECT_EQ(at(t, s, kRaggedStarts, t.slots), 12);
}

TEST(RaggedTable, ExactSizesWithoutRoundingAndSlotsNeverPastTheCapacity) {
  const std::vector<int32_t> segments = {0, 1, 2, 3, 4, 4};  // five sequences in six tokens
  RaggedTableShape s = shape_of(1, 6);
  s.round_up = false;
  RaggedTableHost t = build_ragged_table(segments.data(), s);
  EXPECT_EQ(t.sequences, 5);
  EXPECT_EQ(t.slots, 5);
  EXPECT_EQ(t.max_len, 2);
  // Rounded up, eight slots would not fit a table of capacity 6 (sequences <= tokens).
  s.round_up = true;
  t = build_ragged_table(segments.data(), s);
  EXPECT_EQ(t.slots, 6);
  EXPECT_EQ(at(t, s, kRaggedLengths, 5), 0);
  // A larger capacity (the plan's tokens, bigger than this batch) leaves room for all eight.
  s = shape_of(1, 6, 40);
  t = build_ragged_table(segments.data(), s);
  EXPECT_EQ(t.slots, 8);
  EXPECT_EQ(at(t, s, kRaggedStarts, 8), 6);
}

TEST(RaggedTable, LongestRoundsUpToAPowerOfTwo) {
  std::vector<int32_t> segments(300, 0);
  for (int i = 129; i < 300; ++i) segments[i] = 1;  // 129 + 171 tokens
  const RaggedTableHost t = build_ragged_table(segments.data(), shape_of(1, 300));
  EXPECT_EQ(t.longest, 171);
  EXPECT_EQ(t.max_len, 256);
  EXPECT_EQ(t.slots, 2);
  EXPECT_EQ(round_up_pow2(1), 1);
  EXPECT_EQ(round_up_pow2(64), 64);
  EXPECT_EQ(round_up_pow2(65), 128);
}

TEST(RaggedTable, AnIdThatComesBackWithinARowGivesNoTable) {
  // Tokens 4-5 share segment 0 with tokens 0-1: the flash op's mask joins them, runs would not.
  const std::vector<int32_t> back = {0, 0, 1, 1, 0, 0};
  EXPECT_TRUE(build_ragged_table(back.data(), shape_of(1, 6)).empty());
  // Ids restarting at a new row are fine.
  const std::vector<int32_t> rows = {0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 2, 2};
  EXPECT_EQ(build_ragged_table(rows.data(), shape_of(2, 6)).sequences, 5);
}

TEST(RaggedTable, OffsetsPastI32GiveNoTable) {
  RaggedTableShape s = shape_of(1, 4);
  s.n_heads = 1 << 16;
  s.head_dim = 1 << 14;  // 4 tokens * 2^30 elements each
  const std::vector<int32_t> segments = {0, 0, 1, 1};
  EXPECT_TRUE(build_ragged_table(segments.data(), s).empty());
}

// Random packed rows: the table's sequences tile the tokens in order, never cross a row, and two
// tokens of a row share a sequence exactly when they share a segment id.
TEST(RaggedTable, RandomPackedRowsTileTheTokensAndMatchTheSegmentMask) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 4), seq = 1 + static_cast<int64_t>(rng() % 80);
    std::vector<int32_t> segments(static_cast<size_t>(rows * seq));
    for (int64_t r = 0; r < rows; ++r) {
      int32_t id = 0;
      for (int64_t t = 0; t < seq; ++t) {
        if (t > 0 && rng() % 5 == 0) ++id;  // a new sample
        segments[static_cast<size_t>(r * seq + t)] = id;
      }
    }
    const RaggedTableShape s = shape_of(rows, seq, rows * seq + static_cast<int64_t>(rng() % 10));
    const RaggedTableHost t = build_ragged_table(segments.data(), s);
    ASSERT_FALSE(t.empty());
    ASSERT_GE(t.slots, t.sequences);
    ASSERT_LE(t.slots, s.capacity);
    ASSERT_GE(t.max_len, t.longest);
    std::vector<int64_t> sequence_of(segments.size(), -1);
    int64_t next = 0;
    for (int64_t i = 0; i < t.slots; ++i) {
      const int64_t start = at(t, s, kRaggedStarts, i), length = at(t, s, kRaggedLengths, i);
      ASSERT_EQ(start, next) << "trial " << trial << " sequence " << i;
      ASSERT_EQ(at(t, s, kRaggedStarts, i + 1), start + length);
      ASSERT_EQ(length > 0, i < t.sequences);
      ASSERT_LE(length, t.longest);
      if (length > 0) ASSERT_EQ(start / seq, (start + length - 1) / seq) << "crosses a row";
      for (int64_t k = start; k < start + length; ++k) sequence_of[static_cast<size_t>(k)] = i;
      next = start + length;
    }
    ASSERT_EQ(next, rows * seq);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t a = 0; a < seq; ++a)
        for (int64_t b = 0; b < a; ++b) {
          const size_t ia = static_cast<size_t>(r * seq + a), ib = static_cast<size_t>(r * seq + b);
          ASSERT_EQ(sequence_of[ia] == sequence_of[ib], segments[ia] == segments[ib]);
        }
  }
}

}  // namespace
