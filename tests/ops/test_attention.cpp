// Causal GQA attention, eager and flash, against a naive double implementation that builds the
// full score matrix: outputs, saved probs / lse, and all three gradients; finite differences;
// eager == flash (with and without segments); packed segments == separate runs; bf16/f16
// storage within the error budget of the same-precision eager path (the flash-attention rule).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "memtune/ops/backend.h"
#include "op_test_util.h"
#include "../support/attention_setup.h"

using namespace memtune;
using namespace memtune::optest;

namespace {

struct AttentionCase {
  int64_t batch, seq, heads, kv_heads, head_dim;
  bool segmented;
};

std::string label(const AttentionCase& c) {
  return fmt::format("b{} s{} h{} kv{} d{}{}", c.batch, c.seq, c.heads, c.kv_heads, c.head_dim,
                     c.segmented ? " segmented" : "");
}

// Seq 1 and 17, head_dim 8/16/24, GQA ratios 1, 2 and 4, sequences longer than the flash
// blocks (32 queries x 16 keys) with ragged tails.
const AttentionCase kCases[] = {
    {1, 1, 1, 1, 8, false},  {2, 17, 4, 2, 16, false}, {2, 17, 4, 2, 16, true},
    {1, 33, 4, 1, 24, true}, {2, 70, 2, 2, 8, true},   {1, 17, 4, 4, 16, false},
    {1, 50, 8, 2, 8, false}, {3, 1, 2, 1, 8, true},    {1, 100, 4, 2, 24, true},
};

// Contiguous segments of random lengths per row (packed sequences), some of length 1.
std::vector<int32_t> random_segments(int64_t batch, int64_t seq, std::mt19937_64& rng) {
  std::vector<int32_t> ids;
  std::uniform_int_distribution<int64_t> length_dist(1, std::max<int64_t>(1, seq / 3));
  for (int64_t b = 0; b < batch; ++b) {
    int32_t id = static_cast<int32_t>(100 * b);
    for (int64_t filled = 0; filled < seq; ++id) {
      const int64_t length = std::min(seq - filled, length_dist(rng));
      for (int64_t i = 0; i < length; ++i) ids.push_back(id);
      filled += length;
    }
  }
  return ids;
}

struct AttentionInputs {
  AttentionDims dims;
  HostTensor q, k, v, d_out, segments;
  std::vector<int32_t> segment_ids;  // empty: none

