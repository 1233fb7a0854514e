// cuDNN fused attention (--attn_implementation cudnn) of the CUDA backend: forward and backward
// against the CPU backend's flash op (the oracle) with fresh random inputs at odd lengths, GQA
// groups 1/4/8 and head_dim 64/128 in bf16 and f16; cuDNN's workspace sizes; a whole LlamaStep
// with cudnn against the same step with flash; and a timing print beside memtune's flash kernel.
// Skips without a GPU or without cuDNN in the build.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <tuple>

#include "gpu_test_util.h"
#include "gpu_timing.h"
#include "memtune/ops/cuda/cuda_backend.h"
#include "memtune/train/engine_arena.h"
#include "../train/engine_test_util.h"

namespace memtune::gputest {
namespace {

using optest::random_tensor;

struct Config {
  int64_t batch, seq, heads, kv_heads, head_dim;
};

std::string label(const Config& c, DType type) {
  return "b" + std::to_string(c.batch) + " s" + std::to_string(c.seq) + " h" +
         std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " d" +
         std::to_string(c.head_dim) + " " + optest::dtype_label(type);
}

AttentionDims dims_of(const Config& c) {
  AttentionDims dims;
  dims.batch = c.batch;
  dims.seq = c.seq;
  dims.n_heads = c.heads;
  dims.n_kv_heads = c.kv_heads;
  dims.head_dim = c.head_dim;
  dims.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  return dims;
}

struct Results {
  std::vector<float> out, lse, dq, dk, dv;
};

class CudnnAttentionTest : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped()) return;
    if (!cudnn_attention_available())
      GTEST_SKIP() << "cuDNN attention not available (built without the cudnn frontend, or no "
                      "libcudnn 9 / sm80+ GPU): cuDNN tests skipped";
  }
  CudaBackend& cuda() { return static_cast<CudaBackend&>(gpu()); }

  Results gpu_cudnn(const Config& c, const HostTensor& hq, const HostTensor& hk,
                    const HostTensor& hv, const HostTensor& hdo) {
    const AttentionDims dims = dims_of(c);
    const DType type = hq.dtype;
    DeviceTensor q = upload(hq), k = upload(hk), v = upload(hv), d_out = upload(hdo);
    DeviceTensor out = poisoned(type, hq.shape), lse = poisoned(DType::f32, Shape{c.batch * c.heads * c.seq});
    DeviceTensor fwd_ws = poisoned(DType::f32, Shape{cudnn_attention_workspace_floats(dims, false)});
    DeviceTensor bwd_ws = poisoned(DType::f32, Shape{cudnn_attention_workspace_floats(dims, true)});
    DeviceTensor delta = poisoned(DType::f32, Shape{c.batch * c.heads * c.seq});
    const Tensor none;
    gpu().attention_cudnn_forward(out, lse, q, k, v, none, fwd_ws, dims);
    DeviceTensor dq = poisoned(type, hq.shape), dk = poisoned(type, hk.shape), dv = poisoned(type, hk.shape);
    gpu().attention_cudnn_backward(dq, dk, dv, delta, bwd_ws, d_out, out, lse, q, k, v, none, dims);
    return Results{out.floats(), lse.floats(), dq.floats(), dk.floats(), dv.floats()};
  }

  Results cpu_flash(const Config& c, const HostTensor& q, const HostTensor& k, const HostTensor& v,
                    const HostTensor& d_out) {
    const AttentionDims dims = dims_of(c);
    const DType type = q.dtype;
    HostTensor out(type, q.shape), dq(type, q.shape), dk(type, k.shape), dv(type, k.shape);
    HostTensor lse(DType::f32, Shape{c.batch * c.heads * c.seq}), delta = lse;
    HostTensor dq_accum(DType::f32, q.shape);
    const Tensor none;
    cpu().attention_flash_forward(out, lse, q, k, v, none, dims);
    cpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, none, dims);
    return Results{out.floats(), lse.floats(), dq.floats(), dk.floats(), dv.floats()};
  }
};

TEST_F(CudnnAttentionTest, ForwardAndBackwardMatchCpu) {
  const Config configs[] = {{1, 1, 4, 1, 64},    {2, 17, 4, 1, 64},   {1, 17, 8, 8, 128},
                            {2, 17, 8, 2, 128},  {1, 1000, 4, 1, 64}, {1, 1000, 8, 2, 128},
                            {2, 130, 32, 4, 128}, {1, 300, 8, 8, 64}};
  for (const Config& c : configs)
    for (DType type : {DType::bf16, DType::f16}) {
      const int64_t n = c.batch * c.seq;
      // Scores of a few units: the softmax is neither flat nor one-hot.
      const HostTensor q = random_tensor(type, Shape{n, c.heads * c.head_dim}, rng_, -1.5, 1.5);
      const HostTensor k = random_tensor(type, Shape{n, c.kv_heads * c.head_dim}, rng_, -1.5, 1.5);
      const HostTensor v = random_tensor(type, Shape{n, c.kv_heads * c.head_dim}, rng_);
      const HostTensor d_out = random_tensor(type, Shape{n, c.heads * c.head_dim}, rng_);
      const Results got = gpu_cudnn(c, q, k, v, d_out);
      const Results want = cpu_flash(c, q, k, v, d_out);
      const double tol = storage_tolerance(type);
      const std::string what = "cudnn " + label(c, type);
      expect_close(what + " out", got.out, want.out, tol);
      // cuDNN's Stats is memtune's lse (natural-log logsumexp of the scaled scores): fp32 both.
      expect_close(what + " lse", got.lse, want.lse, 1e-4);
      expect_close(what + " dq", got.dq, want.dq, tol);
      expect_close(what + " dk", got.dk, want.dk, tol);
      expect_close(what + " dv", got.dv, want.dv, tol);
    }
}

