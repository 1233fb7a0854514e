#include "memtune/report/ladder_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <set>

#include "memtune/core/bytes.h"
#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"
#include "memtune/report/svg.h"

namespace memtune {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------
namespace {

uint64_t get_bytes(const json& object, std::string_view key, const std::string& context) {
  const int64_t value = json_get<int64_t>(object, key, context);
  MT_USER_CHECK(value >= 0, "{}: expected a byte count >= 0, got {}",
                json_key_description(context, key), value);
  return static_cast<uint64_t>(value);
}

std::optional<uint64_t> get_bytes_optional(const json& object, std::string_view key,
                                           const std::string& context) {
  const std::optional<int64_t> value = json_get_optional<int64_t>(object, key, context);
  if (!value) return std::nullopt;
  MT_USER_CHECK(*value >= 0, "{}: expected a byte count >= 0, got {}",
                json_key_description(context, key), *value);
  return static_cast<uint64_t>(*value);
}

// JSON has no NaN: a diverged run writes the loss as a string.
std::optional<double> get_loss(const json& object, std::string_view key, const std::string& context) {
  const json* value = json_find(object, key, context);
  if (value == nullptr || value->is_null()) return std::nullopt;
  if (value->is_string()) {
    std::string text = value->get<std::string>();
    std::transform(text.begin(), text.end(), text.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (text == "nan" || text == "-nan") return std::numeric_limits<double>::quiet_NaN();
    if (text == "inf" || text == "+inf" || text == "infinity") return std::numeric_limits<double>::infinity();
    if (text == "-inf" || text == "-infinity") return -std::numeric_limits<double>::infinity();
  }
  return json_as<double>(*value, json_key_description(context, key) +
                                     " (a number, or \"nan\"/\"inf\" for a diverged run)");
}

// The peer's figures for one rung: in peer.json's rungs and, once attached, under rung["peer"].
LadderPeer parse_peer_figures(const json& value, const std::string& context) {
  json_require_object(value, context);
  LadderPeer peer;
  peer.name = json_get_or<std::string>(value, "name", "", context);
  peer.measured = json_get_optional<bool>(value, "measured", context);
  peer.error = json_get_or<std::string>(value, "error", "", context);
  peer.tokens_per_second = json_get_optional<double>(value, "tokens_per_second", context);
  peer.step_seconds = json_get_optional<double>(value, "step_seconds", context);
  peer.loss = get_loss(value, "loss", context);
  peer.peak_allocated_bytes = get_bytes_optional(value, "peak_allocated_bytes", context);
  peer.peak_reserved_bytes = get_bytes_optional(value, "peak_reserved_bytes", context);
  peer.device_peak_bytes = get_bytes_optional(value, "device_peak_bytes", context);
  peer.context_bytes = get_bytes_optional(value, "context_bytes", context);
  return peer;
}

LadderRung parse_rung(const json& value, size_t index) {
  std::string context = fmt::format("ladder: rungs[{}]", index);
  json_require_object(value, context);
  LadderRung rung;
  rung.name = json_get<std::string>(value, "name", context);
  context = fmt::format("ladder: rungs[{}] (\"{}\")", index, rung.name);
  rung.techniques = json_get<std::vector<std::string>>(value, "techniques", context);
  rung.added = json_get<std::string>(value, "added", context);

  const json& planned = json_require(value, "planned", context);
  const std::string planned_context = context + ": planned";
  json_require_object(planned, planned_context);
  for (int c = 0; c < kNumMemCategories; ++c)
    rung.planned[c] = get_bytes(planned, category_name(category_at(c)), planned_context);

  rung.planned_peak_bytes = get_bytes(value, "planned_peak_bytes", context);
  rung.engine_peak_bytes = get_bytes_optional(value, "engine_peak_bytes", context);
  rung.device_peak_bytes = get_bytes_optional(value, "device_peak_bytes", context);
  rung.fits_budget = json_get<bool>(value, "fits_budget", context);
  rung.measured = json_get<bool>(value, "measured", context);
  rung.fits_device = json_get_or<bool>(value, "fits_device", rung.measured, context);
  rung.step_seconds = json_get_optional<double>(value, "step_seconds", context);
  rung.tokens_per_second = json_get_optional<double>(value, "tokens_per_second", context);
  rung.loss = get_loss(value, "loss", context);
  // nlohmann::json writes a NaN double as null: a trained rung without a loss diverged.
  if (rung.measured && !rung.loss) rung.loss = std::numeric_limits<double>::quiet_NaN();
  rung.micro_batch = json_get<int64_t>(value, "micro_batch", context);
  rung.grad_accum = json_get<int64_t>(value, "grad_accum", context);
  rung.seq = json_get<int64_t>(value, "seq", context);

  if (const json* scaler = json_find(value, "loss_scaler", context); scaler && !scaler->is_null()) {
    const std::string scaler_context = context + ": loss_scaler";
    json_require_object(*scaler, scaler_context);
    rung.loss_scaler = LadderLossScaler{
        json_get_optional<int64_t>(*scaler, "skipped_steps", scaler_context),
        json_get_optional<double>(*scaler, "final_scale", scaler_context)};
  }
  rung.mfu = json_get_optional<double>(value, "mfu", context);
  rung.model_flops_per_token = json_get_optional<double>(value, "model_flops_per_token", context);
  if (const json* peer = json_find(value, "peer", context); peer && !peer->is_null())
    rung.peer = parse_peer_figures(*peer, context + ": peer");
  if (const json* more = json_find(value, "more_peers", context); more && !more->is_null()) {
    MT_USER_CHECK(more->is_array(), "{}: key \"more_peers\": expected an array, got {}", context,
                  json_value_description(*more));
    for (size_t k = 0; k < more->size(); ++k)
      rung.more_peers.push_back((*more)[k].is_null()
                                    ? std::nullopt
                                    : std::optional<LadderPeer>(parse_peer_figures(
                                          (*more)[k], fmt::format("{}: more_peers[{}]", context, k))));
  }
  return rung;
}

// The top-level "peer" object, and each of "more_peers": who the peer was.
LadderPeerInfo parse_peer_info(const json& peer, const std::string& context) {
  json_require_object(peer, context);
  LadderPeerInfo info;
  info.versions = json_get_or<std::string>(peer, "peer", "unknown", context);
  info.tool = json_get_or<std::string>(peer, "tool", "", context);
  info.device = json_get_or<std::string>(peer, "device", "unknown", context);
  info.date = json_get_or<std::string>(peer, "date", "unknown", context);
  info.source = json_get_or<std::string>(peer, "source", "", context);
  info.unmatched = json_get_or<std::vector<std::string>>(peer, "unmatched", {}, context);
  return info;
}

std::vector<LadderIsolateEntry> parse_isolate_list(const json& isolate, std::string_view key,
                                                   const std::string& context, bool alone,
                                                   const Ladder& ladder) {
  std::vector<LadderIsolateEntry> entries;
  const json* list = json_find(isolate, key, context);
  if (list == nullptr || list->is_null()) return entries;
  MT_USER_CHECK(list->is_array(), "{}: expected an array, got {}", json_key_description(context, key),
                json_value_description(*list));
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string entry_context = fmt::format("{}.{}[{}]", context, key, i);
    const json& item = (*list)[i];
    json_require_object(item, entry_context);
    LadderIsolateEntry entry;
    entry.name = json_get<std::string>(item, "name", entry_context);
    entry.planned_peak_bytes = get_bytes(item, "planned_peak_bytes", entry_context);
    entry.device_peak_bytes = get_bytes_optional(item, "device_peak_bytes", entry_context);
    const uint64_t reference = alone ? ladder.rungs[ladder.baseline].planned_peak_bytes
                                     : ladder.rungs.back().planned_peak_bytes;
    const int64_t computed = alone ? static_cast<int64_t>(reference) - static_cast<int64_t>(entry.planned_peak_bytes)
                                   : static_cast<int64_t>(entry.planned_peak_bytes) - static_cast<int64_t>(reference);
    entry.saving_bytes = json_get_or<int64_t>(item, "saving_bytes", computed, entry_context);
    entry.tokens_per_second = json_get_optional<double>(item, "tokens_per_second", entry_context);
    entry.mfu = json_get_optional<double>(item, "mfu", entry_context);
    entries.push_back(std::move(entry));
  }
  return entries;
}

}  // namespace

Ladder parse_ladder_json(const json& value) {
  const std::string context = "ladder";
  json_require_object(value, context);
  Ladder ladder;
  ladder.config = json_require(value, "config", context);
  json_require_object(ladder.config, "ladder: config");
  ladder.model = json_get<std::string>(ladder.config, "model", "ladder: config");
  ladder.device = json_get<std::string>(value, "device", context);
  ladder.device_context_bytes = get_bytes_optional(value, "device_context_bytes", context).value_or(0);
  ladder.commit = json_get_or<std::string>(value, "commit", "unknown", context);
  ladder.date = json_get_or<std::string>(value, "date", "unknown", context);
  ladder.budget_bytes = get_bytes(value, "budget_bytes", context);
  const json& rungs = json_require(value, "rungs", context);
  MT_USER_CHECK(rungs.is_array(), "ladder: key \"rungs\": expected an array, got {}",
                json_value_description(rungs));
  MT_USER_CHECK(!rungs.empty(), "ladder: key \"rungs\": the ladder has no rungs");
  for (size_t i = 0; i < rungs.size(); ++i) ladder.rungs.push_back(parse_rung(rungs[i], i));
  ladder.baseline = 0;
  for (size_t i = 0; i < ladder.rungs.size(); ++i) {
    if (ladder.rungs[i].added.empty()) {
      ladder.baseline = i;
      break;
    }
  }
  if (const json* unavailable = json_find(value, "unavailable", context); unavailable && !unavailable->is_null()) {
    MT_USER_CHECK(unavailable->is_array(), "ladder: key \"unavailable\": expected an array, got {}",
                  json_value_description(*unavailable));
    for (size_t i = 0; i < unavailable->size(); ++i) {
      const std::string entry_context = fmt::format("ladder: unavailable[{}]", i);
      ladder.unavailable.emplace_back(json_get<std::string>((*unavailable)[i], "name", entry_context),
                                      json_get_or<std::string>((*unavailable)[i], "reason", "", entry_context));
    }
  }
  if (const json* isolate = json_find(value, "isolate", context); isolate && !isolate->is_null()) {
    json_require_object(*isolate, "ladder: isolate");
    ladder.has_isolate = true;
    ladder.isolate_alone = parse_isolate_list(*isolate, "alone", "ladder: isolate", true, ladder);
    ladder.isolate_removed = parse_isolate_list(*isolate, "removed", "ladder: isolate", false, ladder);
  }
  if (const json* peer = json_find(value, "peer", context); peer && !peer->is_null())
    ladder.peer = parse_peer_info(*peer, "ladder: peer");
  if (const json* more = json_find(value, "more_peers", context); more && !more->is_null()) {
    MT_USER_CHECK(more->is_array(), "ladder: key \"more_peers\": expected an array, got {}",
                  json_value_description(*more));
    for (size_t k = 0; k < more->size(); ++k)
      ladder.more_peers.push_back(parse_peer_info((*more)[k], fmt::format("ladder: more_peers[{}]", k)));
    for (LadderRung& rung : ladder.rungs) {
      MT_USER_CHECK(rung.more_peers.size() <= ladder.more_peers.size(),
                    "ladder: rung \"{}\": {} entries in \"more_peers\", but the ladder names {} more peers",
                    rung.name, rung.more_peers.size(), ladder.more_peers.size());
      rung.more_peers.resize(ladder.more_peers.size());
    }
  }
  ladder.device_peak_flops = json_get_optional<double>(value, "device_peak_flops", context);
  ladder.device_peak_flops_source = json_get_or<std::string>(value, "device_peak_flops_source", "", context);
  ladder.mfu_definition = json_get_or<std::string>(value, "mfu_definition", "", context);
  ladder.measured_gemm_flops = json_get_optional<double>(value, "measured_gemm_flops", context);
  ladder.measured_gemm_definition = json_get_or<std::string>(value, "measured_gemm_definition", "", context);
  return ladder;
}

PeerComparison compare_with_peer(const LadderRung& rung) { return compare_with(rung, rung.peer); }

PeerComparison compare_with(const LadderRung& rung, const std::optional<LadderPeer>& peer_figures) {
  PeerComparison comparison;
  if (!peer_figures) return comparison;
  const LadderPeer& peer = *peer_figures;
  if (rung.measured && rung.tokens_per_second && peer.tokens_per_second && std::isfinite(*rung.tokens_per_second) &&
      std::isfinite(*peer.tokens_per_second) && *peer.tokens_per_second > 0) {
    comparison.tokens_per_second_ratio = *rung.tokens_per_second / *peer.tokens_per_second;
    comparison.beats_tokens_per_second = *rung.tokens_per_second > *peer.tokens_per_second;
  }
  // Both process-level (nvidia-smi): memtune's device peak against the peer's, never against
  // torch's reserved bytes, which leave out the CUDA context and so flatter the peer.
  if (rung.device_peak_bytes && peer.device_peak_bytes && *peer.device_peak_bytes > 0) {
    comparison.device_peak_ratio =
        static_cast<double>(*rung.device_peak_bytes) / static_cast<double>(*peer.device_peak_bytes);
    comparison.beats_device_peak = *rung.device_peak_bytes < *peer.device_peak_bytes;
  }
  return comparison;
}

std::string_view claim_verdict_name(ClaimVerdict verdict) {
  switch (verdict) {
    case ClaimVerdict::held: return "held";
    case ClaimVerdict::did_not_hold: return "did not hold";
    case ClaimVerdict::not_measured: return "not measured";
  }
  return "not measured";
}

// ---------------------------------------------------------------------------------------------
// Shared helpers: formatting, figures, technique lookup
// ---------------------------------------------------------------------------------------------
namespace {

int64_t signed_difference(uint64_t before, uint64_t after) {
  return static_cast<int64_t>(before) - static_cast<int64_t>(after);
}

// "24 GiB" rather than "24.00 GiB": for labels.
std::string compact_bytes(uint64_t bytes) {
  std::string text = format_bytes(bytes);
  const size_t space = text.find(' ');
  const size_t dot = text.find('.');
  if (space != std::string::npos && dot != std::string::npos && dot < space) {
    size_t end = space;
    while (end > dot + 1 && text[end - 1] == '0') --end;
    if (end == dot + 1) --end;
    text = text.substr(0, end) + text.substr(space);
  }
  return text;
}

// A saving: positive is less memory. "16.00 GiB", "-512.0 MiB" (an increase).
std::string saving_bytes_text(int64_t saving) {
  const uint64_t magnitude = saving < 0 ? static_cast<uint64_t>(-saving) : static_cast<uint64_t>(saving);
  std::string text = saving < 0 ? "-" : "";
  text += format_bytes(magnitude);
  return text;
}

std::string percent_text(double fraction) {
  if (!std::isfinite(fraction)) return "n/a";
  const double percent = fraction * 100;
  if (std::abs(percent) < 0.05) return "0%";
  if (std::abs(percent) < 1) return fmt::format("{:.1f}%", percent);
  return fmt::format("{:.0f}%", percent);
}

double fraction_of(int64_t part, uint64_t whole) {
  return whole == 0 ? std::numeric_limits<double>::quiet_NaN()
                    : static_cast<double>(part) / static_cast<double>(whole);
}

std::string saving_cell(int64_t saving, uint64_t reference) {
  return fmt::format("{} ({})", saving_bytes_text(saving), percent_text(fraction_of(saving, reference)));
}

std::string rate_text(double value) {
  if (!std::isfinite(value)) return "nan";
  return std::abs(value) >= 100 ? fmt::format("{:.0f}", value) : fmt::format("{:.2f}", value);
}

std::string loss_text(double loss) {
  if (std::isnan(loss)) return "nan";
  if (std::isinf(loss)) return loss > 0 ? "inf" : "-inf";
  return fmt::format("{:.4f}", loss);
}

template <typename T, typename F>
std::string optional_text(const std::optional<T>& value, F format, std::string_view missing = "-") {
  return value ? format(*value) : std::string(missing);
}

std::string fits_text(const LadderRung& rung) {
  if (!rung.measured) return "plan only";
  if (!rung.fits_budget) return "exceeds budget";
  return "yes";
}

std::string shape_text(const LadderRung& rung) {
  return fmt::format("{}x{}, {}", rung.micro_batch, rung.grad_accum, rung.seq);
}

// "gradient-checkpointing" and "Gradient Checkpointing" compare equal to "gradient_checkpointing".
std::string normalise(std::string_view text) {
  std::string out;
  for (char c : text) {
    const unsigned char u = static_cast<unsigned char>(c);
    out += (c == '-' || c == ' ') ? '_' : static_cast<char>(std::tolower(u));
  }
  return out;
}

// "bf16+nf4-base" uses bf16: a technique may combine several with '+'.
bool has_technique(const LadderRung& rung, std::string_view technique) {
  for (const std::string& t : rung.techniques) {
    const std::string normalised = normalise(t);
    for (size_t start = 0; start <= normalised.size();) {
      const size_t end = std::min(normalised.find('+', start), normalised.size());
      if (std::string_view(normalised).substr(start, end - start) == technique) return true;
      start = end + 1;
    }
  }
  return false;
}

bool any_technique_contains(const LadderRung& rung, std::initializer_list<std::string_view> keys) {
  for (const std::string& technique : rung.techniques) {
    const std::string t = normalise(technique);
    if (t.starts_with("no_")) continue;  // "no-checkpointing" does not use checkpointing
    for (std::string_view key : keys)
      if (t.find(key) != std::string::npos) return true;
  }
  return false;
}

bool added_contains(const LadderRung& rung, std::initializer_list<std::string_view> keys) {
  const std::string added = normalise(rung.added);
  for (std::string_view key : keys)
    if (added.find(key) != std::string::npos) return true;
  return false;
}

// The rung that adds a technique: by "added" first, else the first rung that uses it while the
// rung before it does not.
std::optional<size_t> rung_adding(const Ladder& ladder, std::initializer_list<std::string_view> keys) {
  for (size_t i = 0; i < ladder.rungs.size(); ++i)
    if (added_contains(ladder.rungs[i], keys)) return i;
  for (size_t i = 1; i < ladder.rungs.size(); ++i)
    if (any_technique_contains(ladder.rungs[i], keys) && !any_technique_contains(ladder.rungs[i - 1], keys))
      return i;
  return std::nullopt;
}

enum class PeakKind { device, engine, planned };

std::string_view peak_kind_name(PeakKind kind) {
  switch (kind) {
    case PeakKind::device: return "device peak";
    case PeakKind::engine: return "engine peak";
    case PeakKind::planned: return "planned peak";
  }
  return "planned peak";
}

uint64_t peak_of(const LadderRung& rung, PeakKind kind) {
  if (kind == PeakKind::device) return *rung.device_peak_bytes;
  if (kind == PeakKind::engine) return *rung.engine_peak_bytes;
  return rung.planned_peak_bytes;
}

// The most measured figure that every given rung has: comparisons use one kind throughout.
PeakKind common_peak_kind(const std::vector<const LadderRung*>& rungs) {
  const bool device = std::all_of(rungs.begin(), rungs.end(),
                                  [](const LadderRung* r) { return r->measured && r->device_peak_bytes.has_value(); });
  if (device) return PeakKind::device;
  const bool engine = std::all_of(rungs.begin(), rungs.end(),
                                  [](const LadderRung* r) { return r->measured && r->engine_peak_bytes.has_value(); });
  return engine ? PeakKind::engine : PeakKind::planned;
}

std::vector<const LadderRung*> all_rungs(const Ladder& ladder) {
  std::vector<const LadderRung*> out;
  for (const LadderRung& rung : ladder.rungs) out.push_back(&rung);
  return out;
}

uint64_t attention_bytes(const LadderRung& rung) {
  return rung.planned[static_cast<int>(MemCategory::attention_scratch)] +
         rung.planned[static_cast<int>(MemCategory::saved_activations)];
}

uint64_t sixteen_bit_part_bytes(const LadderRung& rung) {
  return rung.planned[static_cast<int>(MemCategory::frozen_weights)] +
         rung.planned[static_cast<int>(MemCategory::saved_activations)] +
         rung.planned[static_cast<int>(MemCategory::transient_activations)] +
         rung.planned[static_cast<int>(MemCategory::attention_scratch)];
}

std::string budget_text(const Ladder& ladder) {
  return ladder.budget_bytes == 0 ? std::string("no budget") : "budget " + compact_bytes(ladder.budget_bytes);
}

// A config value as text, trying the brief's names and the Hugging Face names in turn.
std::string config_text(const json& config, std::initializer_list<std::string_view> keys) {
  for (std::string_view key : keys) {
    const auto it = config.find(key);
    if (it == config.end()) continue;
    const json& value = *it;
    if (value.is_string()) return value.get<std::string>();
    if (value.is_array()) {
      std::string joined;
      for (const json& element : value) {
        if (!joined.empty()) joined += ", ";
        joined += element.is_string() ? element.get<std::string>() : element.dump();
      }
      return joined;
    }
    return value.dump(-1, ' ', false, json::error_handler_t::replace);
  }
  return "";
}

std::string config_or(const json& config, std::initializer_list<std::string_view> keys,
                      std::string fallback) {
  std::string text = config_text(config, keys);
  return text.empty() ? std::move(fallback) : text;
}

// Savings of every rung after the first against the rung before it, in one figure.
struct StepSaving {
  size_t index;
  int64_t saving;
  uint64_t before;
};

std::vector<StepSaving> step_savings(const Ladder& ladder, PeakKind kind) {
  std::vector<StepSaving> out;
  for (size_t i = ladder.baseline + 1; i < ladder.rungs.size(); ++i) {
    const uint64_t before = peak_of(ladder.rungs[i - 1], kind);
    out.push_back({i, signed_difference(before, peak_of(ladder.rungs[i], kind)), before});
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Claims
// ---------------------------------------------------------------------------------------------
namespace {

constexpr double kHalvesThreshold = 0.45;          // "halves": at least 45% less
constexpr double kCheckpointMinSaving = 0.30;      // "30-50% less"
constexpr double kCheckpointMaxSaving = 0.50;
constexpr double kCheckpointMaxSlowdown = 0.30;    // "~20% slower", with 10 points of slack
constexpr double kFlashMinAttentionSaving = 0.50;  // "large"
constexpr double kLossTolerance = 0.01;            // a loss 1% higher counts as worse
// Fewer steps than this show no instability by their nature: fp16 overflows and divergence
// take many updates to appear, so "none seen" from a short run is no evidence either way.
constexpr int64_t kMinStabilitySteps = 50;

// A percentage beside the threshold it is judged against: to one decimal near the threshold,
// where whole percents would print "50%" for a 49.6% that did not hold.
std::string verdict_percent_text(double fraction, double threshold) {
  if (std::isfinite(fraction) && std::abs(fraction - threshold) < 0.01) return fmt::format("{:.1f}%", fraction * 100);
  return percent_text(fraction);
}

LadderClaim claim_sixteen_bit(const Ladder& ladder) {
  LadderClaim claim{"16bit_halves", "16-bit (fp16/bf16) training halves memory", "", ClaimVerdict::not_measured};
  std::optional<size_t> fp32;
  for (size_t i = 0; i < ladder.rungs.size() && !fp32; ++i)
    if (has_technique(ladder.rungs[i], "fp32") || normalise(ladder.rungs[i].name).find("fp32") != std::string::npos)
      fp32 = i;
  if (!fp32) {
    claim.measured =
        "No fp32 rung on this run, so there is no 32-bit figure to compare with (add an fp32 rung to "
        "test it).";
    return claim;
  }
  // The 16-bit rung that differs least from the fp32 one.
  const LadderRung& reference = ladder.rungs[*fp32];
  std::optional<size_t> sixteen;
  size_t best_difference = std::numeric_limits<size_t>::max();
  for (size_t i = 0; i < ladder.rungs.size(); ++i) {
    const LadderRung& rung = ladder.rungs[i];
    if (i == *fp32 || !(has_technique(rung, "fp16") || has_technique(rung, "bf16"))) continue;
    size_t difference = 0;
    for (const std::string& t : rung.techniques)
      if (std::find(reference.techniques.begin(), reference.techniques.end(), t) == reference.techniques.end())
        ++difference;
    if (difference < best_difference) best_difference = difference, sixteen = i;
  }
  if (!sixteen) {
    claim.measured = fmt::format("The fp32 rung \"{}\" has no 16-bit rung to compare with.", reference.name);
    return claim;
  }
  const LadderRung& half = ladder.rungs[*sixteen];
  const PeakKind kind = common_peak_kind({&reference, &half});
  const uint64_t before = peak_of(reference, kind), after = peak_of(half, kind);
  const double reduction = fraction_of(signed_difference(before, after), before);
  const uint64_t parts_before = sixteen_bit_part_bytes(reference), parts_after = sixteen_bit_part_bytes(half);
  const double parts_reduction = fraction_of(signed_difference(parts_before, parts_after), parts_before);
  claim.verdict = reduction >= kHalvesThreshold ? ClaimVerdict::held : ClaimVerdict::did_not_hold;
  claim.measured = fmt::format(
      "\"{}\" {} -> \"{}\" {} ({}): {} less. The parts that change width (frozen weights and "
      "activations, plan) went {} -> {}, {} less; adapters, their gradients, optimizer state and the "
      "fp32 loss stay 32-bit. Held means at least {} less in total.",
      reference.name, format_bytes(before), half.name, format_bytes(after), peak_kind_name(kind),
      verdict_percent_text(reduction, kHalvesThreshold), format_bytes(parts_before), format_bytes(parts_after),
      percent_text(parts_reduction), percent_text(kHalvesThreshold));
  return claim;
}

LadderClaim claim_bf16_stable(const Ladder& ladder) {
  LadderClaim claim{"bf16_stable", "bf16 is more numerically stable than fp16", "", ClaimVerdict::not_measured};
  std::optional<size_t> fp16, bf16;
  for (size_t i = 0; i < ladder.rungs.size(); ++i) {
    if (!fp16 && has_technique(ladder.rungs[i], "fp16")) fp16 = i;
    if (normalise(ladder.rungs[i].added) == "bf16" && !bf16) bf16 = i;
  }
  if (!bf16)
    for (size_t i = 0; i < ladder.rungs.size() && !bf16; ++i)
      if (has_technique(ladder.rungs[i], "bf16")) bf16 = i;
  if (!fp16 || !bf16) {
    claim.measured = "This run has no fp16 and bf16 pair of rungs.";
    return claim;
  }
  const LadderRung& a = ladder.rungs[*fp16];
  const LadderRung& b = ladder.rungs[*bf16];
  if (!a.measured || !b.measured || !a.loss || !b.loss) {
    const LadderRung& missing = (!a.measured || !a.loss) ? a : b;
    claim.measured = fmt::format("\"{}\" was not trained on this device ({}), so there is no loss or "
                                 "loss-scaler record to compare.",
                                 missing.name, missing.measured ? "no loss recorded" : "plan only");
    return claim;
  }
  const int64_t skipped = a.loss_scaler && a.loss_scaler->skipped_steps ? *a.loss_scaler->skipped_steps : 0;
  const bool fp16_diverged = !std::isfinite(*a.loss) && std::isfinite(*b.loss);
  const bool fp16_worse = std::isfinite(*a.loss) && std::isfinite(*b.loss) &&
                          *a.loss > *b.loss * (1 + kLossTolerance);
  const std::string scale = a.loss_scaler && a.loss_scaler->final_scale
                                ? fmt::format(", final loss scale {:g}", *a.loss_scaler->final_scale)
                                : "";
  const std::string figures =
      fmt::format("fp16 (\"{}\") skipped {} step{}{} and ended at loss {}; bf16 (\"{}\") ended at loss {}.",
                  a.name, skipped, skipped == 1 ? "" : "s", scale, loss_text(*a.loss), b.name, loss_text(*b.loss));
  if (skipped > 0 || fp16_diverged || fp16_worse) {
    claim.verdict = ClaimVerdict::held;
    claim.measured = figures + (skipped > 0 ? " fp16 overflowed: the loss scaler threw those steps away."
                                            : " fp16's loss is worse.");
  } else if (const int64_t steps = ladder.config.contains("steps_per_rung") && ladder.config["steps_per_rung"].is_number_integer()
                                        ? ladder.config["steps_per_rung"].get<int64_t>()
                                        : 0;
             steps < kMinStabilitySteps) {
    claim.measured = figures + fmt::format(" No instability in {} step{} per rung, too few to judge (at least {}: "
                                           "--steps-per-rung {}).",
                                           steps, steps == 1 ? "" : "s", kMinStabilitySteps, kMinStabilitySteps);
  } else {
    claim.verdict = ClaimVerdict::did_not_hold;
    claim.measured = figures + " No instability was seen on this run (losses within " +
                     percent_text(kLossTolerance) + ", no skipped steps).";
  }
  return claim;
}

LadderClaim claim_checkpointing(const Ladder& ladder) {
  LadderClaim claim{"checkpointing", "Gradient checkpointing: 30-50% less VRAM at about 20% slower", "",
                    ClaimVerdict::not_measured};
  const std::optional<size_t> index = rung_adding(ladder, {"checkpoint"});
  if (!index || *index == 0) {
    claim.measured = "No rung adds gradient checkpointing on this run.";
    return claim;
  }
  const LadderRung& before = ladder.rungs[*index - 1];
  const LadderRung& after = ladder.rungs[*index];
  const PeakKind kind = common_peak_kind({&before, &after});
  const uint64_t peak_before = peak_of(before, kind), peak_after = peak_of(after, kind);
  const double saving = fraction_of(signed_difference(peak_before, peak_after), peak_before);
  const std::string memory = fmt::format("\"{}\" against \"{}\" ({}): {} -> {}, {} less", after.name, before.name,
                                         peak_kind_name(kind), format_bytes(peak_before),
                                         format_bytes(peak_after), verdict_percent_text(saving, kCheckpointMinSaving));
  if (kind == PeakKind::planned || !before.tokens_per_second || !after.tokens_per_second ||
      *before.tokens_per_second <= 0) {
    claim.measured = memory + "; the speed was not measured (" +
                     (before.measured ? after.name : before.name) + " is plan only or has no tokens/s).";
    return claim;
  }
  const double slowdown = 1 - *after.tokens_per_second / *before.tokens_per_second;
  const bool memory_holds = saving >= kCheckpointMinSaving;
  const bool speed_holds = slowdown <= kCheckpointMaxSlowdown;
  claim.verdict = memory_holds && speed_holds ? ClaimVerdict::held : ClaimVerdict::did_not_hold;
  // Compared at the precision printed, so that "50% less" never reads "more than 30-50%".
  const double printed = std::round(saving * 100) / 100;
  std::string memory_note = printed > kCheckpointMaxSaving ? " (more than the 30-50% claimed)"
                            : saving < kCheckpointMinSaving ? " (less than the 30% claimed: held needs at least 30%)" : "";
  claim.measured = fmt::format("{}{}; tokens/s {} -> {}, {} {}{}.", memory, memory_note,
                               rate_text(*before.tokens_per_second), rate_text(*after.tokens_per_second),
                               verdict_percent_text(std::abs(slowdown), kCheckpointMaxSlowdown), slowdown >= 0 ? "slower" : "faster",
                               speed_holds ? "" : " (more than the ~20% claimed: held allows at most 30%)");
  return claim;
}

LadderClaim claim_flash(const Ladder& ladder) {
  LadderClaim claim{"flash_linear", "Flash attention takes attention memory from O(n^2) to O(n)", "",
                    ClaimVerdict::not_measured};
  const std::optional<size_t> index = rung_adding(ladder, {"flash"});
  if (!index || *index == 0) {
    claim.measured = "No rung adds flash attention on this run. `memtune sweep` (peak memory and tokens/s "
                     "against max_seq_length, eager against flash) shows the growth.";
    return claim;
  }
  const LadderRung& eager = ladder.rungs[*index - 1];
  const LadderRung& flash = ladder.rungs[*index];
  const uint64_t eager_bytes = attention_bytes(eager), flash_bytes = attention_bytes(flash);
  const std::string sweep =
      fmt::format(" One ladder measures one sequence length ({}); `memtune sweep` plots peak memory and "
                  "tokens/s against max_seq_length for eager and flash, and that is where n^2 against n shows.",
                  flash.seq);
  if (eager_bytes == 0) {
    claim.measured = fmt::format("\"{}\" plans no attention scratch or saved activations.", eager.name) + sweep;
    return claim;
  }
  const double saving = fraction_of(signed_difference(eager_bytes, flash_bytes), eager_bytes);
  const PeakKind kind = common_peak_kind({&eager, &flash});
  claim.verdict = saving >= kFlashMinAttentionSaving ? ClaimVerdict::held : ClaimVerdict::did_not_hold;
  claim.measured = fmt::format(
      "Attention scratch + saved activations (plan), \"{}\" (eager) {} -> \"{}\" {}: {} less{}; "
      "whole {} {} -> {}.{}",
      eager.name, format_bytes(eager_bytes), flash.name, format_bytes(flash_bytes),
      verdict_percent_text(saving, kFlashMinAttentionSaving),
      saving >= kFlashMinAttentionSaving ? "" : " (held needs at least 50%)", peak_kind_name(kind),
      format_bytes(peak_of(eager, kind)), format_bytes(peak_of(flash, kind)), sweep);
  return claim;
}

LadderClaim claim_qlora(const Ladder& ladder) {
  LadderClaim claim{"qlora_biggest", "QLoRA is the biggest single win", "", ClaimVerdict::not_measured};
  const std::optional<size_t> index = rung_adding(ladder, {"qlora", "nf4", "4bit"});
  if (!index || *index == 0) {
    claim.measured = "No rung adds QLoRA on this run.";
    for (const auto& [name, reason] : ladder.unavailable)
      if (normalise(name).find("qlora") != std::string::npos)
        claim.measured = fmt::format("The {} rung was not run{}.", name, reason.empty() ? "" : ": " + reason);
    return claim;
  }
  const PeakKind kind = common_peak_kind(all_rungs(ladder));
  const std::vector<StepSaving> savings = step_savings(ladder, kind);
  const auto biggest = std::max_element(savings.begin(), savings.end(),
                                        [](const StepSaving& a, const StepSaving& b) { return a.saving < b.saving; });
  const auto qlora = std::find_if(savings.begin(), savings.end(),
                                  [&](const StepSaving& s) { return s.index == *index; });
  if (qlora == savings.end() || biggest == savings.end()) {
    claim.measured = "The QLoRA rung is the baseline, so it has no saving of its own.";
    return claim;
  }
  const std::string figure = kind == PeakKind::planned ? "planned peak: not every rung was measured" : std::string(peak_kind_name(kind));
  const std::string own = fmt::format("\"{}\" saved {} ({}) against \"{}\" ({})", ladder.rungs[qlora->index].name,
                                      saving_bytes_text(qlora->saving), percent_text(fraction_of(qlora->saving, qlora->before)),
                                      ladder.rungs[qlora->index - 1].name, figure);
  if (qlora->saving >= biggest->saving) {
    claim.verdict = ClaimVerdict::held;
    claim.measured = own + fmt::format(", the largest of the {} rungs' savings.", savings.size());
  } else {
    claim.verdict = ClaimVerdict::did_not_hold;
    claim.measured = own + fmt::format("; the biggest single saving was \"{}\": {} ({}).",
                                       ladder.rungs[biggest->index].name, saving_bytes_text(biggest->saving),
                                       percent_text(fraction_of(biggest->saving, biggest->before)));
  }
  return claim;
}

LadderClaim claim_order(const Ladder& ladder) {
  LadderClaim claim{"order_of_impact", "The checklist's order is the order of impact (biggest saving first)", "",
                    ClaimVerdict::not_measured};
  const PeakKind kind = common_peak_kind(all_rungs(ladder));
  const std::vector<StepSaving> savings = step_savings(ladder, kind);
  if (savings.size() < 2) {
    claim.measured = "Fewer than two rungs after the baseline: nothing to rank.";
    return claim;
  }
  std::vector<StepSaving> ranked = savings;
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const StepSaving& a, const StepSaving& b) { return a.saving > b.saving; });
  bool same = true;
  for (size_t i = 0; i + 1 < savings.size(); ++i) same = same && savings[i].saving >= savings[i + 1].saving;
  std::string ladder_order, by_saving;
  for (const StepSaving& s : savings) ladder_order += (ladder_order.empty() ? "" : ", ") + ladder.rungs[s.index].name;
  for (const StepSaving& s : ranked)
    by_saving += (by_saving.empty() ? "" : ", ") +
                 fmt::format("{} ({})", ladder.rungs[s.index].name, saving_bytes_text(s.saving));
  const std::string seed = config_text(ladder.config, {"order"});
  claim.verdict = same ? ClaimVerdict::held : ClaimVerdict::did_not_hold;
  claim.measured = fmt::format(
      "Checklist (seed) order: {}{}. Ranked by saving against the rung before ({}): {}. Each saving is "
      "taken after the rungs before it, so a trick placed later has less left to save.",
      ladder_order, seed.empty() ? "" : fmt::format(" (config order: {})", seed), peak_kind_name(kind), by_saving);
  return claim;
}

std::vector<LadderClaim> claims_of(const Ladder& ladder) {
  return {claim_sixteen_bit(ladder), claim_bf16_stable(ladder), claim_checkpointing(ladder),
          claim_flash(ladder),       claim_qlora(ladder),       claim_order(ladder)};
}

}  // namespace

std::vector<LadderClaim> ladder_claims(const json& ladder) { return claims_of(parse_ladder_json(ladder)); }

// ---------------------------------------------------------------------------------------------
// Table rows (terminal and markdown share the cells)
// ---------------------------------------------------------------------------------------------
namespace {

bool any_peer(const Ladder& ladder) {
  return std::any_of(ladder.rungs.begin(), ladder.rungs.end(), [](const LadderRung& r) { return r.peer.has_value(); });
}

// ---- several peers (attach_peers): peer 0 is "peer", peer k >= 1 is more_peers[k - 1] ----
const LadderPeerInfo* peer_info(const Ladder& ladder, size_t k) {
  if (k == 0) return ladder.peer ? &*ladder.peer : nullptr;
  return &ladder.more_peers[k - 1];
}

std::string peer_label(const Ladder& ladder, size_t k) {
  const LadderPeerInfo* info = peer_info(ladder, k);
  if (info && !info->tool.empty()) return info->tool;
  return k == 0 ? std::string("peer") : fmt::format("peer {}", k + 1);
}

const std::optional<LadderPeer>& peer_of(const LadderRung& rung, size_t k) {
  return k == 0 ? rung.peer : rung.more_peers[k - 1];
}
// ---- end several peers ----

std::string mfu_text(double mfu) { return std::isfinite(mfu) ? fmt::format("{:.1f}%", mfu * 100) : "n/a"; }

std::string ratio_text(const std::optional<double>& ratio, const std::optional<bool>& beats, std::string_view better,
                       std::string_view worse) {
  if (!ratio) return "-";
  return fmt::format("{:.2f}x {}", *ratio, beats.value_or(false) ? better : worse);
}

const std::vector<std::string>& result_headers() {
  static const std::vector<std::string> headers = {
      "rung", "batch", "planned peak", "engine peak", "device peak", "fits", "tokens/s", "MFU",
      "step s", "loss", "saving vs previous", "saving vs baseline"};
  return headers;
}

// The terminal's extra columns when a peer is attached: memtune/peer ratios, the verdict in words.
const std::vector<std::string>& peer_headers() {
  static const std::vector<std::string> headers = {"peer tokens/s", "peer device peak", "tokens/s vs peer",
                                                   "device peak vs peer"};
  return headers;
}

std::vector<std::string> peer_cells(const LadderRung& r) {
  if (!r.peer) return {"-", "-", "-", "-"};
  const PeerComparison c = compare_with_peer(r);
  const bool failed = r.peer->measured.has_value() && !*r.peer->measured;
  return {failed ? std::string("failed") : optional_text(r.peer->tokens_per_second, rate_text),
          failed ? std::string("failed") : optional_text(r.peer->device_peak_bytes, [](uint64_t b) { return format_bytes(b); }),
          ratio_text(c.tokens_per_second_ratio, c.beats_tokens_per_second, "faster", "slower"),
          ratio_text(c.device_peak_ratio, c.beats_device_peak, "smaller", "larger")};
}

std::vector<std::vector<std::string>> result_rows(const Ladder& ladder) {
  std::vector<std::vector<std::string>> rows;
  const uint64_t baseline_peak = ladder.rungs[ladder.baseline].planned_peak_bytes;
  for (size_t i = 0; i < ladder.rungs.size(); ++i) {
    const LadderRung& r = ladder.rungs[i];
    const auto bytes = [](uint64_t b) { return format_bytes(b); };
    std::vector<std::string> row;
    row.push_back(r.name);
    row.push_back(shape_text(r));
    row.push_back(format_bytes(r.planned_peak_bytes));
    row.push_back(optional_text(r.engine_peak_bytes, bytes));
    row.push_back(optional_text(r.device_peak_bytes, bytes));
    row.push_back(fits_text(r));
    row.push_back(optional_text(r.tokens_per_second, rate_text));
    row.push_back(optional_text(r.mfu, mfu_text));
    row.push_back(optional_text(r.step_seconds, [](double s) {
      return s >= 1 || s <= 0 ? fmt::format("{:.2f}", s) : fmt::format("{:.3g}", s);
    }));
    row.push_back(optional_text(r.loss, loss_text));
    if (i == 0) {
      row.push_back("-");
    } else {
      const uint64_t previous = ladder.rungs[i - 1].planned_peak_bytes;
      row.push_back(saving_cell(signed_difference(previous, r.planned_peak_bytes), previous));
    }
    row.push_back(i == ladder.baseline ? "baseline"
                                       : saving_cell(signed_difference(baseline_peak, r.planned_peak_bytes), baseline_peak));
    rows.push_back(std::move(row));
  }
  return rows;
}

std::string markdown_cell(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += "\\|";
    else if (c == '\n' || c == '\r') out += ' ';
    else out += c;
  }
  return out;
}

std::string markdown_table(const std::vector<std::string>& headers,
                           const std::vector<std::vector<std::string>>& rows,
                           const std::vector<bool>& right_aligned) {
  std::string out = "|";
  for (const std::string& h : headers) {
    out += ' ';
    out += markdown_cell(h);
    out += " |";
  }
  out += "\n|";
  for (size_t c = 0; c < headers.size(); ++c)
    out += (c < right_aligned.size() && right_aligned[c]) ? "---:|" : "---|";
  out += "\n";
  for (const auto& row : rows) {
    out += "|";
    for (const std::string& cell : row) {
      out += ' ';
      out += markdown_cell(cell);
      out += " |";
    }
    out += "\n";
  }
  return out;
}

std::string run_summary_line(const Ladder& ladder) {
  return fmt::format("{} on {}, {}{}", ladder.model, ladder.device, budget_text(ladder),
                     ladder.device_context_bytes > 0
                         ? fmt::format(" (device context {} counts against it)", format_bytes(ladder.device_context_bytes))
                         : "");
}

// report.md's section for several peers: each peer's figures beside memtune's, with the ratio.
std::string every_peer_markdown(const Ladder& ladder) {
  const size_t count = 1 + ladder.more_peers.size();
  std::string md = "## Against every peer\n\n";
  md += "The same rungs run by each peer, matched by the trick each rung adds. Each cell holds the peer's figure and, "
        "in brackets, memtune / peer: tokens/s above 1x means memtune is faster; device peak below 1x means "
        "memtune takes less device memory (both process-level, as nvidia-smi shows, the CUDA context included).\n\n";
  for (size_t k = 0; k < count; ++k) {
    const LadderPeerInfo* info = peer_info(ladder, k);
    if (!info) {
      md += fmt::format("- **{}**: no peer record\n", peer_label(ladder, k));
      continue;
    }
    md += fmt::format("- **{}**: {} on {}, {}{}{}\n", peer_label(ladder, k), info->versions, info->device, info->date,
                      info->source.empty() ? "" : " (" + info->source + ")",
                      info->device != ladder.device ? " **(not the device memtune ran on)**" : "");
  }
  md += "\n";
  std::vector<std::string> headers = {"rung", "memtune tokens/s", "memtune device peak"};
  std::vector<bool> right = {false, true, true};
  for (size_t k = 0; k < count; ++k) {
    headers.push_back(peer_label(ladder, k) + " tokens/s (memtune x)");
    headers.push_back(peer_label(ladder, k) + " device peak (memtune x)");
    right.insert(right.end(), {true, true});
  }
  const auto bytes = [](uint64_t b) { return format_bytes(b); };
  std::vector<size_t> faster(count), compared_speed(count), smaller(count), compared_memory(count);
  std::vector<std::vector<std::string>> rows;
  for (const LadderRung& r : ladder.rungs) {
    std::vector<std::string> row = {r.name, optional_text(r.tokens_per_second, rate_text),
                                    optional_text(r.device_peak_bytes, bytes)};
    for (size_t k = 0; k < count; ++k) {
      const std::optional<LadderPeer>& p = peer_of(r, k);
      if (!p) {
        row.insert(row.end(), {"-", "-"});
        continue;
      }
      if (p->measured.has_value() && !*p->measured) {
        const std::string why = p->error.empty() ? std::string("did not run") : p->error;
        row.insert(row.end(), {why, "-"});
        continue;
      }
      const PeerComparison c = compare_with(r, p);
      compared_speed[k] += c.beats_tokens_per_second.has_value();
      faster[k] += c.beats_tokens_per_second.value_or(false);
      compared_memory[k] += c.beats_device_peak.has_value();
      smaller[k] += c.beats_device_peak.value_or(false);
      const auto with_ratio = [](std::string text, const std::optional<double>& ratio) {
        return ratio ? fmt::format("{} ({:.2f}x)", text, *ratio) : text;
      };
      row.push_back(with_ratio(optional_text(p->tokens_per_second, rate_text), c.tokens_per_second_ratio));
      row.push_back(with_ratio(optional_text(p->device_peak_bytes, bytes), c.device_peak_ratio));
    }
    rows.push_back(std::move(row));
  }
  md += markdown_table(headers, rows, right);
  md += "\n";
  for (size_t k = 0; k < count; ++k) {
    md += fmt::format("- memtune against {}: faster on {} of {} rungs where both speeds were measured, smaller on {} "
                      "of {} where both device peaks were.",
                      peer_label(ladder, k), faster[k], compared_speed[k], smaller[k], compared_memory[k]);
    const LadderPeerInfo* info = peer_info(ladder, k);
    if (info && !info->unmatched.empty())
      md += fmt::format(" Its rungs with no memtune rung of the same \"added\": {}.", fmt::join(info->unmatched, "; "));
    md += "\n";
  }
  md += "\n";
  return md;
}

}  // namespace

std::string ladder_terminal_table(const json& value) {
  const Ladder ladder = parse_ladder_json(value);
  std::vector<std::string> headers = result_headers();
  std::vector<std::vector<std::string>> rows = result_rows(ladder);
  const bool with_peer = any_peer(ladder);
  if (with_peer) {
    headers.insert(headers.end(), peer_headers().begin(), peer_headers().end());
    for (size_t i = 0; i < rows.size(); ++i) {
      const std::vector<std::string> cells = peer_cells(ladder.rungs[i]);
      rows[i].insert(rows[i].end(), cells.begin(), cells.end());
    }
  }
  for (size_t k = 1; k <= ladder.more_peers.size(); ++k) {  // several peers: two ratio columns each
    headers.push_back("tokens/s vs " + peer_label(ladder, k));
    headers.push_back("device peak vs " + peer_label(ladder, k));
    for (size_t i = 0; i < rows.size(); ++i) {
      const PeerComparison c = compare_with(ladder.rungs[i], peer_of(ladder.rungs[i], k));
      rows[i].push_back(ratio_text(c.tokens_per_second_ratio, c.beats_tokens_per_second, "faster", "slower"));
      rows[i].push_back(ratio_text(c.device_peak_ratio, c.beats_device_peak, "smaller", "larger"));
    }
  }
  std::vector<size_t> widths(headers.size());
  for (size_t c = 0; c < headers.size(); ++c) {
    widths[c] = headers[c].size();
    for (const auto& row : rows) widths[c] = std::max(widths[c], row[c].size());
  }
  const auto emit = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (size_t c = 0; c < cells.size(); ++c) {
      if (c > 0) line += "  ";
      // Names, batch shape and the fits word read left to right; numbers line up on the right.
      const bool left = c == 0 || c == 1 || c == 5;
      line += left ? fmt::format("{:<{}}", cells[c], widths[c]) : fmt::format("{:>{}}", cells[c], widths[c]);
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    return line + "\n";
  };
  std::string out = "memtune memory ladder: " + run_summary_line(ladder) + "\n";
  out += emit(headers);
  std::vector<std::string> rule;
  for (size_t w : widths) rule.push_back(std::string(w, '-'));
  out += emit(rule);
  for (const auto& row : rows) out += emit(row);
  out += "planned = the plan's arena peak; engine = measured peak of memtune's arenas; device = process\n"
         "device memory (nvidia-smi), context included. Savings are differences of planned peaks.\n";
  out += ladder.device_peak_flops
             ? fmt::format("MFU = model FLOPs/s over the {:.0f} TFLOP/s dense 16-bit peak of this device.\n",
                           *ladder.device_peak_flops / 1e12)
             : std::string("MFU: none (no GPU, or a device without a known peak).\n");
  if (with_peer)
    out += fmt::format("peer = {}: its device peak is process-level too, so the columns compare like with like;\n"
                       "x = memtune / peer.\n",
                       ladder.peer ? ladder.peer->versions : std::string("transformers + PEFT"));
  for (size_t k = 1; k <= ladder.more_peers.size(); ++k)
    out += fmt::format("{} = {}.\n", peer_label(ladder, k), ladder.more_peers[k - 1].versions);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Markdown
// ---------------------------------------------------------------------------------------------
std::string ladder_markdown(const json& value) {
  const Ladder ladder = parse_ladder_json(value);
  const LadderRung& first = ladder.rungs[ladder.baseline];
  const json& config = ladder.config;
  std::string md;
  md += fmt::format("# Memory ladder: {}\n\n", ladder.model);
  md += fmt::format("{} rungs on {}; commit {}, {}. Each rung adds one memory technique to the one before it.\n\n",
                    ladder.rungs.size(), ladder.device, ladder.commit, ladder.date);
  md += "![Planned memory by category for each rung, with measured peaks and the budget](ladder.svg)\n\n";

  // Configuration.
  md += "## Configuration\n\n";
  const std::string mb = config_or(config, {"micro_batch", "per_device_train_batch_size"}, std::to_string(first.micro_batch));
  const std::string ga = config_or(config, {"grad_accum", "gradient_accumulation_steps"}, std::to_string(first.grad_accum));
  std::string effective = "";
  try {
    effective = std::to_string(std::stoll(mb) * std::stoll(ga));
  } catch (const std::exception&) {
    effective = "n/a";
  }
  std::vector<std::vector<std::string>> settings = {
      {"model", ladder.model},
      {"max_seq_length", config_or(config, {"seq", "max_seq_length"}, std::to_string(first.seq))},
      {"micro-batch (per_device_train_batch_size)", mb},
      {"gradient accumulation (gradient_accumulation_steps)", ga},
      {"sequences per optimizer step", effective},
      {"LoRA rank (lora_r)", config_or(config, {"lora_r", "r"}, "not recorded")},
      {"LoRA alpha", config_or(config, {"lora_alpha"}, "not recorded")},
      {"LoRA targets", config_or(config, {"lora_targets", "lora_target_modules"}, "not recorded")},
      {"steps per rung", config_or(config, {"steps_per_rung", "steps", "max_steps"}, "not recorded")},
      {"VRAM budget", ladder.budget_bytes == 0 ? std::string("none") : compact_bytes(ladder.budget_bytes)},
      {"rung order", config_or(config, {"order"}, "as listed")},
      {"device", ladder.device},
      {"device context (CUDA context + library handles, before the first rung)",
       ladder.device_context_bytes > 0 ? format_bytes(ladder.device_context_bytes) : "0 (none)"},
      {"commit", ladder.commit},
      {"date", ladder.date},
  };
  md += markdown_table({"setting", "value"}, settings, {});
  md += "\nThe configuration in full, as the runner recorded it (everything needed to rerun):\n\n```json\n";
  md += config.dump(2, ' ', false, json::error_handler_t::replace);
  md += "\n```\n\n";

  md += "## Which memory figure is which\n\n";
  md += "**Planned** is the plan's arena peak: the training step run once on the meta backend, every buffer laid "
        "out, before anything is allocated. **Engine** is the measured peak of memtune's own arenas during "
        "training; because the engine allocates exactly what the plan lays out, it equals the plan. "
        "**Device** is process-level device memory as nvidia-smi shows it: the arenas plus the CUDA context "
        "and library handles";
  md += ladder.device_context_bytes > 0
            ? fmt::format(" ({} on this device, measured before the first rung)", format_bytes(ladder.device_context_bytes))
            : " (none here: this run had no GPU, so there is no device figure)";
  if (ladder.budget_bytes > 0)
    md += fmt::format(". A rung fits the budget when planned + context <= {}", compact_bytes(ladder.budget_bytes));
  md += ". \"plan only\" marks a rung that does not fit this device, so it was reported from the plan and not run. "
        "Savings in the tables are differences of planned peaks, which every rung has.\n\n";

  md += "## Results\n\n";
  md += markdown_table(result_headers(), result_rows(ladder),
                       {false, false, true, true, true, false, true, true, true, true, true, true});
  md += "\n";
  if (ladder.device_peak_flops) {
    md += fmt::format("**MFU** (model FLOPs utilisation) = model FLOPs per token x tokens/s / {:.1f} TFLOP/s, the "
                      "dense bf16/fp16 tensor-core peak of this device ({}). ",
                      *ladder.device_peak_flops / 1e12,
                      ladder.device_peak_flops_source.empty() ? "source not recorded" : ladder.device_peak_flops_source);
  } else {
    md += "**MFU** is not given: this run had no GPU, or the device has no known peak. ";
  }
  md += ladder.mfu_definition.empty()
            ? std::string("Model FLOPs count the forward and backward of every matmul once (no checkpointing "
                          "recompute).\n")
            : ladder.mfu_definition + "\n";
  md += "\n";
  if (ladder.measured_gemm_flops && ladder.device_peak_flops && *ladder.measured_gemm_flops > 0) {
    // The same model FLOPs against what the GEMMs reach here rather than the datasheet peak.
    md += fmt::format("**Against the measured GEMM rate**: {:.1f} TFLOP/s ({}). The same model FLOPs as a share "
                      "of it:\n\n",
                      *ladder.measured_gemm_flops / 1e12,
                      ladder.measured_gemm_definition.empty() ? "definition not recorded" : ladder.measured_gemm_definition);
    std::vector<std::vector<std::string>> rows;
    for (const LadderRung& r : ladder.rungs)
      if (r.mfu && std::isfinite(*r.mfu))
        rows.push_back({r.name, mfu_text(*r.mfu),
                        mfu_text(*r.mfu * *ladder.device_peak_flops / *ladder.measured_gemm_flops)});
    md += markdown_table({"rung", "MFU (peak)", "share of measured GEMM rate"}, rows, {false, true, true});
    md += "\n";
  }

  if (!ladder.unavailable.empty()) {
    md += "Rungs that this run could not do at all:\n\n";
    for (const auto& [name, reason] : ladder.unavailable)
      md += fmt::format("- {}{}\n", name, reason.empty() ? "" : ": " + reason);
    md += "\n";
  }

  md += "## Memory by category (planned, at the peak)\n\n";
  {
    std::vector<std::string> headers = {"rung"};
    for (int c = 0; c < kNumMemCategories; ++c) headers.emplace_back(category_label(category_at(c)));
    headers.emplace_back("planned peak");
    std::vector<std::vector<std::string>> rows;
    for (const LadderRung& r : ladder.rungs) {
      std::vector<std::string> row = {r.name};
      for (int c = 0; c < kNumMemCategories; ++c) row.push_back(r.planned[c] == 0 ? "0" : format_bytes(r.planned[c]));
      row.push_back(format_bytes(r.planned_peak_bytes));
      rows.push_back(std::move(row));
    }
    std::vector<bool> right(headers.size(), true);
    right[0] = false;
    md += markdown_table(headers, rows, right);
    md += "\nThe categories are the live bytes at the moment of the peak; the planned peak is the arena size, "
          "which can exceed their sum by the gaps between buffers.\n\n";
  }

  md += "## fp16 loss scaler\n\n";
  {
    bool any = false;
    const std::string steps = config_text(config, {"steps_per_rung", "steps", "max_steps"});
    for (const LadderRung& r : ladder.rungs) {
      if (!r.loss_scaler && !has_technique(r, "fp16")) continue;
      any = true;
      if (!r.measured) {
        md += fmt::format("- \"{}\": not measured (plan only: the rung does not fit this device).\n", r.name);
      } else if (!r.loss_scaler || !r.loss_scaler->skipped_steps) {
        md += fmt::format("- \"{}\": the run recorded no loss-scaler figures.\n", r.name);
      } else {
        md += fmt::format("- \"{}\": {} skipped step{}{} (overflowed gradients, update thrown away); final scale {}.\n",
                          r.name, *r.loss_scaler->skipped_steps, *r.loss_scaler->skipped_steps == 1 ? "" : "s",
                          steps.empty() ? "" : " of " + steps,
                          r.loss_scaler->final_scale ? fmt::format("{:g}", *r.loss_scaler->final_scale)
                                                     : std::string("not recorded"));
      }
    }
    if (!any) md += "No fp16 rung on this run.\n";
    md += "\n";
  }

  if (any_peer(ladder)) {
    md += "## Against Hugging Face (peer)\n\n";
    if (ladder.peer) {
      md += fmt::format("The peer is the same ladder run with {} on {}, {}{}.", ladder.peer->versions,
                        ladder.peer->device, ladder.peer->date,
                        ladder.peer->source.empty() ? "" : " (" + ladder.peer->source + ")");
      if (ladder.peer->device != ladder.device)
        md += fmt::format(" **The peer ran on \"{}\" and memtune on \"{}\": the figures are not from the same device.**",
                          ladder.peer->device, ladder.device);
      md += "\n\n";
    } else {
      md += "The peer is the same rung run with transformers + PEFT (+ bitsandbytes).\n\n";
    }
    md += "What is compared with what: memtune's **device peak** with the peer's **device_peak_bytes**; both are "
          "process-level device memory as nvidia-smi shows it, the CUDA context and library handles included, so "
          "neither side is flattered. torch's peak reserved (the caching allocator's pool, without the context) "
          "is shown for reference only. Speed: memtune's tokens/s with the peer's tokens_per_second, on the same "
          "rung (same shape, matched by the trick it adds). The ratios are memtune / peer: tokens/s above 1x means "
          "memtune is faster; device peak below 1x means memtune takes less memory. \"beats\" is **yes** where "
          "memtune is faster, or smaller.\n\n";
    std::vector<std::vector<std::string>> rows;
    size_t faster = 0, compared_speed = 0, smaller = 0, compared_memory = 0;
    std::vector<std::string> without_peer;
    const auto bytes = [](uint64_t b) { return format_bytes(b); };
    const auto verdict = [](const std::optional<bool>& beats) {
      return beats ? std::string(*beats ? "**yes**" : "no") : std::string("-");
    };
    for (const LadderRung& r : ladder.rungs) {
      if (!r.peer) {
        without_peer.push_back(r.name);
        continue;
      }
      const PeerComparison c = compare_with_peer(r);
      compared_speed += c.beats_tokens_per_second.has_value();
      faster += c.beats_tokens_per_second.value_or(false);
      compared_memory += c.beats_device_peak.has_value();
      smaller += c.beats_device_peak.value_or(false);
      std::string status = r.peer->measured.value_or(true) ? "measured" : "did not run";
      if (!r.peer->error.empty()) status += ": " + r.peer->error;
      const auto ratio = [](const std::optional<double>& v) { return v ? fmt::format("{:.2f}x", *v) : std::string("-"); };
      rows.push_back({r.name, optional_text(r.tokens_per_second, rate_text),
                      optional_text(r.peer->tokens_per_second, rate_text), ratio(c.tokens_per_second_ratio),
                      verdict(c.beats_tokens_per_second), optional_text(r.device_peak_bytes, bytes),
                      optional_text(r.peer->device_peak_bytes, bytes), ratio(c.device_peak_ratio),
                      verdict(c.beats_device_peak), optional_text(r.peer->peak_reserved_bytes, bytes), status});
    }
    md += markdown_table({"rung", "memtune tokens/s", "peer tokens/s", "tokens/s memtune/peer", "beats on tokens/s",
                          "memtune device peak", "peer device peak", "device peak memtune/peer", "beats on device peak",
                          "peer torch peak reserved", "peer"},
                         rows, {false, true, true, true, false, true, true, true, false, true, false});
    md += fmt::format("\nmemtune is faster on {} of {} rungs where both speeds were measured, and takes less device "
                      "memory on {} of {} rungs where both device peaks were measured.",
                      faster, compared_speed, smaller, compared_memory);
    if (compared_memory == 0)
      md += " (No device-peak comparison: one side has no process-level figure, e.g. a CPU run or a peer file "
            "without device_peak_bytes.)";
    md += "\n";
    if (!without_peer.empty())
      md += fmt::format("\nNo peer figure for: {}.\n", fmt::join(without_peer, "; "));
    if (ladder.peer && !ladder.peer->unmatched.empty())
      md += fmt::format("\nPeer rungs with no memtune rung of the same \"added\": {}.\n",
                        fmt::join(ladder.peer->unmatched, "; "));
    md += "\n";
  }

  if (!ladder.more_peers.empty()) md += every_peer_markdown(ladder);

  md += "## Claims\n\n";
  md += "Each claim from the usual advice beside what this run measured. The verdicts are computed from the "
        "numbers above: **held**, **did not hold**, or **not measured** on this run.\n\n";
  {
    std::vector<std::vector<std::string>> rows;
    const std::vector<LadderClaim> claims = claims_of(ladder);
    for (size_t i = 0; i < claims.size(); ++i)
      rows.push_back({fmt::format("{}", static_cast<char>('a' + i)), claims[i].claim, claims[i].measured,
                      fmt::format("**{}**", claim_verdict_name(claims[i].verdict))});
    md += markdown_table({"", "claim", "what this run measured", "verdict"}, rows, {});
    md += "\n";
  }

  if (ladder.has_isolate) {
    md += "## Isolating each trick\n\n";
    md += "The ladder above adds each trick after the ones before it, so a trick's saving there depends on its place "
          "in the order. Here each trick is taken on its own: added alone to the baseline, and removed alone from the "
          "full stack. Savings are differences of planned peaks (every entry has one); device peak and tokens/s are "
          "measured where the entry ran.\n\n";
    const auto bytes = [](uint64_t b) { return format_bytes(b); };
    const LadderRung& base = ladder.rungs[ladder.baseline];
    const LadderRung& full = ladder.rungs.back();
    if (!ladder.isolate_alone.empty()) {
      md += fmt::format("Each trick alone, added to \"{}\" ({} planned):\n\n", base.name,
                        format_bytes(base.planned_peak_bytes));
      std::vector<std::vector<std::string>> rows;
      for (const LadderIsolateEntry& e : ladder.isolate_alone)
        rows.push_back({e.name, format_bytes(e.planned_peak_bytes), optional_text(e.device_peak_bytes, bytes, "-"),
                        optional_text(e.tokens_per_second, rate_text), saving_cell(e.saving_bytes, base.planned_peak_bytes)});
      md += markdown_table({"trick", "planned peak", "device peak", "tokens/s", "saving vs baseline"}, rows,
                           {false, true, true, true, true});
      const auto most = std::max_element(ladder.isolate_alone.begin(), ladder.isolate_alone.end(),
                                         [](const auto& a, const auto& b) { return a.saving_bytes < b.saving_bytes; });
      md += fmt::format("\nMatters most alone: **{}**, saving {} ({} of the baseline).\n\n", most->name,
                        saving_bytes_text(most->saving_bytes),
                        percent_text(fraction_of(most->saving_bytes, base.planned_peak_bytes)));
    }
    if (!ladder.isolate_removed.empty()) {
      md += fmt::format("Each trick removed from the full stack, \"{}\" ({} planned):\n\n", full.name,
                        format_bytes(full.planned_peak_bytes));
      std::vector<std::vector<std::string>> rows;
      for (const LadderIsolateEntry& e : ladder.isolate_removed)
        rows.push_back({e.name, format_bytes(e.planned_peak_bytes), optional_text(e.device_peak_bytes, bytes, "-"),
                        optional_text(e.tokens_per_second, rate_text), saving_cell(e.saving_bytes, full.planned_peak_bytes)});
      md += markdown_table({"trick removed", "planned peak without it", "device peak", "tokens/s", "cost of removing it"},
                           rows, {false, true, true, true, true});
      const auto most = std::max_element(ladder.isolate_removed.begin(), ladder.isolate_removed.end(),
                                         [](const auto& a, const auto& b) { return a.saving_bytes < b.saving_bytes; });
      md += fmt::format("\nRemoval that hurts most: **{}**, adding {} ({} more than the full stack).\n\n", most->name,
                        saving_bytes_text(most->saving_bytes),
                        percent_text(fraction_of(most->saving_bytes, full.planned_peak_bytes)));
    }
    if (ladder.isolate_alone.empty() && ladder.isolate_removed.empty()) md += "The isolate run recorded no entries.\n\n";
  }
  return md;
}

// ---------------------------------------------------------------------------------------------
// CSV
// ---------------------------------------------------------------------------------------------
namespace {

std::string csv_field(std::string_view text) {
  if (text.find_first_of(",\"\r\n") == std::string_view::npos) return std::string(text);
  std::string out = "\"";
  for (char c : text) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

std::string csv_double(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return fmt::format("{}", value);
}

std::string csv_scalar(const json& value) {
  if (value.is_null()) return "";
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "true" : "false";
  if (value.is_number_float()) return csv_double(value.get<double>());
  return value.dump();
}

}  // namespace

std::string ladder_csv(const json& value) {
  const Ladder ladder = parse_ladder_json(value);
  // Top-level scalar fields of the rungs that this module does not know yet, so that a field the
  // runner adds later still reaches the CSV.
  static const std::set<std::string> kKnown = {
      "name", "techniques", "added", "planned", "planned_peak_bytes", "engine_peak_bytes", "device_peak_bytes",
      "fits_budget", "fits_device", "measured", "step_seconds", "tokens_per_second", "loss", "loss_scaler",
      "micro_batch", "grad_accum", "seq", "peer", "mfu", "model_flops_per_token", "more_peers"};
  std::set<std::string> extra;
  for (const json& rung : value.at("rungs"))
    for (const auto& [key, field] : rung.items())
      if (!kKnown.contains(key) && !field.is_object() && !field.is_array()) extra.insert(key);

  std::vector<std::string> header = {
      "index", "name", "added", "techniques", "micro_batch", "grad_accum", "seq", "planned_peak_bytes",
      "engine_peak_bytes", "device_peak_bytes", "fits_budget", "fits_device", "measured", "step_seconds",
      "tokens_per_second", "mfu", "model_flops_per_token", "loss", "loss_scaler_skipped_steps",
      "loss_scaler_final_scale", "peer_measured", "peer_error", "peer_tokens_per_second", "peer_step_seconds",
      "peer_loss", "peer_peak_allocated_bytes", "peer_peak_reserved_bytes", "peer_device_peak_bytes",
      "peer_context_bytes", "tokens_per_second_vs_peer", "device_peak_vs_peer", "beats_peer_tokens_per_second",
      "beats_peer_device_peak", "saving_vs_previous_bytes", "saving_vs_baseline_bytes"};
  for (int c = 0; c < kNumMemCategories; ++c) header.push_back("planned_" + std::string(category_name(category_at(c))));
  for (const std::string& key : extra) header.push_back(key);
  for (size_t k = 1; k <= ladder.more_peers.size(); ++k)  // several peers: the second is peer2_..., at the end
    for (const char* field : {"tool", "measured", "error", "tokens_per_second", "step_seconds", "device_peak_bytes",
                              "peak_reserved_bytes"})
      header.push_back(fmt::format("peer{}_{}", k + 1, field));
  for (size_t k = 1; k <= ladder.more_peers.size(); ++k) {
    header.push_back(fmt::format("tokens_per_second_vs_peer{}", k + 1));
    header.push_back(fmt::format("device_peak_vs_peer{}", k + 1));
  }

  std::string out;
  const auto emit = [&](const std::vector<std::string>& fields) {
    for (size_t i = 0; i < fields.size(); ++i) {
      if (i > 0) out += ',';
      out += csv_field(fields[i]);
    }
    out += "\r\n";
  };
  emit(header);
  const auto opt_u = [](const std::optional<uint64_t>& v) { return v ? std::to_string(*v) : std::string(); };
  const auto opt_d = [](const std::optional<double>& v) { return v ? csv_double(*v) : std::string(); };
  const auto boolean = [](bool b) { return std::string(b ? "true" : "false"); };
  const auto opt_b = [&](const std::optional<bool>& v) { return v ? boolean(*v) : std::string(); };
  const uint64_t baseline_peak = ladder.rungs[ladder.baseline].planned_peak_bytes;
  for (size_t i = 0; i < ladder.rungs.size(); ++i) {
    const LadderRung& r = ladder.rungs[i];
    const PeerComparison comparison = compare_with_peer(r);
    std::string techniques;
    for (const std::string& t : r.techniques) techniques += (techniques.empty() ? "" : ";") + t;
    std::vector<std::string> row = {
        std::to_string(i), r.name, r.added, techniques, std::to_string(r.micro_batch), std::to_string(r.grad_accum),
        std::to_string(r.seq), std::to_string(r.planned_peak_bytes), opt_u(r.engine_peak_bytes),
        opt_u(r.device_peak_bytes), boolean(r.fits_budget), boolean(r.fits_device), boolean(r.measured),
        opt_d(r.step_seconds), opt_d(r.tokens_per_second), opt_d(r.mfu), opt_d(r.model_flops_per_token),
        opt_d(r.loss),
        r.loss_scaler && r.loss_scaler->skipped_steps ? std::to_string(*r.loss_scaler->skipped_steps) : "",
        r.loss_scaler ? opt_d(r.loss_scaler->final_scale) : "",
        r.peer && r.peer->measured ? boolean(*r.peer->measured) : "", r.peer ? r.peer->error : "",
        r.peer ? opt_d(r.peer->tokens_per_second) : "", r.peer ? opt_d(r.peer->step_seconds) : "",
        r.peer ? opt_d(r.peer->loss) : "", r.peer ? opt_u(r.peer->peak_allocated_bytes) : "",
        r.peer ? opt_u(r.peer->peak_reserved_bytes) : "", r.peer ? opt_u(r.peer->device_peak_bytes) : "",
        r.peer ? opt_u(r.peer->context_bytes) : "", opt_d(comparison.tokens_per_second_ratio),
        opt_d(comparison.device_peak_ratio), opt_b(comparison.beats_tokens_per_second),
        opt_b(comparison.beats_device_peak),
        i == 0 ? "" : std::to_string(signed_difference(ladder.rungs[i - 1].planned_peak_bytes, r.planned_peak_bytes)),
        std::to_string(signed_difference(baseline_peak, r.planned_peak_bytes))};
    for (int c = 0; c < kNumMemCategories; ++c) row.push_back(std::to_string(r.planned[c]));
    const json& raw = value.at("rungs")[i];
    for (const std::string& key : extra) {
      const auto it = raw.find(key);
      row.push_back(it == raw.end() || it->is_object() || it->is_array() ? "" : csv_scalar(*it));
    }
    for (size_t k = 1; k <= ladder.more_peers.size(); ++k) {
      const std::optional<LadderPeer>& p = peer_of(r, k);
      row.insert(row.end(), {peer_label(ladder, k), p && p->measured ? boolean(*p->measured) : "", p ? p->error : "",
                             p ? opt_d(p->tokens_per_second) : "", p ? opt_d(p->step_seconds) : "",
                             p ? opt_u(p->device_peak_bytes) : "", p ? opt_u(p->peak_reserved_bytes) : ""});
    }
    for (size_t k = 1; k <= ladder.more_peers.size(); ++k) {
      const PeerComparison c = compare_with(r, peer_of(r, k));
      row.push_back(opt_d(c.tokens_per_second_ratio));
      row.push_back(opt_d(c.device_peak_ratio));
    }
    emit(row);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// SVG
// ---------------------------------------------------------------------------------------------
namespace {

// Colours by category, chosen so that neighbours in the stack differ strongly in lightness.
constexpr size_t kCategoryColor[kNumMemCategories] = {
    1,  // frozen weights: indigo
    4,  // quant constants: cyan
    3,  // adapters: green
    6,  // adapter grads: teal
    7,  // optimizer state: olive
    0,  // saved activations: rose
    2,  // transient activations: sand
    5,  // attention scratch: wine
    8,  // logits/loss: purple
    9,  // workspace: pale grey
};
constexpr std::string_view kBudgetRed = "#CC3311";
constexpr std::string_view kPeerOrange = "#EE7733";  // Paul Tol's vibrant orange: apart from every category colour

// The second, third, ... peer's device-peak marker: a square, a triangle, a hexagon, each in a
// colour of its own (Paul Tol's vibrant blue, magenta, teal), centred on (x, y).
std::string_view extra_peer_color(size_t k) {
  static constexpr std::string_view colors[] = {"#0077BB", "#EE3377", "#009988"};
  return colors[(k - 1) % 3];
}

std::vector<std::pair<double, double>> extra_peer_marker(size_t k, double x, double y) {
  switch ((k - 1) % 3) {
    case 0: return {{x - 5, y - 5}, {x + 5, y - 5}, {x + 5, y + 5}, {x - 5, y + 5}};
    case 1: return {{x, y - 6}, {x + 6, y + 5}, {x - 6, y + 5}};
    default: return {{x - 3, y - 5}, {x + 3, y - 5}, {x + 6, y}, {x + 3, y + 5}, {x - 3, y + 5}, {x - 6, y}};
  }
}

struct ChartUnit {
  double bytes;
  std::string_view name;
};

ChartUnit chart_unit(uint64_t max_bytes) {
  if (max_bytes >= 2 * kGiB) return {static_cast<double>(kGiB), "GiB"};
  if (max_bytes >= 2 * kMiB) return {static_cast<double>(kMiB), "MiB"};
  return {static_cast<double>(kKiB), "KiB"};
}

// Three significant figures in the chart's unit: "66.2 GiB", "7.56 GiB", "160 MiB".
std::string short_bytes(uint64_t bytes) {
  const ChartUnit unit = chart_unit(bytes);
  double value = static_cast<double>(bytes) / unit.bytes;
  if (bytes < kKiB) return fmt::format("{} B", bytes);
  const int decimals = value >= 100 ? 0 : value >= 10 ? 1 : 2;
  return fmt::format("{:.{}f} {}", value, decimals, unit.name);
}

// The planned peak over a bar: two decimals below 100 so that 23.95 GiB does not read as 24.0.
std::string peak_label(uint64_t bytes) {
  const ChartUnit unit = chart_unit(bytes);
  if (bytes < kKiB) return fmt::format("{} B", bytes);
  const double value = static_cast<double>(bytes) / unit.bytes;
  return fmt::format("{:.{}f} {}", value, value >= 100 ? 1 : 2, unit.name);
}

std::string change_label(int64_t saving, uint64_t reference) {
  // A saving is less memory: written as a negative change, the way the bar moved.
  const uint64_t magnitude = saving < 0 ? static_cast<uint64_t>(-saving) : static_cast<uint64_t>(saving);
  const double percent = reference == 0 ? 0 : 100.0 * static_cast<double>(magnitude) / static_cast<double>(reference);
  const char sign = saving > 0 ? '-' : saving < 0 ? '+' : ' ';
  if (saving == 0) return "no change";
  return fmt::format("{}{}, {}{:.0f}%", sign, short_bytes(magnitude), sign, percent);
}

}  // namespace

std::string ladder_svg(const json& value) {
  const Ladder ladder = parse_ladder_json(value);
  const size_t n = ladder.rungs.size();
  const LadderRung& base = ladder.rungs[ladder.baseline];

  uint64_t max_bytes = 0;
  bool any_gap = false;
  for (const LadderRung& r : ladder.rungs) {
    uint64_t live = 0;
    for (uint64_t b : r.planned) live += b;
    if (r.planned_peak_bytes > live + live / 200) any_gap = true;
    max_bytes = std::max({max_bytes, r.planned_peak_bytes, live, r.engine_peak_bytes.value_or(0),
                          r.device_peak_bytes.value_or(0), r.peer ? r.peer->device_peak_bytes.value_or(0) : 0});
    for (const std::optional<LadderPeer>& p : r.more_peers)
      max_bytes = std::max(max_bytes, p ? p->device_peak_bytes.value_or(0) : 0);
  }
  // A budget far above every bar would squash them to slivers: then it is written, not drawn.
  const bool has_budget = ladder.budget_bytes > 0;
  const bool budget_on_scale = has_budget && (max_bytes == 0 || ladder.budget_bytes <= 4 * max_bytes);
  if (budget_on_scale) max_bytes = std::max(max_bytes, ladder.budget_bytes);
  if (max_bytes == 0) max_bytes = kKiB;
  const ChartUnit unit = chart_unit(max_bytes);

  // Horizontal layout: y tick labels | bars | budget label | legend.
  const double legend_font = 12;
  std::vector<std::pair<std::string, int>> legend_categories;  // top of the stack first
  for (int c = kNumMemCategories - 1; c >= 0; --c)
    legend_categories.emplace_back(std::string(category_label(category_at(c))), c);
  const std::string budget_label = budget_text(ladder);
  std::vector<std::string> marker_labels = {
      "device peak (nvidia-smi)", "engine peak (memtune arenas)", budget_label,
      "plan limit (budget less context)", "over budget", "plan only (not run here)", "arena gaps",
      "peer device peak (transformers)"};
  if (!ladder.more_peers.empty()) {  // several peers: each marker names its tool
    marker_labels[7] = "peer device peak (" + peer_label(ladder, 0) + ")";
    for (size_t k = 1; k <= ladder.more_peers.size(); ++k)
      marker_labels.push_back("peer device peak (" + peer_label(ladder, k) + ")");
  }
  double legend_width = svg::text_width("planned, by category", legend_font);
  for (const auto& [label, c] : legend_categories)
    legend_width = std::max(legend_width, svg::text_width(label, legend_font));
  for (const std::string& label : marker_labels) legend_width = std::max(legend_width, svg::text_width(label, legend_font));
  legend_width += 34;

  const double slot = std::max(112.0, 640.0 / static_cast<double>(n));
  const double bar_width = std::min(64.0, slot * 0.58);
  const double plot_left = 78;
  const double plot_right = plot_left + slot * static_cast<double>(n);
  const double budget_label_width =
      std::max(svg::text_width(budget_label, 11), budget_on_scale ? 0.0 : svg::text_width("(above the scale)", 10)) + 14;
  const double legend_x = plot_right + budget_label_width + 18;
  const double width = legend_x + legend_width + 16;

  // Rung names, wrapped to the slot.
  const double name_font = 11;
  const size_t max_chars = static_cast<size_t>(std::max(6.0, (slot - 8) / (name_font * 0.6)));
  std::vector<std::vector<std::string>> names;
  size_t max_lines = 1;
  for (const LadderRung& r : ladder.rungs) {
    names.push_back(svg::wrap_words(r.name, max_chars));
    max_lines = std::max(max_lines, names.back().size());
  }

  const double plot_top = 104, plot_height = 430;
  const double plot_bottom = plot_top + plot_height;
  const double names_bottom = plot_bottom + 18 + 14.0 * static_cast<double>(max_lines);
  const double legend_height = 30 + 20.0 * (kNumMemCategories + marker_labels.size()) + 30;
  const double height = std::max(names_bottom + 52, plot_top + legend_height + 10);

  // Vertical scale: room above the tallest bar for its three label lines.
  const double label_room = 62;  // up to four lines
  const double needed = static_cast<double>(max_bytes) / unit.bytes * plot_height / (plot_height - label_room);
  const svg::Ticks ticks = svg::nice_ticks(0, needed, 6);
  const double y_max = ticks.values.back();
  const auto y_of = [&](double bytes) { return plot_bottom - bytes / unit.bytes / y_max * plot_height; };

  svg::Document doc(width, height);

  // Title: model, then the run's shape and device, then how to read the chart.
  const std::string title = "Memory ladder: " + ladder.model;
  const std::string subtitle = fmt::format(
      "max_seq_length {}, micro-batch {} x accumulation {}, LoRA r {} - {}",
      config_or(ladder.config, {"seq", "max_seq_length"}, std::to_string(base.seq)),
      config_or(ladder.config, {"micro_batch", "per_device_train_batch_size"}, std::to_string(base.micro_batch)),
      config_or(ladder.config, {"grad_accum", "gradient_accumulation_steps"}, std::to_string(base.grad_accum)),
      config_or(ladder.config, {"lora_r"}, "?"), ladder.device);
  const std::string reading =
      "Bars: planned bytes at the peak, by category. Lines: measured peaks. Above each bar: planned peak and "
      "change vs the baseline.";
  const auto fitted_font = [&](const std::string& text, double font) {
    while (font > 8 && svg::text_width(text, font) > width - 30) font -= 0.5;
    return font;
  };
  doc.text(16, 30, title, fmt::format("font-size=\"{}\" font-weight=\"bold\" fill=\"#111111\"", fitted_font(title, 19)));
  doc.text(16, 52, subtitle, fmt::format("font-size=\"{}\" fill=\"#222222\"", fitted_font(subtitle, 13)));
  doc.text(16, 72, reading, fmt::format("font-size=\"{}\" fill=\"#555555\"", fitted_font(reading, 11.5)));

  // Axis and grid.
  for (double tick : ticks.values) {
    const double y = y_of(tick * unit.bytes);
    doc.line(plot_left, y, plot_right, y, "stroke=\"#e6e6e6\" stroke-width=\"1\"");
    doc.text(plot_left - 8, y + 4, svg::format_tick(tick, ticks.step),
             "font-size=\"11\" fill=\"#333333\" text-anchor=\"end\"");
  }
  doc.line(plot_left, plot_top, plot_left, plot_bottom, "stroke=\"#333333\"");
  doc.line(plot_left, plot_bottom, plot_right, plot_bottom, "stroke=\"#333333\"");
  const double axis_label_y = (plot_top + plot_bottom) / 2;
  doc.text(24, axis_label_y, fmt::format("memory ({})", unit.name),
           fmt::format("font-size=\"12\" fill=\"#222222\" text-anchor=\"middle\" transform=\"rotate(-90 24 {})\"",
                       axis_label_y));

  // Bars and their markers; the labels come after the budget line so that it never crosses them.
  std::vector<double> label_bases(n);
  for (size_t i = 0; i < n; ++i) {
    const LadderRung& r = ladder.rungs[i];
    const double center = plot_left + slot * (static_cast<double>(i) + 0.5);
    const double left = center - bar_width / 2;
    doc.raw(fmt::format("<g class=\"rung\" id=\"rung-{}\">", i));
    doc.title(fmt::format("{}: planned {}, engine {}, device {}{}{}", r.name, format_bytes(r.planned_peak_bytes),
                          r.engine_peak_bytes ? format_bytes(*r.engine_peak_bytes) : "not measured",
                          r.device_peak_bytes ? format_bytes(*r.device_peak_bytes) : "not measured",
                          r.peer && r.peer->device_peak_bytes ? ", peer device " + format_bytes(*r.peer->device_peak_bytes) : "",
                          r.fits_budget ? "" : ", over budget"));
    const std::string opacity = r.measured ? "" : " fill-opacity=\"0.45\"";
    double cursor = 0;
    for (int c = 0; c < kNumMemCategories; ++c) {
      if (r.planned[c] == 0) continue;
      const double top = y_of(cursor + static_cast<double>(r.planned[c]));
      const double bottom = y_of(cursor);
      doc.rect(left, top, bar_width, bottom - top,
               fmt::format("class=\"segment\" fill=\"{}\"{} stroke=\"#ffffff\" stroke-width=\"0.6\"",
                           svg::palette_color(kCategoryColor[c]), opacity));
      cursor += static_cast<double>(r.planned[c]);
    }
    if (static_cast<double>(r.planned_peak_bytes) > cursor * 1.005) {
      doc.rect(left, y_of(static_cast<double>(r.planned_peak_bytes)), bar_width,
               y_of(cursor) - y_of(static_cast<double>(r.planned_peak_bytes)),
               "fill=\"none\" stroke=\"#777777\" stroke-dasharray=\"2,2\"");
    }
    const double bar_top = y_of(std::max(cursor, static_cast<double>(r.planned_peak_bytes)));
    if (!r.fits_budget) {
      doc.rect(left - 3, bar_top - 3, bar_width + 6, plot_bottom - bar_top + 3,
               fmt::format("class=\"over-budget\" fill=\"none\" stroke=\"{}\" stroke-width=\"2.5\"", kBudgetRed));
    }
    label_bases[i] = bar_top - (r.fits_budget ? 6 : 9);
    if (r.engine_peak_bytes) {
      const double y = y_of(static_cast<double>(*r.engine_peak_bytes));
      doc.line(left - 6, y, left + bar_width + 6, y,
               "class=\"engine-peak\" stroke=\"#000000\" stroke-width=\"1.6\" stroke-dasharray=\"4,3\"");
      label_bases[i] = std::min(label_bases[i], y - 6);
    }
    if (r.device_peak_bytes) {
      const double y = y_of(static_cast<double>(*r.device_peak_bytes));
      doc.line(left - 8, y, left + bar_width + 8, y, "class=\"device-peak\" stroke=\"#000000\" stroke-width=\"3\"");
      const double tip = left + bar_width + 8;
      doc.polygon({{tip, y}, {tip + 8, y - 5}, {tip + 8, y + 5}}, "fill=\"#000000\"");
      label_bases[i] = std::min(label_bases[i], y - 7);
    }
    if (r.peer && r.peer->device_peak_bytes) {
      // The peer's process-level peak, comparable with the device peak line: an open diamond left
      // of the bar, where nothing else is drawn, so both stay readable when they nearly coincide.
      const double y = y_of(static_cast<double>(*r.peer->device_peak_bytes));
      const double x = left - 16;
      doc.polygon({{x, y - 6}, {x + 6, y}, {x, y + 6}, {x - 6, y}},
                  fmt::format("class=\"peer-device-peak\" fill=\"#ffffff\" stroke=\"{}\" stroke-width=\"2.2\"", kPeerOrange));
      label_bases[i] = std::min(label_bases[i], y - 9);
    }
    for (size_t k = 1; k <= r.more_peers.size(); ++k) {
      const std::optional<LadderPeer>& p = r.more_peers[k - 1];
      if (!p || !p->device_peak_bytes) continue;
      const double y = y_of(static_cast<double>(*p->device_peak_bytes));
      doc.polygon(extra_peer_marker(k, left - 16 - 11.0 * static_cast<double>(k), y),
                  fmt::format("class=\"peer-device-peak peer-{}\" fill=\"#ffffff\" stroke=\"{}\" stroke-width=\"2\"",
                              k + 1, extra_peer_color(k)));
      label_bases[i] = std::min(label_bases[i], y - 9);
    }
    doc.raw("</g>");
  }

  // Budget, over the bars so that it stays visible, with its label outside the plot.
  const double budget_y = y_of(static_cast<double>(ladder.budget_bytes));
  if (budget_on_scale) {
    doc.line(plot_left, budget_y, plot_right + 6, budget_y,
             fmt::format("class=\"budget\" stroke=\"{}\" stroke-width=\"2\" stroke-dasharray=\"9,5\"", kBudgetRed));
    doc.text(plot_right + 10, budget_y + 4, budget_label,
             fmt::format("class=\"budget-label\" font-size=\"11\" font-weight=\"bold\" fill=\"{}\"", kBudgetRed));
  } else if (has_budget) {
    doc.text(plot_right + 10, plot_top + 4, budget_label,
             fmt::format("class=\"budget-label\" font-size=\"11\" font-weight=\"bold\" fill=\"{}\"", kBudgetRed));
    doc.text(plot_right + 10, plot_top + 18, "(above the scale)", fmt::format("font-size=\"10\" fill=\"{}\"", kBudgetRed));
  }
  const bool has_context =
      budget_on_scale && ladder.device_context_bytes > 0 && ladder.device_context_bytes < ladder.budget_bytes;
  if (has_context) {
    const double y = y_of(static_cast<double>(ladder.budget_bytes - ladder.device_context_bytes));
    doc.line(plot_left, y, plot_right + 6, y,
             fmt::format("class=\"plan-limit\" stroke=\"{}\" stroke-width=\"1\" stroke-dasharray=\"2,3\"", kBudgetRed));
  }

  // Labels above each bar, bottom up: change vs the baseline, planned peak, then what is special
  // about the rung. Each line sits on a pale backing so that grid and budget lines do not cut it.
  const auto label_font = [&](const std::string& text, double font) {
    while (font > 8 && svg::text_width(text, font) > slot - 6) font -= 0.5;
    return font;
  };
  for (size_t i = 0; i < n; ++i) {
    const LadderRung& r = ladder.rungs[i];
    const double center = plot_left + slot * (static_cast<double>(i) + 0.5);
    struct Label {
      std::string text, attributes;
      double font;
    };
    std::vector<Label> labels;  // bottom up
    const std::string change = i == ladder.baseline
                                   ? "baseline"
                                   : change_label(signed_difference(base.planned_peak_bytes, r.planned_peak_bytes),
                                                  base.planned_peak_bytes);
    labels.push_back({change, "class=\"saving\" fill=\"#333333\"", label_font(change, 10.5)});
    const std::string peak = peak_label(r.planned_peak_bytes);
    labels.push_back({peak, fmt::format("font-weight=\"bold\" fill=\"{}\"", r.fits_budget ? "#111111" : kBudgetRed),
                      label_font(peak, 11.5)});
    if (!r.fits_budget) labels.push_back({"over budget", fmt::format("fill=\"{}\"", kBudgetRed), 10.5});
    if (!r.measured) labels.push_back({"plan only", "font-style=\"italic\" fill=\"#555555\"", 10.5});
    doc.raw(fmt::format("<g class=\"rung-labels\" id=\"rung-labels-{}\">", i));
    double y = label_bases[i];
    for (const Label& label : labels) {
      const double w = svg::text_width(label.text, label.font) + 6;
      doc.rect(center - w / 2, y - label.font * 0.92, w, label.font * 1.18,
               "fill=\"#ffffff\" fill-opacity=\"0.85\" stroke=\"none\"");
      doc.text(center, y, label.text,
               fmt::format("font-size=\"{}\" text-anchor=\"middle\" {}", label.font, label.attributes));
      y -= label.font + 2.5;
    }
    for (size_t line = 0; line < names[i].size(); ++line) {
      doc.text(center, plot_bottom + 18 + 14.0 * static_cast<double>(line), names[i][line],
               fmt::format("class=\"rung-name\" font-size=\"{}\" fill=\"#111111\" text-anchor=\"middle\"",
                           label_font(names[i][line], name_font)));
    }
    doc.raw("</g>");
  }

  // Legend: the categories in stack order (top first, as the bars read), then only the markers
  // that this chart uses.
  double ly = plot_top + 4;
  doc.text(legend_x, ly, "planned, by category", "font-size=\"12\" font-weight=\"bold\" fill=\"#111111\"");
  ly += 12;
  for (const auto& [label, c] : legend_categories) {
    doc.rect(legend_x, ly, 14, 14, fmt::format("fill=\"{}\"", svg::palette_color(kCategoryColor[c])));
    doc.text(legend_x + 22, ly + 11.5, label, fmt::format("font-size=\"{}\" fill=\"#222222\"", legend_font));
    ly += 20;
  }
  ly += 14;
  doc.text(legend_x, ly, "markers", "font-size=\"12\" font-weight=\"bold\" fill=\"#111111\"");
  ly += 12;
  const auto legend_row = [&](const std::string& label) {
    doc.text(legend_x + 34, ly + 11.5, label, fmt::format("font-size=\"{}\" fill=\"#222222\"", legend_font));
    ly += 20;
  };
  const auto any_rung = [&](const auto& predicate) { return std::any_of(ladder.rungs.begin(), ladder.rungs.end(), predicate); };
  if (any_rung([](const LadderRung& r) { return r.device_peak_bytes.has_value(); })) {
    doc.line(legend_x, ly + 7, legend_x + 22, ly + 7, "stroke=\"#000000\" stroke-width=\"3\"");
    doc.polygon({{legend_x + 22, ly + 7}, {legend_x + 29, ly + 2.5}, {legend_x + 29, ly + 11.5}}, "fill=\"#000000\"");
    legend_row(marker_labels[0]);
  }
  if (any_rung([](const LadderRung& r) { return r.engine_peak_bytes.has_value(); })) {
    doc.line(legend_x, ly + 7, legend_x + 26, ly + 7, "stroke=\"#000000\" stroke-width=\"1.6\" stroke-dasharray=\"4,3\"");
    legend_row(marker_labels[1]);
  }
  if (budget_on_scale) {
    doc.line(legend_x, ly + 7, legend_x + 26, ly + 7,
             fmt::format("stroke=\"{}\" stroke-width=\"2\" stroke-dasharray=\"9,5\"", kBudgetRed));
    legend_row(marker_labels[2]);
  }
  if (has_context) {
    doc.line(legend_x, ly + 7, legend_x + 26, ly + 7,
             fmt::format("stroke=\"{}\" stroke-width=\"1\" stroke-dasharray=\"2,3\"", kBudgetRed));
    legend_row(marker_labels[3]);
  }
  if (any_rung([](const LadderRung& r) { return !r.fits_budget; })) {
    doc.rect(legend_x + 4, ly, 18, 14, fmt::format("fill=\"none\" stroke=\"{}\" stroke-width=\"2.5\"", kBudgetRed));
    legend_row(marker_labels[4]);
  }
  if (any_rung([](const LadderRung& r) { return !r.measured; })) {
    doc.rect(legend_x + 4, ly, 18, 14, fmt::format("fill=\"{}\" fill-opacity=\"0.45\"", svg::palette_color(1)));
    legend_row(marker_labels[5]);
  }
  if (any_gap) {
    doc.rect(legend_x + 4, ly, 18, 14, "fill=\"none\" stroke=\"#777777\" stroke-dasharray=\"2,2\"");
    legend_row(marker_labels[6]);
  }
  if (any_rung([](const LadderRung& r) { return r.peer && r.peer->device_peak_bytes.has_value(); })) {
    doc.polygon({{legend_x + 13, ly + 1}, {legend_x + 19, ly + 7}, {legend_x + 13, ly + 13}, {legend_x + 7, ly + 7}},
                fmt::format("fill=\"#ffffff\" stroke=\"{}\" stroke-width=\"2.2\"", kPeerOrange));
    legend_row(marker_labels[7]);
  }
  for (size_t k = 1; k <= ladder.more_peers.size(); ++k) {
    if (!any_rung([&](const LadderRung& r) { return r.more_peers[k - 1] && r.more_peers[k - 1]->device_peak_bytes; }))
      continue;
    doc.polygon(extra_peer_marker(k, legend_x + 13, ly + 7),
                fmt::format("fill=\"#ffffff\" stroke=\"{}\" stroke-width=\"2\"", extra_peer_color(k)));
    legend_row(marker_labels[7 + k]);
  }

  // How the measured figures relate, under the names.
  const std::string note =
      ladder.device_context_bytes > 0
          ? fmt::format("Device peak includes the CUDA context and library handles ({}); the budget counts them too.",
                        format_bytes(ladder.device_context_bytes))
          : std::string("No GPU on this run: there is no device peak; engine peaks are the measured figure.");
  doc.text(plot_left, height - 18, note, "font-size=\"11\" fill=\"#555555\"");
  return doc.finish();
}

// ---------------------------------------------------------------------------------------------
// Peer
// ---------------------------------------------------------------------------------------------
namespace {

// Every peer rung, validated, with the trick it adds.
std::vector<std::pair<std::string, LadderPeer>> parse_peer_rungs(const json& peer, const std::string& context) {
  json_require_object(peer, context);
  json_get<std::string>(peer, "peer", context);
  json_get_or<std::string>(peer, "device", "", context);
  json_get_or<std::string>(peer, "date", "", context);
  const json& peer_rungs = json_require(peer, "rungs", context);
  MT_USER_CHECK(peer_rungs.is_array(), "{}: key \"rungs\": expected an array, got {}", context,
                json_value_description(peer_rungs));
  std::vector<std::pair<std::string, LadderPeer>> by_added;
  for (size_t i = 0; i < peer_rungs.size(); ++i) {
    std::string rung_context = fmt::format("{}: rungs[{}]", context, i);
    json_require_object(peer_rungs[i], rung_context);
    const std::string name = json_get<std::string>(peer_rungs[i], "name", rung_context);
    rung_context = fmt::format("{}: rungs[{}] (\"{}\")", context, i, name);
    const std::string added = json_get<std::string>(peer_rungs[i], "added", rung_context);
    json_get<bool>(peer_rungs[i], "measured", rung_context);
    for (const auto& [seen, figures] : by_added)
      MT_USER_CHECK(seen != added, "{}: a second rung with \"added\": \"{}\" (the first is \"{}\")", rung_context,
                    added, figures.name);
    by_added.emplace_back(added, parse_peer_figures(peer_rungs[i], rung_context));
  }
  return by_added;
}

std::string peer_context(const std::string& source) { return source.empty() ? std::string("peer") : source; }

}  // namespace

void validate_peer_json(const json& peer, const std::string& source) { parse_peer_rungs(peer, peer_context(source)); }

namespace {

// One peer matched to a ladder's rungs: per rung the peer's figures with the comparison (null
// where the peer has no rung of the same "added"), and the top-level record of who it was.
struct MatchedPeer {
  std::vector<json> figures;
  json info;
};

MatchedPeer match_peer(const Ladder& ladder, const json& peer, const std::string& source) {
  const std::string context = peer_context(source);
  const std::vector<std::pair<std::string, LadderPeer>> by_added = parse_peer_rungs(peer, context);
  const json& peer_rungs = peer["rungs"];
  MatchedPeer matched;
  std::vector<bool> used(by_added.size(), false);
  for (size_t r = 0; r < ladder.rungs.size(); ++r) {
    json figures = nullptr;
    for (size_t p = 0; p < by_added.size(); ++p) {
      if (by_added[p].first != ladder.rungs[r].added) continue;
      used[p] = true;
      figures = peer_rungs[p];
      figures.erase("added");  // the rung's own "added" says it
      const PeerComparison c = compare_with(ladder.rungs[r], by_added[p].second);
      const auto or_null = [](const auto& v) { return v ? json(*v) : json(nullptr); };
      figures["tokens_per_second_ratio"] = or_null(c.tokens_per_second_ratio);
      figures["device_peak_ratio"] = or_null(c.device_peak_ratio);
      figures["beats_tokens_per_second"] = or_null(c.beats_tokens_per_second);
      figures["beats_device_peak"] = or_null(c.beats_device_peak);
    }
    matched.figures.push_back(std::move(figures));
  }
  json unmatched = json::array();
  for (size_t p = 0; p < by_added.size(); ++p)
    if (!used[p]) unmatched.push_back(by_added[p].second.name);
  matched.info = {{"peer", peer["peer"].get<std::string>()},
                  {"device", json_get_or<std::string>(peer, "device", "unknown", context)},
                  {"date", json_get_or<std::string>(peer, "date", "unknown", context)},
                  {"config", peer.contains("config") ? peer["config"] : json(nullptr)},
                  {"source", source},
                  {"unmatched", unmatched},
                  {"compared",
                   "memtune device_peak_bytes with the peer's device_peak_bytes (both process-level, as nvidia-smi "
                   "shows: CUDA context included); memtune tokens_per_second with the peer's tokens_per_second; "
                   "ratios are memtune / peer"}};
  const std::string tool = json_get_or<std::string>(peer, "tool", "", context);
  if (!tool.empty()) matched.info["tool"] = tool;
  return matched;
}

}  // namespace

json attach_peer(const json& ladder_value, const json& peer, const std::string& source) {
  return attach_peers(ladder_value, {{peer, source}});
}

json attach_peers(const json& ladder_value, const std::vector<std::pair<json, std::string>>& peers) {
  const Ladder ladder = parse_ladder_json(ladder_value);  // a bad ladder fails here, not half-way
  MT_USER_CHECK(!peers.empty(), "attach_peers: no peer given");
  std::vector<MatchedPeer> matched;
  for (const auto& [peer, source] : peers) matched.push_back(match_peer(ladder, peer, source));  // all checked first
  json out = ladder_value;
  out.erase("more_peers");
  for (size_t r = 0; r < ladder.rungs.size(); ++r) {
    json& rung = out["rungs"][r];
    rung.erase("peer");
    rung.erase("more_peers");
    if (!matched[0].figures[r].is_null()) rung["peer"] = matched[0].figures[r];
    if (matched.size() > 1) {
      json more = json::array();
      for (size_t k = 1; k < matched.size(); ++k) more.push_back(matched[k].figures[r]);
      rung["more_peers"] = std::move(more);
    }
  }
  out["peer"] = matched[0].info;
  if (matched.size() > 1) {
    json more = json::array();
    for (size_t k = 1; k < matched.size(); ++k) more.push_back(matched[k].info);
    out["more_peers"] = std::move(more);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------------
void write_ladder_outputs(const json& ladder, const std::filesystem::path& out_dir) {
  // Render everything first: a ladder that fails validation writes nothing.
  const std::string json_text = ladder.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  const std::string csv = ladder_csv(ladder);
  const std::string markdown = ladder_markdown(ladder);
  const std::string chart = ladder_svg(ladder);
  std::error_code error;
  std::filesystem::create_directories(out_dir, error);
  MT_USER_CHECK(!error, "{}: cannot create the report directory: {}", out_dir.string(), error.message());
  write_file_atomic(out_dir / "ladder.json", json_text);
  write_file_atomic(out_dir / "ladder.csv", csv);
  write_file_atomic(out_dir / "report.md", markdown);
  write_file_atomic(out_dir / "ladder.svg", chart);
}

}  // namespace memtune