  Tensor segments_tensor() const { return segment_ids.empty() ? no_tensor() : segments.tensor(); }
};

AttentionInputs random_inputs(const AttentionCase& c, DType dtype, std::mt19937_64& rng) {
  AttentionInputs in;
  in.dims = test::attention_dims_of(c);
  const int64_t n = c.batch * c.seq;
  // Spread 2: scores of a few units, so the softmax is far from uniform.
  in.q = random_tensor(dtype, {n, c.heads * c.head_dim}, rng, -2.0f, 2.0f);
  in.k = random_tensor(dtype, {n, c.kv_heads * c.head_dim}, rng, -2.0f, 2.0f);
  in.v = random_tensor(dtype, {n, c.kv_heads * c.head_dim}, rng);
  in.d_out = random_tensor(dtype, {n, c.heads * c.head_dim}, rng);
  if (c.segmented) {
    in.segment_ids = random_segments(c.batch, c.seq, rng);
    in.segments = i32_tensor({n}, in.segment_ids);
  }
  return in;
}

AttentionInputs converted_inputs(const AttentionInputs& in, DType dtype) {
  AttentionInputs out = in;
  out.q = converted(in.q, dtype);
  out.k = converted(in.k, dtype);
  out.v = converted(in.v, dtype);
  out.d_out = converted(in.d_out, dtype);
  return out;
}

struct NaiveAttention {
  std::vector<double> out, probs, lse, dq, dk, dv;
};

// Attention with the full [seq, seq] matrices in double, from the stored input values.
NaiveAttention naive_attention(const AttentionInputs& in) {
  const AttentionDims& d = in.dims;
  const std::vector<float> q = in.q.floats(), k = in.k.floats(), v = in.v.floats(),
                           d_out = in.d_out.floats();
  const int64_t S = d.seq, D = d.head_dim, H = d.n_heads, KV = d.n_kv_heads;
  NaiveAttention r;
  r.out.assign(q.size(), 0.0);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(k.size(), 0.0);
  r.probs.assign(d.batch * H * S * S, 0.0);
  r.lse.assign(d.batch * H * S, 0.0);
  auto q_at = [&](int64_t b, int64_t h, int64_t i) { return ((b * S + i) * H + h) * D; };
  auto k_at = [&](int64_t b, int64_t g, int64_t j) { return ((b * S + j) * KV + g) * D; };
  auto visible = [&](int64_t b, int64_t i, int64_t j) {
    return j <= i && (in.segment_ids.empty() || in.segment_ids[b * S + i] == in.segment_ids[b * S + j]);
  };
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / d.group();
      std::vector<double> p(S * S, 0.0), dp(S * S, 0.0);
      for (int64_t i = 0; i < S; ++i) {
        std::vector<double> s(S, -INFINITY);
        double max_score = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          if (!visible(b, i, j)) continue;
          double dot = 0.0;
          for (int64_t c = 0; c < D; ++c) dot += double(q[q_at(b, h, i) + c]) * k[k_at(b, g, j) + c];
          s[j] = dot * d.scale;
          max_score = std::max(max_score, s[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j < S; ++j)
          if (visible(b, i, j)) sum += std::exp(s[j] - max_score);
        r.lse[(b * H + h) * S + i] = max_score + std::log(sum);
        for (int64_t j = 0; j < S; ++j) {
          if (!visible(b, i, j)) continue;
          p[i * S + j] = std::exp(s[j] - max_score) / sum;
          r.probs[((b * H + h) * S + i) * S + j] = p[i * S + j];
          for (int64_t c = 0; c < D; ++c) r.out[q_at(b, h, i) + c] += p[i * S + j] * v[k_at(b, g, j) + c];
        }
        // Backward of the row.
        double row_dot = 0.0;
        for (int64_t j = 0; j < S; ++j) {
          if (!visible(b, i, j)) continue;
          double value = 0.0;
          for (int64_t c = 0; c < D; ++c) value += double(d_out[q_at(b, h, i) + c]) * v[k_at(b, g, j) + c];
          dp[i * S + j] = value;
          row_dot += value * p[i * S + j];
        }
        for (int64_t j = 0; j < S; ++j) {
          if (!visible(b, i, j)) continue;
          const double ds = p[i * S + j] * (dp[i * S + j] - row_dot) * d.scale;
          for (int64_t c = 0; c < D; ++c) {
            r.dq[q_at(b, h, i) + c] += ds * k[k_at(b, g, j) + c];
            r.dk[k_at(b, g, j) + c] += ds * q[q_at(b, h, i) + c];
            r.dv[k_at(b, g, j) + c] += p[i * S + j] * d_out[q_at(b, h, i) + c];
          }
        }
      }
    }
  return r;
}

struct AttentionResult {
  HostTensor out, probs, lse, dq, dk, dv;
};

// Forward then (unless forward_only) backward, outputs and scratch in the inputs' dtype (as the
// step stores them).
AttentionResult run_eager(Backend& backend, const AttentionInputs& in, bool forward_only = false) {
  const AttentionDims& d = in.dims;
  const DType dtype = in.q.dtype;
  const Shape matrix{d.batch, d.n_heads, d.seq, d.seq};
  AttentionResult r;
  r.out = HostTensor(dtype, in.q.shape);
  r.probs = HostTensor(dtype, matrix);
  HostTensor scores(dtype, matrix), dprobs(dtype, matrix);
  backend.attention_eager_forward(r.out, r.probs, scores, in.q, in.k, in.v, in.segments_tensor(), d);
  if (forward_only) return r;
  r.dq = HostTensor(dtype, in.q.shape);
  r.dk = HostTensor(dtype, in.k.shape);
  r.dv = HostTensor(dtype, in.k.shape);
  backend.attention_eager_backward(r.dq, r.dk, r.dv, dprobs, in.d_out, r.probs, in.q, in.k, in.v,
                                   in.segments_tensor(), d);
  return r;
}

AttentionResult run_flash(Backend& backend, const AttentionInputs& in, bool forward_only = false) {
  const AttentionDims& d = in.dims;
  const DType dtype = in.q.dtype;
  AttentionResult r;
  r.out = HostTensor(dtype, in.q.shape);
  r.lse = HostTensor(DType::f32, {d.batch, d.n_heads, d.seq});
  backend.attention_flash_forward(r.out, r.lse, in.q, in.k, in.v, in.segments_tensor(), d);
  if (forward_only) return r;
  r.dq = HostTensor(dtype, in.q.shape);
  r.dk = HostTensor(dtype, in.k.shape);
  r.dv = HostTensor(dtype, in.k.shape);
  HostTensor delta(DType::f32, {d.batch, d.n_heads, d.seq});
  HostTensor dq_accum(DType::f32, in.q.shape);
  backend.attention_flash_backward(r.dq, r.dk, r.dv, delta, dq_accum, in.d_out, r.out, r.lse,
                                   in.q, in.k, in.v, in.segments_tensor(), d);
  return r;
}

// Every case of kCases through eager (with its probs) or flash (with its lse) attention against
// the naive reference, to fp32 rounding; `seed` draws the inputs.
void expect_every_case_matches_naive(bool flash, uint64_t seed) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(seed);
  for (const AttentionCase& c : kCases) {
    const AttentionInputs in = random_inputs(c, DType::f32, rng);
    const NaiveAttention expected = naive_attention(in);
    const AttentionResult got = flash ? run_flash(*backend, in) : run_eager(*backend, in);
    EXPECT_LT(scaled_error(got.out.floats(), expected.out), 1e-5) << label(c);
    if (flash) {
      EXPECT_LT(max_abs_error(got.lse.floats(), expected.lse), 1e-5) << label(c);
    } else {
      EXPECT_LT(max_abs_error(got.probs.floats(), expected.probs), 1e-6) << label(c);
    }
    EXPECT_LT(scaled_error(got.dq.floats(), expected.dq), 1e-5) << label(c);
    EXPECT_LT(scaled_error(got.dk.floats(), expected.dk), 1e-5) << label(c);
    EXPECT_LT(scaled_error(got.dv.floats(), expected.dv), 1e-5) << label(c);
  }
}

}  // namespace

