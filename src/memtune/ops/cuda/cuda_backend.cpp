// CudaBackend: argument checks (the same as the CPU backend's, on cuda tensors) and launches of
// the kernels declared in cuda_ops.h. See cuda_backend.h for the stream and the memory the
// backend owns, and cuda_ops.h for why this file, not a .cu, holds the class.
#include "memtune/ops/cuda/cuda_backend.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "memtune/ops/op_checks.h"
#include "memtune/ops/cuda/attention_flash_args.h"
#include "memtune/ops/cuda/cuda_check.h"
#include "memtune/quant/codebook.h"  // quant4bit: the reference's constants
#include "memtune/quant/codebook_shared.h"
#include "memtune/ops/device.h"
#include "memtune/ops/ragged_attention.h"

namespace memtune {
namespace {

void check_float_tensor(const Tensor& t, const char* what) { check_float_tensor_on(Device::cuda, t, what); }

void check_tensor(const Tensor& t, DType dtype, const char* what) { check_tensor_on(Device::cuda, t, dtype, what); }

void check_same_count(const Tensor& t, const Tensor& like, const char* what) {
  MT_ASSERT(t.numel() == like.numel(), "{}: {} vs {}", what, t.shape.str(), like.shape.str());
}

cuda::AttentionParams attention_params(const AttentionDims& dims, const Tensor& q,
                                       const Tensor& k, const Tensor& v, const Tensor& segments) {
  check_attention_inputs(dims, q, k, v, check_float_tensor);
  // The kernels have no sliding-window mask; the step refuses a window that rows reach.
  MT_ASSERT(dims.window == 0 || dims.seq <= dims.window,
            "CUDA attention over rows of {} under a sliding window of {}", dims.seq, dims.window);
  if (!segments.empty()) {
    check_tensor(segments, DType::i32, "attention segments");
    MT_ASSERT(segments.numel() == dims.tokens(), "attention segments {} vs N {}", segments.shape.str(),
              dims.tokens());
  }
  return cuda::attention_params_of(dims, segments);
}

}  // namespace

bool cuda_device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
}

static_assert(kCudaReductionScratchBytes == sizeof(float) * cuda::kMaxPartials);

CudaBackend::CudaBackend() { gemm_ = cuda::gemm_context_create(nullptr, kCudaGemmWorkspaceBytes); }

CudaBackend::~CudaBackend() {
  cudaDeviceSynchronize();
  cuda::gemm_context_destroy(gemm_);
  cudaFree(owned_workspace_);
  // ---- offload ----
  for (cudaEvent_t event : copy_events_)
    if (event != nullptr) cudaEventDestroy(event);
  if (compute_issued_ != nullptr) cudaEventDestroy(compute_issued_);
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  // ---- end offload ----
}

uint64_t CudaBackend::workspace_bytes() const { return backend_workspace_bytes(Device::cuda); }

void CudaBackend::bind_workspace(const Tensor& workspace) {
  if (workspace.empty()) {
    bound_workspace_ = nullptr;
  } else {
    MT_ASSERT(workspace.device == Device::cuda && workspace.nbytes() >= workspace_bytes(),
              "bind_workspace: {} bytes on {}, need {} on cuda", workspace.nbytes(),
              device_name(workspace.device), workspace_bytes());
    bound_workspace_ = workspace.data;
  }
  reduction_scratch_ = nullptr;  // re-pointed by the next ensure_workspace
}

void CudaBackend::ensure_workspace() {
  if (reduction_scratch_ != nullptr) return;
  void* base = bound_workspace_;
  if (base == nullptr) {
    if (owned_workspace_ == nullptr) MT_CUDA_CHECK(cudaMalloc(&owned_workspace_, workspace_bytes()));
    base = owned_workspace_;
  }
  // The GEMM workspace first (cudaMalloc and the planner both align the base to 256 bytes).
  cuda::gemm_context_set_workspace(gemm_, base, kCudaGemmWorkspaceBytes);
  reduction_scratch_ = reinterpret_cast<float*>(static_cast<char*>(base) + kCudaGemmWorkspaceBytes);
}

void* CudaBackend::allocate_arena(uint64_t bytes) {
  void* base = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&base, bytes == 0 ? 256 : bytes));  // cudaMalloc aligns to 256
  return base;
}

void CudaBackend::free_arena(void* base) {
  MT_CUDA_CHECK(cudaDeviceSynchronize());
  MT_CUDA_CHECK(cudaFree(base));
}

void CudaBackend::copy_from_host(const Tensor& dst, const void* host_src) {
  MT_ASSERT(dst.device == Device::cuda, "copy_from_host into a {} tensor",
            device_name(dst.device));
  // cudaMemcpyDefault: a "device" tensor may live in pinned host memory that kernels read
  // through unified addressing (offload_embeddings); the driver picks the direction.
  if (dst.nbytes() > 0)
    MT_CUDA_CHECK(cudaMemcpy(dst.data, host_src, dst.nbytes(), cudaMemcpyDefault));
}

