// Tokenizer throughput: encode ~10 MB of text line by line on one thread, best of 3.
//
// The peer is tools/bench_tokenizer_hf.py (HF tokenizers, RAYON_NUM_THREADS=1), which builds
// the same lines the same way and encodes each with Tokenizer.encode; both print the token
// total, so a run also shows that both did the same work.
//
// Usage (from the repository root):
//   bench_tokenizer [--tokenizer ../shared/data/llama3-tokenizer/tokenizer.json]
//                   [--text FILE | --corpus tests/fixtures/tokenizer/corpus.jsonl] [--mb 10]
// Lines are the text split on '\n' (the corpus: its strings joined by '\n'), repeated in order
// until they hold at least --mb * 10^6 bytes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/data/tokenizer.h"
#include "memtune/io/file_util.h"

namespace {

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (true) {
    const size_t end = text.find('\n', start);
    if (end == std::string::npos) {
      lines.push_back(text.substr(start));
      return lines;
    }
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
}

std::string corpus_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MT_USER_CHECK(in.good(), "cannot open {}", path);
  std::string line, joined;
  bool first = true;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (!first) joined += '\n';
    joined += nlohmann::json::parse(line)["text"].get<std::string>();
    first = false;
  }
  return joined;
}

int run(int argc, char** argv) {
  std::string tokenizer_path = "../shared/data/llama3-tokenizer/tokenizer.json";
  std::string corpus_path = "tests/fixtures/tokenizer/corpus.jsonl";
  std::string text_path;
  double megabytes = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    MT_USER_CHECK(i + 1 < argc, "{} needs a value", arg);
    if (arg == "--tokenizer") {
      tokenizer_path = argv[++i];
    } else if (arg == "--text") {
      text_path = argv[++i];
    } else if (arg == "--corpus") {
      corpus_path = argv[++i];
    } else if (arg == "--mb") {
      megabytes = std::stod(argv[++i]);
    } else {
      memtune::mt_fail("unknown argument {}", arg);
    }
  }
  const auto load_start = std::chrono::steady_clock::now();
  const memtune::Tokenizer tokenizer = memtune::Tokenizer::from_file(tokenizer_path);
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();

  const std::string source = text_path.empty() ? corpus_text(corpus_path)
                                               : memtune::read_file(text_path);
  const std::vector<std::string> base = split_lines(source);
  MT_USER_CHECK(source.size() > base.size() - 1, "the benchmark text has no bytes but newlines");
  std::vector<std::string> lines;
  size_t bytes = 0;
  const auto target = size_t(megabytes * 1e6);
  while (bytes < target) {
    for (const std::string& line : base) {
      lines.push_back(line);
      bytes += line.size();
    }
  }

  double best_s = 1e30;
  size_t tokens = 0;
  for (int round = 0; round < 3; ++round) {
    tokens = 0;
    const auto start = std::chrono::steady_clock::now();
    for (const std::string& line : lines) tokens += tokenizer.encode(line).size();
    best_s = std::min(
        best_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf("memtune tokenizer, 1 thread\n");
  std::printf("  text:     %s\n", text_path.empty() ? corpus_path.c_str() : text_path.c_str());
  std::printf("  lines:    %zu, bytes %zu, tokens %zu\n", lines.size(), bytes, tokens);
  std::printf("  load:     %.3f s\n", load_s);
  std::printf("  encode:   best of 3 %.3f s = %.2f MB/s, %.2f M tokens/s\n", best_s,
              double(bytes) / best_s / 1e6, double(tokens) / best_s / 1e6);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const memtune::Error& error) {
    std::fprintf(stderr, "bench_tokenizer: %s\n", error.what());
    return 1;
  }
}
