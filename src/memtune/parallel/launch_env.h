// Who this process is in a multi-process run, from the variables its launcher set.
//
// Launchers, in the order they are looked for (the first whose rank variable is set wins, so
// torchrun inside a Slurm allocation, or mpirun inside one, is read as torchrun or mpirun):
//   torchrun      RANK, WORLD_SIZE, LOCAL_RANK (and LOCAL_WORLD_SIZE), MASTER_ADDR, MASTER_PORT
//   Open MPI      OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
//   PMI (MPICH, Intel MPI, hydra)  PMI_RANK, PMI_SIZE; local rank from MPI_LOCALRANKID
//   Slurm (srun)  SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
// None set: a single process (rank 0 of 1). MPI and Slurm do not say where rank 0 listens:
// MASTER_ADDR is required with them when world_size > 1, and MASTER_PORT defaults to 29500 (as
// torch.distributed does). LOCAL_RANK, when set, overrides an MPI launcher's local rank.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace memtune {

enum class LaunchSource : uint8_t { single_process, torchrun, open_mpi, pmi, slurm };
std::string_view launch_source_name(LaunchSource source);  // "torchrun", "Open MPI", ...

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;         // the CUDA device this process uses
  int local_world_size = 0;   // processes on this node; 0: the launcher did not say
  std::string master_addr;    // rank 0's host; empty for a single process
  int master_port = 0;
  LaunchSource source = LaunchSource::single_process;
  bool distributed() const { return world_size > 1; }
  std::string describe() const;  // "rank 1 of 2 (local rank 1, torchrun, rendezvous 10.0.0.1:29500)"
};

constexpr int kDefaultMasterPort = 29500;

// Reads the variables through `lookup` (null: not set). Throws memtune::Error naming the
// variable for a value that is not an integer, a rank outside [0, world_size), a local rank
// outside [0, local_world_size), a launcher whose variables are only partly set, a missing
// MASTER_ADDR, or a port outside 1..65535.
LaunchEnv launch_env_from(const std::function<const char*(const char*)>& lookup);
// From this process's environment.
LaunchEnv launch_env_from_process();

// NCCL settings memtune wants unless the user chose otherwise: NCCL_NVLS_ENABLE=0 (NVLink
// multicast off: it reserves device memory outside the plan). Call before NCCL initialises.
void apply_nccl_environment_defaults();

}  // namespace memtune