void CudaBackend::copy_to_host(void* host_dst, const Tensor& src) {
  MT_ASSERT(src.device == Device::cuda, "copy_to_host from a {} tensor",
            device_name(src.device));
  if (src.nbytes() > 0)
    MT_CUDA_CHECK(cudaMemcpy(host_dst, src.data, src.nbytes(), cudaMemcpyDefault));
}

void CudaBackend::synchronize() { MT_CUDA_CHECK(cudaDeviceSynchronize()); }

// ---- offload --------------------------------------------------------------------------------------

void* CudaBackend::allocate_host(uint64_t bytes) {
  void* base = nullptr;
  const cudaError_t status = cudaHostAlloc(&base, bytes == 0 ? 256 : bytes, cudaHostAllocDefault);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    mt_fail("{} bytes of pinned host memory (offloaded activations or embeddings) could not be allocated ({}): "
            "free host memory, shorten --max_seq_length or drop --offload_activations",
            bytes, cudaGetErrorString(status));
  }
  return base;
}

void CudaBackend::free_host(void* base) { MT_CUDA_CHECK(cudaFreeHost(base)); }

CopyEvent CudaBackend::create_event() {
  if (copy_stream_ == nullptr) {
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&compute_issued_, cudaEventDisableTiming));
  }
  cudaEvent_t event = nullptr;
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  copy_events_.push_back(event);
  return CopyEvent{static_cast<int32_t>(copy_events_.size() - 1)};
}

void CudaBackend::destroy_event(CopyEvent event) {
  cudaEvent_t& slot = copy_events_.at(static_cast<size_t>(event.id));
  if (slot != nullptr) MT_CUDA_CHECK(cudaEventDestroy(slot));
  slot = nullptr;
}

cudaEvent_t CudaBackend::event_of(CopyEvent event) const {
  MT_ASSERT(event.id >= 0 && static_cast<size_t>(event.id) < copy_events_.size() &&
                copy_events_[event.id] != nullptr,
            "copy event {} was not created by this backend", event.id);
  return copy_events_[event.id];
}

void CudaBackend::copy_stream_follows_compute() {
  MT_ASSERT(copy_stream_ != nullptr, "an offload copy before any copy event was created");
  MT_CUDA_CHECK(cudaEventRecord(compute_issued_, stream_));
  MT_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, compute_issued_, 0));
}

void CudaBackend::copy_to_host_async(void* host_dst, const Tensor& src, CopyEvent done) {
  MT_ASSERT(src.device == Device::cuda, "copy_to_host_async from a {} tensor", device_name(src.device));
  const cudaEvent_t event = event_of(done);
  copy_stream_follows_compute();
  if (src.nbytes() > 0)
    MT_CUDA_CHECK(cudaMemcpyAsync(host_dst, src.data, src.nbytes(), cudaMemcpyDeviceToHost, copy_stream_));
  MT_CUDA_CHECK(cudaEventRecord(event, copy_stream_));
}

void CudaBackend::copy_from_host_async(const Tensor& dst, const void* host_src, CopyEvent done) {
  MT_ASSERT(dst.device == Device::cuda, "copy_from_host_async into a {} tensor", device_name(dst.device));
  const cudaEvent_t event = event_of(done);
  copy_stream_follows_compute();
  if (dst.nbytes() > 0)
    MT_CUDA_CHECK(cudaMemcpyAsync(dst.data, host_src, dst.nbytes(), cudaMemcpyHostToDevice, copy_stream_));
  MT_CUDA_CHECK(cudaEventRecord(event, copy_stream_));
}

void CudaBackend::compute_wait(CopyEvent done) {
  MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, event_of(done), 0));
}

// ---- end offload ----------------------------------------------------------------------------------

// ---- elementwise ------------------------------------------------------------------------------

void CudaBackend::fill(const Tensor& dst, float value) {
  check_float_tensor(dst, "fill dst");
  cuda::launch_fill(dst.data, dst.dtype, dst.numel(), value, stream_);
}

void CudaBackend::convert(const Tensor& dst, const Tensor& src) {
  check_float_tensor(dst, "convert dst");
  check_float_tensor(src, "convert src");
  check_same_count(dst, src, "convert");
  cuda::launch_convert(dst.data, dst.dtype, src.data, src.dtype, dst.numel(), stream_);
}

void CudaBackend::add(const Tensor& dst, const Tensor& a, const Tensor& b) {
  check_float_tensor(dst, "add dst");
  check_float_tensor(a, "add a");
  check_float_tensor(b, "add b");
  check_same_count(dst, a, "add");
  check_same_count(dst, b, "add");
  cuda::launch_add(dst.data, dst.dtype, a.data, a.dtype, b.data, b.dtype, dst.numel(), stream_);
}

void CudaBackend::broadcast_rows(const Tensor& dst, const Tensor& row) {
  check_float_tensor(dst, "broadcast_rows dst");
  check_float_tensor(row, "broadcast_rows row");
  MT_ASSERT(row.numel() == dst.cols(), "broadcast_rows {} from {}",
            dst.shape.str(), row.shape.str());
  // A 2-D copy whose source rows all start at the row itself (leading dimension 0).
  cuda::launch_copy_2d(dst.data, dst.dtype, dst.cols(), row.data, row.dtype, 0, dst.rows(),
                       dst.cols(), stream_);
}

