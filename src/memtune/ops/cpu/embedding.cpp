// Embedding lookup: out[i, :] = table[ids[i], :], converted to out's dtype.
#include <cstring>
#include <vector>

#include "memtune/ops/cpu/cpu_backend.h"

namespace memtune {

void CpuBackend::embedding_forward(const Tensor& out, const Tensor& table, const Tensor& ids) {
  cpu::check_float_tensor(out, "embedding out");
  cpu::check_float_tensor(table, "embedding table");
  cpu::check_tensor(ids, DType::i32, "embedding ids");
  MT_ASSERT(table.shape.ndim == 2, "embedding table {} is not 2-D", table.shape.str());
  const int64_t vocab = table.dim(0), hidden = table.dim(1), n = ids.numel();
  MT_ASSERT(out.numel() == n * hidden && out.cols() == hidden,
            "embedding out {} for {} ids of width {}", out.shape.str(), n, hidden);
  const int32_t* id_values = ids.as<const int32_t>();
  for (int64_t i = 0; i < n; ++i)
    MT_ASSERT(id_values[i] >= 0 && id_values[i] < vocab, "embedding id {} at {} outside [0, {})",
              id_values[i], i, vocab);

  const bool same_dtype = out.dtype == table.dtype;
  const size_t row_bytes = static_cast<size_t>(hidden) * dtype_size(out.dtype);
#pragma omp parallel if (n * hidden >= cpu::kParallelMinElements)
  {
    std::vector<float> row(same_dtype ? 0 : static_cast<size_t>(hidden));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t source = static_cast<int64_t>(id_values[i]) * hidden;
      if (same_dtype) {
        std::memcpy(static_cast<char*>(out.data) + static_cast<size_t>(i) * row_bytes,
                    static_cast<const char*>(table.data) + static_cast<size_t>(source) *
                                                               dtype_size(table.dtype),
                    row_bytes);
      } else {
        cpu::load_f32(table, source, hidden, row.data());
        cpu::store_f32(out, i * hidden, hidden, row.data());
      }
    }
  }
}

}  // namespace memtune
