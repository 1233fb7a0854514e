#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/core/memory.h"
#include "memtune/io/file_util.h"
#include "memtune/report/ladder_report.h"
#include "../support/expect_error.h"
#include "report_test_util.h"

using namespace memtune;
using nlohmann::json;
namespace fs = std::filesystem;

using namespace memtune::report_test;

namespace {

// The message of the memtune::Error that `render` throws, or "" when it does not throw.
template <typename F>
std::string error_of(F render) {
  try {
    render();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

std::map<std::string, ClaimVerdict> verdicts_of(const json& ladder) {
  std::map<std::string, ClaimVerdict> out;
  for (const LadderClaim& claim : ladder_claims(ladder)) out[claim.id] = claim.verdict;
  return out;
}

class LadderReportTest : public ::testing::TestWithParam<std::string> {};

}  // namespace

// Every output, for both fixtures.
TEST_P(LadderReportTest, ProducesEveryOutput) {
  const json ladder = load_fixture(GetParam());
  EXPECT_FALSE(ladder_terminal_table(ladder).empty());
  EXPECT_FALSE(ladder_markdown(ladder).empty());
  EXPECT_FALSE(ladder_csv(ladder).empty());
  EXPECT_FALSE(ladder_svg(ladder).empty());

  // Left in the build tree on purpose: the files to look at (the test is rerun with the same name).
  const fs::path out = fs::path(MEMTUNE_BINARY_DIR) / "test_output" / "report" / fs::path(GetParam()).stem();
  fs::remove_all(out);
  write_ladder_outputs(ladder, out);
  for (const char* name : {"ladder.json", "ladder.csv", "report.md", "ladder.svg"})
    EXPECT_TRUE(fs::is_regular_file(out / name)) << name;
  EXPECT_EQ(json::parse(read_file(out / "ladder.json")), ladder) << "ladder.json must be written back unchanged";
  EXPECT_EQ(read_file(out / "report.md"), ladder_markdown(ladder));
  EXPECT_EQ(read_file(out / "ladder.csv"), ladder_csv(ladder));
  EXPECT_EQ(read_file(out / "ladder.svg"), ladder_svg(ladder));
  for (const auto& entry : fs::directory_iterator(out))
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << "temporary file left behind";
}

TEST_P(LadderReportTest, CsvHasOneRowPerRungAndEveryColumn) {
  const json ladder = load_fixture(GetParam());
  const auto rows = parse_csv(ladder_csv(ladder));
  ASSERT_EQ(rows.size(), ladder["rungs"].size() + 1);
  const std::vector<std::string>& header = rows[0];
  for (const auto& row : rows) EXPECT_EQ(row.size(), header.size());
  const auto has = [&](const std::string& column) {
    return std::find(header.begin(), header.end(), column) != header.end();
  };
  for (int c = 0; c < kNumMemCategories; ++c)
    EXPECT_TRUE(has("planned_" + std::string(category_name(category_at(c))))) << category_name(category_at(c));
  // Every scalar field of every rung has a column; the nested ones are flattened.
  for (const json& rung : ladder["rungs"])
    for (const auto& [key, value] : rung.items())
      if (!value.is_object() && !value.is_array()) EXPECT_TRUE(has(key)) << key;
  for (const char* column : {"techniques", "loss_scaler_skipped_steps", "loss_scaler_final_scale",
                             "peer_tokens_per_second", "peer_peak_reserved_bytes", "saving_vs_previous_bytes",
                             "saving_vs_baseline_bytes"})
    EXPECT_TRUE(has(column)) << column;

  // Values are the JSON's: names, bytes, and empty for null.
  const size_t name_col = std::find(header.begin(), header.end(), "name") - header.begin();
  const size_t peak_col = std::find(header.begin(), header.end(), "planned_peak_bytes") - header.begin();
  const size_t device_col = std::find(header.begin(), header.end(), "device_peak_bytes") - header.begin();
  for (size_t i = 0; i < ladder["rungs"].size(); ++i) {
    const json& rung = ladder["rungs"][i];
    EXPECT_EQ(rows[i + 1][name_col], rung["name"].get<std::string>());
    EXPECT_EQ(rows[i + 1][peak_col], std::to_string(rung["planned_peak_bytes"].get<uint64_t>()));
    if (rung["device_peak_bytes"].is_null()) EXPECT_EQ(rows[i + 1][device_col], "");
  }
}

TEST_P(LadderReportTest, MarkdownHasEveryRungAndEveryClaimWithAVerdict) {
  const json ladder = load_fixture(GetParam());
  const std::string md = ladder_markdown(ladder);
  for (const json& rung : ladder["rungs"]) EXPECT_CONTAINS(md, rung["name"].get<std::string>());
  EXPECT_CONTAINS(md, "## Configuration");
  EXPECT_CONTAINS(md, "## Which memory figure is which");
  EXPECT_CONTAINS(md, "## Memory by category");
  EXPECT_CONTAINS(md, "## fp16 loss scaler");
  EXPECT_CONTAINS(md, ladder["commit"].get<std::string>());
  EXPECT_CONTAINS(md, ladder["date"].get<std::string>());
  EXPECT_CONTAINS(md, ladder["device"].get<std::string>());
  const size_t claims_at = md.find("## Claims");
  ASSERT_NE(claims_at, std::string::npos);
  const std::string claims_section = md.substr(claims_at);
  const std::vector<LadderClaim> claims = ladder_claims(ladder);
  ASSERT_EQ(claims.size(), 6u);
  for (const LadderClaim& claim : claims) {
    // The claim's row carries its verdict.
    const size_t row = claims_section.find(claim.claim);
    ASSERT_NE(row, std::string::npos) << claim.claim;
    const std::string line = claims_section.substr(row, claims_section.find('\n', row) - row);
    EXPECT_CONTAINS(line, "**" + std::string(claim_verdict_name(claim.verdict)) + "**");
    EXPECT_FALSE(claim.measured.empty()) << claim.id;
  }
}

TEST_P(LadderReportTest, SvgIsWellFormedWithOneBarGroupPerRungAndTheBudgetLine) {
  const json ladder = load_fixture(GetParam());
  const std::string svg = ladder_svg(ladder);
  EXPECT_EQ(xml_well_formedness_error(svg), "");
  EXPECT_EQ(count_of(svg, "<g class=\"rung\""), ladder["rungs"].size());
  EXPECT_EQ(count_of(svg, "class=\"budget\""), 1u);
  EXPECT_CONTAINS(svg, "font-family=\"sans-serif\"");
  EXPECT_EQ(svg.find("<script"), std::string::npos);
  EXPECT_EQ(svg.find("@import"), std::string::npos);
  for (const json& rung : ladder["rungs"]) EXPECT_CONTAINS(svg, "<title>" + rung["name"].get<std::string>());

  const fs::path file = fs::temp_directory_path() / ("memtune_report_" + std::to_string(::getpid()) + "_" +
                                                     fs::path(GetParam()).stem().string() + ".svg");
  write_file_atomic(file, svg);
  const int parsed = python_minidom_check(file);
  fs::remove(file);
  if (parsed < 0) GTEST_SKIP() << "python3 with xml.dom.minidom is missing: only the built-in XML check ran";
  EXPECT_EQ(parsed, 0) << "xml.dom.minidom could not parse the SVG";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LadderReportTest, ::testing::Values("ladder_gpu.json", "ladder_cpu.json",
                                                                    "ladder_cpu_runner.json"),
                         [](const auto& info) { return fs::path(info.param).stem().string(); });

TEST(LadderReport, GpuFixtureClaimsComeFromTheData) {
  const json ladder = load_fixture("ladder_gpu.json");
  std::map<std::string, ClaimVerdict> v = verdicts_of(ladder);
  EXPECT_EQ(v["16bit_halves"], ClaimVerdict::not_measured);  // no fp32 rung
  EXPECT_EQ(v["bf16_stable"], ClaimVerdict::not_measured);   // the fp16 rung is plan only
  EXPECT_EQ(v["checkpointing"], ClaimVerdict::held);
  EXPECT_EQ(v["flash_linear"], ClaimVerdict::held);
  EXPECT_EQ(v["qlora_biggest"], ClaimVerdict::did_not_hold);  // checkpointing saves more here
  EXPECT_EQ(v["order_of_impact"], ClaimVerdict::did_not_hold);

  // Make QLoRA the biggest single saving: the verdict follows the numbers.
  json changed = ladder;
  ASSERT_EQ(changed["rungs"][4]["added"], "qlora");
  changed["rungs"][3]["planned_peak_bytes"] = 60ull << 30;
  changed["rungs"][4]["planned_peak_bytes"] = 512ull << 20;
  EXPECT_EQ(verdicts_of(changed)["qlora_biggest"], ClaimVerdict::held);

  // A checkpointing rung that is 60% slower does not hold.
  changed = ladder;
  changed["rungs"][2]["tokens_per_second"] = 0.4 * changed["rungs"][1]["tokens_per_second"].get<double>();
  EXPECT_EQ(verdicts_of(changed)["checkpointing"], ClaimVerdict::did_not_hold);

  // Savings that fall along the ladder: the checklist order holds.
  changed = ladder;
  for (size_t i = 0; i < changed["rungs"].size(); ++i) {
    json& rung = changed["rungs"][i];
    const uint64_t peak = (uint64_t{1} << (40 - i));  // each rung halves: savings fall
    rung["planned_peak_bytes"] = peak;
    rung["engine_peak_bytes"] = nullptr;
    rung["device_peak_bytes"] = nullptr;
  }
  EXPECT_EQ(verdicts_of(changed)["order_of_impact"], ClaimVerdict::held);
}

TEST(LadderReport, CpuFixtureClaimsComeFromTheData) {
  const json ladder = load_fixture("ladder_cpu.json");
  std::map<std::string, ClaimVerdict> v = verdicts_of(ladder);
  EXPECT_EQ(v["16bit_halves"], ClaimVerdict::did_not_hold);  // 38% less: fp32 adapters and optimizer stay
  EXPECT_EQ(v["bf16_stable"], ClaimVerdict::held);           // fp16 skipped steps
  EXPECT_EQ(v["checkpointing"], ClaimVerdict::held);
  EXPECT_EQ(v["flash_linear"], ClaimVerdict::held);
  EXPECT_EQ(v["qlora_biggest"], ClaimVerdict::not_measured);  // no QLoRA rung
  EXPECT_EQ(v["order_of_impact"], ClaimVerdict::did_not_hold);

  // No skipped steps and the same loss: the report says no instability was seen.
  // From enough steps only: a few steps without an overflow are no evidence either way.
  json calm = ladder;
  calm["rungs"][1]["loss_scaler"]["skipped_steps"] = 0;
  calm["rungs"][1]["loss"] = calm["rungs"][2]["loss"];
  calm["config"]["steps_per_rung"] = 3;
  for (const LadderClaim& claim : ladder_claims(calm)) {
    if (claim.id != "bf16_stable") continue;
    EXPECT_EQ(claim.verdict, ClaimVerdict::not_measured);
    EXPECT_CONTAINS(claim.measured, "No instability in 3 steps per rung, too few to judge (at least 50");
  }
  calm["config"]["steps_per_rung"] = 100;
  for (const LadderClaim& claim : ladder_claims(calm)) {
    if (claim.id != "bf16_stable") continue;
    EXPECT_EQ(claim.verdict, ClaimVerdict::did_not_hold);
    EXPECT_CONTAINS(claim.measured, "No instability was seen on this run");
  }
  // A diverged fp16 run (nlohmann writes NaN as null) holds it too.
  json diverged = calm;
  diverged["rungs"][1]["loss"] = nullptr;
  EXPECT_EQ(verdicts_of(diverged)["bf16_stable"], ClaimVerdict::held);
  diverged["rungs"][1]["loss"] = "nan";
  EXPECT_EQ(verdicts_of(diverged)["bf16_stable"], ClaimVerdict::held);

  // 16-bit that really halves the total holds.
  json halves = ladder;
  const uint64_t fp32_peak = halves["rungs"][0]["planned_peak_bytes"].get<uint64_t>();
  halves["rungs"][1]["engine_peak_bytes"] = fp32_peak / 2;
  EXPECT_EQ(verdicts_of(halves)["16bit_halves"], ClaimVerdict::held);
}

TEST(LadderReport, PlanOnlyRungRendersWithoutMeasurements) {
  const json ladder = load_fixture("ladder_gpu.json");
  ASSERT_FALSE(ladder["rungs"][0]["measured"].get<bool>());
  const std::string table = ladder_terminal_table(ladder);
  const std::string first_row = table.substr(table.find("fp16 baseline"), table.find('\n', table.find("fp16 baseline")) -
                                                                               table.find("fp16 baseline"));
  EXPECT_CONTAINS(first_row, "plan only");
  EXPECT_CONTAINS(table, "exceeds budget");  // +bf16 and +gradient checkpointing: measured, over 24 GiB
  EXPECT_CONTAINS(ladder_markdown(ladder), "plan only");
  EXPECT_CONTAINS(ladder_svg(ladder), "plan only");

  // The same rung with its measurement keys absent altogether, not null.
  json bare = ladder;
  for (const char* key : {"engine_peak_bytes", "device_peak_bytes", "step_seconds", "tokens_per_second", "loss",
                          "loss_scaler", "fits_device"})
    bare["rungs"][0].erase(key);
  EXPECT_CONTAINS(ladder_terminal_table(bare), "plan only");
  EXPECT_EQ(xml_well_formedness_error(ladder_svg(bare)), "");
  EXPECT_FALSE(ladder_csv(bare).empty());
  EXPECT_CONTAINS(ladder_markdown(bare), "fp16 baseline");

  // Every rung plan only: nothing to compare, and still no crash.
  json nothing = ladder;
  for (json& rung : nothing["rungs"]) {
    rung["measured"] = false;
    for (const char* key : {"engine_peak_bytes", "device_peak_bytes", "step_seconds", "tokens_per_second", "loss"})
      rung[key] = nullptr;
    rung.erase("peer");
  }
  nothing.erase("isolate");
  const std::string md = ladder_markdown(nothing);
  EXPECT_EQ(md.find("## Against Hugging Face"), std::string::npos);
  EXPECT_EQ(md.find("## Isolating"), std::string::npos);
  EXPECT_EQ(verdicts_of(nothing)["checkpointing"], ClaimVerdict::not_measured);
  EXPECT_EQ(xml_well_formedness_error(ladder_svg(nothing)), "");
}

TEST(LadderReport, TerminalTableColumns) {
  const json ladder = load_fixture("ladder_gpu.json");
  const std::string table = ladder_terminal_table(ladder);
  for (const char* column : {"rung", "planned peak", "engine peak", "device peak", "fits", "tokens/s", "step s", "loss",
                             "saving vs previous", "saving vs baseline"})
    EXPECT_CONTAINS(table, column);
  // Fixed width: the header, the rule and the rows line up (every column starts where the header's does).
  std::vector<std::string> lines;
  for (size_t pos = 0, end; (end = table.find('\n', pos)) != std::string::npos; pos = end + 1)
    lines.push_back(table.substr(pos, end - pos));
  ASSERT_GE(lines.size(), 2 + ladder["rungs"].size());
  const std::string& header = lines[1];
  const std::string& rule = lines[2];
  EXPECT_EQ(rule.find_first_not_of("- "), std::string::npos);
  const size_t loss_column = header.find("loss");
  ASSERT_NE(loss_column, std::string::npos);
  for (size_t i = 3; i < 3 + ladder["rungs"].size(); ++i) EXPECT_EQ(lines[i].size() > loss_column, true);
  EXPECT_CONTAINS(table, "baseline");
  EXPECT_CONTAINS(table, "16.00 GiB (22%)");  // +bf16 against the fp16 baseline, planned
}

TEST(LadderReport, MarkdownSections) {
  const json gpu = load_fixture("ladder_gpu.json");
  const std::string md = ladder_markdown(gpu);
  EXPECT_CONTAINS(md, "# Memory ladder: meta-llama/Llama-3.1-8B");
  EXPECT_CONTAINS(md, "| LoRA targets | q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj |");
  EXPECT_CONTAINS(md, "| max_seq_length | 2048 |");
  EXPECT_CONTAINS(md, "```json");
  EXPECT_CONTAINS(md, "\"vram_budget_bytes\"");
  EXPECT_CONTAINS(md, "nvidia-smi");
  EXPECT_CONTAINS(md, "## Against Hugging Face (peer)");
  EXPECT_CONTAINS(md, "## Isolating each trick");
  EXPECT_CONTAINS(md, "Matters most alone: **gradient checkpointing**");
  EXPECT_CONTAINS(md, "Removal that hurts most: **QLoRA**");
  EXPECT_CONTAINS(md, "\"fp16 baseline\": not measured");
  EXPECT_CONTAINS(md, "`memtune sweep`");
  // Every category appears in the breakdown's header.
  for (int c = 0; c < kNumMemCategories; ++c) EXPECT_CONTAINS(md, std::string(category_label(category_at(c))));

  const std::string cpu = ladder_markdown(load_fixture("ladder_cpu.json"));
  EXPECT_CONTAINS(cpu, "\"fp16\": 2 skipped steps of 10");
  EXPECT_CONTAINS(cpu, "final scale 16384");
  EXPECT_EQ(cpu.find("## Against Hugging Face"), std::string::npos);
}

TEST(LadderReport, MissingOrWrongFieldsNameTheField) {
  const json ladder = load_fixture("ladder_gpu.json");
  const auto all_renderers = [](const json& j) {
    return std::vector<std::string>{error_of([&] { ladder_terminal_table(j); }), error_of([&] { ladder_markdown(j); }),
                                    error_of([&] { ladder_csv(j); }), error_of([&] { ladder_svg(j); }),
                                    error_of([&] { ladder_claims(j); })};
  };
  struct Case {
    std::function<void(json&)> damage;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["rungs"][2].erase("planned_peak_bytes"); },
       {"rungs[2]", "+gradient checkpointing", "missing key \"planned_peak_bytes\""}},
      {[](json& j) { j["rungs"][3]["planned"].erase("attention_scratch"); },
       {"rungs[3]", "planned", "missing key \"attention_scratch\""}},
      {[](json& j) { j["rungs"][1].erase("name"); }, {"rungs[1]", "missing key \"name\""}},
      {[](json& j) { j.erase("device"); }, {"missing key \"device\""}},
      {[](json& j) { j.erase("budget_bytes"); }, {"missing key \"budget_bytes\""}},
      {[](json& j) { j["config"].erase("model"); }, {"config", "missing key \"model\""}},
      {[](json& j) { j.erase("rungs"); }, {"missing key \"rungs\""}},
      {[](json& j) { j["rungs"] = json::array(); }, {"rungs", "no rungs"}},
      {[](json& j) { j["rungs"][0]["fits_budget"] = "no"; }, {"fits_budget", "expected true or false"}},
      {[](json& j) { j["rungs"][5]["planned"]["workspace"] = -1; }, {"workspace", ">= 0"}},
      {[](json& j) { j["rungs"][1]["tokens_per_second"] = "fast"; }, {"tokens_per_second", "expected a number"}},
      {[](json& j) { j["rungs"][4]["techniques"] = "qlora"; }, {"techniques", "expected an array"}},
      {[](json& j) { j["isolate"]["alone"][0].erase("planned_peak_bytes"); },
       {"isolate.alone[0]", "missing key \"planned_peak_bytes\""}},
  };
  for (const Case& c : cases) {
    json damaged = ladder;
    c.damage(damaged);
    for (const std::string& message : all_renderers(damaged)) {
      ASSERT_FALSE(message.empty()) << "expected a memtune::Error mentioning " << c.expected.front();
      for (const std::string& part : c.expected) EXPECT_CONTAINS(message, part);
    }
  }
  EXPECT_CONTAINS(error_of([] { ladder_markdown(json::array()); }), "expected a JSON object");
}

