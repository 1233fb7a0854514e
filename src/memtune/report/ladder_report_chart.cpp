// The ladder report's chart (ladder.svg): one stacked bar of planned bytes by category per rung,
// measured peaks and the peers' peaks as markers, the budget as a line.
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
#include "memtune/report/svg.h"

namespace memtune {

using nlohmann::json;
using namespace ladder_detail;

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

}  // namespace memtune
