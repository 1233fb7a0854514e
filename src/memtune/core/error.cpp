#include "memtune/core/error.h"

#include <cstdio>
#include <cstdlib>

namespace memtune {

void assert_failed(const char* expression, const char* file, int line, const std::string& message) {
  std::fprintf(stderr, "memtune: internal error at %s:%d: %s%s%s\n", file, line, expression,
               message.empty() ? "" : ": ", message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace memtune
