// cuDNN fused attention; see attention_cudnn.h.
#include "memtune/ops/cuda/attention_cudnn.h"

#include <fmt/format.h>

#include <cstdio>
#include <map>
#include <string>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "memtune/core/error.h"

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

// Tensor uids of the variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

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
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, float, int, bool>;
  std::map<Key, std::shared_ptr<fe::graph::Graph>> graphs;
  std::mutex mutex;

  Impl() {
    if (fe::cudnn_dlhandle == nullptr) {
      // Already loaded (memtune links it): dlopen returns that copy.
      fe::cudnn_dlhandle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
      MT_USER_CHECK(fe::cudnn_dlhandle != nullptr, "cuDNN attention: dlopen libcudnn.so.9: {}", dlerror());
    }
    MT_CUDNN_CHECK(cudnnCreate(&handle));
  }
  ~Impl() {
    graphs.clear();
    if (handle != nullptr) cudnnDestroy(handle);
  }

  std::shared_ptr<fe::graph::Graph> graph(const AttentionDims& d, DType dtype, bool backward) {
    MT_USER_CHECK(d.head_dim == 64 || d.head_dim == 128,
                  "cuDNN attention takes head_dim 64 or 128, got {} (use --attn_implementation flash)",
                  d.head_dim);
    MT_ASSERT(d.n_kv_heads > 0 && d.n_heads % d.n_kv_heads == 0, "heads {} / kv heads {}",
              d.n_heads, d.n_kv_heads);
    const Key key{d.batch, d.seq, d.n_heads, d.n_kv_heads, d.head_dim, d.scale,
                  static_cast<int>(dtype), backward};
    std::lock_guard<std::mutex> lock(mutex);
    auto it = graphs.find(key);
    if (it != graphs.end()) return it->second;

    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe_type(dtype))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
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
    if (!backward) {
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
    // A shape cuDNN has no engine for (e.g. its backward at seq 1) is cached as null: the caller
    // runs memtune's flash kernel for it, and this says so once.
    if (auto e = g->validate(); !e.is_good())
      return unsupported(key, d, backward, "validate", e.get_message());
    if (auto e = g->build_operation_graph(handle); !e.is_good())
      return unsupported(key, d, backward, "build_operation_graph", e.get_message());
    if (auto e = g->create_execution_plans({fe::HeurMode_t::A}); !e.is_good())
      return unsupported(key, d, backward, "create_execution_plans", e.get_message());
    if (auto e = g->check_support(handle); !e.is_good())
      return unsupported(key, d, backward, "check_support", e.get_message());
    check_fe(g->build_plans(handle), "build_plans", d, backward);
    graphs.emplace(key, g);
    return g;
  }

  std::shared_ptr<fe::graph::Graph> unsupported(const Key& key, const AttentionDims& d, bool backward,
                                                const char* what, const std::string& message) {
    std::fprintf(stderr,
                 "memtune: cuDNN attention %s has no engine for batch %ld seq %ld heads %ld/%ld "
                 "head_dim %ld (%s: %s); running memtune's flash kernel for this shape\n",
                 backward ? "backward" : "forward", static_cast<long>(d.batch),
                 static_cast<long>(d.seq), static_cast<long>(d.n_heads),
                 static_cast<long>(d.n_kv_heads), static_cast<long>(d.head_dim), what,
                 message.c_str());
    graphs.emplace(key, nullptr);
    return nullptr;
  }

  size_t workspace(const std::shared_ptr<fe::graph::Graph>& g, const AttentionDims& d,
                   bool backward) {
    int64_t bytes = 0;
    check_fe(g->get_workspace_size(bytes), "get_workspace_size", d, backward);
    return static_cast<size_t>(bytes);
  }

  bool execute(const AttentionDims& d, const CudnnSdpaTensors& t, cudaStream_t stream,
               bool backward) {
    auto g = graph(d, t.dtype, backward);
    if (!g) return false;
    const size_t need = workspace(g, d, backward);
    MT_USER_CHECK(need <= t.workspace_bytes,
                  "cuDNN attention {} needs {} bytes of workspace, the plan gave {} (batch {} seq {} "
                  "heads {}/{} head_dim {}); use --attn_implementation flash",
                  backward ? "backward" : "forward", need, t.workspace_bytes, d.batch, d.seq,
                  d.n_heads, d.n_kv_heads, d.head_dim);
    MT_CUDNN_CHECK(cudnnSetStream(handle, stream));
    std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(t.q)},
                                            {kK, const_cast<void*>(t.k)},
                                            {kV, const_cast<void*>(t.v)},
                                            {kO, t.out},
                                            {kStats, t.lse}};
    if (backward) {
      pack[kDO] = const_cast<void*>(t.d_out);
      pack[kDQ] = t.dq;
      pack[kDK] = t.dk;
      pack[kDV] = t.dv;
    }
    check_fe(g->execute(handle, pack, need > 0 ? t.workspace : nullptr), "execute", d, backward);
    return true;
  }
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

size_t CudnnAttention::workspace_bytes(const AttentionDims& dims, DType dtype, bool backward) {
  auto g = impl_->graph(dims, dtype, backward);
  return g ? impl_->workspace(g, dims, backward) : kCudnnUnsupported;
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
size_t CudnnAttention::workspace_bytes(const AttentionDims&, DType, bool) { not_built(); }

#endif

}  // namespace memtune::cuda
