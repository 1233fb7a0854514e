// Embedding lookup on the GPU: out[i, :] = table[ids[i], :], converted to out's dtype. One block
// per token row. ids are validated when the batch is built (backend.h); an id outside [0, V)
// here is an internal error, and the row is written as NaN so that it cannot pass unnoticed.
#include "memtune/ops/cuda/cuda_common.h"
#include "memtune/ops/cuda/cuda_ops.h"

namespace memtune::cuda {
namespace {

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
  for (int64_t begin = 0; begin < n; begin += INT32_MAX) {
    const int64_t count = n - begin < INT32_MAX ? n - begin : INT32_MAX;
    embedding_kernel<<<static_cast<unsigned>(count), 256, 0, stream>>>(
        static_cast<char*>(out) + begin * hidden * dtype_size(out_type), out_type, table,
        table_type, vocab, hidden, ids + begin);
    MT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace memtune::cuda
