// The NCCL communicator (compiled only when CMake found CUDA and NCCL: MEMTUNE_WITH_NCCL).
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0): init and every call return at
// once, possibly with ncclInProgress, and the state is polled with ncclCommGetAsyncError. That
// is what lets a rank whose peer died give up: wait() polls the stream and the async error with
// a deadline, and on an error or a timeout calls ncclCommAbort (which also ends the NCCL kernels
// still spinning on the device) and throws memtune::Error, so every surviving rank exits with a
// message instead of hanging.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/parallel/communicator.h"
#include "memtune/parallel/launch_env.h"
#include "memtune/parallel/tcp_bootstrap.h"

namespace memtune {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::u8: return ncclUint8;
    case DType::i32: return ncclInt32;
  }
  MT_ASSERT(false, "no NCCL type for {}", dtype_name(dtype));
  return ncclFloat32;
}

cudaStream_t cuda_stream(CommStream stream) { return static_cast<cudaStream_t>(stream.cuda_stream); }

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const std::vector<uint8_t>& unique_id, int rank, int world_size, const NcclOptions& options)
      : rank_(rank), world_size_(world_size), options_(options) {
    MT_USER_CHECK(unique_id.size() == sizeof(ncclUniqueId), "NCCL: a unique id of {} bytes, expected {}",
                  unique_id.size(), sizeof(ncclUniqueId));
    ncclUniqueId id;
    std::memcpy(&id, unique_id.data(), sizeof id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t started = ncclCommInitRankConfig(&comm_, world_size, id, rank, &config);
    if (started != ncclSuccess && started != ncclInProgress) {
      const std::string detail = ncclGetLastError(comm_);
      comm_ = nullptr;
      mt_fail("NCCL init of rank {} of {} failed: {} ({})", rank, world_size, ncclGetErrorString(started), detail);
    }
    settle("ncclCommInitRankConfig", Clock::now() + options_.timeout);
  }
  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      // Finalize flushes outstanding work; when a peer is gone it fails or stalls, and abort ends it.
      ncclResult_t state = ncclCommFinalize(comm_);
      const auto deadline = Clock::now() + std::chrono::seconds(30);
      while (state == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::yield();
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
      }
      if (state == ncclSuccess) ncclCommDestroy(comm_);
      else ncclCommAbort(comm_);
    }
    // After the communicator: an abort has ended any NCCL kernel still on the side stream.
    destroy_side_stream();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string name() const override { return "nccl"; }

  void all_reduce_sum(const Tensor& send, const Tensor& recv, CommStream stream) override {
    check_collective_shapes("all_reduce_sum", send, recv, world_size_);
    if (skip(send)) return;
    enqueue("ncclAllReduce", ncclAllReduce(send.data, recv.data, static_cast<size_t>(send.numel()),
                                           nccl_dtype(send.dtype), ncclSum, comm_, cuda_stream(stream)));
  }
  void reduce_scatter_sum(const Tensor& send, const Tensor& recv, CommStream stream) override {
    check_collective_shapes("reduce_scatter_sum", send, recv, world_size_);
    if (skip(send)) return;
    enqueue("ncclReduceScatter", ncclReduceScatter(send.data, recv.data, static_cast<size_t>(recv.numel()),
                                                   nccl_dtype(send.dtype), ncclSum, comm_, cuda_stream(stream)));
  }
  void all_gather(const Tensor& send, const Tensor& recv, CommStream stream) override {
    check_collective_shapes("all_gather", send, recv, world_size_);
    if (skip(send)) return;
    enqueue("ncclAllGather", ncclAllGather(send.data, recv.data, static_cast<size_t>(send.numel()),
                                           nccl_dtype(send.dtype), comm_, cuda_stream(stream)));
  }
  void broadcast(const Tensor& buffer, int root, CommStream stream) override {
    MT_ASSERT(root >= 0 && root < world_size_, "broadcast from rank {} of {}", root, world_size_);
    if (skip(buffer)) return;
    enqueue("ncclBroadcast", ncclBroadcast(buffer.data, buffer.data, static_cast<size_t>(buffer.numel()),
                                           nccl_dtype(buffer.dtype), root, comm_, cuda_stream(stream)));
  }
  void wait(CommStream stream) override {
    check_usable();
    const auto deadline = Clock::now() + options_.timeout;
    for (;;) {
      const cudaError_t done = cudaStreamQuery(cuda_stream(stream));
      ncclResult_t state = ncclSuccess;
      const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
      if (queried != ncclSuccess || (state != ncclSuccess && state != ncclInProgress))
        fail_and_abort(fmt::format("an NCCL operation failed: {} ({}); a peer rank probably exited or lost its "
                                   "connection (its own error says why)",
                                   ncclGetErrorString(queried != ncclSuccess ? queried : state),
                                   ncclGetLastError(comm_)));
      if (done == cudaSuccess) return;
      MT_ASSERT(done == cudaErrorNotReady, "cudaStreamQuery: {}", cudaGetErrorString(done));
      if (Clock::now() > deadline)
        fail_and_abort(fmt::format("the collectives did not finish within {} s: a peer rank is probably dead or "
                                   "stuck",
                                   std::chrono::duration_cast<std::chrono::seconds>(options_.timeout).count()));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // The side stream: non-blocking, so that it does not serialise with the legacy default
  // stream the backend computes on; events order the two (cudaEventRecord / cudaStreamWaitEvent;
  // a wait takes the event's most recent record at the time of the call, so one event per
  // purpose can be recorded again and again).
  CommStream side_stream() override {
    if (side_ == nullptr) {
      check_cuda("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
      check_cuda("cudaEventCreateWithFlags", cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
    }
    return {side_};
  }
  CommEvent create_event() override {
    cudaEvent_t event = nullptr;
    check_cuda("cudaEventCreateWithFlags", cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    events_.push_back(event);
    return {static_cast<int32_t>(events_.size() - 1)};
  }
  void after_compute(CommStream side) override {
    if (side.cuda_stream == nullptr) return;  // the compute stream itself: ordered already
    check_cuda("cudaEventRecord", cudaEventRecord(compute_done_, kComputeStream));
    check_cuda("cudaStreamWaitEvent", cudaStreamWaitEvent(cuda_stream(side), compute_done_, 0));
  }
  void record(CommEvent event, CommStream side) override {
    check_cuda("cudaEventRecord", cudaEventRecord(event_at(event), cuda_stream(side)));
  }
  void compute_waits(CommEvent event) override {
    check_cuda("cudaStreamWaitEvent", cudaStreamWaitEvent(kComputeStream, event_at(event), 0));
  }

 private:
  // The backend's stream (ops/cuda/cuda_backend.h): the legacy default stream.
  static constexpr cudaStream_t kComputeStream = nullptr;
  cudaEvent_t event_at(CommEvent event) const {
    MT_ASSERT(event.id >= 0 && static_cast<size_t>(event.id) < events_.size(), "communicator event {}", event.id);
    return events_[static_cast<size_t>(event.id)];
  }
  static void check_cuda(const char* what, cudaError_t status) {
    MT_USER_CHECK(status == cudaSuccess, "{}: {}", what, cudaGetErrorString(status));
  }
  void destroy_side_stream() {
    // A failed synchronize leaves the stream to process exit.
    if (side_ != nullptr && cudaStreamSynchronize(side_) == cudaSuccess) cudaStreamDestroy(side_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (compute_done_ != nullptr) cudaEventDestroy(compute_done_);
    side_ = nullptr;
    compute_done_ = nullptr;
    events_.clear();
  }
  bool skip(const Tensor& t) {
    check_usable();
    return t.device == Device::meta || t.numel() == 0;
  }
  void check_usable() const {
    MT_USER_CHECK(comm_ != nullptr, "NCCL: rank {} of {}: the communicator was aborted after an earlier error",
                  rank_, world_size_);
  }
  void enqueue(const char* what, ncclResult_t result) {
    if (result != ncclSuccess && result != ncclInProgress)
      fail_and_abort(fmt::format("{} failed: {} ({})", what, ncclGetErrorString(result), ncclGetLastError(comm_)));
    settle(what, Clock::now() + options_.timeout);
  }
  // A non-blocking communicator must leave ncclInProgress before the next NCCL call.
  void settle(const char* what, Clock::time_point deadline) {
    for (;;) {
      ncclResult_t state = ncclInProgress;
      const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
      if (queried == ncclSuccess && state == ncclSuccess) return;
      if (queried != ncclSuccess || state != ncclInProgress)
        fail_and_abort(fmt::format("{} failed: {} ({}); is every rank running?", what,
                                   ncclGetErrorString(queried != ncclSuccess ? queried : state),
                                   ncclGetLastError(comm_)));
      if (Clock::now() > deadline)
        fail_and_abort(fmt::format("{} did not finish within {} s: a rank is missing or stuck", what,
                                   std::chrono::duration_cast<std::chrono::seconds>(options_.timeout).count()));
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  [[noreturn]] void fail_and_abort(const std::string& message) {
    ncclComm_t comm = comm_;
    comm_ = nullptr;
    if (comm != nullptr) ncclCommAbort(comm);
    mt_fail("NCCL, rank {} of {}: {}", rank_, world_size_, message);
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t side_ = nullptr;
  cudaEvent_t compute_done_ = nullptr;
  std::vector<cudaEvent_t> events_;
  int rank_, world_size_;
  NcclOptions options_;
};

}  // namespace

bool nccl_available() { return true; }

std::vector<uint8_t> nccl_unique_id() {
  apply_nccl_environment_defaults();
  ncclUniqueId id;
  const ncclResult_t result = ncclGetUniqueId(&id);
  MT_USER_CHECK(result == ncclSuccess, "ncclGetUniqueId failed: {} ({})", ncclGetErrorString(result),
                ncclGetLastError(nullptr));
  std::vector<uint8_t> bytes(sizeof id);
  std::memcpy(bytes.data(), &id, sizeof id);
  return bytes;
}

std::unique_ptr<Communicator> make_nccl_communicator_from_id(const std::vector<uint8_t>& unique_id, int rank,
                                                             int world_size, const NcclOptions& options) {
  apply_nccl_environment_defaults();
  return std::make_unique<NcclCommunicator>(unique_id, rank, world_size, options);
}

std::unique_ptr<Communicator> make_nccl_communicator(const LaunchEnv& env, const NcclOptions& options) {
  apply_nccl_environment_defaults();
  int devices = 0;
  const cudaError_t counted = cudaGetDeviceCount(&devices);
  MT_USER_CHECK(counted == cudaSuccess && devices > 0, "{}: no CUDA device is visible ({})", env.describe(),
                cudaGetErrorString(counted));
  MT_USER_CHECK(env.local_rank < devices,
                "{}: local rank {} has no GPU of its own: {} device(s) are visible (start one process per GPU, "
                "and do not narrow CUDA_VISIBLE_DEVICES per process)",
                env.describe(), env.local_rank, devices);
  const cudaError_t selected = cudaSetDevice(env.local_rank);
  MT_USER_CHECK(selected == cudaSuccess, "cudaSetDevice({}): {}", env.local_rank, cudaGetErrorString(selected));
  BootstrapOptions bootstrap;
  bootstrap.address = env.master_addr;
  bootstrap.port = env.master_port;
  bootstrap.rank = env.rank;
  bootstrap.world_size = env.world_size;
  bootstrap.timeout = options.bootstrap_timeout;
  const std::vector<uint8_t> id = bootstrap_broadcast(bootstrap, env.rank == 0 ? nccl_unique_id() : std::vector<uint8_t>{});
  return std::make_unique<NcclCommunicator>(id, env.rank, env.world_size, options);
}

}  // namespace memtune
