#!/usr/bin/env python3
"""Record transformers' greedy generation on the golden fixture models for memtune's generate test.

    python3 tools/make_generate_golden.py --out tests/fixtures/generate/greedy.json

For each fixture model in tests/fixtures/golden (written by tools/make_golden.py), alone and with
its PEFT adapter, and for each fixed prompt: `model.generate(do_sample=False, max_new_tokens=N)`
with the KV cache on, eos from the folder's generation_config.json, eager attention, fp32, one CPU
thread. The JSON keeps the prompt ids, the new ids (a final eos included, as generate returns it)
and, per case, the smallest gap between the best and the second-best logit over the steps: the
test's tolerance has to stay far below it, or an fp32 rounding difference could flip a token.

Deterministic: the models are the committed fixtures and greedy decoding draws nothing.
"""

import argparse
import json
import os
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden  # noqa: E402  (its versions(); it runs nothing on import)

# Llama, and one model of each other family (Qwen2's q/k/v biases with tied embeddings, Qwen3's
# per-head q/k norm, Mistral's explicit head_dim). mistral_window is left out: its window of 6 is
# shorter than a generation, which memtune's generate refuses (no sliding-window KV cache yet).
FIXTURES = ["gqa_rope", "tied_odd", "qwen2_bias", "qwen3_qk_norm", "mistral_head_dim"]
# Ids below 263 (the smaller Llama fixture vocabulary; the others take them modulo theirs); 1 is
# bos, 2 is eos in every fixture.
PROMPTS = [
    [1, 17, 104, 33, 250, 7, 61, 199, 42],
    [1, 150, 3],
    [1],
]
MAX_NEW_TOKENS = 24
# A gap below this would make the test depend on fp32 noise (memtune and torch sum in different
# orders: logits agree to about 1e-5).
MIN_SAFE_MARGIN = 1e-3


def versions():
    """make_golden.py's versions, less the two libraries this script does not use."""
    every = make_golden.versions()
    return {name: every[name] for name in ("python", "torch", "transformers", "peft")}


def greedy(model, prompt, eos_ids, max_new_tokens):
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_ids,
            pad_token_id=eos_ids[0],
            use_cache=True,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new_ids = out.sequences[0, len(prompt):].tolist()
    margin = float("inf")
    for scores in out.scores:  # greedy without processors: the raw fp32 logits of each step
        top2 = torch.topk(scores[0].float(), 2).values
        margin = min(margin, float(top2[0] - top2[1]))
    stop = "eos" if new_ids and new_ids[-1] in eos_ids else "max_new_tokens"
    return new_ids, margin, stop


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--golden", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "golden"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    cases = []
    for fixture in FIXTURES:
        folder = os.path.join(args.golden, fixture)
        with open(os.path.join(folder, "generation_config.json")) as f:
            eos = json.load(f)["eos_token_id"]
        eos_ids = eos if isinstance(eos, list) else [eos]
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        vocab, window = config["vocab_size"], config.get("sliding_window")
        for with_adapter in (False, True):
            model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
            if with_adapter:
                model = PeftModel.from_pretrained(model, os.path.join(folder, "adapter"))
            model.eval()
            # The family fixtures have smaller vocabularies (83-97): their prompts are the same ids
            # modulo the vocabulary (1, bos, stays 1).
            for prompt in ([i % vocab for i in p] for p in PROMPTS):
                # Within a sliding window (mistral_head_dim: 32), where memtune's generate works.
                max_new = MAX_NEW_TOKENS if window is None else min(MAX_NEW_TOKENS, window - len(prompt))
                new_ids, margin, stop = greedy(model, prompt, eos_ids, max_new)
                # A case whose margin is below MIN_SAFE_MARGIN is recorded but marked: the test
                # leaves it out (an fp32 rounding difference could flip one of its tokens).
                safe = margin >= MIN_SAFE_MARGIN
                if not safe:
                    print(f"note: {fixture} adapter={with_adapter} prompt={prompt}: logit margin {margin:.2e} "
                          f"< {MIN_SAFE_MARGIN}: recorded as not checkable")
                cases.append({"fixture": fixture, "adapter": with_adapter, "prompt_ids": prompt,
                              "max_new_tokens": max_new, "output_ids": new_ids, "stop_reason": stop, "min_logit_margin": margin,
                              "checkable": safe})
                print(f"{fixture:16s} adapter={with_adapter!s:5s} prompt={len(prompt):2d} tokens -> "
                      f"{len(new_ids):2d} new ({stop}), min margin {margin:.4f}")

    record = {
        "about": "transformers greedy generate on tests/fixtures/golden models; written by "
                 "tools/make_generate_golden.py, do not edit",
        "generated_with": versions(),
        "attn_implementation": "eager",
        "dtype": "float32",
        "max_new_tokens": MAX_NEW_TOKENS,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
