// Shared pieces of the 4-bit tests on any backend (tests/quant on the CPU, tests/gpu on CUDA):
// configs, reading device tensors back, and the bit-for-bit comparison of a Quantized4bit with
// the host reference of quant/nf4.h.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/quant/nf4.h"
#include "../support/expect_error.h"

namespace memtune::quanttest {

inline QuantConfig make_config(QuantType type, int64_t blocksize, bool double_quant) {
  QuantConfig config;
  config.type = type;
  config.blocksize = blocksize;
  config.double_quant = double_quant;
  return config;
}

inline std::string config_label(const QuantConfig& c) {
  return std::string(quant_type_name(c.type)) + " bs" + std::to_string(c.blocksize) +
         (c.double_quant ? " dq" : "");
}

template <typename T>
std::vector<T> read_back(Backend& backend, const Tensor& t) {
  std::vector<T> values(t.nbytes() / sizeof(T));
  backend.copy_to_host(values.data(), t);
  return values;
}

inline uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

// Bitwise equality of two arrays, reporting the first difference (and how many there are).
template <typename T>
void expect_same(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t differing = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    bool same;
    if constexpr (std::is_same_v<T, float>) same = bits_of(got[i]) == bits_of(want[i]);
    else same = got[i] == want[i];
    if (!same) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++differing;
    }
  }
  if (differing == 0) return;
  ADD_FAILURE() << what << ": " << differing << " of " << got.size() << " differ; first at " << first
                << ": " << +got[first] << " vs " << +want[first];
}

// Every field of q (on `backend`) equals the reference weight, bit for bit.
inline void expect_equals_reference(Backend& backend, const Quantized4bit& q, const QuantizedWeight& ref,
                                    const std::string& what) {
  expect_same(read_back<uint8_t>(backend, q.packed), ref.packed, what + " packed");
  expect_same(read_back<float>(backend, q.code_map), ref.quant_map, what + " code_map");
  if (q.config.double_quant) {
    expect_same(read_back<uint8_t>(backend, q.absmax), ref.absmax_codes, what + " absmax codes");
    expect_same(read_back<float>(backend, q.nested_absmax), ref.nested_absmax, what + " nested_absmax");
    expect_same(read_back<float>(backend, q.nested_map), ref.nested_quant_map, what + " nested_map");
    EXPECT_EQ(bits_of(q.nested_offset), bits_of(ref.nested_offset))
        << what << " nested_offset " << q.nested_offset << " vs " << ref.nested_offset;
  } else {
    expect_same(read_back<float>(backend, q.absmax), ref.absmax, what + " absmax");
    EXPECT_EQ(q.nested_offset, 0.0f) << what;
  }
}

inline std::vector<float> normal_values(int64_t n, std::mt19937_64& rng, float std_dev) {
  std::normal_distribution<float> normal(0.0f, std_dev);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = normal(rng);
  return values;
}

// The message of the memtune::Error that body throws; empty when it throws none.
inline std::string error_of(const std::function<void()>& action) { return test::error_or_empty(action); }

// A model whose projections have odd element counts and partial blocks (45 x 45, 9 x 45, ...).
inline LlamaConfig odd_tiny_model() {
  LlamaConfig c;
  c.hidden_size = 45;
  c.intermediate_size = 103;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 5;
  c.num_key_value_heads = 1;
  c.head_dim = 9;
  c.vocab_size = 50;
  c.max_position_embeddings = 64;
  c.initializer_range = 0.02;
  c.name = "odd-tiny";
  return c;
}

}  // namespace memtune::quanttest
