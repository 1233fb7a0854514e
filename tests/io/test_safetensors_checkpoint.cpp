// Checkpoints: single files, directories, sharded indexes; the model-side checks; the sharded
// writer; and the fuzzer's seed corpus.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"
#include "memtune/io/safetensors.h"
#include "../support/expect_error.h"
#include "../support/fixtures.h"
#include "../support/temp_dir.h"

using namespace memtune;
using memtune::test::error_of;
namespace fs = std::filesystem;

namespace {

// A tiny Llama-shaped parameter set: two layers of f32 weights with distinct values.
struct TinyModel {
  std::vector<std::vector<float>> storage;
  std::vector<SafetensorsWriteEntry> entries;

  TinyModel() {
    add("model.embed_tokens.weight", Shape{16, 8});
    for (int layer = 0; layer < 2; ++layer) {
      const std::string prefix = "model.layers." + std::to_string(layer) + ".";
      add(prefix + "input_layernorm.weight", Shape{8});
      add(prefix + "self_attn.q_proj.weight", Shape{8, 8});
      add(prefix + "self_attn.k_proj.weight", Shape{4, 8});
      add(prefix + "mlp.down_proj.weight", Shape{8, 12});
    }
    add("model.norm.weight", Shape{8});
    add("lm_head.weight", Shape{16, 8});
    for (size_t i = 0; i < entries.size(); ++i) entries[i].data = storage[i].data();
  }
  void add(const std::string& name, Shape shape) {
    storage.emplace_back(static_cast<size_t>(shape.numel()));
    std::iota(storage.back().begin(), storage.back().end(),
              static_cast<float>(storage.size() * 1000));
    entries.push_back({name, DType::f32, shape, nullptr});
  }
  uint64_t total_bytes() const {
    uint64_t total = 0;
    for (const auto& values : storage) total += values.size() * 4;
    return total;
  }
};

void expect_checkpoint_holds(const SafetensorsCheckpoint& checkpoint, const TinyModel& model) {
  ASSERT_EQ(checkpoint.size(), model.entries.size());
  for (size_t i = 0; i < model.entries.size(); ++i) {
    const SafetensorsWriteEntry& entry = model.entries[i];
    SCOPED_TRACE(entry.name);
    EXPECT_EQ(checkpoint.names()[i], entry.name);  // shard order, then file order
    const SafetensorsTensor& tensor =
        expect_tensor(checkpoint, entry.name, DType::f32, entry.shape);
    ASSERT_EQ(tensor.nbytes, model.storage[i].size() * 4);
    EXPECT_EQ(std::memcmp(tensor.data, model.storage[i].data(), tensor.nbytes), 0);
    EXPECT_EQ(checkpoint.find(entry.name), &tensor);
  }
}

class CheckpointTest : public test::TempDirTest {
 protected:
  CheckpointTest() : TempDirTest("memtune_ckpt") {}

