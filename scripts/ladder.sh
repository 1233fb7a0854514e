#!/usr/bin/env bash
# Builds and runs the memory ladder: Llama-3.1-8B-shaped on a GPU, the embedded tiny model on
# the CPU where there is none. Outputs land in ladder-out/ (report.md, ladder.json/.csv/.svg).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
if ./build/memtune ladder --help >/dev/null && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  ./build/memtune ladder --model llama-3.1-8b --batch 2 --accum 8 --seq 2048 --vram 24GiB --out ladder-out "$@"
else
  echo "no GPU here: running the ladder on the embedded tiny model on the CPU"
  ./build/memtune ladder --model tiny --vram 24GiB --out ladder-out "$@"
fi
