// Eager and flash attention of the CUDA backend: against the CPU backend (same dtype), and, for
// the bf16 tensor-core flash kernels, against an fp32 reference with the error bound taken from
// flash-attention's tests: within 2x the error of a same-precision eager implementation, both
// measured against fp32. Both backward paths are checked for dq, dk and dv. Outputs are
// poisoned with NaN before each run. Last, a timing print (not an assertion).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>

#include "gpu_test_util.h"
#include "gpu_timing.h"
#include "memtune/ops/cuda/attention_flash.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "../support/attention_setup.h"

namespace memtune::gputest {
namespace {

using optest::random_tensor;

struct Config {
  int64_t batch, seq, heads, kv_heads, head_dim;
  bool segments;
  // q's values lie in [-q_range, q_range]: 1.5 gives scores of a few units; 8 gives rows whose
  // running max jumps by more than the forward's rescale slack (2^8) between key blocks.
  double q_range = 1.5;
};

std::string label(const Config& c, DType type) {
  return "b" + std::to_string(c.batch) + " s" + std::to_string(c.seq) + " h" +
         std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " d" +
         std::to_string(c.head_dim) + (c.segments ? " segs " : " ") +
         (c.q_range != 1.5 ? "q" + std::to_string(static_cast<int>(c.q_range)) + " " : "") +
         optest::dtype_label(type);
}

// Packed rows: segments of random lengths (1 to seq / 2) in each batch row.
HostTensor make_segments(const Config& c, std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(c.batch * c.seq));
  std::uniform_int_distribution<int64_t> length(1, std::max<int64_t>(1, c.seq / 2));
  for (int64_t b = 0; b < c.batch; ++b) {
    int32_t id = 0;
    for (int64_t s = 0; s < c.seq;) {
      const int64_t n = std::min(length(rng), c.seq - s);
      for (int64_t i = 0; i < n; ++i) ids[b * c.seq + s + i] = id;
      s += n;
      ++id;
    }
  }
  return optest::i32_tensor(Shape{c.batch * c.seq}, ids);
}

// Packed rows whose ids come back: runs of random length (1 to max_run) with ids
// sign * (run % cycle), so with cycle 3 a token also sees the earlier runs of its id, any number of
// blocks back (the CPU backend masks by id alone), and with sign -1 the ids fall. The kernels'
// block bounds must hold for any ids, not only for ids that never decrease along a row.
HostTensor make_cycling_segments(const Config& c, int64_t max_run, int32_t cycle, int32_t sign,
                                 std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(c.batch * c.seq));
  std::uniform_int_distribution<int64_t> length(1, max_run);
  for (int64_t b = 0; b < c.batch; ++b) {
    int32_t run = 0;
    for (int64_t s = 0; s < c.seq; ++run) {
      const int64_t n = std::min(length(rng), c.seq - s);
      for (int64_t i = 0; i < n; ++i) ids[b * c.seq + s + i] = sign * (run % cycle);
      s += n;
    }
  }
  return optest::i32_tensor(Shape{c.batch * c.seq}, ids);
}

struct Inputs {
  HostTensor q, k, v, d_out, segments;
};

Inputs make_inputs(const Config& c, DType type, std::mt19937_64& rng) {
  const int64_t n = c.batch * c.seq;
  Inputs in;
  // Scores of a few units: the softmax is neither flat nor one-hot.
  in.q = random_tensor(type, Shape{n, c.heads * c.head_dim}, rng, -c.q_range, c.q_range);
  in.k = random_tensor(type, Shape{n, c.kv_heads * c.head_dim}, rng, -1.5, 1.5);
  in.v = random_tensor(type, Shape{n, c.kv_heads * c.head_dim}, rng);
  in.d_out = random_tensor(type, Shape{n, c.heads * c.head_dim}, rng);
  if (c.segments) in.segments = make_segments(c, rng);
  return in;
}

struct Grads {
  std::vector<float> out, dq, dk, dv;
};

class CudaAttentionTest : public CudaTest {
 protected:
  Tensor segments_of(const Inputs& in, DeviceTensor& holder) {
    if (in.segments.storage.empty()) return Tensor{};
    holder = upload(in.segments);
    return holder;
  }

