// cuDNN fused attention; see attention_cudnn.h.
#include "memtune/ops/cuda/attention_cudnn.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <set>
#include <string>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "memtune/core/error.h"
#include "memtune/ops/cuda/cuda_ops.h"
#include "memtune/ops/ragged_attention.h"

#if MEMTUNE_HAVE_CUDNN
// The frontend's dynamic-loading mode: it reaches cuDNN (and NVRTC, which only its experimental
// Sm100 engines use) through dlopen, so the binary needs no libnvrtc, which the device lacks on
// its system path. memtune itself links libcudnn for the few calls below (handle, stream,
// version, error strings), and hands the frontend that same library.
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING 1
#include <cudnn.h>
#include <cudnn_frontend.h>
#include <dlfcn.h>

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend
#endif

namespace memtune {

#if MEMTUNE_HAVE_CUDNN
bool cudnn_attention_available() {
  // Built with cuDNN; the loaded libcudnn must be 9.x (the graph SDPA ops) and a GPU of compute
  // capability 8.0+ must be present (cuDNN's fused flash engines start at Ampere).
  static const bool available = [] {
    if (cudnnGetVersion() < 90000) return false;
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
      return false;
    return major >= 8;
  }();
  return available;
}
#else
bool cudnn_attention_available() { return false; }
#endif

}  // namespace memtune

namespace memtune::cuda {

#if MEMTUNE_HAVE_CUDNN
size_t cudnn_runtime_version() { return cudnnGetVersion(); }

namespace fe = cudnn_frontend;

namespace {

// Tensor uids of the variant packs; the ragged graphs add their offset and length tensors (one
// per ragged tensor, several bound to the same table row).
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV,
  kSeqLenQ = 20, kSeqLenKv, kQOff, kKOff, kVOff, kOOff, kStatsOff, kDOOff, kDQOff, kDKOff, kDVOff
};

// The ragged graphs' index tensors and the table row each one reads.
struct IndexTensor {
  Uid uid;
  int row;
};

// The op's own scratch in front of cuDNN's workspace (ragged Stats in the layout cuDNN writes or
// reads), rounded to 256 bytes.
size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

#define MT_CUDNN_CHECK(call)                                                                   \
  do {                                                                                         \
    const cudnnStatus_t mt_cudnn_status_ = (call);                                             \
    MT_ASSERT(mt_cudnn_status_ == CUDNN_STATUS_SUCCESS, "cuDNN: {} failed: {}", #call,         \
              cudnnGetErrorString(mt_cudnn_status_));                                          \
  } while (0)

void check_fe(fe::error_t e, const char* what, const AttentionDims& d, bool backward) {
  MT_ASSERT(e.is_good(), "cuDNN attention {} ({}; batch {} seq {} heads {}/{} head_dim {}): {}",
            backward ? "backward" : "forward", what, d.batch, d.seq, d.n_heads, d.n_kv_heads,
            d.head_dim, e.get_message());
}

fe::DataType_t fe_type(DType t) {
  MT_ASSERT(t == DType::bf16 || t == DType::f16, "cuDNN attention takes bf16 or f16, got {}",
            dtype_name(t));
  return t == DType::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
}

// memtune's [tokens, heads * head_dim] is [batch, seq, heads, head_dim]; cuDNN wants the dims in
// (b, h, s, d) order with the strides saying where each lives.
std::vector<int64_t> bshd_stride(int64_t seq, int64_t heads, int64_t d) {
  return {seq * heads * d, d, heads * d, 1};
}

}  // namespace

struct CudnnAttention::Impl {
  cudnnHandle_t handle = nullptr;
  // Dense graphs: slots = max_len = 0. Ragged: tokens and seq matter too (max_total_seq_len_q,
  // the head-major Stats strides).
  struct Key {
    int64_t batch, seq, heads, kv_heads, head_dim;
    float scale;
    int dtype;
    bool backward;
    int64_t slots, max_len;
    int stats;
    auto tie() const {
      return std::tie(batch, seq, heads, kv_heads, head_dim, scale, dtype, backward, slots, max_len,
                      stats);
    }
    bool operator<(const Key& o) const { return tie() < o.tie(); }
  };
  std::map<Key, std::shared_ptr<fe::graph::Graph>> graphs;
  mutable std::mutex mutex;
  RaggedStats stats_layout = RaggedStats::token_major;
  CudnnStats counters;

