// CPU backend: memory, elementwise ops, embedding, RMSNorm, RoPE, SwiGLU, dropout, sum_squares
// and AdamW, each against a naive double implementation, finite differences for the ops that
// have a backward, and bf16/f16 storage against the rounding it should cost.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "memtune/ops/backend.h"
#include "op_test_util.h"

using namespace memtune;
using namespace memtune::optest;

namespace {

const DType kFloatDtypes[] = {DType::f32, DType::bf16, DType::f16};

}  // namespace

// ---- memory -----------------------------------------------------------------------------------

TEST(CpuBackend, ArenaIsAlignedAndCopiesRoundTrip) {
  auto backend = make_cpu_backend();
  EXPECT_EQ(backend->device(), Device::cpu);
  EXPECT_EQ(backend->name(), "cpu");
  void* arena = backend->allocate_arena(1000);
  ASSERT_NE(arena, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(arena) % 64, 0u);
  Tensor t{arena, DType::f32, {10, 25}, Device::cpu};
  std::mt19937_64 rng(1);
  const std::vector<float> values = random_floats(250, rng);
  backend->copy_from_host(t, values.data());
  std::vector<float> back(250);
  backend->synchronize();
  backend->copy_to_host(back.data(), t);
  EXPECT_EQ(std::memcmp(values.data(), back.data(), 1000), 0);
  t.shape = {1};
  t.data = static_cast<char*>(arena) + 996;
  EXPECT_EQ(backend->read_scalar(t), values[249]);
  backend->free_arena(arena);
}

// ---- elementwise --------------------------------------------------------------------------------

TEST(CpuElementwise, FillConvertRoundOnce) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(2);
  for (DType dst_dtype : kFloatDtypes) {
    HostTensor filled(dst_dtype, {3, 1001});
    backend->fill(filled, 0.1f);
    for (float v : filled.floats()) ASSERT_EQ(v, round_to_dtype(0.1f, dst_dtype));
    for (DType src_dtype : kFloatDtypes) {
      HostTensor src = random_tensor(src_dtype, {70001}, rng, -100.0f, 100.0f);
      HostTensor dst(dst_dtype, {70001});
      backend->convert(dst, src);
      const std::vector<float> in = src.floats(), out = dst.floats();
      for (size_t i = 0; i < in.size(); ++i)
        ASSERT_EQ(out[i], round_to_dtype(in[i], dst_dtype))
            << dtype_label(src_dtype) << " -> " << dtype_label(dst_dtype);
    }
  }
}

TEST(CpuElementwise, AddAndScale) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(3);
  for (DType dtype : kFloatDtypes) {
    HostTensor a = random_tensor(dtype, {5, 60001}, rng);
    HostTensor b = random_tensor(DType::f32, {5, 60001}, rng);
    HostTensor sum(DType::f32, {5, 60001});
    backend->add(sum, a, b);
    const std::vector<float> av = a.floats(), bv = b.floats(), sv = sum.floats();
    for (size_t i = 0; i < av.size(); ++i) ASSERT_EQ(sv[i], av[i] + bv[i]);
    // In place (dst aliases a), rounded once into a's dtype.
    backend->add(a, a, b);
    const std::vector<float> in_place = a.floats();
    for (size_t i = 0; i < av.size(); ++i)
      ASSERT_EQ(in_place[i], round_to_dtype(av[i] + bv[i], dtype));
    backend->scale(a, -0.37f);
    const std::vector<float> scaled = a.floats();
    for (size_t i = 0; i < av.size(); ++i)
      ASSERT_EQ(scaled[i], round_to_dtype(in_place[i] * -0.37f, dtype));
  }
}

TEST(CpuElementwise, SumSquaresAccumulates) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(4);
  for (DType dtype : kFloatDtypes) {
    HostTensor x = random_tensor(dtype, {300007}, rng, -3.0f, 3.0f);
    HostTensor acc = tensor_from(DType::f32, {1}, {2.5f});
    backend->sum_squares(acc, x);
    double expected = 2.5;
    for (float v : x.floats()) expected += static_cast<double>(v) * v;
    EXPECT_NEAR(acc.floats()[0], expected, expected * 1e-6) << dtype_label(dtype);
  }
}