  Grads gpu_flash(const Config& c, const Inputs& in) {
    const AttentionDims dims = test::attention_dims_of(c);
    const DType type = in.q.dtype;
    DeviceTensor q = upload(in.q), k = upload(in.k), v = upload(in.v), d_out = upload(in.d_out);
    DeviceTensor seg_holder;
    const Tensor seg = segments_of(in, seg_holder);
    DeviceTensor out = poisoned(type, in.q.shape), lse = poisoned(DType::f32, Shape{c.batch * c.heads * c.seq});
    gpu().attention_flash_forward(out, lse, q, k, v, seg, dims);
    DeviceTensor dq = poisoned(type, in.q.shape), dk = poisoned(type, in.k.shape), dv = poisoned(type, in.k.shape);
    DeviceTensor delta = poisoned(DType::f32, Shape{c.batch * c.heads * c.seq});
    DeviceTensor dq_accum = poisoned(DType::f32, in.q.shape);
    gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, seg, dims);
    return Grads{out.floats(), dq.floats(), dk.floats(), dv.floats()};
  }

  Grads gpu_eager(const Config& c, const Inputs& in) {
    const AttentionDims dims = test::attention_dims_of(c);
    const DType type = in.q.dtype;
    DeviceTensor q = upload(in.q), k = upload(in.k), v = upload(in.v), d_out = upload(in.d_out);
    DeviceTensor seg_holder;
    const Tensor seg = segments_of(in, seg_holder);
    const Shape matrix{c.batch, c.heads, c.seq, c.seq};
    DeviceTensor out = poisoned(type, in.q.shape), probs = poisoned(type, matrix), scores = poisoned(type, matrix);
    gpu().attention_eager_forward(out, probs, scores, q, k, v, seg, dims);
    DeviceTensor dq = poisoned(type, in.q.shape), dk = poisoned(type, in.k.shape), dv = poisoned(type, in.k.shape);
    gpu().attention_eager_backward(dq, dk, dv, scores, d_out, probs, q, k, v, seg, dims);
    return Grads{out.floats(), dq.floats(), dk.floats(), dv.floats()};
  }

  Grads cpu_attention(const Config& c, const Inputs& in, bool flash) {
    const AttentionDims dims = test::attention_dims_of(c);
    const DType type = in.q.dtype;
    const Tensor seg = in.segments.storage.empty() ? Tensor{} : in.segments.tensor();
    HostTensor out(type, in.q.shape), dq(type, in.q.shape), dk(type, in.k.shape), dv(type, in.k.shape);
    if (flash) {
      HostTensor lse(DType::f32, Shape{c.batch * c.heads * c.seq}), delta = lse;
      HostTensor dq_accum(DType::f32, in.q.shape);
      cpu().attention_flash_forward(out, lse, in.q, in.k, in.v, seg, dims);
      cpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, in.d_out, out, lse, in.q, in.k,
                                     in.v, seg, dims);
    } else {
      const Shape matrix{c.batch, c.heads, c.seq, c.seq};
      HostTensor probs(type, matrix), scratch(type, matrix);
      cpu().attention_eager_forward(out, probs, scratch, in.q, in.k, in.v, seg, dims);
      cpu().attention_eager_backward(dq, dk, dv, scratch, in.d_out, probs, in.q, in.k, in.v, seg,
                                     dims);
    }
    return Grads{out.floats(), dq.floats(), dk.floats(), dv.floats()};
  }

  void expect_grads_close(const std::string& what, const Grads& g, const Grads& ref, double tol) {
    expect_close(what + " out", g.out, ref.out, tol);
    expect_close(what + " dq", g.dq, ref.dq, tol);
    expect_close(what + " dk", g.dk, ref.dk, tol);
    expect_close(what + " dv", g.dv, ref.dv, tol);
  }
};

Inputs upcast(const Inputs& in) {
  Inputs up;
  up.q = optest::converted(in.q, DType::f32);
  up.k = optest::converted(in.k, DType::f32);
  up.v = optest::converted(in.v, DType::f32);
  up.d_out = optest::converted(in.d_out, DType::f32);
  up.segments = in.segments;
  return up;
}

// Same-dtype comparisons against the CPU backend (generic kernels for f32 and odd head_dims,
// tensor-core kernels for bf16/f16 at 64/128).
TEST_F(CudaAttentionTest, FlashAndEagerMatchCpu) {
  const Config configs[] = {
      {1, 1, 4, 1, 64, false},  {2, 17, 4, 1, 64, false},  {1, 17, 8, 8, 128, false},
      {2, 100, 8, 2, 128, true}, {1, 130, 8, 1, 64, true},  {1, 33, 2, 1, 16, false},
      {2, 40, 4, 2, 24, true},  {1, 50, 4, 4, 32, false},  {1, 1000, 4, 1, 64, false},
      {1, 300, 8, 1, 128, false},  {1, 300, 4, 2, 128, false, 8.0}, {1, 200, 4, 4, 64, true, 8.0},
      // A long packed row: the tensor-core kernels skip the blocks before a query block's
      // earliest sample start (forward) and after a key block's latest sample end (backward).
      {1, 2600, 2, 1, 128, true}};
  for (const Config& c : configs)
    for (DType type : {DType::f32, DType::bf16, DType::f16}) {
      if (type == DType::f16 && c.head_dim != 64 && c.head_dim != 128) continue;
      const Inputs in = make_inputs(c, type, rng_);
      const double tol = type == DType::f32 ? 1e-4 : storage_tolerance(type);
      expect_grads_close("flash " + label(c, type), gpu_flash(c, in), cpu_attention(c, in, true), tol);
      if (c.seq <= 300)
        expect_grads_close("eager " + label(c, type), gpu_eager(c, in), cpu_attention(c, in, false),
                           type == DType::f32 ? 1e-4 : 2 * storage_tolerance(type));
    }
}

