#!/usr/bin/env python3
"""The Unsloth peer for `memtune ladder`: Unsloth's own path (FastLanguageModel.from_pretrained on
a random-weight model folder, FastLanguageModel.get_peft_model with use_gradient_checkpointing=
"unsloth"), timed by the same loop and rules as bench/peer_hf.py, JSON in the same schema.

    python3 bench/peer_unsloth.py --out unsloth.json                    # 16-bit LoRA + QLoRA rungs, 8B shape
    python3 bench/peer_unsloth.py --only qlora --batch 2 --accum 4 --lora-r 32 --lora-alpha 32 \\
        --data examples/sft-tasks.jsonl --repeat 30 --tokenizer .devbin/tokenizer.json   # Unsloth's shape
    python3 bench/peer_unsloth.py --max-context --cap-gib 24            # longest context, QLoRA, batch 1

First a child writes the model folder (--model-dir; reused while its marker matches): the
preset's config through transformers, bf16, random init on the GPU, save_pretrained, with a
tokenizer whose vocabulary matches (the Llama 3 tokenizer.json when one is given or found in
.devbin/ or ../shared/data/llama3-tokenizer/, else a word-level one of vocab_size made with the
tokenizers package). Then each rung runs in its own child (a fresh CUDA context and peak); an OOM
is reported {"measured": false, "error": "CUDA out of memory"} and the next rung goes on.

Rungs (memtune's ladder names, so `memtune report --peer` matches them by "added"): flash (16-bit
LoRA: bf16 weights; Unsloth always checkpoints and picks its own attention), qlora (load_in_4bit),
micro_batch, seq_halved. The baseline, bf16 and gradient_checkpointing rungs have no Unsloth
equivalent (it always runs bf16/fp16 with its checkpointing) and are listed as not run; chunked_loss
is listed as not run too (Unsloth's fused cross entropy is on in every rung).

The child sets HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE and
UNSLOTH_DISABLE_STATISTICS (else every from_pretrained tries the network) and points
UNSLOTH_COMPILE_LOCATION at a temporary folder, before `import unsloth`, which comes before
transformers is imported. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from peer_common import (LLAMA3_BOS, LLAMA3_CHAT_TEMPLATE, LLAMA3_EOS, REPO, TARGET_MODULES,  # noqa: E402
                         config_sha16,
                         data_batches, describe_batches, emit_result, load_chat_tokenizer,
                         load_model_config, memory_stats, read_sft_jsonl, record_failure, run_child,
                         synthetic_batches, train_steps, version_of, write_atomic,
                         add_ladder_args, add_optimizer_args, parse_peer_args, prepare_device, start_training_peak, measurement_config, child_argv, context_rung, finish_report, note_device,
                         search_max_context)
from peer_hf import DEFAULT_CONFIG, TRICKS, plan_rungs, rung_base  # noqa: E402  (imports no torch)

RUN_KEYS = ["flash", "qlora", "micro_batch", "seq_halved"]
NOT_UNSLOTH = {
    "baseline": "no Unsloth equivalent: Unsloth always trains with its gradient checkpointing and its attention",
    "bf16": "no Unsloth equivalent: Unsloth always trains with its gradient checkpointing and its attention",
    "gradient_checkpointing": "no Unsloth equivalent: Unsloth picks its own attention (SDPA here)",
    "chunked_loss": "not run: Unsloth's fused cross entropy (chunked, no full fp32 logits) is on in every rung",
}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "UNSLOTH_DISABLE_STATISTICS": "1"}
MARKER = "peer_random_model.json"


def set_unsloth_env() -> None:
    """Before `import unsloth`: offline, no statistics, compiled modules in a temporary folder."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    if not os.environ.get("UNSLOTH_COMPILE_LOCATION"):
        os.environ["UNSLOTH_COMPILE_LOCATION"] = tempfile.mkdtemp(prefix="unsloth_compiled_")


def unsloth_versions() -> str:
    names = ["unsloth", "unsloth_zoo", "transformers", "peft", "trl", "torch", "bitsandbytes", "triton"]
    return ", ".join(f"{n} {version_of(n) or 'none'}" for n in names)


