// The progress line (redrawn in place on a terminal, plain lines elsewhere) and the metrics
// JSONL (whole lines, appended).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/core/progress.h"

using namespace memtune;
namespace fs = std::filesystem;

namespace {

// What a ProgressLine wrote into a temporary FILE*.
template <typename F>
std::string captured(bool enabled, bool terminal, F use) {
  std::FILE* file = std::tmpfile();
  {
    ProgressLine progress(file, enabled, terminal);
    use(progress);
  }
  std::fflush(file);
  std::rewind(file);
  std::string out;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, file)) > 0) out.append(buffer, n);
  std::fclose(file);
  return out;
}

void three_steps(ProgressLine& progress) {
  progress.start(30);
  progress.update("[1/2] fp16 baseline  step 1/3");  // no work done yet: no ETA
  progress.set_work_done(10);
  progress.update("[1/2] fp16 baseline  step 2/3 with a longer text");
  progress.set_work_done(20);
  progress.update("[1/2] fp16 baseline  step 3/3");
  progress.note("[2/2] + bf16: plan only");
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  for (size_t start = 0, end; (end = text.find('\n', start)) != std::string::npos; start = end + 1)
    lines.push_back(text.substr(start, end - start));
  return lines;
}

}  // namespace

TEST(Progress, FormatDuration) {
  EXPECT_EQ(format_duration(0), "0 s");
  EXPECT_EQ(format_duration(42.4), "42 s");
  EXPECT_EQ(format_duration(187), "3:07");
  EXPECT_EQ(format_duration(3729), "1:02:09");
  EXPECT_EQ(format_duration(std::numeric_limits<double>::infinity()), "?");
}

TEST(Progress, TerminalRedrawsOneLineInPlace) {
  const std::string out = captured(true, true, three_steps);
  // Three redraws of one line (carriage returns), then the note on a line of its own.
  EXPECT_EQ(std::count(out.begin(), out.end(), '\r'), 3 + 2);  // + the wipe before the note (\r ... \r)
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
  EXPECT_NE(out.find("ETA"), std::string::npos);
  EXPECT_TRUE(out.ends_with("[2/2] + bf16: plan only\n"));
  // The shorter third line is padded over the longer second one.
  const size_t third = out.find("\r[1/2] fp16 baseline  step 3/3");
  ASSERT_NE(third, std::string::npos);
  const size_t second = out.find("\r[1/2] fp16 baseline  step 2/3");
  EXPECT_EQ(out.find('\r', third + 1) - third, out.find('\r', second + 1) - second);
}

TEST(Progress, PipeGetsPlainLines) {
  const std::string out = captured(true, false, three_steps);
  EXPECT_EQ(out.find('\r'), std::string::npos);
  const std::vector<std::string> lines = lines_of(out);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], "[1/2] fp16 baseline  step 1/3");
  EXPECT_NE(lines[1].find("  ETA "), std::string::npos);
  EXPECT_EQ(lines[3], "[2/2] + bf16: plan only");
}

TEST(Progress, QuietWritesNothing) {
  EXPECT_EQ(captured(false, true, three_steps), "");
  EXPECT_EQ(captured(false, false, three_steps), "");
}

TEST(Progress, TerminalLineIsClearedBeforeOtherOutputAndEndedAtExit) {
  const std::string out = captured(true, true, [](ProgressLine& p) {
    p.start(0);
    p.update("step 1");
    p.clear();
    p.update("step 2");
  });
  EXPECT_EQ(out, "\rstep 1\r      \r\rstep 2\n");
}

TEST(Metrics, AppendsWholeJsonLines) {
  const fs::path file = fs::temp_directory_path() / ("memtune_metrics_" + std::to_string(::getpid()) + ".jsonl");
  fs::remove(file);
  write_file_atomic(file, "{\"event\": \"earlier run\"}\n");
  {
    MetricsLog log(file);
    ASSERT_TRUE(log.enabled());
    log.write({{"event", "step"}, {"step", 1}, {"loss", std::numeric_limits<double>::quiet_NaN()},
               {"rung", "bad \xff name"}});
  }
  // Two writers at once, as two commands appending to one file would be: no line is torn.
  {
    MetricsLog a(file), b(file);
    std::thread ta([&] {
      for (int i = 0; i < 200; ++i) a.write({{"writer", "a"}, {"i", i}, {"pad", std::string(300, 'a')}});
    });
    std::thread tb([&] {
      for (int i = 0; i < 200; ++i) b.write({{"writer", "b"}, {"i", i}, {"pad", std::string(300, 'b')}});
    });
    ta.join();
    tb.join();
  }
  std::ifstream in(file);
  std::string line;
  std::vector<nlohmann::json> records;
  while (std::getline(in, line)) records.push_back(nlohmann::json::parse(line));  // throws on a torn line
  ASSERT_EQ(records.size(), 2u + 400u);
  EXPECT_EQ(records[0]["event"], "earlier run");  // appended, not truncated
  EXPECT_TRUE(records[1]["loss"].is_null());       // NaN
  EXPECT_TRUE(records[1].contains("time"));
  int a_count = 0;
  for (const auto& r : records) a_count += r.value("writer", "") == "a";
  EXPECT_EQ(a_count, 200);
  fs::remove(file);

  MetricsLog disabled{fs::path()};
  EXPECT_FALSE(disabled.enabled());
  disabled.write({{"ignored", true}});
  EXPECT_THROW(MetricsLog(fs::temp_directory_path()), Error);  // a directory
}
