#include "memtune/parallel/grad_buckets.h"

#include <algorithm>
#include <limits>

#include "memtune/core/error.h"

namespace memtune {

GradBucketPlan plan_grad_buckets(const std::vector<GradParam>& params, int num_layers, uint64_t bucket_bytes) {
  MT_ASSERT(num_layers >= 0 && bucket_bytes > 0, "{} layers, bucket of {} bytes", num_layers, bucket_bytes);
  struct LayerRange {
    int64_t begin = std::numeric_limits<int64_t>::max(), end = -1, numel = 0;
  };
  std::vector<LayerRange> layers(static_cast<size_t>(num_layers));
  for (const GradParam& p : params) {
    MT_ASSERT(p.layer >= 0 && p.layer < num_layers && p.offset >= 0 && p.numel > 0, "grad of layer {} at {} x {}",
              p.layer, p.offset, p.numel);
    LayerRange& r = layers[static_cast<size_t>(p.layer)];
    r.begin = std::min(r.begin, p.offset);
    r.end = std::max(r.end, p.offset + p.numel);
    r.numel += p.numel;
  }
  GradBucketPlan plan;
  plan.bucket_of_layer.assign(static_cast<size_t>(num_layers), -1);
  GradBucket open;
  uint64_t open_bytes = 0;
  const auto close = [&] {
    if (open.layers.empty()) return;
    plan.buckets.push_back(open);
    open = GradBucket{};
    open_bytes = 0;
  };
  for (int layer = num_layers - 1; layer >= 0; --layer) {
    const LayerRange& r = layers[static_cast<size_t>(layer)];
    if (r.numel == 0) continue;
    if (open.layers.empty()) {
      open.begin = r.begin;
      open.end = r.end;
    } else {
      open.begin = std::min(open.begin, r.begin);
      open.end = std::max(open.end, r.end);
    }
    open.layers.push_back(layer);
    plan.bucket_of_layer[static_cast<size_t>(layer)] = static_cast<int>(plan.buckets.size());
    open_bytes += static_cast<uint64_t>(r.numel) * sizeof(float);
    if (open_bytes >= bucket_bytes) close();
  }
  close();
  // One all-reduce per bucket range reduces only that bucket's grads: no range may hold a grad
  // of another bucket.
  for (const GradParam& p : params)
    for (size_t b = 0; b < plan.buckets.size(); ++b) {
      const GradBucket& bucket = plan.buckets[b];
      const bool inside = p.offset < bucket.end && p.offset + p.numel > bucket.begin;
      MT_ASSERT(!inside || plan.bucket_of_layer[static_cast<size_t>(p.layer)] == static_cast<int>(b),
                "bucket {} [{}, {}) overlaps a grad of layer {} at {} (the flat grads are not layer by layer)", b,
                bucket.begin, bucket.end, p.layer, p.offset);
    }
  return plan;
}

BucketReadiness::BucketReadiness(const GradBucketPlan& plan) : plan_(&plan) { reset(); }

void BucketReadiness::reset() {
  layers_left_.clear();
  for (const GradBucket& b : plan_->buckets) layers_left_.push_back(static_cast<int>(b.layers.size()));
  layer_seen_.assign(plan_->bucket_of_layer.size(), false);
  complete_ = 0;
}

std::vector<int> BucketReadiness::layer_done(int layer) {
  MT_ASSERT(layer >= 0 && layer < static_cast<int>(layer_seen_.size()), "layer {}", layer);
  MT_ASSERT(!layer_seen_[static_cast<size_t>(layer)], "layer {} finished twice in one backward", layer);
  layer_seen_[static_cast<size_t>(layer)] = true;
  const int bucket = plan_->bucket_of_layer[static_cast<size_t>(layer)];
  if (bucket < 0 || --layers_left_[static_cast<size_t>(bucket)] > 0) return {};
  ++complete_;
  return {bucket};
}

std::vector<int> BucketReadiness::incomplete() const {
  std::vector<int> out;
  for (size_t b = 0; b < layers_left_.size(); ++b)
    if (layers_left_[b] > 0) out.push_back(static_cast<int>(b));
  return out;
}

}  // namespace memtune
