#include "memtune/parallel/sharded_base.h"

#include <algorithm>
#include <limits>
#include <map>

#include <fmt/format.h>

#include "memtune/core/bytes.h"
#include "memtune/core/error.h"
#include "memtune/parallel/zero_shard.h"

namespace memtune {
namespace {

constexpr uint64_t kAlign = LifetimeAllocator::kAlignment;

uint64_t align_up(uint64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

bool is_base_category(MemCategory c) {
  return c == MemCategory::frozen_weights || c == MemCategory::quant_constants;
}

// "model.layers.12.self_attn.q_proj.weight..." -> 12; the embedding -> -1 (first); the rest
// (model.norm, lm_head) -> the head (last).
int unit_layer(const std::string& name, bool* is_embed) {
  *is_embed = name.rfind("model.embed_tokens", 0) == 0;
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) return -1;
  size_t end = prefix.size();
  int layer = 0;
  while (end < name.size() && name[end] >= '0' && name[end] <= '9') layer = layer * 10 + (name[end++] - '0');
  return end > prefix.size() ? layer : -1;
}

// The unit's aligned pieces end to end, without the padding to world equal shards.
uint64_t whole_bytes(const BaseUnit& unit) {
  uint64_t whole = 0;
  for (const BaseUnitPiece& p : unit.pieces) whole = std::max(whole, p.offset + align_up(p.bytes));
  return whole;
}

void keep_whole(BaseUnit& unit) {
  unit.replicated = true;
  unit.bytes = unit.shard_bytes = whole_bytes(unit);
}

}  // namespace

uint64_t ShardedBaseLayout::shard_bytes_per_rank() const {
  uint64_t total = 0;
  for (const BaseUnit& u : units) total += u.bytes_per_rank();
  return total;
}

uint64_t ShardedBaseLayout::gather_buffer_bytes() const {
  uint64_t largest = 0;
  for (const BaseUnit& u : units)
    if (!u.replicated) largest = std::max(largest, u.bytes);
  return largest;
}

ShardedBaseLayout sharded_base_layout(const std::vector<AllocationRecord>& records, int world_size,
                                      bool replicate_when_cheaper) {
  MT_USER_CHECK(world_size >= 1, "sharding the base over {} ranks: expected at least 1", world_size);
  ShardedBaseLayout layout;
  layout.world_size = world_size;
  // Key: 0 embed, 1 + layer, INT_MAX head.
  std::map<int, BaseUnit> units;
  for (const AllocationRecord& r : records) {
    if (!is_base_category(r.category) || r.freed_at >= 0) continue;
    bool is_embed = false;
    const int layer = unit_layer(r.name, &is_embed);
    const int key = is_embed ? 0 : layer >= 0 ? 1 + layer : std::numeric_limits<int>::max();
    BaseUnit& unit = units[key];
    unit.layer = layer;
    unit.name = is_embed ? "embed_tokens" : layer >= 0 ? fmt::format("layers.{}", layer) : "head";
    unit.pieces.push_back({r.name, r.category, r.bytes, unit.bytes});
    unit.bytes += align_up(r.bytes);
    layout.unsharded_bytes += r.bytes;
    layout.unsharded_arena_bytes += align_up(r.bytes);
  }
  bool has_lm_head = false;
  for (const AllocationRecord& r : records)
    if (is_base_category(r.category) && r.freed_at < 0 && r.name.rfind("lm_head", 0) == 0) has_lm_head = true;
  for (auto& [key, unit] : units) {
    const uint64_t per_rank = (unit.bytes + world_size - 1) / world_size;
    unit.shard_bytes = align_up(per_rank);
    unit.bytes = unit.shard_bytes * static_cast<uint64_t>(world_size);
    layout.units.push_back(std::move(unit));
  }
  // Tied embeddings: the LM head is the embedding table, read again at the head's visit while
  // the head's own unit (the final norm) is gathered; the table is kept whole on every rank.
  if (!has_lm_head && layout.units.size() > 1 && layout.units.front().name == "embed_tokens" &&
      layout.units.back().name == "head")
    keep_whole(layout.units.front());
  if (!replicate_when_cheaper || world_size == 1) return layout;
  // Every replicate/shard choice for the non-layer units (at most the embedding and the head:
  // four choices); the cost is a rank's persistent base plus the two gather buffers.
  std::vector<size_t> candidates;
  for (size_t u = 0; u < layout.units.size(); ++u)
    if (layout.units[u].layer < 0 && !layout.units[u].replicated) candidates.push_back(u);
  MT_ASSERT(candidates.size() <= 8, "{} base units outside the decoder layers", candidates.size());
  auto cost = [&](uint32_t replicated_mask) {
    uint64_t base = 0, largest = 0;
    for (size_t u = 0; u < layout.units.size(); ++u) {
      const BaseUnit& unit = layout.units[u];
      const auto at = std::find(candidates.begin(), candidates.end(), u);
      const bool replicated = unit.replicated ||
                              (at != candidates.end() && (replicated_mask >> (at - candidates.begin()) & 1u) != 0);
      // A replicated unit keeps its aligned pieces, not the padding to world equal shards.
      base += replicated ? whole_bytes(unit) : unit.shard_bytes;
      if (!replicated) largest = std::max(largest, unit.bytes);
    }
    return base + largest * ShardedBaseLayout::kGatherBuffers;
  };
  uint32_t best = 0;
  for (uint32_t mask = 1; mask < (1u << candidates.size()); ++mask)
    if (cost(mask) < cost(best)) best = mask;
  for (size_t i = 0; i < candidates.size(); ++i)
    if ((best >> i & 1u) != 0) keep_whole(layout.units[candidates[i]]);
  return layout;
}

std::vector<int> streamed_layer_choice(int layers, int count) {
  MT_USER_CHECK(count >= 0 && count < layers, "--stream_layers {} of {} decoder layers: expected 0 to {} (one layer "
                "at least stays on the device)", count, layers, layers - 1);
  std::vector<int> chosen;
  for (int i = 0; i < count; ++i)
    chosen.push_back(static_cast<int>((2 * static_cast<int64_t>(i) + 1) * layers / (2 * static_cast<int64_t>(count))));
  return chosen;
}

ShardedBaseLayout streamed_base_layout(const std::vector<AllocationRecord>& records, const std::vector<int>& layers) {
  ShardedBaseLayout layout = sharded_base_layout(records, /*world_size=*/1);
  layout.from_host = true;
  size_t found = 0;
  for (BaseUnit& unit : layout.units) {
    const bool streamed = unit.layer >= 0 && std::find(layers.begin(), layers.end(), unit.layer) != layers.end();
    if (streamed) ++found;
    else keep_whole(unit);
  }
  MT_ASSERT(found == layers.size(), "{} of the {} streamed layers are in the base's records", found, layers.size());
  return layout;
}

std::vector<int> gathered_unit_visits(const ShardedBaseLayout& layout, bool with_backward) {
  std::vector<int> visits;
  const int n = static_cast<int>(layout.units.size());
  for (int u = 0; u < n; ++u)
    if (!layout.units[static_cast<size_t>(u)].replicated) visits.push_back(u);
  if (with_backward)
    for (int u = n - 1; u >= 0; --u)
      if (layout.units[static_cast<size_t>(u)].layer >= 0 && !layout.units[static_cast<size_t>(u)].replicated)
        visits.push_back(u);
  return visits;
}

std::vector<GatherEvent> unit_visits_of_step(const ShardedBaseLayout& layout, std::vector<int>* visits_out) {
  const std::vector<int> visits = gathered_unit_visits(layout, /*with_backward=*/true);
  if (visits_out != nullptr) *visits_out = visits;
  return gather_schedule(visits);
}

std::vector<int> gather_buffers(const std::vector<int>& visits) {
  std::vector<int> buffers(visits.size(), 0);
  for (size_t k = 1; k < visits.size(); ++k)
    buffers[k] = visits[k] == visits[k - 1] ? buffers[k - 1] : 1 - buffers[k - 1];
  return buffers;
}

std::vector<GatherEvent> gather_schedule(const std::vector<int>& visits) {
  std::vector<GatherEvent> events;
  if (visits.empty()) return events;
  const std::vector<int> buffers = gather_buffers(visits);
  events.push_back({GatherAction::gather, visits[0], 0});
  for (size_t k = 0; k < visits.size(); ++k) {
    const bool next_is_other = k + 1 < visits.size() && visits[k + 1] != visits[k];
    events.push_back({GatherAction::wait, visits[k], buffers[k]});
    if (next_is_other) events.push_back({GatherAction::gather, visits[k + 1], buffers[k + 1]});
    events.push_back({GatherAction::compute, visits[k], buffers[k]});
    if (next_is_other || k + 1 == visits.size()) events.push_back({GatherAction::release, visits[k], buffers[k]});
  }
  return events;
}

std::string check_gather_schedule(const std::vector<GatherEvent>& events, const std::vector<int>& visits) {
  int held_unit[2] = {-1, -1};
  bool ready[2] = {false, false};
  size_t next_visit = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    const GatherEvent& e = events[i];
    if (e.buffer < 0 || e.buffer > 1) return fmt::format("event {}: buffer {}", i, e.buffer);
    const int b = e.buffer;
    switch (e.action) {
      case GatherAction::gather:
        if (held_unit[b] >= 0) return fmt::format("event {}: gather of unit {} into buffer {} that holds unit {}", i, e.unit, b, held_unit[b]);
        held_unit[b] = e.unit;
        ready[b] = false;
        break;
      case GatherAction::wait:
        if (held_unit[b] != e.unit) return fmt::format("event {}: wait for unit {} in buffer {} that holds {}", i, e.unit, b, held_unit[b]);
        ready[b] = true;
        break;
      case GatherAction::compute:
        if (held_unit[b] != e.unit || !ready[b]) return fmt::format("event {}: compute of unit {} before it was gathered and waited for", i, e.unit);
        if (next_visit >= visits.size() || visits[next_visit] != e.unit) return fmt::format("event {}: compute of unit {} out of order", i, e.unit);
        ++next_visit;
        break;
      case GatherAction::release:
        if (held_unit[b] != e.unit) return fmt::format("event {}: release of unit {} not in buffer {}", i, e.unit, b);
        held_unit[b] = -1;
        ready[b] = false;
        break;
    }
  }
  if (next_visit != visits.size()) return fmt::format("{} of {} visits computed", next_visit, visits.size());
  if (held_unit[0] >= 0 || held_unit[1] >= 0) return "a buffer is still held at the end";
  return {};
}

