#!/usr/bin/env bash
# Builds and runs the whole test suite. GPU tests skip (and say so) where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
# One OpenMP thread per test: ctest runs tests side by side on the cores.
OMP_NUM_THREADS=1 ctest --test-dir build -j "$(nproc)" --output-on-failure
# Each fuzz target for 20 s (scripts/fuzz.sh; skipped, saying so, where clang's libFuzzer is
# missing; MEMTUNE_SKIP_FUZZ=1 skips it when iterating).
[ "${MEMTUNE_SKIP_FUZZ:-0}" = 1 ] || bash scripts/fuzz.sh
