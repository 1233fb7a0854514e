// CPU matmul against a naive double GEMM: transposes, alpha/beta, beta == 0 over NaN, mixed
// dtypes, odd shapes that cross the tile edges, a finite-difference check, and a throughput
// report (GFLOP/s; printed, not asserted).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <limits>

#include "memtune/ops/backend.h"
#include "op_test_util.h"

using namespace memtune;
using namespace memtune::optest;

namespace {

struct GemmShape {
  int64_t m, n, k;
};

// Storage shape of a when op(a) is [m, k].
Shape a_storage(const GemmShape& s, bool transpose_a) {
  return transpose_a ? Shape{s.k, s.m} : Shape{s.m, s.k};
}
Shape b_storage(const GemmShape& s, bool transpose_b) {
  return transpose_b ? Shape{s.n, s.k} : Shape{s.k, s.n};
}

// alpha * op(a) @ op(b) + beta * c0 in double, from the stored (rounded) values.
std::vector<double> naive_gemm(const GemmShape& s, const std::vector<float>& a, bool transpose_a,
                               const std::vector<float>& b, bool transpose_b, float alpha,
                               float beta, const std::vector<float>& c0) {
  std::vector<double> c(static_cast<size_t>(s.m * s.n));
  for (int64_t i = 0; i < s.m; ++i)
    for (int64_t j = 0; j < s.n; ++j) {
      double sum = 0.0;
      for (int64_t p = 0; p < s.k; ++p) {
        const double av = transpose_a ? a[p * s.m + i] : a[i * s.k + p];
        const double bv = transpose_b ? b[j * s.k + p] : b[p * s.n + j];
        sum += av * bv;
      }
      c[i * s.n + j] = alpha * sum + (beta != 0.0f ? beta * c0[i * s.n + j] : 0.0);
    }
  return c;
}

const GemmShape kShapes[] = {{1, 1, 1},    {7, 5, 3},      {17, 33, 29},  {6, 8, 256},
                             {100, 70, 300}, {130, 300, 40}, {97, 257, 513}, {3, 1000, 2}};

}  // namespace

TEST(CpuMatmul, AllTransposesMatchNaive) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(11);
  for (const GemmShape& s : kShapes)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        HostTensor a = random_tensor(DType::f32, a_storage(s, ta), rng);
        HostTensor b = random_tensor(DType::f32, b_storage(s, tb), rng);
        HostTensor c(DType::f32, {s.m, s.n});
        backend->matmul(c, a, ta, b, tb, 1.0f, 0.0f);
        const auto expected = naive_gemm(s, a.floats(), ta, b.floats(), tb, 1.0f, 0.0f, {});
        EXPECT_LT(scaled_error(c.floats(), expected), 2e-6)
            << s.m << "x" << s.n << "x" << s.k << " ta=" << ta << " tb=" << tb;
      }
}

TEST(CpuMatmul, AlphaBeta) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(12);
  for (const GemmShape& s : {GemmShape{33, 19, 45}, GemmShape{100, 270, 300}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        HostTensor a = random_tensor(DType::f32, a_storage(s, ta), rng);
        HostTensor b = random_tensor(DType::f32, b_storage(s, tb), rng);
        HostTensor c = random_tensor(DType::f32, {s.m, s.n}, rng);
        const std::vector<float> c0 = c.floats();
        backend->matmul(c, a, ta, b, tb, 0.75f, -1.5f);
        const auto expected = naive_gemm(s, a.floats(), ta, b.floats(), tb, 0.75f, -1.5f, c0);
        EXPECT_LT(scaled_error(c.floats(), expected), 2e-6);
      }
}

TEST(CpuMatmul, BetaZeroDoesNotReadC) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(13);
  for (DType c_dtype : {DType::f32, DType::bf16, DType::f16}) {
    const GemmShape s{29, 41, 37};
    HostTensor a = random_tensor(DType::f32, {s.m, s.k}, rng);
    HostTensor b = random_tensor(DType::f32, {s.n, s.k}, rng);
    HostTensor c(c_dtype, {s.m, s.n});
    write_floats(c, std::vector<float>(s.m * s.n, std::numeric_limits<float>::quiet_NaN()));
    backend->matmul(c, a, false, b, true, 2.0f, 0.0f);
    const auto expected = naive_gemm(s, a.floats(), false, b.floats(), true, 2.0f, 0.0f, {});
    for (float v : c.floats()) ASSERT_TRUE(std::isfinite(v)) << dtype_label(c_dtype);
    EXPECT_LT(scaled_error(c.floats(), expected), 2 * unit_roundoff(c_dtype) + 2e-6);
  }
}

TEST(CpuMatmul, ZeroInnerDimensionScalesC) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(14);
  HostTensor a(DType::f32, {5, 0});
  HostTensor b(DType::f32, {0, 3});
  HostTensor c = random_tensor(DType::f32, {5, 3}, rng);
  const std::vector<float> c0 = c.floats();
  backend->matmul(c, a, false, b, false, 1.0f, 0.5f);
  for (size_t i = 0; i < c0.size(); ++i) EXPECT_EQ(c.floats()[i], 0.5f * c0[i]);
}