void ShardedBase::allocate(Memory& memory) {
  for (const BaseUnit& unit : layout_.units) {
    const bool on_host = layout_.from_host && !unit.replicated;
    const std::string name = fmt::format(
        "{}.{}", unit.replicated ? kWholeRecordPrefix : on_host ? kHostRecordPrefix : kShardRecordPrefix, unit.name);
    const Shape shape{static_cast<int64_t>(unit.bytes_per_rank())};
    if (on_host) {
      host_owners_.emplace_back();
      shards_.push_back(allocate_host_tensor(backend_, memory, name, DType::u8, shape, host_owners_.back()));
    } else {
      shards_.push_back(memory.alloc(name, MemCategory::frozen_weights, DType::u8, shape));
    }
  }
  const uint64_t buffer_bytes = layout_.gather_buffer_bytes();
  if (buffer_bytes > 0)
    for (int b = 0; b < ShardedBaseLayout::kGatherBuffers; ++b)
      gather_[b] = memory.alloc(fmt::format("{}.{}", kGatherRecordPrefix, b), MemCategory::frozen_weights, DType::u8,
                                Shape{static_cast<int64_t>(buffer_bytes)});
}

ShardedBase::ShardedBase(Backend& backend, Memory& memory, const ShardedBaseLayout& layout, Communicator& comm,
                         CommStream stream)
    : backend_(backend), layout_(layout), comm_(&comm), stream_(stream) {
  MT_USER_CHECK(layout.world_size == comm.world_size(), "a base sharded for {} ranks on a communicator of {} ranks",
                layout.world_size, comm.world_size());
  MT_ASSERT(!layout.from_host, "a streamed layout given to the sharded base of a communicator");
  allocate(memory);
  for (CommEvent& event : gathered_) event = comm.create_event();
}

