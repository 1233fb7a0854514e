// Memory categories and the lifetime allocator that both the planner and the engine use.
//
// Every buffer carries a category. The planner runs the training step on the meta device
// through this allocator; the engine runs the same step on the real device through the same
// allocator over one arena of the planned size, so every offset, and the peak, are identical
// by construction (and checked: see Memory::verify_against).
//
// Room core/ (docs/ARCHITECTURE.md): the ground floor; includes nothing else of memtune.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "memtune/core/tensor.h"

namespace memtune {

enum class MemCategory : uint8_t {
  frozen_weights,
  quant_constants,
  adapters,
  adapter_grads,
  optimizer_state,
  saved_activations,
  transient_activations,
  attention_scratch,
  logits_loss,
  workspace,
};
constexpr int kNumMemCategories = 10;
using CategoryBytes = std::array<uint64_t, kNumMemCategories>;

std::string_view category_name(MemCategory category);  // "frozen_weights", ...
std::string_view category_label(MemCategory category);  // "frozen weights", ... (for tables)
inline MemCategory category_at(int index) { return static_cast<MemCategory>(index); }

// First-fit allocator over a free list, in bytes, with a fixed alignment. Deterministic: the
// same sequence of allocate/release calls gives the same offsets.
class LifetimeAllocator {
 public:
  static constexpr uint64_t kAlignment = 256;

  uint64_t allocate(uint64_t bytes, MemCategory category);
  void release(uint64_t offset);

  uint64_t high_water() const { return high_water_; }        // arena bytes needed
  uint64_t live_bytes() const { return live_total_; }
  uint64_t peak_live_bytes() const { return peak_live_; }    // <= high_water (fragmentation)
  const CategoryBytes& live_by_category() const { return live_; }
  const CategoryBytes& at_peak_by_category() const { return at_peak_; }  // sums to peak_live
  const CategoryBytes& max_by_category() const { return max_; }
  size_t live_count() const { return blocks_.size(); }
  // One past the last byte of the highest live block (0 when nothing is live).
  uint64_t live_end() const { return blocks_.empty() ? 0 : blocks_.back().offset + blocks_.back().bytes; }

 private:
  struct Block {
    uint64_t offset, bytes;
    MemCategory category;
  };
  std::vector<Block> blocks_;  // live blocks sorted by offset
  uint64_t high_water_ = 0, live_total_ = 0, peak_live_ = 0;
  CategoryBytes live_{}, at_peak_{}, max_{};
};

// One record per allocation, in order: what the plan lists and what the engine checks.
struct AllocationRecord {
  std::string name;
  MemCategory category;
  uint64_t offset;
  uint64_t bytes;
  int64_t allocated_at = 0;  // index of the event (allocations and frees counted together)
  int64_t freed_at = -1;     // index of the event that freed it; -1: alive at the end
};

// Host memory that a run allocates once beside the device arena (pinned, for offloaded
// activations): recorded so that the plan shows it and a test can compare it with the engine's.
struct HostAllocationRecord {
  std::string name;
  uint64_t bytes;
};

// The memory of one run on one device: an arena base pointer (null on the meta device) and the
// allocator that places buffers in it.
class Memory {
 public:
  Memory(Device device, void* arena_base, uint64_t arena_bytes);

  Device device() const { return device_; }
  Tensor alloc(std::string name, MemCategory category, DType dtype, Shape shape);
  // A buffer of reserve's size holding a tensor of `shape` (no more elements than reserve) at its
  // start. A micro-batch shorter than planned runs its tensors at their own shapes inside
  // buffers of the planned shapes: the allocator then sees exactly the planned sizes, so every
  // offset and the peak stay those of the plan (LlamaStep::set_shape).
  Tensor alloc(std::string name, MemCategory category, DType dtype, Shape shape, Shape reserve);
  void free(const Tensor& tensor);

  // Records host bytes that the caller allocated (Backend::allocate_host), for the plan.
  void record_host(std::string name, uint64_t bytes);
  const std::vector<HostAllocationRecord>& host_records() const { return host_records_; }
  uint64_t host_bytes() const;

  const LifetimeAllocator& allocator() const { return allocator_; }
  const std::vector<AllocationRecord>& records() const { return records_; }
  uint64_t arena_bytes() const { return arena_bytes_; }
  // The arena past the highest live buffer, as a u8 tensor: free until the next alloc. Before
  // the first step only the persistent buffers (weights, adapters, optimizer) are live, and the
  // activations' space above them is unused; the engine lends it to the weight loader for the
  // dense copy of a projection it quantizes, so that loading stays inside the planned arena.
  // Empty on the meta device.
  Tensor free_tail() const;
  // The bytes of a buffer this memory placed (u8, the record's size): for code that works on the
  // records rather than the typed tensors, as the sharded base does. Empty on the meta device.
  Tensor bytes_of(const AllocationRecord& record) const;
  // Record-by-record comparison with a plan made on the meta device. Returns an empty string
  // when they agree, else a description of the first difference.
  std::string verify_against(const std::vector<AllocationRecord>& planned) const;

 private:
  Device device_;
  char* base_;
  uint64_t arena_bytes_;  // 0 on the meta device: unbounded
  LifetimeAllocator allocator_;
  std::vector<AllocationRecord> records_;
  std::vector<HostAllocationRecord> host_records_;
  std::vector<std::pair<uint64_t, size_t>> live_records_;  // offset -> record index
  int64_t events_ = 0;
};

}  // namespace memtune
