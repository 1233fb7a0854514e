#include "memtune/core/bytes.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <cstdlib>

#include "memtune/core/error.h"

namespace memtune {

std::string format_bytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= kGiB) return fmt::format("{:.2f} GiB", b / kGiB);
  if (bytes >= kMiB) return fmt::format("{:.1f} MiB", b / kMiB);
  if (bytes >= kKiB) return fmt::format("{:.1f} KiB", b / kKiB);
  return fmt::format("{} B", bytes);
}

uint64_t parse_bytes(std::string_view text) {
  std::string s(text);
  size_t pos = 0;
  while (pos < s.size() && std::isspace(static_cast<unsigned char>(s[pos]))) ++pos;
  size_t number_end = pos;
  while (number_end < s.size() &&
         (std::isdigit(static_cast<unsigned char>(s[number_end])) || s[number_end] == '.'))
    ++number_end;
  MT_USER_CHECK(number_end > pos, "'{}' is not a byte count (expected e.g. 24GiB)", text);
  char* parse_end = nullptr;
  const std::string number_text = s.substr(pos, number_end - pos);
  const double number = std::strtod(number_text.c_str(), &parse_end);
  MT_USER_CHECK(parse_end == number_text.c_str() + number_text.size() && std::isfinite(number),
                "'{}' is not a byte count", text);
  std::string unit;
  for (size_t i = number_end; i < s.size(); ++i)
    if (!std::isspace(static_cast<unsigned char>(s[i])))
      unit += static_cast<char>(std::tolower(static_cast<unsigned char>(s[i])));
  double multiplier = 0;
  if (unit.empty() || unit == "b") multiplier = 1;
  else if (unit == "kib" || unit == "k") multiplier = kKiB;
  else if (unit == "mib" || unit == "m") multiplier = kMiB;
  else if (unit == "gib" || unit == "g") multiplier = kGiB;
  else if (unit == "tib" || unit == "t") multiplier = 1024.0 * kGiB;
  else if (unit == "kb") multiplier = 1e3;
  else if (unit == "mb") multiplier = 1e6;
  else if (unit == "gb") multiplier = 1e9;
  else if (unit == "tb") multiplier = 1e12;
  MT_USER_CHECK(multiplier > 0, "unknown byte unit '{}' in '{}' (use B, KiB, MiB, GiB, KB, MB, GB)",
                unit, text);
  const double value = number * multiplier;
  MT_USER_CHECK(value < 1.8e19, "byte count '{}' is too large", text);
  return static_cast<uint64_t>(std::llround(value));
}

}  // namespace memtune
