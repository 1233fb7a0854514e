#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"
#include "../support/expect_error.h"
#include "../support/temp_dir.h"

using namespace memtune;
using memtune::test::error_of;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

class JsonFileTest : public test::TempDirTest {
 protected:
  JsonFileTest() : TempDirTest("memtune_json") {}
};

const json kConfig = json::parse(R"({
  "hidden_size": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": false,
  "model_type": "llama", "rope_scaling": null, "eos_token_id": [128001, 128008],
  "whole_float": 8192.0, "huge": 18446744073709551615, "negative": -3,
  "rope": {"factor": 8.0}
})");

}  // namespace

TEST_F(JsonFileTest, ReadsObject) {
  write_file_atomic(dir_ / "config.json", R"({"a": [1, 2], "b": "x"})");
  const json j = read_json_file(dir_ / "config.json");
  EXPECT_EQ(j["a"][1], 2);
  EXPECT_EQ(j["b"], "x");
}

TEST_F(JsonFileTest, SyntaxErrorNamesFileLineAndColumn) {
  write_file_atomic(dir_ / "config.json", "{\n  \"a\": 1,\n  oops\n}");
  const std::string message = error_of([&] { read_json_file(dir_ / "config.json"); });
  EXPECT_CONTAINS(message, (dir_ / "config.json").string());
  EXPECT_CONTAINS(message, "line 3, column 3");
  EXPECT_CONTAINS(message, "byte 14");
  EXPECT_EQ(message.find("[json.exception"), std::string::npos) << message;
}

TEST_F(JsonFileTest, EmptyAndTruncatedFilesAreSyntaxErrors) {
  write_file_atomic(dir_ / "empty.json", "");
  EXPECT_CONTAINS(error_of([&] { read_json_file(dir_ / "empty.json"); }), "invalid JSON");
  write_file_atomic(dir_ / "cut.json", "{\"a\": [1, 2");
  EXPECT_CONTAINS(error_of([&] { read_json_file(dir_ / "cut.json"); }), "line 1");
}

TEST_F(JsonFileTest, NulByteIsAnErrorNotTheEndOfInput) {
  write_file_atomic(dir_ / "config.json", std::string("{\"a\": 1}\0{\"b\"", 13));
  const std::string message = error_of([&] { read_json_file(dir_ / "config.json"); });
  EXPECT_CONTAINS(message, "line 1, column 9 (byte 8): NUL byte");
}

TEST_F(JsonFileTest, NumberTooLargeForADoubleIsAnError) {
  write_file_atomic(dir_ / "config.json", R"({"rope_theta": 1e999})");
  const std::string message = error_of([&] { read_json_file(dir_ / "config.json"); });
  EXPECT_CONTAINS(message, "config.json: invalid JSON");
  EXPECT_CONTAINS(message, "number overflow");
}

TEST_F(JsonFileTest, MissingFileNamesPath) {
  const std::string message = error_of([&] { read_json_file(dir_ / "config.json"); });
  EXPECT_CONTAINS(message, "config.json");
  EXPECT_CONTAINS(message, "No such file or directory");
}

TEST(JsonGet, TypedValues) {
  EXPECT_EQ(json_get<int64_t>(kConfig, "hidden_size", "config.json"), 4096);
  EXPECT_EQ(json_get<int>(kConfig, "hidden_size", "config.json"), 4096);
  EXPECT_DOUBLE_EQ(json_get<double>(kConfig, "rms_norm_eps", "config.json"), 1e-5);
  EXPECT_FLOAT_EQ(json_get<float>(kConfig, "rms_norm_eps", "config.json"), 1e-5f);
  EXPECT_DOUBLE_EQ(json_get<double>(kConfig, "hidden_size", "config.json"), 4096.0);
  EXPECT_FALSE(json_get<bool>(kConfig, "tie_word_embeddings", "config.json"));
  EXPECT_EQ(json_get<std::string>(kConfig, "model_type", "config.json"), "llama");
  EXPECT_EQ(json_get<std::vector<int64_t>>(kConfig, "eos_token_id", "config.json"),
            (std::vector<int64_t>{128001, 128008}));
  EXPECT_EQ(json_get<int64_t>(kConfig, "whole_float", "config.json"), 8192);
  EXPECT_EQ(json_get<int64_t>(kConfig, "negative", "config.json"), -3);
  EXPECT_DOUBLE_EQ(
      json_get<double>(json_require(kConfig, "rope", "config.json"), "factor", "config.json: rope"),
      8.0);
}

TEST(JsonGet, MissingKeyNamesFileAndKey) {
  EXPECT_EQ(error_of([] { json_get<int64_t>(kConfig, "num_hidden_layers", "config.json"); }),
            "config.json: missing key \"num_hidden_layers\"");
}

TEST(JsonGet, WrongTypeNamesKeyAndWhatWasFound) {
  EXPECT_EQ(error_of([] { json_get<int64_t>(kConfig, "model_type", "config.json"); }),
            "config.json: key \"model_type\": expected an integer, got string \"llama\"");
  EXPECT_CONTAINS(error_of([] { json_get<int64_t>(kConfig, "rms_norm_eps", "c.json"); }),
                  "expected an integer, got number");
  EXPECT_CONTAINS(error_of([] { json_get<bool>(kConfig, "hidden_size", "c.json"); }),
                  "expected true or false");
  EXPECT_CONTAINS(error_of([] { json_get<std::string>(kConfig, "rope_scaling", "c.json"); }),
                  "got null");
  EXPECT_CONTAINS(
      error_of([] { json_get<std::vector<std::string>>(kConfig, "eos_token_id", "c.json"); }),
      "key \"eos_token_id\"[0]: expected a string");
  EXPECT_CONTAINS(error_of([] { json_get<double>(kConfig, "rope", "c.json"); }), "got an object");
}

TEST(JsonGet, IntegersAreRangeChecked) {
  EXPECT_CONTAINS(error_of([] { json_get<int64_t>(kConfig, "huge", "c.json"); }), "out of range");
  const json big = {{"n", int64_t{1} << 40}};
  EXPECT_CONTAINS(error_of([&] { json_get<int>(big, "n", "c.json"); }), "32-bit");
  EXPECT_EQ(json_get<int64_t>(big, "n", "c.json"), int64_t{1} << 40);
}

TEST(JsonGet, OptionalAndDefaults) {
  EXPECT_EQ(json_get_or<int64_t>(kConfig, "head_dim", 128, "c.json"), 128);
  EXPECT_EQ(json_get_or<int64_t>(kConfig, "hidden_size", 1, "c.json"), 4096);
  EXPECT_EQ(json_get_or<std::string>(kConfig, "rope_scaling", "none", "c.json"), "none");
  EXPECT_FALSE(json_get_optional<double>(kConfig, "rope_scaling", "c.json").has_value());
  EXPECT_FALSE(json_get_optional<double>(kConfig, "absent", "c.json").has_value());
  EXPECT_EQ(json_get_optional<double>(kConfig, "rms_norm_eps", "c.json").value(), 1e-5);
  // A present value of the wrong type is an error, not the default.
  EXPECT_CONTAINS(error_of([] { json_get_or<int64_t>(kConfig, "model_type", 0, "c.json"); }),
                  "key \"model_type\"");
}

TEST(JsonGet, NonObjectIsClearError) {
  EXPECT_EQ(error_of([] { json_get<int64_t>(json::array({1}), "x", "c.json"); }),
            "c.json: expected a JSON object, got an array of 1");
}
