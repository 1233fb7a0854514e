// Errors are values at the edges, aborts inside (DESIGN.md).
//  - memtune::Error: bad user input (config, data, files, flags). Caught in main(), printed,
//    non-zero exit. Throw it with MT_USER_CHECK / mt_fail.
//  - MT_ASSERT: a broken internal invariant. Prints file:line and aborts.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace memtune {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Args>
[[noreturn]] void mt_fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

[[noreturn]] void assert_failed(const char* expression, const char* file, int line,
                                const std::string& message);

}  // namespace memtune

#define MT_USER_CHECK(cond, ...)                  \
  do {                                            \
    if (!(cond)) ::memtune::mt_fail(__VA_ARGS__); \
  } while (0)

#define MT_ASSERT(cond, ...)                                                            \
  do {                                                                                  \
    if (!(cond))                                                                        \
      ::memtune::assert_failed(#cond, __FILE__, __LINE__, ::fmt::format("" __VA_ARGS__)); \
  } while (0)