ShardedBase::ShardedBase(Backend& backend, Memory& memory, const ShardedBaseLayout& layout)
    : backend_(backend), layout_(layout) {
  MT_ASSERT(layout.from_host && layout.world_size == 1, "a sharded layout of {} ranks without a communicator",
            layout.world_size);
  allocate(memory);
  for (CopyEvent& event : copied_) event = backend.create_event();
}

ShardedBase::~ShardedBase() {
  if (comm_ == nullptr)
    for (CopyEvent event : copied_) backend_.destroy_event(event);
}

ShardedBase::ShardedBase(Backend& backend, Memory& memory, const ShardedBaseLayout& layout, const Memory& source,
                         Communicator& comm, CommStream stream)
    : ShardedBase(backend, memory, layout, comm, stream) {
  // The last live record of each name is the buffer the layout was made from.
  std::map<std::string, const AllocationRecord*> live;
  for (const AllocationRecord& r : source.records())
    if (r.freed_at < 0) live[r.name] = &r;
  std::vector<uint8_t> whole;
  for (size_t u = 0; u < layout_.units.size(); ++u) {
    const BaseUnit& unit = layout_.units[u];
    whole.assign(unit.bytes, 0);  // the gaps and the padding are zeros on every rank
    for (const BaseUnitPiece& p : unit.pieces) {
      const auto it = live.find(p.name);
      MT_USER_CHECK(it != live.end() && it->second->bytes == p.bytes, "sharding the base: {} ({} bytes) is not in the "
                    "weights' memory", p.name, p.bytes);
      backend.copy_to_host(whole.data() + p.offset, source.bytes_of(*it->second));
    }
    const uint64_t begin = unit.replicated ? 0 : static_cast<uint64_t>(comm.rank()) * unit.shard_bytes;
    if (shards_[u].data != nullptr) backend.copy_from_host(shards_[u], whole.data() + begin);
  }
}

