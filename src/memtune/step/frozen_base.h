// Where the step finds the frozen base while it runs.
//
// On one device the whole base is resident and ModelWeights' tensors point at it all the time.
// With the base sharded across ranks (parallel/sharded_base.h), a rank keeps only its shard of each
// unit (the embedding, one decoder layer, the final norm with the LM head), and a unit's
// ModelWeights tensors point at real bytes only between acquire and release: the provider has
// gathered the unit into a gather buffer by then (and starts gathering the next unit of the
// pass into the other buffer, so that the gather overlaps this unit's compute).
//
// The step announces each pass (its units in order: the forward's, then for a backward the
// layers again, last first; the LM head's loss and backward are one visit) and brackets every
// read of a unit's weights with acquire / release. A layer's recompute under checkpointing
// happens inside its backward visit, so it reads the same gathered weights.
#pragma once

namespace memtune {

class FrozenBaseUnits {
 public:
  // Unit ids as the step names them: a decoder layer is its index.
  static constexpr int kEmbedding = -1;
  static constexpr int kHead = -2;  // final norm + LM head

  virtual ~FrozenBaseUnits() = default;
  // A pass starts: forward only (eval), or forward + backward (training).
  virtual void begin_pass(bool with_backward) = 0;
  // The unit's ModelWeights tensors are readable (on the compute stream) until release.
  virtual void acquire(int unit) = 0;
  // The step has issued its last read of the unit for this visit.
  virtual void release(int unit) = 0;
};

}  // namespace memtune
