#!/usr/bin/env python3
"""Check that transformers + PEFT read memtune's adapter (and merged model) as memtune does.

    python3 tools/check_peft.py --model MODEL_DIR --adapter PEFT_DIR [--merged MERGED_DIR] \\
        [--input-ids 1,2,3] [--generate 16] [--memtune build/memtune]

Loads the base with transformers and the adapter with PEFT (PeftModel.from_pretrained), runs one
forward over --input-ids and compares its logits with `memtune logits` on the same model and
adapter. With --merged (a folder written by `memtune merge`): transformers loads that folder on
its own, its logits are compared with PEFT's, and its weights with PEFT's merge_and_unload().
With --generate N: greedy generation of N tokens, PEFT against `memtune generate`.

Prints the max abs difference of each comparison and exits 1 when one exceeds --tolerance.
Needs torch, transformers, peft and safetensors (tools/requirements-golden.txt); CPU is enough.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

DEFAULT_IDS = "1,40,7,255,3,18,99,120,61,2,44,5,230,17,8,150"


def find_memtune(explicit):
    if explicit:
        return explicit
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.environ.get("MEMTUNE"), os.path.join(here, "..", "build", "memtune")):
        if candidate and os.path.exists(candidate):
            return candidate
    sys.exit("memtune binary not found: pass --memtune PATH (or set MEMTUNE)")


def run(command):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def memtune_logits(memtune, model, adapter, ids, dtype, workdir, name):
    out = os.path.join(workdir, name + ".safetensors")
    command = [memtune, "logits", "--device", "cpu", "--dtype", dtype, "--model", model,
               "--input-ids", ",".join(map(str, ids)), "--out", out]
    if adapter:
        command += ["--adapter", adapter]
    run(command)
    return load_file(out)["logits"].float()


def load_hf(folder, dtype):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="base model folder (config.json + safetensors)")
    parser.add_argument("--adapter", required=True, help="PEFT adapter folder (memtune train --out X: X/adapter)")
    parser.add_argument("--merged", help="folder written by memtune merge")
    parser.add_argument("--input-ids", default=DEFAULT_IDS, help="comma-separated token ids")
    parser.add_argument("--generate", type=int, default=0, help="also compare N greedily generated tokens")
    parser.add_argument("--memtune", help="path to the memtune binary")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max abs logit difference allowed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    memtune = find_memtune(args.memtune)
    dtype = getattr(torch, args.dtype)
    memtune_dtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[args.dtype]
    ids = [int(x) for x in args.input_ids.replace(" ", "").split(",") if x]
    input_ids = torch.tensor([ids])

    results = []  # (what, max abs diff)
    peft_model = PeftModel.from_pretrained(load_hf(args.model, dtype), args.adapter).eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids).logits[0].float()
    with tempfile.TemporaryDirectory() as workdir:
        ours = memtune_logits(memtune, args.model, args.adapter, ids, memtune_dtype, workdir, "adapter")
        results.append(("memtune logits (base + adapter) vs PEFT", (ours - peft_logits).abs().max().item()))

        if args.merged:
            merged_model = load_hf(args.merged, dtype)
            with torch.no_grad():
                merged_logits = merged_model(input_ids).logits[0].float()
            results.append(("transformers on memtune's merged folder vs PEFT",
                            (merged_logits - peft_logits).abs().max().item()))
            ours_merged = memtune_logits(memtune, args.merged, None, ids, memtune_dtype, workdir, "merged")
            results.append(("memtune logits (merged folder) vs PEFT", (ours_merged - peft_logits).abs().max().item()))
            reference = PeftModel.from_pretrained(load_hf(args.model, dtype), args.adapter).merge_and_unload()
            theirs = reference.state_dict()
            worst = 0.0
            for key, value in merged_model.state_dict().items():
                if key in theirs:
                    worst = max(worst, (value.float() - theirs[key].float()).abs().max().item())
            results.append(("memtune merge weights vs PEFT merge_and_unload (max abs)", worst))

        if args.generate > 0:
            with torch.no_grad():
                out = peft_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                          do_sample=False, max_new_tokens=args.generate)
            theirs_ids = out[0, len(ids):].tolist()
            line = run([memtune, "generate", "--device", "cpu", "--json", "--dtype", memtune_dtype, "--model", args.model,
                        "--adapter", args.adapter, "--input-ids", ",".join(map(str, ids)),
                        "--max_new_tokens", str(args.generate)])
            ours_ids = json.loads(line)["output_ids"]
            same = ours_ids == theirs_ids  # both stop at the eos ids of generation_config.json
            print(f"greedy generate, {len(ours_ids)} tokens: {'identical' if same else 'DIFFERENT'}")
            print(f"  PEFT:    {theirs_ids}\n  memtune: {ours_ids}")
            if not same:
                results.append(("greedy tokens", float("inf")))

    failed = False
    for what, diff in results:
        ok = diff <= args.tolerance
        failed |= not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}: max abs diff {diff:.3e}")
    print(f"logits of {len(ids)} tokens, vocab {peft_logits.shape[-1]}, |logit| up to {peft_logits.abs().max().item():.3f}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
