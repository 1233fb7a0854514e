#include "memtune/train/engine.h"

#include <array>
#include <chrono>
#include <cmath>
#include <fstream>

#include "memtune/core/error.h"
#include "memtune/parallel/data_parallel.h"
#include "memtune/parallel/sharded_base.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"
#include "memtune/io/safetensors.h"
#include "memtune/lora/merge.h"
#include "memtune/ops/device.h"
#include "memtune/train/output_dir.h"

namespace memtune {

int64_t HostMicroBatch::valid_targets() const {
  int64_t count = 0;
  for (int32_t t : targets) count += t != -100;
  return count;
}

namespace {

// Writes f32 adapter-state tensors to one safetensors file through host copies: pick(spec,
// tensors) gives each adapter's (key, tensor) pairs, in the file's order.
template <typename Pick>
void write_lora_safetensors(Backend& backend, const LoraState& lora, const std::filesystem::path& path,
                            const SafetensorsMetadata& metadata, Pick pick) {
  std::vector<std::vector<uint8_t>> host;  // a moved vector keeps its buffer: entries stay valid
  std::vector<SafetensorsWriteEntry> entries;
  for (size_t i = 0; i < lora.specs().size(); ++i) {
    for (const auto& [key, tensor] : pick(lora.specs()[i], lora.tensors()[i])) {
      host.emplace_back(tensor.nbytes());
      backend.copy_to_host(host.back().data(), tensor);
      entries.push_back({key, DType::f32, tensor.shape, host.back().data()});
    }
  }
  write_safetensors(path, entries, metadata);
}

bool is_data_parallel(const Communicator* communicator) {
  return communicator != nullptr && communicator->world_size() > 1;
}

// --shard_base means something only with several ranks; one rank keeps the whole base.
bool shards_base(const RunConfig& run, const Communicator* communicator) {
  return run.shard_base && is_data_parallel(communicator);
}

// --stream_layers: one device keeps some layers in host memory. Several ranks shard the base instead.
bool streams_base(const RunConfig& run, const Communicator* communicator) {
  MT_USER_CHECK(run.stream_layers == 0 || !is_data_parallel(communicator), "--stream_layers {} with {} ranks: "
                "streaming layers from host memory is for one device; with several, use --shard_base",
                run.stream_layers, communicator != nullptr ? communicator->world_size() : 1);
  return run.stream_layers > 0;
}

// The whole base is only described (on the meta device) where a ShardedBase holds its bytes.
bool base_held_in_units(const RunConfig& run, const Communicator* communicator) {
  return shards_base(run, communicator) || streams_base(run, communicator);
}

std::unique_ptr<ShardedBase> make_sharded_base(Backend& backend, Memory& memory, const Memory& description,
                                               const RunConfig& run, const LlamaConfig& model,
                                               Communicator* communicator) {
  if (streams_base(run, communicator)) {
    const std::vector<int> layers =
        streamed_layer_choice(static_cast<int>(model.num_hidden_layers), static_cast<int>(run.stream_layers));
    return std::make_unique<ShardedBase>(backend, memory, streamed_base_layout(description.records(), layers));
  }
  const ShardedBaseLayout layout =
      sharded_base_layout(description.records(), communicator->world_size(), /*replicate_when_cheaper=*/true);
  // The gathers on the communicator's side stream, beside the compute (events order them).
  return std::make_unique<ShardedBase>(backend, memory, layout, *communicator, communicator->side_stream());
}

}  // namespace

Engine::Engine(Backend& backend, void* arena, uint64_t arena_bytes, const RunConfig& run,
               const LlamaConfig& model, Communicator* communicator)
    : backend_(backend),
      run_(run),
      model_(model),
      memory_(backend.device(), arena, arena_bytes),
      base_description_(Device::meta, nullptr, 0),
      weights_(ModelWeights::allocate(base_held_in_units(run, communicator) ? base_description_ : memory_, model_,
                                      precision_dtype(run.precision), run.load_in_4bit ? &run.quant : nullptr,
                                      run.offload_embeddings ? &backend : nullptr)),
      sharded_base_(base_held_in_units(run, communicator)
                        ? make_sharded_base(backend, memory_, base_description_, run, model_, communicator)
                        : nullptr),
      lora_(LoraState::allocate(memory_, model_, run.lora_config(), precision_dtype(run.precision),
                                /*with_optimizer=*/!is_data_parallel(communicator),
                                is_data_parallel(communicator) ? lora_flat_multiple(communicator->world_size()) : 0,
                                run.offload_optimizer ? &backend : nullptr)),
      grad_norm_sq_(memory_.alloc("optimizer.grad_norm_sq", MemCategory::workspace, DType::f32, Shape{1})),
      backend_workspace_(backend.workspace_bytes() == 0
                             ? Tensor{}
                             : memory_.alloc("backend.workspace", MemCategory::workspace, DType::u8,
                                             Shape{static_cast<int64_t>(backend.workspace_bytes())})),
      step_(backend_, memory_, model_, run.step_options(), weights_, lora_) {
  backend_.bind_workspace(backend_workspace_);
  if (sharded_base_) {
    for (const HostAllocationRecord& h : base_description_.host_records()) memory_.record_host(h.name, h.bytes);
    sharded_views_ = std::make_unique<ShardedBaseWeights>(*sharded_base_, weights_);
    step_.set_frozen_base_units(sharded_views_.get());
  }
  if (is_data_parallel(communicator)) {
    MT_USER_CHECK(!run.offload_optimizer,
                  "--offload_optimizer with data parallel: ZeRO-1 already splits AdamW's moments across the ranks; "
                  "drop --offload_optimizer");
    // run.validate() (through step_options above) bounded ddp_bucket_cap_mb: the bytes convert.
    DataParallelOptions options;
    options.bucket_bytes = std::max<uint64_t>(1, static_cast<uint64_t>(run.ddp_bucket_cap_mb * (1 << 20)));
    data_parallel_ = std::make_unique<DataParallelAdapters>(backend_, memory_, lora_, *communicator, options);
  }
}

Engine::~Engine() { backend_.bind_workspace(Tensor{}); }

void Engine::fill_base_by_unit(const std::function<void(const std::vector<size_t>& rows)>& fill) {
  if (!sharded_base_) {
    std::vector<size_t> all(weights_.table.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    return fill(all);
  }
  std::vector<bool> in_unit(weights_.table.size(), false);
  for (int u = 0; u < static_cast<int>(sharded_base_->layout().units.size()); ++u) {
    sharded_views_->bind(u, 0);
    fill(sharded_views_->table_rows(u));
    sharded_base_->keep_shard_of(u, 0);
    sharded_views_->unbind(u);
    for (size_t i : sharded_views_->table_rows(u)) in_unit[i] = true;
  }
  // What lives outside the arena (the embedding table on the host) is filled in place.
  std::vector<size_t> rest;
  for (size_t i = 0; i < in_unit.size(); ++i)
    if (!in_unit[i]) rest.push_back(i);
  if (!rest.empty()) fill(rest);
}

bool Engine::base_sharded() const { return sharded_base_ != nullptr && !sharded_base_->layout().from_host; }
bool Engine::base_streamed() const { return sharded_base_ != nullptr && sharded_base_->layout().from_host; }

int Engine::rank() const { return data_parallel_ ? data_parallel_->comm().rank() : 0; }
int Engine::world_size() const { return data_parallel_ ? data_parallel_->comm().world_size() : 1; }

void Engine::init_random_weights(uint64_t seed) {
  fill_base_by_unit([&](const std::vector<size_t>& rows) {
    weights_.init_random_rows(backend_, model_, seed, rows, memory_.free_tail());
  });
}

void Engine::init_adapters(uint64_t seed) {
  lora_.init_peft(backend_, seed);
  lora_.zero_optimizer(backend_);
  if (data_parallel_) data_parallel_->zero_optimizer();
}

namespace {

void upload_converted(Backend& backend, const Tensor& dst, const SafetensorsTensor& src) {
  copy_from_host_converted(backend, dst, src.data, src.dtype);
}

}  // namespace

void Engine::load_base_checkpoint(const std::filesystem::path& checkpoint_path) {
  // A projection saved by bitsandbytes in 4 bits is copied as it is into a 4-bit run (its quant
  // config must equal the run's) and dequantized into a dense run; dense projections are
  // quantized here under load_in_4bit.
  const BaseCheckpoint base(checkpoint_path, model_);
  MT_ASSERT(base.table().size() == weights_.table.size(), "load_base_checkpoint: parameter tables differ");
  fill_base_by_unit([&](const std::vector<size_t>& rows) {
    for (size_t i : rows) {
      if (const SafetensorsTensor* t = base.dense(i)) {
        // safetensors data need not be aligned for its dtype: copy before reading it as numbers.
        std::vector<uint8_t> aligned(t->nbytes);
        std::memcpy(aligned.data(), t->data, t->nbytes);
        weights_.upload(backend_, i, aligned.data(), t->dtype, memory_.free_tail());
      } else if (weights_.is_quantized(i)) {
        weights_.upload_quantized(backend_, i, base.read_4bit(i));
      } else {
        const std::vector<float> values = base.read_f32(i);
        weights_.upload(backend_, i, values.data(), DType::f32, memory_.free_tail());
      }
      base.release(i);
    }
  });
}

void Engine::load_adapter(const std::filesystem::path& adapter_dir) {
  // The reader merge and generate use: it checks adapter_config.json and that the file holds
  // exactly the tensors of that config, each in its shape.
  const PeftAdapter adapter = PeftAdapter::read(adapter_dir, model_);
  const std::string differences = lora_config_differences(adapter.config, lora_.config());
  MT_USER_CHECK(differences.empty(), "{}/adapter_config.json does not match this run's LoRA settings ({}: file vs run)",
                adapter_dir.string(), differences);
  MT_ASSERT(adapter.specs.size() == lora_.specs().size(), "adapter of {} tensors for {}", adapter.specs.size(),
            lora_.specs().size());
  for (size_t i = 0; i < lora_.specs().size(); ++i) {
    const LoraTensors& t = lora_.tensors()[i];
    backend_.copy_from_host(t.a, adapter.a[i].data());
    backend_.copy_from_host(t.b, adapter.b[i].data());
  }
  lora_.sync_compute_copies(backend_);
  lora_.zero_optimizer(backend_);
  if (data_parallel_) data_parallel_->zero_optimizer();
}

void Engine::save_adapter(const std::filesystem::path& dir, const std::string& base_model) const {
  std::filesystem::create_directories(dir);
  before_checkpoint_write(dir / "adapter_model.safetensors");
  write_lora_safetensors(backend_, lora_, dir / "adapter_model.safetensors", {{"format", "pt"}},
                         [](const LoraSpec& spec, const LoraTensors& t) {
                           return std::array{std::pair{spec.a_key, t.a}, std::pair{spec.b_key, t.b}};
                         });
  const LoraConfig& lc = lora_.config();
  nlohmann::json targets = nlohmann::json::array();
  for (Projection p : lc.targets) targets.push_back(std::string(projection_name(p)));
  const nlohmann::json config = {
      {"peft_type", "LORA"}, {"task_type", "CAUSAL_LM"}, {"r", lc.r}, {"lora_alpha", lc.alpha},
      {"lora_dropout", lc.dropout}, {"target_modules", targets}, {"bias", "none"},
      {"use_rslora", lc.use_rslora}, {"base_model_name_or_path", base_model},
      {"fan_in_fan_out", false}, {"inference_mode", true}, {"init_lora_weights", true},
      {"modules_to_save", nullptr}, {"use_dora", false}};
  before_checkpoint_write(dir / "adapter_config.json");
  write_file_atomic(dir / "adapter_config.json", config.dump(2) + "\n");
}

void Engine::save_checkpoint(const std::filesystem::path& dir, const std::string& base_model,
                             const nlohmann::json& trainer_fields) const {
  namespace fs = std::filesystem;
  MT_USER_CHECK(!data_parallel_, "{}: resumable checkpoints of a data-parallel run (ZeRO-1 moment shards) are not "
                "written yet; the adapter is (save_adapter)", dir.string());
  const fs::path staging = dir.string() + ".partial";
  const fs::path old = dir.string() + ".old";
  try {
    fs::remove_all(staging);
    save_adapter(staging, base_model);
    before_checkpoint_write(staging / "optimizer.safetensors");
    write_lora_safetensors(backend_, lora_, staging / "optimizer.safetensors", {{"format", "memtune"}},
                           [](const LoraSpec& spec, const LoraTensors& t) {
                             return std::array{std::pair{spec.a_key + ".exp_avg", t.exp_avg_a},
                                               std::pair{spec.a_key + ".exp_avg_sq", t.exp_avg_sq_a},
                                               std::pair{spec.b_key + ".exp_avg", t.exp_avg_b},
                                               std::pair{spec.b_key + ".exp_avg_sq", t.exp_avg_sq_b}};
                           });
    nlohmann::json state = trainer_fields.is_object() ? trainer_fields : nlohmann::json::object();
    state["step"] = steps_done_;
    state["loss_scale"] = scaler_.scale;
    state["scaler_good_steps"] = scaler_.good_steps;
    state["scaler_skipped_steps"] = scaler_.skipped_steps;
    // Written last: a folder without it is not a checkpoint.
    before_checkpoint_write(staging / "trainer_state.json");
    write_file_atomic(staging / "trainer_state.json", state.dump(2) + "\n");
  } catch (const std::exception& e) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    const bool had_previous = fs::exists(dir / "trainer_state.json", ignored);
    mt_fail("saving the checkpoint {} at step {} failed: {}; {}", dir.string(), steps_done_, e.what(),
            had_previous ? "the previous checkpoint there is unchanged" : "nothing of it is left");
  }
  // Swap it in. Between the two renames only DIR.old exists, and load_checkpoint looks there.
  std::error_code error;
  fs::remove_all(old, error);
  if (fs::exists(dir)) {
    fs::rename(dir, old, error);
    MT_USER_CHECK(!error, "saving the checkpoint {}: moving the previous one aside failed: {}; it is unchanged, "
                  "and the new one is in {}", dir.string(), error.message(), staging.string());
  }
  fs::rename(staging, dir, error);
  if (error) {
    std::error_code restore_error;
    if (fs::exists(old)) fs::rename(old, dir, restore_error);
    mt_fail("saving the checkpoint {}: renaming {} into place failed: {}; the previous checkpoint is {}",
            dir.string(), staging.string(), error.message(), restore_error ? "in " + old.string() : "unchanged");
  }
  fs::remove_all(old, error);
}

nlohmann::json Engine::load_checkpoint(const std::filesystem::path& requested) {
  MT_USER_CHECK(!data_parallel_, "--resume {}: resuming a data-parallel run is not supported yet; start it from the "
                "adapter with --init-adapter", requested.string());
  // A save interrupted between its renames leaves the last complete checkpoint in DIR.old.
  const std::filesystem::path dir = complete_checkpoint_folder(requested);
  const nlohmann::json state = read_json_file(dir / "trainer_state.json");
  load_adapter(dir);
  const SafetensorsCheckpoint optimizer = SafetensorsCheckpoint::open(dir, "optimizer.safetensors");
  for (size_t i = 0; i < lora_.specs().size(); ++i) {
    const LoraSpec& spec = lora_.specs()[i];
    const LoraTensors& t = lora_.tensors()[i];
    for (const auto& [key, tensor, shape] :
         {std::tuple{spec.a_key + ".exp_avg", t.exp_avg_a, spec.a_shape}, std::tuple{spec.a_key + ".exp_avg_sq", t.exp_avg_sq_a, spec.a_shape},
          std::tuple{spec.b_key + ".exp_avg", t.exp_avg_b, spec.b_shape}, std::tuple{spec.b_key + ".exp_avg_sq", t.exp_avg_sq_b, spec.b_shape}})
      upload_converted(backend_, tensor, expect_tensor(optimizer, key, DType::f32, shape));
  }
  steps_done_ = json_get<int64_t>(state, "step", "trainer_state.json");
  scaler_.scale = json_get<double>(state, "loss_scale", "trainer_state.json");
  scaler_.good_steps = json_get<int64_t>(state, "scaler_good_steps", "trainer_state.json");
  scaler_.skipped_steps = json_get<int64_t>(state, "scaler_skipped_steps", "trainer_state.json");
  return state;
}

namespace {
// Whether causal masking alone is exact for this batch (MicroBatchBuffers::one_sample_per_row):
// each row's first segment runs to the row's end, or whatever follows it has no target (padding,
// which only later padding can see and whose gradient is zero).
bool one_sample_per_row(const HostMicroBatch& batch, int64_t seq) {
  const size_t n = batch.segments.size();
  const size_t row = static_cast<size_t>(seq);
  if (row == 0 || n % row != 0) return false;
  for (size_t start = 0; start < n; start += row) {
    const int32_t first = batch.segments[start];
    for (size_t t = start; t < start + row; ++t)
      if (batch.segments[t] != first && batch.targets[t] != -100) return false;
  }
  return true;
}
}  // namespace

void Engine::upload(const HostMicroBatch& batch) {
  const StepOptions& planned = step_.options();
  const int64_t rows = batch.rows > 0 ? batch.rows : planned.micro_batch;
  const int64_t seq = batch.rows > 0 ? batch.seq : planned.seq;
  step_.set_shape(rows, seq);
  const MicroBatchBuffers& b = step_.batch();
  const size_t n = static_cast<size_t>(b.input_ids.numel());
  MT_ASSERT(batch.input_ids.size() == n && batch.targets.size() == n &&
            batch.positions.size() == n && batch.segments.size() == n,
            "micro-batch of {} tokens for a shape of {} x {}", batch.input_ids.size(), rows, seq);
  if (backend_.device() == Device::meta) return;
  for (int32_t id : batch.input_ids)
    MT_USER_CHECK(id >= 0 && id < model_.vocab_size, "token id {} is outside the vocabulary of {} ids", id, model_.vocab_size);
  for (int32_t t : batch.targets)
    MT_USER_CHECK(t == -100 || (t >= 0 && t < model_.vocab_size), "label {} is outside the vocabulary of {} ids", t, model_.vocab_size);
  backend_.copy_from_host(b.input_ids, batch.input_ids.data());
  backend_.copy_from_host(b.targets, batch.targets.data());
  backend_.copy_from_host(b.positions, batch.positions.data());
  backend_.copy_from_host(b.segments, batch.segments.data());
  const bool one_sample = one_sample_per_row(batch, seq);
  step_.set_one_sample_per_row(one_sample);
  // Packed rows: their sequence table, for cuDNN's ragged attention (AttentionImpl::cudnn).
  if (!one_sample) step_.set_packed_segments(batch.segments.data(), rows, seq);
}

StepReport Engine::train_step(const std::vector<HostMicroBatch>& micro_batches) {
  StepReport report;
  int64_t valid = 0;
  for (const HostMicroBatch& mb : micro_batches) valid += mb.valid_targets();
  // ---- data parallel: the loss is normalised by the valid targets of the global batch ----
  DataParallelAdapters::StepCounts global;
  if (data_parallel_) {
    DataParallelAdapters::StepCounts local;
    local.valid_targets = valid;
    for (const HostMicroBatch& mb : micro_batches) local.tokens += mb.tokens(), local.real_tokens += mb.sample_tokens();
    global = data_parallel_->global_counts(local);
    valid = global.valid_targets;
  }
  // ---- end data parallel ----
  const bool meta = backend_.device() == Device::meta;
  MT_USER_CHECK(meta || valid > 0, "every label of this optimizer step is masked (-100): nothing to learn from");
  const double denominator = static_cast<double>(std::max<int64_t>(valid, 1));
  const bool fp16 = run_.precision == Precision::fp16;
  const double loss_scale = fp16 ? scaler_.scale : 1.0;

  lora_.zero_grads(backend_);
  backend_.fill(step_.loss_sum(), 0.0f);
  const uint64_t seed = dropout_hash(run_.seed, static_cast<uint64_t>(steps_done_));
  for (size_t m = 0; m < micro_batches.size(); ++m) {
    upload(micro_batches[m]);
    // Data parallel: rank r holds the global micro-batches r, r + world, ... (the trainer's
    // order), and dropout is seeded by the global index, as one rank with all of them would be.
    const uint64_t global_m = m * static_cast<uint64_t>(world_size()) + static_cast<uint64_t>(rank());
    // The last micro-batch finishes each layer's grads as its backward passes the layer: the
    // hook issues the all-reduce of the buckets that layer completes right then.
    const bool final_backward = data_parallel_ && m + 1 == micro_batches.size();
    if (final_backward) {
      data_parallel_->begin_final_backward();
      step_.set_on_layer_grads_done([this](int layer) { data_parallel_->layer_backward_done(layer); });
    }
    step_.forward_backward(static_cast<float>(loss_scale / denominator), dropout_hash(seed, global_m));
    if (final_backward) step_.set_on_layer_grads_done({});
    report.tokens += micro_batches[m].tokens();
    report.real_tokens += micro_batches[m].sample_tokens();
  }
  report.targets = valid;
  // ---- data parallel: grads and loss summed over ranks (every rank then decides alike) ----
  if (data_parallel_) {
    data_parallel_->reduce_gradients(step_.loss_sum());
    report.tokens = global.tokens;
    report.real_tokens = global.real_tokens;
  }
  // ---- end data parallel ----
  report.loss = backend_.read_scalar(step_.loss_sum()) / denominator;

  backend_.fill(grad_norm_sq_, 0.0f);
  lora_.add_grad_squares(backend_, grad_norm_sq_);
  const double scaled_norm = std::sqrt(static_cast<double>(backend_.read_scalar(grad_norm_sq_)));
  if (!std::isfinite(scaled_norm)) {
    // fp16 overflow (or a NaN anywhere): skip the update and back off, as GradScaler does.
    report.skipped = true;
    report.grad_norm = scaled_norm;
    if (fp16) {
      scaler_.scale *= LossScalerState::kBackoff;
      scaler_.good_steps = 0;
      ++scaler_.skipped_steps;
    }
    ++steps_done_;
    return report;
  }
  report.grad_norm = scaled_norm / loss_scale;
  double clip = 1.0;
  if (run_.max_grad_norm > 0) clip = std::min(1.0, run_.max_grad_norm / (report.grad_norm + 1e-6));
  report.learning_rate = learning_rate_at(run_, steps_done_);
  AdamWParams params;
  params.lr = static_cast<float>(report.learning_rate);
  params.beta1 = static_cast<float>(run_.adam_beta1);
  params.beta2 = static_cast<float>(run_.adam_beta2);
  params.eps = static_cast<float>(run_.adam_epsilon);
  params.weight_decay = static_cast<float>(run_.weight_decay);
  params.step = steps_done_ + 1 - scaler_.skipped_steps;
  params.grad_scale = static_cast<float>(clip / loss_scale);
  if (data_parallel_) {
    data_parallel_->adamw_step(params);  // ZeRO-1: this rank's shard, then the all-gather
  } else {
    lora_.adamw_step(backend_, params);
  }
  lora_.sync_compute_copies(backend_);
  if (fp16 && ++scaler_.good_steps >= LossScalerState::kGrowthInterval) {
    scaler_.scale *= LossScalerState::kGrowth;
    scaler_.good_steps = 0;
  }
  ++steps_done_;
  return report;
}

std::pair<double, int64_t> Engine::eval_loss_sum(const HostMicroBatch& batch) {
  upload(batch);
  backend_.fill(step_.loss_sum(), 0.0f);
  step_.forward_loss();
  return {backend_.read_scalar(step_.loss_sum()), batch.valid_targets()};
}

Plan plan_run(const RunConfig& run, const LlamaConfig& model, Device target, int world_size) {
  const auto start = std::chrono::steady_clock::now();
  // Refused here too, so that a CUDA run is refused by its plan, before anything is allocated.
  MT_USER_CHECK(target != Device::cuda || !sliding_window_reached(model, run.max_seq_length), "{}",
                sliding_window_refusal(model, run.max_seq_length));
  std::unique_ptr<Backend> meta = make_meta_backend(backend_workspace_bytes(target));
  const std::unique_ptr<Communicator> comm = world_size > 1 ? make_meta_communicator(0, world_size) : nullptr;
  Engine engine(*meta, nullptr, 0, run, model, comm.get());
  const int64_t n = run.per_device_train_batch_size * run.max_seq_length;
  HostMicroBatch batch;
  batch.input_ids.assign(n, 0);
  batch.targets.assign(n, 0);
  batch.positions.assign(n, 0);
  batch.segments.assign(n, 0);
  // One micro-batch is enough: the accumulation repeats the same allocations.
  engine.train_step({batch});
  engine.eval_loss_sum(batch);
  Plan plan;
  const LifetimeAllocator& a = engine.memory().allocator();
  plan.records = engine.memory().records();
  plan.arena_bytes = a.high_water();
  plan.peak_live_bytes = a.peak_live_bytes();
  plan.at_peak = a.at_peak_by_category();
  plan.max_by_category = a.max_by_category();
  plan.trainable_parameters = engine.lora().parameter_count();
  plan.frozen_parameters = engine.weights().parameter_count();
  // ---- offload: host memory ----
  plan.host_records = engine.memory().host_records();
  plan.host_bytes = engine.memory().host_bytes();
  // ---- end offload ----
  plan.target = target;
  plan.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return plan;
}

HostMicroBatch make_micro_batch(const std::vector<std::vector<int32_t>>& input_ids,
                                const std::vector<std::vector<int32_t>>& labels, int64_t seq,
                                int32_t pad_id) {
  MT_ASSERT(input_ids.size() == labels.size());
  HostMicroBatch b;
  const size_t rows = input_ids.size();
  b.rows = static_cast<int64_t>(rows);
  b.seq = seq;
  b.real_tokens = 0;
  for (const std::vector<int32_t>& ids : input_ids) b.real_tokens += std::min<int64_t>(seq, static_cast<int64_t>(ids.size()));
  b.input_ids.assign(rows * seq, pad_id);
  b.targets.assign(rows * seq, -100);
  b.positions.resize(rows * seq);
  b.segments.assign(rows * seq, 0);
  for (size_t r = 0; r < rows; ++r) {
    const int64_t len = std::min<int64_t>(seq, static_cast<int64_t>(input_ids[r].size()));
    MT_ASSERT(labels[r].size() == input_ids[r].size());
    for (int64_t t = 0; t < seq; ++t) b.positions[r * seq + t] = static_cast<int32_t>(t);
    for (int64_t t = 0; t < len; ++t) b.input_ids[r * seq + t] = input_ids[r][t];
    for (int64_t t = 0; t + 1 < len; ++t) b.targets[r * seq + t] = labels[r][t + 1];
  }
  return b;
}

}  // namespace memtune
