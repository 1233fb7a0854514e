#include "memtune/core/progress.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "memtune/core/error.h"

namespace memtune {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t total = static_cast<int64_t>(std::llround(seconds));
  if (total < 60) return fmt::format("{} s", total);
  const int64_t hours = total / 3600, minutes = (total % 3600) / 60, rest = total % 60;
  if (hours > 0) return fmt::format("{}:{:02}:{:02}", hours, minutes, rest);
  return fmt::format("{}:{:02}", minutes, rest);
}

ProgressLine::ProgressLine(std::FILE* out, bool enabled, std::optional<bool> terminal)
    : out_(out), enabled_(enabled && out != nullptr),
      terminal_(terminal.value_or(out != nullptr && ::isatty(::fileno(out)) == 1)) {}

ProgressLine::~ProgressLine() {
  if (enabled_ && line_open_) write({"\n"});
}

void ProgressLine::start(double total_work) {
  total_work_ = total_work;
  work_done_ = 0;
  started_ = std::chrono::steady_clock::now();
}

std::string ProgressLine::eta_text() const {
  if (total_work_ <= 0 || work_done_ <= 0) return "";
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  const double remaining = std::max(0.0, total_work_ - work_done_) * elapsed / work_done_;
  return "ETA " + format_duration(remaining);
}

void ProgressLine::write(std::initializer_list<std::string_view> pieces) {
  for (std::string_view piece : pieces) std::fwrite(piece.data(), 1, piece.size(), out_);
  std::fflush(out_);
}

void ProgressLine::update(std::string_view text) {
  if (!enabled_) return;
  std::string line(text);
  if (const std::string eta = eta_text(); !eta.empty()) line += "  " + eta;
  if (!terminal_) {
    write({line, "\n"});
    return;
  }
  // Pad over what the previous, longer line left on the screen; no escape codes, so that any
  // terminal (and `script` logs) shows the same thing.
  const size_t width = line.size();
  if (width < drawn_width_) line.append(drawn_width_ - width, ' ');
  write({"\r", line});
  drawn_width_ = width;
  line_open_ = true;
}

void ProgressLine::clear() {
  if (!enabled_ || !terminal_ || !line_open_) return;
  write({"\r", std::string(drawn_width_, ' '), "\r"});
  line_open_ = false;
  drawn_width_ = 0;
}

void ProgressLine::note(std::string_view text) {
  if (!enabled_) return;
  clear();
  write({text, "\n"});
}

MetricsLog::MetricsLog(const std::filesystem::path& path) : path_(path) {
  if (path.empty()) return;
  if (path.has_parent_path()) {
    std::error_code ignored;
    std::filesystem::create_directories(path.parent_path(), ignored);
  }
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  MT_USER_CHECK(fd_ >= 0, "--metrics {}: cannot open for appending: {}", path.string(), std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::write(nlohmann::json record) {
  if (fd_ < 0) return;
  if (record.is_object() && !record.contains("time"))
    record["time"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  // nlohmann writes NaN and infinities as null; invalid UTF-8 in a name becomes U+FFFD.
  const std::string line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  // One write(2) per line: with O_APPEND the kernel places it at the end in one piece. A short
  // write (disk full, a signal) is finished by a second call rather than dropped.
  size_t written = 0;
  while (written < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + written, line.size() - written);
    if (n < 0 && errno == EINTR) continue;
    MT_USER_CHECK(n > 0, "--metrics {}: write failed: {}", path_.string(), std::strerror(errno));
    written += static_cast<size_t>(n);
  }
}

}  // namespace memtune