Tensor ShardedBase::unit_bytes(int unit, int buffer) const {
  const BaseUnit& u = layout_.units[static_cast<size_t>(unit)];
  if (u.replicated) return shards_[static_cast<size_t>(unit)];
  return flat_range(gather_[buffer], 0, static_cast<int64_t>(u.bytes));
}

void ShardedBase::keep_shard_of(int unit, int buffer) {
  const BaseUnit& u = layout_.units[static_cast<size_t>(unit)];
  if (u.replicated || backend_.device() == Device::meta) return;
  const Tensor& shard = shards_[static_cast<size_t>(unit)];
  // A streamed unit: the whole unit, into its host bytes.
  if (comm_ == nullptr)
    return backend_.copy_to_host(shard.data, flat_range(gather_[buffer], 0, static_cast<int64_t>(u.shard_bytes)));
  // Load time only: through the host, as the backend has no device-to-device copy.
  std::vector<uint8_t> host(u.shard_bytes);
  backend_.copy_to_host(host.data(), flat_range(gather_[buffer], static_cast<int64_t>(comm_->rank() * u.shard_bytes),
                                                static_cast<int64_t>(u.shard_bytes)));
  backend_.copy_from_host(shard, host.data());
}

void ShardedBase::gather(int unit, int buffer) {
  MT_ASSERT(unit >= 0 && unit < static_cast<int>(layout_.units.size()) && buffer >= 0 &&
            buffer < ShardedBaseLayout::kGatherBuffers, "gather of unit {} into buffer {}", unit, buffer);
  const BaseUnit& u = layout_.units[static_cast<size_t>(unit)];
  MT_ASSERT(!u.replicated, "{} is replicated: nothing to gather", u.name);
  const Tensor into = flat_range(gather_[buffer], 0, static_cast<int64_t>(u.bytes));
  // From the host: the copy stream starts after the kernels issued so far (the buffer's last
  // reader among them), as the all-gather's side stream does.
  if (comm_ == nullptr) return backend_.copy_from_host_async(into, shards_[static_cast<size_t>(unit)].data, copied_[buffer]);
  comm_->after_compute(stream_);
  comm_->all_gather(shards_[static_cast<size_t>(unit)], into, stream_);
  comm_->record(gathered_[buffer], stream_);
}

