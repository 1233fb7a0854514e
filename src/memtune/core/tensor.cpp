#include "memtune/core/tensor.h"

#include <fmt/format.h>

#include "memtune/core/enum_names.h"

namespace memtune {

namespace {

constexpr EnumName<Device> kDeviceNames[] = {{Device::cpu, "cpu"}, {Device::cuda, "cuda"}, {Device::meta, "meta"}};

}  // namespace

std::string_view device_name(Device device) { return name_of(kDeviceNames, device); }

std::string Shape::str() const {
  std::string out = "[";
  for (int i = 0; i < ndim; ++i) out += fmt::format("{}{}", i ? ", " : "", dims[i]);
  return out + "]";
}

}  // namespace memtune
