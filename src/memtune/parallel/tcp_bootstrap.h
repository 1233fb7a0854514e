// The rendezvous of a multi-process run over TCP (POSIX sockets): rank 0 listens at
// MASTER_ADDR:MASTER_PORT, every other rank connects (retrying until rank 0 is up), says who it
// is, and receives an opaque blob from rank 0: the ncclUniqueId, from which NCCL builds its own
// connections. Only that blob and a few bytes of protocol cross this socket; tensors never do.
//
// Protocol (all integers little-endian u32):
//   peer -> 0:  magic "MTB1", version, rank, world_size
//   0 -> peer:  magic, blob length, blob bytes      (after all peers have said hello)
//   peer -> 0:  magic                               (ack: rank 0 returns once all have acked)
// Every wait has a deadline; a peer that closes its socket, a duplicate or out-of-range rank, a
// world_size that differs from rank 0's, or a deadline that passes is a memtune::Error that says
// which rank and what to check.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace memtune {

struct BootstrapOptions {
  std::string address;  // rank 0's host (name or IP); rank 0 binds to it (empty: all interfaces)
  int port = 0;
  int rank = 0;
  int world_size = 1;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // for the whole exchange
  std::chrono::milliseconds retry_interval{200};               // between connection attempts
};

// Rank 0 passes the blob and gets it back; other ranks pass nothing and get rank 0's blob.
std::vector<uint8_t> bootstrap_broadcast(const BootstrapOptions& options, const std::vector<uint8_t>& blob = {});

}  // namespace memtune
