// The CPU reference backend: the oracle that every CUDA kernel is checked against.
//
// Every op loads its float inputs as fp32 (whatever the storage dtype: f32, bf16 or f16), does
// all of its math in fp32 and rounds once when it stores an output, as backend.h specifies. The
// one documented exception is rmsnorm_forward, which rounds twice as HF's LlamaRMSNorm does.
// Work is split over rows, tiles or (batch, head) pairs with OpenMP where that pays; every split
// keeps the order of each reduction fixed, so results do not depend on the thread count.
//
// The ops are defined one family per file: cpu_backend.cpp (memory, elementwise, sum_squares),
// matmul.cpp, embedding.cpp, norm.cpp, rope.cpp, swiglu.cpp, attention_eager.cpp,
// attention_flash.cpp, attention_decode.cpp, cross_entropy.cpp, dropout.cpp, adamw.cpp.
#pragma once

#include <cstdint>
#include <string>

#include "memtune/ops/backend.h"

namespace memtune {

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::cpu; }
  std::string name() const override { return "cpu"; }

  void* allocate_arena(uint64_t bytes) override;
  void free_arena(void* base) override;
  void copy_from_host(const Tensor& dst, const void* host_src) override;
  void copy_to_host(void* host_dst, const Tensor& src) override;
  void synchronize() override {}

  void fill(const Tensor& dst, float value) override;
  void convert(const Tensor& dst, const Tensor& src) override;
  void add(const Tensor& dst, const Tensor& a, const Tensor& b) override;
  void broadcast_rows(const Tensor& dst, const Tensor& row) override;

  void matmul(const Tensor& c, const Tensor& a, bool transpose_a, const Tensor& b,
              bool transpose_b, float alpha, float beta) override;

  void embedding_forward(const Tensor& out, const Tensor& table, const Tensor& ids) override;
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, float eps) override;
  void rmsnorm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Tensor& rstd, bool accumulate) override;
  void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                    int64_t head_dim) override;
  void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                     int64_t head_dim) override;
  void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) override;
  void swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out,
                       const Tensor& gate, const Tensor& up) override;

  void attention_eager_forward(const Tensor& out, const Tensor& probs,
                               const Tensor& scores_scratch, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& segments,
                               const AttentionDims& dims) override;
  void attention_eager_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                const Tensor& dprobs_scratch, const Tensor& d_out,
                                const Tensor& probs, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& segments,
                                const AttentionDims& dims) override;
  void attention_flash_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                               const Tensor& k, const Tensor& v, const Tensor& segments,
                               const AttentionDims& dims) override;
  void attention_flash_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                const Tensor& delta_scratch, const Tensor& dq_accum_scratch,
                                const Tensor& d_out, const Tensor& out, const Tensor& lse,
                                const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& segments, const AttentionDims& dims) override;
  // attention_decode.cpp
  void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                        const Tensor& v_cache, const AttentionDims& dims) override;

  void cross_entropy_forward_backward(const Tensor& loss_sum, const Tensor& d_logits,
                                      const Tensor& logits, const Tensor& targets,
                                      float grad_scale) override;
  void cross_entropy_forward(const Tensor& loss_sum, const Tensor& logits,
                             const Tensor& targets) override;

  void dropout(const Tensor& out, const Tensor& x, float p, uint64_t seed,
               uint64_t index_offset) override;

  void sum_squares(const Tensor& acc, const Tensor& x) override;
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, const AdamWParams& params) override;
  void scale(const Tensor& dst, float value) override;
};

// Helpers shared by the op files of the CPU backend (defined in cpu_backend.cpp).
namespace cpu {

// Elementwise and row-wise ops go parallel only from this many elements on (~0.1 ms of work on
// one core). Below it the fork/join costs more than it saves, and on a shared machine (CI runs
// on 2 cores next to other jobs) a parallel region can wait a whole scheduler slice for a
// descheduled thread.
constexpr int64_t kParallelMinElements = 1 << 18;

// Argument checks: a broken one is an internal error (the step builds every op's arguments).
void check_float_tensor(const Tensor& t, const char* what);       // cpu, f32/bf16/f16, has data
void check_tensor(const Tensor& t, DType dtype, const char* what);  // cpu, this dtype, has data

// Rows of storage to and from fp32 working buffers: one dtype switch per row, then a loop the
// compiler can vectorize. offset and count are in elements.
void load_f32(const Tensor& src, int64_t offset, int64_t count, float* dst);
void store_f32(const Tensor& dst, int64_t offset, int64_t count, const float* src);

// Reductions with eight independent partial sums (a fixed order, so the result does not depend
// on the compiler's vectorization, and one the compiler vectorizes without -ffast-math).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) lanes[l] += a[i] * b[i];
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
         ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

// y += alpha * x
inline void axpy_f32(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Attention: which keys a query sees, and the per-head gathers both implementations share.
struct AttentionView {
  const AttentionDims& dims;
  const int32_t* segments;  // null: one segment per row of the batch

  // Query position i of batch row b sees key position j.
  bool visible(int64_t b, int64_t i, int64_t j) const {
    if (j > i) return false;
    if (dims.window > 0 && i - j >= dims.window) return false;
    if (segments == nullptr) return true;
    const int32_t* row = segments + b * dims.seq;
    return row[i] == row[j];
  }
};

// Checks q/k/v/out-like tensors against dims; segments must be empty or i32 [N].
AttentionView make_attention_view(const AttentionDims& dims, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& segments);
// Head h of batch row b of x ([N, heads * head_dim]) to/from a dense fp32 [seq, head_dim].
void gather_head(const Tensor& x, const AttentionDims& dims, int64_t heads, int64_t b, int64_t h,
                 float* dst);
// The forward's inputs for query head h of batch row b: q's head, and k's and v's head of its
// kv group, each [seq, head_dim] in f32.
void gather_query_head_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionDims& dims,
                              int64_t b, int64_t h, float* q_head, float* k_head, float* v_head);
void scatter_head(const Tensor& x, const AttentionDims& dims, int64_t heads, int64_t b,
                  int64_t h, const float* src);

}  // namespace cpu
}  // namespace memtune
