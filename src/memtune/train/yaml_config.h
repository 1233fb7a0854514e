// Run YAMLs in Hugging Face names (configs/runs/*.yaml). Resolution order: defaults, then the
// YAML file, then command-line flags.
#pragma once

#include <filesystem>
#include <set>
#include <string>

#include "memtune/train/run_config.h"

namespace memtune {

// Applies the file's keys to `run` and returns them (what the user set, as opposed to the
// defaults). Unknown keys and wrong types are errors naming the key.
std::set<std::string> apply_run_yaml(const std::filesystem::path& path, RunConfig& run);

// The same for a YAML text; `name` stands for the file in the errors.
std::set<std::string> apply_run_yaml_text(const std::string& text, const std::string& name, RunConfig& run);

}  // namespace memtune