void CudaBackend::scale(const Tensor& dst, float value) {
  check_float_tensor(dst, "scale dst");
  cuda::launch_scale(dst.data, dst.dtype, dst.numel(), value, stream_);
}

void CudaBackend::fill_random(const Tensor& dst, Distribution distribution, float a, float b,
                              uint64_t seed) {
  check_float_tensor(dst, "fill_random dst");
  cuda::launch_fill_random(dst.data, dst.dtype, dst.numel(),
                           distribution == Distribution::uniform ? 1 : 0, a, b, seed, stream_);
}

void CudaBackend::sum_squares(const Tensor& acc, const Tensor& x) {
  check_tensor(acc, DType::f32, "sum_squares acc");
  MT_ASSERT(acc.numel() == 1, "sum_squares acc {} is not one value", acc.shape.str());
  check_float_tensor(x, "sum_squares x");
  ensure_workspace();
  cuda::launch_sum_squares(acc.as<float>(), x.data, x.dtype, x.numel(), reduction_scratch_,
                           stream_);
}

// ---- GEMM -----------------------------------------------------------------------------------------

void CudaBackend::matmul(const Tensor& c, const Tensor& a, bool transpose_a, const Tensor& b,
                         bool transpose_b, float alpha, float beta) {
  const MatmulSizes sizes = check_matmul_inputs(c, a, transpose_a, b, transpose_b, check_float_tensor);
  const int64_t m = sizes.m, n = sizes.n, k = sizes.k;
  if (m == 0 || n == 0) return;
  MT_ASSERT(c.data != a.data && c.data != b.data, "matmul: c aliases an input");
  cuda::GemmArgs args;
  args.c = c.data;
  args.c_type = c.dtype;
  args.ldc = n;
  args.a = a.data;
  args.a_type = a.dtype;
  args.transpose_a = transpose_a;
  args.lda = a.dim(1);
  args.b = b.data;
  args.b_type = b.dtype;
  args.transpose_b = transpose_b;
  args.ldb = b.dim(1);
  args.m = m;
  args.n = n;
  args.k = k;
  args.alpha = alpha;
  args.beta = beta;
  ensure_workspace();
  cuda::gemm(gemm_, args, stream_);
}

// ---- model ops ------------------------------------------------------------------------------------

void CudaBackend::embedding_forward(const Tensor& out, const Tensor& table, const Tensor& ids) {
  check_float_tensor(out, "embedding out");
  check_float_tensor(table, "embedding table");
  check_tensor(ids, DType::i32, "embedding ids");
  MT_ASSERT(table.shape.ndim == 2, "embedding table {} is not 2-D", table.shape.str());
  const int64_t vocab = table.dim(0), hidden = table.dim(1), n = ids.numel();
  MT_ASSERT(out.numel() == n * hidden && out.cols() == hidden,
            "embedding out {} for {} ids of width {}", out.shape.str(), n, hidden);
  cuda::launch_embedding(out.data, out.dtype, table.data, table.dtype, vocab, hidden,
                         ids.as<const int32_t>(), n, stream_);
}

void CudaBackend::rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                  const Tensor& weight, float eps) {
  check_rmsnorm_inputs("rmsnorm_forward", x, weight, rstd, check_float_tensor, check_tensor);
  check_float_like(out, x, "rmsnorm_forward out", check_float_tensor);
  cuda::launch_rmsnorm_forward(out.data, out.dtype, rstd.as<float>(), x.data, x.dtype,
                               weight.data, weight.dtype, x.rows(), x.cols(), eps, stream_);
}

void CudaBackend::rmsnorm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                   const Tensor& weight, const Tensor& rstd, bool accumulate) {
  check_rmsnorm_inputs("rmsnorm_backward", x, weight, rstd, check_float_tensor, check_tensor);
  check_float_like(dx, x, "rmsnorm_backward dx", check_float_tensor);
  check_float_like(dy, x, "rmsnorm_backward dy", check_float_tensor);
  cuda::launch_rmsnorm_backward(dx.data, dx.dtype, dy.data, dy.dtype, x.data, x.dtype,
                                weight.data, weight.dtype, rstd.as<const float>(), x.rows(),
                                x.cols(), accumulate, stream_);
}

namespace {
void check_rope_args(const char* op, const Tensor& x, const Tensor& positions,
                     const Tensor& inv_freq, int64_t head_dim) {
  check_float_tensor(x, op);
  MT_ASSERT(positions.dtype == DType::i32 || positions.dtype == DType::f32,
            "{}: positions dtype {}", op, dtype_name(positions.dtype));
  MT_ASSERT(positions.device == Device::cuda && positions.numel() == x.rows(),
            "{}: positions {} for x {}", op, positions.shape.str(), x.shape.str());
  check_tensor(inv_freq, DType::f32, op);
  MT_ASSERT(head_dim > 0 && head_dim % 2 == 0 && x.cols() % head_dim == 0,
            "{}: head_dim {} for x {}", op, head_dim, x.shape.str());
  MT_ASSERT(inv_freq.numel() == head_dim / 2, "{}: inv_freq {} for head_dim {}", op,
            inv_freq.shape.str(), head_dim);
}
}  // namespace