// Packed rows whose segment ids come back or fall (make_cycling_segments), at odd lengths, both
// head_dims and both 16-bit dtypes (the tensor-core kernels), forward and backward against the
// CPU backend: the blocks that the kernels skip on packed rows must be exactly ones that no
// (query, key) pair of the tile sees.
TEST_F(CudaAttentionTest, FlashMatchesCpuWhenSegmentIdsComeBack) {
  struct Case {
    Config config;
    int64_t max_run;
    int32_t cycle, sign;
  };
  const Case cases[] = {
      {{1, 1999, 4, 2, 128, true}, 40, 3, 1},   // short runs: blocks hold all three ids
      {{2, 1337, 2, 1, 64, true}, 450, 3, 1},   // an id comes back after blocks without it
      {{1, 2601, 2, 1, 128, true}, 900, 3, 1},  // the same, a few runs per row
      {{1, 777, 4, 1, 64, true}, 200, 1 << 30, -1}};  // falling ids, none comes back
  for (const Case& k : cases)
    for (DType type : {DType::bf16, DType::f16}) {
      Inputs in = make_inputs(k.config, type, rng_);
      in.segments = make_cycling_segments(k.config, k.max_run, k.cycle, k.sign, rng_);
      const std::string what = "flash ids cycle " + std::to_string(k.cycle) + " sign " +
                               std::to_string(k.sign) + " runs <= " + std::to_string(k.max_run) +
                               " " + label(k.config, type);
      expect_grads_close(what, gpu_flash(k.config, in), cpu_attention(k.config, in, true),
                         storage_tolerance(type));
    }
}

// bf16 tensor-core flash against fp32, with the bound of 2x the bf16 eager error. The fp32
// reference is the CUDA backend's f32 flash path (checked against the CPU above), which keeps
// seq 4096 affordable.
TEST_F(CudaAttentionTest, Bf16FlashWithinTwiceEagerError) {
  const Config configs[] = {{2, 17, 8, 2, 64, false},   {1, 1000, 8, 1, 128, false},
                            {1, 1000, 8, 8, 64, true},  {1, 4096, 4, 1, 128, false},
                            {1, 4096, 8, 1, 64, false}, {2, 257, 32, 4, 128, true},
                            {1, 1000, 8, 2, 128, false, 8.0}, {2, 300, 4, 4, 64, true, 8.0}};
  for (const Config& c : configs) {
    const Inputs in = make_inputs(c, DType::bf16, rng_);
    {
      DeviceTensor q = upload(in.q), k = upload(in.k), v = upload(in.v);
      cuda::AttentionParams p;
      p.head_dim = c.head_dim;
      p.batch = c.batch;
      p.n_heads = c.heads;
      cuda::FlashTensors t;
      t.q = q.tensor().data;
      t.k = k.tensor().data;
      t.v = v.tensor().data;
      t.d_out = t.q;
      t.q_type = t.k_type = t.v_type = t.d_out_type = DType::bf16;
      ASSERT_TRUE(cuda::attention_flash_uses_tensor_cores(p, t, true)) << label(c, DType::bf16);
    }
    const Grads reference = gpu_flash(c, upcast(in));
    const Grads flash = gpu_flash(c, in);
    const Grads eager = gpu_eager(c, in);
    auto check = [&](const char* name, const std::vector<float>& f, const std::vector<float>& e,
                     const std::vector<float>& r) {
      const double flash_error = optest::norm_rel_error(f, optest::to_double(r));
      const double eager_error = optest::norm_rel_error(e, optest::to_double(r));
      EXPECT_TRUE(all_finite(f)) << name;
      EXPECT_LE(flash_error, 2 * eager_error + 1e-5)
          << label(c, DType::bf16) << " " << name << ": flash " << flash_error << " eager "
          << eager_error;
      EXPECT_LT(flash_error, 1e-2) << label(c, DType::bf16) << " " << name;
      std::printf("  %-32s %-3s flash %.2e  eager %.2e\n", label(c, DType::bf16).c_str(), name,
                  flash_error, eager_error);
    };
    check("out", flash.out, eager.out, reference.out);
    check("dq", flash.dq, eager.dq, reference.dq);
    check("dk", flash.dk, eager.dk, reference.dk);
    check("dv", flash.dv, eager.dv, reference.dv);
  }
}