void ShardedBase::compute_waits_for(int buffer) {
  if (comm_ == nullptr) return backend_.compute_wait(copied_[buffer]);
  comm_->compute_waits(gathered_[buffer]);
}

Tensor ShardedBase::piece(int unit, int buffer, size_t piece) const {
  const BaseUnit& u = layout_.units[static_cast<size_t>(unit)];
  MT_ASSERT(piece < u.pieces.size(), "piece {} of {}", piece, u.name);
  const BaseUnitPiece& p = u.pieces[piece];
  const Tensor& from = u.replicated ? shards_[static_cast<size_t>(unit)] : gather_[buffer];
  return flat_range(from, static_cast<int64_t>(p.offset), static_cast<int64_t>(p.bytes));
}

ShardedBaseWeights::ShardedBaseWeights(ShardedBase& base, ModelWeights& weights)
    : base_(base),
      fields_(base.layout().units.size()),
      rows_(base.layout().units.size()),
      layer_units_(weights.layers.size(), -1) {
  const ShardedBaseLayout& layout = base_.layout();
  std::map<std::string, std::pair<int, size_t>> piece_of;  // name -> (unit, piece)
  for (size_t u = 0; u < layout.units.size(); ++u) {
    const BaseUnit& unit = layout.units[u];
    for (size_t p = 0; p < unit.pieces.size(); ++p) piece_of[unit.pieces[p].name] = {static_cast<int>(u), p};
    if (unit.name == "embed_tokens") embedding_unit_ = static_cast<int>(u);
    else if (unit.name == "head") head_unit_ = static_cast<int>(u);
    else {
      MT_ASSERT(unit.layer >= 0 && unit.layer < static_cast<int>(layer_units_.size()), "base unit {}", unit.name);
      layer_units_[static_cast<size_t>(unit.layer)] = static_cast<int>(u);
    }
  }
  for (const auto& [name, field] : weights.named_buffers()) {
    field->device = base_.device();  // the weights were described on the meta device
    const auto it = piece_of.find(name);
    if (it == piece_of.end()) continue;  // not in the arena (the embedding table on the host)
    fields_[static_cast<size_t>(it->second.first)].emplace_back(it->second.second, field);
    if (field == &weights.lm_head && it->second.first == embedding_unit_) head_reads_embedding_ = true;
  }
  MT_ASSERT(!head_reads_embedding_ || layout.units[static_cast<size_t>(embedding_unit_)].replicated,
            "tied embeddings with the table sharded: the head's visit could not read it");
  for (size_t u = 0; u < fields_.size(); ++u) {
    MT_ASSERT(!fields_[u].empty(), "base unit {} has no weights", layout.units[u].name);
    unbind(static_cast<int>(u));
  }
  for (size_t i = 0; i < weights.table.size(); ++i)
    if (const auto it = piece_of.find(weights.table[i].hf_key); it != piece_of.end())
      rows_[static_cast<size_t>(it->second.first)].push_back(i);
}

int ShardedBaseWeights::layout_unit(int step_unit) const {
  if (step_unit == FrozenBaseUnits::kEmbedding) return embedding_unit_;
  if (step_unit == FrozenBaseUnits::kHead) return head_unit_;
  MT_ASSERT(step_unit >= 0 && step_unit < static_cast<int>(layer_units_.size()), "base unit {}", step_unit);
  return layer_units_[static_cast<size_t>(step_unit)];
}

void ShardedBaseWeights::bind(int unit, int buffer) {
  const Tensor bytes = base_.unit_bytes(unit, buffer);
  const BaseUnit& u = base_.layout().units[static_cast<size_t>(unit)];
  for (const auto& [piece, field] : fields_[static_cast<size_t>(unit)]) {
    MT_ASSERT(field->nbytes() == u.pieces[piece].bytes, "{}: {} bytes, the layout {}", u.pieces[piece].name,
              field->nbytes(), u.pieces[piece].bytes);
    field->data = static_cast<char*>(bytes.data) + u.pieces[piece].offset;
  }
}

