// Every non-attention op of the CUDA backend against the CPU backend, on fresh random inputs at
// several shapes (odd sizes included) and dtypes, with NaN-poisoned outputs.
#include <cmath>
#include <cstring>

#include "gpu_test_util.h"

namespace memtune::gputest {
namespace {

using optest::random_tensor;

constexpr DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};
constexpr int64_t kSizes[] = {1, 1000, 12345};

TEST_F(CudaTest, FillConvertAddScale) {
  for (DType a_type : kFloatTypes)
    for (DType out_type : kFloatTypes)
      for (int64_t n : kSizes) {
        const std::string what = std::string(optest::dtype_label(a_type)) + "->" +
                                 optest::dtype_label(out_type) + " n=" + std::to_string(n);
        HostTensor a = random_tensor(a_type, Shape{n}, rng_, -3, 3);
        HostTensor b = random_tensor(DType::f32, Shape{n}, rng_, -3, 3);
        DeviceTensor a_dev = upload(a), b_dev = upload(b);

        DeviceTensor converted = poisoned(out_type, Shape{n});
        gpu().convert(converted, a_dev);
        HostTensor expected(out_type, Shape{n});
        cpu().convert(expected, a);
        expect_close("convert " + what, converted.floats(), expected.floats(), 1e-7);

        DeviceTensor sum = poisoned(out_type, Shape{n});
        gpu().add(sum, a_dev, b_dev);
        cpu().add(expected, a, b);
        expect_close("add " + what, sum.floats(), expected.floats(), 1e-7);

        gpu().scale(sum, -0.37f);
        cpu().scale(expected, -0.37f);
        expect_close("scale " + what, sum.floats(), expected.floats(), 1e-7);

        gpu().fill(sum, 2.5f);
        for (float v : sum.floats()) ASSERT_EQ(v, 2.5f) << "fill " << what;
      }
}

TEST_F(CudaTest, AddInPlace) {
  HostTensor a = random_tensor(DType::bf16, Shape{777}, rng_);
  HostTensor b = random_tensor(DType::bf16, Shape{777}, rng_);
  DeviceTensor a_dev = upload(a), b_dev = upload(b);
  gpu().add(a_dev, a_dev, b_dev);
  cpu().add(a, a, b);
  expect_close("add aliasing a", a_dev.floats(), a.floats(), 1e-7);
}

TEST_F(CudaTest, FillRandomMatchesCpu) {
  for (DType type : kFloatTypes)
    for (auto distribution : {Backend::Distribution::normal, Backend::Distribution::uniform}) {
      const int64_t n = 100003;
      DeviceTensor dev = poisoned(type, Shape{n});
      HostTensor host(type, Shape{n});
      gpu().fill_random(dev, distribution, 0.25f, 1.5f, 987654321);
      cpu().fill_random(host, distribution, 0.25f, 1.5f, 987654321);
      const std::vector<float> g = dev.floats(), c = host.floats();
      int64_t differing = 0;
      for (int64_t i = 0; i < n; ++i) differing += g[i] != c[i];
      // Device log/cos in double may differ from glibc's in the last bit; after rounding to
      // float that flips at most a handful of values.
      EXPECT_LE(differing, 5) << optest::dtype_label(type);
      expect_close("fill_random", g, c, 1e-6);
    }
}

TEST_F(CudaTest, SumSquares) {
  for (DType type : kFloatTypes)
    for (int64_t n : {int64_t{1}, int64_t{4099}, int64_t{3000001}}) {
      HostTensor x = random_tensor(type, Shape{n}, rng_, -2, 2);
      DeviceTensor x_dev = upload(x);
      HostTensor acc = optest::tensor_from(DType::f32, Shape{1}, {1.5f});
      DeviceTensor acc_dev = upload(acc);
      gpu().sum_squares(acc_dev, x_dev);
      gpu().sum_squares(acc_dev, x_dev);  // accumulates
      cpu().sum_squares(acc, x);
      cpu().sum_squares(acc, x);
      const float g = gpu().read_scalar(acc_dev), c = acc.floats()[0];
      EXPECT_NEAR(g, c, 1e-5 * std::fabs(c)) << optest::dtype_label(type) << " n=" << n;
      // Deterministic: the same call gives the same bits.
      DeviceTensor again = upload(acc);
      gpu().fill(again, 0.0f);
      gpu().sum_squares(again, x_dev);
      const float first = gpu().read_scalar(again);
      gpu().fill(again, 0.0f);
      gpu().sum_squares(again, x_dev);
      EXPECT_EQ(first, gpu().read_scalar(again));
    }
}

struct GemmCase {
  int64_t m, n, k;
};

TEST_F(CudaTest, MatmulAgainstCpu) {
  const GemmCase cases[] = {{1, 1, 1}, {17, 33, 65}, {128, 256, 64}, {300, 129, 1000}, {5, 4096, 16}};
  struct Types {
    DType a, b, c;
  };
  const Types types[] = {{DType::f32, DType::f32, DType::f32},   {DType::bf16, DType::bf16, DType::bf16},
                         {DType::bf16, DType::bf16, DType::f32}, {DType::f16, DType::f16, DType::f16},
                         {DType::f16, DType::f16, DType::f32},   {DType::bf16, DType::f32, DType::f32},
                         {DType::f32, DType::f32, DType::bf16}};
  for (const GemmCase& gc : cases)
    for (const Types& t : types)
      for (int trans = 0; trans < 4; ++trans)
        for (float beta : {0.0f, 0.5f}) {
          const bool ta = trans & 1, tb = trans & 2;
          const std::string what = "m" + std::to_string(gc.m) + " n" + std::to_string(gc.n) +
                                   " k" + std::to_string(gc.k) + " " + optest::dtype_label(t.a) +
                                   "x" + optest::dtype_label(t.b) + "->" +
                                   optest::dtype_label(t.c) + (ta ? " aT" : "") +
                                   (tb ? " bT" : "") + " beta=" + std::to_string(beta);
          HostTensor a = random_tensor(t.a, ta ? Shape{gc.k, gc.m} : Shape{gc.m, gc.k}, rng_);
          HostTensor b = random_tensor(t.b, tb ? Shape{gc.n, gc.k} : Shape{gc.k, gc.n}, rng_);
          HostTensor c = random_tensor(t.c, Shape{gc.m, gc.n}, rng_);
          DeviceTensor a_dev = upload(a), b_dev = upload(b);
          DeviceTensor c_dev = beta == 0.0f ? poisoned(t.c, c.shape) : upload(c);  // beta 0: NaN in c
          gpu().matmul(c_dev, a_dev, ta, b_dev, tb, 0.7f, beta);
          cpu().matmul(c, a, ta, b, tb, 0.7f, beta);
          expect_close("matmul " + what, c_dev.floats(), c.floats(), storage_tolerance(t.c));
        }
}

TEST_F(CudaTest, MatmulOnSlicedRows) {
  // A row slice at an odd offset: pointers far from 256-byte aligned.
  HostTensor a = random_tensor(DType::bf16, Shape{41, 72}, rng_);
  HostTensor b = random_tensor(DType::bf16, Shape{96, 72}, rng_);
  DeviceTensor a_dev = upload(a), b_dev = upload(b);
  DeviceTensor c_dev = poisoned(DType::f32, Shape{40, 96});
  HostTensor c(DType::f32, Shape{40, 96});
  gpu().matmul(c_dev, a_dev.tensor().slice_rows(1, 41), false, b_dev, true, 1.0f, 0.0f);
  cpu().matmul(c, a.tensor().slice_rows(1, 41), false, b, true, 1.0f, 0.0f);
  expect_close("matmul sliced", c_dev.floats(), c.floats(), 2e-5);
}

TEST_F(CudaTest, Embedding) {
  for (DType table_type : kFloatTypes)
    for (DType out_type : {DType::f32, DType::bf16}) {
      const int64_t vocab = 50, hidden = 37, n = 23;
      HostTensor table = random_tensor(table_type, Shape{vocab, hidden}, rng_);
      std::vector<int32_t> id_values(n);
      std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
      for (auto& id : id_values) id = pick(rng_);
      HostTensor ids = optest::i32_tensor(Shape{n}, id_values);
      DeviceTensor table_dev = upload(table), ids_dev = upload(ids);
      DeviceTensor out = poisoned(out_type, Shape{n, hidden});
      HostTensor expected(out_type, Shape{n, hidden});
      gpu().embedding_forward(out, table_dev, ids_dev);
      cpu().embedding_forward(expected, table, ids);
      expect_close("embedding", out.floats(), expected.floats(), 1e-7);
    }
}

TEST_F(CudaTest, RmsNorm) {
  for (DType type : kFloatTypes)
    for (int64_t hidden : {int64_t{64}, int64_t{4099}})
      for (bool accumulate : {false, true}) {
        const int64_t rows = 7;
        const std::string what = std::string(optest::dtype_label(type)) + " h=" +
                                 std::to_string(hidden) + (accumulate ? " acc" : "");
        HostTensor x = random_tensor(type, Shape{rows, hidden}, rng_, -2, 2);
        HostTensor w = random_tensor(type, Shape{hidden}, rng_, 0.5, 1.5);
        HostTensor dy = random_tensor(type, Shape{rows, hidden}, rng_);
        HostTensor dx = random_tensor(type, Shape{rows, hidden}, rng_);
        DeviceTensor x_dev = upload(x), w_dev = upload(w), dy_dev = upload(dy);
        DeviceTensor out = poisoned(type, Shape{rows, hidden}), rstd = poisoned(DType::f32, Shape{rows});
        HostTensor out_ref(type, Shape{rows, hidden}), rstd_ref(DType::f32, Shape{rows});
        gpu().rmsnorm_forward(out, rstd, x_dev, w_dev, 1e-5f);
        cpu().rmsnorm_forward(out_ref, rstd_ref, x, w, 1e-5f);
        expect_close("rmsnorm fwd " + what, out.floats(), out_ref.floats(), storage_tolerance(type));
        expect_close("rmsnorm rstd " + what, rstd.floats(), rstd_ref.floats(), 1e-6);
        DeviceTensor dx_dev = accumulate ? upload(dx) : poisoned(type, Shape{rows, hidden});
        gpu().rmsnorm_backward(dx_dev, dy_dev, x_dev, w_dev, rstd, accumulate);
        cpu().rmsnorm_backward(dx, dy, x, w, rstd_ref, accumulate);
        expect_close("rmsnorm bwd " + what, dx_dev.floats(), dx.floats(), storage_tolerance(type));
      }
}

TEST_F(CudaTest, Rope) {
  for (DType type : kFloatTypes)
    for (int64_t head_dim : {int64_t{64}, int64_t{24}, int64_t{128}}) {
      const int64_t tokens = 19, heads = 3;
      HostTensor x = random_tensor(type, Shape{tokens, heads * head_dim}, rng_);
      std::vector<int32_t> positions(tokens);
      std::uniform_int_distribution<int32_t> pick(0, 8000);
      for (auto& p : positions) p = pick(rng_);
      HostTensor pos = optest::i32_tensor(Shape{tokens}, positions);
      std::vector<float> freq(head_dim / 2);
      for (int64_t j = 0; j < head_dim / 2; ++j)
        freq[j] = 1.0f / std::pow(500000.0f, static_cast<float>(2 * j) / head_dim);
      HostTensor inv = optest::tensor_from(DType::f32, Shape{head_dim / 2}, freq);
      DeviceTensor x_dev = upload(x), pos_dev = upload(pos), inv_dev = upload(inv);
      gpu().rope_forward(x_dev, pos_dev, inv_dev, head_dim);
      cpu().rope_forward(x, pos, inv, head_dim);
      expect_close("rope fwd", x_dev.floats(), x.floats(), storage_tolerance(type));
      gpu().rope_backward(x_dev, pos_dev, inv_dev, head_dim);
      cpu().rope_backward(x, pos, inv, head_dim);
      expect_close("rope bwd", x_dev.floats(), x.floats(), storage_tolerance(type));
    }
}

TEST_F(CudaTest, SwiGlu) {
  for (DType type : kFloatTypes)
    for (int64_t n : kSizes) {
      HostTensor gate = random_tensor(type, Shape{n}, rng_, -4, 4);
      HostTensor up = random_tensor(type, Shape{n}, rng_, -2, 2);
      HostTensor d_out = random_tensor(type, Shape{n}, rng_);
      DeviceTensor gate_dev = upload(gate), up_dev = upload(up), d_out_dev = upload(d_out);
      DeviceTensor out = poisoned(type, Shape{n});
      HostTensor out_ref(type, Shape{n});
      gpu().swiglu_forward(out, gate_dev, up_dev);
      cpu().swiglu_forward(out_ref, gate, up);
      expect_close("swiglu fwd", out.floats(), out_ref.floats(), storage_tolerance(type));
      // In place over gate and up, as the step does it.
      gpu().swiglu_backward(gate_dev, up_dev, d_out_dev, gate_dev, up_dev);
      cpu().swiglu_backward(gate, up, d_out, gate, up);
      expect_close("swiglu d_gate", gate_dev.floats(), gate.floats(), storage_tolerance(type));
      expect_close("swiglu d_up", up_dev.floats(), up.floats(), storage_tolerance(type));
    }
}

TEST_F(CudaTest, CrossEntropy) {
  for (DType type : {DType::f32, DType::bf16})
    for (int64_t vocab : {int64_t{1000}, int64_t{32003}}) {
      const int64_t rows = 9;
      HostTensor logits = random_tensor(type, Shape{rows, vocab}, rng_, -8, 8);
      std::vector<int32_t> target_values(rows);
      std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab) - 1);
      for (auto& t : target_values) t = pick(rng_);
      target_values[2] = -100;
      target_values[7] = -100;
      HostTensor targets = optest::i32_tensor(Shape{rows}, target_values);
      DeviceTensor logits_dev = upload(logits), targets_dev = upload(targets);
      HostTensor loss = optest::tensor_from(DType::f32, Shape{1}, {0.25f});
      DeviceTensor loss_dev = upload(loss);
      gpu().cross_entropy_forward(loss_dev, logits_dev, targets_dev);
      cpu().cross_entropy_forward(loss, logits, targets);
      EXPECT_NEAR(gpu().read_scalar(loss_dev), loss.floats()[0], 1e-5 * loss.floats()[0]);