TEST(LadderReport, InvalidLadderWritesNothing) {
  const fs::path out = fs::temp_directory_path() / ("memtune_report_invalid_" + std::to_string(::getpid()));
  fs::remove_all(out);
  fs::create_directories(out);
  write_file_atomic(out / "report.md", "previous report\n");
  json damaged = load_fixture("ladder_gpu.json");
  damaged["rungs"][0].erase("planned");
  EXPECT_THROW(write_ladder_outputs(damaged, out), Error);
  EXPECT_EQ(read_file(out / "report.md"), "previous report\n");
  EXPECT_FALSE(fs::exists(out / "ladder.json"));
  EXPECT_FALSE(fs::exists(out / "ladder.svg"));
  fs::remove_all(out);
}

TEST(LadderReport, SpecialCharactersAreEscapedAndQuoted) {
  json ladder = load_fixture("ladder_cpu.json");
  ladder["rungs"][2]["name"] = "bf16 <fast> & \"safe\", 'ok' | piped";
  ladder["config"]["model"] = "tiny<&>";
  ladder["device"] = std::string("cpu \x01 weird \xff bytes");
  const std::string svg = ladder_svg(ladder);
  EXPECT_EQ(xml_well_formedness_error(svg), "");
  EXPECT_CONTAINS(svg, "bf16 &lt;fast&gt; &amp; &quot;safe&quot;");
  EXPECT_CONTAINS(svg, "tiny&lt;&amp;&gt;");
  EXPECT_EQ(svg.find('\x01'), std::string::npos);

  const auto rows = parse_csv(ladder_csv(ladder));
  ASSERT_EQ(rows.size(), ladder["rungs"].size() + 1);
  EXPECT_EQ(rows[3][1], "bf16 <fast> & \"safe\", 'ok' | piped");
  for (const auto& row : rows) EXPECT_EQ(row.size(), rows[0].size());

  EXPECT_CONTAINS(ladder_markdown(ladder), "bf16 <fast> & \"safe\", 'ok' \\| piped");
}