// ---- embedding ----------------------------------------------------------------------------------

TEST(CpuEmbedding, GathersRowsInAnyDtype) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(5);
  const int64_t vocab = 37, hidden = 19;
  const std::vector<int32_t> id_values = {0, 36, 5, 5, 17, 1, 36};
  HostTensor ids = i32_tensor({7}, id_values);
  for (DType table_dtype : kFloatDtypes)
    for (DType out_dtype : kFloatDtypes) {
      HostTensor table = random_tensor(table_dtype, {vocab, hidden}, rng);
      HostTensor out(out_dtype, {7, hidden});
      backend->embedding_forward(out, table, ids);
      const std::vector<float> t = table.floats(), o = out.floats();
      for (int64_t i = 0; i < 7; ++i)
        for (int64_t j = 0; j < hidden; ++j)
          ASSERT_EQ(o[i * hidden + j], round_to_dtype(t[id_values[i] * hidden + j], out_dtype));
    }
}

TEST(CpuEmbeddingDeathTest, IdOutsideVocabIsInternalError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // OpenMP threads may exist
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(6);
  HostTensor table = random_tensor(DType::f32, {4, 3}, rng);
  HostTensor ids = i32_tensor({2}, {1, 4});
  HostTensor out(DType::f32, {2, 3});
  EXPECT_DEATH(backend->embedding_forward(out, table, ids), "outside");
}

// ---- RMSNorm ------------------------------------------------------------------------------------

namespace {

struct NormShape {
  int64_t rows, hidden;
};
const NormShape kNormShapes[] = {{1, 8}, {5, 17}, {3, 100}, {2, 4096}, {33, 7}};

}  // namespace

TEST(CpuRmsNorm, ForwardMatchesNaive) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(7);
  const float eps = 1e-5f;
  for (const NormShape& s : kNormShapes) {
    HostTensor x = random_tensor(DType::f32, {s.rows, s.hidden}, rng, -2.0f, 2.0f);
    HostTensor weight = random_tensor(DType::f32, {s.hidden}, rng, 0.5f, 1.5f);
    HostTensor out(DType::f32, {s.rows, s.hidden});
    HostTensor rstd(DType::f32, {s.rows});
    backend->rmsnorm_forward(out, rstd, x, weight, eps);
    const std::vector<float> xv = x.floats(), wv = weight.floats();
    std::vector<double> expected(xv.size()), expected_rstd(s.rows);
    for (int64_t i = 0; i < s.rows; ++i) {
      double mean_square = 0.0;
      for (int64_t j = 0; j < s.hidden; ++j) mean_square += double(xv[i * s.hidden + j]) * xv[i * s.hidden + j];
      mean_square /= s.hidden;
      expected_rstd[i] = 1.0 / std::sqrt(mean_square + eps);
      for (int64_t j = 0; j < s.hidden; ++j)
        expected[i * s.hidden + j] = wv[j] * (xv[i * s.hidden + j] * expected_rstd[i]);
    }
    EXPECT_LT(max_rel_error(rstd.floats(), expected_rstd), 1e-6) << s.rows << "x" << s.hidden;
    EXPECT_LT(scaled_error(out.floats(), expected), 2e-6) << s.rows << "x" << s.hidden;
  }
}