void CudaBackend::rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                               int64_t head_dim) {
  check_rope_args("rope_forward", x, positions, inv_freq, head_dim);
  cuda::launch_rope(x.data, x.dtype, x.rows(), x.cols(), positions.data, positions.dtype,
                    inv_freq.as<const float>(), head_dim, /*inverse=*/false, stream_);
}

void CudaBackend::rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                                int64_t head_dim) {
  check_rope_args("rope_backward", dx, positions, inv_freq, head_dim);
  cuda::launch_rope(dx.data, dx.dtype, dx.rows(), dx.cols(), positions.data, positions.dtype,
                    inv_freq.as<const float>(), head_dim, /*inverse=*/true, stream_);
}

void CudaBackend::swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  check_swiglu_forward_inputs(out, gate, up, check_float_tensor);
  cuda::launch_swiglu_forward(out.data, out.dtype, gate.data, gate.dtype, up.data, up.dtype,
                              out.numel(), stream_);
}

void CudaBackend::swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out,
                                  const Tensor& gate, const Tensor& up) {
  check_swiglu_backward_inputs(d_gate, d_up, d_out, gate, up, check_float_tensor);
  cuda::launch_swiglu_backward(d_gate.data, d_gate.dtype, d_up.data, d_up.dtype, d_out.data,
                               d_out.dtype, gate.data, gate.dtype, up.data, up.dtype,
                               d_out.numel(), stream_);
}

void CudaBackend::lora_residual_forward(const Tensor& y, const Tensor& u, const Tensor& b, float scale,
                                        const Tensor& residual) {
  const int64_t rows = y.rows(), cols = y.cols(), rank = b.cols();
  MT_ASSERT(u.rows() == rows && u.cols() == rank && b.rows() == cols && residual.numel() == y.numel(),
            "lora_residual_forward: y {} with u {}, B {}, residual {}", y.shape.str(), u.shape.str(), b.shape.str(),
            residual.shape.str());
  const DType t = y.dtype;
  const bool one_dtype = u.dtype == t && b.dtype == t && residual.dtype == t;
  if (one_dtype &&
      cuda::launch_lora_residual_forward(y.data, u.data, b.data, residual.data, t, scale, rows, cols, rank, stream_))
    return;
  Backend::lora_residual_forward(y, u, b, scale, residual);
}

// ---- attention --------------------------------------------------------------------------------------

void CudaBackend::attention_eager_forward(const Tensor& out, const Tensor& probs,
                                          const Tensor& scores_scratch, const Tensor& q,
                                          const Tensor& k, const Tensor& v,
                                          const Tensor& segments, const AttentionDims& dims) {
  const cuda::AttentionParams p = attention_params(dims, q, k, v, segments);
  check_float_like(out, q, "attention_eager_forward out", check_float_tensor);
  check_attention_matrix(probs, dims, "attention_eager_forward probs", check_float_tensor);
  check_attention_matrix(scores_scratch, dims, "attention_eager_forward scores_scratch", check_float_tensor);
  ensure_workspace();
  cuda::attention_eager_forward(gemm_, p, out.data, out.dtype, probs.data, probs.dtype,
                                scores_scratch.data, scores_scratch.dtype, q.data, q.dtype,
                                k.data, k.dtype, v.data, v.dtype, stream_);
}

void CudaBackend::attention_eager_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                           const Tensor& dprobs_scratch, const Tensor& d_out,
                                           const Tensor& probs, const Tensor& q, const Tensor& k,
                                           const Tensor& v, const Tensor& segments,
                                           const AttentionDims& dims) {
  const cuda::AttentionParams p = attention_params(dims, q, k, v, segments);
  check_attention_eager_backward(dq, dk, dv, dprobs_scratch, d_out, probs, q, k, dims, check_float_tensor);
  ensure_workspace();
  cuda::attention_eager_backward(gemm_, p, dq.data, dq.dtype, dk.data, dk.dtype, dv.data,
                                 dv.dtype, dprobs_scratch.data, dprobs_scratch.dtype,
                                 d_out.data, d_out.dtype, probs.data, probs.dtype, q.data,
                                 q.dtype, k.data, k.dtype, v.data, v.dtype, stream_);
}

void CudaBackend::attention_flash_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                                          const Tensor& k, const Tensor& v,
                                          const Tensor& segments, const AttentionDims& dims) {
  const cuda::AttentionParams p = attention_params(dims, q, k, v, segments);
  check_float_like(out, q, "attention_flash_forward out", check_float_tensor);
  check_attention_rows(lse, dims, "attention_flash_forward lse", check_tensor);
  const cuda::FlashTensors t = cuda::flash_forward_tensors(out, lse, q, k, v);
  MT_ASSERT(cuda::attention_flash_uses_tensor_cores(p, t, false) ||
                (dims.head_dim % 2 == 0 && dims.head_dim <= 256),
            "attention_flash_forward: head_dim {} (the generic kernel takes even ones <= 256)",
            dims.head_dim);
  cuda::attention_flash_forward(p, t, stream_);
}

