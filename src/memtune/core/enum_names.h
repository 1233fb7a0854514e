#pragma once
// One table of (value, name) pairs an enum, read both ways: the name of a value for messages and
// files, and the value of a name that a user typed or a file holds. Each enum's names are written
// once, in its table, and every to-string and from-string of that enum reads the same table.
//
//   constexpr EnumName<Device> kDeviceNames[] = {{Device::cpu, "cpu"}, {Device::cuda, "cuda"}};
//   name_of(kDeviceNames, Device::cuda)   -> "cuda"
//   value_of(kDeviceNames, "cpu")         -> Device::cpu (std::nullopt for a name not listed)
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace memtune {

template <typename Enum>
struct EnumName {
  Enum value;
  std::string_view name;
};

template <typename Enum, size_t N>
constexpr std::string_view name_of(const EnumName<Enum> (&table)[N], Enum value, std::string_view unknown = "?") {
  for (const EnumName<Enum>& entry : table)
    if (entry.value == value) return entry.name;
  return unknown;
}

template <typename Enum, size_t N>
constexpr std::optional<Enum> value_of(const EnumName<Enum> (&table)[N], std::string_view name) {
  for (const EnumName<Enum>& entry : table)
    if (entry.name == name) return entry.value;
  return std::nullopt;
}

// "a, b or c": the names a table accepts, for an error message.
template <typename Enum, size_t N>
std::string names_of(const EnumName<Enum> (&table)[N]) {
  std::string out;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) out += i + 1 == N ? " or " : ", ";
    out += table[i].name;
  }
  return out;
}

}  // namespace memtune
