"""What the peers of `memtune ladder` share (bench/peer_hf.py, bench/peer_unsloth.py): package
versions, the model config, the child-process protocol, memory figures, the real-data batches
(the Llama 3 chat template through the real tokenizer, padded to the longest row or packed), the
timed training loop, and the longest-context bisection. Nothing here imports torch at module
level: the parents never touch CUDA.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as _md
import json
import math
import os
import random
import subprocess
import sys
import threading
import time

RESULT_MARK = "@@PEER_RUNG@@ "
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# The Llama 3 chat template and special tokens, as tokenizer_config.json of the Llama 3 tokenizer
# in ../shared/data/llama3-tokenizer/ has them (the same format memtune renders,
# src/memtune/data/chat_template.h). Used when no tokenizer_config.json lies beside the
# tokenizer.json given (the device carries only tokenizer.json, in .devbin/).
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_BOS = "<|begin_of_text|>"
LLAMA3_EOS = "<|eot_id|>"
# What Unsloth and TRL pad Llama 3.1 with (a reserved token that never appears in text).
LLAMA3_PAD = "<|finetune_right_pad_id|>"
LLAMA3_PAD_ID = 128004  # its id; Llama 3.0 tokenizers name it <|reserved_special_token_2|>


def version_of(name: str) -> str | None:
    try:
        return _md.version(name)
    except _md.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------
# Model config
# ---------------------------------------------------------------------------------------------
def config_file(path: str) -> str:
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def config_sha16(path: str) -> str:
    with open(config_file(path), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def load_model_config(path: str):
    from transformers import CONFIG_MAPPING

    path = config_file(path)
    with open(path) as f:
        data = json.load(f)
    model_type = data.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise SystemExit(f"{path}: model_type {model_type!r} is not a transformers config")
    data = {k: v for k, v in data.items() if k != "model_type"}
    return CONFIG_MAPPING[model_type](**data)


# ---------------------------------------------------------------------------------------------
# Errors and memory
# ---------------------------------------------------------------------------------------------
def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def record_failure(out: dict, exc: BaseException, on_cuda: bool) -> None:
    """One run's failure as its report: OOM by name, anything else with its first line."""
    import traceback

    if is_oom(exc):
        out["error"] = "CUDA out of memory" if on_cuda else "out of memory"
    else:
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        traceback.print_exc(file=sys.stderr)
    out["error_detail"] = str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__
    if on_cuda:
        try:
            import torch

            out["peak_allocated_bytes_before_failure"] = torch.cuda.max_memory_allocated()
            out["peak_reserved_bytes_before_failure"] = torch.cuda.max_memory_reserved()
        except Exception:  # noqa: BLE001
            pass
    out["measured"] = False


