// Helpers shared by the report and experiment tests (defined in report_test_util.cpp): fixtures, a
// CSV reader, and XML well-formedness checks.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace memtune::report_test {

// tests/fixtures/report/<name>, parsed.
nlohmann::json load_fixture(std::string_view name);
// RFC 4180 rows and fields.
std::vector<std::vector<std::string>> parse_csv(std::string_view text);
// "" for well-formed XML, else what is wrong.
std::string xml_well_formedness_error(std::string_view xml);
// 0 when python3 parsed the file with xml.dom.minidom, 1 when it failed, -1 when there is no
// python3 with xml.dom.minidom on this machine.
int python_minidom_check(const std::filesystem::path& file);

// How often `needle` occurs in `haystack`, overlapping occurrences included.
inline size_t count_of(std::string_view haystack, std::string_view needle) {
  size_t count = 0;
  for (size_t pos = haystack.find(needle); pos != std::string_view::npos; pos = haystack.find(needle, pos + 1)) ++count;
  return count;
}

}  // namespace memtune::report_test
