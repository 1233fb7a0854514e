// Model presets (configs/models/*.json), embedded in the binary at build time.
#pragma once

#include <string>
#include <vector>

namespace memtune {

struct EmbeddedPreset {
  const char* name;
  const char* config_json;
};
const std::vector<EmbeddedPreset>& embedded_presets();

}  // namespace memtune
