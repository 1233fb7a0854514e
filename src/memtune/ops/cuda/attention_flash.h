// Which version of the flash attention backward runs (attention_flash.cu). v2 is the default;
// MEMTUNE_FLASH_BWD=v1 (read once, at the first flash backward) selects the previous kernel, as
// a fall-back and for A/B timing. set_flash_versions overrides it for the rest of the process
// (the timing test times both versions in one run) from the next launch on. The forward has one
// version.
#pragma once

namespace memtune::cuda {

struct FlashVersions {
  bool backward_v1 = false;
};

FlashVersions flash_versions();
void set_flash_versions(const FlashVersions& versions);

}  // namespace memtune::cuda
