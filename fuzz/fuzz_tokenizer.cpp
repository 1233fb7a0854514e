// libFuzzer entry point for tokenizer.json (Tokenizer::from_json_text, fuzz/README.md).
//
// The property: any byte string is either refused with memtune::Error, or gives a tokenizer
// that encodes a fixed set of texts (ASCII, multi-byte UTF-8, digits, whitespace runs, special
// tokens) to ids inside its vocabulary and decodes them again without failing. Anything else is
// a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "memtune/core/error.h"
#include "memtune/data/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), data != nullptr ? size : 0);
  try {
    const memtune::Tokenizer tokenizer = memtune::Tokenizer::from_json_text(text, "fuzz tokenizer.json");
    for (std::string_view sample : {"Hello, world!", "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac 12345 ", "  \n\t x",
                                    "<|begin_of_text|>hi<|eot_id|>", ""}) {
      for (const std::vector<int32_t>& ids : {tokenizer.encode(sample), tokenizer.encode_plain(sample)}) {
        for (int32_t id : ids)
          if (id < 0 || id >= tokenizer.vocab_size()) std::abort();
        (void)tokenizer.decode(ids, /*skip_special_tokens=*/false);
      }
    }
  } catch (const memtune::Error&) {
    // Refusing a malformed tokenizer.json is the expected outcome.
  }
  return 0;
}