// HF's two roundings: (x * rstd) to x's dtype, then weight * that to out's dtype.
TEST(CpuRmsNorm, LowPrecisionRoundsLikeHf) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(8);
  for (DType x_dtype : {DType::bf16, DType::f16})
    for (DType weight_dtype : {x_dtype, DType::f32})
      for (DType out_dtype : {x_dtype, DType::f32}) {
        const NormShape s{9, 301};
        HostTensor x = random_tensor(x_dtype, {s.rows, s.hidden}, rng, -2.0f, 2.0f);
        HostTensor weight = random_tensor(weight_dtype, {s.hidden}, rng, 0.5f, 1.5f);
        HostTensor out(out_dtype, {s.rows, s.hidden});
        HostTensor rstd(DType::f32, {s.rows});
        backend->rmsnorm_forward(out, rstd, x, weight, 1e-6f);
        const std::vector<float> xv = x.floats(), wv = weight.floats(), r = rstd.floats();
        const std::vector<float> got = out.floats();
        // Bit-exact against the documented formula, given the op's own fp32 rstd.
        for (int64_t i = 0; i < s.rows; ++i)
          for (int64_t j = 0; j < s.hidden; ++j) {
            const float normalized = round_to_dtype(xv[i * s.hidden + j] * r[i], x_dtype);
            ASSERT_EQ(got[i * s.hidden + j], round_to_dtype(wv[j] * normalized, out_dtype));
          }
        // And within the two roundings of the unrounded value.
        HostTensor out_f32(DType::f32, {s.rows, s.hidden});
        backend->rmsnorm_forward(out_f32, rstd, converted(x, DType::f32),
                                 converted(weight, DType::f32), 1e-6f);
        const std::vector<float> exact = out_f32.floats();
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_LE(std::fabs(got[i] - exact[i]),
                    (unit_roundoff(x_dtype) + unit_roundoff(out_dtype)) * 1.01 *
                        std::fabs(exact[i]));
      }
}

TEST(CpuRmsNorm, BackwardMatchesFiniteDifferences) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(9);
  for (const NormShape& s : {NormShape{4, 13}, NormShape{2, 64}, NormShape{1, 1}}) {
    HostTensor x = random_tensor(DType::f32, {s.rows, s.hidden}, rng, -2.0f, 2.0f);
    HostTensor weight = random_tensor(DType::f32, {s.hidden}, rng, 0.5f, 1.5f);
    HostTensor out(DType::f32, {s.rows, s.hidden});
    HostTensor rstd(DType::f32, {s.rows});
    const std::vector<float> weights = random_floats(x.numel(), rng);
    HostTensor dy = tensor_from(DType::f32, x.shape, weights);
    backend->rmsnorm_forward(out, rstd, x, weight, 1e-5f);
    HostTensor dx(DType::f32, x.shape);
    backend->rmsnorm_backward(dx, dy, x, weight, rstd, false);
    auto objective = [&] {
      backend->rmsnorm_forward(out, rstd, x, weight, 1e-5f);
      return weighted_sum(out, weights);
    };
    if (s.hidden == 1) {
      // One feature: y = w * sign(x) (up to eps), so the gradient is ~0; check it is tiny.
      EXPECT_LT(max_abs(dx.floats()), 1e-2);
      continue;
    }
    expect_gradient_matches("rmsnorm dx", dx.floats(), x, objective,
                            indices_to_check(x.numel(), 400, rng));

    // accumulate: dx += the same gradient.
    backend->rmsnorm_forward(out, rstd, x, weight, 1e-5f);
    HostTensor accumulated = random_tensor(DType::f32, x.shape, rng);
    const std::vector<float> before = accumulated.floats(), grad = dx.floats();
    backend->rmsnorm_backward(accumulated, dy, x, weight, rstd, true);
    const std::vector<float> after = accumulated.floats();
    for (size_t i = 0; i < after.size(); ++i) ASSERT_EQ(after[i], before[i] + grad[i]);
  }
}

TEST(CpuRmsNorm, BackwardLowPrecisionAndAliasing) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(10);
  const NormShape s{6, 130};
  for (DType dtype : {DType::bf16, DType::f16}) {
    HostTensor x = random_tensor(dtype, {s.rows, s.hidden}, rng, -2.0f, 2.0f);
    HostTensor weight = random_tensor(dtype, {s.hidden}, rng, 0.5f, 1.5f);
    HostTensor dy = random_tensor(dtype, {s.rows, s.hidden}, rng);
    HostTensor out(dtype, x.shape), rstd(DType::f32, {s.rows});
    backend->rmsnorm_forward(out, rstd, x, weight, 1e-5f);
    HostTensor dx(dtype, x.shape);
    backend->rmsnorm_backward(dx, dy, x, weight, rstd, false);
    HostTensor dx_f32(DType::f32, x.shape);
    backend->rmsnorm_backward(dx_f32, converted(dy, DType::f32), converted(x, DType::f32),
                              converted(weight, DType::f32), rstd, false);
    const std::vector<float> exact = dx_f32.floats(), got = dx.floats();
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], round_to_dtype(exact[i], dtype));  // one rounding at the output
    // dx aliasing dy gives the same result.
    backend->rmsnorm_backward(dy, dy, x, weight, rstd, false);
    EXPECT_EQ(dy.storage, dx.storage);
  }
}

