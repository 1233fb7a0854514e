#include "memtune/parallel/launch_env.h"

#include <charconv>
#include <cstdlib>

#include <fmt/format.h>

#include "memtune/core/enum_names.h"
#include "memtune/core/error.h"

namespace memtune {
namespace {

struct Lookup {
  const std::function<const char*(const char*)>& get;
  bool has(const char* name) const {
    const char* v = get(name);
    return v != nullptr && *v != '\0';
  }
  std::string text(const char* name) const { return has(name) ? std::string(get(name)) : std::string(); }
  // A variable the launcher must have set.
  int integer(const char* name, std::string_view launcher) const {
    MT_USER_CHECK(has(name), "the {} variables are incomplete: {} is not set", launcher, name);
    return parse(name);
  }
  int parse(const char* name) const {
    const std::string value = text(name);
    int out = 0;
    const char* end = value.data() + value.size();
    const auto [ptr, ec] = std::from_chars(value.data(), end, out);
    MT_USER_CHECK(ec == std::errc() && ptr == end, "{}={}: expected an integer", name, value);
    return out;
  }
};

struct Names {
  LaunchSource source;
  const char* rank;
  const char* size;
  const char* local_rank;  // null: the launcher has none
  const char* local_size;  // null: the launcher has none
};

constexpr Names kLaunchers[] = {
    {LaunchSource::torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {LaunchSource::open_mpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {LaunchSource::pmi, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {LaunchSource::slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
};

}  // namespace

constexpr EnumName<LaunchSource> kLaunchSourceNames[] = {
    {LaunchSource::single_process, "single process"}, {LaunchSource::torchrun, "torchrun"},
    {LaunchSource::open_mpi, "Open MPI"}, {LaunchSource::pmi, "PMI"}, {LaunchSource::slurm, "Slurm"}};

std::string_view launch_source_name(LaunchSource source) { return name_of(kLaunchSourceNames, source); }

std::string LaunchEnv::describe() const {
  if (!distributed()) return fmt::format("a single process ({})", launch_source_name(source));
  return fmt::format("rank {} of {} (local rank {}, {}, rendezvous {}:{})", rank, world_size, local_rank,
                     launch_source_name(source), master_addr, master_port);
}

LaunchEnv launch_env_from(const std::function<const char*(const char*)>& lookup) {
  const Lookup env{lookup};
  LaunchEnv out;
  const Names* found = nullptr;
  for (const Names& names : kLaunchers)
    if (env.has(names.rank) || (names.source == LaunchSource::torchrun && env.has(names.size))) {
      found = &names;
      break;
    }
  if (found == nullptr) {
    MT_USER_CHECK(!env.has("LOCAL_RANK") || env.parse("LOCAL_RANK") == 0,
                  "LOCAL_RANK={} is set without RANK and WORLD_SIZE (or an MPI / Slurm rank): is this process "
                  "one of several? Start it with torchrun, mpirun or srun",
                  env.text("LOCAL_RANK"));
    return out;
  }
  const std::string launcher(launch_source_name(found->source));
  out.source = found->source;
  out.rank = env.integer(found->rank, launcher);
  out.world_size = env.integer(found->size, launcher);
  MT_USER_CHECK(out.world_size >= 1, "{}={}: the world size must be at least 1", found->size, out.world_size);
  MT_USER_CHECK(out.rank >= 0 && out.rank < out.world_size, "{}={} is outside [0, {}) ({}={})", found->rank,
                out.rank, out.world_size, found->size, out.world_size);

  // The local rank picks the GPU. torchrun always sets it; an MPI launcher may not (PMI), and a
  // LOCAL_RANK exported by a wrapper script takes precedence over the launcher's own.
  const char* local_name = nullptr;
  if (env.has("LOCAL_RANK")) local_name = "LOCAL_RANK";
  else if (found->local_rank != nullptr && env.has(found->local_rank)) local_name = found->local_rank;
  if (local_name != nullptr) {
    out.local_rank = env.parse(local_name);
  } else {
    MT_USER_CHECK(out.world_size == 1,
                  "{}: no local rank ({} or LOCAL_RANK) is set, so the GPU of rank {} is unknown; export "
                  "LOCAL_RANK for each process",
                  launcher, found->local_rank == nullptr ? "none" : found->local_rank, out.rank);
    out.local_rank = 0;
  }
  MT_USER_CHECK(out.local_rank >= 0, "{}={}: a local rank cannot be negative", local_name, out.local_rank);
  MT_USER_CHECK(out.local_rank < out.world_size, "{}={} is not below the world size {} ({}={})", local_name,
                out.local_rank, out.world_size, found->size, out.world_size);
  const char* local_size_name = found->source == LaunchSource::torchrun || !env.has(found->local_size)
                                    ? "LOCAL_WORLD_SIZE"
                                    : found->local_size;
  // Slurm's SLURM_NTASKS_PER_NODE may be a list ("2(x3)") on heterogeneous allocations: only a
  // plain number is checked.
  const bool plain_local_size =
      env.has(local_size_name) &&
      env.text(local_size_name).find_first_not_of("0123456789") == std::string::npos;
  if (plain_local_size) {
    out.local_world_size = env.parse(local_size_name);
    MT_USER_CHECK(out.local_world_size >= 1 && out.local_world_size <= out.world_size,
                  "{}={} is not in [1, {}] (the world size)", local_size_name, out.local_world_size,
                  out.world_size);
    MT_USER_CHECK(out.local_rank < out.local_world_size, "{}={} is not below {}={}", local_name, out.local_rank,
                  local_size_name, out.local_world_size);
  }
  if (!out.distributed()) return out;

  out.master_addr = env.text("MASTER_ADDR");
  MT_USER_CHECK(!out.master_addr.empty(),
                "{} started {} processes but MASTER_ADDR is not set: export MASTER_ADDR as the host of rank 0 "
                "(under Slurm: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1))",
                launcher, out.world_size);
  out.master_port = env.has("MASTER_PORT") ? env.parse("MASTER_PORT") : kDefaultMasterPort;
  MT_USER_CHECK(out.master_port >= 1 && out.master_port <= 65535, "MASTER_PORT={}: expected a port in 1..65535",
                out.master_port);
  return out;
}

LaunchEnv launch_env_from_process() {
  return launch_env_from([](const char* name) -> const char* { return std::getenv(name); });
}

void apply_nccl_environment_defaults() {
  // overwrite = 0: a value the user exported wins.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
}

}  // namespace memtune