// cuDNN's real workspace beside the planned bound (a print, and the bound must hold).
TEST_F(CudnnAttentionTest, WorkspaceFitsThePlannedBound) {
  const Config configs[] = {{2, 2048, 32, 8, 128}, {8, 2048, 32, 8, 128}, {1, 1000, 8, 2, 128},
                            {2, 17, 4, 1, 64},     {1, 32768, 32, 8, 128}};
  for (const Config& c : configs)
    for (bool backward : {false, true}) {
      const AttentionDims dims = dims_of(c);
      const size_t need = cuda().cudnn_attention_workspace_bytes(dims, DType::bf16, backward);
      const size_t bound = 4 * static_cast<size_t>(cudnn_attention_workspace_floats(dims, backward));
      if (need == cuda::kCudnnUnsupported) {
        std::printf("  WORKSPACE cudnn %-3s %-26s unsupported by cuDNN (flash kernel runs)\n",
                    backward ? "bwd" : "fwd", label(c, DType::bf16).c_str());
        continue;
      }
      std::printf("  WORKSPACE cudnn %-3s %-26s %12zu bytes (planned %12zu)\n",
                  backward ? "bwd" : "fwd", label(c, DType::bf16).c_str(), need, bound);
      EXPECT_LE(need, bound) << label(c, DType::bf16) << (backward ? " backward" : " forward");
    }
}

// A workspace smaller than the graph needs is a clear error, not an allocation.
TEST_F(CudnnAttentionTest, TooSmallWorkspaceFails) {
  const Config c{2, 2048, 32, 8, 128};
  const AttentionDims dims = dims_of(c);
  const size_t need = cuda().cudnn_attention_workspace_bytes(dims, DType::bf16, true);
  if (need == 0 || need == cuda::kCudnnUnsupported) GTEST_SKIP() << "no workspace";
  const int64_t n = c.batch * c.seq;
  DeviceTensor q = poisoned(DType::bf16, Shape{n, c.heads * c.head_dim});
  DeviceTensor kv = poisoned(DType::bf16, Shape{n, c.kv_heads * c.head_dim});
  DeviceTensor lse = poisoned(DType::f32, Shape{c.batch * c.heads * c.seq});
  DeviceTensor tiny = poisoned(DType::f32, Shape{64});
  EXPECT_THROW(gpu().attention_cudnn_backward(q, kv, kv, lse, tiny, q, q, lse, q, kv, kv, Tensor{}, dims),
               Error);
}

// One LlamaStep-driven run with cudnn against the same with flash (head_dim 64, GQA 2): the same
// losses and grads within the bf16 tolerance. The rows are one sample plus padding, so the cuDNN
// path runs (not the packed-rows fallback).
TEST_F(CudnnAttentionTest, WholeStepMatchesFlash) {
  LlamaConfig model = enginetest::small_model();
  model.head_dim = 64;
  model.num_attention_heads = 4;
  model.num_key_value_heads = 2;
  model.hidden_size = 256;
  RunConfig run = enginetest::small_run();
  run.max_seq_length = 40;
  run.precision = Precision::bf16;
  auto losses_and_grads = [&](const char* attention, bool checkpointing) {
    RunConfig r = run;
    r.attn_implementation = attention;
    r.gradient_checkpointing = checkpointing;
    PlannedEngine engine(gpu(), r, model);
    engine->init_random_weights(7);
    engine->init_adapters(11);
    for (const LoraTensors& t : engine->lora().tensors())
      gpu().fill_random(t.b, Backend::Distribution::normal, 0.0f, 0.05f, 3);
    engine->lora().sync_compute_copies(gpu());
    std::vector<double> losses;
    std::vector<float> grads;
    for (int s = 0; s < 2; ++s) {
      const StepReport report =
          engine->train_step(enginetest::random_batches(model, r, 2, 5 + s, /*padding_step=*/7));
      losses.push_back(report.loss);
      if (s == 0)
        for (const LoraTensors& t : engine->lora().tensors())
          for (const Tensor* g : {&t.grad_a, &t.grad_b}) {
            std::vector<uint8_t> raw(g->nbytes());
            gpu().copy_to_host(raw.data(), *g);
            for (int64_t i = 0; i < g->numel(); ++i) grads.push_back(load_as_f32(raw.data(), g->dtype, i));
          }
    }
    EXPECT_TRUE(engine->step().batch().one_sample_per_row) << attention;
    EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes) << attention;
    return std::make_pair(losses, grads);
  };
  for (bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "checkpointing" : "no checkpointing");
    const auto flash = losses_and_grads("flash", checkpointing);
    const auto cudnn = losses_and_grads("cudnn", checkpointing);
    for (size_t s = 0; s < flash.first.size(); ++s)
      EXPECT_NEAR(cudnn.first[s], flash.first[s], 1e-2 * flash.first[s]) << "step " << s;
    expect_close("lora grads after step 1", cudnn.second, flash.second, 5e-2);
  }
}

