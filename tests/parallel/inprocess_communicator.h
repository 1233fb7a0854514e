// TEST DOUBLE (tests only): a Communicator for ranks that are threads of one process, sharing
// memory, so that the data-parallel logic can be checked on the CPU without NCCL. Every
// collective is a rendezvous of all ranks: each posts its buffer, all read what they need into a
// private result, all meet again, and only then do they write (so in-place calls are safe).
// Sums run over ranks 0..world-1 in order: every rank gets bit-identical results, as with NCCL.
// A rank that does not arrive within the timeout makes the others throw memtune::Error.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "memtune/core/error.h"
#include "memtune/parallel/communicator.h"

namespace memtune::disttest {

class InProcessGroup {
 public:
  explicit InProcessGroup(int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(20))
      : world_size_(world_size), timeout_(timeout), posted_(static_cast<size_t>(world_size)) {}
  int world_size() const { return world_size_; }

  // All ranks meet; throws when one does not come in time.
  void meet(int rank) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == world_size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != generation || broken_; }) || broken_) {
      broken_ = true;
      cv_.notify_all();
      mt_fail("in-process communicator: rank {} waited more than {} ms for the other ranks (one stopped)", rank,
              timeout_.count());
    }
  }
  void post(int rank, const Tensor& t) { posted_[static_cast<size_t>(rank)] = t; }
  const Tensor& posted(int rank) const { return posted_[static_cast<size_t>(rank)]; }

 private:
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::vector<Tensor> posted_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool broken_ = false;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(InProcessGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_.world_size(); }
  std::string name() const override { return "in-process (test double)"; }
  int calls() const { return calls_; }

  void all_reduce_sum(const Tensor& send, const Tensor& recv, CommStream) override {
    check_collective_shapes("all_reduce_sum", send, recv, world_size());
    collective(send, [&](std::vector<uint8_t>& out) { sum_of(0, send.numel(), send.dtype, out); }, recv);
  }
  void reduce_scatter_sum(const Tensor& send, const Tensor& recv, CommStream) override {
    check_collective_shapes("reduce_scatter_sum", send, recv, world_size());
    collective(send, [&](std::vector<uint8_t>& out) { sum_of(rank_ * recv.numel(), recv.numel(), send.dtype, out); },
               recv);
  }
  void all_gather(const Tensor& send, const Tensor& recv, CommStream) override {
    check_collective_shapes("all_gather", send, recv, world_size());
    collective(send, [&](std::vector<uint8_t>& out) {
      out.resize(recv.nbytes());
      for (int r = 0; r < world_size(); ++r)
        std::memcpy(out.data() + r * send.nbytes(), group_.posted(r).data, send.nbytes());
    }, recv);
  }
  void broadcast(const Tensor& buffer, int root, CommStream) override {
    collective(buffer, [&](std::vector<uint8_t>& out) {
      out.resize(buffer.nbytes());
      std::memcpy(out.data(), group_.posted(root).data, buffer.nbytes());
    }, buffer);
  }
  void wait(CommStream) override {}

 private:
  template <typename Read>
  void collective(const Tensor& send, Read read, const Tensor& recv) {
    ++calls_;
    if (send.device == Device::meta) return;
    group_.post(rank_, send);
    group_.meet(rank_);
    std::vector<uint8_t> result;
    read(result);
    group_.meet(rank_);  // every rank has read: writing is safe now
    std::memcpy(recv.data, result.data(), result.size());
    group_.meet(rank_);  // nobody posts the next buffer before everyone has written
  }
  void sum_of(int64_t first, int64_t count, DType dtype, std::vector<uint8_t>& out) const {
    out.resize(static_cast<size_t>(count) * dtype_size(dtype));
    if (dtype == DType::i32) {
      auto* o = reinterpret_cast<int32_t*>(out.data());
      for (int64_t i = 0; i < count; ++i) {
        int32_t s = 0;
        for (int r = 0; r < world_size(); ++r) s += group_.posted(r).as<int32_t>()[first + i];
        o[i] = s;
      }
      return;
    }
    MT_ASSERT(dtype == DType::f32, "the test double sums f32 and i32 only");
    auto* o = reinterpret_cast<float*>(out.data());
    for (int64_t i = 0; i < count; ++i) {
      float s = 0;
      for (int r = 0; r < world_size(); ++r) s += group_.posted(r).as<float>()[first + i];
      o[i] = s;
    }
  }

  InProcessGroup& group_;
  int rank_;
  int calls_ = 0;
};

// Runs body(rank) on world_size threads; rethrows the first exception (after all have ended).
// Each rank's CPU ops run on one OpenMP thread: ranks that are threads share the cores, and
// teams of spinning OpenMP threads per rank made the tests ten times slower on 2 cores.
template <typename Body>
void run_ranks(int world_size, Body body) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r)
    threads.emplace_back([&, r] {
#ifdef _OPENMP
      omp_set_num_threads(1);  // this thread's parallel regions only
#endif
      try {
        body(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace memtune::disttest