void CudaBackend::attention_flash_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                           const Tensor& delta_scratch,
                                           const Tensor& dq_accum_scratch, const Tensor& d_out,
                                           const Tensor& out, const Tensor& lse, const Tensor& q,
                                           const Tensor& k, const Tensor& v,
                                           const Tensor& segments, const AttentionDims& dims) {
  const cuda::AttentionParams p = attention_params(dims, q, k, v, segments);
  check_fused_attention_backward("attention_flash_backward", dq, dk, dv, d_out, out, lse, q, k, dims,
                                 check_float_tensor, check_tensor);
  check_attention_rows(delta_scratch, dims, "attention_flash_backward delta_scratch", check_tensor);
  check_tensor(dq_accum_scratch, DType::f32, "attention_flash_backward dq_accum_scratch");
  check_same_count(dq_accum_scratch, q, "attention_flash_backward dq_accum_scratch");
  const cuda::FlashTensors t =
      cuda::flash_backward_tensors(dq, dk, dv, delta_scratch, dq_accum_scratch, d_out, out, lse, q, k, v);
  MT_ASSERT(cuda::attention_flash_uses_tensor_cores(p, t, true) ||
                (dims.head_dim % 2 == 0 && dims.head_dim <= 256),
            "attention_flash_backward: head_dim {} (the generic kernel takes even ones <= 256)",
            dims.head_dim);
  cuda::attention_flash_backward(p, t, stream_);
}

cuda::CudnnAttention& CudaBackend::cudnn() {
  if (!cudnn_) cudnn_ = std::make_unique<cuda::CudnnAttention>();
  return *cudnn_;
}

namespace {
// One dtype for every tensor of the cuDNN graph (its io type), checked here so that a mixed call
// says which tensor differs.
DType cudnn_io_dtype(std::initializer_list<std::pair<const Tensor*, const char*>> tensors) {
  const DType d = tensors.begin()->first->dtype;
  MT_USER_CHECK(d == DType::bf16 || d == DType::f16,
                "cuDNN attention takes bf16 or f16 tensors, {} is {} (use --attn_implementation flash)",
                tensors.begin()->second, dtype_name(d));
  for (const auto& [t, name] : tensors)
    MT_ASSERT(t->dtype == d, "cuDNN attention: {} is {}, q is {}", name, dtype_name(t->dtype),
              dtype_name(d));
  return d;
}
}  // namespace

namespace {
// The op's view of a ragged table, after the checks that tie it to the call.
cuda::CudnnRagged cudnn_ragged(const RaggedAttention& ragged, const AttentionDims& dims,
                               const char* op) {
  cuda::CudnnRagged r;
  if (ragged.empty()) return r;
  check_tensor(ragged.table, DType::i32, op);
  MT_ASSERT(ragged.rows == dims.batch && ragged.seq == dims.seq,
            "{}: the ragged table describes {} x {} tokens, the call {} x {}", op, ragged.rows,
            ragged.seq, dims.batch, dims.seq);
  MT_ASSERT(ragged.capacity >= dims.tokens() && ragged.slots >= ragged.sequences &&
                ragged.slots <= ragged.capacity && ragged.max_len > 0 &&
                ragged.table.numel() >= kRaggedTableRows * (ragged.capacity + 1),
            "{}: ragged table {} (capacity {}, slots {}, max_len {}) for {} tokens", op,
            ragged.table.shape.str(), ragged.capacity, ragged.slots, ragged.max_len, dims.tokens());
  r.table = ragged.table.as<const int32_t>();
  r.stride = ragged.capacity + 1;
  r.slots = ragged.slots;
  r.max_len = ragged.max_len;
  return r;
}
}  // namespace

size_t CudaBackend::cudnn_attention_workspace_bytes(const AttentionDims& dims, DType dtype,
                                                    bool backward, const RaggedAttention* ragged) {
  if (ragged == nullptr || ragged->empty()) return cudnn().workspace_bytes(dims, dtype, backward);
  cuda::CudnnRagged r;
  r.slots = ragged->slots;
  r.max_len = ragged->max_len;
  return cudnn().workspace_bytes(dims, dtype, backward, &r);
}

void CudaBackend::attention_cudnn_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                                          const Tensor& k, const Tensor& v,
                                          const Tensor& segments, const RaggedAttention& ragged,
                                          const Tensor& workspace, const AttentionDims& dims) {
  (void)attention_params(dims, q, k, v, segments);  // the shape checks
  check_same_count(out, q, "attention_cudnn_forward out");
  check_attention_rows(lse, dims, "attention_cudnn_forward lse", check_tensor);
  check_tensor(workspace, DType::f32, "attention_cudnn_forward workspace");
  cuda::CudnnSdpaTensors t;
  t.dtype = cudnn_io_dtype({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}});
  t.q = q.data;
  t.k = k.data;
  t.v = v.data;
  t.out = out.data;
  t.lse = lse.as<float>();
  t.workspace = workspace.data;
  t.workspace_bytes = workspace.nbytes();
  t.ragged = cudnn_ragged(ragged, dims, "attention_cudnn_forward");
  // A shape (or packed rows) cuDNN refuses: the flash kernel, with the segments.
  if (!cudnn().forward(dims, t, stream_)) attention_flash_forward(out, lse, q, k, v, segments, dims);
}

