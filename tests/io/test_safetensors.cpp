// The safetensors reader and writer on single files: round trips, byte-exact agreement with the
// reference implementation, and hostile input of every kind the format allows to go wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/io/safetensors.h"
#include "../support/expect_error.h"
#include "../support/fixtures.h"
#include "../support/temp_dir.h"

using namespace memtune;
using memtune::test::error_of;
namespace fs = std::filesystem;

namespace {

SafetensorsFile parse_bytes(const std::string& bytes, std::string source = "test.safetensors") {
  return SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                std::move(source));
}

// A file from a header written by hand, so that tests can say exactly what is wrong with it.
std::string file_with_header(const std::string& header, const std::string& buffer) {
  const uint64_t length = header.size();
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &length, 8);
  return bytes + header + buffer;
}

std::string parse_error(const std::string& header, const std::string& buffer) {
  return error_of([&] { parse_bytes(file_with_header(header, buffer), "hostile.safetensors"); });
}

std::string le_bytes(const void* data, size_t size) {
  return std::string(static_cast<const char*>(data), size);
}

class SafetensorsTest : public test::TempDirTest {
 protected:
  SafetensorsTest() : TempDirTest("memtune_st") {}
};

// Every dtype, a scalar, an empty tensor and metadata: the small valid file the prefix and
// corruption sweeps start from.
struct SampleTensors {
  std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, -7.0f};
  std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x7bff, 0x0001};
  std::vector<uint16_t> bf16 = {0x3f80, 0xbf80};
  std::vector<uint8_t> u8 = {0, 1, 2, 255, 128};
  std::vector<int32_t> i32 = {-1, 2147483647};
  float scalar = 42.0f;

  std::vector<SafetensorsWriteEntry> entries() const {
    return {{"layers.0.weight", DType::f32, Shape{2, 3}, f32.data()},
            {"layers.0.norm", DType::f16, Shape{4}, f16.data()},
            {"layers.0.bias", DType::bf16, Shape{1, 1, 1, 2}, bf16.data()},
            {"codes", DType::u8, Shape{5}, u8.data()},
            {"ids", DType::i32, Shape{2}, i32.data()},
            {"scale", DType::f32, Shape{}, &scalar},
            {"nothing", DType::f32, Shape{0, 3}, nullptr}};
  }
};

std::string sample_file_bytes() {
  SampleTensors sample;
  return serialize_safetensors(sample.entries(), {{"format", "pt"}, {"note", "x"}});
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Round trips and the reference layout

TEST_F(SafetensorsTest, RoundTripKeepsDtypesShapesBytesOrderAndMetadata) {
  SampleTensors sample;
  const fs::path path = dir_ / "sample.safetensors";
  write_safetensors(path, sample.entries(), {{"format", "pt"}});
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.source_name(), path.string());
  EXPECT_EQ(file.metadata(), (SafetensorsMetadata{{"format", "pt"}}));
  const auto entries = sample.entries();
  ASSERT_EQ(file.tensors().size(), entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsTensor& tensor = file.tensors()[i];
    SCOPED_TRACE(entries[i].name);
    EXPECT_EQ(tensor.name, entries[i].name);
    EXPECT_EQ(tensor.dtype, entries[i].dtype);
    EXPECT_EQ(tensor.shape, entries[i].shape);
    EXPECT_EQ(tensor.nbytes, tensor.shape.numel() * dtype_size(tensor.dtype));
    if (tensor.nbytes > 0) EXPECT_EQ(std::memcmp(tensor.data, entries[i].data, tensor.nbytes), 0);
    EXPECT_EQ(file.find(entries[i].name), &tensor);
  }
  EXPECT_EQ(file.find("absent"), nullptr);
  EXPECT_EQ(file.get("ids").shape, (Shape{2}));
  const std::string message = error_of([&] { file.get("absent"); });
  EXPECT_CONTAINS(message, path.string());
  EXPECT_CONTAINS(message, "no tensor named \"absent\"");
}

TEST_F(SafetensorsTest, HeaderIsPaddedToEightAndBufferFollowsInEntryOrder) {
  const std::string bytes = sample_file_bytes();
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  EXPECT_EQ(header_length % 8, 0u);
  const std::string header = bytes.substr(8, header_length);
  EXPECT_EQ(header.rfind("{\"__metadata__\":{\"format\":\"pt\",\"note\":\"x\"},", 0), 0u) << header;
  EXPECT_LT(header.find("layers.0.weight"), header.find("layers.0.norm"));
  const SafetensorsFile file = parse_bytes(bytes);
  EXPECT_EQ(file.tensors()[0].data,
            reinterpret_cast<const uint8_t*>(bytes.data()) + 8 + header_length);
}

