#include "memtune/parallel/communicator.h"

#include <cstring>

#ifdef MEMTUNE_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "memtune/core/error.h"
#include "memtune/parallel/launch_env.h"

namespace memtune {
namespace {

void copy_bytes(const Tensor& dst, const Tensor& src, CommStream stream) {
  if (dst.data == src.data || src.device == Device::meta) return;
  MT_ASSERT(dst.device == src.device, "collective copy between {} and {}", device_name(src.device),
            device_name(dst.device));
  if (src.device == Device::cpu) {
    std::memcpy(dst.data, src.data, src.nbytes());
    return;
  }
#ifdef MEMTUNE_WITH_CUDA
  const cudaError_t status = cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice,
                                             static_cast<cudaStream_t>(stream.cuda_stream));
  MT_ASSERT(status == cudaSuccess, "cudaMemcpyAsync: {}", cudaGetErrorString(status));
#else
  MT_ASSERT(false, "a {} tensor in a binary without CUDA", device_name(src.device));
#endif
}

class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string name() const override { return "single-rank"; }
  void all_reduce_sum(const Tensor& send, const Tensor& recv, CommStream stream) override {
    check_collective_shapes("all_reduce_sum", send, recv, 1);
    copy_bytes(recv, send, stream);
  }
  void reduce_scatter_sum(const Tensor& send, const Tensor& recv, CommStream stream) override {
    check_collective_shapes("reduce_scatter_sum", send, recv, 1);
    copy_bytes(recv, send, stream);
  }
  void all_gather(const Tensor& send, const Tensor& recv, CommStream stream) override {
    check_collective_shapes("all_gather", send, recv, 1);
    copy_bytes(recv, send, stream);
  }
  void broadcast(const Tensor&, int root, CommStream) override {
    MT_ASSERT(root == 0, "broadcast from rank {} of 1", root);
  }
  void wait(CommStream) override {}
};

class MetaCommunicator final : public Communicator {
 public:
  MetaCommunicator(int rank, int world_size) : rank_(rank), world_size_(world_size) {
    MT_ASSERT(world_size >= 1 && rank >= 0 && rank < world_size, "rank {} of {}", rank, world_size);
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string name() const override { return "meta"; }
  void all_reduce_sum(const Tensor& send, const Tensor& recv, CommStream) override {
    check_collective_shapes("all_reduce_sum", send, recv, world_size_);
  }
  void reduce_scatter_sum(const Tensor& send, const Tensor& recv, CommStream) override {
    check_collective_shapes("reduce_scatter_sum", send, recv, world_size_);
  }
  void all_gather(const Tensor& send, const Tensor& recv, CommStream) override {
    check_collective_shapes("all_gather", send, recv, world_size_);
  }
  void broadcast(const Tensor&, int root, CommStream) override {
    MT_ASSERT(root >= 0 && root < world_size_, "broadcast from rank {} of {}", root, world_size_);
  }
  void wait(CommStream) override {}

 private:
  int rank_, world_size_;
};

}  // namespace

void check_collective_shapes(std::string_view collective, const Tensor& send, const Tensor& recv, int world_size) {
  MT_ASSERT(send.dtype == recv.dtype, "{}: send {} recv {}", collective, dtype_name(send.dtype),
            dtype_name(recv.dtype));
  MT_ASSERT(send.device == recv.device, "{}: send on {} recv on {}", collective, device_name(send.device),
            device_name(recv.device));
  const int64_t w = world_size;
  if (collective == "reduce_scatter_sum")
    MT_ASSERT(send.numel() == w * recv.numel(), "{}: send {} elements, recv {} x {} ranks", collective,
              send.numel(), recv.numel(), w);
  else if (collective == "all_gather")
    MT_ASSERT(recv.numel() == w * send.numel(), "{}: send {} elements x {} ranks, recv {}", collective,
              send.numel(), w, recv.numel());
  else
    MT_ASSERT(send.numel() == recv.numel(), "{}: send {} recv {} elements", collective, send.numel(), recv.numel());
}

std::unique_ptr<Communicator> make_single_rank_communicator() { return std::make_unique<SingleRankCommunicator>(); }

std::unique_ptr<Communicator> make_meta_communicator(int rank, int world_size) {
  return std::make_unique<MetaCommunicator>(rank, world_size);
}

#ifndef MEMTUNE_WITH_NCCL
bool nccl_available() { return false; }
std::unique_ptr<Communicator> make_nccl_communicator(const LaunchEnv& env, const NcclOptions&) {
  mt_fail("{}: this memtune was built without NCCL (it needs the CUDA toolkit with nccl.h and libnccl.so at "
          "configure time), so it trains on one GPU only",
          env.describe());
}
std::vector<uint8_t> nccl_unique_id() { mt_fail("this memtune was built without NCCL"); }
std::unique_ptr<Communicator> make_nccl_communicator_from_id(const std::vector<uint8_t>&, int, int,
                                                             const NcclOptions&) {
  mt_fail("this memtune was built without NCCL");
}
#endif

void select_local_cuda_device(const LaunchEnv& env) {
  if (!env.distributed()) return;
#ifdef MEMTUNE_WITH_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return;  // the CPU backend will say more
  MT_USER_CHECK(env.local_rank < devices,
                "{}: local rank {} has no GPU of its own: {} device(s) are visible (start one process per GPU)",
                env.describe(), env.local_rank, devices);
  const cudaError_t status = cudaSetDevice(env.local_rank);
  MT_USER_CHECK(status == cudaSuccess, "cudaSetDevice({}): {}", env.local_rank, cudaGetErrorString(status));
#endif
}

std::unique_ptr<Communicator> make_communicator(const LaunchEnv& env, Device device) {
  if (!env.distributed()) return make_single_rank_communicator();
  MT_USER_CHECK(device == Device::cuda,
                "{}: several processes need the CUDA backend (NCCL); the {} backend trains on one process",
                env.describe(), device_name(device));
  return make_nccl_communicator(env);
}

}  // namespace memtune