// ---- RoPE ---------------------------------------------------------------------------------------

namespace {

struct RopeShape {
  int64_t tokens, heads, head_dim;
};
const RopeShape kRopeShapes[] = {{1, 1, 8}, {17, 3, 16}, {9, 2, 24}, {40, 4, 8}};

std::vector<float> llama_inv_freq(int64_t head_dim, double theta = 500000.0) {
  std::vector<float> inv(head_dim / 2);
  for (int64_t j = 0; j < head_dim / 2; ++j)
    inv[j] = static_cast<float>(1.0 / std::pow(theta, double(2 * j) / head_dim));
  return inv;
}

std::vector<int32_t> random_positions(int64_t n, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> dist(0, 9000);
  std::vector<int32_t> positions(n);
  for (auto& p : positions) p = dist(rng);
  if (n > 0) positions[0] = 0;
  return positions;
}

// The rotation in double, with the fp32 angle HF uses.
std::vector<double> naive_rope(const std::vector<float>& x, const std::vector<int32_t>& positions,
                               const std::vector<float>& inv_freq, const RopeShape& s,
                               bool inverse) {
  std::vector<double> out(x.size());
  const int64_t half = s.head_dim / 2, width = s.heads * s.head_dim;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t j = 0; j < half; ++j) {
        const float angle = static_cast<float>(positions[t]) * inv_freq[j];
        const double c = std::cos(double(angle)), sn = (inverse ? -1 : 1) * std::sin(double(angle));
        const int64_t i1 = t * width + h * s.head_dim + j, i2 = i1 + half;
        out[i1] = x[i1] * c - x[i2] * sn;
        out[i2] = x[i2] * c + x[i1] * sn;
      }
  return out;
}

}  // namespace

TEST(CpuRope, ForwardAndBackwardMatchNaive) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(11);
  for (const RopeShape& s : kRopeShapes) {
    const std::vector<int32_t> pos = random_positions(s.tokens, rng);
    HostTensor positions = i32_tensor({s.tokens}, pos);
    const std::vector<float> inv = llama_inv_freq(s.head_dim);
    HostTensor inv_freq = tensor_from(DType::f32, {s.head_dim / 2}, inv);
    for (bool inverse : {false, true}) {
      HostTensor x = random_tensor(DType::f32, {s.tokens, s.heads * s.head_dim}, rng);
      const std::vector<float> before = x.floats();
      if (inverse)
        backend->rope_backward(x, positions, inv_freq, s.head_dim);
      else
        backend->rope_forward(x, positions, inv_freq, s.head_dim);
      EXPECT_LT(scaled_error(x.floats(), naive_rope(before, pos, inv, s, inverse)), 1e-6)
          << s.tokens << "x" << s.heads << "x" << s.head_dim;
    }
  }
}

TEST(CpuRope, BackwardIsTransposeOfForward) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(12);
  for (const RopeShape& s : kRopeShapes) {
    HostTensor positions = i32_tensor({s.tokens}, random_positions(s.tokens, rng));
    HostTensor inv_freq = tensor_from(DType::f32, {s.head_dim / 2}, llama_inv_freq(s.head_dim));
    const Shape shape{s.tokens, s.heads * s.head_dim};
    HostTensor x = random_tensor(DType::f32, shape, rng);
    // Inverse: backward(forward(x)) == x.
    HostTensor round_trip = x;
    backend->rope_forward(round_trip, positions, inv_freq, s.head_dim);
    backend->rope_backward(round_trip, positions, inv_freq, s.head_dim);
    EXPECT_LT(scaled_error(round_trip.floats(), x.floats()), 1e-6);
    // Gradient: d/dx sum(rope(x) * R) = rope_backward(R).
    const std::vector<float> weights = random_floats(x.numel(), rng);
    HostTensor grad = tensor_from(DType::f32, shape, weights);
    backend->rope_backward(grad, positions, inv_freq, s.head_dim);
    HostTensor work(DType::f32, shape);
    auto objective = [&] {
      work.storage = x.storage;
      backend->rope_forward(work, positions, inv_freq, s.head_dim);
      return weighted_sum(work, weights);
    };
    expect_gradient_matches("rope dx", grad.floats(), x, objective,
                            indices_to_check(x.numel(), 500, rng));
  }
}