  Impl() {
    if (fe::cudnn_dlhandle == nullptr) {
      // Already loaded (memtune links it): dlopen returns that copy.
      fe::cudnn_dlhandle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
      MT_USER_CHECK(fe::cudnn_dlhandle != nullptr, "cuDNN attention: dlopen libcudnn.so.9: {}", dlerror());
    }
    MT_CUDNN_CHECK(cudnnCreate(&handle));
    if (const char* env = std::getenv("MEMTUNE_CUDNN_RAGGED_STATS")) {
      MT_USER_CHECK(std::strcmp(env, "token_major") == 0 || std::strcmp(env, "head_major") == 0,
                    "MEMTUNE_CUDNN_RAGGED_STATS={}: token_major or head_major", env);
      stats_layout = std::strcmp(env, "head_major") == 0 ? RaggedStats::head_major : RaggedStats::token_major;
    }
  }
  ~Impl() {
    graphs.clear();
    if (handle != nullptr) cudnnDestroy(handle);
  }

  static Key key_of(const AttentionDims& d, DType dtype, bool backward, const CudnnRagged* r,
                    RaggedStats stats) {
    const bool ragged = r != nullptr && r->slots > 0;
    return Key{d.batch, d.seq, d.n_heads, d.n_kv_heads, d.head_dim, d.scale,
               static_cast<int>(dtype), backward, ragged ? r->slots : 0, ragged ? r->max_len : 0,
               ragged ? static_cast<int>(stats) : 0};
  }

  std::shared_ptr<fe::graph::Graph> graph(const Key& key, const AttentionDims& d, DType dtype) {
    MT_USER_CHECK(d.head_dim == 64 || d.head_dim == 128,
                  "cuDNN attention takes head_dim 64 or 128, got {} (use --attn_implementation flash)",
                  d.head_dim);
    MT_ASSERT(d.n_kv_heads > 0 && d.n_heads % d.n_kv_heads == 0, "heads {} / kv heads {}",
              d.n_heads, d.n_kv_heads);
    std::lock_guard<std::mutex> lock(mutex);
    auto it = graphs.find(key);
    if (it != graphs.end()) return it->second;
    const auto t0 = std::chrono::steady_clock::now();
    std::shared_ptr<fe::graph::Graph> g;
    std::string failed_step, message;
    try {
      // The frontend throws where no SDPA implementation takes the attributes.
      g = key.slots > 0 ? make_ragged_graph(key, d, dtype) : make_dense_graph(key, d, dtype);
    } catch (const std::exception& e) {
      failed_step = "sdpa", message = e.what();
    }
    if (!failed_step.empty()) {
    } else if (auto e = g->validate(); !e.is_good()) {
      failed_step = "validate", message = e.get_message();
    } else if (auto e2 = g->build_operation_graph(handle); !e2.is_good()) {
      failed_step = "build_operation_graph", message = e2.get_message();
    } else if (auto e3 = g->create_execution_plans({fe::HeurMode_t::A}); !e3.is_good()) {
      failed_step = "create_execution_plans", message = e3.get_message();
    } else if (auto e4 = g->check_support(handle); !e4.is_good()) {
      failed_step = "check_support", message = e4.get_message();
    } else if (auto e5 = g->build_plans(handle); !e5.is_good()) {
      // A dense shape that passed check_support must build; packed rows fall back.
      if (key.slots == 0) check_fe(e5, "build_plans", d, key.backward);
      failed_step = "build_plans", message = e5.get_message();
    }
    counters.graphs += 1;
    counters.build_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // A shape cuDNN has no engine for (e.g. its backward at seq 1) is cached as null: the caller
    // runs memtune's flash kernel for it, and this says so once.
    if (!failed_step.empty()) {
      say_unsupported(key, d, failed_step.c_str(), message);
      g = nullptr;
    }
    graphs.emplace(key, g);
    return g;
  }