void ShardedBaseWeights::unbind(int unit) {
  for (const auto& [piece, field] : fields_[static_cast<size_t>(unit)]) field->data = nullptr;
}

void ShardedBaseWeights::begin_pass(bool with_backward) {
  MT_ASSERT(next_visit_ == visits_.size(), "a pass began while {} of {} visits of the last one were left",
            visits_.size() - next_visit_, visits_.size());
  visits_ = gathered_unit_visits(base_.layout(), with_backward);
  buffers_ = gather_buffers(visits_);
  next_visit_ = 0;
  if (!visits_.empty()) base_.gather(visits_[0], 0);
}

void ShardedBaseWeights::acquire(int step_unit) {
  const int unit = layout_unit(step_unit);
  if (unit < 0) return;
  if (step_unit == FrozenBaseUnits::kHead && head_reads_embedding_) bind(embedding_unit_, 0);
  if (base_.layout().units[static_cast<size_t>(unit)].replicated) return bind(unit, 0);
  MT_ASSERT(next_visit_ < visits_.size() && visits_[next_visit_] == unit,
            "the step visits base unit {} where the pass expects {}", base_.layout().units[static_cast<size_t>(unit)].name,
            next_visit_ < visits_.size() ? base_.layout().units[static_cast<size_t>(visits_[next_visit_])].name : "none");
  // The schedule of gather_schedule: wait for this visit's gather, then issue the next visit's
  // into the other buffer (its last reader was released before this acquire), then compute. A
  // next visit of this same unit reads this buffer again: nothing to gather.
  // The compute stream waits for the gather's event, not for the side stream as a whole, so that
  // the grad buckets all-reduced there meanwhile keep overlapping. The host waits once per pass,
  // at its last visit: that is where a dead peer becomes an error instead of a hang.
  const int buffer = buffers_[next_visit_];
  base_.compute_waits_for(buffer);
  if (next_visit_ + 1 == visits_.size()) base_.wait();
  if (next_visit_ + 1 < visits_.size() && visits_[next_visit_ + 1] != unit)
    base_.gather(visits_[next_visit_ + 1], buffers_[next_visit_ + 1]);
  bind(unit, buffer);
  ++next_visit_;
}

void ShardedBaseWeights::release(int step_unit) {
  const int unit = layout_unit(step_unit);
  if (unit >= 0) unbind(unit);
  if (step_unit == FrozenBaseUnits::kHead && head_reads_embedding_) unbind(embedding_unit_);
}

bool plan_has_sharded_base(const Plan& plan) {
  for (const AllocationRecord& r : plan.records)
    if (r.name.rfind(ShardedBase::kShardRecordPrefix, 0) == 0 || r.name.rfind(ShardedBase::kWholeRecordPrefix, 0) == 0)
      return true;
  return false;
}

uint64_t RankMemory::peak_live_bytes() const {
  uint64_t total = 0;
  for (uint64_t b : at_peak) total += b;
  return total;
}

