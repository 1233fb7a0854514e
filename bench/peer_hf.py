#!/usr/bin/env python3
"""The Hugging Face peer for `memtune ladder`: the same cumulative rungs, run with transformers +
PEFT (+ bitsandbytes for QLoRA), so the two can be shown side by side from one device call.

    python3 bench/peer_hf.py --out peer.json                       # Llama-3.1-8B shape on the GPU
    python3 bench/peer_hf.py --device cpu --config configs/models/tiny.json --steps 2 --seq 64

Each rung runs in a fresh child process (`--one-rung INDEX`, same other arguments) so that its
peak memory and CUDA context start clean; the parent only reads package versions (it never
touches CUDA) and collects one JSON line per child. A rung that runs out of memory is reported
{"measured": false, "error": "CUDA out of memory"} and the ladder goes on. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib.metadata as _md
import json
import math
import os
import subprocess
import sys
import time
import traceback

TRICKS = ["bf16", "gradient_checkpointing", "flash", "qlora", "chunked_loss", "micro_batch", "seq_halved"]
# The labels memtune's ladder shows (src/memtune/report/ladder.cpp), so rows line up by name too.
LABELS = {
    "": "fp16 baseline",
    "bf16": "+ bf16",
    "gradient_checkpointing": "+ gradient checkpointing",
    "flash": "+ flash attention",
    "qlora": "+ QLoRA (nf4, double quant)",
    "chunked_loss": "+ chunked loss",
    "micro_batch": "micro-batch 1 x more accumulation",
    "seq_halved": "max_seq_length halved",
}
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RESULT_MARK = "@@PEER_RUNG@@ "
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "models", "llama-3.1-8b.json")
NO_CHUNKED_LOSS = ("transformers computes the full logits and upcasts them to fp32 (ForCausalLMLoss); its only "
                   "memory-lean loss path is Trainer(use_liger_kernel=True), which needs the separate liger-kernel "
                   "package (not used here)")
KBIT_PREP = {
    "trl": "TRL SFTTrainer recipe: get_peft_model on the 4-bit model, no prepare_model_for_kbit_training; "
           "embeddings, lm_head and norms stay in the compute dtype; trainable (LoRA) params cast to bf16",
    "peft": "peft.prepare_model_for_kbit_training: every non-4-bit param (embeddings, lm_head, norms) cast to "
            "fp32; LoRA params fp32 (PEFT's autocast_adapter_dtype)",
    "none": "get_peft_model only: non-4-bit params stay in the compute dtype; LoRA params fp32 "
            "(PEFT's autocast_adapter_dtype)",
}


def version_of(name: str) -> str | None:
    try:
        return _md.version(name)
    except _md.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------
# The ladder plan: the same cumulative tricks memtune applies (ladder.cpp), in --order.
# ---------------------------------------------------------------------------------------------
def plan_rungs(args) -> list[dict]:
    state = {"precision": "fp16", "attention": "eager", "checkpointing": False, "qlora": False,
             "loss": "full", "batch": args.batch, "accum": args.accum, "seq": args.seq}
    rungs = [{"name": LABELS[""], "added": "", **state}]
    for trick in args.order:
        state = dict(state)
        if trick == "bf16":
            state["precision"] = "bf16"
        elif trick == "gradient_checkpointing":
            state["checkpointing"] = True
        elif trick == "flash":
            state["attention"] = "flash"
        elif trick == "qlora":
            state["qlora"] = True  # compute dtype = the rung's 16-bit precision, as memtune does
        elif trick == "chunked_loss":
            # The peer has none: this rung is reported unmeasured with its techniques as asked, and
            # the rungs after it go on with the full loss (which their techniques say).
            rungs.append({"name": LABELS[trick], "added": trick, **state, "loss": "chunked"})
            continue
        elif trick == "micro_batch":
            state["accum"] = state["accum"] * state["batch"]
            state["batch"] = 1
        elif trick == "seq_halved":
            state["seq"] = max(2, state["seq"] // 2)
        rungs.append({"name": LABELS[trick], "added": trick, **state})
    return rungs


def techniques_of(r: dict) -> list[str]:
    """memtune's list form (techniques_of in ladder.cpp), for the same rows."""
    return [r["precision"] + ("+nf4-base" if r["qlora"] else ""), r["attention"],
            "checkpointing" if r["checkpointing"] else "no-checkpointing", r["loss"] + "-loss",
            f"batch {r['batch']} x accumulation {r['accum']}", f"seq {r['seq']}"]


