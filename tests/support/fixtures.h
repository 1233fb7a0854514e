// Where the tests' fixture files are, on the build machine and on a machine that got a copy of the
// checkout at another path (a device run carries the tree and a binary folder such as .devbin/).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

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

// A fixture's path under tests/fixtures/, which must exist: a missing one fails with its path
// instead of surfacing later as "unexpected end of input" from a parser reading nothing.
inline std::filesystem::path fixture_path(const std::string& relative) {
  const std::filesystem::path path = source_root() / "tests" / "fixtures" / relative;
  if (!std::filesystem::exists(path)) {
    throw std::runtime_error("tests: missing fixture " + path.string() +
                             " (set MEMTUNE_SOURCE_DIR to the checkout that holds tests/fixtures)");
  }
  return path;
}

}  // namespace memtune::test
