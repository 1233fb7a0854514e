// Shared pieces of the command-line tests: running memtune (or a shell script) as a user does,
// capturing its output and exit code, a fresh scratch folder per test, and the fixtures.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <cstring>
#include <string>
#include <vector>

#include "memtune/io/json_util.h"
#include "memtune/io/safetensors.h"
#include "../support/fixtures.h"

namespace memtune::clitest {

struct Result {
  int exit_code;
  std::string output;  // stdout and stderr together
};

// The records of a JSONL file (a --metrics log), one per line.
inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
  return records;
}

// Runs `script` in a subshell with stderr folded into stdout.
inline Result run_shell(const std::string& script) {
  std::FILE* pipe = popen(("(" + script + ") 2>&1").c_str(), "r");
  std::string output;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) output.append(buffer.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

inline std::string memtune_binary() { return std::string(MEMTUNE_BINARY_DIR) + "/memtune"; }

// The memtune binary of this build with the given arguments.
inline Result run_memtune(const std::string& args) { return run_shell(memtune_binary() + " " + args); }

// An empty folder under the build tree, removed and re-created on each call.
inline std::filesystem::path scratch_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(MEMTUNE_BINARY_DIR) / "cli_tests" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::filesystem::path golden(const std::string& name) { return test::golden_dir(name); }

// A golden case's batch (tests/fixtures/golden/<name>/batch.safetensors) as JSON lines of
// input_ids and labels at `path`, the form `memtune eval --data` reads; returns `path`.
inline std::filesystem::path write_golden_batch_jsonl(const std::string& name, const std::filesystem::path& path) {
  const SafetensorsFile batch = SafetensorsFile::open(golden(name) / "batch.safetensors");
  const auto& ids = batch.get("input_ids");
  const auto& labels = batch.get("labels");
  std::ofstream out(path);
  for (int64_t r = 0; r < ids.shape[0]; ++r) {
    nlohmann::json row_ids = nlohmann::json::array(), row_labels = nlohmann::json::array();
    for (int64_t t = 0; t < ids.shape[1]; ++t) {
      int32_t v;
      std::memcpy(&v, ids.data + 4 * (r * ids.shape[1] + t), 4);
      row_ids.push_back(v);
      std::memcpy(&v, labels.data + 4 * (r * ids.shape[1] + t), 4);
      row_labels.push_back(v);
    }
    out << nlohmann::json{{"input_ids", row_ids}, {"labels", row_labels}}.dump() << "\n";
  }
  return path;
}

}  // namespace memtune::clitest
