// The ladder report's claims: what each memory technique is said to save or cost, judged
// against the ladder's own figures (held, did not hold, not measured).
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
#include "memtune/report/ladder_report_detail.h"

namespace memtune {

using nlohmann::json;
using namespace ladder_detail;

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

// The rung that adds one of `keys` to the rung before it; where there is none, nothing, and the
// claim says `no_rung` (its verdict stays not measured).
std::optional<size_t> rung_of_claim(const Ladder& ladder, std::initializer_list<std::string_view> keys,
                                    LadderClaim& claim, std::string no_rung) {
  const std::optional<size_t> index = rung_adding(ladder, keys);
  if (index && *index > 0) return index;
  claim.measured = std::move(no_rung);
  return std::nullopt;
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
  const std::optional<size_t> index =
      rung_of_claim(ladder, {"checkpoint"}, claim, "No rung adds gradient checkpointing on this run.");
  if (!index) return claim;
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
  const std::optional<size_t> index =
      rung_of_claim(ladder, {"flash"}, claim,
                    "No rung adds flash attention on this run. `memtune sweep` (peak memory and tokens/s "
                    "against max_seq_length, eager against flash) shows the growth.");
  if (!index) return claim;
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
  // One length can confirm the claim (the n^2 part is most of eager's bytes already) but not refute
  // it: at a short length the n^2 part is small by nature, so a smaller saving is not measured.
  claim.verdict = saving >= kFlashMinAttentionSaving ? ClaimVerdict::held : ClaimVerdict::not_measured;
  claim.measured = fmt::format(
      "Attention scratch + saved activations (plan), \"{}\" (eager) {} -> \"{}\" {}: {} less{}; "
      "whole {} {} -> {}.{}",
      eager.name, format_bytes(eager_bytes), flash.name, format_bytes(flash_bytes),
      verdict_percent_text(saving, kFlashMinAttentionSaving),
      saving >= kFlashMinAttentionSaving ? ""
                                         : " (held needs at least 50%; at one length a smaller saving cannot "
                                           "tell n^2 from n)",
      peak_kind_name(kind),
      format_bytes(peak_of(eager, kind)), format_bytes(peak_of(flash, kind)), sweep);
  return claim;
}

LadderClaim claim_qlora(const Ladder& ladder) {
  LadderClaim claim{"qlora_biggest", "QLoRA is the biggest single win", "", ClaimVerdict::not_measured};
  const std::optional<size_t> index =
      rung_of_claim(ladder, {"qlora", "nf4", "4bit"}, claim, "No rung adds QLoRA on this run.");
  if (!index) {
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

}  // namespace

std::vector<LadderClaim> ladder_detail::claims_of(const Ladder& ladder) {
  return {claim_sixteen_bit(ladder), claim_bf16_stable(ladder), claim_checkpointing(ladder),
          claim_flash(ladder),       claim_qlora(ladder),       claim_order(ladder)};
}

std::vector<LadderClaim> ladder_claims(const json& ladder) { return claims_of(parse_ladder_json(ladder)); }

}  // namespace memtune