TEST(LadderReport, UnknownScalarRungFieldsReachTheCsv) {
  json ladder = load_fixture("ladder_cpu.json");
  ladder["rungs"][1]["planned_with_context_bytes"] = 12345;
  const auto rows = parse_csv(ladder_csv(ladder));
  const auto column = std::find(rows[0].begin(), rows[0].end(), "planned_with_context_bytes");
  ASSERT_NE(column, rows[0].end());
  const size_t index = column - rows[0].begin();
  EXPECT_EQ(rows[2][index], "12345");
  EXPECT_EQ(rows[1][index], "");
}

TEST(LadderReport, NoBudgetAndUnavailableRungs) {
  json ladder = load_fixture("ladder_cpu.json");
  ladder["budget_bytes"] = 0;
  for (json& rung : ladder["rungs"]) rung["fits_budget"] = true;
  ladder["unavailable"] = json::array({{{"name", "+ QLoRA"}, {"reason", "the NF4 base is not wired in yet"}}});
  const std::string svg = ladder_svg(ladder);
  EXPECT_EQ(xml_well_formedness_error(svg), "");
  EXPECT_EQ(svg.find("class=\"budget\""), std::string::npos);
  const std::string md = ladder_markdown(ladder);
  EXPECT_CONTAINS(md, "+ QLoRA: the NF4 base is not wired in yet");
  for (const LadderClaim& claim : ladder_claims(ladder))
    if (claim.id == "qlora_biggest") EXPECT_CONTAINS(claim.measured, "the NF4 base is not wired in yet");
  EXPECT_CONTAINS(ladder_terminal_table(ladder), "no budget");

  // A budget far above every bar is written beside the chart rather than drawn.
  ladder["budget_bytes"] = 8ull << 30;
  const std::string far = ladder_svg(ladder);
  EXPECT_EQ(xml_well_formedness_error(far), "");
  EXPECT_EQ(far.find("class=\"budget\""), std::string::npos);
  EXPECT_CONTAINS(far, "budget 8 GiB");
  EXPECT_CONTAINS(far, "above the scale");
  EXPECT_CONTAINS(far, ">20<");  // MiB ticks: the bars keep their scale
}