// Expected bytes are the ones safetensors' own tests assert (safetensors/src/tensor.rs:
// test_serialization, test_serialization_forced_alignement, test_empty).
TEST_F(SafetensorsTest, WriterMatchesReferenceImplementationBytes) {
  const std::vector<float> values = {0, 1, 2, 3, 4, 5};
  const std::string data = le_bytes(values.data(), 24);
  {
    const std::string bytes =
        serialize_safetensors({{{"attn.0", DType::f32, Shape{1, 2, 3}, values.data()}}});
    const std::string header =
        R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
    ASSERT_EQ(header.size(), 64u);
    EXPECT_EQ(bytes, std::string("\x40\0\0\0\0\0\0\0", 8) + header + data);
  }
  {
    const std::string bytes =
        serialize_safetensors({{{"attn0", DType::f32, Shape{1, 1, 2, 3}, values.data()}}});
    const std::string header =
        R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
    EXPECT_EQ(bytes, std::string("\x48\0\0\0\0\0\0\0", 8) + header + "       " + data);
  }
  EXPECT_EQ(serialize_safetensors({}), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  EXPECT_EQ(
      serialize_safetensors({}, {{"framework", "pt"}}),
      std::string("\x28\0\0\0\0\0\0\0", 8) + R"({"__metadata__":{"framework":"pt"}})" + "     ");
}

TEST_F(SafetensorsTest, EmptyFileOfNoTensorsParses) {
  const SafetensorsFile file = parse_bytes(serialize_safetensors({}));
  EXPECT_TRUE(file.tensors().empty());
  EXPECT_TRUE(file.metadata().empty());
  EXPECT_TRUE(parse_bytes(file_with_header(R"({"__metadata__":null})", "")).metadata().empty());
}

TEST_F(SafetensorsTest, TensorsAreListedInDataOrderNotHeaderOrder) {
  // Header order b, a; data order a, b. Zero-byte tensors may share an offset.
  const std::string header = R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},)"
                             R"("z2":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},)"
                             R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                             R"("z1":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}})";
  const std::string bytes = file_with_header(header, "ABCD");
  const SafetensorsFile file = parse_bytes(bytes);
  ASSERT_EQ(file.tensors().size(), 4u);
  EXPECT_EQ(file.tensors()[0].name, "a");
  EXPECT_EQ(file.tensors()[1].name, "b");
  EXPECT_EQ(file.tensors()[2].name, "z2");  // ties keep header order
  EXPECT_EQ(file.tensors()[3].name, "z1");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file.get("b").data), 2), "CD");
}

TEST_F(SafetensorsTest, ProducerCallbackWritesTensorData) {
  const std::vector<int32_t> values = {1, 2, 3, 4, 5, 6};
  std::vector<SafetensorsWriteEntry> entries(1);
  entries[0].name = "streamed";
  entries[0].dtype = DType::i32;
  entries[0].shape = Shape{2, 3};
  entries[0].write_data = [&](FileSink& sink) {
    sink.write(values.data(), 12);  // in two pieces, as a device-to-host copy loop would
    sink.write(values.data() + 3, 12);
  };
  write_safetensors(dir_ / "s.safetensors", entries);
  const SafetensorsFile file = SafetensorsFile::open(dir_ / "s.safetensors");
  EXPECT_EQ(std::memcmp(file.get("streamed").data, values.data(), 24), 0);
}

TEST_F(SafetensorsTest, ProducerWritingWrongByteCountFailsAndKeepsOldFile) {
  const fs::path path = dir_ / "s.safetensors";
  write_file_atomic(path, "old");
  std::vector<SafetensorsWriteEntry> entries(1);
  entries[0].name = "short";
  entries[0].dtype = DType::f32;
  entries[0].shape = Shape{4};
  entries[0].write_data = [](FileSink& sink) { sink.write("abc"); };
  const std::string message = error_of([&] { write_safetensors(path, entries); });
  EXPECT_CONTAINS(message, "\"short\"");
  EXPECT_CONTAINS(message, "wrote 3 bytes, not 16");
  EXPECT_EQ(read_file(path), "old");
  EXPECT_FALSE(fs::exists(atomic_temp_path(path)));
}

