// --attn_implementation auto's measured pick (train/attention_pick.h) on the CPU backend: the
// probe runs both implementations' ops at small and odd shapes (the CPU backend's cuDNN op is its
// flash op), the pick is the faster of the timings it reports, and the cache keeps it, refuses
// what is not its own file, and is never the reason a run fails.
#include "memtune/train/attention_pick.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/model/llama_config.h"
#include "memtune/ops/backend.h"
#include "memtune/train/run_config.h"
#include "../support/temp_dir.h"

namespace memtune {
namespace {

class AttentionPickTest : public test::TempDirTest {
 protected:
  AttentionPickTest() : TempDirTest("memtune_attention_pick") {}
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
};

AttentionShape small_shape(bool packed) {
  AttentionShape s;
  s.batch = 2;
  s.seq = 37;  // odd, not a tile multiple
  s.n_heads = 4;
  s.n_kv_heads = 2;
  s.head_dim = 16;
  s.dtype = DType::bf16;
  s.packed = packed;
  return s;
}

TEST_F(AttentionPickTest, ShapeKeyNamesEveryDimension) {
  EXPECT_EQ(small_shape(false).key(), "b2 s37 h4/2 d16 bf16");
  EXPECT_EQ(small_shape(true).key(), "b2 s37 h4/2 d16 bf16 packed");
}

TEST_F(AttentionPickTest, ProbeBytesCountEachImplementationsScratch) {
  const AttentionShape s = small_shape(false);
  const uint64_t flash = attention_probe_bytes(s, {"flash"}), cudnn = attention_probe_bytes(s, {"cudnn"});
  // Both hold q, k, v, out, lse, d_out, dq, dk, dv and delta; flash adds its f32 dQ accumulator,
  // cuDNN its workspace (at least that accumulator).
  const uint64_t q_bytes = 2 * 37 * 4 * 16 * 2;
  EXPECT_GE(flash, 4 * q_bytes + q_bytes * 2);
  EXPECT_GE(cudnn, flash);
  EXPECT_GT(attention_probe_bytes(small_shape(true), {"cudnn"}), cudnn) << "packed rows add ids and a sequence table";
}

TEST_F(AttentionPickTest, TimesBothImplementationsAtOddShapesOnTheCpu) {
  for (const bool packed : {false, true})
    for (const char* implementation : {"flash", "cudnn"}) {
      SCOPED_TRACE(std::string(implementation) + (packed ? " packed" : ""));
      const double ms = time_attention(*cpu_, small_shape(packed), implementation, 2);
      EXPECT_TRUE(std::isfinite(ms));
      EXPECT_GT(ms, 0.0);
    }
  AttentionShape one = small_shape(true);
  one.seq = 3;  // shorter than the probe's four samples a row
  one.n_kv_heads = 1;
  EXPECT_GT(time_attention(*cpu_, one, "flash", 1), 0.0);
  EXPECT_THROW(time_attention(*cpu_, one, "eager", 1), Error);
}

TEST_F(AttentionPickTest, PicksTheFasterAndCachesIt) {
  const std::filesystem::path cache = dir_ / "nested" / "attention-picks.json";
  const AttentionShape shape = small_shape(false);
  const AttentionPick pick = pick_attention(*cpu_, shape, {"cudnn", "flash"}, cache, 2);
  ASSERT_EQ(pick.timings.size(), 2u);
  EXPECT_EQ(pick.source, "measured now");
  const AttentionTiming& faster =
      pick.timings[0].milliseconds <= pick.timings[1].milliseconds ? pick.timings[0] : pick.timings[1];
  EXPECT_EQ(pick.implementation, faster.implementation);
  EXPECT_NE(pick.describe(shape).find(shape.key()), std::string::npos);

  // Stored for this device and shape; a second pick reads it instead of timing again.
  const std::string device = attention_device_key(*cpu_);
  const std::optional<AttentionPick> stored = read_cached_attention_pick(cache, device, shape.key());
  ASSERT_TRUE(stored.has_value());
  EXPECT_EQ(stored->implementation, pick.implementation);
  const AttentionPick again = pick_attention(*cpu_, shape, {"cudnn", "flash"}, cache, 2);
  EXPECT_EQ(again.implementation, pick.implementation);
  EXPECT_EQ(again.source, "cached in " + cache.string());
  EXPECT_FALSE(read_cached_attention_pick(cache, device, small_shape(true).key()).has_value()) << "another shape";
  EXPECT_FALSE(read_cached_attention_pick(cache, device + "x", shape.key()).has_value()) << "another device";
}

TEST_F(AttentionPickTest, ACachedPickIsWhatTheEntrySays) {
  const std::filesystem::path cache = dir_ / "attention-picks.json";
  const AttentionShape shape = small_shape(false);
  const std::string device = attention_device_key(*cpu_);
  AttentionPick slow_cudnn;
  slow_cudnn.implementation = "flash";
  slow_cudnn.timings = {{"cudnn", 9.0}, {"flash", 1.0}};
  store_attention_pick(cache, device, shape.key(), slow_cudnn);
  const AttentionPick pick = pick_attention(*cpu_, shape, {"cudnn", "flash"}, cache);
  EXPECT_EQ(pick.implementation, "flash");
  EXPECT_EQ(pick.source, "cached in " + cache.string());
  ASSERT_EQ(pick.timings.size(), 2u);

  // An entry without a timing for every candidate is measured again (and replaced).
  AttentionPick partial;
  partial.implementation = "flash";
  partial.timings = {{"flash", 1.0}};
  store_attention_pick(cache, device, shape.key(), partial);
  const AttentionPick measured = pick_attention(*cpu_, shape, {"cudnn", "flash"}, cache, 1);
  EXPECT_EQ(measured.source, "measured now");
  EXPECT_EQ(read_cached_attention_pick(cache, device, shape.key())->timings.size(), 2u);

  // One candidate: no timing, no cache entry needed.
  const AttentionPick only = pick_attention(*cpu_, small_shape(true), {"flash"}, cache);
  EXPECT_EQ(only.implementation, "flash");
  EXPECT_TRUE(only.timings.empty());
}

TEST_F(AttentionPickTest, AForeignOrBrokenCacheIsLeftAloneAndNotUsed) {
  const AttentionShape shape = small_shape(false);
  const std::string device = attention_device_key(*cpu_);
  AttentionPick pick;
  pick.implementation = "cudnn";
  pick.timings = {{"cudnn", 1.0}, {"flash", 2.0}};
  for (const std::string& text : {std::string("{not json"), std::string("{\"format\": \"something else\"}"),
                                  std::string("[1, 2, 3]")}) {
    SCOPED_TRACE(text);
    const std::filesystem::path cache = dir_ / "attention-picks.json";
    write_file_atomic(cache, text);
    EXPECT_FALSE(read_cached_attention_pick(cache, device, shape.key()).has_value());
    store_attention_pick(cache, device, shape.key(), pick);  // not stored: the file is not ours
    EXPECT_EQ(read_file(cache), text);
    EXPECT_EQ(pick_attention(*cpu_, shape, {"cudnn", "flash"}, cache, 1).source, "measured now");
    EXPECT_EQ(read_file(cache), text) << "a pick is not written over a file that is not a memtune cache";
  }
  // A well-formed file with a bad entry: the entry is ignored, the pick measured.
  const std::filesystem::path cache = dir_ / "attention-picks.json";
  write_file_atomic(cache, "{\"format\": \"memtune attention picks 1\", \"entries\": {\"" + device + " | " +
                               shape.key() + "\": {\"pick\": \"cudnn\", \"milliseconds\": {\"cudnn\": -1, \"flash\": 2}}}}");
  EXPECT_FALSE(read_cached_attention_pick(cache, device, shape.key()).has_value());
  EXPECT_EQ(pick_attention(*cpu_, shape, {"cudnn", "flash"}, cache, 1).source, "measured now");
  // No cache folder known: picks all the same.
  EXPECT_FALSE(pick_attention(*cpu_, shape, {"cudnn", "flash"}, std::filesystem::path{}, 1).implementation.empty());
}

TEST_F(AttentionPickTest, ResolveLeavesACpuRunToTheRuleAndRefusesAMistypedSwitch) {
  RunConfig run;
  run.attn_implementation = "flash";
  const LlamaConfig model = resolve_model("tiny").config;
  EXPECT_EQ(resolve_auto_attention(*cpu_, run, model, 0, 0), "");
  EXPECT_EQ(run.attn_implementation, "flash");
  ::setenv("MEMTUNE_ATTENTION_PICK", "fastest", 1);
  EXPECT_THROW(resolve_auto_attention(*cpu_, run, model, 0, 0), Error);
  ::setenv("MEMTUNE_ATTENTION_PICK", "rule", 1);
  EXPECT_EQ(resolve_auto_attention(*cpu_, run, model, 0, 0), "");
  ::unsetenv("MEMTUNE_ATTENTION_PICK");
}

}  // namespace
}  // namespace memtune
