#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>

#include "memtune/io/file_util.h"
#include "memtune/report/svg.h"
#include "report_test_util.h"

using namespace memtune;
namespace fs = std::filesystem;

using memtune::report_test::count_of;
using memtune::report_test::python_minidom_check;
using memtune::report_test::xml_well_formedness_error;

namespace {

std::vector<Series> sweep_series() {
  const std::vector<double> seqs = {512, 1024, 2048, 4096, 8192};
  Series eager{"eager attention", {}, false}, flash{"flash attention", {}, true};
  for (double s : seqs) {
    // Peak memory in GiB: weights plus activations, quadratic for eager.
    eager.points.emplace_back(s, 15.6 + 0.004 * s + 5.0e-7 * s * s);
    flash.points.emplace_back(s, 15.6 + 0.004 * s);
  }
  return {eager, flash};
}

}  // namespace

TEST(Svg, XmlEscape) {
  EXPECT_EQ(svg::xml_escape("a<b>&\"c\"'d'"), "a&lt;b&gt;&amp;&quot;c&quot;&apos;d&apos;");
  EXPECT_EQ(svg::xml_escape("tab\tnew\nline\x01\x1f"), "tab\tnew\nline");
  EXPECT_EQ(svg::xml_escape("caf\xc3\xa9 \xe2\x80\x94 ok"), "caf\xc3\xa9 \xe2\x80\x94 ok");  // UTF-8 kept
  EXPECT_EQ(svg::xml_escape("bad \xff\xc3 end"), "bad ?? end");                               // invalid bytes
  EXPECT_EQ(svg::xml_escape("\xc0\xaf"), "??");                                               // overlong
  EXPECT_EQ(svg::xml_escape("\xed\xa0\x80"), "???");                                          // surrogate
  EXPECT_EQ(svg::xml_escape("\xef\xbf\xbf"), "?");                                            // U+FFFF
}

TEST(Svg, NiceTicks) {
  svg::Ticks t = svg::nice_ticks(0, 80, 6);
  EXPECT_EQ(t.step, 20);
  EXPECT_EQ(t.values.front(), 0);
  EXPECT_EQ(t.values.back(), 80);
  t = svg::nice_ticks(0, 81, 6);
  EXPECT_GE(t.values.back(), 81);
  t = svg::nice_ticks(512, 8192, 6);
  EXPECT_LE(t.values.front(), 512);
  EXPECT_GE(t.values.back(), 8192);
  EXPECT_EQ(t.step, 2000);
  t = svg::nice_ticks(0.0, 0.0, 5);  // degenerate ranges still give an axis
  EXPECT_GE(t.values.size(), 2u);
  EXPECT_LT(t.values.front(), t.values.back());
  t = svg::nice_ticks(3, 3, 5);
  EXPECT_LE(t.values.front(), 3);
  EXPECT_GT(t.values.back(), 3);
  t = svg::nice_ticks(0, 0.37, 5);
  EXPECT_NEAR(t.step, 0.1, 1e-12);
  EXPECT_EQ(svg::format_tick(t.values[1], t.step), "0.1");
  EXPECT_EQ(svg::format_tick(2.5, 0.5), "2.5");
  EXPECT_EQ(svg::format_tick(1024, 1000), "1024");
  EXPECT_EQ(svg::format_tick(-0.0, 1), "0");
}

TEST(Svg, WrapWords) {
  EXPECT_EQ(svg::wrap_words("micro-batch 1 x accumulation 16", 15),
            (std::vector<std::string>{"micro-batch 1 x", "accumulation 16"}));
  EXPECT_EQ(svg::wrap_words("averyveryverylongword x", 5), (std::vector<std::string>{"averyveryverylongword", "x"}));
  EXPECT_EQ(svg::wrap_words("", 5), (std::vector<std::string>{""}));
}

TEST(Svg, LineChartIsWellFormedWithLegendAxesAndDashes) {
  const std::string chart = line_chart_svg("Peak memory vs max_seq_length <8B>", "max_seq_length (tokens)",
                                           "peak memory (GiB)", sweep_series());
  EXPECT_EQ(xml_well_formedness_error(chart), "");
  EXPECT_EQ(count_of(chart, "<g class=\"series\">"), 2u);
  EXPECT_EQ(count_of(chart, "<polyline"), 2u);
  EXPECT_EQ(count_of(chart, "stroke-dasharray"), 2u);  // flash's curve and its legend sample
  EXPECT_EQ(count_of(chart, ">eager attention</text>"), 1u);  // legend text
  EXPECT_EQ(count_of(chart, ">flash attention</text>"), 1u);
  EXPECT_NE(chart.find("Peak memory vs max_seq_length &lt;8B&gt;"), std::string::npos);
  EXPECT_NE(chart.find(">max_seq_length (tokens)<"), std::string::npos);
  EXPECT_NE(chart.find(">peak memory (GiB)<"), std::string::npos);
  EXPECT_NE(chart.find(">8000<"), std::string::npos);  // an x tick
  EXPECT_NE(chart.find("font-family=\"sans-serif\""), std::string::npos);

  const fs::path file = fs::temp_directory_path() / ("memtune_line_chart_" + std::to_string(::getpid()) + ".svg");
  write_file_atomic(file, chart);
  const int parsed = python_minidom_check(file);
  // Left for looking at, next to the ladder's outputs.
  fs::create_directories(fs::path(MEMTUNE_BINARY_DIR) / "test_output" / "report");
  fs::copy_file(file, fs::path(MEMTUNE_BINARY_DIR) / "test_output" / "report" / "sweep_memory.svg",
                fs::copy_options::overwrite_existing);
  fs::remove(file);
  if (parsed < 0) GTEST_SKIP() << "python3 with xml.dom.minidom is missing: only the built-in XML check ran";
  EXPECT_EQ(parsed, 0);
}

TEST(Svg, LineChartEdgeCases) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // No data at all, and data that is all non-finite.
  for (const std::vector<Series>& series :
       {std::vector<Series>{}, std::vector<Series>{{"empty", {}, false}},
        std::vector<Series>{{"nan", {{nan, 1.0}, {1.0, nan}}, false}}}) {
    const std::string chart = line_chart_svg("t", "x", "y", series);
    EXPECT_EQ(xml_well_formedness_error(chart), "");
    EXPECT_NE(chart.find("no data"), std::string::npos);
  }
  // One point, a flat line, negative values, and a hostile series name.
  const std::string chart = line_chart_svg(
      "t", "x", "y", {{"one", {{1, 1}}, false}, {"flat", {{0, 5}, {10, 5}}, true}, {"neg & <b>", {{0, -3}, {5, 2}}, false}});
  EXPECT_EQ(xml_well_formedness_error(chart), "");
  EXPECT_NE(chart.find("neg &amp; &lt;b&gt;"), std::string::npos);
  EXPECT_EQ(chart.find("nan"), std::string::npos);
  EXPECT_EQ(chart.find("inf"), std::string::npos);
}
