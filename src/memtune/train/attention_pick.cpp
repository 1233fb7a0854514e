#include "memtune/train/attention_pick.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/ops/backend.h"
#include "memtune/ops/device.h"
#include "memtune/ops/ragged_attention.h"
#include "memtune/train/engine.h"
#include "memtune/train/run_config.h"

#ifdef MEMTUNE_WITH_CUDA
#include "memtune/ops/cuda/attention_cudnn.h"
#endif

namespace memtune {

namespace {

constexpr uint64_t kProbeAlignment = 256;
constexpr const char* kCacheFormat = "memtune attention picks 1";

uint64_t aligned(uint64_t bytes) { return (bytes + kProbeAlignment - 1) / kProbeAlignment * kProbeAlignment; }

AttentionDims dims_of(const AttentionShape& s) {
  AttentionDims d;
  d.batch = s.batch;
  d.seq = s.seq;
  d.n_heads = s.n_heads;
  d.n_kv_heads = s.n_kv_heads;
  d.head_dim = s.head_dim;
  d.scale = attention_softmax_scale(s.head_dim);
  return d;
}

bool has(const std::vector<std::string>& list, const std::string& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

void check_implementation(const std::string& implementation) {
  MT_USER_CHECK(implementation == "flash" || implementation == "cudnn",
                "attention pick: '{}' is not flash or cudnn", implementation);
}

// Segment ids of a packed probe: kProbeSamplesPerRow samples a row, in increasing ids (the last
// takes the remainder); a row shorter than that has one token per sample.
std::vector<int32_t> probe_segments(const AttentionShape& s) {
  std::vector<int32_t> ids(static_cast<size_t>(s.batch * s.seq));
  const int64_t length = std::max<int64_t>(1, s.seq / kProbeSamplesPerRow);
  for (int64_t r = 0; r < s.batch; ++r)
    for (int64_t t = 0; t < s.seq; ++t)
      ids[r * s.seq + t] = static_cast<int32_t>(std::min(t / length, kProbeSamplesPerRow - 1));
  return ids;
}

// The probe's tensors, carved in order from one arena (attention_probe_bytes counts the same).
struct ProbeLayout {
  uint64_t offset = 0;
  Device device = Device::cpu;
  uint8_t* base = nullptr;
  Tensor take(DType dtype, Shape shape) {
    Tensor t;
    t.dtype = dtype;
    t.shape = shape;
    t.device = device;
    t.data = base == nullptr ? nullptr : base + offset;
    offset += aligned(t.nbytes());
    return t;
  }
};

struct ProbeTensors {
  Tensor q, k, v, out, lse, d_out, dq, dk, dv, delta, dq_accum, segments, workspace, ragged_table;
};

ProbeTensors carve(ProbeLayout& layout, const AttentionShape& s, const std::vector<std::string>& implementations) {
  const int64_t n = s.batch * s.seq;
  const Shape q_shape{n, s.n_heads * s.head_dim}, kv_shape{n, s.n_kv_heads * s.head_dim};
  const Shape rows{s.batch * s.n_heads * s.seq};
  ProbeTensors t;
  t.q = layout.take(s.dtype, q_shape);
  t.k = layout.take(s.dtype, kv_shape);
  t.v = layout.take(s.dtype, kv_shape);
  t.out = layout.take(s.dtype, q_shape);
  t.lse = layout.take(DType::f32, rows);
  t.d_out = layout.take(s.dtype, q_shape);
  t.dq = layout.take(s.dtype, q_shape);
  t.dk = layout.take(s.dtype, kv_shape);
  t.dv = layout.take(s.dtype, kv_shape);
  t.delta = layout.take(DType::f32, rows);
  if (has(implementations, "flash")) t.dq_accum = layout.take(DType::f32, q_shape);
  if (s.packed) t.segments = layout.take(DType::i32, Shape{n});
  if (has(implementations, "cudnn")) {
    const AttentionDims d = dims_of(s);
    const int64_t floats = std::max(cudnn_attention_workspace_floats(d, false, s.packed),
                                    cudnn_attention_workspace_floats(d, true, s.packed));
    t.workspace = layout.take(DType::f32, Shape{floats});
    if (s.packed) t.ragged_table = layout.take(DType::i32, Shape{kRaggedTableRows * (n + 1)});
  }
  return t;
}

}  // namespace

std::string AttentionShape::key() const {
  return fmt::format("b{} s{} h{}/{} d{} {}{}", batch, seq, n_heads, n_kv_heads, head_dim, dtype_name(dtype),
                     packed ? " packed" : "");
}

std::string AttentionPick::describe(const AttentionShape& shape) const {
  if (timings.empty()) return fmt::format("attention auto: {} ({}) at {}", implementation, source, shape.key());
  std::string others;
  for (const AttentionTiming& t : timings) {
    if (t.implementation == implementation) continue;
    others += fmt::format("{}{} ({:.3f} ms)", others.empty() ? "" : ", ", t.implementation, t.milliseconds);
  }
  double own = 0.0;
  for (const AttentionTiming& t : timings)
    if (t.implementation == implementation) own = t.milliseconds;
  return fmt::format("attention auto: {} ({:.3f} ms a forward + backward) over {}, {} at {}", implementation, own,
                     others, source, shape.key());
}

uint64_t attention_probe_bytes(const AttentionShape& shape, const std::vector<std::string>& implementations) {
  ProbeLayout layout;
  carve(layout, shape, implementations);
  return layout.offset;
}

double time_attention(Backend& backend, const AttentionShape& s, const std::string& implementation, int repeats) {
  check_implementation(implementation);
  MT_USER_CHECK(s.batch >= 1 && s.seq >= 1 && s.n_kv_heads >= 1 && s.head_dim >= 1 && s.n_heads % s.n_kv_heads == 0,
                "attention pick: no attention shape {}", s.key());
  const std::vector<std::string> one{implementation};
  ProbeLayout layout;
  carve(layout, s, one);
  const uint64_t bytes = layout.offset;
  void* arena = backend.allocate_arena(bytes);
  struct Free {
    Backend& backend;
    void* base;
    ~Free() { backend.free_arena(base); }
  } free_arena{backend, arena};
  layout = ProbeLayout{};
  layout.device = backend.device();
  layout.base = static_cast<uint8_t*>(arena);
  const ProbeTensors t = carve(layout, s, one);
  // Scores of a few units, as in the attention timing tests.
  backend.fill_random(t.q, Backend::Distribution::uniform, -1.5f, 1.5f, 1);
  backend.fill_random(t.k, Backend::Distribution::uniform, -1.5f, 1.5f, 2);
  backend.fill_random(t.v, Backend::Distribution::uniform, -1.0f, 1.0f, 3);
  backend.fill_random(t.d_out, Backend::Distribution::uniform, -1.0f, 1.0f, 4);
  RaggedAttention ragged;
  if (s.packed) {
    const std::vector<int32_t> ids = probe_segments(s);
    backend.copy_from_host(t.segments, ids.data());
    if (implementation == "cudnn") {
      RaggedTableShape table_shape;
      table_shape.rows = s.batch;
      table_shape.seq = s.seq;
      table_shape.capacity = s.batch * s.seq;
      table_shape.n_heads = s.n_heads;
      table_shape.n_kv_heads = s.n_kv_heads;
      table_shape.head_dim = s.head_dim;
      ragged.table = t.ragged_table;
      ragged.capacity = table_shape.capacity;
      upload_ragged_table(backend, ids.data(), table_shape, ragged);
    }
  }
  const AttentionDims dims = dims_of(s);
  auto forward_backward = [&] {
    if (implementation == "flash") {
      backend.attention_flash_forward(t.out, t.lse, t.q, t.k, t.v, t.segments, dims);
      backend.attention_flash_backward(t.dq, t.dk, t.dv, t.delta, t.dq_accum, t.d_out, t.out, t.lse, t.q, t.k, t.v,
                                       t.segments, dims);
    } else {
      backend.attention_cudnn_forward(t.out, t.lse, t.q, t.k, t.v, t.segments, ragged, t.workspace, dims);
      backend.attention_cudnn_backward(t.dq, t.dk, t.dv, t.delta, t.workspace, t.d_out, t.out, t.lse, t.q, t.k, t.v,
                                       t.segments, ragged, dims);
    }
  };
  forward_backward();  // untimed: cuDNN builds its graphs, kernels load
  backend.synchronize();
  std::vector<double> ms;
  double total = 0.0;
  // At long context one run is seconds (~2 s for cuDNN at 8B 1 x 200k on an H100): stop once 3 s
  // are spent, after at least one timed run, so that the probe stays small beside a step.
  for (int i = 0; i < std::max(1, repeats) && (i == 0 || total < 3'000.0); ++i) {
    const auto start = std::chrono::steady_clock::now();
    forward_backward();
    backend.synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    total += ms.back();
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::filesystem::path attention_cache_path() {
  std::filesystem::path folder;
  if (const char* dir = std::getenv("MEMTUNE_CACHE_DIR"); dir != nullptr && *dir != 0) folder = dir;
  else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != 0) folder = std::filesystem::path(xdg) / "memtune";
  else if (const char* home = std::getenv("HOME"); home != nullptr && *home != 0) folder = std::filesystem::path(home) / ".cache" / "memtune";
  else return {};
  return folder / "attention-picks.json";
}

std::string attention_device_key(const Backend& backend) {
  size_t cudnn = 0;
#ifdef MEMTUNE_WITH_CUDA
  if (backend.device() == Device::cuda) cudnn = cuda::cudnn_runtime_version();
#endif
  std::string binary = "unknown";
  struct stat status {};
  if (::stat("/proc/self/exe", &status) == 0)
    binary = fmt::format("{}-{}", static_cast<int64_t>(status.st_size), static_cast<int64_t>(status.st_mtime));
  return fmt::format("{} | cudnn {} | binary {}", device_description(backend), cudnn, binary);
}

namespace {

// The cache's JSON, or nullopt (with a note on stderr) where the file exists but is not one.
std::optional<nlohmann::json> read_cache(const std::filesystem::path& cache) {
  std::error_code error;
  if (!std::filesystem::exists(cache, error)) return nlohmann::json{{"format", kCacheFormat}, {"entries", nlohmann::json::object()}};
  try {
    nlohmann::json value = nlohmann::json::parse(read_file(cache));
    if (value.is_object() && value.value("format", "") == kCacheFormat && value.contains("entries") &&
        value["entries"].is_object())
      return value;
    std::cerr << fmt::format("memtune: note: {} is not a memtune attention cache; it is left as it is and not used\n",
                             cache.string());
  } catch (const std::exception& e) {
    std::cerr << fmt::format("memtune: note: the attention cache {} is unreadable ({}); it is left as it is and not used\n",
                             cache.string(), e.what());
  }
  return std::nullopt;
}

std::string entry_key(const std::string& device_key, const std::string& shape_key) {
  return device_key + " | " + shape_key;
}

// The entry of (device, shape) in a cache read by read_cache, if it is a whole one.
std::optional<AttentionPick> cached_entry(const nlohmann::json& value, const std::filesystem::path& cache,
                                          const std::string& device_key, const std::string& shape_key) {
  const nlohmann::json& entries = value["entries"];
  const auto it = entries.find(entry_key(device_key, shape_key));
  if (it == entries.end() || !it->is_object()) return std::nullopt;
  const nlohmann::json& entry = *it;
  if (!entry.contains("pick") || !entry["pick"].is_string() || !entry.contains("milliseconds") ||
      !entry["milliseconds"].is_object())
    return std::nullopt;
  AttentionPick pick;
  pick.implementation = entry["pick"].get<std::string>();
  for (const auto& [name, ms] : entry["milliseconds"].items()) {
    if (!ms.is_number() || !(ms.get<double>() > 0.0)) return std::nullopt;
    pick.timings.push_back({name, ms.get<double>()});
  }
  pick.source = "cached in " + cache.string();
  return pick;
}

}  // namespace

std::optional<AttentionPick> read_cached_attention_pick(const std::filesystem::path& cache,
                                                        const std::string& device_key, const std::string& shape_key) {
  if (cache.empty()) return std::nullopt;
  const std::optional<nlohmann::json> value = read_cache(cache);
  return value ? cached_entry(*value, cache, device_key, shape_key) : std::nullopt;
}

void store_attention_pick(const std::filesystem::path& cache, const std::string& device_key,
                          const std::string& shape_key, const AttentionPick& pick) {
  if (cache.empty()) return;
  try {
    std::filesystem::create_directories(cache.parent_path());
    std::optional<nlohmann::json> value = read_cache(cache);
    if (!value) return;
    nlohmann::json ms = nlohmann::json::object();
    for (const AttentionTiming& t : pick.timings) ms[t.implementation] = t.milliseconds;
    (*value)["entries"][entry_key(device_key, shape_key)] = {{"pick", pick.implementation}, {"milliseconds", ms}};
    write_file_atomic(cache, value->dump(2) + "\n");
  } catch (const std::exception& e) {
    std::cerr << fmt::format("memtune: note: the attention pick was not cached ({})\n", e.what());
  }
}

AttentionPick pick_attention(Backend& backend, const AttentionShape& shape, const std::vector<std::string>& candidates,
                             const std::filesystem::path& cache, int repeats) {
  MT_USER_CHECK(!candidates.empty(), "attention pick: no candidate implementation");
  for (const std::string& c : candidates) check_implementation(c);
  AttentionPick pick;
  if (candidates.size() == 1) {
    pick.implementation = candidates.front();
    pick.source = "the only candidate";
    return pick;
  }
  const std::string device_key = attention_device_key(backend);
  // Read once: a file that is not a memtune cache is reported here, and then neither used nor
  // written (store_attention_pick reads it again before writing, to keep other runs' entries).
  const std::optional<nlohmann::json> stored = cache.empty() ? std::nullopt : read_cache(cache);
  if (std::optional<AttentionPick> cached = stored ? cached_entry(*stored, cache, device_key, shape.key()) : std::nullopt) {
    bool covers = has(candidates, cached->implementation);
    for (const std::string& c : candidates)
      covers = covers && std::any_of(cached->timings.begin(), cached->timings.end(),
                                     [&](const AttentionTiming& t) { return t.implementation == c; });
    if (covers) return *cached;
  }
  for (const std::string& c : candidates) pick.timings.push_back({c, time_attention(backend, shape, c, repeats)});
  // The fastest; on a tie the earlier candidate.
  const AttentionTiming* best = &pick.timings.front();
  for (const AttentionTiming& t : pick.timings)
    if (t.milliseconds < best->milliseconds) best = &t;
  pick.implementation = best->implementation;
  pick.source = "measured now";
  if (stored) store_attention_pick(cache, device_key, shape.key(), pick);
  return pick;
}

std::string resolve_auto_attention(Backend& backend, RunConfig& run, const LlamaConfig& model, uint64_t budget_bytes,
                                   uint64_t context_bytes) {
  // A mistyped switch is an error wherever it is read, not only on a GPU.
  if (const char* mode = std::getenv("MEMTUNE_ATTENTION_PICK"); mode != nullptr) {
    const std::string value = mode;
    MT_USER_CHECK(value == "rule" || value == "measure", "MEMTUNE_ATTENTION_PICK={}: expected rule or measure", value);
    if (value == "rule") return "";
  }
  if (backend.device() != Device::cuda) return "";
  std::vector<std::string> candidates;
  if (cudnn_attention_available() && (model.head_dim == 64 || model.head_dim == 128) &&
      (run.precision == Precision::bf16 || run.precision == Precision::fp16))
    candidates.push_back("cudnn");  // first: the rule's choice, kept on a tie
  candidates.push_back("flash");
  const AttentionShape shape{run.per_device_train_batch_size, run.max_seq_length, model.num_attention_heads,
                             model.num_key_value_heads, model.head_dim, precision_dtype(run.precision), run.packed_rows};
  std::string note;
  if (budget_bytes > 0) {
    std::vector<std::string> fitting;
    for (const std::string& c : candidates) {
      RunConfig r = run;
      r.attn_implementation = c;
      if (plan_run(r, model, Device::cuda).arena_bytes + context_bytes <= budget_bytes) fitting.push_back(c);
      else note += fmt::format("; {} does not fit the budget", c);
    }
    if (fitting.empty()) return "";
    candidates = fitting;
    uint64_t probe = 0;  // one candidate is timed at a time
    for (const std::string& c : candidates) probe = std::max(probe, attention_probe_bytes(shape, {c}));
    if (candidates.size() > 1 && probe + context_bytes > budget_bytes) {
      run.attn_implementation = candidates.front();
      return fmt::format("attention auto: {} (the rule: timing both at {} would take more than the budget)",
                         run.attn_implementation, shape.key());
    }
  }
  const AttentionPick pick = pick_attention(backend, shape, candidates, attention_cache_path());
  run.attn_implementation = pick.implementation;
  return pick.describe(shape) + note;
}

}  // namespace memtune
