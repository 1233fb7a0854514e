// Every non-attention op of the CUDA backend against the CPU backend, on fresh random inputs at
// several shapes (odd sizes included) and dtypes, with NaN-poisoned outputs.
//
// The bandwidth-bound ops (fill, convert, add, scale, embedding, rmsnorm, rope, swiglu) have a
// typed kernel with 16-byte accesses and a scalar tail, and a generic run-time-dtype kernel
// (cuda_ops.h). Their tests run each case on both paths (set_generic_kernels_only), at sizes
// that leave a tail (odd and not multiples of 8) and at 16-byte-misaligned views, so that the
// vector body, the scalar tail / scalar path and the generic path all run; and they compare
// element by element, since a relative norm error over the whole tensor would hide a wrong tail.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>

#include "gpu_test_util.h"
#include "gpu_timing.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::gputest {
namespace {

using optest::random_tensor;

constexpr DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};
// Sizes for the elementwise kernels: below, at and around multiples of the 8-element pack.
constexpr int64_t kElementwiseSizes[] = {1, 7, 8, 13, 1000, 4095, 4097, 12345};

// Runs the CUDA ops on their generic kernels while alive (restored even when a test fails).
class GenericKernelsOnly {
 public:
  explicit GenericKernelsOnly(bool generic) : previous_(cuda::generic_kernels_only()) {
    cuda::set_generic_kernels_only(generic);
  }
  ~GenericKernelsOnly() { cuda::set_generic_kernels_only(previous_); }
  GenericKernelsOnly(const GenericKernelsOnly&) = delete;
  GenericKernelsOnly& operator=(const GenericKernelsOnly&) = delete;

 private:
  bool previous_;
};

constexpr bool kPaths[] = {false, true};
const char* path_label(bool generic) { return generic ? " [generic]" : " [typed]"; }

// One rounding to dtype, relative.
double unit_roundoff(DType dtype) {
  return dtype == DType::bf16 ? 0x1p-8 : dtype == DType::f16 ? 0x1p-11 : 0x1p-24;
}
DType coarser(DType a, DType b) { return unit_roundoff(a) >= unit_roundoff(b) ? a : b; }

// Element by element: |gpu - reference| <= ulps * u * (|reference| + floor * max |reference|),
// u the unit roundoff of dtype (at least 2^-17 ~ 7.6e-6, for fp32 sums over up to 16k terms taken
// in another order, and expf / sincosf against glibc's within an ulp or two). floor
// lets a value that cancels to near zero (rope, the norm backward, swiglu's d_silu) differ by
// the error of its terms, which are of the tensor's scale; exact ops pass 0. A wrong element
// (an unwritten tail, a wrong index) is off by the tensor's scale itself.
void expect_each_close(const std::string& what, const std::vector<float>& gpu,
                       const std::vector<float>& reference, DType dtype, double ulps = 4.0,
                       double floor = 1.0) {
  ASSERT_EQ(gpu.size(), reference.size()) << what;
  const double u = std::max(unit_roundoff(dtype), 0x1p-17);
  const double scale = optest::max_abs(reference);
  int64_t bad = 0, first_bad = -1;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double r = reference[i], g = gpu[i];
    const bool ok = std::isfinite(g) && std::fabs(g - r) <= ulps * u * (std::fabs(r) + floor * scale);
    if (!ok && bad++ == 0) first_bad = static_cast<int64_t>(i);
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << gpu.size() << " elements differ, first at "
                    << first_bad << " (gpu " << (first_bad >= 0 ? gpu[first_bad] : 0.0f)
                    << ", cpu " << (first_bad >= 0 ? reference[first_bad] : 0.0f) << ")";
}

// A view of `shape` starting element_offset elements into base (to make misaligned pointers).
Tensor view_at(const Tensor& base, int64_t element_offset, Shape shape) {
  Tensor t = base;
  t.data = static_cast<char*>(base.data) + element_offset * static_cast<int64_t>(dtype_size(base.dtype));
  t.shape = shape;
  EXPECT_LE(element_offset + shape.numel(), base.numel());
  return t;
}

std::vector<float> download_view(Backend& backend, const Tensor& device_view) {
  HostTensor host(device_view.dtype, device_view.shape);
  backend.copy_to_host(host.storage.data(), device_view);
  return host.floats();
}

std::vector<float> host_view_floats(const Tensor& host_view) {
  HostTensor copy(host_view.dtype, host_view.shape);
  std::memcpy(copy.storage.data(), host_view.data, host_view.nbytes());
  return copy.floats();
}

