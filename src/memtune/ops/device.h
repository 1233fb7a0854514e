// Choosing the backend a run executes on.
#pragma once

#include <memory>
#include <string>

#include "memtune/ops/backend.h"

namespace memtune {

// True when this binary has the CUDA backend and a CUDA device is present.
bool cuda_device_present();
// "cpu", "cuda", or "auto" (cuda when present, else cpu). Throws memtune::Error for "cuda"
// without a device.
std::unique_ptr<Backend> make_backend(const std::string& device);
// Device memory in use by everything on the device (as nvidia-smi shows it: CUDA context and
// library handles included), and the device's total; 0 on the CPU.
uint64_t device_memory_in_use(const Backend& backend);
uint64_t device_memory_total(const Backend& backend);
// A short description for reports: "NVIDIA H200" or "cpu".
std::string device_description(const Backend& backend);

}  // namespace memtune
