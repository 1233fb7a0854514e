// The tokenizer tests' data: the real Llama 3 tokenizer (shared/data/llama3-tokenizer, beside the
// checkout: CI clones the repo with shared/ next to it), the small fixtures under
// tests/fixtures/tokenizer (with the Qwen3 and Mistral tokenizers gzipped in qwen3/ and mistral/:
// see the README there), and JSON lines reading.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "memtune/data/chat_template.h"
#include "memtune/data/tokenizer.h"
#include "fixtures.h"

namespace memtune::test {

inline std::filesystem::path llama3_tokenizer_dir() {
  return source_root() / ".." / "shared" / "data" / "llama3-tokenizer";
}

inline std::filesystem::path tokenizer_fixture_dir() { return fixture_path("tokenizer"); }

// The real Llama 3 tokenizer, loaded once per test binary (it takes a fraction of a second).
// The data must be there: CI clones the repo with shared/ beside it, so a missing file is a
// broken checkout and fails loudly rather than skipping.
inline const Tokenizer& llama3_tokenizer() {
  static const Tokenizer* tokenizer = [] {
    const auto path = llama3_tokenizer_dir() / "tokenizer.json";
    if (!std::filesystem::exists(path)) {
      ADD_FAILURE() << "Llama 3 tokenizer data missing: " << path.string()
                    << " (expected shared/data/llama3-tokenizer beside the repository)";
      return static_cast<Tokenizer*>(nullptr);
    }
    return new Tokenizer(Tokenizer::from_file(path));
  }();
  if (tokenizer == nullptr) throw std::runtime_error("Llama 3 tokenizer data missing");
  return *tokenizer;
}

// A folder holding the family's tokenizer.json (gunzipped from tests/fixtures/tokenizer/<json_from>/
// tokenizer.json.gz) and the tokenizer_config.json of tests/fixtures/tokenizer/<config_from>/,
// made once per test process under the temporary directory.
inline std::filesystem::path family_tokenizer_dir(const std::string& json_from,
                                                  const std::string& config_from) {
  namespace fs = std::filesystem;
  // Removed when the test process exits.
  struct Root {
    fs::path path = fs::temp_directory_path() / ("memtune_tokenizers_" + std::to_string(::getpid()));
    ~Root() {
      std::error_code ignored;
      fs::remove_all(path, ignored);
    }
  };
  static const Root root;
  const fs::path dir = root.path / (json_from + "+" + config_from);
  if (fs::exists(dir / "tokenizer.json")) return dir;
  fs::create_directories(dir);
  const fs::path gz = tokenizer_fixture_dir() / json_from / "tokenizer.json.gz";
  if (!fs::exists(gz)) throw std::runtime_error("missing fixture " + gz.string());
  const std::string command =
      "gzip -dc '" + gz.string() + "' > '" + (dir / "tokenizer.json.part").string() + "'";
  if (std::system(command.c_str()) != 0) throw std::runtime_error("failed: " + command);
  fs::rename(dir / "tokenizer.json.part", dir / "tokenizer.json");
  fs::copy_file(tokenizer_fixture_dir() / config_from / "tokenizer_config.json",
                dir / "tokenizer_config.json", fs::copy_options::overwrite_existing);
  return dir;
}

// The real tokenizer of a family, loaded once per test binary: "qwen3" (the real Qwen3 files),
// "qwen2.5" (Qwen3's tokenizer.json, which Qwen2.5 shares but for four added tokens, with
// Qwen2.5-Instruct's chat template), "mistral" (Mistral 7B v0.3).
inline const Tokenizer& family_tokenizer(const std::string& family) {
  static std::map<std::string, Tokenizer> loaded;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(family);
  if (it == loaded.end()) {
    const std::string json_from = family == "qwen2.5" ? "qwen3" : family;
    it = loaded.emplace(family, Tokenizer::from_file(family_tokenizer_dir(json_from, family) /
                                                     "tokenizer.json"))
             .first;
  }
  return it->second;
}

inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open fixture " + path.string());
  std::vector<nlohmann::json> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  }
  return rows;
}

// "[1, 2, 3]": ids in a failure message.
inline std::string ids_to_string(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out + "]";
}

// The "ids" of a fixture row (tools/make_tokenizer_golden.py and make_golden.py's corpora).
inline std::vector<int32_t> ids_of(const nlohmann::json& row) { return row["ids"].get<std::vector<int32_t>>(); }

// Every row's "text" encodes to its HF "ids" (at least min_rows rows); each mismatch is
// reported with both id lists.
inline void expect_ids_match_fixture(const Tokenizer& tokenizer, const std::filesystem::path& fixture,
                                     size_t min_rows = 1) {
  const auto rows = read_jsonl(fixture);
  ASSERT_GE(rows.size(), min_rows) << fixture;
  size_t mismatches = 0;
  for (const nlohmann::json& row : rows) {
    const std::string text = row["text"];
    const auto expected = ids_of(row);
    const auto actual = tokenizer.encode(text);
    if (actual != expected) {
      ++mismatches;
      ADD_FAILURE() << "text " << nlohmann::json(text).dump() << "\n  HF:      " << ids_to_string(expected)
                    << "\n  memtune: " << ids_to_string(actual);
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << rows.size() << " strings in " << fixture;
}

// The messages of a chat fixture row ({"messages": [{"role", "content"}, ...]}).
inline std::vector<ChatMessage> messages_of(const nlohmann::json& row) {
  std::vector<ChatMessage> messages;
  for (const nlohmann::json& m : row["messages"]) messages.push_back({m["role"], m["content"]});
  return messages;
}

}  // namespace memtune::test
