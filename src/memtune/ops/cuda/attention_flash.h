// Run-time variants of the tensor-core flash attention (attention_flash_forward.cu and the
// backward's main pass in attention_flash_backward.cu), for
// A/B timing and bisecting; the defaults are the measured best. set_flash_versions overrides them
// for the rest of the process from the next launch on (the tests run several in one process).
#pragma once

namespace memtune::cuda {

// How the Hopper backward adds each query block's dQ into the fp32 accumulator:
//  pairs  red.global.add.v2.f32 from every thread's accumulator pairs (32 a thread an item at
//         head_dim 128);
//  bulk   the warpgroup's 64 x 64 tile through shared memory, added by the copy engine
//         (cp.reduce.async.bulk.tensor), two 128-byte-wide boxes an item: 1.11-1.37x pairs' backward
//         alone on an H100 (bench/results/2026-12-07-h100-session5); the default.
// A third way, red.global.add.v4.f32 after a lane-pair exchange (half as many reductions), measured
// 0.94-1.02x pairs there and was removed.
enum class HopperDq { pairs, bulk };

// The order in which the Hopper backward's blocks and their items run. dQ's fp32 adds hit L2 only
// where a query tile's adds from the key blocks that see it come close together in time:
//  keys_first    key blocks slowest over the grid (the longest, first keys of each row start
//                first), each block's items head by head, query blocks rising: a tile's adds
//                are spread over the whole launch;
//  rows_rising   rows (kv head, batch row) slowest, key blocks within, each block's items query
//                block by query block with the group's heads fastest, rising from the diagonal;
//  rows_falling  as rows_rising, query blocks falling from the row's last: a row's blocks that
//                start together add into the same query tile at once.
// In the rows_* orders the rows go in groups (FlashVersions::backward_hopper_row_group), key
// blocks slowest within a group. The default size (groups of at least two waves of blocks each,
// the rows shared evenly) was chosen from a count of the launch's tail (bench/backward_schedule.py:
// 12-15% for one row a group at b8 s2048 and b2 s8192); the H100 did not show those tails, but no
// other size measured faster at any shape, so it stays (bench/NOTES.md, 2026-12-07).
// The rows_* orders are built with dQ by bulk reduce-adds only, and the 2-float reductions with
// keys_first only: FlashVersions::backward_hopper_dq = pairs runs keys_first.
enum class HopperOrder { keys_first, rows_rising, rows_falling };
// Each order's short name: MEMTUNE_FLASH_BACKWARD_ORDER's values and the tests' NVTX ranges.
struct HopperOrderName {
  const char* name;
  HopperOrder order;
};
inline constexpr HopperOrderName kHopperOrderNames[] = {
    {"keys", HopperOrder::keys_first}, {"rising", HopperOrder::rows_rising}, {"falling", HopperOrder::rows_falling}};
inline const char* hopper_order_short_name(HopperOrder order) {
  for (const HopperOrderName& entry : kHopperOrderNames)
    if (entry.order == order) return entry.name;
  return "?";
}

struct FlashVersions {
  bool forward_hopper = true;           // the Hopper forward (attention_hopper.h: compute capability
                                        // 9.0, the sm_90a object in the build) where it serves the
                                        // call, else forward v2; false: forward v2 always.
                                        // MEMTUNE_FLASH_FORWARD=v2 sets the start value false
  bool forward_hopper_overlap = false;  // the Hopper forward's kernel with FlashAttention-3's
                                        // intra-warpgroup pipelining (attention_hopper_forward.cu:
                                        // one key block's softmax under the block before's
                                        // O += P V); false: each wgmma group waited for at once.
                                        // Not yet timed on a GPU. MEMTUNE_FLASH_FORWARD=
                                        // hopper-overlap sets the start value true (and
                                        // forward_hopper's)
  bool backward_hopper = true;          // the Hopper backward's main pass (attention_hopper.h) where
                                        // it serves the call, else backward v2's; false: v2 always.
                                        // 1.06-1.68x backward v2 on an H100 (bench/NOTES.md).
                                        // MEMTUNE_FLASH_BACKWARD=v2 sets the start value false
  HopperDq backward_hopper_dq = HopperDq::bulk;  // how the Hopper backward adds dQ into its
                                                  // fp32 accumulator (HopperDq); pairs run in the
                                                  // keys_first order whatever backward_hopper_order
                                                  // says (the only order built for them).
                                                  // MEMTUNE_FLASH_BACKWARD=hopper-pairs sets pairs
  HopperOrder backward_hopper_order = HopperOrder::rows_falling;  // the Hopper backward's block and
                                                                 // item order (HopperOrder): with
                                                                 // bulk, 1.20x / 0.99x / 1.03x /
                                                                 // 1.09x keys_first's backward at
                                                                 // b8 s2048 / b2 s8192 / b1 s32768 /
                                                                 // d64 on an H100 (bench/NOTES.md);
                                                                 // MEMTUNE_FLASH_BACKWARD_ORDER=keys,
                                                                 // rising or falling sets the start value
  int backward_hopper_row_group = 0;  // rows a group in the rows_* orders; 0: as many groups as
                                      // hold two waves of blocks each, the rows shared evenly
  int forward_keys = 0;                 // keys per block: 32 or 64 (where shared memory allows),
                                        // 0 the default; MEMTUNE_FLASH_FWD_KEYS sets the start value
  bool forward_grid_per_head = false;   // heaviest query blocks first per head, not grid-wide
  bool forward_rescale_always = false;  // rescale O every key block, not only where a max moved
  int forward_rescale_slack = 8;        // a row's running max (log2 units) moves only when a
                                        // key block's exceeds it by more than this
};

FlashVersions flash_versions();
void set_flash_versions(const FlashVersions& versions);

}  // namespace memtune::cuda