// Every mix of f32/bf16/f16 for a, b and c: the result is the exact product of the stored
// inputs, accumulated in fp32 and rounded once into c's dtype.
TEST(CpuMatmul, MixedDtypesRoundOnce) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(15);
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  const GemmShape s{37, 45, 70};
  for (DType da : dtypes)
    for (DType db : dtypes)
      for (DType dc : dtypes)
        for (bool ta : {false, true}) {
          const bool tb = !ta;
          HostTensor a = random_tensor(da, a_storage(s, ta), rng);
          HostTensor b = random_tensor(db, b_storage(s, tb), rng);
          HostTensor c = random_tensor(dc, {s.m, s.n}, rng);
          const std::vector<float> c0 = c.floats();
          backend->matmul(c, a, ta, b, tb, 1.0f, 1.0f);
          const auto expected = naive_gemm(s, a.floats(), ta, b.floats(), tb, 1.0f, 1.0f, c0);
          const std::vector<float> got = c.floats();
          double worst = 0.0;  // error in units of the output's rounding at that entry
          for (size_t i = 0; i < got.size(); ++i) {
            const double allowed =
                unit_roundoff(dc) * std::fabs(expected[i]) + 1e-5 * std::sqrt(double(s.k));
            worst = std::max(worst, std::fabs(got[i] - expected[i]) / allowed);
          }
          EXPECT_LE(worst, 1.0) << "a " << dtype_label(da) << " b " << dtype_label(db) << " c "
                                << dtype_label(dc) << " ta=" << ta;
        }
}

// The gradient of sum(op(a) @ op(b) * R) with respect to a is R @ op(b)^T, computed with the
// op itself, against central differences.
TEST(CpuMatmul, GradientMatchesFiniteDifferences) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(16);
  const GemmShape s{9, 7, 13};
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      HostTensor a = random_tensor(DType::f32, a_storage(s, ta), rng);
      HostTensor b = random_tensor(DType::f32, b_storage(s, tb), rng);
      HostTensor c(DType::f32, {s.m, s.n});
      const std::vector<float> weights = random_floats(s.m * s.n, rng);
      HostTensor r = tensor_from(DType::f32, {s.m, s.n}, weights);
      // d op(a) = R @ op(b)^T is [m, k]; stored a is op(a) or its transpose.
      HostTensor grad_a(DType::f32, a_storage(s, ta));
      if (!ta)
        backend->matmul(grad_a, r, false, b, !tb, 1.0f, 0.0f);
      else  // d a = (R @ op(b)^T)^T = op(b) @ R^T, [k, m]
        backend->matmul(grad_a, b, tb, r, true, 1.0f, 0.0f);
      auto objective = [&] {
        backend->matmul(c, a, ta, b, tb, 1.0f, 0.0f);
        return weighted_sum(c, weights);
      };
      expect_gradient_matches("matmul da", grad_a.floats(), a, objective,
                              indices_to_check(a.numel(), 1000, rng));
    }
}

TEST(CpuMatmul, ThroughputReport) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(17);
  struct Case {
    GemmShape s;
    bool ta, tb;
    DType dtype;
    const char* label;
  };
  const Case cases[] = {
      {{512, 512, 512}, false, false, DType::f32, "512x512x512 f32 NN"},
      {{512, 512, 512}, false, true, DType::f32, "512x512x512 f32 NT"},
      {{512, 512, 512}, true, false, DType::f32, "512x512x512 f32 TN"},
      {{512, 512, 512}, false, true, DType::bf16, "512x512x512 bf16 NT"},
      {{4096, 64, 256}, false, true, DType::f32, "4096x64x256 f32 NT (x @ W^T)"},
      {{4096, 256, 64}, false, false, DType::f32, "4096x256x64 f32 NN (dy @ W)"},
      {{64, 256, 4096}, true, false, DType::f32, "64x256x4096 f32 TN (dy^T @ x)"},
      {{4096, 64, 256}, false, true, DType::bf16, "4096x64x256 bf16 NT"},
      {{4096, 352, 128}, false, true, DType::f32, "4096x352x128 f32 NT (tiny MLP)"},
      {{4096, 512, 128}, false, true, DType::f32, "4096x512x128 f32 NT (tiny lm_head)"},
      {{4096, 8, 128}, false, true, DType::f32, "4096x8x128 f32 NT (LoRA A, r 8)"},
      {{4096, 128, 8}, false, true, DType::f32, "4096x128x8 f32 NT (LoRA B, r 8)"},
      {{8, 128, 4096}, true, false, DType::f32, "8x128x4096 f32 TN (LoRA A grad)"},
  };
  for (const Case& test_case : cases) {
    const GemmShape& s = test_case.s;
    HostTensor a = random_tensor(test_case.dtype, a_storage(s, test_case.ta), rng);
    HostTensor b = random_tensor(test_case.dtype, b_storage(s, test_case.tb), rng);
    HostTensor c(test_case.dtype, {s.m, s.n});
    backend->matmul(c, a, test_case.ta, b, test_case.tb, 1.0f, 0.0f);  // warm up
    const double flops = 2.0 * s.m * s.n * s.k;
    const int reps = std::max(1, static_cast<int>(4e8 / flops));
    // Best of several batches: the machine may be shared, and the best batch is the one least
    // disturbed by other work.
    double best = 0.0;
    for (int batch = 0; batch < 5; ++batch) {
      const auto start = std::chrono::steady_clock::now();
      for (int rep = 0; rep < reps; ++rep)
        backend->matmul(c, a, test_case.ta, b, test_case.tb, 1.0f, 0.0f);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      best = std::max(best, flops * reps / seconds / 1e9);
    }
    std::printf("[ matmul   ] %-34s %7.2f GFLOP/s\n", test_case.label, best);
  }
}
