#include "memtune/train/output_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <optional>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"

namespace memtune {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kCheckpointPrefix = "checkpoint-";
constexpr std::string_view kLegacyCheckpointName = "checkpoint";

// The step of a folder named checkpoint-<step> (nothing after the digits), else nullopt.
std::optional<int64_t> step_of_name(std::string_view name) {
  if (name.substr(0, kCheckpointPrefix.size()) != kCheckpointPrefix) return std::nullopt;
  const std::string_view digits = name.substr(kCheckpointPrefix.size());
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  int64_t step = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (error != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return step;
}

// A checkpoint is complete once its trainer_state.json is written (Engine::save_checkpoint
// writes it last); between the two renames of a save only the .old twin holds one.
bool is_complete_checkpoint(const fs::path& dir) {
  std::error_code ignored;
  return fs::exists(dir / "trainer_state.json", ignored) ||
         fs::exists(fs::path(dir.string() + ".old") / "trainer_state.json", ignored);
}

// memtune's own outputs in an output folder: what --overwrite_output_dir may remove.
bool is_training_output(const std::string& name) {
  std::string base = name;
  for (const char* suffix : {".old", ".partial"})
    if (base.size() > std::string_view(suffix).size() && base.ends_with(suffix))
      base.resize(base.size() - std::string_view(suffix).size());
  return base == "adapter" || base == kLegacyCheckpointName || step_of_name(base).has_value();
}

}  // namespace

fs::path checkpoint_dir_for_step(const fs::path& out, int64_t step) {
  return out / (std::string(kCheckpointPrefix) + std::to_string(step));
}

fs::path complete_checkpoint_folder(const fs::path& dir) {
  std::error_code ignored;
  if (fs::exists(dir / "trainer_state.json", ignored)) return dir;
  const fs::path old = dir.string() + ".old";
  if (fs::exists(old / "trainer_state.json", ignored)) return old;
  mt_fail("{} is not a complete memtune checkpoint (no trainer_state.json)", dir.string());
}

std::vector<CheckpointFolder> list_checkpoints(const fs::path& out) {
  std::vector<CheckpointFolder> found;
  std::error_code error;
  if (!fs::is_directory(out, error)) return found;
  std::vector<int64_t> steps;
  for (const fs::directory_entry& entry : fs::directory_iterator(out, error)) {
    std::string name = entry.path().filename().string();
    if (name.ends_with(".old")) name.resize(name.size() - 4);
    if (const std::optional<int64_t> step = step_of_name(name); step && is_complete_checkpoint(out / name))
      steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  for (int64_t step : steps) found.push_back({step, checkpoint_dir_for_step(out, step)});
  const fs::path legacy = out / kLegacyCheckpointName;
  if (is_complete_checkpoint(legacy)) {
    try {
      const fs::path state = complete_checkpoint_folder(legacy) / "trainer_state.json";
      const int64_t step = json_get<int64_t>(read_json_file(state), "step", state.string());
      found.push_back({step, legacy});
      std::stable_sort(found.begin(), found.end(),
                       [](const CheckpointFolder& a, const CheckpointFolder& b) { return a.step < b.step; });
    } catch (const Error&) {
      // Unreadable: not a checkpoint to resume from; --resume of its path says why.
    }
  }
  return found;
}

fs::path resolve_resume_folder(const fs::path& requested) {
  if (is_complete_checkpoint(requested)) return requested;
  std::error_code error;
  MT_USER_CHECK(fs::is_directory(requested, error), "--resume {}: no such folder", requested.string());
  const std::vector<CheckpointFolder> checkpoints = list_checkpoints(requested);
  MT_USER_CHECK(!checkpoints.empty(),
                "--resume {}: neither a complete memtune checkpoint (no trainer_state.json) nor an output folder "
                "holding checkpoint-<step> folders",
                requested.string());
  return checkpoints.back().path;
}

std::vector<fs::path> rotate_checkpoints(const fs::path& out, int64_t limit) {
  std::vector<fs::path> removed;
  if (limit <= 0) return removed;
  std::vector<CheckpointFolder> numbered;
  for (const CheckpointFolder& c : list_checkpoints(out))
    if (c.path.filename() != kLegacyCheckpointName) numbered.push_back(c);
  for (size_t i = 0; i + static_cast<size_t>(limit) < numbered.size(); ++i) {
    std::error_code error;
    for (const char* suffix : {"", ".old", ".partial"}) fs::remove_all(numbered[i].path.string() + suffix, error);
    removed.push_back(numbered[i].path);
  }
  return removed;
}

OutputDirLock::OutputDirLock(const fs::path& out) : out_(out) {
  std::error_code error;
  created_ = !fs::exists(out, error);
  fs::create_directories(out, error);
  MT_USER_CHECK(!error, "--out {}: cannot create the folder: {}", out.string(), error.message());
  const fs::path path = out / kOutputLockName;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  MT_USER_CHECK(fd_ >= 0, "--out {}: cannot open its lock file {}: {}", out.string(), path.string(),
                system_error_text(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int lock_error = errno;
    ::close(fd_);
    fd_ = -1;
    if (lock_error == EWOULDBLOCK) {
      std::string holder;
      try {
        holder = read_file(path);
      } catch (const Error&) {
      }
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
      mt_fail("--out {}: another memtune run (pid {}) is writing into this folder ({} is locked); wait for it to "
              "end or choose another --out", out.string(), holder.empty() ? "unknown" : holder, path.string());
    }
    mt_fail("--out {}: cannot lock {}: {}", out.string(), path.string(), system_error_text(lock_error));
  }
  // The holder's pid, for the message another run gets; the lock itself is the flock.
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] const ssize_t written = ::pwrite(fd_, pid.data(), pid.size(), 0);
  }
}

OutputDirLock::~OutputDirLock() {
  if (fd_ < 0) return;
  // A run that made OUT and wrote nothing into it (refused before its first file) leaves no
  // folder behind: the lock file goes while it is still held, then the empty folder.
  std::error_code error;
  if (created_) {
    bool only_lock = true;
    for (const fs::directory_entry& entry : fs::directory_iterator(out_, error))
      if (entry.path().filename() != kOutputLockName) only_lock = false;
    if (!error && only_lock && fs::remove(out_ / kOutputLockName, error)) fs::remove(out_, error);
  }
  ::close(fd_);  // drops the flock
}

std::vector<std::string> prepare_output_dir(const fs::path& out, bool overwrite, bool resuming) {
  std::vector<std::string> removed;
  std::error_code error;
  if (resuming || !fs::is_directory(out, error)) return removed;
  std::vector<std::string> present;
  for (const fs::directory_entry& entry : fs::directory_iterator(out, error))
    if (entry.path().filename() != kOutputLockName) present.push_back(entry.path().filename().string());
  std::sort(present.begin(), present.end());
  if (present.empty()) return removed;
  if (!overwrite) {
    std::string listed;
    for (size_t i = 0; i < present.size() && i < 4; ++i) listed += (i ? ", " : "") + present[i];
    if (present.size() > 4) listed += fmt::format(" and {} more", present.size() - 4);
    const bool has_checkpoint = !list_checkpoints(out).empty();
    mt_fail("--out {} is not empty ({}); a fresh run does not write over what is there: {}choose another --out, "
            "or pass --overwrite_output_dir to replace the previous run's adapter and checkpoints",
            out.string(), listed, has_checkpoint ? fmt::format("continue that run with --resume {}, ", out.string()) : "");
  }
  for (const std::string& name : present) {
    if (!is_training_output(name)) continue;
    fs::remove_all(out / name, error);
    MT_USER_CHECK(!error, "--overwrite_output_dir: cannot remove {}: {}", (out / name).string(), error.message());
    removed.push_back(name);
  }
  return removed;
}

}  // namespace memtune
