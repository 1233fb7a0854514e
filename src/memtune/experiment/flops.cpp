#include "memtune/experiment/flops.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <vector>

#include "memtune/lora/lora_config.h"
#include "memtune/model/param_table.h"

namespace memtune {

// Model FLOPs per token (one multiply-add = 2 FLOPs), for a step that trains LoRA adapters on a
// frozen base. For a matmul y = x W^T with W of shape [out, in], one token costs:
//   forward                      2 * in * out
//   backward to the input        2 * in * out   (dx = dy W)
//   backward to the weight       2 * in * out   (dW = dy^T x) -- only for trained weights.
// So with P_frozen = the parameters of every frozen matmul (the seven projections of each layer
// and the LM head, which is a matmul against [vocab, hidden] whether or not it is tied to the
// embedding; the embedding itself is a lookup and costs nothing):
//   frozen matmuls:   2 * P_frozen (forward) + 2 * P_frozen (backward to the input) = 4 * P_frozen.
//     The backward to the input is needed everywhere above the lowest adapter, and memtune runs
//     it through every layer, so it is counted in full; there are no frozen-weight gradients.
//   LoRA adapters:    x A^T then u B^T, P_lora = r * (in + out) per adapter, all three terms
//     (forward, backward to the input, weight gradients of A and B) = 6 * P_lora.
//   attention:        per layer and token, QK^T and PV each take 2 * seq * q_dim FLOPs over the
//     whole sequence (q_dim = heads * head_dim); causal masking leaves half of the keys, so we
//     count HALF: 2 * (2 * seq * q_dim) / 2 = 2 * seq * q_dim forward. The backward has twice the
//     forward's matmuls (dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q), so fwd + bwd = 3x:
//     6 * seq * q_dim per layer. Counting the causal half is the work the model needs; an eager
//     kernel that computes the masked half as well does more, which MFU does not credit (PaLM's
//     appendix B counts the full square; our MFU is the stricter of the two by that term).
// Not counted: the recompute of gradient checkpointing (a second forward of each layer: that
// is hardware FLOPs, not model FLOPs, so checkpointing lowers MFU, as it should), QLoRA's
// dequantization, norms, RoPE, SwiGLU, softmax, the loss and the optimizer (elementwise, well
// under 1% of the total for Llama shapes).
double lora_training_flops_per_token(const LlamaConfig& model, const RunConfig& run) {
  double frozen_matmul_parameters = static_cast<double>(model.vocab_size) * static_cast<double>(model.hidden_size);
  for (Projection p : kAllProjections)
    frozen_matmul_parameters += static_cast<double>(model.num_hidden_layers) *
                                static_cast<double>(projection_in_features(model, p)) *
                                static_cast<double>(projection_out_features(model, p));
  const double lora_parameters =
      static_cast<double>(count_lora_parameters(lora_table(model, run.lora_config())));
  const double attention = 6.0 * static_cast<double>(model.num_hidden_layers) *
                           static_cast<double>(run.max_seq_length) * static_cast<double>(model.q_dim());
  return 4.0 * frozen_matmul_parameters + 6.0 * lora_parameters + attention;
}

namespace {

std::vector<std::string> upper_tokens(std::string_view text) {
  std::vector<std::string> tokens;
  std::string current;
  for (char c : text) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      current += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    } else if (!current.empty()) {
      tokens.push_back(std::move(current));
      current.clear();
    }
  }
  if (!current.empty()) tokens.push_back(std::move(current));
  return tokens;
}

// Whole tokens in sequence, so that "A10" does not match "A100" or "A10G".
bool has_token_sequence(const std::vector<std::string>& tokens, const std::vector<std::string>& key) {
  for (size_t i = 0; i + key.size() <= tokens.size(); ++i) {
    bool all = true;
    for (size_t k = 0; k < key.size() && all; ++k) all = tokens[i + k] == key[k];
    if (all) return true;
  }
  return false;
}

struct KnownPeak {
  std::vector<std::string> key;  // tokens of the driver's name, upper case
  const char* device;
  double tflops;  // dense 16-bit tensor-core peak, fp32 accumulation
  int multiprocessors;  // SMs of the whole part, to scale the peak for a MIG slice
  const char* source;
};

