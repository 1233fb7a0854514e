// The flash forward's run-time versions (attention_flash.h) set for one scope and put back after
// it, so that a test can run the backend's own flash forward as forward v2 and as the Hopper
// forward in one process without leaking its choice into the next test.
#pragma once

#include "memtune/ops/cuda/attention_flash.h"

namespace memtune::gputest {

class FlashVersionsScope {
 public:
  explicit FlashVersionsScope(const cuda::FlashVersions& versions) : saved_(cuda::flash_versions()) {
    cuda::set_flash_versions(versions);
  }
  ~FlashVersionsScope() { cuda::set_flash_versions(saved_); }
  FlashVersionsScope(const FlashVersionsScope&) = delete;
  FlashVersionsScope& operator=(const FlashVersionsScope&) = delete;

 private:
  cuda::FlashVersions saved_;
};

// The current versions with the Hopper forward allowed (where it serves the call) or not.
inline cuda::FlashVersions flash_versions_with_hopper(bool allowed) {
  cuda::FlashVersions versions = cuda::flash_versions();
  versions.forward_hopper = allowed;
  return versions;
}

}  // namespace memtune::gputest