// A verdict near its threshold prints the figure to a tenth of a percent and the threshold,
// so that a 49.6% saving that did not hold never reads "50% less".
TEST(LadderReport, CloseVerdictsShowTheirThreshold) {
  json ladder = load_fixture("ladder_cpu.json");
  // Flash's attention scratch + saved activations: 1,000,000 -> 504,000 bytes, 49.6% less.
  ladder["rungs"][3]["planned"]["saved_activations"] = 500000;
  ladder["rungs"][3]["planned"]["attention_scratch"] = 500000;
  ladder["rungs"][4]["planned"]["saved_activations"] = 500000;
  ladder["rungs"][4]["planned"]["attention_scratch"] = 4000;
  for (const LadderClaim& claim : ladder_claims(ladder)) {
    if (claim.id != "flash_linear") continue;
    // One length cannot refute a claim about growth: under the threshold it is not measured.
    EXPECT_EQ(claim.verdict, ClaimVerdict::not_measured);
    EXPECT_CONTAINS(claim.measured, "49.6% less (held needs at least 50%");
  }
}

TEST(LadderReport, XmlCheckerCatchesBrokenDocuments) {
  EXPECT_EQ(xml_well_formedness_error("<svg a=\"1\"><g><text>x &amp; y</text></g></svg>"), "");
  EXPECT_NE(xml_well_formedness_error("<svg><g></svg>"), "");
  EXPECT_NE(xml_well_formedness_error("<svg a=1></svg>"), "");
  EXPECT_NE(xml_well_formedness_error("<svg a=\"1\" a=\"2\"></svg>"), "");
  EXPECT_NE(xml_well_formedness_error("<svg><text>a & b</text></svg>"), "");
  EXPECT_NE(xml_well_formedness_error("<svg><text>a < b</text></svg>"), "");
  EXPECT_NE(xml_well_formedness_error("<svg></svg><svg></svg>"), "");
  EXPECT_NE(xml_well_formedness_error("<svg t=\"a<b\"></svg>"), "");
}

