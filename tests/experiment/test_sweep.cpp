// memtune sweep on the tiny model, on the CPU: eager attention memory grows with seq^2, flash
// with seq, the charts are valid SVG, and one small point is measured for real.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/experiment/sweep.h"
#include "../report/report_test_util.h"

using namespace memtune;
using nlohmann::json;
namespace fs = std::filesystem;

using namespace memtune::report_test;

namespace {

SweepOptions tiny_sweep(std::vector<int64_t> values, bool plan_only) {
  SweepOptions options;
  options.base.model = "tiny";
  options.base.precision = Precision::bf16;
  options.vary = "seq";
  options.values = std::move(values);
  options.plan_only = plan_only;
  options.steps = 1;
  options.device = "cpu";
  options.quiet = true;
  return options;
}

// attention_bytes and planned peak by (attention, value).
std::map<std::pair<std::string, int64_t>, const json*> by_point(const json& sweep) {
  std::map<std::pair<std::string, int64_t>, const json*> out;
  for (const json& p : sweep["points"]) out[{p["attn_implementation"], p["value"]}] = &p;
  return out;
}

}  // namespace

TEST(Sweep, EagerAttentionGrowsQuadraticallyFlashLinearly) {
  const json sweep = run_sweep(tiny_sweep({128, 256, 512, 1024}, true));
  ASSERT_EQ(sweep["points"].size(), 8u);  // 4 values x eager, flash
  EXPECT_EQ(sweep["vary"], "seq");
  EXPECT_EQ(sweep["attn_implementations"], json({"eager", "flash"}));
  const auto points = by_point(sweep);
  for (int64_t seq : {128, 256, 512}) {
    const auto attention = [&](const char* impl, int64_t s) {
      return (*points.at({impl, s}))["attention_bytes"].get<double>();
    };
    EXPECT_NEAR(attention("eager", 2 * seq) / attention("eager", seq), 4.0, 0.2) << seq;
    EXPECT_NEAR(attention("flash", 2 * seq) / attention("flash", seq), 2.0, 0.1) << seq;
    // And the whole plan: eager's peak pulls away from flash's as the sequence grows.
    const auto gap = [&](int64_t s) {
      return (*points.at({"eager", s}))["planned_peak_bytes"].get<double>() -
             (*points.at({"flash", s}))["planned_peak_bytes"].get<double>();
    };
    EXPECT_GT(gap(2 * seq), 3 * gap(seq)) << seq;
  }
  for (const json& p : sweep["points"]) {
    EXPECT_FALSE(p["measured"].get<bool>());  // --plan-only
    EXPECT_TRUE(p["tokens_per_second"].is_null());
    EXPECT_EQ(p["seq"], p["value"]);
    EXPECT_EQ(p["planned"].size(), 10u);
  }
  // The growth summary says the same.
  ASSERT_EQ(sweep["growth"].size(), 6u);
  for (const json& g : sweep["growth"])
    EXPECT_NEAR(g["attention_bytes_ratio"].get<double>(), g["attn_implementation"] == "eager" ? 4.0 : 2.0, 0.2);

  const std::string table = sweep_terminal_table(sweep);
  EXPECT_NE(table.find("eager attention bytes: 128->256: x4.00"), std::string::npos) << table;
  EXPECT_NE(table.find("flash attention bytes: 128->256: x2.00"), std::string::npos) << table;

  const auto rows = parse_csv(sweep_csv(sweep));
  ASSERT_EQ(rows.size(), 9u);
  for (const auto& row : rows) EXPECT_EQ(row.size(), rows[0].size());
  for (const char* column : {"value", "attn_implementation", "planned_peak_bytes", "attention_bytes", "tokens_per_second",
                             "mfu", "planned_attention_scratch"})
    EXPECT_NE(std::find(rows[0].begin(), rows[0].end(), column), rows[0].end()) << column;
}

