// Helpers that the ladder report's parts share: formatting of bytes and ratios, technique lookup,
// the peak every compared rung has, and which peer is which (ladder_report_detail.h).
#include "memtune/report/ladder_report_detail.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>

#include "memtune/core/bytes.h"
#include "memtune/core/enum_names.h"

namespace memtune::ladder_detail {

using nlohmann::json;


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

constexpr EnumName<PeakKind> kPeakKindNames[] = {
    {PeakKind::device, "device peak"}, {PeakKind::engine, "engine peak"}, {PeakKind::planned, "planned peak"}};

std::string_view peak_kind_name(PeakKind kind) { return name_of(kPeakKindNames, kind, "planned peak"); }

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

std::vector<StepSaving> step_savings(const Ladder& ladder, PeakKind kind) {
  std::vector<StepSaving> out;
  for (size_t i = ladder.baseline + 1; i < ladder.rungs.size(); ++i) {
    const uint64_t before = peak_of(ladder.rungs[i - 1], kind);
    out.push_back({i, signed_difference(before, peak_of(ladder.rungs[i], kind)), before});
  }
  return out;
}


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

}  // namespace memtune::ladder_detail
