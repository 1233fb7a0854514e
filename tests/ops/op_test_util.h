// Helpers for op tests: host tensors of any dtype over std::vector storage, random fills, float
// read-back, error measures and central-difference gradients. Generic over backends: a CUDA test
// makes its inputs here, copies them with Backend::copy_from_host, and compares read-backs with
// the CPU backend's results through the same error measures.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "memtune/core/dtype.h"
#include "memtune/core/tensor.h"

namespace memtune::optest {

// A cpu Tensor over storage, resized to fit dtype x shape. The view stays valid while storage is
// neither resized nor destroyed (moving the vector keeps its buffer).
inline Tensor tensor_over(std::vector<uint8_t>& storage, DType dtype, Shape shape) {
  storage.resize(static_cast<size_t>(shape.numel()) * dtype_size(dtype));
  Tensor t;
  t.data = storage.empty() ? nullptr : storage.data();
  t.dtype = dtype;
  t.shape = shape;
  t.device = Device::cpu;
  return t;
}

// Values of any tensor with host-readable data (f32/bf16/f16/i32/u8) as floats.
inline std::vector<float> read_floats(const Tensor& t) {
  std::vector<float> values(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) values[i] = load_as_f32(t.data, t.dtype, i);
  return values;
}

// Stores values into t (rounded to its dtype).
inline void write_floats(const Tensor& t, const std::vector<float>& values) {
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) store_from_f32(t.data, t.dtype, i, values[i]);
}

// An owning host tensor. Copying copies the data; tensor() is a view over this object's storage.
struct HostTensor {
  DType dtype = DType::f32;
  Shape shape;
  std::vector<uint8_t> storage;

  HostTensor() = default;
  HostTensor(DType dtype_, Shape shape_) : dtype(dtype_), shape(shape_) {
    tensor_over(storage, dtype, shape);
  }
  Tensor tensor() const {
    Tensor t;
    t.data = storage.empty() ? nullptr : const_cast<uint8_t*>(storage.data());
    t.dtype = dtype;
    t.shape = shape;
    t.device = Device::cpu;
    return t;
  }
  operator Tensor() const { return tensor(); }  // pass straight to backend ops
  int64_t numel() const { return shape.numel(); }
  std::vector<float> floats() const { return read_floats(tensor()); }
  float* f32() {
    EXPECT_EQ(dtype, DType::f32);
    return reinterpret_cast<float*>(storage.data());
  }
};

// "No tensor": the empty optional argument of an op.
inline Tensor no_tensor() { return Tensor{}; }

// Uniform values in [lo, hi), kept away from zero by at least min_magnitude (so that nothing is
// accidentally zero and relative errors stay meaningful).
inline std::vector<float> random_floats(int64_t n, std::mt19937_64& rng, float lo = -1.0f,
                                        float hi = 1.0f, float min_magnitude = 1e-3f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) {
    do v = dist(rng);
    while (std::fabs(v) < min_magnitude);
  }
  return values;
}

inline std::vector<float> rounded_to(std::vector<float> values, DType dtype) {
  for (float& v : values) v = round_to_dtype(v, dtype);
  return values;
}

inline HostTensor tensor_from(DType dtype, Shape shape, const std::vector<float>& values) {
  HostTensor t(dtype, shape);
  write_floats(t.tensor(), values);
  return t;
}

inline HostTensor random_tensor(DType dtype, Shape shape, std::mt19937_64& rng, float lo = -1.0f,
                                float hi = 1.0f) {
  return tensor_from(dtype, shape, random_floats(shape.numel(), rng, lo, hi));
}

inline HostTensor i32_tensor(Shape shape, const std::vector<int32_t>& values) {
  HostTensor t(DType::i32, shape);
  EXPECT_EQ(static_cast<int64_t>(values.size()), shape.numel());
  std::copy(values.begin(), values.end(), reinterpret_cast<int32_t*>(t.storage.data()));
  return t;
}

// A tensor of the same values in another dtype (rounded once).
inline HostTensor converted(const HostTensor& t, DType dtype) {
  return tensor_from(dtype, t.shape, t.floats());
}

inline double max_abs(const std::vector<float>& values) {
  double m = 0.0;
  for (float v : values) m = std::max(m, static_cast<double>(std::fabs(v)));
  return m;
}

inline double max_abs_error(const std::vector<float>& actual, const std::vector<double>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  double m = 0.0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i)
    m = std::max(m, std::fabs(static_cast<double>(actual[i]) - expected[i]));
  return m;
}

inline std::vector<double> to_double(const std::vector<float>& values) {
  return std::vector<double>(values.begin(), values.end());
}

inline double max_abs_error(const std::vector<float>& actual, const std::vector<float>& expected) {
  return max_abs_error(actual, to_double(expected));
}