TEST_F(CudaTest, FillConvertAddScale) {
  for (bool generic : kPaths) {
    GenericKernelsOnly path(generic);
    for (DType a_type : kFloatTypes)
      for (DType out_type : kFloatTypes)
        for (int64_t n : kElementwiseSizes) {
          const std::string what = std::string(optest::dtype_label(a_type)) + "->" +
                                   optest::dtype_label(out_type) + " n=" + std::to_string(n) +
                                   path_label(generic);
          HostTensor a = random_tensor(a_type, Shape{n}, rng_, -3, 3);
          HostTensor b = random_tensor(DType::f32, Shape{n}, rng_, -3, 3);
          HostTensor b_same = random_tensor(a_type, Shape{n}, rng_, -3, 3);
          DeviceTensor a_dev = upload(a), b_dev = upload(b), b_same_dev = upload(b_same);

          DeviceTensor converted = poisoned(out_type, Shape{n});
          gpu().convert(converted, a_dev);
          HostTensor expected(out_type, Shape{n});
          cpu().convert(expected, a);
          expect_each_close("convert " + what, converted.floats(), expected.floats(), out_type, 1.0, 0.0);

          // a (any dtype) + b (f32): one dtype throughout only for f32.
          DeviceTensor sum = poisoned(out_type, Shape{n});
          gpu().add(sum, a_dev, b_dev);
          cpu().add(expected, a, b);
          expect_each_close("add " + what, sum.floats(), expected.floats(), out_type, 1.0, 0.0);

          gpu().scale(sum, -0.37f);
          cpu().scale(expected, -0.37f);
          expect_each_close("scale " + what, sum.floats(), expected.floats(), out_type, 1.0, 0.0);

          if (out_type == a_type) {  // one dtype throughout: the typed add
            DeviceTensor same = poisoned(out_type, Shape{n});
            gpu().add(same, a_dev, b_same_dev);
            cpu().add(expected, a, b_same);
            expect_each_close("add same dtype " + what, same.floats(), expected.floats(), out_type, 1.0, 0.0);
          }

          gpu().fill(sum, 2.5f);
          for (float v : sum.floats()) ASSERT_EQ(v, 2.5f) << "fill " << what;
        }
  }
}

TEST_F(CudaTest, AddInPlace) {
  for (bool generic : kPaths)
    for (int64_t n : {int64_t{777}, int64_t{4096}}) {
      GenericKernelsOnly path(generic);
      HostTensor a = random_tensor(DType::bf16, Shape{n}, rng_);
      HostTensor b = random_tensor(DType::bf16, Shape{n}, rng_);
      DeviceTensor a_dev = upload(a), b_dev = upload(b);
      gpu().add(a_dev, a_dev, b_dev);
      cpu().add(a, a, b);
      expect_each_close(std::string("add aliasing a") + path_label(generic), a_dev.floats(),
                        a.floats(), DType::bf16, 1.0, 0.0);
      gpu().add(b_dev, a_dev, b_dev);
      cpu().add(b, a, b);
      expect_each_close(std::string("add aliasing b") + path_label(generic), b_dev.floats(),
                        b.floats(), DType::bf16, 1.0, 0.0);
    }
}

TEST_F(CudaTest, BroadcastRowsAgainstCpu) {
  // A projection's bias into y (Qwen2's q/k/v): any bias dtype into any output dtype, odd widths,
  // and rows of a larger buffer (a token chunk), which must leave the rows around them alone.
  for (DType row_type : kFloatTypes)
    for (DType out_type : kFloatTypes)
      for (int64_t cols : {int64_t{1}, int64_t{10}, int64_t{33}, int64_t{512}}) {
        const std::string what = std::string(optest::dtype_label(row_type)) + "->" +
                                 optest::dtype_label(out_type) + " cols=" + std::to_string(cols);
        HostTensor row = random_tensor(row_type, Shape{cols}, rng_, -3, 3);
        HostTensor whole = random_tensor(out_type, Shape{9, cols}, rng_, -3, 3);
        DeviceTensor row_dev = upload(row), whole_dev = upload(whole);
        gpu().broadcast_rows(static_cast<Tensor>(whole_dev).slice_rows(2, 7), row_dev);
        cpu().broadcast_rows(whole.tensor().slice_rows(2, 7), row);
        expect_each_close("broadcast_rows " + what, whole_dev.floats(), whole.floats(), out_type, 1.0, 0.0);
      }
}

TEST_F(CudaTest, PerHeadRmsNormAgainstCpu) {
  // Qwen3's q/k norm: rows of head_dim values, one per (token, head), many short rows; the
  // backward in place on dy as the step runs it.
  for (DType type : kFloatTypes)
    for (int64_t head_dim : {int64_t{14}, int64_t{64}, int64_t{128}}) {
      const int64_t rows = 37 * 6;  // 37 tokens x 6 heads
      const std::string what = std::string(optest::dtype_label(type)) + " head_dim=" + std::to_string(head_dim);
      HostTensor x = random_tensor(type, Shape{rows, head_dim}, rng_, -2, 2);
      HostTensor w = random_tensor(type, Shape{head_dim}, rng_, 0.5, 1.5);
      HostTensor dy = random_tensor(type, Shape{rows, head_dim}, rng_);
      DeviceTensor x_dev = upload(x), w_dev = upload(w), dy_dev = upload(dy);
      DeviceTensor out = poisoned(type, Shape{rows, head_dim}), rstd = poisoned(DType::f32, Shape{rows});
      HostTensor out_ref(type, Shape{rows, head_dim}), rstd_ref(DType::f32, Shape{rows});
      gpu().rmsnorm_forward(out, rstd, x_dev, w_dev, 1e-6f);
      cpu().rmsnorm_forward(out_ref, rstd_ref, x, w, 1e-6f);
      expect_each_close("head norm fwd " + what, out.floats(), out_ref.floats(), type, 8.0, 0.0);
      gpu().rmsnorm_backward(dy_dev, dy_dev, x_dev, w_dev, rstd, false);
      cpu().rmsnorm_backward(dy, dy, x, w, rstd_ref, false);
      expect_each_close("head norm bwd in place " + what, dy_dev.floats(), dy.floats(), type);
    }
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
  for (bool generic : kPaths)
    for (DType table_type : kFloatTypes)
      for (DType out_type : kFloatTypes)
        for (int64_t hidden : {int64_t{37}, int64_t{64}, int64_t{4096}}) {
          GenericKernelsOnly path(generic);
          const int64_t vocab = 50, n = 23;
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
          expect_each_close(std::string("embedding ") + optest::dtype_label(table_type) + "->" +
                                optest::dtype_label(out_type) + " h=" + std::to_string(hidden) +
                                path_label(generic),
                            out.floats(), expected.floats(), out_type, 1.0, 0.0);
        }
}

