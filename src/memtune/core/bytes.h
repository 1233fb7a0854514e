// Byte counts as people write them: "24GiB", "512 MiB", "8GB", "1234".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace memtune {

constexpr uint64_t kKiB = 1024, kMiB = kKiB * 1024, kGiB = kMiB * 1024;

std::string format_bytes(uint64_t bytes);  // "1.50 GiB", "12.0 MiB", "512 B"
// Throws memtune::Error on text that is not a byte count. Decimal units (KB, MB, GB) are powers
// of 1000, binary units (KiB, MiB, GiB) powers of 1024.
uint64_t parse_bytes(std::string_view text);

}  // namespace memtune