TEST(CpuRope, LowPrecisionRoundsOnceAndFloatPositionsAgree) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(13);
  const RopeShape s{23, 3, 24};
  const std::vector<int32_t> pos = random_positions(s.tokens, rng);
  HostTensor positions = i32_tensor({s.tokens}, pos);
  std::vector<float> pos_f(pos.begin(), pos.end());
  HostTensor positions_f32 = tensor_from(DType::f32, {s.tokens}, pos_f);
  HostTensor inv_freq = tensor_from(DType::f32, {s.head_dim / 2}, llama_inv_freq(s.head_dim));
  for (DType dtype : {DType::bf16, DType::f16}) {
    HostTensor x = random_tensor(dtype, {s.tokens, s.heads * s.head_dim}, rng);
    HostTensor x_f32 = converted(x, DType::f32);
    backend->rope_forward(x, positions, inv_freq, s.head_dim);
    backend->rope_forward(x_f32, positions_f32, inv_freq, s.head_dim);
    const std::vector<float> got = x.floats(), exact = x_f32.floats();
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], round_to_dtype(exact[i], dtype));
  }
}

// ---- SwiGLU -------------------------------------------------------------------------------------

TEST(CpuSwiglu, ForwardMatchesNaiveAndRoundsOnce) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(14);
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{5000}, int64_t{70001}}) {
    HostTensor gate = random_tensor(DType::f32, {n}, rng, -6.0f, 6.0f);
    HostTensor up = random_tensor(DType::f32, {n}, rng, -2.0f, 2.0f);
    HostTensor out(DType::f32, {n});
    backend->swiglu_forward(out, gate, up);
    const std::vector<float> g = gate.floats(), u = up.floats();
    std::vector<double> expected(n);
    for (int64_t i = 0; i < n; ++i) expected[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
    EXPECT_LT(max_rel_error(out.floats(), expected, 1e-3), 1e-5) << n;
    for (DType dtype : {DType::bf16, DType::f16}) {
      HostTensor out_low(dtype, {n});
      backend->swiglu_forward(out_low, gate, up);
      const std::vector<float> got = out_low.floats(), exact = out.floats();
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], round_to_dtype(exact[i], dtype));
    }
  }
}

TEST(CpuSwiglu, BackwardMatchesFiniteDifferencesAndAliases) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(15);
  const int64_t n = 301;
  HostTensor gate = random_tensor(DType::f32, {n}, rng, -5.0f, 5.0f);
  HostTensor up = random_tensor(DType::f32, {n}, rng, -2.0f, 2.0f);
  HostTensor out(DType::f32, {n});
  const std::vector<float> weights = random_floats(n, rng);
  HostTensor d_out = tensor_from(DType::f32, {n}, weights);
  HostTensor d_gate(DType::f32, {n}), d_up(DType::f32, {n});
  backend->swiglu_backward(d_gate, d_up, d_out, gate, up);
  auto objective = [&] {
    backend->swiglu_forward(out, gate, up);
    return weighted_sum(out, weights);
  };
  expect_gradient_matches("swiglu d_gate", d_gate.floats(), gate, objective,
                          indices_to_check(n, n, rng));
  expect_gradient_matches("swiglu d_up", d_up.floats(), up, objective,
                          indices_to_check(n, n, rng));
  // In place: d_gate over gate, d_up over up.
  HostTensor gate_in_place = gate, up_in_place = up;
  backend->swiglu_backward(gate_in_place, up_in_place, d_out, gate_in_place, up_in_place);
  EXPECT_EQ(gate_in_place.storage, d_gate.storage);
  EXPECT_EQ(up_in_place.storage, d_up.storage);
  // bf16 storage: each output is the fp32 result rounded once.
  HostTensor gate_bf16 = converted(gate, DType::bf16), up_bf16 = converted(up, DType::bf16);
  HostTensor d_out_bf16 = converted(d_out, DType::bf16);
  HostTensor dg_bf16(DType::bf16, {n}), du_bf16(DType::bf16, {n});
  backend->swiglu_backward(dg_bf16, du_bf16, d_out_bf16, gate_bf16, up_bf16);
  HostTensor dg_ref(DType::f32, {n}), du_ref(DType::f32, {n});
  backend->swiglu_backward(dg_ref, du_ref, converted(d_out_bf16, DType::f32),
                           converted(gate_bf16, DType::f32), converted(up_bf16, DType::f32));
  EXPECT_EQ(dg_bf16.floats(), rounded_to(dg_ref.floats(), DType::bf16));
  EXPECT_EQ(du_bf16.floats(), rounded_to(du_ref.floats(), DType::bf16));
}

