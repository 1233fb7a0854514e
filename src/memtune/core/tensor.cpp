#include "memtune/core/tensor.h"

#include <fmt/format.h>

namespace memtune {

std::string_view device_name(Device device) {
  switch (device) {
    case Device::cpu: return "cpu";
    case Device::cuda: return "cuda";
    case Device::meta: return "meta";
  }
  return "?";
}

std::string Shape::str() const {
  std::string out = "[";
  for (int i = 0; i < ndim; ++i) out += fmt::format("{}{}", i ? ", " : "", dims[i]);
  return out + "]";
}

}  // namespace memtune
