// GEMM throughput of the backend's matmul (cuBLASLt on CUDA) in bf16 with fp32 accumulation: the
// "measured dense bf16 GEMM rate" that MFU targets are stated against, and the rate of the GEMM
// shapes of one Llama-3.1-8B LoRA step (micro-batch 2 x seq 2048 = 4096 tokens).
//
// And the six LoRA products per projection (rank 16 and 64, T = 1024 and 4096 tokens, feature
// sizes 1024 / 4096 / 14336), with a per-step total. (A split-K kernel for the thin ones was
// measured against cuBLASLt with this bench and not kept: bench/results/2026-12-03-h200-lora-gemm.)
//
// Usage: bench_gemm [--iters 20] [--json]
// Each shape runs once to warm up, then --iters times between two synchronisations; the table
// gives milliseconds per GEMM, TFLOP/s (2 M N K per GEMM) and GB/s (A + B + C bytes, C twice
// with beta 1). Without a CUDA device it says so and exits 0 (this is a benchmark, not a test).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "memtune/ops/backend.h"
#include "memtune/ops/device.h"

namespace {

using namespace memtune;

struct GemmShape {
  std::string what;
  int64_t m, n, k;  // c [m, n] = op(a) [m, k] @ op(b) [k, n]
  bool transpose_a, transpose_b;  // a stored [k, m]; b stored [n, k] (a linear weight in the forward)
  DType c_type = DType::bf16;
  float beta = 0.0f;
  int lora_product = -1;  // index into kLoraProducts for the LoRA rows
  int64_t tokens = 0, rank = 0, feature = 0;
};

// The six LoRA products of one projection with T tokens, rank r and feature size D (the in
// features K for u, gradA, dx; the out features N for y, gradB, du), as llama_step.cpp calls them.
struct LoraProduct {
  const char* name;
  bool feature_is_in;  // D = K (in features) or N (out features)
};
constexpr LoraProduct kLoraProducts[] = {
    {"u = x A^T", true},        {"y += s u B^T", false}, {"gB += s dy^T u", false},
    {"du = s dy B", false},      {"gA += du^T x", true},  {"dx += du A", true},
};

GemmShape lora_shape(int product, int64_t tokens, int64_t rank, int64_t d) {
  GemmShape s;
  s.what = std::string("lora ") + kLoraProducts[product].name + " T" + std::to_string(tokens) +
           " D" + std::to_string(d) + " r" + std::to_string(rank);
  s.lora_product = product;
  s.tokens = tokens;
  s.rank = rank;
  s.feature = d;
  switch (product) {
    case 0: s.m = tokens, s.n = rank, s.k = d, s.transpose_a = false, s.transpose_b = true; break;
    case 1: s.m = tokens, s.n = d, s.k = rank, s.transpose_a = false, s.transpose_b = true, s.beta = 1.0f; break;
    case 2: s.m = d, s.n = rank, s.k = tokens, s.transpose_a = true, s.transpose_b = false, s.c_type = DType::f32, s.beta = 1.0f; break;
    case 3: s.m = tokens, s.n = rank, s.k = d, s.transpose_a = false, s.transpose_b = false; break;
    case 4: s.m = rank, s.n = d, s.k = tokens, s.transpose_a = true, s.transpose_b = false, s.c_type = DType::f32, s.beta = 1.0f; break;
    default: s.m = tokens, s.n = d, s.k = rank, s.transpose_a = false, s.transpose_b = false, s.beta = 1.0f; break;
  }
  return s;
}

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
  std::vector<GemmShape> shapes = {
      {"square 8192 (dense rate)", 8192, 8192, 8192, false, false},
      {"q/o_proj fwd  [T,4096]x[4096,4096]^T", tokens, 4096, 4096, false, true},
      {"k/v_proj fwd  [T,4096]x[1024,4096]^T", tokens, 1024, 4096, false, true},
      {"gate/up fwd   [T,4096]x[14336,4096]^T", tokens, 14336, 4096, false, true},
      {"down fwd      [T,14336]x[4096,14336]^T", tokens, 4096, 14336, false, true},
      {"gate/up dx    [T,14336]x[14336,4096]", tokens, 4096, 14336, false, false},
      {"down dx       [T,4096]x[4096,14336]", tokens, 14336, 4096, false, false},
      {"lm_head chunk [256,4096]x[128256,4096]^T", 256, 128256, 4096, false, true},
      {"lm_head dx    [256,128256]x[128256,4096]", 256, 4096, 128256, false, false},
  };
  // LoRA: T = 1024 (a token chunk) and 4096 (micro-batch 2 x 2048), r = 16 and 64,
  // D in {1024, 4096, 14336}. u, du, y, dx are bf16; gradA, gradB fp32 accumulating (beta 1).
  for (int64_t lora_tokens : {int64_t{1024}, int64_t{4096}})
    for (int64_t rank : {int64_t{16}, int64_t{64}})
      for (int product = 0; product < 6; ++product)
        for (int64_t d : {int64_t{1024}, int64_t{4096}, int64_t{14336}})
          shapes.push_back(lora_shape(product, lora_tokens, rank, d));

