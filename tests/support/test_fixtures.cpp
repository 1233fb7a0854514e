// tests/support/fixtures.h: fixtures are found from any checkout, and a missing one fails with
// its path.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "fixtures.h"
#include "temp_dir.h"

namespace fs = std::filesystem;
using namespace memtune::test;

namespace {

class FixturesTest : public TempDirTest {
 protected:
  FixturesTest() : TempDirTest("memtune_fixtures") {}
  void TearDown() override {
    unsetenv("MEMTUNE_SOURCE_DIR");
    TempDirTest::TearDown();
  }
};

TEST_F(FixturesTest, FindsAFixtureOfThisCheckout) {
  const fs::path path = fixture_path("report/ladder_cpu.json");
  EXPECT_TRUE(fs::is_regular_file(path)) << path;
}

TEST_F(FixturesTest, AMissingFixtureFailsWithItsPath) {
  try {
    fixture_path("report/no_such_fixture.json");
    FAIL() << "expected a missing fixture to throw";
  } catch (const std::runtime_error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find((source_root() / "tests" / "fixtures" / "report/no_such_fixture.json").string()),
              std::string::npos)
        << message;
  }
}

// configs/ and examples/ come through the same lookup; a parsed fixture that is missing names its
// path, not the parser's "unexpected end of input".
TEST_F(FixturesTest, OtherCheckoutFilesAndParsedFixtures) {
  EXPECT_TRUE(fs::is_regular_file(source_path("configs/models/tiny.json")));
  EXPECT_EQ(read_json_fixture("generate/greedy.json").type(), nlohmann::json::value_t::object);
  try {
    read_json_fixture("golden/no_such_case/config.json");
    FAIL() << "expected a missing fixture to throw";
  } catch (const std::runtime_error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("golden/no_such_case/config.json"), std::string::npos) << message;
    EXPECT_EQ(message.find("unexpected end of input"), std::string::npos) << message;
  }
}

// A copy of the checkout at another path (as a device run gets one): MEMTUNE_SOURCE_DIR names it.
TEST_F(FixturesTest, MemtuneSourceDirPointsAtAnotherCheckout) {
  fs::create_directories(dir_ / "tests" / "fixtures" / "report");
  fs::copy_file(fixture_path("report/ladder_cpu.json"), dir_ / "tests" / "fixtures" / "report" / "ladder_cpu.json");
  setenv("MEMTUNE_SOURCE_DIR", dir_.c_str(), 1);
  EXPECT_EQ(source_root(), dir_);
  EXPECT_EQ(fixture_path("report/ladder_cpu.json"), dir_ / "tests" / "fixtures" / "report" / "ladder_cpu.json");
  EXPECT_THROW(fixture_path("report/ladder_gpu.json"), std::runtime_error);  // not in the copy
}

}  // namespace