// Hidden sizes for the row kernels: tiny, odd (scalar register path, up to its 8192 limit),
// multiples of 8 (vector register path, up to its 32768 limit), and past each limit (generic
// two-pass kernel).
constexpr int64_t kNormHiddens[] = {13, 64, 4095, 4096, 4097, 8191, 8192, 8200, 8201, 16392, 32768, 32776};

TEST_F(CudaTest, RmsNorm) {
  for (bool generic : kPaths)
    for (DType type : kFloatTypes)
      for (int64_t hidden : kNormHiddens)
        for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{7}})
          for (bool accumulate : {false, true}) {
            if (hidden > 4097 && rows == 7) continue;
            GenericKernelsOnly path(generic);
            const std::string what = std::string(optest::dtype_label(type)) + " h=" +
                                     std::to_string(hidden) + " rows=" + std::to_string(rows) +
                                     (accumulate ? " acc" : "") + path_label(generic);
            HostTensor x = random_tensor(type, Shape{rows, hidden}, rng_, -2, 2);
            HostTensor w = random_tensor(type, Shape{hidden}, rng_, 0.5, 1.5);
            HostTensor dy = random_tensor(type, Shape{rows, hidden}, rng_);
            HostTensor dx = random_tensor(type, Shape{rows, hidden}, rng_);
            DeviceTensor x_dev = upload(x), w_dev = upload(w), dy_dev = upload(dy);
            DeviceTensor out = poisoned(type, Shape{rows, hidden}), rstd = poisoned(DType::f32, Shape{rows});
            HostTensor out_ref(type, Shape{rows, hidden}), rstd_ref(DType::f32, Shape{rows});
            gpu().rmsnorm_forward(out, rstd, x_dev, w_dev, 1e-5f);
            cpu().rmsnorm_forward(out_ref, rstd_ref, x, w, 1e-5f);
            // The normalised value is rounded to x's dtype and then the product again: two
            // roundings, each of which may land on the other side of a tie.
            expect_each_close("rmsnorm fwd " + what, out.floats(), out_ref.floats(), type, 8.0, 0.0);
            expect_each_close("rmsnorm rstd " + what, rstd.floats(), rstd_ref.floats(), DType::f32, 4.0, 0.0);
            DeviceTensor dx_dev = accumulate ? upload(dx) : poisoned(type, Shape{rows, hidden});
            gpu().rmsnorm_backward(dx_dev, dy_dev, x_dev, w_dev, rstd, accumulate);
            cpu().rmsnorm_backward(dx, dy, x, w, rstd_ref, accumulate);
            expect_each_close("rmsnorm bwd " + what, dx_dev.floats(), dx.floats(), type);
          }
}

// Dtype mixes that the typed kernels do not take (generic kernel), and the documented aliasing:
// dx may alias dy or x, with and without accumulate.
TEST_F(CudaTest, RmsNormMixedDtypesAndAliasing) {
  struct Mix {
    DType x, weight, out;
  };
  for (bool generic : kPaths)
    for (const Mix& mix : {Mix{DType::bf16, DType::f32, DType::f32}, Mix{DType::f32, DType::bf16, DType::bf16},
                           Mix{DType::f16, DType::f16, DType::f32}})
      for (int64_t hidden : {int64_t{13}, int64_t{4096}}) {
        GenericKernelsOnly path(generic);
        const int64_t rows = 3;
        const std::string what = std::string(optest::dtype_label(mix.x)) + "/" +
                                 optest::dtype_label(mix.weight) + "->" +
                                 optest::dtype_label(mix.out) + " h=" + std::to_string(hidden) +
                                 path_label(generic);
        HostTensor x = random_tensor(mix.x, Shape{rows, hidden}, rng_, -2, 2);
        HostTensor w = random_tensor(mix.weight, Shape{hidden}, rng_, 0.5, 1.5);
        HostTensor dy = random_tensor(mix.out, Shape{rows, hidden}, rng_);
        DeviceTensor x_dev = upload(x), w_dev = upload(w), dy_dev = upload(dy);
        DeviceTensor out = poisoned(mix.out, Shape{rows, hidden}), rstd = poisoned(DType::f32, Shape{rows});
        HostTensor out_ref(mix.out, Shape{rows, hidden}), rstd_ref(DType::f32, Shape{rows});
        gpu().rmsnorm_forward(out, rstd, x_dev, w_dev, 1e-6f);
        cpu().rmsnorm_forward(out_ref, rstd_ref, x, w, 1e-6f);
        // The normalised value is rounded to x's dtype even when out is wider.
        const DType tolerance_type = coarser(mix.x, mix.out);
        expect_each_close("rmsnorm fwd " + what, out.floats(), out_ref.floats(), tolerance_type, 8.0, 0.0);
        DeviceTensor dx_dev = poisoned(mix.out, Shape{rows, hidden});
        HostTensor dx_ref(mix.out, Shape{rows, hidden});
        gpu().rmsnorm_backward(dx_dev, dy_dev, x_dev, w_dev, rstd, false);
        cpu().rmsnorm_backward(dx_ref, dy, x, w, rstd_ref, false);
        expect_each_close("rmsnorm bwd " + what, dx_dev.floats(), dx_ref.floats(), tolerance_type);
      }
  for (bool generic : kPaths)
    for (DType type : kFloatTypes)
      for (int64_t hidden : {int64_t{13}, int64_t{4096}})
        for (bool accumulate : {false, true}) {
          GenericKernelsOnly path(generic);
          const int64_t rows = 3;
          const std::string what = std::string(optest::dtype_label(type)) + " h=" +
                                   std::to_string(hidden) + (accumulate ? " acc" : "") +
                                   path_label(generic);
          HostTensor x = random_tensor(type, Shape{rows, hidden}, rng_, -2, 2);
          HostTensor w = random_tensor(type, Shape{hidden}, rng_, 0.5, 1.5);
          HostTensor dy = random_tensor(type, Shape{rows, hidden}, rng_);
          HostTensor rstd_ref(DType::f32, Shape{rows}), normed(type, Shape{rows, hidden});
          cpu().rmsnorm_forward(normed, rstd_ref, x, w, 1e-5f);
          DeviceTensor rstd = upload(rstd_ref);
          // dx aliasing dy.
          {
            DeviceTensor x_dev = upload(x), w_dev = upload(w), dy_dev = upload(dy);
            HostTensor expected = dy;
            cpu().rmsnorm_backward(expected, expected, x, w, rstd_ref, accumulate);
            gpu().rmsnorm_backward(dy_dev, dy_dev, x_dev, w_dev, rstd, accumulate);
            expect_each_close("rmsnorm bwd dx=dy " + what, dy_dev.floats(), expected.floats(), type);
          }
          // dx aliasing x.
          {
            DeviceTensor x_dev = upload(x), w_dev = upload(w), dy_dev = upload(dy);
            HostTensor expected = x;
            cpu().rmsnorm_backward(expected, dy, expected, w, rstd_ref, accumulate);
            gpu().rmsnorm_backward(x_dev, dy_dev, x_dev, w_dev, rstd, accumulate);
            expect_each_close("rmsnorm bwd dx=x " + what, x_dev.floats(), expected.floats(), type);
          }
        }
}

