#!/usr/bin/env python3
"""bitsandbytes as the reference for memtune's 4-bit format (run on a CUDA machine with torch,
transformers, bitsandbytes and, for --adapter, peft).

    python3 tools/bnb_reference.py make --config configs/models/llama-3.1-8b.json --layers 2 --out DIR
        DIR/dense            a random bf16 model (save_pretrained), the widths of --config and
                             --layers decoder layers: real-sized projections, small files
        DIR/bnb-nf4-dq       that model loaded with BitsAndBytesConfig(nf4, double quant, bf16
                             compute) and written by transformers' save_pretrained: bitsandbytes'
                             own codes, absmax and nested constants
        DIR/bnb-fp4          the same with fp4 and no double quant
    python3 tools/bnb_reference.py compare BNB_DIR MEMTUNE_DIR
        every tensor of the two folders byte for byte (the quant_state JSON as parsed JSON) and
        the quantization_config; exit 1 on any difference
    python3 tools/bnb_reference.py logits MODEL_DIR --input-ids 1,2,3 --out FILE [--adapter DIR]
        transformers (+ PEFT) logits of one sequence, f32, as `memtune logits` writes them
    python3 tools/bnb_reference.py compare-logits A B [--max-rel 0.02]
        max abs difference, relative L2 norm and the argmax agreement; exit 1 past --max-rel
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file


def folder_tensors(folder):
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def cmd_make(args):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    with open(args.config) as f:
        config_json = json.load(f)
    config_json["num_hidden_layers"] = args.layers
    config = LlamaConfig(**config_json)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    dense_dir = os.path.join(args.out, "dense")
    model.save_pretrained(dense_dir)
    del model
    torch.cuda.empty_cache()
    variants = {
        "bnb-nf4-dq": dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
        "bnb-fp4": dict(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False),
    }
    for name, settings in variants.items():
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16,
                                          **settings)
        quantized = AutoModelForCausalLM.from_pretrained(dense_dir, quantization_config=quantization,
                                                         dtype=torch.bfloat16, device_map=args.device)
        quantized.save_pretrained(os.path.join(args.out, name))
        del quantized
        torch.cuda.empty_cache()
    print(f"wrote {dense_dir} and {', '.join(variants)} under {args.out}")


def as_bytes(tensor):
    return tensor.contiguous().view(-1).view(torch.uint8)


def explain_code_differences(key, dense_weight, ref, ref_bytes, got_bytes):
    """For 4-bit codes that differ: the value x / absmax of each differing element (IEEE fp32:
    x * (1 / absmax)), next to both codes, to show whether the differences sit on a decision
    threshold (a rounding difference in the scaling) or not (a different rule)."""
    absmax = ref.get(key + ".absmax")
    if absmax is None or absmax.dtype != torch.float32:
        return
    x = dense_weight.float().reshape(-1)
    blocksize = x.numel() // absmax.numel()
    scaled = x * (1.0 / absmax.repeat_interleave(blocksize))
    where = (ref_bytes != got_bytes).nonzero().reshape(-1)[:12]
    for byte in where.tolist():
        for nibble, shift in ((0, 4), (1, 0)):
            element = 2 * byte + nibble
            code_ref = (int(ref_bytes[byte]) >> shift) & 15
            code_got = (int(got_bytes[byte]) >> shift) & 15
            if code_ref != code_got:
                print(f"  {key}[{element}]: x {float(x[element]):.9g} absmax "
                      f"{float(absmax[element // blocksize]):.9g} x/absmax {float(scaled[element]):.9g} "
                      f"(bits {int(scaled[element:element+1].view(torch.int32)):#010x}): "
                      f"reference code {code_ref}, candidate {code_got}")


def cmd_compare(args):
    ref, got = folder_tensors(args.reference), folder_tensors(args.candidate)
    dense = folder_tensors(args.dense) if args.dense else None
    problems = []
    counts = {}
    for key in sorted(set(ref) | set(got)):
        if key not in got or key not in ref:
            problems.append(f"{key}: only in {'reference' if key in ref else 'candidate'}")
            continue
        a, b = ref[key], got[key]
        kind = key.rsplit(".", 1)[-1] if "quant_state" not in key else "quant_state"
        if ".weight." in key or key.endswith(".weight"):
            kind = key.split(".weight", 1)[1].lstrip(".") or "weight"
        counts[kind] = counts.get(kind, 0) + 1
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            problems.append(f"{key}: {a.dtype}{tuple(a.shape)} against {b.dtype}{tuple(b.shape)}")
            continue
        if "quant_state" in key:
            sa = json.loads(bytes(as_bytes(a).tolist()).decode())
            sb = json.loads(bytes(as_bytes(b).tolist()).decode())
            if sa != sb:
                problems.append(f"{key}: {sa} against {sb}")
            continue
        ba, bb = as_bytes(a), as_bytes(b)
        if not torch.equal(ba, bb):
            differing = int((ba != bb).sum())
            detail = ""
            if a.dtype == torch.float32:
                ulps = (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()
                detail = f" (float32: largest difference {int(ulps.max())} ulp)"
            problems.append(f"{key}: {differing} of {ba.numel()} bytes differ{detail}")
            if dense is not None and key.endswith(".weight") and key in dense:
                explain_code_differences(key, dense[key], ref, ba, bb)
    with open(os.path.join(args.reference, "config.json")) as f:
        qa = json.load(f).get("quantization_config", {})
    with open(os.path.join(args.candidate, "config.json")) as f:
        qb = json.load(f).get("quantization_config", {})
    for key in ("quant_method", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type",
                "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
        if qa.get(key) != qb.get(key):
            problems.append(f"quantization_config.{key}: {qa.get(key)!r} against {qb.get(key)!r}")
    print(f"compared {sum(counts.values())} tensors: " +
          ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())))
    for p in problems[:40]:
        print("DIFFERS", p)
    print("IDENTICAL" if not problems else f"{len(problems)} differences")
    return 0 if not problems else 1


def cmd_logits(args):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map=args.device,
                                                 attn_implementation="eager")
    if args.adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, args.adapter)
    model.eval()
    ids = torch.tensor([[int(t) for t in args.input_ids.split(",")]], device=args.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float().cpu().contiguous()
    save_file({"logits": logits}, args.out)
    print(f"wrote {args.out}: logits {tuple(logits.shape)}")


def cmd_compare_logits(args):
    a = load_file(args.a)["logits"].float()
    b = load_file(args.b)["logits"].float()
    if a.shape != b.shape:
        print(f"shapes differ: {tuple(a.shape)} against {tuple(b.shape)}")
        return 1
    max_abs = float((a - b).abs().max())
    rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
    argmax = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    ok = rel <= args.max_rel
    print(f"logits {tuple(a.shape)}: max abs diff {max_abs:.4g}, relative L2 {rel:.4g}, "
          f"argmax agreement {argmax:.3f}, scale {float(b.abs().max()):.4g} -> "
          f"{'MATCH' if ok else 'MISMATCH'} (max relative {args.max_rel})")
    return 0 if ok else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make")
    make.add_argument("--config", required=True)
    make.add_argument("--layers", type=int, default=2)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--out", required=True)
    make.add_argument("--device", default="cuda", help="cuda: bitsandbytes' CUDA kernels (the reference)")
    compare = sub.add_parser("compare")
    compare.add_argument("reference")
    compare.add_argument("candidate")
    compare.add_argument("--dense", help="the dense folder both were quantized from: explain differing codes")
    logits = sub.add_parser("logits")
    logits.add_argument("model")
    logits.add_argument("--input-ids", required=True)
    logits.add_argument("--adapter")
    logits.add_argument("--out", required=True)
    logits.add_argument("--device", default="cuda")
    compare_logits = sub.add_parser("compare-logits")
    compare_logits.add_argument("a")
    compare_logits.add_argument("b")
    compare_logits.add_argument("--max-rel", type=float, default=0.02)
    args = parser.parse_args()
    handler = {"make": cmd_make, "compare": cmd_compare, "logits": cmd_logits,
               "compare-logits": cmd_compare_logits}[args.command]
    sys.exit(handler(args) or 0)


if __name__ == "__main__":
    main()
