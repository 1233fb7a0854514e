// Launch environments of torchrun, Open MPI, PMI and Slurm, and the errors for bad ones.
#include "memtune/parallel/launch_env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>

#include "memtune/core/error.h"

using namespace memtune;

namespace {

using Vars = std::map<std::string, std::string>;

LaunchEnv parse(const Vars& vars) {
  return launch_env_from([&](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const Vars& vars) {
  try {
    parse(vars);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(LaunchEnv, NothingSetIsOneProcess) {
  const LaunchEnv env = parse({});
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_FALSE(env.distributed());
  EXPECT_EQ(env.source, LaunchSource::single_process);
}

TEST(LaunchEnv, Torchrun) {
  const LaunchEnv env = parse({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                               {"MASTER_ADDR", "10.0.0.7"}, {"MASTER_PORT", "29400"}});
  EXPECT_EQ(env.source, LaunchSource::torchrun);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "10.0.0.7");
  EXPECT_EQ(env.master_port, 29400);
  EXPECT_NE(env.describe().find("rank 3 of 4"), std::string::npos);
}

TEST(LaunchEnv, TorchrunWithOneProcessNeedsNoMaster) {
  const LaunchEnv env = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}});
  EXPECT_FALSE(env.distributed());
  EXPECT_TRUE(env.master_addr.empty());
}

TEST(LaunchEnv, OpenMpiWithTheDefaultPort) {
  const LaunchEnv env = parse({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                               {"MASTER_ADDR", "node1"}});
  EXPECT_EQ(env.source, LaunchSource::open_mpi);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_port, kDefaultMasterPort);
}

TEST(LaunchEnv, PmiTakesTheLocalRankFromMpiLocalRankIdOrLocalRank) {
  LaunchEnv env = parse({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}, {"MASTER_ADDR", "h"}});
  EXPECT_EQ(env.source, LaunchSource::pmi);
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.local_rank, 0);
  env = parse({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "h"}});
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_NE(error_of({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MASTER_ADDR", "h"}}).find("export LOCAL_RANK"),
            std::string::npos);
}

TEST(LaunchEnv, Slurm) {
  const LaunchEnv env = parse({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                               {"SLURM_NTASKS_PER_NODE", "4"}, {"MASTER_ADDR", "gpu01"}, {"MASTER_PORT", "6000"}});
  EXPECT_EQ(env.source, LaunchSource::slurm);
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  // A heterogeneous allocation's list is not checked.
  EXPECT_EQ(parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "0"},
                   {"SLURM_NTASKS_PER_NODE", "2(x4)"}, {"MASTER_ADDR", "gpu01"}}).local_world_size, 0);
}

TEST(LaunchEnv, TorchrunInsideSlurmAndMpiInsideSlurmReadTheInnerLauncher) {
  EXPECT_EQ(parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "a"},
                   {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"}}).source,
            LaunchSource::torchrun);
  EXPECT_EQ(parse({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                   {"MASTER_ADDR", "a"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}).source,
            LaunchSource::open_mpi);
}

TEST(LaunchEnv, InconsistentValuesAreClearErrors) {
  const Vars base = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "a"}};
  auto with = [&](std::string key, std::string value) {
    Vars v = base;
    v[key] = value;
    return v;
  };
  EXPECT_NE(error_of(with("RANK", "2")).find("RANK=2 is outside [0, 2)"), std::string::npos);
  EXPECT_NE(error_of(with("RANK", "-1")).find("outside"), std::string::npos);
  EXPECT_NE(error_of(with("RANK", "one")).find("RANK=one: expected an integer"), std::string::npos);
  EXPECT_NE(error_of(with("WORLD_SIZE", "0")).find("at least 1"), std::string::npos);
  EXPECT_NE(error_of(with("LOCAL_RANK", "2")).find("LOCAL_RANK=2 is not below the world size 2"), std::string::npos);
  EXPECT_EQ(error_of(with("LOCAL_WORLD_SIZE", "1")), "");
  Vars two_nodes = with("LOCAL_WORLD_SIZE", "1");
  two_nodes["LOCAL_RANK"] = "1";
  EXPECT_NE(error_of(two_nodes).find("LOCAL_RANK=1 is not below LOCAL_WORLD_SIZE=1"), std::string::npos);
  EXPECT_NE(error_of(with("LOCAL_WORLD_SIZE", "3")).find("not in [1, 2]"), std::string::npos);
  EXPECT_NE(error_of(with("MASTER_PORT", "70000")).find("1..65535"), std::string::npos);
  EXPECT_NE(error_of(with("MASTER_ADDR", "")).find("MASTER_ADDR is not set"), std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "2"}}).find("RANK is not set"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "1"}}).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(error_of({{"LOCAL_RANK", "3"}}).find("without RANK"), std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}}).find("scontrol"),
            std::string::npos);
}

TEST(LaunchEnv, NvlsIsTurnedOffUnlessTheUserSetIt) {
  unsetenv("NCCL_NVLS_ENABLE");
  apply_nccl_environment_defaults();
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  apply_nccl_environment_defaults();
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "1");
  unsetenv("NCCL_NVLS_ENABLE");
}