# ---------------------------------------------------------------------------------------------
# The random-weight model folder
# ---------------------------------------------------------------------------------------------
def find_tokenizer(args, vocab_size: int) -> str | None:
    """--tokenizer, else the Llama 3 tokenizer.json in .devbin/ (prepare-devbin copies it there) or
    ../shared/data/llama3-tokenizer/, when its vocabulary is the model's."""
    if args.tokenizer:
        return args.tokenizer
    for path in (os.path.join(REPO, ".devbin", "tokenizer.json"),
                 os.path.join(REPO, "..", "shared", "data", "llama3-tokenizer", "tokenizer.json")):
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    data = json.load(f)
                n = max([v for v in data["model"]["vocab"].values()] + [t["id"] for t in data.get("added_tokens", [])]) + 1
            except (OSError, ValueError, KeyError):
                continue
            if n == vocab_size:
                return path
    return None


def synthetic_tokenizer(cfg):
    """A word-level tokenizer with exactly vocab_size ids ("<t{i}>"), the bos/eos ids named as
    Llama 3 names them, so Unsloth's tokenizer checks see a vocabulary that matches the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(cfg.vocab_size)}
    names = {}
    bos = cfg.bos_token_id if isinstance(cfg.bos_token_id, int) else None
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    for tid, name in ((bos, LLAMA3_BOS), (eos, LLAMA3_EOS)):
        if isinstance(tid, int) and 0 <= tid < cfg.vocab_size:
            del vocab[f"<t{tid}>"]
            vocab[name] = tid
            names[tid] = name
    pad_id = cfg.vocab_size - 1 if cfg.vocab_size - 1 not in names else cfg.vocab_size - 2
    pad = f"<t{pad_id}>"
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=names.get(bos, "<t1>"),
                                   eos_token=names.get(eos, "<t2>"), pad_token=pad, unk_token="<t0>",
                                   chat_template=LLAMA3_CHAT_TEMPLATE)


def model_marker(args, cfg, tokenizer_path: str | None) -> dict:
    return {"config_sha256_16": config_sha16(args.config), "vocab_size": cfg.vocab_size, "seed": args.seed,
            "tokenizer": os.path.abspath(tokenizer_path) if tokenizer_path else "synthetic word-level",
            "dtype": "bfloat16", "written_by": "bench/peer_unsloth.py"}


def write_model(args) -> dict:
    """The child that writes --model-dir: random bf16 weights made on the GPU, save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {"name": "write model folder", "added": "write_model", "measured": False}
    cfg = load_model_config(args.config)
    if args.vocab_size:
        cfg.vocab_size = args.vocab_size
    tokenizer_path = find_tokenizer(args, cfg.vocab_size)
    marker = model_marker(args, cfg, tokenizer_path)
    try:
        t0 = time.perf_counter()
        device = torch.device(args.device)
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        tok = load_chat_tokenizer(tokenizer_path) if tokenizer_path else synthetic_tokenizer(cfg)
        if tok.pad_token is None:
            tok.pad_token = tok.convert_ids_to_tokens(tok.peer_pad_id)
        if len(tok) > cfg.vocab_size:
            raise ValueError(f"tokenizer {tokenizer_path}: {len(tok)} ids > vocab_size {cfg.vocab_size}")
        tmp = args.model_dir.rstrip("/") + f".tmp.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.generation_config.do_sample = False
        model.save_pretrained(tmp, max_shard_size="5GB")
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f, indent=1)
        shutil.rmtree(args.model_dir, ignore_errors=True)
        os.replace(tmp, args.model_dir)
        out.update(measured=True, seconds=time.perf_counter() - t0, tokenizer=marker["tokenizer"],
                   parameters=sum(p.numel() for p in model.parameters()))
    except Exception as exc:  # noqa: BLE001
        record_failure(out, exc, args.device == "cuda")
    return out


