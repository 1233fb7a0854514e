#!/usr/bin/env python3
"""The Hugging Face peer for `memtune ladder`: the same cumulative rungs, run with transformers +
PEFT (+ bitsandbytes for QLoRA), so the two can be shown side by side from one device call.

    python3 bench/peer_hf.py --out peer.json                       # Llama-3.1-8B shape on the GPU
    python3 bench/peer_hf.py --device cpu --config configs/models/tiny.json --steps 2 --seq 64
    python3 bench/peer_hf.py --liger --out peer-liger.json         # + Liger kernels in every rung
    python3 bench/peer_hf.py --only qlora --data examples/sft-tasks.jsonl --repeat 30 \
        --tokenizer .devbin/tokenizer.json [--packing]             # real data, padded or packed
    python3 bench/peer_hf.py --max-context --cap-gib 24            # longest context at batch 1

Each rung runs in a fresh child process (`--one-rung INDEX`, same other arguments) so that its
peak memory and CUDA context start clean; the parent only reads package versions (it never
touches CUDA) and collects one JSON line per child. A rung that runs out of memory is reported
{"measured": false, "error": "CUDA out of memory"} and the ladder goes on. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_common import (TARGET_MODULES,  # noqa: E402
                         config_sha16, data_batches, describe_batches, emit_result,
                         load_chat_tokenizer, load_model_config, memory_stats, read_sft_jsonl,
                         record_failure, run_child, synthetic_batches, train_steps, version_of, write_atomic,
                         add_ladder_args, add_optimizer_args, parse_peer_args,
                         child_argv, finish_report, note_device, prepare_device, start_training_peak, measurement_config, search_max_context)
import peer_common  # noqa: E402

TRICKS = ["bf16", "gradient_checkpointing", "flash", "qlora", "chunked_loss", "micro_batch", "seq_halved"]
# The labels memtune's ladder shows (src/memtune/experiment/ladder.cpp), so rows line up by name too.
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
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "models", "llama-3.1-8b.json")
NO_CHUNKED_LOSS = ("transformers computes the full logits and upcasts them to fp32 (ForCausalLMLoss); its only "
                   "memory-lean loss path is Trainer(use_liger_kernel=True), which needs the separate liger-kernel "
                   "package (--liger applies it in every rung)")
LIGER_NO_CHUNKED = ("--liger: Liger's fused linear cross entropy (logits never materialised, in chunks) is on in "
                    "every rung, so this rung would repeat the one before it")
KBIT_PREP = {
    "trl": "TRL SFTTrainer recipe: get_peft_model on the 4-bit model, no prepare_model_for_kbit_training; "
           "embeddings, lm_head and norms stay in the compute dtype; trainable (LoRA) params cast to bf16",
    "peft": "peft.prepare_model_for_kbit_training: every non-4-bit param (embeddings, lm_head, norms) cast to "
            "fp32; LoRA params fp32 (PEFT's autocast_adapter_dtype)",
    "none": "get_peft_model only: non-4-bit params stay in the compute dtype; LoRA params fp32 "
            "(PEFT's autocast_adapter_dtype)",
}


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


# ---------------------------------------------------------------------------------------------
# One rung, in its own process.
# ---------------------------------------------------------------------------------------------
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


def rung_base(rung: dict) -> dict:
    return {"name": rung["name"], "added": rung["added"], "techniques": techniques_of(rung),
            "micro_batch": rung["batch"], "grad_accum": rung["accum"], "seq": rung["seq"], "measured": False}


def apply_liger(settings: dict) -> None:
    """Liger's kernels patched into transformers' Llama classes before the model is built:
    RoPE, RMSNorm, SwiGLU and the fused linear cross entropy (the logits are never
    materialised; training forwards with labels compute the loss in chunks)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    kwargs = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
              "fused_linear_cross_entropy": True}
    apply_liger_kernel_to_llama(**kwargs)
    settings["liger"] = {"version": version_of("liger-kernel") or version_of("liger_kernel"),
                         "apply_liger_kernel_to_llama": kwargs}


