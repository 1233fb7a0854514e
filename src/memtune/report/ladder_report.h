// The memory ladder's report: from the ladder runner's JSON to the terminal table, report.md,
// ladder.csv and ladder.svg.
//
// Input (ladder.json; the runner writes it, this module writes it back unchanged):
//   config (object, with at least "model"), device (string), budget_bytes, rungs (array, >= 1);
//   optional: device_context_bytes (0), commit, date, isolate, unavailable ([{name, reason}]: rungs
//   the runner could not run at all), peer (see attach_peer), device_peak_flops (the dense
//   16-bit peak that "mfu" divides by; null: unknown or no GPU), device_peak_flops_source,
//   mfu_definition. budget_bytes 0 means no budget.
//   Each rung: name, techniques (array of strings), added (string, "" for the baseline),
//   planned (an object with all ten category names -> bytes at the planned peak),
//   planned_peak_bytes, fits_budget, measured, micro_batch, grad_accum, seq;
//   nullable or absent: engine_peak_bytes, device_peak_bytes, step_seconds, tokens_per_second,
//   loss (a number, or "nan"/"inf" for a diverged run; null on a measured rung is read as NaN,
//   because nlohmann::json writes a NaN double as null), loss_scaler {skipped_steps,
//   final_scale}, mfu (model FLOPs/s over the device's peak, 0..1), model_flops_per_token,
//   peer {name, measured, error, tokens_per_second, step_seconds, loss, peak_allocated_bytes,
//   peak_reserved_bytes, device_peak_bytes, context_bytes: the peer's figures for the rung with
//   the same "added"}; fits_device (absent: the value of measured). Other scalar fields (the
//   runner writes planned_with_context_bytes, attention_bytes, ...) reach the CSV as they are.
//   isolate: {"alone": [...], "removed": [...]}, entries {name, planned_peak_bytes,
//   device_peak_bytes (nullable), saving_bytes (optional)}, and optionally any rung field (the
//   runner writes whole rungs: tokens_per_second, mfu, ...). For "alone", saving_bytes is what the
//   trick saves on its own against the baseline rung; for "removed", it is what taking the trick
//   out of the full stack (the last rung) costs, so in both lists larger means the trick matters
//   more. Absent, both are computed from planned peaks.
// A missing or mistyped field throws memtune::Error naming it: `ladder: rungs[3] ("+flash
// attention"): missing key "planned_peak_bytes"`.
//
// The baseline is the first rung whose "added" is empty (else the first rung). Savings in the
// tables and on the chart are differences of planned peaks, which every rung has, measured or
// not; the claims use measured figures wherever both sides of a comparison have them.
//
// Against the peer (transformers + PEFT), memtune's device peak is compared with the peer's
// device_peak_bytes: both are process-level device memory as nvidia-smi shows it, CUDA context
// included. Tokens/s is compared with tokens/s.
//
// The implementation is in four parts: ladder_report_parse.cpp (ladder.json and peer.json in),
// ladder_report_claims.cpp (the claims), ladder_report_render.cpp (terminal table, report.md,
// ladder.csv, the files) and ladder_report_chart.cpp (ladder.svg), sharing
// ladder_report_detail.h.
//
// Room report/ (docs/ARCHITECTURE.md): renderers only, JSON in and text or SVG out; may include core/
// and io/ only, so that `memtune report` re-renders without an engine.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memtune/core/memory.h"

