// The output folder of `memtune train` (--out / --output_dir), laid out as transformers' Trainer
// lays out its output_dir:
//
//   OUT/adapter/             the final adapter (PEFT format)
//   OUT/checkpoint-<step>/   resumable checkpoints (adapter, optimizer, trainer_state.json); with
//                            --save_total_limit N only the newest N are kept
//   OUT/.memtune.lock        held (flock) by the run writing into OUT
//
// A fresh run refuses a folder that already holds something (another run's checkpoints would
// be mixed with its own, and a later --resume OUT would pick the wrong one) unless told to
// overwrite it. Earlier memtune versions wrote a single OUT/checkpoint/ folder, replaced at
// every save; it still resumes, by its path or as the latest checkpoint of OUT.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace memtune {

inline constexpr const char* kOutputLockName = ".memtune.lock";

// OUT/checkpoint-<step>.
std::filesystem::path checkpoint_dir_for_step(const std::filesystem::path& out, int64_t step);

struct CheckpointFolder {
  int64_t step = 0;
  std::filesystem::path path;  // what --resume takes (load_checkpoint finds an interrupted swap's .old)
};

// The complete checkpoints in `out`, oldest first: checkpoint-<step> folders whose
// trainer_state.json exists (in the folder, or in its .old twin when a save was interrupted
// between its two renames), and the older single checkpoint/ folder (its step read from its
// trainer_state.json).
std::vector<CheckpointFolder> list_checkpoints(const std::filesystem::path& out);

// Where a checkpoint's files are: `dir`, or its .old twin when a save into `dir` was interrupted
// between its two renames (the last complete checkpoint then). memtune::Error when neither is
// complete.
std::filesystem::path complete_checkpoint_folder(const std::filesystem::path& dir);

// --resume's argument as a checkpoint folder: a checkpoint folder as it is, an output folder as
// its newest checkpoint. memtune::Error when it is neither.
std::filesystem::path resolve_resume_folder(const std::filesystem::path& requested);

// Removes the oldest checkpoint-<step> folders of `out` until `limit` remain (limit <= 0: keeps
// every one), as transformers' save_total_limit does. Returns the removed folders.
std::vector<std::filesystem::path> rotate_checkpoints(const std::filesystem::path& out, int64_t limit);

// Holds an exclusive flock on OUT/.memtune.lock (creating OUT when needed) so that two runs
// cannot write into one folder at once. The kernel releases it when the descriptor closes:
// on destruction, and however the process ends (a SIGKILL too), so a stale lock never blocks.
// A folder that it made and that holds nothing but the lock at destruction is removed.
class OutputDirLock {
 public:
  // memtune::Error when another process holds the lock (naming its pid) or OUT cannot be made.
  explicit OutputDirLock(const std::filesystem::path& out);
  ~OutputDirLock();
  OutputDirLock(const OutputDirLock&) = delete;
  OutputDirLock& operator=(const OutputDirLock&) = delete;

 private:
  std::filesystem::path out_;
  bool created_ = false;  // OUT did not exist before: removed again if the run writes nothing into it
  int fd_ = -1;
};

// Before a run writes into `out` (under its lock): a resumed run may write into a folder that
// holds checkpoints. A fresh run needs a folder with nothing in it but the lock (memtune::Error
// saying what is there and what to do otherwise), unless `overwrite` (transformers'
// overwrite_output_dir): then the previous run's adapter/ and checkpoint folders are removed,
// and their names returned, so that no checkpoint of that run is taken for one of this run.
std::vector<std::string> prepare_output_dir(const std::filesystem::path& out, bool overwrite, bool resuming);

}  // namespace memtune
