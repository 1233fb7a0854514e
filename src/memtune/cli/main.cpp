// memtune: plan, train, eval, fit, the memory ladder, the sweep and the report renderer. Bad input
// is reported as one line on stderr with a non-zero exit; nothing already written is lost (every
// output is written atomically).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>

#include "memtune/cli/output_commands.h"
#include "memtune/cli/run_options.h"
#include "memtune/core/bytes.h"
#include "memtune/data/jsonl_dataset.h"
#include "memtune/data/sft_dataset.h"
#include "memtune/parallel/sharded_base.h"
#include "memtune/parallel/communicator.h"
#include "memtune/parallel/launch_env.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"
#include "memtune/lora/merge.h"  // quantize
#include "memtune/model/llama_config.h"
#include "memtune/ops/device.h"
#include "memtune/ops/timed_backend.h"
#include "memtune/plan/fit.h"
#include "memtune/plan/plan_report.h"
#include "memtune/experiment/ladder.h"
#include "memtune/report/ladder_report.h"
#include "memtune/core/progress.h"
#include "memtune/experiment/sweep.h"
#include "memtune/train/attention_pick.h"
#include "memtune/train/engine_arena.h"
#include "memtune/train/output_dir.h"
#include "memtune/train/trainer.h"
#include "memtune/train/yaml_config.h"


