#include "memtune/core/memory.h"

#include <algorithm>

#include "memtune/core/error.h"

namespace memtune {

namespace {

// One row per MemCategory, in its order: the name (JSON keys, CSV columns) and the label (tables).
struct CategoryNames {
  std::string_view name, label;
};
constexpr CategoryNames kCategoryNames[kNumMemCategories] = {
    {"frozen_weights", "frozen weights"},
    {"quant_constants", "quant constants"},
    {"adapters", "adapters"},
    {"adapter_grads", "adapter grads"},
    {"optimizer_state", "optimizer state"},
    {"saved_activations", "saved activations"},
    {"transient_activations", "transient activations"},
    {"attention_scratch", "attention scratch"},
    {"logits_loss", "logits/loss"},
    {"workspace", "workspace"},
};

}  // namespace

std::string_view category_name(MemCategory category) { return kCategoryNames[static_cast<int>(category)].name; }

std::string_view category_label(MemCategory category) { return kCategoryNames[static_cast<int>(category)].label; }

uint64_t LifetimeAllocator::allocate(uint64_t bytes, MemCategory category) {
  const uint64_t size = std::max<uint64_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  // First fit: the lowest gap between live blocks that holds the buffer.
  uint64_t candidate = 0;
  size_t insert_at = 0;
  for (; insert_at < blocks_.size(); ++insert_at) {
    const Block& block = blocks_[insert_at];
    if (block.offset >= candidate + size) break;
    candidate = std::max(candidate, block.offset + block.bytes);
  }
  blocks_.insert(blocks_.begin() + static_cast<std::ptrdiff_t>(insert_at), Block{candidate, size, category});
  high_water_ = std::max(high_water_, candidate + size);
  const int c = static_cast<int>(category);
  live_[c] += size;
  live_total_ += size;
  max_[c] = std::max(max_[c], live_[c]);
  if (live_total_ > peak_live_) {
    peak_live_ = live_total_;
    at_peak_ = live_;
  }
  return candidate;
}

void LifetimeAllocator::release(uint64_t offset) {
  auto it = std::lower_bound(blocks_.begin(), blocks_.end(), offset,
                             [](const Block& block, uint64_t value) { return block.offset < value; });
  MT_ASSERT(it != blocks_.end() && it->offset == offset, "release of unknown offset {}", offset);
  live_[static_cast<int>(it->category)] -= it->bytes;
  live_total_ -= it->bytes;
  blocks_.erase(it);
}

Tensor Memory::free_tail() const {
  const uint64_t end = allocator_.live_end();
  if (base_ == nullptr || end >= arena_bytes_) return Tensor{};
  return Tensor{base_ + end, DType::u8, Shape{static_cast<int64_t>(arena_bytes_ - end)}, device_};
}

Tensor Memory::bytes_of(const AllocationRecord& record) const {
  if (base_ == nullptr) return Tensor{};
  MT_ASSERT(arena_bytes_ == 0 || record.offset + record.bytes <= arena_bytes_, "{} lies outside the arena", record.name);
  return Tensor{base_ + record.offset, DType::u8, Shape{static_cast<int64_t>(record.bytes)}, device_};
}

Memory::Memory(Device device, void* arena_base, uint64_t arena_bytes)
    : device_(device), base_(static_cast<char*>(arena_base)), arena_bytes_(arena_bytes) {
  MT_ASSERT(device == Device::meta || arena_base != nullptr || arena_bytes == 0);
  // Meta tensors get addresses in a range that is never mapped, so that views, slices and
  // frees work the same on every device. Nothing dereferences them: meta ops do no arithmetic.
  if (device == Device::meta) base_ = reinterpret_cast<char*>(uint64_t{1} << 46);
}

Tensor Memory::alloc(std::string name, MemCategory category, DType dtype, Shape shape) {
  return alloc(std::move(name), category, dtype, shape, shape);
}

Tensor Memory::alloc(std::string name, MemCategory category, DType dtype, Shape shape, Shape reserve) {
  MT_ASSERT(shape.numel() <= reserve.numel(), "'{}': shape {} does not fit its reserve {}", name, shape.str(),
            reserve.str());
  Tensor tensor;
  tensor.dtype = dtype;
  tensor.shape = shape;
  tensor.device = device_;
  const uint64_t bytes = static_cast<uint64_t>(reserve.numel()) * dtype_size(dtype);
  const uint64_t offset = allocator_.allocate(bytes, category);
  if (device_ != Device::meta)
    MT_ASSERT(offset + bytes <= arena_bytes_,
              "allocation '{}' ({} bytes at {}) exceeds the planned arena of {} bytes", name, bytes,
              offset, arena_bytes_);
  tensor.data = base_ + offset;
  live_records_.emplace_back(offset, records_.size());
  records_.push_back(AllocationRecord{std::move(name), category, offset, bytes, events_++, -1});
  return tensor;
}

void Memory::free(const Tensor& tensor) {
  // Frees are rare next to arithmetic, and most free a recent buffer: search from the back.
  for (size_t i = live_records_.size(); i-- > 0;) {
    const auto [offset, record_index] = live_records_[i];
    if (base_ + offset != tensor.data) continue;
    allocator_.release(offset);
    records_[record_index].freed_at = events_++;
    live_records_.erase(live_records_.begin() + static_cast<std::ptrdiff_t>(i));
    return;
  }
  MT_ASSERT(false, "free of a tensor this memory did not allocate");
}

void Memory::record_host(std::string name, uint64_t bytes) {
  host_records_.push_back(HostAllocationRecord{std::move(name), bytes});
}

uint64_t Memory::host_bytes() const {
  uint64_t total = 0;
  for (const HostAllocationRecord& r : host_records_) total += r.bytes;
  return total;
}

std::string Memory::verify_against(const std::vector<AllocationRecord>& planned) const {
  if (planned.size() != records_.size())
    return fmt::format("{} allocations planned, {} made", planned.size(), records_.size());
  for (size_t i = 0; i < planned.size(); ++i) {
    const AllocationRecord& p = planned[i];
    const AllocationRecord& r = records_[i];
    if (p.name != r.name || p.category != r.category || p.offset != r.offset ||
        p.bytes != r.bytes || p.freed_at != r.freed_at)
      return fmt::format("allocation {}: planned '{}' {} bytes at {}, made '{}' {} bytes at {}", i,
                         p.name, p.bytes, p.offset, r.name, r.bytes, r.offset);
  }
  return "";
}

}  // namespace memtune
