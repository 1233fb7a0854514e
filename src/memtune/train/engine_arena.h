// An engine together with the arena it runs in: plans, allocates the planned bytes once, and
// builds the engine over them. Freed when it goes out of scope.
#pragma once

#include <memory>

#include "memtune/parallel/communicator.h"
#include "memtune/ops/backend.h"
#include "memtune/train/engine.h"

namespace memtune {

class PlannedEngine {
 public:
  // A communicator of world_size > 1 makes it one rank of a data-parallel run (engine.h).
  PlannedEngine(Backend& backend, const RunConfig& run, const LlamaConfig& model,
                Communicator* communicator = nullptr)
      : backend_(backend),
        plan_(plan_run(run, model, backend.device(), communicator ? communicator->world_size() : 1)) {
    arena_ = backend_.allocate_arena(plan_.arena_bytes);
    engine_ = std::make_unique<Engine>(backend_, arena_, plan_.arena_bytes, run, model, communicator);
  }
  ~PlannedEngine() {
    engine_.reset();
    backend_.free_arena(arena_);
  }
  PlannedEngine(const PlannedEngine&) = delete;
  PlannedEngine& operator=(const PlannedEngine&) = delete;

  Engine& engine() { return *engine_; }
  Engine* operator->() { return engine_.get(); }
  const Plan& plan() const { return plan_; }

 private:
  Backend& backend_;
  Plan plan_;
  void* arena_ = nullptr;
  std::unique_ptr<Engine> engine_;
};

}  // namespace memtune
