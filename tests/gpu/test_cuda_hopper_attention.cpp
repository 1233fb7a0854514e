// The Hopper forward of flash attention (attention_hopper.h; wgmma + TMA, sm_90a), which the
// backend's own flash forward runs on this device unless told not to (FlashVersions): its out and
// lse against the CPU backend's flash forward at odd shapes (bf16 and f16, head_dim 64 and 128,
// GQA, causal), the existing flash backward run on what it saved against the CPU backward, the
// backend's forward with and without it (forward v2) over the same inputs, forward and backward,
// packed rows against the CPU, and a timing print beside forward v2 and cuDNN. Each test runs
// both of its kernels (FlashVersions::forward_hopper_overlap: without and with the
// intra-warpgroup pipelining). Skips without a GPU, on devices other than compute capability 9.0,
// and in builds without its sm_90a kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <tuple>

#include "flash_versions_scope.h"
#include "gpu_test_util.h"
#include "gpu_timing.h"
#include "hopper_attention_cases.h"
#include "memtune/ops/cuda/attention_flash_args.h"
#include "memtune/ops/cuda/attention_hopper.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "../support/attention_setup.h"

namespace memtune::gputest {
namespace {

using hopper::Config;
using hopper::label;
using hopper::relative_error;
using hopper::segment_ids;

cuda::AttentionParams params_of(const Config& c) { return cuda::attention_params_of(test::attention_dims_of(c)); }

// The Hopper forward's kernels (FlashVersions::forward_hopper_overlap), by MEMTUNE_FLASH_FORWARD's
// names; the launcher reads the choice on every launch.
struct HopperVariant {
  const char* name;
  bool overlap;
};
constexpr HopperVariant kHopperVariants[] = {{"hopper", false}, {"hopper-overlap", true}};

// The current versions with the Hopper forward allowed and `variant`'s kernel chosen.
cuda::FlashVersions versions_with_variant(const HopperVariant& variant) {
  cuda::FlashVersions versions = flash_versions_with_hopper(true);
  versions.forward_hopper_overlap = variant.overlap;
  return versions;
}

class CudaHopperAttentionTest : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped()) return;
    if (const std::string reason = hopper::hopper_device_skip_reason(); !reason.empty())
      GTEST_SKIP() << reason << "; skipped";
    // A shape it serves: false only where the binary lacks the sm_90a kernel.
    DeviceTensor probe(gpu(), DType::bf16, Shape{64});
    DeviceTensor lse(gpu(), DType::f32, Shape{1});
    const Tensor p = probe;
    if (!cuda::flash_forward_hopper_serves(params_of(Config{1, 1, 1, 1, 64}),
                                           cuda::flash_forward_tensors(p, lse, p, p, p)))
      GTEST_SKIP() << "this build has no sm_90a kernel (MEMTUNE_CUDA_ARCHS without 90); skipped";
  }
};