  const auto bytes_of = [](int64_t elements, DType dtype) {
    return static_cast<uint64_t>(elements) * static_cast<uint64_t>(dtype_size(dtype));
  };
  uint64_t largest = 0;
  for (const GemmShape& s : shapes)
    largest = std::max<uint64_t>(largest, bytes_of(s.m * s.k + s.k * s.n, DType::bf16) +
                                              bytes_of(s.m * s.n, s.c_type) + 512);
  void* arena = backend->allocate_arena(largest);
  const auto tensor = [&](uint64_t offset_bytes, DType dtype, int64_t rows, int64_t cols) {
    return Tensor{static_cast<char*>(arena) + offset_bytes, dtype, Shape{rows, cols}, Device::cuda};
  };
  {  // random inputs: GEMM speed depends a little on the bit patterns (zeros are faster)
    const Tensor all{arena, DType::bf16, Shape{static_cast<int64_t>(largest / 2)}, Device::cuda};
    backend->fill_random(all, Backend::Distribution::normal, 0.0f, 1.0f, 7);
  }
  nlohmann::json rows = nlohmann::json::array();
  std::printf("bench_gemm on %s: bf16 inputs, fp32 accumulation, bf16 output (LoRA gradA/gradB: "
              "fp32, beta 1); %d iterations\n",
              device_description(*backend).c_str(), iters);
  std::printf("%-44s %9s %9s %9s\n", "shape (c = op(a) x op(b))", "ms", "TFLOP/s", "GB/s");
  // ms per LoRA row, by (product, T, r, D), for the per-step estimate below.
  std::map<std::tuple<int, int64_t, int64_t, int64_t>, double> lora_ms;
  for (const GemmShape& s : shapes) {
    const uint64_t a_bytes = bytes_of(s.m * s.k, DType::bf16), b_bytes = bytes_of(s.k * s.n, DType::bf16);
    const Tensor a = s.transpose_a ? tensor(0, DType::bf16, s.k, s.m) : tensor(0, DType::bf16, s.m, s.k);
    const Tensor b = s.transpose_b ? tensor(a_bytes, DType::bf16, s.n, s.k) : tensor(a_bytes, DType::bf16, s.k, s.n);
    const uint64_t c_offset = (a_bytes + b_bytes + 255) / 256 * 256;
    const Tensor c = tensor(c_offset, s.c_type, s.m, s.n);
    // beta 1 keeps adding to c: start it at zero so the values stay finite (bf16 c rounds).
    if (s.beta != 0.0f) backend->fill(c, 0.0f);
    backend->matmul(c, a, s.transpose_a, b, s.transpose_b, 1.0f, s.beta);
    backend->synchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) backend->matmul(c, a, s.transpose_a, b, s.transpose_b, 1.0f, s.beta);
    backend->synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
    const double tflops = 2.0 * s.m * s.n * s.k / seconds / 1e12;
    const uint64_t c_bytes = bytes_of(s.m * s.n, s.c_type) * (s.beta != 0.0f ? 2 : 1);
    const double gbps = static_cast<double>(a_bytes + b_bytes + c_bytes) / seconds / 1e9;
    std::printf("%-44s %9.3f %9.1f %9.0f\n", s.what.c_str(), seconds * 1e3, tflops, gbps);
    rows.push_back({{"shape", s.what}, {"m", s.m}, {"n", s.n}, {"k", s.k}, {"ms", seconds * 1e3},
                    {"tflops", tflops}, {"gbps", gbps}});
    if (s.lora_product >= 0) lora_ms[{s.lora_product, s.tokens, s.rank, s.feature}] = seconds * 1e3;
  }
  backend->free_arena(arena);
  // One Llama-3.1-8B step's LoRA products at T tokens per projection, no token chunking:
  // 32 layers x (q, k, v, o, gate, up, down) with (K, N) = (4096, 4096), (4096, 1024) x 2,
  // (4096, 4096), (4096, 14336) x 2, (14336, 4096).
  const std::pair<int64_t, int64_t> projections[] = {{4096, 4096}, {4096, 1024}, {4096, 1024}, {4096, 4096},
                                                     {4096, 14336}, {4096, 14336}, {14336, 4096}};
  nlohmann::json estimates = nlohmann::json::array();
  for (int64_t lora_tokens : {int64_t{1024}, int64_t{4096}})
    for (int64_t rank : {int64_t{16}, int64_t{64}}) {
      double per_layer = 0.0;
      for (const auto& [in, out] : projections)
        for (int product = 0; product < 6; ++product)
          per_layer += lora_ms[{product, lora_tokens, rank, kLoraProducts[product].feature_is_in ? in : out}];
      std::printf("LoRA products per step (32 layers x 7 projections, T%lld r%lld): %.2f ms\n",
                  static_cast<long long>(lora_tokens), static_cast<long long>(rank), 32 * per_layer);
      estimates.push_back({{"tokens", lora_tokens}, {"rank", rank}, {"ms_per_step", 32 * per_layer}});
    }
  if (json)
    std::printf("%s\n", nlohmann::json{{"bench", "gemm"}, {"device", device_description(*backend)},
                                       {"rows", rows}, {"lora_step_estimates", estimates}}
                            .dump()
                            .c_str());
  return 0;
#endif
}