def ensure_model(args) -> dict:
    cfg = load_model_config(args.config)
    if args.vocab_size:
        cfg.vocab_size = args.vocab_size
    want = model_marker(args, cfg, find_tokenizer(args, cfg.vocab_size))
    try:
        with open(os.path.join(args.model_dir, MARKER)) as f:
            if json.load(f) == want:
                return {"measured": True, "reused": True, "folder": args.model_dir, "tokenizer": want["tokenizer"]}
    except (OSError, ValueError):
        pass
    print(f"peer_unsloth: writing the random-weight model folder {args.model_dir}", file=sys.stderr, flush=True)
    argv = [sys.executable, os.path.abspath(__file__)] + args.raw_argv + ["--write-model"]
    result = run_child(argv, args.rung_timeout, {"name": "write model folder", "added": "write_model"})
    result["folder"] = args.model_dir
    return result


# ---------------------------------------------------------------------------------------------
# One rung, in its own process
# ---------------------------------------------------------------------------------------------
def model_facts(model) -> dict:
    """What Unsloth built: where the embeddings live, the 4-bit config, the attention."""
    facts = {}
    try:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        facts["attn_implementation"] = getattr(base.config, "_attn_implementation", None)
        emb = base.get_input_embeddings()
        facts["input_embeddings"] = f"{type(emb).__name__} {emb.weight.dtype} on {emb.weight.device}"
        head = base.get_output_embeddings()
        facts["lm_head"] = f"{type(head).__name__} {head.weight.dtype} on {head.weight.device}"
        q = getattr(base.config, "quantization_config", None)
        if q is not None:
            q = q.to_dict() if hasattr(q, "to_dict") else q
            facts["quantization_config"] = {k: str(v) for k, v in dict(q).items()
                                            if k.startswith(("bnb_4bit", "load_in", "quant_method"))}
        kinds = {}
        for _name, module in base.named_modules():
            kind = f"{type(module).__module__.split('.')[0]}.{type(module).__name__}"
            kinds[kind] = kinds.get(kind, 0) + 1
        facts["linear_kinds"] = {k: v for k, v in kinds.items() if "Linear" in k or "lora" in k.lower()}
    except Exception as exc:  # noqa: BLE001  facts are a nicety, never the rung's failure
        facts["error"] = f"{type(exc).__name__}: {exc}"[:200]
    for name in ("xformers", "flash_attn"):
        facts[f"{name}_installed"] = version_of(name.replace("_", "-")) or version_of(name)
    return facts