RankMemory rank_memory(const Plan& rank_plan, int world_size, bool shard_base) {
  MT_USER_CHECK(world_size >= 1, "per-rank memory of {} ranks: expected at least 1", world_size);
  RankMemory out;
  out.world_size = world_size;
  out.base_sharded = shard_base && world_size > 1;
  out.at_peak = rank_plan.at_peak;
  out.arena_bytes = rank_plan.arena_bytes;
  if (plan_has_sharded_base(rank_plan)) {
    // Traced: what the rank allocates. The shards are u8 records of frozen_weights, the quant
    // constants' share of them included.
    MT_USER_CHECK(out.base_sharded, "a plan traced with the base sharded, read as {} ranks{}", world_size,
                  shard_base ? "" : " without --shard_base");
    out.traced = true;
    for (const AllocationRecord& r : rank_plan.records) {
      if (r.freed_at >= 0) continue;
      const std::string_view name = r.name;
      if (name.rfind(ShardedBase::kGatherRecordPrefix, 0) == 0) out.base_gather_bytes += r.bytes;
      else if (name.rfind(ShardedBase::kShardRecordPrefix, 0) == 0) out.base_shard_bytes += r.bytes;
      else if (name.rfind(ShardedBase::kWholeRecordPrefix, 0) == 0) {
        out.base_shard_bytes += r.bytes;
        out.replicated_units.push_back(r.name.substr(std::string_view(ShardedBase::kWholeRecordPrefix).size() + 1));
      }
    }
    return out;
  }
  if (!out.base_sharded) return out;
  const ShardedBaseLayout layout = sharded_base_layout(rank_plan.records, world_size, /*replicate_when_cheaper=*/true);
  // The persistent base is live at the peak; its records are the first ones (the bottom of the
  // arena), so removing them lowers the arena by their aligned bytes. The allocator counts live
  // bytes aligned too, so the categories lose the aligned bytes as well.
  uint64_t persistent_aligned = 0;
  CategoryBytes persistent{};
  for (const AllocationRecord& r : rank_plan.records)
    if (is_base_category(r.category) && r.freed_at < 0) {
      persistent[static_cast<int>(r.category)] += align_up(r.bytes);
      persistent_aligned += align_up(r.bytes);
    }
  out.base_shard_bytes = layout.shard_bytes_per_rank();
  for (const BaseUnit& u : layout.units)
    if (u.replicated) out.replicated_units.push_back(u.name);
  out.base_gather_bytes = layout.gather_buffer_bytes() * ShardedBaseLayout::kGatherBuffers;
  const uint64_t unsharded = persistent[0] + persistent[1];
  // The shards are split between the two categories in the proportion of the unsharded bytes.
  const int fw = static_cast<int>(MemCategory::frozen_weights), qc = static_cast<int>(MemCategory::quant_constants);
  const uint64_t qc_share =
      unsharded == 0 ? 0
                     : static_cast<uint64_t>(static_cast<double>(out.base_shard_bytes) *
                                             static_cast<double>(persistent[qc]) / static_cast<double>(unsharded));
  out.at_peak[fw] = out.at_peak[fw] - persistent[fw] + (out.base_shard_bytes - qc_share) + out.base_gather_bytes;
  out.at_peak[qc] = out.at_peak[qc] - persistent[qc] + qc_share;
  out.arena_bytes = rank_plan.arena_bytes - persistent_aligned + out.base_shard_bytes + out.base_gather_bytes;
  return out;
}

std::string format_rank_memory(const Plan& single, const RankMemory& rank) {
  std::string out = fmt::format("per-rank memory, {} ranks ({}; ZeRO-1 optimizer state)\n", rank.world_size,
                                rank.base_sharded ? "frozen base sharded, 2 gather buffers" : "frozen base replicated");
  out += fmt::format("  {:<24} {:>12} {:>12}\n", "category", "one device", "per rank");
  for (int c = 0; c < kNumMemCategories; ++c)
    out += fmt::format("  {:<24} {:>12} {:>12}\n", category_label(category_at(c)), format_bytes(single.at_peak[c]),
                       format_bytes(rank.at_peak[c]));
  out += fmt::format("  {:<24} {:>12} {:>12}\n", "live at peak", format_bytes(single.peak_live_bytes),
                     format_bytes(rank.peak_live_bytes()));
  out += fmt::format("  {:<24} {:>12} {:>12}\n", "arena", format_bytes(single.arena_bytes),
                     format_bytes(rank.arena_bytes));
  if (rank.base_sharded)
    out += fmt::format("  (frozen weights per rank include the gather buffers: {}{})\n",
                       format_bytes(rank.base_gather_bytes),
                       rank.traced && single.at_peak[static_cast<int>(MemCategory::quant_constants)] > 0
                           ? ", and the shards of the quant constants"
                           : "");
  for (const std::string& name : rank.replicated_units)
    out += fmt::format("  ({} is kept whole on every rank: sharding it would make both gather buffers its size)\n", name);
  return out;
}

}  // namespace memtune
