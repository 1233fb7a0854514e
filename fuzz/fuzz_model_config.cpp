// libFuzzer entry point for config.json (LlamaConfig::from_json, fuzz/README.md).
//
// The property: any byte string is either refused with memtune::Error, or gives a config whose
// sizes are within the limits the planner's byte counts rely on, and which survives a round
// trip through to_json unchanged. Anything else (a crash, a sanitizer report, another exception
// type) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "memtune/core/error.h"
#include "memtune/io/json_util.h"
#include "memtune/model/llama_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), data != nullptr ? size : 0);
  try {
    const memtune::LlamaConfig config =
        memtune::LlamaConfig::from_json(memtune::parse_json_text(text, "fuzz config.json"), "fuzz config.json");
    if (config.hidden_size <= 0 || config.hidden_size > (int64_t{1} << 17) || config.num_hidden_layers > 1024 ||
        config.vocab_size > (int64_t{1} << 24) || config.head_dim <= 0 || config.head_dim % 2 != 0 ||
        config.num_attention_heads % config.num_key_value_heads != 0)
      std::abort();
    const memtune::LlamaConfig again = memtune::LlamaConfig::from_json(config.to_json(), "round trip");
    if (again.to_json() != config.to_json()) std::abort();
    (void)memtune::rope_inv_freq(config);
  } catch (const memtune::Error&) {
    // Refusing a malformed config is the expected outcome.
  }
  return 0;
}