  std::vector<std::string> files_in(const fs::path& directory) const {
    std::vector<std::string> names;
    for (const auto& item : fs::directory_iterator(directory)) {
      names.push_back(item.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  TinyModel model_;
};

}  // namespace

TEST_F(CheckpointTest, SingleFileByPathAndByDirectory) {
  write_safetensors(dir_ / "model.safetensors", model_.entries, {{"format", "pt"}});
  expect_checkpoint_holds(SafetensorsCheckpoint::open(dir_ / "model.safetensors"), model_);
  const SafetensorsCheckpoint by_directory = SafetensorsCheckpoint::open(dir_);
  expect_checkpoint_holds(by_directory, model_);
  EXPECT_EQ(by_directory.source_name(), (dir_ / "model.safetensors").string());
  EXPECT_EQ(by_directory.metadata().at("format"), "pt");
  EXPECT_EQ(by_directory.files().size(), 1u);
}

TEST_F(CheckpointTest, ShardedRoundTrip) {
  // About three layers' worth per shard: several shards, none empty.
  const std::vector<fs::path> written =
      write_sharded_safetensors(dir_, model_.entries, 700, {{"format", "pt"}});
  ASSERT_GT(written.size(), 3u);
  EXPECT_EQ(written.back().filename(), "model.safetensors.index.json");
  const size_t shard_count = written.size() - 1;
  const std::string count = fmt::format("{:05d}", shard_count);
  EXPECT_EQ(written.front().filename(), "model-00001-of-" + count + ".safetensors");
  for (size_t i = 0; i < shard_count; ++i) {
    EXPECT_EQ(SafetensorsFile::open(written[i]).metadata().at("format"), "pt");
  }

  const nlohmann::json index = read_json_file(written.back());
  EXPECT_EQ(index["metadata"]["total_size"], model_.total_bytes());
  EXPECT_EQ(index["weight_map"].size(), model_.entries.size());
  EXPECT_EQ(index["weight_map"]["model.embed_tokens.weight"],
            "model-00001-of-" + count + ".safetensors");
  EXPECT_EQ(index["weight_map"]["lm_head.weight"],
            fmt::format("model-{:05d}-of-{}.safetensors", shard_count, count));

  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(dir_);
  expect_checkpoint_holds(checkpoint, model_);
  EXPECT_EQ(checkpoint.files().size(), shard_count);
  EXPECT_EQ(checkpoint.file_of("lm_head.weight").source_name(), written[shard_count - 1].string());
  expect_checkpoint_holds(SafetensorsCheckpoint::open(written.back()), model_);
  expect_checkpoint_holds(SafetensorsCheckpoint::open(dir_, "model.safetensors.index.json"),
                          model_);
}

TEST_F(CheckpointTest, ShardsRespectTheLimitAndOversizedTensorsGetTheirOwn) {
  const std::vector<fs::path> written = write_sharded_safetensors(dir_, model_.entries, 100);
  for (size_t i = 0; i + 1 < written.size(); ++i) {
    const SafetensorsFile shard = SafetensorsFile::open(written[i]);
    uint64_t bytes = 0;
    for (const auto& tensor : shard.tensors()) bytes += tensor.nbytes;
    EXPECT_TRUE(bytes <= 100 || shard.tensors().size() == 1) << written[i];
  }
  expect_checkpoint_holds(SafetensorsCheckpoint::open(dir_), model_);
}

TEST_F(CheckpointTest, ShardedWriterWritesOneFileWhenItFits) {
  const std::vector<fs::path> written =
      write_sharded_safetensors(dir_ / "new_dir", model_.entries, model_.total_bytes());
  ASSERT_EQ(written.size(), 1u);
  EXPECT_EQ(written[0], dir_ / "new_dir" / "model.safetensors");
  EXPECT_EQ(files_in(dir_ / "new_dir"), std::vector<std::string>{"model.safetensors"});
  expect_checkpoint_holds(SafetensorsCheckpoint::open(dir_ / "new_dir"), model_);
}

TEST_F(CheckpointTest, ResavingWithAnotherLayoutRemovesStaleWeightFiles) {
  write_file_atomic(dir_ / "config.json", "{}");
  write_sharded_safetensors(dir_, model_.entries, 300);
  const size_t many = files_in(dir_).size();
  write_sharded_safetensors(dir_, model_.entries, 1200);
  const std::vector<std::string> fewer = files_in(dir_);
  EXPECT_LT(fewer.size(), many);
  EXPECT_EQ(fewer.front(), "config.json");  // not a weight file: kept
  expect_checkpoint_holds(SafetensorsCheckpoint::open(dir_), model_);

  write_sharded_safetensors(dir_, model_.entries, 1 << 20);
  EXPECT_EQ(files_in(dir_), (std::vector<std::string>{"config.json", "model.safetensors"}));
  expect_checkpoint_holds(SafetensorsCheckpoint::open(dir_), model_);

  write_sharded_safetensors(dir_, model_.entries, 300);
  EXPECT_FALSE(fs::exists(dir_ / "model.safetensors"));
  expect_checkpoint_holds(SafetensorsCheckpoint::open(dir_), model_);
}

TEST_F(CheckpointTest, MissingShardIsClearError) {
  const std::vector<fs::path> written = write_sharded_safetensors(dir_, model_.entries, 700);
  fs::remove(written[1]);
  const std::string message = error_of([&] { SafetensorsCheckpoint::open(dir_); });
  EXPECT_CONTAINS(message, "model.safetensors.index.json");
  EXPECT_CONTAINS(message, written[1].filename().string());
  EXPECT_CONTAINS(message, "is missing");
}

TEST_F(CheckpointTest, IndexNamingATensorItsShardLacksIsClearError) {
  const std::vector<fs::path> written = write_sharded_safetensors(dir_, model_.entries, 700);
  nlohmann::json index = read_json_file(written.back());
  index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = written[0].filename().string();
  // A tensor the index moved to a shard that does not hold it.
  index["weight_map"]["lm_head.weight"] = written[0].filename().string();
  write_file_atomic(written.back(), index.dump());
  const std::string message = error_of([&] { SafetensorsCheckpoint::open(dir_); });
  EXPECT_CONTAINS(message, "but that shard does not hold it");
}

TEST_F(CheckpointTest, MalformedIndexesAreClearErrors) {
  write_safetensors(dir_ / "model-00001-of-00001.safetensors", model_.entries);
  const auto error_for_index = [&](const std::string& text) {
    write_file_atomic(dir_ / "model.safetensors.index.json", text);
    return error_of([&] { SafetensorsCheckpoint::open(dir_); });
  };
  EXPECT_CONTAINS(error_for_index("{\"weight_map\": "), "invalid JSON");
  EXPECT_CONTAINS(error_for_index("[]"), "expected a JSON object");
  EXPECT_CONTAINS(error_for_index("{}"), "missing key \"weight_map\"");
  EXPECT_CONTAINS(error_for_index(R"({"weight_map": []})"), "weight_map must be an object");
  EXPECT_CONTAINS(error_for_index(R"({"weight_map": {"a": 1}})"), "must be a file name");
  EXPECT_CONTAINS(error_for_index(R"({"weight_map": {"a": "../x.safetensors"}})"),
                  "not a file inside");
  EXPECT_CONTAINS(error_for_index(R"({"weight_map": {"a": "/etc/passwd"}})"), "not a file inside");
}

TEST_F(CheckpointTest, AdapterFileInDirectoryByNameOrAsTheOnlyFile) {
  write_safetensors(dir_ / "adapter_model.safetensors", model_.entries);
  expect_checkpoint_holds(SafetensorsCheckpoint::open(dir_, "adapter_model.safetensors"), model_);
  expect_checkpoint_holds(SafetensorsCheckpoint::open(dir_), model_);

  write_safetensors(dir_ / "other.safetensors", model_.entries);
  const std::string message = error_of([&] { SafetensorsCheckpoint::open(dir_); });
  EXPECT_CONTAINS(message, "adapter_model.safetensors, other.safetensors");
  EXPECT_CONTAINS(message, "name the one to open");
  const std::string missing =
      error_of([&] { SafetensorsCheckpoint::open(dir_, "nope.safetensors"); });
  EXPECT_CONTAINS(missing, "nope.safetensors does not exist");
  EXPECT_CONTAINS(missing, "adapter_model.safetensors");
}

TEST_F(CheckpointTest, MissingPathOrEmptyDirectoryIsClearError) {
  EXPECT_CONTAINS(error_of([&] { SafetensorsCheckpoint::open(dir_ / "absent"); }),
                  "does not exist");
  const std::string message = error_of([&] { SafetensorsCheckpoint::open(dir_); });
  EXPECT_CONTAINS(message, dir_.string());
  EXPECT_CONTAINS(message, "model.safetensors.index.json");
  EXPECT_CONTAINS(error_of([&] { SafetensorsCheckpoint::open(dir_ / "absent", "x.safetensors"); }),
                  "is not a directory");
}

TEST_F(CheckpointTest, ExpectTensorNamesShapeAndDtypeMismatches) {
  write_safetensors(dir_ / "model.safetensors", model_.entries);
  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(dir_);
  const std::string file = (dir_ / "model.safetensors").string();
  EXPECT_EQ(error_of([&] {
              expect_tensor(checkpoint, "model.layers.0.self_attn.k_proj.weight", DType::f32,
                            Shape{8, 8});
            }),
            "model.layers.0.self_attn.k_proj.weight: shape [4, 8] in file " + file +
                ", model expects [8, 8]");
  EXPECT_EQ(
      error_of([&] { expect_tensor(checkpoint, "model.norm.weight", DType::bf16, Shape{8}); }),
      "model.norm.weight: dtype F32 in file " + file + ", model expects BF16");
  EXPECT_CONTAINS(
      error_of([&] {
        expect_tensor(checkpoint, "model.norm.weight", {DType::f16, DType::bf16}, Shape{8});
      }),
      "model expects F16 or BF16");
  EXPECT_EQ(&expect_tensor(checkpoint, "model.norm.weight", {DType::f16, DType::bf16, DType::f32},
                           Shape{8}),
            checkpoint.find("model.norm.weight"));
}

TEST_F(CheckpointTest, MissingTensorErrorHintsAtPrefixedName) {
  write_safetensors(dir_ / "model.safetensors", model_.entries);
  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(dir_);
  const std::string message = error_of([&] { checkpoint.get("layers.0.mlp.down_proj.weight"); });
  EXPECT_CONTAINS(message, "no tensor named \"layers.0.mlp.down_proj.weight\"");
  EXPECT_CONTAINS(message, "the checkpoint has \"model.layers.0.mlp.down_proj.weight\"");
  EXPECT_CONTAINS(error_of([&] { checkpoint.get("base_model.model.model.norm.weight"); }),
                  "the checkpoint has \"model.norm.weight\"");
  EXPECT_EQ(checkpoint.find("weight"), nullptr);
  EXPECT_EQ(error_of([&] { checkpoint.get("weight"); }).find("the checkpoint has"),
            std::string::npos);
}

TEST_F(CheckpointTest, ReleasingPagesKeepsTensorsReadable) {
  write_safetensors(dir_ / "model.safetensors", model_.entries);
  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(dir_);
  for (const std::string& name : checkpoint.names()) {
    checkpoint.file_of(name).release_pages(checkpoint.get(name));
  }
  expect_checkpoint_holds(checkpoint, model_);
}

TEST_F(CheckpointTest, CheckpointSurvivesMoves) {
  write_sharded_safetensors(dir_, model_.entries, 700);
  SafetensorsCheckpoint first = SafetensorsCheckpoint::open(dir_);
  std::vector<SafetensorsCheckpoint> many;
  many.push_back(std::move(first));
  many.push_back(SafetensorsCheckpoint::open(dir_));
  many.push_back(SafetensorsCheckpoint::open(dir_));
  for (const auto& checkpoint : many) expect_checkpoint_holds(checkpoint, model_);
}

// Writes the libFuzzer seed corpus (fuzz/README.md) into the build folder: valid files of
// each shape of content, so that mutations start from files that get past the header checks.
TEST(SafetensorsFuzzSeeds, WriteSeedCorpus) {
  const fs::path seeds = fs::path(MEMTUNE_BINARY_DIR) / "fuzz_safetensors_seeds";
  fs::create_directories(seeds);
  TinyModel model;
  const std::vector<float> f32 = {1, 2, 3, 4};
  const std::vector<uint16_t> half = {0x3c00, 0x4000};
  const std::vector<uint8_t> bytes = {1, 2, 3};
  const int32_t id = 7;
  using Entries = std::vector<SafetensorsWriteEntry>;
  const std::vector<std::pair<std::string, std::string>> corpus = {
      {"empty", serialize_safetensors({})},
      {"metadata_only", serialize_safetensors({}, {{"format", "pt"}})},
      {"one_f32", serialize_safetensors(Entries{{"w", DType::f32, Shape{2, 2}, f32.data()}})},
      {"mixed", serialize_safetensors(Entries{{"a", DType::f16, Shape{2}, half.data()},
                                              {"b", DType::bf16, Shape{1, 2}, half.data()},
                                              {"c", DType::u8, Shape{3}, bytes.data()},
                                              {"d", DType::i32, Shape{}, &id},
                                              {"e", DType::f32, Shape{0, 1, 2, 3}, nullptr}},
                                      {{"format", "pt"}, {"k", "v"}})},
      {"tiny_model", serialize_safetensors(std::vector<SafetensorsWriteEntry>(
                                               model.entries.begin(), model.entries.begin() + 3),
                                           {{"format", "pt"}})},
  };
  for (const auto& [name, content] : corpus) {
    write_file_atomic(seeds / (name + ".safetensors"), content);
    EXPECT_NO_THROW(SafetensorsFile::open(seeds / (name + ".safetensors")));
  }
  fs::copy_file(
      memtune::test::fixture_path("safetensors/python_numpy.safetensors"),
      seeds / "python_numpy.safetensors", fs::copy_options::overwrite_existing);
}
