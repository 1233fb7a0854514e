// A report's files, written into their folder.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace memtune {

// Creates out_dir if needed and writes each (file name, text) into it atomically. `what` names the
// folder in the error when it cannot be created ("report", "sweep"). Render everything before the
// call, so that a report that fails validation writes nothing.
void write_output_files(const std::filesystem::path& out_dir, std::string_view what,
                        const std::vector<std::pair<std::string, std::string>>& files);

}  // namespace memtune