      DeviceTensor d_logits = poisoned(type, Shape{rows, vocab});
      HostTensor d_ref(type, Shape{rows, vocab});
      gpu().cross_entropy_forward_backward(loss_dev, d_logits, logits_dev, targets_dev, 0.5f);
      cpu().cross_entropy_forward_backward(loss, d_ref, logits, targets, 0.5f);
      EXPECT_NEAR(gpu().read_scalar(loss_dev), loss.floats()[0], 1e-5 * loss.floats()[0]);
      expect_close("cross_entropy d_logits", d_logits.floats(), d_ref.floats(),
                   storage_tolerance(type));
      // d_logits aliasing logits.
      gpu().cross_entropy_forward_backward(loss_dev, logits_dev, logits_dev, targets_dev, 0.5f);
      expect_close("cross_entropy in place", logits_dev.floats(), d_ref.floats(),
                   storage_tolerance(type));
    }
}

TEST_F(CudaTest, DropoutMaskIdenticalToCpu) {
  for (DType type : kFloatTypes)
    for (float p : {0.0f, 0.1f, 0.5f}) {
      const int64_t n = 50001;
      HostTensor x = random_tensor(type, Shape{n}, rng_);
      DeviceTensor x_dev = upload(x);
      DeviceTensor out = poisoned(type, Shape{n});
      HostTensor expected(type, Shape{n});
      gpu().dropout(out, x_dev, p, 0x1234abcdull, 0);
      cpu().dropout(expected, x, p, 0x1234abcdull, 0);
      const std::vector<float> g = out.floats(), c = expected.floats();
      int64_t mask_differs = 0;
      for (int64_t i = 0; i < n; ++i) mask_differs += (g[i] == 0.0f) != (c[i] == 0.0f);
      EXPECT_EQ(mask_differs, 0) << "p=" << p;
      expect_close("dropout", g, c, 1e-7);
    }
}