TEST(CpuAttention, EagerMatchesNaive) { expect_every_case_matches_naive(/*flash=*/false, 31); }

TEST(CpuAttention, FlashMatchesNaive) { expect_every_case_matches_naive(/*flash=*/true, 32); }

TEST(CpuAttention, EagerEqualsFlashAtFp32) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(33);
  for (const AttentionCase& c : kCases) {
    const AttentionInputs in = random_inputs(c, DType::f32, rng);
    const AttentionResult eager = run_eager(*backend, in);
    const AttentionResult flash = run_flash(*backend, in);
    EXPECT_LT(scaled_error(flash.out.floats(), eager.out.floats()), 2e-6) << label(c);
    EXPECT_LT(scaled_error(flash.dq.floats(), eager.dq.floats()), 2e-6) << label(c);
    EXPECT_LT(scaled_error(flash.dk.floats(), eager.dk.floats()), 2e-6) << label(c);
    EXPECT_LT(scaled_error(flash.dv.floats(), eager.dv.floats()), 2e-6) << label(c);
  }
}

TEST(CpuAttention, GradientsMatchFiniteDifferences) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(34);
  for (const AttentionCase& c : {AttentionCase{1, 9, 4, 2, 8, true}, AttentionCase{2, 5, 2, 1, 8, false},
                                 AttentionCase{1, 20, 4, 1, 16, true}}) {
    AttentionInputs in = random_inputs(c, DType::f32, rng);
    const std::vector<float> weights = in.d_out.floats();  // the objective is sum(out * d_out)
    for (bool flash : {false, true}) {
      const AttentionResult grads = flash ? run_flash(*backend, in) : run_eager(*backend, in);
      auto objective = [&] {
        const AttentionResult forward =
            flash ? run_flash(*backend, in, true) : run_eager(*backend, in, true);
        return weighted_sum(forward.out, weights);
      };
      const std::string what = label(c) + (flash ? " flash " : " eager ");
      expect_gradient_matches(what + "dq", grads.dq.floats(), in.q, objective,
                              indices_to_check(in.q.numel(), 150, rng));
      expect_gradient_matches(what + "dk", grads.dk.floats(), in.k, objective,
                              indices_to_check(in.k.numel(), 150, rng));
      expect_gradient_matches(what + "dv", grads.dv.floats(), in.v, objective,
                              indices_to_check(in.v.numel(), 150, rng));
    }
  }
}

