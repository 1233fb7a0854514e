// SFT datasets: the three TRL forms (and pre-tokenized ids) with their labels, BOS/EOS, and
// truncation; and every kind of bad input with a message naming file:line.
#include "memtune/data/sft_dataset.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "memtune/core/error.h"
#include "memtune/data/tokenizer.h"
#include "../support/fixtures.h"
#include "../support/tokenizer_data.h"

using namespace memtune;
namespace fs = std::filesystem;

namespace {

constexpr int32_t kBos = 256, kEos = 257, kEot = 260;  // Tokenizer::byte_level()

fs::path temp_dir(const std::string& name) {
  const fs::path dir = fs::path(MEMTUNE_BINARY_DIR) / "sft_dataset_tests" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

fs::path write_file(const fs::path& dir, const std::string& name, const std::string& text) {
  std::ofstream(dir / name, std::ios::binary) << text;
  return dir / name;
}

std::vector<int32_t> bytes_of(std::string_view text) {
  std::vector<int32_t> ids;
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::vector<int32_t> concat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// The message of the memtune::Error that `read` throws ("" when it throws none).
template <typename F>
std::string error_of(F&& read) {
  try {
    read();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

const Tokenizer& bytes() {
  static const Tokenizer tokenizer = Tokenizer::byte_level();
  return tokenizer;
}

TEST(SftSample, TextGetsBosAndOneEosAndTrainsEveryToken) {
  const Sample s = encode_text_sample(bytes(), "hi", kEos);
  EXPECT_EQ(s.input_ids, concat({{kBos}, bytes_of("hi"), {kEos}}));
  EXPECT_EQ(s.labels, s.input_ids);
  // TRL appends eos_token only when the text does not already end with it.
  EXPECT_EQ(encode_text_sample(bytes(), "hi<|end_of_text|>", kEos).input_ids, s.input_ids);
}

TEST(SftSample, PromptCompletionMasksThePromptAndTrainsTheCompletionWithEos) {
  const Sample s = encode_prompt_completion_sample(bytes(), "Q?", " A", kEos, /*completion_only_loss=*/true);
  EXPECT_EQ(s.input_ids, concat({{kBos}, bytes_of("Q? A"), {kEos}}));
  // BOS and the prompt's two tokens are masked; the completion and its EOS are trained.
  EXPECT_EQ(s.labels, concat({{-100, -100, -100}, bytes_of(" A"), {kEos}}));
  EXPECT_EQ(trained_targets(s), 3);
  const Sample all = encode_prompt_completion_sample(bytes(), "Q?", " A", kEos, false);
  EXPECT_EQ(all.labels, all.input_ids);
}

TEST(SftSample, MessagesTrainTheAssistantTurnsOnlyOrEverything) {
  const std::vector<ChatMessage> chat = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}};
  const ChatEncoding reference = encode_chat(bytes(), chat);
  const Sample s = encode_messages_sample(bytes(), chat, /*assistant_only_loss=*/true);
  EXPECT_EQ(s.input_ids, reference.ids);
  EXPECT_EQ(s.input_ids.front(), kBos);
  EXPECT_EQ(s.input_ids.back(), kEot);  // no EOS appended to conversations (TRL)
  std::vector<int32_t> trained;
  for (int32_t label : s.labels)
    if (label != -100) trained.push_back(label);
  EXPECT_EQ(trained, concat({bytes_of("Hello"), {kEot}}));
  EXPECT_EQ(encode_messages_sample(bytes(), chat, false).labels, reference.ids);
}

TEST(SftSample, Llama3TokenizerUsesTheEosOfTokenizerConfig) {
  const fs::path tokenizer_json = memtune::test::llama3_tokenizer_dir() / "tokenizer.json";
  ASSERT_TRUE(fs::exists(tokenizer_json)) << tokenizer_json;
  const Tokenizer llama3 = Tokenizer::from_file(tokenizer_json);
  // The shared tokenizer_config.json is Llama 3 Instruct's: eos_token <|eot_id|>.
  const std::optional<int32_t> eos = eos_id_from_tokenizer_config(tokenizer_json, llama3);
  ASSERT_TRUE(eos.has_value());
  EXPECT_EQ(*eos, 128009);
  const Sample s = encode_prompt_completion_sample(llama3, "Hello", " world", *eos, true);
  EXPECT_EQ(s.input_ids, (std::vector<int32_t>{128000, 9906, 1917, 128009}));
  EXPECT_EQ(s.labels, (std::vector<int32_t>{-100, -100, 1917, 128009}));
}

TEST(SftSample, EosTokenFromTokenizerConfigInBothSpellings) {
  const fs::path dir = temp_dir("eos_config");
  const fs::path fixture = memtune::test::fixture_path("tokenizer/tiny_tokenizer.json");
  fs::copy_file(fixture, dir / "tokenizer.json");
  const Tokenizer tokenizer = Tokenizer::from_file(dir / "tokenizer.json");
  EXPECT_FALSE(eos_id_from_tokenizer_config(dir / "tokenizer.json", tokenizer).has_value());
  write_file(dir, "tokenizer_config.json", R"({"eos_token": "<|eot_id|>"})");
  EXPECT_EQ(eos_id_from_tokenizer_config(dir / "tokenizer.json", tokenizer), tokenizer.token_to_id("<|eot_id|>"));
  write_file(dir, "tokenizer_config.json", R"({"eos_token": {"content": "<|end_of_text|>", "special": true}})");
  EXPECT_EQ(eos_id_from_tokenizer_config(dir / "tokenizer.json", tokenizer), tokenizer.eos_id());
  write_file(dir, "tokenizer_config.json", R"({"eos_token": "<|nope|>"})");
  EXPECT_NE(error_of([&] { eos_id_from_tokenizer_config(dir / "tokenizer.json", tokenizer); }).find("<|nope|>"),
            std::string::npos);
}

TEST(SftDataset, DetectsEachFormFromTheFile) {
  const fs::path dir = temp_dir("forms");
  const struct {
    std::string line;
    DatasetFormat format;
  } cases[] = {
      {R"({"text": "abc"})", DatasetFormat::text},
      {R"({"prompt": "a", "completion": "b"})", DatasetFormat::prompt_completion},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})", DatasetFormat::messages},
      {R"({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]})", DatasetFormat::token_ids},
  };
  for (const auto& c : cases) {
    const fs::path file = write_file(dir, "one.jsonl", c.line + "\n" + c.line + "\n");
    const Dataset data = read_dataset(file, bytes(), 512, {});
    EXPECT_EQ(data.format, c.format) << c.line;
    EXPECT_EQ(data.samples.size(), 2u) << c.line;
    EXPECT_EQ(data.stats.lines, 2);
  }
}

TEST(SftDataset, MixingFormsIsAnErrorNamingTheLineEvenWhenSkipping) {
  const fs::path dir = temp_dir("mixed");
  const fs::path file = write_file(dir, "mixed.jsonl", "{\"text\": \"a\"}\n\n{\"prompt\": \"a\", \"completion\": \"b\"}\n");
  for (BadLinePolicy policy : {BadLinePolicy::error, BadLinePolicy::skip}) {
    DatasetOptions options;
    options.on_bad_line = policy;
    const std::string message = error_of([&] { read_dataset(file, bytes(), 512, options); });
    EXPECT_NE(message.find("mixed.jsonl:3"), std::string::npos) << message;
    EXPECT_NE(message.find("line 1 made this a {\"text\"} dataset"), std::string::npos) << message;
  }
}

TEST(SftDataset, MalformedLinesErrorWithFileLineOrAreSkippedAndCounted) {
  const fs::path dir = temp_dir("malformed");
  const fs::path file = write_file(dir, "bad.jsonl",
                                   "{\"text\": \"good\"}\n{\"text\": \"cut\n[1, 2]\n{\"text\": 7}\n{\"other\": 1}\n"
                                   "{\"text\": \"fine\"}\n");
  const std::string message = error_of([&] { read_dataset(file, bytes(), 512, {}); });
  EXPECT_NE(message.find("bad.jsonl:2: not valid JSON"), std::string::npos) << message;
  DatasetOptions skip;
  skip.on_bad_line = BadLinePolicy::skip;
  const Dataset data = read_dataset(file, bytes(), 512, skip);
  EXPECT_EQ(data.samples.size(), 2u);
  EXPECT_EQ(data.stats.skipped_bad_lines, 4) << data.stats.first_skipped_line;  // lines 2..5
  EXPECT_NE(data.stats.first_skipped_line.find("bad.jsonl:2"), std::string::npos);
}

TEST(SftDataset, EachBadLineKindHasItsOwnMessage) {
  const fs::path dir = temp_dir("kinds");
  const struct {
    std::string second_line, expected;
  } cases[] = {
      {"[1, 2]", "bad.jsonl:2: not a JSON object"},
      {"{\"text\": 7}", "bad.jsonl:2: \"text\" must be a string"},
      {"{\"other\": 1}", "bad.jsonl:2: expected one of"},
      {"{\"text\": \"caf\xC3\"}", "bad.jsonl:2: invalid UTF-8 (byte 0xC3 at offset 13"},
      {"{\"text\": \"\\ud800\"}", "bad.jsonl:2: not valid JSON"},
      // A number too large for a double: nlohmann's out_of_range, not a parse_error (fuzz_dataset).
      {"{\"text\": \"a\", \"n\": 3e513}", "bad.jsonl:2: not valid JSON"},
  };
  for (const auto& c : cases) {
    const fs::path file = write_file(dir, "bad.jsonl", "{\"text\": \"ok\"}\n" + c.second_line + "\n");
    const std::string message = error_of([&] { read_dataset(file, bytes(), 512, {}); });
    EXPECT_NE(message.find(c.expected), std::string::npos) << c.second_line << "\n" << message;
    DatasetOptions skip;
    skip.on_bad_line = BadLinePolicy::skip;
    const Dataset data = read_dataset(file, bytes(), 512, skip);
    EXPECT_EQ(data.samples.size(), 1u);
    EXPECT_EQ(data.stats.skipped_bad_lines, 1);
  }
  const fs::path messages = write_file(dir, "chat.jsonl", "{\"messages\": [{\"role\": \"user\"}]}\n");
  EXPECT_NE(error_of([&] { read_dataset(messages, bytes(), 512, {}); }).find("chat.jsonl:1: messages[0]: missing \"content\""),
            std::string::npos);
}

TEST(SftDataset, EmptyMissingAndAllMaskedDataAreErrors) {
  const fs::path dir = temp_dir("empty");
  EXPECT_NE(error_of([&] { read_dataset(dir / "none.jsonl", bytes(), 512, {}); }).find("cannot open dataset"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_dataset(dir / "none.jsonl", bytes(), 512, {}); }).find("No such file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_dataset(dir, bytes(), 512, {}); }).find("is a directory"), std::string::npos);
  const fs::path blank = write_file(dir, "blank.jsonl", "\n  \n");
  EXPECT_NE(error_of([&] { read_dataset(blank, bytes(), 512, {}); }).find("holds no samples"), std::string::npos);
  // Nothing left after skipping the bad lines.
  const fs::path all_bad = write_file(dir, "all_bad.jsonl", "nope\n{\n");
  DatasetOptions skip;
  skip.on_bad_line = BadLinePolicy::skip;
  const std::string message = error_of([&] { read_dataset(all_bad, bytes(), 512, skip); });
  EXPECT_NE(message.find("holds no samples (2 lines, 2 skipped as malformed; first: "), std::string::npos) << message;
  // A chat without an assistant turn has nothing to train on under assistant-only loss.
  const fs::path masked = write_file(dir, "masked.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n");
  EXPECT_NE(error_of([&] { read_dataset(masked, bytes(), 512, {}); }).find("every sample of"), std::string::npos);
  DatasetOptions everything;
  everything.assistant_only_loss = false;
  EXPECT_EQ(read_dataset(masked, bytes(), 512, everything).samples.size(), 1u);
}

TEST(SftDataset, FullyMaskedSamplesAreSkippedAndCounted) {
  const fs::path dir = temp_dir("masked");
  const fs::path file = write_file(dir, "pc.jsonl",
                                   "{\"prompt\": \"a long prompt\", \"completion\": \" yes\"}\n"
                                   "{\"prompt\": \"q\", \"completion\": \" a\"}\n");
  DatasetOptions options;
  options.max_seq_length = 8;  // the first prompt alone is 14 tokens: its completion is cut off
  const Dataset data = read_dataset(file, bytes(), 512, options);
  ASSERT_EQ(data.samples.size(), 1u);
  EXPECT_EQ(data.stats.skipped_fully_masked, 1);
  EXPECT_EQ(data.stats.truncated_samples, 1);
  EXPECT_EQ(data.stats.truncated_tokens, 19 - 8);
  EXPECT_EQ(data.stats.trained_targets, 3);  // " a" and EOS
}

TEST(SftDataset, TruncationKeepsTheStartAndCountsWhatItDrops) {
  const fs::path dir = temp_dir("truncate");
  const fs::path file = write_file(dir, "t.jsonl", "{\"text\": \"0123456789abcdefghij\"}\n{\"text\": \"short\"}\n");
  DatasetOptions options;
  options.max_seq_length = 8;
  const Dataset data = read_dataset(file, bytes(), 512, options);
  ASSERT_EQ(data.samples.size(), 2u);
  EXPECT_EQ(data.samples[0].input_ids, concat({{kBos}, bytes_of("0123456")}));  // EOS cut off too
  EXPECT_EQ(data.stats.truncated_samples, 1);
  EXPECT_EQ(data.stats.truncated_tokens, 22 - 8);
  EXPECT_EQ(data.stats.tokens, 8 + 7);
  const std::string summary = dataset_summary("t.jsonl", data, 8);
  EXPECT_NE(summary.find("1 truncated to max_seq_length 8 (14 tokens dropped)"), std::string::npos) << summary;
}

TEST(SftDataset, TokenizerLargerThanTheModelIsRefused) {
  const fs::path dir = temp_dir("vocab");
  const fs::path file = write_file(dir, "t.jsonl", "{\"text\": \"a\"}\n");
  const std::string message = error_of([&] { read_dataset(file, bytes(), 200, {}); });
  EXPECT_NE(message.find("the tokenizer has 262 ids (max id + 1) but the model's vocab_size is 200"), std::string::npos)
      << message;
  const fs::path ids = write_file(dir, "ids.jsonl", "{\"input_ids\": [1, 300]}\n");
  EXPECT_NE(error_of([&] { read_dataset(ids, bytes(), 300, {}); }).find("outside the model's vocabulary [0, 300)"),
            std::string::npos);
}

TEST(SftDataset, SeededSplitSizesLikeTrainTestSplitAndIsReproducible) {
  Dataset data;
  for (int32_t i = 0; i < 21; ++i) data.samples.push_back({{kBos, i}, {kBos, i}});
  const DatasetSplit a = split_dataset(data, 0.1, 7);
  EXPECT_EQ(a.eval.samples.size(), 3u);  // ceil(2.1)
  EXPECT_EQ(a.train.samples.size(), 18u);
  std::set<int32_t> seen;
  for (const Dataset* part : {&a.train, &a.eval})
    for (const Sample& s : part->samples) EXPECT_TRUE(seen.insert(s.input_ids[1]).second);
  EXPECT_EQ(seen.size(), 21u);
  const DatasetSplit again = split_dataset(data, 0.1, 7);
  EXPECT_EQ(dataset_fingerprint(a.eval), dataset_fingerprint(again.eval));
  EXPECT_NE(dataset_fingerprint(a.eval), dataset_fingerprint(split_dataset(data, 0.1, 8).eval));
  EXPECT_NE(error_of([&] { split_dataset(data, 1.5, 7); }).find("--eval_split 1.5"), std::string::npos);
  Dataset one;
  one.samples.push_back({{kBos, 1}, {kBos, 1}});
  EXPECT_NE(error_of([&] { split_dataset(one, 0.5, 7); }).find("leaves none to train on"), std::string::npos);
}

TEST(SftDataset, SeededPermutationIsAPermutationAndDependsOnTheSeed) {
  const std::vector<uint32_t> p = seeded_permutation(50, 3);
  std::vector<uint32_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  for (uint32_t i = 0; i < 50; ++i) EXPECT_EQ(sorted[i], i);
  EXPECT_EQ(p, seeded_permutation(50, 3));
  EXPECT_NE(p, seeded_permutation(50, 4));
}

}  // namespace

// A conversational file read with the Qwen and Mistral tokenizers takes their chat format (from
// the tokenizer_config.json beside each tokenizer.json) and trains only the assistant turns; the
// text form gets tokenizer_config.json's eos_token (Qwen3: <|im_end|>) and, for Qwen, no BOS.
TEST(SftDataset, QwenAndMistralUseTheirChatFormatAndEos) {
  const fs::path dir = temp_dir("families");
  const fs::path chat = write_file(
      dir, "chat.jsonl",
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})"
      "\n");
  for (const std::string family : {"qwen3", "qwen2.5", "mistral"}) {
    SCOPED_TRACE(family);
    const Tokenizer& tokenizer = test::family_tokenizer(family);
    const Dataset data = read_dataset(chat, tokenizer, tokenizer.vocab_size(), DatasetOptions{});
    ASSERT_EQ(data.samples.size(), 1u);
    const Sample& s = data.samples[0];
    const ChatEncoding expected = encode_chat(tokenizer, {{"user", "Hi"}, {"assistant", "Hello"}});
    EXPECT_EQ(s.input_ids, expected.ids);
    std::string trained;
    for (size_t t = 0; t < s.labels.size(); ++t) {
      if (s.labels[t] != -100) trained += tokenizer.token_bytes(s.labels[t]);
    }
    EXPECT_EQ(trained, family == "qwen3"     ? "<think>\n\n</think>\n\nHello<|im_end|>"
                       : family == "qwen2.5" ? "Hello<|im_end|>"
                                             : "  Hello</s>");
  }
  const fs::path qwen_json = test::family_tokenizer_dir("qwen3", "qwen3") / "tokenizer.json";
  const Tokenizer& qwen = test::family_tokenizer("qwen3");
  const std::optional<int32_t> eos = eos_id_from_tokenizer_config(qwen_json, qwen);
  EXPECT_EQ(eos, qwen.token_to_id("<|im_end|>"));
  const Sample text = encode_text_sample(qwen, "Hello", *eos);
  EXPECT_EQ(text.input_ids, (std::vector<int32_t>{9707, *eos}));
}