// Dense (no 2:4 sparsity) bf16/fp16 tensor-core peaks with fp32 accumulation, which is what
// memtune's GEMMs use; the datasheets print the sparse figure, twice these. The more specific
// names come first (H100 PCIe before H100).
const std::vector<KnownPeak>& known_peaks() {
  static const std::vector<KnownPeak> table = {
      {{"H200"}, "NVIDIA H200", 989.4, 132, "NVIDIA H200 datasheet: BF16 tensor core 1,979 TFLOPS with sparsity"},
      {{"H100", "PCIE"}, "NVIDIA H100 PCIe", 756.0, 114, "NVIDIA H100 datasheet: BF16 tensor core 1,513 TFLOPS with sparsity (PCIe)"},
      {{"H100", "NVL"}, "NVIDIA H100 NVL", 835.5, 132, "NVIDIA H100 NVL product brief: BF16 tensor core 1,671 TFLOPS with sparsity"},
      {{"H100"}, "NVIDIA H100 SXM", 989.4, 132, "NVIDIA H100 datasheet: BF16 tensor core 1,979 TFLOPS with sparsity (SXM)"},
      {{"A100"}, "NVIDIA A100", 312.0, 108, "NVIDIA A100 datasheet: BF16 tensor core 312 TFLOPS (624 with sparsity)"},
      {{"RTX", "4090"}, "NVIDIA GeForce RTX 4090", 165.2, 128,
       "NVIDIA Ada Lovelace architecture whitepaper: peak FP16/BF16 tensor TFLOPS with FP32 accumulate 165.2"},
      {{"RTX", "3090"}, "NVIDIA GeForce RTX 3090", 71.0, 82,
       "NVIDIA Ampere GA102 architecture whitepaper: peak FP16/BF16 tensor TFLOPS with FP32 accumulate 71"},
      {{"L4"}, "NVIDIA L4", 121.0, 58, "NVIDIA L4 datasheet: BF16 tensor core 242 TFLOPS with sparsity"},
      {{"A10"}, "NVIDIA A10", 125.0, 72, "NVIDIA A10 datasheet: BF16 tensor core 125 TFLOPS (250 with sparsity)"},
  };
  return table;
}

}  // namespace

std::optional<DevicePeakFlops> device_peak_flops(std::string_view device_name, Precision precision,
                                                 int multiprocessors) {
  // fp32 rungs get no MFU: whether an fp32 GEMM ran on TF32 tensor cores or on the FP32 units is
  // the math library's choice, and the two peaks differ by 8-16x, so either figure would mislead.
  if (precision == Precision::fp32) return std::nullopt;
  const std::vector<std::string> tokens = upper_tokens(device_name);
  for (const KnownPeak& known : known_peaks()) {
    if (!has_token_sequence(tokens, known.key)) continue;
    DevicePeakFlops peak{known.tflops * 1e12, known.device, known.source};
    // Tensor throughput is per SM at a fixed clock: a slice with fewer SMs has that share of it.
    if (multiprocessors > 0 && multiprocessors < known.multiprocessors) {
      peak.flops_per_second *= static_cast<double>(multiprocessors) / known.multiprocessors;
      peak.device = fmt::format("{} ({} of {} SMs)", known.device, multiprocessors, known.multiprocessors);
      peak.source += fmt::format("; scaled to the {} of {} SMs this device reports (a MIG slice)", multiprocessors,
                                 known.multiprocessors);
    }
    return peak;
  }
  return std::nullopt;
}

std::optional<double> model_flops_utilization(double flops_per_token, std::optional<double> tokens_per_second,
                                              const std::optional<DevicePeakFlops>& peak) {
  if (!peak || !tokens_per_second || !std::isfinite(*tokens_per_second) || *tokens_per_second <= 0 ||
      flops_per_token <= 0 || peak->flops_per_second <= 0)
    return std::nullopt;
  return flops_per_token * *tokens_per_second / peak->flops_per_second;
}

}  // namespace memtune