namespace memtune {

struct LadderLossScaler {
  std::optional<int64_t> skipped_steps;
  std::optional<double> final_scale;
};

// The peer's figures for one rung (bench/peer_hf.py's peer.json, matched by "added").
struct LadderPeer {
  std::string name;
  std::optional<bool> measured;
  std::string error;
  std::optional<double> tokens_per_second, step_seconds, loss;
  std::optional<uint64_t> peak_allocated_bytes, peak_reserved_bytes, device_peak_bytes, context_bytes;
};

// memtune against the peer on one rung; empty where either side lacks the figure.
struct PeerComparison {
  std::optional<double> tokens_per_second_ratio;  // memtune / peer: above 1, memtune is faster
  std::optional<double> device_peak_ratio;        // memtune / peer: below 1, memtune takes less
  std::optional<bool> beats_tokens_per_second, beats_device_peak;
};

struct LadderRung {
  std::string name;
  std::vector<std::string> techniques;
  std::string added;
  CategoryBytes planned{};
  uint64_t planned_peak_bytes = 0;
  std::optional<uint64_t> engine_peak_bytes, device_peak_bytes;
  bool fits_budget = false, fits_device = false, measured = false;
  std::optional<double> step_seconds, tokens_per_second;
  std::optional<double> loss;  // NaN or infinity when the run wrote "nan"/"inf"
  std::optional<LadderLossScaler> loss_scaler;
  int64_t micro_batch = 0, grad_accum = 0, seq = 0;
  std::optional<double> mfu, model_flops_per_token;
  std::optional<LadderPeer> peer;
  // The second, third, ... peer's figures (ladder["rungs"][i]["more_peers"], aligned with
  // Ladder::more_peers; nullopt where that peer has no rung of the same "added").
  std::vector<std::optional<LadderPeer>> more_peers;
};

PeerComparison compare_with_peer(const LadderRung& rung);
// The same against any peer's figures for this rung.
PeerComparison compare_with(const LadderRung& rung, const std::optional<LadderPeer>& peer);

struct LadderIsolateEntry {
  std::string name;
  uint64_t planned_peak_bytes = 0;
  std::optional<uint64_t> device_peak_bytes;
  int64_t saving_bytes = 0;  // larger: the trick matters more (see the header comment)
  std::optional<double> tokens_per_second, mfu;
};

// The top-level "peer" object: who the peer was.
struct LadderPeerInfo {
  std::string versions;  // "transformers X, peft Y, torch Z, bitsandbytes W|none"
  std::string tool;      // the peer JSON's "tool" ("transformers+peft+bnb", "...+liger", "unsloth"); may be empty
  std::string device, date, source;
  std::vector<std::string> unmatched;  // peer rungs that no memtune rung has
};

struct Ladder {
  nlohmann::json config;
  std::string model, device, commit, date;
  uint64_t device_context_bytes = 0, budget_bytes = 0;
  std::vector<LadderRung> rungs;
  size_t baseline = 0;  // index into rungs
  std::vector<std::pair<std::string, std::string>> unavailable;  // name, reason
  bool has_isolate = false;
  std::vector<LadderIsolateEntry> isolate_alone, isolate_removed;
  std::optional<LadderPeerInfo> peer;
  std::vector<LadderPeerInfo> more_peers;  // ladder["more_peers"]: the peers after the first
  std::optional<double> device_peak_flops;
  std::optional<double> measured_gemm_flops;  // dense bf16 GEMM rate measured in the same process
  std::string device_peak_flops_source, mfu_definition, measured_gemm_definition;
};

// Validates and converts; memtune::Error naming the first bad field.
Ladder parse_ladder_json(const nlohmann::json& ladder);

enum class ClaimVerdict : uint8_t { held, did_not_hold, not_measured };
std::string_view claim_verdict_name(ClaimVerdict verdict);  // "held", "did not hold", "not measured"

// One piece of the usual advice set beside what this run measured.
struct LadderClaim {
  std::string id;        // "16bit_halves", "bf16_stable", "checkpointing", "flash_linear",
                         // "qlora_biggest", "order_of_impact"
  std::string claim;     // the advice as people give it
  std::string measured;  // what this run shows, with the numbers
  ClaimVerdict verdict = ClaimVerdict::not_measured;
};

// The six claims, computed from the data (never fixed text): see ladder_report_claims.cpp for the rules.
std::vector<LadderClaim> ladder_claims(const nlohmann::json& ladder);

// Fixed-width table for the terminal: one row per rung.
std::string ladder_terminal_table(const nlohmann::json& ladder);
// report.md.
std::string ladder_markdown(const nlohmann::json& ladder);
// ladder.csv: a header row and one row per rung (RFC 4180 quoting).
std::string ladder_csv(const nlohmann::json& ladder);
// ladder.svg: stacked bars of planned bytes by category, measured peaks as markers, the budget.
std::string ladder_svg(const nlohmann::json& ladder);

// Attaches a peer run (bench/peer_hf.py's peer.json: {"peer", "device", "date", "config",
// "rungs": [{"name", "added", "techniques", "measured", "error", "tokens_per_second",
// "step_seconds", "loss", "peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes",
// "context_bytes"}]}) to a ladder: each memtune rung gets "peer" from the peer rung with the same
// "added", with the comparison (tokens_per_second_ratio, device_peak_ratio,
// beats_tokens_per_second, beats_device_peak); the top level gets "peer" {peer, device, date,
// config, source, unmatched}. A peer already attached is replaced. `source` names the file in
// errors and in the report. memtune::Error names the first bad field of either input.
nlohmann::json attach_peer(const nlohmann::json& ladder, const nlohmann::json& peer, const std::string& source);
// Several peers (memtune report --peer A --peer B ...): the first attached as attach_peer does
// (so one peer gives exactly attach_peer's output), each further one under "more_peers": the
// top level gets "more_peers" [{peer, tool, device, date, config, source, unmatched}, ...] and
// every rung "more_peers" [figures with the comparison, or null, ...] in the same order. Any
// peers already attached are replaced. report.md, the terminal table, ladder.csv and the SVG
// then show every peer beside memtune, each labelled by its "tool" (else "peer N").
nlohmann::json attach_peers(const nlohmann::json& ladder,
                            const std::vector<std::pair<nlohmann::json, std::string>>& peers);
// The same checks on peer.json alone: for a command that runs for a long time before attaching.
void validate_peer_json(const nlohmann::json& peer, const std::string& source);

// Creates out_dir and writes ladder.json (pretty), ladder.csv, report.md and ladder.svg, each
// atomically. Everything is rendered before the first file is written, so invalid input leaves
// the directory as it was.
void write_ladder_outputs(const nlohmann::json& ladder, const std::filesystem::path& out_dir);

}  // namespace memtune
