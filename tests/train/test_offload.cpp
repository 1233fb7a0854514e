// Activation offload (offload_activations): the checkpointed layer inputs go to host memory and
// come back through a ring of two device slots. On the CPU the copies are plain memcpys, so an
// offloaded step must give the very same bits as a plain checkpointed one. A backend whose
// copies run as late as the events allow (DeferredCopyBackend) checks that the step waits for
// every copy before it overwrites or reads a slot. And the plan shows the saving on the device
// and the bytes on the host.
#include <gtest/gtest.h>

#include <deque>
#include <cstring>

#include "../support/engine_setup.h"
#include "memtune/core/error.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/plan/plan_report.h"
#include "memtune/train/engine_arena.h"

using namespace memtune;

namespace {

using enginetest::random_batches;

// Four layers: the ring (two slots) then holds fewer inputs than the layers have.
LlamaConfig four_layer_model() {
  LlamaConfig c = enginetest::small_model();
  c.num_hidden_layers = 4;
  return c;
}

RunConfig checkpointed_run() {
  RunConfig run = enginetest::small_run();
  run.gradient_checkpointing = true;
  return run;
}

// The CPU backend, except that the asynchronous copies are queued in order (one copy stream)
// and run only when the step waits for one of them (then that one and all before it), or at
// synchronize: as late as a real copy stream may run them. A step that overwrote a slot before
// its copy-out was waited for would offload the new contents; one that read a slot before its
// copy-in was waited for would read the old ones. Either changes the grads.
class DeferredCopyBackend final : public Backend {
 public:
  DeferredCopyBackend() : cpu_(make_cpu_backend()) {}
  ~DeferredCopyBackend() override { EXPECT_TRUE(pending_.empty()) << "copies left unfinished"; }

  int64_t copies_run() const { return copies_run_; }
  int64_t waits() const { return waits_; }

  void copy_to_host_async(void* host_dst, const Tensor& src, CopyEvent done) override {
    pending_.push_back({host_dst, src.data, src.nbytes(), done.id});
  }
  void copy_from_host_async(const Tensor& dst, const void* host_src, CopyEvent done) override {
    pending_.push_back({dst.data, host_src, dst.nbytes(), done.id});
  }
  void compute_wait(CopyEvent done) override {
    ++waits_;
    // The last queued copy that records this event, and everything queued before it.
    size_t last = pending_.size();
    for (size_t i = 0; i < pending_.size(); ++i)
      if (pending_[i].event == done.id) last = i;
    if (last == pending_.size()) return;  // already complete (or never recorded)
    for (size_t i = 0; i <= last; ++i) run_front();
  }
  void synchronize() override {
    while (!pending_.empty()) run_front();
  }

