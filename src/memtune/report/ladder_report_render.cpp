// The ladder report as text: the terminal table, report.md and ladder.csv, and the files.
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
#include "memtune/report/output_files.h"

namespace memtune {

using nlohmann::json;
using namespace ladder_detail;

// ---------------------------------------------------------------------------------------------
// Table rows (terminal and markdown share the cells)
// ---------------------------------------------------------------------------------------------
namespace {


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
namespace {

// An isolate list as a markdown table: per entry its planned and device peaks, tokens/s, and its
// saving against `reference` (the baseline's or the full stack's planned peak).
std::string isolate_table(const std::vector<LadderIsolateEntry>& entries, uint64_t reference,
                          const std::vector<std::string>& headers) {
  const auto bytes = [](uint64_t b) { return format_bytes(b); };
  std::vector<std::vector<std::string>> rows;
  for (const LadderIsolateEntry& e : entries)
    rows.push_back({e.name, format_bytes(e.planned_peak_bytes), optional_text(e.device_peak_bytes, bytes, "-"),
                    optional_text(e.tokens_per_second, rate_text), saving_cell(e.saving_bytes, reference)});
  return markdown_table(headers, rows, {false, true, true, true, true});
}

// The entry with the largest saving (the first of equals); `entries` is not empty.
const LadderIsolateEntry& largest_saving(const std::vector<LadderIsolateEntry>& entries) {
  return *std::max_element(entries.begin(), entries.end(),
                           [](const auto& a, const auto& b) { return a.saving_bytes < b.saving_bytes; });
}

// An isolate list under its heading, then the sentence on the entry with the largest saving
// (`entries` is not empty). `heading` names {rung} and {planned}, the reference rung's name and
// planned peak; `most` names {trick}, {saving} and {share} (of the reference's planned peak).
std::string isolate_section(const std::vector<LadderIsolateEntry>& entries, const LadderRung& reference,
                            std::string_view heading, const std::vector<std::string>& headers,
                            std::string_view most) {
  const uint64_t planned = reference.planned_peak_bytes;
  const LadderIsolateEntry& largest = largest_saving(entries);
  return fmt::format(fmt::runtime(heading), fmt::arg("rung", reference.name),
                     fmt::arg("planned", format_bytes(planned))) +
         isolate_table(entries, planned, headers) +
         fmt::format(fmt::runtime(most), fmt::arg("trick", largest.name),
                     fmt::arg("saving", saving_bytes_text(largest.saving_bytes)),
                     fmt::arg("share", percent_text(fraction_of(largest.saving_bytes, planned))));
}

}  // namespace

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
    const LadderRung& base = ladder.rungs[ladder.baseline];
    const LadderRung& full = ladder.rungs.back();
    if (!ladder.isolate_alone.empty()) {
      md += isolate_section(ladder.isolate_alone, base, "Each trick alone, added to \"{rung}\" ({planned} planned):\n\n",
                            {"trick", "planned peak", "device peak", "tokens/s", "saving vs baseline"},
                            "\nMatters most alone: **{trick}**, saving {saving} ({share} of the baseline).\n\n");
    }
    if (!ladder.isolate_removed.empty()) {
      md += isolate_section(ladder.isolate_removed, full,
                            "Each trick removed from the full stack, \"{rung}\" ({planned} planned):\n\n",
                            {"trick removed", "planned peak without it", "device peak", "tokens/s", "cost of removing it"},
                            "\nRemoval that hurts most: **{trick}**, adding {saving} ({share} more than the full stack).\n\n");
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
// Files
// ---------------------------------------------------------------------------------------------
void write_ladder_outputs(const json& ladder, const std::filesystem::path& out_dir) {
  // Render everything first: a ladder that fails validation writes nothing.
  write_output_files(out_dir, "report",
                     {{"ladder.json", ladder.dump(2, ' ', false, json::error_handler_t::replace) + "\n"},
                      {"ladder.csv", ladder_csv(ladder)},
                      {"report.md", ladder_markdown(ladder)},
                      {"ladder.svg", ladder_svg(ladder)}});
}

}  // namespace memtune
