// Shared pieces of the GPU tests: a fixture that skips (saying so) without a CUDA device, device
// buffers over the CUDA backend's allocations, upload/download of optest::HostTensor, NaN
// poisoning and the comparison against the CPU backend.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "memtune/ops/backend.h"
#include "memtune/ops/cuda/cuda_backend.h"
#include "../ops/op_test_util.h"

namespace memtune::gputest {

using optest::HostTensor;

// A device allocation of one tensor, freed on destruction.
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(Backend& backend, DType dtype, Shape shape) : backend_(&backend) {
    tensor_.dtype = dtype;
    tensor_.shape = shape;
    tensor_.device = Device::cuda;
    tensor_.data = backend.allocate_arena(std::max<uint64_t>(tensor_.nbytes(), 256));
  }
  DeviceTensor(Backend& backend, const HostTensor& host) : DeviceTensor(backend, host.dtype, host.shape) {
    backend.copy_from_host(tensor_, host.storage.data());
  }
  DeviceTensor(DeviceTensor&& other) noexcept { *this = std::move(other); }
  DeviceTensor& operator=(DeviceTensor&& other) noexcept {
    std::swap(backend_, other.backend_);
    std::swap(tensor_, other.tensor_);
    return *this;
  }
  ~DeviceTensor() {
    if (backend_ != nullptr && tensor_.data != nullptr) backend_->free_arena(tensor_.data);
  }
  operator Tensor() const { return tensor_; }
  const Tensor& tensor() const { return tensor_; }
  HostTensor download() const {
    HostTensor host(tensor_.dtype, tensor_.shape);
    backend_->copy_to_host(host.storage.data(), tensor_);
    return host;
  }
  std::vector<float> floats() const { return download().floats(); }

 private:
  Backend* backend_ = nullptr;
  Tensor tensor_;
};

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
    cuda_ = make_cuda_backend();
    cpu_ = make_cpu_backend();
  }
  Backend& gpu() { return *cuda_; }
  Backend& cpu() { return *cpu_; }

  DeviceTensor upload(const HostTensor& host) { return DeviceTensor(*cuda_, host); }
  // A device tensor full of NaN: an element the op fails to write fails the comparison.
  DeviceTensor poisoned(DType dtype, Shape shape) {
    DeviceTensor t(*cuda_, dtype, shape);
    if (dtype_is_float(dtype)) cuda_->fill(t, std::nanf(""));
    return t;
  }

  std::mt19937_64 rng_{20241107};

 private:
  std::unique_ptr<Backend> cuda_, cpu_;
};

inline bool all_finite(const std::vector<float>& values) {
  for (float v : values)
    if (!std::isfinite(v)) return false;
  return true;
}

// ||gpu - cpu|| / ||cpu|| below tolerance, and every element finite (NaN never passes).
inline void expect_close(const std::string& what, const std::vector<float>& gpu,
                         const std::vector<float>& reference, double tolerance) {
  ASSERT_EQ(gpu.size(), reference.size()) << what;
  EXPECT_TRUE(all_finite(gpu)) << what << ": non-finite values (unwritten or NaN)";
  // A result that is zero in exact arithmetic (attention's dq and dk at seq 1, where dS =
  // P (dP - D) cancels) has no relative error to speak of: hold it to an absolute bound.
  double reference_norm = 0.0;
  for (float r : reference) reference_norm += static_cast<double>(r) * r;
  reference_norm = std::sqrt(reference_norm);
  if (reference_norm < 1e-6 * std::sqrt(static_cast<double>(reference.size()))) {
    EXPECT_LT(optest::max_abs(gpu), 1e-4) << what << ": reference ~0, result not";
    return;
  }
  const double error = optest::norm_rel_error(gpu, optest::to_double(reference));
  EXPECT_LT(error, tolerance) << what << ": relative norm error " << error;
}

// The tolerance for comparing two results stored in dtype (each rounded once from fp32 sums
// taken in different orders).
inline double storage_tolerance(DType dtype) {
  return dtype == DType::bf16 ? 1e-2 : dtype == DType::f16 ? 2e-3 : 2e-5;
}

}  // namespace memtune::gputest