TEST_F(SafetensorsTest, WriterRejectsBadEntries) {
  const float value = 1.0f;
  using Entries = std::vector<SafetensorsWriteEntry>;
  EXPECT_CONTAINS(error_of([&] {
                    serialize_safetensors(Entries{{"w", DType::f32, Shape{1}, &value},
                                                  {"w", DType::f32, Shape{1}, &value}});
                  }),
                  "\"w\" is listed twice");
  EXPECT_CONTAINS(error_of([&] {
                    serialize_safetensors(Entries{{"__metadata__", DType::f32, Shape{1}, &value}});
                  }),
                  "__metadata__");
  EXPECT_CONTAINS(error_of([&] {
                    serialize_safetensors(Entries{{"neg", DType::f32, Shape{-1}, &value}});
                  }),
                  "negative");
  EXPECT_CONTAINS(error_of([&] {
                    serialize_safetensors(Entries{{"null", DType::f32, Shape{1}, nullptr}});
                  }),
                  "no data");
  EXPECT_CONTAINS(error_of([&] {
                    serialize_safetensors(Entries{{"\xff\xfe", DType::f32, Shape{1}, &value}});
                  }),
                  "UTF-8");
  // Bad entries are refused before anything touches the disk.
  EXPECT_CONTAINS(
      error_of([&] {
        write_safetensors(dir_ / "bad.safetensors", Entries{{"n", DType::f32, Shape{1}, nullptr}});
      }),
      "no data");
  EXPECT_FALSE(fs::exists(dir_ / "bad.safetensors"));
}

TEST_F(SafetensorsTest, FailedWriteLeavesExistingFileIntact) {
  const float value = 1.0f;
  const fs::path path = dir_ / "adapter_model.safetensors";
  write_safetensors(path, std::vector<SafetensorsWriteEntry>{{"a", DType::f32, Shape{1}, &value}});
  const std::string before = read_file(path);
  std::vector<SafetensorsWriteEntry> entries = {{"a", DType::f32, Shape{1}, &value}, {}};
  entries[1].name = "b";
  entries[1].shape = Shape{1 << 20};
  entries[1].write_data = [](FileSink& sink) {
    sink.write(std::string(2 << 20, 'x'));
    mt_fail("device copy failed");
  };
  EXPECT_CONTAINS(error_of([&] { write_safetensors(path, entries); }), "device copy failed");
  EXPECT_EQ(read_file(path), before);
  EXPECT_FALSE(fs::exists(atomic_temp_path(path)));
}

// ---------------------------------------------------------------------------------------------
// A file written by the Python package (tools/make_safetensors_fixture.py)

TEST(SafetensorsPythonFixture, ValuesMatchAndWriterReproducesTheBytes) {
  const fs::path path =
      memtune::test::fixture_path("safetensors/python_numpy.safetensors");
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.metadata(), (SafetensorsMetadata{{"format", "np"}}));

  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(path);
  const SafetensorsTensor& embed =
      expect_tensor(checkpoint, "model.embed_tokens.weight", DType::f32, Shape{3, 4});
  for (int i = 0; i < 12; ++i) {
    float value;
    std::memcpy(&value, embed.data + 4 * i, 4);
    EXPECT_EQ(value, i * 0.5f - 2.0f) << i;
  }
  const SafetensorsTensor& norm = file.get("model.norm.weight");
  EXPECT_EQ(norm.dtype, DType::f16);
  const float norm_expected[] = {1.0f, -2.5f, 0.125f, 65504.0f};
  for (int i = 0; i < 4; ++i) {
    uint16_t bits;
    std::memcpy(&bits, norm.data + 2 * i, 2);
    EXPECT_EQ(f16_bits_to_f32(bits), norm_expected[i]);
  }
  const SafetensorsTensor& ids = file.get("token_ids");
  EXPECT_EQ(ids.dtype, DType::i32);
  EXPECT_EQ(ids.shape, (Shape{2, 2}));
  int32_t id_values[4];
  std::memcpy(id_values, ids.data, 16);
  EXPECT_EQ(id_values[0], -1);
  EXPECT_EQ(id_values[3], 2147483647);
  const SafetensorsTensor& codes = file.get("codes");
  EXPECT_EQ(std::vector<uint8_t>(codes.data, codes.data + codes.nbytes),
            (std::vector<uint8_t>{0, 1, 127, 128, 255}));
  const SafetensorsTensor& scalar = file.get("scalar");
  EXPECT_EQ(scalar.shape.ndim, 0);
  float scalar_value;
  std::memcpy(&scalar_value, scalar.data, 4);
  EXPECT_EQ(scalar_value, 3.25f);
  EXPECT_EQ(file.get("empty").shape, (Shape{0, 4}));
  EXPECT_EQ(file.get("empty").nbytes, 0u);

  // Same tensors, same order, same metadata: the same bytes as the reference writer.
  std::vector<SafetensorsWriteEntry> entries;
  for (const SafetensorsTensor& tensor : file.tensors()) {
    entries.push_back({tensor.name, tensor.dtype, tensor.shape, tensor.data});
  }
  EXPECT_EQ(serialize_safetensors(entries, file.metadata()), read_file(path));
}

