// Plain SVG 1.1 for the reports: no scripts, no external fonts (font-family sans-serif), every
// piece of text XML-escaped, so the files open in a browser, in rsvg-convert, and in an XML
// parser alike.
//
// Two layers: small helpers (escaping, tick choice, a document builder) that the ladder chart
// in ladder_report_chart.cpp also uses, and line_chart_svg for `memtune sweep` (peak memory and
// tokens/s against sequence length, eager against flash).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace memtune {

// One curve of a line chart. Points are drawn in the order given (sort them by x first).
struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;
  bool dashed = false;
};

// A complete SVG document: title on top, axes with ticks at round numbers, one polyline with
// point markers per series (a colour-blind-friendly colour each; dashed where asked), and a
// legend on the right. Non-finite points are dropped. With no finite point at all it still
// returns a valid document that says "no data". The y axis starts at 0 unless a value is negative.
std::string line_chart_svg(std::string_view title, std::string_view x_label, std::string_view y_label,
                           std::vector<Series> series);

namespace svg {

// Text and attribute values: & < > " ' become entities; control characters that XML 1.0 does
// not allow are dropped; bytes that are not valid UTF-8 become '?'.
std::string xml_escape(std::string_view text);

// Paul Tol's "muted" scheme plus its pale grey: ten colours that stay distinct under the
// common forms of colour blindness. index is taken modulo 10.
std::string_view palette_color(size_t index);

// Round-number ticks covering [low, high]: the first tick <= low, the last >= high, about
// `target_count` intervals, step 1, 2 or 5 times a power of ten. low == high gives a unit range.
struct Ticks {
  std::vector<double> values;
  double step = 1;
};
Ticks nice_ticks(double low, double high, int target_count);

// A tick label with just enough decimals for the step: 0, 0.5, 1, 1.5 or 512, 1024.
std::string format_tick(double value, double step);

// Width in pixels of `text` in a sans-serif font of `font_px`, a little generous (DejaVu Sans
// is the widest common default), so that layout decisions based on it do not overlap.
double text_width(std::string_view text, double font_px);

// Greedy word wrap to lines of at most `max_chars` characters (a longer word gets its own line).
std::vector<std::string> wrap_words(std::string_view text, size_t max_chars);

// Accumulates elements. Arguments called `attributes` are inserted verbatim and must come from
// code (they are not escaped); every `text` argument is escaped.
class Document {
 public:
  Document(double width, double height);

  void raw(std::string_view markup);  // verbatim, for <defs> and group open/close tags
  void rect(double x, double y, double width, double height, std::string_view attributes);
  void line(double x1, double y1, double x2, double y2, std::string_view attributes);
  void polyline(const std::vector<std::pair<double, double>>& points, std::string_view attributes);
  void polygon(const std::vector<std::pair<double, double>>& points, std::string_view attributes);
  void circle(double cx, double cy, double r, std::string_view attributes);
  void text(double x, double y, std::string_view text, std::string_view attributes);
  // A <title> child (hover tooltip in browsers) for the enclosing group.
  void title(std::string_view text);

  double width() const { return width_; }
  double height() const { return height_; }
  // The whole document: XML declaration, <svg> root with a white background, the elements.
  std::string finish() const;

 private:
  double width_, height_;
  std::string body_;
};

}  // namespace svg
}  // namespace memtune