TEST_F(CudaTest, AdamWMatchesCpuBitForBit) {
  const int64_t n = 10007;
  HostTensor param = random_tensor(DType::f32, Shape{n}, rng_);
  HostTensor grad = random_tensor(DType::f32, Shape{n}, rng_, -0.1, 0.1);
  HostTensor m = random_tensor(DType::f32, Shape{n}, rng_, -0.01, 0.01);
  HostTensor v = random_tensor(DType::f32, Shape{n}, rng_, 0.001, 0.01);  // positive: a second moment
  DeviceTensor param_dev = upload(param), grad_dev = upload(grad), m_dev = upload(m), v_dev = upload(v);
  for (int64_t step = 1; step <= 3; ++step) {
    AdamWParams params;
    params.lr = 2e-4f;
    params.step = step;
    params.grad_scale = 0.75f;
    gpu().adamw_step(param_dev, grad_dev, m_dev, v_dev, params);
    cpu().adamw_step(param, grad, m, v, params);
  }
  const std::vector<float> g = param_dev.floats(), c = param.floats();
  int64_t differing = 0;
  for (int64_t i = 0; i < n; ++i) differing += g[i] != c[i];
  EXPECT_EQ(differing, 0);
  expect_close("adamw param", g, c, 1e-7);
  expect_close("adamw exp_avg", m_dev.floats(), m.floats(), 1e-7);
  expect_close("adamw exp_avg_sq", v_dev.floats(), v.floats(), 1e-7);
}

}  // namespace
}  // namespace memtune::gputest