// ---------------------------------------------------------------------------------------------
// Hostile files: each is a memtune::Error naming the file (and the tensor), never a crash.

TEST(SafetensorsHostile, ShorterThanEightBytes) {
  for (size_t size = 0; size < 8; ++size) {
    const std::string message =
        error_of([&] { parse_bytes(std::string(size, '\x01'), "tiny.safetensors"); });
    EXPECT_CONTAINS(message, "tiny.safetensors");
    EXPECT_CONTAINS(message, "shorter than the 8-byte header length");
  }
}

TEST(SafetensorsHostile, HeaderLengthPastEndOfFile) {
  std::string bytes = file_with_header("{}      ", "");
  bytes[0] = 9;  // one more than the header that is there
  EXPECT_CONTAINS(error_of([&] { parse_bytes(bytes); }), "runs past the end of the file");
  bytes[0] = 0;
  bytes[7] = 0x7f;  // ~9e18: would overflow 8 + length in a careless reader
  EXPECT_CONTAINS(error_of([&] { parse_bytes(bytes); }), "limit");
}

TEST(SafetensorsHostile, HeaderLengthOverTheLimit) {
  std::string bytes = file_with_header("{}      ", "");
  const uint64_t length = kSafetensorsMaxHeaderBytes + 1;
  std::memcpy(bytes.data(), &length, 8);
  EXPECT_CONTAINS(error_of([&] { parse_bytes(bytes); }), "100,000,000");
}

TEST(SafetensorsHostile, HeaderNotJsonOrNotAnObject) {
  EXPECT_CONTAINS(parse_error("", ""), "does not start with '{'");
  EXPECT_CONTAINS(parse_error("[1, 2]  ", ""), "does not start with '{'");
  EXPECT_CONTAINS(parse_error(" {}", ""), "does not start with '{'");
  EXPECT_CONTAINS(parse_error("{\"a\": ", ""), "not valid JSON");
  EXPECT_CONTAINS(parse_error("{} trailing", ""), "not valid JSON");
  EXPECT_CONTAINS(parse_error(std::string("{}\0\0\0\0\0\0", 8), ""), "not valid JSON");
  EXPECT_CONTAINS(parse_error("{\"\xff\": 1}", ""), "not valid JSON");  // not UTF-8
  // Found by the fuzzer: nlohmann reports a number too large for a double as out_of_range.
  EXPECT_CONTAINS(parse_error(R"({"w":{"dtype":4E444444444}})", ""), "not valid JSON");
  EXPECT_CONTAINS(
      parse_error(R"({"w":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}})", "...."),
      "number overflow");
}