def run_one_rung(args, rung: dict) -> dict:
    import warnings

    import torch

    # transformers 5.2x renames gradient_checkpointing_* to activation_checkpointing_* with a
    # FutureWarning per call; the old names are the ones 5.17 (the device's) has.
    warnings.filterwarnings("ignore", category=FutureWarning)

    out = rung_base(rung)
    settings = {k: rung[k] for k in ("precision", "attention", "checkpointing", "loss", "batch", "accum", "seq")}
    settings["qlora"] = rung["qlora"]
    out["settings"] = settings
    on_cuda = args.device == "cuda"
    device = torch.device(args.device)

    if rung["loss"] == "chunked":
        out["error"] = "no equivalent in transformers" if not args.liger else "not run: --liger"
        out["note"] = NO_CHUNKED_LOSS if not args.liger else LIGER_NO_CHUNKED
        return out
    if not prepare_device(out, args, torch, args.threads or os.cpu_count() or 1):
        return out

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
    # Real data has padding or packed samples, hence an attention mask, which SDPA's flash backend
    # does not take: SDPA then picks its backend itself (memory-efficient, with the mask).
    force_flash = attn_impl == "sdpa" and not args.data
    settings["sdpa_backend"] = ("FLASH_ATTENTION (forced, forward and backward/recompute)" if force_flash
                                else "SDPA's own choice (the batch has an attention mask)" if attn_impl == "sdpa"
                                else None)
    if rung["qlora"]:
        settings["kbit_prep"] = args.kbit_prep
        settings["kbit_prep_meaning"] = KBIT_PREP[args.kbit_prep]

    try:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        if args.liger:
            apply_liger(settings)
            settings["loss_used"] = "liger fused_linear_cross_entropy"
        cfg = load_model_config(args.config)
        if args.vocab_size:
            cfg.vocab_size = args.vocab_size
        cfg.use_cache = False
        if args.data:
            tok = load_chat_tokenizer(args.tokenizer)
            if len(tok) > cfg.vocab_size:
                raise ValueError(f"the tokenizer has {len(tok)} ids, the model's vocabulary {cfg.vocab_size} "
                                 f"(pass --vocab-size {len(tok)})")
            samples, data_stats = read_sft_jsonl(args.data, tok, rung["seq"], args.repeat)
            batches = data_batches(samples, steps=args.steps, accum=rung["accum"], batch=rung["batch"],
                                   seq=rung["seq"], packing=args.packing, pad_id=tok.peer_pad_id, seed=args.seed)
            out["data"] = {**data_stats, "packing": args.packing, "pad_id": tok.peer_pad_id,
                           "chat_template": tok.chat_template_source, **describe_batches(batches)}
        else:
            batches = synthetic_batches(steps=args.steps, accum=rung["accum"], batch=rung["batch"], seq=rung["seq"],
                                        vocab=cfg.vocab_size, seed=args.seed)
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
        sampler = start_training_peak(out, torch, on_cuda, t_build)

        def attention_ctx():
            from contextlib import nullcontext

            if not force_flash:
                return nullcontext()
            from torch.nn.attention import SDPBackend, sdpa_kernel

            return sdpa_kernel(SDPBackend.FLASH_ATTENTION)

        result = train_steps(model, trainable, opt, batches, device=device, autocast_dtype=autocast_dtype,
                             attention_ctx=attention_ctx, scaler=scaler, max_grad_norm=args.max_grad_norm,
                             label=rung["name"], normalise_by_targets=bool(args.data))
        out.update(result)
        out["measured"] = True
        if on_cuda:
            memory_stats(out, sampler.stop(), sampler.samples)
    except Exception as exc:  # noqa: BLE001  one rung's failure is its report, not the ladder's end
        record_failure(out, exc, on_cuda)
    return out


# ---------------------------------------------------------------------------------------------
# The parent: loop the rungs, one child each.
# ---------------------------------------------------------------------------------------------
def tool_name(args) -> str:
    return "transformers+peft+bnb" + ("+liger" if args.liger else "")


def peer_versions(args) -> str:
    bnb = version_of("bitsandbytes")
    text = (f"transformers {version_of('transformers')}, peft {version_of('peft')}, torch {version_of('torch')}, "
            f"bitsandbytes {bnb or 'none'}")
    if args.liger:
        text += f", liger-kernel {version_of('liger-kernel') or version_of('liger_kernel') or 'none'}"
    return text