TEST_F(CudaTest, Rope) {
  for (bool generic : kPaths)
    for (DType type : kFloatTypes)
      for (int64_t head_dim : {int64_t{8}, int64_t{24}, int64_t{64}, int64_t{128}})
        for (int64_t heads : {int64_t{1}, int64_t{3}, int64_t{8}})
          for (int64_t tokens : {int64_t{1}, int64_t{17}, int64_t{19}, int64_t{37}}) {
            GenericKernelsOnly path(generic);
            const bool float_positions = tokens == 19;
            const std::string what = std::string(optest::dtype_label(type)) + " d=" +
                                     std::to_string(head_dim) + " heads=" + std::to_string(heads) +
                                     " tokens=" + std::to_string(tokens) +
                                     (float_positions ? " f32 positions" : "") + path_label(generic);
            HostTensor x = random_tensor(type, Shape{tokens, heads * head_dim}, rng_);
            std::vector<int32_t> positions(tokens);
            std::uniform_int_distribution<int32_t> pick(0, 8000);
            for (auto& p : positions) p = pick(rng_);
            HostTensor pos = optest::i32_tensor(Shape{tokens}, positions);
            if (float_positions) {
              std::vector<float> as_float(positions.begin(), positions.end());
              pos = optest::tensor_from(DType::f32, Shape{tokens}, as_float);
            }
            std::vector<float> freq(head_dim / 2);
            for (int64_t j = 0; j < head_dim / 2; ++j)
              freq[j] = 1.0f / std::pow(500000.0f, static_cast<float>(2 * j) / head_dim);
            HostTensor inv = optest::tensor_from(DType::f32, Shape{head_dim / 2}, freq);
            DeviceTensor x_dev = upload(x), pos_dev = upload(pos), inv_dev = upload(inv);
            gpu().rope_forward(x_dev, pos_dev, inv_dev, head_dim);
            cpu().rope_forward(x, pos, inv, head_dim);
            expect_each_close("rope fwd " + what, x_dev.floats(), x.floats(), type);
            gpu().rope_backward(x_dev, pos_dev, inv_dev, head_dim);
            cpu().rope_backward(x, pos, inv, head_dim);
            expect_each_close("rope bwd " + what, x_dev.floats(), x.floats(), type);
          }
}

// A low-rank case of the LoRA epilogue tests: rows x cols outputs, rank r.
struct LoraShape {
  int64_t rows, cols, r;
};

std::string lora_label(DType type, const LoraShape& sh) {
  return std::string(optest::dtype_label(type)) + " " + std::to_string(sh.rows) + "x" + std::to_string(sh.cols) +
         " r" + std::to_string(sh.r);
}

