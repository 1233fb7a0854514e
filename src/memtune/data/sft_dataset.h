// Supervised fine-tuning data as TRL's SFTTrainer prepares it (trl/trainer/sft_trainer.py,
// `_prepare_dataset`), one JSONL file at a time.
//
// Forms (one per file, fixed by its first good line; a line of another form is an error naming
// file:line, whatever the bad-line policy, because a file that mixes forms is not a file with a
// few bad lines):
//  - {"text": "..."}: language modelling. Tokens: the tokenizer's post-processor output (BOS
//    first for Llama 3), then EOS unless the text already ends with it (TRL's add_eos). Every
//    token is trained.
//  - {"prompt": "...", "completion": "..."}: TRL's prompt-completion type. Tokens: those of
//    prompt + completion as ONE text (BOS first, EOS appended as above), which is what TRL
//    tokenizes; the first len(encode(prompt)) tokens (BOS included) form the prompt. With
//    completion_only_loss (TRL's name, default true here as TRL's None resolves to for this
//    form) the prompt's labels are -100. Like TRL, the boundary is the prompt's own token count
//    even when a BPE merge crosses it.
//  - {"messages": [{"role": ..., "content": ...}, ...]}: conversational. Tokens: the chat format
//    of the tokenizer (chat_template.h's chat_format_of: Llama 3, Qwen2.5, Qwen3 or Mistral
//    v0.3; BOS from the template where it has one, no EOS appended: each turn ends in its
//    end-of-turn token, and TRL adds no EOS to conversational data). With assistant_only_loss
//    (TRL's name) only the assistant turns and the token closing each are trained.
//    memtune's default is TRUE, where TRL's is false: TRL can only honour the flag for chat
//    templates with {% generation %} markers, which Llama 3's lacks, so its default is what is
//    possible rather than what is wanted; training on user turns teaches the model to write
//    the user's side of the conversation. --assistant_only_loss false trains on everything.
//  - {"input_ids": [...], "labels": [...]}: already tokenized (labels optional, -100 masks);
//    used as given, nothing added.
// EOS is tokenizer_config.json's eos_token when that file lies beside tokenizer.json (Llama 3
// Instruct: <|eot_id|>, base: <|end_of_text|>), else Tokenizer::eos_id().
//
// Truncation keeps the first max_seq_length tokens (TRL's truncation_mode "keep_start"), so a
// truncated sample loses its EOS; each cut is counted. A sample left with no trained target
// (labels[1..] all -100: a prompt longer than max_seq_length, a chat without an assistant
// turn) is skipped and counted; a file where every sample is so is an error.
//
// Invalid UTF-8 is an error naming file:line and the byte (or a skipped line under
// BadLinePolicy::skip), never a replacement character: Python's json loader and the Arrow JSON
// reader behind HF datasets both reject such a file, so there is no HF behaviour of silently
// repairing it to match, and a repaired text would train on characters nobody wrote.
#pragma once

#include <cstdint>
#include <filesystem>
#include <istream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memtune/data/chat_template.h"
#include "memtune/data/jsonl_dataset.h"

namespace memtune {

struct DatasetOptions {
  BadLinePolicy on_bad_line = BadLinePolicy::error;
  bool completion_only_loss = true;  // TRL SFTConfig.completion_only_loss
  bool assistant_only_loss = true;   // TRL SFTConfig.assistant_only_loss (TRL default: false)
  int64_t max_seq_length = 0;        // 0: keep every token
  std::optional<int32_t> eos_id;     // nullopt: tokenizer.eos_id()
};

// Reads, tokenizes, labels and truncates a JSONL file. memtune::Error (naming file:line where
// there is a line) for: a missing or unreadable file; a bad line under BadLinePolicy::error
// (not JSON, invalid UTF-8, unknown form, wrong field types, ids outside [0, vocab_size)); a
// line whose form differs from the file's; no samples left; every sample fully masked; a
// tokenizer with more ids than the model's vocabulary.
Dataset read_dataset(const std::filesystem::path& path, const Tokenizer& tokenizer,
                     int64_t vocab_size, const DatasetOptions& options);
// The same from a stream; `name` stands for the file in messages ("name:line").
Dataset read_dataset(std::istream& in, const std::string& name, const Tokenizer& tokenizer,
                     int64_t vocab_size, const DatasetOptions& options);

// The samples of each form, as read_dataset builds them (before truncation).
Sample encode_text_sample(const Tokenizer& tokenizer, std::string_view text, int32_t eos_id);
Sample encode_prompt_completion_sample(const Tokenizer& tokenizer, std::string_view prompt,
                                       std::string_view completion, int32_t eos_id,
                                       bool completion_only_loss);
Sample encode_messages_sample(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages,
                              bool assistant_only_loss);

// The id of tokenizer_config.json's "eos_token" (a string or {"content": ...}) in the folder of
// `tokenizer_json`; nullopt when there is no such file or field. memtune::Error when the file is
// not JSON or names a token the tokenizer does not have.
std::optional<int32_t> eos_id_from_tokenizer_config(const std::filesystem::path& tokenizer_json,
                                                    const Tokenizer& tokenizer);

// memtune::Error when the tokenizer can produce ids the model has no embedding for.
void check_tokenizer_fits_model(const Tokenizer& tokenizer, int64_t vocab_size);

// Tokens t >= 1 with a label: the targets a sample trains (token 0 is never predicted).
int64_t trained_targets(const Sample& sample);

// A seeded permutation of [0, n): the same on every platform (std::shuffle is not).
std::vector<uint32_t> seeded_permutation(size_t n, uint64_t seed);

// A seeded split as datasets' train_test_split(test_size=eval_fraction, seed) sizes it:
// ceil(eval_fraction * n) samples for eval, the rest for training, each in file order.
// memtune::Error when either part would be empty or the fraction is outside (0, 1).
struct DatasetSplit {
  Dataset train, eval;
};
DatasetSplit split_dataset(const Dataset& data, double eval_fraction, uint64_t seed);

// A 64-bit FNV-1a hash of the samples' ids and labels: a resumed run checks that it reads the
// data its checkpoint's position counts in.
uint64_t dataset_fingerprint(const Dataset& data);

// One line for the run's log: counts of samples, tokens, truncation and what was skipped.
std::string dataset_summary(std::string_view name, const Dataset& data, int64_t max_seq_length);

}  // namespace memtune