TEST(Sweep, ChartsAreValidSvgWithOneLinePerAttentionImplementation) {
  const json sweep = run_sweep(tiny_sweep({128, 256, 512}, true));
  const fs::path out = fs::path(MEMTUNE_BINARY_DIR) / "test_output" / "sweep";  // left to look at
  fs::remove_all(out);
  write_sweep_outputs(sweep, out);
  for (const char* name : {"sweep.json", "sweep.csv", "sweep_memory.svg", "sweep_tokens_per_second.svg"})
    EXPECT_TRUE(fs::is_regular_file(out / name)) << name;
  EXPECT_EQ(json::parse(read_file(out / "sweep.json")), sweep);

  const std::string memory = read_file(out / "sweep_memory.svg");
  EXPECT_EQ(xml_well_formedness_error(memory), "");
  EXPECT_EQ(count_of(memory, "<g class=\"series\">"), 2u);
  EXPECT_EQ(count_of(memory, "<polyline"), 2u);
  EXPECT_NE(memory.find(">eager attention</text>"), std::string::npos);
  EXPECT_NE(memory.find(">flash attention</text>"), std::string::npos);
  EXPECT_NE(memory.find("max_seq_length (tokens)"), std::string::npos);
  const std::string speed = read_file(out / "sweep_tokens_per_second.svg");
  EXPECT_EQ(xml_well_formedness_error(speed), "");
  EXPECT_NE(speed.find("no data"), std::string::npos);  // plan only: nothing measured
  EXPECT_NE(speed.find("plan only"), std::string::npos);
  for (const char* name : {"sweep_memory.svg", "sweep_tokens_per_second.svg"}) {
    const int parsed = python_minidom_check(out / name);
    if (parsed < 0) GTEST_SKIP() << "python3 with xml.dom.minidom is missing: only the built-in XML check ran";
    EXPECT_EQ(parsed, 0) << name;
  }
}

TEST(Sweep, OneTinyPointIsMeasured) {
  SweepOptions options = tiny_sweep({16, 32}, false);
  options.vary = "batch";
  options.base.max_seq_length = 16;
  options.values = {1, 2};
  const json sweep = run_sweep(options);
  ASSERT_EQ(sweep["points"].size(), 4u);
  for (const json& p : sweep["points"]) {
    EXPECT_TRUE(p["measured"].get<bool>()) << p["name"];
    EXPECT_GT(p["tokens_per_second"].get<double>(), 0);
    EXPECT_EQ(p["engine_peak_bytes"], p["planned_peak_bytes"]);
    EXPECT_EQ(p["micro_batch"], p["value"]);
    EXPECT_TRUE(p["mfu"].is_null());  // CPU
    EXPECT_GT(p["model_flops_per_token"].get<double>(), 0);
  }
  EXPECT_TRUE(sweep["device_peak_flops"].is_null());
  const std::string speed = sweep_speed_svg(sweep);
  EXPECT_EQ(xml_well_formedness_error(speed), "");
  EXPECT_EQ(count_of(speed, "<polyline"), 2u);
  EXPECT_NE(sweep_memory_svg(sweep).find("per_device_train_batch_size"), std::string::npos);
}

TEST(Sweep, BadOptionsNameTheFlag) {
  EXPECT_EQ(parse_sweep_values("256,512,1024", "--values"), (std::vector<int64_t>{256, 512, 1024}));
  for (const char* bad : {"", "256,,512", "256,abc", "-5", "12x"}) {
    try {
      parse_sweep_values(bad, "--values");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--values"), std::string::npos) << e.what();
    }
  }
  SweepOptions options = tiny_sweep({64}, true);
  options.vary = "heads";
  EXPECT_THROW(run_sweep(options), Error);
  options = tiny_sweep({64}, true);
  options.attention = {"magic"};
  EXPECT_THROW(run_sweep(options), Error);
  options = tiny_sweep({1}, true);  // max_seq_length 1
  EXPECT_THROW(run_sweep(options), Error);
}
