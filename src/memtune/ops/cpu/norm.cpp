// HF LlamaRMSNorm, forward and backward for a frozen weight.
//
// Forward (transformers modeling_llama.py): x.float(); r = rsqrt(mean(x^2) + eps);
// normalized = (x * r).to(x.dtype); y = weight * normalized. The two roundings, first to x's
// dtype and then to out's, are HF's and are kept on purpose: they are the one exception to the
// backend's "round once" rule.
// Backward, with n = x * r and dn = dy * weight (the rounding of n passes the gradient as is):
//   dx_j = r * dn_j - r^3 * x_j * sum_i(dn_i * x_i) / H.
#include <cmath>
#include <vector>

#include "memtune/ops/cpu/cpu_backend.h"
#include "memtune/ops/op_checks.h"

namespace memtune {

void CpuBackend::rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                 const Tensor& weight, float eps) {
  check_rmsnorm_inputs("rmsnorm_forward", x, weight, rstd, cpu::check_float_tensor, cpu::check_tensor);
  cpu::check_float_tensor(out, "rmsnorm_forward out");
  MT_ASSERT(out.numel() == x.numel(), "rmsnorm_forward out {} for x {}", out.shape.str(),
            x.shape.str());
  const int64_t rows = x.rows(), hidden = x.cols();
  std::vector<float> weight_values(static_cast<size_t>(hidden));
  cpu::load_f32(weight, 0, hidden, weight_values.data());
  float* rstd_values = rstd.as<float>();

#pragma omp parallel if (rows * hidden >= cpu::kParallelMinElements)
  {
    std::vector<float> row(static_cast<size_t>(hidden));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      cpu::load_f32(x, i * hidden, hidden, row.data());
      const float mean_square = cpu::dot_f32(row.data(), row.data(), hidden) /
                                static_cast<float>(hidden);
      const float r = 1.0f / std::sqrt(mean_square + eps);
      rstd_values[i] = r;
      for (int64_t j = 0; j < hidden; ++j)
        row[j] = weight_values[j] * round_to_dtype(row[j] * r, x.dtype);
      cpu::store_f32(out, i * hidden, hidden, row.data());
    }
  }
}

void CpuBackend::rmsnorm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                  const Tensor& weight, const Tensor& rstd, bool accumulate) {
  check_rmsnorm_inputs("rmsnorm_backward", x, weight, rstd, cpu::check_float_tensor, cpu::check_tensor);
  cpu::check_float_tensor(dx, "rmsnorm_backward dx");
  cpu::check_float_tensor(dy, "rmsnorm_backward dy");
  MT_ASSERT(dx.numel() == x.numel() && dy.numel() == x.numel(),
            "rmsnorm_backward dx {} dy {} for x {}", dx.shape.str(), dy.shape.str(),
            x.shape.str());
  const int64_t rows = x.rows(), hidden = x.cols();
  std::vector<float> weight_values(static_cast<size_t>(hidden));
  cpu::load_f32(weight, 0, hidden, weight_values.data());
  const float* rstd_values = rstd.as<const float>();

#pragma omp parallel if (rows * hidden >= cpu::kParallelMinElements)
  {
    // Whole rows are loaded before dx is stored, so dx may alias dy or x.
    std::vector<float> x_row(static_cast<size_t>(hidden)), dn(static_cast<size_t>(hidden));
    std::vector<float> previous(accumulate ? static_cast<size_t>(hidden) : 0);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      cpu::load_f32(x, i * hidden, hidden, x_row.data());
      cpu::load_f32(dy, i * hidden, hidden, dn.data());
      if (accumulate) cpu::load_f32(dx, i * hidden, hidden, previous.data());
      for (int64_t j = 0; j < hidden; ++j) dn[j] *= weight_values[j];
      const float r = rstd_values[i];
      const float projection =
          cpu::dot_f32(dn.data(), x_row.data(), hidden) / static_cast<float>(hidden);
      const float x_coefficient = r * r * r * projection;
      for (int64_t j = 0; j < hidden; ++j) dn[j] = r * dn[j] - x_coefficient * x_row[j];
      if (accumulate)
        for (int64_t j = 0; j < hidden; ++j) dn[j] += previous[j];
      cpu::store_f32(dx, i * hidden, hidden, dn.data());
    }
  }
}

}  // namespace memtune