  std::shared_ptr<fe::graph::Graph> new_graph(DType dtype) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe_type(dtype))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    return g;
  }

  std::shared_ptr<fe::graph::Graph> make_dense_graph(const Key& key, const AttentionDims& d,
                                                     DType dtype) {
    auto g = new_graph(dtype);
    const int64_t b = d.batch, s = d.seq, h = d.n_heads, hk = d.n_kv_heads, hd = d.head_dim;
    auto tensor = [&](const char* name, int64_t uid, int64_t heads) {
      return g->tensor(fe::graph::Tensor_attributes()
                           .set_name(name)
                           .set_uid(uid)
                           .set_dim({b, heads, s, hd})
                           .set_stride(bshd_stride(s, heads, hd)));
    };
    auto q = tensor("Q", kQ, h);
    auto k = tensor("K", kK, hk);
    auto v = tensor("V", kV, hk);
    if (!key.backward) {
      auto options = fe::graph::SDPA_attributes()
                         .set_name("memtune_sdpa_fwd")
                         .set_generate_stats(true)
                         .set_causal_mask(true)
                         .set_attn_scale(d.scale);
      auto [o, stats] = g->sdpa(q, k, v, options);
      o->set_output(true).set_uid(kO).set_dim({b, h, s, hd}).set_stride(bshd_stride(s, h, hd));
      stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT)
          .set_dim({b, h, s, 1}).set_stride({h * s, s, 1, 1});
    } else {
      auto o = tensor("O", kO, h);
      auto d_o = tensor("dO", kDO, h);
      auto stats = g->tensor(fe::graph::Tensor_attributes()
                                 .set_name("Stats")
                                 .set_uid(kStats)
                                 .set_dim({b, h, s, 1})
                                 .set_stride({h * s, s, 1, 1})
                                 .set_data_type(fe::DataType_t::FLOAT));
      auto options = fe::graph::SDPA_backward_attributes()
                         .set_name("memtune_sdpa_bwd")
                         .set_causal_mask(true)
                         .set_attn_scale(d.scale);
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, options);
      dq->set_output(true).set_uid(kDQ).set_dim({b, h, s, hd}).set_stride(bshd_stride(s, h, hd));
      dk->set_output(true).set_uid(kDK).set_dim({b, hk, s, hd}).set_stride(bshd_stride(s, hk, hd));
      dv->set_output(true).set_uid(kDV).set_dim({b, hk, s, hd}).set_stride(bshd_stride(s, hk, hd));
    }
    return g;
  }

  // The ragged graph: `slots` sequences of at most `max_len` tokens (dims b and s of every
  // tensor), each placed by its ragged offset; the BSHD strides within a sequence are memtune's.
  std::shared_ptr<fe::graph::Graph> make_ragged_graph(const Key& key, const AttentionDims& d,
                                                      DType dtype) {
    auto g = new_graph(dtype);
    const int64_t b = key.slots, s = key.max_len, h = d.n_heads, hk = d.n_kv_heads, hd = d.head_dim;
    const int64_t tokens = d.tokens(), row_seq = d.seq;
    auto index = [&](const char* name, Uid uid, int64_t n) {
      return g->tensor(fe::graph::Tensor_attributes()
                           .set_name(name)
                           .set_uid(uid)
                           .set_dim({n, 1, 1, 1})
                           .set_stride({1, 1, 1, 1})
                           .set_data_type(fe::DataType_t::INT32));
    };
    auto ragged = [&](const char* name, Uid uid, int64_t heads, const char* off_name, Uid off_uid) {
      return g->tensor(fe::graph::Tensor_attributes()
                           .set_name(name)
                           .set_uid(uid)
                           .set_dim({b, heads, s, hd})
                           .set_stride(bshd_stride(s, heads, hd))
                           .set_ragged_offset(index(off_name, off_uid, b + 1)));
    };
    auto set_ragged_output = [&](const std::shared_ptr<fe::graph::Tensor_attributes>& t, Uid uid,
                                 int64_t heads, const char* off_name, Uid off_uid) {
      t->set_output(true).set_uid(uid).set_dim({b, heads, s, hd}).set_stride(bshd_stride(s, heads, hd))
          .set_ragged_offset(index(off_name, off_uid, b + 1));
    };
    // Stats: token-major [tokens, heads] (offset start * heads); head-major, as the forward writes
    // it: lse [batch, heads, seq] (offset row * heads * seq + position, head stride seq); as the
    // backward reads it: [heads, tokens] (offset start, head stride tokens).
    const bool head_major = key.stats == static_cast<int>(RaggedStats::head_major);
    const std::vector<int64_t> stats_stride =
        !head_major ? std::vector<int64_t>{s * h, 1, h, 1}
        : !key.backward ? std::vector<int64_t>{h * row_seq, row_seq, 1, 1}
                        : std::vector<int64_t>{h * tokens, tokens, 1, 1};
    auto q = ragged("Q", kQ, h, "Q_offsets", kQOff);
    auto k = ragged("K", kK, hk, "K_offsets", kKOff);
    auto v = ragged("V", kV, hk, "V_offsets", kVOff);
    auto seq_q = index("seq_len_q", kSeqLenQ, b);
    auto seq_kv = index("seq_len_kv", kSeqLenKv, b);
    if (!key.backward) {
      auto options = fe::graph::SDPA_attributes()
                         .set_name("memtune_sdpa_ragged_fwd")
                         .set_generate_stats(true)
                         .set_causal_mask(true)
                         .set_padding_mask(true)
                         .set_seq_len_q(seq_q)
                         .set_seq_len_kv(seq_kv)
                         .set_attn_scale(d.scale);
      auto [o, stats] = g->sdpa(q, k, v, options);
      set_ragged_output(o, kO, h, "O_offsets", kOOff);
      stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT)
          .set_dim({b, h, s, 1}).set_stride(stats_stride)
          .set_ragged_offset(index("Stats_offsets", kStatsOff, b + 1));
    } else {
      auto o = ragged("O", kO, h, "O_offsets", kOOff);
      auto d_o = ragged("dO", kDO, h, "dO_offsets", kDOOff);
      auto stats = g->tensor(fe::graph::Tensor_attributes()
                                 .set_name("Stats")
                                 .set_uid(kStats)
                                 .set_dim({b, h, s, 1})
                                 .set_stride(stats_stride)
                                 .set_data_type(fe::DataType_t::FLOAT)
                                 .set_ragged_offset(index("Stats_offsets", kStatsOff, b + 1)));
      auto options = fe::graph::SDPA_backward_attributes()
                         .set_name("memtune_sdpa_ragged_bwd")
                         .set_causal_mask(true)
                         .set_padding_mask(true)
                         .set_seq_len_q(seq_q)
                         .set_seq_len_kv(seq_kv)
                         .set_max_total_seq_len_q(tokens)
                         .set_attn_scale(d.scale);
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, options);
      set_ragged_output(dq, kDQ, h, "dQ_offsets", kDQOff);
      set_ragged_output(dk, kDK, hk, "dK_offsets", kDKOff);
      set_ragged_output(dv, kDV, hk, "dV_offsets", kDVOff);
    }
    return g;
  }

  void say_unsupported(const Key& key, const AttentionDims& d, const char* what,
                       const std::string& message) {
    if (key.slots > 0)
      std::fprintf(stderr,
                   "memtune: cuDNN ragged attention %s has no engine for %ld sequences of <= %ld "
                   "tokens (batch %ld seq %ld heads %ld/%ld head_dim %ld; %s: %s); running "
                   "memtune's flash kernel for these packed rows\n",
                   key.backward ? "backward" : "forward", static_cast<long>(key.slots),
                   static_cast<long>(key.max_len), static_cast<long>(d.batch),
                   static_cast<long>(d.seq), static_cast<long>(d.n_heads),
                   static_cast<long>(d.n_kv_heads), static_cast<long>(d.head_dim), what,
                   message.c_str());
    else
      std::fprintf(stderr,
                   "memtune: cuDNN attention %s has no engine for batch %ld seq %ld heads %ld/%ld "
                   "head_dim %ld (%s: %s); running memtune's flash kernel for this shape\n",
                   key.backward ? "backward" : "forward", static_cast<long>(d.batch),
                   static_cast<long>(d.seq), static_cast<long>(d.n_heads),
                   static_cast<long>(d.n_kv_heads), static_cast<long>(d.head_dim), what,
                   message.c_str());
  }

  size_t workspace(const std::shared_ptr<fe::graph::Graph>& g, const AttentionDims& d,
                   bool backward) {
    int64_t bytes = 0;
    check_fe(g->get_workspace_size(bytes), "get_workspace_size", d, backward);
    return static_cast<size_t>(bytes);
  }

  // Bytes of the op's own scratch in front of cuDNN's workspace for a ragged call: the row
  // statistics in the layout cuDNN writes (token-major forward) or reads (token-major backward;
  // head-major backward at batch > 1).
  static size_t ragged_scratch_bytes(const AttentionDims& d, bool backward, RaggedStats layout) {
    const bool needed = layout == RaggedStats::token_major || (backward && d.batch > 1);
    return needed ? align256(static_cast<size_t>(d.tokens() * d.n_heads) * sizeof(float)) : 0;
  }

  size_t total_workspace(const AttentionDims& d, DType dtype, bool backward, const CudnnRagged* r) {
    const RaggedStats layout = stats_layout;
    auto g = graph(key_of(d, dtype, backward, r, layout), d, dtype);
    if (!g) return kCudnnUnsupported;
    const size_t scratch = (r != nullptr && r->slots > 0) ? ragged_scratch_bytes(d, backward, layout) : 0;
    return scratch + workspace(g, d, backward);
  }

  bool execute(const AttentionDims& d, const CudnnSdpaTensors& t, cudaStream_t stream,
               bool backward) {
    const bool ragged = t.ragged.table != nullptr;
    const RaggedStats layout = stats_layout;
    const Key key = key_of(d, t.dtype, backward, ragged ? &t.ragged : nullptr, layout);
    auto g = graph(key, d, t.dtype);
    if (!g) return refuse();
    const size_t need = workspace(g, d, backward);
    const size_t scratch = ragged ? ragged_scratch_bytes(d, backward, layout) : 0;
    if (ragged && scratch + need > t.workspace_bytes) {
      // The sequences come from the data, so a batch may ask for more than the plan gave: the
      // flash kernel runs it (said once per graph).
      std::lock_guard<std::mutex> lock(mutex);
      if (too_small_said.insert(key).second)
        std::fprintf(stderr,
                     "memtune: cuDNN ragged attention %s needs %zu bytes of workspace for %ld "
                     "sequences of <= %ld tokens, the plan gave %zu; running memtune's flash "
                     "kernel for these packed rows\n",
                     backward ? "backward" : "forward", scratch + need,
                     static_cast<long>(t.ragged.slots), static_cast<long>(t.ragged.max_len),
                     t.workspace_bytes);
      counters.refused += 1;
      return false;
    }
    MT_USER_CHECK(need <= t.workspace_bytes,
                  "cuDNN attention {} needs {} bytes of workspace, the plan gave {} (batch {} seq {} "
                  "heads {}/{} head_dim {}); use --attn_implementation flash",
                  backward ? "backward" : "forward", need, t.workspace_bytes, d.batch, d.seq,
                  d.n_heads, d.n_kv_heads, d.head_dim);
    MT_CUDNN_CHECK(cudnnSetStream(handle, stream));
    float* stats_scratch = scratch > 0 ? static_cast<float*>(t.workspace) : nullptr;
    void* cudnn_workspace = static_cast<char*>(t.workspace) + scratch;
    float* stats = t.lse;
    if (ragged && stats_scratch != nullptr) stats = stats_scratch;
    std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(t.q)},
                                            {kK, const_cast<void*>(t.k)},
                                            {kV, const_cast<void*>(t.v)},
                                            {kO, t.out},
                                            {kStats, stats}};
    if (backward) {
      pack[kDO] = const_cast<void*>(t.d_out);
      pack[kDQ] = t.dq;
      pack[kDK] = t.dk;
      pack[kDV] = t.dv;
    }
    const int64_t rows = d.batch, seq = d.seq, heads = d.n_heads;
    if (ragged) {
      auto row = [&](int r) { return const_cast<int32_t*>(t.ragged.table + r * t.ragged.stride); };
      pack[kSeqLenQ] = row(kRaggedLengths);
      pack[kSeqLenKv] = row(kRaggedLengths);
      for (Uid uid : {kQOff, kOOff}) pack[uid] = row(kRaggedQOffsets);
      for (Uid uid : {kKOff, kVOff}) pack[uid] = row(kRaggedKvOffsets);
      if (backward) {
        for (Uid uid : {kDOOff, kDQOff}) pack[uid] = row(kRaggedQOffsets);
        for (Uid uid : {kDKOff, kDVOff}) pack[uid] = row(kRaggedKvOffsets);
      }
      pack[kStatsOff] = row(layout == RaggedStats::token_major ? kRaggedStatsTokens
                            : backward                         ? kRaggedStarts
                                                               : kRaggedStatsRows);
      if (backward && stats_scratch != nullptr) {
        if (layout == RaggedStats::token_major) {
          // lse [batch, heads, seq] -> [tokens, heads]
          launch_transpose_f32(stats_scratch, t.lse, rows, heads, seq, stream);
        } else {
          // lse [batch, heads, seq] -> [heads, tokens]: row b's block of each head moves to
          // column b * seq of that head's row.
          for (int64_t b = 0; b < rows; ++b)
            launch_copy_2d(stats_scratch + b * seq, DType::f32, rows * seq, t.lse + b * heads * seq,
                           DType::f32, seq, heads, seq, stream);
        }
      }
    }
    check_fe(g->execute(handle, pack, need > 0 ? cudnn_workspace : nullptr), "execute", d, backward);
    // [tokens, heads] -> lse [batch, heads, seq]
    if (ragged && !backward && stats_scratch != nullptr)
      launch_transpose_f32(t.lse, stats_scratch, rows, seq, heads, stream);
    if (ragged) {
      std::lock_guard<std::mutex> lock(mutex);
      counters.ragged_runs += 1;
    }
    return true;
  }

  bool refuse() {
    std::lock_guard<std::mutex> lock(mutex);
    counters.refused += 1;
    return false;
  }

  std::set<Key> too_small_said;
};

