// Multi-GPU training: one process per GPU, started by torchrun, mpirun or srun.
//
// Why a folder of its own: data parallelism cuts across train/ (the loop and the engine), lora/
// (the adapter state that is reduced and sharded) and plan/ (per-rank memory), and it brings a
// transport (NCCL) and a bootstrap (TCP) that nothing else needs. Keeping it in parallel/ leaves
// world_size == 1 exactly as it was and keeps the NCCL dependency in one file.
//
//   launch_env.h       rank / world / master address from the launcher's variables
//   tcp_bootstrap.h    rank 0 hands an opaque blob (the ncclUniqueId) to every rank over TCP
//   communicator.h     (this) the collectives on memtune Tensors, and the implementations
//   grad_buckets.h     adapter grads in buckets, in the order the backward finishes them
//   zero_shard.h       ZeRO-1: the flat fp32 adapter space split into equal rank shards
//   sharded_base.h     FSDP-QLoRA: the frozen base split across ranks, gathered per layer
//   data_parallel.h    the engine's data-parallel step built from the above
//
// Tensors carry only bytes over NCCL; the TCP socket carries only the bootstrap id.
//
// Room parallel/ (docs/ARCHITECTURE.md) shares a floor with train/: the engine builds the
// data-parallel state, and the sharded base sizes a rank from the engine's plan.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memtune/core/tensor.h"

namespace memtune {

class Backend;
struct LaunchEnv;

// The stream a collective is ordered on. Null is CUDA's legacy default stream, which is where
// the CUDA backend runs every op (ops/cuda/cuda_backend.h), so collectives are ordered with the
// step's kernels without events. CPU communicators ignore it.
struct CommStream {
  void* cuda_stream = nullptr;
};

// A point in one stream's work, for ordering another stream after it (a CUDA event on NCCL).
struct CommEvent {
  int32_t id = -1;
};

// Collectives over all ranks. Every rank must make the same calls in the same order with the
// same element counts and dtypes (a mismatch is an internal error: MT_ASSERT where it can be
// seen). Calls are asynchronous on the stream; wait() is the point where the host may read the
// results, and the point where a dead or stuck peer becomes a memtune::Error instead of a hang.
// Sums are in the tensor's dtype (f32 for everything memtune reduces). Tensors on the meta
// device are not touched (the planner runs the data-parallel step too).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string name() const = 0;

  // recv = sum over ranks of send; recv may be send (in place). Same element count.
  virtual void all_reduce_sum(const Tensor& send, const Tensor& recv, CommStream stream) = 0;
  // recv (n elements) = sum over ranks of send[rank * n, (rank + 1) * n); send has world * n.
  // In place when recv.data == send.data + rank * n bytes (NCCL's in-place convention).
  virtual void reduce_scatter_sum(const Tensor& send, const Tensor& recv, CommStream stream) = 0;
  // recv[r * n, (r + 1) * n) = send of rank r; send has n elements, recv world * n. In place
  // when send.data == recv.data + rank * n bytes.
  virtual void all_gather(const Tensor& send, const Tensor& recv, CommStream stream) = 0;
  // Every rank's buffer = root's buffer.
  virtual void broadcast(const Tensor& buffer, int root, CommStream stream) = 0;
  // Returns when everything enqueued on the stream has finished. Throws memtune::Error when a
  // peer failed or nothing finished within the communicator's timeout (the communicator is
  // aborted then: no further call may be made).
  virtual void wait(CommStream stream) = 0;

  // ---- overlap with compute ----
  // Collectives that should run beside the step's kernels go on side_stream(), ordered by
  // events instead of sharing the compute stream (the backend's: CUDA's legacy default stream):
  //   after_compute(side)       the side stream's next work waits for every kernel issued so far;
  //   record(event, side)       marks the side stream's work issued so far;
  //   compute_waits(event)      the compute stream's next kernels wait for that mark.
  // The NCCL communicator makes a non-blocking CUDA stream of its own. The CPU, meta and
  // in-process communicators run every collective synchronously: their side stream is the null
  // stream and the three calls do nothing (which is exact there).
  virtual CommStream side_stream() { return {}; }
  virtual CommEvent create_event() { return {}; }
  virtual void after_compute(CommStream /*side*/) {}
  virtual void record(CommEvent /*event*/, CommStream /*side*/) {}
  virtual void compute_waits(CommEvent /*event*/) {}
  // ---- end overlap with compute ----
};

// Checks shared by the implementations: same dtype, the element counts the collective needs.
void check_collective_shapes(std::string_view collective, const Tensor& send, const Tensor& recv,
                             int world_size);

// world_size 1: every collective is the identity (a copy on the tensors' device when recv is not
// send).
std::unique_ptr<Communicator> make_single_rank_communicator();
// For the planner: reports (rank, world_size) and does nothing (meta tensors only).
std::unique_ptr<Communicator> make_meta_communicator(int rank, int world_size);

struct NcclOptions {
  // How long init and any wait() may take before the others are told that a rank is gone.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  std::chrono::milliseconds bootstrap_timeout{std::chrono::minutes(5)};
};

// Whether this binary was built with NCCL (CUDA and nccl.h / libnccl found at configure time).
bool nccl_available();
// NCCL over the launch environment: rank 0 makes the unique id and hands it to the others through
// the TCP bootstrap (tcp_bootstrap.h) at MASTER_ADDR:MASTER_PORT, then every rank joins on CUDA
// device env.local_rank. Sets NCCL_NVLS_ENABLE=0 unless the user set it. Throws memtune::Error
// without NCCL, on a bootstrap failure, or when init does not finish within the timeout.
std::unique_ptr<Communicator> make_nccl_communicator(const LaunchEnv& env, const NcclOptions& options = {});
// The bytes of a fresh ncclUniqueId (for in-process use: one rank, or the GPU test).
std::vector<uint8_t> nccl_unique_id();
// Joins the communicator of `unique_id` as `rank` of `world_size` on the current CUDA device.
std::unique_ptr<Communicator> make_nccl_communicator_from_id(const std::vector<uint8_t>& unique_id, int rank,
                                                             int world_size, const NcclOptions& options = {});

// Makes CUDA device env.local_rank current (a no-op for one process or without CUDA). Call it
// before the CUDA backend is made: the backend's handles belong to the device current then.
void select_local_cuda_device(const LaunchEnv& env);

// The communicator of a run on `device`: the identity for world_size 1, NCCL for more (which
// selects CUDA device env.local_rank: make it before the backend). A CPU run with world_size > 1
// is refused (the CPU backend trains on one process).
std::unique_ptr<Communicator> make_communicator(const LaunchEnv& env, Device device);

}  // namespace memtune
