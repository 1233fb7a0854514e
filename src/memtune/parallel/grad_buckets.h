// Adapter gradients in buckets for the data-parallel all-reduce, so that the all-reduce of the
// last layers can run while the backward is still in the first ones (PyTorch DDP's scheme; its
// default bucket is 25 MiB).
//
// The backward finishes a layer's adapter grads all at once (a chunked MLP accumulates into them
// until the layer's backward returns), last layer first. So a bucket is a run of whole layers in
// that order, closed once it holds at least bucket_bytes. In the flat gradient buffer
// (lora_state.h's flat layout) layer l's grads sit before layer l + 1's, so a bucket is one
// contiguous range of it: one all-reduce per bucket, no packing copy.
#pragma once

#include <cstdint>
#include <vector>

namespace memtune {

constexpr uint64_t kDefaultGradBucketBytes = 25ull << 20;

// One adapter gradient tensor, located in the flat f32 gradient buffer.
struct GradParam {
  int layer = 0;
  int64_t offset = 0;  // first element in the flat buffer
  int64_t numel = 0;
};

struct GradBucket {
  std::vector<int> layers;  // in the order the backward finishes them (descending)
  int64_t begin = 0, end = 0;  // the flat element range that the bucket's all-reduce covers
  int64_t numel() const { return end - begin; }
};

struct GradBucketPlan {
  std::vector<GradBucket> buckets;  // in launch order: buckets[0] holds the last layer
  std::vector<int> bucket_of_layer;  // -1 for a layer without adapters
};

// Buckets of about bucket_bytes (f32 elements; at least one layer each). A range of a bucket
// that would cover a grad of a layer outside it (params not laid out layer by layer) is an
// internal error.
GradBucketPlan plan_grad_buckets(const std::vector<GradParam>& params, int num_layers, uint64_t bucket_bytes);

// Which buckets are complete during one backward. layer_done(l) after layer l's backward returns
// gives the buckets it completes (launch their all-reduce then); every layer is done at most
// once per backward (an internal error otherwise).
class BucketReadiness {
 public:
  explicit BucketReadiness(const GradBucketPlan& plan);
  void reset();
  std::vector<int> layer_done(int layer);
  bool all_complete() const { return complete_ == static_cast<int>(plan_->buckets.size()); }
  // The buckets not yet complete (launched after the backward in order, when no hook drove this).
  std::vector<int> incomplete() const;

 private:
  const GradBucketPlan* plan_;
  std::vector<int> layers_left_;  // per bucket
  std::vector<bool> layer_seen_;
  int complete_ = 0;
};

}  // namespace memtune