// A timing print, not a test: memtune's flash kernel beside cuDNN's fused attention at the seed
// run's shape (b8 s2048: 16k tokens per call) and at longer sequences and head_dim 64, the
// shapes bench/attention_peer.py times for PyTorch's SDPA in the same device call.
TEST_F(CudnnAttentionTest, TimingPrintCudnnVsFlash) {
  for (const Config c : {Config{8, 2048, 32, 8, 128}, Config{2, 8192, 32, 8, 128},
                         Config{1, 32768, 32, 8, 128}, Config{8, 2048, 32, 8, 64}}) {
    const AttentionDims dims = dims_of(c);
    const int64_t n = c.batch * c.seq;
    const HostTensor hq = random_tensor(DType::bf16, Shape{n, c.heads * c.head_dim}, rng_, -1.5, 1.5);
    const HostTensor hk = random_tensor(DType::bf16, Shape{n, c.kv_heads * c.head_dim}, rng_, -1.5, 1.5);
    const HostTensor hv = random_tensor(DType::bf16, Shape{n, c.kv_heads * c.head_dim}, rng_);
    const HostTensor hdo = random_tensor(DType::bf16, Shape{n, c.heads * c.head_dim}, rng_);
    DeviceTensor q = upload(hq), k = upload(hk), v = upload(hv), d_out = upload(hdo);
    DeviceTensor out(gpu(), DType::bf16, hq.shape), lse(gpu(), DType::f32, Shape{c.batch * c.heads * c.seq});
    DeviceTensor dq(gpu(), DType::bf16, hq.shape), dk(gpu(), DType::bf16, hk.shape), dv(gpu(), DType::bf16, hk.shape);
    DeviceTensor delta(gpu(), DType::f32, Shape{c.batch * c.heads * c.seq}), dq_accum(gpu(), DType::f32, hq.shape);
    DeviceTensor fwd_ws(gpu(), DType::f32, Shape{cudnn_attention_workspace_floats(dims, false)});
    DeviceTensor bwd_ws(gpu(), DType::f32, Shape{cudnn_attention_workspace_floats(dims, true)});
    // The first calls build the cuDNN graphs: three untimed calls.
    auto time_ms = [](const std::function<void()>& run) { return median_event_ms(run, 3); };
    const Tensor none;
    const double flash_fwd = time_ms([&] { gpu().attention_flash_forward(out, lse, q, k, v, none, dims); });
    const double flash_bwd = time_ms([&] {
      gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, none, dims);
    });
    const double cudnn_fwd =
        time_ms([&] { gpu().attention_cudnn_forward(out, lse, q, k, v, none, fwd_ws, dims); });
    const double cudnn_bwd = time_ms([&] {
      gpu().attention_cudnn_backward(dq, dk, dv, delta, bwd_ws, d_out, out, lse, q, k, v, none, dims);
    });
    // Causal FLOPs (half the S x S products): forward 2 GEMMs, backward 5 (FA2's count).
    const double pairs = static_cast<double>(c.batch) * c.heads * c.seq * c.seq / 2.0;
    const double fwd_flops = 4.0 * pairs * c.head_dim, bwd_flops = 10.0 * pairs * c.head_dim;
    auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
    std::printf("TIMING attention %s causal (median of 7), libcudnn %zu:\n", label(c, DType::bf16).c_str(),
                cuda::cudnn_runtime_version());
    for (const auto& [name, f, b] : {std::tuple{"memtune-flash", flash_fwd, flash_bwd},
                                     std::tuple{"memtune-cudnn", cudnn_fwd, cudnn_bwd}})
      std::printf("  %-13s fwd %8.3f ms %7.1f TFLOP/s | bwd %8.3f ms %7.1f TFLOP/s | fwd+bwd %7.1f TFLOP/s\n",
                  name, f, tflops(fwd_flops, f), b, tflops(bwd_flops, b), tflops(fwd_flops + bwd_flops, f + b));
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

}  // namespace
}  // namespace memtune::gputest
