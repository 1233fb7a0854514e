// Which versions of the flash attention forward and backward run (attention_flash.cu). v2 is
// the default for both; MEMTUNE_FLASH_FWD=v1 and MEMTUNE_FLASH_BWD=v1 (each read once, at the
// first use) select the previous kernels, as fall-backs and for A/B timing. set_flash_versions
// overrides them for the rest of the process (the timing test times both versions in one run)
// from the next launch on.
#pragma once

namespace memtune::cuda {

struct FlashVersions {
  bool backward_v1 = false;
  bool forward_v1 = false;
  // Forward v2's variants, for A/B timing (the defaults are the measured best):
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
