// Checking what went wrong: the text of a memtune::Error, and that a message says something.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "memtune/core/error.h"

// Expects `needle` somewhere in `haystack` (both anything a std::string is made from), and shows
// the whole haystack when it is not. Evaluates its arguments once: they are often calls that are
// expected to throw.
#define EXPECT_CONTAINS(haystack, needle)                                        \
  do {                                                                           \
    const std::string contains_haystack_ = (haystack);                           \
    const std::string contains_needle_ = (needle);                               \
    EXPECT_NE(contains_haystack_.find(contains_needle_), std::string::npos)      \
        << "expected \"" << contains_needle_ << "\" in: " << contains_haystack_; \
  } while (0)

namespace memtune::test {

// The message of the memtune::Error that `action` throws; a test failure (and "") when it throws
// none.
inline std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  ADD_FAILURE() << "expected memtune::Error";
  return "";
}

// The message of the memtune::Error that `action` throws, or "" when it throws none: for checks
// that expect either.
inline std::string error_or_empty(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

}  // namespace memtune::test
