// Choosing the backend a run executes on.
#pragma once

#include <memory>
#include <string>

#include "memtune/ops/backend.h"

namespace memtune {

// The device scratch a backend for `target` binds (Backend::workspace_bytes), known without
// creating one so that a plan can be made for a device that is not here: the CUDA backend's
// cuBLASLt workspace plus its reduction partials; nothing on the CPU.
constexpr uint64_t kCudaGemmWorkspaceBytes = 32ull << 20;
constexpr uint64_t kCudaReductionScratchBytes = 256ull << 10;
uint64_t backend_workspace_bytes(Device target);

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