// The LoRA B terms of gate and up, then SwiGLU (Backend::swiglu_lora_forward), against sums in
// double: the sums written back into gate and up, rounded once as a beta-1 GEMM rounds them.
TEST(CpuSwiglu, LoraForwardAddsBothLowRankTermsThenActivates) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(21);
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (auto [rows, cols, r] : {std::array<int64_t, 3>{1, 1, 1}, std::array<int64_t, 3>{7, 33, 4},
                                 std::array<int64_t, 3>{65, 130, 16}}) {
      HostTensor gate = random_tensor(dtype, {rows, cols}, rng, -3.0f, 3.0f);
      HostTensor up = random_tensor(dtype, {rows, cols}, rng, -2.0f, 2.0f);
      HostTensor ut_gate = random_tensor(dtype, {r, rows}, rng), ut_up = random_tensor(dtype, {r, rows}, rng);
      HostTensor b_gate = random_tensor(dtype, {cols, r}, rng), b_up = random_tensor(dtype, {cols, r}, rng);
      const float scale = 0.5f;
      const std::vector<float> g0 = gate.floats(), u0 = up.floats(), ug = ut_gate.floats(), uu = ut_up.floats(),
                               bg = b_gate.floats(), bu = b_up.floats();
      HostTensor out(dtype, {rows, cols});
      backend->swiglu_lora_forward(out, gate, up, ut_gate, b_gate, ut_up, b_up, scale);
      std::vector<double> want_gate(rows * cols), want_up(rows * cols), want_out(rows * cols);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          double tg = 0, tu = 0;
          for (int64_t k = 0; k < r; ++k) {
            tg += double(ug[k * rows + i]) * bg[j * r + k];
            tu += double(uu[k * rows + i]) * bu[j * r + k];
          }
          const int64_t e = i * cols + j;
          want_gate[e] = g0[e] + scale * tg;
          want_up[e] = u0[e] + scale * tu;
          // SwiGLU reads the sums as stored (rounded to the dtype).
          const double g = round_to_dtype(static_cast<float>(want_gate[e]), dtype);
          const double u = round_to_dtype(static_cast<float>(want_up[e]), dtype);
          want_out[e] = g / (1.0 + std::exp(-g)) * u;
        }
      // One rounding of an fp32 sum: within an ulp of the dtype (a double sum can round the other
      // way at a tie), or in f32 the sum's own error (16 terms of ~1 against the 1e-2 floor);
      // SwiGLU's output moves by up to ~4 times its input's relative error where silu is steep
      // (g near -3), then is rounded once more.
      const double tol = dtype == DType::f32 ? 1e-4 : 8e-3;
      const std::string what = std::string(dtype_label(dtype)) + " " + std::to_string(rows) + "x" + std::to_string(cols);
      EXPECT_LT(max_rel_error(gate.floats(), want_gate, 1e-2), tol) << what;
      EXPECT_LT(max_rel_error(up.floats(), want_up, 1e-2), tol) << what;
      EXPECT_LT(max_rel_error(out.floats(), want_out, 1e-2), dtype == DType::f32 ? 4e-4 : 2.5e-2) << what;
    }
  }
}

