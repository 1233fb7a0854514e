// Where the tests' files are (tests/fixtures/, configs/, examples/, and shared/data beside the
// checkout), on the build machine and on a machine that got a copy of the checkout at another path
// (a device run carries the tree and a binary folder such as .devbin/). Every test that reads such
// a file asks here, so that a missing one fails with its full path, not later as "json parse
// error: unexpected end of input" from a parser that read nothing.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <system_error>

#include "memtune/io/json_util.h"

namespace memtune::test {

// The checkout root: $MEMTUNE_SOURCE_DIR when set; else the first folder above the test binary
// that holds tests/fixtures (the binary sits in build/ or .devbin/ of a copied tree); else the
// path the tests were compiled in. The compiled-in path comes last because on another machine it
// may name a different, or no, checkout.
inline std::filesystem::path source_root() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("MEMTUNE_SOURCE_DIR"); env != nullptr && *env != '\0') return env;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path(); dir = dir.parent_path()) {
      if (fs::is_directory(dir / "tests" / "fixtures", ec)) return dir;
    }
  }
#ifdef MEMTUNE_SOURCE_DIR
  return MEMTUNE_SOURCE_DIR;
#else
  throw std::runtime_error("tests: cannot find the checkout's tests/fixtures; set MEMTUNE_SOURCE_DIR");
#endif
}

// A file or folder of the checkout (e.g. "configs/models/tiny.json"), which must exist.
inline std::filesystem::path source_path(const std::string& relative) {
  const std::filesystem::path path = source_root() / relative;
  if (!std::filesystem::exists(path)) {
    throw std::runtime_error("tests: missing " + path.string() +
                             " (set MEMTUNE_SOURCE_DIR to the checkout that holds it)");
  }
  return path;
}

// A fixture's path under tests/fixtures/, which must exist.
inline std::filesystem::path fixture_path(const std::string& relative) {
  return source_path("tests/fixtures/" + relative);
}

// tests/fixtures/golden/<name>: a golden case from tools/make_golden.py.
inline std::filesystem::path golden_dir(const std::string& name) { return fixture_path("golden/" + name); }

// tests/fixtures/<relative>, parsed as JSON (io/json_util.h: a missing or broken file fails with
// its path).
inline nlohmann::json read_json_fixture(const std::string& relative) { return read_json_file(fixture_path(relative)); }

}  // namespace memtune::test