// A packed row with segments gives, segment by segment, what running each segment alone gives.
TEST(CpuAttention, SegmentsEqualSeparateRuns) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(35);
  const AttentionCase c{2, 45, 4, 2, 16, true};
  const AttentionInputs packed = random_inputs(c, DType::f32, rng);
  const int64_t q_width = c.heads * c.head_dim, kv_width = c.kv_heads * c.head_dim;
  for (bool flash : {false, true}) {
    const AttentionResult whole = flash ? run_flash(*backend, packed) : run_eager(*backend, packed);
    const std::vector<float> out = whole.out.floats(), dq = whole.dq.floats(),
                             dk = whole.dk.floats(), dv = whole.dv.floats();
    int segments_checked = 0;
    for (int64_t start = 0; start < c.batch * c.seq;) {
      int64_t end = start + 1;
      while (end < c.batch * c.seq && end % c.seq != 0 &&
             packed.segment_ids[end] == packed.segment_ids[start])
        ++end;
      const int64_t length = end - start;
      auto rows = [&](const HostTensor& t, int64_t width) {
        const std::vector<float> all = t.floats();
        return tensor_from(DType::f32, {length, width},
                           std::vector<float>(all.begin() + start * width, all.begin() + end * width));
      };
      AttentionInputs alone;
      alone.dims = packed.dims;
      alone.dims.batch = 1;
      alone.dims.seq = length;
      alone.q = rows(packed.q, q_width);
      alone.k = rows(packed.k, kv_width);
      alone.v = rows(packed.v, kv_width);
      alone.d_out = rows(packed.d_out, q_width);
      const AttentionResult part = flash ? run_flash(*backend, alone) : run_eager(*backend, alone);
      auto slice = [&](const std::vector<float>& all, int64_t width) {
        return std::vector<float>(all.begin() + start * width, all.begin() + end * width);
      };
      // Flash tiles the segment differently from the packed row (other sums in other orders),
      // so it agrees to fp32 rounding; eager adds exact zeros for the other segments' keys.
      const double tolerance = flash ? 2e-6 : 0.0;
      const std::string what = std::string(flash ? "flash" : "eager") + " segment at " +
                               std::to_string(start) + " length " + std::to_string(length);
      EXPECT_LE(scaled_error(slice(out, q_width), part.out.floats()), tolerance) << what;
      EXPECT_LE(scaled_error(slice(dq, q_width), part.dq.floats()), tolerance) << what;
      EXPECT_LE(scaled_error(slice(dk, kv_width), part.dk.floats()), tolerance) << what;
      EXPECT_LE(scaled_error(slice(dv, kv_width), part.dv.floats()), tolerance) << what;
      ++segments_checked;
      start = end;
    }
    EXPECT_GT(segments_checked, 4);
  }
}

// bf16/f16 storage, measured against the double result on the same rounded inputs. Flash keeps
// everything but the outputs in fp32, so it must be within 2x the error of the eager path in the
// same precision (which also rounds scores, probs and dprobs), as flash-attention's tests require;
// both must stay within a few roundings of the output's dtype.
TEST(CpuAttention, LowPrecisionWithinRoundingBudget) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(36);
  for (DType dtype : {DType::bf16, DType::f16})
    for (const AttentionCase& c : {AttentionCase{2, 17, 4, 2, 16, true}, AttentionCase{1, 70, 4, 1, 24, false},
                                   AttentionCase{1, 40, 8, 2, 8, true}}) {
      const AttentionInputs in = random_inputs(c, dtype, rng);
      const NaiveAttention expected = naive_attention(in);
      const AttentionResult eager = run_eager(*backend, in);
      const AttentionResult flash = run_flash(*backend, in);
      const double u = unit_roundoff(dtype);
      const std::string what = label(c) + " " + dtype_label(dtype);
      struct Output {
        const char* name;
        const HostTensor& eager;
        const HostTensor& flash;
        const std::vector<double>& expected;
      };
      const Output outputs[] = {{"out", eager.out, flash.out, expected.out},
                                {"dq", eager.dq, flash.dq, expected.dq},
                                {"dk", eager.dk, flash.dk, expected.dk},
                                {"dv", eager.dv, flash.dv, expected.dv}};
      for (const Output& o : outputs) {
        const double eager_error = scaled_error(o.eager.floats(), o.expected);
        const double flash_error = scaled_error(o.flash.floats(), o.expected);
        EXPECT_LE(flash_error, std::max(2.0 * eager_error, 2.0 * u)) << what << " " << o.name;
        EXPECT_LT(flash_error, 3.0 * u) << what << " " << o.name;
        EXPECT_LT(eager_error, 6.0 * u) << what << " " << o.name;
      }
    }
}

// Times forward + backward at the tiny model's attention shape (printed, not asserted).
TEST(CpuAttention, ThroughputReport) {
  auto backend = make_cpu_backend();
  std::mt19937_64 rng(37);
  const AttentionCase c{2, 512, 4, 2, 32, true};
  const AttentionInputs in = random_inputs(c, DType::f32, rng);
  for (bool flash : {false, true}) {
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      const AttentionResult r = flash ? run_flash(*backend, in) : run_eager(*backend, in);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::printf("[ attention] %s b2 s512 h4 kv2 d32 forward+backward %.1f ms\n",
                flash ? "flash" : "eager", best * 1e3);
  }
}
