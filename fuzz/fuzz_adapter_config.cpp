// libFuzzer entry point for a PEFT adapter_config.json (parse_peft_adapter_config, the reader
// train --init-adapter, eval, merge and generate share; fuzz/README.md).
//
// The property: any byte string is either refused with memtune::Error, or gives a LoRA config
// with a positive rank and at least one target, which equals itself under
// lora_config_differences and which a run can adopt (adopt_adapter_lora_config) with nothing
// given on the command line. Anything else is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "memtune/core/error.h"
#include "memtune/io/json_util.h"
#include "memtune/lora/lora_config.h"
#include "memtune/lora/merge.h"
#include "memtune/train/run_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), data != nullptr ? size : 0);
  try {
    const memtune::LoraConfig config = memtune::parse_peft_adapter_config(
        memtune::parse_json_text(text, "fuzz adapter_config.json"), "fuzz adapter_config.json");
    if (config.r <= 0 || config.targets.empty()) std::abort();
    if (!memtune::lora_config_differences(config, config).empty()) std::abort();
    memtune::RunConfig run;
    memtune::adopt_adapter_lora_config(run, config, {}, "fuzz");
    if (!memtune::lora_config_differences(run.lora_config(), config).empty()) std::abort();
    run.validate();  // alpha, dropout and r out of range are refused here, with memtune::Error
  } catch (const memtune::Error&) {
    // Refusing a malformed or unsupported config is the expected outcome.
  }
  return 0;
}
