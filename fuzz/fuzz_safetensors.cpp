// libFuzzer entry point for the safetensors reader (fuzz/README.md says how to build and run).
//
// The property: any byte string either parses into tensors whose views lie inside the input, or
// is refused with memtune::Error. Anything else (a crash, a sanitizer report, another exception
// type, an abort) is a bug. A file that parses must also survive a round trip through the
// writer unchanged, so that what memtune saves is what it read.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/io/safetensors.h"

namespace {

// Reads every byte of every tensor, so that a view reaching outside the input is caught by
// AddressSanitizer; the sum keeps the reads from being optimised away.
uint64_t touch_tensor_bytes(const memtune::SafetensorsFile& file, const uint8_t* input,
                            size_t size) {
  uint64_t sum = 0;
  for (const memtune::SafetensorsTensor& tensor : file.tensors()) {
    if (tensor.nbytes > 0 && (tensor.data < input || tensor.data + tensor.nbytes > input + size)) {
      std::abort();
    }
    for (size_t i = 0; i < tensor.nbytes; ++i) sum += tensor.data[i];
  }
  return sum;
}

void check_round_trip(const memtune::SafetensorsFile& file) {
  std::vector<memtune::SafetensorsWriteEntry> entries;
  entries.reserve(file.tensors().size());
  for (const memtune::SafetensorsTensor& tensor : file.tensors()) {
    entries.push_back({tensor.name, tensor.dtype, tensor.shape, tensor.data});
  }
  const std::string bytes = memtune::serialize_safetensors(entries, file.metadata());
  const memtune::SafetensorsFile again = memtune::SafetensorsFile::parse(
      reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "round trip");
  if (again.tensors().size() != file.tensors().size() || again.metadata() != file.metadata()) {
    std::abort();
  }
  for (size_t i = 0; i < file.tensors().size(); ++i) {
    const memtune::SafetensorsTensor& a = file.tensors()[i];
    const memtune::SafetensorsTensor& b = again.tensors()[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.nbytes != b.nbytes ||
        (a.nbytes > 0 && std::memcmp(a.data, b.data, a.nbytes) != 0)) {
      std::abort();
    }
  }
}

volatile uint64_t g_sink;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // libFuzzer may pass a null pointer for the empty input.
  static const uint8_t kEmpty[1] = {0};
  const uint8_t* bytes = data != nullptr ? data : kEmpty;
  try {
    const memtune::SafetensorsFile file =
        memtune::SafetensorsFile::parse(bytes, size, "fuzz input");
    g_sink = touch_tensor_bytes(file, bytes, size);
    for (const memtune::SafetensorsTensor& tensor : file.tensors()) {
      if (file.find(tensor.name) != &tensor) std::abort();
    }
    check_round_trip(file);
  } catch (const memtune::Error&) {
    // Refusing a malformed file is the expected outcome.
  }
  return 0;
}
