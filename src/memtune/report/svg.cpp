#include "memtune/report/svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace memtune {
namespace svg {

namespace {

// Coordinates with one decimal, without a trailing ".0": short files, stable output.
std::string num(double value) {
  if (!std::isfinite(value)) value = 0;
  std::string s = fmt::format("{:.1f}", value);
  if (s.size() >= 2 && s.compare(s.size() - 2, 2, ".0") == 0) s.resize(s.size() - 2);
  if (s == "-0") s = "0";
  return s;
}

// The points attribute of a polyline or polygon: "x1,y1 x2,y2 ...".
std::string points_text(const std::vector<std::pair<double, double>>& points) {
  std::string coordinates;
  for (const auto& [x, y] : points) {
    if (!coordinates.empty()) coordinates += ' ';
    coordinates += num(x) + "," + num(y);
  }
  return coordinates;
}

// Length of the UTF-8 sequence starting at text[i] and its code point, or 0 when the bytes
// there are not valid UTF-8 (overlong forms, surrogates and values past U+10FFFF included).
size_t utf8_sequence(std::string_view text, size_t i, uint32_t& code_point) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  size_t length = 0;
  uint32_t cp = 0;
  if (lead < 0x80) {
    code_point = lead;
    return 1;
  } else if ((lead & 0xE0) == 0xC0) {
    length = 2;
    cp = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3;
    cp = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4;
    cp = lead & 0x07;
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  for (size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  static constexpr uint32_t kMinimum[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinimum[length] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  code_point = cp;
  return length;
}

double char_width_em(uint32_t cp) {
  if (cp >= 0x80) return 0.75;
  const char c = static_cast<char>(cp);
  if (c == ' ') return 0.34;
  if (std::string_view("il.,:;'|!").find(c) != std::string_view::npos) return 0.32;
  if (std::string_view("fjrt()[]-/").find(c) != std::string_view::npos) return 0.42;
  if (std::string_view("mwMW@%").find(c) != std::string_view::npos) return 0.95;
  if (c >= 'A' && c <= 'Z') return 0.72;
  if (c >= '0' && c <= '9') return 0.64;
  return 0.62;
}

}  // namespace

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 16);
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    const size_t length = utf8_sequence(text, i, cp);
    if (length == 0) {
      out += '?';
      ++i;
      continue;
    }
    if (length == 1) {
      const char c = text[i];
      switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&quot;"; break;
        case '\'': out += "&apos;"; break;
        default:
          // XML 1.0 allows only tab, newline and carriage return below 0x20.
          if (cp >= 0x20 || c == '\t' || c == '\n' || c == '\r') out += c;
      }
    } else if (cp == 0xFFFE || cp == 0xFFFF) {
      out += '?';  // not XML characters
    } else {
      out.append(text.substr(i, length));
    }
    i += length;
  }
  return out;
}

std::string_view palette_color(size_t index) {
  static constexpr std::string_view kColors[10] = {
      "#CC6677",  // rose
      "#332288",  // indigo
      "#DDCC77",  // sand
      "#117733",  // green
      "#88CCEE",  // cyan
      "#882255",  // wine
      "#44AA99",  // teal
      "#999933",  // olive
      "#AA4499",  // purple
      "#DDDDDD",  // pale grey
  };
  return kColors[index % 10];
}

Ticks nice_ticks(double low, double high, int target_count) {
  if (!std::isfinite(low) || !std::isfinite(high)) low = 0, high = 1;
  if (low > high) std::swap(low, high);
  if (high - low <= std::abs(high) * 1e-12) high = low + (low == 0 ? 1 : std::abs(low) * 0.5);
  if (high <= low) high = low + 1;  // values so large that the above rounded away
  target_count = std::max(1, target_count);
  const double raw_step = (high - low) / target_count;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw_step)));
  const double normalised = raw_step / magnitude;
  const double multiple = normalised <= 1 ? 1 : normalised <= 2 ? 2 : normalised <= 5 ? 5 : 10;
  Ticks ticks;
  ticks.step = multiple * magnitude;
  // A small tolerance so that 24.000000001 does not add a tick for floating-point noise.
  const double first = std::floor(low / ticks.step + 1e-9);
  const double last = std::ceil(high / ticks.step - 1e-9);
  for (double k = first; k <= last + 0.5; k += 1) ticks.values.push_back(k * ticks.step + 0.0);
  if (ticks.values.size() < 2) ticks.values.push_back((last + 1) * ticks.step);
  return ticks;
}