// The LoRA B terms of gate and up, then SwiGLU (swiglu_lora_forward), against the CPU backend at
// the step's layouts (u transposed [r, rows], B [cols, r]) and at odd shapes. The sums may round
// the other way than the CPU's at a tie (their fp32 orders differ), and SwiGLU can amplify that
// about fourfold where silu is steep: 8 ulps on out.
// Both paths: the typed and the [generic] SwiGLU kernel after the two GEMMs.
TEST_F(CudaTest, SwiGluWithLoraTerms) {
  for (bool generic : kPaths)
  for (DType type : kFloatTypes)
    for (const LoraShape sh : {LoraShape{1, 1, 1}, LoraShape{7, 33, 4}, LoraShape{130, 1000, 16}, LoraShape{257, 4099, 16},
                            LoraShape{64, 14336, 32}, LoraShape{65, 514, 8}}) {
      GenericKernelsOnly path(generic);
      const std::string what = lora_label(type, sh) + path_label(generic);
      HostTensor gate = random_tensor(type, Shape{sh.rows, sh.cols}, rng_, -3, 3);
      HostTensor up = random_tensor(type, Shape{sh.rows, sh.cols}, rng_, -2, 2);
      HostTensor ut_gate = random_tensor(type, Shape{sh.r, sh.rows}, rng_), ut_up = random_tensor(type, Shape{sh.r, sh.rows}, rng_);
      HostTensor b_gate = random_tensor(type, Shape{sh.cols, sh.r}, rng_), b_up = random_tensor(type, Shape{sh.cols, sh.r}, rng_);
      DeviceTensor gate_dev = upload(gate), up_dev = upload(up), ut_gate_dev = upload(ut_gate), ut_up_dev = upload(ut_up),
                   b_gate_dev = upload(b_gate), b_up_dev = upload(b_up);
      DeviceTensor out = poisoned(type, Shape{sh.rows, sh.cols});
      HostTensor out_ref(type, Shape{sh.rows, sh.cols});
      gpu().swiglu_lora_forward(out, gate_dev, up_dev, ut_gate_dev, b_gate_dev, ut_up_dev, b_up_dev, 0.5f);
      cpu().swiglu_lora_forward(out_ref, gate, up, ut_gate, b_gate, ut_up, b_up, 0.5f);
      expect_each_close("swiglu+lora gate " + what, gate_dev.floats(), gate.floats(), type);
      expect_each_close("swiglu+lora up " + what, up_dev.floats(), up.floats(), type);
      expect_each_close("swiglu+lora out " + what, out.floats(), out_ref.floats(), type, 8.0);
    }
}

// A projection's LoRA B term, then the residual (lora_residual_forward), against the CPU backend
// at the step's layouts (u [rows, r], b [cols, r]) and at odd shapes; two roundings, so 8 ulps.
TEST_F(CudaTest, LoraResidualForward) {
  for (bool generic : kPaths)
  for (DType type : kFloatTypes)
    for (const LoraShape sh : {LoraShape{1, 1, 1}, LoraShape{9, 70, 8}, LoraShape{257, 4099, 16}, LoraShape{64, 4096, 32},
                            LoraShape{130, 63, 4}}) {
      GenericKernelsOnly path(generic);
      const std::string what = lora_label(type, sh) + path_label(generic);
      HostTensor y = random_tensor(type, Shape{sh.rows, sh.cols}, rng_, -3, 3);
      HostTensor residual = random_tensor(type, Shape{sh.rows, sh.cols}, rng_, -3, 3);
      HostTensor u = random_tensor(type, Shape{sh.rows, sh.r}, rng_), b = random_tensor(type, Shape{sh.cols, sh.r}, rng_);
      DeviceTensor y_dev = upload(y), residual_dev = upload(residual), u_dev = upload(u), b_dev = upload(b);
      gpu().lora_residual_forward(y_dev, u_dev, b_dev, 2.0f, residual_dev);
      cpu().lora_residual_forward(y, u, b, 2.0f, residual);
      expect_each_close("lora+residual " + what, y_dev.floats(), y.floats(), type, 8.0);
    }
}

// TIMING: the one-pass LoRA + residual kernel beside the two ops it replaces (Backend's default:
// cuBLAS's rank-r GEMM and the typed add kernel, as the step ran them), at an 8B step's shapes
// (4,096 tokens, 4,096 wide), bf16; r32 is not served and runs the two ops on both lines. And
// swiglu_lora_forward (the default: two GEMMs and SwiGLU) at the gate/up shapes, for reference.
// Prints; asserts nothing.
TEST_F(CudaTest, LoraEpilogueTiming) {
  const int64_t rows = 4096;
  for (const int64_t r : {16, 32}) {
    const DType t = DType::bf16;
    DeviceTensor gate = upload(random_tensor(t, Shape{rows, 14336}, rng_)), up = upload(random_tensor(t, Shape{rows, 14336}, rng_));
    DeviceTensor out = poisoned(t, Shape{rows, 14336});
    DeviceTensor ut_gate = upload(random_tensor(t, Shape{r, rows}, rng_)), ut_up = upload(random_tensor(t, Shape{r, rows}, rng_));
    DeviceTensor b_gate = upload(random_tensor(t, Shape{14336, r}, rng_)), b_up = upload(random_tensor(t, Shape{14336, r}, rng_));
    DeviceTensor y = upload(random_tensor(t, Shape{rows, 4096}, rng_)), residual = upload(random_tensor(t, Shape{rows, 4096}, rng_));
    DeviceTensor u = upload(random_tensor(t, Shape{rows, r}, rng_)), b = upload(random_tensor(t, Shape{4096, r}, rng_));
    Backend& cuda = gpu();
    const double one_pass_ms = median_event_ms([&] { cuda.lora_residual_forward(y, u, b, 0.0f, residual); });
    const double two_ops_ms = median_event_ms([&] { cuda.Backend::lora_residual_forward(y, u, b, 0.0f, residual); });
    const double swiglu_ms = median_event_ms([&] { cuda.swiglu_lora_forward(out, gate, up, ut_gate, b_gate, ut_up, b_up, 0.0f); });
    // Bytes the one pass must move: y and residual read, y written.
    const double bytes = 3.0 * rows * 4096 * 2;
    std::printf("TIMING lora+residual r%-2lld  one pass %7.3f ms (%6.0f GB/s)  two ops %7.3f ms (%6.0f GB/s)  |  swiglu+lora (3 ops) %7.3f ms\n",
                static_cast<long long>(r), one_pass_ms, bytes / (one_pass_ms * 1e-3) / 1e9, two_ops_ms,
                bytes / (two_ops_ms * 1e-3) / 1e9, swiglu_ms);
  }
}

