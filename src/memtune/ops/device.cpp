#include "memtune/ops/device.h"

#include "memtune/core/error.h"

#ifdef MEMTUNE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace memtune {

uint64_t backend_workspace_bytes(Device target) {
  return target == Device::cuda ? kCudaGemmWorkspaceBytes + kCudaReductionScratchBytes : 0;
}

bool cuda_device_present() {
#ifdef MEMTUNE_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
#else
  return false;
#endif
}

std::unique_ptr<Backend> make_backend(const std::string& device) {
  MT_USER_CHECK(device == "cpu" || device == "cuda" || device == "auto",
                "--device {}: expected cpu, cuda or auto", device);
  if (device == "cpu") return make_cpu_backend();
  if (cuda_device_present()) {
#ifdef MEMTUNE_WITH_CUDA
    return make_cuda_backend();
#endif
  }
  MT_USER_CHECK(device == "auto", "--device cuda: no CUDA device is available{}",
#ifdef MEMTUNE_WITH_CUDA
                ""
#else
                " (this binary was built without the CUDA backend)"
#endif
  );
  return make_cpu_backend();
}

uint64_t device_memory_in_use(const Backend& backend) {
#ifdef MEMTUNE_WITH_CUDA
  size_t free_bytes = 0, total_bytes = 0;
  if (backend.device() == Device::cuda && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
    return total_bytes - free_bytes;
#endif
  return 0;
}

uint64_t device_memory_total(const Backend& backend) {
#ifdef MEMTUNE_WITH_CUDA
  size_t free_bytes = 0, total_bytes = 0;
  if (backend.device() == Device::cuda && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
    return total_bytes;
#endif
  return 0;
}

uint64_t context_reserve_bytes(Device target) {
  return target == Device::cuda ? kCudaContextReserveBytes : 0;
}

uint64_t measured_context_reserve_bytes(const Backend& backend) {
  if (backend.device() != Device::cuda) return 0;
  return device_memory_in_use(backend) + kLazyKernelReserveBytes;
}

std::string device_description(const Backend& backend) {
#ifdef MEMTUNE_WITH_CUDA
  if (backend.device() == Device::cuda) {
    int index = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&index) == cudaSuccess && cudaGetDeviceProperties(&prop, index) == cudaSuccess)
      return prop.name;
    return "cuda";
  }
#endif
  return std::string(device_name(backend.device()));
}

}  // namespace memtune
