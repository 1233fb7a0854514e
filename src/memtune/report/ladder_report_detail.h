// Inside the ladder report (ladder_report.h): the helpers that its parts share. parse reads
// ladder.json into Ladder; claims judges it; render writes the terminal table, report.md and
// ladder.csv; chart writes ladder.svg. Every part formats bytes, savings and peers the same way,
// so those helpers live here once (ladder_report_common.cpp). Not for use outside report/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "memtune/report/ladder_report.h"

namespace memtune::ladder_detail {

// ---- formatting ----
int64_t signed_difference(uint64_t before, uint64_t after);
// "24 GiB" rather than "24.00 GiB": for labels.
std::string compact_bytes(uint64_t bytes);
// A saving: positive is less memory. "16.00 GiB", "-512.0 MiB" (an increase).
std::string saving_bytes_text(int64_t saving);
std::string percent_text(double fraction);
double fraction_of(int64_t part, uint64_t whole);
std::string saving_cell(int64_t saving, uint64_t reference);
std::string rate_text(double value);
std::string loss_text(double loss);
template <typename T, typename F>
std::string optional_text(const std::optional<T>& value, F format, std::string_view missing = "-") {
  return value ? format(*value) : std::string(missing);
}
std::string fits_text(const LadderRung& rung);
std::string shape_text(const LadderRung& rung);
std::string budget_text(const Ladder& ladder);

// ---- techniques ----
// "gradient-checkpointing" and "Gradient Checkpointing" compare equal to "gradient_checkpointing".
std::string normalise(std::string_view text);
// "bf16+nf4-base" uses bf16: a technique may combine several with '+'.
bool has_technique(const LadderRung& rung, std::string_view technique);
bool any_technique_contains(const LadderRung& rung, std::initializer_list<std::string_view> keys);
bool added_contains(const LadderRung& rung, std::initializer_list<std::string_view> keys);
// The rung that adds a technique: by "added" first, else the first rung that uses it while the
// rung before it does not.
std::optional<size_t> rung_adding(const Ladder& ladder, std::initializer_list<std::string_view> keys);

// ---- peaks ----
enum class PeakKind { device, engine, planned };
std::string_view peak_kind_name(PeakKind kind);
uint64_t peak_of(const LadderRung& rung, PeakKind kind);
// The most measured figure that every given rung has: comparisons use one kind throughout.
PeakKind common_peak_kind(const std::vector<const LadderRung*>& rungs);
std::vector<const LadderRung*> all_rungs(const Ladder& ladder);
uint64_t attention_bytes(const LadderRung& rung);
uint64_t sixteen_bit_part_bytes(const LadderRung& rung);

// Savings of every rung after the first against the rung before it, in one figure.
struct StepSaving {
  size_t index;
  int64_t saving;
  uint64_t before;
};
std::vector<StepSaving> step_savings(const Ladder& ladder, PeakKind kind);

// ---- the run's config ----
// A config value as text, trying the brief's names and the Hugging Face names in turn.
std::string config_text(const nlohmann::json& config, std::initializer_list<std::string_view> keys);
std::string config_or(const nlohmann::json& config, std::initializer_list<std::string_view> keys,
                      std::string fallback);

// ---- several peers (attach_peers): peer 0 is "peer", peer k >= 1 is more_peers[k - 1] ----
bool any_peer(const Ladder& ladder);
const LadderPeerInfo* peer_info(const Ladder& ladder, size_t k);
std::string peer_label(const Ladder& ladder, size_t k);
const std::optional<LadderPeer>& peer_of(const LadderRung& rung, size_t k);

// ---- claims (ladder_report_claims.cpp) ----
std::vector<LadderClaim> claims_of(const Ladder& ladder);

}  // namespace memtune::ladder_detail
