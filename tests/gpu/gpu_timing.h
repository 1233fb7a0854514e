// Timing for the GPU tests' TIMING prints: the median of several runs, each bracketed by CUDA
// events on the default stream (the stream the CUDA backend's ops run on in these tests).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace memtune::gputest {

// Milliseconds of one call of `run`: `warmups` untimed calls first (first-use costs: cuDNN graph
// builds, shared-memory opt-ins, caches), then the median of `repeats` timed ones.
inline double median_event_ms(const std::function<void()>& run, int warmups = 2, int repeats = 7) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < warmups; ++i) run();
  std::vector<float> times;
  for (int i = 0; i < repeats; ++i) {
    cudaEventRecord(start);
    run();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace memtune::gputest