CudnnAttention::CudnnAttention() : impl_(std::make_unique<Impl>()) {}
CudnnAttention::~CudnnAttention() = default;

bool CudnnAttention::forward(const AttentionDims& dims, const CudnnSdpaTensors& t,
                             cudaStream_t stream) {
  return impl_->execute(dims, t, stream, false);
}

bool CudnnAttention::backward(const AttentionDims& dims, const CudnnSdpaTensors& t,
                              cudaStream_t stream) {
  return impl_->execute(dims, t, stream, true);
}

size_t CudnnAttention::workspace_bytes(const AttentionDims& dims, DType dtype, bool backward,
                                       const CudnnRagged* ragged) {
  return impl_->total_workspace(dims, dtype, backward, ragged);
}

void CudnnAttention::set_ragged_stats(RaggedStats layout) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->stats_layout = layout;
}

RaggedStats CudnnAttention::ragged_stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->stats_layout;
}

CudnnStats CudnnAttention::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->counters;
}

#else  // no cuDNN in this build

struct CudnnAttention::Impl {};
size_t cudnn_runtime_version() { return 0; }

namespace {
[[noreturn]] void not_built() {
  mt_fail("--attn_implementation cudnn: this memtune was built without cuDNN (run "
          "scripts/fetch-cudnn-frontend.sh, or point -DMEMTUNE_CUDNN_FRONTEND_DIR at the "
          "cudnn_frontend headers, and rebuild; libcudnn 9 must be found too)");
}
}  // namespace

CudnnAttention::CudnnAttention() = default;
CudnnAttention::~CudnnAttention() = default;
bool CudnnAttention::forward(const AttentionDims&, const CudnnSdpaTensors&, cudaStream_t) { not_built(); }
bool CudnnAttention::backward(const AttentionDims&, const CudnnSdpaTensors&, cudaStream_t) { not_built(); }
size_t CudnnAttention::workspace_bytes(const AttentionDims&, DType, bool, const CudnnRagged*) {
  not_built();
}
void CudnnAttention::set_ragged_stats(RaggedStats) { not_built(); }
RaggedStats CudnnAttention::ragged_stats() const { not_built(); }
CudnnStats CudnnAttention::stats() const { not_built(); }

#endif

}  // namespace memtune::cuda
