// FSDP-QLoRA: the frozen base split across ranks and gathered one unit at a time.
//
// A unit is what the step needs at once: the embedding, one decoder layer, or the final norm with
// the LM head. A unit's buffers (NF4 codes, absmax or absmax codes, nested absmax, the code maps;
// or 16-bit weights, and the norms) are laid end to end at 256-byte offsets into one flat byte
// buffer, padded to world_size equal shards. Rank r keeps shard r of every unit; before a unit
// computes, an all-gather (bytes: u8) restores the whole flat buffer in one of two gather
// buffers, so the gather of the next unit runs while this one computes, and the buffer is given
// back when the unit is done. The bytes are gathered as they are, so the 4-bit format needs no
// special case; the dequantize of the step then reads the gathered codes.
//
// The layout is made from the plan's own records (plan by running): every persistent buffer of
// category frozen_weights or quant_constants, grouped by its name's unit.
//
// The same machinery streams frozen layers on one device (run.stream_layers, a layout made by
// streamed_base_layout): there the "shard" of a gathered unit is the whole unit, kept in pinned
// host memory, and a gather is a host-to-device copy on the backend's copy stream into one of
// the two buffers. Every other unit is kept whole on the device (replicated). The step reads the
// same bytes through the same ShardedBaseWeights, so the numbers are those of the resident base.
//
// ShardedBase (below) holds a rank's shards and does the gathers; ShardedBaseWeights is what the
// step reads through (step/frozen_base.h): at each unit's acquire it waits for that unit's
// gather, issues the next visit's gather into the other buffer, and points the unit's
// ModelWeights tensors at the gathered bytes (at null again on release). The engine builds both
// when run.shard_base is set and world_size > 1 (train/engine.cpp), and the planner traces that
// same engine, so the plan of a rank is what the rank allocates.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memtune/core/memory.h"
#include "memtune/parallel/communicator.h"
#include "memtune/model/model_weights.h"
#include "memtune/ops/backend.h"
#include "memtune/step/frozen_base.h"
#include "memtune/train/engine.h"

