// Cross-entropy forward/backward against a naive double log-softmax: ignored rows, grad_scale,
// accumulation into loss_sum, aliasing, low-precision logits, stability and finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "memtune/ops/backend.h"
#include "op_test_util.h"

using namespace memtune;
using namespace memtune::optest;

namespace {

struct NaiveLoss {
  double loss_sum = 0.0;
  std::vector<double> d_logits;
};

NaiveLoss naive_cross_entropy(const std::vector<float>& logits, const std::vector<int32_t>& targets,
                              int64_t vocab, double grad_scale) {
  NaiveLoss result;
  result.d_logits.assign(logits.size(), 0.0);
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] == -100) continue;
    const float* row = logits.data() + i * vocab;
    double max_value = row[0];
    for (int64_t j = 1; j < vocab; ++j) max_value = std::max(max_value, double(row[j]));
    double sum = 0.0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(row[j] - max_value);
    const double log_sum_exp = max_value + std::log(sum);
    result.loss_sum += log_sum_exp - row[targets[i]];
    for (int64_t j = 0; j < vocab; ++j)
      result.d_logits[i * vocab + j] =
          (std::exp(row[j] - log_sum_exp) - (j == targets[i] ? 1.0 : 0.0)) * grad_scale;
  }
  return result;
}

std::vector<int32_t> random_targets(int64_t rows, int64_t vocab, std::mt19937_64& rng,
                                    double ignored_fraction) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::bernoulli_distribution ignore(ignored_fraction);
  std::vector<int32_t> targets(rows);
  for (auto& t : targets) t = ignore(rng) ? -100 : dist(rng);
  return targets;
}

struct CeShape {
  int64_t rows, vocab;
};
const CeShape kCeShapes[] = {{1, 1}, {3, 7}, {17, 1000}, {9, 32003}};

}  // namespace

TEST(CpuCrossEntropy, MatchesNaiveWithIgnoredRowsAndGradScale) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(21);
  for (const CeShape& s : kCeShapes) {
    HostTensor logits = random_tensor(DType::f32, {s.rows, s.vocab}, rng, -4.0f, 4.0f);
    std::vector<int32_t> target_values = random_targets(s.rows, s.vocab, rng, 0.3);
    if (s.rows > 1) target_values[0] = -100;  // at least one ignored row
    target_values.back() = static_cast<int32_t>(s.vocab - 1);  // and one used row
    HostTensor targets = i32_tensor({s.rows}, target_values);
    const float grad_scale = 0.37f;
    HostTensor loss_sum = tensor_from(DType::f32, {1}, {1.5f});  // accumulates onto this
    HostTensor d_logits = random_tensor(DType::f32, logits.shape, rng);  // garbage to overwrite
    backend->cross_entropy_forward_backward(loss_sum, d_logits, logits, targets, grad_scale);
    const NaiveLoss expected =
        naive_cross_entropy(logits.floats(), target_values, s.vocab, grad_scale);
    EXPECT_NEAR(loss_sum.floats()[0], 1.5 + expected.loss_sum, 1e-5 * (1.5 + expected.loss_sum))
        << s.rows << "x" << s.vocab;
    EXPECT_LT(max_abs_error(d_logits.floats(), expected.d_logits), 1e-6 * grad_scale + 1e-8);
    const std::vector<float> grads = d_logits.floats();
    for (int64_t i = 0; i < s.rows; ++i)
      if (target_values[i] == -100)
        for (int64_t j = 0; j < s.vocab; ++j) ASSERT_EQ(grads[i * s.vocab + j], 0.0f);

    // Forward only: the same loss, nothing else written.
    HostTensor loss_only = tensor_from(DType::f32, {1}, {1.5f});
    const std::vector<uint8_t> logits_before = logits.storage;
    backend->cross_entropy_forward(loss_only, logits, targets);
    EXPECT_EQ(loss_only.floats()[0], loss_sum.floats()[0]);
    EXPECT_EQ(logits.storage, logits_before);
  }
}

TEST(CpuCrossEntropy, GradientMatchesFiniteDifferences) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(22);
  const CeShape s{4, 23};
  HostTensor logits = random_tensor(DType::f32, {s.rows, s.vocab}, rng, -2.0f, 2.0f);
  HostTensor targets = i32_tensor({s.rows}, {3, -100, 22, 0});
  HostTensor loss_sum(DType::f32, {1});
  HostTensor d_logits(DType::f32, logits.shape);
  backend->fill(loss_sum, 0.0f);
  const float grad_scale = 2.0f;
  backend->cross_entropy_forward_backward(loss_sum, d_logits, logits, targets, grad_scale);
  auto objective = [&] {
    backend->fill(loss_sum, 0.0f);
    backend->cross_entropy_forward(loss_sum, logits, targets);
    return double(loss_sum.floats()[0]) * grad_scale;
  };
  // A sum of a few O(1) losses in fp32: a larger step keeps the fp32 noise of the objective
  // well below the differences.
  expect_gradient_matches("cross_entropy d_logits", d_logits.floats(), logits, objective,
                          indices_to_check(logits.numel(), logits.numel(), rng), 1e-2, 1e-2);
}

TEST(CpuCrossEntropy, InPlaceLowPrecisionAndStability) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(23);
  const CeShape s{6, 515};
  const std::vector<int32_t> target_values = random_targets(s.rows, s.vocab, rng, 0.2);
  HostTensor targets = i32_tensor({s.rows}, target_values);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    // An offset of 1e4 overflows exp() without the max subtraction (f16 cannot hold it: 30).
    const float offset = dtype == DType::f16 ? 30.0f : 1e4f;
    std::vector<float> values = random_floats(s.rows * s.vocab, rng, -3.0f, 3.0f);
    for (float& v : values) v += offset;
    HostTensor logits = tensor_from(dtype, {s.rows, s.vocab}, values);
    const NaiveLoss expected = naive_cross_entropy(logits.floats(), target_values, s.vocab, 1.0);
    HostTensor loss_sum = tensor_from(DType::f32, {1}, {0.0f});
    backend->cross_entropy_forward_backward(loss_sum, logits, logits, targets, 1.0f);  // in place
    EXPECT_NEAR(loss_sum.floats()[0], expected.loss_sum, 1e-5 * expected.loss_sum + 1e-5)
        << dtype_label(dtype);
    // d_logits rounded once into the logits' dtype: within half an ulp of entries up to 1.
    const std::vector<float> got = logits.floats();
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_LE(std::fabs(got[i] - expected.d_logits[i]),
                unit_roundoff(dtype) * std::fabs(expected.d_logits[i]) + 1e-6)
          << dtype_label(dtype) << " at " << i;
  }
}

TEST(CpuCrossEntropy, AllRowsIgnored) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(24);
  HostTensor logits = random_tensor(DType::bf16, {3, 50}, rng);
  HostTensor targets = i32_tensor({3}, {-100, -100, -100});
  HostTensor loss_sum = tensor_from(DType::f32, {1}, {4.0f});
  HostTensor d_logits = random_tensor(DType::f32, {3, 50}, rng);
  backend->cross_entropy_forward_backward(loss_sum, d_logits, logits, targets, 1.0f);
  EXPECT_EQ(loss_sum.floats()[0], 4.0f);
  for (float v : d_logits.floats()) ASSERT_EQ(v, 0.0f);
}