TEST_F(CudaTest, SwiGlu) {
  for (bool generic : kPaths)
    for (DType type : kFloatTypes)
      for (int64_t n : kElementwiseSizes) {
        GenericKernelsOnly path(generic);
        const std::string what = std::string(optest::dtype_label(type)) + " n=" + std::to_string(n) +
                                 path_label(generic);
        HostTensor gate = random_tensor(type, Shape{n}, rng_, -4, 4);
        HostTensor up = random_tensor(type, Shape{n}, rng_, -2, 2);
        HostTensor d_out = random_tensor(type, Shape{n}, rng_);
        DeviceTensor gate_dev = upload(gate), up_dev = upload(up), d_out_dev = upload(d_out);
        DeviceTensor out = poisoned(type, Shape{n});
        HostTensor out_ref(type, Shape{n});
        gpu().swiglu_forward(out, gate_dev, up_dev);
        cpu().swiglu_forward(out_ref, gate, up);
        expect_each_close("swiglu fwd " + what, out.floats(), out_ref.floats(), type);
        // Into separate outputs.
        DeviceTensor d_gate = poisoned(type, Shape{n}), d_up = poisoned(type, Shape{n});
        HostTensor d_gate_ref(type, Shape{n}), d_up_ref(type, Shape{n});
        gpu().swiglu_backward(d_gate, d_up, d_out_dev, gate_dev, up_dev);
        cpu().swiglu_backward(d_gate_ref, d_up_ref, d_out, gate, up);
        expect_each_close("swiglu d_gate " + what, d_gate.floats(), d_gate_ref.floats(), type);
        expect_each_close("swiglu d_up " + what, d_up.floats(), d_up_ref.floats(), type);
        // In place over gate and up, as the step does it.
        gpu().swiglu_backward(gate_dev, up_dev, d_out_dev, gate_dev, up_dev);
        cpu().swiglu_backward(gate, up, d_out, gate, up);
        expect_each_close("swiglu d_gate in place " + what, gate_dev.floats(), gate.floats(), type);
        expect_each_close("swiglu d_up in place " + what, up_dev.floats(), up.floats(), type);
      }
  // A dtype mix (the generic kernels).
  for (bool generic : kPaths) {
    GenericKernelsOnly path(generic);
    const int64_t n = 4097;
    HostTensor gate = random_tensor(DType::bf16, Shape{n}, rng_, -4, 4);
    HostTensor up = random_tensor(DType::f32, Shape{n}, rng_, -2, 2);
    DeviceTensor gate_dev = upload(gate), up_dev = upload(up);
    DeviceTensor out = poisoned(DType::f32, Shape{n});
    HostTensor out_ref(DType::f32, Shape{n});
    gpu().swiglu_forward(out, gate_dev, up_dev);
    cpu().swiglu_forward(out_ref, gate, up);
    expect_each_close(std::string("swiglu fwd bf16*f32->f32") + path_label(generic), out.floats(),
                      out_ref.floats(), DType::f32);
  }
}