def run_one_rung(args, rung: dict) -> dict:
    set_unsloth_env()
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)
    out = rung_base(rung)
    settings = {k: rung[k] for k in ("precision", "attention", "checkpointing", "loss", "batch", "accum", "seq")}
    settings.update(qlora=rung["qlora"], load_in_4bit=rung["qlora"], use_gradient_checkpointing="unsloth",
                    loss_used="Unsloth's fused cross entropy", unsloth_compile_location=os.environ[
                        "UNSLOTH_COMPILE_LOCATION"])
    out["settings"] = settings
    on_cuda = args.device == "cuda"
    # On the CPU, Unsloth's own fallback (16-bit LoRA): a check of this code path, not a benchmark.
    if not prepare_device(out, args, torch, os.cpu_count() or 1):
        return out
    device = torch.device(args.device)
    dtype = torch.bfloat16 if rung["precision"] == "bf16" else torch.float16
    settings["precision_used"] = f"{str(dtype).replace('torch.', '')} weights, autocast (as Trainer's bf16/fp16)" + \
        (", GradScaler" if dtype == torch.float16 else "")
    try:
        t_build = time.perf_counter()
        import unsloth  # noqa: F401  before transformers, as Unsloth asks
        from unsloth import FastLanguageModel

        if args.data:
            tok = load_chat_tokenizer(args.tokenizer)
            samples, data_stats = read_sft_jsonl(args.data, tok, rung["seq"], args.repeat)
            batches = data_batches(samples, steps=args.steps, accum=rung["accum"], batch=rung["batch"],
                                   seq=rung["seq"], packing=args.packing, pad_id=tok.peer_pad_id, seed=args.seed,
                                   flatten=True)
            out["data"] = {**data_stats, "packing": args.packing, "pad_id": tok.peer_pad_id,
                           "layout": ("padding-free: each micro-batch's packed rows in one row, packed_seq_lengths"
                                      if args.packing else "one sample a row, padded to the longest, attention_mask"),
                           "chat_template": tok.chat_template_source, **describe_batches(batches)}
        else:
            cfg = load_model_config(args.config)
            batches = synthetic_batches(steps=args.steps, accum=rung["accum"], batch=rung["batch"], seq=rung["seq"],
                                        vocab=args.vocab_size or cfg.vocab_size, seed=args.seed)
        load_kwargs = {"model_name": args.model_dir, "max_seq_length": rung["seq"], "dtype": dtype,
                       "load_in_4bit": rung["qlora"], "local_files_only": True}
        if not rung["qlora"]:
            load_kwargs["load_in_16bit"] = True
        settings["from_pretrained"] = {k: str(v) for k, v in load_kwargs.items()}
        model, _tokenizer = FastLanguageModel.from_pretrained(**load_kwargs)
        peft_kwargs = {"r": args.lora_r, "lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout,
                       "target_modules": TARGET_MODULES, "bias": "none", "use_gradient_checkpointing": "unsloth",
                       "random_state": args.seed, "max_seq_length": rung["seq"]}
        settings["get_peft_model"] = {k: v for k, v in peft_kwargs.items()}
        model = FastLanguageModel.get_peft_model(model, **peft_kwargs)
        if hasattr(FastLanguageModel, "for_training"):
            FastLanguageModel.for_training(model)
        model.train()
        settings["model"] = model_facts(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        out["trainable_parameters"] = sum(p.numel() for p in trainable)
        out["adapter_dtype"] = str(trainable[0].dtype).replace("torch.", "")
        opt = torch.optim.AdamW(trainable, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                                weight_decay=args.weight_decay, fused=on_cuda)
        settings["optimizer"] = f"torch.optim.AdamW(fused={on_cuda})"
        scaler = torch.amp.GradScaler(args.device, init_scale=args.init_scale) if dtype == torch.float16 else None
        sampler = start_training_peak(out, torch, on_cuda, t_build)
        result = train_steps(model, trainable, opt, batches, device=device, autocast_dtype=dtype, scaler=scaler,
                             max_grad_norm=args.max_grad_norm, label=rung["name"],
                             normalise_by_targets=bool(args.data))
        out.update(result)
        out["measured"] = True
        if on_cuda:
            memory_stats(out, sampler.stop(), sampler.samples)
    except Exception as exc:  # noqa: BLE001
        record_failure(out, exc, on_cuda)
    return out


# ---------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------
def child_env(args) -> dict:
    """One compile folder for the whole run, so the children reuse what the first compiled."""
    env = dict(OFFLINE_ENV)
    env["UNSLOTH_COMPILE_LOCATION"] = os.environ.get("UNSLOTH_COMPILE_LOCATION") or args.compile_dir
    return env


def report_header(args) -> dict:
    config = {
        "model": os.path.relpath(os.path.abspath(args.config)), "model_config_sha256_16": config_sha16(args.config),
        "vocab_size_override": args.vocab_size or None, "model_dir": args.model_dir,
        "per_device_train_batch_size": args.batch, "gradient_accumulation_steps": args.accum,
        "max_seq_length": args.seq, "steps_per_rung": args.steps, "order": args.order, "only": args.only,
        "seed": args.seed, "learning_rate": args.lr, "weight_decay": args.weight_decay, "adam_beta1": args.beta1,
        "adam_beta2": args.beta2, "adam_epsilon": args.eps, "max_grad_norm": args.max_grad_norm,
        "lr_scheduler_type": "constant", "warmup_steps": 0, "lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
        "lora_dropout": args.lora_dropout, "lora_target_modules": TARGET_MODULES,
        "unsloth": {"from_pretrained": "FastLanguageModel.from_pretrained(model_dir, max_seq_length=seq, dtype, "
                                       "load_in_4bit=qlora, load_in_16bit=not qlora, local_files_only=True)",
                    "get_peft_model": "FastLanguageModel.get_peft_model(r, lora_alpha, lora_dropout, all seven "
                                      "projections, bias none, use_gradient_checkpointing='unsloth')",
                    "env": OFFLINE_ENV, "weights": "random bf16 folder written by transformers (save_pretrained)"},
        "data": ("uniform random token ids in [0, vocab), labels = input_ids, no attention mask, no padding"
                 if not args.data else
                 f"{args.data} x {args.repeat} through {args.tokenizer} (Llama 3 chat template, assistant-only "
                 f"labels), shuffled (seed {args.seed}), " +
                 ("packed best-fit decreasing, each micro-batch padding-free in one row with packed_seq_lengths "
                  "(Unsloth's packing layout)" if args.packing else
                  "one sample a row, each micro-batch right-padded to its longest row")),
        **measurement_config(args, __file__),
    }
    return {"peer": unsloth_versions(), "tool": "unsloth", "device": "cuda (name from the first rung)",
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "config": config,
            "rungs": []}


def run_ladder(args, report: dict) -> dict:
    for index, rung in enumerate(plan_rungs(args)):
        key = rung["added"] or "baseline"
        if key in NOT_UNSLOTH:
            report["rungs"].append({**rung_base(rung), "error": NOT_UNSLOTH[key]})
            continue
        if key not in args.only:
            report["rungs"].append({**rung_base(rung), "error": "not run (--only)"})
            continue
        print(f"peer_unsloth: {rung['name']}", file=sys.stderr, flush=True)
        result = run_child(child_argv(__file__, args, index), args.rung_timeout, rung_base(rung), env=child_env(args))
        report["rungs"].append(result)
        note_device(report, result)
        if args.out:
            write_atomic(args.out, report)
    return report


def run_context_search(args, report: dict) -> dict:
    return search_max_context(args, report, script=__file__, tool="peer_unsloth", rungs=plan_rungs(args),
                              rung_base=rung_base, env=child_env(args))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.normpath(DEFAULT_CONFIG), help="model config.json (HF format)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: Unsloth's CPU fallback (16-bit LoRA only), a check of the code path")
    p.add_argument("--model-dir", default="", help="the random-weight folder (default: /tmp/peer_unsloth_model-"
                   "<config sha>); reused while its marker matches")
    p.add_argument("--compile-dir", default="", help="UNSLOTH_COMPILE_LOCATION for the children (default: a "
                   "temporary folder)")
    add_ladder_args(p)
    p.add_argument("--order", default=",".join(TRICKS), help="the ladder's order (for the rungs' shapes)")
    p.add_argument("--only", default="flash,qlora", help="comma list of: " + ",".join(RUN_KEYS))
    add_optimizer_args(p)
    p.add_argument("--context-rung", default="qlora", help="--max-context: the rung it runs at batch 1")
    p.add_argument("--rung-timeout", type=float, default=1800, help="seconds before a rung's process is killed")
    p.add_argument("--out", default="", help="write the JSON here (atomically)")
    p.add_argument("--one-rung", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--write-model", action="store_true", help=argparse.SUPPRESS)
    args = parse_peer_args(p, argv, TRICKS)
    for t in args.only:
        if t not in RUN_KEYS:
            p.error(f"--only: '{t}' is not one of {','.join(RUN_KEYS)}")
    if not args.model_dir:
        args.model_dir = os.path.join(tempfile.gettempdir(), f"peer_unsloth_model-{config_sha16(args.config)}"
                                      + (f"-v{args.vocab_size}" if args.vocab_size else ""))
    if not args.compile_dir:
        args.compile_dir = os.path.join(tempfile.gettempdir(), "peer_unsloth_compiled")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.write_model:
        emit_result(write_model(args))
        return 0
    if args.one_rung is not None:
        rung = context_rung(args, plan_rungs(args), args.context_seq)[0] if args.context_seq else plan_rungs(args)[args.one_rung]
        emit_result(run_one_rung(args, rung))
        return 0
    report = report_header(args)
    folder = ensure_model(args)
    report["model_folder"] = {k: folder.get(k) for k in ("folder", "reused", "tokenizer", "seconds", "error",
                                                         "wall_seconds", "parameters")}
    if not folder.get("measured"):
        print(f"peer_unsloth: could not write the model folder: {folder.get('error')}", file=sys.stderr)
        if args.out:
            write_atomic(args.out, report)
        return 1
    os.makedirs(args.compile_dir, exist_ok=True)
    if args.device == "cpu":
        report["device"] = "cpu"
    return finish_report(args, run_context_search(args, report) if args.max_context else run_ladder(args, report))


if __name__ == "__main__":
    sys.exit(main())