  // Everything else is the CPU backend's.
  Device device() const override { return cpu_->device(); }
  std::string name() const override { return "cpu-deferred-copies"; }
  void* allocate_arena(uint64_t bytes) override { return cpu_->allocate_arena(bytes); }
  void free_arena(void* base) override { cpu_->free_arena(base); }
  void copy_from_host(const Tensor& dst, const void* src) override { cpu_->copy_from_host(dst, src); }
  void copy_to_host(void* dst, const Tensor& src) override { cpu_->copy_to_host(dst, src); }
  void fill(const Tensor& d, float v) override { cpu_->fill(d, v); }
  void convert(const Tensor& d, const Tensor& s) override { cpu_->convert(d, s); }
  void add(const Tensor& d, const Tensor& a, const Tensor& b) override { cpu_->add(d, a, b); }
  void broadcast_rows(const Tensor& d, const Tensor& row) override { cpu_->broadcast_rows(d, row); }
  void matmul(const Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta) override {
    cpu_->matmul(c, a, ta, b, tb, alpha, beta);
  }
  void embedding_forward(const Tensor& o, const Tensor& t, const Tensor& i) override { cpu_->embedding_forward(o, t, i); }
  void rmsnorm_forward(const Tensor& o, const Tensor& r, const Tensor& x, const Tensor& w, float eps) override {
    cpu_->rmsnorm_forward(o, r, x, w, eps);
  }
  void rmsnorm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& r, bool acc) override {
    cpu_->rmsnorm_backward(dx, dy, x, w, r, acc);
  }
  void rope_forward(const Tensor& x, const Tensor& p, const Tensor& f, int64_t h) override { cpu_->rope_forward(x, p, f, h); }
  void rope_backward(const Tensor& x, const Tensor& p, const Tensor& f, int64_t h) override { cpu_->rope_backward(x, p, f, h); }
  void swiglu_forward(const Tensor& o, const Tensor& g, const Tensor& u) override { cpu_->swiglu_forward(o, g, u); }
  void swiglu_backward(const Tensor& dg, const Tensor& du, const Tensor& d, const Tensor& g, const Tensor& u) override {
    cpu_->swiglu_backward(dg, du, d, g, u);
  }
  void attention_eager_forward(const Tensor& o, const Tensor& p, const Tensor& s, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& seg, const AttentionDims& d) override {
    cpu_->attention_eager_forward(o, p, s, q, k, v, seg, d);
  }
  void attention_eager_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dp, const Tensor& dout,
                                const Tensor& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                                const AttentionDims& d) override {
    cpu_->attention_eager_backward(dq, dk, dv, dp, dout, p, q, k, v, seg, d);
  }
  void attention_flash_forward(const Tensor& o, const Tensor& l, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& seg, const AttentionDims& d) override {
    cpu_->attention_flash_forward(o, l, q, k, v, seg, d);
  }
  void attention_flash_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& delta, const Tensor& acc,
                                const Tensor& dout, const Tensor& o, const Tensor& l, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& seg, const AttentionDims& d) override {
    cpu_->attention_flash_backward(dq, dk, dv, delta, acc, dout, o, l, q, k, v, seg, d);
  }
  void attention_decode(const Tensor& o, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionDims& d) override {
    cpu_->attention_decode(o, q, k, v, d);
  }
  void cross_entropy_forward_backward(const Tensor& s, const Tensor& d, const Tensor& l, const Tensor& t, float g) override {
    cpu_->cross_entropy_forward_backward(s, d, l, t, g);
  }
  void cross_entropy_forward(const Tensor& s, const Tensor& l, const Tensor& t) override { cpu_->cross_entropy_forward(s, l, t); }
  void dropout(const Tensor& o, const Tensor& x, float p, uint64_t seed, uint64_t offset) override {
    cpu_->dropout(o, x, p, seed, offset);
  }
  void sum_squares(const Tensor& a, const Tensor& x) override { cpu_->sum_squares(a, x); }
  void adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWParams& a) override {
    cpu_->adamw_step(p, g, m, v, a);
  }
  void scale(const Tensor& d, float v) override { cpu_->scale(d, v); }
  void dequantize_4bit(const Tensor& out, const Quantized4bit& q) override { cpu_->dequantize_4bit(out, q); }
  void quantize_4bit(Quantized4bit& q, const Tensor& dense, std::string_view name) override {
    cpu_->quantize_4bit(q, dense, name);
  }
  void fill_random(const Tensor& d, Distribution dist, float a, float b, uint64_t seed) override {
    cpu_->fill_random(d, dist, a, b, seed);
  }

 private:
  struct PendingCopy {
    void* dst;
    const void* src;
    uint64_t bytes;
    int32_t event;
  };
  void run_front() {
    const PendingCopy copy = pending_.front();
    pending_.pop_front();
    std::memcpy(copy.dst, copy.src, copy.bytes);
    ++copies_run_;
  }
  std::unique_ptr<Backend> cpu_;
  std::deque<PendingCopy> pending_;
  int64_t copies_run_ = 0, waits_ = 0;
};

struct StepsResult {
  std::vector<double> losses;
  std::vector<float> grads;         // after the last step
  std::vector<float> lora_weights;  // after the last step
  uint64_t arena_bytes = 0, host_bytes = 0;
};

