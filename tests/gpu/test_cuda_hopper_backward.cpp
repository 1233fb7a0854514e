// The Hopper backward of flash attention (attention_hopper.h; wgmma + TMA, sm_90a), the main pass
// that the backend's flash backward runs in place of backward v2's where FlashVersions::
// backward_hopper is set (the default), with dQ added both ways (FlashVersions::
// backward_hopper_dq: 2- and 4-float reductions, bulk reduce-adds): dq, dk and dv against the CPU backend's
// flash backward at odd shapes (seq 1 to 2,600, head_dim 64 and 128, GQA 32/8, 4/1 and 2/2, batch
// 1 and 3, bf16 and f16), against backward v2 on the same device inputs over the whole grid of those
// shapes, on packed rows against the CPU, what it refuses, and a timing print beside backward v2
// and cuDNN. Skips without a GPU, on devices other than compute capability 9.0, and in builds
// without its sm_90a kernel.
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "flash_versions_scope.h"
#include "gpu_test_util.h"
#include "gpu_timing.h"
#include "hopper_attention_cases.h"
#include "memtune/core/dtype.h"
#include "memtune/ops/cuda/attention_flash.h"
#include "memtune/ops/cuda/attention_flash_args.h"
#include "memtune/ops/cuda/attention_hopper.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "../support/attention_setup.h"

namespace memtune::gputest {
namespace {

using optest::random_tensor;

using hopper::Config;
using hopper::label;
using hopper::relative_error;
using hopper::segment_ids;

// The current flash versions with the Hopper backward turned on or off, and how it adds dQ. Its
// defaults are the tests' reference way (2-float reductions, keys_first), not FlashVersions' default
// (bulk, rows_falling): the other ways are compared against it.
cuda::FlashVersions versions_with_hopper_backward(bool on, cuda::HopperDq dq = cuda::HopperDq::pairs,
                                                  cuda::HopperOrder order = cuda::HopperOrder::keys_first,
                                                  int row_group = 0) {
  cuda::FlashVersions versions = cuda::flash_versions();
  versions.backward_hopper = on;
  versions.backward_hopper_dq = dq;
  versions.backward_hopper_order = order;
  versions.backward_hopper_row_group = row_group;
  return versions;
}

// The Hopper backward's block and item orders other than keys_first, and the names of all three.
constexpr cuda::HopperOrder kRowOrders[] = {cuda::HopperOrder::rows_rising, cuda::HopperOrder::rows_falling};
const char* order_name(cuda::HopperOrder order) {
  return order == cuda::HopperOrder::rows_rising    ? "rows, query blocks rising"
         : order == cuda::HopperOrder::rows_falling ? "rows, query blocks falling"
                                                    : "key blocks first";
}

// The Hopper backward's two ways of adding dQ, and their names in messages.
constexpr cuda::HopperDq kDqModes[] = {cuda::HopperDq::pairs, cuda::HopperDq::bulk};
const char* dq_mode_name(cuda::HopperDq dq) {
  return dq == cuda::HopperDq::bulk ? "dQ by bulk reduce-adds" : "dQ by 2-float reductions";
}

struct Gradients {
  std::vector<float> dq, dk, dv;
};

// An NVTX push/pop range for the scope's lifetime.
class NvtxScope {
 public:
  explicit NvtxScope(const std::string& name) { nvtxRangePushA(name.c_str()); }
  ~NvtxScope() { nvtxRangePop(); }
  NvtxScope(const NvtxScope&) = delete;
  NvtxScope& operator=(const NvtxScope&) = delete;
};

// A variant's short name in NVTX ranges: "bulk_falling".
std::string variant_range_name(cuda::HopperDq dq, cuda::HopperOrder order) {
  const char* way = dq == cuda::HopperDq::bulk ? "bulk" : "pairs";
  return std::string(way) + "_" + cuda::hopper_order_short_name(order);
}

class CudaHopperBackwardTest : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped()) return;
    if (const std::string reason = hopper::hopper_device_skip_reason(); !reason.empty())
      GTEST_SKIP() << reason << "; skipped";
    // A shape it serves: false only where the binary lacks the sm_90a kernel.
    DeviceTensor probe(gpu(), DType::bf16, Shape{64});
    DeviceTensor stats(gpu(), DType::f32, Shape{64});
    if (!cuda::flash_backward_hopper_serves(params_of(Config{1, 1, 1, 1, 64}), probe_tensors(probe, stats)))
      GTEST_SKIP() << "this build has no sm_90a kernel (MEMTUNE_CUDA_ARCHS without 90); skipped";
  }

  static cuda::AttentionParams params_of(const Config& c, const Tensor& segments = Tensor{}) {
    return cuda::attention_params_of(test::attention_dims_of(c), segments);
  }
  // Backward tensors that all alias one 16-bit buffer and one f32 buffer (for serves checks).
  static cuda::FlashTensors probe_tensors(const Tensor& b16, const Tensor& f32) {
    return cuda::flash_backward_tensors(b16, b16, b16, f32, f32, b16, b16, f32, b16, b16, b16);
  }

  // The backend's flash backward with the Hopper backward on (dQ added either way) or off;
  // outputs poisoned first.
  Gradients backend_backward(bool hopper, DType type, const Config& c, const Tensor& d_out, const Tensor& out,
                             const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& segments = Tensor{}, cuda::HopperDq dq_mode = cuda::HopperDq::pairs,
                             cuda::HopperOrder order = cuda::HopperOrder::keys_first, int row_group = 0) {
    const FlashVersionsScope choice(versions_with_hopper_backward(hopper, dq_mode, order, row_group));
    const AttentionDims dims = test::attention_dims_of(c);
    const Shape q_shape = q.shape, kv_shape = k.shape, rows{c.batch * c.heads * c.seq};
    DeviceTensor dq = poisoned(type, q_shape), dk = poisoned(type, kv_shape), dv = poisoned(type, kv_shape);
    DeviceTensor delta = poisoned(DType::f32, rows), dq_accum = poisoned(DType::f32, q_shape);
    gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, segments, dims);
    return Gradients{dq.floats(), dk.floats(), dv.floats()};
  }
};

