// The tokenizer tests' data: the real Llama 3 tokenizer (shared/data/llama3-tokenizer, beside the
// checkout: CI clones the repo with shared/ next to it), the small fixtures under
// tests/fixtures/tokenizer, and JSON lines reading.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

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

}  // namespace memtune::test