// The runner's own output (memtune ladder on the CPU, tiny model) as it is written today.
TEST(LadderReport, RunnerOutputIsUnderstood) {
  const json ladder = load_fixture("ladder_cpu_runner.json");
  std::map<std::string, ClaimVerdict> v = verdicts_of(ladder);
  EXPECT_NE(v["qlora_biggest"], ClaimVerdict::not_measured);   // found by "added": "qlora"
  EXPECT_NE(v["checkpointing"], ClaimVerdict::not_measured);   // "gradient_checkpointing"
  for (const LadderClaim& claim : ladder_claims(ladder))        // "flash": found (its verdict may be
    if (claim.id == "flash_linear")                             // "not measured" at one short length)
      EXPECT_EQ(claim.measured.find("No rung adds"), std::string::npos) << claim.measured;
  EXPECT_EQ(v["bf16_stable"], ClaimVerdict::not_measured);     // no overflow in 2 steps: too few to judge
  const std::string md = ladder_markdown(ladder);
  EXPECT_CONTAINS(md, "| steps per rung | 2 |");               // steps_per_rung, not the base run's max_steps
  EXPECT_CONTAINS(md, "| micro-batch (per_device_train_batch_size) | 2 |");
  EXPECT_CONTAINS(md, "| LoRA targets | all-linear |");
  EXPECT_CONTAINS(md, "\"fp16 baseline\": 0 skipped steps of 2");
}

