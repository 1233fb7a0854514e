// Several peers beside memtune (memtune report --peer A --peer B ...): attach_peers, and every
// output (terminal table, report.md, ladder.csv, ladder.svg) with one column pair / marker per peer.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/report/ladder_report.h"
#include "../support/expect_error.h"
#include "report_test_util.h"

using namespace memtune;
using nlohmann::json;

using namespace memtune::report_test;

namespace {

// The runner fixture as if it had run on a GPU: device peaks = planned + 500 MB (the peer
// fixtures' device peaks are that x 0.95 for Liger and x 0.8 for Unsloth).
json runner_on_gpu() {
  json ladder = load_fixture("ladder_cpu_runner.json");
  ladder["device"] = "NVIDIA H200";
  for (json& r : ladder["rungs"]) r["device_peak_bytes"] = r["planned_peak_bytes"].get<uint64_t>() + 500000000;
  return ladder;
}

// A transformers peer in peer_hf.py's older form (no "tool"): every rung 20% slower, 10% larger.
json hf_peer(const json& ladder) {
  json rungs = json::array();
  for (const json& r : ladder["rungs"])
    rungs.push_back({{"name", r["name"]}, {"added", r["added"]}, {"measured", true},
                     {"tokens_per_second", r["tokens_per_second"].get<double>() * 0.8},
                     {"device_peak_bytes", static_cast<uint64_t>(r["device_peak_bytes"].get<double>() * 1.1)}});
  return {{"peer", "transformers 5.17.0, peft 0.21.0, torch 2.11.0, bitsandbytes 0.50.2"}, {"device", "NVIDIA H200"},
          {"date", "2026-12-05"}, {"rungs", rungs}};
}

std::vector<std::pair<json, std::string>> three_peers(const json& ladder) {
  return {{hf_peer(ladder), "peer.json"},
          {load_fixture("peer_liger.json"), "peer-liger.json"},
          {load_fixture("peer_unsloth.json"), "unsloth.json"}};
}

}  // namespace

TEST(LadderPeers, OnePeerIsExactlyAttachPeer) {
  const json ladder = runner_on_gpu();
  const json peer = load_fixture("peer_unsloth.json");
  const json one = attach_peers(ladder, {{peer, "unsloth.json"}});
  EXPECT_EQ(one, attach_peer(ladder, peer, "unsloth.json"));
  EXPECT_FALSE(one.contains("more_peers"));
  for (const json& r : one["rungs"]) EXPECT_FALSE(r.contains("more_peers"));
  EXPECT_EQ(one["peer"]["tool"], "unsloth");
  // A peer file without "tool" leaves the record as before (no "tool" key).
  EXPECT_FALSE(attach_peer(ladder, hf_peer(ladder), "peer.json")["peer"].contains("tool"));
  // With one peer the outputs have no several-peer parts.
  EXPECT_EQ(ladder_markdown(one).find("## Against every peer"), std::string::npos);
  EXPECT_EQ(ladder_svg(one).find("peer-2"), std::string::npos);
}

TEST(LadderPeers, EveryPeerMatchedByAddedInTheLadderJson) {
  const json ladder = runner_on_gpu();
  const json out = attach_peers(ladder, three_peers(ladder));
  EXPECT_EQ(out["peer"]["peer"], "transformers 5.17.0, peft 0.21.0, torch 2.11.0, bitsandbytes 0.50.2");
  ASSERT_EQ(out["more_peers"].size(), 2u);
  EXPECT_EQ(out["more_peers"][0]["tool"], "transformers+peft+bnb+liger");
  EXPECT_EQ(out["more_peers"][1]["tool"], "unsloth");
  EXPECT_EQ(out["more_peers"][1]["source"], "unsloth.json");
  EXPECT_EQ(out["more_peers"][1]["unmatched"], json({"max context (QLoRA), batch 1, seq 65536"}));
  for (size_t i = 0; i < ladder["rungs"].size(); ++i) {
    const json& rung = out["rungs"][i];
    ASSERT_EQ(rung["more_peers"].size(), 2u) << i;
    const std::string added = ladder["rungs"][i]["added"];
    const json& unsloth = rung["more_peers"][1];
    if (added == "seq_halved") {
      EXPECT_TRUE(unsloth.is_null());  // not in the Unsloth file at all
      continue;
    }
    if (added == "qlora") {
      EXPECT_NEAR(unsloth["tokens_per_second_ratio"].get<double>(), 1 / 1.25, 1e-3);
      EXPECT_NEAR(unsloth["device_peak_ratio"].get<double>(), 1 / 0.8, 1e-6);
      EXPECT_EQ(unsloth["beats_tokens_per_second"], false);
      EXPECT_EQ(unsloth["beats_device_peak"], false);
      EXPECT_NEAR(rung["more_peers"][0]["tokens_per_second_ratio"].get<double>(), 1 / 0.9, 1e-3);
      EXPECT_NEAR(rung["peer"]["tokens_per_second_ratio"].get<double>(), 1 / 0.8, 1e-9);
    }
    if (added == "micro_batch") {
      EXPECT_EQ(unsloth["measured"], false);
      EXPECT_EQ(unsloth["error"], "CUDA out of memory");
      EXPECT_TRUE(unsloth["tokens_per_second_ratio"].is_null());
    }
  }
  // Attaching again replaces every peer, the extra ones too.
  const json again = attach_peers(out, {{hf_peer(ladder), "peer.json"}});
  EXPECT_FALSE(again.contains("more_peers"));
  for (const json& r : again["rungs"]) EXPECT_FALSE(r.contains("more_peers"));
  EXPECT_EQ(again, attach_peer(ladder, hf_peer(ladder), "peer.json"));
}

