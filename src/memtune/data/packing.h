// Rows of a micro-batch: which samples each row of max_seq_length tokens holds, and the row's
// shifted token arrays.
//
// Unpacked, a row holds one sample, right-padded. Packed (TRL's packing=True with its default
// packing_strategy "bfd"), a row holds several whole samples end to end, placed by best-fit
// decreasing, and each sample sees only itself: positions restart at 0 where a sample starts,
// every sample of a row has its own segment id (the attention ops' block-diagonal causal mask),
// and the last token of a sample has no target (-100), so no target crosses into the next
// sample. That is TRL's padding-free layout (position_ids reset per sequence, the label at each
// sequence start set to -100) in the fixed [batch, seq] shape the plan was made for: a packed
// micro-batch costs exactly the bytes of an unpacked one, and its loss sum and gradients are
// those of the same samples unpacked.
#pragma once

#include <cstdint>
#include <vector>

#include "memtune/data/jsonl_dataset.h"

namespace memtune {

struct RowLayout {
  std::vector<uint32_t> samples;  // indices into Dataset::samples, in row order
  int64_t tokens = 0;             // their total length (<= seq)
};

// One row per sample, in sample order.
std::vector<RowLayout> rows_one_sample_each(const std::vector<Sample>& samples);

// Best-fit decreasing: samples by length, longest first (ties in sample order), each into the
// open row with the least room that still fits it, else into a new row. Rows come in the order
// they were opened. memtune::Error for a sample longer than seq (truncate first).
std::vector<RowLayout> pack_best_fit_decreasing(const std::vector<Sample>& samples, int64_t seq);

// The length a micro-batch's rows run at when shapes follow the data: the longest row's tokens
// rounded up to a multiple of `multiple` (the kernels' tile; 1: exact), at most `cap` (the
// planned row length). transformers' DataCollatorWithPadding(padding="longest",
// pad_to_multiple_of=multiple) pads a batch the same way.
int64_t padded_length(int64_t longest, int64_t multiple, int64_t cap);

// transformers' group_by_length (LengthGroupedSampler, trainer_pt_utils.py): the shuffled order
// cut into mega-batches of min(rows / (4 * batch), 50) * batch rows (at least one batch), each
// sorted by length, longest first (ties keep the shuffled order), so that a micro-batch holds rows
// of similar length and little padding, while the order stays random at the mega-batch scale.
// memtune does not move the longest batch to the front as transformers does (to hit an
// out-of-memory error early): the plan already holds the longest.
std::vector<uint32_t> group_by_length(const std::vector<uint32_t>& shuffled, const std::vector<RowLayout>& rows,
                                      int64_t batch);

// Where write_row puts one row: four arrays of seq entries each.
struct RowBuffers {
  int32_t* input_ids;
  int32_t* targets;    // targets[t]: the label of token t + 1 of the same sample, else -100
  int32_t* positions;  // restart at 0 at each sample (and at the padding)
  int32_t* segments;   // 0, 1, ... per sample; the padding after them gets one more
};

// Lays out `row` in seq tokens, padding with pad_id. A row with no samples is all padding
// (every target -100): it fills the last micro-batch of an epoch to the planned shape.
void write_row(const std::vector<Sample>& samples, const RowLayout& row, int64_t seq, int32_t pad_id,
               const RowBuffers& out);

}  // namespace memtune