namespace {

// A peer.json as bench/peer_hf.py writes it, for the runner fixture's rungs: every rung but the
// baseline (which ran out of memory) measured, 20% slower, with 10% more device memory than `memtune`.
json peer_for(const json& ladder, double speed = 0.8, double memory = 1.1) {
  json rungs = json::array();
  for (const json& r : ladder["rungs"]) {
    const bool baseline = r["added"] == "";
    json rung = {{"name", "hf " + r["name"].get<std::string>()}, {"added", r["added"]},
                 {"techniques", {{"bf16", true}}}, {"measured", !baseline}};
    if (baseline) {
      rung["error"] = "CUDA out of memory";
      for (const char* key : {"tokens_per_second", "step_seconds", "loss", "peak_allocated_bytes", "peak_reserved_bytes",
                              "device_peak_bytes", "context_bytes"})
        rung[key] = nullptr;
    } else {
      rung["tokens_per_second"] = r["tokens_per_second"].get<double>() * speed;
      rung["step_seconds"] = 1.5;
      rung["loss"] = 6.25;
      rung["peak_allocated_bytes"] = 1000000;
      rung["peak_reserved_bytes"] = 2000000;
      rung["device_peak_bytes"] = static_cast<uint64_t>(r["device_peak_bytes"].get<double>() * memory);
      rung["context_bytes"] = 500000000;
    }
    rungs.push_back(rung);
  }
  rungs.push_back({{"name", "hf only"}, {"added", "liger_kernels"}, {"measured", true}, {"tokens_per_second", 1.0}});
  return {{"peer", "transformers 4.46.0, peft 0.13.2, torch 2.5.1, bitsandbytes 0.44.1"},
          {"device", "NVIDIA H200"}, {"date", "2025-01-02"}, {"config", {{"seq", 64}}}, {"rungs", rungs}};
}

// The runner fixture as if it had run on a GPU: device peaks and an MFU on every rung.
json runner_on_gpu() {
  json ladder = load_fixture("ladder_cpu_runner.json");
  ladder["device"] = "NVIDIA H200";
  ladder["device_peak_flops"] = 989.4e12;
  ladder["device_peak_flops_source"] = "NVIDIA H200 datasheet";
  for (json& r : ladder["rungs"]) {
    r["device_peak_bytes"] = r["planned_peak_bytes"].get<uint64_t>() + 500000000;
    r["mfu"] = 0.412;
  }
  return ladder;
}

}  // namespace

