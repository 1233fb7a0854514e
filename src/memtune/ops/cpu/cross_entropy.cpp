// Cross-entropy over logits [rows, V] against i32 targets (-100 = ignored), in fp32 whatever the
// logits' dtype (HF: logits.float()). Per row, with m = max(x) and s = sum(exp(x - m)):
//   loss = (m - x[target]) + log(s);  d_logits = (exp(x - m) / s - onehot(target)) * grad_scale.
// Row losses are added to loss_sum in row order in fp32, so the sum does not depend on threads.
#include <algorithm>
#include <cmath>
#include <vector>

#include "memtune/ops/cpu/cpu_backend.h"

namespace memtune {
namespace {

constexpr int32_t kIgnoreIndex = -100;

void check_cross_entropy_args(const char* op, const Tensor& loss_sum, const Tensor& logits,
                              const Tensor& targets) {
  cpu::check_tensor(loss_sum, DType::f32, op);
  MT_ASSERT(loss_sum.numel() == 1, "{}: loss_sum {} is not one value", op, loss_sum.shape.str());
  cpu::check_float_tensor(logits, op);
  cpu::check_tensor(targets, DType::i32, op);
  MT_ASSERT(logits.shape.ndim >= 1 && targets.numel() == logits.rows(),
            "{}: targets {} for logits {}", op, targets.shape.str(), logits.shape.str());
  const int32_t* target_values = targets.as<const int32_t>();
  for (int64_t i = 0; i < targets.numel(); ++i)
    MT_ASSERT(target_values[i] == kIgnoreIndex ||
                  (target_values[i] >= 0 && target_values[i] < logits.cols()),
              "{}: target {} at row {} outside [0, {})", op, target_values[i], i, logits.cols());
}

// exp(x - max) in place; returns max, and the sum of the exponentials in *sum_out.
float exponentiate_row(float* x, int64_t n, float* sum_out) {
  float max_value = x[0];
  for (int64_t j = 1; j < n; ++j) max_value = std::max(max_value, x[j]);
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) {
      x[j + l] = std::exp(x[j + l] - max_value);
      lanes[l] += x[j + l];
    }
  for (int l = 0; j < n; ++j, ++l) {
    x[j] = std::exp(x[j] - max_value);
    lanes[l] += x[j];
  }
  const float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                    ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  *sum_out = sum;
  return max_value;
}

// d_logits empty: forward only.
void cross_entropy(const Tensor& loss_sum, const Tensor& d_logits, const Tensor& logits,
                   const Tensor& targets, float grad_scale) {
  const int64_t rows = logits.rows(), vocab = logits.cols();
  const int32_t* target_values = targets.as<const int32_t>();
  const bool backward = !d_logits.empty();
  std::vector<float> row_losses(static_cast<size_t>(rows), 0.0f);

#pragma omp parallel if (rows * vocab >= cpu::kParallelMinElements)
  {
    std::vector<float> row(static_cast<size_t>(vocab));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      const int32_t target = target_values[i];
      if (target == kIgnoreIndex) {
        if (backward) {
          std::fill(row.begin(), row.end(), 0.0f);
          cpu::store_f32(d_logits, i * vocab, vocab, row.data());
        }
        continue;
      }
      // The whole row is loaded before d_logits is stored: d_logits may alias logits.
      cpu::load_f32(logits, i * vocab, vocab, row.data());
      const float target_logit = row[target];
      float sum = 0.0f;
      const float max_value = exponentiate_row(row.data(), vocab, &sum);
      // -log_softmax[target] = (max - x_t) + log(sum), as torch's log_softmax forms it: the
      // difference of two large logits is exact, so large logits lose no precision.
      row_losses[i] = (max_value - target_logit) + std::log(sum);
      if (backward) {
        const float target_probability = row[target] / sum;
        for (int64_t j = 0; j < vocab; ++j) row[j] = row[j] / sum * grad_scale;
        row[target] = (target_probability - 1.0f) * grad_scale;
        cpu::store_f32(d_logits, i * vocab, vocab, row.data());
      }
    }
  }
  float* total = loss_sum.as<float>();
  for (float loss : row_losses) *total += loss;
}

}  // namespace

void CpuBackend::cross_entropy_forward_backward(const Tensor& loss_sum, const Tensor& d_logits,
                                                const Tensor& logits, const Tensor& targets,
                                                float grad_scale) {
  check_cross_entropy_args("cross_entropy_forward_backward", loss_sum, logits, targets);
  cpu::check_float_tensor(d_logits, "cross_entropy_forward_backward d_logits");
  MT_ASSERT(d_logits.numel() == logits.numel() && d_logits.numel() > 0,
            "cross_entropy_forward_backward d_logits {} for logits {}", d_logits.shape.str(),
            logits.shape.str());
  cross_entropy(loss_sum, d_logits, logits, targets, grad_scale);
}

void CpuBackend::cross_entropy_forward(const Tensor& loss_sum, const Tensor& logits,
                                       const Tensor& targets) {
  check_cross_entropy_args("cross_entropy_forward", loss_sum, logits, targets);
  cross_entropy(loss_sum, Tensor{}, logits, targets, 1.0f);
}

}  // namespace memtune