// Against the CPU backend's flash backward (fp32 math on the same 16-bit inputs, and the CPU
// forward's out and lse, uploaded): dq, dk and dv within the dtype's storage tolerance, as backward
// v2 is held in test_cuda_attention.cpp. Every odd length with every GQA shape and batch at seq <=
// 130; the long rows with the head counts that keep the CPU's quadratic backward to seconds.
TEST_F(CudaHopperBackwardTest, BackwardMatchesCpu) {
  std::vector<Config> configs;
  for (const int64_t seq : {1, 77, 130})
    for (const int64_t head_dim : {64, 128})
      for (const auto& [heads, kv_heads] : {std::pair<int64_t, int64_t>{32, 8}, {4, 1}, {2, 2}})
        for (const int64_t batch : {1, 3}) configs.push_back(Config{batch, seq, heads, kv_heads, head_dim});
  for (const int64_t head_dim : {64, 128}) {
    configs.push_back(Config{3, 1000, 4, 1, head_dim});
    configs.push_back(Config{1, 1000, 2, 2, head_dim});
    configs.push_back(Config{1, 2600, 4, 1, head_dim});
    configs.push_back(Config{1, 2600, 2, 2, head_dim});
  }
  configs.push_back(Config{1, 1000, 32, 8, 128});
  for (const Config& c : configs)
    for (const DType type : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(label(c, type));
      const hopper::CpuAttention ref = hopper::cpu_attention(cpu(), rng_, c, type);

      DeviceTensor q = upload(ref.q), k = upload(ref.k), v = upload(ref.v), d_out = upload(ref.d_out);
      DeviceTensor out = upload(ref.out), lse = upload(ref.lse);
      for (const cuda::HopperDq dq : kDqModes) {
        SCOPED_TRACE(dq_mode_name(dq));
        const Gradients hopper = backend_backward(true, type, c, d_out, out, lse, q, k, v, Tensor{}, dq);
        expect_close("hopper backward dq", hopper.dq, ref.dq.floats(), storage_tolerance(type));
        expect_close("hopper backward dk", hopper.dk, ref.dk.floats(), storage_tolerance(type));
        expect_close("hopper backward dv", hopper.dv, ref.dv.floats(), storage_tolerance(type));
      }
    }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The backend's flash backward with the Hopper backward on and off (backward v2) over the same
// device inputs and the same forward's out and lse, over the whole grid of odd shapes: seq 1, 77,
// 130, 1000, 2600 x head_dim 64, 128 x GQA 32/8, 4/1, 2/2 x batch 1, 3 x bf16, f16. dq, dk and dv
// within the dtype's storage tolerance of each other. That the backend ran the Hopper kernel: a
// direct launch of its main pass on the backend's D (left in the delta scratch) gives the same dk
// and dv bit for bit (their sums run in registers in a fixed order; dQ's reductions do not), and
// its dQ accumulator matches the backend's dq.
TEST_F(CudaHopperBackwardTest, BackendBackwardMatchesV2AtOddShapes) {
  uint64_t seed = 300;
  for (const int64_t seq : {1, 77, 130, 1000, 2600})
    for (const int64_t head_dim : {64, 128})
      for (const auto& [heads, kv_heads] : {std::pair<int64_t, int64_t>{32, 8}, {4, 1}, {2, 2}})
        for (const int64_t batch : {1, 3})
          for (const DType type : {DType::bf16, DType::f16}) {
            const Config c{batch, seq, heads, kv_heads, head_dim};
            SCOPED_TRACE(label(c, type));
            const AttentionDims dims = test::attention_dims_of(c);
            const int64_t n = batch * seq;
            const Shape q_shape{n, heads * head_dim}, kv_shape{n, kv_heads * head_dim}, rows{batch * heads * seq};
            DeviceTensor q(gpu(), type, q_shape), k(gpu(), type, kv_shape), v(gpu(), type, kv_shape);
            DeviceTensor d_out(gpu(), type, q_shape);
            gpu().fill_random(q, Backend::Distribution::uniform, -1.5f, 1.5f, ++seed);
            gpu().fill_random(k, Backend::Distribution::uniform, -1.5f, 1.5f, ++seed);
            gpu().fill_random(v, Backend::Distribution::uniform, -1.0f, 1.0f, ++seed);
            gpu().fill_random(d_out, Backend::Distribution::uniform, -1.0f, 1.0f, ++seed);
            const Tensor none;
            DeviceTensor out = poisoned(type, q_shape), lse = poisoned(DType::f32, rows);
            gpu().attention_flash_forward(out, lse, q, k, v, none, dims);

            const Gradients v2 = backend_backward(false, type, c, d_out, out, lse, q, k, v);
            DeviceTensor dq = poisoned(type, q_shape), dk = poisoned(type, kv_shape), dv = poisoned(type, kv_shape);
            DeviceTensor delta = poisoned(DType::f32, rows), dq_accum = poisoned(DType::f32, q_shape);
            {
              const FlashVersionsScope hopper(versions_with_hopper_backward(true));
              gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, none, dims);
            }
            const Gradients hopper{dq.floats(), dk.floats(), dv.floats()};
            for (const auto& [what, a, b] : {std::tuple{"dq", &hopper.dq, &v2.dq}, std::tuple{"dk", &hopper.dk, &v2.dk},
                                             std::tuple{"dv", &hopper.dv, &v2.dv}}) {
              bool finite = false;
              const double error = relative_error(*a, *b, finite);
              EXPECT_TRUE(finite) << what << ": non-finite values (unwritten or NaN)";
              EXPECT_LT(error, storage_tolerance(type)) << what << ", hopper vs v2";
            }

            // The direct launch: the backend's D, a zeroed accumulator, fresh dk and dv, under the
            // same way and order as the backend's run (the launch reads flash_versions(); dk and dv
            // are bit for bit only within one order: 33ae4c3 compared the default order's launch
            // with keys_first's backend run and failed on every shape past seq 1, H100 2026-12-07).
            DeviceTensor direct_dk = poisoned(type, kv_shape), direct_dv = poisoned(type, kv_shape);
            DeviceTensor direct_accum(gpu(), DType::f32, q_shape);
            ASSERT_EQ(cudaMemset(direct_accum.tensor().data, 0, direct_accum.tensor().nbytes()), cudaSuccess);
            const cuda::FlashTensors t = cuda::flash_backward_tensors(dq, direct_dk, direct_dv, delta, direct_accum,
                                                                      d_out, out, lse, q, k, v);
            ASSERT_TRUE(cuda::flash_backward_hopper_serves(params_of(c), t));
            {
              const FlashVersionsScope hopper_reference(versions_with_hopper_backward(true));
              ASSERT_TRUE(cuda::launch_flash_backward_hopper(params_of(c), t, nullptr));
            }
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            EXPECT_TRUE(direct_dk.floats() == hopper.dk) << "the backend's backward is not the Hopper kernel";
            EXPECT_TRUE(direct_dv.floats() == hopper.dv) << "the backend's backward is not the Hopper kernel";
            // The backend's dq is its accumulator rounded to the storage type: round the direct one
            // the same way before comparing. Unrounded, f16's subnormals made the comparison fail at
            // seq 1, where dQ is only rounding noise (P = 1, dP - D ~ 1e-7): fp32 values of ~1e-8
            // against their f16 roundings, 0 or one subnormal step (H100, 2026-12-07).
            std::vector<float> direct_dq = direct_accum.floats();
            for (float& value : direct_dq) value = round_to_dtype(value, type);
            bool finite = false;
            EXPECT_LT(relative_error(direct_dq, hopper.dq, finite), storage_tolerance(type))
                << "direct dQ accumulator, rounded to " << dtype_name(type) << ", vs the backend's dq";
            EXPECT_TRUE(finite);

            // dQ added by bulk reduce-adds: dk and dv are not touched by it (bit for bit); dq (sums in
            // another order) within the tolerance of the 2-float reductions'.
            {
              SCOPED_TRACE(dq_mode_name(cuda::HopperDq::bulk));
              const Gradients other =
                  backend_backward(true, type, c, d_out, out, lse, q, k, v, none, cuda::HopperDq::bulk);
              EXPECT_TRUE(other.dk == hopper.dk) << "dk differs";
              EXPECT_TRUE(other.dv == hopper.dv) << "dv differs";
              finite = false;
              EXPECT_LT(relative_error(other.dq, hopper.dq, finite), storage_tolerance(type)) << "dq";
              EXPECT_TRUE(finite) << "dq: non-finite values (unwritten or NaN)";
            }

            // The other block and item orders (built with dQ by bulk reduce-adds; rows in groups of the
            // default size, and in groups of 5, which leaves a smaller last group at 8 or 24 rows):
            // dk and dv summed in another order, dq too; each within the tolerance of keys_first's.
            for (const auto& [order, row_group] : {std::pair{kRowOrders[0], 0}, std::pair{kRowOrders[1], 0},
                                                   std::pair{kRowOrders[1], 5}}) {
              SCOPED_TRACE(std::string(order_name(order)) + ", rows a group " + std::to_string(row_group));
              const Gradients other = backend_backward(true, type, c, d_out, out, lse, q, k, v, none,
                                                       cuda::HopperDq::bulk, order, row_group);
              for (const auto& [what, a, b] : {std::tuple{"dq", &other.dq, &hopper.dq},
                                               std::tuple{"dk", &other.dk, &hopper.dk},
                                               std::tuple{"dv", &other.dv, &hopper.dv}}) {
                finite = false;
                EXPECT_LT(relative_error(*a, *b, finite), storage_tolerance(type)) << what << " vs keys_first";
                EXPECT_TRUE(finite) << what << ": non-finite values (unwritten or NaN)";
              }
            }
          }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The Hopper backward on packed rows against the CPU backend's flash backward with the same ids
// (the CPU forward's out and lse, uploaded), and against backward v2 on the device. The rows, as
// for the Hopper forward's packed test: a one-token sample and samples across the 128-key blocks;
// ids that come back after others, ids that fall; a last token whose id is the first token's (the
// first key block's query loop must run to the row's end); every token its own sample; one sample.
TEST_F(CudaHopperBackwardTest, PackedRowsMatchCpu) {
  for (const hopper::PackedCase& test_case : hopper::packed_cases())
    for (const DType type : {DType::bf16, DType::f16}) {
      const Config& c = test_case.config;
      SCOPED_TRACE("packed " + label(c, type));
      const HostTensor hids = segment_ids(c, test_case.rows);
      const hopper::CpuAttention ref = hopper::cpu_attention(cpu(), rng_, c, type, hids.tensor());

      DeviceTensor q = upload(ref.q), k = upload(ref.k), v = upload(ref.v), d_out = upload(ref.d_out);
      DeviceTensor ids = upload(hids);
      DeviceTensor out = upload(ref.out), lse = upload(ref.lse);
      {
        DeviceTensor probe_dk(gpu(), type, ref.k.shape), probe_accum(gpu(), DType::f32, ref.q.shape);
        const cuda::FlashTensors t = cuda::flash_backward_tensors(q, probe_dk, probe_dk, lse, probe_accum, d_out, out,
                                                                  lse, q, k, v);
        ASSERT_TRUE(cuda::flash_backward_hopper_serves(params_of(c, ids), t)) << "packed rows are served";
      }
      const Gradients v2 = backend_backward(false, type, c, d_out, out, lse, q, k, v, ids);
      // Each way of adding dQ in the keys_first order, and the other orders (with the bulk way, the
      // only one built for them).
      std::vector<std::pair<cuda::HopperDq, cuda::HopperOrder>> runs;
      for (const cuda::HopperDq dq : kDqModes) runs.emplace_back(dq, cuda::HopperOrder::keys_first);
      for (const cuda::HopperOrder order : kRowOrders) runs.emplace_back(cuda::HopperDq::bulk, order);
      for (const auto& [dq, order] : runs) {
        SCOPED_TRACE(std::string(dq_mode_name(dq)) + ", " + order_name(order));
        const Gradients hopper = backend_backward(true, type, c, d_out, out, lse, q, k, v, ids, dq, order);
        expect_close("hopper packed dq", hopper.dq, ref.dq.floats(), storage_tolerance(type));
        expect_close("hopper packed dk", hopper.dk, ref.dk.floats(), storage_tolerance(type));
        expect_close("hopper packed dv", hopper.dv, ref.dv.floats(), storage_tolerance(type));
        expect_close("hopper packed dq vs v2", hopper.dq, v2.dq, storage_tolerance(type));
        expect_close("hopper packed dk vs v2", hopper.dk, v2.dk, storage_tolerance(type));
        expect_close("hopper packed dv vs v2", hopper.dv, v2.dv, storage_tolerance(type));
      }
    }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// What the launcher refuses, launching nothing: head_dims other than 64/128, f32, a dk of another
// dtype, misaligned pointers, no D scratch, GQA groups that do not divide. Packed rows it serves.
// With the Hopper backward turned on, the backend's flash backward still runs (backward v2 or the
// generic kernels) where it refuses: head_dim 96 against the CPU.
TEST_F(CudaHopperBackwardTest, RefusesWhatItDoesNotServe) {
  DeviceTensor buffer(gpu(), DType::bf16, Shape{4096});
  DeviceTensor stats(gpu(), DType::f32, Shape{4096});
  DeviceTensor segments(gpu(), DType::i32, Shape{64});
  const cuda::AttentionParams good = params_of(Config{1, 16, 2, 1, 64});
  const cuda::FlashTensors t = probe_tensors(buffer, stats);
  EXPECT_TRUE(cuda::flash_backward_hopper_serves(good, t));
  cuda::AttentionParams packed = good;
  packed.segments = static_cast<const int32_t*>(segments.tensor().data);
  EXPECT_TRUE(cuda::flash_backward_hopper_serves(packed, t));
  cuda::AttentionParams d96 = good;
  d96.head_dim = 96;
  EXPECT_FALSE(cuda::launch_flash_backward_hopper(d96, t, nullptr));
  cuda::AttentionParams uneven = good;
  uneven.n_heads = 3;
  uneven.n_kv_heads = 2;
  EXPECT_FALSE(cuda::launch_flash_backward_hopper(uneven, t, nullptr));
  cuda::FlashTensors f32 = t;
  f32.q_type = f32.k_type = f32.v_type = f32.d_out_type = f32.dk_type = f32.dv_type = DType::f32;
  EXPECT_FALSE(cuda::launch_flash_backward_hopper(good, f32, nullptr));
  cuda::FlashTensors mixed = t;
  mixed.dk_type = DType::f16;
  EXPECT_FALSE(cuda::launch_flash_backward_hopper(good, mixed, nullptr));
  cuda::FlashTensors misaligned = t;
  misaligned.k = static_cast<const uint8_t*>(t.k) + 2;
  EXPECT_FALSE(cuda::launch_flash_backward_hopper(good, misaligned, nullptr));
  cuda::FlashTensors misaligned_accum = t;
  misaligned_accum.dq_accum = t.dq_accum + 1;
  EXPECT_FALSE(cuda::launch_flash_backward_hopper(good, misaligned_accum, nullptr));
  cuda::FlashTensors no_delta = t;
  no_delta.delta = nullptr;
  EXPECT_FALSE(cuda::launch_flash_backward_hopper(good, no_delta, nullptr));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  // head_dim 96 through the backend with the Hopper backward on: the generic kernels, right.
  const Config c{1, 77, 4, 2, 96};
  const AttentionDims dims = test::attention_dims_of(c);
  const HostTensor hq = random_tensor(DType::bf16, Shape{c.seq, c.heads * c.head_dim}, rng_, -1.5, 1.5);
  const HostTensor hk = random_tensor(DType::bf16, Shape{c.seq, c.kv_heads * c.head_dim}, rng_, -1.5, 1.5);
  const HostTensor hv = random_tensor(DType::bf16, Shape{c.seq, c.kv_heads * c.head_dim}, rng_);
  const HostTensor hdo = random_tensor(DType::bf16, Shape{c.seq, c.heads * c.head_dim}, rng_);
  const Shape rows{c.heads * c.seq};
  HostTensor cpu_out(DType::bf16, hq.shape), cpu_lse(DType::f32, rows), cpu_delta(DType::f32, rows);
  HostTensor cpu_dq(DType::bf16, hq.shape), cpu_dk(DType::bf16, hk.shape), cpu_dv(DType::bf16, hk.shape);
  HostTensor cpu_dq_accum(DType::f32, hq.shape);
  cpu().attention_flash_forward(cpu_out, cpu_lse, hq, hk, hv, Tensor{}, dims);
  cpu().attention_flash_backward(cpu_dq, cpu_dk, cpu_dv, cpu_delta, cpu_dq_accum, hdo, cpu_out, cpu_lse, hq, hk, hv,
                                 Tensor{}, dims);
  DeviceTensor q = upload(hq), k = upload(hk), v = upload(hv), d_out = upload(hdo);
  DeviceTensor out = upload(cpu_out), lse = upload(cpu_lse);
  const Gradients g = backend_backward(true, DType::bf16, c, d_out, out, lse, q, k, v);
  expect_close("d96 dq", g.dq, cpu_dq.floats(), storage_tolerance(DType::bf16));
  expect_close("d96 dk", g.dk, cpu_dk.floats(), storage_tolerance(DType::bf16));
  expect_close("d96 dv", g.dv, cpu_dv.floats(), storage_tolerance(DType::bf16));
}

// A timing print, not a test (its only assertions: the Hopper backward's gradients agree with
// backward v2's): the backend's flash backward with the Hopper main pass and with backward v2's
// (both with the same D and dQ-rounding passes), the Hopper main pass alone, and in builds with
// cuDNN cuDNN's backward, at the shapes of CudnnAttentionTest.TimingPrintCudnnVsFlash, causal,
// 32/8 heads, bf16. TFLOP/s with FA2's causal count: the backward is 2.5x the forward's 4 * pairs *
// head_dim (5 GEMMs to 2).
TEST_F(CudaHopperBackwardTest, TimingPrintHopperBackward) {
  for (const Config c : {Config{8, 2048, 32, 8, 128}, Config{2, 8192, 32, 8, 128}, Config{1, 32768, 32, 8, 128},
                         Config{8, 2048, 32, 8, 64}}) {
    // NVTX ranges for Nsight Compute to pick kernels by (device-check's ncu-attn: --nvtx
    // --nvtx-include "hopper_bwd_b2_s8192_d128/"); no-ops without a tool attached. Flat, not nested:
    // "hopper_bwd_<shape>" around the 2-float reductions' (keys_first) and cuDNN's timings, and
    // "hopper_bwd_<shape>_<dq way>_<order>" around each other variant's.
    const std::string range = "hopper_bwd_b" + std::to_string(c.batch) + "_s" + std::to_string(c.seq) + "_d" +
                              std::to_string(c.head_dim);
    const AttentionDims dims = test::attention_dims_of(c);
    const int64_t n = c.batch * c.seq;
    const Shape q_shape{n, c.heads * c.head_dim}, kv_shape{n, c.kv_heads * c.head_dim}, rows{c.batch * c.heads * c.seq};
    DeviceTensor q(gpu(), DType::bf16, q_shape), k(gpu(), DType::bf16, kv_shape), v(gpu(), DType::bf16, kv_shape);
    DeviceTensor d_out(gpu(), DType::bf16, q_shape);
    // Scores of a few units, as the other timing tests: q and k uniform in [-1.5, 1.5).
    gpu().fill_random(q, Backend::Distribution::uniform, -1.5f, 1.5f, 21);
    gpu().fill_random(k, Backend::Distribution::uniform, -1.5f, 1.5f, 22);
    gpu().fill_random(v, Backend::Distribution::uniform, -1.0f, 1.0f, 23);
    gpu().fill_random(d_out, Backend::Distribution::uniform, -1.0f, 1.0f, 24);
    const Tensor none;
    DeviceTensor out(gpu(), DType::bf16, q_shape), lse(gpu(), DType::f32, rows);
    gpu().attention_flash_forward(out, lse, q, k, v, none, dims);
    DeviceTensor dq(gpu(), DType::bf16, q_shape), dk(gpu(), DType::bf16, kv_shape), dv(gpu(), DType::bf16, kv_shape);
    DeviceTensor v2_dq(gpu(), DType::bf16, q_shape), v2_dk(gpu(), DType::bf16, kv_shape);
    DeviceTensor v2_dv(gpu(), DType::bf16, kv_shape);
    DeviceTensor delta(gpu(), DType::f32, rows), dq_accum(gpu(), DType::f32, q_shape);
    const cuda::FlashTensors t =
        cuda::flash_backward_tensors(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v);
    ASSERT_TRUE(cuda::flash_backward_hopper_serves(params_of(c), t)) << label(c, DType::bf16);

    auto time_ms = [](const std::function<void()>& run) { return median_event_ms(run, 3); };
    double hopper = 0.0, v2 = 0.0, main_pass = 0.0;
    {
      const NvtxScope nvtx(range);
      const FlashVersionsScope on(versions_with_hopper_backward(true));
      hopper = time_ms([&] {
        gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, none, dims);
      });
      // The main pass alone, on the D and the (now dirty) accumulator of the last run: same work;
      // here and below with dQ added each way.
      main_pass = time_ms([&] { cuda::launch_flash_backward_hopper(params_of(c), t, nullptr); });
    }
    // dQ by bulk reduce-adds in each order: keys_first; rising and falling with groups of the
    // default size (0); falling with 1, 2, 4 and 8 rows a group (the group size trades the tail of
    // the launch, bench/backward_schedule.py, against how much of the accumulator a group touches).
    constexpr int kOrderRuns = 7;
    const cuda::HopperOrder run_order[kOrderRuns] = {cuda::HopperOrder::keys_first, kRowOrders[0], kRowOrders[1],
                                                     kRowOrders[1], kRowOrders[1], kRowOrders[1], kRowOrders[1]};
    const int run_row_group[kOrderRuns] = {0, 0, 0, 1, 2, 4, 8};
    double main_pass_order[kOrderRuns] = {}, hopper_order[kOrderRuns] = {};
    for (int i = 0; i < kOrderRuns; ++i) {
      const NvtxScope nvtx(range + "_" + variant_range_name(cuda::HopperDq::bulk, run_order[i]) +
                           (run_row_group[i] > 0 ? "_r" + std::to_string(run_row_group[i]) : ""));
      const FlashVersionsScope other(
          versions_with_hopper_backward(true, cuda::HopperDq::bulk, run_order[i], run_row_group[i]));
      main_pass_order[i] = time_ms([&] { cuda::launch_flash_backward_hopper(params_of(c), t, nullptr); });
      hopper_order[i] = time_ms([&] {
        gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, none, dims);
      });
    }
    {
      const FlashVersionsScope off(versions_with_hopper_backward(false));
      v2 = time_ms([&] {
        gpu().attention_flash_backward(v2_dq, v2_dk, v2_dv, delta, dq_accum, d_out, out, lse, q, k, v, none, dims);
      });
    }
    // The Hopper gradients again (the main-pass timing wrote dk and dv again, identically, but
    // left dq_accum summed many times; dq itself is from the last backend run).
    {
      const FlashVersionsScope on(versions_with_hopper_backward(true));
      gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, none, dims);
    }
    double cudnn = 0.0;
    if (cudnn_attention_available()) {
      const NvtxScope nvtx(range);
      DeviceTensor workspace(gpu(), DType::f32, Shape{std::max<int64_t>(1, cudnn_attention_workspace_floats(dims, true))});
      DeviceTensor cudnn_dq(gpu(), DType::bf16, q_shape), cudnn_dk(gpu(), DType::bf16, kv_shape);
      DeviceTensor cudnn_dv(gpu(), DType::bf16, kv_shape), cudnn_delta(gpu(), DType::f32, rows);
      cudnn = time_ms([&] {
        gpu().attention_cudnn_backward(cudnn_dq, cudnn_dk, cudnn_dv, cudnn_delta, workspace, d_out, out, lse, q, k, v,
                                       none, RaggedAttention{}, dims);
      });
    }
    const double pairs = static_cast<double>(c.batch) * c.heads * c.seq * c.seq / 2.0;
    const double flops = 2.5 * 4.0 * pairs * c.head_dim;
    auto tflops = [&](double ms) { return flops / (ms * 1e-3) / 1e12; };
    std::printf("TIMING attention backward %s causal (median of 7):\n", label(c, DType::bf16).c_str());
    std::printf("  hopper, 2-float reductions, key blocks first %8.3f ms %7.1f TFLOP/s\n", hopper, tflops(hopper));
    std::printf("  the same, main pass only                     %8.3f ms %7.1f TFLOP/s\n", main_pass, tflops(main_pass));
    for (int i = 0; i < kOrderRuns; ++i) {
      const std::string group_size = run_order[i] == cuda::HopperOrder::keys_first ? ""
                                     : run_row_group[i] > 0 ? std::to_string(run_row_group[i]) + " rows a group"
                                                            : "default groups";
      std::printf("  hopper, TMA, %-26s %-16s %8.3f ms %7.1f TFLOP/s (main pass only %.3f ms, %.1f TFLOP/s)\n",
                  order_name(run_order[i]), group_size.c_str(), hopper_order[i], tflops(hopper_order[i]),
                  main_pass_order[i], tflops(main_pass_order[i]));
    }
    std::printf("  v2 (mma.sync)         %8.3f ms %7.1f TFLOP/s\n", v2, tflops(v2));
    if (cudnn > 0.0) std::printf("  cudnn                 %8.3f ms %7.1f TFLOP/s\n", cudnn, tflops(cudnn));

    bool finite_dq = false, finite_dk = false, finite_dv = false;
    const double dq_error = relative_error(dq.floats(), v2_dq.floats(), finite_dq);
    const double dk_error = relative_error(dk.floats(), v2_dk.floats(), finite_dk);
    const double dv_error = relative_error(dv.floats(), v2_dv.floats(), finite_dv);
    std::printf("  hopper vs v2: dq %.2e, dk %.2e, dv %.2e (relative norm)\n", dq_error, dk_error, dv_error);
    EXPECT_TRUE(finite_dq && finite_dk && finite_dv) << label(c, DType::bf16);
    EXPECT_LT(dq_error, storage_tolerance(DType::bf16)) << label(c, DType::bf16);
    EXPECT_LT(dk_error, storage_tolerance(DType::bf16)) << label(c, DType::bf16);
    EXPECT_LT(dv_error, storage_tolerance(DType::bf16)) << label(c, DType::bf16);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

// MEMTUNE_FLASH_BACKWARD, read once per process: each value sets the backward's start versions, and
// an unknown one aborts naming the values it takes. No GPU is needed (CI runs it): each statement
// runs in a fresh process (threadsafe death tests re-run the binary), where the variable has not
// been read yet.
TEST(FlashVersionsEnvironment, BackwardValuesSetTheVersionsAndAnUnknownOneAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto exit_code = [](bool hopper, cuda::HopperDq dq) {
    const cuda::FlashVersions versions = cuda::flash_versions();
    return versions.backward_hopper == hopper && versions.backward_hopper_dq == dq ? 0 : 1;
  };
  EXPECT_EXIT(
      {
        ::unsetenv("MEMTUNE_FLASH_BACKWARD");
        std::exit(exit_code(true, cuda::HopperDq::bulk));
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        ::setenv("MEMTUNE_FLASH_BACKWARD", "hopper", 1);
        std::exit(exit_code(true, cuda::HopperDq::bulk));
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        ::setenv("MEMTUNE_FLASH_BACKWARD", "v2", 1);
        std::exit(exit_code(false, cuda::HopperDq::bulk));
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        ::setenv("MEMTUNE_FLASH_BACKWARD", "hopper-pairs", 1);
        std::exit(exit_code(true, cuda::HopperDq::pairs));
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_DEATH(
      {
        ::setenv("MEMTUNE_FLASH_BACKWARD", "hopper-fast", 1);
        (void)cuda::flash_versions();
      },
      "MEMTUNE_FLASH_BACKWARD takes v2, hopper or hopper-pairs");
}

// MEMTUNE_FLASH_BACKWARD_ORDER, likewise: keys (or unset), rising, falling; anything else aborts.
TEST(FlashVersionsEnvironment, BackwardOrderValuesSetTheOrderAndAnUnknownOneAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto exit_code = [](cuda::HopperOrder order) { return cuda::flash_versions().backward_hopper_order == order ? 0 : 1; };
  EXPECT_EXIT(
      {
        ::unsetenv("MEMTUNE_FLASH_BACKWARD_ORDER");
        std::exit(exit_code(cuda::HopperOrder::rows_falling));
      },
      ::testing::ExitedWithCode(0), "");
  for (const auto& [value, order] : {std::pair{"keys", cuda::HopperOrder::keys_first},
                                     std::pair{"rising", cuda::HopperOrder::rows_rising},
                                     std::pair{"falling", cuda::HopperOrder::rows_falling}}) {
    SCOPED_TRACE(value);
    EXPECT_EXIT(
        {
          ::setenv("MEMTUNE_FLASH_BACKWARD_ORDER", value, 1);
          std::exit(exit_code(order));
        },
        ::testing::ExitedWithCode(0), "");
  }
  EXPECT_DEATH(
      {
        ::setenv("MEMTUNE_FLASH_BACKWARD_ORDER", "rows", 1);
        (void)cuda::flash_versions();
      },
      "MEMTUNE_FLASH_BACKWARD_ORDER takes keys, rising or falling");
}

// MEMTUNE_FLASH_FORWARD, likewise: hopper (or unset) and v2 set whether the Hopper forward runs,
// hopper-overlap runs it with its pipelined kernel (FlashVersions::forward_hopper_overlap);
// anything else aborts.
TEST(FlashVersionsEnvironment, ForwardValuesSetTheVersionAndAnUnknownOneAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto exit_code = [](bool hopper, bool overlap) {
    const cuda::FlashVersions versions = cuda::flash_versions();
    return versions.forward_hopper == hopper && versions.forward_hopper_overlap == overlap ? 0 : 1;
  };
  struct Case {
    const char* value;  // "": unset
    bool hopper, overlap;
  };
  for (const Case& c : {Case{"", true, false}, Case{"hopper", true, false}, Case{"hopper-overlap", true, true},
                        Case{"v2", false, false}}) {
    SCOPED_TRACE(c.value);
    EXPECT_EXIT(
        {
          if (*c.value == 0) ::unsetenv("MEMTUNE_FLASH_FORWARD");
          else ::setenv("MEMTUNE_FLASH_FORWARD", c.value, 1);
          std::exit(exit_code(c.hopper, c.overlap));
        },
        ::testing::ExitedWithCode(0), "");
  }
  EXPECT_DEATH(
      {
        ::setenv("MEMTUNE_FLASH_FORWARD", "v3", 1);
        (void)cuda::flash_versions();
      },
      "MEMTUNE_FLASH_FORWARD takes v2, hopper or hopper-overlap");
}

}  // namespace
}  // namespace memtune::gputest
