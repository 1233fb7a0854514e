// GEMM throughput of the backend's matmul (cuBLASLt on CUDA) in bf16 with fp32 accumulation: the
// "measured dense bf16 GEMM rate" that MFU targets are stated against, and the rate of the GEMM
// shapes of one Llama-3.1-8B LoRA step (micro-batch 2 x seq 2048 = 4096 tokens).
//
// Usage: bench_gemm [--iters 20] [--json]
// Each shape runs once to warm up, then --iters times between two synchronisations; the table
// gives milliseconds per GEMM and TFLOP/s (2 M N K per GEMM). Without a CUDA device it says so and
// exits 0 (this is a benchmark, not a test).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "memtune/ops/backend.h"
#include "memtune/ops/device.h"

namespace {

using namespace memtune;

struct GemmShape {
  const char* what;
  int64_t m, n, k;  // c [m, n] = a [m, k] @ op(b) [k, n]
  bool transpose_b;  // b stored [n, k] (a linear weight in the forward)
};

}  // namespace

int main(int argc, char** argv) {
  int iters = 20;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--json") == 0) json = true;
    else {
      std::fprintf(stderr, "usage: bench_gemm [--iters N] [--json]\n");
      return 2;
    }
  }
#ifndef MEMTUNE_WITH_CUDA
  std::printf("bench_gemm: built without CUDA; nothing to measure\n");
  return 0;
#else
  if (!cuda_device_present()) {
    std::printf("bench_gemm: no CUDA device; nothing to measure\n");
    return 0;
  }
  const std::unique_ptr<Backend> backend = make_backend("cuda");
  const int64_t tokens = 4096;
  const std::vector<GemmShape> shapes = {
      {"square 8192 (dense rate)", 8192, 8192, 8192, false},
      {"q/o_proj fwd  [T,4096]x[4096,4096]^T", tokens, 4096, 4096, true},
      {"k/v_proj fwd  [T,4096]x[1024,4096]^T", tokens, 1024, 4096, true},
      {"gate/up fwd   [T,4096]x[14336,4096]^T", tokens, 14336, 4096, true},
      {"down fwd      [T,14336]x[4096,14336]^T", tokens, 4096, 14336, true},
      {"gate/up dx    [T,14336]x[14336,4096]", tokens, 4096, 14336, false},
      {"down dx       [T,4096]x[4096,14336]", tokens, 14336, 4096, false},
      {"lm_head chunk [256,4096]x[128256,4096]^T", 256, 128256, 4096, true},
      {"lm_head dx    [256,128256]x[128256,4096]", 256, 4096, 128256, false},
      {"lora A fwd    [T,4096]x[16,4096]^T", tokens, 16, 4096, true},
  };
  uint64_t largest = 0;
  for (const GemmShape& s : shapes)
    largest = std::max<uint64_t>(largest, static_cast<uint64_t>(s.m * s.k + s.k * s.n + s.m * s.n));
  void* arena = backend->allocate_arena(largest * 2 + 256);
  const auto tensor = [&](uint64_t offset_elements, int64_t rows, int64_t cols) {
    return Tensor{static_cast<char*>(arena) + offset_elements * 2, DType::bf16, Shape{rows, cols}, Device::cuda};
  };
  {  // random inputs: GEMM speed depends a little on the bit patterns (zeros are faster)
    const Tensor all{arena, DType::bf16, Shape{static_cast<int64_t>(largest)}, Device::cuda};
    backend->fill_random(all, Backend::Distribution::normal, 0.0f, 1.0f, 7);
  }
  nlohmann::json rows = nlohmann::json::array();
  std::printf("bench_gemm on %s: bf16 inputs, fp32 accumulation, bf16 output; %d iterations\n",
              device_description(*backend).c_str(), iters);
  std::printf("%-44s %9s %9s\n", "shape (c = a x op(b))", "ms", "TFLOP/s");
  for (const GemmShape& s : shapes) {
    const Tensor a = tensor(0, s.m, s.k);
    const Tensor b = s.transpose_b ? tensor(s.m * s.k, s.n, s.k) : tensor(s.m * s.k, s.k, s.n);
    const Tensor c = tensor(s.m * s.k + s.k * s.n, s.m, s.n);
    backend->matmul(c, a, false, b, s.transpose_b, 1.0f, 0.0f);
    backend->synchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) backend->matmul(c, a, false, b, s.transpose_b, 1.0f, 0.0f);
    backend->synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
    const double tflops = 2.0 * s.m * s.n * s.k / seconds / 1e12;
    std::printf("%-44s %9.3f %9.1f\n", s.what, seconds * 1e3, tflops);
    rows.push_back({{"shape", s.what}, {"m", s.m}, {"n", s.n}, {"k", s.k}, {"ms", seconds * 1e3}, {"tflops", tflops}});
  }
  backend->free_arena(arena);
  if (json) std::printf("%s\n", nlohmann::json{{"bench", "gemm"}, {"device", device_description(*backend)}, {"rows", rows}}.dump().c_str());
  return 0;
#endif
}