// Against the CPU backend's flash forward (fp32 math on the same 16-bit inputs): out within the
// storage tolerance, lse (fp32) within 1e-4; then the existing flash backward, fed the Hopper
// forward's out and lse, against the CPU backward. Outputs are poisoned with NaN first. Both
// kernels, on the same inputs.
TEST_F(CudaHopperAttentionTest, ForwardMatchesCpuAndFeedsTheBackward) {
  const Config configs[] = {{1, 1, 1, 1, 64},      {1, 77, 4, 1, 64},    {2, 300, 8, 2, 128},
                            {1, 1000, 4, 4, 128},  {1, 2049, 8, 2, 64},  {2, 129, 2, 1, 128},
                            {1, 128, 2, 2, 64},    {3, 255, 4, 2, 128}};
  for (const Config& c : configs)
    for (DType type : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(label(c, type));
      const AttentionDims dims = test::attention_dims_of(c);
      const Shape rows{c.batch * c.heads * c.seq};
      const hopper::CpuAttention ref = hopper::cpu_attention(cpu(), rng_, c, type);

      DeviceTensor q = upload(ref.q), k = upload(ref.k), v = upload(ref.v), d_out = upload(ref.d_out);
      for (const HopperVariant& variant : kHopperVariants) {
        SCOPED_TRACE(variant.name);
        const FlashVersionsScope kernel(versions_with_variant(variant));
        DeviceTensor out = poisoned(type, ref.q.shape), lse = poisoned(DType::f32, rows);
        ASSERT_TRUE(
            cuda::launch_flash_forward_hopper(params_of(c), cuda::flash_forward_tensors(out, lse, q, k, v), nullptr));
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        expect_close("hopper out", out.floats(), ref.out.floats(), storage_tolerance(type));
        expect_close("hopper lse", lse.floats(), ref.lse.floats(), 1e-4);

        DeviceTensor dq = poisoned(type, ref.q.shape), dk = poisoned(type, ref.k.shape),
                     dv = poisoned(type, ref.k.shape);
        DeviceTensor delta = poisoned(DType::f32, rows), dq_accum = poisoned(DType::f32, ref.q.shape);
        gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, Tensor{}, dims);
        expect_close("backward on hopper forward dq", dq.floats(), ref.dq.floats(), storage_tolerance(type));
        expect_close("backward on hopper forward dk", dk.floats(), ref.dk.floats(), storage_tolerance(type));
        expect_close("backward on hopper forward dv", dv.floats(), ref.dv.floats(), storage_tolerance(type));
      }
    }
}