// Two optimizer steps of two micro-batches each, with non-zero B (every grad non-zero).
StepsResult two_steps(Backend& backend, const RunConfig& run, const LlamaConfig& model) {
  PlannedEngine engine(backend, run, model);
  enginetest::init_with_nonzero_b(engine.engine());
  StepsResult result;
  for (int s = 0; s < 2; ++s) {
    const StepReport report = engine->train_step(random_batches(model, run, 2, 5 + s));
    EXPECT_FALSE(report.skipped);
    result.losses.push_back(report.loss);
  }
  backend.synchronize();
  result.grads = enginetest::adapter_grads(engine.engine());
  result.lora_weights = enginetest::adapter_values(engine.engine());
  // The engine stayed inside its plan, and allocated the host bytes the plan lists.
  EXPECT_EQ(engine->memory().allocator().high_water(), engine.plan().arena_bytes);
  EXPECT_EQ(engine->memory().host_bytes(), engine.plan().host_bytes);
  result.arena_bytes = engine.plan().arena_bytes;
  result.host_bytes = engine.plan().host_bytes;
  return result;
}

struct Variant {
  const char* attention;
  int64_t chunk_tokens;
  double dropout;
  Precision precision = Precision::fp32;
  bool qlora = false;
  std::string name() const {
    return fmt::format("{} chunk {} dropout {} {}{}", attention, chunk_tokens, dropout,
                       precision_name(precision), qlora ? " nf4" : "");
  }
  // A checkpointed run with this variant's settings.
  RunConfig run() const {
    RunConfig r = checkpointed_run();
    r.attn_implementation = attention;
    r.mlp_chunk_tokens = chunk_tokens;
    r.lora_dropout = dropout;
    r.precision = precision;
    r.load_in_4bit = qlora;
    return r;
  }
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = {
      {"eager", 0, 0.0},   {"flash", 0, 0.1},  {"eager", 7, 0.1},
      {"flash", 16, 0.0},  {"flash", 7, 0.1, Precision::bf16, true},
  };
  return all;
}

// The same training, bit for bit: losses, adapter gradients and the adapters after the steps.
void expect_identical_training(const StepsResult& got, const StepsResult& want) {
  EXPECT_EQ(got.losses, want.losses);
  EXPECT_EQ(got.grads, want.grads);
  EXPECT_EQ(got.lora_weights, want.lora_weights);
}

// For every variant: its two checkpointed steps without offloading (`plain`, on a CPU backend),
// then check(cpu, run, plain) with the same backend and run the same settings with
// offload_activations on.
template <typename Check>
void for_each_offloaded_variant(const LlamaConfig& model, Check check) {
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name());
    RunConfig run = v.run();
    auto cpu = make_cpu_backend();
    const StepsResult plain = two_steps(*cpu, run, model);
    run.offload_activations = true;
    check(*cpu, run, plain);
  }
}

TEST(Offload, OffloadedStepsAreBitIdenticalToPlainCheckpointedSteps) {
  const LlamaConfig model = four_layer_model();
  for_each_offloaded_variant(model, [&](Backend& cpu, const RunConfig& run, const StepsResult& plain) {
    const StepsResult offloaded = two_steps(cpu, run, model);
    expect_identical_training(offloaded, plain);
    // Two device slots instead of five layer inputs; three layer inputs on the host.
    EXPECT_LT(offloaded.arena_bytes, plain.arena_bytes);
    EXPECT_EQ(plain.host_bytes, 0u);
    const uint64_t layer_input_bytes = static_cast<uint64_t>(run.per_device_train_batch_size * run.max_seq_length *
                                                             model.hidden_size) * dtype_size(precision_dtype(run.precision));
    EXPECT_EQ(offloaded.host_bytes, 3 * layer_input_bytes);
  });
}

TEST(Offload, TheStepWaitsForEveryCopyBeforeItOverwritesOrReadsASlot) {
  const LlamaConfig model = four_layer_model();
  for_each_offloaded_variant(model, [&](Backend&, const RunConfig& run, const StepsResult& plain) {
    DeferredCopyBackend deferred;
    const StepsResult offloaded = two_steps(deferred, run, model);
    expect_identical_training(offloaded, plain);
    // 4 micro-batches x (3 out + 3 in): the copies did happen, through the queue.
    EXPECT_EQ(deferred.copies_run(), 4 * 6);
    EXPECT_GT(deferred.waits(), 0);
  });
}

