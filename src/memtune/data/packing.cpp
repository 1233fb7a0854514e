#include "memtune/data/packing.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <utility>

#include "memtune/core/error.h"

namespace memtune {

std::vector<RowLayout> rows_one_sample_each(const std::vector<Sample>& samples) {
  std::vector<RowLayout> rows(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    rows[i].samples = {static_cast<uint32_t>(i)};
    rows[i].tokens = static_cast<int64_t>(samples[i].input_ids.size());
  }
  return rows;
}

std::vector<RowLayout> pack_best_fit_decreasing(const std::vector<Sample>& samples, int64_t seq) {
  std::vector<uint32_t> order(samples.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return samples[a].input_ids.size() > samples[b].input_ids.size();
  });
  std::vector<RowLayout> rows;
  std::set<std::pair<int64_t, size_t>> room;  // (free tokens, row): the best fit is a lower_bound
  for (uint32_t index : order) {
    const int64_t length = static_cast<int64_t>(samples[index].input_ids.size());
    MT_USER_CHECK(length <= seq, "packing: sample {} has {} tokens, more than max_seq_length {} (truncate it first)",
                  index, length, seq);
    auto best = room.lower_bound({length, 0});
    size_t row;
    if (best == room.end()) {
      row = rows.size();
      rows.emplace_back();
    } else {
      row = best->second;
      room.erase(best);
    }
    rows[row].samples.push_back(index);
    rows[row].tokens += length;
    if (rows[row].tokens < seq) room.insert({seq - rows[row].tokens, row});
  }
  return rows;
}

int64_t padded_length(int64_t longest, int64_t multiple, int64_t cap) {
  MT_ASSERT(longest > 0 && multiple > 0 && longest <= cap, "padded_length({}, {}, {})", longest, multiple, cap);
  return std::min(cap, (longest + multiple - 1) / multiple * multiple);
}

std::vector<uint32_t> group_by_length(const std::vector<uint32_t>& shuffled, const std::vector<RowLayout>& rows,
                                      int64_t batch) {
  MT_ASSERT(batch > 0);
  const int64_t n = static_cast<int64_t>(shuffled.size());
  const int64_t mega = std::max<int64_t>(1, std::min<int64_t>(n / (4 * batch), 50)) * batch;
  std::vector<uint32_t> order = shuffled;
  for (int64_t begin = 0; begin < n; begin += mega) {
    const auto first = order.begin() + begin, last = order.begin() + std::min(n, begin + mega);
    std::stable_sort(first, last, [&](uint32_t a, uint32_t b) { return rows[a].tokens > rows[b].tokens; });
  }
  return order;
}

void write_row(const std::vector<Sample>& samples, const RowLayout& row, int64_t seq, int32_t pad_id,
               const RowBuffers& out) {
  MT_ASSERT(row.tokens <= seq, "row of {} tokens for seq {}", row.tokens, seq);
  int64_t t = 0;
  int32_t segment = 0;
  for (uint32_t index : row.samples) {
    const Sample& sample = samples[index];
    const int64_t length = static_cast<int64_t>(sample.input_ids.size());
    MT_ASSERT(t + length <= seq && sample.labels.size() == sample.input_ids.size());
    for (int64_t i = 0; i < length; ++i, ++t) {
      out.input_ids[t] = sample.input_ids[i];
      out.targets[t] = i + 1 < length ? sample.labels[i + 1] : -100;
      out.positions[t] = static_cast<int32_t>(i);
      out.segments[t] = segment;
    }
    ++segment;
  }
  for (int32_t position = 0; t < seq; ++t, ++position) {
    out.input_ids[t] = pad_id;
    out.targets[t] = -100;
    out.positions[t] = position;
    out.segments[t] = segment;
  }
}

}  // namespace memtune
