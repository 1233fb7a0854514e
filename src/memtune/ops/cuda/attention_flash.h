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
};

FlashVersions flash_versions();
void set_flash_versions(const FlashVersions& versions);

}  // namespace memtune::cuda