// What the launcher refuses, launching nothing: head_dims other than 64/128, f32, mixed dtypes,
// misaligned pointers. Packed rows it serves.
TEST_F(CudaHopperAttentionTest, RefusesWhatItDoesNotServe) {
  DeviceTensor buffer(gpu(), DType::bf16, Shape{4096});
  DeviceTensor lse(gpu(), DType::f32, Shape{64});
  DeviceTensor segments(gpu(), DType::i32, Shape{64});
  const Tensor b = buffer;
  const cuda::AttentionParams good = params_of(Config{1, 16, 2, 1, 64});
  const cuda::FlashTensors t = cuda::flash_forward_tensors(b, lse, b, b, b);
  EXPECT_TRUE(cuda::flash_forward_hopper_serves(good, t));
  cuda::AttentionParams packed = good;
  packed.segments = static_cast<const int32_t*>(segments.tensor().data);
  EXPECT_TRUE(cuda::flash_forward_hopper_serves(packed, t));
  cuda::AttentionParams d96 = good;
  d96.head_dim = 96;
  EXPECT_FALSE(cuda::launch_flash_forward_hopper(d96, t, nullptr));
  cuda::FlashTensors f32 = t;
  f32.q_type = f32.k_type = f32.v_type = f32.out_type = DType::f32;
  EXPECT_FALSE(cuda::launch_flash_forward_hopper(good, f32, nullptr));
  cuda::FlashTensors mixed = t;
  mixed.out_type = DType::f16;
  EXPECT_FALSE(cuda::launch_flash_forward_hopper(good, mixed, nullptr));
  cuda::FlashTensors misaligned = t;
  misaligned.k = static_cast<const uint8_t*>(t.k) + 2;
  EXPECT_FALSE(cuda::launch_flash_forward_hopper(good, misaligned, nullptr));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The backend's own flash forward with the Hopper forward turned off (forward v2) and on (its
// default on this device; each of its kernels) over the same inputs, at odd lengths, both
// head_dims, GQA 32/8 and 4/1, batch 1 and 3: out within the dtype's storage tolerance, lse (fp32
// in both, from the same 16-bit inputs) within 1e-5. The path taken must be the chosen Hopper
// kernel itself: its out and lse equal a direct launch's under the same choice bit for bit (the
// kernels are deterministic). Inputs are drawn on the device (the largest shape holds 32M values a
// tensor); the CPU is the oracle of all in the other tests.
TEST_F(CudaHopperAttentionTest, BackendForwardMatchesForcedV2AtOddShapes) {
  struct Heads {
    int64_t heads, kv_heads;
  };
  uint64_t seed = 100;
  for (const int64_t seq : {1, 77, 1000, 2600})
    for (const int64_t head_dim : {64, 128})
      for (const Heads g : {Heads{32, 8}, Heads{4, 1}})
        for (const int64_t batch : {1, 3})
          for (const DType type : {DType::bf16, DType::f16}) {
            const Config c{batch, seq, g.heads, g.kv_heads, head_dim};
            SCOPED_TRACE(label(c, type));
            const AttentionDims dims = test::attention_dims_of(c);
            const int64_t n = batch * seq;
            const Shape q_shape{n, g.heads * head_dim}, kv_shape{n, g.kv_heads * head_dim};
            const Shape rows{batch * g.heads * seq};
            DeviceTensor q(gpu(), type, q_shape), k(gpu(), type, kv_shape), v(gpu(), type, kv_shape);
            gpu().fill_random(q, Backend::Distribution::uniform, -1.5f, 1.5f, ++seed);
            gpu().fill_random(k, Backend::Distribution::uniform, -1.5f, 1.5f, ++seed);
            gpu().fill_random(v, Backend::Distribution::uniform, -1.0f, 1.0f, ++seed);
            const Tensor none;

            DeviceTensor v2_out = poisoned(type, q_shape), v2_lse = poisoned(DType::f32, rows);
            {
              const FlashVersionsScope forced_v2(flash_versions_with_hopper(false));
              gpu().attention_flash_forward(v2_out, v2_lse, q, k, v, none, dims);
            }
            const std::vector<float> v2_out_values = v2_out.floats(), v2_lse_values = v2_lse.floats();
            for (const HopperVariant& variant : kHopperVariants) {
              SCOPED_TRACE(variant.name);
              const FlashVersionsScope kernel(versions_with_variant(variant));
              DeviceTensor out = poisoned(type, q_shape), lse = poisoned(DType::f32, rows);
              gpu().attention_flash_forward(out, lse, q, k, v, none, dims);
              const cuda::FlashTensors direct_tensors = cuda::flash_forward_tensors(out, lse, q, k, v);
              ASSERT_TRUE(cuda::flash_forward_hopper_serves(params_of(c), direct_tensors));
              DeviceTensor direct_out = poisoned(type, q_shape), direct_lse = poisoned(DType::f32, rows);
              ASSERT_TRUE(cuda::launch_flash_forward_hopper(
                  params_of(c), cuda::flash_forward_tensors(direct_out, direct_lse, q, k, v), nullptr));
              ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

              const std::vector<float> out_values = out.floats(), lse_values = lse.floats();
              EXPECT_TRUE(out_values == direct_out.floats()) << "the backend's forward is not the chosen Hopper kernel";
              EXPECT_TRUE(lse_values == direct_lse.floats()) << "the backend's forward is not the chosen Hopper kernel";
              bool finite_out = false, finite_lse = false;
              const double out_error = relative_error(out_values, v2_out_values, finite_out);
              const double lse_error = relative_error(lse_values, v2_lse_values, finite_lse);
              EXPECT_TRUE(finite_out && finite_lse);
              EXPECT_LT(out_error, storage_tolerance(type)) << "out, hopper vs v2";
              EXPECT_LT(lse_error, 1e-5) << "lse, hopper vs v2";
            }
          }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The existing flash backward fed each forward's out and lse (each Hopper kernel's, forward v2's)
// with the same d_out: dq, dk and dv agree within the dtype's storage tolerance (the outs differ
// by rounding, which reaches the gradients through delta = rowsum(dO * O)).
TEST_F(CudaHopperAttentionTest, BackwardOnHopperForwardMatchesBackwardOnV2) {
  const Config configs[] = {{1, 77, 4, 1, 64},     {3, 1000, 32, 8, 128}, {1, 2600, 4, 1, 128},
                            {3, 1, 32, 8, 64},     {1, 1000, 32, 8, 64},  {3, 2600, 4, 1, 64}};
  uint64_t seed = 200;
  for (const Config& c : configs)
    for (const DType type : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(label(c, type));
      const AttentionDims dims = test::attention_dims_of(c);
      const int64_t n = c.batch * c.seq;
      const Shape q_shape{n, c.heads * c.head_dim}, kv_shape{n, c.kv_heads * c.head_dim};
      const Shape rows{c.batch * c.heads * c.seq};
      DeviceTensor q(gpu(), type, q_shape), k(gpu(), type, kv_shape), v(gpu(), type, kv_shape);
      DeviceTensor d_out(gpu(), type, q_shape);
      gpu().fill_random(q, Backend::Distribution::uniform, -1.5f, 1.5f, ++seed);
      gpu().fill_random(k, Backend::Distribution::uniform, -1.5f, 1.5f, ++seed);
      gpu().fill_random(v, Backend::Distribution::uniform, -1.0f, 1.0f, ++seed);
      gpu().fill_random(d_out, Backend::Distribution::uniform, -1.0f, 1.0f, ++seed);
      struct Gradients {
        std::vector<float> dq, dk, dv;
      };
      auto backward_after = [&](const cuda::FlashVersions& versions) {
        const FlashVersionsScope choice(versions);
        const Tensor none;
        DeviceTensor out = poisoned(type, q_shape), lse = poisoned(DType::f32, rows);
        gpu().attention_flash_forward(out, lse, q, k, v, none, dims);
        DeviceTensor dq = poisoned(type, q_shape), dk = poisoned(type, kv_shape), dv = poisoned(type, kv_shape);
        DeviceTensor delta = poisoned(DType::f32, rows), dq_accum = poisoned(DType::f32, q_shape);
        gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, none, dims);
        return Gradients{dq.floats(), dk.floats(), dv.floats()};
      };
      const Gradients on_v2 = backward_after(flash_versions_with_hopper(false));
      for (const HopperVariant& variant : kHopperVariants) {
        SCOPED_TRACE(variant.name);
        const Gradients on_hopper = backward_after(versions_with_variant(variant));
        expect_close("dq, backward on hopper vs on v2", on_hopper.dq, on_v2.dq, storage_tolerance(type));
        expect_close("dk, backward on hopper vs on v2", on_hopper.dk, on_v2.dk, storage_tolerance(type));
        expect_close("dv, backward on hopper vs on v2", on_hopper.dv, on_v2.dv, storage_tolerance(type));
      }
    }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The Hopper forward on packed rows against the CPU backend's flash forward with the same ids (out
// within the storage tolerance, lse 1e-4), and the existing flash backward on what it saved
// against the CPU backward. The rows: one of 2,600 tokens split 700/1/1,299/600 (a one-token
// sample, samples across the 128-key blocks); ids that come back after others, ids that fall, a
// last token whose id is the first token's (its query block must start at key block 0), every token
// its own sample, and a row that is one sample. The backend's own forward (default: the Hopper
// forward) must give the direct launch's out and lse bit for bit on packed rows too. Both kernels,
// on the same inputs.
TEST_F(CudaHopperAttentionTest, PackedRowsMatchCpu) {
  for (const hopper::PackedCase& test_case : hopper::packed_cases())
    for (const DType type : {DType::bf16, DType::f16}) {
      const Config& c = test_case.config;
      SCOPED_TRACE("packed " + label(c, type));
      const AttentionDims dims = test::attention_dims_of(c);
      const HostTensor hids = segment_ids(c, test_case.rows);
      const Shape rows{c.batch * c.heads * c.seq};
      const hopper::CpuAttention ref = hopper::cpu_attention(cpu(), rng_, c, type, hids.tensor());

      DeviceTensor q = upload(ref.q), k = upload(ref.k), v = upload(ref.v), d_out = upload(ref.d_out);
      DeviceTensor ids = upload(hids);
      const cuda::AttentionParams p = cuda::attention_params_of(dims, ids);
      for (const HopperVariant& variant : kHopperVariants) {
        SCOPED_TRACE(variant.name);
        const FlashVersionsScope kernel(versions_with_variant(variant));
        DeviceTensor out = poisoned(type, ref.q.shape), lse = poisoned(DType::f32, rows);
        ASSERT_TRUE(cuda::launch_flash_forward_hopper(p, cuda::flash_forward_tensors(out, lse, q, k, v), nullptr));
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> out_values = out.floats(), lse_values = lse.floats();
        expect_close("hopper packed out", out_values, ref.out.floats(), storage_tolerance(type));
        expect_close("hopper packed lse", lse_values, ref.lse.floats(), 1e-4);

        DeviceTensor backend_out = poisoned(type, ref.q.shape), backend_lse = poisoned(DType::f32, rows);
        gpu().attention_flash_forward(backend_out, backend_lse, q, k, v, ids, dims);
        EXPECT_TRUE(backend_out.floats() == out_values) << "the backend's forward is not the chosen Hopper kernel";
        EXPECT_TRUE(backend_lse.floats() == lse_values) << "the backend's forward is not the chosen Hopper kernel";

        DeviceTensor dq = poisoned(type, ref.q.shape), dk = poisoned(type, ref.k.shape),
                     dv = poisoned(type, ref.k.shape);
        DeviceTensor delta = poisoned(DType::f32, rows), dq_accum = poisoned(DType::f32, ref.q.shape);
        gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, ids, dims);
        expect_close("backward on hopper packed forward dq", dq.floats(), ref.dq.floats(), storage_tolerance(type));
        expect_close("backward on hopper packed forward dk", dk.floats(), ref.dk.floats(), storage_tolerance(type));
        expect_close("backward on hopper packed forward dv", dv.floats(), ref.dv.floats(), storage_tolerance(type));
      }
    }
}

// A timing print, not a test (its only assertions: each Hopper kernel's out and lse agree with
// forward v2's): the Hopper forward (both kernels: FlashVersions::forward_hopper_overlap off and
// on) beside forward v2 (the backend's attention_flash_forward with the Hopper forward turned off)
// and, in builds with cuDNN, cuDNN's forward, at the shapes of CudnnAttentionTest.TimingPrintCudnnVsFlash.
// TFLOP/s with FA2's causal count (half the S x S products, 2 GEMMs: 4 * pairs * head_dim).
TEST_F(CudaHopperAttentionTest, TimingPrintHopperForward) {
  for (const Config c : {Config{8, 2048, 32, 8, 128}, Config{2, 8192, 32, 8, 128}, Config{1, 32768, 32, 8, 128},
                         Config{8, 2048, 32, 8, 64}}) {
    const AttentionDims dims = test::attention_dims_of(c);
    const int64_t n = c.batch * c.seq;
    const Shape q_shape{n, c.heads * c.head_dim}, kv_shape{n, c.kv_heads * c.head_dim}, rows{c.batch * c.heads * c.seq};
    DeviceTensor q(gpu(), DType::bf16, q_shape), k(gpu(), DType::bf16, kv_shape), v(gpu(), DType::bf16, kv_shape);
    // Scores of a few units, as the other timing tests: q and k uniform in [-1.5, 1.5).
    gpu().fill_random(q, Backend::Distribution::uniform, -1.5f, 1.5f, 11);
    gpu().fill_random(k, Backend::Distribution::uniform, -1.5f, 1.5f, 12);
    gpu().fill_random(v, Backend::Distribution::uniform, -1.0f, 1.0f, 13);
    DeviceTensor out(gpu(), DType::bf16, q_shape), lse(gpu(), DType::f32, rows);
    DeviceTensor overlap_out(gpu(), DType::bf16, q_shape), overlap_lse(gpu(), DType::f32, rows);
    DeviceTensor v2_out(gpu(), DType::bf16, q_shape), v2_lse(gpu(), DType::f32, rows);
    const Tensor none;
    const cuda::AttentionParams p = params_of(c);
    const cuda::FlashTensors t = cuda::flash_forward_tensors(out, lse, q, k, v);
    const cuda::FlashTensors overlap_t = cuda::flash_forward_tensors(overlap_out, overlap_lse, q, k, v);

    auto time_ms = [](const std::function<void()>& run) { return median_event_ms(run, 3); };
    double hopper = 0.0, overlap = 0.0;
    {
      const FlashVersionsScope kernel(versions_with_variant(kHopperVariants[0]));
      ASSERT_TRUE(cuda::launch_flash_forward_hopper(p, t, nullptr)) << label(c, DType::bf16);
      hopper = time_ms([&] { cuda::launch_flash_forward_hopper(p, t, nullptr); });
    }
    {
      const FlashVersionsScope kernel(versions_with_variant(kHopperVariants[1]));
      ASSERT_TRUE(cuda::launch_flash_forward_hopper(p, overlap_t, nullptr)) << label(c, DType::bf16);
      overlap = time_ms([&] { cuda::launch_flash_forward_hopper(p, overlap_t, nullptr); });
    }
    double v2 = 0.0;
    {
      const FlashVersionsScope forced_v2(flash_versions_with_hopper(false));
      v2 = time_ms([&] { gpu().attention_flash_forward(v2_out, v2_lse, q, k, v, none, dims); });
    }
    double cudnn = 0.0;
    if (cudnn_attention_available()) {
      DeviceTensor workspace(gpu(), DType::f32, Shape{std::max<int64_t>(1, cudnn_attention_workspace_floats(dims, false))});
      DeviceTensor cudnn_out(gpu(), DType::bf16, q_shape), cudnn_lse(gpu(), DType::f32, rows);
      cudnn = time_ms([&] {
        gpu().attention_cudnn_forward(cudnn_out, cudnn_lse, q, k, v, none, RaggedAttention{}, workspace, dims);
      });
    }
    const double pairs = static_cast<double>(c.batch) * c.heads * c.seq * c.seq / 2.0;
    const double flops = 4.0 * pairs * c.head_dim;
    auto tflops = [&](double ms) { return flops / (ms * 1e-3) / 1e12; };
    std::printf("TIMING attention forward %s causal (median of 7):\n", label(c, DType::bf16).c_str());
    std::printf("  hopper (wgmma+TMA) %8.3f ms %7.1f TFLOP/s\n", hopper, tflops(hopper));
    std::printf("  hopper overlap     %8.3f ms %7.1f TFLOP/s\n", overlap, tflops(overlap));
    std::printf("  v2 (mma.sync)      %8.3f ms %7.1f TFLOP/s\n", v2, tflops(v2));
    if (cudnn > 0.0) std::printf("  cudnn              %8.3f ms %7.1f TFLOP/s\n", cudnn, tflops(cudnn));

    const std::vector<float> v2_out_values = v2_out.floats(), v2_lse_values = v2_lse.floats();
    for (const auto& [name, kernel_out, kernel_lse] :
         {std::tuple{"hopper", &out, &lse}, std::tuple{"hopper overlap", &overlap_out, &overlap_lse}}) {
      bool finite_out = false, finite_lse = false;
      const double out_error = relative_error(kernel_out->floats(), v2_out_values, finite_out);
      const double lse_error = relative_error(kernel_lse->floats(), v2_lse_values, finite_lse);
      std::printf("  %s vs v2: out %.2e, lse %.2e (relative norm)\n", name, out_error, lse_error);
      EXPECT_TRUE(finite_out && finite_lse) << name << " " << label(c, DType::bf16);
      EXPECT_LT(out_error, storage_tolerance(DType::bf16)) << name << " " << label(c, DType::bf16);
      EXPECT_LT(lse_error, 1e-4) << name << " " << label(c, DType::bf16);
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

}  // namespace
}  // namespace memtune::gputest