std::string format_tick(double value, double step) {
  if (std::abs(value) < std::abs(step) * 1e-9) value = 0;
  int decimals = 0;
  if (step > 0 && step < 1) decimals = std::clamp(static_cast<int>(std::ceil(-std::log10(step) - 1e-9)), 0, 9);
  // A step of 2.5 needs one decimal: check that the value prints exactly at this precision.
  while (decimals < 6 && std::abs(std::round(value * std::pow(10, decimals)) -
                                  value * std::pow(10, decimals)) > 1e-6 * std::pow(10, decimals))
    ++decimals;
  std::string s = fmt::format("{:.{}f}", value, decimals);
  if (s == "-0") s = "0";
  return s;
}

double text_width(std::string_view text, double font_px) {
  double em = 0;
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    const size_t length = utf8_sequence(text, i, cp);
    em += char_width_em(length == 0 ? '?' : cp);
    i += length == 0 ? 1 : length;
  }
  return em * font_px;
}

std::vector<std::string> wrap_words(std::string_view text, size_t max_chars) {
  std::vector<std::string> lines;
  std::string current;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(' ', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view word = text.substr(start, end - start);
    if (!word.empty()) {
      if (current.empty()) {
        current = word;
      } else if (current.size() + 1 + word.size() <= max_chars) {
        current += ' ';
        current += word;
      } else {
        lines.push_back(std::move(current));
        current = word;
      }
    }
    start = end + 1;
  }
  if (!current.empty() || lines.empty()) lines.push_back(std::move(current));
  return lines;
}

Document::Document(double width, double height) : width_(width), height_(height) {}

void Document::raw(std::string_view markup) {
  body_ += markup;
  body_ += '\n';
}

void Document::rect(double x, double y, double width, double height, std::string_view attributes) {
  body_ += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" {}/>\n", num(x), num(y),
                       num(std::max(0.0, width)), num(std::max(0.0, height)), attributes);
}

void Document::line(double x1, double y1, double x2, double y2, std::string_view attributes) {
  body_ += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" {}/>\n", num(x1), num(y1),
                       num(x2), num(y2), attributes);
}

void Document::polyline(const std::vector<std::pair<double, double>>& points,
                        std::string_view attributes) {
  body_ += fmt::format("<polyline points=\"{}\" {}/>\n", points_text(points), attributes);
}

void Document::polygon(const std::vector<std::pair<double, double>>& points,
                       std::string_view attributes) {
  body_ += fmt::format("<polygon points=\"{}\" {}/>\n", points_text(points), attributes);
}

void Document::circle(double cx, double cy, double r, std::string_view attributes) {
  body_ += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"{}\" {}/>\n", num(cx), num(cy), num(r),
                       attributes);
}

void Document::text(double x, double y, std::string_view text, std::string_view attributes) {
  body_ += fmt::format("<text x=\"{}\" y=\"{}\" {}>{}</text>\n", num(x), num(y), attributes,
                       xml_escape(text));
}

void Document::title(std::string_view text) {
  body_ += fmt::format("<title>{}</title>\n", xml_escape(text));
}

std::string Document::finish() const {
  std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out += fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"sans-serif\">\n",
      num(width_), num(height_));
  out += fmt::format("<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n",
                     num(width_), num(height_));
  out += body_;
  out += "</svg>\n";
  return out;
}

}  // namespace svg