void CudaBackend::attention_cudnn_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                           const Tensor& delta_scratch, const Tensor& workspace,
                                           const Tensor& d_out, const Tensor& out,
                                           const Tensor& lse, const Tensor& q, const Tensor& k,
                                           const Tensor& v, const Tensor& segments,
                                           const RaggedAttention& ragged,
                                           const AttentionDims& dims) {
  (void)attention_params(dims, q, k, v, segments);
  // delta_scratch: cuDNN keeps its row sums in its own workspace; only the flash fallback uses it.
  check_fused_attention_backward("attention_cudnn_backward", dq, dk, dv, d_out, out, lse, q, k, dims,
                                 check_float_tensor, check_tensor);
  check_tensor(workspace, DType::f32, "attention_cudnn_backward workspace");
  cuda::CudnnSdpaTensors t;
  t.dtype = cudnn_io_dtype({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&d_out, "d_out"},
                            {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}});
  t.q = q.data;
  t.k = k.data;
  t.v = v.data;
  t.out = out.data;
  t.lse = lse.as<float>();
  t.d_out = d_out.data;
  t.dq = dq.data;
  t.dk = dk.data;
  t.dv = dv.data;
  t.workspace = workspace.data;
  t.workspace_bytes = workspace.nbytes();
  t.ragged = cudnn_ragged(ragged, dims, "attention_cudnn_backward");
  if (!cudnn().backward(dims, t, stream_))  // a shape cuDNN refuses: the flash kernel
    attention_flash_backward(dq, dk, dv, delta_scratch, cudnn_dq_accum_view(workspace, q), d_out,
                             out, lse, q, k, v, segments, dims);
}

// ---- attention_decode (attention_decode.cu) ----
void CudaBackend::attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                                   const Tensor& v_cache, const AttentionDims& dims) {
  const int64_t capacity = check_attention_decode_inputs(out, q, k_cache, v_cache, dims, check_float_tensor);
  MT_ASSERT(dims.head_dim <= 256, "attention_decode: head_dim {} (1..256)", dims.head_dim);
  cuda::AttentionDecodeArgs a;
  a.batch = dims.batch;
  a.n_heads = dims.n_heads;
  a.n_kv_heads = dims.n_kv_heads;
  a.head_dim = dims.head_dim;
  a.kv_len = dims.seq;
  a.capacity = capacity;
  a.scale = dims.scale;
  a.q = q.data;
  a.k_cache = k_cache.data;
  a.v_cache = v_cache.data;
  a.out = out.data;
  a.q_type = q.dtype;
  a.k_type = k_cache.dtype;
  a.v_type = v_cache.dtype;
  a.out_type = out.dtype;
  cuda::attention_decode(a, stream_);
}
// ---- end attention_decode ----

// ---- loss, dropout, optimizer ---------------------------------------------------------------------

namespace {
void check_cross_entropy_args(const char* op, const Tensor& loss_sum, const Tensor& logits,
                              const Tensor& targets) {
  check_tensor(loss_sum, DType::f32, op);
  MT_ASSERT(loss_sum.numel() == 1, "{}: loss_sum {} is not one value", op, loss_sum.shape.str());
  check_float_tensor(logits, op);
  check_tensor(targets, DType::i32, op);
  MT_ASSERT(logits.shape.ndim >= 1 && targets.numel() == logits.rows(),
            "{}: targets {} for logits {}", op, targets.shape.str(), logits.shape.str());
}
}  // namespace

void CudaBackend::cross_entropy_forward_backward(const Tensor& loss_sum, const Tensor& d_logits,
                                                 const Tensor& logits, const Tensor& targets,
                                                 float grad_scale) {
  check_cross_entropy_args("cross_entropy_forward_backward", loss_sum, logits, targets);
  check_float_tensor(d_logits, "cross_entropy_forward_backward d_logits");
  MT_ASSERT(d_logits.numel() == logits.numel() && d_logits.numel() > 0,
            "cross_entropy_forward_backward d_logits {} for logits {}", d_logits.shape.str(),
            logits.shape.str());
  ensure_workspace();
  cuda::launch_cross_entropy(loss_sum.as<float>(), d_logits.data, d_logits.dtype, logits.data,
                             logits.dtype, targets.as<const int32_t>(), logits.rows(),
                             logits.cols(), grad_scale, reduction_scratch_, stream_);
}