def config_file(path: str) -> str:
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


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
# One rung, in its own process.
# ---------------------------------------------------------------------------------------------
def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def _quantize_linears_4bit(model, compute_dtype, device):
    """Replaces every decoder nn.Linear (q,k,v,o,gate,up,down; not lm_head, as transformers'
    bnb quantizer keeps it) with bnb.nn.Linear4bit quantized from its random weight, one at a
    time: peak = the 16-bit model + one layer's 4-bit copy. Nothing touches the disk."""
    import bitsandbytes as bnb
    import torch

    # Names only: holding the modules themselves would keep every bf16 weight alive to the end.
    targets = [name for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and name.split(".")[-1] != "lm_head"]
    for full in targets:
        parent_name, _, child_name = full.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        child = getattr(parent, child_name)
        new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                quant_storage=torch.uint8, device="meta")
        weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, blocksize=64,
                                   compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8,
                                   module=new)
        new.weight = weight.to(device)  # Params4bit.to() on an unquantized param quantizes it
        if child.bias is not None:
            new.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
        setattr(parent, child_name, new)
        del child, weight, new
    count = len(targets)
    return count


def run_one_rung(args, rung: dict) -> dict:
    import warnings

    import torch

    # transformers 5.2x renames gradient_checkpointing_* to activation_checkpointing_* with a
    # FutureWarning per call; the old names are the ones 5.17 (the device's) has.
    warnings.filterwarnings("ignore", category=FutureWarning)

    out = {"name": rung["name"], "added": rung["added"], "techniques": techniques_of(rung),
           "micro_batch": rung["batch"], "grad_accum": rung["accum"], "seq": rung["seq"], "measured": False}
    settings = {k: rung[k] for k in ("precision", "attention", "checkpointing", "loss", "batch", "accum", "seq")}
    settings["qlora"] = rung["qlora"]
    out["settings"] = settings
    on_cuda = args.device == "cuda"
    device = torch.device(args.device)

    if rung["loss"] == "chunked":
        out["error"] = "no equivalent in transformers"
        out["note"] = NO_CHUNKED_LOSS
        return out
    if on_cuda:
        if not torch.cuda.is_available():
            out["error"] = "--device cuda but torch sees no GPU"
            return out
        torch.cuda.init()
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        out["context_bytes"] = total - free
        out["device_total_bytes"] = total
        out["device_name"] = torch.cuda.get_device_name()
    else:
        out["device_name"] = "cpu"
        torch.set_num_threads(max(1, args.threads or os.cpu_count() or 1))

    if rung["qlora"]:
        try:
            import bitsandbytes as bnb  # noqa: F401  (after the context is measured: it queries the GPU)
        except ModuleNotFoundError:
            out["error"] = "bitsandbytes not installed"
            return out
        except Exception as exc:  # installed but broken (e.g. no native library for this CUDA)
            out["error"] = f"bitsandbytes failed to import: {type(exc).__name__}: {exc}".splitlines()[0][:300]
            return out

    # Precision actually used: fp16 autocast + GradScaler on the GPU; on the CPU fp16 is replaced by
    # fp32 (no autocast, the GradScaler still runs, so its code path is exercised).
    if rung["precision"] == "fp16":
        dtype, autocast_dtype = (torch.float16, torch.float16) if on_cuda else (torch.float32, None)
    else:
        dtype, autocast_dtype = torch.bfloat16, torch.bfloat16
    settings["precision_used"] = (f"{str(dtype).replace('torch.', '')} weights, "
                                  + (f"autocast {str(autocast_dtype).replace('torch.', '')}" if autocast_dtype
                                     else "no autocast")
                                  + (", GradScaler" if rung["precision"] == "fp16" else ""))
    attn_impl = "sdpa" if rung["attention"] == "flash" else "eager"
    settings["attn_implementation"] = attn_impl
    settings["sdpa_backend"] = "FLASH_ATTENTION (forced, forward and backward/recompute)" if attn_impl == "sdpa" else None
    if rung["qlora"]:
        settings["kbit_prep"] = args.kbit_prep
        settings["kbit_prep_meaning"] = KBIT_PREP[args.kbit_prep]

    try:
        from contextlib import nullcontext

        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        cfg = load_model_config(args.config)
        cfg.use_cache = False
        torch.manual_seed(args.seed)
        t_build = time.perf_counter()
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_impl)
        off = {str(p.device) for p in model.parameters()} - {str(device), f"{device}:0"}
        if off:
            raise RuntimeError(f"model parameters landed on {off}, not {device}")
        if rung["qlora"]:
            from transformers import BitsAndBytesConfig

            bnb_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype,
                                            bnb_4bit_quant_storage=torch.uint8)
            settings["quantized_linears"] = _quantize_linears_4bit(model, dtype, device)
            model.is_loaded_in_4bit = True  # what transformers' bnb quantizer sets after loading
            model.config.quantization_config = bnb_config
            if on_cuda:
                torch.cuda.empty_cache()
        gc_kwargs = {"use_reentrant": False}
        if rung["qlora"] and args.kbit_prep == "peft":
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=rung["checkpointing"],
                                                    gradient_checkpointing_kwargs=gc_kwargs)
        elif rung["checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
        lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                          target_modules=TARGET_MODULES, bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
        if rung["checkpointing"]:
            model.enable_input_require_grads()  # as PEFT / TRL do with gradient checkpointing
        if rung["qlora"] and args.kbit_prep == "trl" and rung["precision"] == "bf16":
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        out["trainable_parameters"] = sum(p.numel() for p in trainable)
        out["adapter_dtype"] = str(trainable[0].dtype).replace("torch.", "")
        fused = on_cuda  # transformers' default optim on torch >= 2.8 is adamw_torch_fused
        opt = torch.optim.AdamW(trainable, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                                weight_decay=args.weight_decay, fused=fused)
        settings["optimizer"] = f"torch.optim.AdamW(fused={fused})"
        scaler = None
        if rung["precision"] == "fp16":
            scaler = torch.amp.GradScaler(args.device, init_scale=args.init_scale)
        if on_cuda:
            torch.cuda.synchronize()
            out["build_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        out["build_seconds"] = time.perf_counter() - t_build

        # Synthetic data: uniform token ids in [0, vocab), labels = input_ids (HF shifts inside).
        gen = torch.Generator().manual_seed(args.seed)
        per_step = rung["batch"] * rung["accum"]
        data = torch.randint(0, cfg.vocab_size, (args.steps, rung["accum"], rung["batch"], rung["seq"]),
                             generator=gen, dtype=torch.long)

        def attention_ctx():
            if attn_impl != "sdpa":
                return nullcontext()
            from torch.nn.attention import SDPBackend, sdpa_kernel

            return sdpa_kernel(SDPBackend.FLASH_ATTENTION)

        def autocast_ctx():
            if autocast_dtype is None:
                return nullcontext()
            return torch.autocast(device_type=device.type, dtype=autocast_dtype)

        def sync():
            if on_cuda:
                torch.cuda.synchronize()

        timed, timed_steps, loss_value, skipped = 0.0, 0, float("nan"), 0
        for step in range(args.steps):
            sync()
            t0 = time.perf_counter()
            step_loss = 0.0
            for m in range(rung["accum"]):
                ids = data[step, m].to(device, non_blocking=True)
                # The SDPA backend choice is thread-local state that non-reentrant checkpointing does
                # not record: keep the backward (which recomputes the forward) inside it too.
                with attention_ctx():
                    with autocast_ctx():
                        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    step_loss += loss.detach()
                    loss = loss / rung["accum"]
                    (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm)
            if scaler:
                scaler.step(opt)
                scale_before = scaler.get_scale()
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            seconds = time.perf_counter() - t0
            if scaler and scaler.get_scale() < scale_before:
                skipped += 1
            loss_value = float(step_loss) / rung["accum"]
            if step > 0 or args.steps == 1:
                timed += seconds
                timed_steps += 1
            print(f"  [{rung['name']}] step {step + 1}/{args.steps} loss {loss_value:.4f} {seconds:.2f} s",
                  file=sys.stderr, flush=True)

        out["measured"] = True
        out["step_seconds"] = timed / timed_steps
        out["tokens_per_second"] = per_step * rung["seq"] * timed_steps / timed
        out["loss"] = loss_value if math.isfinite(loss_value) else str(loss_value)
        if scaler:
            out["loss_scaler"] = {"skipped_steps": skipped, "final_scale": float(scaler.get_scale())}
        if on_cuda:
            _memory_stats(out)
    except Exception as exc:  # noqa: BLE001  one rung's failure is its report, not the ladder's end
        if _is_oom(exc):
            out["error"] = "CUDA out of memory" if on_cuda else "out of memory"
        else:
            out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            traceback.print_exc(file=sys.stderr)
        out["error_detail"] = str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__
        if on_cuda:
            try:
                out["peak_allocated_bytes_before_failure"] = torch.cuda.max_memory_allocated()
                out["peak_reserved_bytes_before_failure"] = torch.cuda.max_memory_reserved()
            except Exception:  # noqa: BLE001
                pass
        out["measured"] = False
    return out


def _memory_stats(out: dict) -> None:
    import torch

    torch.cuda.synchronize()
    out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    # What nvidia-smi would have shown at the peak: in use now (context, library workspaces, the
    # allocator's pool) less the pool now plus the pool at its largest.
    out["device_in_use_end_bytes"] = used
    out["device_peak_bytes"] = used - torch.cuda.memory_reserved() + torch.cuda.max_memory_reserved()


# ---------------------------------------------------------------------------------------------
# The parent: loop the rungs, one child each.
# ---------------------------------------------------------------------------------------------
def child_argv(args, index: int) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--one-rung", str(index),
            "--config", args.config, "--device", args.device, "--steps", str(args.steps),
            "--batch", str(args.batch), "--accum", str(args.accum), "--seq", str(args.seq),
            "--order", ",".join(args.order), "--seed", str(args.seed), "--lr", repr(args.lr),
            "--weight-decay", repr(args.weight_decay), "--beta1", repr(args.beta1), "--beta2", repr(args.beta2),
            "--eps", repr(args.eps), "--max-grad-norm", repr(args.max_grad_norm),
            "--lora-r", str(args.lora_r), "--lora-alpha", repr(args.lora_alpha),
            "--lora-dropout", repr(args.lora_dropout), "--init-scale", repr(args.init_scale),
            "--kbit-prep", args.kbit_prep]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return argv


def run_child(args, index: int, rung: dict) -> dict:
    base = {"name": rung["name"], "added": rung["added"], "techniques": techniques_of(rung),
            "micro_batch": rung["batch"], "grad_accum": rung["accum"], "seq": rung["seq"], "measured": False}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(child_argv(args, index), stdout=subprocess.PIPE, stderr=None, text=True,
                              timeout=args.rung_timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timed out after {args.rung_timeout} s", "wall_seconds": time.perf_counter() - t0}
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK):])
        elif line.strip():
            print(line, file=sys.stderr)
    if result is None:
        why = "killed by signal %d" % -proc.returncode if proc.returncode < 0 else f"exit code {proc.returncode}"
        result = {**base, "error": f"rung process died ({why}) without a result"}
    result["wall_seconds"] = time.perf_counter() - t0
    return result


def gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def print_table(report: dict) -> None:
    rows = [("rung", "ok", "tok/s", "step s", "loss", "alloc GiB", "resv GiB", "device GiB", "note")]
    for r in report["rungs"]:
        loss = r.get("loss")
        rows.append((r["name"], "yes" if r.get("measured") else "no",
                     f"{r['tokens_per_second']:.0f}" if r.get("tokens_per_second") else "-",
                     f"{r['step_seconds']:.3f}" if r.get("step_seconds") else "-",
                     f"{loss:.4f}" if isinstance(loss, float) else str(loss or "-"),
                     gib(r.get("peak_allocated_bytes")), gib(r.get("peak_reserved_bytes")),
                     gib(r.get("device_peak_bytes")),
                     r.get("error", "") + (f" scaler skipped {r['loss_scaler']['skipped_steps']}, scale "
                                           f"{r['loss_scaler']['final_scale']:g}" if r.get("loss_scaler") else "")))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    print(f"peer: {report['peer']} | device: {report['device']}")
    for k, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) if i in (0, 8) else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def write_atomic(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def run_ladder(args) -> dict:
    rungs = plan_rungs(args)
    bnb = version_of("bitsandbytes")
    peer = (f"transformers {version_of('transformers')}, peft {version_of('peft')}, torch {version_of('torch')}, "
            f"bitsandbytes {bnb or 'none'}")
    with open(config_file(args.config), "rb") as f:
        config_sha = hashlib.sha256(f.read()).hexdigest()[:16]
    config = {
        "model": os.path.relpath(os.path.abspath(args.config)), "model_config_sha256_16": config_sha,
        "device": args.device, "precision": "fp16", "attn_implementation": "eager",
        "gradient_checkpointing": False, "loss_implementation": "full",
        "per_device_train_batch_size": args.batch, "gradient_accumulation_steps": args.accum,
        "max_seq_length": args.seq, "steps_per_rung": args.steps, "order": args.order,
        "only": args.only, "seed": args.seed, "learning_rate": args.lr, "weight_decay": args.weight_decay,
        "adam_beta1": args.beta1, "adam_beta2": args.beta2, "adam_epsilon": args.eps,
        "max_grad_norm": args.max_grad_norm, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "lora_r": args.lora_r, "lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout,
        "lora_target_modules": TARGET_MODULES, "grad_scaler_init_scale": args.init_scale,
        "qlora": {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True, "blocksize": 64,
                  "bnb_4bit_compute_dtype": "the rung's 16-bit precision", "kbit_prep": args.kbit_prep,
                  "kbit_prep_meaning": KBIT_PREP[args.kbit_prep],
                  "weights": "random bf16 model built on the device, each decoder nn.Linear replaced by "
                             "bnb.nn.Linear4bit quantized from it (lm_head, embeddings, norms not quantized)"},
        "chunked_loss": NO_CHUNKED_LOSS,
        "data": "uniform random token ids in [0, vocab), labels = input_ids, no attention mask, no padding",
        "timing": "optimizer steps after the first; torch.cuda.synchronize() around each",
        "command": [os.path.relpath(os.path.abspath(__file__))] + sys.argv[1:],
    }
    report = {"peer": peer, "device": "cpu" if args.device == "cpu" else "cuda (name from the first rung)",
              "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "config": config, "rungs": []}
    for index, rung in enumerate(rungs):
        key = rung["added"] or "baseline"
        if args.only and key not in args.only:
            report["rungs"].append({"name": rung["name"], "added": rung["added"], "techniques": techniques_of(rung),
                                    "micro_batch": rung["batch"], "grad_accum": rung["accum"], "seq": rung["seq"],
                                    "measured": False, "error": "not run (--only)"})
            continue
        print(f"peer_hf: rung {index + 1}/{len(rungs)}: {rung['name']}", file=sys.stderr, flush=True)
        result = run_child(args, index, rung)
        report["rungs"].append(result)
        if result.get("device_name") and args.device == "cuda":
            report["device"] = result["device_name"]
        if "context_bytes" in result and "device_context_bytes" not in report:
            report["device_context_bytes"] = result["context_bytes"]
        if args.out:  # keep what is measured so far, should a later rung take the machine down
            write_atomic(args.out, report)
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.normpath(DEFAULT_CONFIG),
                   help="model config.json (HF format; memtune's configs/models/*.json are)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per rung; the first is not timed")
    p.add_argument("--batch", type=int, default=2, help="per-device micro-batch")
    p.add_argument("--accum", type=int, default=8, help="gradient accumulation steps")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--order", default=",".join(TRICKS), help="comma list of: " + ",".join(TRICKS))
    p.add_argument("--only", default="", help="comma list of rung keys to run (baseline," + ",".join(TRICKS)
                   + "); the others are listed as not run")
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
    p.add_argument("--kbit-prep", default="trl", choices=sorted(KBIT_PREP),
                   help="how the QLoRA rung prepares the 4-bit model: " +
                        "; ".join(f"{k}: {v}" for k, v in KBIT_PREP.items()))
    p.add_argument("--rung-timeout", type=float, default=1800, help="seconds before a rung's process is killed")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for --device cpu (0: all)")
    p.add_argument("--out", default="", help="write the ladder JSON here (atomically)")
    p.add_argument("--one-rung", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.order = [t for t in args.order.split(",") if t]
    for t in args.order:
        if t not in TRICKS:
            p.error(f"--order: unknown trick '{t}' (known: {','.join(TRICKS)})")
    args.only = [t for t in args.only.split(",") if t]
    for t in args.only:
        if t not in ["baseline"] + TRICKS:
            p.error(f"--only: unknown rung '{t}'")
    if min(args.steps, args.batch, args.accum, args.seq) < 1:
        p.error("--steps, --batch, --accum and --seq must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one_rung is not None:
        rungs = plan_rungs(args)
        result = run_one_rung(args, rungs[args.one_rung])
        sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
        sys.stdout.flush()
        return 0
    report = run_ladder(args)
    if args.out:
        write_atomic(args.out, report)
    print_table(report)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
