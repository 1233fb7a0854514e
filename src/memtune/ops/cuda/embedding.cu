// Embedding lookup on the GPU: out[i, :] = table[ids[i], :], converted to out's dtype. One block
// per token row. ids are validated when the batch is built (backend.h); an id outside [0, V)
// here is an internal error, and the row is written as NaN so that it cannot pass unnoticed.
// table and out of one dtype run a kernel instantiated for it, with 16-byte accesses when
// hidden is a multiple of kPack and both pointers are 16-byte aligned (cuda_vector.h); other
// mixes run the kernel with a run-time dtype switch.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "memtune/ops/cuda/cuda_vector.h"

namespace memtune::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads)
    embedding_typed_kernel(T* out, const T* table, int64_t vocab, int64_t hidden,
                           const int32_t* ids) {
  const int64_t row = blockIdx.x;
  const int32_t id = ids[row];
  const bool valid = id >= 0 && id < vocab;
  const T* source = table + static_cast<int64_t>(valid ? id : 0) * hidden;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * kWidth; j < hidden;
       j += static_cast<int64_t>(blockDim.x) * kWidth) {
    float v[kWidth];
    if (valid) load_chunk<kWidth>(source + j, v);
    else
#pragma unroll
      for (int k = 0; k < kWidth; ++k) v[k] = __int_as_float(0x7fc00000);
    store_chunk<kWidth>(out + row * hidden + j, v);
  }
}

__global__ void embedding_kernel(void* out, DType out_type, const void* table, DType table_type,
                                 int64_t vocab, int64_t hidden, const int32_t* ids) {
  const int64_t row = blockIdx.x;
  const int32_t id = ids[row];
  const bool valid = id >= 0 && id < vocab;
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
    const float value = valid ? load_float(table, table_type, static_cast<int64_t>(id) * hidden + j)
                              : __int_as_float(0x7fc00000);
    store_float(out, out_type, row * hidden + j, value);
  }
}

}  // namespace

void launch_embedding(void* out, DType out_type, const void* table, DType table_type,
                      int64_t vocab, int64_t hidden, const int32_t* ids, int64_t n,
                      cudaStream_t stream) {
  if (n == 0 || hidden == 0) return;
  const bool vector = hidden % kPack == 0 && is_aligned_16(out) && is_aligned_16(table);
  for (int64_t begin = 0; begin < n; begin += INT32_MAX) {
    const int64_t count = n - begin < INT32_MAX ? n - begin : INT32_MAX;
    void* out_rows = static_cast<char*>(out) + begin * hidden * dtype_size(out_type);
    const bool typed =
        !generic_kernels_only() && out_type == table_type &&
        with_float_type(out_type, [&](auto tag) {
          using T = typename decltype(tag)::type;
          const unsigned blocks = static_cast<unsigned>(count);
          if (vector)
            embedding_typed_kernel<T, kPack><<<blocks, kThreads, 0, stream>>>(
                static_cast<T*>(out_rows), static_cast<const T*>(table), vocab, hidden,
                ids + begin);
          else
            embedding_typed_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(
                static_cast<T*>(out_rows), static_cast<const T*>(table), vocab, hidden,
                ids + begin);
        });
    if (!typed)
      embedding_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
          out_rows, out_type, table, table_type, vocab, hidden, ids + begin);
    MT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace memtune::cuda