std::string line_chart_svg(std::string_view title, std::string_view x_label, std::string_view y_label,
                           std::vector<Series> series) {
  // Dark colours first: lines are thin, and the pale ones are hard to see on white.
  static constexpr size_t kLineColorOrder[10] = {1, 0, 3, 5, 6, 8, 7, 4, 2, 9};
  for (Series& s : series) {
    std::erase_if(s.points, [](const std::pair<double, double>& p) {
      return !std::isfinite(p.first) || !std::isfinite(p.second);
    });
  }
  double x_min = std::numeric_limits<double>::infinity(), x_max = -x_min;
  double y_min = 0, y_max = -std::numeric_limits<double>::infinity();
  size_t point_count = 0;
  for (const Series& s : series) {
    for (const auto& [x, y] : s.points) {
      x_min = std::min(x_min, x);
      x_max = std::max(x_max, x);
      y_min = std::min(y_min, y);
      y_max = std::max(y_max, y);
      ++point_count;
    }
  }

  double legend_width = 0;
  for (const Series& s : series) legend_width = std::max(legend_width, svg::text_width(s.name, 12));
  legend_width = series.empty() ? 0 : legend_width + 44;
  const double width = std::max(720.0, 640 + legend_width);
  const double height = 520;
  const double plot_left = 84, plot_top = 64, plot_bottom = height - 72;
  const double plot_right = width - 24 - legend_width;

  svg::Document doc(width, height);
  double title_px = 17;
  // Bold runs about 10% wider than the regular face that text_width measures.
  while (title_px > 10 && 1.1 * svg::text_width(title, title_px) > width - 32) title_px -= 1;
  doc.text(width / 2, 32, title,
           fmt::format("font-size=\"{}\" font-weight=\"bold\" text-anchor=\"middle\"", title_px));

  if (point_count == 0) {
    doc.rect(plot_left, plot_top, plot_right - plot_left, plot_bottom - plot_top,
             "fill=\"none\" stroke=\"#999999\"");
    doc.text((plot_left + plot_right) / 2, (plot_top + plot_bottom) / 2, "no data",
             "font-size=\"14\" fill=\"#666666\" text-anchor=\"middle\"");
    return doc.finish();
  }

  const svg::Ticks x_ticks = svg::nice_ticks(x_min, x_max, 6);
  const svg::Ticks y_ticks = svg::nice_ticks(y_min, y_max, 5);
  const double x_lo = x_ticks.values.front(), x_hi = x_ticks.values.back();
  const double y_lo = y_ticks.values.front(), y_hi = y_ticks.values.back();
  const auto px = [&](double x) { return plot_left + (x - x_lo) / (x_hi - x_lo) * (plot_right - plot_left); };
  const auto py = [&](double y) { return plot_bottom - (y - y_lo) / (y_hi - y_lo) * (plot_bottom - plot_top); };

  for (double y : y_ticks.values) {
    doc.line(plot_left, py(y), plot_right, py(y), "stroke=\"#e4e4e4\" stroke-width=\"1\"");
    doc.text(plot_left - 8, py(y) + 4, svg::format_tick(y, y_ticks.step),
             "font-size=\"11\" fill=\"#333333\" text-anchor=\"end\"");
  }
  for (double x : x_ticks.values) {
    doc.line(px(x), plot_top, px(x), plot_bottom, "stroke=\"#f0f0f0\" stroke-width=\"1\"");
    doc.line(px(x), plot_bottom, px(x), plot_bottom + 5, "stroke=\"#333333\"");
    doc.text(px(x), plot_bottom + 19, svg::format_tick(x, x_ticks.step),
             "font-size=\"11\" fill=\"#333333\" text-anchor=\"middle\"");
  }
  doc.line(plot_left, plot_bottom, plot_right, plot_bottom, "stroke=\"#333333\"");
  doc.line(plot_left, plot_top, plot_left, plot_bottom, "stroke=\"#333333\"");
  doc.text((plot_left + plot_right) / 2, plot_bottom + 44, x_label,
           "font-size=\"12\" fill=\"#222222\" text-anchor=\"middle\"");
  const double y_label_y = (plot_top + plot_bottom) / 2;
  doc.text(22, y_label_y, y_label,
           fmt::format("font-size=\"12\" fill=\"#222222\" text-anchor=\"middle\" "
                       "transform=\"rotate(-90 22 {})\"",
                       y_label_y));

  for (size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    const std::string_view color = svg::palette_color(kLineColorOrder[i % 10]);
    const std::string dash = s.dashed ? " stroke-dasharray=\"7,4\"" : "";
    doc.raw(fmt::format("<g class=\"series\">"));
    doc.title(s.name);
    std::vector<std::pair<double, double>> pixels;
    for (const auto& [x, y] : s.points) pixels.emplace_back(px(x), py(y));
    if (pixels.size() >= 2)
      doc.polyline(pixels, fmt::format("fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{}", color, dash));
    for (const auto& [x, y] : pixels)
      doc.circle(x, y, 3.2, fmt::format("fill=\"{}\" stroke=\"#ffffff\" stroke-width=\"1\"", color));
    doc.raw("</g>");

    const double legend_x = plot_right + 20, legend_y = plot_top + 8 + 22.0 * static_cast<double>(i);
    doc.line(legend_x, legend_y, legend_x + 26, legend_y,
             fmt::format("stroke=\"{}\" stroke-width=\"2\"{}", color, dash));
    doc.circle(legend_x + 13, legend_y, 3.2, fmt::format("fill=\"{}\"", color));
    doc.text(legend_x + 34, legend_y + 4, s.name, "font-size=\"12\" fill=\"#222222\"");
  }
  return doc.finish();
}

}  // namespace memtune
