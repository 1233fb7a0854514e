// libFuzzer entry point for the training data reader (read_dataset: JSONL of text,
// prompt/completion, messages or input_ids/labels lines; fuzz/README.md).
//
// The input goes through the stream overload of the reader (the file overload only opens the
// file and hands its stream over), so nothing touches the disk. The property: the file is
// either refused with memtune::Error, or gives samples whose ids lie in the model's vocabulary, whose labels are as long as the ids (each an id or -100) and no
// longer than max_seq_length, with at least one trained target each. The first byte picks the
// options (bad-line policy, loss masking), so both paths are explored. Anything else is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "memtune/core/error.h"
#include "memtune/data/sft_dataset.h"
#include "memtune/data/tokenizer.h"

namespace {

constexpr int64_t kVocab = 300;  // the byte tokenizer's ids fit; larger input_ids are refused
constexpr int64_t kMaxSeq = 64;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const memtune::Tokenizer tokenizer = memtune::Tokenizer::byte_level();
  memtune::DatasetOptions options;
  options.on_bad_line = (data[0] & 1) ? memtune::BadLinePolicy::skip : memtune::BadLinePolicy::error;
  options.completion_only_loss = (data[0] & 2) != 0;
  options.assistant_only_loss = (data[0] & 4) != 0;
  options.max_seq_length = kMaxSeq;
  std::istringstream input(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  try {
    const memtune::Dataset dataset = memtune::read_dataset(input, "fuzz.jsonl", tokenizer, kVocab, options);
    for (const memtune::Sample& sample : dataset.samples) {
      if (sample.input_ids.size() != sample.labels.size() || static_cast<int64_t>(sample.input_ids.size()) > kMaxSeq)
        std::abort();
      for (int32_t id : sample.input_ids)
        if (id < 0 || id >= kVocab) std::abort();
      for (int32_t label : sample.labels)
        if (label != -100 && (label < 0 || label >= kVocab)) std::abort();
      if (memtune::trained_targets(sample) == 0) std::abort();
    }
  } catch (const memtune::Error&) {
    // Refusing a malformed dataset is the expected outcome.
  }
  return 0;
}
