// Several ranks' engines in one process, for the data-parallel tests: each rank a thread with its
// own in-process communicator, CPU backend and planned engine.
#pragma once

#include "inprocess_communicator.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/train/engine_arena.h"
#include "memtune/train/run_config.h"
#include "../support/engine_setup.h"

namespace memtune::disttest {

// Runs body(rank, engine, comm) for ranks 0..world-1 over `group`; each engine is planned and
// allocated for (run, model) on its own CPU backend, with the seeded base and adapters of
// enginetest::init_with_nonzero_b, the same on every rank.
template <typename Body>
void run_seeded_engines(InProcessGroup& group, int world, const RunConfig& run, const LlamaConfig& model, Body body) {
  run_ranks(world, [&](int rank) {
    InProcessCommunicator comm(group, rank);
    auto backend = make_cpu_backend();
    PlannedEngine engine(*backend, run, model, &comm);
    enginetest::init_with_nonzero_b(engine.engine());
    body(rank, engine, comm);
  });
}

}  // namespace memtune::disttest
