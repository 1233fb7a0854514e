// safetensors: reading (memory-mapped, validated), sharded checkpoints through
// model.safetensors.index.json, and writing (atomic, optionally sharded).
//
// Format (SPECS.md §5; safetensors README and safetensors/src/tensor.rs): a little-endian u64
// header length N, N bytes of JSON starting with '{', then the data buffer. Each header entry is
// {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, offsets relative to the
// buffer; an optional "__metadata__" maps strings to strings. N is at most 100,000,000. The
// tensors tile the buffer exactly: no holes, no overlaps, nothing after the last one.
//
// Every violation of that is a memtune::Error naming the file and, where there is one, the
// tensor; nothing a file contains can make the reader crash or read outside the file.
//
// Alignment: a tensor's data pointer is only as aligned as the writer made it. Files written
// here and by the Python package start the buffer at a multiple of 8, but tensors of mixed
// dtypes can still follow each other at odd offsets. Read elements with memcpy (or check the
// pointer) rather than casting data to float*.
//
// Room io/ (docs/ARCHITECTURE.md): files on disk; may include core/ only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "memtune/core/dtype.h"
#include "memtune/core/tensor.h"
#include "memtune/io/file_util.h"

namespace memtune {

using SafetensorsMetadata = std::map<std::string, std::string>;

inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;  // safetensors tensor.rs

// One tensor of a file: a view into the file's bytes, valid while the file (or the checkpoint
// holding it) lives.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
};

namespace detail {
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
using NameIndex = std::unordered_map<std::string, size_t, StringHash, std::equal_to<>>;
}  // namespace detail

class SafetensorsFile {
 public:
  // Maps the file and validates it.
  static SafetensorsFile open(const std::filesystem::path& path);
  // Validates bytes owned by the caller, who keeps them alive as long as the result.
  // `source_name` starts every error message.
  static SafetensorsFile parse(const uint8_t* bytes, size_t size, std::string source_name);

  // In the order their bytes lie in the file (data offset; header order among empty tensors).
  // Reading them in this order reads the file front to back.
  // The views die with the file: asking a temporary for them is a compile error.
  const std::vector<SafetensorsTensor>& tensors() const& { return tensors_; }
  const SafetensorsTensor* find(std::string_view name) const&;
  // memtune::Error naming the file when there is no such tensor.
  const SafetensorsTensor& get(std::string_view name) const&;
  void tensors() const&& = delete;
  void find(std::string_view name) const&& = delete;
  void get(std::string_view name) const&& = delete;
  const SafetensorsMetadata& metadata() const { return metadata_; }
  const std::string& source_name() const { return source_name_; }

  // Lets the kernel drop the resident pages behind a tensor once it has been converted (see
  // MappedFile::release_pages); a no-op for parse()d buffers, which the caller owns.
  void release_pages(const SafetensorsTensor& tensor) const;

 private:
  MappedFile mapping_;
  std::string source_name_;
  std::vector<SafetensorsTensor> tensors_;
  detail::NameIndex index_;
  SafetensorsMetadata metadata_;
};

// A model's weights as one file or as shards.
class SafetensorsCheckpoint {
 public:
  // `path` is one of:
  //  - a .safetensors file;
  //  - a *.index.json file (sharded; shard names are relative to its directory);
  //  - a directory holding model.safetensors.index.json (preferred, as transformers does),
  //    else model.safetensors, else exactly one *.safetensors file of another name
  //    (adapter_model.safetensors, say).
  static SafetensorsCheckpoint open(const std::filesystem::path& path);
  // `filename` inside `directory`: a .safetensors file or an index .json file.
  static SafetensorsCheckpoint open(const std::filesystem::path& directory,
                                    const std::string& filename);

  const SafetensorsTensor* find(std::string_view name) const&;
  // memtune::Error naming the checkpoint when there is no such tensor.
  const SafetensorsTensor& get(std::string_view name) const&;
  void find(std::string_view name) const&& = delete;
  void get(std::string_view name) const&& = delete;
  // Shard by shard (file name order), each in file order: the order that reads the disk once.
  const std::vector<std::string>& names() const { return names_; }
  size_t size() const { return names_.size(); }
  // The file that holds `name` (for messages); memtune::Error when there is no such tensor.
  const SafetensorsFile& file_of(std::string_view name) const;
  const std::vector<SafetensorsFile>& files() const { return files_; }
  // What was opened: the file, the index, or the directory.
  const std::string& source_name() const { return source_name_; }
  // __metadata__ of the first file (the same in every shard written by transformers or here).
  const SafetensorsMetadata& metadata() const;