TEST(LadderPeers, MarkdownHasAColumnPairPerPeerWithTheRatio) {
  const json ladder = runner_on_gpu();
  const std::string md = ladder_markdown(attach_peers(ladder, three_peers(ladder)));
  EXPECT_CONTAINS(md, "## Against Hugging Face (peer)");  // the first peer's section, as with one peer
  EXPECT_CONTAINS(md, "## Against every peer");
  for (const char* header : {"peer tokens/s (memtune x)", "peer device peak (memtune x)",
                             "transformers+peft+bnb+liger tokens/s (memtune x)",
                             "transformers+peft+bnb+liger device peak (memtune x)", "unsloth tokens/s (memtune x)",
                             "unsloth device peak (memtune x)"})
    EXPECT_CONTAINS(md, header);
  EXPECT_CONTAINS(md, "- **unsloth**: unsloth 2026.10.9");
  EXPECT_CONTAINS(md, "(0.80x)");   // memtune / Unsloth tokens/s on the rungs Unsloth ran
  EXPECT_CONTAINS(md, "(1.25x)");   // memtune / Unsloth device peak
  EXPECT_CONTAINS(md, "| CUDA out of memory | - |");
  EXPECT_CONTAINS(md, "memtune against unsloth: faster on 0 of 2 rungs");
  EXPECT_CONTAINS(md, "memtune against peer: faster on 8 of 8 rungs");
  EXPECT_CONTAINS(md, "\"added\": max context (QLoRA), batch 1, seq 65536.");
  // Each table row has rung + 2 memtune cells + 2 per peer.
  const size_t start = md.find("| rung | memtune tokens/s | memtune device peak |");
  ASSERT_NE(start, std::string::npos);
  const std::string header_line = md.substr(start, md.find('\n', start) - start);
  EXPECT_EQ(count_of(header_line, "|"), 1u + 3 + 2 * 3);
}

TEST(LadderPeers, TerminalCsvAndSvgShowEveryPeer) {
  const json ladder = runner_on_gpu();
  const json out = attach_peers(ladder, three_peers(ladder));
  const std::string table = ladder_terminal_table(out);
  for (const char* column : {"tokens/s vs peer", "tokens/s vs transformers+peft+bnb+liger", "tokens/s vs unsloth",
                             "device peak vs unsloth"})
    EXPECT_CONTAINS(table, column);
  EXPECT_CONTAINS(table, "unsloth = unsloth 2026.10.9");

  const auto rows = parse_csv(ladder_csv(out));
  ASSERT_EQ(rows.size(), ladder["rungs"].size() + 1);
  const auto column = [&](const std::string& name) {
    const auto it = std::find(rows[0].begin(), rows[0].end(), name);
    EXPECT_NE(it, rows[0].end()) << name;
    return static_cast<size_t>(it - rows[0].begin());
  };
  EXPECT_EQ(rows[0].size(), rows[1].size());
  EXPECT_EQ(rows[5][column("peer3_tool")], "unsloth");  // row 5: the qlora rung
  EXPECT_EQ(rows[5][column("peer2_tool")], "transformers+peft+bnb+liger");
  EXPECT_EQ(rows[5][column("peer3_measured")], "true");
  EXPECT_NEAR(std::stod(rows[5][column("tokens_per_second_vs_peer3")]), 0.8, 1e-3);
  EXPECT_EQ(rows[7][column("peer3_error")], "CUDA out of memory");  // micro_batch
  EXPECT_EQ(rows[8][column("peer3_tool")], "unsloth");
  EXPECT_EQ(rows[8][column("peer3_measured")], "");  // seq_halved: no Unsloth figure
  // The single-peer columns stay where they were.
  EXPECT_EQ(rows[0][column("peer_tokens_per_second")], "peer_tokens_per_second");

  const std::string svg = ladder_svg(out);
  EXPECT_EQ(xml_well_formedness_error(svg), "");
  EXPECT_EQ(count_of(svg, "class=\"peer-device-peak\""), ladder["rungs"].size());  // the first peer, every rung
  EXPECT_EQ(count_of(svg, "class=\"peer-device-peak peer-2\""), ladder["rungs"].size() - 1);  // liger: no chunked
  EXPECT_EQ(count_of(svg, "class=\"peer-device-peak peer-3\""), 2u);  // unsloth: flash and qlora ran
  EXPECT_CONTAINS(svg, "peer device peak (peer)");
  EXPECT_CONTAINS(svg, "peer device peak (transformers+peft+bnb+liger)");
  EXPECT_CONTAINS(svg, "peer device peak (unsloth)");
}

TEST(LadderPeers, BadExtraPeersNameTheirFile) {
  const json ladder = runner_on_gpu();
  json broken = load_fixture("peer_unsloth.json");
  broken["rungs"][0].erase("added");
  std::string message;
  try {
    attach_peers(ladder, {{hf_peer(ladder), "peer.json"}, {broken, "unsloth.json"}});
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_CONTAINS(message, "unsloth.json");
  EXPECT_CONTAINS(message, "added");
  json ladder_bad = attach_peers(ladder, three_peers(ladder));
  ladder_bad["rungs"][0]["more_peers"].push_back(nullptr);
  ladder_bad["rungs"][0]["more_peers"].push_back(nullptr);
  message.clear();
  try {
    ladder_markdown(ladder_bad);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_CONTAINS(message, "more_peers");
}