// A projection's LoRA B term, then the residual (Backend::lora_residual_forward), against sums in
// double, each of the two rounded once as the two ops round.
TEST(CpuLinear, LoraResidualForwardAddsTheLowRankTermThenTheResidual) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(22);
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (auto [rows, cols, r] : {std::array<int64_t, 3>{1, 1, 1}, std::array<int64_t, 3>{9, 70, 8},
                                 std::array<int64_t, 3>{33, 129, 16}}) {
      HostTensor y = random_tensor(dtype, {rows, cols}, rng, -3.0f, 3.0f);
      HostTensor residual = random_tensor(dtype, {rows, cols}, rng, -3.0f, 3.0f);
      HostTensor u = random_tensor(dtype, {rows, r}, rng), b = random_tensor(dtype, {cols, r}, rng);
      const std::vector<float> y0 = y.floats(), res = residual.floats(), uf = u.floats(), bf = b.floats();
      const float scale = 2.0f;
      backend->lora_residual_forward(y, u, b, scale, residual);
      std::vector<double> want(rows * cols);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          double t = 0;
          for (int64_t k = 0; k < r; ++k) t += double(uf[i * r + k]) * bf[j * r + k];
          const int64_t e = i * cols + j;
          const double with_lora = round_to_dtype(static_cast<float>(y0[e] + scale * t), dtype);
          want[e] = with_lora + res[e];
        }
      // Against the largest value (a sum may cancel to near zero): two roundings, an ulp each.
      const double tol = dtype == DType::f32 ? 1e-5 : 1e-2;
      EXPECT_LT(scaled_error(y.floats(), want), tol)
          << dtype_label(dtype) << " " << rows << "x" << cols << " r" << r;
    }
  }
}

// ---- dropout ------------------------------------------------------------------------------------

TEST(CpuDropout, MaskIsDeterministicAndKeepsOneMinusP) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(16);
  const int64_t n = 300007;  // above the parallel threshold
  HostTensor x = random_tensor(DType::f32, {n}, rng);
  const std::vector<float> xv = x.floats();
  for (float p : {0.05f, 0.1f, 0.5f}) {
    HostTensor first(DType::f32, {n}), second(DType::f32, {n}), other_seed(DType::f32, {n});
    backend->dropout(first, x, p, 1234, 0);
    backend->dropout(second, x, p, 1234, 0);
    backend->dropout(other_seed, x, p, 1235, 0);
    EXPECT_EQ(first.storage, second.storage);
    EXPECT_NE(first.storage, other_seed.storage);
    const std::vector<float> out = first.floats();
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool keep = dropout_keep(1234, static_cast<uint64_t>(i), p);
      ASSERT_EQ(out[i], keep ? xv[i] / (1.0f - p) : 0.0f);
      kept += keep;
    }
    EXPECT_NEAR(double(kept) / n, 1.0 - p, 0.005) << p;
  }
}

TEST(CpuDropout, ZeroPIsIdentityAndGradientUsesSameMask) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(17);
  for (DType dtype : kFloatDtypes) {
    HostTensor x = random_tensor(dtype, {3, 777}, rng);
    HostTensor out(dtype, {3, 777});
    backend->dropout(out, x, 0.0f, 99, 0);
    EXPECT_EQ(out.storage, x.storage);
  }
  // d/dx sum(dropout(x) * R) = dropout(R) with the same seed.
  HostTensor x = random_tensor(DType::f32, {257}, rng);
  const std::vector<float> weights = random_floats(257, rng);
  HostTensor grad(DType::f32, {257}), out(DType::f32, {257});
  backend->dropout(grad, tensor_from(DType::f32, {257}, weights), 0.3f, 7, 0);
  auto objective = [&] {
    backend->dropout(out, x, 0.3f, 7, 0);
    return weighted_sum(out, weights);
  };
  expect_gradient_matches("dropout dx", grad.floats(), x, objective, indices_to_check(257, 257, rng));
}

// ---- AdamW --------------------------------------------------------------------------------------

