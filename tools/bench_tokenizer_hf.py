#!/usr/bin/env python3
"""HF tokenizers' side of bench/bench_tokenizer.cpp: the same lines, encoded one by one.

One thread (RAYON_NUM_THREADS=1, set before tokenizers is imported), Tokenizer.encode per line
(encode_batch is not used: memtune's side encodes line by line too), best of 3. The token total
is printed so the two runs can be seen to do the same work. The Python loop's own cost
(about a microsecond a line) is inside the HF figure.

Usage (from the repository root):
  python3 tools/bench_tokenizer_hf.py [--tokenizer ../shared/data/llama3-tokenizer/tokenizer.json]
                                      [--text FILE | --corpus tests/fixtures/tokenizer/corpus.jsonl]
                                      [--mb 10]
"""

import argparse
import json
import os
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Tokenizer, __version__ as tokenizers_version  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default="../shared/data/llama3-tokenizer/tokenizer.json")
    parser.add_argument("--corpus", default="tests/fixtures/tokenizer/corpus.jsonl")
    parser.add_argument("--text")
    parser.add_argument("--mb", type=float, default=10)
    args = parser.parse_args()

    start = time.perf_counter()
    tok = Tokenizer.from_file(args.tokenizer)
    load_s = time.perf_counter() - start

    if args.text:
        with open(args.text, "rb") as f:
            source = f.read().decode("utf-8")
    else:
        with open(args.corpus, encoding="utf-8") as f:
            source = "\n".join(json.loads(line)["text"] for line in f if line.strip())
    base = source.split("\n")
    if len(source) <= len(base) - 1:
        raise SystemExit("the benchmark text has no bytes but newlines")
    lines = []
    size = 0
    target = int(args.mb * 1e6)
    while size < target:
        for line in base:
            lines.append(line)
            size += len(line.encode("utf-8"))

    best = float("inf")
    tokens = 0
    encode = tok.encode
    for _ in range(3):
        tokens = 0
        start = time.perf_counter()
        for line in lines:
            tokens += len(encode(line).ids)
        best = min(best, time.perf_counter() - start)
    print(f"HF tokenizers {tokenizers_version}, 1 thread")
    print(f"  text:     {args.text or args.corpus}")
    print(f"  lines:    {len(lines)}, bytes {size}, tokens {tokens}")
    print(f"  load:     {load_s:.3f} s")
    print(f"  encode:   best of 3 {best:.3f} s = {size / best / 1e6:.2f} MB/s, "
          f"{tokens / best / 1e6:.2f} M tokens/s")


if __name__ == "__main__":
    main()
