// libFuzzer entry point for run YAMLs (apply_run_yaml_text, `--config`; fuzz/README.md).
//
// The property: any byte string is either refused with memtune::Error, or gives a RunConfig that
// validate() accepts, whose numbers are the finite, in-range values that the planner and the
// optimizer rely on; the same text applied twice names the same options. Anything else (a
// crash, a sanitizer report, another exception type such as yaml-cpp's) is a bug.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "memtune/core/error.h"
#include "memtune/train/run_config.h"
#include "memtune/train/yaml_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), data != nullptr ? size : 0);
  try {
    memtune::RunConfig run;
    const auto keys = memtune::apply_run_yaml_text(text, "fuzz run.yaml", run);
    run.validate();  // what every command does with the result
    using memtune::RunConfig;
    if (!(run.max_seq_length > 1 && run.max_seq_length <= RunConfig::kMaxSeqLength) ||
        !(run.per_device_train_batch_size > 0 && run.gradient_accumulation_steps > 0) ||
        !(run.lora_r > 0 && run.lora_r <= RunConfig::kMaxLoraRank) || !std::isfinite(run.lora_alpha) ||
        !std::isfinite(run.learning_rate) || !std::isfinite(run.adam_epsilon) || !std::isfinite(run.weight_decay) ||
        std::isnan(run.max_grad_norm) || !(run.ddp_bucket_cap_mb > 0 && run.ddp_bucket_cap_mb <= RunConfig::kMaxBucketCapMb) ||
        run.stream_layers < 0 || keys.size() > 64)
      std::abort();
    memtune::RunConfig again = run;
    if (memtune::apply_run_yaml_text(text, "fuzz run.yaml", again) != keys) std::abort();
  } catch (const memtune::Error&) {
    // Refusing a malformed run config is the expected outcome.
  }
  return 0;
}