namespace memtune {
namespace {

std::string today() {
  const std::time_t now = std::time(nullptr);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%d", std::gmtime(&now));
  return buffer;
}

// The commit the binary reports in its outputs: MEMTUNE_COMMIT when set (a binary built on one
// machine and run on another, whose checkout may not be the one it was built from), else git's.
std::string git_commit() {
  if (const char* from_env = std::getenv("MEMTUNE_COMMIT"); from_env != nullptr && *from_env != 0)
    return from_env;
  std::FILE* pipe = popen("git rev-parse --short HEAD 2>/dev/null", "r");
  if (pipe == nullptr) return "unknown";
  char buffer[64] = {0};
  const bool ok = std::fgets(buffer, sizeof buffer, pipe) != nullptr;
  pclose(pipe);
  std::string commit = ok ? buffer : "unknown";
  while (!commit.empty() && (commit.back() == '\n' || commit.back() == '\r')) commit.pop_back();
  return commit;
}

Tokenizer load_tokenizer(const std::string& path) {
  return path.empty() ? Tokenizer::byte_level() : Tokenizer::from_file(path);
}

// `plan` is one rank's when world_size > 1 (plan_run with world_size: what `memtune plan
// --world_size N` prints as the per-rank arena), and the budget is per GPU. `context` is what the
// device holds outside the arena (ops/device.h): the budget holds the plan plus it, so that a run
// accepted here stays inside the budget as nvidia-smi counts it. `budget_name` says what the
// budget is in the refusal ("--vram 24GiB").
void refuse_over_budget(const Plan& plan, const RunConfig& run, const LlamaConfig& model, uint64_t budget,
                        const std::string& budget_name, uint64_t context, int world_size = 1) {
  if (plan.arena_bytes + context <= budget) return;
  if (world_size > 1)
    mt_fail("one rank of {} does not fit {}: it plans {} per rank{} + {} context; {}", world_size, budget_name,
            format_bytes(plan.arena_bytes), run.shard_base ? " with the base sharded" : "", format_bytes(context),
            fit_advice(run, model, budget, context, plan.target, world_size));
  mt_fail("run does not fit {}: {}", budget_name, fit_advice(run, model, budget, context, plan.target));
}

void check_budget(const Plan& plan, const RunConfig& run, const LlamaConfig& model, const std::string& vram,
                  uint64_t context, int world_size = 1) {
  if (!vram.empty()) refuse_over_budget(plan, run, model, parse_bytes(vram), "--vram " + vram, context, world_size);
}

// On the CPU the arena is host memory: a run larger than the machine is refused before it
// allocates, as --vram refuses one on the GPU, instead of failing inside the allocator. On the GPU
// the pinned host memory of offload (activations, embeddings) is checked the same way: pinned
// pages cannot be swapped, so an oversized run would otherwise end in the kernel's OOM killer.
void check_host_memory(const Plan& plan, Device device) {
  const uint64_t available = host_memory_available();
  if (device == Device::cpu) {
    const uint64_t needed = plan.arena_bytes + plan.host_bytes;
    MT_USER_CHECK(available == 0 || needed <= available,
                  "the run needs {} of host memory (its planned arena on the CPU), the machine has {} available "
                  "(MemAvailable); use a smaller model, --bf16, --load_in_4bit, --gradient_checkpointing or a shorter "
                  "--max_seq_length (memtune plan --device cpu shows the plan)",
                  format_bytes(needed), format_bytes(available));
    return;
  }
  MT_USER_CHECK(available == 0 || plan.host_bytes <= available,
                "the run pins {} of host memory (--offload_activations, --offload_embeddings, --offload_optimizer), the machine has {} "
                "available (MemAvailable); use a shorter --max_seq_length or a smaller micro-batch (memtune fit "
                "--max-context finds the longest length that fits the GPU and this host)",
                format_bytes(plan.host_bytes), format_bytes(available));
}

// Levenshtein distance: how far a mistyped option is from each real one.
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The closest of `names` to `typed`, or "" when none is close enough to be the one meant.
std::string closest_name(const std::string& typed, const std::vector<std::string>& names) {
  std::string best;
  size_t best_distance = std::max<size_t>(2, typed.size() / 3) + 1;
  for (const std::string& name : names) {
    const size_t distance = edit_distance(typed, name);
    if (distance < best_distance) best = name, best_distance = distance;
  }
  return best;
}

// CLI11's parse errors as memtune's: one line and exit 2 (help and --version exit 0 as CLI11
// prints them). An unknown option is named with the closest real one.
int exit_for_parse_error(CLI::App& app, const CLI::ParseError& error, int argc, char** argv) {
  if (error.get_exit_code() == 0) return app.exit(error);
  CLI::App* command = nullptr;
  std::vector<std::string> command_names;
  const std::vector<CLI::App*> commands = app.get_subcommands([](CLI::App*) { return true; });
  for (CLI::App* sub : commands) command_names.push_back(sub->get_name());
  int first = 1;
  for (; first < argc; ++first) {
    const std::string arg = argv[first];
    if (arg.rfind("-", 0) == 0) continue;
    for (CLI::App* sub : commands)
      if (sub->check_name(arg)) command = sub;
    if (command == nullptr) {
      const std::string near = closest_name(arg, command_names);
      std::fprintf(stderr, "memtune: error: unknown command %s%s (memtune --help lists them)\n", arg.c_str(),
                   near.empty() ? "" : ("; did you mean " + near + "?").c_str());
      return 2;
    }
    break;
  }
  if (command != nullptr && dynamic_cast<const CLI::ExtrasError*>(&error) != nullptr) {
    for (int i = first + 1; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg.rfind("--", 0) != 0 || arg == "--") continue;
      arg = arg.substr(0, arg.find('='));
      if (command->get_option_no_throw(arg) != nullptr) continue;
      std::vector<std::string> names;
      for (const CLI::Option* option : command->get_options())
        for (const std::string& name : option->get_lnames()) names.push_back("--" + name);
      const std::string near = closest_name(arg, names);
      std::fprintf(stderr, "memtune: error: unknown option %s%s\n", arg.c_str(),
                   near.empty() ? fmt::format(" (memtune {} --help lists the options)", command->get_name()).c_str()
                                : ("; did you mean " + near + "?").c_str());
      return 2;
    }
  }
  std::fprintf(stderr, "memtune: error: %s%s\n", error.what(),
               command != nullptr ? fmt::format(" (memtune {} --help)", command->get_name()).c_str() : "");
  return 2;
}


int run_cli(int argc, char** argv) {
  CLI::App app{"memtune: LoRA/QLoRA fine-tuning for Llama that plans every byte"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("memtune ") + MEMTUNE_VERSION);
  RunConfig run;
  RunFlags flags;
  std::string device = "auto", vram, data_path, eval_path, tokenizer_path, out_dir, init_adapter, resume;
  std::string bad_line = "error";
  bool json = false, quiet = false;
  int64_t save_steps = 0, eval_steps = 0, ladder_steps = 3;
  std::string order;
  // The ladder, sweep and report commands; --metrics is train's too.
  std::vector<std::string> peer_paths;  // --peer, repeatable: each peer beside memtune
  std::string metrics_path, ladder_path, vary, sweep_values, sweep_attention = "eager,flash";
  bool isolate = false, plan_only = false, profile = false;
  int64_t sweep_steps = 2;

  CLI::App* plan_cmd = app.add_subcommand("plan", "print the memory plan of a run (no checkpoint, no GPU needed)");
  add_run_options(*plan_cmd, run, flags);
  plan_cmd->add_flag("--json", json, "print one JSON object");
  bool live_at_peak = false;
  plan_cmd->add_flag("--live-at-peak", live_at_peak, "also list the buffers alive at the peak, largest first");
  plan_cmd->add_option("--vram", vram, "budget, e.g. 24GiB: refuse, with advice, a plan over it");
  plan_cmd->add_option("--device", device, "the device planned for: cuda (auto; its 32 MiB GEMM and reduction workspace included) or cpu (no workspace: what train --device cpu allocates)")->capture_default_str();
  int plan_world_size = 1;
  plan_cmd->add_option("--world_size", plan_world_size, "several GPUs: plan one rank of this many (ZeRO-1 optimizer state)")->capture_default_str();
  plan_cmd->add_flag("--packing,--padding_free", run.packed_rows, "plan a run whose rows hold several samples (train --packing / --padding_free): cuDNN attention gets room for its ragged backward");
  plan_cmd->add_flag("--shard_base", run.shard_base, "with --world_size 2 or more: the frozen base sharded across the ranks and gathered one layer at a time (FSDP-QLoRA)");

  // train's data and loop options, in TRL / transformers names (data/sft_dataset.h, train/trainer.h).
  bool completion_only_loss = true, assistant_only_loss = true, packing = false, padding_free = false,
       group_by_length = false, merge_micro_batches = true;
  std::string padding = "longest";
  int64_t pad_to_multiple_of = 64;
  double eval_split = 0, num_train_epochs = 0;
  uint64_t data_seed = 0;
  CLI::App* train_cmd = app.add_subcommand("train", "train a LoRA adapter");
  add_run_options(*train_cmd, run, flags);
  train_cmd->add_option("--data", data_path, "JSONL of {\"text\"}, {\"prompt\",\"completion\"}, {\"messages\"} or {\"input_ids\",\"labels\"} lines; synthetic tokens when absent");
  train_cmd->add_option("--eval_data", eval_path, "JSONL evaluated every --eval_steps and at the end");
  train_cmd->add_option("--eval_split", eval_split, "evaluate on this seeded fraction of --data instead (datasets' test_size)");
  train_cmd->add_option("--eval_steps", eval_steps, "evaluate every N steps (and always at the end)");
  train_cmd->add_option("--completion_only_loss", completion_only_loss, "prompt-completion data: train on the completion only (TRL)")->capture_default_str();
  train_cmd->add_option("--assistant_only_loss", assistant_only_loss, "messages data: train on the assistant turns only (TRL; TRL's default is false)")->capture_default_str();
  train_cmd->add_flag("--packing", packing, "several whole samples per row, each attending only to itself (TRL, best-fit decreasing)");
  train_cmd->add_option("--padding", padding, "longest: a micro-batch runs at its longest row (transformers' collators); max_length: every row padded to --max_seq_length")->capture_default_str();
  train_cmd->add_option("--pad_to_multiple_of", pad_to_multiple_of, "round a micro-batch's row length up to a multiple of this (the kernels' tile)")->capture_default_str();
  train_cmd->add_flag("--padding_free", padding_free, "lay each micro-batch's samples end to end in one row, each attending only to itself (TRL); needs flash or cuDNN attention");
  train_cmd->add_flag("--group_by_length", group_by_length, "micro-batches of rows of similar length, still shuffled (transformers)");
  // On by default since it was timed on an H100 (bench/results/2026-12-06-h100-session4: 1.36x tokens/s on
  // short chat samples, the same device peak); it stays off by itself with LoRA dropout or several processes.
  train_cmd->add_option("--merge_micro_batches", merge_micro_batches,
                        "run a step's micro-batches as fewer, larger ones where their rows fit the planned micro-batch "
                        "(same gradients; only without LoRA dropout and on one process, where it is off by itself)")
      ->capture_default_str();
  train_cmd->add_option("--num_train_epochs", num_train_epochs, "epochs to train; --max_steps wins when both are given (transformers)");
  train_cmd->add_option("--data_seed", data_seed, "seed of the epoch-wise shuffle (default: --seed)");
  train_cmd->add_option("--tokenizer", tokenizer_path, "tokenizer.json (default: the built-in byte tokenizer)");
  train_cmd->add_option("--out,--output_dir", out_dir, "output folder: adapter/ (PEFT format) and checkpoint-<step>/ folders; a fresh run needs an empty one");
  train_cmd->add_option("--init-adapter,--init_adapter", init_adapter, "start from a PEFT adapter folder (its adapter_config.json gives the LoRA settings)");
  train_cmd->add_option("--resume,--resume_from_checkpoint", resume, "continue from a checkpoint folder, or from the newest checkpoint-<step> of an output folder");
  train_cmd->add_option("--save_steps", save_steps, "write a checkpoint every N steps");
  bool overwrite_output_dir = false, allow_skipped_steps = false;
  int64_t save_total_limit = 0, logging_steps = 1;
  double max_skipped_steps_ratio = StepHealthOptions{}.max_skipped_steps_ratio;
  train_cmd->add_flag("--overwrite_output_dir", overwrite_output_dir, "a fresh run into a non-empty --out: remove the previous run's adapter and checkpoints first");
  train_cmd->add_option("--save_total_limit", save_total_limit, "keep only the newest N checkpoint-<step> folders (0: all)")->capture_default_str();
  train_cmd->add_option("--logging_steps", logging_steps, "print a step line every N steps (--metrics gets every step)")->capture_default_str();
  train_cmd->add_option("--max_skipped_steps_ratio", max_skipped_steps_ratio, "fail the run when more than this share of its steps were skipped (fp16 overflow) or had a gradient norm of exactly 0")->capture_default_str();
  train_cmd->add_flag("--allow_skipped_steps", allow_skipped_steps, "report skipped and zero-gradient steps, never fail for them");
  train_cmd->add_option("--device", device, "cpu | cuda | auto")->capture_default_str();
  train_cmd->add_option("--vram", vram, "budget, e.g. 24GiB");
  train_cmd->add_option("--on-bad-line,--on_bad_line", bad_line, "error | skip (skipped lines are counted and reported)")->capture_default_str();
  train_cmd->add_flag("--quiet", quiet, "no per-step lines and no progress line");
  int train_world_size = 0;
  train_cmd->add_option("--world_size", train_world_size, "several GPUs: the ranks expected from the launcher (torchrun's WORLD_SIZE, mpirun, srun); refused when it disagrees");
  train_cmd->add_flag("--shard_base", run.shard_base, "several GPUs: the frozen base sharded across the ranks and gathered one layer at a time (FSDP-QLoRA)");
  train_cmd->add_option("--metrics", metrics_path, "append one JSON line per step to this .jsonl file");
  train_cmd->add_flag("--profile", profile, "time every op of the last step (a per-op table on stderr; that step is left out of the tokens/s totals)");

  CLI::App* eval_cmd = app.add_subcommand("eval", "print the mean loss on a JSONL file as JSON");
  add_run_options(*eval_cmd, run, flags);
  eval_cmd->add_option("--data", data_path, "JSONL file")->required();
  eval_cmd->add_option("--adapter", init_adapter, "PEFT adapter folder");
  eval_cmd->add_option("--tokenizer", tokenizer_path);
  eval_cmd->add_option("--device", device)->capture_default_str();

  CLI::App* fit_cmd = app.add_subcommand("fit", "find, from the plan, the fastest techniques and largest micro-batch that fit --vram");
  add_run_options(*fit_cmd, run, flags);
  std::string context = fmt::format("{}MiB", kCudaContextReserveBytes >> 20);
  fit_cmd->add_option("--vram", vram, "budget, e.g. 24GiB")->required();
  fit_cmd->add_flag("--packing,--padding_free", run.packed_rows, "fit a run whose rows hold several samples (train --packing / --padding_free)");
  fit_cmd->add_flag("--json", json, "print one JSON object: the fitted run (its options and plan), or with --max-context the longest contexts");
  fit_cmd->add_option("--context", context, "CUDA context + library handles to reserve (the ladder measures it)")->capture_default_str();
  bool max_context = false;
  fit_cmd->add_flag("--max-context,--max_context", max_context,
                    "report the longest max_seq_length at micro-batch 1 that fits, with the full memory stack, with and without --offload_activations");
  std::string host_memory = "auto";
  fit_cmd->add_option("--host_memory,--host-memory", host_memory,
                      "pinned host memory that offload may take: auto (this machine's MemAvailable), none (no "
                      "limit) or a size, e.g. 64GiB")->capture_default_str();

  CLI::App* ladder_cmd = app.add_subcommand("ladder", "the memory ladder: apply memory techniques one at a time");
  add_run_options(*ladder_cmd, run, flags);
  ladder_cmd->add_option("--vram", vram, "budget, e.g. 24GiB");
  ladder_cmd->add_option("--out", out_dir, "folder for ladder.json (and report.md, ladder.csv, ladder.svg)")->capture_default_str();
  ladder_cmd->add_option("--order", order, "comma list of: bf16,gradient_checkpointing,flash,qlora,chunked_loss,micro_batch,seq_halved; fp32 first starts from an fp32 baseline (as --fp32)");
  ladder_cmd->add_option("--steps-per-rung", ladder_steps, "optimizer steps measured per rung")->capture_default_str();
  ladder_cmd->add_option("--device", device)->capture_default_str();
  std::string ladder_flash_backend = "auto";
  ladder_cmd->add_option("--flash-backend", ladder_flash_backend,
                         "which fused attention the flash trick turns on: auto (cudnn where available, else flash) | flash (memtune's kernel) | cudnn")
      ->check(CLI::IsMember({"auto", "flash", "cudnn"}))
      ->capture_default_str();
  ladder_cmd->add_flag("--quiet", quiet, "no progress line on stderr");
  ladder_cmd->add_flag("--isolate", isolate, "also run each trick alone from the baseline, and the full stack without each");
  ladder_cmd->add_flag("--profile", profile, "after each rung's steps, time every op of one more step: a per-op table (stdout) and op_profile in ladder.json");
  ladder_cmd->add_option("--peer", peer_paths, "peer JSON from bench/peer_hf.py or bench/peer_unsloth.py: its figures beside memtune's (repeatable)");
  ladder_cmd->add_option("--metrics", metrics_path, "append one JSON line per step and per rung to this .jsonl file");

  CLI::App* sweep_cmd = app.add_subcommand(
      "sweep", "peak memory and tokens/s against max_seq_length or the micro-batch, eager against flash");
  add_run_options(*sweep_cmd, run, flags);
  sweep_cmd->add_option("--vary", vary, "seq | batch")->required();
  sweep_cmd->add_option("--values", sweep_values, "comma list, e.g. 256,512,1024,2048")->required();
  sweep_cmd->add_option("--attn", sweep_attention, "attention implementations to compare")->capture_default_str();
  sweep_cmd->add_flag("--plan-only,--plan_only", plan_only, "plan every point, measure none");
  sweep_cmd->add_option("--steps-per-point", sweep_steps, "optimizer steps measured per point")->capture_default_str();
  sweep_cmd->add_option("--vram", vram, "budget, e.g. 24GiB (marks the points over it)");
  sweep_cmd->add_option("--out", out_dir, "folder for sweep.json, sweep.csv, sweep_memory.svg, sweep_tokens_per_second.svg");
  sweep_cmd->add_option("--device", device)->capture_default_str();
  sweep_cmd->add_flag("--quiet", quiet, "no progress line on stderr");
  sweep_cmd->add_option("--metrics", metrics_path, "append one JSON line per step and per point to this .jsonl file");

  CLI::App* report_cmd = app.add_subcommand(
      "report", "re-render report.md, ladder.csv, ladder.svg (and the table) from a saved ladder.json");
  report_cmd->add_option("--ladder", ladder_path, "ladder.json written by memtune ladder")->required();
  report_cmd->add_option("--peer", peer_paths, "peer JSON from bench/peer_hf.py or bench/peer_unsloth.py: attached, replacing any peers already there (repeatable: each beside memtune)");
  report_cmd->add_option("--out", out_dir, "output folder (default: the ladder.json's folder)");

  // ---- merge, generate, logits (their own options: no run flags) ----
  OutputCommandOptions output;
  CLI::App* merge_cmd = app.add_subcommand("merge", "merge a PEFT adapter into its base: a Hugging Face model folder");
  merge_cmd->add_option("--model", output.model, "base model folder (config.json + safetensors; 16-bit, or bitsandbytes 4-bit: dequantized)")->required();
  merge_cmd->add_option("--adapter", output.adapter, "PEFT adapter folder")->required();
  merge_cmd->add_option("--out", output.out, "output folder, written atomically (an existing one is replaced only on success)")->required();
  merge_cmd->add_option("--dtype", output.dtype, "bf16 | f16 | f32 (default: the base's dtype)");
  merge_cmd->add_option("--max_shard_size", output.max_shard_size, "shard limit as transformers' save_pretrained (GB = 10^9)")->capture_default_str();
  CLI::App* generate_cmd = app.add_subcommand("generate", "generate text with a KV cache (base model, optionally with a PEFT adapter)");
  CLI::App* logits_cmd = app.add_subcommand("logits", "write the logits of every position of one sequence to a .safetensors file");
  for (CLI::App* command : {generate_cmd, logits_cmd}) {
    command->add_option("--model", output.model, "preset, or a folder with config.json + safetensors")->capture_default_str();
    command->add_option("--adapter", output.adapter, "PEFT adapter folder (applied unmerged)");
    command->add_option("--prompt", output.prompt, "text; encoded with <|begin_of_text|> as transformers' tokenizer(prompt)");
    command->add_option("--input-ids,--input_ids", output.input_ids, "token ids instead of --prompt: 1,2,3");
    command->add_flag("--chat", output.chat, "wrap --prompt in the Llama 3 chat template (add_generation_prompt)");
    command->add_option("--system", output.system, "system message for --chat");
    command->add_option("--tokenizer", output.tokenizer, "tokenizer.json (default: the model folder's, else the built-in byte tokenizer)");
    command->add_option("--device", output.device, "cpu | cuda | auto")->capture_default_str();
    command->add_option("--dtype", output.dtype, "bf16 | f16 | f32 | auto (the config's dtype)")->capture_default_str();
    command->add_flag("--load_in_4bit", output.load_in_4bit, "keep the projections in nf4 (double quant), as QLoRA training does");
    command->add_option("--seed", output.seed, "sampling seed, and the random init of a preset without weights (as train --seed)")->capture_default_str();
  }
  generate_cmd->add_option("--max_new_tokens", output.max_new_tokens)->capture_default_str();
  generate_cmd->add_option("--temperature", output.temperature, "0: greedy")->capture_default_str();
  generate_cmd->add_option("--top_p", output.top_p, "nucleus sampling (with --temperature > 0)")->capture_default_str();
  generate_cmd->add_flag("--json", output.json, "print one JSON object (prompt_ids, output_ids, text, stop_reason) instead of the text");
  logits_cmd->add_option("--out", output.out, "output .safetensors: logits f32 [tokens, vocab], input_ids i32 [tokens]")->required();
  // ---- end merge, generate, logits ----

  // ---- quantize ----
  std::string quantize_model, quantize_out, quantize_type = "nf4", quantize_compute_dtype = "auto";
  QuantConfig quantize_config;
  CLI::App* quantize_cmd = app.add_subcommand("quantize", "write a bitsandbytes 4-bit Hugging Face folder (load it with --load_in_4bit)");
  quantize_cmd->add_option("--model", quantize_model, "dense model folder (config.json + safetensors)")->required();
  quantize_cmd->add_option("--out", quantize_out, "output folder, written atomically (an existing one is replaced only on success)")->required();
  quantize_cmd->add_option("--bnb_4bit_quant_type", quantize_type, "nf4 | fp4")->capture_default_str();
  quantize_cmd->add_option("--bnb_4bit_use_double_quant", quantize_config.double_quant, "true | false")->capture_default_str();
  quantize_cmd->add_option("--bnb_4bit_blocksize", quantize_config.blocksize)->capture_default_str();
  quantize_cmd->add_option("--bnb_4bit_compute_dtype", quantize_compute_dtype, "bf16 | f16 | f32 | auto (the base's dtype)")->capture_default_str();
  // ---- end quantize ----

  // A run YAML (--config FILE) sets defaults that the flags then override.
  std::set<std::string> yaml_keys;  // what the YAML set, as opposed to the defaults
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--config") yaml_keys.merge(apply_run_yaml(argv[i + 1], run));
  std::string config_path;
  for (CLI::App* command : {plan_cmd, train_cmd, eval_cmd, ladder_cmd, fit_cmd, sweep_cmd})
    command->add_option("--config", config_path, "run YAML in HF option names (configs/runs/)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return exit_for_parse_error(app, e, argc, argv);
  }

  // A run whose result is thrown away, or learned from nothing, says so before anything else.
  if (train_cmd->parsed() && (data_path.empty() || out_dir.empty())) {
    std::string note;
    if (data_path.empty()) note = "no --data: training on synthetic random tokens";
    if (out_dir.empty()) note += std::string(note.empty() ? "" : "; ") + "no --out: the trained adapter is not saved";
    std::cerr << "memtune: note: " << note << "\n";
  }

  if (report_cmd->parsed()) {
    nlohmann::json ladder = read_json_file(ladder_path);
    if (!peer_paths.empty()) {
      std::vector<std::pair<nlohmann::json, std::string>> peers;
      for (const std::string& path : peer_paths) peers.emplace_back(read_json_file(path), path);
      ladder = attach_peers(ladder, peers);
    }
    std::filesystem::path out = out_dir.empty() ? std::filesystem::path(ladder_path).parent_path()
                                                : std::filesystem::path(out_dir);
    if (out.empty()) out = ".";
    write_ladder_outputs(ladder, out);
    std::cout << ladder_terminal_table(ladder);
    std::cout << "wrote " << out.string() << "\n";
    return 0;
  }

  // ---- merge, generate, logits ----
  if (merge_cmd->parsed()) return run_merge(output);
  if (generate_cmd->parsed()) return run_generate(output);
  if (logits_cmd->parsed()) return run_logits(output);
  // ---- end merge, generate, logits ----

  // ---- quantize ----
  if (quantize_cmd->parsed()) {
    quantize_config.type = parse_quant_type(quantize_type, "--bnb_4bit_quant_type");
    QuantizeOptions options;
    if (quantize_compute_dtype != "auto") options.compute_dtype = parse_float_dtype(quantize_compute_dtype, "--bnb_4bit_compute_dtype");
    const QuantizeReport report = quantize_checkpoint(quantize_model, quantize_out, quantize_config, options);
    std::cout << fmt::format("wrote {}: {} projections in {} (blocksize {}, double quant {}), {} weight file(s)\n",
                             quantize_out, report.quantized_projections, quant_type_name(quantize_config.type),
                             quantize_config.blocksize, quantize_config.double_quant, report.weight_files.size());
    return 0;
  }
  // ---- end quantize ----

  // The ladder sets checkpointing per rung, so --offload_activations without
  // --gradient_checkpointing is valid there (run_ladder validates every rung).
  // auto (sdpa) resolves to the fixed rule here; `train` on a GPU measures instead (attention_pick.h).
  const bool attention_auto = run.attn_implementation == "auto" || run.attn_implementation == "sdpa";
  resolve_run_flags(run, flags, /*validate=*/!ladder_cmd->parsed());
  // An adapter to start from (train --init-adapter, eval --adapter) brings its own LoRA settings.
  if (!init_adapter.empty() && (train_cmd->parsed() || eval_cmd->parsed())) {
    CLI::App* command = train_cmd->parsed() ? train_cmd : eval_cmd;
    const auto given = [&](const char* flag, const char* key) {
      return command->count(flag) > 0 || yaml_keys.count(key) > 0;
    };
    LoraOptionsGiven lora_given;
    lora_given.r = given("--lora_r", "lora_r");
    lora_given.alpha = given("--lora_alpha", "lora_alpha");
    lora_given.dropout = given("--lora_dropout", "lora_dropout");
    lora_given.use_rslora = given("--use_rslora", "use_rslora");
    lora_given.target_modules = given("--lora_target_modules", "lora_target_modules");
    adopt_adapter_lora_config(run, read_peft_adapter_config(init_adapter), lora_given, init_adapter);
    run.validate();
  }
  const ModelSource source = resolve_model(run.model);
  const LlamaConfig& model = source.config;
  // Past the model's positions a run goes on, as transformers does, with a word about it.
  if ((train_cmd->parsed() || plan_cmd->parsed()) && model.max_position_embeddings > 0 &&
      run.max_seq_length > model.max_position_embeddings)
    std::cerr << fmt::format("memtune: warning: --max_seq_length {} is past the model's max_position_embeddings {}: "
                             "positions beyond it were never trained, and the quality there is unknown\n",
                             run.max_seq_length, model.max_position_embeddings);

  // ---- several GPUs: how many ranks, and whether the base is sharded ----
  // plan: --world_size (default 1). train: the launcher's variables (launch_env.h); --world_size,
  // when given, must agree with them. --shard_base needs 2 ranks or more in both.
  int world_size = 1;
  if (plan_cmd->parsed()) {
    MT_USER_CHECK(plan_world_size >= 1, "--world_size {}: expected 1 or more ranks", plan_world_size);
    world_size = plan_world_size;
    MT_USER_CHECK(!run.shard_base || world_size >= 2, "--shard_base needs --world_size 2 or more: it splits the "
                  "frozen base across the ranks (--world_size is {})", world_size);
  } else if (train_cmd->parsed()) {
    const LaunchEnv env = launch_env_from_process();
    world_size = env.world_size;
    if (train_cmd->count("--world_size") > 0) {
      MT_USER_CHECK(train_world_size >= 1, "--world_size {}: expected 1 or more ranks", train_world_size);
      MT_USER_CHECK(train_world_size == env.world_size, "--world_size {} disagrees with the launcher, which "
                    "started {} rank(s) (WORLD_SIZE or its MPI / Slurm kin; this process: {}); start {} processes "
                    "with torchrun, mpirun or srun, or drop --world_size", train_world_size, env.world_size,
                    env.describe(), train_world_size);
    }
    MT_USER_CHECK(!run.shard_base || world_size >= 2, "--shard_base needs 2 ranks or more, and the launcher "
                  "started {} ({}): start one process per GPU with torchrun (WORLD_SIZE >= 2), mpirun or srun",
                  env.world_size, env.describe());
  }
  // ---- end several GPUs ----

  // Under --vram, an auto token-chunk size becomes the largest that fits (fit.h).
  if (!vram.empty() && (plan_cmd->parsed() || train_cmd->parsed()))
    fit_token_chunks(run, model, parse_bytes(vram), context_reserve_bytes(device == "cpu" ? Device::cpu : Device::cuda),
                     world_size);

  if (plan_cmd->parsed() && world_size > 1) {
    MT_USER_CHECK(!json && !live_at_peak, "--world_size: --json and --live-at-peak are for one device only");
    RunConfig one_device = run;
    one_device.shard_base = false;
    const Plan single = plan_run(one_device, model);
    // Traced: with --shard_base the engine of one rank keeps its shards and two gather buffers.
    const Plan rank_plan = plan_run(run, model, Device::cuda, world_size);
    std::cout << format_rank_memory(single, rank_memory(rank_plan, world_size, run.shard_base));
    check_budget(rank_plan, run, model, vram, context_reserve_bytes(Device::cuda), world_size);
    return 0;
  }
  if (plan_cmd->parsed()) {
    MT_USER_CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device {}: expected cpu, cuda or auto", device);
    const Device planned_for = device == "cpu" ? Device::cpu : Device::cuda;
    const Plan plan = plan_run(run, model, planned_for);
    const uint64_t reserve = context_reserve_bytes(planned_for);
    if (json) {
      nlohmann::json out = plan_json(plan, run, model);
      if (!vram.empty()) {
        out["budget_bytes"] = parse_bytes(vram);
        out["context_reserve_bytes"] = reserve;
        out["fits"] = plan.arena_bytes + reserve <= parse_bytes(vram);
      }
      std::cout << out.dump(2) << std::endl;  // whole on stdout before a refusal on stderr
    }
    else std::cout << format_plan(plan, run, model);
    if (live_at_peak && !json) std::cout << format_live_at_peak(plan);
    std::cout.flush();  // the plan, then (on stderr) a refusal
    check_budget(plan, run, model, vram, reserve);
    return 0;
  }

  // fit: the pinned host memory that offload may take (--host_memory).
  uint64_t host_budget = 0;
  if (fit_cmd->parsed()) {
    host_budget = host_memory == "auto" ? host_memory_available() : host_memory == "none" ? 0 : parse_bytes(host_memory);
    MT_USER_CHECK(host_memory == "none" || host_memory == "auto" || host_budget > 0,
                  "--host_memory {}: expected auto, none or a positive size such as 64GiB", host_memory);
  }

  if (fit_cmd->parsed() && max_context) {
    const MaxContextReport report = max_context_report(run, model, parse_bytes(vram), parse_bytes(context), host_budget);
    if (json) {
      nlohmann::json out = nlohmann::json::object();
      for (const MaxContextResult* r : {&report.without_offload, &report.with_offload})
        out[r->offload_activations ? "with_offload" : "without_offload"] = {
            {"seq", r->seq}, {"planned_bytes", r->planned_bytes}, {"host_bytes", r->host_bytes},
            {"at_search_limit", r->at_search_limit}, {"past_model_limit", r->past_model_limit},
            {"limited_by_host", r->limited_by_host}};
      out["host_budget_bytes"] = host_budget;
      out["model_max_position_embeddings"] = model.max_position_embeddings;
      out["budget_bytes"] = parse_bytes(vram);
      out["context_bytes"] = parse_bytes(context);
      std::cout << out.dump(2) << "\n";
    } else {
      std::cout << report.text;
    }
    MT_USER_CHECK(report.fits(), "no context of {} tokens or more fits --vram {} with the full memory stack, even with offload",
                  kContextStep, vram);
    return 0;
  }

  if (fit_cmd->parsed()) {
    const FitResult fit = fit_run(run, model, parse_bytes(vram), parse_bytes(context), host_budget);
    if (json) {
      nlohmann::json out = {{"units", "bytes"}, {"fits", fit.fits}, {"budget_bytes", parse_bytes(vram)},
                            {"context_bytes", parse_bytes(context)}, {"host_budget_bytes", host_budget},
                            {"explanation", fit.explanation}};
      if (fit.fits) {
        out["options"] = fit_flags(fit.run);
        out["planned_bytes"] = fit.planned_bytes;
        out["with_context_bytes"] = fit.with_context_bytes;
        out["plan"] = plan_json(plan_run(fit.run, model), fit.run, model);
      }
      std::cout << out.dump(2) << "\n";
      return fit.fits ? 0 : 3;
    }
    std::cout << fit.explanation;
    if (!fit.fits) return 3;
    std::cout << format_plan(plan_run(fit.run, model), fit.run, model);
    std::cout << fmt::format("predicted peak with context: {}\n", format_bytes(fit.with_context_bytes));
    std::cout << fmt::format("the options: {}\n", fit_flags(fit.run));
    return 0;
  }

  if (ladder_cmd->parsed()) {
    // The seed run's shape unless told otherwise: micro-batch 2 x accumulation 8, seq 2048
    // (256 for the embedded tiny model, which runs on the CPU in seconds).
    const bool tiny = model.hidden_size <= 256;
    if (ladder_cmd->count("--per_device_train_batch_size") == 0) run.per_device_train_batch_size = 2;
    if (ladder_cmd->count("--gradient_accumulation_steps") == 0) run.gradient_accumulation_steps = 8;
    if (ladder_cmd->count("--max_seq_length") == 0) run.max_seq_length = tiny ? 256 : 2048;
    if (ladder_cmd->count("--loss_chunk_tokens") == 0) run.loss_chunk_tokens = tiny ? 128 : 256;
    LadderOptions options;
    options.base = run;
    options.device = device;
    options.budget_bytes = vram.empty() ? 0 : parse_bytes(vram);
    // No step measured would fill the table with zero tokens/s that read as measurements.
    MT_USER_CHECK(ladder_steps >= 1, "--steps-per-rung {}: expected 1 or more", ladder_steps);
    options.steps = ladder_steps;
    options.quiet = quiet;
    options.isolate = isolate;
    options.profile = profile;
    options.flash_backend = ladder_flash_backend;
    options.fp32_baseline = flags.fp32;
    options.metrics = metrics_path;
    options.commit = git_commit();
    options.date = today();
    for (size_t start = 0; !order.empty() && start <= order.size();) {
      const size_t end = std::min(order.find(',', start), order.size());
      options.order.push_back(order.substr(start, end - start));
      start = end + 1;
    }
    // Read and check the peer file before a run that may take an hour, not after it.
    std::vector<std::pair<nlohmann::json, std::string>> peers;
    for (const std::string& path : peer_paths) {
      peers.emplace_back(read_json_file(path), path);
      validate_peer_json(peers.back().first, path);
    }
    nlohmann::json ladder = run_ladder(options);
    if (!peers.empty()) ladder = attach_peers(ladder, peers);
    if (out_dir.empty()) out_dir = "ladder-out";
    std::filesystem::create_directories(out_dir);
    write_ladder_outputs(ladder, out_dir);
    std::cout << ladder_terminal_table(ladder);
    std::cout << "wrote " << out_dir << "\n";
    return 0;
  }

  if (sweep_cmd->parsed()) {
    SweepOptions options;
    options.base = run;
    options.vary = vary;
    options.values = parse_sweep_values(sweep_values, "--values");
    options.attention.clear();
    for (size_t start = 0; start <= sweep_attention.size();) {
      const size_t end = std::min(sweep_attention.find(',', start), sweep_attention.size());
      options.attention.push_back(sweep_attention.substr(start, end - start));
      start = end + 1;
    }
    options.plan_only = plan_only;
    MT_USER_CHECK(plan_only || sweep_steps >= 1, "--steps-per-point {}: expected 1 or more (or --plan-only)", sweep_steps);
    options.steps = sweep_steps;
    options.device = device;
    options.budget_bytes = vram.empty() ? 0 : parse_bytes(vram);
    options.quiet = quiet;
    options.metrics = metrics_path;
    options.commit = git_commit();
    options.date = today();
    const nlohmann::json sweep = run_sweep(options);
    if (out_dir.empty()) out_dir = "sweep-out";
    write_sweep_outputs(sweep, out_dir);
    std::cout << sweep_terminal_table(sweep);
    std::cout << "wrote " << out_dir << "\n";
    return 0;
  }

  // Several GPUs (parallel/): one process per GPU from torchrun / mpirun / srun; its GPU first.
  const LaunchEnv launch = launch_env_from_process();
  select_local_cuda_device(launch);
  std::unique_ptr<Backend> backend = make_backend(device);
  const Tokenizer tokenizer = load_tokenizer(tokenizer_path);
  const BadLinePolicy policy = bad_line == "skip" ? BadLinePolicy::skip : BadLinePolicy::error;
  MT_USER_CHECK(bad_line == "skip" || bad_line == "error", "--on-bad-line {}: expected error or skip", bad_line);

  if (eval_cmd->parsed()) {
    const Dataset data = read_jsonl_dataset(data_path, tokenizer, model.vocab_size);
    RunConfig eval_run = run;
    eval_run.per_device_train_batch_size = 1;
    int64_t longest = 2;
    for (const Sample& s : data.samples) longest = std::max<int64_t>(longest, s.input_ids.size());
    eval_run.max_seq_length = std::min<int64_t>(longest, run.max_seq_length);
    check_host_memory(plan_run(eval_run, model, backend->device()), backend->device());
    PlannedEngine engine(*backend, eval_run, model);
    if (!source.checkpoint_dir.empty()) engine->load_base_checkpoint(source.checkpoint_dir);
    else engine->init_random_weights(run.seed);
    if (!init_adapter.empty()) engine->load_adapter(init_adapter);
    else engine->init_adapters(run.seed + 1);
    double loss_sum = 0;
    int64_t tokens = 0;
    for (const Sample& s : data.samples) {
      // Each sample at its own length (rounded up to the kernels' tile), inside the planned row.
      const int64_t length = std::min<int64_t>(static_cast<int64_t>(s.input_ids.size()), eval_run.max_seq_length);
      const auto [sum, count] = engine->eval_loss_sum(make_micro_batch(
          {s.input_ids}, {s.labels}, padded_length(std::max<int64_t>(length, 1), 64, eval_run.max_seq_length)));
      loss_sum += sum;
      tokens += count;
    }
    MT_USER_CHECK(tokens > 0, "every label in {} is masked (-100): no loss to report", data_path);
    // A diverged adapter, or fp16 overflow: no number to report is an error, not a null.
    MT_USER_CHECK(std::isfinite(loss_sum), "the eval loss over {} is not finite ({}): the adapter's outputs overflow{}",
                  data_path, loss_sum, eval_run.precision == Precision::fp16 ? " fp16 (--bf16 or --fp32 keep them finite)" : "");
    std::cout << nlohmann::json{{"loss", loss_sum / tokens}, {"tokens", tokens}, {"samples", data.samples.size()}}.dump() << "\n";
    return 0;
  }

  // train
  // Written so that NaN fails each check: a NaN or negative count would otherwise turn the option
  // off without a word (every comparison with NaN is false).
  MT_USER_CHECK(eval_split == 0 || (eval_split > 0 && eval_split < 1), "--eval_split {}: expected a fraction in (0, 1)",
                eval_split);
  MT_USER_CHECK(train_cmd->count("--num_train_epochs") == 0 || (num_train_epochs > 0 && num_train_epochs <= 1e6),
                "--num_train_epochs {}: expected a positive number of epochs (up to 1e6)", num_train_epochs);
  MT_USER_CHECK(save_steps >= 0, "--save_steps {}: expected 0 (no checkpoints before the end) or more", save_steps);
  MT_USER_CHECK(eval_steps >= 0, "--eval_steps {}: expected 0 (evaluate at the end only) or more", eval_steps);
  MT_USER_CHECK(eval_path.empty() || eval_split == 0, "--eval_data and --eval_split exclude each other");
  MT_USER_CHECK(padding == "longest" || padding == "max_length", "--padding {}: expected longest or max_length", padding);
  MT_USER_CHECK(pad_to_multiple_of >= 1, "--pad_to_multiple_of {}: expected a positive number", pad_to_multiple_of);
  MT_USER_CHECK(!padding_free || padding == "longest",
                "--padding_free lays the samples end to end, so it has no padding to max_length: drop --padding {}",
                padding);
  // Eager attention keeps [batch, heads, seq, seq] probabilities: a padding-free row of several
  // samples is longer than the planned rows, and its probabilities would not fit the plan.
  MT_USER_CHECK(!padding_free || run.step_options().attention != AttentionImpl::eager,
                "--padding_free needs flash or cuDNN attention (--attn_implementation flash, cudnn or auto): eager "
                "attention keeps [batch, heads, seq, seq] probabilities, which a row of several samples outgrows");
  MT_USER_CHECK(!data_path.empty() || eval_split == 0, "--eval_split splits --data, and no --data was given");
  // Merging changes which micro-batch a token is in: LoRA dropout draws its masks per micro-batch,
  // and a rank's micro-batches are its share of the global step.
  // Asked for by name (not the default), the combinations it cannot serve are refused.
  const bool merge_asked = train_cmd->count("--merge_micro_batches") > 0 && merge_micro_batches;
  MT_USER_CHECK(!merge_asked || run.lora_dropout == 0,
                "--merge_micro_batches keeps the gradients only without LoRA dropout (its masks are drawn per "
                "micro-batch): drop --lora_dropout {} or --merge_micro_batches", run.lora_dropout);
  MT_USER_CHECK(!merge_asked || launch.world_size == 1,
                "--merge_micro_batches runs on one process; this launch has {}", launch.world_size);
  // Rows of several samples: the plan gives cuDNN attention room for its ragged backward.
  run.packed_rows = run.packed_rows || packing || padding_free;
  if (!tokenizer_path.empty()) check_tokenizer_fits_model(tokenizer, model.vocab_size);
  DatasetOptions data_options;
  data_options.on_bad_line = policy;
  data_options.completion_only_loss = completion_only_loss;
  data_options.assistant_only_loss = assistant_only_loss;
  data_options.max_seq_length = run.max_seq_length;
  if (!tokenizer_path.empty()) data_options.eos_id = eos_id_from_tokenizer_config(tokenizer_path, tokenizer);
  const uint64_t shuffle_seed = train_cmd->count("--data_seed") > 0 ? data_seed : run.seed;
  Dataset data = data_path.empty()
      ? synthetic_dataset(run.per_device_train_batch_size * run.gradient_accumulation_steps * std::max<int64_t>(1, run.max_steps), run.max_seq_length, model.vocab_size, run.seed)
      : read_dataset(data_path, tokenizer, model.vocab_size, data_options);
  Dataset eval_data;
  std::string eval_name = eval_path;
  if (eval_split > 0) {
    DatasetSplit split = split_dataset(data, eval_split, shuffle_seed);
    data = std::move(split.train);
    eval_data = std::move(split.eval);
    eval_name = fmt::format("{} (eval split {})", data_path, eval_split);
  } else if (!eval_path.empty()) {
    eval_data = read_dataset(eval_path, tokenizer, model.vocab_size, data_options);
  }
  const bool has_eval = !eval_data.samples.empty();
  // Rows of one sample padded to the longest of their micro-batch never outgrow the data's
  // longest sample: the engine (its plan, --vram verdict and workspaces) is sized for that.
  const int64_t max_seq_length = run.max_seq_length;
  const Padding padding_kind = padding == "max_length" ? Padding::max_length : Padding::longest;
  if (!data_path.empty()) {
    const int64_t row_tokens = planned_row_tokens({&data, &eval_data}, max_seq_length, packing, padding_kind,
                                                  pad_to_multiple_of);
    if (row_tokens < max_seq_length) {
      std::cerr << fmt::format("memtune: note: no row of this data is longer than {} tokens (its longest sample, "
                               "rounded up to a multiple of {}): the engine is planned for rows of {}, not "
                               "--max_seq_length {}\n", row_tokens, pad_to_multiple_of, row_tokens, max_seq_length);
      run.max_seq_length = row_tokens;
    }
  }
  // transformers: max_steps > 0 overrides num_train_epochs. A YAML run config may set it too.
  const bool max_steps_given = train_cmd->count("--max_steps") > 0 || run.max_steps != RunConfig{}.max_steps;
  if (num_train_epochs > 0 && !max_steps_given) {
    run.max_steps = steps_for_epochs(num_train_epochs, static_cast<int64_t>(training_rows(data, run.max_seq_length, packing).size()),
                                     run.per_device_train_batch_size, run.gradient_accumulation_steps);
  } else if (num_train_epochs > 0) {
    std::cerr << "memtune: note: --max_steps " << run.max_steps << " wins over --num_train_epochs\n";
  }
  MT_USER_CHECK(save_total_limit >= 0, "--save_total_limit {}: expected 0 (keep all) or more", save_total_limit);
  MT_USER_CHECK(logging_steps >= 1, "--logging_steps {}: expected 1 or more", logging_steps);
  MT_USER_CHECK(max_skipped_steps_ratio >= 0 && max_skipped_steps_ratio <= 1,
                "--max_skipped_steps_ratio {}: expected a share from 0 to 1", max_skipped_steps_ratio);
  MT_USER_CHECK(resume.empty() || !overwrite_output_dir,
                "--resume and --overwrite_output_dir exclude each other: a resumed run continues in its output folder");
  // The output folder is locked and checked before the model is loaded (rank 0 writes it).
  std::shared_ptr<OutputDirLock> output_lock;
  if (!out_dir.empty() && launch.rank == 0) {
    output_lock = std::make_shared<OutputDirLock>(out_dir);
    for (const std::string& name : prepare_output_dir(out_dir, overwrite_output_dir, !resume.empty()))
      std::cerr << "memtune: --overwrite_output_dir: removed the previous run's "
                << (std::filesystem::path(out_dir) / name).string() << "\n";
  }
  // One rank's plan, as `memtune plan --world_size N` traces it, for the device it runs on;
  // held against --vram (per GPU), and on the CPU against the host's memory, before anything is
  // allocated.
  // Several ranks run on GPUs only (the communicator refuses CPU ranks after the budget check).
  const Device planned_device = launch.world_size > 1 ? Device::cuda : backend->device();
  const uint64_t budget_bytes = vram.empty() ? 0 : parse_bytes(vram);  // 0: no --vram
  // --attn_implementation auto on one GPU: the faster of the own kernel and cuDNN at this run's
  // shape, measured once and cached (several ranks keep the rule: each would measure on its own).
  // The context is measured again for the budget check below: the probe may create handles.
  if (attention_auto && launch.world_size == 1) {
    const std::string picked =
        resolve_auto_attention(*backend, run, model, budget_bytes, measured_context_reserve_bytes(*backend));
    if (!picked.empty()) std::cerr << "memtune: " << picked << "\n";
  }
  const Plan plan = plan_run(run, model, planned_device, launch.world_size);
  std::cerr << format_plan(plan, run, model);
  if (launch.world_size > 1) {
    RunConfig one_device = run;
    one_device.shard_base = false;
    std::cerr << format_rank_memory(plan_run(one_device, model), rank_memory(plan, launch.world_size, run.shard_base));
  }
  // The context as it is on this GPU once the backend's handles exist (+ the lazy-load margin).
  const uint64_t measured_context = measured_context_reserve_bytes(*backend);
  check_budget(plan, run, model, vram, measured_context, launch.world_size);
  // Without --vram a GPU run is held against the GPU's own size, with the advice --vram would give
  // there, instead of ending in cudaMalloc's abort.
  if (const uint64_t gpu_bytes = device_memory_total(*backend); vram.empty() && gpu_bytes > 0)
    refuse_over_budget(plan, run, model, gpu_bytes, fmt::format("this GPU ({} in all)", format_bytes(gpu_bytes)),
                       measured_context, launch.world_size);
  check_host_memory(plan, backend->device());
  const std::unique_ptr<Communicator> communicator = make_communicator(launch, backend->device());
  // --profile: the engine runs on a timing wrapper that the trainer switches on for the last step.
  std::optional<TimedBackend> profiler;
  if (profile) profiler.emplace(*backend);
  PlannedEngine engine(profiler ? static_cast<Backend&>(*profiler) : *backend, run, model, communicator.get());
  if (!source.checkpoint_dir.empty()) engine->load_base_checkpoint(source.checkpoint_dir);
  else engine->init_random_weights(run.seed);
  engine->init_adapters(run.seed + 1);
  if (!init_adapter.empty()) engine->load_adapter(init_adapter);
  TrainerOptions options;
  options.packing = packing;
  options.padding = padding_kind;
  options.pad_to_multiple_of = pad_to_multiple_of;
  options.max_seq_length = max_seq_length;
  options.padding_free = padding_free;
  options.group_by_length = group_by_length;
  options.merge_micro_batches = merge_micro_batches;
  options.data_seed = shuffle_seed;
  options.save_steps = save_steps;
  options.eval_steps = eval_steps;
  options.out_dir = out_dir;
  options.resume_from = resume;
  options.base_model_name = model.name.empty() ? run.model : model.name;
  options.train_data_name = data_path;
  options.eval_data_name = eval_name;
  options.metrics_path = metrics_path;
  options.planned_peak_bytes = plan.arena_bytes;
  options.budget_bytes = budget_bytes;
  options.profiler = profiler ? &*profiler : nullptr;
  options.quiet = quiet;
  options.overwrite_output_dir = overwrite_output_dir;
  options.save_total_limit = save_total_limit;
  options.logging_steps = logging_steps;
  options.step_health.max_skipped_steps_ratio = max_skipped_steps_ratio;
  options.step_health.allow_skipped_steps = allow_skipped_steps;
  options.base_checkpoint = source.checkpoint_dir.string();
  options.output_lock = output_lock;
  Trainer trainer(engine.engine(), data, has_eval ? &eval_data : nullptr, options, std::cout, std::cerr);
  return trainer.run().exit_code;
}

}  // namespace
}  // namespace memtune

int main(int argc, char** argv) {
  try {
    return memtune::run_cli(argc, argv);
  } catch (const memtune::Error& e) {
    std::fprintf(stderr, "memtune: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memtune: error: %s\n", e.what());
    return 2;
  }
}