// A timing print, not a test of anything: flash vs eager, forward and backward, at the seed
// run's attention shape (seq 2048, 32 heads / 8 kv heads, head_dim 128, bf16, batch 8).
TEST_F(CudaAttentionTest, TimingPrintFlashVsEager) {
  const Config c{8, 2048, 32, 8, 128, false};
  const AttentionDims dims = test::attention_dims_of(c);
  const Inputs in = make_inputs(c, DType::bf16, rng_);
  DeviceTensor q = upload(in.q), k = upload(in.k), v = upload(in.v), d_out = upload(in.d_out);
  DeviceTensor out(gpu(), DType::bf16, in.q.shape), lse(gpu(), DType::f32, Shape{c.batch * c.heads * c.seq});
  DeviceTensor dq(gpu(), DType::bf16, in.q.shape), dk(gpu(), DType::bf16, in.k.shape), dv(gpu(), DType::bf16, in.k.shape);
  DeviceTensor delta(gpu(), DType::f32, Shape{c.batch * c.heads * c.seq}), dq_accum(gpu(), DType::f32, in.q.shape);
  const Shape matrix{c.batch, c.heads, c.seq, c.seq};
  DeviceTensor probs(gpu(), DType::bf16, matrix), scores(gpu(), DType::bf16, matrix);

  const auto time_ms = [](const std::function<void()>& run) { return median_event_ms(run); };
  const Tensor none;
  const double flash_fwd = time_ms([&] { gpu().attention_flash_forward(out, lse, q, k, v, none, dims); });
  const double flash_bwd = time_ms([&] {
    gpu().attention_flash_backward(dq, dk, dv, delta, dq_accum, d_out, out, lse, q, k, v, none, dims);
  });
  const double eager_fwd = time_ms([&] { gpu().attention_eager_forward(out, probs, scores, q, k, v, none, dims); });
  const double eager_bwd = time_ms([&] {
    gpu().attention_eager_backward(dq, dk, dv, scores, d_out, probs, q, k, v, none, dims);
  });
  // Causal FLOPs (half the S x S products): forward 2 GEMMs, backward 5 (FA2's count).
  const double pairs = static_cast<double>(c.batch) * c.heads * c.seq * c.seq / 2.0;
  const double fwd_flops = 4.0 * pairs * c.head_dim, bwd_flops = 10.0 * pairs * c.head_dim;
  auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
  std::printf("TIMING attention b8 s2048 h32/8 d128 bf16 causal (median of 7):\n");
  std::printf("  flash fwd %8.3f ms %7.1f TFLOP/s | bwd %8.3f ms %7.1f TFLOP/s | fwd+bwd %7.1f TFLOP/s\n",
              flash_fwd, tflops(fwd_flops, flash_fwd), flash_bwd, tflops(bwd_flops, flash_bwd),
              tflops(fwd_flops + bwd_flops, flash_fwd + flash_bwd));
  std::printf("  eager fwd %8.3f ms %7.1f TFLOP/s | bwd %8.3f ms %7.1f TFLOP/s | fwd+bwd %7.1f TFLOP/s\n",
              eager_fwd, tflops(fwd_flops, eager_fwd), eager_bwd, tflops(bwd_flops, eager_bwd),
              tflops(fwd_flops + bwd_flops, eager_fwd + eager_bwd));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// A timing print of the default flash forward and forward v2's variants (FlashVersions) at the
// same shape, each one's output also held against the default's (they differ only in rounding).
TEST_F(CudaAttentionTest, TimingPrintFlashForwardVariants) {
  const Config c{8, 2048, 32, 8, 128, false};
  const AttentionDims dims = test::attention_dims_of(c);
  const Inputs in = make_inputs(c, DType::bf16, rng_);
  DeviceTensor q = upload(in.q), k = upload(in.k), v = upload(in.v);
  DeviceTensor out(gpu(), DType::bf16, in.q.shape), lse(gpu(), DType::f32, Shape{c.batch * c.heads * c.seq});
  const Tensor none;
  const cuda::FlashVersions defaults = cuda::flash_versions();
  gpu().attention_flash_forward(out, lse, q, k, v, none, dims);
  const std::vector<float> reference = out.floats();
  struct Variant {
    const char* name;
    cuda::FlashVersions versions;
  };
  std::vector<Variant> variants;
  // Every variant but the default is forward v2's (the Hopper forward, where the device and the
  // build have it, is the default's).
  auto add = [&](const char* name, auto change) {
    cuda::FlashVersions versions = defaults;
    versions.forward_hopper = false;
    change(versions);
    variants.push_back({name, versions});
  };
  variants.push_back({"default", defaults});
  add("v2", [](cuda::FlashVersions&) {});
  add("keys32", [](cuda::FlashVersions& v) { v.forward_keys = 32; });
  add("keys64", [](cuda::FlashVersions& v) { v.forward_keys = 64; });
  add("keys32 rescale-always", [](cuda::FlashVersions& v) { v.forward_keys = 32; v.forward_rescale_always = true; });
  add("keys64 rescale-always", [](cuda::FlashVersions& v) { v.forward_keys = 64; v.forward_rescale_always = true; });
  add("keys32 slack0", [](cuda::FlashVersions& v) { v.forward_keys = 32; v.forward_rescale_slack = 0; });
  add("keys64 slack0", [](cuda::FlashVersions& v) { v.forward_keys = 64; v.forward_rescale_slack = 0; });
  add("keys32 slack8", [](cuda::FlashVersions& v) { v.forward_keys = 32; v.forward_rescale_slack = 8; });
  add("keys64 slack8", [](cuda::FlashVersions& v) { v.forward_keys = 64; v.forward_rescale_slack = 8; });
  add("keys32 grid-per-head", [](cuda::FlashVersions& v) { v.forward_keys = 32; v.forward_grid_per_head = true; });
  add("keys64 grid-per-head", [](cuda::FlashVersions& v) { v.forward_keys = 64; v.forward_grid_per_head = true; });
  const double fwd_flops = 4.0 * static_cast<double>(c.batch) * c.heads * c.seq * c.seq / 2.0 * c.head_dim;
  std::printf("TIMING flash forward variants b8 s2048 h32/8 d128 bf16 causal (median of 7):\n");
  for (const Variant& variant : variants) {
    cuda::set_flash_versions(variant.versions);
    const double ms = median_event_ms([&] { gpu().attention_flash_forward(out, lse, q, k, v, none, dims); });
    // expect_close's double copies of 67M values would take longer than the timing.
    const std::vector<float> result = out.floats();
    double difference = 0.0, norm = 0.0;
    bool finite = true;
    for (size_t i = 0; i < result.size(); ++i) {
      finite = finite && std::isfinite(result[i]);
      difference += (static_cast<double>(result[i]) - reference[i]) * (result[i] - reference[i]);
      norm += static_cast<double>(reference[i]) * reference[i];
    }
    EXPECT_TRUE(finite) << variant.name;
    EXPECT_LT(std::sqrt(difference / norm), storage_tolerance(DType::bf16)) << variant.name;
    std::printf("  %-24s fwd %8.3f ms %7.1f TFLOP/s\n", variant.name, ms, fwd_flops / (ms * 1e-3) / 1e12);
  }
  // Packed rows (four 512-token documents per row): the default forward, and forward v2's
  // kSegments kernels at 64 keys and 32.
  std::vector<int32_t> ids(static_cast<size_t>(c.batch * c.seq));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % c.seq / 512);
  DeviceTensor segments = upload(optest::i32_tensor(Shape{c.batch * c.seq}, ids));
  const double packed_flops = fwd_flops / 4;  // each document is a causal 512 x 512 block
  {
    cuda::set_flash_versions(defaults);  // the Hopper forward, where the device and build have it
    const double ms = median_event_ms([&] { gpu().attention_flash_forward(out, lse, q, k, v, segments, dims); });
    std::printf("  segments 4x512 default     fwd %8.3f ms %7.1f TFLOP/s (useful FLOPs)\n", ms,
                packed_flops / (ms * 1e-3) / 1e12);
  }
  for (const int keys : {64, 32}) {
    cuda::FlashVersions versions = defaults;
    versions.forward_hopper = false;
    versions.forward_keys = keys;
    cuda::set_flash_versions(versions);
    const double ms = median_event_ms([&] { gpu().attention_flash_forward(out, lse, q, k, v, segments, dims); });
    std::printf("  segments 4x512 keys%-8d fwd %8.3f ms %7.1f TFLOP/s (useful FLOPs)\n", keys, ms,
                packed_flops / (ms * 1e-3) / 1e12);
  }
  cuda::set_flash_versions(defaults);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace memtune::gputest
