// What a long command says while it runs: a progress line with an ETA on stderr, and an
// optional JSONL file of per-step and per-rung metrics for tools to follow (tail -f, plots).
#pragma once

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace memtune {

// "42 s", "3:07", "1:02:09".
std::string format_duration(double seconds);

// One progress line. On a terminal it is redrawn in place (carriage return, padded over the
// previous text) so that the screen keeps a single line; into a file or pipe each update is
// a plain line, because a log full of carriage returns reads badly. Disabled: writes nothing.
//
// The ETA assumes the remaining work runs at the rate seen so far. Work is counted in whatever
// unit the caller passes (the ladder uses tokens, so a rung of half the sequence counts half).
class ProgressLine {
 public:
  // `terminal`: nullopt detects it with isatty() on `out`.
  ProgressLine(std::FILE* out, bool enabled, std::optional<bool> terminal = std::nullopt);
  ~ProgressLine();  // ends a line still open on the terminal
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  bool enabled() const { return enabled_; }
  bool terminal() const { return terminal_; }

  // Starts the clock; `total_work` > 0 enables the ETA.
  void start(double total_work);
  // Marks work done (cumulative) without drawing.
  void set_work_done(double work_done) { work_done_ = work_done; }
  // Redraws the line: `text`, then "ETA m:ss" from the work done so far.
  void update(std::string_view text);
  // A line that stays (a rung finished, a rung that is plan only): the progress line, if open,
  // is wiped first and redrawn by the next update.
  void note(std::string_view text);
  // Wipes the open line before someone else writes to the terminal (train's stdout).
  void clear();
  // The ETA text for the current state: "ETA 1:05", or "" before any work is done.
  std::string eta_text() const;

 private:
  void write(std::initializer_list<std::string_view> pieces);

  std::FILE* out_;
  bool enabled_, terminal_;
  bool line_open_ = false;
  size_t drawn_width_ = 0;
  double total_work_ = 0, work_done_ = 0;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

// Appends one JSON object per line to a file. The file is opened once with O_APPEND and each
// record goes out in a single write(2) of the whole line, so lines are never torn or
// interleaved with another writer's, and a reader sees each line as soon as it is written (no
// user-space buffer). An empty path disables it.
class MetricsLog {
 public:
  explicit MetricsLog(const std::filesystem::path& path);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  bool enabled() const { return fd_ >= 0; }
  // Adds "time" (seconds since the epoch) unless present. NaN and infinities become null.
  void write(nlohmann::json record);

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace memtune
