// cuDNN fused attention (--attn_implementation cudnn) of the CUDA backend: forward and backward
// against the CPU backend's flash op (the oracle) with fresh random inputs at odd lengths, GQA
// groups 1/4/8 and head_dim 64/128 in bf16 and f16; cuDNN's workspace sizes; a whole LlamaStep
// with cudnn against the same step with flash; and a timing print beside memtune's flash kernel.
// Packed rows (cuDNN's ragged SDPA from the sequence table, ops/ragged_attention.h): the same
// checks against the CPU flash op with the segments, per segment, in both ragged Stats layouts,
// with and without the table's rounding (empty slots); nothing read or written past the tensors;
// the flash fallback where cuDNN refuses; a whole packed step; the workspace against the plan;
// graph build times; and a timing print of packed rows against unpacked rows of the same shape.
// Skips without a GPU or without cuDNN in the build.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <tuple>

#include <chrono>
#include <cstring>

#include "gpu_test_util.h"
#include "gpu_timing.h"
#include "memtune/ops/cuda/cuda_backend.h"
#include "memtune/ops/ragged_attention.h"
#include "memtune/train/engine_arena.h"
#include "../support/engine_setup.h"
#include "../support/attention_setup.h"

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

struct Results {
  std::vector<float> out, lse, dq, dk, dv;
};

// The whole-step tests' model and run: head_dim 64, GQA 2, bf16, rows of 40 tokens.
LlamaConfig whole_step_model() {
  LlamaConfig model = enginetest::small_model();
  model.head_dim = 64;
  model.num_attention_heads = 4;
  model.num_key_value_heads = 2;
  model.hidden_size = 256;
  return model;
}
RunConfig whole_step_run() {
  RunConfig run = enginetest::small_run();
  run.max_seq_length = 40;
  run.precision = Precision::bf16;
  return run;
}

// A run's losses over its steps and its LoRA grads after the first, for an attention
// implementation, without or with gradient checkpointing.
using LossesAndGrads = std::pair<std::vector<double>, std::vector<float>>;
using WholeSteps = std::function<LossesAndGrads(const char* attention, bool checkpointing)>;

// cuDNN's losses and first-step LoRA grads against memtune's flash kernel within the bf16
// tolerance, without and with checkpointing.
void expect_cudnn_steps_match_flash(const WholeSteps& steps, const std::string& what) {
  for (bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "checkpointing" : "no checkpointing");
    const LossesAndGrads flash = steps("flash", checkpointing), cudnn = steps("cudnn", checkpointing);
    for (size_t s = 0; s < flash.first.size(); ++s)
      EXPECT_NEAR(cudnn.first[s], flash.first[s], 1e-2 * flash.first[s]) << "step " << s;
    expect_close(what + " lora grads after step 1", cudnn.second, flash.second, 5e-2);
  }
}

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
    const AttentionDims dims = test::attention_dims_of(c);
    const DType type = hq.dtype;
    DeviceTensor q = upload(hq), k = upload(hk), v = upload(hv), d_out = upload(hdo);
    DeviceTensor out = poisoned(type, hq.shape), lse = poisoned(DType::f32, Shape{c.batch * c.heads * c.seq});
    DeviceTensor fwd_ws = poisoned(DType::f32, Shape{cudnn_attention_workspace_floats(dims, false)});
    DeviceTensor bwd_ws = poisoned(DType::f32, Shape{cudnn_attention_workspace_floats(dims, true)});
    DeviceTensor delta = poisoned(DType::f32, Shape{c.batch * c.heads * c.seq});
    const Tensor none;
    gpu().attention_cudnn_forward(out, lse, q, k, v, none, RaggedAttention{}, fwd_ws, dims);
    DeviceTensor dq = poisoned(type, hq.shape), dk = poisoned(type, hk.shape), dv = poisoned(type, hk.shape);
    gpu().attention_cudnn_backward(dq, dk, dv, delta, bwd_ws, d_out, out, lse, q, k, v, none, RaggedAttention{}, dims);
    return Results{out.floats(), lse.floats(), dq.floats(), dk.floats(), dv.floats()};
  }

  Results cpu_flash(const Config& c, const HostTensor& q, const HostTensor& k, const HostTensor& v,
                    const HostTensor& d_out) {
    const AttentionDims dims = test::attention_dims_of(c);
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
      const AttentionDims dims = test::attention_dims_of(c);
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
  const AttentionDims dims = test::attention_dims_of(c);
  const size_t need = cuda().cudnn_attention_workspace_bytes(dims, DType::bf16, true);
  if (need == 0 || need == cuda::kCudnnUnsupported) GTEST_SKIP() << "no workspace";
  const int64_t n = c.batch * c.seq;
  DeviceTensor q = poisoned(DType::bf16, Shape{n, c.heads * c.head_dim});
  DeviceTensor kv = poisoned(DType::bf16, Shape{n, c.kv_heads * c.head_dim});
  DeviceTensor lse = poisoned(DType::f32, Shape{c.batch * c.heads * c.seq});
  DeviceTensor tiny = poisoned(DType::f32, Shape{64});
  EXPECT_THROW(gpu().attention_cudnn_backward(q, kv, kv, lse, tiny, q, q, lse, q, kv, kv, Tensor{}, RaggedAttention{}, dims),
               Error);
}

