// Packing: best-fit decreasing placement, and the row layout that keeps samples apart
// (positions restart, one segment per sample, no target across a boundary).
#include "memtune/data/packing.h"

#include <gtest/gtest.h>

#include "memtune/core/error.h"

using namespace memtune;

namespace {

std::vector<Sample> samples_of_lengths(const std::vector<int>& lengths) {
  std::vector<Sample> samples;
  for (size_t i = 0; i < lengths.size(); ++i) {
    Sample s;
    for (int t = 0; t < lengths[i]; ++t) s.input_ids.push_back(static_cast<int32_t>(100 * (i + 1) + t));
    s.labels = s.input_ids;
    samples.push_back(std::move(s));
  }
  return samples;
}

TEST(Packing, BestFitDecreasingPlacesLongestFirstIntoTheTightestRow) {
  const std::vector<Sample> samples = samples_of_lengths({5, 3, 7, 2, 4});
  const std::vector<RowLayout> rows = pack_best_fit_decreasing(samples, 10);
  // 7 opens row 0 (room 3); 5 opens row 1 (room 5); 4 fits best in row 1 (room 1); 3 fills
  // row 0; 2 fits nowhere and opens row 2.
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].samples, (std::vector<uint32_t>{2, 1}));
  EXPECT_EQ(rows[1].samples, (std::vector<uint32_t>{0, 4}));
  EXPECT_EQ(rows[2].samples, (std::vector<uint32_t>{3}));
  EXPECT_EQ(rows[0].tokens, 10);
  EXPECT_EQ(rows[1].tokens, 9);
  EXPECT_EQ(rows[2].tokens, 2);
  EXPECT_THROW(pack_best_fit_decreasing(samples_of_lengths({11}), 10), Error);
  EXPECT_EQ(rows_one_sample_each(samples).size(), samples.size());
}

TEST(Packing, RowKeepsSamplesApart) {
  std::vector<Sample> samples = samples_of_lengths({3, 4});
  samples[1].labels[2] = -100;  // a masked label stays masked
  RowLayout row{{0, 1}, 7};
  const int64_t seq = 10;
  std::vector<int32_t> ids(seq), targets(seq), positions(seq), segments(seq);
  write_row(samples, row, seq, /*pad_id=*/9, {ids.data(), targets.data(), positions.data(), segments.data()});
  EXPECT_EQ(ids, (std::vector<int32_t>{100, 101, 102, 200, 201, 202, 203, 9, 9, 9}));
  // Each sample's last token predicts nothing: the next sample's first token is not its target.
  EXPECT_EQ(targets, (std::vector<int32_t>{101, 102, -100, 201, -100, 203, -100, -100, -100, -100}));
  EXPECT_EQ(positions, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0, 1, 2}));
  EXPECT_EQ(segments, (std::vector<int32_t>{0, 0, 0, 1, 1, 1, 1, 2, 2, 2}));
  // A row of no samples is padding only.
  write_row(samples, RowLayout{}, seq, 9, {ids.data(), targets.data(), positions.data(), segments.data()});
  EXPECT_EQ(targets, std::vector<int32_t>(seq, -100));
  EXPECT_EQ(segments, std::vector<int32_t>(seq, 0));
}

}  // namespace
