// AdamW with torch.optim.AdamW semantics (torch/optim/adamw.py, _single_tensor_adamw; SPECS.md
// §8), element by element in the order of torch's tensor ops so that fp32 results follow it:
//   param.mul_(1 - lr * wd)
//   exp_avg.lerp_(grad, 1 - beta1)
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//   denom = (exp_avg_sq.sqrt() / sqrt(1 - beta2^step)).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1^step))
// The scalar coefficients are computed in double, as Python computes them, and used as fp32.
// grad is first multiplied by grad_scale (fp16 unscale times the clip coefficient).
#include <cmath>

#include "memtune/ops/cpu/cpu_backend.h"
#include "memtune/ops/op_checks.h"

namespace memtune {

void CpuBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                            const Tensor& exp_avg_sq, const AdamWParams& params) {
  check_adamw_inputs(param, grad, exp_avg, exp_avg_sq, params, cpu::check_tensor);
  const int64_t n = param.numel();

  const double lr = params.lr, beta1 = params.beta1, beta2 = params.beta2;
  const double step = static_cast<double>(params.step);
  const float decay_factor = static_cast<float>(1.0 - lr * params.weight_decay);
  const float avg_weight = static_cast<float>(1.0 - beta1);  // lerp weight
  const float beta2_f = params.beta2;
  const float sq_weight = static_cast<float>(1.0 - beta2);
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  const float neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, step))));
  const float eps = params.eps;
  const float grad_scale = params.grad_scale;

  float* p = param.as<float>();
  const float* g_stored = grad.as<const float>();
  float* m = exp_avg.as<float>();
  float* v = exp_avg_sq.as<float>();
#pragma omp parallel for schedule(static) if (n >= cpu::kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) {
    const float g = g_stored[i] * grad_scale;
    p[i] *= decay_factor;
    // torch's lerp: start + weight * (end - start) for weight < 0.5, else the mirrored form.
    m[i] = avg_weight < 0.5f ? m[i] + avg_weight * (g - m[i])
                             : g - (g - m[i]) * (1.0f - avg_weight);
    v[i] = v[i] * beta2_f + sq_weight * g * g;
    const float denom = std::sqrt(v[i]) / bias_correction2_sqrt + eps;
    p[i] += neg_step_size * m[i] / denom;
  }
}

}  // namespace memtune