namespace memtune {

struct BaseUnitPiece {
  std::string name;  // the record's name ("model.layers.3.mlp.down_proj.weight.absmax")
  MemCategory category;
  uint64_t bytes = 0;
  uint64_t offset = 0;  // in the unit's flat buffer, 256-byte aligned
};

struct BaseUnit {
  std::string name;  // "embed_tokens", "layers.3", "head"
  int layer = -1;    // the decoder layer, -1 for embed_tokens and head
  std::vector<BaseUnitPiece> pieces;
  uint64_t bytes = 0;        // the flat buffer, world_size * shard_bytes
  uint64_t shard_bytes = 0;  // what each rank keeps, 256-byte aligned
  // Kept whole on every rank and never gathered (see sharded_base_layout): then shard_bytes is
  // the whole unit and bytes is not a multiple of the world.
  bool replicated = false;
  uint64_t bytes_per_rank() const { return replicated ? bytes : shard_bytes; }
};

struct ShardedBaseLayout {
  int world_size = 1;
  // One device streaming some layers (streamed_base_layout): the gathered units lie whole in
  // pinned host memory and a gather is a host-to-device copy.
  bool from_host = false;
  std::vector<BaseUnit> units;  // in forward order: embed_tokens, layers.0, ..., head
  uint64_t unsharded_bytes = 0;  // the records' bytes as one device holds them
  uint64_t unsharded_arena_bytes = 0;  // the same, each 256-byte aligned as the arena places it
  uint64_t shard_bytes_per_rank() const;  // the persistent base a rank keeps (replicated units whole)
  uint64_t gather_buffer_bytes() const;   // one buffer: the largest unit that is gathered
  static constexpr int kGatherBuffers = 2;
};

// Throws memtune::Error for world_size < 1.
//
// replicate_when_cheaper: a unit that is not a decoder layer (the embedding, the final norm with
// the LM head) can be far larger than a layer (Llama 3.1 70B: a 2.1 GB bf16 LM head beside
// 0.45 GB NF4 layers). Sharding it saves (1 - 1/world) of it per rank but makes both gather
// buffers its size; keeping it whole on every rank costs all of it but lets the buffers stay
// layer-sized. With the flag, each of those units is replicated or sharded, whichever set of
// choices gives a rank the fewest bytes of base + gather buffers (the decoder layers are always
// sharded). Nothing changes numerically: a replicated unit is the very bytes a gather would give.
// Tied embeddings (no lm_head record): the embedding unit is always replicated, because the head's
// visit needs the table beside its own unit, and the other gather buffer holds the prefetch then.
ShardedBaseLayout sharded_base_layout(const std::vector<AllocationRecord>& records, int world_size,
                                      bool replicate_when_cheaper = false);

// One device (run.stream_layers): `count` of the model's `layers` decoder layers streamed from
// pinned host memory, spread evenly (layer (2i + 1) * layers / (2 count) for i < count), so that
// each copy has the resident layers between two streamed ones to hide behind. Throws
// memtune::Error unless 0 <= count < layers (at least one layer stays resident: a run that needs
// every layer streamed is better served by a smaller model or 4 bits).
std::vector<int> streamed_layer_choice(int layers, int count);
// The layout of a streamed base: every unit of `records` (as sharded_base_layout with one rank)
// kept whole on the device except the layers listed, which are gathered from the host.
ShardedBaseLayout streamed_base_layout(const std::vector<AllocationRecord>& records, const std::vector<int>& layers);

// The order in which a training step gathers, waits for, computes with and releases the units,
// double-buffered. The forward visits every gathered unit (replicated ones need no gather) (the head does the loss and its backward in
// one visit); the backward visits the layers again, last first (the embedding is frozen and
// nothing needs its backward).
enum class GatherAction : uint8_t { gather, wait, compute, release };
struct GatherEvent {
  GatherAction action;
  int unit;
  int buffer;  // 0 or 1
};
std::vector<GatherEvent> unit_visits_of_step(const ShardedBaseLayout& layout, std::vector<int>* visits = nullptr);
// The gathered units a pass visits, in order: the forward's, then (with_backward) the layers
// again, last first. A training step's are unit_visits_of_step's; eval's are the forward's.
std::vector<int> gathered_unit_visits(const ShardedBaseLayout& layout, bool with_backward);
// The schedule for a sequence of unit visits: gather(v0); then per visit k: wait(vk),
// gather(v(k+1)) into the other buffer, compute(vk), release(vk). A visit of the unit the visit
// before it computed with (the last gathered layer's forward, then its backward, where the head is
// not gathered between them) reads the same buffer again: no gather, and no release between them.
std::vector<GatherEvent> gather_schedule(const std::vector<int>& visits);
// The gather buffer of each visit under gather_schedule: alternating, except that a repeated unit
// keeps its buffer.
std::vector<int> gather_buffers(const std::vector<int>& visits);
// Empty when the schedule is sound (each compute's unit gathered and waited for in its buffer,
// never more than two buffers held, no gather into a held buffer), else the first problem.
std::string check_gather_schedule(const std::vector<GatherEvent>& events, const std::vector<int>& visits);

// The runtime side: one rank's shards of the base and the two gather buffers. A gather is one
// all-gather of u8 (NCCL between GPUs); a piece of a gathered unit is then a view of the very
// bytes the unsharded buffer holds. The step reads it through ShardedBaseWeights (below).
class ShardedBase {
 public:
  // Allocates this rank's shards and the gather buffers in `memory` (frozen_weights) and fills
  // the shards from `source`, whose live records hold the whole base the layout was made from
  // (a loader that reads only its shard from the checkpoint is the production path; this is the
  // path the tests use). Throws memtune::Error when the layout's world is not the communicator's
  // or a piece is missing from `source`.
  ShardedBase(Backend& backend, Memory& memory, const ShardedBaseLayout& layout, const Memory& source,
              Communicator& comm, CommStream stream = {});
  // Allocates the shards and the gather buffers only; the engine then fills each unit in gather
  // buffer 0 (or a replicated unit in its shard) and keeps its shard (keep_shard_of). The bytes
  // between pieces are whatever the buffer held: nothing reads them.
  ShardedBase(Backend& backend, Memory& memory, const ShardedBaseLayout& layout, Communicator& comm,
              CommStream stream = {});
  // A streamed layout (layout.from_host): the gathered units' bytes in pinned host memory
  // (memory.record_host, "base_host.layers.3"), the rest and the two buffers in `memory`; the
  // engine fills them as above. Gathers are the backend's asynchronous host-to-device copies.
  ShardedBase(Backend& backend, Memory& memory, const ShardedBaseLayout& layout);
  ~ShardedBase();
  ShardedBase(const ShardedBase&) = delete;
  ShardedBase& operator=(const ShardedBase&) = delete;
  // The record names: "base_shard.layers.3", "base_whole.head" (replicated), "base_gather.0".
  static constexpr const char* kShardRecordPrefix = "base_shard";
  static constexpr const char* kWholeRecordPrefix = "base_whole";
  static constexpr const char* kGatherRecordPrefix = "base_gather";
  static constexpr const char* kHostRecordPrefix = "base_host";  // a streamed unit, in host memory
  const ShardedBaseLayout& layout() const { return layout_; }
  Device device() const { return backend_.device(); }
  // u8 bytes of the whole unit: its shard when replicated, else gather buffer `buffer`.
  Tensor unit_bytes(int unit, int buffer) const;
  // After the whole unit was written into gather buffer `buffer`: keeps this rank's shard of it
  // (nothing for a replicated unit, which was written in place).
  void keep_shard_of(int unit, int buffer);
  // Issues the all-gather of `unit` into gather buffer `buffer` (0 or 1) on the stream, after
  // the kernels issued so far (the buffer's last reader among them); wait() (host) or
  // compute_waits_for(buffer) (the compute stream, no host wait) before reading.
  void gather(int unit, int buffer);
  // From the host, the compute stream's wait is the only one: no peer can fail to answer.
  void wait() {
    if (comm_ != nullptr) comm_->wait(stream_);
  }
  void compute_waits_for(int buffer);
  // u8 view of piece `piece` of `unit` as gathered into `buffer`; a replicated unit's pieces are
  // in its shard (the buffer is then ignored).
  Tensor piece(int unit, int buffer, size_t piece) const;
  const Tensor& shard(int unit) const { return shards_[static_cast<size_t>(unit)]; }