// Views one element into their buffers: pointers that are naturally aligned but not 16-byte
// aligned, which the typed kernels must take through their scalar paths.
TEST_F(CudaTest, ElementwiseOnMisalignedViews) {
  for (DType type : kFloatTypes) {
    const std::string what = optest::dtype_label(type);
    const int64_t rows = 3, hidden = 64, n = rows * hidden;
    const Shape shape{rows, hidden}, buffer{n + 1};
    HostTensor a = random_tensor(type, buffer, rng_, -3, 3), b = random_tensor(type, buffer, rng_, -3, 3);
    HostTensor c = random_tensor(type, buffer, rng_, -3, 3);
    DeviceTensor a_dev = upload(a), b_dev = upload(b), c_dev = upload(c);
    const Tensor av = view_at(a_dev, 1, shape), bv = view_at(b_dev, 1, shape), cv = view_at(c_dev, 1, shape);
    const Tensor ah = view_at(a, 1, shape), bh = view_at(b, 1, shape), ch = view_at(c, 1, shape);

    DeviceTensor out_dev = poisoned(type, buffer);
    HostTensor out(type, buffer);
    const Tensor ov = view_at(out_dev, 1, shape), oh = view_at(out, 1, shape);
    gpu().add(ov, av, bv);
    cpu().add(oh, ah, bh);
    expect_each_close("misaligned add " + what, download_view(gpu(), ov), host_view_floats(oh), type, 1.0, 0.0);
    gpu().scale(ov, 1.75f);
    cpu().scale(oh, 1.75f);
    expect_each_close("misaligned scale " + what, download_view(gpu(), ov), host_view_floats(oh), type, 1.0, 0.0);
    const DType other = type == DType::f32 ? DType::bf16 : DType::f32;
    DeviceTensor converted_dev = poisoned(other, buffer);
    HostTensor converted(other, buffer);
    gpu().convert(view_at(converted_dev, 1, shape), av);
    cpu().convert(view_at(converted, 1, shape), ah);
    expect_each_close("misaligned convert " + what, download_view(gpu(), view_at(converted_dev, 1, shape)),
                      host_view_floats(view_at(converted, 1, shape)), other, 1.0, 0.0);
    gpu().fill(ov, -1.5f);
    for (float v : download_view(gpu(), ov)) ASSERT_EQ(v, -1.5f) << "misaligned fill " << what;

    gpu().swiglu_forward(ov, av, bv);
    cpu().swiglu_forward(oh, ah, bh);
    expect_each_close("misaligned swiglu fwd " + what, download_view(gpu(), ov), host_view_floats(oh), type);
    gpu().swiglu_backward(av, bv, cv, av, bv);
    cpu().swiglu_backward(ah, bh, ch, ah, bh);
    expect_each_close("misaligned swiglu d_gate " + what, download_view(gpu(), av), host_view_floats(ah), type);
    expect_each_close("misaligned swiglu d_up " + what, download_view(gpu(), bv), host_view_floats(bh), type);

    // rmsnorm over rows of 64 (a vector width) starting at a misaligned pointer.
    HostTensor w = random_tensor(type, Shape{hidden}, rng_, 0.5, 1.5);
    DeviceTensor w_dev = upload(w);
    DeviceTensor rstd = poisoned(DType::f32, Shape{rows});
    HostTensor rstd_ref(DType::f32, Shape{rows});
    gpu().rmsnorm_forward(ov, rstd, cv, w_dev, 1e-5f);
    cpu().rmsnorm_forward(oh, rstd_ref, ch, w, 1e-5f);
    expect_each_close("misaligned rmsnorm fwd " + what, download_view(gpu(), ov), host_view_floats(oh), type, 8.0, 0.0);
    gpu().rmsnorm_backward(av, bv, cv, w_dev, rstd, true);
    cpu().rmsnorm_backward(ah, bh, ch, w, rstd_ref, true);
    expect_each_close("misaligned rmsnorm bwd " + what, download_view(gpu(), av), host_view_floats(ah), type);

    // rope with head_dim 16 (half a vector width of 8) on the misaligned view.
    std::vector<int32_t> positions = {5, 700, 4095};
    HostTensor pos = optest::i32_tensor(Shape{rows}, positions);
    std::vector<float> freq(8);
    for (int64_t j = 0; j < 8; ++j) freq[j] = 1.0f / std::pow(500000.0f, static_cast<float>(2 * j) / 16);
    HostTensor inv = optest::tensor_from(DType::f32, Shape{8}, freq);
    DeviceTensor pos_dev = upload(pos), inv_dev = upload(inv);
    gpu().rope_forward(cv, pos_dev, inv_dev, 16);
    cpu().rope_forward(ch, pos, inv, 16);
    expect_each_close("misaligned rope " + what, download_view(gpu(), cv), host_view_floats(ch), type);

    // embedding into a misaligned output.
    HostTensor table = random_tensor(type, Shape{10, hidden}, rng_);
    HostTensor ids = optest::i32_tensor(Shape{rows}, {9, 0, 4});
    DeviceTensor table_dev = upload(table), ids_dev = upload(ids);
    gpu().embedding_forward(ov, table_dev, ids_dev);
    cpu().embedding_forward(oh, table, ids);
    expect_each_close("misaligned embedding " + what, download_view(gpu(), ov), host_view_floats(oh), type, 1.0, 0.0);
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

// Achieved bandwidth of the bandwidth-bound kernels at the Llama-3.1-8B shapes of one 4096-token
// micro-batch, in bf16: typed kernels against the generic ones. It prints; the only assertions
// are that both paths agree on the results. Bytes are those each op must move (reads + writes of
// the activations; the norm weight and rstd are counted too), over the mean time of kIterations
// back-to-back launches on the backend's stream (the legacy default stream).
TEST_F(CudaTest, BandwidthAt8BShapes) {
  constexpr int64_t tokens = 4096, hidden = 4096, intermediate = 14336, kv_width = 1024;
  constexpr int64_t head_dim = 128, vocab = 32000;
  constexpr int kIterations = 20;
  const DType bf16 = DType::bf16;
  const int64_t e = 2;  // bytes per bf16 element

  auto random_device = [&](DType dtype, Shape shape, float a, float b, uint64_t seed,
                           Backend::Distribution d = Backend::Distribution::normal) {
    DeviceTensor t(gpu(), dtype, shape);
    gpu().fill_random(t, d, a, b, seed);
    return t;
  };
  DeviceTensor x = random_device(bf16, Shape{tokens, hidden}, 0.0f, 1.0f, 1);
  DeviceTensor x2 = random_device(bf16, Shape{tokens, hidden}, 0.0f, 1.0f, 2);
  DeviceTensor weight = random_device(bf16, Shape{hidden}, 0.5f, 1.5f, 3, Backend::Distribution::uniform);
  DeviceTensor normed(gpu(), bf16, Shape{tokens, hidden});
  DeviceTensor dx = random_device(bf16, Shape{tokens, hidden}, 0.0f, 1.0f, 4);
  DeviceTensor rstd(gpu(), DType::f32, Shape{tokens});
  DeviceTensor x_f32 = random_device(DType::f32, Shape{tokens, hidden}, 0.0f, 1.0f, 5);
  DeviceTensor gate = random_device(bf16, Shape{tokens, intermediate}, 0.0f, 2.0f, 6);
  DeviceTensor up = random_device(bf16, Shape{tokens, intermediate}, 0.0f, 1.0f, 7);
  DeviceTensor d_out = random_device(bf16, Shape{tokens, intermediate}, 0.0f, 1.0f, 8);
  DeviceTensor act(gpu(), bf16, Shape{tokens, intermediate});
  DeviceTensor d_gate(gpu(), bf16, Shape{tokens, intermediate});
  DeviceTensor d_up(gpu(), bf16, Shape{tokens, intermediate});
  DeviceTensor q = random_device(bf16, Shape{tokens, hidden}, 0.0f, 1.0f, 9);
  DeviceTensor k = random_device(bf16, Shape{tokens, kv_width}, 0.0f, 1.0f, 10);
  DeviceTensor table = random_device(bf16, Shape{vocab, hidden}, 0.0f, 0.02f, 11);
  std::vector<int32_t> position_values(tokens), id_values(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    position_values[t] = static_cast<int32_t>(t);
    id_values[t] = static_cast<int32_t>((t * 7919) % vocab);
  }
  DeviceTensor positions = upload(optest::i32_tensor(Shape{tokens}, position_values));
  DeviceTensor ids = upload(optest::i32_tensor(Shape{tokens}, id_values));
  std::vector<float> freq(head_dim / 2);
  for (int64_t j = 0; j < head_dim / 2; ++j)
    freq[j] = 1.0f / std::pow(500000.0f, static_cast<float>(2 * j) / head_dim);
  DeviceTensor inv_freq = upload(optest::tensor_from(DType::f32, Shape{head_dim / 2}, freq));

  struct Case {
    const char* name;
    double bytes;
    std::function<void()> run;
  };
  const double th = static_cast<double>(tokens) * hidden, ti = static_cast<double>(tokens) * intermediate;
  const Case cases[] = {
      {"rmsnorm fwd 4096x4096", 2 * th * e + hidden * e + tokens * 4.0,
       [&] { gpu().rmsnorm_forward(normed, rstd, x, weight, 1e-5f); }},
      {"rmsnorm bwd 4096x4096 (accumulate)", 4 * th * e + hidden * e + tokens * 4.0,
       [&] { gpu().rmsnorm_backward(dx, normed, x, weight, rstd, true); }},
      {"swiglu fwd 4096x14336", 3 * ti * e, [&] { gpu().swiglu_forward(act, gate, up); }},
      {"swiglu bwd 4096x14336", 5 * ti * e,
       [&] { gpu().swiglu_backward(d_gate, d_up, d_out, gate, up); }},
      {"rope fwd q 4096x4096", 2 * th * e,
       [&] { gpu().rope_forward(q, positions, inv_freq, head_dim); }},
      {"rope fwd k 4096x1024", 2.0 * tokens * kv_width * e,
       [&] { gpu().rope_forward(k, positions, inv_freq, head_dim); }},
      {"add (residual) 4096x4096", 3 * th * e, [&] { gpu().add(x2, x2, x); }},
      {"convert f32->bf16 4096x4096", th * (4 + e), [&] { gpu().convert(normed, x_f32); }},
      {"embedding 4096 rows x 4096", 2 * th * e, [&] { gpu().embedding_forward(normed, table, ids); }},
  };

  cudaEvent_t start, stop;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
  auto time_ms = [&](const Case& c) {
    c.run();  // warm-up
    c.run();
    EXPECT_EQ(cudaEventRecord(start, nullptr), cudaSuccess);
    for (int i = 0; i < kIterations; ++i) c.run();
    EXPECT_EQ(cudaEventRecord(stop, nullptr), cudaSuccess);
    EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
    float ms = 0.0f;
    EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
    return ms / kIterations;
  };
  std::printf("bandwidth at the 8B shapes, bf16, mean of %d launches (GB/s = 1e9 bytes/s):\n", kIterations);
  for (const Case& c : cases) {
    float generic_ms, typed_ms;
    {
      GenericKernelsOnly path(true);
      generic_ms = time_ms(c);
    }
    {
      GenericKernelsOnly path(false);
      typed_ms = time_ms(c);
    }
    std::printf("  %-36s generic %8.1f GB/s (%8.1f us)   typed %8.1f GB/s (%8.1f us)   x%.2f\n",
                c.name, c.bytes / (generic_ms * 1e6), generic_ms * 1e3, c.bytes / (typed_ms * 1e6),
                typed_ms * 1e3, generic_ms / typed_ms);
  }
  std::fflush(stdout);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);

  // The two paths agree at these shapes (fresh outputs, same inputs).
  for (int which = 0; which < 3; ++which) {
    std::vector<float> results[2];
    for (bool generic : kPaths) {
      GenericKernelsOnly path(generic);
      if (which == 0) {
        gpu().rmsnorm_forward(normed, rstd, x, weight, 1e-5f);
        results[generic] = normed.floats();
      } else if (which == 1) {
        gpu().rmsnorm_backward(dx, x2, x, weight, rstd, false);
        results[generic] = dx.floats();
      } else {
        DeviceTensor q_copy = upload(q.download());
        gpu().rope_forward(q_copy, positions, inv_freq, head_dim);
        results[generic] = q_copy.floats();
      }
    }
    expect_each_close("typed vs generic at the 8B shape, case " + std::to_string(which), results[0],
                      results[1], bf16);
  }
}

}  // namespace
}  // namespace memtune::gputest
