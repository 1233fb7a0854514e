// A tensor is a non-owning, contiguous, row-major view: a pointer, a dtype, a shape and the
// device that the pointer belongs to. Memory is owned by arenas (core/memory.h) or by the caller.
// On the meta device the pointer is a placeholder that is never dereferenced: the planner runs
// the step without data.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "memtune/core/dtype.h"
#include "memtune/core/error.h"

namespace memtune {

enum class Device : uint8_t { cpu, cuda, meta };
std::string_view device_name(Device device);

struct Shape {
  static constexpr int kMaxDims = 4;
  std::array<int64_t, kMaxDims> dims{};
  int ndim = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> list) {
    MT_ASSERT(list.size() <= kMaxDims, "too many dims");
    for (int64_t d : list) dims[ndim++] = d;
  }
  int64_t operator[](int i) const { return dims[i]; }
  int64_t& operator[](int i) { return dims[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= dims[i];
    return n;
  }
  bool operator==(const Shape& other) const {
    if (ndim != other.ndim) return false;
    for (int i = 0; i < ndim; ++i)
      if (dims[i] != other.dims[i]) return false;
    return true;
  }
  bool operator!=(const Shape& other) const { return !(*this == other); }
  std::string str() const;  // "[2, 3]"
};

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  Device device = Device::cpu;

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape[i < 0 ? shape.ndim + i : i]; }
  // Rows of a 2-D view of the tensor: all dims but the last folded together.
  int64_t rows() const { return shape.ndim == 0 ? 1 : numel() / shape[shape.ndim - 1]; }
  int64_t cols() const { return shape.ndim == 0 ? 1 : shape[shape.ndim - 1]; }
  bool empty() const { return data == nullptr; }  // "no tensor" (optional arguments)

  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  // Same memory, another shape with the same element count.
  Tensor view(Shape new_shape) const {
    MT_ASSERT(new_shape.numel() == numel(), "view {} of {}", new_shape.str(), shape.str());
    Tensor t = *this;
    t.shape = new_shape;
    return t;
  }
  // Rows [begin, end) of the leading dimension.
  Tensor slice_rows(int64_t begin, int64_t end) const {
    MT_ASSERT(shape.ndim >= 1 && begin >= 0 && end <= shape[0] && begin <= end, "bad slice");
    Tensor t = *this;
    const int64_t row_elems = shape[0] == 0 ? 0 : numel() / shape[0];
    if (data != nullptr) t.data = static_cast<char*>(data) + begin * row_elems * dtype_size(dtype);
    t.shape[0] = end - begin;
    return t;
  }
};

}  // namespace memtune
