#include "memtune/io/safetensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <system_error>
#include <unordered_set>

#include "memtune/core/error.h"
#include "memtune/io/json_util.h"

namespace memtune {

namespace {

using nlohmann::json;

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian and is read and written as host bytes");

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kSupportedDtypes = "F32, F16, BF16, U8, I32";
// The format needs an object of entries holding arrays: containers opening deeper than this
// cannot be valid, and refusing them early keeps recursive JSON code (dump) off hostile input.
constexpr int kMaxHeaderNesting = 3;

// Names come from files and may hold quotes, newlines or megabytes: quote them JSON-style and
// cut them short so that a message stays one readable line.
std::string quoted_name(std::string_view name) {
  constexpr size_t kLimit = 160;
  std::string text = json(std::string(name.substr(0, kLimit)))
                         .dump(-1, ' ', false, json::error_handler_t::replace);
  if (name.size() > kLimit) text.insert(text.size() - 1, "...");
  return text;
}

struct ParsedHeader {
  json root;
  std::vector<std::string> top_level_keys;  // header order; the std::map in `root` sorts them
};

// nlohmann keeps the last of two equal keys without a word, so a file could carry two entries
// for one tensor and a reader would see only one of them; this callback refuses duplicates at
// every level, and records the header's own order of tensor names.
ParsedHeader parse_header_json(std::string_view text, const std::string& source) {
  ParsedHeader parsed;
  std::vector<std::unordered_set<std::string>> keys_of_open_objects;
  auto on_event = [&](int depth, json::parse_event_t event, json& value) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        MT_USER_CHECK(depth <= kMaxHeaderNesting,
                      "{}: header nests JSON deeper than safetensors entries can be", source);
        if (event == json::parse_event_t::object_start) keys_of_open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        keys_of_open_objects.pop_back();
        break;
      case json::parse_event_t::key: {
        std::string key = value.get<std::string>();
        if (depth == 1) {
          MT_USER_CHECK(!keys_of_open_objects.back().contains(key),
                        "{}: tensor {} appears twice in the header (duplicate name)", source,
                        quoted_name(key));
          parsed.top_level_keys.push_back(key);
        } else {
          MT_USER_CHECK(!keys_of_open_objects.back().contains(key),
                        "{}: key {} appears twice in one header entry (duplicate key)", source,
                        quoted_name(key));
        }
        keys_of_open_objects.back().insert(std::move(key));
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    parsed.root = json::parse(text.begin(), text.end(), on_event);
  } catch (const json::parse_error& error) {
    mt_fail("{}: header is not valid JSON at byte {} of the header: {}", source, error.byte,
            json_exception_reason(error));
  } catch (const json::exception& error) {
    // Not every rejection is a parse_error: a number too large for a double ("1e999") is
    // out_of_range (found by fuzz/fuzz_safetensors.cpp).
    mt_fail("{}: header is not valid JSON: {}", source, json_exception_reason(error));
  }
  return parsed;
}

// A JSON value that must be a non-negative integer that fits in int64 (shape dims, offsets).
bool read_non_negative_int(const json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return *out <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {  // "-0"
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

std::string describe(const json& value) { return json_value_description(value); }

struct PendingTensor {
  SafetensorsTensor tensor;
  uint64_t begin = 0, end = 0;
  size_t header_position = 0;
};

PendingTensor parse_entry(const std::string& source, const std::string& name, const json& entry,
                          size_t buffer_size) {
  const std::string where = fmt::format("{}: tensor {}", source, quoted_name(name));
  MT_USER_CHECK(entry.is_object(),
                "{}: entry must be an object with dtype, shape and "
                "data_offsets, got {}",
                where, describe(entry));

  PendingTensor pending;
  pending.tensor.name = name;

  const auto dtype_it = entry.find("dtype");
  MT_USER_CHECK(dtype_it != entry.end(), "{}: entry has no \"dtype\"", where);
  MT_USER_CHECK(dtype_it->is_string(), "{}: dtype must be a string, got {}", where,
                describe(*dtype_it));
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  MT_USER_CHECK(dtype_from_safetensors_name(dtype_name, &pending.tensor.dtype),
                "{}: dtype {} is not supported (supported dtypes: {})", where,
                quoted_name(dtype_name), kSupportedDtypes);

  const auto shape_it = entry.find("shape");
  MT_USER_CHECK(shape_it != entry.end(), "{}: entry has no \"shape\"", where);
  MT_USER_CHECK(shape_it->is_array(), "{}: shape must be an array of dims, got {}", where,
                describe(*shape_it));
  MT_USER_CHECK(shape_it->size() <= static_cast<size_t>(Shape::kMaxDims),
                "{}: shape has {} dims; memtune supports at most {}", where, shape_it->size(),
                Shape::kMaxDims);
  uint64_t numel = 1;
  for (const json& dim_value : *shape_it) {
    uint64_t dim = 0;
    MT_USER_CHECK(read_non_negative_int(dim_value, &dim),
                  "{}: shape dims must be non-negative integers, got {}", where,
                  describe(dim_value));
    pending.tensor.shape.dims[pending.tensor.shape.ndim++] = static_cast<int64_t>(dim);
    MT_USER_CHECK(!__builtin_mul_overflow(numel, dim, &numel) &&
                      numel <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  "{}: shape {} has more elements than fit in 64 bits (overflow)", where,
                  shape_it->dump());
  }
  uint64_t nbytes = 0;
  MT_USER_CHECK(!__builtin_mul_overflow(numel, dtype_size(pending.tensor.dtype), &nbytes),
                "{}: shape {} of {} needs more bytes than fit in 64 bits (overflow)", where,
                shape_it->dump(), dtype_name);

  const auto offsets_it = entry.find("data_offsets");
  MT_USER_CHECK(offsets_it != entry.end(), "{}: entry has no \"data_offsets\"", where);
  MT_USER_CHECK(offsets_it->is_array() && offsets_it->size() == 2,
                "{}: data_offsets must be [begin, end], got {}", where,
                offsets_it->is_array() ? offsets_it->dump() : describe(*offsets_it));
  MT_USER_CHECK(read_non_negative_int((*offsets_it)[0], &pending.begin) &&
                    read_non_negative_int((*offsets_it)[1], &pending.end),
                "{}: data_offsets must be two non-negative integers, got {}", where,
                offsets_it->dump());
  MT_USER_CHECK(pending.begin <= pending.end, "{}: data_offsets {} decrease (begin after end)",
                where, offsets_it->dump());
  MT_USER_CHECK(pending.end <= buffer_size,
                "{}: data_offsets {} run past the end of the data buffer ({} bytes); the file "
                "is truncated or corrupt",
                where, offsets_it->dump(), buffer_size);
  MT_USER_CHECK(pending.end - pending.begin == nbytes,
                "{}: data_offsets {} hold {} bytes, but shape {} of {} needs {} bytes", where,
                offsets_it->dump(), pending.end - pending.begin, shape_it->dump(), dtype_name,
                nbytes);
  pending.tensor.nbytes = static_cast<size_t>(nbytes);
  return pending;
}

SafetensorsMetadata parse_metadata(const std::string& source, const json& value) {
  SafetensorsMetadata metadata;
  // The reference reader (serde, Option<HashMap>) takes null as "no metadata".
  if (value.is_null()) return metadata;
  MT_USER_CHECK(value.is_object(), "{}: __metadata__ must be an object of strings, got {}", source,
                describe(value));
  for (const auto& [key, item] : value.items()) {
    MT_USER_CHECK(item.is_string(), "{}: __metadata__ key {} must map to a string, got {}", source,
                  quoted_name(key), describe(item));
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

}  // namespace

SafetensorsFile SafetensorsFile::parse(const uint8_t* bytes, size_t size, std::string source_name) {
  SafetensorsFile file;
  file.source_name_ = std::move(source_name);
  const std::string& source = file.source_name_;

  MT_USER_CHECK(size >= 8,
                "{}: file is {} bytes, shorter than the 8-byte header length of a safetensors "
                "file (truncated?)",
                source, size);
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes, 8);
  MT_USER_CHECK(header_length <= kSafetensorsMaxHeaderBytes,
                "{}: header length {} is larger than the safetensors limit of 100,000,000 bytes "
                "(corrupt, or not a safetensors file)",
                source, header_length);
  MT_USER_CHECK(header_length <= size - 8,
                "{}: header length {} runs past the end of the file ({} bytes; truncated?)", source,
                header_length, size);
  MT_USER_CHECK(header_length > 0 && bytes[8] == '{',
                "{}: header does not start with '{{' (not a safetensors file?)", source);

  const std::string_view header_text(reinterpret_cast<const char*>(bytes + 8),
                                     static_cast<size_t>(header_length));
  const uint8_t* buffer = bytes + 8 + header_length;
  const size_t buffer_size = size - 8 - static_cast<size_t>(header_length);

  // nlohmann stops at a NUL as if the input ended there, which would let bytes after it go
  // unread; JSON allows no raw NUL anywhere, so the reference reader rejects them too.
  MT_USER_CHECK(header_text.find('\0') == std::string_view::npos,
                "{}: header is not valid JSON: it contains a NUL byte at byte {}", source,
                header_text.find('\0'));
  const ParsedHeader header = parse_header_json(header_text, source);
  MT_USER_CHECK(header.root.is_object(), "{}: header must be a JSON object, got {}", source,
                describe(header.root));

  std::vector<PendingTensor> pending;
  pending.reserve(header.top_level_keys.size());
  for (const std::string& key : header.top_level_keys) {
    const json& value = header.root.find(key).value();
    if (key == kMetadataKey) {
      file.metadata_ = parse_metadata(source, value);
      continue;
    }
    pending.push_back(parse_entry(source, key, value, buffer_size));
    pending.back().header_position = pending.size() - 1;
    pending.back().tensor.data = buffer + pending.back().begin;
  }

  // Sorting by offsets turns "no holes, no overlaps" into "each tensor starts where the
  // previous one ended", the check safetensors' own validate() makes.
  std::sort(pending.begin(), pending.end(), [](const PendingTensor& a, const PendingTensor& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.header_position < b.header_position;
  });
  uint64_t covered_until = 0;
  const PendingTensor* previous = nullptr;
  for (const PendingTensor& item : pending) {
    MT_USER_CHECK(item.begin >= covered_until,
                  "{}: tensor {} (data_offsets [{}, {}]) overlaps tensor {} (data_offsets "
                  "[{}, {}])",
                  source, quoted_name(item.tensor.name), item.begin, item.end,
                  previous ? quoted_name(previous->tensor.name) : "?",
                  previous ? previous->begin : 0, previous ? previous->end : 0);
    MT_USER_CHECK(item.begin == covered_until,
                  "{}: bytes [{}, {}) of the data buffer belong to no tensor (a hole before "
                  "tensor {}); safetensors buffers have no holes",
                  source, covered_until, item.begin, quoted_name(item.tensor.name));
    covered_until = item.end;
    previous = &item;
  }
  MT_USER_CHECK(covered_until == buffer_size,
                "{}: the data buffer has {} bytes after the last tensor ends at byte {}; "
                "safetensors buffers end with their last tensor (corrupt file?)",
                source, buffer_size - covered_until, covered_until);

  file.tensors_.reserve(pending.size());
  for (PendingTensor& item : pending) {
    file.index_.emplace(item.tensor.name, file.tensors_.size());
    file.tensors_.push_back(std::move(item.tensor));
  }
  return file;
}

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  MappedFile mapping = MappedFile::open(path);
  // An empty file has no mapping; give parse() a valid pointer so it reports the size.
  static const uint8_t kNoBytes[1] = {0};
  const uint8_t* bytes = mapping.size() == 0 ? kNoBytes : mapping.data();
  SafetensorsFile file = parse(bytes, mapping.size(), path.string());
  // The tensors point into the mapping, whose address does not move with it.
  file.mapping_ = std::move(mapping);
  return file;
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const& {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const SafetensorsTensor& SafetensorsFile::get(std::string_view name) const& {
  const SafetensorsTensor* tensor = find(name);
  MT_USER_CHECK(tensor != nullptr, "{}: no tensor named {} ({} tensors in the file)", source_name_,
                quoted_name(name), tensors_.size());
  return *tensor;
}

void SafetensorsFile::release_pages(const SafetensorsTensor& tensor) const {
  if (mapping_.data() == nullptr || tensor.nbytes == 0) return;
  MT_ASSERT(tensor.data >= mapping_.data() &&
                tensor.data + tensor.nbytes <= mapping_.data() + mapping_.size(),
            "tensor {} is not from {}", tensor.name, source_name_);
  mapping_.release_pages(static_cast<size_t>(tensor.data - mapping_.data()), tensor.nbytes);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

namespace {

constexpr std::string_view kIndexFilename = "model.safetensors.index.json";
constexpr std::string_view kSingleFilename = "model.safetensors";

bool has_suffix(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

std::vector<std::string> safetensors_files_in(const std::filesystem::path& directory) {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& item : std::filesystem::directory_iterator(directory, error)) {
    const std::string name = item.path().filename().string();
    if (has_suffix(name, ".safetensors") && item.is_regular_file(error)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// Shard names come from a file: keep them inside the checkpoint's directory.
bool is_safe_relative_path(const std::string& name) {
  if (name.empty()) return false;
  const std::filesystem::path path(name);
  if (path.is_absolute()) return false;
  for (const auto& part : path) {
    if (part == "..") return false;
  }
  return true;
}

}  // namespace

void SafetensorsCheckpoint::add_file_tensors(
    size_t file, const std::function<bool(const std::string&)>& wanted) {
  const std::vector<SafetensorsTensor>& tensors = files_[file].tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!wanted(tensors[i].name)) continue;
    index_.emplace(tensors[i].name, names_.size());
    names_.push_back(tensors[i].name);
    locations_.push_back({file, i});
  }
}

SafetensorsCheckpoint SafetensorsCheckpoint::open_single(const std::filesystem::path& file) {
  SafetensorsCheckpoint checkpoint;
  checkpoint.source_name_ = file.string();
  checkpoint.files_.push_back(SafetensorsFile::open(file));
  checkpoint.add_file_tensors(0, [](const std::string&) { return true; });
  return checkpoint;
}

SafetensorsCheckpoint SafetensorsCheckpoint::open_index(const std::filesystem::path& index_json) {
  const std::string source = index_json.string();
  const json index = read_json_file(index_json);
  json_require_object(index, source);
  const json& weight_map = json_require(index, "weight_map", source);
  MT_USER_CHECK(weight_map.is_object(), "{}: weight_map must be an object, got {}", source,
                json_value_description(weight_map));

  // Each shard opened once, in name order, which for model-0000i-of-0000N is disk order.
  std::map<std::string, std::string> first_tensor_of_shard;
  for (const auto& [tensor_name, shard] : weight_map.items()) {
    MT_USER_CHECK(shard.is_string(), "{}: weight_map[{}] must be a file name, got {}", source,
                  quoted_name(tensor_name), json_value_description(shard));
    const std::string& shard_name = shard.get_ref<const std::string&>();
    MT_USER_CHECK(is_safe_relative_path(shard_name),
                  "{}: weight_map[{}] names shard {}, which is not a file inside the "
                  "checkpoint's directory",
                  source, quoted_name(tensor_name), quoted_name(shard_name));
    first_tensor_of_shard.emplace(shard_name, tensor_name);
  }

  SafetensorsCheckpoint checkpoint;
  checkpoint.source_name_ = source;
  const std::filesystem::path directory = index_json.parent_path();
  for (const auto& [shard_name, example_tensor] : first_tensor_of_shard) {
    const std::filesystem::path shard_path = directory / shard_name;
    std::error_code error;
    MT_USER_CHECK(std::filesystem::exists(shard_path, error),
                  "{}: shard {} is missing (the index puts tensors such as {} in it)", source,
                  shard_path.string(), quoted_name(example_tensor));
    checkpoint.files_.push_back(SafetensorsFile::open(shard_path));
    const std::string& this_shard = shard_name;
    // A tensor that also sits in another shard is taken from the shard the index names.
    checkpoint.add_file_tensors(checkpoint.files_.size() - 1, [&](const std::string& name) {
      const auto it = weight_map.find(name);
      return it != weight_map.end() && it->get_ref<const std::string&>() == this_shard;
    });
  }
  for (const auto& [tensor_name, shard] : weight_map.items()) {
    MT_USER_CHECK(checkpoint.index_.contains(tensor_name),
                  "{}: the index puts tensor {} in {}, but that shard does not hold it", source,
                  quoted_name(tensor_name), shard.get<std::string>());
  }
  return checkpoint;
}

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::filesystem::path& path) {
  std::error_code error;
  const std::filesystem::file_status status = std::filesystem::status(path, error);
  MT_USER_CHECK(std::filesystem::exists(status), "checkpoint {} does not exist", path.string());
  if (!std::filesystem::is_directory(status)) {
    return has_suffix(path.filename().string(), ".json") ? open_index(path) : open_single(path);
  }
  // transformers prefers the index when both are present; so does this.
  if (std::filesystem::exists(path / kIndexFilename, error))
    return open_index(path / kIndexFilename);
  if (std::filesystem::exists(path / kSingleFilename, error))
    return open_single(path / kSingleFilename);
  const std::vector<std::string> candidates = safetensors_files_in(path);
  MT_USER_CHECK(!candidates.empty(), "{}: no {}, {} or other *.safetensors file in the directory",
                path.string(), kIndexFilename, kSingleFilename);
  MT_USER_CHECK(candidates.size() == 1,
                "{}: no {} or {}, and several other *.safetensors files ({}); name the one to "
                "open",
                path.string(), kIndexFilename, kSingleFilename, joined(candidates));
  return open_single(path / candidates.front());
}

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::filesystem::path& directory,
                                                  const std::string& filename) {
  std::error_code error;
  MT_USER_CHECK(std::filesystem::is_directory(directory, error), "{} is not a directory",
                directory.string());
  const std::filesystem::path path = directory / filename;
  if (!std::filesystem::exists(path, error)) {
    const std::vector<std::string> present = safetensors_files_in(directory);
    mt_fail("{} does not exist (safetensors files in {}: {})", path.string(), directory.string(),
            present.empty() ? std::string("none") : joined(present));
  }
  return has_suffix(filename, ".json") ? open_index(path) : open_single(path);
}

const SafetensorsTensor* SafetensorsCheckpoint::find(std::string_view name) const& {
  const auto it = index_.find(name);
  if (it == index_.end()) return nullptr;
  const Location& location = locations_[it->second];
  return &files_[location.file].tensors()[location.tensor];
}

const SafetensorsTensor& SafetensorsCheckpoint::get(std::string_view name) const& {
  const SafetensorsTensor* tensor = find(name);
  if (tensor != nullptr) return *tensor;
  // The usual cause is a prefix ("base_model.model.", "model."): point at such a name.
  // A dotted name only: every weight ends in "weight", which would say nothing.
  const auto extends_by_prefix = [](std::string_view longer, std::string_view shorter) {
    return shorter.find('.') != std::string_view::npos && longer.size() > shorter.size() &&
           has_suffix(longer, shorter) && longer[longer.size() - shorter.size() - 1] == '.';
  };
  std::string hint;
  for (const std::string& stored : names_) {
    if (extends_by_prefix(stored, name) || extends_by_prefix(name, stored)) {
      hint = fmt::format("; the checkpoint has {}", quoted_name(stored));
      break;
    }
  }
  mt_fail("{}: no tensor named {} ({} tensors in the checkpoint{})", source_name_,
          quoted_name(name), names_.size(), hint);
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(std::string_view name) const {
  get(name);
  return files_[locations_[index_.find(name)->second].file];
}

const SafetensorsMetadata& SafetensorsCheckpoint::metadata() const {
  static const SafetensorsMetadata kEmpty;
  return files_.empty() ? kEmpty : files_.front().metadata();
}

const SafetensorsTensor& expect_tensor(const SafetensorsCheckpoint& checkpoint,
                                       std::string_view name, std::span<const DType> allowed_dtypes,
                                       const Shape& shape) {
  const SafetensorsTensor& tensor = checkpoint.get(name);
  const std::string& file = checkpoint.file_of(name).source_name();
  MT_USER_CHECK(tensor.shape == shape, "{}: shape {} in file {}, model expects {}", name,
                tensor.shape.str(), file, shape.str());
  if (std::find(allowed_dtypes.begin(), allowed_dtypes.end(), tensor.dtype) ==
      allowed_dtypes.end()) {
    std::string expected;
    for (DType dtype : allowed_dtypes) {
      expected +=
          fmt::format("{}{}", expected.empty() ? "" : " or ", dtype_safetensors_name(dtype));
    }
    mt_fail("{}: dtype {} in file {}, model expects {}", name, dtype_safetensors_name(tensor.dtype),
            file, expected);
  }
  return tensor;
}

const SafetensorsTensor& expect_tensor(const SafetensorsCheckpoint& checkpoint,
                                       std::string_view name, DType dtype, const Shape& shape) {
  return expect_tensor(checkpoint, name, std::span<const DType>(&dtype, 1), shape);
}

const SafetensorsTensor& expect_tensor(const SafetensorsCheckpoint& checkpoint,
                                       std::string_view name,
                                       std::initializer_list<DType> allowed_dtypes,
                                       const Shape& shape) {
  return expect_tensor(checkpoint, name,
                       std::span<const DType>(allowed_dtypes.begin(), allowed_dtypes.size()),
                       shape);
}

// ---------------------------------------------------------------------------------------------
// Writing

uint64_t safetensors_entry_bytes(const SafetensorsWriteEntry& entry) {
  MT_USER_CHECK(entry.shape.ndim >= 0 && entry.shape.ndim <= Shape::kMaxDims,
                "tensor {}: shape has {} dims", quoted_name(entry.name), entry.shape.ndim);
  uint64_t bytes = dtype_size(entry.dtype);
  for (int i = 0; i < entry.shape.ndim; ++i) {
    MT_USER_CHECK(entry.shape[i] >= 0, "tensor {}: shape {} has a negative dim",
                  quoted_name(entry.name), entry.shape.str());
    MT_USER_CHECK(!__builtin_mul_overflow(bytes, static_cast<uint64_t>(entry.shape[i]), &bytes),
                  "tensor {}: shape {} overflows 64 bits", quoted_name(entry.name),
                  entry.shape.str());
  }
  return bytes;
}

namespace {

std::string json_string(std::string_view text, std::string_view what) {
  try {
    return json(std::string(text)).dump();
  } catch (const json::type_error&) {
    mt_fail("{} is not valid UTF-8, which safetensors headers require", what);
  }
}

// Checks the entries and returns each one's byte count, before anything is written.
std::vector<uint64_t> checked_entry_bytes(std::span<const SafetensorsWriteEntry> entries) {
  std::vector<uint64_t> bytes;
  bytes.reserve(entries.size());
  std::unordered_set<std::string_view> names;
  for (const SafetensorsWriteEntry& entry : entries) {
    MT_USER_CHECK(entry.name != kMetadataKey, "a tensor cannot be named __metadata__");
    MT_USER_CHECK(names.insert(entry.name).second, "tensor {} is listed twice",
                  quoted_name(entry.name));
    bytes.push_back(safetensors_entry_bytes(entry));
    MT_USER_CHECK(entry.data != nullptr || entry.write_data || bytes.back() == 0,
                  "tensor {}: no data to write", quoted_name(entry.name));
  }
  return bytes;
}

}  // namespace

void serialize_safetensors(FileSink& sink, std::span<const SafetensorsWriteEntry> entries,
                           const SafetensorsMetadata& metadata) {
  const std::vector<uint64_t> entry_bytes = checked_entry_bytes(entries);

  // Built by hand rather than as an ordered_json object, whose inserts are linear scans.
  std::string header = "{";
  if (!metadata.empty()) {
    header += fmt::format("{}:{{", json_string(kMetadataKey, "__metadata__"));
    bool first = true;
    for (const auto& [key, value] : metadata) {
      header += fmt::format("{}{}:{}", first ? "" : ",", json_string(key, "a metadata key"),
                            json_string(value, fmt::format("metadata value of {}", key)));
      first = false;
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsWriteEntry& entry = entries[i];
    std::string dims;
    for (int d = 0; d < entry.shape.ndim; ++d)
      dims += fmt::format("{}{}", d ? "," : "", entry.shape[d]);
    uint64_t end = 0;
    MT_USER_CHECK(!__builtin_add_overflow(offset, entry_bytes[i], &end),
                  "tensors add up to more than 2^64 bytes");
    header += fmt::format("{}{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                          header.size() > 1 ? "," : "", json_string(entry.name, "a tensor name"),
                          dtype_safetensors_name(entry.dtype), dims, offset, end);
    offset = end;
  }
  header += "}";
  // The buffer then starts 8-aligned, as in safetensors' own writer.
  header.append((8 - header.size() % 8) % 8, ' ');
  MT_USER_CHECK(header.size() <= kSafetensorsMaxHeaderBytes,
                "the safetensors header would be {} bytes, over the 100,000,000-byte limit",
                header.size());

  const uint64_t header_length = header.size();
  sink.write(&header_length, 8);
  sink.write(header);
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsWriteEntry& entry = entries[i];
    if (entry_bytes[i] == 0) continue;
    if (entry.data != nullptr) {
      sink.write(entry.data, static_cast<size_t>(entry_bytes[i]));
      continue;
    }
    const uint64_t before = sink.bytes_written();
    entry.write_data(sink);
    const uint64_t produced = sink.bytes_written() - before;
    MT_USER_CHECK(produced == entry_bytes[i], "tensor {}: its producer wrote {} bytes, not {}",
                  quoted_name(entry.name), produced, entry_bytes[i]);
  }
}

std::string serialize_safetensors(std::span<const SafetensorsWriteEntry> entries,
                                  const SafetensorsMetadata& metadata) {
  StringSink sink;
  serialize_safetensors(sink, entries, metadata);
  return sink.take();
}

void write_safetensors(const std::filesystem::path& path,
                       std::span<const SafetensorsWriteEntry> entries,
                       const SafetensorsMetadata& metadata) {
  // Validate before creating the temporary file, so that bad entries cost no I/O.
  checked_entry_bytes(entries);
  write_file_atomic_streaming(
      path, [&](FileSink& sink) { serialize_safetensors(sink, entries, metadata); });
}

namespace {

// model-00001-of-00004.safetensors, as transformers names shards.
std::string shard_filename(size_t index, size_t count) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", index + 1, count);
}

bool is_shard_filename(std::string_view name) {
  constexpr std::string_view kPrefix = "model-", kMiddle = "-of-", kSuffix = ".safetensors";
  if (name.size() != kPrefix.size() + 5 + kMiddle.size() + 5 + kSuffix.size()) return false;
  if (name.substr(0, kPrefix.size()) != kPrefix || !has_suffix(name, kSuffix)) return false;
  if (name.substr(kPrefix.size() + 5, kMiddle.size()) != kMiddle) return false;
  for (size_t start : {kPrefix.size(), kPrefix.size() + 5 + kMiddle.size()}) {
    for (size_t i = start; i < start + 5; ++i) {
      if (name[i] < '0' || name[i] > '9') return false;
    }
  }
  return true;
}

void remove_stale_weight_files(const std::filesystem::path& directory,
                               const std::vector<std::filesystem::path>& written) {
  std::set<std::string> keep;
  for (const auto& path : written) keep.insert(path.filename().string());
  std::vector<std::filesystem::path> stale;
  std::error_code error;
  for (const auto& item : std::filesystem::directory_iterator(directory, error)) {
    const std::string name = item.path().filename().string();
    const bool weight_file =
        name == kSingleFilename || name == kIndexFilename || is_shard_filename(name);
    if (weight_file && !keep.contains(name)) stale.push_back(item.path());
  }
  for (const auto& path : stale) {
    std::filesystem::remove(path, error);
    MT_USER_CHECK(!error,
                  "wrote {}, but could not remove {} left by an earlier save: {}; remove it, or "
                  "loading the directory may read stale weights",
                  directory.string(), path.string(), error.message());
  }
}

}  // namespace

std::vector<std::filesystem::path> write_sharded_safetensors(
    const std::filesystem::path& directory, std::span<const SafetensorsWriteEntry> entries,
    uint64_t max_shard_bytes, const SafetensorsMetadata& metadata) {
  MT_USER_CHECK(max_shard_bytes > 0, "the shard size limit must be positive");
  const std::vector<uint64_t> entry_bytes = checked_entry_bytes(entries);
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  MT_USER_CHECK(!error, "cannot create directory {}: {}", directory.string(), error.message());

  // Greedy in entry order, as transformers' shard splitting is.
  std::vector<std::pair<size_t, size_t>> shards;  // [begin, end) into entries
  size_t shard_begin = 0;
  uint64_t shard_bytes = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i > shard_begin && shard_bytes + entry_bytes[i] > max_shard_bytes) {
      shards.emplace_back(shard_begin, i);
      shard_begin = i;
      shard_bytes = 0;
    }
    shard_bytes += entry_bytes[i];
  }
  shards.emplace_back(shard_begin, entries.size());

  std::vector<std::filesystem::path> written;
  if (shards.size() == 1) {
    written.push_back(directory / kSingleFilename);
    write_safetensors(written.back(), entries, metadata);
    remove_stale_weight_files(directory, written);
    return written;
  }

  json weight_map = json::object();
  uint64_t total_size = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = shard_filename(s, shards.size());
    const auto [begin, end] = shards[s];
    written.push_back(directory / name);
    write_safetensors(written.back(), entries.subspan(begin, end - begin), metadata);
    for (size_t i = begin; i < end; ++i) {
      weight_map[entries[i].name] = name;
      total_size += entry_bytes[i];
    }
  }
  // The index goes last, so that it never names a shard that is not completely written.
  const json index = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
  written.push_back(directory / kIndexFilename);
  write_file_atomic(written.back(), index.dump(2) + "\n");
  remove_stale_weight_files(directory, written);
  return written;
}

}  // namespace memtune