// max |actual - expected| / max(|expected|, floor): per-element relative error, with floor
// keeping near-zero expected values from dominating.
inline double max_rel_error(const std::vector<float>& actual, const std::vector<double>& expected,
                            double floor = 1e-6) {
  EXPECT_EQ(actual.size(), expected.size());
  double m = 0.0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i) {
    const double err = std::fabs(static_cast<double>(actual[i]) - expected[i]);
    m = std::max(m, err / std::max(std::fabs(expected[i]), floor));
  }
  return m;
}
inline double max_rel_error(const std::vector<float>& actual, const std::vector<float>& expected,
                            double floor = 1e-6) {
  return max_rel_error(actual, to_double(expected), floor);
}

// max |actual - expected| / max |expected|: error relative to the scale of the whole result,
// the measure for outputs where single entries may cancel to near zero.
inline double scaled_error(const std::vector<float>& actual, const std::vector<double>& expected) {
  double scale = 0.0;
  for (double e : expected) scale = std::max(scale, std::fabs(e));
  return max_abs_error(actual, expected) / std::max(scale, 1e-30);
}
inline double scaled_error(const std::vector<float>& actual, const std::vector<float>& expected) {
  return scaled_error(actual, to_double(expected));
}

// ||actual - expected||_2 / ||expected||_2.
inline double norm_rel_error(const std::vector<float>& actual, const std::vector<double>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i) {
    const double d = static_cast<double>(actual[i]) - expected[i];
    num += d * d;
    den += expected[i] * expected[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// sum(out * weights) in double: the random scalar objective of gradient checks.
inline double weighted_sum(const Tensor& out, const std::vector<float>& weights) {
  const std::vector<float> values = read_floats(out);
  EXPECT_EQ(values.size(), weights.size());
  double total = 0.0;
  for (size_t i = 0; i < values.size() && i < weights.size(); ++i)
    total += static_cast<double>(values[i]) * weights[i];
  return total;
}

// Indices to check: all of [0, n) when n <= max_count, else max_count distinct random ones.
inline std::vector<int64_t> indices_to_check(int64_t n, int64_t max_count, std::mt19937_64& rng) {
  std::vector<int64_t> all(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) all[i] = i;
  if (n <= max_count) return all;
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(max_count));
  std::sort(all.begin(), all.end());
  return all;
}

// Central differences of objective() with respect to the f32 entries of input at indices. The
// objective must re-run the forward from input's current values. The step is the one actually
// representable in f32 around each value.
inline std::vector<double> numeric_gradient(HostTensor& input,
                                            const std::function<double()>& objective,
                                            const std::vector<int64_t>& indices,
                                            double eps = 1e-3) {
  float* values = input.f32();
  std::vector<double> gradient;
  gradient.reserve(indices.size());
  for (int64_t index : indices) {
    const float saved = values[index];
    const float plus = static_cast<float>(saved + eps);
    const float minus = static_cast<float>(saved - eps);
    values[index] = plus;
    const double f_plus = objective();
    values[index] = minus;
    const double f_minus = objective();
    values[index] = saved;
    gradient.push_back((f_plus - f_minus) / (static_cast<double>(plus) - minus));
  }
  return gradient;
}

inline std::vector<float> gather(const std::vector<float>& values,
                                 const std::vector<int64_t>& indices) {
  std::vector<float> out;
  out.reserve(indices.size());
  for (int64_t i : indices) out.push_back(values[static_cast<size_t>(i)]);
  return out;
}

// Compares an analytic gradient (all entries) with central differences at indices: the error
// relative to the largest gradient entry must stay below tolerance.
inline void expect_gradient_matches(const std::string& what, const std::vector<float>& analytic,
                                    HostTensor& input, const std::function<double()>& objective,
                                    const std::vector<int64_t>& indices, double tolerance = 1e-2,
                                    double eps = 1e-3) {
  const std::vector<double> numeric = numeric_gradient(input, objective, indices, eps);
  const std::vector<float> checked = gather(analytic, indices);
  const double error = scaled_error(checked, numeric);
  EXPECT_LT(error, tolerance) << what << ": analytic vs central differences over "
                              << indices.size() << " entries (norm error "
                              << norm_rel_error(checked, numeric) << ")";
  double analytic_scale = max_abs(checked);
  EXPECT_GT(analytic_scale, 0.0) << what << ": gradient is identically zero";
}

// Spacing of dtype's values near magnitude (one unit in the last place).
inline double ulp_of(DType dtype, double magnitude) {
  const int mantissa_bits = dtype == DType::bf16 ? 8 : dtype == DType::f16 ? 11 : 24;
  if (magnitude == 0.0) return 0.0;
  return std::ldexp(1.0, std::ilogb(magnitude) - (mantissa_bits - 1));
}

// The relative rounding of one store into dtype (half an ulp, relative).
inline double unit_roundoff(DType dtype) {
  return dtype == DType::bf16 ? 1.0 / 256 : dtype == DType::f16 ? 1.0 / 2048 : 1.0 / 16777216;
}

inline const char* dtype_label(DType dtype) {
  return dtype == DType::bf16 ? "bf16" : dtype == DType::f16 ? "f16" : "f32";
}

}  // namespace memtune::optest
