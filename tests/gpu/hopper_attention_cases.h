// What the Hopper attention tests (test_cuda_hopper_attention.cpp, forward; test_cuda_hopper_
// backward.cpp, backward) share: the shape of a case and its label, a relative error over large
// arrays, whether this device and build run the sm_90a kernels, a case's random inputs with the CPU
// backend's forward and backward on them, and the packed-row cases (runs of segment ids) that both
// kernels are held to.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "../support/attention_setup.h"

namespace memtune::gputest::hopper {

struct Config {
  int64_t batch, seq, heads, kv_heads, head_dim;
};

inline std::string label(const Config& c, DType type) {
  return "b" + std::to_string(c.batch) + " s" + std::to_string(c.seq) + " h" + std::to_string(c.heads) + "/" +
         std::to_string(c.kv_heads) + " d" + std::to_string(c.head_dim) + " " + optest::dtype_label(type);
}

// ||a - b|| / ||b|| in double over two equally long arrays (the timing shapes hold tens of millions
// of values: expect_close's double copies would take longer than the kernels); `finite` says
// whether the sizes match and every value of a is finite.
inline double relative_error(const std::vector<float>& a, const std::vector<float>& b, bool& finite) {
  double difference = 0.0, norm = 0.0;
  finite = a.size() == b.size();
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    finite = finite && std::isfinite(a[i]);
    difference += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return norm > 0.0 ? std::sqrt(difference / norm) : std::sqrt(difference);
}

// Empty where the current device is compute capability 9.0 (what the sm_90a kernels need), else
// why a test skips. Whether the build holds the sm_90a kernel each test asks its launcher.
inline std::string hopper_device_skip_reason() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return "the device's compute capability could not be read";
  if (major == 9 && minor == 0) return "";
  return "compute capability " + std::to_string(major) + "." + std::to_string(minor) +
         ": the Hopper (sm_90a) attention kernels need 9.0";
}

// A case's 16-bit inputs (q and k uniform in [-1.5, 1.5): scores of a few units; v and dO in
// [-1, 1)) and the CPU backend's flash forward and backward on them, the reference the GPU kernels
// are held to; `segments` (host ids, or none) packs the rows.
struct CpuAttention {
  HostTensor q, k, v, d_out;
  HostTensor out, lse, dq, dk, dv;
};

inline CpuAttention cpu_attention(Backend& cpu, std::mt19937_64& rng, const Config& c, DType type,
                                  const Tensor& segments = Tensor{}) {
  const AttentionDims dims = test::attention_dims_of(c);
  const int64_t n = c.batch * c.seq;
  const Shape q_shape{n, c.heads * c.head_dim}, kv_shape{n, c.kv_heads * c.head_dim}, rows{c.batch * c.heads * c.seq};
  CpuAttention a;
  a.q = optest::random_tensor(type, q_shape, rng, -1.5, 1.5);
  a.k = optest::random_tensor(type, kv_shape, rng, -1.5, 1.5);
  a.v = optest::random_tensor(type, kv_shape, rng);
  a.d_out = optest::random_tensor(type, q_shape, rng);
  a.out = HostTensor(type, q_shape);
  a.lse = HostTensor(DType::f32, rows);
  a.dq = HostTensor(type, q_shape);
  a.dk = HostTensor(type, kv_shape);
  a.dv = HostTensor(type, kv_shape);
  HostTensor delta(DType::f32, rows), dq_accum(DType::f32, q_shape);
  cpu.attention_flash_forward(a.out, a.lse, a.q, a.k, a.v, segments, dims);
  cpu.attention_flash_backward(a.dq, a.dk, a.dv, delta, dq_accum, a.d_out, a.out, a.lse, a.q, a.k, a.v, segments,
                               dims);
  return a;
}

// Packed rows: each batch row's runs of equal segment ids, as (tokens, id) in order.
struct IdRun {
  int64_t tokens;
  int32_t id;
};

inline HostTensor segment_ids(const Config& c, const std::vector<std::vector<IdRun>>& rows) {
  EXPECT_EQ(rows.size(), static_cast<size_t>(c.batch));
  std::vector<int32_t> ids;
  for (size_t r = 0; r < rows.size(); ++r) {
    for (const IdRun& run : rows[r]) ids.insert(ids.end(), static_cast<size_t>(run.tokens), run.id);
    EXPECT_EQ(ids.size(), static_cast<size_t>(c.seq) * (r + 1)) << "row " << r << "'s runs must fill seq";
  }
  return optest::i32_tensor(Shape{c.batch * c.seq}, ids);
}

struct PackedCase {
  Config config;
  std::vector<std::vector<IdRun>> rows;  // one list of runs a batch row
};

// One row of 2,600 tokens split 700/1/1,299/600 (a one-token sample, samples across the 128-key
// blocks) at head_dim 128 and 64; ids that come back after others, and ids that fall; a last token
// whose id is the first token's (its query block sees key block 0; the first key block's query loop
// runs to the row's end); every token its own sample; a row that is one sample.
inline std::vector<PackedCase> packed_cases() {
  std::vector<IdRun> own_ids;  // 300 samples of one token
  for (int32_t i = 0; i < 300; ++i) own_ids.push_back(IdRun{1, i});
  return {{{1, 2600, 2, 1, 128}, {{{700, 0}, {1, 1}, {1299, 2}, {600, 3}}}},
          {{1, 2600, 4, 2, 64}, {{{700, 0}, {1, 1}, {1299, 2}, {600, 3}}}},
          {{2, 1337, 4, 1, 128}, {{{300, 0}, {200, 1}, {400, 0}, {437, 2}}, {{1, 5}, {500, 7}, {1, 5}, {835, 7}}}},
          {{3, 777, 2, 2, 64}, {{{100, 9}, {300, 4}, {377, -2}}, {{777, 0}}, {{129, 3}, {129, 2}, {129, 3}, {390, 1}}}},
          {{1, 1000, 2, 1, 64}, {{{1, 0}, {998, 1}, {1, 0}}}},
          {{1, 300, 8, 2, 128}, {own_ids}}};
}

}  // namespace memtune::gputest::hopper