def data_description(args) -> str:
    if not args.data:
        return "uniform random token ids in [0, vocab), labels = input_ids, no attention mask, no padding"
    return (f"{args.data} x {args.repeat} through {args.tokenizer} (Llama 3 chat template, assistant-only labels), "
            f"shuffled (seed {args.seed}), " +
            ("packed best-fit decreasing into rows of max_seq_length, position_ids restarting per sample, "
             "block-diagonal causal mask from them (transformers masking_utils), micro-batches padded to the "
             "longest row" if args.packing else
             "one sample a row, each micro-batch right-padded to its longest row (DataCollatorForSeq2Seq), "
             "attention_mask"))


def report_header(args) -> dict:
    config = {
        "model": os.path.relpath(os.path.abspath(args.config)), "model_config_sha256_16": config_sha16(args.config),
        "vocab_size_override": args.vocab_size or None,
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
        "liger": args.liger,
        "chunked_loss": NO_CHUNKED_LOSS if not args.liger else LIGER_NO_CHUNKED,
        "data": data_description(args),
        **measurement_config(args, __file__),
    }
    return {"peer": peer_versions(args), "tool": tool_name(args),
            "device": "cpu" if args.device == "cpu" else "cuda (name from the first rung)",
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "config": config, "rungs": []}


def run_ladder(args) -> dict:
    rungs = plan_rungs(args)
    report = report_header(args)
    for index, rung in enumerate(rungs):
        key = rung["added"] or "baseline"
        if args.only and key not in args.only:
            report["rungs"].append({**rung_base(rung), "error": "not run (--only)"})
            continue
        print(f"peer_hf: rung {index + 1}/{len(rungs)}: {rung['name']}", file=sys.stderr, flush=True)
        result = run_child(child_argv(__file__, args, index), args.rung_timeout, rung_base(rung))
        report["rungs"].append(result)
        note_device(report, result, args.device == "cuda")
        if args.out:  # keep what is measured so far, should a later rung take the machine down
            write_atomic(args.out, report)
    return report


def context_rung(args, seq: int) -> tuple[dict, int]:
    return peer_common.context_rung(args, plan_rungs(args), seq)


def run_context_search(args) -> dict:
    return search_max_context(args, report_header(args), script=__file__, tool="peer_hf", rungs=plan_rungs(args),
                              rung_base=rung_base, name_device=args.device == "cuda")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.normpath(DEFAULT_CONFIG),
                   help="model config.json (HF format; memtune's configs/models/*.json are)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    add_ladder_args(p)
    p.add_argument("--order", default=",".join(TRICKS), help="comma list of: " + ",".join(TRICKS))
    p.add_argument("--only", default="", help="comma list of rung keys to run (baseline," + ",".join(TRICKS)
                   + "); the others are listed as not run")
    add_optimizer_args(p)
    p.add_argument("--kbit-prep", default="trl", choices=sorted(KBIT_PREP),
                   help="how the QLoRA rung prepares the 4-bit model: " +
                        "; ".join(f"{k}: {v}" for k, v in KBIT_PREP.items()))
    p.add_argument("--rung-timeout", type=float, default=1800, help="seconds before a rung's process is killed")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for --device cpu (0: all)")
    p.add_argument("--liger", action="store_true", help="apply liger_kernel.transformers.apply_liger_kernel_to_llama "
                   "(rope, rms_norm, swiglu, fused_linear_cross_entropy) in every rung")
    p.add_argument("--context-rung", default="qlora", help="--max-context: the rung whose techniques it runs at batch 1")
    p.add_argument("--out", default="", help="write the ladder JSON here (atomically)")
    p.add_argument("--one-rung", type=int, default=None, help=argparse.SUPPRESS)
    args = parse_peer_args(p, argv, TRICKS)
    for t in args.only:
        if t not in ["baseline"] + TRICKS:
            p.error(f"--only: unknown rung '{t}'")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one_rung is not None:
        rung = context_rung(args, args.context_seq)[0] if args.context_seq else plan_rungs(args)[args.one_rung]
        emit_result(run_one_rung(args, rung))
        return 0
    return finish_report(args, run_context_search(args) if args.max_context else run_ladder(args))


if __name__ == "__main__":
    sys.exit(main())