void CudaBackend::cross_entropy_forward(const Tensor& loss_sum, const Tensor& logits,
                                        const Tensor& targets) {
  check_cross_entropy_args("cross_entropy_forward", loss_sum, logits, targets);
  ensure_workspace();
  cuda::launch_cross_entropy(loss_sum.as<float>(), nullptr, DType::f32, logits.data,
                             logits.dtype, targets.as<const int32_t>(), logits.rows(),
                             logits.cols(), 1.0f, reduction_scratch_, stream_);
}

void CudaBackend::dropout(const Tensor& out, const Tensor& x, float p, uint64_t seed,
                          uint64_t index_offset) {
  check_float_tensor(out, "dropout out");
  check_float_tensor(x, "dropout x");
  check_same_count(out, x, "dropout");
  MT_ASSERT(p >= 0.0f && p < 1.0f, "dropout p {} outside [0, 1)", p);
  if (p == 0.0f) {
    convert(out, x);
    return;
  }
  cuda::launch_dropout(out.data, out.dtype, x.data, x.dtype, x.numel(), p, seed, index_offset,
                       stream_);
}

void CudaBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                             const Tensor& exp_avg_sq, const AdamWParams& params) {
  check_adamw_inputs(param, grad, exp_avg, exp_avg_sq, params, check_tensor);
  const int64_t n = param.numel();
  // The scalars exactly as ops/cpu/adamw.cpp computes them (double, then fp32).
  const double lr = params.lr, beta1 = params.beta1, beta2 = params.beta2;
  const double step = static_cast<double>(params.step);
  cuda::AdamWScalars s;
  s.decay_factor = static_cast<float>(1.0 - lr * params.weight_decay);
  s.avg_weight = static_cast<float>(1.0 - beta1);
  s.beta2 = params.beta2;
  s.sq_weight = static_cast<float>(1.0 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  s.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, step))));
  s.eps = params.eps;
  s.grad_scale = params.grad_scale;
  cuda::launch_adamw(param.as<float>(), grad.as<const float>(), exp_avg.as<float>(),
                     exp_avg_sq.as<float>(), n, s, stream_);
}

// ---- QLoRA 4-bit (quant4bit.cu) -------------------------------------------------------------------