 private:
  struct Location {
    size_t file;
    size_t tensor;
  };
  static SafetensorsCheckpoint open_single(const std::filesystem::path& file);
  static SafetensorsCheckpoint open_index(const std::filesystem::path& index_json);
  void add_file_tensors(size_t file, const std::function<bool(const std::string&)>& wanted);

  std::string source_name_;
  std::vector<SafetensorsFile> files_;
  std::vector<std::string> names_;
  std::vector<Location> locations_;  // parallel to names_
  detail::NameIndex index_;
};

// The tensor `name` with the dtype and shape the model expects, or memtune::Error such as
// "model.layers.0.self_attn.q_proj.weight: shape [64, 32] in file <path>, model expects [64, 64]".
const SafetensorsTensor& expect_tensor(const SafetensorsCheckpoint& checkpoint,
                                       std::string_view name, DType dtype, const Shape& shape);
// Any of `allowed_dtypes` (loading converts F32/F16/BF16 to the run's dtype).
const SafetensorsTensor& expect_tensor(const SafetensorsCheckpoint& checkpoint,
                                       std::string_view name, std::span<const DType> allowed_dtypes,
                                       const Shape& shape);
const SafetensorsTensor& expect_tensor(const SafetensorsCheckpoint& checkpoint,
                                       std::string_view name,
                                       std::initializer_list<DType> allowed_dtypes,
                                       const Shape& shape);

// Views into a temporary checkpoint would dangle.
void expect_tensor(const SafetensorsCheckpoint&& checkpoint, std::string_view name, DType dtype,
                   const Shape& shape) = delete;
void expect_tensor(const SafetensorsCheckpoint&& checkpoint, std::string_view name,
                   std::span<const DType> allowed_dtypes, const Shape& shape) = delete;
void expect_tensor(const SafetensorsCheckpoint&& checkpoint, std::string_view name,
                   std::initializer_list<DType> allowed_dtypes, const Shape& shape) = delete;

// One tensor to write. Its bytes come from `data` (numel * dtype_size bytes, host memory), or,
// when `data` is null, from `write_data`, which must write exactly that many bytes to the sink:
// that lets a multi-GB model be written from device memory one piece at a time.
struct SafetensorsWriteEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  const void* data = nullptr;
  std::function<void(FileSink&)> write_data = {};
};

// Bytes per tensor, checked for overflow; memtune::Error for negative dims.
uint64_t safetensors_entry_bytes(const SafetensorsWriteEntry& entry);

// The header keys are the entries in the given order, after "__metadata__" when `metadata` is
// not empty; the header is padded with spaces to a multiple of 8 bytes (as safetensors does) so
// that the buffer starts 8-aligned; the data follows in entry order with no gaps.
void serialize_safetensors(FileSink& sink, std::span<const SafetensorsWriteEntry> entries,
                           const SafetensorsMetadata& metadata = {});
std::string serialize_safetensors(std::span<const SafetensorsWriteEntry> entries,
                                  const SafetensorsMetadata& metadata = {});
// Atomically (write_file_atomic_streaming): a failed write leaves an existing file intact.
void write_safetensors(const std::filesystem::path& path,
                       std::span<const SafetensorsWriteEntry> entries,
                       const SafetensorsMetadata& metadata = {});

// Writes `entries` into `directory` (created if missing) as a single model.safetensors when
// their data fits in `max_shard_bytes`, else as model-00001-of-0000N.safetensors shards plus
// model.safetensors.index.json ({"metadata":{"total_size":...},"weight_map":{...}}), the layout
// transformers writes. Shards are filled greedily in entry order; a tensor larger than the
// limit gets a shard of its own. `metadata` goes into every file. Weight files left in the
// directory by an earlier save with another layout (model.safetensors, an index, shards of
// another count) are removed afterwards, so that opening the directory cannot find stale
// weights. Returns the files written, the index last.
std::vector<std::filesystem::path> write_sharded_safetensors(
    const std::filesystem::path& directory, std::span<const SafetensorsWriteEntry> entries,
    uint64_t max_shard_bytes, const SafetensorsMetadata& metadata = {});

}  // namespace memtune