// One LlamaStep-driven run with cudnn against the same with flash (head_dim 64, GQA 2): the same
// losses and grads within the bf16 tolerance. The rows are one sample plus padding, so the cuDNN
// path runs (not the packed-rows fallback).
TEST_F(CudnnAttentionTest, WholeStepMatchesFlash) {
  const LlamaConfig model = whole_step_model();
  const RunConfig run = whole_step_run();
  const WholeSteps losses_and_grads = [&](const char* attention, bool checkpointing) {
    RunConfig r = run;
    r.attn_implementation = attention;
    r.gradient_checkpointing = checkpointing;
    r.packed_rows = true;  // as train --packing sets it
    PlannedEngine engine(gpu(), r, model);
    enginetest::init_with_nonzero_b(engine.engine());
    std::vector<double> losses;
    std::vector<float> grads;
    for (int s = 0; s < 2; ++s) {
      const StepReport report =
          engine->train_step(enginetest::random_batches(model, r, 2, 5 + s, /*padding_step=*/7));
      losses.push_back(report.loss);
      if (s == 0) grads = enginetest::adapter_grads(engine.engine());
    }
    EXPECT_TRUE(engine->step().batch().one_sample_per_row) << attention;
    EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes) << attention;
    return LossesAndGrads(losses, grads);
  };
  expect_cudnn_steps_match_flash(losses_and_grads, "unpacked");
}

