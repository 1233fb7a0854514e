#include "memtune/parallel/data_parallel.h"

#include "memtune/core/error.h"

namespace memtune {
namespace {

std::vector<GradParam> grad_params(const LoraState& lora) {
  std::vector<GradParam> params;
  for (size_t i = 0; i < lora.specs().size(); ++i) {
    const LoraTensors& t = lora.tensors()[i];
    for (const Tensor* g : {&t.grad_a, &t.grad_b})
      params.push_back({lora.specs()[i].layer, lora.flat_offset(*g), g->numel()});
  }
  return params;
}

int num_layers(const LoraState& lora) {
  int layers = 0;
  for (const LoraSpec& spec : lora.specs()) layers = std::max(layers, spec.layer + 1);
  return layers;
}

}  // namespace

DataParallelAdapters::DataParallelAdapters(Backend& backend, Memory& memory, LoraState& lora, Communicator& comm,
                                           const DataParallelOptions& options)
    : backend_(backend),
      lora_(lora),
      comm_(comm),
      layout_(zero_shard_layout(lora.flat_params().numel(), comm.world_size())),
      buckets_(plan_grad_buckets(grad_params(lora), num_layers(lora), options.bucket_bytes)),
      readiness_(buckets_),
      stream_(comm.side_stream()) {
  MT_ASSERT(!lora.flat_params().empty() && layout_.padded_total() == lora.flat_params().numel(),
            "data parallel needs LoraState's flat layout padded to {} x {} (got {} elements)", comm.world_size(),
            kZeroShardAlignElements, lora.flat_params().numel());
  for (const LoraTensors& t : lora.tensors()) MT_ASSERT(t.exp_avg_a.empty(), "per-tensor moments beside ZeRO-1");
  counts_ = memory.alloc("dist.global_counts", MemCategory::workspace, DType::i32, Shape{3});
  exp_avg_ = memory.alloc("dist.zero1.exp_avg_shard", MemCategory::optimizer_state, DType::f32, Shape{layout_.shard});
  exp_avg_sq_ =
      memory.alloc("dist.zero1.exp_avg_sq_shard", MemCategory::optimizer_state, DType::f32, Shape{layout_.shard});
  // The gaps between the tensors and the padding must be zeros (zero_shard.h).
  backend_.fill(lora.flat_params(), 0.0f);
  zero_optimizer();
}

DataParallelAdapters::StepCounts DataParallelAdapters::global_counts(const StepCounts& local) {
  if (backend_.device() == Device::meta) {
    comm_.after_compute(stream_);
    comm_.all_reduce_sum(counts_, counts_, stream_);
    return local;
  }
  // int32 holds any real step: 2^31 tokens is a thousand 2M-token steps' worth.
  MT_USER_CHECK(local.valid_targets < (int64_t{1} << 31) / comm_.world_size() &&
                    local.tokens < (int64_t{1} << 31) / comm_.world_size(),
                "{} tokens per rank in one step: too many for the global count", local.tokens);
  const int32_t counts[3] = {static_cast<int32_t>(local.valid_targets), static_cast<int32_t>(local.tokens),
                             static_cast<int32_t>(local.real_tokens)};
  backend_.copy_from_host(counts_, counts);
  comm_.after_compute(stream_);
  comm_.all_reduce_sum(counts_, counts_, stream_);
  comm_.wait(stream_);
  int32_t global[3] = {0, 0, 0};
  backend_.copy_to_host(global, counts_);
  return {global[0], global[1], global[2]};
}

void DataParallelAdapters::begin_final_backward() { readiness_.reset(); }

// Called through LlamaStep::set_on_layer_grads_done (the engine sets it for the last
// micro-batch of a step) right after layer l's backward. The all-reduce runs on the
// communicator's side stream after the kernels issued so far (layer l's backward among them), so
// on NCCL it overlaps the backward of the layers below; nothing writes a launched bucket's grads
// again before reduce_gradients waits.
void DataParallelAdapters::layer_backward_done(int layer) {
  for (int bucket : readiness_.layer_done(layer)) launch_bucket(bucket);
}

void DataParallelAdapters::launch_bucket(int bucket) {
  const GradBucket& b = buckets_.buckets[static_cast<size_t>(bucket)];
  const Tensor range = flat_range(lora_.flat_grads(), b.begin, b.numel());
  comm_.after_compute(stream_);
  comm_.all_reduce_sum(range, range, stream_);
}

void DataParallelAdapters::reduce_gradients(const Tensor& loss_sum) {
  for (int bucket : readiness_.incomplete()) {
    for (int layer : buckets_.buckets[static_cast<size_t>(bucket)].layers) readiness_.layer_done(layer);
    launch_bucket(bucket);
  }
  readiness_.reset();  // for the next step
  comm_.after_compute(stream_);
  comm_.all_reduce_sum(loss_sum, loss_sum, stream_);
  comm_.wait(stream_);
}

void DataParallelAdapters::adamw_step(const AdamWParams& params) {
  zero_adamw_shard(backend_, layout_, comm_.rank(), lora_.flat_params(), lora_.flat_grads(), exp_avg_, exp_avg_sq_,
                   params);
  comm_.after_compute(stream_);
  zero_all_gather_params(comm_, layout_, lora_.flat_params(), stream_);
  comm_.wait(stream_);
}

void DataParallelAdapters::zero_optimizer() {
  backend_.fill(exp_avg_, 0.0f);
  backend_.fill(exp_avg_sq_, 0.0f);
}

}  // namespace memtune
