// The ladder report's input side: ladder.json and peer.json read into Ladder, checked field by
// field, and the peer's rungs matched to the ladder's (attach_peer).
#include "memtune/report/ladder_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <set>

#include "memtune/core/bytes.h"
#include "memtune/core/enum_names.h"
#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"
#include "memtune/report/ladder_report_detail.h"

namespace memtune {

using nlohmann::json;
using namespace ladder_detail;

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

constexpr EnumName<ClaimVerdict> kClaimVerdictNames[] = {{ClaimVerdict::held, "held"},
                                                         {ClaimVerdict::did_not_hold, "did not hold"},
                                                         {ClaimVerdict::not_measured, "not measured"}};

std::string_view claim_verdict_name(ClaimVerdict verdict) {
  return name_of(kClaimVerdictNames, verdict, "not measured");
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

}  // namespace memtune