// A timing print, not a test: memtune's flash kernel beside cuDNN's fused attention at the seed
// run's shape (b8 s2048: 16k tokens per call) and at longer sequences and head_dim 64, the
// shapes bench/attention_peer.py times for PyTorch's SDPA in the same device call.
TEST_F(CudnnAttentionTest, TimingPrintCudnnVsFlash) {
  for (const Config c : {Config{8, 2048, 32, 8, 128}, Config{2, 8192, 32, 8, 128},
                         Config{1, 32768, 32, 8, 128}, Config{8, 2048, 32, 8, 64}}) {
    const AttentionDims dims = test::attention_dims_of(c);
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
        time_ms([&] { gpu().attention_cudnn_forward(out, lse, q, k, v, none, RaggedAttention{}, fwd_ws, dims); });
    const double cudnn_bwd = time_ms([&] {
      gpu().attention_cudnn_backward(dq, dk, dv, delta, bwd_ws, d_out, out, lse, q, k, v, none, RaggedAttention{}, dims);
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


// ---- packed rows (cuDNN's ragged SDPA) --------------------------------------------------------

// A packed batch: each row's sample lengths; the rest of a row is padding, a segment of its own.
struct PackedConfig {
  int64_t seq, heads, kv_heads, head_dim;
  std::vector<std::vector<int64_t>> rows;
  int64_t batch() const { return static_cast<int64_t>(rows.size()); }
};

std::string packed_label(const PackedConfig& c, DType type) {
  std::string rows;
  for (const auto& r : c.rows) {
    rows += rows.empty() ? "[" : " [";
    const size_t shown = std::min<size_t>(r.size(), 6);
    for (size_t i = 0; i < shown; ++i) rows += (i ? "," : "") + std::to_string(r[i]);
    if (r.size() > shown) rows += ",... (" + std::to_string(r.size()) + " samples)";
    rows += "]";
  }
  return "b" + std::to_string(c.batch()) + " s" + std::to_string(c.seq) + " h" +
         std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " d" +
         std::to_string(c.head_dim) + " " + optest::dtype_label(type) + " " + rows;
}

AttentionDims packed_dims(const PackedConfig& c) {
  return test::attention_dims_of(Config{c.batch(), c.seq, c.heads, c.kv_heads, c.head_dim});
}

// write_row's numbering: 0, 1, ... per sample, the padding one more.
std::vector<int32_t> packed_segments(const PackedConfig& c) {
  std::vector<int32_t> ids;
  for (const auto& row : c.rows) {
    int32_t id = 0;
    int64_t used = 0;
    for (int64_t len : row) {
      for (int64_t t = 0; t < len; ++t) ids.push_back(id);
      used += len;
      ++id;
    }
    EXPECT_LE(used, c.seq);
    for (; used < c.seq; ++used) ids.push_back(id);
  }
  return ids;
}

// (first token, length) of every segment, padding included.
std::vector<std::pair<int64_t, int64_t>> segment_spans(const std::vector<int32_t>& ids, int64_t seq) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int64_t t = 0; t < static_cast<int64_t>(ids.size()); ++t)
    if (t % seq == 0 || ids[t] != ids[t - 1]) spans.push_back({t, 0});
  for (size_t i = 0; i < spans.size(); ++i)
    spans[i].second = (i + 1 < spans.size() ? spans[i + 1].first : static_cast<int64_t>(ids.size())) -
                      spans[i].first;
  return spans;
}

// Many samples of odd and tiny lengths, then padding, in a row of `seq`.
std::vector<int64_t> many_samples(int64_t seq) {
  const int64_t pattern[] = {1, 3, 17, 2, 63, 5, 1, 9, 31, 4, 1, 129, 7, 3, 11, 1, 23};
  std::vector<int64_t> out;
  int64_t used = 0;
  for (size_t i = 0;; ++i) {
    const int64_t len = pattern[i % (sizeof(pattern) / sizeof(pattern[0]))];
    if (used + len > seq - 5) break;  // leave a few tokens of padding
    out.push_back(len);
    used += len;
  }
  return out;
}

// The FA2 FLOP count of causal attention within each segment: per segment of length L, L^2 / 2
// score pairs per head; forward 2 GEMMs (4 * pairs * head_dim), backward 5 (10 * ...).
double causal_pairs(const std::vector<int32_t>& ids, int64_t seq, int64_t heads) {
  double pairs = 0;
  for (const auto& [first, len] : segment_spans(ids, seq))
    pairs += static_cast<double>(len) * static_cast<double>(len) / 2.0;
  return pairs * static_cast<double>(heads);
}

const char* layout_name(cuda::RaggedStats layout) {
  return layout == cuda::RaggedStats::token_major ? "token_major" : "head_major";
}

class CudnnRaggedTest : public CudnnAttentionTest {
 protected:
  static constexpr int64_t kTail = 256;  // rows past every tensor, to catch reads and writes there

  // A device buffer of rows + kTail rows of `cols`, and the view of its first `rows`. The tail is
  // NaN (nan_tail; for outputs: a write there shows) or zero (inputs whose tail must not matter);
  // `data` fills the view.
  struct Padded {
    DeviceTensor buffer;
    Tensor view;
    int64_t elements = 0;
  };
  Padded padded(DType dtype, int64_t rows, int64_t cols, const HostTensor* data, bool nan_tail) {
    Padded p;
    p.buffer = DeviceTensor(gpu(), dtype, Shape{rows + kTail, cols});
    gpu().fill(p.buffer, nan_tail ? std::nanf("") : 0.0f);
    p.view = p.buffer.tensor();
    p.view.shape = Shape{rows, cols};
    p.elements = rows * cols;
    if (data != nullptr) gpu().copy_from_host(p.view, data->storage.data());
    return p;
  }
  std::vector<float> floats_of(const Tensor& view) {
    HostTensor h(view.dtype, view.shape);
    gpu().copy_to_host(h.storage.data(), view);
    return h.floats();
  }
  // Whether nothing was written past the view (the tail still all NaN).
  bool tail_untouched(const Padded& p) {
    const std::vector<float> all = p.buffer.floats();
    for (size_t i = static_cast<size_t>(p.elements); i < all.size(); ++i)
      if (!std::isnan(all[i])) return false;
    return true;
  }

  // The table on the device (capacity: the batch's tokens unless given).
  struct DeviceTable {
    DeviceTensor buffer;
    RaggedAttention ragged;
    RaggedTableHost host;
  };
  DeviceTable upload_table(const std::vector<int32_t>& ids, const AttentionDims& dims,
                           bool round_up = true, int64_t capacity = 0) {
    RaggedTableShape shape;
    shape.rows = dims.batch;
    shape.seq = dims.seq;
    shape.capacity = capacity > 0 ? capacity : dims.tokens();
    shape.n_heads = dims.n_heads;
    shape.n_kv_heads = dims.n_kv_heads;
    shape.head_dim = dims.head_dim;
    shape.round_up = round_up;
    DeviceTable t;
    t.host = build_ragged_table(ids.data(), shape);
    EXPECT_FALSE(t.host.empty());
    HostTensor values(DType::i32, Shape{static_cast<int64_t>(t.host.values.size())});
    std::memcpy(values.storage.data(), t.host.values.data(), values.storage.size());
    t.buffer = upload(values);
    t.ragged.table = t.buffer;
    t.ragged.capacity = shape.capacity;
    t.ragged.sequences = t.host.sequences;
    t.ragged.slots = t.host.slots;
    t.ragged.max_len = t.host.max_len;
    t.ragged.rows = dims.batch;
    t.ragged.seq = dims.seq;
    return t;
  }
  HostTensor segments_tensor(const std::vector<int32_t>& ids) {
    HostTensor t(DType::i32, Shape{static_cast<int64_t>(ids.size())});
    std::memcpy(t.storage.data(), ids.data(), t.storage.size());
    return t;
  }

  struct Inputs {
    HostTensor q, k, v, d_out;
  };
  Inputs random_inputs(const AttentionDims& d, DType type) {
    const int64_t n = d.tokens();
    Inputs in;
    in.q = random_tensor(type, Shape{n, d.n_heads * d.head_dim}, rng_, -1.5, 1.5);
    in.k = random_tensor(type, Shape{n, d.n_kv_heads * d.head_dim}, rng_, -1.5, 1.5);
    in.v = random_tensor(type, Shape{n, d.n_kv_heads * d.head_dim}, rng_);
    in.d_out = random_tensor(type, Shape{n, d.n_heads * d.head_dim}, rng_);
    return in;
  }

  Results cpu_segments(const AttentionDims& d, const std::vector<int32_t>& ids, const Inputs& in) {
    const DType type = in.q.dtype;
    const HostTensor seg = segments_tensor(ids);
    HostTensor out(type, in.q.shape), dq(type, in.q.shape), dk(type, in.k.shape), dv(type, in.k.shape);
    HostTensor lse(DType::f32, Shape{d.batch * d.n_heads * d.seq}), delta = lse;
    HostTensor dq_accum(DType::f32, in.q.shape);
    cpu().attention_flash_forward(out, lse, in.q, in.k, in.v, seg, d);
    cpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, in.d_out, out, lse, in.q, in.k, in.v,
                                   seg, d);
    return Results{out.floats(), lse.floats(), dq.floats(), dk.floats(), dv.floats()};
  }

  // The op on the GPU, every tensor with a tail (inputs: NaN with nan_inputs, else zero; outputs:
  // NaN, checked untouched). fwd_floats / bwd_floats: the workspaces (default: the bound a packed
  // run plans, or what this table's graphs ask for where that is more: these tiny rows round
  // slots x max_len up to several times their tokens, which WorkspaceFitsThePlannedBound covers).
  Results gpu_ragged(const AttentionDims& d, const std::vector<int32_t>& ids, const Inputs& in,
                     const DeviceTable& table, bool nan_inputs, int64_t fwd_floats = -1,
                     int64_t bwd_floats = -1) {
    const DType type = in.q.dtype;
    const int64_t n = d.tokens(), qw = d.n_heads * d.head_dim, kw = d.n_kv_heads * d.head_dim;
    const int64_t rows = d.batch * d.n_heads * d.seq;
    Padded q = padded(type, n, qw, &in.q, nan_inputs), k = padded(type, n, kw, &in.k, nan_inputs);
    Padded v = padded(type, n, kw, &in.v, nan_inputs), d_out = padded(type, n, qw, &in.d_out, nan_inputs);
    Padded out = padded(type, n, qw, nullptr, true), lse = padded(DType::f32, rows, 1, nullptr, true);
    Padded dq = padded(type, n, qw, nullptr, true), dk = padded(type, n, kw, nullptr, true);
    Padded dv = padded(type, n, kw, nullptr, true);
    auto room = [&](bool backward) {
      const size_t asked = cuda().cudnn_attention_workspace_bytes(d, type, backward, &table.ragged);
      const int64_t planned = cudnn_attention_workspace_floats(d, backward, /*packed_rows=*/true);
      if (asked == cuda::kCudnnUnsupported) return planned;
      return std::max<int64_t>(planned, static_cast<int64_t>((asked + 3) / 4));
    };
    DeviceTensor fwd_ws = poisoned(DType::f32, Shape{fwd_floats >= 0 ? fwd_floats : room(false)});
    DeviceTensor bwd_ws = poisoned(DType::f32, Shape{bwd_floats >= 0 ? bwd_floats : room(true)});
    DeviceTensor delta = poisoned(DType::f32, Shape{rows});
    const DeviceTensor seg = upload(segments_tensor(ids));
    Tensor lse_view = lse.view;
    lse_view.shape = Shape{rows};
    gpu().attention_cudnn_forward(out.view, lse_view, q.view, k.view, v.view, seg, table.ragged, fwd_ws, d);
    gpu().attention_cudnn_backward(dq.view, dk.view, dv.view, delta, bwd_ws, d_out.view, out.view, lse_view,
                                   q.view, k.view, v.view, seg, table.ragged, d);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(tail_untouched(out)) << "out written past its end";
    EXPECT_TRUE(tail_untouched(lse)) << "lse written past its end";
    EXPECT_TRUE(tail_untouched(dq)) << "dq written past its end";
    EXPECT_TRUE(tail_untouched(dk)) << "dk written past its end";
    EXPECT_TRUE(tail_untouched(dv)) << "dv written past its end";
    return Results{floats_of(out.view), floats_of(lse_view), floats_of(dq.view), floats_of(dk.view),
                   floats_of(dv.view)};
  }

  // Whole tensors at `tol`, and every segment on its own at 2 x tol (so that a short segment's
  // error does not hide in a long one's norm).
  void expect_matches(const std::string& what, const AttentionDims& d, const std::vector<int32_t>& ids,
                      const Results& got, const Results& want, double tol) {
    expect_close(what + " out", got.out, want.out, tol);
    expect_close(what + " lse", got.lse, want.lse, 1e-4);
    expect_close(what + " dq", got.dq, want.dq, tol);
    expect_close(what + " dk", got.dk, want.dk, tol);
    expect_close(what + " dv", got.dv, want.dv, tol);
    const int64_t qw = d.n_heads * d.head_dim, kw = d.n_kv_heads * d.head_dim;
    auto rows_of = [](const std::vector<float>& x, int64_t first, int64_t len, int64_t width) {
      return std::vector<float>(x.begin() + first * width, x.begin() + (first + len) * width);
    };
    auto lse_of = [&](const std::vector<float>& x, int64_t first, int64_t len) {
      std::vector<float> out;
      for (int64_t h = 0; h < d.n_heads; ++h)
        for (int64_t t = first; t < first + len; ++t)
          out.push_back(x[static_cast<size_t>(((t / d.seq) * d.n_heads + h) * d.seq + t % d.seq)]);
      return out;
    };
    int failures = 0;
    for (const auto& [first, len] : segment_spans(ids, d.seq)) {
      if (failures > 3) break;  // enough said
      const std::string seg = what + " segment @" + std::to_string(first) + " len " + std::to_string(len);
      const int before = ::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count();
      expect_close(seg + " out", rows_of(got.out, first, len, qw), rows_of(want.out, first, len, qw), 2 * tol);
      expect_close(seg + " lse", lse_of(got.lse, first, len), lse_of(want.lse, first, len), 2e-4);
      expect_close(seg + " dq", rows_of(got.dq, first, len, qw), rows_of(want.dq, first, len, qw), 2 * tol);
      expect_close(seg + " dk", rows_of(got.dk, first, len, kw), rows_of(want.dk, first, len, kw), 2 * tol);
      expect_close(seg + " dv", rows_of(got.dv, first, len, kw), rows_of(want.dv, first, len, kw), 2 * tol);
      if (::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count() > before)
        ++failures;
    }
  }

  cuda::CudnnAttention& op() { return cuda().cudnn_attention(); }
};

const PackedConfig kPackedConfigs[] = {
    {300, 8, 2, 128, {{1, 3, 17, 63, 129}}},                   // odd lengths, 87 tokens of padding
    {257, 32, 8, 128, {{129, 63, 17, 3, 1, 1}, {256}}},        // Llama 3 8B's heads, two rows
    {130, 4, 1, 64, {{130}, {1, 129}, {64, 64, 2}}},           // MQA, full rows
    {17, 8, 8, 64, {{1, 3, 13}}},                              // MHA, a tiny row
    {1000, 4, 1, 64, {many_samples(1000)}},                    // ~90 segments in a row
    {1024, 32, 8, 128, {{513, 511}, {1, 1022}}},               // long samples
};

// cuDNN's ragged SDPA against the CPU flash op with the segments, in bf16 and f16, both Stats
// layouts, with the table's rounding (empty slots, max_len a power of two) and without; and
// cuDNN must have run (not the flash fallback).
TEST_F(CudnnRaggedTest, ForwardAndBackwardMatchCpuWithSegments) {
  for (const PackedConfig& c : kPackedConfigs)
    for (DType type : {DType::bf16, DType::f16}) {
      const AttentionDims d = packed_dims(c);
      const std::vector<int32_t> ids = packed_segments(c);
      const Inputs in = random_inputs(d, type);
      const Results want = cpu_segments(d, ids, in);
      for (cuda::RaggedStats layout : {cuda::RaggedStats::token_major, cuda::RaggedStats::head_major})
        for (bool round_up : {true, false}) {
          op().set_ragged_stats(layout);
          const DeviceTable table = upload_table(ids, d, round_up);
          const std::string what = "ragged " + packed_label(c, type) + " " + layout_name(layout) +
                                   (round_up ? " slots " : " exact slots ") +
                                   std::to_string(table.host.slots) + "/" +
                                   std::to_string(table.host.sequences) + " max_len " +
                                   std::to_string(table.host.max_len);
          SCOPED_TRACE(what);
          const cuda::CudnnStats before = op().stats();
          const Results got = gpu_ragged(d, ids, in, table, /*nan_inputs=*/false);
          const cuda::CudnnStats after = op().stats();
          EXPECT_EQ(after.refused - before.refused, 0) << what << ": cuDNN refused (the flash kernel ran)";
          EXPECT_EQ(after.ragged_runs - before.ragged_runs, 2) << what;
          expect_matches(what, d, ids, got, want, storage_tolerance(type));
        }
    }
  op().set_ragged_stats(cuda::RaggedStats::token_major);
}

// Every input tensor followed by NaN: a kernel that reads past the last sequence (and multiplies
// the masked rows by zero) would turn its results NaN.
TEST_F(CudnnRaggedTest, ReadsNothingPastTheLastSequence) {
  for (const PackedConfig& c : {kPackedConfigs[0], kPackedConfigs[1], kPackedConfigs[3]})
    for (cuda::RaggedStats layout : {cuda::RaggedStats::token_major, cuda::RaggedStats::head_major}) {
      op().set_ragged_stats(layout);
      const AttentionDims d = packed_dims(c);
      const std::vector<int32_t> ids = packed_segments(c);
      const Inputs in = random_inputs(d, DType::bf16);
      const DeviceTable table = upload_table(ids, d);
      const std::string what = "NaN past the inputs " + packed_label(c, DType::bf16) + " " + layout_name(layout);
      SCOPED_TRACE(what);
      expect_matches(what, d, ids, gpu_ragged(d, ids, in, table, /*nan_inputs=*/true),
                     cpu_segments(d, ids, in), storage_tolerance(DType::bf16));
    }
  op().set_ragged_stats(cuda::RaggedStats::token_major);
}

// Packed rows whose graph wants more workspace than the call gives: the flash kernel with the
// segments runs them (forward and backward), with the same results.
TEST_F(CudnnRaggedTest, FallsBackToTheFlashKernelWhereCudnnRefuses) {
  op().set_ragged_stats(cuda::RaggedStats::token_major);  // its forward needs a scratch
  for (const PackedConfig& c : {kPackedConfigs[0], kPackedConfigs[4]}) {
    const AttentionDims d = packed_dims(c);
    const std::vector<int32_t> ids = packed_segments(c);
    const Inputs in = random_inputs(d, DType::bf16);
    const DeviceTable table = upload_table(ids, d);
    const std::string what = "fallback " + packed_label(c, DType::bf16);
    SCOPED_TRACE(what);
    const cuda::CudnnStats before = op().stats();
    // Forward: 64 floats (no room for the token-major Stats); backward: exactly the flash dq
    // accumulator (no room for cuDNN's).
    const Results got = gpu_ragged(d, ids, in, table, false, 64, d.tokens() * d.n_heads * d.head_dim);
    const cuda::CudnnStats after = op().stats();
    EXPECT_EQ(after.refused - before.refused, 2) << what;
    EXPECT_EQ(after.ragged_runs - before.ragged_runs, 0) << what;
    expect_matches(what, d, ids, got, cpu_segments(d, ids, in), storage_tolerance(DType::bf16));
  }
}

// The ragged graphs' workspace beside the planned bound, at the shapes of the timing print and
// the ladder, and at adversarial ones (thousands of one-token sequences; one long sequence among
// many short ones), where cuDNN may size by slots x max_len: those run the flash kernel if they
// do not fit (a print, not a failure). Also the graph build times.
TEST_F(CudnnRaggedTest, WorkspaceFitsThePlannedBoundAndGraphBuildTimes) {
  struct Case {
    Config shape;
    int64_t slots, max_len;
    bool typical;
  };
  const Case cases[] = {
      {{1, 8192, 32, 8, 128}, 4, 2048, true},    {{1, 8192, 32, 8, 128}, 8, 2048, true},
      {{2, 8192, 32, 8, 128}, 8, 2048, true},    {{2, 8192, 32, 8, 128}, 16, 2048, true},
      {{8, 2048, 32, 8, 128}, 16, 2048, true},   {{2, 2048, 32, 8, 128}, 64, 128, true},
      {{2, 2048, 32, 8, 128}, 128, 64, true},    {{1, 8192, 32, 8, 128}, 64, 256, true},
      {{2, 2048, 32, 8, 64}, 64, 128, true},     {{1, 8192, 32, 8, 128}, 4096, 64, false},
      {{1, 8192, 32, 8, 128}, 256, 8192, false}, {{8, 2048, 32, 8, 128}, 2048, 2048, false},
  };
  op().set_ragged_stats(cuda::RaggedStats::token_major);
  for (const Case& c : cases) {
    const AttentionDims dims = test::attention_dims_of(c.shape);
    RaggedAttention r;
    r.slots = c.slots;
    r.max_len = c.max_len;
    for (bool backward : {false, true}) {
      const cuda::CudnnStats before = op().stats();
      const auto t0 = std::chrono::steady_clock::now();
      const size_t need = cuda().cudnn_attention_workspace_bytes(dims, DType::bf16, backward, &r);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      const cuda::CudnnStats after = op().stats();
      const size_t bound = 4 * static_cast<size_t>(cudnn_attention_workspace_floats(dims, backward, /*packed_rows=*/true));
      const std::string what = label(c.shape, DType::bf16) + " slots " + std::to_string(c.slots) +
                               " max_len " + std::to_string(c.max_len);
      if (need == cuda::kCudnnUnsupported) {
        std::printf("  WORKSPACE cudnn ragged %-3s %-44s unsupported by cuDNN (flash kernel runs); "
                    "graph build %.1f ms\n", backward ? "bwd" : "fwd", what.c_str(), ms);
        EXPECT_FALSE(c.typical) << what << (backward ? " backward" : " forward") << " unsupported";
        continue;
      }
      std::printf("  WORKSPACE cudnn ragged %-3s %-44s %12zu bytes (planned %12zu)%s; graph build "
                  "%.1f ms (%ld graph)\n",
                  backward ? "bwd" : "fwd", what.c_str(), need, bound,
                  need <= bound ? "" : " EXCEEDS: flash kernel runs", ms,
                  static_cast<long>(after.graphs - before.graphs));
      if (c.typical) EXPECT_LE(need, bound) << what << (backward ? " backward" : " forward");
    }
  }
  const cuda::CudnnStats s = op().stats();
  std::printf("  GRAPHS cudnn: %ld built in %.2f s (%.1f ms each)\n", static_cast<long>(s.graphs),
              s.build_seconds, s.graphs > 0 ? 1e3 * s.build_seconds / s.graphs : 0.0);
}

// Packed micro-batches through the whole LlamaStep (rows of several samples; the engine builds
// the table at upload): cudnn (its ragged path) against flash, the same losses and grads.
TEST_F(CudnnRaggedTest, WholePackedStepMatchesFlash) {
  const LlamaConfig model = whole_step_model();
  const RunConfig run = whole_step_run();
  // Row 0: samples of 7, 11 and 15 tokens, 7 of padding; row 1: 1, 3, 17 and 19 tokens.
  const std::vector<std::vector<int64_t>> layout = {{7, 11, 15}, {1, 3, 17, 19}};
  auto packed_batches = [&](int count, uint64_t seed) {
    std::vector<HostMicroBatch> out;
    const int64_t seq = run.max_seq_length;
    for (int m = 0; m < count; ++m) {
      HostMicroBatch b;
      for (size_t r = 0; r < layout.size(); ++r) {
        int32_t id = 0;
        int64_t used = 0;
        for (int64_t len : layout[r]) {
          for (int64_t t = 0; t < len; ++t) {
            b.input_ids.push_back(static_cast<int32_t>(dropout_hash(seed, m * 10000 + r * 100 + used + t) % model.vocab_size));
            b.positions.push_back(static_cast<int32_t>(t));
            b.segments.push_back(id);
          }
          used += len;
          ++id;
        }
        for (int64_t t = used; t < seq; ++t) {
          b.input_ids.push_back(0);
          b.positions.push_back(static_cast<int32_t>(t - used));
          b.segments.push_back(id);
        }
      }
      // targets[t]: the next token of the same sample, else -100.
      b.targets.assign(b.input_ids.size(), -100);
      for (size_t t = 0; t + 1 < b.input_ids.size(); ++t) {
        const bool same_row = (t + 1) % seq != 0;
        const bool padding = b.input_ids[t] == 0 && b.segments[t] == static_cast<int32_t>(layout[t / seq].size());
        if (same_row && !padding && b.segments[t] == b.segments[t + 1]) b.targets[t] = b.input_ids[t + 1];
      }
      out.push_back(std::move(b));
    }
    return out;
  };
  const WholeSteps losses_and_grads = [&](const char* attention, bool checkpointing) {
    RunConfig r = run;
    r.attn_implementation = attention;
    r.gradient_checkpointing = checkpointing;
    PlannedEngine engine(gpu(), r, model);
    enginetest::init_with_nonzero_b(engine.engine());
    const cuda::CudnnStats before = op().stats();
    std::vector<double> losses;
    std::vector<float> grads;
    for (int s = 0; s < 2; ++s) {
      const StepReport report = engine->train_step(packed_batches(2, 5 + s));
      losses.push_back(report.loss);
      if (s == 0) grads = enginetest::adapter_grads(engine.engine());
    }
    const cuda::CudnnStats after = op().stats();
    EXPECT_FALSE(engine->step().batch().one_sample_per_row) << attention;
    if (std::string(attention) == "cudnn") {
      EXPECT_FALSE(engine->step().batch().ragged.empty());
      EXPECT_EQ(engine->step().batch().ragged.sequences, 8);  // 3 samples + padding, 4 samples
      EXPECT_GT(after.ragged_runs, before.ragged_runs) << "the ragged cuDNN path did not run";
      EXPECT_EQ(after.refused, before.refused) << "cuDNN refused the packed rows";
    }
    EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes) << attention;
    return LossesAndGrads(losses, grads);
  };
  expect_cudnn_steps_match_flash(losses_and_grads, "packed");
}