TEST(SafetensorsHostile, EntryNotAnObjectOrMissingFields) {
  EXPECT_CONTAINS(parse_error(R"({"w": 5})", ""), "tensor \"w\": entry must be an object");
  EXPECT_CONTAINS(parse_error(R"({"w": {"shape": [], "data_offsets": [0, 4]}})", "...."),
                  "tensor \"w\": entry has no \"dtype\"");
  EXPECT_CONTAINS(parse_error(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", "...."),
                  "entry has no \"shape\"");
  EXPECT_CONTAINS(parse_error(R"({"w": {"dtype": "F32", "shape": []}})", "...."),
                  "entry has no \"data_offsets\"");
}

TEST(SafetensorsHostile, UnknownOrMistypedDtype) {
  const std::string message =
      parse_error(R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", "........");
  EXPECT_CONTAINS(message, "hostile.safetensors: tensor \"w\"");
  EXPECT_CONTAINS(message, "dtype \"F64\" is not supported");
  EXPECT_CONTAINS(message, "F32, F16, BF16, U8, I32");
  EXPECT_CONTAINS(
      parse_error(R"({"w": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}})", "...."),
      "not supported");
  EXPECT_CONTAINS(
      parse_error(R"({"w": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}})", "...."),
      "dtype must be a string");
}

TEST(SafetensorsHostile, BadShapes) {
  const auto with_shape = [](const std::string& shape, const std::string& offsets = "[0, 4]") {
    return parse_error(
        R"({"w": {"dtype": "F32", "shape": )" + shape + R"(, "data_offsets": )" + offsets + "}}",
        "....");
  };
  EXPECT_CONTAINS(with_shape("[-1]"), "non-negative integers");
  EXPECT_CONTAINS(with_shape("[1.5]"), "non-negative integers");
  EXPECT_CONTAINS(with_shape("[\"1\"]"), "non-negative integers");
  EXPECT_CONTAINS(with_shape("[[1]]"), "non-negative integers");
  EXPECT_CONTAINS(with_shape("7"), "shape must be an array");
  EXPECT_CONTAINS(with_shape("[1, 1, 1, 1, 1]"), "shape has 5 dims");
  EXPECT_CONTAINS(with_shape("[4294967296, 4294967296]"), "overflow");
  EXPECT_CONTAINS(with_shape("[18446744073709551615]"), "non-negative integers");
  EXPECT_CONTAINS(with_shape("[4611686018427387904]"), "overflow");  // 2^62 * 4 bytes
  EXPECT_CONTAINS(with_shape("[1e3]"), "non-negative integers");
}

TEST(SafetensorsHostile, BadDataOffsets) {
  const auto with_offsets = [](const std::string& offsets, const std::string& buffer) {
    return parse_error(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": )" + offsets + "}}",
                       buffer);
  };
  const std::string eight(8, 'x');
  EXPECT_CONTAINS(with_offsets("[0]", eight), "must be [begin, end]");
  EXPECT_CONTAINS(with_offsets("[0, 4, 8]", eight), "must be [begin, end]");
  EXPECT_CONTAINS(with_offsets("{\"a\": 1}", eight), "must be [begin, end]");
  EXPECT_CONTAINS(with_offsets("[0, -8]", eight), "two non-negative integers");
  EXPECT_CONTAINS(with_offsets("[0.0, 8]", eight), "two non-negative integers");
  EXPECT_CONTAINS(with_offsets("[8, 0]", eight), "decrease");
  EXPECT_CONTAINS(with_offsets("[0, 16]", eight), "run past the end of the data buffer (8 bytes)");
  EXPECT_CONTAINS(with_offsets("[0, 18446744073709551615]", eight), "non-negative integers");
  const std::string wrong_size = with_offsets("[0, 4]", "xxxx");
  EXPECT_CONTAINS(wrong_size, "tensor \"w\"");
  EXPECT_CONTAINS(wrong_size, "hold 4 bytes, but shape [2] of F32 needs 8 bytes");
}

TEST(SafetensorsHostile, OverlappingTensors) {
  const std::string message =
      parse_error(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
                  R"( "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})",
                  std::string(12, 'x'));
  EXPECT_CONTAINS(message, "tensor \"b\"");
  EXPECT_CONTAINS(message, "overlaps tensor \"a\"");
  // Two names for the same bytes.
  EXPECT_CONTAINS(parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                              R"( "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})",
                              "xxxx"),
                  "overlaps");
  // An empty tensor placed inside another one's bytes.
  EXPECT_CONTAINS(parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                              R"( "e": {"dtype": "U8", "shape": [0], "data_offsets": [2, 2]}})",
                              "xxxx"),
                  "overlaps");
}

TEST(SafetensorsHostile, HolesAndTrailingBytes) {
  const std::string hole =
      parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                  R"( "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}})",
                  std::string(12, 'x'));
  EXPECT_CONTAINS(hole, "bytes [4, 8) of the data buffer belong to no tensor");
  EXPECT_CONTAINS(hole, "\"b\"");
  EXPECT_CONTAINS(parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}})",
                              std::string(8, 'x')),
                  "hole");
  EXPECT_CONTAINS(parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})",
                              std::string(6, 'x')),
                  "2 bytes after the last tensor");
  EXPECT_CONTAINS(parse_error("{}", "x"), "1 bytes after the last tensor");
}