def cuda_context(out: dict) -> None:
    """Initialises CUDA and records the context's device bytes (before anything else)."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    out["context_bytes"] = total - free
    out["device_total_bytes"] = total
    out["device_name"] = torch.cuda.get_device_name()


def prepare_device(out: dict, args, torch, cpu_threads: int) -> bool:
    """A rung's device: on CUDA the context is measured and --cap-gib applied; on the CPU torch
    gets cpu_threads threads. False, with out["error"], where CUDA was asked for and is not there."""
    if args.device == "cuda":
        if not torch.cuda.is_available():
            out["error"] = "--device cuda but torch sees no GPU"
            return False
        cuda_context(out)
        apply_memory_cap(out, args.cap_gib)
    else:
        out["device_name"] = "cpu"
        torch.set_num_threads(max(1, cpu_threads))
    return True


def start_training_peak(out: dict, torch, on_cuda: bool, t_build: float):
    """Once the model is built: its build time and (CUDA) build peak into out, then the peak
    statistics reset and nvidia-smi sampling started (the sampler, or None on the CPU), so that
    the training peak is measured apart from the load's."""
    sampler = None
    if on_cuda:
        torch.cuda.synchronize()
        out["build_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        sampler = SmiSampler().start()
    out["build_seconds"] = time.perf_counter() - t_build
    return sampler


def apply_memory_cap(out: dict, cap_gib: float | None) -> None:
    """torch.cuda.set_per_process_memory_fraction(cap / total): the caching allocator refuses
    to grow past the cap (the CUDA context and library workspaces are outside it)."""
    if not cap_gib:
        return
    import torch

    total = torch.cuda.mem_get_info()[1]
    fraction = min(1.0, cap_gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    out["memory_cap"] = {"cap_gib": cap_gib, "fraction": fraction, "device_total_bytes": total,
                         "how": "torch.cuda.set_per_process_memory_fraction(cap / total): bounds torch's "
                                "caching allocator; the CUDA context is outside it"}


class SmiSampler:
    """nvidia-smi's memory.used of this process's GPU every interval_ms, in a background
    process; stop() returns the maximum in bytes (None when nvidia-smi is missing)."""

    def __init__(self, interval_ms: int = 100):
        self.interval_ms = interval_ms
        self.max_mib: int | None = None
        self.samples = 0
        self.proc = None
        self.thread = None

    def start(self) -> "SmiSampler":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", visible, "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                 "-lms", str(self.interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except (OSError, ValueError):
            self.proc = None
            return self

        def read():
            for line in self.proc.stdout:
                try:
                    value = int(line.strip().split()[0])
                except (ValueError, IndexError):
                    continue
                self.samples += 1
                self.max_mib = value if self.max_mib is None else max(self.max_mib, value)

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        time.sleep(self.interval_ms / 1000 * 2)  # one more sample after the last step
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.thread:
            self.thread.join(timeout=5)
        return None if self.max_mib is None else self.max_mib * 2**20


def memory_stats(out: dict, smi_peak_bytes: int | None = None, smi_samples: int = 0) -> None:
    """torch's peaks and the process-level device peak. device_peak_bytes is what nvidia-smi
    showed at the peak: the larger of (device in use at the end - pool now + pool at its largest)
    and nvidia-smi's maximum sampled since the model was built (when sampled)."""
    import torch

    torch.cuda.synchronize()
    out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    out["device_in_use_end_bytes"] = used
    from_pool = used - torch.cuda.memory_reserved() + torch.cuda.max_memory_reserved()
    out["device_peak_from_pool_bytes"] = from_pool
    out["device_peak_bytes"] = from_pool
    out["device_peak_source"] = "mem_get_info at the end - memory_reserved + max_memory_reserved"
    if smi_peak_bytes is not None:
        out["nvidia_smi_peak_bytes"] = smi_peak_bytes
        out["nvidia_smi_samples"] = smi_samples
        if smi_peak_bytes > from_pool:
            out["device_peak_bytes"] = smi_peak_bytes
            out["device_peak_source"] = "nvidia-smi memory.used, maximum sampled every 100 ms after the build"


# ---------------------------------------------------------------------------------------------
# Child processes
# ---------------------------------------------------------------------------------------------
def run_child(argv: list[str], timeout: float, base: dict, env: dict | None = None) -> dict:
    """Runs one configuration in a fresh process; its result is the line after RESULT_MARK."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    except subprocess.TimeoutExpired:
        return {**base, "measured": False, "error": f"timed out after {timeout:g} s",
                "wall_seconds": time.perf_counter() - t0}
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK):])
        elif line.strip():
            print(line, file=sys.stderr)
    if result is None:
        why = "killed by signal %d" % -proc.returncode if proc.returncode < 0 else f"exit code {proc.returncode}"
        result = {**base, "measured": False, "error": f"process died ({why}) without a result"}
    result["wall_seconds"] = time.perf_counter() - t0
    return result


def emit_result(result: dict) -> None:
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def write_atomic(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def print_table(report: dict) -> None:
    data_mode = any(r.get("data") for r in report["rungs"])
    head = ["rung", "ok", "tok/s"] + (["real tok/s", "target tok/s"] if data_mode else []) + \
           ["step s", "loss", "alloc GiB", "resv GiB", "device GiB", "note"]
    rows = [tuple(head)]
    for r in report["rungs"]:
        loss = r.get("loss")
        row = [r["name"], "yes" if r.get("measured") else "no",
               f"{r['tokens_per_second']:.0f}" if r.get("tokens_per_second") else "-"]
        if data_mode:
            row += [f"{r['real_tokens_per_second']:.0f}" if r.get("real_tokens_per_second") else "-",
                    f"{r['target_tokens_per_second']:.0f}" if r.get("target_tokens_per_second") else "-"]
        row += [f"{r['step_seconds']:.3f}" if r.get("step_seconds") else "-",
                f"{loss:.4f}" if isinstance(loss, float) else str(loss or "-"),
                gib(r.get("peak_allocated_bytes")), gib(r.get("peak_reserved_bytes")), gib(r.get("device_peak_bytes")),
                r.get("error", "") + (f" scaler skipped {r['loss_scaler']['skipped_steps']}, scale "
                                      f"{r['loss_scaler']['final_scale']:g}" if r.get("loss_scaler") else "")]
        rows.append(tuple(row))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    last = len(head) - 1
    print(f"peer: {report['peer']} | tool: {report.get('tool', '?')} | device: {report['device']}")
    for k, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) if i in (0, last) else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))
    mc = report.get("max_context")
    if mc:
        print(f"max context at {mc['cap_gib']:g} GiB cap: {mc.get('max_seq') or 'none'} tokens"
              + (f", {mc['run']['tokens_per_second']:.0f} tok/s" if mc.get("run", {}).get("tokens_per_second") else ""))


# ---------------------------------------------------------------------------------------------
# Real data: the Llama 3 chat template, assistant-only labels, padded or packed batches
# ---------------------------------------------------------------------------------------------
def load_chat_tokenizer(tokenizer_json: str):
    """transformers' PreTrainedTokenizerFast from tokenizer.json, with the chat template and
    bos/eos of the tokenizer_config.json beside it (else the Llama 3 ones above)."""
    from transformers import PreTrainedTokenizerFast

    cfg = {}
    side = os.path.join(os.path.dirname(os.path.abspath(tokenizer_json)), "tokenizer_config.json")
    if os.path.isfile(side):
        with open(side) as f:
            cfg = json.load(f)

    def token_text(value, default):
        if isinstance(value, dict):
            value = value.get("content")
        return value or default

    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json,
                                  bos_token=token_text(cfg.get("bos_token"), LLAMA3_BOS),
                                  eos_token=token_text(cfg.get("eos_token"), LLAMA3_EOS),
                                  chat_template=cfg.get("chat_template") or LLAMA3_CHAT_TEMPLATE)
    tok.chat_template_source = side if cfg.get("chat_template") else "bench/peer_common.py LLAMA3_CHAT_TEMPLATE"
    vocab = tok.get_vocab()
    pad = vocab.get(LLAMA3_PAD)
    if pad is None and len(tok) > LLAMA3_PAD_ID:  # the same id under its older reserved name
        name = tok.convert_ids_to_tokens(LLAMA3_PAD_ID)
        pad = LLAMA3_PAD_ID if isinstance(name, str) and name.startswith("<|reserved_special_token") else None
    tok.peer_pad_id = pad if pad is not None else tok.convert_tokens_to_ids(tok.eos_token)
    return tok


def encode_messages(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation: the chat template rendered, tokenized without
    added specials (the template has the bos), and labels = ids on each assistant message's
    content and its closing <|eot_id|>, -100 elsewhere: memtune's assistant_only_loss
    (src/memtune/data/chat_template.h). The spans come from the rendered prefixes: an assistant
    turn's trained text runs from the end of render(messages[:k], add_generation_prompt=True)
    to the end of render(messages[:k+1])."""
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    spans = []
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        start = len(tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)) if k else 0
        end = len(tok.apply_chat_template(messages[:k + 1], tokenize=False))
        if not text.startswith(tok.apply_chat_template(messages[:k + 1], tokenize=False)):
            raise ValueError("the chat template is not prefix-consistent: cannot find the assistant spans")
        spans.append((start, end))
    labels = []
    for tid, (a, _b) in zip(ids, offsets):
        labels.append(tid if any(s <= a < e for s, e in spans) else -100)
    return ids, labels


def read_sft_jsonl(path: str, tok, max_seq: int, repeat: int = 1) -> tuple[list[dict], dict]:
    """The samples of a {"messages": [...]} JSONL file (each line once, then the list repeated),
    truncated to max_seq (keep the start, as TRL), those with no trained target dropped."""
    base, truncated, skipped = [], 0, 0
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" not in row:
                raise SystemExit(f"{path}:{line_no}: expected {{\"messages\": [...]}}")
            ids, labels = encode_messages(tok, row["messages"])
            if len(ids) > max_seq:
                ids, labels = ids[:max_seq], labels[:max_seq]
                truncated += 1
            if not any(x != -100 for x in labels[1:]):
                skipped += 1
                continue
            base.append({"input_ids": ids, "labels": labels})
    if not base:
        raise SystemExit(f"{path}: no sample with a trained target")
    samples = base * max(1, repeat)
    lengths = [len(s["input_ids"]) for s in base]
    stats = {"file": os.path.relpath(os.path.abspath(path), REPO), "lines_used": len(base), "repeat": repeat,
             "samples": len(samples), "truncated": truncated, "skipped_no_target": skipped,
             "mean_tokens": sum(lengths) / len(lengths), "max_tokens": max(lengths),
             "targets_per_sample": sum(sum(1 for x in s["labels"][1:] if x != -100) for s in base) / len(base)}
    return samples, stats


def pack_bfd(samples: list[dict], seq: int) -> list[list[int]]:
    """Best-fit decreasing, as TRL's packing_strategy "bfd" and memtune's
    pack_best_fit_decreasing (src/memtune/data/packing.h): longest first (ties in order), each
    into the open row with the least room that still fits it, else a new row; rows in the order
    they were opened. Returns sample indices per row."""
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]["input_ids"]), i))
    rows, room = [], []
    for i in order:
        n = len(samples[i]["input_ids"])
        best = None
        for r, left in enumerate(room):
            if left >= n and (best is None or left < room[best]):
                best = r
        if best is None:
            rows.append([i])
            room.append(seq - n)
        else:
            rows[best].append(i)
            room[best] -= n
    return rows