// A timing print: packed rows (several 2048-token samples in an 8192-token row) through cuDNN's
// ragged SDPA against cuDNN on unpacked rows of the same work (b4 x 2048 and b8 x 2048: the same
// tensors, the same causal-within-sample FLOPs), in both ragged Stats layouts, and memtune's flash
// kernel on the packed rows. Median of 7 after 3 untimed calls (the graph builds, timed apart).
// The target (issue 22): packed within 5% of unpacked, forward + backward.
TEST_F(CudnnRaggedTest, TimingPrintPackedVsUnpacked) {
  struct Case {
    PackedConfig packed;
    Config unpacked;
  };
  const Case cases[] = {
      {{8192, 32, 8, 128, {{2048, 2048, 2048, 2048}}}, {4, 2048, 32, 8, 128}},
      {{8192, 32, 8, 128, {{2048, 2048, 2048, 2048}, {2048, 2048, 2048, 2048}}}, {8, 2048, 32, 8, 128}},
  };
  auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
  for (const Case& c : cases) {
    const AttentionDims pd = packed_dims(c.packed), ud = test::attention_dims_of(c.unpacked);
    ASSERT_EQ(pd.tokens(), ud.tokens());
    const std::vector<int32_t> ids = packed_segments(c.packed);
    const int64_t n = pd.tokens();
    const Inputs in = random_inputs(pd, DType::bf16);
    DeviceTensor q = upload(in.q), k = upload(in.k), v = upload(in.v), d_out = upload(in.d_out);
    DeviceTensor out(gpu(), DType::bf16, in.q.shape), lse(gpu(), DType::f32, Shape{n * pd.n_heads});
    DeviceTensor dq(gpu(), DType::bf16, in.q.shape), dk(gpu(), DType::bf16, in.k.shape), dv(gpu(), DType::bf16, in.k.shape);
    DeviceTensor delta(gpu(), DType::f32, Shape{n * pd.n_heads}), dq_accum(gpu(), DType::f32, in.q.shape);
    DeviceTensor fwd_ws(gpu(), DType::f32, Shape{cudnn_attention_workspace_floats(pd, false)});
    DeviceTensor bwd_ws(gpu(), DType::f32, Shape{cudnn_attention_workspace_floats(pd, true, /*packed_rows=*/true)});
    const DeviceTensor seg = upload(segments_tensor(ids));
    const DeviceTable table = upload_table(ids, pd);
    const Tensor none;
    const double pairs = causal_pairs(ids, pd.seq, pd.n_heads);
    const double fwd_flops = 4.0 * pairs * pd.head_dim, bwd_flops = 10.0 * pairs * pd.head_dim;
    auto time_ms = [](const std::function<void()>& run) { return median_event_ms(run, 3); };
    struct Row {
      std::string name;
      double fwd, bwd;
    };
    std::vector<Row> rows;
    const double dense_fwd = time_ms([&] { gpu().attention_cudnn_forward(out, lse, q, k, v, none, RaggedAttention{}, fwd_ws, ud); });
    const double dense_bwd = time_ms([&] {
      gpu().attention_cudnn_backward(dq, dk, dv, delta, bwd_ws, d_out, out, lse, q, k, v, none, RaggedAttention{}, ud);
    });
    rows.push_back({"cudnn unpacked " + label(c.unpacked, DType::bf16), dense_fwd, dense_bwd});
    const std::vector<float> dense_out = out.floats();
    for (cuda::RaggedStats layout : {cuda::RaggedStats::token_major, cuda::RaggedStats::head_major}) {
      op().set_ragged_stats(layout);
      const cuda::CudnnStats before = op().stats();
      const auto t0 = std::chrono::steady_clock::now();
      gpu().attention_cudnn_forward(out, lse, q, k, v, seg, table.ragged, fwd_ws, pd);
      gpu().attention_cudnn_backward(dq, dk, dv, delta, bwd_ws, d_out, out, lse, q, k, v, seg, table.ragged, pd);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const double first_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      const cuda::CudnnStats built = op().stats();
      // The same work as the unpacked rows: the same outputs, up to summation order.
      expect_close(std::string("packed vs unpacked out ") + layout_name(layout), out.floats(), dense_out,
                   storage_tolerance(DType::bf16));
      const double fwd = time_ms([&] { gpu().attention_cudnn_forward(out, lse, q, k, v, seg, table.ragged, fwd_ws, pd); });
      const double bwd = time_ms([&] {
        gpu().attention_cudnn_backward(dq, dk, dv, delta, bwd_ws, d_out, out, lse, q, k, v, seg, table.ragged, pd);
      });
      const cuda::CudnnStats after = op().stats();
      EXPECT_EQ(after.refused, before.refused) << "cuDNN refused the packed rows " << layout_name(layout);
      std::printf("  GRAPHS cudnn ragged %s: %ld built in %.1f ms (first forward + backward call %.1f ms)\n",
                  layout_name(layout), static_cast<long>(built.graphs - before.graphs),
                  1e3 * (built.build_seconds - before.build_seconds), first_ms);
      rows.push_back({std::string("cudnn packed ") + layout_name(layout), fwd, bwd});
    }
    op().set_ragged_stats(cuda::RaggedStats::token_major);
    const double flash_fwd = time_ms([&] { gpu().attention_flash_forward(out, lse, q, k, v, seg, pd); });
    const double flash_bwd = time_ms([&] {
      gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, seg, pd);
    });
    rows.push_back({"memtune-flash packed", flash_fwd, flash_bwd});
    std::printf("TIMING attention packed %s (%zu samples) vs unpacked %s, causal within samples "
                "(median of 7), libcudnn %zu:\n",
                packed_label(c.packed, DType::bf16).c_str(), segment_spans(ids, pd.seq).size(),
                label(c.unpacked, DType::bf16).c_str(), cuda::cudnn_runtime_version());
    for (const Row& r : rows)
      std::printf("  %-40s fwd %8.3f ms %7.1f TFLOP/s | bwd %8.3f ms %7.1f TFLOP/s | fwd+bwd %7.1f "
                  "TFLOP/s = %.3fx unpacked%s\n",
                  r.name.c_str(), r.fwd, tflops(fwd_flops, r.fwd), r.bwd, tflops(bwd_flops, r.bwd),
                  tflops(fwd_flops + bwd_flops, r.fwd + r.bwd), (dense_fwd + dense_bwd) / (r.fwd + r.bwd),
                  r.name.rfind("cudnn packed", 0) == 0
                      ? ((dense_fwd + dense_bwd) / (r.fwd + r.bwd) >= 0.95 ? " (target >= 0.95x: met)"
                                                                          : " (target >= 0.95x: NOT met)")
                      : "");
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

}  // namespace
}  // namespace memtune::gputest