// Three steps of torch.optim.AdamW written out in double, against the op.
TEST(CpuAdamW, MatchesHandComputedThreeSteps) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(18);
  const int64_t n = 1001;
  HostTensor param = random_tensor(DType::f32, {n}, rng);
  HostTensor m(DType::f32, {n}), v(DType::f32, {n});
  backend->fill(m, 0.0f);
  backend->fill(v, 0.0f);
  std::vector<double> p_ref = to_double(param.floats()), m_ref(n, 0.0), v_ref(n, 0.0);
  AdamWParams params;
  params.lr = 1e-2f;
  params.beta1 = 0.9f;
  params.beta2 = 0.99f;
  params.eps = 1e-6f;
  params.weight_decay = 0.1f;
  for (int64_t step = 1; step <= 3; ++step) {
    HostTensor grad = random_tensor(DType::f32, {n}, rng, -2.0f, 2.0f);
    params.step = step;
    params.grad_scale = step == 2 ? 0.25f : 1.0f;
    backend->adamw_step(param, grad, m, v, params);
    const std::vector<float> g = grad.floats();
    const double lr = params.lr, b1 = params.beta1, b2 = params.beta2;
    for (int64_t i = 0; i < n; ++i) {
      const double gi = double(g[i]) * params.grad_scale;
      p_ref[i] *= 1.0 - lr * params.weight_decay;
      m_ref[i] = b1 * m_ref[i] + (1.0 - b1) * gi;
      v_ref[i] = b2 * v_ref[i] + (1.0 - b2) * gi * gi;
      const double denom = std::sqrt(v_ref[i]) / std::sqrt(1.0 - std::pow(b2, step)) + params.eps;
      p_ref[i] -= lr / (1.0 - std::pow(b1, step)) * m_ref[i] / denom;
    }
    EXPECT_LT(max_rel_error(param.floats(), p_ref, 1e-3), 2e-6) << "step " << step;
    // The moments can cancel to near zero: their error is measured against their scale.
    EXPECT_LT(scaled_error(m.floats(), m_ref), 2e-6) << "step " << step;
    EXPECT_LT(scaled_error(v.floats(), v_ref), 2e-6) << "step " << step;
  }
}

// ---- argument checks ----------------------------------------------------------------------------

TEST(CpuBackendDeathTest, ShapeMismatchIsInternalError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto backend = make_cpu_backend();
  HostTensor a(DType::f32, {4, 5}), b(DType::f32, {6, 3}), c(DType::f32, {4, 3});
  EXPECT_DEATH(backend->matmul(c, a, false, b, false, 1.0f, 0.0f), "matmul shapes");
  HostTensor x(DType::f32, {2, 8}), weight(DType::f32, {7}), rstd(DType::f32, {2});
  EXPECT_DEATH(backend->rmsnorm_forward(x, rstd, x, weight, 1e-5f), "weight");
  HostTensor gate(DType::f32, {9}), up(DType::f32, {8});
  EXPECT_DEATH(backend->swiglu_forward(up, gate, up), "swiglu_forward");
}

// ---- determinism --------------------------------------------------------------------------------

#ifdef _OPENMP
// The split of work over threads never changes the order of a sum: 1 and 3 threads give the
// same bits (matmul with shrunk tiles, the chunked sum_squares, row-parallel ops).
TEST(CpuBackend, ResultsDoNotDependOnThreadCount) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(19);
  HostTensor a = random_tensor(DType::bf16, {300, 700}, rng);
  HostTensor b = random_tensor(DType::f32, {50, 700}, rng);
  HostTensor x = random_tensor(DType::f32, {3, 200001}, rng);
  HostTensor weight = random_tensor(DType::f32, {200001}, rng);
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    HostTensor c(DType::f32, {300, 50}), acc = tensor_from(DType::f32, {1}, {0.0f});
    HostTensor normed(DType::bf16, x.shape), rstd(DType::f32, {3});
    backend->matmul(c, a, false, b, true, 1.0f, 0.0f);
    backend->sum_squares(acc, x);
    backend->rmsnorm_forward(normed, rstd, x, weight, 1e-5f);
    omp_set_num_threads(saved);
    std::vector<uint8_t> bits = c.storage;
    bits.insert(bits.end(), acc.storage.begin(), acc.storage.end());
    bits.insert(bits.end(), normed.storage.begin(), normed.storage.end());
    return bits;
  };
  EXPECT_EQ(run(1), run(3));
}
#endif