namespace {

// The reference's constants (quant/codebook.h) for the kernels, built once per type.
const cuda::Quant4bitTables& quant4bit_tables(QuantType type) {
  static const auto build = [](QuantType t) {
    cuda::Quant4bitTables tables;
    tables.is_nf4 = t == QuantType::nf4;
    const std::array<float, 16>& values =
        tables.is_nf4 ? nf4_code_values() : fp4_code_values();
    std::copy(values.begin(), values.end(), tables.code_values);
    std::copy(nf4_thresholds().begin(), nf4_thresholds().end(), tables.nf4_thresholds);
    const std::array<float, 7>& fp4 = fp4_magnitude_thresholds();
    std::copy(fp4.begin(), fp4.end(), tables.fp4_thresholds);
    tables.fp4_code_by_rank = codebook::kFp4CodeByRankPacked;
    return tables;
  };
  static const cuda::Quant4bitTables nf4 = build(QuantType::nf4);
  static const cuda::Quant4bitTables fp4 = build(QuantType::fp4);
  return type == QuantType::nf4 ? nf4 : fp4;
}

void check_quantized_on_cuda(const Quantized4bit& q, std::string_view what) {
  check_quantized4bit_layout(q, what);
  MT_ASSERT(q.packed.device == Device::cuda && q.absmax.device == Device::cuda &&
                q.code_map.device == Device::cuda,
            "{}: quantized tensors not on cuda", what);
  if (q.config.double_quant)
    MT_ASSERT(q.nested_absmax.device == Device::cuda && q.nested_map.device == Device::cuda,
              "{}: nested tensors not on cuda", what);
}

// Whether the device's absmax sum is bit for bit the reference's index-order double sum
// (absmax_mean in quant/nf4.cpp). Every absmax is 0 or a normal fp32 (subnormals are flushed),
// so each is an integer multiple of u = ulp(smallest nonzero absmax) = 2^(exponent - 23), and so
// is every partial sum of them, in any order. A double holds such a multiple exactly while it is
// below 2^53 u; the values are non-negative, so no partial sum exceeds the total. Hence when the
// total is below 2^52 u (a factor 2 of margin for the rounding of the computed total itself) no
// addition on either side rounded, and both sums are the exact sum. Random and real weights pass
// with a margin of thousands; a tensor whose absmax values span more than ~2^20 (e.g. an all-but-
// zero block next to normal ones) fails, and the caller then sums on the host in index order.
bool absmax_sum_is_exact(double sum, float min_nonzero_absmax) {
  if (sum == 0.0) return true;  // every absmax is 0
  if (!(min_nonzero_absmax > 0.0f) || !std::isfinite(min_nonzero_absmax)) return false;
  const double ulp = std::ldexp(1.0, std::ilogb(min_nonzero_absmax) - 23);
  return sum < std::ldexp(ulp, 52);
}

// A device buffer for the duration of one call.
class TemporaryDeviceBuffer {
 public:
  explicit TemporaryDeviceBuffer(uint64_t bytes) {
    MT_CUDA_CHECK(cudaMalloc(&data_, std::max<uint64_t>(bytes, 256)));
  }
  ~TemporaryDeviceBuffer() {
    MT_CUDA_CHECK(cudaDeviceSynchronize());  // the kernels that use it are done
    MT_CUDA_CHECK(cudaFree(data_));
  }
  TemporaryDeviceBuffer(const TemporaryDeviceBuffer&) = delete;
  TemporaryDeviceBuffer& operator=(const TemporaryDeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
};

}  // namespace

void CudaBackend::dequantize_4bit(const Tensor& out, const Quantized4bit& q) {
  check_quantized_on_cuda(q, "dequantize_4bit");
  check_float_tensor(out, "dequantize_4bit out");
  MT_ASSERT(out.numel() == q.shape.numel(), "dequantize {} into {}", q.shape.str(),
            out.shape.str());
  cuda::Dequantize4bitArgs args;
  args.out = out.data;
  args.out_type = out.dtype;
  args.packed = q.packed.as<const uint8_t>();
  args.n = q.shape.numel();
  args.blocksize = q.config.blocksize;
  args.double_quant = q.config.double_quant;
  if (q.config.double_quant) {
    args.absmax_codes = q.absmax.as<const uint8_t>();
    args.nested_absmax = q.nested_absmax.as<const float>();
    args.nested_map = q.nested_map.as<const float>();
    args.nested_offset = q.nested_offset;
    args.nested_blocksize = q.config.nested_blocksize;
  } else {
    args.absmax = q.absmax.as<const float>();
  }
  cuda::launch_dequantize_4bit(args, quant4bit_tables(q.config.type), stream_);
}

void CudaBackend::quantize_4bit(Quantized4bit& q, const Tensor& dense, std::string_view name) {
  check_quantized_on_cuda(q, name);
  check_float_tensor(dense, "quantize_4bit dense");
  MT_ASSERT(dense.numel() == q.shape.numel(), "quantize '{}': dense {} for shape {}", name,
            dense.shape.str(), q.shape.str());
  ensure_workspace();
  const int64_t n = q.shape.numel();
  const int64_t blocks = (n + q.config.blocksize - 1) / q.config.blocksize;
  const bool double_quant = q.config.double_quant;
  // Double quant needs the fp32 absmax only until it is re-quantized: stage it.
  std::unique_ptr<TemporaryDeviceBuffer> staged_absmax;
  if (double_quant)
    staged_absmax = std::make_unique<TemporaryDeviceBuffer>(static_cast<uint64_t>(blocks) * sizeof(float));
  float* absmax = double_quant ? staged_absmax->as<float>() : q.absmax.as<float>();

  cuda::Quantize4bitBlocksArgs args;
  args.dense = dense.data;
  args.dense_type = dense.dtype;
  args.n = n;
  args.blocksize = q.config.blocksize;
  args.packed = q.packed.as<uint8_t>();
  args.absmax = absmax;
  args.sum_absmax = double_quant;
  args.scratch = reduction_scratch_;
  args.scratch_bytes = kCudaReductionScratchBytes;
  const cuda::Quantize4bitBlocksResult result =
      cuda::quantize_4bit_blocks(args, quant4bit_tables(q.config.type), stream_);

  if (result.first_non_finite >= 0) {
    // The reference scans before it quantizes and throws the error users see; run it on the
    // host copy so that both backends say exactly the same thing.
    staged_absmax.reset();
    std::vector<uint8_t> host(dense.nbytes());
    copy_to_host(host.data(), dense);
    (void)memtune::quantize_4bit(host.data(), dense.dtype, q.shape, q.config, name);
    MT_ASSERT(false, "quantize '{}': the device found a non-finite element {} that the host did not",
              name, result.first_non_finite);
  }

  const std::array<float, 16> code_map = bnb_quant_map(q.config.type == QuantType::nf4);
  copy_from_host(q.code_map, code_map.data());
  q.nested_offset = 0.0f;
  if (!double_quant) return;

  // offset = mean(absmax) exactly as absmax_mean computes it (see absmax_sum_is_exact).
  if (absmax_sum_is_exact(result.absmax_sum, result.min_nonzero_absmax)) {
    q.nested_offset = static_cast<float>(result.absmax_sum / static_cast<double>(blocks));
  } else {
    std::vector<float> host_absmax(static_cast<size_t>(blocks));
    MT_CUDA_CHECK(cudaMemcpy(host_absmax.data(), absmax, host_absmax.size() * sizeof(float),
                             cudaMemcpyDeviceToHost));
    q.nested_offset = absmax_mean(host_absmax);
  }
  copy_from_host(q.nested_map, signed_dynamic_map().data());
  cuda::launch_double_quantize_absmax(absmax, blocks, q.config.nested_blocksize, q.nested_offset,
                                      q.nested_map.as<const float>(), q.absmax.as<uint8_t>(),
                                      q.nested_absmax.as<float>(), stream_);
}

// ---- end QLoRA 4-bit -------------------------------------------------------------------------------

#ifdef MEMTUNE_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }
#endif

}  // namespace memtune