def _row_of(samples: list[dict], indices: list[int]) -> tuple[list[int], list[int], list[int]]:
    ids, labels, pos = [], [], []
    for i in indices:
        s = samples[i]
        n = len(s["input_ids"])
        ids += s["input_ids"]
        lab = list(s["labels"])
        lab[0] = -100  # no target crosses from the previous sample into this one
        labels += lab
        pos += list(range(n))
    return ids, labels, pos


def data_batches(samples: list[dict], *, steps: int, accum: int, batch: int, seq: int, packing: bool,
                 pad_id: int, seed: int, flatten: bool = False) -> list[list[dict]]:
    """steps x accum micro-batches of `batch` rows, each micro-batch padded (right) to its
    longest row, as transformers' DataCollatorForSeq2Seq and TRL's collator pad. Unpacked: a row
    is one sample, with attention_mask. Packed: a row is several whole samples (best-fit
    decreasing), position_ids restarting at 0 per sample, no attention_mask: transformers then
    builds a block-diagonal causal mask from the position_ids (masking_utils
    find_packed_sequence_indices), so no sample attends to another; the padding is a segment of
    its own (positions from 0), its labels -100. Rows (or samples) are shuffled with the seed,
    reshuffled each pass over the data.

    flatten (with packing): TRL's padding-free layout instead, as Unsloth's own packing collator
    builds it: the micro-batch's packed rows laid end to end in ONE row [1, total] with no
    padding at all, position_ids restarting per sample, and "packed_seq_lengths" (int32, one
    length per sample), from which Unsloth's attention takes the sample boundaries."""
    import torch

    units = pack_bfd(samples, seq) if packing else [[i] for i in range(len(samples))]
    rng = random.Random(seed)
    order, cursor = [], 0
    out = []
    for _step in range(steps):
        micro = []
        for _m in range(accum):
            rows = []
            for _b in range(batch):
                if cursor >= len(order):
                    order = list(range(len(units)))
                    rng.shuffle(order)
                    cursor = 0
                rows.append(_row_of(samples, units[order[cursor]]) + ([len(samples[i]["input_ids"])
                                                                     for i in units[order[cursor]]],))
                cursor += 1
            if packing and flatten:
                ids = torch.tensor([sum((r[0] for r in rows), [])], dtype=torch.long)
                labels = torch.tensor([sum((r[1] for r in rows), [])], dtype=torch.long)
                pos = torch.tensor([sum((r[2] for r in rows), [])], dtype=torch.long)
                lengths = torch.tensor(sum((r[3] for r in rows), []), dtype=torch.int32)
                n = int(ids.shape[1])
                micro.append({"input_ids": ids, "labels": labels, "position_ids": pos, "packed_seq_lengths": lengths,
                              "tokens": n, "real_tokens": n, "target_tokens": int((labels[:, 1:] != -100).sum())})
                continue
            longest = max(len(r[0]) for r in rows)
            ids = torch.full((batch, longest), pad_id, dtype=torch.long)
            labels = torch.full((batch, longest), -100, dtype=torch.long)
            pos = torch.zeros((batch, longest), dtype=torch.long)
            mask = torch.zeros((batch, longest), dtype=torch.long)
            real = 0
            for b, (i, lab, p, _lengths) in enumerate(rows):
                n = len(i)
                ids[b, :n] = torch.tensor(i)
                labels[b, :n] = torch.tensor(lab)
                pos[b, :n] = torch.tensor(p)
                pos[b, n:] = torch.arange(longest - n)
                mask[b, :n] = 1
                real += n
            mb = {"input_ids": ids, "labels": labels, "tokens": batch * longest, "real_tokens": real,
                  "target_tokens": int((labels[:, 1:] != -100).sum())}
            if packing:
                mb["position_ids"] = pos
            else:
                mb["attention_mask"] = mask
            micro.append(mb)
        out.append(micro)
    return out