TEST(SafetensorsHostile, BadMetadata) {
  EXPECT_CONTAINS(parse_error(R"({"__metadata__": [1]})", ""),
                  "__metadata__ must be an object of strings");
  EXPECT_CONTAINS(parse_error(R"({"__metadata__": {"epoch": 3}})", ""),
                  "__metadata__ key \"epoch\" must map to a string");
  EXPECT_CONTAINS(parse_error(R"({"__metadata__": {"a": {"b": "c"}}})", ""),
                  "must map to a string");
}

TEST(SafetensorsHostile, DuplicateNamesAndKeys) {
  EXPECT_CONTAINS(parse_error(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},)"
                              R"( "w": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}})",
                              "xxxx"),
                  "tensor \"w\" appears twice in the header");
  EXPECT_CONTAINS(parse_error(R"({"w": {"dtype": "U8", "dtype": "F32", "shape": [2],)"
                              R"( "data_offsets": [0, 2]}})",
                              "xx"),
                  "key \"dtype\" appears twice");
  EXPECT_CONTAINS(parse_error(R"({"__metadata__": {}, "__metadata__": {}})", ""), "twice");
}

TEST(SafetensorsHostile, DeepNestingIsRefusedEarly) {
  const std::string deep = "{\"w\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_CONTAINS(parse_error(deep, ""), "deeper");
}

TEST(SafetensorsHostile, LongNamesAreShortenedInMessages) {
  const std::string name(10000, 'n');
  const std::string message = parse_error("{\"" + name + "\": 1}", "");
  EXPECT_LT(message.size(), 400u) << message;
  EXPECT_CONTAINS(message, "...");
}

TEST_F(SafetensorsTest, EmptyAndTinyFilesOnDiskAreClearErrors) {
  write_file_atomic(dir_ / "empty.safetensors", "");
  EXPECT_CONTAINS(error_of([&] { SafetensorsFile::open(dir_ / "empty.safetensors"); }),
                  "file is 0 bytes");
  EXPECT_CONTAINS(error_of([&] { SafetensorsFile::open(dir_ / "missing.safetensors"); }),
                  "No such file or directory");
}

// ---------------------------------------------------------------------------------------------
// Sweeps: no prefix and no single-byte corruption of a valid file may crash the reader.
// Each candidate lives in a buffer of exactly its size, so a sanitizer build catches any read
// past its end.

namespace {

// Every tensor byte is read, so an out-of-range view cannot go unnoticed under ASan.
size_t touch_all_bytes(const SafetensorsFile& file) {
  size_t sum = 0;
  for (const SafetensorsTensor& tensor : file.tensors()) {
    for (size_t i = 0; i < tensor.nbytes; ++i) sum += tensor.data[i];
  }
  return sum;
}

}  // namespace

TEST(SafetensorsSweep, EveryTruncationIsAnError) {
  const std::string bytes = sample_file_bytes();
  for (size_t size = 0; size < bytes.size(); ++size) {
    std::vector<uint8_t> prefix(bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(size));
    try {
      const SafetensorsFile file = SafetensorsFile::parse(prefix.data(), size, "prefix");
      // The sample's last tensor is not empty, so every strict prefix loses bytes it needs.
      ADD_FAILURE() << "prefix of " << size << " bytes parsed (" << touch_all_bytes(file) << ")";
    } catch (const Error&) {
    }
  }
  const std::vector<uint8_t> whole(bytes.begin(), bytes.end());
  const SafetensorsFile file = SafetensorsFile::parse(whole.data(), whole.size(), "whole");
  EXPECT_EQ(file.tensors().size(), 7u);
}

TEST(SafetensorsSweep, EverySingleByteCorruptionIsAnErrorOrAValidFile) {
  const std::string bytes = sample_file_bytes();
  size_t still_valid = 0;
  for (size_t position = 0; position < bytes.size(); ++position) {
    for (const uint8_t replacement :
         {uint8_t{0x00}, uint8_t{0xff}, uint8_t{'9'}, uint8_t{'"'}, uint8_t{'['}, uint8_t{'}'}}) {
      std::vector<uint8_t> corrupt(bytes.begin(), bytes.end());
      corrupt[position] = replacement;
      try {
        const SafetensorsFile file = SafetensorsFile::parse(corrupt.data(), corrupt.size(), "c");
        touch_all_bytes(file);
        ++still_valid;  // e.g. a changed data byte or metadata character
      } catch (const Error&) {
      }
    }
  }
  EXPECT_GT(still_valid, 0u);
}
