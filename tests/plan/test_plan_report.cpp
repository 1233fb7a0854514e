// The plan's printed table (plan/plan_report.h): its figure columns stay apart at any size.
#include <gtest/gtest.h>

#include <cctype>
#include <sstream>

#include "memtune/model/presets.h"
#include "memtune/plan/plan_report.h"
#include "memtune/train/engine.h"

using namespace memtune;

// A plan at the size limits (figures of a million GiB and more) prints every row with at least
// two spaces before each figure, as a small one does.
TEST(PlanReport, FigureColumnsNeverRunTogether) {
  const LlamaConfig model = resolve_model("tiny").config;
  const RunConfig run;
  for (const uint64_t scale : {uint64_t{1} << 20, uint64_t{1} << 50, uint64_t{1} << 62}) {
    Plan plan;
    for (int c = 0; c < kNumMemCategories; ++c) plan.at_peak[c] = plan.max_by_category[c] = scale + c;
    plan.arena_bytes = scale * 3;
    plan.host_records.push_back({"model.embed_tokens.weight", scale});
    std::istringstream text(format_plan(plan, run, model));
    std::string line;
    std::getline(text, line);  // the run's one-line summary
    int rows = 0;
    while (std::getline(text, line)) {
      if (line.rfind("  parameters:", 0) == 0) continue;
      ++rows;
      // Each figure ends in a unit ("B", "KiB" ... "GiB"): the character before a figure's first
      // digit is a space, and so is the one before that.
      for (size_t at = line.find(" B"); at != std::string::npos; at = line.find(" B", at + 1)) {
        size_t start = at;
        while (start > 0 && (std::isdigit(static_cast<unsigned char>(line[start - 1])) || line[start - 1] == '.')) --start;
        ASSERT_GE(start, 2u) << line;
        EXPECT_EQ(line.substr(start - 2, 2), "  ") << "figures run together at scale " << scale << ": " << line;
      }
      for (const char* unit : {"KiB", "MiB", "GiB", "TiB"})
        for (size_t at = line.find(unit); at != std::string::npos; at = line.find(unit, at + 1)) {
          size_t start = at - 1;  // the space before the unit
          while (start > 0 && (std::isdigit(static_cast<unsigned char>(line[start - 1])) || line[start - 1] == '.')) --start;
          ASSERT_GE(start, 2u) << line;
          EXPECT_EQ(line.substr(start - 2, 2), "  ") << "figures run together at scale " << scale << ": " << line;
        }
    }
    EXPECT_GE(rows, kNumMemCategories + 2);  // header, categories, peak, host
  }
}