 private:
  // The shards and the gather buffers in `memory` (every unit of a streamed layout that is not
  // gathered is replicated, so it lands there whole).
  void allocate(Memory& memory);

  Backend& backend_;
  ShardedBaseLayout layout_;
  Communicator* comm_ = nullptr;  // null for a streamed layout
  CommStream stream_;
  std::vector<Tensor> shards_;  // a streamed unit's: its whole bytes in host memory
  std::vector<std::shared_ptr<void>> host_owners_;
  Tensor gather_[ShardedBaseLayout::kGatherBuffers];
  CommEvent gathered_[ShardedBaseLayout::kGatherBuffers];  // recorded after each buffer's gather
  CopyEvent copied_[ShardedBaseLayout::kGatherBuffers];    // the same, for a streamed layout
};

// The step's view of a sharded base (step/frozen_base.h). `weights` is the engine's
// ModelWeights, allocated outside the arena (its tensors hold no bytes of their own): each
// piece's fields are pointed at its bytes in the unit's gather buffer (or whole shard) while the
// unit is acquired, and at null otherwise, so that a read outside a visit fails loudly.
class ShardedBaseWeights final : public FrozenBaseUnits {
 public:
  ShardedBaseWeights(ShardedBase& base, ModelWeights& weights);
  void begin_pass(bool with_backward) override;
  void acquire(int unit) override;
  void release(int unit) override;
  // The layout unit of a step unit (FrozenBaseUnits ids); -1 when the layout has none (the
  // embedding table on the host).
  int layout_unit(int step_unit) const;
  // Points the unit's fields at its bytes in `buffer` (load time: the engine fills them there).
  void bind(int unit, int buffer);
  void unbind(int unit);
  // The ModelWeights table rows whose buffers belong to the layout unit.
  const std::vector<size_t>& table_rows(int unit) const { return rows_[static_cast<size_t>(unit)]; }

 private:
  ShardedBase& base_;
  std::vector<std::vector<std::pair<size_t, Tensor*>>> fields_;  // per unit: (piece, field)
  std::vector<std::vector<size_t>> rows_;
  int embedding_unit_ = -1, head_unit_ = -1;
  bool head_reads_embedding_ = false;  // tied: lm_head is the (replicated) embedding table
  std::vector<int> layer_units_;
  std::vector<int> visits_;
  std::vector<int> buffers_;  // gather_buffers(visits_)
  size_t next_visit_ = 0;
};

// One rank's memory: a rank's plan (plan_run with world_size: flat adapters, ZeRO-1 moment
// shards) with the frozen base sharded, or not.
struct RankMemory {
  int world_size = 1;
  bool base_sharded = false;
  CategoryBytes at_peak{};      // live bytes per category at the peak, per rank
  uint64_t base_shard_bytes = 0;   // persistent base per rank (frozen_weights + quant_constants)
  uint64_t base_gather_bytes = 0;  // the two gather buffers (counted in frozen_weights)
  uint64_t arena_bytes = 0;     // the arena a rank allocates
  std::vector<std::string> replicated_units;  // base units kept whole (sharded_base_layout)
  // From a plan traced with the base sharded: a shard's bytes (NF4 codes and quant constants
  // alike) count as frozen weights.
  bool traced = false;
  uint64_t peak_live_bytes() const;
};
// A plan traced with the sharded base (run.shard_base, world_size > 1: its records hold the
// base_shard / base_gather buffers) is taken as it is; a plan of the replicated base is turned
// into the sharded one's figures by arithmetic on its records (the two agree: tested).
RankMemory rank_memory(const Plan& rank_plan, int world_size, bool shard_base);
// Whether the plan was traced with the base sharded.
bool plan_has_sharded_base(const Plan& plan);
// A table: category, one device, per rank; and the totals.
std::string format_rank_memory(const Plan& single_device_plan, const RankMemory& rank);

}  // namespace memtune