TEST(LadderPeer, AttachedByAddedWithComparisonsInEveryOutput) {
  const json ladder = runner_on_gpu();
  const json with_peer = attach_peer(ladder, peer_for(ladder), "peer.json");
  // The rungs keep their own fields; each gets the peer rung with the same "added".
  ASSERT_EQ(with_peer["rungs"].size(), ladder["rungs"].size());
  for (size_t i = 0; i < ladder["rungs"].size(); ++i) {
    json rung = with_peer["rungs"][i];
    ASSERT_TRUE(rung.contains("peer")) << i;
    const json peer = rung["peer"];
    rung.erase("peer");
    EXPECT_EQ(rung, ladder["rungs"][i]);
    EXPECT_EQ(peer["name"], "hf " + ladder["rungs"][i]["name"].get<std::string>());
    if (i == 0) {
      EXPECT_EQ(peer["measured"], false);
      EXPECT_EQ(peer["error"], "CUDA out of memory");
      EXPECT_TRUE(peer["beats_tokens_per_second"].is_null());
      continue;
    }
    EXPECT_NEAR(peer["tokens_per_second_ratio"].get<double>(), 1 / 0.8, 1e-9);
    EXPECT_NEAR(peer["device_peak_ratio"].get<double>(), 1 / 1.1, 1e-6);
    EXPECT_EQ(peer["beats_tokens_per_second"], true);
    EXPECT_EQ(peer["beats_device_peak"], true);
  }
  EXPECT_EQ(with_peer["peer"]["peer"], "transformers 4.46.0, peft 0.13.2, torch 2.5.1, bitsandbytes 0.44.1");
  EXPECT_EQ(with_peer["peer"]["unmatched"], json({"hf only"}));
  EXPECT_EQ(with_peer["peer"]["source"], "peer.json");

  const std::string table = ladder_terminal_table(with_peer);
  for (const char* column : {"peer tokens/s", "peer device peak", "tokens/s vs peer", "device peak vs peer", "MFU"})
    EXPECT_CONTAINS(table, column);
  EXPECT_CONTAINS(table, "1.25x faster");
  EXPECT_CONTAINS(table, "0.91x smaller");
  EXPECT_CONTAINS(table, "41.2%");

  const std::string md = ladder_markdown(with_peer);
  EXPECT_CONTAINS(md, "## Against Hugging Face (peer)");
  EXPECT_CONTAINS(md, "transformers 4.46.0, peft 0.13.2, torch 2.5.1, bitsandbytes 0.44.1 on NVIDIA H200, 2025-01-02");
  EXPECT_CONTAINS(md, "memtune's **device peak** with the peer's **device_peak_bytes**");
  EXPECT_CONTAINS(md, "memtune is faster on 7 of 7 rungs");
  EXPECT_CONTAINS(md, "less device memory on 7 of 7 rungs");
  EXPECT_CONTAINS(md, "did not run: CUDA out of memory");
  EXPECT_CONTAINS(md, "Peer rungs with no memtune rung of the same \"added\": hf only");
  EXPECT_CONTAINS(md, "| 1.25x | **yes** |");
  EXPECT_CONTAINS(md, "**MFU**");
  EXPECT_CONTAINS(md, "989.4 TFLOP/s");
  EXPECT_EQ(md.find("not from the same device"), std::string::npos);

  const auto rows = parse_csv(ladder_csv(with_peer));
  const auto column = [&](const std::string& name) {
    const auto it = std::find(rows[0].begin(), rows[0].end(), name);
    EXPECT_NE(it, rows[0].end()) << name;
    return static_cast<size_t>(it - rows[0].begin());
  };
  EXPECT_EQ(rows[2][column("beats_peer_tokens_per_second")], "true");
  EXPECT_EQ(rows[2][column("beats_peer_device_peak")], "true");
  EXPECT_EQ(rows[1][column("beats_peer_device_peak")], "");  // the peer's baseline did not run
  EXPECT_EQ(rows[1][column("peer_error")], "CUDA out of memory");
  EXPECT_EQ(rows[2][column("peer_device_peak_bytes")],
            std::to_string(with_peer["rungs"][1]["peer"]["device_peak_bytes"].get<uint64_t>()));
  EXPECT_EQ(rows[2][column("mfu")], "0.412");
  for (const auto& row : rows) EXPECT_EQ(row.size(), rows[0].size());

  const std::string svg = ladder_svg(with_peer);
  EXPECT_EQ(xml_well_formedness_error(svg), "");
  EXPECT_EQ(count_of(svg, "class=\"peer-device-peak\""), ladder["rungs"].size() - 1);  // not the baseline
  EXPECT_CONTAINS(svg, "peer device peak (transformers)");

  // Slower and larger: the verdicts follow the numbers. Attaching again replaces the peer.
  const json worse = attach_peer(with_peer, peer_for(ladder, 1.5, 0.5), "peer2.json");
  EXPECT_EQ(worse["rungs"][3]["peer"]["beats_tokens_per_second"], false);
  EXPECT_EQ(worse["rungs"][3]["peer"]["beats_device_peak"], false);
  EXPECT_EQ(worse["peer"]["source"], "peer2.json");
  EXPECT_CONTAINS(ladder_markdown(worse), "memtune is faster on 0 of 7 rungs");
  EXPECT_CONTAINS(ladder_terminal_table(worse), "slower");

  // A peer from another device is flagged.
  json elsewhere = peer_for(ladder);
  elsewhere["device"] = "NVIDIA A100-SXM4-80GB";
  EXPECT_CONTAINS(ladder_markdown(attach_peer(ladder, elsewhere, "peer.json")), "not from the same device");

  // On the CPU there is no device peak: tokens/s is compared, the memory verdict is left open.
  const json cpu = load_fixture("ladder_cpu_runner.json");
  json cpu_peer = peer_for(runner_on_gpu());
  const std::string cpu_md = ladder_markdown(attach_peer(cpu, cpu_peer, "peer.json"));
  EXPECT_CONTAINS(cpu_md, "less device memory on 0 of 0 rungs");
  EXPECT_CONTAINS(cpu_md, "No device-peak comparison");
}