TEST(Offload, ThePlanHasTwoDeviceSlotsAndTheLayerInputsOnTheHost) {
  const LlamaConfig model = four_layer_model();
  RunConfig run = checkpointed_run();
  run.attn_implementation = "flash";
  run.offload_activations = true;
  const Plan plan = plan_run(run, model, Device::cpu);
  int slots = 0, per_layer_inputs = 0;
  for (const AllocationRecord& r : plan.records) {
    slots += r.name.rfind("offload.layer_input_slot", 0) == 0;
    per_layer_inputs += r.name.find(".layer_input") != std::string::npos && r.name.rfind("layers.", 0) == 0 &&
                        r.category == MemCategory::saved_activations;
  }
  EXPECT_EQ(slots, 2);             // allocated once for the one planned micro-batch
  EXPECT_EQ(per_layer_inputs, 0);  // no saved per-layer input on the device
  ASSERT_EQ(plan.host_records.size(), 1u);
  EXPECT_EQ(plan.host_records[0].name, "offload.layer_inputs");
  EXPECT_EQ(plan.host_bytes, plan.host_records[0].bytes);
  // The saved activations at the peak: the two slots and the batch's four i32 rows, not five
  // layer inputs.
  run.offload_activations = false;
  const Plan plain = plan_run(run, model, Device::cpu);
  EXPECT_LT(plan.at_peak[static_cast<int>(MemCategory::saved_activations)],
            plain.at_peak[static_cast<int>(MemCategory::saved_activations)]);
  EXPECT_EQ(plain.host_bytes, 0u);
}

TEST(Offload, NeedsGradientCheckpointing) {
  RunConfig run = enginetest::small_run();
  run.offload_activations = true;
  run.gradient_checkpointing = false;
  try {
    run.validate();
    FAIL() << "offload without checkpointing was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gradient_checkpointing"), std::string::npos) << e.what();
  }
  EXPECT_THROW(plan_run(run, four_layer_model(), Device::cpu), Error);
}

TEST(Offload, OneLayerModelKeepsItsOnlyInputOnTheDevice) {
  LlamaConfig model = enginetest::small_model();
  model.num_hidden_layers = 1;
  RunConfig run = checkpointed_run();
  auto cpu = make_cpu_backend();
  const StepsResult plain = two_steps(*cpu, run, model);
  run.offload_activations = true;
  const StepsResult offloaded = two_steps(*cpu, run, model);
  EXPECT_EQ(offloaded.losses, plain.losses);
  EXPECT_EQ(offloaded.grads, plain.grads);
  EXPECT_EQ(offloaded.host_bytes, 0u);
}

// ---- token chunks at a long sequence: only attention's tensors span it -------------------------

TEST(TokenChunks, ACheckpointedChunkedPlanHasNoWholeSequenceNormOrMidBuffers) {
  LlamaConfig model = enginetest::small_model();
  RunConfig run = checkpointed_run();
  run.attn_implementation = "flash";
  run.per_device_train_batch_size = 1;
  run.max_seq_length = 512;
  run.mlp_chunk_tokens = 64;
  const uint64_t whole_rows_hidden = static_cast<uint64_t>(run.max_seq_length * model.hidden_size) * 4;
  const Plan plan = plan_run(run, model, Device::cpu);
  for (const AllocationRecord& r : plan.records) {
    for (const char* name : {"norm1_out", "mid", "norm2_out", "d_norm1", "gate", "swiglu_out"})
      if (r.name.size() > std::strlen(name) && r.name.ends_with(std::string(".") + name))
        EXPECT_LT(r.bytes, whole_rows_hidden) << r.name;
  }
  run.mlp_chunk_tokens = 0;
  const Plan whole = plan_run(run, model, Device::cpu);
  EXPECT_LT(plan.arena_bytes, whole.arena_bytes);
}

// ---- offload_embeddings: the input embedding table in host memory ----------------------------

