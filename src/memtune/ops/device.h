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
// What a CUDA run holds on the device outside its arena: the CUDA context, the cuBLASLt and cuDNN
// handles, and the kernels that CUDA's lazy module loading brings in on first use. A --vram
// budget holds the plan plus this.
// - Without a GPU at hand (plan, fit) a fixed reserve: the H200 context measured before any arena
//   was 529 MiB (bench/NOTES.md, "Load-time scratch"), and a 131k/200k-token run grew by up to
//   ~100 MiB past plan + context as kernels loaded (issue 21): 640 MiB holds both.
// - A run on a GPU measures its context once its backend exists and adds the lazy-load margin.
constexpr uint64_t kCudaContextReserveBytes = 640ull << 20;
constexpr uint64_t kLazyKernelReserveBytes = 96ull << 20;
// The reserve for a plan made for `target` without its device: 0 on the CPU.
uint64_t context_reserve_bytes(Device target);
// The reserve of a run on `backend`: the device memory in use now (context and handles) plus
// kLazyKernelReserveBytes on a GPU; 0 on the CPU.
uint64_t measured_context_reserve_bytes(const Backend& backend);
// A short description for reports: "NVIDIA H200" or "cpu".
std::string device_description(const Backend& backend);

}  // namespace memtune