TEST(LadderPeer, BadPeerFilesNameTheField) {
  const json ladder = runner_on_gpu();
  struct Case {
    std::function<void(json&)> damage;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {[](json& p) { p.erase("peer"); }, {"peer.json", "missing key \"peer\""}},
      {[](json& p) { p.erase("rungs"); }, {"peer.json", "missing key \"rungs\""}},
      {[](json& p) { p["rungs"] = json::object(); }, {"\"rungs\"", "expected an array"}},
      {[](json& p) { p["rungs"][2].erase("added"); }, {"rungs[2]", "missing key \"added\""}},
      {[](json& p) { p["rungs"][2].erase("measured"); }, {"rungs[2]", "missing key \"measured\""}},
      {[](json& p) { p["rungs"][3]["tokens_per_second"] = "fast"; }, {"rungs[3]", "tokens_per_second", "expected a number"}},
      {[](json& p) { p["rungs"][3]["device_peak_bytes"] = -5; }, {"rungs[3]", "device_peak_bytes", ">= 0"}},
      {[](json& p) { p["rungs"][4]["added"] = p["rungs"][3]["added"]; }, {"rungs[4]", "a second rung with \"added\""}},
  };
  for (const Case& c : cases) {
    json peer = peer_for(ladder);
    c.damage(peer);
    for (const std::string& message : {error_of([&] { attach_peer(ladder, peer, "peer.json"); }),
                                       error_of([&] { validate_peer_json(peer, "peer.json"); })}) {
      ASSERT_FALSE(message.empty()) << c.expected.front();
      for (const std::string& part : c.expected) EXPECT_CONTAINS(message, part);
    }
  }
  EXPECT_CONTAINS(error_of([&] { attach_peer(ladder, json::array(), "peer.json"); }), "expected a JSON object");
}

TEST(LadderReport, MfuColumnAndNote) {
  const json cpu = load_fixture("ladder_cpu_runner.json");
  EXPECT_CONTAINS(ladder_terminal_table(cpu), "MFU: none");
  EXPECT_CONTAINS(ladder_markdown(cpu), "**MFU** is not given");
  const std::string gpu = ladder_terminal_table(runner_on_gpu());
  EXPECT_CONTAINS(gpu, "41.2%");
  EXPECT_CONTAINS(gpu, "989 TFLOP/s");
}

TEST(LadderReport, MfuAgainstTheMeasuredGemmRateWhenTheLadderMeasuredIt) {
  json ladder = runner_on_gpu();
  // Without the measurement the section is absent.
  EXPECT_EQ(ladder_markdown(ladder).find("Against the measured GEMM rate"), std::string::npos);
  ladder["measured_gemm_flops"] = 706.8e12;
  ladder["measured_gemm_definition"] = "dense bf16 GEMM 8192^3";
  const std::string md = ladder_markdown(ladder);
  ASSERT_NE(md.find("**Against the measured GEMM rate**: 706.8 TFLOP/s (dense bf16 GEMM 8192^3)"), std::string::npos) << md;
  // 41.2% of 989.4 TFLOP/s is 57.7% of 706.8.
  EXPECT_NE(md.find("| 41.2% | 57.7% |"), std::string::npos) << md;
}
