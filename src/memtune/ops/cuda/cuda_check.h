// The one check-macro family for CUDA runtime and cuBLAS(Lt) calls (DESIGN.md: errors inside the
// engine are broken invariants, so a failed call aborts with file:line and the library's error
// string). MT_CUDA_CHECK_LAUNCH() goes after every kernel launch: it catches bad launch
// configurations at once; faults inside a kernel surface at the next synchronising call.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace memtune::cuda {

[[noreturn]] inline void cuda_check_failed(const char* what, const char* library,
                                           const char* message, const char* file, int line) {
  std::fprintf(stderr, "%s:%d: %s error: %s (in %s)\n", file, line, library, message, what);
  std::fflush(stderr);
  std::abort();
}

}  // namespace memtune::cuda

#define MT_CUDA_CHECK(call)                                                                \
  do {                                                                                     \
    const cudaError_t mt_cuda_status_ = (call);                                            \
    if (mt_cuda_status_ != cudaSuccess)                                                    \
      ::memtune::cuda::cuda_check_failed(#call, "CUDA", cudaGetErrorString(mt_cuda_status_), \
                                         __FILE__, __LINE__);                              \
  } while (0)

#define MT_CUBLAS_CHECK(call)                                                                  \
  do {                                                                                         \
    const cublasStatus_t mt_cublas_status_ = (call);                                           \
    if (mt_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                            \
      ::memtune::cuda::cuda_check_failed(#call, "cuBLAS", cublasGetStatusString(mt_cublas_status_), \
                                         __FILE__, __LINE__);                                  \
  } while (0)

#define MT_CUDA_CHECK_LAUNCH() MT_CUDA_CHECK(cudaGetLastError())