def synthetic_batches(*, steps: int, accum: int, batch: int, seq: int, vocab: int, seed: int) -> list[list[dict]]:
    """Uniform random ids in [0, vocab), labels = input_ids (HF shifts inside), no mask."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (steps, accum, batch, seq), generator=gen, dtype=torch.long)
    return [[{"input_ids": data[s, m], "labels": data[s, m], "tokens": batch * seq, "real_tokens": batch * seq,
              "target_tokens": batch * (seq - 1)} for m in range(accum)] for s in range(steps)]


def describe_batches(batches: list[list[dict]]) -> dict:
    micro = [mb for step in batches for mb in step]
    return {"micro_batches": len(micro), "padded_tokens": sum(m["tokens"] for m in micro),
            "real_tokens": sum(m["real_tokens"] for m in micro),
            "target_tokens": sum(m["target_tokens"] for m in micro),
            "row_lengths": sorted({int(m["input_ids"].shape[1]) for m in micro})[:8]}


# ---------------------------------------------------------------------------------------------
# The timed loop (what transformers' Trainer does per optimizer step, without its overhead)
# ---------------------------------------------------------------------------------------------
def train_steps(model, trainable, opt, batches, *, device, autocast_dtype=None, attention_ctx=None,
                scaler=None, max_grad_norm=1.0, label="", normalise_by_targets=False) -> dict:
    """Runs the optimizer steps over `batches` (steps x micro-batches). The first step is not
    timed unless it is the only one; torch.cuda.synchronize() around each step.

    normalise_by_targets: pass num_items_in_batch = the step's trained targets (what Trainer does
    since transformers 4.46, so the loss is the mean over the step's targets across micro-batches);
    a forward that does not take it falls back to the micro-batch mean / accumulation. Otherwise
    (synthetic rows, where every micro-batch has the same targets) the micro-batch mean /
    accumulation."""
    from contextlib import nullcontext

    import torch

    on_cuda = device.type == "cuda"

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    def autocast():
        return torch.autocast(device_type=device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()

    attn = attention_ctx or nullcontext
    info = {"loss_normalisation": "num_items_in_batch (the step's trained targets)" if normalise_by_targets
            else "micro-batch mean / accumulation"}
    use_items = normalise_by_targets
    timed = 0.0
    timed_steps = 0
    sums = {"tokens": 0, "real_tokens": 0, "target_tokens": 0}
    loss_value, skipped = float("nan"), 0
    n = len(batches)

    def one_step(micro):
        nonlocal use_items
        step_loss = 0.0
        accum = len(micro)
        items = sum(mb["target_tokens"] for mb in micro)
        for mb in micro:
            kwargs = {k: mb[k].to(device, non_blocking=True) for k in ("input_ids", "labels", "attention_mask",
                                                                        "position_ids", "packed_seq_lengths")
                      if k in mb}
            # The SDPA backend choice is thread-local state that non-reentrant checkpointing does
            # not record: keep the backward (which recomputes the forward) inside it too.
            with attn():
                with autocast():
                    if use_items:
                        try:
                            loss = model(**kwargs, use_cache=False,
                                         num_items_in_batch=torch.tensor(items, device=device)).loss
                        except TypeError as exc:
                            if "num_items_in_batch" not in str(exc):
                                raise
                            use_items = False
                            info["loss_normalisation"] = ("micro-batch mean / accumulation (the forward "
                                                          "refused num_items_in_batch)")
                            loss = model(**kwargs, use_cache=False).loss
                    else:
                        loss = model(**kwargs, use_cache=False).loss
                if use_items:
                    step_loss += loss.detach()
                else:
                    step_loss += loss.detach() / accum
                    loss = loss / accum
                (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
        scale_before = None
        if scaler:
            scale_before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return step_loss, scale_before

    for step, micro in enumerate(batches):
        sync()
        t0 = time.perf_counter()
        step_loss, scale_before = one_step(micro)
        sync()
        seconds = time.perf_counter() - t0
        if scaler and scaler.get_scale() < scale_before:
            skipped += 1
        loss_value = float(step_loss)
        if step > 0 or n == 1:
            timed += seconds
            timed_steps += 1
            for k in sums:
                sums[k] += sum(mb[k] for mb in micro)
        print(f"  [{label}] step {step + 1}/{n} loss {loss_value:.4f} {seconds:.2f} s", file=sys.stderr, flush=True)
    # PEER_PROFILE=1: one more step (the last batch again, after the timed ones) under
    # torch.profiler, its kernels by GPU time: where the peer's step goes, beside memtune's
    # `train --profile` table (bench/NOTES.md).
    profile = None
    if os.environ.get("PEER_PROFILE") == "1" and on_cuda and batches:
        try:
            from torch.profiler import ProfilerActivity, profile as torch_profile
            sync()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                one_step(batches[-1])
                sync()
            events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
            total_us = sum(e.self_device_time_total for e in events)
            profile = {"total_kernel_ms": total_us / 1e3,
                       "kernels": [{"name": e.key[:120], "calls": e.count, "ms": e.self_device_time_total / 1e3}
                                   for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:40]]}
            print(f"  [{label}] profile of one step: {profile['total_kernel_ms']:.1f} ms of kernels; the top:",
                  file=sys.stderr)
            for k in profile["kernels"][:25]:
                print(f"    {k['ms']:9.2f} ms {k['calls']:6d}x  {k['name']}", file=sys.stderr)
        except Exception as exc:  # a profile is an extra; the measured steps stand without it
            print(f"  [{label}] profile failed: {exc!r}", file=sys.stderr)
    result = {"step_seconds": timed / timed_steps, "tokens_per_second": sums["tokens"] / timed,
              "real_tokens_per_second": sums["real_tokens"] / timed,
              "target_tokens_per_second": sums["target_tokens"] / timed,
              "timed_steps": timed_steps, "timed_tokens": sums,
              "loss": loss_value if math.isfinite(loss_value) else str(loss_value), **info}
    if scaler:
        result["loss_scaler"] = {"skipped_steps": skipped, "final_scale": float(scaler.get_scale())}
    if profile:
        result["profile"] = profile
    return result


# ---------------------------------------------------------------------------------------------
# Longest context: bisection over lengths, one child each
# ---------------------------------------------------------------------------------------------
def bisect_max_context(probe, lo: int, hi: int, unit: int) -> tuple[int | None, list[dict]]:
    """The longest multiple of `unit` in [lo, hi] for which probe(seq) -> dict says
    "fits": True, assuming that fitting is monotone in the length. lo - unit counts as fitting
    and hi + unit as not, so about log2((hi - lo) / unit + 2) probes run. Returns (the length or
    None, the probes in order)."""
    good, bad = lo // unit - 1, hi // unit + 1
    probes = []
    while bad - good > 1:
        mid = (good + bad) // 2
        result = probe(mid * unit)
        probes.append(result)
        if result.get("fits"):
            good = mid
        else:
            bad = mid
    return (good * unit if good >= max(1, lo // unit) else None), probes


def run_max_context(args, report: dict, probe, model_config) -> dict:
    """The --max-context mode of either peer: bisection over multiples of --context-unit in
    [--context-min, --context-max] at batch 1 under --cap-gib, each length in its own child
    running --context-steps timed steps + 1 untimed (probe(seq, steps) -> the child's result).
    A length fits when all of them ran: the optimizer's state is allocated in the first step, so a
    one-step probe can pass at a length whose second step runs out of memory. The longest
    fitting probe is the timed run (no second process at that length)."""
    steps = args.context_steps + 1
    runs: dict[int, dict] = {}

    def fits(seq: int) -> dict:
        result = probe(seq, steps)
        runs[seq] = result
        return {"seq": seq, "fits": bool(result.get("measured")), "error": result.get("error"),
                "peak_reserved_bytes": result.get("peak_reserved_bytes"),
                "device_peak_bytes": result.get("device_peak_bytes"), "wall_seconds": result.get("wall_seconds")}

    found, probes = bisect_max_context(fits, args.context_min, args.context_max, args.context_unit)
    mc = {"cap_gib": args.cap_gib, "unit": args.context_unit, "range": [args.context_min, args.context_max],
          "probe_steps": steps, "probes": probes, "max_seq": found,
          "max_position_embeddings": getattr(model_config, "max_position_embeddings", None),
          "rule": "longest multiple of unit whose probe ran all its steps, context_steps timed + 1 untimed "
                  "(bisection: assumes fitting is monotone in the length); that probe is the timed run"}
    report["max_context"] = mc
    if found:  # the bisection returns only lengths that it probed
        run = runs[found]
        mc["run"] = {k: run.get(k) for k in ("measured", "error", "tokens_per_second", "step_seconds",
                                               "device_peak_bytes", "peak_reserved_bytes", "timed_steps")}
        report["rungs"].append(run)
    if args.out:
        write_atomic(args.out, report)
    return report


# ---------------------------------------------------------------------------------------------
# The parent of either peer: one child process a rung (or a probe)
# ---------------------------------------------------------------------------------------------
def child_argv(script: str, args, index: int, extra: list[str] | None = None) -> list[str]:
    """The parent's own arguments (the child reads the same configuration), then the rung."""
    return [sys.executable, os.path.abspath(script)] + args.raw_argv + ["--one-rung", str(index)] + (extra or [])


def note_device(report: dict, result: dict, name_device: bool = True) -> None:
    """The device the first child saw, and the CUDA context bytes it measured, into the report;
    name_device False keeps the report's own device name (a CPU run of bench/peer_hf.py)."""
    if result.get("device_name") and name_device:
        report["device"] = result["device_name"]
    if "context_bytes" in result and "device_context_bytes" not in report:
        report["device_context_bytes"] = result["context_bytes"]


def context_rung(args, rungs: list[dict], seq: int) -> tuple[dict, int]:
    """--max-context: the rung named by --context-rung at batch 1 and length seq, and its index."""
    keys = [r["added"] or "baseline" for r in rungs]
    if args.context_rung not in keys:
        raise SystemExit(f"--context-rung {args.context_rung}: not a rung of --order ({','.join(keys)})")
    index = keys.index(args.context_rung)
    rung = dict(rungs[index], batch=1, accum=1, seq=seq)
    rung["name"] = f"max context ({rung['name']}), batch 1, seq {seq}"
    rung["added"] = "max_context"
    return rung, index


def search_max_context(args, report: dict, *, script: str, tool: str, rungs: list[dict], rung_base,
                       env: dict | None = None, name_device: bool = True) -> dict:
    """run_max_context with each probe in a child of `script` (its messages prefixed by `tool`)."""
    _, index = context_rung(args, rungs, args.context_min)

    def probe(seq: int, steps: int) -> dict:
        rung, _ = context_rung(args, rungs, seq)
        print(f"{tool}: max-context probe seq {seq} ({steps} steps)", file=sys.stderr, flush=True)
        result = run_child(child_argv(script, args, index, ["--context-seq", str(seq), "--steps", str(steps)]),
                           args.probe_timeout, rung_base(rung), env=env)
        note_device(report, result, name_device)
        return result

    report = run_max_context(args, report, probe, load_model_config(args.config))
    report["max_context"]["context_rung"] = args.context_rung
    return report


def measurement_config(args, script: str) -> dict:
    """The end of a report's "config": packing, the memory cap, what is timed and counted, and the
    command that ran (`script` with its arguments)."""
    return {
        "packing": args.packing if args.data else None,
        "memory_cap_gib": args.cap_gib or None,
        "timing": "optimizer steps after the first; torch.cuda.synchronize() around each",
        "tokens_per_second": "padded tokens (batch x the micro-batch's row length, summed) per second; "
                             "real_tokens_per_second: non-padding tokens; target_tokens_per_second: trained targets",
        "command": [os.path.relpath(os.path.abspath(script))] + args.raw_argv,
    }


def finish_report(args, report: dict) -> int:
    """The report written to --out (atomically) and printed as a table; the exit status."""
    if args.out:
        write_atomic(args.out, report)
    print_table(report)
    if args.out:
        print(f"wrote {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------
# Options both peers take
# ---------------------------------------------------------------------------------------------
def add_ladder_args(p) -> None:
    """The run's shape, the optimizer and LoRA, as both peers name them (after memtune's)."""
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per rung; the first is not timed")
    p.add_argument("--batch", type=int, default=2, help="per-device micro-batch")
    p.add_argument("--accum", type=int, default=8, help="gradient accumulation steps")
    p.add_argument("--seq", type=int, default=2048)


def add_optimizer_args(p) -> None:
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--init-scale", type=float, default=2.0**16, help="GradScaler initial scale (fp16 rungs)")


def parse_peer_args(p, argv, tricks: list[str]):
    """Adds the shared options to `p`, parses argv (None: sys.argv) and checks what both peers
    take; args.order and args.only come back as lists (the caller checks --only's names)."""
    add_shared_args(p)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    args.raw_argv = raw
    check_shared_args(p, args)
    args.order = [t for t in args.order.split(",") if t]
    for t in args.order:
        if t not in tricks:
            p.error(f"--order: unknown trick '{t}' (known: {','.join(tricks)})")
    if min(args.steps, args.batch, args.accum, args.seq) < 1:
        p.error("--steps, --batch, --accum and --seq must be >= 1")
    args.only = [t for t in args.only.split(",") if t]
    return args


def add_shared_args(p) -> None:
    """--data/--tokenizer/--packing/--repeat, --max-context/--cap-gib and the bisection's knobs,
    --vocab-size: the same names and meaning in bench/peer_hf.py and bench/peer_unsloth.py."""
    g = p.add_argument_group("real data (instead of uniform random ids)")
    g.add_argument("--data", default="", help="JSONL of {\"messages\": [...]} (e.g. examples/sft-tasks.jsonl)")
    g.add_argument("--tokenizer", default="", help="tokenizer.json (a tokenizer_config.json beside it gives the chat "
                   "template and bos/eos; else the Llama 3 ones)")
    g.add_argument("--packing", action="store_true", help="pack samples into rows of --seq (best-fit decreasing), "
                   "position_ids restarting per sample")
    g.add_argument("--repeat", type=int, default=1, help="repeat the file's samples this many times")
    g.add_argument("--vocab-size", type=int, default=0, help="override the config's vocab_size (e.g. the tiny "
                   "preset with the Llama 3 tokenizer: 128256)")
    g = p.add_argument_group("longest context (batch 1, bisection over lengths, one child each)")
    g.add_argument("--max-context", action="store_true", help="find the longest trainable length under --cap-gib")
    g.add_argument("--cap-gib", type=float, default=0.0, help="torch.cuda.set_per_process_memory_fraction(cap / "
                   "total) in every child (0: none)")
    g.add_argument("--context-min", type=int, default=1024, help="shortest length tried")
    g.add_argument("--context-max", type=int, default=262144, help="longest length tried")
    g.add_argument("--context-unit", type=int, default=1024, help="lengths are multiples of this")
    g.add_argument("--context-steps", type=int, default=2, help="timed steps of each probe (+1 untimed; 0: "
                   "one step, timed with its warm-up)")
    g.add_argument("--probe-timeout", type=float, default=600, help="seconds before a probe's process is killed")
    g.add_argument("--context-seq", type=int, default=0, help=argparse_suppress())


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def check_shared_args(p, args) -> None:
    if args.data and not args.tokenizer:
        p.error("--data needs --tokenizer (tokenizer.json)")
    if args.data and not os.path.isfile(args.data):
        p.error(f"--data {args.data}: no such file")
    if args.tokenizer and not os.path.isfile(args.tokenizer):
        p.error(f"--tokenizer {args.tokenizer}: no such file")
    if args.packing and not args.data:
        p.error("--packing needs --data")
    if args.max_context and args.context_unit < 1:
        p.error("--context-unit must be >= 1")
    if args.max_context and args.context_steps < 0:
        p.error("--context-steps must be >= 0 (0: one step, timed with its warm-up)")
    if args.max_context and not (0 < args.context_min <= args.context_max):
        p.error("--context-min must be in (0, --context-max]")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