TEST(OffloadEmbeddings, StepsAreBitIdenticalAndTheTableLeavesTheArena) {
  LlamaConfig model = four_layer_model();
  model.tie_word_embeddings = false;
  for (const bool offload_activations : {false, true}) {
    SCOPED_TRACE(offload_activations ? "with offload_activations" : "alone");
    RunConfig run = checkpointed_run();
    run.offload_activations = offload_activations;
    auto cpu = make_cpu_backend();
    const StepsResult plain = two_steps(*cpu, run, model);
    run.offload_embeddings = true;
    const StepsResult offloaded = two_steps(*cpu, run, model);
    expect_identical_training(offloaded, plain);
    const uint64_t table_bytes = static_cast<uint64_t>(model.vocab_size * model.hidden_size) *
                                 dtype_size(precision_dtype(run.precision));
    EXPECT_EQ(offloaded.host_bytes, plain.host_bytes + table_bytes);
    // The table was at the bottom of the arena for the whole run: the peak drops by its bytes
    // (up to the arena's alignment).
    EXPECT_LE(offloaded.arena_bytes + table_bytes, plain.arena_bytes + 4096);
    EXPECT_GE(offloaded.arena_bytes + table_bytes + 4096, plain.arena_bytes);
  }
  RunConfig run = checkpointed_run();
  run.offload_embeddings = true;
  const Plan plan = plan_run(run, model, Device::cpu);
  ASSERT_EQ(plan.host_records.size(), 1u);
  EXPECT_EQ(plan.host_records[0].name, "model.embed_tokens.weight");
  for (const AllocationRecord& r : plan.records) EXPECT_NE(r.name, "model.embed_tokens.weight");
}

TEST(OffloadEmbeddings, ATiedModelIsRefusedWithTheReason) {
  LlamaConfig model = four_layer_model();
  model.tie_word_embeddings = true;
  RunConfig run = checkpointed_run();
  run.offload_embeddings = true;
  try {
    plan_run(run, model, Device::cpu);
    FAIL() << "offload_embeddings of a tied model was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("untied"), std::string::npos) << e.what();
  }
}

// ---- offload_optimizer: AdamW's moments in host memory ------------------------------------------

TEST(OffloadOptimizer, StepsAreBitIdenticalAndTheMomentsLeaveTheArena) {
  const LlamaConfig model = four_layer_model();
  for (const bool qlora : {false, true}) {
    SCOPED_TRACE(qlora ? "QLoRA" : "16-bit LoRA");
    RunConfig run = checkpointed_run();
    run.load_in_4bit = qlora;
    auto cpu = make_cpu_backend();
    const StepsResult plain = two_steps(*cpu, run, model);
    run.offload_optimizer = true;
    const StepsResult offloaded = two_steps(*cpu, run, model);
    // The same AdamW over the same values: the adapters after two updates are the same bits.
    expect_identical_training(offloaded, plain);
    const Plan plan = plan_run(run, model, Device::cpu);
    EXPECT_EQ(plan.at_peak[static_cast<int>(MemCategory::optimizer_state)], 0u);
    EXPECT_EQ(plan.max_by_category[static_cast<int>(MemCategory::optimizer_state)], 0u);
    ASSERT_EQ(plan.host_records.size(), 1u);
    EXPECT_EQ(plan.host_records[0].name.rfind("lora.", 0), 0u);
    // Two f32 moments of every trainable parameter (and the views' alignment gaps) on the host,
    // and the arena smaller by them.
    const uint64_t moments = 2 * sizeof(float) * static_cast<uint64_t>(plan.trainable_parameters);
    EXPECT_GE(offloaded.host_bytes, moments);
    EXPECT_LT(offloaded.host_bytes, moments + moments / 2);
    EXPECT_EQ(offloaded.arena_bytes + offloaded.host_bytes, plain.arena_bytes);
    EXPECT_NE(format_plan(plan, run, model).find("offloaded optimizer"), std::string::npos);
  }
}

TEST(OffloadOptimizer, DataParallelIsRefusedWithTheReason) {
  const LlamaConfig model = four_layer_model();
  RunConfig run = checkpointed_run();
  run.offload_optimizer = true;
  try {
    plan_run(run, model, Device::cpu, /*world_size=*/2);
    FAIL() << "offload_optimizer with data parallel was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ZeRO-1"), std::string::npos) << e.what();
  }
}

}  // namespace
